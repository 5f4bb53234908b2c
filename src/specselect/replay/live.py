"""Live comparisons: run ``speculative_generate`` for real and measure wall-clock goodput.

Replay (:func:`~specselect.replay.compare_replay`) is exact for tokens per step and VSR but
*models* time. :func:`compare_live` runs every configuration through the HuggingFace loop
instead, under the conventions of the traces (greedy, no EOS stop, every request runs to
``max_new_tokens``), in static batches of ``slots`` prompts with a fresh selector per batch,
and times the calls; with ``refill=True``, in one call whose ``slots`` rows take the next
prompt as they finish (continuous batching, ``speculative_generate(..., slots=...)``). Under
greedy decoding its tokens per step and VSR equal a replay with the same ``refill`` exactly;
only the seconds are new.

The oracle cannot run live (it needs the true run lengths): its row is replayed on the same
schedule, so that it bounds the live rows beside it, and its goodput stays modelled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specselect import native
from specselect._checks import check_int
from specselect.cost import CostModel, default_cost_model
from specselect.metrics import StepCounts, Totals
from specselect.replay.engine import replay
from specselect.replay.grid import SelectorConfig
from specselect.replay.results import MEASURED, ResultRow
from specselect.replay.traces import Traces, left_pad

if TYPE_CHECKING:
    from specselect.hf import TreeSpec

__all__ = ["compare_live", "live_totals", "oracle_row"]

_NO_EOS: list[int] = []
"""Passed as ``eos_token_id``: no token stops a request, as in the traces."""

_WARM_UP = SelectorConfig("fixed", 1, None, None, {"k": 1})
"""The untimed first run of :func:`compare_live`: any cheap configuration."""
_WARM_UP_TOKENS = 4


def live_totals(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt_ids: Sequence[Tensor],
    config: SelectorConfig,
    slots: int,
    max_new_tokens: int,
    cost_model: CostModel | None = None,
    tree: TreeSpec | None = None,
    *,
    refill: bool = False,
    on_batch: Callable[[], object] | None = None,
) -> Totals:
    """Run ``speculative_generate`` over the prompts in static batches of ``slots``, or with
    ``refill`` in one call through ``slots`` slots (continuous batching).

    Greedy, no EOS stop (as the traces), one fresh selector per call (built with
    ``cost_model`` when it takes one). Goodput is measured: the totals' seconds are the
    wall-clock time of the ``speculative_generate`` calls, padding and batching excluded.

    Args:
        target: HF causal LM whose output is generated.
        draft: HF causal LM sharing its tokenizer (on any device).
        prompt_ids: one ``[P_i]`` int64 tensor of token ids per request, not padded.
        config: the selector configuration to run.
        slots: prompts per batch (rows at once, with ``refill``).
        max_new_tokens: tokens generated per request.
        cost_model: given to selectors that take one (None: their own default).
        tree: draft-tree shape; None runs chains.
        refill: one call, a finished row's slot taken by the next prompt, as
            :func:`~specselect.replay.replay` refills (its default).
        on_batch: called after each call (a progress bar's step).
    """
    from specselect.hf import speculative_generate

    check_int("slots", slots, minimum=1)  # (a negative one ran nothing and reported zeros)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; live_totals needs at least one prompt")
    steps: list[StepCounts] = []
    seconds = 0.0
    device = next(target.parameters()).device
    per_call = len(prompt_ids) if refill else slots
    for start in range(0, len(prompt_ids), per_call):
        ids, mask = left_pad(prompt_ids[start : start + per_call], device)  # [b, P] each
        selector = config.build(cost_model)
        began = time.perf_counter()
        output = speculative_generate(
            target,
            draft,
            ids,
            mask,
            selector=selector,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=_NO_EOS,
            pad_token_id=0,
            tree=tree,
            slots=slots,
        )
        seconds += time.perf_counter() - began
        steps.extend(output.stats.steps)
        if on_batch is not None:
            on_batch()
    return replace(Totals.of(steps), seconds=seconds)


def oracle_row(
    traces: Traces,
    config: SelectorConfig,
    slots: int,
    cost_model: CostModel | None = None,
    *,
    refill: bool = False,
) -> ResultRow:
    """The oracle replayed on the live rows' schedule: static batches, or with ``refill``
    refilling slots.

    Replayed on another schedule, it would batch the requests differently from the live rows
    beside it, so its bound would not be a bound for them.
    """
    cost_model = default_cost_model() if cost_model is None else cost_model
    result = replay(traces, config.build(cost_model), slots, cost_model, refill=refill)
    return ResultRow.replayed(config, result)


def compare_live(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    traces: Traces,
    configs: Sequence[SelectorConfig],
    slots: int,
    cost_model: CostModel | None = None,
    tree: TreeSpec | None = None,
    *,
    refill: bool = False,
    progress: bool = False,
) -> list[ResultRow]:
    """Live rows for every configuration on the traces' prompts; the oracle gets a replay row.

    With ``tree``, every tree-capable selector also runs with a draft tree of that shape, once
    per name, ``k`` and budget (the tree's shape, not ``extra``, sets what is drafted), next to
    its chain rows. The traces give the prompts and ``max_new_tokens``; they should come from
    ``target`` and ``draft`` (:func:`~specselect.replay.check_trace_models`).

    A short untimed warm-up run comes first: the first forward passes of a process pay for
    one-off initialisation, which would otherwise be charged to the first configuration; so
    does the first selection with the fused CPU kernel (:mod:`specselect.native`), which builds
    or loads it then.

    ``cost_model`` is given to selectors that take one (DSD) and prices the oracle's replayed
    row; None: :func:`~specselect.cost.default_cost_model`. ``refill`` runs the prompts through
    ``slots`` refilling slots instead of static batches (see :func:`live_totals`).
    ``progress`` shows a tqdm bar over the live runs' calls (every run's, chains and trees; the
    oracle's replay is not one).
    """
    from tqdm.auto import tqdm

    check_int("slots", slots, minimum=1)
    cost_model = default_cost_model() if cost_model is None else cost_model
    prompt_ids = list(traces.prompt_ids)
    max_new_tokens = traces.max_new_tokens
    live_totals(target, draft, prompt_ids[:slots], _WARM_UP, slots, _WARM_UP_TOKENS, cost_model)
    native.available()  # (its first use builds or loads TETRIS's kernel: not the first row's)
    runs = _live_runs(configs, tree)
    calls = 1 if refill else -(-len(prompt_ids) // slots)  # ceil
    total = calls * sum(not config.replay_only for config, _ in runs)
    rows = []
    with tqdm(total=total, desc="live", unit="batch", disable=not progress, leave=False) as bar:
        for config, shape in runs:
            if config.replay_only:
                rows.append(oracle_row(traces, config, slots, cost_model, refill=refill))
                continue
            totals = live_totals(
                target,
                draft,
                prompt_ids,
                config,
                slots,
                max_new_tokens,
                cost_model,
                shape,
                refill=refill,
                on_batch=bar.update,
            )
            rows.append(ResultRow(config, totals, MEASURED, tree=shape))
    return rows


def _live_runs(
    configs: Sequence[SelectorConfig], tree: TreeSpec | None
) -> list[tuple[SelectorConfig, TreeSpec | None]]:
    """``(config, tree shape or None for a chain)`` in row order: each configuration, then its
    tree run when it has one (tree-capable, first of its name, ``k`` and budget). Planned up
    front so that the progress bar knows its total."""
    runs: list[tuple[SelectorConfig, TreeSpec | None]] = []
    trees_done: set[tuple[str, int, int | str | None]] = set()
    for config in configs:
        runs.append((config, None))
        tree_key = (config.name, config.k, config.budget)
        if (
            tree is None
            or config.replay_only
            or tree_key in trees_done
            or not config.build().supports_trees
        ):
            continue
        trees_done.add(tree_key)
        runs.append((config, tree))
    return runs
