"""The replay engine: stream requests through batch slots and replay a selector exactly.

:func:`iter_replay` yields every step (:class:`ReplayStep`); :func:`replay` runs it to the end
and returns the totals, per-request statistics and, for selectors that expose their acceptance
scores, reliability-diagram bins (:class:`ReplayResult`). :func:`end_of_row_logprobs` is the
end-of-request convention shared with the decoding loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from specselect._checks import check_int, check_real, trusted_values
from specselect.cost import CostModel, default_cost_model
from specselect.estimators import observed_outcomes
from specselect.metrics import StepCounts, Totals
from specselect.replay.oracle import OracleSelector
from specselect.replay.traces import Traces
from specselect.selection import NEG_INF, Selection, Selector, draftable_depth, prefix_mask

__all__ = [
    "RELIABILITY_BINS",
    "ReplayResult",
    "ReplayStep",
    "end_of_row_logprobs",
    "iter_replay",
    "replay",
]


def end_of_row_logprobs(draft_logprobs: Tensor, remaining: Tensor) -> Tensor:
    """Apply the end-of-request convention: no draft token at positions ``j >= remaining - 1``.

    Args:
        draft_logprobs: ``[B, K]`` log-probs.
        remaining: ``[B]`` int64 tokens each request may still emit.

    Returns:
        ``[B, K]`` with ``-inf`` where a verified token could not be emitted (every step emits
        accepted + 1 tokens, so at most ``remaining - 1`` draft tokens can be accepted).
    """
    allowed = prefix_mask((remaining - 1).clamp(min=0), draft_logprobs.shape[1])
    return draft_logprobs.masked_fill(~allowed, NEG_INF)


@dataclass(frozen=True)
class ReplayStep:
    """Everything one replayed step saw and decided (for inspection and tests).

    Attributes:
        index: step number (0-based).
        requests: ``[S]`` int64 request in each slot (``-1`` = empty slot).
        positions: ``[S]`` int64 tokens each slot's request had emitted before the step.
        window: ``K``, the draft length the selector asked for.
        draft_logprobs: ``[S, K]`` what the selector was shown (``-inf`` past the end and in
            empty slots).
        active: ``[S]`` bool.
        runs: ``[S]`` int64 true run lengths, capped at ``remaining - 1`` (0 in empty slots).
        selection: the selector's choice.
        accepted: ``[S]`` int64 ``min(lengths, runs)``.
        counts: the step's :class:`~specselect.metrics.StepCounts` (seconds = modelled).
        context: mean context length used by the cost model.
    """

    index: int
    requests: Tensor  # [S] int64
    positions: Tensor  # [S] int64
    window: int
    draft_logprobs: Tensor  # [S, K]
    active: Tensor  # [S] bool
    runs: Tensor  # [S] int64
    selection: Selection
    accepted: Tensor  # [S] int64
    counts: StepCounts
    context: float


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` measured.

    Attributes:
        steps: per-step counts (``seconds`` = modelled by the cost model).
        windows: draft length ``K`` of each step.
        accepted_per_step: per step, ``[S]`` int64 accepted draft tokens per slot (0 if empty).
        request_verified / request_accepted / request_emitted / request_steps: ``[N]`` int64
            per-request totals; ``request_seconds``: ``[N]`` float64 modelled latency (from
            the request's first step to its last, queueing excluded).
        selector: ``repr`` of the selector.
        reliability: ``[3, RELIABILITY_BINS]`` float64 per bin of predicted acceptance (the
            ``exp`` of the selector's ``last_scores``, in ``RELIABILITY_BINS`` equal-width bins
            over ``[0, 1]``) of the tokens the target tested: the sum of the predictions, the
            accepted tokens and the tested tokens; ``None`` when the selector exposed no scores
            or the target tested no token. :meth:`calibration` reads it per bin.

    :attr:`totals` gives the run's metrics (:class:`~specselect.metrics.Totals` of ``steps``).
    """

    steps: list[StepCounts]
    windows: list[int]
    accepted_per_step: list[Tensor]
    request_verified: Tensor  # [N] int64
    request_accepted: Tensor  # [N] int64
    request_emitted: Tensor  # [N] int64
    request_steps: Tensor  # [N] int64
    request_seconds: Tensor  # [N] float64
    selector: str = ""
    reliability: Tensor | None = None  # [3, RELIABILITY_BINS]: predicted sum, passed, tested

    def calibration(self) -> list[dict[str, float]]:
        """Reliability diagram data: per bin of predicted acceptance, the mean prediction, the
        observed acceptance rate and the number of tokens the target tested (bins with none
        are left out)."""
        if self.reliability is None:
            return []
        predicted, passed, tested = self.reliability.tolist()
        return [
            {"predicted": p / n, "observed": a / n, "tokens": n}
            for p, a, n in zip(predicted, passed, tested, strict=True)
            if n > 0
        ]

    @cached_property
    def totals(self) -> Totals:
        """Totals over the run (metrics as defined in :mod:`specselect.metrics`)."""
        return Totals.of(self.steps)


