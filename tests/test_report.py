"""The comparison report: table columns, merged repeats, the summary's names, plot styles."""

from __future__ import annotations

import codecs
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specselect.cli import default_selectors
from specselect.estimators import RequestHistory
from specselect.metrics import Totals
from specselect.replay import MEASURED, ResultRow, SelectorConfig
from specselect.report import (
    PLOT_FILES,
    PLOTS_SKIPPED,
    _reliability_figure,
    _style,
    _summary_lines,
    _tokens_figure,
    format_table,
    markdown_table,
    merge_extra_repeats,
    results_json,
    write_report,
)

FIXED = Totals(steps=4, active=8, verified=16, accepted=8, emitted=16, seconds=1.0)
DSD = Totals(steps=4, active=8, verified=12, accepted=9, emitted=17, seconds=0.5)
BINS = [{"predicted": 0.5, "observed": 0.4, "tokens": 10.0}]


def row(
    name: str,
    k: int,
    extra: int | None,
    totals: Totals,
    budget: int | None = None,
    **fields: object,
) -> ResultRow:
    return ResultRow(SelectorConfig(name, k, extra, budget, {"k": k}), totals, **fields)  # type: ignore[arg-type]


def slower(totals: Totals, by: float) -> Totals:
    return Totals(
        totals.steps,
        totals.active,
        totals.verified,
        totals.accepted,
        totals.emitted,
        totals.seconds + by,
    )


def grid_rows() -> list[ResultRow]:
    """Fixed SD, a selector identical at every extra (DSD), one that is not (threshold)."""
    return [
        row("fixed", 2, None, FIXED),
        *(row("dsd", 2, extra, DSD) for extra in (1, 2, 3)),
        *(row("threshold", 2, extra, slower(DSD, extra)) for extra in (1, 2)),
    ]


@pytest.mark.parametrize(("verified", "accepted", "vsr"), [(0, 0, None), (4, 3, 0.75)])
def test_totals_alone_say_where_vsr_is_undefined(
    verified: int, accepted: int, vsr: float | None
) -> None:
    """0 / 0 is undefined (NaN, None in ``as_dict``), never 0, which would read as "every
    verified token was rejected"; results.json writes what ``as_dict`` says, as valid JSON."""
    totals = Totals(2, 4, verified, accepted, 4 + accepted, 1.0)
    assert math.isnan(totals.vsr) if vsr is None else totals.vsr == vsr
    assert totals.as_dict()["vsr"] == vsr
    written = json.dumps(results_json([row("threshold", 2, 1, totals)], {}), allow_nan=False)
    assert json.loads(written)["rows"][0]["metrics"] == totals.as_dict()


def table_lines(rows: list[ResultRow], name: str) -> list[str]:
    return [line for line in format_table(rows).splitlines() if line.startswith(name + " ")]


def test_the_baselines_tree_rows_come_first() -> None:
    """A live tree run's rows are ``fixed tree(...)`` and the others' trees: the baseline's
    sorted among the others by name (after ``dsd tree``), not first."""
    from specselect.hf import TreeSpec

    tree = TreeSpec(3, 2, 2)
    rows = [row(name, 2, None, DSD, tree=tree) for name in ("dsd", "oracle", "fixed", "tetris")]
    shown = [line.split()[0] for line in format_table(rows).splitlines()[-4:]]
    assert shown == ["fixed", "dsd", "tetris", "oracle"]


def test_row_holds_its_config() -> None:
    kwargs = {"k": 3, "extra": 2, "budget": 24, "estimator": RequestHistory()}
    config = SelectorConfig("tetris", 3, 2, 24, kwargs)
    result = ResultRow(config, FIXED)
    assert (result.selector, result.k, result.extra, result.budget) == ("tetris", 3, 2, 24)
    assert result.label == config.label == "tetris k=3 extra=2 C=24"
    # Every constructor argument, defaults included; an object as its type's name (JSON).
    assert result.params == {
        "k": 3,
        "extra": 2,
        "budget": 24,
        "estimator": "RequestHistory",
        "guard": True,
    }


def test_repeats_over_extra_are_shown_once() -> None:
    rows = grid_rows()
    merged = merge_extra_repeats(rows)
    assert [(r.selector, r.extra) for r in merged] == [
        ("fixed", None),
        ("dsd", None),
        ("threshold", 1),
        ("threshold", 2),
    ]
    assert [line.split()[:3] for line in table_lines(rows, "dsd")] == [["dsd", "2", "-"]]
    assert len(table_lines(rows, "threshold")) == 2  # its goodput depends on extra: kept
    assert len(results_json(rows, {})["rows"]) == len(rows)  # the data keeps every config


