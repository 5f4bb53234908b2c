"""Does the default TETRIS rank at least as well as the better of the draft's probability and a
learned estimate, on pairs of different calibration? (Exact greedy replay.)

For every pair, the grid ``k in {2, 3, 4} x extra in {1, 2, 3}`` is replayed through 32 slots
with fixed-window SD, the oracle, the paper's TETRIS (``estimator=None, guard=False``), TETRIS
with the learned estimate alone (``estimator="history", guard=False``) and the default TETRIS.
It prints tokens per step relative to fixed SD, the default's distance to the paper's ranking
in points (percentage points of tokens per step over fixed SD), the share of the
fixed-to-oracle gap each closes (n/a in a cell where the oracle does no better than fixed SD;
the mean is over the other cells), and whether the default ranking meets its goals: that it
costs nothing where the draft is well calibrated and gains where a learned estimate ranks better,
namely

* the default >= fixed SD in tokens per step in every cell;
* never more than 0.2 points below the paper's ranking;
* closes >= 65% of the fixed-to-oracle gap on average.

Pairs: the shipped one, and any ``--pair DIR`` laid out like the shipped one (``target/``,
``draft/``, ``tokenizer/``, ``prompts.jsonl``; ``scripts/train_second_pair.sh`` writes one);
``--synthetic`` adds synthetic drafts of known calibration
(:mod:`specselect.estimators.synthetic`). Each pair's calibration is reported as the expected
calibration error (ECE, 10 bins) of the draft's probability of its first drafted token as a
predictor of the target accepting it, on the recorded traces.

    python benchmarks/bench_replay_goals.py                              # shipped pair
    python benchmarks/bench_replay_goals.py --pair DIR --synthetic
    python benchmarks/bench_replay_goals.py --traces-dir /tmp/traces     # cache recordings
    python benchmarks/bench_replay_goals.py --ops                        # per-step op counts

Cached traces are keyed by the pair's resolved path (two pairs in directories of the same name
do not share a file) and checked when read, by the policy ``specselect compare --traces``
applies (:func:`specselect.replay.reuse_traces`): recorded from this pair's models, on its
prompts, with this ``--max-new-tokens`` and at least this window.

``--ops`` counts the operations one ``select`` + ``update`` dispatches (views excluded) at
``B = 256``, ``K = 8`` and times it on one CPU thread, for the paper's TETRIS and the default,
and the same for computing the lookup features the default reads.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _args import at_least
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from specselect import FixedWindowSelector, TetrisSelector
from specselect.estimators.synthetic import CALIBRATIONS, synthetic_traces
from specselect.lookup import LOOKUP_WINDOW, chain_paths, lookup_features
from specselect.models import TINY_PAIR_DIR, load_pair, load_prompts
from specselect.replay import (
    OracleSelector,
    Traces,
    load_traces,
    record_traces,
    replay,
    reuse_traces,
    save_traces,
)
from specselect.selection import Selector

VARIANTS: dict[str, Callable[[int, int], Selector]] = {
    "paper": lambda k, extra: TetrisSelector(k, extra, estimator=None, guard=False),
    "learned": lambda k, extra: TetrisSelector(k, extra, estimator="history", guard=False),
    "default": lambda k, extra: TetrisSelector(k, extra),
}
GAP_GOAL = 0.65  # share of the fixed-to-oracle gap the default must close on average
POINTS_GOAL = 0.2  # points of tokens per step the default may lose to the paper's ranking


def trace_cache_path(cache: Path, pair: Path, max_new_tokens: int, max_k: int) -> Path:
    """The cached traces of ``pair`` in ``cache``, named by the directory's name (to read) and a
    hash of its resolved path (so that two pairs named alike do not share a file)."""
    digest = hashlib.sha256(str(pair.resolve()).encode()).hexdigest()[:12]
    return cache / f"{pair.name}-{digest}-{max_new_tokens}-{max_k}.pt"


def load_pair_traces(pair: Path, max_new_tokens: int, max_k: int, path: Path | None) -> Traces:
    """Greedy traces of the pair in ``pair`` on its own prompts: read from ``path`` when it
    exists, after checking they serve this run (a trace file outlives the run that wrote it, and
    replaying another pair's or a shorter recording would report it silently), else recorded
    (and written to ``path``).

    Raises:
        TraceMismatchError: the file at ``path`` does not fit this pair, its prompts or the shape.
    """
    target, draft, tokenizer = load_pair(pair)
    texts = [prompt["text"] for prompt in load_prompts(pair)]
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
    if path is not None and path.exists():
        return reuse_traces(
            load_traces(path),
            max_k=max_k,
            max_new_tokens=max_new_tokens,
            target=target,
            draft=draft,
            prompt_ids=prompts,
            texts=texts,
            name=str(path),
        )
    traces = record_traces(target, draft, prompts, max_new_tokens, max_k, progress=True)
    if path is not None:
        save_traces(traces, path)
    return traces


def gap_closed(value: float, fixed: float, oracle: float) -> float | None:
    """The share of the fixed-to-oracle gap ``value`` closes; ``None`` where there is no gap
    (the oracle does no better than fixed SD, so no ranking can close anything)."""
    return (value - fixed) / (oracle - fixed) if oracle != fixed else None


def mean_closed(shares: list[float | None]) -> float | None:
    """The mean share over the cells that have a gap; ``None`` if none has."""
    defined = [share for share in shares if share is not None]
    return statistics.mean(defined) if defined else None


def percent(share: float | None, spec: str = ".0%") -> str:
    """A share as a percentage, or ``n/a`` where it is undefined."""
    return "n/a" if share is None else format(share, spec)


def first_token_ece(traces: Traces, bins: int = 10) -> float:
    """ECE of the draft's probability of its first drafted token as a predictor of the
    target accepting it (run >= 1), over every recorded position."""
    q = traces.draft_logprobs[:, :, 0].exp().flatten().double()  # [N * T]
    accepted = (traces.runs >= 1).flatten().double()  # [N * T]
    cells = (q * bins).long().clamp(max=bins - 1)
    error = 0.0
    for cell in range(bins):
        inside = cells == cell
        if inside.any():
            gap = (q[inside].mean() - accepted[inside].mean()).abs()
            error += float(gap) * int(inside.sum()) / q.numel()
    return error


@dataclass
class Cell:
    k: int
    extra: int
    fixed: float  # tokens per step
    oracle: float
    variants: dict[str, float]

    def gain(self, value: float) -> float:
        """Points of tokens per step over fixed SD."""
        return 100 * (value / self.fixed - 1)

    def closed(self, value: float) -> float | None:
        return gap_closed(value, self.fixed, self.oracle)


def replay_grid(traces: Traces, ks: list[int], extras: list[int], slots: int) -> list[Cell]:
    def tokens_per_step(selector: Selector) -> float:
        return replay(traces, selector, slots).totals.tokens_per_step

    fixed = {k: tokens_per_step(FixedWindowSelector(k)) for k in ks}
    cells = []
    for k, extra in tqdm(list(itertools.product(ks, extras)), desc="grid", leave=False):
        oracle = tokens_per_step(OracleSelector(k, extra))
        values = {name: tokens_per_step(make(k, extra)) for name, make in VARIANTS.items()}
        cells.append(Cell(k, extra, fixed[k], oracle, values))
    return cells


def report(label: str, cells: list[Cell], ece: float) -> dict[str, Any]:
    """Print the pair's table and goals; return the summary."""
    print(f"\n### {label} (ECE of the draft's probability: {ece:.3f})\n")
    names = list(VARIANTS)
    print("| k | extra | fixed tok/step | oracle | " + " | ".join(names) + " | default - paper |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|")
    for c in cells:
        gains = " | ".join(f"{c.gain(c.variants[n]):+.1f}%" for n in names)
        delta = c.gain(c.variants["default"]) - c.gain(c.variants["paper"])
        print(
            f"| {c.k} | {c.extra} | {c.fixed:.3f} | {c.gain(c.oracle):+.1f}% | {gains} | "
            f"{delta:+.2f} |"
        )
    closed = {n: mean_closed([c.closed(c.variants[n]) for c in cells]) for n in names}
    print("| **gap closed** | | | | " + " | ".join(percent(closed[n]) for n in names) + " | |")
    at_least_fixed = sum(c.variants["default"] >= c.fixed for c in cells)
    worst = min(c.gain(c.variants["default"]) - c.gain(c.variants["paper"]) for c in cells)
    goals = {
        "default >= fixed in every cell": at_least_fixed == len(cells),
        f"default never more than {POINTS_GOAL} points below the paper": worst >= -POINTS_GOAL,
        f"default closes >= {GAP_GOAL:.0%} of the gap": (closed["default"] or 0.0) >= GAP_GOAL,
    }
    print(
        f"\ndefault >= fixed in {at_least_fixed}/{len(cells)} cells; worst cell vs the paper "
        f"{worst:+.2f} points; gap closed: " + ", ".join(f"{n} {percent(closed[n])}" for n in names)
    )
    for goal, met in goals.items():
        print(f"- {'met' if met else 'NOT met'}: {goal}")
    return {"pair": label, "ece": ece, "closed": closed, "worst_vs_paper": worst, "goals": goals}


class _CountOps(TorchDispatchMode):
    """Counts dispatched operations, views excluded (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def op_counts(batch: int = 256, width: int = 8, repeats: int = 200) -> None:
    """Operations and CPU time of one ``select`` + ``update`` (k = 4, extra = 4), given the
    lookup features as the loop gives them, and of computing those features (the loop's
    draft stage does, for a selector that reads them)."""
    print(f"\n| step | ops (B={batch}, K={width}) | CPU µs (1 thread) |")
    print("|---|---|---|")
    g = torch.Generator().manual_seed(0)
    logprobs = torch.rand(batch, width, generator=g).log()  # [B, K]
    runs = torch.randint(0, width + 1, (batch,), generator=g)  # [B]
    window = torch.randint(0, 100, (batch, LOOKUP_WINDOW), generator=g)  # [B, W] some repeats
    filled = torch.full((batch,), LOOKUP_WINDOW)  # [B]
    tokens = torch.randint(0, 100, (batch, width), generator=g)  # [B, K]
    paths = chain_paths(width, torch.device("cpu"))  # [K, K]

    def lookup() -> Tensor:  # [B, K, F]
        return lookup_features(window, filled, tokens, paths)

    features = lookup()
    steps: dict[str, Callable[[], object]] = {"lookup features": lookup}
    for name in ("paper", "default"):
        selector = VARIANTS[name](width // 2, width - width // 2)

        def step(selector: Selector = selector) -> None:
            selection = selector.select(logprobs, features=features)
            selector.update(selection, torch.minimum(selection.lengths, runs))

        steps[f"{name}: select + update"] = step
    for name, run in steps.items():
        for _ in range(5):
            run()
        with _CountOps() as counter:
            run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        micros = (time.perf_counter() - start) / repeats * 1e6
        print(f"| {name} | {sum(counter.ops.values())} | {micros:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--pair", type=Path, action="append", default=[], help="a pair directory")
    parser.add_argument("--no-shipped", action="store_true", help="skip the shipped pair")
    parser.add_argument("--synthetic", action="store_true", help="add the synthetic drafts")
    parser.add_argument("--traces-dir", type=Path, default=None, help="cache traces here")
    parser.add_argument("--slots", type=at_least(1), default=32)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--k", type=at_least(1), nargs="+", default=[2, 3, 4])
    parser.add_argument("--extra", type=at_least(0), nargs="+", default=[1, 2, 3])
    parser.add_argument("--ops", action="store_true", help="also count per-step operations")
    args = parser.parse_args()
    if args.no_shipped and not (args.pair or args.synthetic or args.ops):
        parser.error("--no-shipped leaves nothing to run: add --pair, --synthetic or --ops")
    torch.set_num_threads(1)
    max_k = max(args.k) + max(args.extra)
    pairs = ([] if args.no_shipped else [TINY_PAIR_DIR]) + list(args.pair)
    for pair in pairs:
        cache = args.traces_dir
        path = None if cache is None else trace_cache_path(cache, pair, args.max_new_tokens, max_k)
        traces = load_pair_traces(pair, args.max_new_tokens, max_k, path)
        label = "shipped pair" if pair == TINY_PAIR_DIR else pair.name
        report(label, replay_grid(traces, args.k, args.extra, args.slots), first_token_ece(traces))
    if args.synthetic:
        for calibration in CALIBRATIONS:
            traces = synthetic_traces(calibration, length=args.max_new_tokens, width=max_k)
            cells = replay_grid(traces, args.k, args.extra, args.slots)
            report(f"synthetic, {calibration}", cells, first_token_ece(traces))
    if args.ops:
        op_counts()


if __name__ == "__main__":
    main()