def _check_traces(traces: object) -> Traces:
    if not isinstance(traces, Traces):
        raise TypeError(f"traces must be a specselect.replay.Traces, got {type(traces).__name__}")
    return traces


def _check_cost_model(cost_model: object) -> CostModel:
    """Anything that prices a step (``step_time``), as a :class:`~specselect.cost.CostModel`
    does: replay needs no more of it."""
    if not callable(getattr(cost_model, "step_time", None)):
        raise TypeError(
            "cost_model must have a step_time(active, K, verified, context) method (a "
            f"specselect.cost.CostModel) or be None, got {type(cost_model).__name__}"
        )
    return cost_model  # type: ignore[return-value]


def _step_seconds(
    cost_model: CostModel, active: int, window: int, verified: int, context: float
) -> float:
    """The cost model's time for a step, checked: a negative or NaN time would sum into
    totals (and goodput) that read as measured."""
    seconds = cost_model.step_time(active, window, verified, context)
    return check_real(f"cost_model.step_time({active}, {window}, {verified}, ...)", seconds, low=0)


def _draft_window(selector: Selector, num_active: int, max_k: int, most_remaining: int) -> int:
    """The step's draft length, checked against the traces, and cut as the live loop cuts it
    (:func:`~specselect.selection.draftable_depth`)."""
    window = check_int("selector.draft_length()", selector.draft_length(num_active))
    if window > max_k:
        raise ValueError(
            f"{selector!r} asks for a draft window of {window} tokens but the traces hold only "
            f"max_k={max_k}; record them with max_k >= {window}"
        )
    return draftable_depth(window, most_remaining)


def iter_replay(
    traces: Traces,
    selector: Selector,
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    refill: bool = True,
) -> Iterator[ReplayStep]:
    """Replay ``selector`` over ``traces`` step by step (see :func:`replay`); yields each step."""
    traces = _check_traces(traces)
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a specselect Selector, got {type(selector).__name__}")
    slots = check_int("slots", slots, minimum=1)
    if not isinstance(refill, bool):  # a truthy string would refill
        raise TypeError(f"refill must be True or False, got {refill!r}")
    cost_model = default_cost_model() if cost_model is None else _check_cost_model(cost_model)
    n, length = traces.num_requests, traces.max_new_tokens
    selector.reset()

    requests = torch.full((slots,), -1, dtype=torch.int64)  # [S]
    positions = torch.zeros(slots, dtype=torch.int64)  # [S]
    queued = 0
    index = 0
    while True:
        free = requests < 0
        if queued < n and (refill or bool(free.all())):
            if not refill and queued:  # a new static batch: a new speculative_generate call,
                selector.reset()  # which starts its selector afresh
            new = _refill(requests, positions, free, queued, n)
            queued += int(new.sum())
        if not bool((requests >= 0).any()):
            return
        # The selector's inputs come from checked traces: its value checks would only re-read
        # them. Only around the step: a generator must not leave the caller's checks off.
        with trusted_values():
            waiting = refill and queued < n  # static batches drain: nobody joins them
            step = _replay_step(
                traces, selector, requests, positions, cost_model, context, index, waiting
            )
        yield step
        positions += torch.where(step.active, step.accepted + 1, 0)
        finished = step.active & (positions >= length)
        requests[finished] = -1
        positions[finished] = 0
        index += 1


