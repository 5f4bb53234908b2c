"""Comparison reports: a console table, a JSON file, a markdown report and PNG plots.

Every number comes from :class:`specselect.metrics.Totals` (the one definition of the metrics).
Each selector configuration is shown next to fixed-window speculative decoding at the same
``k`` (standard SD, the baseline every selector must beat), and the oracle's row is the upper
bound that a selector with perfect knowledge of acceptance would reach.

The distinct per-step quantities shown besides tokens per step and VSR are per *request-step*
(per active request per step), the same axis as ``k``:

* ``verified / request-step``: the budget a selector actually spent (fixed SD: ``k``, less near
  the end of requests; dynamic selectors: whatever they chose);
* ``accepted / request-step``: ``tokens per step - 1``, shown because relative changes are
  clearer on it. (Accepted per verified token is the VSR itself.)

A metric that :class:`~specselect.metrics.Totals` leaves undefined (the VSR of a row that
verified nothing) is shown as ``-`` and written as ``null``, and has no ratio to fixed SD.

The rows are :class:`specselect.replay.ResultRow` s (re-exported here). Tables, summaries and
plots show a selector once per ``k`` where all its ``extra`` values gave identical results
(:func:`merge_extra_repeats`); ``results.json`` keeps every configuration.

matplotlib is imported only when plots are drawn, and through its object-oriented API
(``Figure`` + Agg canvas), so that writing a report never changes the caller's pyplot backend.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specselect.replay.results import MEASURED, MODELLED, ResultRow

BASELINE = "fixed"
ORACLE = "oracle"

__all__ = [
    "ResultRow",
    "format_table",
    "markdown_report",
    "merge_extra_repeats",
    "plot_tokens_vs_budget",
    "plot_vsr_vs_extra",
    "relative_to_baseline",
    "results_json",
    "write_report",
]


_RELATIVE = ("tokens_per_step", "accepted_per_request_step", "vsr", "goodput")

PLOT_FILES = {
    "tokens_plot": "tokens_per_step_vs_budget.png",
    "vsr_plot": "vsr_vs_extra.png",
    "reliability_plot": "reliability.png",
}
"""The plots :func:`write_report` may write, by kind; a run removes those it did not draw."""


def _baseline(rows: Sequence[ResultRow], k: int) -> ResultRow | None:
    for row in rows:
        if row.selector == BASELINE and row.k == k and row.budget is None:
            return row
    return None


def relative_to_baseline(row: ResultRow, rows: Sequence[ResultRow]) -> dict[str, float | None]:
    """Ratios of ``row``'s metrics to fixed SD's at the same ``k`` (None: no baseline or 0)."""
    base = _baseline(rows, row.k)
    if base is None:
        return dict.fromkeys(_RELATIVE)
    mine, theirs = row.totals.as_dict(), base.totals.as_dict()
    ratios = {m: _ratio(mine[m], theirs[m]) for m in _RELATIVE}
    if row.goodput_kind != base.goodput_kind:  # modelled vs measured seconds: not comparable
        ratios["goodput"] = None
    return ratios


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return None if mine is None or not theirs else mine / theirs


def _pct(ratio: float | None) -> str:
    return "" if ratio is None else f"{(ratio - 1) * 100:+.1f}%"


def _opt(value: int | str | None) -> str:
    return "-" if value is None else str(value)


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``-`` when undefined."""
    return "-" if value is None else format(value, spec)


def _goodput_header(rows: Sequence[ResultRow]) -> str:
    kinds = {r.goodput_kind for r in rows}
    return f"goodput ({'/'.join(sorted(kinds)) or MODELLED} tok/s)"


