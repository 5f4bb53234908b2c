"""The goodput budget on exact replay: goodput-TETRIS against fixed SD, DSD and the oracle.

For each cost model, replays the shipped pair's traces (32 slots, every ``k`` x ``extra`` of
the grid) with fixed SD, DSD, the oracle and TETRIS with the goodput budget (the default
estimator, and the paper's ranking), and checks the goals of the goodput budget:

* goodput-TETRIS >= fixed SD at its best ``k`` (of the grid), in every cell;
* goodput-TETRIS >= DSD at the same ``k`` and ``extra``;
* goodput-TETRIS within 5% of the oracle's best goodput (over the grid).

Goodput is modelled: emitted tokens per second of the cost model, which also prices what the
selectors plan with. Cost models:

* ``h100-graph``: a 1.1B bf16 target and a 74M draft, forward passes captured in CUDA graphs on
  an H100 (timed by hand: target at B = 1/8/32/64 and W = 1/4/8 tokens per row, draft at W = 1);
* ``cpu-eager``: the shipped pair on one CPU thread, eager (the measured default cost model of
  ``specselect.cost`` when this version has one);
* any ``--cost-model NAME=FILE`` (a cost file from ``specselect profile``).

A cost model is the library's fit of the timings where the library can fit them (a model with
a knee and a per-row term); otherwise the timings are interpolated (:class:`TimingTable`).

    python benchmarks/bench_goodput.py                    # shipped pair, 40 prompts, 64 tokens
    python benchmarks/bench_goodput.py --traces t.pt      # reuse (or save) recorded traces
    python benchmarks/bench_goodput.py --replicate 5      # 5x the requests: throughput-bound
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from bench_estimators import grid_parser, shipped_traces

from specselect import DSDSelector, FixedWindowSelector, TetrisSelector
from specselect.cost import CostModel, CostSample
from specselect.replay import OracleSelector, Traces, replay

# Hand-captured H100 times (ms) of one forward pass in a CUDA graph: batch -> per width.
H100_BATCHES = (1, 8, 32, 64)
H100_TARGET_MS = {
    1: (3.22, 4.40, 7.83, 11.97),
    4: (3.65, 4.89, 8.47, 13.39),
    8: (3.73, 4.94, 8.81, 14.53),
}
H100_DRAFT_MS = (0.51, 0.60, 0.86, 1.18)  # W = 1
H100_CONTEXT = 128.0


def h100_samples() -> list[CostSample]:
    """The hand-captured H100 graph-mode timings as cost samples (seconds)."""
    samples = [
        CostSample("verify", batch, batch * width, H100_CONTEXT, ms / 1e3)
        for width, row in H100_TARGET_MS.items()
        for batch, ms in zip(H100_BATCHES, row, strict=True)
    ]
    samples += [
        CostSample("draft", batch, 1, H100_CONTEXT, ms / 1e3)
        for batch, ms in zip(H100_BATCHES, H100_DRAFT_MS, strict=True)
    ]
    return samples


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points, extended linearly beyond the ends."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x) - 1, 0), len(xs) - 2)
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + t * (ys[i + 1] - ys[i]))


@dataclass(frozen=True)
class TimingTable(CostModel):
    """Measured times, interpolated: verification over (batch, tokens per row), drafting per
    pass over batch; context is ignored (the samples share one).

    For specselect versions whose :class:`CostModel` cannot fit the timings (a model linear in
    the tokens has no per-row term, and graph-mode verification time grows with the rows, not
    the tokens). Times are clamped at the smallest measured one, so an extrapolation never
    reaches zero.
    """

    samples: tuple[CostSample, ...] = field(default=())

    def draft_time(self, batch: int, tokens: int, context: float = 512.0) -> float:
        points = sorted((s.batch, s.seconds / s.tokens) for s in self.samples if s.kind == "draft")
        return tokens * self._floor(_interpolate(*zip(*points, strict=True), batch), points)

    def verify_time(self, batch: int, tokens: int, context: float = 512.0) -> float:
        if batch == 0:
            return 0.0
        widths: dict[float, list[tuple[int, float]]] = {}
        for s in self.samples:
            if s.kind == "verify":
                widths.setdefault(s.tokens / s.batch, []).append((s.batch, s.seconds))
        per_width = sorted(
            (w, _interpolate(*zip(*sorted(points), strict=True), batch))
            for w, points in widths.items()
        )
        times = [t for _, t in per_width]
        return max(_interpolate([w for w, _ in per_width], times, tokens / batch), min(times))

    @staticmethod
    def _floor(value: float, points: list[tuple[int, float]]) -> float:
        return max(value, min(t for _, t in points))


def from_samples(samples: list[CostSample]) -> tuple[CostModel, str]:
    """The library's fit of ``samples`` if it can fit them, else :class:`TimingTable`."""
    try:
        return CostModel.fit(samples), "fitted by specselect.cost"
    except ValueError as exc:
        return TimingTable(samples=tuple(samples)), f"interpolated ({exc.args[0][:60]}...)"