def _replay_step(
    traces: Traces,
    selector: Selector,
    requests: Tensor,  # [S] int64, -1 for an empty slot
    positions: Tensor,  # [S] int64
    cost_model: CostModel,
    context: float | None,
    index: int,
    waiting: bool,
) -> ReplayStep:
    """One step over the occupied slots: the window, what the selector is shown, its
    selection and feedback (as the live loop gives it: with the tokens each row may still
    emit, and whether requests wait for a slot), and the step's modelled counts."""
    active = requests >= 0  # [S]
    num_active = int(active.sum())
    most_remaining = traces.max_new_tokens - int(positions[active].min())
    window = _draft_window(selector, num_active, traces.max_k, most_remaining)
    shown, runs = _offer(traces, requests, positions, window)
    if isinstance(selector, OracleSelector):
        selector.set_runs(runs)
    features = None
    if selector.uses_features:  # [S, K, F]; garbage in empty slots, whose tokens are -inf
        features = traces.lookup_features[requests.clamp(min=0), positions, :window]
    # Request ids follow requests: a refilled slot gets a new id and its state is reset.
    selection = selector.select(shown, active, request_ids=requests, features=features)
    accepted = torch.minimum(selection.lengths, runs)  # [S]
    selector.update(selection, accepted)
    # What a live loop reads back after the step, as it passes it on.
    remaining = (traces.max_new_tokens - positions - accepted - 1).clamp(min=0)  # [S]
    selector.observe(
        selection.lengths[active].tolist(),
        accepted[active].tolist(),
        active=active.tolist(),
        remaining=remaining[active].tolist(),
        waiting=waiting,
    )
    if context is None:
        context = _mean_context(traces.prompt_lengths, requests, positions)
    verified, accepted_total = int(selection.lengths.sum()), int(accepted.sum())
    counts = StepCounts(
        active=num_active,
        verified=verified,
        accepted=accepted_total,
        emitted=accepted_total + num_active,
        seconds=_step_seconds(cost_model, num_active, window, verified, context),
    )
    return ReplayStep(
        index,
        requests.clone(),
        positions.clone(),
        window,
        shown,
        active,
        runs,
        selection,
        accepted,
        counts,
        float(context),
    )


def _offer(
    traces: Traces, requests: Tensor, positions: Tensor, window: int
) -> tuple[Tensor, Tensor]:
    """What the selector is shown this step, and the true runs (hidden from real selectors).

    Args:
        traces: the recording.
        requests: ``[S]`` int64 request per slot (``-1`` = empty).
        positions: ``[S]`` int64 tokens emitted so far by each slot's request.
        window: ``K``.

    Returns:
        ``([S, K] log-probs, [S] int64 runs)``: ``-inf`` past each request's end and in empty
        slots; runs capped at ``remaining - 1`` (what can still be accepted), 0 in empty slots.
    """
    length = traces.max_new_tokens
    active = requests >= 0
    req, pos = requests.clamp(min=0), positions.clamp(max=length - 1)
    remaining = torch.where(active, length - positions, 0)
    shown = end_of_row_logprobs(traces.draft_logprobs[req, pos, :window], remaining)
    shown = shown.masked_fill(~active.unsqueeze(1), NEG_INF)
    runs = torch.where(active, traces.runs[req, pos].clamp(max=length - 1 - pos), 0)
    return shown, runs


def _mean_context(prompt_lengths: Tensor, requests: Tensor, positions: Tensor) -> float:
    """Mean context (prompt + emitted tokens) of the active slots, for the cost model."""
    active = requests >= 0
    contexts = prompt_lengths[requests.clamp(min=0)] + positions  # [S]
    return float(contexts[active].double().mean())


def _refill(requests: Tensor, positions: Tensor, free: Tensor, queued: int, n: int) -> Tensor:
    """Put the next queued requests into free slots (lowest slot first); returns ``[S]`` new."""
    free_slots = free.nonzero().squeeze(1)[: n - queued]
    requests[free_slots] = torch.arange(queued, queued + free_slots.numel())
    positions[free_slots] = 0
    new = torch.zeros_like(free)
    new[free_slots] = True
    return new