@pytest.mark.parametrize(
    "other",
    [
        {"calibration": BINS},  # same totals, other calibration
        {"goodput_kind": MEASURED},  # another kind of goodput
    ],
)
def test_rows_that_differ_are_not_merged(other: dict) -> None:
    rows = [row("tetris", 2, 1, DSD), row("tetris", 2, 2, DSD, **other)]
    assert merge_extra_repeats(rows) == rows


def test_summary_names_configurations_correctly() -> None:
    """A selector identical at every extra is named without one; ties are all named."""
    summary = " ".join(_summary_lines(grid_rows()))
    assert "Highest goodput: dsd k=2 (" in summary
    assert "dsd k=2 extra" not in summary
    tied = [row("fixed", 2, None, FIXED), row("a", 2, 1, DSD), row("b", 2, None, DSD)]
    assert "Highest goodput: a k=2 extra=1 = b k=2 (" in _summary_lines(tied)[0]
    # No row above fixed SD's goodput: the summary says so rather than crowning a tie or a loss.
    for totals in (FIXED, replace(FIXED, seconds=2.0)):
        line = _summary_lines([row("fixed", 2, None, FIXED), row("dsd", 2, None, totals)])[0]
        assert "None beats fixed SD's goodput; the highest: dsd k=2 (" in line
        assert "Highest goodput" not in line


def spending(verified: int, emitted: int) -> Totals:
    """Totals over 10 request-steps: ``verified / 10`` draft tokens verified per request-step."""
    return Totals(steps=5, active=10, verified=verified, accepted=emitted - 10, emitted=emitted)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (  # fixed SD spent 1.8 < k: a row at 1.9 spent more, though not more than k
            [
                row("fixed", 2, None, spending(18, 25)),
                row("tetris", 2, 1, spending(19, 30)),
                row("dsd", 2, 1, spending(18, 27)),
            ],
            "Most tokens/step within fixed SD's spend (1.800 verified per request-step): "
            "dsd k=2 extra=1 (2.700, +8.0%).",
        ),
        (  # within the spend, but below fixed SD: not named as a win
            [row("fixed", 2, None, spending(18, 25)), row("dsd", 2, 1, spending(12, 21))],
            "None beats fixed SD's tokens/step within its spend (1.800 verified per "
            "request-step); the most: dsd k=2 extra=1 (2.100, -16.0%).",
        ),
        ([row("tetris", 2, 1, spending(10, 30))], None),  # no fixed SD: no spend to compare
    ],
)
def test_summary_compares_spend_with_what_fixed_sd_spent(
    rows: list[ResultRow], expected: str | None
) -> None:
    summary = " ".join(_summary_lines(rows))
    if expected is None:
        assert "Most tokens/step" not in summary and "None beats" not in summary
    else:
        assert expected in summary


def test_budget_column_only_with_budgets() -> None:
    rows = grid_rows()
    for table in (format_table(rows), markdown_table(rows)):
        assert " C " not in table.splitlines()[0]
    with_budget = [*rows, row("tetris", 2, 1, DSD, budget=12)]
    header = markdown_table(with_budget).splitlines()[0]
    assert "| C |" in header
    line = table_lines(with_budget, "tetris")[0].split()
    assert line[:4] == ["tetris", "2", "1", "12"]
    fixed = table_lines(with_budget, "fixed")[0].split()
    assert fixed[:4] == ["fixed", "2", "-", "-"]


def test_every_selector_has_its_own_colour_and_marker() -> None:
    names = [*default_selectors(), "oracle"]
    looks = [(_style(n, names)["color"], _style(n, names)["marker"]) for n in names]
    assert len({color for color, _ in looks}) == len(names)  # dsd and threshold included
    many = [f"selector{i}" for i in range(30)]
    looks = [(_style(n, many)["color"], _style(n, many)["marker"]) for n in many]
    assert len(set(looks)) == len(many)  # beyond the palette: still no two alike


def test_tokens_plot_says_which_point_is_which_k() -> None:
    pytest.importorskip("matplotlib")
    rows = [
        row("fixed", 2, None, FIXED),
        row("fixed", 3, None, Totals(4, 8, 24, 10, 18, 1.0)),
        *(row("dsd", k, 1, DSD) for k in (2, 3)),  # one point for both k
    ]
    _, axes = _tokens_figure(rows)
    assert sorted(t.get_text() for t in axes[0].texts) == ["k=2", "k=2,3", "k=3"]


