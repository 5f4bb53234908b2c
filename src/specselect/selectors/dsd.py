"""Dynamic speculative decoding (DSD): one window for the whole batch, chosen for goodput.

Liu et al. 2024 ("Optimizing speculative decoding for serving LLMs using goodput") pick the
window that maximises *goodput* — expected emitted tokens per second — from an estimate of the
acceptance rate and a model of how draft and verification time grow with the batch and the
window. With a per-token acceptance probability ``alpha``, a request that verifies ``k`` draft
tokens emits ``1 + alpha + ... + alpha^k`` tokens in expectation (the accepted prefix plus the
target's own token), so a batch of ``B`` requests emits ``B * (1 - alpha^(k+1)) / (1 - alpha)``
per step, at a cost of ``k`` draft passes and one target pass over ``B * (k + 1)`` tokens.

Host syncs: none. The window is a Python int, chosen on the host, so DSD plans on the host:
its acceptance estimate is an exponential moving average of host numbers, the verified and
accepted counts a loop already reads back every step and passes to
:meth:`~specselect.selection.Selector.observe`. ``select`` is device code that depends on
nothing but the window, so a loop may capture it per window.

Draft trees. The window is a depth: every active request verifies all its nodes at most that
deep, and the estimate learns from ``accepted / deepest verified depth`` (``observe``'s
``deepest``), which for a chain is ``accepted / verified``. The goodput model still prices a
chain of that depth.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from torch import Tensor

from specselect._checks import check_int, check_probability, check_real
from specselect.cost import CostModel, default_cost_model
from specselect.selection import (
    ObserveWatch,
    Outcomes,
    Selection,
    Selector,
    window_selection,
    window_tree_selection,
)

EMA_DECAY = 0.85  # weight of the previous estimate; the step's observation gets 1 - EMA_DECAY


def expected_emitted(alpha: float, k: int) -> float:
    """Expected tokens one request emits when it verifies ``k`` draft tokens.

    Each draft token is accepted independently with probability ``alpha`` until the first
    rejection, and the target always adds one token, so the expectation is the geometric sum
    ``1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)``. Summing the series directly
    gives the ``alpha -> 1`` limit ``k + 1`` without a division by ``1 - alpha``, and is exact
    enough for the small windows used in practice.
    """
    return math.fsum(alpha**i for i in range(k + 1))


def dsd_goodput(
    alpha: float, k: int, batch: int, cost_model: CostModel, context: float = 512.0
) -> float:
    """Modelled goodput (emitted tokens per second) of window ``k`` for ``batch`` requests.

    Time of one step: ``k`` draft passes (``cost_model.draft_time(batch, k, context)``) plus one
    target pass over ``batch * (k + 1)`` tokens — exactly :meth:`CostModel.step_time` with
    ``verified = batch * k``. A step that the model says is free has infinite goodput.
    """
    seconds = cost_model.step_time(batch, k, batch * k, context)
    emitted = batch * expected_emitted(alpha, k)
    return emitted / seconds if seconds > 0 else math.inf


def best_window(
    alpha: float, batch: int, max_k: int, cost_model: CostModel, context: float = 512.0
) -> int:
    """The window in ``0..max_k`` with the largest modelled goodput (the smallest on ties).

    Preferring the smallest window among equals spends no draft work that the model says does
    not pay. With no active request there is nothing to draft: the window is 0.
    """
    if batch == 0:
        return 0
    best_k, best = 0, -math.inf
    for k in range(max_k + 1):
        value = dsd_goodput(alpha, k, batch, cost_model, context)
        if value > best:
            best_k, best = k, value
    return best_k


def ema_step(alpha: float, verified: int, accepted: int) -> float:
    """One EMA update ``alpha <- 0.85 * alpha + 0.15 * accepted / verified``, with the step's
    draft tokens verified and accepted summed over the active requests (for draft trees,
    ``verified`` sums each request's deepest verified depth).

    A step that verified nothing observed nothing (the batch window was 0, or no row was
    active), so the estimate is kept rather than pulled towards an undefined ratio.
    """
    if verified <= 0:
        return alpha
    return EMA_DECAY * alpha + (1.0 - EMA_DECAY) * (accepted / verified)


class DSDSelector(Selector):
    """One window for the whole batch, re-chosen from feedback to maximise modelled goodput.

    Every step the selector verifies ``min(window, available)`` tokens of every active request,
    where ``window`` maximises :func:`dsd_goodput` for the current number of active requests and
    the acceptance estimate ``alpha``. ``alpha`` is an exponential moving average of each
    step's acceptance ``accepted / verified``, both summed over the active requests
    (:func:`ema_step`), starting at ``alpha0``.

    The estimate learns from :meth:`~specselect.selection.Selector.observe` (host numbers; see
    the module docstring), so a loop must call it after every step, as ``speculative_generate``
    and replay do; :meth:`update` teaches DSD nothing. The window is re-chosen from the
    estimate at the first call of :meth:`draft_length` and then every ``interval`` calls, which
    keeps it steady for a while; in between it only changes when the number of active
    requests does.

    If the chosen window is 0 nothing is verified, so no feedback would arrive and the choice
    would be final; instead every other interval that 0 looks best probes with a window of 1,
    so that the estimate can recover when acceptance improves.

    Args:
        max_k: largest window considered.
        cost_model: timing model; default :func:`~specselect.cost.default_cost_model` (the
            shipped pair measured on a CPU). Measure your own models with ``specselect
            profile`` or :meth:`CostModel.measure`.
        interval: steps between two re-choices of the window from the acceptance estimate.
        alpha0: initial acceptance estimate, in ``[0, 1]``.
        context: mean context length passed to the cost model.
    """

    name = "dsd"
    supports_trees = True

    def __init__(
        self,
        max_k: int = 8,
        cost_model: CostModel | None = None,
        interval: int = 20,
        alpha0: float = 0.7,
        context: float = 512.0,
    ) -> None:
        super().__init__()
        self.max_k = check_int("max_k", max_k)
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(
                f"cost_model must be a specselect.cost.CostModel or None, "
                f"got {type(cost_model).__name__}"
            )
        self.cost_model = default_cost_model() if cost_model is None else cost_model
        if self.cost_model.draft is None:
            raise ValueError(
                "cost_model has no draft part (a model of plain decoding): DSD drafts, so its "
                "cost model must price drafting; measure one with a draft model"
            )
        self.interval = check_int("interval", interval, minimum=1)
        self.alpha0 = check_probability("alpha0", alpha0)
        self.context = check_real("context", context, low=0.0)  # mean tokens in the cache
        self.reset()

    def reset(self) -> None:
        """Back to ``alpha0``; the next :meth:`draft_length` re-chooses the window."""
        super().reset()
        self._alpha = self.alpha0  # the EMA of the observed acceptance
        self._alpha_chosen = self.alpha0  # the value the window is currently chosen from
        self._calls = 0  # draft_length calls since reset
        # A loop written for update() alone would keep the window of alpha0 forever.
        self._watch = ObserveWatch(
            type(self).__name__, self.interval, "its acceptance estimate (and window)"
        )
        self._window: int | None = None  # the last window returned by draft_length
        self._probe = False  # this interval probes with window 1 instead of 0

    def draft_length(self, num_active: int) -> int:
        """The goodput-optimal window for ``num_active`` requests, from the acceptance estimate
        as it was at the first call and at every ``interval``-th call after it."""
        check_int("num_active", num_active)
        self._watch.planned()
        rechoose = self._calls % self.interval == 0
        if rechoose:
            self._alpha_chosen = self._alpha
        self._calls += 1
        window = best_window(
            self._alpha_chosen, num_active, self.max_k, self.cost_model, self.context
        )
        # (No row: nothing to probe; max_k = 0: plain decoding, never a draft token.)
        if window == 0 and self._probing(rechoose) and num_active and self.max_k:
            window = 1
        self._window = window
        return window

    def _probing(self, rechoose: bool) -> bool:
        """Whether this interval verifies one token per request although 0 looks best.

        A window of 0 verifies nothing, so the acceptance estimate would never change again and
        the choice would be final. Every other interval spent at 0 therefore probes with a
        window of 1, so that fresh acceptance evidence keeps arriving.
        """
        if rechoose:
            self._probe = not self._probe and self._window == 0
        return self._probe

    def acceptance_estimate(self) -> float:
        """The current EMA of the observed acceptance rate."""
        return self._alpha

    @property
    def capture_key(self) -> Hashable | None:
        """Stateless on the device: the window of the last :meth:`draft_length` is all a
        captured selection depends on (``None`` before any, when the window would depend on
        the batch)."""
        return None if self._window is None else (self.name, self._window)

    def _batch_window(self, rows: int) -> int:
        """The window of the last :meth:`draft_length`; before any (a ``select`` called
        directly), the choice for a batch of ``rows``, every row counted as active: reading
        ``active`` would be a sync."""
        if self._window is not None:
            return self._window
        return best_window(self._alpha_chosen, rows, self.max_k, self.cost_model, self.context)

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        return window_selection(draft_logprobs, active, self._batch_window(draft_logprobs.shape[0]))

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        window = self._batch_window(draft_logprobs.shape[0])
        return window_tree_selection(draft_logprobs, active, parents, depth, window)

    def _observe(self, outcomes: Outcomes) -> None:
        self._alpha = ema_step(self._alpha, sum(outcomes.deepest), sum(outcomes.accepted))
        self._watch.observed()

    @classmethod
    def spec_kwargs(cls, estimator: str | None, cost_model: CostModel | None) -> dict[str, Any]:
        """The comparison's cost model, which DSD plans its windows with."""
        kwargs = super().spec_kwargs(estimator, cost_model)
        return kwargs if cost_model is None else {**kwargs, "cost_model": cost_model}
