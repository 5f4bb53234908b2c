"""The selection contract: what a selector receives, what it returns, and its base class.

A *selector* decides, each step, which drafted tokens the target model verifies. It sees only
draft-side information (the draft's log-probabilities), so any selection keeps speculative
sampling lossless. Everything here is pure tensor code on the input's device with no host sync,
so that a decoding loop can call it between two forward passes, or capture it in a CUDA graph.
The top-``C`` kernel that budgeted selectors run lives in :mod:`specselect.topc`
(:func:`top_c_mask` is importable from here too).
"""

from __future__ import annotations

import abc
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from specselect._checks import (
    _values_checkable,
    check_active,
    check_at_most,
    check_counts,
    check_int,
    check_integer_tensor,
    check_logprobs,
    check_non_negative,
    check_row_ints,
    check_tensor,
    checked_already,
    distrusted,
    outside_autograd,
    values_trusted,
)
from specselect.constants import arange_constant, cached_constant
from specselect.cost import CostModel
from specselect.estimators import (
    NO_ESTIMATOR,
    AcceptanceEstimator,
    observed_outcomes,
    tree_outcomes,
)
from specselect.estimators.base import check_features
from specselect.topc import top_c_mask as top_c_mask  # public here too
from specselect.tree import available_nodes, check_parents, path_minima, path_sums

NEG_INF = float("-inf")


class CaptureToken(int):
    """A :attr:`Selector.capture_token`: an int, of its own type so that a check can tell it
    from any other int in a capture key."""

    def __repr__(self) -> str:
        return f"CaptureToken({int(self)})"


_CAPTURE_TOKENS = map(CaptureToken, itertools.count())  # see Selector.capture_token