def replay(
    traces: Traces,
    selector: Selector,
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    refill: bool = True,
) -> ReplayResult:
    """Replay ``selector`` exactly over greedy ``traces`` through ``slots`` batch slots.

    Requests enter in trace order. Each step: empty slots take the next queued requests (with
    ``refill=False``, only when *all* slots are empty — static batches, as
    ``speculative_generate`` runs them, and the selector is reset before each new batch as
    each ``speculative_generate`` call resets it); ``K = selector.draft_length(num_active)``,
    cut as the live loop cuts it where no active request could emit a deeper token
    (:func:`~specselect.selection.draftable_depth`); the selector sees the ``[slots, K]``
    recorded log-probs (``-inf`` past each request's end and in empty slots, which are also
    inactive); each active request accepts ``min(L, run)`` and advances by that + 1;
    ``selector.update`` gets the accepted counts, and ``selector.observe`` the verified and
    accepted counts of the active slots as host ints, with the slots they are (``active``), as
    ``speculative_generate`` passes them after its read-back. A slot whose request finished is
    refilled at the next step. The selector receives each slot's request id
    (``request_ids``), so per-request state follows requests: a slot whose id changed is
    reset.

    Args:
        traces: recorded (or synthetic) traces.
        selector: any :class:`~specselect.selection.Selector`; ``selector.reset()`` is called
            first. An :class:`OracleSelector` is handed the true runs each step.
        slots: batch slots.
        cost_model: prices each step (``CostModel.step_time(active, K, verified, context)``;
            any object with that method will do);
            None: :func:`~specselect.cost.default_cost_model` (the shipped pair on a CPU).
        context: context length for the cost model; None uses the mean context (prompt +
            emitted tokens) of the active requests at each step.
        refill: refill slots as soon as they free up (a serving stream) or only in waves.

    Raises:
        ValueError: the selector asks for a window longer than the traces' ``max_k``, or the
            cost model prices a step at a negative or non-finite time.
        TypeError: ``refill`` is not a bool, or the cost model prices a step with something
            other than a number.
    """
    traces = _check_traces(traces)
    n = traces.num_requests
    steps: list[StepCounts] = []
    windows: list[int] = []
    accepted_per_step: list[Tensor] = []
    per_request = torch.zeros(4, n, dtype=torch.int64)  # verified, accepted, emitted, steps
    reliability = torch.zeros(3, RELIABILITY_BINS, dtype=torch.float64)
    first = torch.full((n,), -1, dtype=torch.int64)
    last = torch.full((n,), -1, dtype=torch.int64)
    for step in iter_replay(traces, selector, slots, cost_model, context, refill=refill):
        steps.append(step.counts)
        windows.append(step.window)
        accepted_per_step.append(step.accepted)
        req = step.requests[step.active]
        stats = torch.stack(
            [
                step.selection.lengths,
                step.accepted,
                step.accepted + 1,
                torch.ones_like(step.accepted),
            ]
        )[:, step.active]
        per_request.index_add_(1, req, stats)
        if selector.last_scores is not None:
            _add_reliability(reliability, selector.last_scores, step)
        first[req] = torch.where(first[req] < 0, step.index, first[req])
        last[req] = step.index
    cumulative = torch.tensor([0.0] + [s.seconds for s in steps], dtype=torch.float64).cumsum(0)
    request_seconds = cumulative[last + 1] - cumulative[first.clamp(min=0)]
    return ReplayResult(
        steps=steps,
        windows=windows,
        accepted_per_step=accepted_per_step,
        request_verified=per_request[0],
        request_accepted=per_request[1],
        request_emitted=per_request[2],
        request_steps=per_request[3],
        request_seconds=request_seconds,
        selector=repr(selector),
        reliability=reliability if reliability[2].sum() > 0 else None,
    )


RELIABILITY_BINS = 10


def _add_reliability(reliability: Tensor, scores: Tensor, step: ReplayStep) -> None:
    """Accumulate predicted vs observed acceptance of the tokens the target tested this step."""
    tested, passed = observed_outcomes(step.selection.lengths, step.accepted, scores.shape[1])
    predicted = scores.exp().nan_to_num(0.0).to(torch.float64)[tested]
    cells = (predicted * RELIABILITY_BINS).to(torch.int64).clamp(0, RELIABILITY_BINS - 1)
    reliability[0].index_add_(0, cells, predicted)
    reliability[1].index_add_(0, cells, passed[tested].to(torch.float64))
    reliability[2].index_add_(0, cells, torch.ones_like(predicted))
