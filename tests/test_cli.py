"""``specselect compare`` end to end on tiny models saved to temporary directories."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import specselect
from conftest import plant_timings
from specselect import cli
from specselect.cli import SEED_DEPRECATED, default_selectors, main
from specselect.cost import CostModel, CostSource, default_cost_model
from specselect.metrics import Totals
from specselect.replay import (
    OracleSelector,
    SelectorConfig,
    TraceMismatchError,
    check_trace_models,
    check_trace_prompts,
    check_trace_shape,
    load_traces,
    replay,
    save_traces,
    selector_grid,
)
from specselect.report import (
    PLOTS_SKIPPED,
    ResultRow,
    format_table,
    markdown_table,
    results_json,
)
from specselect.selectors import SELECTORS
from test_replay import build_tiny_pair

PROMPTS = [
    "def add(a, b):",
    "",  # blank lines are skipped
    "    return a + b",
    "class Point:",
    "import os, sys",
    "# a comment about nothing",
]


def save_char_tokenizer(directory: Path) -> int:
    """A character-level fast tokenizer (left padding) saved to ``directory``; returns its size."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", padding_side="left"
    )
    tokenizer.save_pretrained(directory)
    return len(vocab)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pair")
    vocab = save_char_tokenizer(root / "target")
    target, draft = build_tiny_pair(seed=1, vocab=vocab)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return {"target": root / "target", "draft": root / "draft", "prompts": root / "prompts.txt"}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def model_args(model_dirs: dict[str, Path]) -> list[str]:
    """``--target``, ``--draft`` and ``--prompts`` of the module's tiny pair."""
    return [
        "--target",
        str(model_dirs["target"]),
        "--draft",
        str(model_dirs["draft"]),
        "--prompts",
        str(model_dirs["prompts"]),
    ]


GRID = ["--k", "1,2", "--extra", "1,2", "--budget", "3,goodput"]
BUDGETS = [3, "goodput"]  # what GRID's --budget parses to


