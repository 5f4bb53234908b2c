"""Acceptance estimators on exact greedy replay: does TETRIS beat standard SD, and by how much?

For every k in the grid and extra in the grid, replays fixed-window SD, the paper's TETRIS,
TETRIS with each registered acceptance estimator (``specselect.estimators.ESTIMATORS``, with and
without the ranking guard) and the oracle over the same traces and batch slots, and prints
accepted draft tokens per request-step relative to fixed SD, plus the share of the
fixed-to-oracle gap each variant closes (n/a where the oracle does no better than fixed SD; the
mean is over the other configurations).

``--traces FILE`` records the pair's traces into FILE, or reads them back when it exists, after
checking they were recorded from this ``--pair``'s models on its prompts with this
``--max-new-tokens`` and a window of at least the grid's largest ``k + extra``
(:func:`specselect.replay.reuse_traces`).

    python benchmarks/bench_estimators.py                # shipped pair, 40 prompts, 64 tokens
    python benchmarks/bench_estimators.py --traces t.pt  # reuse (or save) recorded traces
    python benchmarks/bench_estimators.py --pair DIR     # another pair (see bench_replay_goals)
    python benchmarks/bench_estimators.py --live-sampling  # plus live runs at temperature 1

Live sampling runs ``speculative_generate`` on ``--pair`` (temperature 1, no top-k, the loop
feeds selectors causal scores) over the same prompts in static batches and reports VSR and
tokens per step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _args import at_least
from bench_replay_goals import gap_closed, load_pair_traces, mean_closed, percent

from specselect import FixedWindowSelector, TetrisSelector
from specselect.estimators import DEFAULT_ESTIMATOR, ESTIMATORS
from specselect.models import TINY_PAIR_DIR, load_pair, load_prompts
from specselect.replay import OracleSelector, replay


def variants() -> dict[str, dict[str, object]]:
    """TETRIS's keyword arguments per column: the paper's ranking, then every registered
    estimator without and with the ranking guard (so a new estimator gets its columns)."""
    table: dict[str, dict[str, object]] = {"paper": {"estimator": None, "guard": False}}
    for name in sorted(ESTIMATORS):
        for guard in (False, True):
            default = " (default)" if guard and name == DEFAULT_ESTIMATOR else ""
            label = name + ("+guard" if guard else "") + default
            table[label] = {"estimator": name, "guard": guard}
    return table


VARIANTS = variants()


def grid_parser(description: str) -> argparse.ArgumentParser:
    """The options of a replay benchmark over the shipped pair's traces and a k x extra grid."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--traces", type=Path, default=None, help="load or save traces here")
    parser.add_argument("--pair", type=Path, default=TINY_PAIR_DIR, help="the pair's directory")
    parser.add_argument("--slots", type=at_least(1), default=32)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--k", type=at_least(1), nargs="+", default=[2, 3, 4])
    parser.add_argument("--extra", type=at_least(0), nargs="+", default=[1, 2, 3])
    return parser


def main() -> None:
    parser = grid_parser(" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--live-sampling", action="store_true", help="also run live sampling")
    parser.add_argument("--batch", type=at_least(1), default=20, help="live batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    max_k = max(args.k) + max(args.extra)
    traces = load_pair_traces(args.pair, args.max_new_tokens, max_k, args.traces)

    def accepted(selector) -> float:
        return replay(traces, selector, args.slots).totals.accepted_per_request_step

    header = ["k", "extra", "fixed", "oracle", *VARIANTS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    closed: dict[str, list[float | None]] = {name: [] for name in VARIANTS}
    wins: dict[str, int] = {name: 0 for name in VARIANTS}
    for k in args.k:
        fixed = accepted(FixedWindowSelector(k))
        for extra in args.extra:
            oracle = accepted(OracleSelector(k, extra))
            cells = [str(k), str(extra), f"{fixed:.3f}", f"{oracle / fixed - 1:+.1%}"]
            for name, kwargs in VARIANTS.items():
                value = accepted(TetrisSelector(k, extra, **kwargs))
                cells.append(f"{value / fixed - 1:+.1%}")
                closed[name].append(gap_closed(value, fixed, oracle))
                wins[name] += value >= fixed
            print("| " + " | ".join(cells) + " |")
    configs = len(args.k) * len(args.extra)
    print()
    print("| variant | configs >= fixed | mean share of the fixed-to-oracle gap closed |")
    print("|---|---|---|")
    for name in VARIANTS:
        share = percent(mean_closed(closed[name]), "+.1%")
        print(f"| {name} | {wins[name]}/{configs} | {share} |")
    if args.live_sampling:
        live_sampling(args)


def live_sampling(args: argparse.Namespace) -> None:
    """VSR and tokens per step of live sampled generation (temperature 1) per selector, on the
    pair in ``--pair`` and its prompts."""
    from specselect import speculative_generate
    from specselect.metrics import Totals

    target, draft, tokenizer = load_pair(args.pair)
    texts = [prompt["text"] for prompt in load_prompts(args.pair)]
    print()
    print("| selector | k | extra | tokens/step | VSR | verified/request-step |")
    print("|---|---|---|---|---|---|")
    for k in args.k:
        for name, make in (
            ("fixed", lambda k=k: FixedWindowSelector(k)),
            ("paper", lambda k=k: TetrisSelector(k, 2, estimator=None, guard=False)),
            ("choice+guard (default)", lambda k=k: TetrisSelector(k, 2)),
        ):
            steps = []
            for start in range(0, len(texts), args.batch):
                batch = tokenizer(
                    texts[start : start + args.batch], return_tensors="pt", padding=True
                )
                out = speculative_generate(
                    target,
                    draft,
                    batch.input_ids,
                    batch.attention_mask,
                    selector=make(),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,  # the whole vocabulary (generate's default would be top_k=50)
                    eos_token_id=[],
                    generator=torch.Generator().manual_seed(start),
                )
                steps += out.stats.steps
            totals = Totals.of(steps)
            extra = "-" if name == "fixed" else "2"
            print(
                f"| {name} | {k} | {extra} | {totals.tokens_per_step:.3f} | {totals.vsr:.3f} | "
                f"{totals.verified_per_request_step:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
