"""TETRIS (Wu et al., ACL 2025): verify the globally best draft tokens of the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int, checked_already
from specselect.constants import cached_constant
from specselect.cost import CostModel
from specselect.estimators import (
    DEFAULT_ESTIMATOR,
    NO_ESTIMATOR,
    AcceptanceEstimator,
    RankingGuard,
    make_estimator,
)
from specselect.selection import (
    NEG_INF,
    ObserveWatch,
    Outcomes,
    Selection,
    Selector,
    chain_scores,
    estimator_kwargs,
    tree_scores,
)
from specselect.selectors.fixed import FixedWindowSelector
from specselect.selectors.goodput import (
    GOODPUT,
    GoodputPlanner,
    StepCosts,
    check_cost_model,
    default_costs,
    drafted_mask,
)
from specselect.topc import cheapest_counts, cheapest_mask

UNOBSERVED_STEPS = 4  # goodput budget: steps without observe() before it warns


class TetrisSelector(Selector):
    """Draft ``k + extra`` tokens per request, verify the best ``C`` of the whole batch.

    The score of draft token ``j`` of request ``i`` is its cumulative draft log-probability
    ``sum_{t<=j} log q[i, t]``: the draft's own estimate of the chance that the target accepts the
    whole prefix. If the scores are calibrated, the expected number of accepted tokens is the sum
    of the selected scores' probabilities; scores never increase along a request, so the best
    ``C`` scores form a set of prefixes and the greedy choice is optimal (the paper's Theorem 1).
    With ``parents=`` the same holds for draft trees: path scores never increase from a node to
    its children, so the best ``C`` nodes are closed under ancestors.

    Args:
        k: mean window. The default budget is ``C = k * num_active``, the cost of standard SD.
        extra: additional tokens drafted per request beyond ``k``, so that easy requests can get
            longer windows than ``k``.
        budget: a fixed total ``C`` per step instead of ``k * num_active``; or ``"goodput"``:
            every step, the ``C`` with the best modelled goodput under ``cost_model``, and a
            draft depth in ``[0, k + extra]`` chosen for it too (0: a plain decoding step)
            (:mod:`specselect.selectors.goodput`; docs: "The goodput budget").
        estimator: an :class:`~specselect.estimators.AcceptanceEstimator` (or its registry name:
            ``"draft"``, ``"calibrated"``, ``"history"``, ``"choice"``) that turns draft
            log-probabilities into estimated acceptance log-probabilities before ranking. The
            default, :class:`~specselect.estimators.RankingChoice`, ranks by the draft
            probabilities (as the paper) until a learned estimate has predicted or ordered
            the tested tokens' acceptance better, then by the learned estimate (docs:
            "Acceptance estimators"); ``None`` ranks by the draft probabilities themselves,
            exactly as in the paper.
        guard: fall back to the fixed window ``k`` once the outcomes show that the scores do
            not rank (see :class:`~specselect.estimators.RankingGuard`), so that the worst case
            is standard SD (with the goodput budget: every token drafted, the planner's
            depth); ``True`` (default) for the default guard, ``False`` or ``None`` (as the
            selector's ``repr`` shows it) for none.
        cost_model: the step times the goodput budget plans with (a
            :class:`~specselect.cost.CostModel`, or anything with its ``draft_time`` and
            ``verify_time``); :func:`~specselect.selectors.goodput.default_costs` if omitted.
            The other budgets do not use it.

    ``TetrisSelector(k, extra, estimator=None, guard=False)`` is the paper's algorithm.

    Ties (equal scores, e.g. probability-1 tokens) go to shallower positions first, then to lower
    row indices, which keeps the selection prefix-closed with exactly ``min(C, available)`` tokens.
    """

    name = "tetris"
    supports_trees = True

    def __init__(
        self,
        k: int,
        extra: int = 2,
        budget: int | str | None = None,
        estimator: AcceptanceEstimator | str | None = DEFAULT_ESTIMATOR,
        guard: RankingGuard | bool | None = True,
        cost_model: StepCosts | None = None,
    ) -> None:
        super().__init__()
        self.k = check_int("k", k)
        self.extra = check_int("extra", extra)
        self.budget = _check_budget(budget)
        self.estimator = make_estimator(estimator)
        if not isinstance(guard, bool | RankingGuard | None):
            raise TypeError(
                f"guard must be True, False (or None) or a RankingGuard, got {type(guard).__name__}"
            )
        self.guard = RankingGuard() if guard is True else (guard or None)
        self.cost_model = None if cost_model is None else check_cost_model(cost_model)
        model = self.cost_model
        if self.budget == GOODPUT and isinstance(model, CostModel) and model.draft is None:
            raise ValueError(
                "cost_model has no draft part (a model of plain decoding): the goodput budget "
                "plans its draft depth, so its cost model must price drafting; measure one "
                "with a draft model"
            )
        self._fallback = FixedWindowSelector(self.k)
        if self.budget == GOODPUT and self.k + self.extra == 0:
            raise ValueError(
                "budget='goodput' chooses a draft depth in [0, k + extra]: k + extra must be "
                f">= 1, got k={self.k}, extra={self.extra} (for plain decoding use k=0 "
                "without it)"
            )
        # The goodput budget's planner (None for the other budgets).
        self._planner = (
            GoodputPlanner(self.k + self.extra, self.cost_model or default_costs())
            if self.budget == GOODPUT
            else None
        )
        self.reset()

    def reset(self) -> None:
        super().reset()
        if self.guard is not None:
            self.guard.reset()
        if self._planner is not None:
            self._planner.reset()
        # The goodput budget's depth comes from observe(): a loop written for update() alone
        # would keep the prior's depth forever.
        self._watch = ObserveWatch(type(self).__name__, UNOBSERVED_STEPS, "its draft depth")

    @property
    def planner(self) -> GoodputPlanner | None:
        """The goodput budget's planner, whose model of each depth (its ``acceptance``,
        ``verification`` and ``width``) says why a depth was chosen; ``None`` for the other
        budgets."""
        return self._planner

    def draft_length(self, num_active: int) -> int:
        """``k + extra``, or the budget when smaller; with the goodput budget, the depth in
        ``[0, k + extra]`` with the best modelled goodput for ``num_active`` rows, from the
        outcomes :meth:`observe` saw.

        A token at depth ``j`` is selected only with its ``j - 1`` predecessors (prefix and
        ancestor closure), so a depth beyond the budget ``C`` can never be verified: drafting
        it is a wasted draft pass. With one active row and ``C = k`` (batch size 1, or the
        last request of a batch) TETRIS selects exactly standard SD's window, and drafts only
        that.
        """
        check_int("num_active", num_active)
        if self._planner is not None:
            self._watch.planned()
            return self._planner.depth(num_active)
        return min(self.k + self.extra, self._step_budget(num_active))

    def _step_budget(self, num_active: int) -> int:
        """The absolute budget ``C`` of a step with ``num_active`` rows (not the goodput one)."""
        return self.budget if isinstance(self.budget, int) else self.k * num_active

    def _max_selected(self, width: int, num_active: int) -> int:
        """``width``, or the budget when smaller: ``C`` itself, or ``k · num_active`` (what
        the active rows share when ``width >= k``; inactive rows absorb the rest)."""
        if self._planner is not None or (self.budget is None and width < self.k):
            return width
        return min(width, self._step_budget(num_active))

    @property
    def capture_key(self) -> Hashable | None:
        """Its parameters for the paper's TETRIS (no estimator, no guard: no state); with a
        :attr:`~specselect.estimators.AcceptanceEstimator.capturable` estimator, the guard or
        the goodput budget, also this object's :attr:`capture_token` (their state is its own;
        the goodput budget's draft depth is the step's draft width, which a loop keys on, and
        its probe flag a device value). ``None`` with an estimator that is not capturable."""
        if self.estimator is not None and not self.estimator.capturable:
            return None
        key = (self.name, self.k, self.extra, self.budget)
        if self.estimator is None and self.guard is None and self._planner is None:
            return key
        return (*key, self.capture_token)

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        # Work with costs (|cumulative log q|, >= +0): abs also turns a -0.0 into +0.0, which is
        # what lets ``cheapest_counts`` skip its sign handling.
        costs = chain_scores(draft_logprobs).abs_()
        best = self._best(costs, active, passes=costs.shape[1])
        return self._guarded(
            best, costs, active, lambda: self._fallback._select(draft_logprobs, active)
        )

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        # A tree's draft passes are its depth: a device value, which the goodput tables index.
        passes = depth.amax() if depth.numel() else 0
        costs = tree_scores(draft_logprobs, parents).abs_()
        best = self._best(costs, active, passes)
        return self._guarded(
            best,
            costs,
            active,
            lambda: self._fallback._select_tree(draft_logprobs, active, parents, depth),
        )

    def _guarded(
        self,
        best: Selection,
        costs: Tensor,  # [B, K] >= +0, +inf where unavailable
        active: Tensor | None,  # [B] bool
        fallback: Callable[[], Selection],
    ) -> Selection:
        """``best``, or standard SD's selection while the guard distrusts the scores.

        Both are computed and one is picked on the device: no sync, static shapes. With a
        fixed ``budget`` the fallback keeps to it too: standard SD's windows, trimmed to the
        ``budget`` shallowest positions (then lowest rows) when they hold more. With the
        goodput budget the window is the planner's depth, chosen from the observed acceptance
        and not from the scores: everything drafted is verified (``k`` would cap a draft
        that is nearly always right, whose scores have nothing to rank).
        """
        if self.guard is None:
            return best
        standard = drafted_mask(costs, active) if self._planner is not None else fallback().mask
        if isinstance(self.budget, int):
            standard = _trim(standard, self.budget)
        return Selection.from_mask(
            torch.where(self.guard.trusted(best.mask.device), best.mask, standard)
        )

    def _best(self, costs: Tensor, active: Tensor | None, passes: Tensor | int) -> Selection:
        """The ``C`` cheapest entries of ``costs`` (``[B, K]``, >= +0), as a selection; the
        goodput budget chooses ``C`` for a step of ``passes`` draft passes."""
        if self._planner is not None:
            return Selection.from_mask(self._planner.select(costs, active, passes))
        rows, width = costs.shape
        budget = self.k * rows if self.budget is None else int(self.budget)
        if active is not None:
            pad = min(self.k, width) if self.budget is None else 0
            costs = _absorb_inactive(costs, active, pad)
        mask, counts = cheapest_counts(costs, budget, nonnegative=True, keep=active)
        return Selection(lengths=counts, mask=mask)

    def _move_state(self, device: torch.device) -> None:
        super()._move_state(device)
        if self.guard is not None:
            self.guard.to(device)

    def _update(
        self, selection: Selection, num_accepted: Tensor, accepted_nodes: Tensor | None
    ) -> None:
        if self.guard is not None and self.last_scores is not None:
            outcomes = self._outcomes_of_step(selection, num_accepted, accepted_nodes)
            with checked_already():  # the scores it ranked, and masks from checked counts
                self.guard.observe(self.last_scores, *outcomes)

    def _observe(self, outcomes: Outcomes) -> None:
        if self._planner is not None:
            self._planner.observe(
                outcomes.verified,
                outcomes.accepted,
                outcomes.deepest,
                active=outcomes.active,
                remaining=outcomes.remaining,
                waiting=outcomes.waiting,
            )
            self._watch.observed()

    @classmethod
    def goodput_grid_kwargs(cls, k: int, extra: int) -> dict[str, Any]:
        """The goodput budget, drafting at most ``k + extra`` deep."""
        return {"k": k, "extra": extra, "budget": GOODPUT}

    @classmethod
    def spec_kwargs(cls, estimator: str | None, cost_model: CostModel | None) -> dict[str, Any]:
        """The spec's estimator (``"tetris+none"`` is the paper's TETRIS: no estimator and no
        ranking guard) and the comparison's cost model, which the goodput budget plans with."""
        guard = {"guard": False} if estimator == NO_ESTIMATOR else {}
        cost = {} if cost_model is None else {"cost_model": cost_model}
        return {**estimator_kwargs(estimator), **guard, **cost}