@pytest.fixture(scope="module")
def compare_run(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("compare")
    argv = [
        "compare",
        *model_args(model_dirs),
        "--out",
        str(out),
        "--slots",
        "2",
        "--max-new-tokens",
        "10",
        "--limit",
        "4",
        "--quiet",
        *GRID,
    ]
    code, stdout, stderr = run_main(argv)
    return {"code": code, "stdout": stdout, "stderr": stderr, "out": out}


def test_compare_writes_table_json_report_and_plots(compare_run: dict) -> None:
    assert compare_run["code"] == 0, compare_run["stderr"]
    # --quiet: not even transformers' "Loading weights"; only the warning that the shipped cost
    # model prices other models (test_compare_marks_a_cost_model_of_other_models_a_what_if)
    assert warned(compare_run["stderr"]) == []
    out: Path = compare_run["out"]
    table = compare_run["stdout"]
    for name in [*SELECTORS, "oracle"]:
        assert f"\n{name} " in table, name
    assert "tok/step" in table and "VSR" in table and "goodput" in table
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    expected = selector_grid([*default_selectors(), "oracle"], [1, 2], [1, 2], BUDGETS)
    assert len(results["rows"]) == len(expected)
    assert {r["label"] for r in results["rows"]} == {c.label for c in expected}
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| selector |" in report and "## Summary" in report
    assert "## Reliability of the ranked scores" in report
    # raw TETRIS (the paper) and TETRIS with each estimator are all compared by default
    assert {"tetris", "tetris+none", "tetris+calibrated"} <= {
        r["selector"] for r in results["rows"]
    }
    calibrated = [r for r in results["rows"] if r["selector"] == "tetris+calibrated"]
    assert all(sum(b["tokens"] for b in r["calibration"]) > 0 for r in calibrated)
    for png in ("tokens_per_step_vs_budget.png", "vsr_vs_extra.png", "reliability.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in report
    traces = load_traces(out / "traces.pt")
    assert (traces.num_requests, traces.max_new_tokens, traces.max_k) == (4, 10, 4)


def test_compare_numbers_match_the_library(compare_run: dict) -> None:
    """Every JSON row equals a direct library replay of the saved traces."""
    out: Path = compare_run["out"]
    traces = load_traces(out / "traces.pt")
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    configs = {
        c.label: c for c in selector_grid([*default_selectors(), "oracle"], [1, 2], [1, 2], BUDGETS)
    }
    for row in results["rows"]:
        totals = replay(traces, configs[row["label"]].build(default_cost_model()), slots=2).totals
        metrics = row["metrics"]
        assert metrics["tokens_per_step"] == pytest.approx(totals.tokens_per_step)
        assert metrics["vsr"] == (pytest.approx(totals.vsr) if totals.verified else None)
        assert metrics["goodput"] == pytest.approx(totals.goodput)
        assert metrics["verified_per_request_step"] == pytest.approx(
            totals.verified / totals.active
        )
        if row["selector"] == "fixed":
            assert row["relative_to_fixed"]["tokens_per_step"] == pytest.approx(1.0)
        if row["selector"] == OracleSelector.name:
            assert metrics["vsr"] in (0.0, 1.0)


def test_compare_reuses_traces_without_models(compare_run: dict, tmp_path: Path) -> None:
    first = json.loads((compare_run["out"] / "results.json").read_text(encoding="utf-8"))
    code, _, stderr = run_main(
        [
            "compare",
            "--traces",
            str(compare_run["out"] / "traces.pt"),
            "--out",
            str(tmp_path),
            "--selectors",
            "tetris",
            "--slots",
            "2",
            "--max-new-tokens",
            "10",
            "--quiet",
            "--no-plots",
            *GRID,
        ]
    )
    assert code == 0, stderr
    second = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    before = {r["label"]: r["metrics"] for r in first["rows"]}
    assert {r["selector"] for r in second["rows"]} == {"fixed", "tetris", "oracle"}
    for row in second["rows"]:
        assert row["metrics"] == before[row["label"]]
    assert not (tmp_path / "vsr_vs_extra.png").exists()


@pytest.fixture(scope="module")
def live_run(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("specselect.hf")
    out = tmp_path_factory.mktemp("live")
    code, stdout, stderr = run_main(
        [
            "compare",
            *model_args(model_dirs),
            "--out",
            str(out),
            "--mode",
            "live",
            "--selectors",
            "tetris",
            "--k",
            "2",
            "--extra",
            "1,2",
            "--limit",
            "3",
            "--slots",
            "2",
            "--max-new-tokens",
            "8",
            "--tree",
            "2,2,1",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0, stderr
    rows = json.loads((out / "results.json").read_text(encoding="utf-8"))["rows"]
    return {"stdout": stdout, "out": out, "rows": rows}


def test_compare_live_mode(live_run: dict) -> None:
    rows = live_run["rows"]
    kinds = {r["selector"]: r["goodput_kind"] for r in rows}
    assert kinds == {
        "fixed": "measured",
        "fixed tree(2,2,1)": "measured",  # tree vs flat at the same budget, measured live
        "tetris": "measured",
        "tetris tree(2,2,1)": "measured",
        "oracle": "modelled",
    }
    for row in rows:  # greedy live runs emit exactly what the traces hold
        assert row["metrics"]["emitted"] == 3 * 8
        assert row["metrics"]["seconds"] > 0
    oracle = next(r for r in rows if r["selector"] == "oracle")
    assert oracle["relative_to_fixed"]["goodput"] is None  # modelled vs measured: no ratio
    assert "measured" in live_run["stdout"]


def test_compare_live_names_what_the_models_cannot_serve(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call the live loop refuses up front (here: caches beyond the memory left) is a usage
    error naming the reason, not a traceback."""
    pytest.importorskip("specselect.hf")
    from specselect.hf import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1)
    argv = ["compare", *model_args(model_dirs), "--out", str(tmp_path), "--mode", "live"]
    code, _, stderr = run_main([*argv, "--k", "2", "--extra", "1", "--limit", "2", "--quiet"])
    assert code == 2
    assert "specselect compare: error: speculative_generate with" in stderr
    assert "GiB is available" in stderr and "Traceback" not in stderr


def test_live_tree_rows_once_per_budget(live_run: dict) -> None:
    """Tree mode ignores ``extra``: one tree row per selector and k, with extra shown as '-'."""
    trees = [r for r in live_run["rows"] if "tree(" in r["selector"]]
    assert sorted(r["selector"] for r in trees) == ["fixed tree(2,2,1)", "tetris tree(2,2,1)"]
    assert all(r["extra"] is None for r in trees)
    assert sum(r["selector"] == "tetris" for r in live_run["rows"]) == 2  # chains: per extra


def test_live_oracle_replays_static_batches(live_run: dict) -> None:
    """The live oracle row is a replay in static batches, like the live rows, and says so."""
    traces = load_traces(live_run["out"] / "traces.pt")
    oracles = [r for r in live_run["rows"] if r["selector"] == "oracle"]
    assert len(oracles) == 2
    differs = False
    for config in selector_grid(["oracle"], [2], [1, 2]):
        row = next(r for r in oracles if r["extra"] == config.extra)
        static = replay(traces, config.build(), slots=2, refill=False).totals
        refilled = replay(traces, config.build(), slots=2).totals
        differs |= static.steps != refilled.steps
        assert row["metrics"]["steps"] == static.steps
        assert row["metrics"]["tokens_per_step"] == pytest.approx(static.tokens_per_step)
        assert row["metrics"]["goodput"] == pytest.approx(static.goodput)
    assert differs  # otherwise this test could not tell the two replays apart
    report = (live_run["out"] / "report.md").read_text(encoding="utf-8")
    note = next(line for line in report.splitlines() if line.startswith("Goodput is"))
    assert "`oracle`" in note and "**modelled**" in note


def test_live_refill_runs_the_replays_schedule(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """--mode live --refill: every prompt through --slots slots in one call (continuous
    batching). The live rows take exactly the steps a refilling replay takes, and so does the
    oracle row, replayed on that schedule."""
    pytest.importorskip("specselect.hf")
    argv = ["compare", *model_args(model_dirs), "--out", str(tmp_path), "--mode", "live"]
    argv += ["--selectors", "tetris", "--k", "2", "--extra", "1", "--limit", "5", "--slots", "2"]
    code, _, stderr = run_main([*argv, "--max-new-tokens", "8", "--refill", "--quiet"])
    assert code == 0, stderr
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["refill"] is True
    traces = load_traces(tmp_path / "traces.pt")
    configs = selector_grid(["fixed", "tetris", "oracle"], [2], [1])
    assert len(results["rows"]) == len(configs)
    for row, config in zip(results["rows"], configs, strict=True):
        refilled = replay(traces, config.build(), slots=2).totals
        static = replay(traces, config.build(), slots=2, refill=False).totals
        assert refilled.steps < static.steps  # the two schedules differ here
        assert row["metrics"]["steps"] == refilled.steps, row["selector"]


def _bad_inputs(dirs: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Named bad command lines and a fragment of the expected error message."""
    (tmp / "empty.txt").write_text("\n \n", encoding="utf-8")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\xfa prompt")
    (tmp / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    (tmp / "notext.jsonl").write_text('{"prompt": "x"}\n', encoding="utf-8")
    (tmp / "prompts.JSON").write_text('{"text": "x"}\n', encoding="utf-8")
    (tmp / "noconfig").mkdir()
    torch.save({"weights": torch.zeros(1)}, tmp / "other.pt")
    models = ["--target", str(dirs["target"]), "--draft", str(dirs["draft"])]
    prompts = ["--prompts", str(dirs["prompts"])]
    return {
        "missing target dir": (
            ["--target", str(tmp / "nope"), "--draft", str(dirs["draft"]), *prompts],
            "is not a directory",
        ),
        "target without draft": (["--target", str(dirs["target"]), *prompts], "go together"),
        "dir without config": (
            ["--target", str(tmp / "noconfig"), "--draft", str(dirs["draft"]), *prompts],
            "no config.json",
        ),
        "target without tokenizer": (
            ["--target", str(dirs["draft"]), "--draft", str(dirs["draft"]), *prompts],
            "(the target's: the tokenizer is read from there by default) holds no tokenizer",
        ),
        "tokenizer without models": (
            ["--tokenizer", str(dirs["target"])],
            "--tokenizer needs --target/--draft",
        ),
        "tokenizer not a dir": (
            [*models, *prompts, "--tokenizer", str(dirs["prompts"])],
            "is not a directory",
        ),
        "prompts required": (models, "--prompts is required"),
        "missing prompts": (
            [*models, "--prompts", str(tmp / "none.txt")],
            f"--prompts: prompts file {str(tmp / 'none.txt')!r} does not exist",
        ),
        "empty prompts": ([*models, "--prompts", str(tmp / "empty.txt")], "holds no prompts"),
        "unreadable prompts": ([*models, "--prompts", str(tmp / "binary.txt")], "cannot read"),
        "bad jsonl": (
            [*models, "--prompts", str(tmp / "broken.jsonl")],
            f"--prompts: {tmp / 'broken.jsonl'}:2: not valid JSON",
        ),
        "jsonl without text": ([*models, "--prompts", str(tmp / "notext.jsonl")], "'text'"),
        "json prompts": (
            [*models, "--prompts", str(tmp / "prompts.JSON")],
            "a .json file is not a prompts file; expected .txt (one prompt per line) or .jsonl",
        ),
        "unknown selector": (
            [*models, *prompts, "--selectors", "tetris,nope"],
            "argument --selectors: unknown selector 'nope'",
        ),
        "k zero": (["--k", "0"], "--k values must be >= 1"),
        "k not int": (["--k", "2,x"], "comma-separated integers"),
        "extra negative": (["--extra", "-1"], "--extra values must be >= 0"),
        "budget negative": (["--budget", "-2"], "--budget values must be >= 0"),
        "budget word": (["--budget", "4,fast"], "integers or 'goodput', got 'fast'"),
        "slots zero": (["--slots", "0"], "--slots must be >= 1"),
        "limit zero": (["--limit", "0"], "--limit must be >= 1"),
        "max new tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        "bad mode": (["--mode", "fast"], "invalid choice"),
        "not a trace file": (["--traces", str(tmp / "other.pt")], "not a specselect trace file"),
        "text as traces": (
            ["--traces", str(tmp / "empty.txt")],
            "--traces '" + str(tmp / "empty.txt") + "' is not a specselect trace file",
        ),
        "directory as traces": (["--traces", str(tmp / "noconfig")], "is a directory"),
        "seed overflow": (["--seed", "99999999999999999999999"], "--seed must be between"),
        "empty estimator": (["--selectors", "tetris+"], "argument --selectors: 'tetris+'"),
        "empty selector name": (["--selectors", "tetris,,fixed"], "names, got 'tetris,,fixed'"),
        "tree without live": ([*models, *prompts, "--tree", "3,2,2"], "--tree needs --mode live"),
        "refill without live": ([*models, *prompts, "--refill"], "--refill needs --mode live"),
        "bad tree": (["--tree", "3,0,2", "--mode", "live"], "TreeSpec.branch must be >= 1"),
        "tree not a triple": (["--tree", "3,2"], "DEPTH,BRANCH,WIDTH"),
        "unknown estimator": ([*models, *prompts, "--selectors", "tetris+magic"], "'magic'"),
        "estimator on fixed": ([*models, *prompts, "--selectors", "fixed+history"], "no estimator"),
        "missing cost model": (["--cost-model", str(tmp / "none.json")], "does not exist"),
        "text as cost model": (
            ["--cost-model", str(tmp / "empty.txt")],
            f"--cost-model: cost file {str(tmp / 'empty.txt')!r} is not valid JSON",
        ),
        "binary as cost model": (["--cost-model", str(tmp / "other.pt")], "is not a text file"),
        # Tracebacks from torch (an int64 overflow) or Python (OverflowError) before:
        "huge k": (["--k", "9" * 20], "--k values must be <= 2147483647"),
        "huge budget": (["--budget", "9" * 21], "--budget values must be <= 2147483647"),
        "huge slots": (["--slots", "9" * 20], "--slots must be <= 2147483647"),
        "empty import": (["--import", ""], "'' is neither a module name nor a .py file"),
        "empty traces path": (["--traces", ""], "argument --traces: expects a path"),
    }


BAD_CASES = [
    "missing target dir",
    "target without draft",
    "dir without config",
    "target without tokenizer",
    "tokenizer without models",
    "tokenizer not a dir",
    "prompts required",
    "missing prompts",
    "empty prompts",
    "unreadable prompts",
    "bad jsonl",
    "jsonl without text",
    "json prompts",
    "unknown selector",
    "k zero",
    "k not int",
    "extra negative",
    "budget negative",
    "budget word",
    "slots zero",
    "limit zero",
    "max new tokens",
    "bad mode",
    "not a trace file",
    "text as traces",
    "directory as traces",
    "seed overflow",
    "empty estimator",
    "empty selector name",
    "tree without live",
    "refill without live",
    "bad tree",
    "tree not a triple",
    "unknown estimator",
    "estimator on fixed",
    "missing cost model",
    "text as cost model",
    "binary as cost model",
    "huge k",
    "huge budget",
    "huge slots",
    "empty import",
    "empty traces path",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_exits_2_without_traceback(
    model_dirs: dict[str, Path], tmp_path: Path, case: str
) -> None:
    argv, message = _bad_inputs(model_dirs, tmp_path)[case]
    code, stdout, stderr = run_main(["compare", "--out", str(tmp_path / "out"), *argv])
    assert code == 2
    assert message in stderr
    assert stderr.startswith("specselect compare: error: ")  # argparse's prefix, and ours
    assert "Traceback" not in stderr + stdout
    assert not (tmp_path / "out" / "results.json").exists()
    assert len(stderr.strip().splitlines()) == 1, stderr  # argparse's errors too: no usage block


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        (["--k", "4", "--extra", "1"], "max_k=4"),  # the saved traces hold 4 draft tokens
        (["--k", "1", "--extra", "1", "--max-new-tokens", "12"], "max_new_tokens=10"),
    ],
)
def test_incompatible_traces_exit_2(
    compare_run: dict, tmp_path: Path, extra_args: list[str], message: str
) -> None:
    argv = ["compare", "--traces", str(compare_run["out"] / "traces.pt"), "--out", str(tmp_path)]
    code, _, stderr = run_main([*argv, "--max-new-tokens", "10", *extra_args])
    assert code == 2 and message in stderr and "Traceback" not in stderr


#: How compare warns that its cost model prices other models than the traces': the shipped
#: pair's does, in every run on the test models without --cost-model.
WHAT_IF_WARNING = "specselect: warning: the cost model was not measured on the traces' models"


def warned(stderr: str) -> list[str]:
    """The lines of ``stderr`` but the what-if warning (see WHAT_IF_WARNING)."""
    return [line for line in stderr.splitlines() if not line.startswith(WHAT_IF_WARNING)]


def _reuse(compare_run: dict, out: Path, *args: str, traces: Path | None = None) -> tuple:
    """``compare`` on the saved traces of ``compare_run`` (small grid, no plots)."""
    path = traces if traces is not None else compare_run["out"] / "traces.pt"
    small = ["--max-new-tokens", "10", "--selectors", "tetris", "--k", "1", "--extra", "1"]
    argv = ["compare", "--traces", str(path), "--out", str(out), *small]
    return run_main([*argv, "--slots", "2", "--quiet", "--no-plots", *args])


def _other_target(model_dirs: dict[str, Path], tmp: Path) -> Path:
    """A model directory other than the recorded target's, with the same tokenizer."""
    other = tmp / "other"
    shutil.copytree(model_dirs["draft"], other)
    save_char_tokenizer(other)
    return other


def test_reused_traces_must_come_from_these_models(
    compare_run: dict, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Other models: a one-line error; a trace file that predates model metadata: no check."""
    other = ["--target", str(_other_target(model_dirs, tmp_path)), "--draft"]
    other += [str(model_dirs["draft"]), "--prompts", str(model_dirs["prompts"]), "--limit", "4"]
    code, _, stderr = _reuse(compare_run, tmp_path / "out", *other)
    assert code == 2 and "Traceback" not in stderr
    error = stderr.strip().splitlines()[-1]
    assert "--traces" in error and "other models" in error and "target name_or_path" in error
    traces = load_traces(compare_run["out"] / "traces.pt")
    old = replace(
        traces, meta={k: v for k, v in traces.meta.items() if k not in ("target", "draft")}
    )
    code, _, stderr = _reuse(
        compare_run, tmp_path / "out", *other, traces=save_traces(old, tmp_path / "old.pt")
    )
    assert code == 0, stderr


def test_reused_traces_must_come_from_these_prompts(
    compare_run: dict, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def sub(a, b):\n    return a - b\n", encoding="utf-8")
    models = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"])]
    code, _, stderr = _reuse(compare_run, tmp_path / "out", *models, "--prompts", str(prompts))
    assert code == 2 and "Traceback" not in stderr
    error = stderr.strip().splitlines()[-1]
    assert "--traces" in error and "other prompts" in error and "prompt 0" in error


def test_reused_traces_matching_inputs_and_limit_warning(
    compare_run: dict, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The recording's own inputs pass; a --limit beyond the traces warns and uses them all."""
    same = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"])]
    same += ["--prompts", str(model_dirs["prompts"])]
    code, _, stderr = _reuse(compare_run, tmp_path / "a", *same, "--limit", "2")
    assert code == 0 and warned(stderr) == [], stderr
    results = json.loads((tmp_path / "a" / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["traces"]["requests"] == 2
    code, _, stderr = _reuse(compare_run, tmp_path / "b", "--limit", "9")
    assert code == 0, stderr
    warnings = warned(stderr)
    assert len(warnings) == 1 and "--limit 9" in warnings[0] and "(4)" in warnings[0]
    results = json.loads((tmp_path / "b" / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["traces"]["requests"] == 4


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_bad_out_fails_before_any_work(
    model_dirs: dict[str, Path], tmp_path: Path, where: str
) -> None:
    (tmp_path / "afile").write_text("not a directory", encoding="utf-8")
    out = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "sub"
    code, stdout, stderr = run_main(
        [
            "compare",
            *model_args(model_dirs),
            "--traces",
            str(tmp_path / "new.pt"),
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 2 and "Traceback" not in stderr + stdout
    assert stderr.count("\n") == 1 and "--out" in stderr
    assert not (tmp_path / "new.pt").exists()  # nothing was recorded


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "/proc"], "--out: the directory '/proc' is not writable (creating a file"),
        (
            ["--traces", "/proc/t.pt"],
            "--traces '/proc/t.pt': the directory '/proc' is not writable (creating a file",
        ),
    ],
)
def test_unwritable_directory_says_so(tmp_path: Path, argv: list[str], message: str) -> None:
    """/proc exists but takes no files (its errno, ENOENT, would say it does not exist)."""
    code, _, stderr = run_main(["compare", "--out", str(tmp_path), *argv, "--quiet"])
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda", "CUDA is not available"),
        ("meta", "meta tensors hold no values"),
        ("xla", "is not usable (PyTorch is not linked with support for xla devices)"),
        ("xpu", "xpu is not available"),
    ],
)
def test_unavailable_device_is_a_usage_error(
    model_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    message: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if device == "xpu":  # a backend with is_available(), whatever this machine has
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    argv = ["compare", *model_args(model_dirs), "--device", device, "--out", str(tmp_path)]
    code, stdout, stderr = run_main(argv)
    assert code == 2 and "Traceback" not in stderr + stdout
    assert stderr.count("\n") == 1 and f"--device {device!r}" in stderr and message in stderr


def test_rerun_removes_stale_plots(compare_run: dict, tmp_path: Path) -> None:
    """Plots a run does not draw are removed; files specselect does not write are kept."""
    pytest.importorskip("matplotlib")
    for name in ("reliability.png", "vsr_vs_extra.png", "mine.png"):
        (tmp_path / name).write_bytes(b"stale")
    traces = ["--traces", str(compare_run["out"] / "traces.pt"), "--max-new-tokens", "10"]
    grid = ["--selectors", "dsd", "--k", "1", "--extra", "1", "--slots", "2", "--quiet"]
    code, _, stderr = run_main(["compare", *traces, "--out", str(tmp_path), *grid])
    assert code == 0, stderr
    assert not (tmp_path / "reliability.png").exists()  # no ranking selector: no reliability
    assert (tmp_path / "vsr_vs_extra.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "mine.png").read_bytes() == b"stale"
    code, _, stderr = _reuse(compare_run, tmp_path)  # --no-plots: no plot of this run
    assert code == 0, stderr
    assert not (tmp_path / "vsr_vs_extra.png").exists()
    assert not (tmp_path / "tokens_per_step_vs_budget.png").exists()
    assert (tmp_path / "mine.png").exists()


def test_compare_without_matplotlib_warns_once(
    compare_run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's words, once, as a warning line; the results are written all the same."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import then raises on
    traces = ["--traces", str(compare_run["out"] / "traces.pt"), "--max-new-tokens", "10"]
    grid = ["--selectors", "tetris", "--k", "1", "--extra", "1", "--slots", "2", "--quiet"]
    code, _, stderr = run_main(["compare", *traces, "--out", str(tmp_path), *grid])
    assert code == 0, stderr
    assert warned(stderr) == [f"specselect: warning: {PLOTS_SKIPPED}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]


PLUGIN = """
from specselect.estimators import ESTIMATORS, DraftProbability
from specselect.selectors import SELECTORS, FixedWindowSelector


class Mine(FixedWindowSelector):
    name = "mine"


class Raw(DraftProbability):
    name = "raw"


SELECTORS["mine"] = Mine
ESTIMATORS["raw"] = Raw
"""


@pytest.mark.parametrize("form", ["file", "module"])
def test_compare_imports_a_users_selectors(
    compare_run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """``--import`` runs before ``--selectors`` is read: a user's selector and estimator are
    compared by name, from a .py path or a module in the working directory (which a console
    script does not have on its path), and listed by ``--help``."""
    module = f"plugin_{form}_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(PLUGIN, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    target = f"{module}.py" if form == "file" else module
    traces = ["--traces", str(compare_run["out"] / "traces.pt"), "--max-new-tokens", "10"]
    grid = ["--selectors", "mine,tetris+raw", "--k", "1", "--extra", "1", "--slots", "2"]
    try:
        code, stdout, stderr = run_main(
            ["compare", "--import", target, *traces, "--out", "out", *grid, "--quiet"]
        )
        assert code == 0, stderr
        rows = json.loads((tmp_path / "out" / "results.json").read_text(encoding="utf-8"))
        assert {"mine", "tetris+raw"} <= {row["selector"] for row in rows["rows"]}
        assert tmp_path.resolve() not in map(Path, sys.path)  # the path is left as it was
        code, stdout, _ = run_main(["compare", "--import", target, "--help"])
        assert code == 0 and "heuristic, mine, tetris," in " ".join(stdout.split())
    finally:
        sys.modules.pop(module, None)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_plugin_module", "no module named 'no_such_plugin_module' in the working"),
        ("missing.py", "no file 'missing.py'"),
        ("json.py", "would be imported as 'json', which names another module already"),
        ("json", "'json' names a module already imported (json from "),
        ("./plugins", "'./plugins' is neither a module name nor a .py file"),
    ],
)
def test_compare_import_that_cannot_be_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, message: str
) -> None:
    """What is not the user's module is refused, the standard library's namesakes included
    (a local json.py must not silently be the json module already imported)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "json.py").write_text("raise AssertionError('imported')\n", encoding="utf-8")
    (tmp_path / "plugins").mkdir()
    code, stdout, stderr = run_main(["compare", "--import", target, "--out", "out"])
    assert code == 2 and stdout == "" and not (tmp_path / "out").exists()
    assert stderr.startswith("specselect compare: error: --import: ")
    assert message in stderr and stderr.count("\n") == 1


def test_compare_import_runs_a_file_as_python_runs_it(
    compare_run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .py plugin imports the modules beside it; only compare imports (profile refuses the
    option without running the module); a missing value is compare's usage error."""
    folder = tmp_path / "plug"
    folder.mkdir()
    helper = f"helpers_{os.getpid()}"
    (folder / f"{helper}.py").write_text(PLUGIN, encoding="utf-8")
    (folder / "register.py").write_text(f"import {helper}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    try:
        code, stdout, stderr = run_main(["compare", "--import", "plug/register.py", "--help"])
        assert code == 0 and "heuristic, mine, tetris," in " ".join(stdout.split()), stderr
        assert str(folder) not in sys.path
    finally:
        sys.modules.pop(helper, None)
        sys.modules.pop("register", None)
    (tmp_path / "side.py").write_text("raise AssertionError('imported')\n", encoding="utf-8")
    code, _, stderr = run_main(["profile", "--import", "side.py"])
    assert code == 2 and "unrecognized arguments: --import side.py" in stderr
    code, _, stderr = run_main(["compare", "--import"])
    assert code == 2 and "specselect compare: error: argument --import" in stderr


@pytest.mark.parametrize(
    ("constructor", "says"),
    [
        (
            "def __init__(self, window: int) -> None:\n        super().__init__(window)",
            "NoK: a comparison grid sets the constructor parameters k, k0, extra, max_k, budget "
            "by name, and its constructor requires window: override the classmethod grid_kwargs",
        ),
        (
            "def __init__(self, k: int) -> None:\n        super().__init__(k - 2)",
            "selector 'nok k=1' cannot be built at this grid point (k must be >= 0, got -1); a "
            "selector whose constructor does not take the grid's values by name",
        ),
    ],
)
def test_compare_refuses_a_selector_the_grid_cannot_build(
    compare_run: dict,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    constructor: str,
    says: str,
) -> None:
    """A registered selector whose constructor requires a parameter the grid cannot set by name
    (and that does not override ``grid_kwargs``), or refuses the values it gets, is a usage
    error before anything is recorded."""
    module = f"nok_{os.getpid()}"
    source = PLUGIN + (
        f"\n\nclass NoK(FixedWindowSelector):\n    name = 'nok'\n\n    {constructor}\n\n\n"
        "SELECTORS['nok'] = NoK\n"
    )
    (tmp_path / f"{module}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    args = ["--selectors", "nok", "--k", "1", "--extra", "1", "--out", "out", "--quiet"]
    try:
        code, _, stderr = run_main(["compare", "--import", module, *args])
    finally:
        sys.modules.pop(module, None)
    assert code == 2 and not (tmp_path / "out" / "traces.pt").exists()
    assert says in " ".join(stderr.split()), stderr


def test_compare_import_of_a_broken_module_shows_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the user's own module is theirs to fix: it propagates, with its line."""
    module = f"broken_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text("import no_such_dependency\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
        run_main(["compare", "--import", module])
    assert module not in sys.modules


@pytest.mark.parametrize(
    ("registers", "message"),
    [
        ('SELECTORS["bad name"] = FixedWindowSelector', "a name must be non-empty, without"),
        ('SELECTORS["notcls"] = 42', "'notcls' must be a subclass of Selector"),
    ],
)
def test_compare_import_whose_registration_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registers: str, message: str
) -> None:
    """The registry's own refusal is specselect's check, not the module's bug: one line."""
    module = f"refused_{os.getpid()}"
    imports = (
        "from specselect import FixedWindowSelector\nfrom specselect.selectors import SELECTORS"
    )
    source = f"{imports}\n{registers}\n"
    (tmp_path / f"{module}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run_main(["compare", "--import", module, "--out", "out"])
    assert code == 2 and stdout == "" and not (tmp_path / "out").exists()
    assert stderr.startswith(f"specselect compare: error: --import {module}: ")
    assert message in stderr and stderr.count("\n") == 1


def test_vsr_undefined_when_nothing_verified() -> None:
    """0 / 0 is shown as '-' and written as null, never as 0 or -100% vs fixed."""
    rows = [
        ResultRow(SelectorConfig("fixed", 2, None, None, {}), Totals(4, 8, 16, 8, 16, 1.0)),
        ResultRow(SelectorConfig("threshold", 2, 1, None, {}), Totals(8, 8, 0, 0, 8, 1.0)),
    ]
    line = next(x for x in format_table(rows).splitlines() if x.startswith("threshold"))
    assert "-100" not in line
    header, _, *cells = (
        [c.strip() for c in x.strip("|").split("|")] for x in markdown_table(rows).splitlines()
    )
    threshold = next(c for c in cells if c[0] == "threshold")
    vsr_column = header.index("VSR")
    assert threshold[vsr_column : vsr_column + 2] == ["-", ""]
    row = next(r for r in results_json(rows, {})["rows"] if r["selector"] == "threshold")
    assert row["metrics"]["vsr"] is None and row["relative_to_fixed"]["vsr"] is None
    assert results_json(rows, {})["rows"][0]["metrics"]["vsr"] == 0.5


def test_version_comes_from_the_package() -> None:
    """``--version`` prints ``specselect.__version__``, and pyproject takes it from there."""
    code, stdout, _ = run_main(["--version"])
    assert code == 0 and stdout.strip() == f"specselect {specselect.__version__}"
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "specselect.__version__"}


def test_compare_help_shows_defaults_and_names() -> None:
    from specselect.registry import available_selectors, spec_estimators

    code, stdout, _ = run_main(["compare", "--help"])
    assert code == 0
    text = " ".join(stdout.split())  # argparse wraps lines
    assert f"from: {', '.join(available_selectors())};" in text
    assert f"ESTIMATOR from: {', '.join(spec_estimators())}" in text
    assert "none, calibrated" in text  # the paper's TETRIS is among them
    assert f"(default: {', '.join(default_selectors())})" in text
    defaults = ["2,3,4", "1,2,3", "32", "64", "replay", "cpu", "float32", "1"]
    for value in [*defaults, "specselect-compare", "all", "none", "the shipped tiny pair"]:
        assert f"(default: {value})" in text, value
    assert "--seed N deprecated, no effect" in text


def test_profile_help_says_what_repeats_keep() -> None:
    code, stdout, _ = run_main(["profile", "--help"])
    text = " ".join(stdout.split())  # argparse wraps lines
    assert code == 0 and "median is kept" not in text
    assert "--repeats N timed calls per shape, of which a shape keeps one statistic" in text
    assert "--statistic {median,min} what a shape keeps of its timed calls" in text


def test_limit_beyond_the_prompts_warns(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    small = ["--selectors", "fixed", "--k", "1", "--extra", "1", "--max-new-tokens", "3"]
    code, _, stderr = run_main(
        [
            "compare",
            *model_args(model_dirs),
            "--limit",
            "9",
            "--out",
            str(tmp_path),
            *small,
            "--slots",
            "2",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0, stderr
    assert warned(stderr) == [
        "specselect: warning: --limit 9 is more than the 5 prompts given; using those 5"
    ]
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["traces"]["requests"] == 5


def test_tokenizer_from_another_directory(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Models saved without their tokenizer (the test pair's draft directory has none) run with
    --tokenizer naming it; without it they were refused, and the CLI had no way round."""
    draft = str(model_dirs["draft"])
    argv = ["--target", draft, "--draft", draft, "--prompts", str(model_dirs["prompts"])]
    small = ["--selectors", "fixed", "--k", "1", "--extra", "1", "--max-new-tokens", "3"]
    tokenizer = ["--tokenizer", str(model_dirs["target"])]
    out = ["--out", str(tmp_path), "--quiet", "--no-plots"]
    code, _, stderr = run_main(["compare", *argv, *tokenizer, *small, *out])
    assert code == 0, stderr
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["traces"]["requests"] == len([p for p in PROMPTS if p.strip()])


def test_threads_apply_to_the_run_only(
    compare_run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--threads (default 1; 0: torch's setting) holds during the run; the caller's comes back."""
    seen: list[int] = []
    replay_all = cli.compare_replay

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return replay_all(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "compare_replay", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for name, threads in (
            ("default", []),
            ("two", ["--threads", "2"]),
            ("zero", ["--threads", "0"]),
        ):
            code, _, stderr = _reuse(compare_run, tmp_path / name, *threads)
            assert code == 0, stderr
            assert torch.get_num_threads() == 3
            meta = json.loads((tmp_path / name / "results.json").read_text(encoding="utf-8"))[
                "meta"
            ]
            assert meta["threads"] == seen[-1]
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 3]


def test_compare_draws_no_random_numbers(compare_run: dict, tmp_path: Path) -> None:
    """A run leaves torch's random state as it found it, and needs no seed to be reproducible:
    --seed (deprecated) warns and changes nothing."""
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    results = []
    for name, seed in (("unseeded", []), ("seeded", ["--seed", "5"])):
        code, _, stderr = _reuse(compare_run, tmp_path / name, *seed)
        assert code == 0, stderr
        warnings = [f"specselect: warning: {SEED_DEPRECATED}"] if seed else []
        assert warned(stderr) == warnings
        results.append(json.loads((tmp_path / name / "results.json").read_text(encoding="utf-8")))
        assert torch.equal(torch.random.get_rng_state(), before)
    unseeded, seeded = results
    assert unseeded["rows"] == seeded["rows"] and "seed" not in seeded["meta"]


def test_trace_checks_are_library_functions(compare_run: dict, model_dirs: dict[str, Path]) -> None:
    """The provenance checks ``compare --traces`` runs, called as a library user would."""
    from transformers import AutoModelForCausalLM

    traces = load_traces(compare_run["out"] / "traces.pt")
    target, draft = (
        AutoModelForCausalLM.from_pretrained(model_dirs[r]) for r in ("target", "draft")
    )
    check_trace_models(traces, target, draft)
    check_trace_prompts(traces, traces.prompt_ids[:2])
    check_trace_shape(traces, max_k=3, max_new_tokens=10)
    first = traces.prompt_ids[0]
    wrong = {
        "^traces were recorded from other models: target name_or_path": lambda: check_trace_models(
            traces, draft, draft
        ),
        "^traces were recorded from other prompts: this run's prompt 1 does not": lambda: (
            check_trace_prompts(traces, [first, first])
        ),
        "^traces hold 4 requests, fewer than the 5": lambda: check_trace_prompts(
            traces, [*traces.prompt_ids, first]
        ),
        "^traces hold max_k=4 draft tokens; this grid needs 5": lambda: check_trace_shape(
            traces, max_k=5, max_new_tokens=10
        ),
    }
    for message, check in wrong.items():
        with pytest.raises(TraceMismatchError, match=message):
            check()


def test_no_command_prints_help_and_exits_2() -> None:
    code, _, stderr = run_main([])
    assert code == 2 and "compare" in stderr


def test_module_entry_point_exit_status() -> None:
    """``python -m specselect``: a real process exits 2 on bad input, with no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "specselect", "compare", "--k", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "--k values must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def _shipped_pair_available() -> bool:
    try:
        from specselect.models import TINY_PAIR_DIR
    except ImportError:
        return False
    return (TINY_PAIR_DIR / "target" / "model.safetensors").is_file()


@pytest.mark.skipif(not _shipped_pair_available(), reason="the shipped pair is not installed")
def test_compare_on_the_shipped_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults' model and prompt path, on a small subset (offline)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, stdout, stderr = run_main(
        [
            "compare",
            "--out",
            str(tmp_path),
            "--limit",
            "4",
            "--max-new-tokens",
            "12",
            "--k",
            "2",
            "--extra",
            "1",
            "--slots",
            "4",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0, stderr
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["models"]["source"] == "shipped tiny pair"
    summary = results["meta"]["traces"]
    assert summary["requests"] == 4
    assert 0.0 < summary["greedy_agreement"] <= 1.0
    assert "oracle" in stdout


# --------------------------------------------------------------------------------------------
# Cost models: compare's default and --cost-model, and specselect profile
# --------------------------------------------------------------------------------------------


def test_results_record_this_runs_versions_and_the_recordings(compare_run: dict) -> None:
    """meta.versions are the versions this run ran on (a reused trace file's are the
    recording's: they were reported as this run's), meta.recorded_with the recording's."""
    meta = json.loads((compare_run["out"] / "results.json").read_text(encoding="utf-8"))["meta"]
    assert meta["versions"]["torch"] == str(torch.__version__)
    assert meta["recorded_with"] == load_traces(compare_run["out"] / "traces.pt").meta["versions"]


def test_compare_uses_the_shipped_cost_model_and_says_so(compare_run: dict) -> None:
    """No --cost-model: the measured CPU model of the shipped pair prices the steps (the numbers
    match a replay with it: test_compare_numbers_match_the_library), and the table, the report
    and results.json name it."""
    shipped = default_cost_model()
    described = shipped.describe() + WHAT_IF  # (the test models are not the shipped pair)
    assert described.startswith("cost-cpu.json: CPU ") and "eager" in described
    assert compare_run["stdout"].splitlines()[0] == f"modelled goodput: cost model {described}"
    meta = json.loads((compare_run["out"] / "results.json").read_text(encoding="utf-8"))["meta"]
    assert meta["cost_model"]["description"] == described
    assert meta["cost_model"]["file"] == shipped.path
    assert (meta["cost_model"]["mode"], meta["cost_model"]["dtype"]) == ("eager", "float32")
    assert f"cost model `{described}`" in (compare_run["out"] / "report.md").read_text(
        encoding="utf-8"
    )


WHAT_IF = " (of other models: a what-if)"


def test_compare_marks_a_cost_model_of_other_models_a_what_if(
    compare_run: dict, tmp_path: Path
) -> None:
    """The shipped cost model prices the shipped pair. Replaying other models' traces with it
    (compare_run's test models), compare warns, names what differs, and the table and
    results.json mark it a what-if; a cost model measured on the traces' models is not."""
    shipped = default_cost_model().source
    assert shipped is not None
    (warning,) = compare_run["stderr"].splitlines()
    assert warning.startswith(f"{WHAT_IF_WARNING} (target ") and warned(warning) == []
    traces = load_traces(compare_run["out"] / "traces.pt")
    for role in ("target", "draft"):
        mine, recorded = shipped.models[role]["parameters"], traces.meta[role]["parameters"]
        assert f"{role} parameters {mine} (the traces': {recorded})" in warning
    meta = json.loads((compare_run["out"] / "results.json").read_text(encoding="utf-8"))["meta"]
    assert len(meta["cost_model"]["other_models"]) == 2
    assert compare_run["stdout"].splitlines()[0].endswith(WHAT_IF)
    models = {role: traces.meta[role] for role in ("target", "draft")}
    own = replace(
        CostModel.linear((1e-3, 0.0, 0.0), (1e-2, 1e-4, 0.0)),
        source=CostSource("a CPU", "float32", "eager", models=models),
    )
    path = own.save(tmp_path / "own.json")
    code, stdout, stderr = _reuse(compare_run, tmp_path / "out", "--cost-model", str(path))
    assert (code, stderr) == (0, "")
    described = CostModel.load(path).describe()
    assert stdout.splitlines()[0] == f"modelled goodput: cost model {described}"


def test_compare_cost_model_option(compare_run: dict, tmp_path: Path) -> None:
    """--cost-model FILE prices every step with that model, and the outputs name it."""
    linear = CostModel.linear((1e-3, 0.0, 0.0), (1e-2, 1e-4, 0.0))
    path = linear.save(tmp_path / "mine.json")
    code, stdout, stderr = _reuse(compare_run, tmp_path / "out", "--cost-model", str(path))
    assert code == 0, stderr
    assert (
        stdout.splitlines()[0] == "modelled goodput: cost model mine.json: hand-made cost "
        "model (not measured)"
    )
    results = json.loads((tmp_path / "out" / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["cost_model"]["file"] == str(path)
    traces = load_traces(compare_run["out"] / "traces.pt")
    configs = {c.label: c for c in selector_grid(["fixed", "tetris", "oracle"], [1], [1])}
    for row in results["rows"]:
        totals = replay(traces, configs[row["label"]].build(linear), 2, linear).totals
        assert row["metrics"]["goodput"] == pytest.approx(totals.goodput)
        assert totals.goodput != pytest.approx(
            replay(traces, configs[row["label"]].build(), 2).totals.goodput
        )


def test_compare_refuses_a_cost_model_without_a_draft_part(
    compare_run: dict, tmp_path: Path
) -> None:
    """A model of plain decoding cannot price a speculative step: a usage error naming the
    option, not a traceback from the first replayed step."""
    path = CostModel.linear(None, (1e-2, 1e-4, 0.0)).save(tmp_path / "plain.json")
    code, _, stderr = _reuse(compare_run, tmp_path / "out", "--cost-model", str(path))
    assert code == 2
    assert stderr.count("\n") == 1 and "--cost-model" in stderr and "no draft part" in stderr


PROFILE_GRID = ["--batch-sizes", "1,2", "--widths", "1,2", "--contexts", "8", "--repeats", "1"]


@pytest.mark.skipif(not _shipped_pair_available(), reason="the shipped pair is not installed")
def test_profile_on_the_shipped_pair(tmp_path: Path) -> None:
    """specselect profile end to end: the JSON that compare --cost-model reads, its plot, and
    a summary of the fit on stdout."""
    out = tmp_path / "costs" / "cpu.json"
    argv = ["profile", "--out", str(out), "--quiet", "--statistic", "min", *PROFILE_GRID]
    code, stdout, stderr = run_main(argv)
    assert code == 0, stderr
    # Nothing on stderr but, on a machine busy enough to spoil the timings, the fit's warning.
    assert stderr == "" or stderr.startswith("specselect: warning: the fit misses"), stderr
    model = CostModel.load(out)
    assert model.draft is not None and len(model.samples) == 6
    assert model.source is not None and model.source.mode == "eager"
    assert model.source.hardware.endswith("1 thread")  # --threads 1, the default
    assert model.source.grid["batch_sizes"] == [1, 2]
    assert model.source.grid["statistic"] == "min"
    assert model.source.models["target"]["class"] == "LlamaForCausalLM"
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = stdout.splitlines()
    assert lines[0] == f"cost model: {model.describe()}"
    assert any(line.startswith("verify pass: ") for line in lines)
    assert any(line.startswith("fit: relative error median") for line in lines)
    assert f"json: {out}" in lines and f"plot: {out.with_suffix('.png')}" in lines


@pytest.mark.usefixtures("planted_timings")  # (timings of tiny models are mostly noise)
def test_profile_needs_no_tokenizer(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Timing passes needs the models alone: directories without tokenizer files profile
    (the test pair's draft has none; compare, which tokenizes prompts, reads the target's)."""
    draft = model_dirs["draft"]
    assert not list(draft.glob("tokenizer*")) and not list(draft.glob("vocab*"))
    out = tmp_path / "cost.json"
    out.with_suffix(".png").write_bytes(b"an earlier run's plot")
    models = ["--target", str(draft), "--draft", str(draft)]
    argv = ["profile", *models, "--out", str(out), "--quiet", "--no-plots", *PROFILE_GRID]
    code, _, stderr = run_main(argv)
    assert code == 0, stderr
    assert not out.with_suffix(".png").exists()  # it would pass for this run's fit
    source = CostModel.load(out).source
    assert source is not None and source.models["target"] == source.models["draft"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-sizes", "4"], "--batch-sizes needs at least 2 distinct values, got '4'"),
        (["--widths", "2,2"], "--widths needs at least 2 distinct values, got '2,2'"),
        (["--widths", "0,1"], "--widths values must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--cuda-graphs"], "--cuda-graphs needs a CUDA --device, got 'cpu'"),
        (["--device", "cuda:7"], "--device 'cuda:7'"),
        (["--device", "meta"], "--device 'meta': meta tensors hold no values"),
        (["--target", "nowhere"], "--target and --draft go together"),
        (["--dtype", "int8"], "invalid choice"),
        (["--statistic", "mean"], "invalid choice"),
    ],
)
def test_profile_bad_input_exits_2_without_traceback(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    code, stdout, stderr = run_main(["profile", "--out", str(tmp_path / "c.json"), *argv])
    assert code == 2 and stderr.startswith("specselect profile: error: ")
    assert message in stderr and "Traceback" not in stderr + stdout
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "c.json").exists()


def test_profile_out_must_be_a_file(tmp_path: Path) -> None:
    code, _, stderr = run_main(["profile", "--out", str(tmp_path)])
    assert code == 2 and "is a directory; name the JSON file" in stderr


def test_profile_refuses_a_plot_path_that_is_a_directory(tmp_path: Path) -> None:
    """Before any timing (the plot is written after it)."""
    (tmp_path / "cost.png").mkdir()
    out = tmp_path / "cost.json"
    code, _, stderr = run_main(["profile", "--out", str(out), "--quiet", *PROFILE_GRID])
    assert code == 2 and "its plot's path" in stderr and "is a directory" in stderr
    assert not out.exists()


@pytest.mark.skipif(not _shipped_pair_available(), reason="the shipped pair is not installed")
@pytest.mark.parametrize("noisy", [False, True])
def test_profile_warns_when_its_fit_misses_its_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noisy: bool
) -> None:
    """Timings a busy machine spoiled (every other pass 3 times as long) fit badly: profile
    says so on stderr, and still writes the model; exact timings fit, with no warning."""
    plant_timings(monkeypatch, (lambda shape, call: 3.0 if call % 2 else 1.0) if noisy else None)
    out = tmp_path / "cost.json"
    argv = ["profile", "--out", str(out), "--quiet", "--no-plots", *PROFILE_GRID]
    code, _, stderr = run_main(argv)
    assert code == 0 and out.exists()
    if noisy:
        assert stderr.startswith("specselect: warning: the fit misses its own samples by ")
        assert "--statistic min" in stderr and stderr.count("\n") == 1
    else:
        assert stderr == ""


@pytest.mark.parametrize("name", ["cost.png", "cost.PNG"])
def test_profile_refuses_out_where_its_plot_goes(tmp_path: Path, name: str) -> None:
    """The plot is written next to --out with the suffix .png: an --out ending so would be
    overwritten by it, so it is refused before any timing."""
    out = tmp_path / name
    code, stdout, stderr = run_main(["profile", "--out", str(out), "--quiet", *PROFILE_GRID])
    assert code == 2 and "Traceback" not in stderr + stdout
    assert f"--out {str(out)!r} ends in .png, the suffix of the plot" in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recorded_device", [True, False])
def test_replay_records_the_traces_device_and_dtype(
    compare_run: dict, tmp_path: Path, recorded_device: bool
) -> None:
    """Replaying --traces alone loads no model, so --device/--dtype do not apply (a warning
    says so): the Setup says what the traces were recorded with (no device for traces that
    do not say), and its command re-runs as it was given, spaces in paths included."""
    traces = load_traces(compare_run["out"] / "traces.pt")
    assert traces.meta["device"] == "cpu"
    if not recorded_device:  # traces from before the device was recorded
        meta = {key: value for key, value in traces.meta.items() if key != "device"}
        traces = replace(traces, meta=meta)
    path = save_traces(traces, tmp_path / "old traces.pt")
    out = tmp_path / "out dir"
    code, _, stderr = _reuse(
        compare_run, out, "--dtype", "bfloat16", "--device", "cuda:3", traces=path
    )
    assert code == 0, stderr
    assert "warning: --device cuda:3 and --dtype bfloat16 ignored: --traces" in stderr
    meta = json.loads((out / "results.json").read_text(encoding="utf-8"))["meta"]
    assert meta["dtype"] == "float32" == meta["models"]["target"]["dtype"]
    assert meta.get("device") == ("cpu" if recorded_device else None)
    report = (out / "report.md").read_text(encoding="utf-8").split("## Setup")[1]
    setup = dict(re.findall(r"^- \*\*(\w+)\*\*: (.*)$", report, flags=re.MULTILINE))
    assert setup["dtype"] == "float32"
    assert setup.get("device") == ("cpu" if recorded_device else None)
    argv = shlex.split(meta["command"])
    assert argv[0] == "specselect" and main(argv[1:]) == 0  # the recorded command re-runs


@pytest.mark.parametrize("quiet", [True, False])
def test_live_progress_follows_quiet(
    compare_run: dict,
    model_dirs: dict[str, Path],
    tmp_path: Path,
    quiet: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--mode live hands compare_live a progress bar unless --quiet."""
    pytest.importorskip("specselect.hf")
    calls: list[object] = []

    def spy(*args: object, progress: bool, refill: bool) -> list[ResultRow]:
        assert refill is False
        calls.append(progress)
        raise KeyboardInterrupt  # enough seen: no need to run the models

    monkeypatch.setattr(cli, "compare_live", spy)
    argv = ["compare", "--traces", str(compare_run["out"] / "traces.pt"), "--out", str(tmp_path)]
    argv += [*model_args(model_dirs), "--limit", "4", "--max-new-tokens", "10", "--mode", "live"]
    argv += ["--k", "1", "--extra", "1"]  # what the traces hold
    with pytest.raises(KeyboardInterrupt):
        run_main([*argv, *(["--quiet"] if quiet else [])])
    assert calls == [not quiet]


def test_compare_live_progress_bar_counts_batches(
    compare_run: dict,
    model_dirs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One bar over every live run's batches (chains and trees), none for the oracle.

    The bar's final count is read when it closes: tqdm redraws at most every ``mininterval``,
    so whether "6/6" reaches the terminal before a ``leave=False`` bar is cleared is timing."""
    pytest.importorskip("specselect.hf")
    import tqdm.auto
    from transformers import AutoModelForCausalLM

    closed: list[tuple[str, int, int]] = []

    class RecordingBar(tqdm.auto.tqdm):  # type: ignore[misc, type-arg]
        def close(self) -> None:
            if not self.disable:  # a closed bar is disabled; close runs again on deletion
                closed.append((self.desc, self.n, self.total))
            super().close()

    from specselect import TreeSpec
    from specselect.replay import compare_live

    target, draft = (
        AutoModelForCausalLM.from_pretrained(model_dirs[name]).eval()
        for name in ("target", "draft")
    )
    traces = load_traces(compare_run["out"] / "traces.pt")  # 4 requests: 2 batches of 2
    configs = selector_grid(["tetris", "oracle"], [1], [1, 2])  # tetris chains at 2 extras
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)  # after loading: weights have bars
    capsys.readouterr()
    rows = compare_live(target, draft, traces, configs, 2, tree=TreeSpec(2, 2, 1), progress=True)
    bar = capsys.readouterr().err
    assert len(rows) == 5  # 2 chains, 1 tree (once per name and k), 2 oracles
    assert "live" in bar and "0/6" in bar
    assert closed == [("live", 6, 6)]
    compare_live(target, draft, traces, configs[:1], 2)
    assert capsys.readouterr().err == ""  # progress is off by default
    assert len(closed) == 1


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """``specselect compare ... | head``: when the reader goes away, the command stops with
    status 1 and no traceback (here the command raises what a write to a closed pipe raises)."""
    code = (
        "import sys, specselect.cli as cli\n"
        "def closed(args):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "cli.run_compare = closed\n"
        "sys.exit(cli.main(['compare']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (done.returncode, done.stderr) == (1, "")


@pytest.mark.parametrize("command", ["compare", "profile"])
def test_an_unknown_option_points_at_the_subcommands_help(command: str) -> None:
    code, stdout, stderr = run_main([command, "--kk", "3"])
    assert code == 2 and not stdout
    assert stderr == (
        f"specselect {command}: error: unrecognized arguments: --kk 3 "
        f"(see specselect {command} --help)\n"
    )


def test_a_refused_compare_leaves_no_empty_out(tmp_path: Path) -> None:
    """--out is created before the work to check it is writable; a run refused after that
    check (an empty prompts file) removes the directories it created, and only those."""
    prompts = tmp_path / "empty.txt"
    prompts.write_text("", encoding="utf-8")
    out = tmp_path / "kept" / "new" / "out"
    (tmp_path / "kept").mkdir()
    code, _, stderr = run_main(["compare", "--prompts", str(prompts), "--out", str(out), "--quiet"])
    assert code == 2 and "holds no prompts" in stderr
    assert not (tmp_path / "kept" / "new").exists() and (tmp_path / "kept").is_dir()


def test_an_out_name_too_long_is_a_usage_error(tmp_path: Path) -> None:
    """An --out the file system cannot name: one line, exit 2, and no directory left over."""
    out = tmp_path / "made" / ("x" * 300)
    code, _, stderr = run_main(["compare", "--out", str(out), "--quiet"])
    assert code == 2 and stderr.count("\n") == 1 and "cannot create the directory" in stderr
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize("name", ["reliability.png", "results.json"])
def test_an_output_path_that_is_a_directory_is_refused_before_the_work(
    tmp_path: Path, name: str
) -> None:
    """A file the run would write is a directory in --out: refused up front, naming it (the
    run used to fail after the work, blaming --out, with a half-written report)."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    code, _, stderr = run_main(["compare", "--out", str(out), "--quiet"])
    assert code == 2 and stderr.count("\n") == 1
    assert f"{name!r} there is a directory" in stderr
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing recorded or written


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--selectors", "fixed+none"],
            "argument --selectors: selector spec 'fixed+none': 'fixed'",
        ),
        (["--selectors", "dsd", "--budget", "goodput"], "argument --budget: budget 'goodput' adds"),
    ],
)
def test_a_grid_the_selectors_refuse_names_its_option(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    code, _, stderr = run_main(["compare", *argv, "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2 and stderr.count("\n") == 1
    assert stderr.startswith(f"specselect compare: error: {says}")
