"""Every benchmark script starts, and the cheap ones run end to end at tiny sizes.

The benchmarks are not run by CI (they take minutes, or a GPU), so nothing else would notice a
script that no longer imports; ``bench_goodput.py`` once imported a helper that a refactor of
``bench_estimators.py`` had renamed. ``--help`` imports the whole script (and the scripts it
imports) and builds its parser, then exits before any work. The real runs cover what ``--help``
cannot: a table built for one device and indexed for another, a share of a gap that is zero,
a trace file reused for a run it does not fit.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from specselect.hf import emulate_on_cpu

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))

#: Tiny real runs, a few seconds each on one CPU core.
RUNS = {
    # Two CPU devices: the second configuration's methods must fit the first one's table.
    "selectors": "bench_selectors.py --devices cpu cpu:0 --batches 8 --windows 4 --rounds 1 "
    "--block 1",
    "gpu-selection": "bench_gpu.py --smoke --device cpu --part s --no-compile "
    "--select-batch-sizes 1",
}


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / args[0]), *args[1:]],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Imports a benchmark script as a module (the scripts import each other by name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Traces of the shipped pair recorded by ``bench_estimators.py`` (2 tokens, ``k = 1``,
    ``extra = 1``: the oracle does no better than fixed SD there) and the script's output."""
    path = tmp_path_factory.mktemp("traces") / "traces.pt"
    run = run_script("bench_estimators.py", "--traces", str(path), *ESTIMATOR_GRID, "2")
    assert run.returncode == 0, run.stderr[-2000:]
    return path, run.stdout


ESTIMATOR_GRID = ("--k", "1", "--extra", "1", "--max-new-tokens")


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_script_starts(script: Path) -> None:
    run = run_script(script.name, "--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:"), run.stdout[:500]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNS.values(), ids=RUNS.keys())
def test_benchmark_runs(command: str) -> None:
    run = run_script(*command.split())
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| **no** |" not in run.stdout and "| NO |" not in run.stdout, run.stdout


def test_ops_per_step_leave_the_models_passes_out(bench: Callable[[str], ModuleType]) -> None:
    """``bench_generate.py --ops`` counts what the loop dispatches besides the models: a
    forward pass alone counts nothing, and a speculative step more than a plain one."""
    generate = bench("bench_generate")
    setup = generate.random_setup("cpu", torch.float32)
    ids, mask = setup.prompts(2)
    with torch.no_grad(), generate.OpsOutsideModels((setup.target, setup.draft)) as counter:
        setup.target(ids, attention_mask=mask)
        setup.draft(ids, attention_mask=mask)
    assert counter.ops == 0
    argv = ["--ops", "--selectors", "fixed", "--max-new-tokens", "6", "--repeats", "1"]
    with torch.no_grad():
        rows = generate.bench_batch(setup, "cpu", 2, generate.parse_args(argv))
    ops = {row.method: row.ops for row in rows if row.ops is not None}
    assert 0 < ops["plain (selector=None)"] < ops["fixed(k=3)"], ops
    assert "ops per step outside the models" in generate.ops_markdown(rows)


def test_selector_table_is_the_union_of_methods(bench: Callable[[str], ModuleType]) -> None:
    """A CUDA row has no ``tetris_pytorch``: its cell is empty, not a KeyError; the speed-up
    is over the fastest reference, not the sorted one."""
    selectors = bench("bench_selectors")
    cpu = {"ref": 9.0, "ref_unsorted": 4.0, "tetris": 2.0, "tetris_pytorch": 3.0}
    cuda = {"ref": 6.0, "ref_unsorted": 8.0, "tetris": 2.0}
    rows = [
        selectors.row_cells(selectors.Config(device, 8, 4), micros, True)
        for device, micros in (("cpu", cpu), ("cuda", cuda))
    ]
    header, _, *lines = selectors.markdown_table(rows)
    table = [dict(zip(cells(header), cells(line), strict=True)) for line in lines]
    assert [row["tetris_pytorch µs"] for row in table] == ["3.0", ""]
    assert [row["fastest ref"] for row in table] == ["ref_unsorted", "ref"]
    assert [row["fastest ref / tetris"] for row in table] == ["2.0x", "3.0x"]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.slow
def test_estimators_without_a_gap_to_close(
    recorded: tuple[Path, str], bench: Callable[[str], ModuleType]
) -> None:
    """Where the oracle equals fixed SD the share of the gap closed is n/a (it divided by
    zero), and every registered estimator has its columns."""
    from specselect.estimators import ESTIMATORS

    variants = bench("bench_estimators").VARIANTS
    assert set(ESTIMATORS) <= {kwargs["estimator"] for kwargs in variants.values()}
    _, output = recorded
    rows = [cells(line) for line in output.splitlines() if line.startswith("| ")]
    summary = {row[0]: row[2] for row in rows if row[0] in variants}
    assert summary == dict.fromkeys(variants, "n/a"), output