def _check_budget(budget: object) -> int | str | None:
    """``None``, an int >= 0, or ``"goodput"``."""
    if budget is None or budget == GOODPUT:
        return budget  # type: ignore[return-value]
    if isinstance(budget, str):
        raise ValueError(f"budget must be an int >= 0, None or {GOODPUT!r}, got {budget!r}")
    return check_int("budget", budget)


def _trim(mask: Tensor, budget: int) -> Tensor:
    """The first ``budget`` entries of ``mask`` (``[B, N]`` bool) by (column, row).

    A node's column is larger than its parent's, so a trimmed chain stays a prefix and a
    trimmed tree stays closed under ancestors.
    """
    key = ("columns_f32", mask.shape[1], mask.device)
    columns = cached_constant(key, _float_columns)  # [1, N]
    costs = torch.where(mask, columns, float("inf"))
    return cheapest_mask(costs, budget, nonnegative=True)


def _float_columns(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, device=device, dtype=torch.float32).unsqueeze(0)


def _absorb_inactive(costs: Tensor, active: Tensor, pad: int) -> Tensor:
    """Give inactive rows ``pad`` free (``-inf`` cost) entries and nothing else (``+inf``).

    ``costs`` is ``[B, K]``, ``active`` ``[B]`` bool. The default budget ``k * num_active``
    depends on how many rows are active, a device value. Reading it back would be a host sync;
    instead every inactive row is given ``k`` entries that rank before everything else, so that
    the static budget ``k * B`` leaves exactly ``k * num_active`` for the active rows. The
    selection then drops the inactive rows (``keep=active``).
    """
    key = ("inactive_filler", costs.shape[1], pad, costs.dtype, costs.device)
    filler = cached_constant(key, _inactive_filler)  # [K]
    return torch.where(active.unsqueeze(1), costs, filler)


def _inactive_filler(width: int, pad: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[width]``: ``-inf`` (taken first) in the first ``pad`` columns, ``+inf`` (never) after."""
    pad_cols = torch.arange(width, device=device) < pad
    return torch.where(pad_cols, NEG_INF, float("inf")).to(dtype)