def load_cost_model(path: Path) -> tuple[CostModel, str]:
    """A cost file: the library's loader where it has one, else the samples it holds."""
    if hasattr(CostModel, "load"):
        return CostModel.load(path), f"loaded from {path}"  # type: ignore[attr-defined]
    document = json.loads(path.read_text())
    samples = [CostSample(**s) for s in document["samples"]]
    return TimingTable(samples=tuple(samples)), f"timings of {path}, interpolated"


def cost_models(extra: Sequence[str]) -> dict[str, tuple[CostModel, str]]:
    models = {"h100-graph": from_samples(h100_samples())}
    try:
        from specselect.cost import default_cost_model  # type: ignore[attr-defined]

        models["cpu-eager"] = (default_cost_model(), "specselect's default (measured on a CPU)")
    except ImportError:
        print("no measured CPU cost model in this version: pass --cost-model cpu-eager=FILE")
    for spec in extra:
        name, _, path = spec.partition("=")
        models[name] = load_cost_model(Path(path))
    return models


def replicated(traces: Traces, times: int, seed: int = 0) -> Traces:
    """The requests ``times`` over, shuffled: a queue that keeps the slots full for longer."""
    order = list(range(traces.num_requests)) * times
    random.Random(seed).shuffle(order)
    return traces.subset(order)


@dataclass
class Cell:
    """One ``(k, extra)`` of the grid: goodput (tok/s) of each selector, and goodput-TETRIS's
    mean draft depth."""

    k: int
    extra: int
    goodput: dict[str, float]
    depth: float


def run_grid(
    traces: Traces, cost: CostModel, slots: int, ks: Sequence[int], extras: Sequence[int]
) -> tuple[dict[int, float], list[Cell]]:
    def goodput(selector) -> tuple[float, float]:
        result = replay(traces, selector, slots, cost)
        return result.totals.goodput, float(np.mean(result.windows))

    fixed = {k: goodput(FixedWindowSelector(k))[0] for k in ks}
    cells = []
    for k in ks:
        for extra in extras:
            tetris, depth = goodput(TetrisSelector(k, extra, budget="goodput", cost_model=cost))
            paper = TetrisSelector(
                k, extra, budget="goodput", cost_model=cost, estimator=None, guard=False
            )
            values = {
                "goodput-tetris": tetris,
                "goodput-tetris (paper ranking)": goodput(paper)[0],
                "tetris (C = k * active)": goodput(TetrisSelector(k, extra))[0],
                "dsd": goodput(DSDSelector(k + extra, cost_model=cost))[0],
                "oracle": goodput(OracleSelector(k, extra))[0],
            }
            cells.append(Cell(k, extra, values, depth))
    return fixed, cells


def report(name: str, source: str, fixed: dict[int, float], cells: list[Cell]) -> list[str]:
    best_fixed = max(fixed.values())
    best_oracle = max(c.goodput["oracle"] for c in cells)
    lines = [
        f"### {name} ({source})",
        "",
        "fixed SD: " + ", ".join(f"k={k} {v:.1f}" for k, v in fixed.items()),
        "",
        "| k | extra | goodput-TETRIS | mean K | paper ranking | TETRIS C=k·active | DSD | oracle "
        "| vs best fixed | vs DSD | vs best oracle |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst = {"fixed": 1e9, "dsd": 1e9, "oracle": 1e9}
    for c in cells:
        g = c.goodput
        ratios = {
            "fixed": g["goodput-tetris"] / best_fixed,
            "dsd": g["goodput-tetris"] / g["dsd"],
            "oracle": g["goodput-tetris"] / best_oracle,
        }
        worst = {key: min(worst[key], value) for key, value in ratios.items()}
        lines.append(
            f"| {c.k} | {c.extra} | {g['goodput-tetris']:.1f} | {c.depth:.2f} | "
            f"{g['goodput-tetris (paper ranking)']:.1f} | {g['tetris (C = k * active)']:.1f} | "
            f"{g['dsd']:.1f} | {g['oracle']:.1f} | {ratios['fixed'] - 1:+.1%} | "
            f"{ratios['dsd'] - 1:+.1%} | {ratios['oracle'] - 1:+.1%} |"
        )
    goals = {
        ">= fixed SD at its best k": worst["fixed"] >= 1.0,
        ">= DSD at every k": worst["dsd"] >= 1.0,
        "within 5% of the oracle's best": worst["oracle"] >= 0.95,
    }
    lines.append("")
    for (goal, met), key in zip(goals.items(), worst, strict=True):
        lines.append(f"- {goal}: {'met' if met else 'NOT met'} (worst cell {worst[key] - 1:+.1%})")
    return lines


def main() -> None:
    parser = grid_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--replicate", type=int, default=1, help="run the requests this many times, shuffled"
    )
    parser.add_argument(
        "--cost-model", action="append", default=[], metavar="NAME=FILE", help="a cost file"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    traces = shipped_traces(args.max_new_tokens, max(args.k) + max(args.extra), args.traces)
    if args.replicate > 1:
        traces = replicated(traces, args.replicate)
    print(f"{traces.num_requests} requests, {args.slots} slots, {traces.max_new_tokens} tokens")
    for name, (cost, source) in cost_models(args.cost_model).items():
        fixed, cells = run_grid(traces, cost, args.slots, args.k, args.extra)
        print("\n".join(["", *report(name, source, fixed, cells)]), flush=True)


if __name__ == "__main__":
    main()