def test_reliability_plot_shows_coinciding_curves_and_its_k() -> None:
    pytest.importorskip("matplotlib")
    rows = [
        row(n, k, 3, DSD, calibration=BINS) for n in ("tetris+draft", "tetris+none") for k in (2, 4)
    ]
    _, axes = _reliability_figure(rows)
    lines = [line for line in axes[0].get_lines() if line.get_label().startswith("tetris")]
    assert len(lines) == 2
    draft, none = (
        (line.get_marker(), line.get_linestyle(), line.get_markersize()) for line in lines
    )
    assert all(a != b for a, b in zip(draft, none, strict=True))
    assert "k = 4, extra = 3" in axes[0].get_title()


def test_table_lines_end_without_blanks() -> None:
    """A row without a goodput ratio (modelled next to measured) ends in an empty cell."""
    rows = [row("fixed", 2, None, FIXED, goodput_kind=MEASURED), row("oracle", 2, 1, DSD)]
    lines = format_table(rows).splitlines()
    assert lines[-1].startswith("oracle")
    assert all(line == line.rstrip() for line in lines)


def test_report_without_matplotlib_writes_results_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No matplotlib: results.json and report.md are written, the plots skipped with one
    warning, and plots of an earlier run removed (they would pass for this one's)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import then raises on
    (tmp_path / PLOT_FILES["vsr_plot"]).write_bytes(b"stale")
    rows = [*grid_rows(), row("tetris", 2, 1, DSD, calibration=BINS)]
    with pytest.warns(RuntimeWarning) as caught:
        written = write_report(rows, tmp_path, {"command": "test"})
    assert [str(w.message) for w in caught] == [PLOTS_SKIPPED]
    assert sorted(written) == ["json", "markdown"]
    assert len(json.loads(written["json"].read_text(encoding="utf-8"))["rows"]) == len(rows)
    assert "## Plots" not in written["markdown"].read_text(encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]


def test_results_json_is_json_with_infinite_values(tmp_path: Path) -> None:
    """A cost model fitted to a sample timed at 0 s misses it infinitely; results.json says
    "inf" where Python's json would write ``Infinity``, which is not JSON."""
    meta = {"cost_model": {"max_relative_error": math.inf, "errors": [0.1, -math.inf]}}
    written = write_report(grid_rows(), tmp_path, meta, plots=False)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    text = written["json"].read_text(encoding="utf-8")
    results = json.loads(text, parse_constant=refuse)
    assert results["meta"]["cost_model"] == {"max_relative_error": "inf", "errors": [0.1, "-inf"]}


# Writes a report holding non-ASCII text: "→" (the reliability table) and "é" (a setup value).
_REPORT_CHILD = """
import sys
from specselect.metrics import Totals
from specselect.replay import ResultRow, SelectorConfig
from specselect.report import write_report
totals = Totals(steps=4, active=8, verified=12, accepted=9, emitted=17, seconds=0.5)
bins = [{"predicted": 0.5, "observed": 0.4, "tokens": 10.0}]
row = ResultRow(SelectorConfig("tetris", 2, 1, None, {"k": 2}), totals, calibration=bins)
write_report([row], sys.argv[1], {"prompts": "caf\\u00e9.jsonl"}, plots=False)
"""


def test_report_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """report.md and results.json are UTF-8 also where the locale's encoding is ASCII
    (``LC_ALL=C`` without UTF-8 mode: a container without locales, some CI runners); the
    locale's encoding could not even write the report. Python chooses the default text
    encoding at startup, so a child process writes the report."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    env.pop("PYTHONIOENCODING", None)
    probe = [sys.executable, "-c", "import locale; print(locale.getpreferredencoding(False))"]
    locale_encoding = subprocess.run(probe, env=env, capture_output=True, text=True).stdout
    assert codecs.lookup(locale_encoding.strip()).name == "ascii", "the test needs an ASCII locale"
    child = subprocess.run(
        [sys.executable, "-c", _REPORT_CHILD, str(tmp_path)], env=env, capture_output=True
    )
    assert child.returncode == 0, child.stderr.decode(errors="replace")
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "café.jsonl" in markdown and "→" in markdown
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["meta"]["prompts"] == "café.jsonl"