def _table_cells(rows: Sequence[ResultRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of ``rows`` (in their order); the ``C`` column only when a row has an
    absolute budget (otherwise it would be all ``-``)."""
    header = [
        "selector",
        "k",
        "extra",
        "C",
        "tok/step",
        "vs fixed",
        "acc/step",
        "ver/step",
        "VSR",
        "vs fixed",
        _goodput_header(rows),
        "vs fixed",
    ]
    body = []
    for row in rows:
        rel = relative_to_baseline(row, rows)
        m = row.totals.as_dict()
        body.append(
            [
                row.selector,
                str(row.k),
                _opt(row.extra),
                _opt(row.budget),
                f"{m['tokens_per_step']:.3f}",
                _pct(rel["tokens_per_step"]),
                f"{m['accepted_per_request_step']:.3f}",
                f"{m['verified_per_request_step']:.3f}",
                _fmt(m["vsr"], ".3f"),
                _pct(rel["vsr"]),
                f"{m['goodput']:.1f}",
                _pct(rel["goodput"]),
            ]
        )
    if all(row.budget is None for row in rows):
        budget = header.index("C")
        header.pop(budget)
        for cells in body:
            cells.pop(budget)
    return header, body


def merge_extra_repeats(rows: Sequence[ResultRow]) -> list[ResultRow]:
    """``rows`` with each selector shown once per ``k`` and budget where every ``extra`` gave it
    identical results (totals and calibration), with ``extra`` None (shown as ``-``).

    Dynamic selectors get ``extra`` only as a cap on their window (``max_k = k + extra``); one
    that never reaches the cap (DSD on a weak pair) repeats the same row for every ``extra``,
    and a summary would then name an arbitrary ``extra`` as best. Measured (live) rows never
    repeat exactly, so they are kept. The first of the merged rows stands for them; the order
    of ``rows`` is kept.
    """

    def group(row: ResultRow) -> tuple[Any, ...]:
        return (row.selector, row.k, row.budget, row.goodput_kind)

    extras: dict[tuple[Any, ...], list[ResultRow]] = {}
    for row in rows:
        if row.extra is not None:
            extras.setdefault(group(row), []).append(row)
    merged: list[ResultRow] = []
    for row in rows:
        same = extras.get(group(row), [])
        if row.extra is None or len(same) < 2 or not _all_alike(same):
            merged.append(row)
        elif row is same[0]:
            merged.append(replace(row, config=replace(row.config, extra=None)))
    return merged


def _all_alike(rows: Sequence[ResultRow]) -> bool:
    first = rows[0]
    return all(r.totals == first.totals and r.calibration == first.calibration for r in rows)


def _ordered(rows: Iterable[ResultRow]) -> list[ResultRow]:
    """Group by ``k``; baseline first (its tree rows too), oracle last, the rest by name, extra
    and budget."""

    def key(row: ResultRow) -> tuple[Any, ...]:
        name = row.config.name  # without a tree's shape
        rank = 0 if name == BASELINE else 2 if name == ORACLE else 1
        budget = row.budget  # the default, then absolute budgets, then named ones ("goodput")
        named = (2, 0, budget) if isinstance(budget, str) else None
        order = named or ((0, 0, "") if budget is None else (1, budget, ""))
        return (row.k, rank, row.selector, row.extra or 0, order)

    return sorted(rows, key=key)


def _shown(rows: Sequence[ResultRow]) -> list[ResultRow]:
    """The rows a table shows, in its order: repeats over ``extra`` merged, grouped by ``k``."""
    return _ordered(merge_extra_repeats(rows))


def format_table(rows: Sequence[ResultRow], *, cost_model: str | None = None) -> str:
    """Fixed-width console table, grouped by ``k`` (relative columns: vs fixed SD at that k).

    A selector whose rows are identical for every ``extra`` is shown once per ``k``
    (:func:`merge_extra_repeats`). ``cost_model`` (a :meth:`CostModel.describe` line) heads the
    table when a row's goodput is modelled: it says what the seconds come from.
    """
    shown = _shown(rows)
    header, body = _table_cells(shown)
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()  # an empty last cell (no ratio) leaves no trailing blanks

    lines = [line(header), "  ".join("-" * w for w in widths)]
    if cost_model is not None and any(r.goodput_kind != MEASURED for r in shown):
        lines.insert(0, cost_model_line(cost_model))
    previous_k = None
    for cells, row in zip(body, shown, strict=True):
        if previous_k is not None and row.k != previous_k:
            lines.append("")
        previous_k = row.k
        lines.append(line(cells))
    return "\n".join(lines)


def markdown_table(rows: Sequence[ResultRow]) -> str:
    """The same table in GitHub markdown."""
    header, body = _table_cells(_shown(rows))
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def results_json(rows: Sequence[ResultRow], meta: dict[str, Any]) -> dict[str, Any]:
    """JSON-compatible results: ``meta`` and one entry per row with metrics and ratios."""
    return {
        "meta": meta,
        "rows": [
            {
                "label": row.label,
                "selector": row.selector,
                "k": row.k,
                "extra": row.extra,
                "budget": row.budget,
                "params": row.params,
                "goodput_kind": row.goodput_kind,
                "metrics": row.totals.as_dict(),
                "relative_to_fixed": relative_to_baseline(row, rows),
                "calibration": row.calibration,
            }
            for row in _ordered(rows)
        ],
    }


def _within_spend(row: ResultRow, base: ResultRow) -> bool:
    """Did ``row`` verify at most as many tokens per request-step as fixed SD (``base``)
    actually did? Not its nominal ``k``: fixed SD verifies fewer where a request has fewer than
    ``k`` tokens left, so a row between the two spent more than the baseline it is ranked
    against. (The tolerance absorbs float rounding of equal spends.)"""
    return row.totals.verified_per_request_step <= base.totals.verified_per_request_step + 1e-9


def _best(rows: Sequence[ResultRow], metric: str) -> list[ResultRow]:
    """The rows with the largest ``metric`` (a :class:`~specselect.metrics.Totals` property):
    all of them on a tie, so that a summary never picks one of equal configurations
    arbitrarily."""
    top = max(getattr(r.totals, metric) for r in rows)
    return [r for r in rows if getattr(r.totals, metric) == top]


def _labels(rows: Sequence[ResultRow]) -> str:
    return " = ".join(r.label for r in rows)


def _summary_lines(rows: Sequence[ResultRow]) -> list[str]:
    """Per ``k``: fixed SD, the best goodput, the best within fixed SD's spend, the oracle.

    Tokens per step are only comparable at equal spend, so the "most tokens per step" pick is
    restricted to rows that verified at most as many tokens per request-step as fixed SD did
    (and made only when there is a fixed SD row to compare with); goodput already charges for
    what was spent, so it is compared across all rows.
    """
    rows = merge_extra_repeats(rows)  # name "dsd k=2", not an arbitrary one of equal extras
    lines = []
    for k in sorted({r.k for r in rows}):
        group = [r for r in rows if r.k == k]
        base = _baseline(rows, k)
        real = [r for r in group if r.selector not in (ORACLE, BASELINE)]
        parts = [f"- **k = {k}**:"]
        if base is not None:
            parts.append(f"fixed SD {base.totals.tokens_per_step:.3f} tokens/step.")
        if real:
            best_gp = _best(real, "goodput")
            rel = relative_to_baseline(best_gp[0], rows)["goodput"]
            found = f"{_labels(best_gp)} ({_pct(rel) or 'n/a'} vs fixed)"
            if base is None or best_gp[0].totals.goodput > base.totals.goodput:
                parts.append(f"Highest goodput: {found}.")
            else:  # a tie or a loss would read as a win
                parts.append(f"None beats fixed SD's goodput; the highest: {found}.")
        frugal = [] if base is None else [r for r in real if _within_spend(r, base)]
        if frugal and base is not None:
            best = _best(frugal, "tokens_per_step")
            rel = relative_to_baseline(best[0], rows)["tokens_per_step"]
            spend = f"{base.totals.verified_per_request_step:.3f} verified per request-step"
            found = f"{_labels(best)} ({best[0].totals.tokens_per_step:.3f}, {_pct(rel) or 'n/a'})"
            if best[0].totals.tokens_per_step > base.totals.tokens_per_step:
                parts.append(f"Most tokens/step within fixed SD's spend ({spend}): {found}.")
            else:  # a "best" below the baseline would read as a win
                parts.append(
                    f"None beats fixed SD's tokens/step within its spend ({spend}); "
                    f"the most: {found}."
                )
        oracle = [r for r in group if r.selector == ORACLE and r.budget is None]
        if oracle:
            top = max(oracle, key=lambda r: r.totals.tokens_per_step)
            rel = relative_to_baseline(top, rows)["tokens_per_step"]
            parts.append(
                f"Oracle at the same budget: {top.totals.tokens_per_step:.3f} "
                f"({_pct(rel) or 'n/a'}, {top.label})."
            )
        lines.append(" ".join(parts))
    return lines


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in meta.items():
        text = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else str(value)
        lines.append(
            f"- **{key}**: `{text}`" if isinstance(value, dict | list) else f"- **{key}**: {text}"
        )
    return lines


_COLUMNS_NOTE = (
    "Relative columns compare with fixed-window speculative decoding (standard SD) at the same "
    "`k`. Tokens per step are comparable only at equal spend (`ver/step`); goodput charges for "
    "what was spent. `acc/step` and `ver/step` are accepted and verified draft tokens per active "
    "request per step (accepted per verified token is the VSR). `extra` is `-` for selectors "
    "without one (fixed SD, draft trees) and for a selector that gave identical results at every "
    "`extra`, shown once (`results.json` lists each configuration). `C`, shown when absolute "
    "budgets were given, is such a budget per step (`-`: the default `k * active requests`; "
    "`goodput`: chosen every step for the modelled goodput of the cost model in Setup, with a "
    "draft depth chosen for it too, up to `k + extra`). "
    "The oracle knows the true run lengths and "
    "spends the budget only on tokens that will be accepted: at each step, the most a selector "
    "with the same window (`k + extra`) and budget (`k` per request) could accept (a per-step "
    "bound, not a bound over whole runs)."
)


_MEASURED_NOTE = (
    "Goodput is **measured**: wall-clock time of `speculative_generate` on this machine."
)


def cost_model_line(description: str | None) -> str:
    """The line naming the cost model that modelled goodput comes from."""
    return f"modelled goodput: cost model {description or 'not recorded'}"


def _cost_model_name(meta: dict[str, Any]) -> str:
    """``meta["cost_model"]``'s description (a :meth:`CostModel.summary`), in backticks."""
    model = meta.get("cost_model")
    description = model.get("description") if isinstance(model, dict) else None
    return f"`{description}`" if description else "not recorded"


def _goodput_note(rows: Sequence[ResultRow], meta: dict[str, Any]) -> str:
    """Say which goodputs were measured and which modelled (live runs mix both: the oracle),
    and which cost model priced the modelled ones."""
    model = _cost_model_name(meta)
    if all(r.goodput_kind != MEASURED for r in rows):
        return (
            "Goodput is **modelled**: emitted tokens per second of the cost model "
            f"{model} (`specselect.cost.CostModel`; its fitted terms are under Setup), not a "
            "measurement of these models on this machine."
        )
    modelled = sorted({r.selector for r in rows if r.goodput_kind != MEASURED})
    if not modelled:
        return _MEASURED_NOTE
    return (
        "Goodput is **measured** wall-clock time of `speculative_generate` on this machine, "
        f"except in the rows of {', '.join(f'`{name}`' for name in modelled)}: those are "
        f"replayed, not run, so their goodput is **modelled** by the cost model {model} "
        "and is not compared with measured ones."
    )


def markdown_report(
    rows: Sequence[ResultRow], meta: dict[str, Any], plots: Sequence[str] = ()
) -> str:
    """A self-contained markdown report (``plots``: image paths relative to the report)."""
    parts = [
        "# specselect compare",
        "",
        "## Summary",
        "",
        *_summary_lines(rows),
        "",
        "## Results",
        "",
        _COLUMNS_NOTE,
        "",
        _goodput_note(rows, meta),
        "",
        markdown_table(rows),
        "",
    ]
    reliability = reliability_lines(rows)
    if reliability:
        parts += [
            "## Reliability of the ranked scores",
            "",
            "Predicted acceptance (the score TETRIS ranks, per token, given its predecessors were "
            "accepted) against the observed acceptance of the tokens the target tested; ECE is "
            "the token-weighted mean gap.",
            "",
            *reliability,
            "",
        ]
    if plots:
        parts += ["## Plots", ""]
        parts += [f"![{Path(p).stem}]({p})" for p in plots]
        parts.append("")
    parts += ["## Setup", "", *_meta_lines(meta), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _new_figure(panels: int) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * panels + 1.0, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, sharey=True, squeeze=False)[0]
    return fig, list(axes)


_MARKERS = ("o", "^", "v", "D", "P", "*", "<", ">")
_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
)
"""tab10 without grey (fixed SD's) and black (the oracle's)."""
_LINESTYLES = ("-", "--", "-.", ":")


def _style(selector: str, names: Sequence[str]) -> dict[str, Any]:
    """The same look for a selector in every panel and plot: a colour of its own (up to nine
    selectors; beyond, colours repeat with another marker and line style), and distinct markers,
    since points of different selectors often coincide (e.g. a dynamic window that settles on
    fixed SD's)."""
    if selector == ORACLE:
        return {"color": "black", "linestyle": "--", "marker": "x", "zorder": 4}
    if selector == BASELINE:  # below the others: a selector that matches it stays visible
        return {"color": "tab:gray", "linestyle": "-", "marker": "s", "markersize": 9, "zorder": 2}
    others = sorted(n for n in set(names) if n not in (ORACLE, BASELINE))
    i = others.index(selector) if selector in others else 0
    return {
        "color": _COLORS[i % len(_COLORS)],
        "marker": _MARKERS[i % len(_MARKERS)],
        "linestyle": _LINESTYLES[i // len(_COLORS) % len(_LINESTYLES)],
        "alpha": 0.85,
        "zorder": 3,
    }


def _finish(fig: Any, axes: list[Any], path: Path) -> Path:
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_tokens_vs_budget(rows: Sequence[ResultRow], path: str | Path) -> Path:
    """Tokens per step against the budget actually spent (verified per request-step).

    One panel per ``extra`` (selectors without ``extra`` appear in every panel); one line per
    selector over ``k`` (and absolute budgets), each point labelled with its ``k`` (and ``C``).
    The x-axis is what each selector *spent*, so dynamic selectors, which choose their own
    budget, sit at their true cost, and a point's position does not tell its ``k``.
    """
    fig, axes = _tokens_figure(rows)
    return _finish(fig, axes, Path(path))


def _point_label(row: ResultRow) -> str:
    return str(row.k) if row.budget is None else f"{row.k} C={row.budget}"


def _tokens_figure(rows: Sequence[ResultRow]) -> tuple[Any, list[Any]]:
    extras: list[int | None] = [*sorted({r.extra for r in rows if r.extra is not None})] or [None]
    fig, axes = _new_figure(len(extras))
    names = [r.selector for r in rows]
    for ax, extra in zip(axes, extras, strict=True):
        panel = [r for r in rows if r.extra in (extra, None)]
        for name in sorted({r.selector for r in panel}):
            mine = sorted(
                (r for r in panel if r.selector == name),
                key=lambda r: r.totals.verified_per_request_step,
            )
            xs = [r.totals.verified_per_request_step for r in mine]
            ys = [r.totals.tokens_per_step for r in mine]
            ax.plot(xs, ys, label=name, **_style(name, names))
        _label_points(ax, panel)
        ax.set_title("all" if extra is None else f"extra = {extra}")
        ax.set_xlabel("verified tokens per request per step (budget)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per step")
    return fig, axes


_NEAR = 0.03
"""Points closer than this (as a fraction of the data's span on both axes) share a label."""


def _label_points(ax: Any, rows: Sequence[ResultRow]) -> None:
    """Write ``k=..`` beside the points of ``rows``, once per cluster of nearby points with
    the same ``k`` (the TETRIS variants of one ``k`` often coincide), and as ``k=2,3,4`` where
    one selector's points coincide (DSD's window does not follow ``k``)."""
    points = [(r.totals.verified_per_request_step, r.totals.tokens_per_step, r) for r in rows]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0

    def near(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return abs(a[0] - b[0]) <= _NEAR * span_x and abs(a[1] - b[1]) <= _NEAR * span_y

    clusters: list[tuple[tuple[float, float], list[str]]] = []  # position, its k labels
    for x, y, row in sorted(points, key=lambda p: (p[2].k, p[0], p[1])):
        label = _point_label(row)
        here = next((c for c in clusters if near(c[0], (x, y))), None)
        if here is None:
            clusters.append(((x, y), [label]))
        elif label not in here[1]:
            here[1].append(label)
    for (x, y), labels in clusters:
        ax.annotate(
            f"k={','.join(labels)}",
            (x, y),
            xytext=(4, -9),
            textcoords="offset points",
            fontsize=6.5,
            color="0.2",
        )


def plot_vsr_vs_extra(rows: Sequence[ResultRow], path: str | Path) -> Path:
    """VSR against extra draft tokens, one panel per ``k`` (default budgets only).

    Selectors without ``extra`` (fixed SD) are drawn as horizontal lines: their window is ``k``
    whatever ``extra`` is. The oracle verifies only tokens it knows will be accepted (VSR 1).
    """
    rows = [r for r in rows if r.budget is None]
    ks = sorted({r.k for r in rows})
    extras = sorted({r.extra for r in rows if r.extra is not None})
    fig, axes = _new_figure(max(len(ks), 1))
    for ax, k in zip(axes, ks, strict=False):
        panel = [r for r in rows if r.k == k]
        for name in sorted({r.selector for r in panel}):
            mine = sorted(  # an undefined VSR (NaN: nothing verified) is a gap, not a 0
                ((r.extra, r.totals.vsr) for r in panel if r.selector == name),
                key=lambda p: -1 if p[0] is None else p[0],
            )
            xs: Sequence[Any]
            ys: Sequence[float]
            if mine[0][0] is None and extras:
                xs, ys = [extras[0], extras[-1]], [mine[0][1]] * 2
            else:
                xs, ys = zip(*mine, strict=True)
            ax.plot(xs, ys, label=name, **_style(name, [r.selector for r in rows]))
        ax.set_title(f"k = {k}")
        ax.set_xticks(extras)
        ax.set_xlabel("extra draft tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("VSR (accepted / verified)")
    return _finish(fig, axes, Path(path))


def calibration_error(bins: Sequence[dict[str, float]]) -> float:
    """Expected calibration error: token-weighted mean |predicted - observed| over the bins."""
    tokens = sum(b["tokens"] for b in bins)
    return sum(b["tokens"] * abs(b["predicted"] - b["observed"]) for b in bins) / tokens


def _reliability_rows(rows: Sequence[ResultRow]) -> list[ResultRow]:
    """One row per ranking selector (TETRIS variants), at its largest ``k`` and ``extra``."""
    best: dict[str, ResultRow] = {}
    for row in rows:
        if row.calibration and row.selector.startswith("tetris") and row.budget is None:
            key = (row.k, row.extra or 0)
            if row.selector not in best or key > (
                best[row.selector].k,
                best[row.selector].extra or 0,
            ):
                best[row.selector] = row
    return [best[name] for name in sorted(best)]


def plot_reliability(rows: Sequence[ResultRow], path: str | Path) -> Path:
    """Reliability diagram: predicted vs observed acceptance of the tokens the target tested.

    A point on the diagonal means the selector's scores are calibrated acceptance
    probabilities; TETRIS's ranking is only as good as that. Each TETRIS variant is shown at
    its largest ``k`` and ``extra`` (the title, or each label, says which). Variants whose
    scores barely differ (``tetris+draft`` and ``tetris+none``) draw nearly the same curve, so
    each gets its own line style and a hollow marker of its own shape and size: both stay
    visible where they coincide.
    """
    fig, axes = _reliability_figure(rows)
    return _finish(fig, axes, Path(path))


def _reliability_figure(rows: Sequence[ResultRow]) -> tuple[Any, list[Any]]:
    fig, axes = _new_figure(1)
    ax = axes[0]
    chosen = _reliability_rows(rows)
    names = [r.selector for r in rows]
    shown = {(r.k, r.extra) for r in chosen}
    for index, row in enumerate(chosen):
        xs = [b["predicted"] for b in row.calibration]
        ys = [b["observed"] for b in row.calibration]
        where = "" if len(shown) == 1 else f", k={row.k} extra={_opt(row.extra)}"
        label = f"{row.selector} (ECE {calibration_error(row.calibration):.2f}{where})"
        style = {
            **_style(row.selector, names),
            "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
            "markersize": max(11 - 2 * index, 4),  # later curves: smaller, thinner, on top
            "linewidth": max(2.8 - 0.6 * index, 1.0),
            "markerfacecolor": "none",
            "markeredgewidth": 1.5,
        }
        ax.plot(xs, ys, label=label, **style)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted acceptance (score of the token)")
    ax.set_ylabel("observed acceptance")
    title = "reliability of the ranked scores"
    if len(shown) == 1:
        k, extra = next(iter(shown))
        title += f"\n(k = {k}, extra = {_opt(extra)})"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, axes


def reliability_lines(rows: Sequence[ResultRow]) -> list[str]:
    """Markdown table of each ranking selector's calibration error and bins."""
    chosen = _reliability_rows(rows)
    if not chosen:
        return []
    lines = [
        "| selector | k | extra | ECE | predicted → observed (tokens) |",
        "|---|---|---|---|---|",
    ]
    for row in chosen:
        cells = ", ".join(
            f"{b['predicted']:.2f}→{b['observed']:.2f} ({int(b['tokens'])})"
            for b in row.calibration
        )
        lines.append(
            f"| {row.selector} | {row.k} | {_opt(row.extra)} | "
            f"{calibration_error(row.calibration):.3f} | {cells} |"
        )
    return lines


def write_report(
    rows: Sequence[ResultRow],
    out_dir: str | Path,
    meta: dict[str, Any],
    *,
    plots: bool = True,
) -> dict[str, Path]:
    """Write ``results.json``, ``report.md`` and (optionally) the PNG plots to ``out_dir``.

    Returns the written paths by kind (``json``, ``markdown``, ``tokens_plot``, ``vsr_plot``,
    and ``reliability_plot`` when a ranking selector reported calibration bins). The results
    are written before any plot is drawn, so that a failing plot never costs them; without
    matplotlib the plots are skipped with a warning (:data:`PLOTS_SKIPPED`). Plots of
    :data:`PLOT_FILES` this call does not draw are removed from ``out_dir``: left from an earlier
    run into the same directory, they would pass for results of this one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kinds = _plot_kinds(rows) if plots and not _warn_if_no_matplotlib() else []
    for kind, name in PLOT_FILES.items():
        if kind not in kinds:
            (out / name).unlink(missing_ok=True)
    written = {"json": out / "results.json", "markdown": out / "report.md"}
    # UTF-8 whatever the locale: the report holds non-ASCII text (arrows, model and file names).
    written["json"].write_text(
        json.dumps(
            _finite(results_json(rows, meta)), indent=2, default=_json_default, allow_nan=False
        ),
        encoding="utf-8",
    )
    markdown = markdown_report(rows, meta, [PLOT_FILES[k] for k in kinds])
    written["markdown"].write_text(markdown, encoding="utf-8")
    for kind in kinds:
        written[kind] = _PLOTTERS[kind](rows, out / PLOT_FILES[kind])
    return written


def _plot_kinds(rows: Sequence[ResultRow]) -> list[str]:
    """The :data:`PLOT_FILES` kinds :func:`write_report` draws for ``rows``."""
    reliability = ["reliability_plot"] if _reliability_rows(rows) else []
    return ["tokens_plot", "vsr_plot", *reliability]


_PLOTTERS = {
    "tokens_plot": plot_tokens_vs_budget,
    "vsr_plot": plot_vsr_vs_extra,
    "reliability_plot": plot_reliability,
}


PLOTS_SKIPPED = "matplotlib is not installed; skipping plots (pip install 'specselect[plot]')"
"""What a report (or ``specselect profile``) says when it cannot draw its plots."""


def matplotlib_missing() -> bool:
    """Whether matplotlib cannot be imported (plots need it; everything else does not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def _warn_if_no_matplotlib() -> bool:
    """:func:`matplotlib_missing`, with the one warning of :data:`PLOTS_SKIPPED` if so."""
    missing = matplotlib_missing()
    if missing:
        warnings.warn(PLOTS_SKIPPED, RuntimeWarning, stacklevel=3)
    return missing


def _finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float written as its string (``"inf"``): JSON has
    neither (Python's ``Infinity`` is not JSON, and other readers refuse the file). A fit's
    error on a sample timed at 0 s, for one, is infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _json_default(value: Any) -> str:
    """Anything JSON cannot encode (paths, dtypes) is written as its string."""
    return str(value)