@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_new_tokens", "max_k", "other_pair", "error"),
    [
        (3, 2, False, "were recorded with max_new_tokens=2, not 3"),
        (2, 3, False, "hold max_k=2 draft tokens; this grid needs 3"),
        (2, 2, True, "were recorded from other models: target name_or_path"),
    ],
)
def test_reused_traces_must_fit_the_run(
    recorded: tuple[Path, str],
    bench: Callable[[str], ModuleType],
    tmp_path: Path,
    max_new_tokens: int,
    max_k: int,
    other_pair: bool,
    error: str,
) -> None:
    from specselect.models import TINY_PAIR_DIR, load_prompts
    from specselect.replay import TraceMismatchError, save_traces

    goals = bench("bench_replay_goals")
    path, _ = recorded
    reused = goals.load_pair_traces(TINY_PAIR_DIR, 2, 2, path)  # fits what it was recorded for
    assert reused.num_requests == len(load_prompts(TINY_PAIR_DIR))
    if other_pair:
        reused.meta["target"]["name_or_path"] = str(tmp_path)
        path = save_traces(reused, tmp_path / "other.pt")
    with pytest.raises(TraceMismatchError, match=error):
        goals.load_pair_traces(TINY_PAIR_DIR, max_new_tokens, max_k, path)


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True], ids=["refilling", "static"])
def test_goodput_benchmark_replays_static_batches(
    recorded: tuple[Path, str],
    bench: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    static: bool,
) -> None:
    """``--static`` reaches every replay of the run (plain decoding's too) as ``refill=False``,
    and the report says which batches it replayed."""
    goodput = bench("bench_goodput")
    replay = goodput.replay
    refills: set[bool] = set()

    def recording(*args: object, refill: bool = True, **kwargs: object) -> object:
        refills.add(refill)
        return replay(*args, refill=refill, **kwargs)

    monkeypatch.setattr(goodput, "replay", recording)
    path, _ = recorded
    argv = ["bench_goodput.py", "--traces", str(path), *ESTIMATOR_GRID, "2", "--slots", "3"]
    monkeypatch.setattr(sys, "argv", argv + ["--static"] * static)
    goodput.main()
    assert refills == {not static}
    batches = "static batches of 3 slots" if static else "refilling 3 slots"
    assert batches in capsys.readouterr().out


def test_gap_closed_is_undefined_without_a_gap(bench: Callable[[str], ModuleType]) -> None:
    goals = bench("bench_replay_goals")
    assert goals.gap_closed(1.5, 1.0, 2.0) == 0.5
    assert goals.gap_closed(1.0, 1.0, 1.0) is None
    assert goals.mean_closed([None, 0.5, 0.25]) == 0.375
    assert goals.mean_closed([None]) is None
    assert goals.percent(None) == "n/a"


def test_trace_cache_is_per_pair_path(bench: Callable[[str], ModuleType], tmp_path: Path) -> None:
    """Two pairs in directories of the same name get different cache files."""
    goals = bench("bench_replay_goals")
    first, second = tmp_path / "a" / "pair", tmp_path / "b" / "pair"
    paths = {goals.trace_cache_path(tmp_path, pair, 64, 7) for pair in (first, second)}
    assert len(paths) == 2


# bench_gpu.py runs on a GPU machine whose commands are stopped after 10 minutes: it prints each
# row as soon as it is measured, stops measuring at --time-limit, and a faster way of selecting
# that fails is a table cell, not the end of the run.
GPU_SMOKE_S = ["--smoke", "--device", "cpu", "--part", "s", "--no-compile"]


