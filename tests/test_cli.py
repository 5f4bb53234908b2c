"""``specselect compare`` end to end on tiny models saved to temporary directories."""

from __future__ import annotations

import contextlib
import io
import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specselect.cli import default_selectors, main, read_prompts
from specselect.cost import CostModel
from specselect.replay import OracleSelector, load_traces, replay, selector_grid
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


GRID = ["--k", "1,2", "--extra", "1,2", "--budget", "3"]


@pytest.fixture(scope="module")
def compare_run(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("compare")
    argv = [
        "compare",
        "--target",
        str(model_dirs["target"]),
        "--draft",
        str(model_dirs["draft"]),
        "--prompts",
        str(model_dirs["prompts"]),
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
    out: Path = compare_run["out"]
    table = compare_run["stdout"]
    for name in [*SELECTORS, "oracle"]:
        assert f"\n{name} " in table, name
    assert "tok/step" in table and "VSR" in table and "goodput" in table
    results = json.loads((out / "results.json").read_text())
    expected = selector_grid([*default_selectors(), "oracle"], [1, 2], [1, 2], [3])
    assert len(results["rows"]) == len(expected)
    assert {r["label"] for r in results["rows"]} == {c.label for c in expected}
    report = (out / "report.md").read_text()
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
    results = json.loads((out / "results.json").read_text())
    configs = {
        c.label: c for c in selector_grid([*default_selectors(), "oracle"], [1, 2], [1, 2], [3])
    }
    for row in results["rows"]:
        totals = replay(traces, configs[row["label"]].build(CostModel()), slots=2).totals
        metrics = row["metrics"]
        assert metrics["tokens_per_step"] == pytest.approx(totals.tokens_per_step)
        assert metrics["vsr"] == pytest.approx(totals.vsr)
        assert metrics["goodput"] == pytest.approx(totals.goodput)
        assert metrics["verified_per_request_step"] == pytest.approx(
            totals.verified / totals.active
        )
        if row["selector"] == "fixed":
            assert row["relative_to_fixed"]["tokens_per_step"] == pytest.approx(1.0)
        if row["selector"] == OracleSelector.name:
            assert metrics["vsr"] in (0.0, 1.0)


def test_compare_reuses_traces_without_models(compare_run: dict, tmp_path: Path) -> None:
    first = json.loads((compare_run["out"] / "results.json").read_text())
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
    second = json.loads((tmp_path / "results.json").read_text())
    before = {r["label"]: r["metrics"] for r in first["rows"]}
    assert {r["selector"] for r in second["rows"]} == {"fixed", "tetris", "oracle"}
    for row in second["rows"]:
        assert row["metrics"] == before[row["label"]]
    assert not (tmp_path / "vsr_vs_extra.png").exists()


def test_compare_live_mode(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("specselect.hf")
    code, stdout, stderr = run_main(
        [
            "compare",
            "--target",
            str(model_dirs["target"]),
            "--draft",
            str(model_dirs["draft"]),
            "--prompts",
            str(model_dirs["prompts"]),
            "--out",
            str(tmp_path),
            "--mode",
            "live",
            "--selectors",
            "tetris",
            "--k",
            "2",
            "--extra",
            "1",
            "--limit",
            "3",
            "--slots",
            "2",
            "--max-new-tokens",
            "6",
            "--tree",
            "2,2,1",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0, stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    kinds = {r["selector"]: r["goodput_kind"] for r in rows}
    assert kinds == {
        "fixed": "measured",
        "fixed tree(2,2,1)": "measured",  # tree vs flat at the same budget, measured live
        "tetris": "measured",
        "tetris tree(2,2,1)": "measured",
        "oracle": "modelled",
    }
    for row in rows:  # greedy live runs emit exactly what the traces hold
        assert row["metrics"]["emitted"] == 3 * 6
        assert row["metrics"]["seconds"] > 0
    oracle = next(r for r in rows if r["selector"] == "oracle")
    assert oracle["relative_to_fixed"]["goodput"] is None  # modelled vs measured: no ratio
    assert "measured" in stdout


@pytest.mark.parametrize(
    ("suffix", "content", "expected"),
    [
        (".txt", "a\n\n b \n", ["a", " b "]),
        (".jsonl", '{"text": "x = 1"}\n\n{"text": "y", "kind": "code"}\n', ["x = 1", "y"]),
    ],
)
def test_read_prompts(tmp_path: Path, suffix: str, content: str, expected: list[str]) -> None:
    path = tmp_path / f"prompts{suffix}"
    path.write_text(content, encoding="utf-8")
    assert read_prompts(path) == expected


def _bad_inputs(dirs: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Named bad command lines and a fragment of the expected error message."""
    (tmp / "empty.txt").write_text("\n \n", encoding="utf-8")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\xfa prompt")
    (tmp / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    (tmp / "notext.jsonl").write_text('{"prompt": "x"}\n', encoding="utf-8")
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
        "prompts required": (models, "--prompts is required"),
        "missing prompts": ([*models, "--prompts", str(tmp / "none.txt")], "does not exist"),
        "empty prompts": ([*models, "--prompts", str(tmp / "empty.txt")], "holds no prompts"),
        "unreadable prompts": ([*models, "--prompts", str(tmp / "binary.txt")], "cannot read"),
        "bad jsonl": ([*models, "--prompts", str(tmp / "broken.jsonl")], ":2: not valid JSON"),
        "jsonl without text": ([*models, "--prompts", str(tmp / "notext.jsonl")], "'text'"),
        "unknown selector": (
            [*models, *prompts, "--selectors", "tetris,nope"],
            "unknown selector 'nope'",
        ),
        "k zero": (["--k", "0"], "--k values must be >= 1"),
        "k not int": (["--k", "2,x"], "comma-separated integers"),
        "extra negative": (["--extra", "-1"], "--extra values must be >= 0"),
        "budget negative": (["--budget", "-2"], "--budget values must be >= 0"),
        "slots zero": (["--slots", "0"], "--slots must be >= 1"),
        "limit zero": (["--limit", "0"], "--limit must be >= 1"),
        "max new tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        "bad mode": (["--mode", "fast"], "invalid choice"),
        "not a trace file": (["--traces", str(tmp / "other.pt")], "not a specselect trace file"),
        "tree without live": ([*models, *prompts, "--tree", "3,2,2"], "--tree needs --mode live"),
        "bad tree": (["--tree", "3,0,2", "--mode", "live"], "TreeSpec.branch must be >= 1"),
        "tree not a triple": (["--tree", "3,2"], "DEPTH,BRANCH,WIDTH"),
        "unknown estimator": ([*models, *prompts, "--selectors", "tetris+magic"], "'magic'"),
        "estimator on fixed": ([*models, *prompts, "--selectors", "fixed+history"], "no estimator"),
    }


BAD_CASES = [
    "missing target dir",
    "target without draft",
    "dir without config",
    "prompts required",
    "missing prompts",
    "empty prompts",
    "unreadable prompts",
    "bad jsonl",
    "jsonl without text",
    "unknown selector",
    "k zero",
    "k not int",
    "extra negative",
    "budget negative",
    "slots zero",
    "limit zero",
    "max new tokens",
    "bad mode",
    "not a trace file",
    "tree without live",
    "bad tree",
    "tree not a triple",
    "unknown estimator",
    "estimator on fixed",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_exits_2_without_traceback(
    model_dirs: dict[str, Path], tmp_path: Path, case: str
) -> None:
    argv, message = _bad_inputs(model_dirs, tmp_path)[case]
    code, stdout, stderr = run_main(["compare", "--out", str(tmp_path / "out"), *argv])
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr + stdout
    assert not (tmp_path / "out" / "results.json").exists()


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
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["models"]["source"] == "shipped tiny pair"
    summary = results["meta"]["traces"]
    assert summary["requests"] == 4
    assert 0.0 < summary["greedy_agreement"] <= 1.0
    assert "oracle" in stdout
