"""The goodput budget on exact replay: goodput-TETRIS against fixed SD, DSD and the oracle.

For each cost model, replays the shipped pair's traces (32 slots, every ``k`` x ``extra`` of
the grid) with fixed SD, DSD, the oracle and TETRIS with the goodput budget (the default
estimator, and the paper's ranking), and checks the goals of the goodput budget:

* goodput-TETRIS >= fixed SD at its best ``k`` (of the grid), in every cell;
* goodput-TETRIS >= DSD at the same ``k`` and ``extra``;
* goodput-TETRIS within 5% of the oracle's best goodput (over the grid).

Plain decoding (no draft) is printed as a reference: with few requests a run can be bound by
its slowest request, and then speculation gains little over it.

Goodput is modelled: emitted tokens per second of the cost model, which also prices what the
selectors plan with. Cost models:

* ``h100-graph``: ``benchmarks/costs/h100-graph-tinyllama-1.1b-bf16.json``, a 1.1B bf16 target
  and a 74M draft, forward passes captured in CUDA graphs on an H100 (timed by hand: target at
  B = 1/8/32/64 and W = 1/4/8 tokens per row, draft at W = 1);
* ``cpu-eager``: the shipped pair on one CPU thread, eager (``specselect.cost``'s measured
  default cost model);
* any ``--cost-model NAME=FILE`` (a cost file from ``specselect profile``), e.g.
  ``h100-measured=benchmarks/costs/h100-graph-94m-pair-bf16.json``, measured on an H100 in
  graph mode for the smaller pair that ``bench_gpu.py --part b`` trains.

    python benchmarks/bench_goodput.py                    # shipped pair, 40 prompts, 64 tokens
    python benchmarks/bench_goodput.py --traces t.pt      # reuse (or save) recorded traces
    python benchmarks/bench_goodput.py --replicate 5      # 5x the requests: throughput-bound
    python benchmarks/bench_goodput.py --static --slots 8 # static batches of 8 requests

``--static`` replays static batches, as ``speculative_generate`` runs them: ``--slots``
requests at a time, the next batch once the whole batch has finished (no refill). A static
batch lasts as long as its slowest request, so the run is bound by it even more than with few
requests and a queue.
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _args import at_least
from bench_estimators import grid_parser
from bench_replay_goals import load_pair_traces
from tqdm.auto import tqdm

from specselect import DSDSelector, FixedWindowSelector, TetrisSelector
from specselect.cost import CostModel, default_cost_model
from specselect.replay import OracleSelector, Traces, replay

H100_GRAPH = Path(__file__).resolve().parent / "costs" / "h100-graph-tinyllama-1.1b-bf16.json"


def cost_models(extra: Sequence[tuple[str, CostModel]]) -> dict[str, tuple[CostModel, str]]:
    """The two built-in cost models, then those of ``--cost-model`` (parsed by
    :func:`named_cost_model`)."""
    models = {
        "h100-graph": (CostModel.load(H100_GRAPH), f"loaded from {H100_GRAPH.name}"),
        "cpu-eager": (default_cost_model(), "specselect's default (measured on a CPU)"),
    }
    for name, model in extra:
        models[name] = (model, f"loaded from {model.path}")
    return models


def named_cost_model(text: str) -> tuple[str, CostModel]:
    """``--cost-model NAME=FILE``: a new name (not a built-in model's) and a cost file that
    loads; an argparse error otherwise, before any replay."""
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    if name in BUILT_IN:
        raise argparse.ArgumentTypeError(f"{name!r} names a built-in cost model; choose another")
    try:
        return name, CostModel.load(Path(path))
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path!r}: {exc}") from None


BUILT_IN = ("h100-graph", "cpu-eager")  # the names of cost_models' own


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
    traces: Traces,
    cost: CostModel,
    slots: int,
    ks: Sequence[int],
    extras: Sequence[int],
    refill: bool = True,
) -> tuple[dict[int, float], list[Cell]]:
    def goodput(selector) -> tuple[float, float]:
        result = replay(traces, selector, slots, cost, refill=refill)
        return result.totals.goodput, float(np.mean(result.windows))

    fixed = {k: goodput(FixedWindowSelector(k))[0] for k in ks}
    cells = []
    for k, extra in tqdm(list(itertools.product(ks, extras)), desc="grid", leave=False):
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


def report(
    name: str, source: str, plain: float, fixed: dict[int, float], cells: list[Cell]
) -> list[str]:
    best_fixed = max(fixed.values())
    best_oracle = max(c.goodput["oracle"] for c in cells)
    lines = [
        f"### {name} ({source})",
        "",
        f"plain decoding {plain:.1f}; fixed SD: "
        + ", ".join(f"k={k} {v:.1f}" for k, v in fixed.items()),
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
    parser = grid_parser(" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--replicate",
        type=at_least(1),
        default=1,
        help="run the requests this many times, shuffled",
    )
    parser.add_argument(
        "--cost-model",
        action="append",
        type=named_cost_model,
        default=[],
        metavar="NAME=FILE",
        help="also a cost file, under a name of its own",
    )
    parser.add_argument(
        "--static", action="store_true", help="static batches of --slots requests (no refill)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    max_k = max(args.k) + max(args.extra)
    traces = load_pair_traces(args.pair, args.max_new_tokens, max_k, args.traces)
    if args.replicate > 1:
        traces = replicated(traces, args.replicate)
    batches = "static batches of" if args.static else "refilling"
    print(
        f"{traces.num_requests} requests, {batches} {args.slots} slots, "
        f"{traces.max_new_tokens} tokens"
    )
    refill = not args.static
    for name, (cost, source) in cost_models(args.cost_model).items():
        fixed, cells = run_grid(traces, cost, args.slots, args.k, args.extra, refill)
        # A reference, not a goal: what the requests cost without speculation (no draft pass).
        plain = replay(
            traces, FixedWindowSelector(0), args.slots, cost, refill=refill
        ).totals.goodput
        print("\n".join(["", *report(name, source, plain, fixed, cells)]), flush=True)


if __name__ == "__main__":
    main()