@dataclass(frozen=True)
class _LastSelect:
    """What the last ``select`` saw, kept for ``update``."""

    logprobs: Tensor  # [B, K] the draft log-probs
    scores: Tensor  # [B, K] what was ranked (estimates, or the log-probs)
    parents: Tensor | None  # [B, N] for a tree selection
    positions: Tensor | None  # [B, N] depth - 1 of each node, for a tree selection
    features: Tensor | None  # [B, K, F] per-token features the estimator read
    returned: weakref.ref[Selection] | None = None  # what that select returned
    earlier: weakref.ref[Selection] | None = None  # what the select before it returned

    def __getstate__(self) -> dict[str, Any]:
        """Without the weak references, which cannot be pickled (a pickled selector keeps what
        it learned; only the check for a stale answer starts afresh)."""
        return {**self.__dict__, "returned": None, "earlier": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def answered_before(self, selection: Selection) -> bool:
        """Whether ``selection`` is the answer of the select before this one (and not also of
        this one: a selector may fill and return one object every step)."""
        earlier = None if self.earlier is None else self.earlier()
        returned = None if self.returned is None else self.returned()
        return earlier is selection and returned is not selection


@dataclass(frozen=True)
class Outcomes:
    """One step's host feedback as :meth:`Selector._observe` gets it (checked): per active row,
    in row order, the draft tokens (tree nodes) verified, the draft tokens accepted and the
    deepest verified depth (a chain's verified count); which batch rows those are; and, when
    the loop says, the tokens each of those rows may still emit and whether requests wait
    for a slot."""

    verified: list[int]
    accepted: list[int]
    deepest: list[int]
    active: list[bool] | None  # per batch row, whether it has an entry (None: not given)
    remaining: list[int] | None = None  # per entry, tokens still to emit (None: not given)
    waiting: bool | None = None  # whether requests wait for a slot (None: not given)


@dataclass(frozen=True)
class Selection:
    """Which drafted tokens to verify.

    Attributes:
        lengths: ``[B]`` int64 — tokens selected per request (on the input's device).
        mask: ``[B, K]`` bool — the selected positions. For chains it is a prefix mask
            (``mask[i, j] == (j < lengths[i])``); for draft trees it is a node mask closed under
            ancestors, and ``lengths`` counts the selected nodes.
    """

    lengths: Tensor  # [B] int64
    mask: Tensor  # [B, K] bool

    @classmethod
    def from_lengths(cls, lengths: Tensor, width: int) -> Selection:
        """Build the prefix selection of ``lengths`` (``[B]`` integers in ``[0, width]``) over
        ``width`` draft positions.

        Raises:
            TypeError: ``lengths`` is not a 1-D integer tensor (a float would be truncated).
            ValueError: a length is negative or above ``width`` (checked where the values are
                readable without a sync): the mask could not hold it.
        """
        width = check_int("width", width)
        lengths = check_integer_tensor("lengths", lengths, rank=1).to(torch.int64)
        check_non_negative("lengths", lengths)
        if _values_checkable(lengths) and lengths.numel() and int(lengths.max()) > width:
            raise ValueError(f"lengths must be <= width = {width}, got {lengths.tolist()}")
        return cls(lengths=lengths, mask=prefix_mask(lengths, width))

    @classmethod
    def from_mask(cls, mask: Tensor, active: Tensor | None = None) -> Selection:
        """Select the nodes of ``mask`` (``[B, N]`` bool, closed under ancestors), none in the
        rows outside ``active`` (``[B]`` bool); ``lengths`` counts each row's nodes."""
        if active is not None:
            mask = mask & active.unsqueeze(1)
        return cls(lengths=mask.sum(dim=1), mask=mask)

    @property
    def num_verified(self) -> Tensor:
        """0-dim int64 tensor: draft tokens (or tree nodes) the target verifies this step."""
        return self.lengths.sum()


def prefix_mask(lengths: Tensor, width: int) -> Tensor:
    """``[B, width]`` bool mask with the first ``lengths[i]`` entries of row ``i`` set."""
    columns = arange_constant(width, lengths.device)  # [width]
    return columns < lengths.unsqueeze(1)


def chain_scores(draft_logprobs: Tensor) -> Tensor:
    """Cumulative log draft probability of each chain prefix.

    Args:
        draft_logprobs: ``[B, K]`` log q of each drafted token (``-inf`` = never select).

    Returns:
        ``[B, K]`` float scores, non-increasing along each row because every log q <= 0; at
        least float32 so that long chains of half-precision inputs do not lose their order.
    """
    dtype = torch.promote_types(draft_logprobs.dtype, torch.float32)
    return draft_logprobs.cumsum(dim=1, dtype=dtype)


def tree_scores(draft_logprobs: Tensor, parents: Tensor) -> Tensor:
    """Cumulative log draft probability of each draft-tree node's root path.

    Args:
        draft_logprobs: ``[B, N]`` log q of each node (``-inf`` = never select it or below it).
        parents: ``[B, N]`` int64 checked parents (see :mod:`specselect.tree`).

    Returns:
        ``[B, N]`` float scores (float32 or wider), never above the parent's. Pointer jumping
        (:func:`~specselect.tree.path_sums`) adds a node's path in another order than its
        parent's, so float rounding can put a child whose log q is 0 or tiny (a certain draft
        token) an ulp *above* its parent; the budgeted selections, which rely on the order for
        closure under ancestors, would then take the child without its parent. The running
        minimum down each path restores the order; ``min`` is exact, so it changes nothing else.
    """
    return path_minima(path_sums(draft_logprobs, parents), parents)


def leading_run(mask: Tensor) -> Tensor:  # [..., K] bool -> [...] int64
    """The length of each row's leading run of ``True``: ``cumprod`` keeps ones up to the first
    ``False`` and zeros after it, so the sum counts the run with no data-dependent control
    flow (no sync, capturable)."""
    return mask.cumprod(dim=-1).sum(dim=-1)  # a bool cumprod gives int64


def available_lengths(draft_logprobs: Tensor) -> Tensor:
    """``[B]`` int64: drafted tokens before the first ``-inf`` (the selectable prefix)."""
    return leading_run(draft_logprobs > NEG_INF)


def draftable_depth(window: int, most_remaining: int) -> int:
    """The draft depth a step drafts: the selector's ``window``, cut where no active row could
    emit the token (``most_remaining``: the most new tokens any active row may still emit; the
    last one is always the target's own). The live loop and replay both draft (and price)
    this depth, so that a replay prices a row's last steps as the loop runs them."""
    return max(0, min(window, most_remaining - 1))


class Selector(abc.ABC):
    """Base class of every selector.

    A decoding loop calls, once per step:

    1. :meth:`draft_length` — how many tokens to draft per request;
    2. :meth:`select` — which of the drafted tokens (or draft-tree nodes) the target verifies;
    3. :meth:`update` — feedback after verification (accepted counts, device tensors), for
       adaptive selectors;
    4. :meth:`observe` — the same feedback as host ints, once the loop has read the step back,
       for selectors that plan on the host (the next :meth:`draft_length`) without a sync.

    Subclasses call ``super().__init__()``, implement :meth:`_select` (chains) and, if
    ``supports_trees``, :meth:`_select_tree`; the base class checks the arguments, applies the
    optional acceptance ``estimator`` to the draft log-probabilities, feeds it the outcomes, and
    resets per-request state when a batch slot starts serving a new request.

    Comparison grids (:func:`specselect.replay.selector_grid`) build selectors through the
    class-level hooks :meth:`grid_kwargs`, :meth:`goodput_grid_kwargs`, ``grid_extra`` and
    :meth:`spec_kwargs`.
    """

    name: ClassVar[str] = "selector"
    supports_trees: ClassVar[bool] = False
    grid_extra: ClassVar[bool | None] = None
    """Whether :meth:`grid_kwargs` depends on ``extra``: a grid then holds one configuration per
    ``extra`` and labels it with it; otherwise one configuration stands for every ``extra``.
    ``None``: whether :meth:`grid_kwargs` differs between two extras (see
    :func:`grid_depends_on_extra`); ``False`` also keeps the default :meth:`grid_kwargs` from
    setting ``extra`` and ``max_k``."""
    replay_only: ClassVar[bool] = False
    """Whether it selects with what only replay knows (the oracle's true run lengths): a
    decoding loop refuses it up front."""
    estimator: AcceptanceEstimator | None = None  # set by selectors that take one
    _initialized = False  # set by __init__: a subclass that skips it gets a clear error

    def __init__(self) -> None:
        self._initialized = True
        self._last: _LastSelect | None = None  # what the last select saw, for update
        self._answered = False  # whether update already had the last select's feedback
        self._request_ids: Tensor | None = None  # [B] request in each slot at the last select
        #: Unique to this object for the life of the process (unlike ``id()``, never reused by a
        #: later object): the part of a stateful selector's :attr:`capture_key` that keeps a
        #: graph recorded on this selector's state from replaying for another one.
        self.capture_token = next(_CAPTURE_TOKENS)
        self._device: torch.device | None = None  # the inputs' device at the last select
        # ([B, K] tested, [B, K] passed) of the step update() is learning from, once computed
        self._step_outcomes: tuple[Tensor, Tensor] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.copy``, ``copy.deepcopy``, unpickling) is another selector, with a
        :attr:`capture_token` of its own: a graph a loop recorded on the original's state must
        not replay for it (it would read and update the original's tensors)."""
        self.__dict__.update(state)
        if "capture_token" in state:
            self.capture_token = next(_CAPTURE_TOKENS)

    @abc.abstractmethod
    def draft_length(self, num_active: int) -> int:
        """Tokens to draft per active request this step, given ``num_active`` active requests."""

    def max_selected(self, width: int, num_active: int) -> int:
        """At most how many of a row's ``width`` drafted tokens (draft-tree nodes) the next
        :meth:`select` selects, with ``num_active`` active rows: a bound known on the host.

        A loop sizes its verification pass with it (static shapes, no sync): a draft tree's
        unselected nodes need not be sent to the target. Default: ``width``; selectors with a
        smaller bound override :meth:`_max_selected`.

        Raises:
            TypeError, ValueError: ``width`` or ``num_active`` is not an int >= 0.
        """
        return self._max_selected(check_int("width", width), check_int("num_active", num_active))

    def _max_selected(self, width: int, num_active: int) -> int:
        """:meth:`max_selected` on checked arguments."""
        return width

    @outside_autograd
    def select(
        self,
        draft_logprobs: Tensor,
        active: Tensor | None = None,
        *,
        parents: Tensor | None = None,
        request_ids: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Selection:
        """Choose the draft tokens to verify.

        Args:
            draft_logprobs: ``[B, K]`` log-probability the draft gave each drafted token
                (``-inf`` = never select this token or anything after it). With ``parents``,
                ``[B, N]`` per tree node.
            active: optional ``[B]`` bool; inactive rows get length 0 and take no budget.
            parents: optional ``[B, N]`` int: select draft-tree nodes instead of chain
                positions (see :mod:`specselect.tree`); the result is closed under ancestors.
            request_ids: optional ``[B]`` int64 id of the request in each batch slot. When a
                slot's id changes, per-request state of that slot is reset (:meth:`reset_rows`);
                when their number changes (another batch), every slot's
                (:meth:`reset_requests`), keeping what was learned across requests.
            features: optional ``[B, K, F]`` float per-token features for the acceptance
                estimator (with ``parents``, ``[B, N, F]`` per node): what
                :func:`specselect.lookup.lookup_features` computes from the context. Read
                only when :attr:`uses_features`; a loop computes them only then.

        Returns:
            A :class:`Selection` on the input's device. With nothing drafted (``K = 0``, a
            plain decoding step) it is empty, and neither the estimator nor the selector's own
            ranking runs: there is nothing to rank, and the step's :meth:`update` has nothing
            to learn.
        """
        self._check_initialized()
        # Contiguous (a no-op for most callers): every estimator and ranking may flatten it.
        draft_logprobs = check_logprobs("draft_logprobs", draft_logprobs).contiguous()
        self._follow_device(draft_logprobs.device)
        rows, width = draft_logprobs.shape
        active = check_active(active, rows, draft_logprobs.device)
        if request_ids is not None:
            self._follow_requests(
                check_row_ints("request_ids", request_ids, rows, draft_logprobs.device)
            )
        positions = None
        if parents is not None:
            if not self.supports_trees:
                raise TypeError(
                    f"{type(self).__name__} does not select draft-tree nodes (parents=...): "
                    "its supports_trees is False (every selector specselect ships supports trees)"
                )
            parents = check_parents(
                parents, rows=rows, width=width, device=draft_logprobs.device
            ).contiguous()
            positions = path_sums(torch.ones_like(draft_logprobs), parents).to(torch.int64) - 1
        if features is not None:
            features = check_features(features, draft_logprobs).contiguous()
        if not self.uses_features:
            features = None
        if width == 0:  # nothing drafted (a plain step): nothing to rank or estimate
            scores = draft_logprobs
            selection = Selection(scores.new_zeros(rows, dtype=torch.int64), scores > 0)
        else:
            scores, selection = self._rank(draft_logprobs, active, parents, positions, features)
        # Weak references: they only recognise a stale answer, and must keep nothing alive.
        earlier = None if self._last is None else self._last.returned
        returned = weakref.ref(selection)
        self._last = _LastSelect(
            draft_logprobs, scores, parents, positions, features, returned, earlier
        )
        self._answered = False
        return selection

    def _check_initialized(self) -> None:
        if not self._initialized:
            raise TypeError(
                f"{type(self).__name__}.__init__ must call super().__init__(): the Selector "
                "state that select, update and observe keep is missing"
            )

    def _rank(
        self,
        draft_logprobs: Tensor,  # [B, K] (or [B, N] nodes)
        active: Tensor | None,  # [B] bool
        parents: Tensor | None,  # [B, N]
        positions: Tensor | None,  # [B, N] depth - 1
        features: Tensor | None,  # [B, K, F]
    ) -> tuple[Tensor, Selection]:
        """The scores ranked (the estimator's, or the log-probs) and the selection of checked
        arguments."""
        scores = draft_logprobs
        if self.estimator is not None:
            # Features go only to an estimator that declared it reads them (one written before
            # they existed takes two arguments).
            given = () if features is None else (features,)
            with checked_already():  # checked above: its own checks would read them again
                scores = self.estimator.estimate(draft_logprobs, positions, *given)
            # An estimator or selector of one's own that breaks its contract is named here, not
            # later where its answer is used (the guard's histograms, a clamped verify pass).
            _check_estimate(self.estimator, scores, draft_logprobs)
        if parents is None or positions is None:
            selection = self._select(scores, active)
        else:
            selection = self._select_tree(scores, active, parents, positions + 1)
        _check_answer(self, selection, draft_logprobs, active, parents)
        return scores, selection

    @abc.abstractmethod
    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        """Selection on checked arguments (``[B, K]`` log-probs, optional ``[B]`` bool)."""

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        """Tree selection from ``[B, N]`` node log-probs, parents and depths (1 for the root's
        children); only if ``supports_trees``. The mask must be closed under ancestors."""
        raise NotImplementedError

    @outside_autograd
    def update(
        self,
        selection: Selection,
        num_accepted: Tensor,
        *,
        accepted_nodes: Tensor | None = None,
    ) -> None:
        """Feedback after verification: ``num_accepted`` ``[B]`` accepted draft tokens per row.

        After a tree selection, also pass ``accepted_nodes`` (``[B, N]`` bool, the accepted
        root-to-node path) so that estimators know which nodes passed. The acceptance
        estimator, if any, learns from the outcomes; adaptive selectors override
        :meth:`_update`. After an empty selection of nothing drafted (``K = 0``) neither runs:
        a step that tested nothing is no evidence, and counting it would only decay what
        earlier steps taught.

        Raises:
            ValueError: ``num_accepted`` is not a ``[B]`` count tensor, exceeds
                ``selection.lengths`` (checked where values are readable without a sync: CPU
                tensors), or ``selection`` does not match the last :meth:`select` (a new batch
                needs :meth:`reset`), or there was no :meth:`select` since the last reset, or
                this select was already given its feedback.
        """
        self._check_initialized()
        lengths = selection.lengths
        check_counts("num_accepted", num_accepted, lengths.shape[0], lengths.device)
        check_at_most("num_accepted", num_accepted, "selection.lengths", lengths)
        last = self._matching_last(selection)
        _check_counted(selection)
        if self._answered:
            raise ValueError(
                f"{type(self).__name__}.update was already called for the last select(): "
                "feedback is once per step (a second call would learn the step twice)"
            )
        if accepted_nodes is not None:
            _check_accepted_nodes(accepted_nodes, selection, num_accepted, last)
        self._step_outcomes = None
        if selection.mask.shape[1] == 0:  # a plain step tested nothing: no evidence to learn
            self._answered = True
            return
        if self.estimator is not None:
            self._step_outcomes = self.outcomes(selection, num_accepted, accepted_nodes)
            given = () if last.features is None else (last.features,)
            with checked_already():  # select's checked inputs, and masks made from them
                self.estimator.learn(last.logprobs, *self._step_outcomes, last.positions, *given)
        self._update(selection, num_accepted, accepted_nodes)
        self._answered = True

    def _outcomes_of_step(
        self, selection: Selection, num_accepted: Tensor, accepted_nodes: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`outcomes` for :meth:`_update`: the masks the estimator learned from this
        step, if it did, rather than a second computation of them."""
        known = self._step_outcomes
        return self.outcomes(selection, num_accepted, accepted_nodes) if known is None else known

    def _matching_last(self, selection: Selection) -> _LastSelect:
        """The last select's record, or a clear error if ``selection`` cannot be its answer."""
        last = self._last
        if last is None:  # the feedback would be lost: nothing knows what was drafted
            raise ValueError(
                f"{type(self).__name__}.update answers a select(): call select() first (a new "
                "selector, or one after reset(), has no step to learn from)"
            )
        if last.answered_before(selection):
            raise ValueError(
                f"{type(self).__name__}.update got the selection of an earlier select(), not of "
                "the last one: it would be learned against the last step's draft"
            )
        seen, mask = last.logprobs, selection.mask
        if mask.shape != seen.shape or mask.device != seen.device:
            raise ValueError(
                f"selection.lengths and selection.mask have shapes "
                f"{tuple(selection.lengths.shape)} and {tuple(mask.shape)} on {mask.device}, but "
                f"the last select() of this {type(self).__name__} saw draft_logprobs of shape "
                f"{tuple(seen.shape)} on {seen.device}; call reset() before a new batch"
            )
        return last

    def outcomes(
        self, selection: Selection, num_accepted: Tensor, accepted_nodes: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``([B, K] tested, [B, K] passed)`` of the last step (see
        :func:`~specselect.estimators.outcomes.observed_outcomes` and
        :func:`~specselect.estimators.outcomes.tree_outcomes`); after a tree selection it needs
        the accepted path, ``accepted_nodes`` (``[B, N]`` bool)."""
        last = self._last
        if last is None or last.parents is None:
            return observed_outcomes(selection.lengths, num_accepted, selection.mask.shape[1])
        if accepted_nodes is None:
            raise ValueError(
                f"{type(self).__name__} learns from its outcomes: after a tree selection, call "
                "update(selection, num_accepted, accepted_nodes=...) with the accepted path"
            )
        return tree_outcomes(selection.mask, last.parents, accepted_nodes)

    def _selected_depths(self, selection: Selection) -> Tensor:
        """``[B]`` int64: the deepest selected position of each row, 0 when nothing is.

        A chain's selected length; for a draft tree (when the last :meth:`select` had
        ``parents``), the largest depth among the selected nodes. An accepted length equal to
        it means the target accepted everything it could have: what adaptive selectors learn
        from, the same way for chains and trees.
        """
        last = self._last
        if last is None or last.positions is None or selection.mask.shape[1] == 0:
            return selection.lengths
        depth = last.positions + 1  # [B, N]
        return torch.where(selection.mask, depth, 0).amax(dim=1)

    def _update(  # noqa: B027
        self, selection: Selection, num_accepted: Tensor, accepted_nodes: Tensor | None
    ) -> None:
        """Adaptive selectors override this (arguments checked; :meth:`_outcomes_of_step`
        gives the step's tested and passed masks); the default keeps no state."""

    @outside_autograd
    def observe(
        self,
        verified: Sequence[int],
        accepted: Sequence[int],
        deepest: Sequence[int] | None = None,
        active: Sequence[bool] | None = None,
        *,
        remaining: Sequence[int] | None = None,
        waiting: bool | None = None,
    ) -> None:
        """Host-side feedback after verification: per active row, in row order, the draft
        tokens (tree nodes) the target verified, the draft tokens it accepted and, after a tree
        selection, the depth of the deepest node it verified (for a chain, the default, that
        is ``verified``); and ``active``, one bool per batch row (the rows :meth:`select` sees),
        saying which rows the entries belong to.

        The loop calls it once per step, after :meth:`update`, with numbers it has already read
        back to the host (``speculative_generate``'s one read-back per step, and replay), so it
        costs no sync. :meth:`update` gets the same outcomes as device tensors, which a selector
        could only read with a sync of its own. A selector that plans on the host learns from
        these: DSD's acceptance estimate, the goodput budget of
        :class:`~specselect.selectors.TetrisSelector`, which chooses its next
        :meth:`draft_length` from them, and HF's heuristic schedule, whose per-request windows
        live on the host; they override :meth:`_observe`. A loop that never calls it is still
        correct, but such a selector then plans from its prior (and says so once per
        generation).

        ``deepest`` is what a tree's outcome means per depth: a row that accepted ``x`` tokens
        tested depths ``1..min(x + 1, deepest)`` (siblings compete for one depth).

        ``active`` is what a selector with per-row state needs (the heuristic's windows): which
        row each entry is. Without it, entries are taken as every row of the batch when there
        are as many as its rows; selectors that pool the rows (DSD, the goodput budget) need
        it only with ``remaining``.

        ``remaining`` (per entry: the most tokens that row may still emit after this step, 0
        for a row this step finished) and ``waiting`` (whether requests wait for a free slot)
        say when the batch is *draining*: with nobody waiting, the run lasts until its slowest
        row finishes, and tokens that finish the other rows sooner shorten nothing. The goodput
        budget of :class:`~specselect.selectors.TetrisSelector` then drafts for the time to
        finish the batch instead of the step's goodput (see
        :meth:`~specselect.selectors.goodput.GoodputPlanner.best_depth`). Without them (a loop
        that does not know) it plans every step for goodput. ``speculative_generate`` and
        replay pass both.

        Each sequence may also be a 1-D NumPy array or CPU tensor (a loop's read-back).

        Raises:
            TypeError: an entry is not an int (a bool, for ``active``), or a tensor is not on
                the CPU (reading it would be a sync the caller should see), or ``waiting`` is
                not a bool.
            ValueError: the sequences differ in length, or an array or tensor is not 1-D, or
                an entry is negative, or a row
                accepted more than it verified, or its deepest depth is not between what it
                accepted and what it verified (at least 1 where it verified anything), or
                ``deepest`` is missing after a tree selection, or ``active`` does not mark one
                row per entry, or there are more entries than the last :meth:`select` had rows,
                or a row verified more than it drafted, or ``remaining`` does not hold one
                count per entry or comes without ``active``, or ``waiting`` comes without
                ``remaining``. Inside
                :func:`~specselect._checks.trusted_values` (a loop's own read-back) nothing is
                checked.
        """
        self._check_initialized()
        if values_trusted():  # a loop's own read-back, every step: no need to check it
            tested = _trusted_list(verified)
            depths = tested if deepest is None else _trusted_list(deepest)
            outcomes = (tested, _trusted_list(accepted), depths)
            rows = None if active is None else _trusted_list(active)
            left = None if remaining is None else _trusted_list(remaining)
        else:
            outcomes = check_outcomes(verified, accepted, deepest)
            rows = None if active is None else check_active_rows(active, len(outcomes[0]))
            left = None if remaining is None else check_remaining(remaining, len(outcomes[0]))
            if waiting is not None and not isinstance(waiting, bool):
                raise TypeError(f"waiting must be True, False or None, got {waiting!r}")
            if left is not None and rows is None:
                raise ValueError(
                    "remaining needs active=: which batch row each entry is (the entries shift "
                    "as rows finish, and a row's tokens left are its own)"
                )
            if waiting is not None and left is None:
                raise ValueError("waiting needs remaining=: the tokens each row has left")
            if self._last is not None:
                _check_fits_selection(outcomes[0], tuple(self._last.logprobs.shape))
        tree = self._last is not None and self._last.parents is not None
        if deepest is None and tree and any(outcomes[0]):
            raise ValueError(
                f"{type(self).__name__}.observe needs deepest= after a tree selection: the "
                "depth of each row's deepest verified node (verified counts nodes, siblings "
                "included, so it is no depth)"
            )
        self._observe(Outcomes(*outcomes, rows, left, waiting))

    def _observe(self, outcomes: Outcomes) -> None:  # noqa: B027
        """Host planners override this (checked outcomes; ``active`` is ``None`` when the loop
        did not say); the default ignores them."""

    @outside_autograd
    def reset(self) -> None:
        """Forget all state learned from feedback (start of a new generation)."""
        self._last = None
        self._answered = False
        self._request_ids = None
        if self.estimator is not None:
            self.estimator.reset()

    def reset_rows(self, rows: Tensor) -> None:
        """Forget per-request state of ``rows`` (``[B]`` bool): their slots hold new requests."""
        check_tensor("rows", rows, rank=1)
        if rows.dtype != torch.bool:
            raise TypeError(f"rows must be a bool tensor, got {rows.dtype}")
        if self.estimator is not None:
            self.estimator.reset_rows(rows)

    def reset_requests(self) -> None:
        """Forget the per-request state of every row (every slot holds a new request, maybe of
        a batch of another size), keeping what was learned across requests; :meth:`reset`
        forgets both. The default resets the estimator's (see
        :meth:`~specselect.estimators.AcceptanceEstimator.reset_requests`); a selector with
        per-request state of its own overrides it, as it overrides :meth:`reset_rows`."""
        if self.estimator is not None:
            self.estimator.reset_requests()

    @property
    def uses_features(self) -> bool:
        """Whether :meth:`select` reads per-token ``features``: its acceptance estimator's
        :attr:`~specselect.estimators.AcceptanceEstimator.uses_features`. A loop computes them
        only when this is true."""
        return self.estimator is not None and self.estimator.uses_features

    @property
    def capture_key(self) -> Hashable | None:
        """A key under which a decoding loop may capture :meth:`select` and :meth:`update` in a
        CUDA graph and replay them, or ``None`` (the default): they must run eagerly.

        A selector may give a key only when both are device code without host reads and every
        state they keep lives in tensors updated in place (never rebound, also by
        :meth:`reset`; allocated on the first call for a shape, before a loop captures that
        shape, which it does only after a warm-up call). Two selectors with equal keys must
        record the same work on the same memory: a stateless selector's key is its parameters
        and every host value its selection depends on (DSD's window of the step: a key may
        change from step to step, and a loop reads it after :meth:`draft_length`); a stateful
        one must include its :attr:`capture_token`. The one rebinding allowed is a
        move: inputs on another device than the last :meth:`select`'s take the state there as
        new tensors, and :meth:`select` then draws a new :attr:`capture_token`.

        ``speculative_generate`` checks every recording of a selector with
        :func:`specselect.capture_contract.recording_checked`, which refuses the mistakes it
        can see; a host value read by :meth:`select` but left out of the key it cannot.
        """
        return None

    @property
    def last_scores(self) -> Tensor | None:
        """``[B, K]`` the log-scores the last :meth:`select` ranked: the estimator's estimates
        of the acceptance log-probabilities, or the draft log-probs without an estimator.

        A diagnostic for eager loops: when a loop replays :meth:`select` from a CUDA graph,
        this is the tensor the capture recorded, in the graph's memory, which later graphs may
        reuse."""
        return None if self._last is None else self._last.scores

    def _follow_device(self, device: torch.device) -> None:
        """State follows the inputs to another device, as new tensors (it keeps what it
        learned), before anything reads it. A graph recorded on the old ones must never replay
        for this selector, so it gets a new :attr:`capture_token`."""
        if self._device is not None and device != self._device:
            self._move_state(device)
            self.capture_token = next(_CAPTURE_TOKENS)
            if self._request_ids is not None:
                self._request_ids = self._request_ids.to(device)
        self._device = device

    def _move_state(self, device: torch.device) -> None:
        """Move device state to ``device``: the estimator's; a selector with device state of
        its own extends this."""
        if self.estimator is not None:
            self.estimator.to(device)

    def _follow_requests(self, request_ids: Tensor) -> None:
        previous = self._request_ids
        if previous is not None and previous.shape == request_ids.shape:
            self.reset_rows(request_ids != previous)
        elif previous is not None:  # another batch size: every slot holds a new request
            self.reset_requests()
        self._request_ids = request_ids.clone()

    @classmethod
    def grid_kwargs(cls, k: int, extra: int, budget: int | None) -> dict[str, Any] | None:
        """Constructor arguments at one point of a comparison grid, or ``None`` for none there.

        ``k`` is the mean window the point compares at (standard SD verifies ``k`` tokens per
        request), ``extra`` the tokens a selector may draft beyond it, and ``budget`` a fixed
        total per step (``None``: the selector's default). The default sets the constructor's
        parameters by name (:data:`GRID_PARAMETERS`: ``k`` and ``k0`` get ``k``, ``extra``
        gets ``extra``, ``max_k`` gets ``k + extra``, ``budget`` the budget) and gives no
        configuration at a fixed budget to a constructor without ``budget``; a selector with
        other required parameters overrides it.

        Raises:
            TypeError: (the default) the constructor takes none of those parameters, or
                requires one the grid cannot set.
        """
        parameters = constructor_parameters(cls)
        if budget is not None and "budget" not in parameters:
            return None
        # A class that says its configurations do not depend on extra keeps its own default.
        by_extra = {"extra", "max_k"} if cls.grid_extra is False else set()
        kwargs = {
            name: rule(k, extra)
            for name, rule in GRID_PARAMETERS.items()
            if name in parameters and name not in by_extra
        }
        if budget is not None:
            kwargs["budget"] = budget
        supplied = set(kwargs) | set(cls.spec_kwargs(None, None))  # spec_kwargs adds these
        unset = [
            name
            for name, parameter in parameters.items()
            if parameter.default is parameter.empty and name not in supplied
        ]
        if unset or not kwargs:
            needs = f"requires {', '.join(unset)}" if unset else "takes none of them"
            raise TypeError(
                f"{cls.__name__}: a comparison grid sets the constructor parameters "
                f"{', '.join([*GRID_PARAMETERS, 'budget'])} by name, and its constructor "
                f"{needs}: override the classmethod grid_kwargs"
            )
        return kwargs

    @classmethod
    def goodput_grid_kwargs(cls, k: int, extra: int) -> dict[str, Any] | None:
        """Constructor arguments for the goodput budget at one grid point (``specselect compare
        --budget goodput``), or ``None`` (the default) for a selector without one."""
        return None

    @classmethod
    def spec_kwargs(cls, estimator: str | None, cost_model: CostModel | None) -> dict[str, Any]:
        """Constructor arguments a comparison adds to those of :meth:`grid_kwargs`.

        ``estimator`` is a selector spec's part after ``+`` (``"calibrated"`` in
        ``"tetris+calibrated"``; :data:`~specselect.estimators.NO_ESTIMATOR` for none), or
        ``None`` when the spec has none; ``cost_model`` is the comparison's timing model, for
        selectors that plan with one. The default takes neither.

        Raises:
            ValueError: an estimator for a selector that takes none.
        """
        if estimator is not None:
            raise ValueError(f"{cls.name!r} takes no estimator")
        return {}

    def __repr__(self) -> str:
        """The constructor's arguments as this selector holds them, compactly (an object by
        its class, a cost model by what it is, not its samples); never its internal state
        (``capture_token``, per-request windows): one short line for a log or a report."""
        held = vars(self)
        params = constructor_parameters(type(self))
        shown = ", ".join(f"{p}={_short_repr(held[p])}" for p in params if p in held)
        return f"{type(self).__name__}({shown})"


GRID_PARAMETERS: dict[str, Callable[[int, int], int]] = {
    "k": lambda k, extra: k,
    "k0": lambda k, extra: k,  # a starting window
    "extra": lambda k, extra: extra,
    "max_k": lambda k, extra: k + extra,  # dynamic windows may draft as far as TETRIS does
}
"""How the default :meth:`Selector.grid_kwargs` sets a constructor parameter of each name from
a comparison grid's ``(k, extra)``."""


def grid_depends_on_extra(cls: type[Selector]) -> bool:
    """Whether ``cls``'s grid configurations depend on ``extra``: :attr:`Selector.grid_extra`,
    else whether its :meth:`~Selector.grid_kwargs` differ between two extras."""
    if cls.grid_extra is not None:
        return cls.grid_extra
    return cls.grid_kwargs(1, 0, None) != cls.grid_kwargs(1, 1, None)


def constructor_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The named parameters of ``cls``'s constructor and, where it passes ``**kwargs`` on (a
    subclass wrapping its parent's constructor), those of the classes up its MRO, until one
    that names all of its own: what ``cls(name=...)`` takes, with each one's default."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        for p in params:  # (the first is self)
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                found.setdefault(p.name, p)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return found


def _short_repr(value: object) -> str:
    """A plain value as itself; a cost model as its one-line description; another object
    (an estimator, a guard) as its class."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, CostModel):
        return f"<CostModel: {value.describe()}>"
    return f"<{type(value).__name__}>"


def _from_elsewhere(part: object) -> bool:
    """Whether ``part``'s class is defined outside specselect (a user's selector or estimator,
    or a subclass of a shipped one). Only their answers' values are checked: the shipped ones
    are held to the contract by the test suite, and the checks cost a few times what a
    selection does on a CPU."""
    return type(part).__module__.partition(".")[0] != "specselect"


def _check_estimate(owner: AcceptanceEstimator, scores: Tensor, draft_logprobs: Tensor) -> None:
    """An estimator's ``estimate`` returns ``[B, K]`` log-probabilities, ``-inf`` wherever the
    draft's is (a token that must never be selected stays so): shapes always, values where
    readable for an estimator defined outside specselect."""
    name = f"{type(owner).__name__}.estimate's output"
    if not isinstance(scores, Tensor) or scores.shape != draft_logprobs.shape:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(
            f"{name} has shape {shape}, expected the draft_logprobs' {tuple(draft_logprobs.shape)}"
        )
    if not _from_elsewhere(owner):
        return
    with distrusted():  # inside a loop's trusted block too: the loop did not make these
        check_logprobs(name, scores)
        readable = _values_checkable(scores) and scores.numel()
    if readable and bool((draft_logprobs.isneginf() & ~scores.isneginf()).any()):
        raise ValueError(f"{name} must stay -inf where draft_logprobs is -inf")


def _check_answer(
    owner: Selector,
    selection: Selection,
    draft_logprobs: Tensor,  # [B, K] (or [B, N] nodes)
    active: Tensor | None,  # [B] bool
    parents: Tensor | None,  # [B, N]
) -> None:
    """What ``_select`` / ``_select_tree`` returned keeps the contract every loop relies on:
    ``[B]`` int64 lengths and a ``[B, K]`` bool mask on the input's device; and, for a selector
    defined outside specselect where the values are readable, each row's mask counts its
    length, is a prefix (closed under ancestors for a tree), takes nothing at or below a
    ``-inf``, nothing in an inactive row, and no row more than :meth:`Selector.max_selected`
    (which sizes a tree step's verification pass). Inside a decoding loop's trusted block too:
    a loop would otherwise clamp, cut, or verify a broken answer without a word."""
    if not isinstance(selection, Selection):
        raise TypeError(
            f"{type(owner).__name__} must select a specselect Selection (lengths and mask), "
            f"got {type(selection).__name__}"
        )
    rows, width = draft_logprobs.shape
    lengths, mask, device = selection.lengths, selection.mask, draft_logprobs.device
    if not (
        lengths.dtype == torch.int64
        and mask.dtype == torch.bool
        and lengths.shape == (rows,)
        and mask.shape == draft_logprobs.shape
        and lengths.device == device
        and mask.device == device
    ):
        raise RuntimeError(
            f"{type(owner).__name__} selected lengths {lengths.dtype} {tuple(lengths.shape)} "
            f"on {lengths.device} and a mask {mask.dtype} {tuple(mask.shape)} on "
            f"{mask.device}; expected int64 [{rows}] and bool [{rows}, {width}] on {device}"
        )
    if not _from_elsewhere(owner) or not mask.numel():
        return
    with distrusted():
        if not (_values_checkable(lengths) and _values_checkable(mask)):
            return
    name = type(owner).__name__
    counted = mask.sum(dim=1) == lengths  # [B]
    if parents is None:
        allowed = prefix_mask(available_lengths(draft_logprobs), width)  # [B, K]
        closed = counted & (mask == prefix_mask(lengths, width)).all(dim=1)  # [B]
    else:
        allowed = available_nodes(draft_logprobs, parents)  # [B, N]
        has_parent = mask.gather(1, parents.clamp(min=0)) | (parents < 0)  # [B, N]
        closed = counted & (has_parent | ~mask).all(dim=1)  # [B]
    shape = "a prefix of each row" if parents is None else "closed under ancestors"
    if not bool(closed.all()):
        raise RuntimeError(f"{name} selected a mask that is not {shape} matching its lengths")
    if active is not None and bool((mask & ~active.unsqueeze(1)).any()):
        raise RuntimeError(f"{name} selected tokens in an inactive row")
    if bool((mask & ~allowed).any()):
        raise RuntimeError(f"{name} selected a token at or after a -inf draft log-probability")
    num_active = rows if active is None else int(active.sum())
    bound = owner.max_selected(width, num_active)
    if int(lengths.max()) > bound:
        raise RuntimeError(
            f"{name} selected {int(lengths.max())} tokens in a row, more than its "
            f"max_selected({width}, {num_active}) = {bound}"
        )


def _check_accepted_nodes(
    accepted_nodes: object,
    selection: Selection,
    num_accepted: Tensor,
    last: _LastSelect,
) -> None:
    """``accepted_nodes`` must be a ``[B, N]`` bool path of selected nodes, ``num_accepted``
    long per row (its values are checked where they are readable without a sync); after the
    tree selection ``last``, a path from the root: every node's parent accepted too, and one
    node per depth."""
    t = check_tensor("accepted_nodes", accepted_nodes, rank=2)
    if t.dtype != torch.bool or t.shape != selection.mask.shape:
        raise ValueError(
            f"accepted_nodes must be a bool tensor of shape {tuple(selection.mask.shape)}, got "
            f"{t.dtype} {tuple(t.shape)}"
        )
    if t.device != selection.mask.device:
        raise ValueError(
            f"accepted_nodes is on {t.device}, expected {selection.mask.device} (the selection's)"
        )
    if not (_values_checkable(t) and _values_checkable(selection.mask) and t.numel()):
        return
    if bool((t & ~selection.mask).any()):
        raise ValueError("accepted_nodes must be selected nodes (within selection.mask)")
    counts = t.sum(dim=1)  # [B]
    if bool((counts != num_accepted).any()):
        row = int((counts != num_accepted).nonzero()[0, 0])
        raise ValueError(
            f"accepted_nodes must hold num_accepted nodes per row (the accepted path), got "
            f"{int(counts[row])} in row {row} where num_accepted[{row}] = {int(num_accepted[row])}"
        )
    if last.parents is not None and last.positions is not None:
        _check_root_paths(t, last.parents, last.positions)


def _check_root_paths(accepted: Tensor, parents: Tensor, positions: Tensor) -> None:
    """Each row of ``accepted`` (``[B, N]`` bool) is one root-to-node path of the tree
    (``positions``: ``[B, N]`` depth - 1 of each node)."""
    parent_accepted = accepted.gather(1, parents.clamp(min=0)) | (parents < 0)  # [B, N]
    deepest = torch.where(accepted, positions + 1, 0).amax(dim=1)  # [B]
    # Closed under parents, a set of n nodes is a path iff its deepest node is at depth n.
    broken = (accepted & ~parent_accepted).any(dim=1) | (deepest != accepted.sum(dim=1))
    if bool(broken.any()):
        row = int(broken.nonzero()[0, 0])
        raise ValueError(
            f"accepted_nodes must be a path from the root (each node's parent accepted, one "
            f"node per depth), got nodes {accepted[row].nonzero().flatten().tolist()} in row "
            f"{row}"
        )


def check_outcomes(
    verified: object, accepted: object, deepest: object = None
) -> tuple[list[int], list[int], list[int]]:
    """``verified``, ``accepted`` and ``deepest`` (:meth:`Selector.observe`) as lists of ints,
    checked; ``deepest`` defaults to ``verified`` (chains)."""
    named = {"verified": verified, "accepted": accepted}
    if deepest is not None:
        named["deepest"] = deepest
    lists = {name: _int_list(name, values) for name, values in named.items()}
    tested, passed = lists["verified"], lists["accepted"]
    depths = lists.get("deepest", tested)
    for name, values in lists.items():
        if len(values) != len(tested):
            raise ValueError(
                f"verified, accepted and deepest must have one entry per active row each, got "
                f"{len(tested)} verified and {len(values)} {name}"
            )
    _check_order("accepted", passed, "deepest" if deepest is not None else "verified", depths)
    if deepest is not None:
        _check_order("deepest", depths, "verified", tested)
        shallow = [i for i, (v, d) in enumerate(zip(tested, depths, strict=True)) if v > d == 0]
        if shallow:
            i = shallow[0]
            raise ValueError(
                f"deepest[{i}] must be >= 1 where the row verified anything, got 0 with "
                f"verified[{i}] = {tested[i]}"
            )
    return tested, passed, depths


def _host_list(name: str, values: object, entries: str) -> list[Any]:
    """``values`` as a list: a sequence, or a 1-D NumPy array or CPU tensor (``.tolist()``: a
    loop's read-back). A tensor on an accelerator would cost a sync: the caller reads it."""
    if isinstance(values, np.ndarray | Tensor) and values.ndim == 1:
        if isinstance(values, Tensor) and values.device.type != "cpu":
            raise TypeError(
                f"{name} must be host values; got a tensor on {values.device}: pass what the "
                "loop read back (e.g. .tolist())"
            )
        return values.tolist()
    if isinstance(values, np.ndarray | Tensor):
        raise ValueError(
            f"{name} must be 1-D (one entry per active row), got shape {tuple(values.shape)}"
        )
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of {entries}, got {type(values).__name__}")
    return list(values)


def _trusted_list(values: Any) -> list[Any]:
    """A loop's own host values as a list (a read-back's ``.tolist()`` if it passed arrays)."""
    return values.tolist() if isinstance(values, np.ndarray | Tensor) else list(values)


def _int_list(name: str, values: object) -> list[int]:
    ints = _host_list(name, values, "ints")
    # Every step of a loop calls this: plain non-negative ints pass at C speed; anything
    # else is checked one by one, so that the error names the entry.
    if not (all(type(v) is int for v in ints) and min(ints, default=0) >= 0):
        ints = [check_int(f"{name}[{i}]", value) for i, value in enumerate(ints)]
    return ints


def _check_order(low_name: str, low: list[int], high_name: str, high: list[int]) -> None:
    """``low[i] <= high[i]`` for every row, or an error naming the first row that breaks it."""
    if any(a > b for a, b in zip(low, high, strict=True)):
        i = next(i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a > b)
        raise ValueError(
            f"{low_name} must be <= {high_name}, got {low_name}[{i}] = {low[i]} > "
            f"{high_name}[{i}] = {high[i]}"
        )


def _check_counted(selection: Selection) -> None:
    """Each row's ``lengths`` counts its mask (a value check: see :mod:`specselect._checks`):
    feedback on lengths another mask would be learned as tokens tested that never were."""
    lengths, mask = selection.lengths, selection.mask
    if _values_checkable(lengths) and _values_checkable(mask) and lengths.numel():
        counted = mask.sum(dim=1)  # [B]
        if not torch.equal(counted, lengths):
            row = int((counted != lengths).nonzero()[0, 0])
            raise ValueError(
                f"selection.lengths[{row}] = {int(lengths[row])} but selection.mask selects "
                f"{int(counted[row])} tokens in that row; lengths must count the mask"
            )


def check_remaining(remaining: object, entries: int) -> list[int]:
    """``remaining`` (:meth:`Selector.observe`) as a list of ints >= 0, one per entry."""
    counts = _int_list("remaining", remaining)
    if len(counts) != entries:
        raise ValueError(
            f"remaining must have one entry per entry of verified, got {len(counts)} for {entries}"
        )
    return counts


def check_active_rows(active: object, entries: int) -> list[bool]:
    """``active`` (:meth:`Selector.observe`) as a list of bools, one per batch row, marking
    exactly ``entries`` rows: the rows the outcomes belong to, in row order."""
    flags = _host_list("active", active, "bools (one per batch row)")
    if not all(type(flag) is bool for flag in flags):
        i = next(i for i, flag in enumerate(flags) if type(flag) is not bool)
        raise TypeError(f"active[{i}] must be a bool, got {type(flags[i]).__name__}")
    if sum(flags) != entries:
        raise ValueError(
            f"active must mark one row per entry of verified (verified and accepted hold the "
            f"active rows only, e.g. lengths[active].tolist()), got {sum(flags)} rows marked "
            f"active for {entries} entries"
        )
    return flags


def _check_fits_selection(verified: list[int], shape: tuple[int, ...]) -> None:
    """``observe``'s outcomes must be possible after the last ``select`` of ``[B, K]`` tokens
    (or nodes): at most ``B`` rows, at most ``K`` verified per row. A host planner would learn
    from any count it is given."""
    rows, width = shape
    if len(verified) > rows:
        raise ValueError(
            f"verified holds {len(verified)} entries, but the last select() had {rows} rows"
        )
    if verified and max(verified) > width:
        raise ValueError(
            f"verified must be at most the {width} draft tokens (nodes) of the last select() "
            f"per row, got {max(verified)}"
        )


class ObserveWatch:
    """Warns once per generation when a loop calls :meth:`Selector.draft_length` but never
    :meth:`Selector.observe`: a selector that plans from ``observe`` alone would otherwise
    keep planning from its prior, silently (a loop written for :meth:`Selector.update`).

    Args:
        owner: the selector's class name, for the message.
        limit: steps without ``observe`` tolerated before the warning.
        plans: what cannot adapt without it, for the message.
    """

    def __init__(self, owner: str, limit: int, plans: str) -> None:
        self.owner, self.limit, self.plans = owner, limit, plans
        self.unobserved = 0  # draft_length calls since the last observe (or reset)

    def planned(self) -> None:
        """One :meth:`Selector.draft_length` call: warns at the first beyond ``limit`` steps
        without ``observe``."""
        self.unobserved += 1
        if self.unobserved == self.limit + 2:  # the first call precedes any step
            warnings.warn(
                f"{self.owner} learns from observe(): {self.limit + 1} steps passed without "
                f"it, so {self.plans} cannot adapt; call selector.observe() with every step's "
                "outcomes after update()",
                RuntimeWarning,
                stacklevel=3,
            )

    def observed(self) -> None:
        """An :meth:`Selector.observe` call (or a new generation): the count starts over."""
        self.unobserved = 0


def estimator_kwargs(estimator: str | None) -> dict[str, Any]:
    """The ``estimator`` argument for a selector spec's estimator part (``None`` for
    :data:`~specselect.estimators.NO_ESTIMATOR`), or none when the spec names no estimator."""
    if estimator is None:
        return {}
    return {"estimator": None if estimator == NO_ESTIMATOR else estimator}


def mask_inactive(lengths: Tensor, active: Tensor | None) -> Tensor:
    """Zero the lengths of inactive rows (``lengths`` ``[B]``, ``active`` ``[B]`` bool)."""
    return lengths if active is None else lengths * active.to(lengths.dtype)


def window_selection(
    draft_logprobs: Tensor,  # [B, K]
    active: Tensor | None,  # [B] bool
    window: int | Tensor,  # one for the batch, or [B] int64 per row
) -> Selection:
    """Each active row's selectable prefix, at most ``window`` long: the window selectors'
    chains (fixed SD, DSD, the heuristic, the threshold's confident prefix).

    As masks, not lengths: the selectable prefix is where the running minimum of the log-probs
    is not yet ``-inf``, and a batch-wide window is a cached ``[1, K]`` mask. Every decoding
    step runs this, and in eager mode on a GPU each kernel costs a launch: five here against
    seven through the lengths."""
    width = draft_logprobs.shape[1]
    window = _checked_window(window, draft_logprobs)
    selectable = draft_logprobs.cummin(dim=1).values > NEG_INF  # [B, K] a prefix per row
    if isinstance(window, Tensor):
        inside = prefix_mask(window, width)  # [B, K]
    else:
        inside = cached_constant(("window", width, window, draft_logprobs.device), _window)
    return Selection.from_mask(selectable & inside, active)


def _checked_window(window: object, draft_logprobs: Tensor) -> int | Tensor:
    """``window`` if it is an int >= 0 or a ``[B]`` integer tensor on the draft's device (its
    values checked >= 0 where that needs no sync): a negative window would select nothing
    silently."""
    if isinstance(window, Tensor):
        rows, device = draft_logprobs.shape[0], draft_logprobs.device
        return check_non_negative("window", check_row_ints("window", window, rows, device))
    return check_int("window", window)


def _window(width: int, window: int, device: torch.device) -> Tensor:  # -> [1, width] bool
    return torch.arange(width, device=device).unsqueeze(0) < window


def window_tree_selection(
    draft_logprobs: Tensor,  # [B, N]
    active: Tensor | None,  # [B] bool
    parents: Tensor,  # [B, N]
    depth: Tensor,  # [B, N] 1 for the root's children
    window: int | Tensor,  # one depth for the batch, or [B] int64 per row
) -> Selection:
    """Every selectable node of an active row at most ``window`` deep: a window read as a
    depth (DSD, the heuristic). Closed under ancestors, as a node's are shallower."""
    window = _checked_window(window, draft_logprobs)
    if isinstance(window, Tensor):
        window = window.unsqueeze(1)  # [B, 1]
    available = available_nodes(draft_logprobs, parents)  # [B, N]
    return Selection.from_mask(available & (depth <= window), active)