def test_gpu_benchmark_stops_measuring_at_its_time_limit(
    bench: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = bench("bench_gpu")
    out = tmp_path / "gpu.md"
    assert gpu.main([*GPU_SMOKE_S, "--time-limit", "1e-9", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## s. Selection" in printed
    assert "(--time-limit 1e-09 s reached: fixed k=3 at B = 1 and what follows not measured)" in (
        printed
    )
    assert out.read_text(encoding="utf-8") == printed


def test_gpu_benchmark_keeps_the_rows_of_a_run_stopped_midway(
    bench: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped from outside (here: an error in the second cell) has already written the
    first cell's row to --output."""
    gpu = bench("bench_gpu")
    cells = iter([gpu.SelectionCost(12.0, {}, {})])

    def one_cell(*args: object) -> object:
        return next(cells)  # the second cell raises StopIteration: the run stops there

    monkeypatch.setattr(gpu, "selection_cost", one_cell)
    out = tmp_path / "gpu.md"
    with pytest.raises(RuntimeError):  # a StopIteration escaping a generator
        gpu.main([*GPU_SMOKE_S, "--select-batch-sizes", "1", "--output", str(out)])
    rows = [line for line in out.read_text(encoding="utf-8").splitlines() if line[:4] == "| 1 "]
    assert rows == ["| 1 | fixed k=3 | 12 |  |  |  |  |"]


def test_gpu_benchmark_reports_a_failed_way_of_selecting(
    bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compilation (or capture) that fails is the cell's error; the eager and replayed
    columns are still measured."""
    gpu = bench("bench_gpu")

    def broken(function: object, **kwargs: object) -> Callable[[], None]:
        def run() -> None:
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    spec = {"name": "fixed", "k": 3}
    with emulate_on_cpu():
        cost = gpu.selection_cost(spec, 2, 4, torch.device("cpu"), steps=3, fuse=True)
    assert cost.errors == {"compiled": "RuntimeError: no compiler here"}
    assert set(cost.times) == {"replayed"} and cost.same == {"replayed": True, "compiled": True}


@pytest.mark.slow
def test_gpu_benchmark_reuses_its_trained_pair_without_tokenizing_again(
    bench: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part b's --cache-dir keeps the pair and its held-out prompts' stream: a second run
    tokenizes nothing (the corpus took minutes of a 10-minute command)."""
    gpu = bench("bench_gpu")
    args = gpu.parse_args(["--smoke", "--device", "cpu", "--cache-dir", str(tmp_path)])
    device = torch.device("cpu")
    *_, held = gpu.trained_pair(args, device)

    def no_tokenizing(*args: object) -> None:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(gpu, "token_stream", no_tokenizing)
    *_, again = gpu.trained_pair(args, device)
    assert torch.equal(again, held)


def test_gpu_benchmark_measures_the_goodput_budgets_cost_models(
    bench: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part b's goodput-TETRIS plans with a cost model of the pair measured in each mode: a
    mode whose measurement fails is a row saying why (the run goes on without that mode's
    goodput row); a measured one is saved beside --output, and its rows say where."""
    from specselect.cost import default_cost_model

    gpu = bench("bench_gpu")
    out = tmp_path / "b.md"
    args = gpu.parse_args(
        ["--smoke", "--device", "cpu", "--batch-sizes", "8", "--output", str(out)]
    )
    asked: list[dict[str, object]] = []

    def measure(target: object, draft: object, **kwargs: object) -> object:
        asked.append(kwargs)
        if not kwargs["cuda_graphs"]:
            raise ValueError("the timings fit a free verification pass")
        return default_cost_model()

    monkeypatch.setattr(gpu.CostModel, "measure", measure)
    costs = dict(gpu.pair_costs(None, None, args))
    assert [a["batch_sizes"] for a in asked] == [[8, 16], [8, 16]]  # two sizes at least
    assert costs[False] == "ValueError: the timings fit a free verification pass"
    rows = [*gpu.cost_rows(False, costs[False], args), *gpu.cost_rows(True, costs[True], args)]
    assert rows[0] == "| eager | | | | | not measured: ValueError: the timings fit a free " + (
        "verification pass |"
    )
    saved = tmp_path / "b-cost-graph.json"
    assert rows[1].startswith("| graph | 8 | ") and rows[1].endswith(f"| {saved} |")
    assert gpu.CostModel.load(saved).verify_time(8, 8) == costs[True].verify_time(8, 8)


@pytest.mark.parametrize(
    ("options", "measured"),
    [
        (["--modes", "graph", "--methods", "fixed,goodput"], [True]),
        (["--methods", "dsd"], [False, True]),
        (["--methods", "plain,fixed"], []),  # no row plans with a cost model
    ],
)
def test_gpu_benchmark_measures_cost_models_only_for_what_it_runs(
    bench: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    measured: list[bool],
) -> None:
    """Part b limited to some methods and modes (a GPU session's minutes) measures the cost
    models of the modes it runs, and only for goodput-TETRIS and DSD, which plan with them."""
    gpu = bench("bench_gpu")
    args = gpu.parse_args(["--smoke", "--device", "cpu", *options])
    asked: list[bool] = []
    monkeypatch.setattr(
        gpu.CostModel, "measure", lambda *models, **kwargs: asked.append(kwargs["cuda_graphs"])
    )
    list(gpu.pair_costs(None, None, args))
    assert asked == measured


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--methods", "fixed,magic"], "--methods: unknown magic; expected plain, "),
        (["--modes", "graphs"], "--modes: unknown graphs; expected eager, graph"),
    ],
)
def test_gpu_benchmark_refuses_unknown_methods_and_modes(
    bench: Callable[[str], ModuleType],
    capsys: pytest.CaptureFixture[str],
    option: list[str],
    says: str,
) -> None:
    with pytest.raises(SystemExit):
        bench("bench_gpu").parse_args(["--smoke", *option])
    assert says in capsys.readouterr().err


def test_gpu_benchmark_trains_a_target_of_100m_and_a_draft_of_a_tenth(
    bench: Callable[[str], ModuleType],
) -> None:
    """Part b's pair has the sizes it promises (counted on the meta device: no weights)."""
    gpu = bench("bench_gpu")
    with torch.device("meta"):
        target, draft = (gpu.llama(shape) for shape in (gpu.TARGET_100M, gpu.DRAFT_9M))
    assert gpu.params(target) >= 100e6
    assert gpu.params(draft) <= gpu.params(target) / 10
