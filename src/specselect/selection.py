"""The selection contract: what a selector receives, what it returns, and the shared kernels.

A *selector* decides, each step, which drafted tokens the target model verifies. It sees only
draft-side information (the draft's log-probabilities), so any selection keeps speculative
sampling lossless. Everything here is pure tensor code on the input's device with no host sync,
so that a decoding loop can call it between two forward passes, or capture it in a CUDA graph.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from specselect import native
from specselect._checks import (
    check_active,
    check_counts,
    check_int,
    check_logprobs,
    check_no_nan,
    check_row_ints,
    check_tensor,
)

if TYPE_CHECKING:
    from specselect.estimators import AcceptanceEstimator

NEG_INF = float("-inf")


@dataclass(frozen=True)
class _LastSelect:
    """What the last ``select`` saw, kept for ``update``."""

    logprobs: Tensor  # [B, K] the draft log-probs
    scores: Tensor  # [B, K] what was ranked (estimates, or the log-probs)
    parents: Tensor | None  # [B, N] for a tree selection
    positions: Tensor | None  # [B, N] depth - 1 of each node, for a tree selection


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
        """Build the prefix selection of ``lengths`` (``[B]``) over ``width`` draft positions."""
        lengths = lengths.to(torch.int64)
        return cls(lengths=lengths, mask=prefix_mask(lengths, width))

    @property
    def num_verified(self) -> Tensor:
        """0-dim int64 tensor: draft tokens (or tree nodes) the target verifies this step."""
        return self.lengths.sum()


def prefix_mask(lengths: Tensor, width: int) -> Tensor:
    """``[B, width]`` bool mask with the first ``lengths[i]`` entries of row ``i`` set."""
    columns = cached_constant(("columns", width, lengths.device), _columns)  # [1, width]
    return columns < lengths.unsqueeze(1)


def _columns(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, device=device).unsqueeze(0)


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


def available_lengths(draft_logprobs: Tensor) -> Tensor:
    """``[B]`` int64: drafted tokens before the first ``-inf`` (the selectable prefix)."""
    return (draft_logprobs > NEG_INF).cumprod(dim=1).sum(dim=1)  # bool cumprod gives int64


def top_c_mask(scores: Tensor, budget: int) -> Tensor:
    """Select exactly ``min(budget, available)`` entries with the largest scores.

    Args:
        scores: ``[B, N]`` float; ``-inf`` marks entries that are never selected, ``+inf``
            entries that always win. Scores must not increase from an entry to any entry that
            depends on it (along a chain, or from a tree node to its children, where a child
            always has a larger index than its parent).
        budget: a static Python int >= 0 (the total count, not per row).

    Returns:
        ``[B, N]`` bool mask on the input's device.

    Equal scores go to lower columns first (shallower positions), then to lower rows. That rule
    keeps the mask closed under prerequisites: an entry's prerequisites score at least as much
    and sit in lower columns, so they rank strictly before it; the best ``budget`` entries of a
    strict order whose prerequisites always rank first are a closed set.

    The work is a linear-time selection (not a sort) and no host sync; see
    :func:`cheapest_mask` for the two kernels and how ties cost nothing. NaN scores are an error
    where values are checked (CPU) and are never selected elsewhere.
    """
    check_tensor("scores", scores, rank=2)
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got {scores.dtype}")
    check_no_nan("scores", scores)
    budget = check_int("budget", budget)
    return cheapest_mask(scores.neg(), budget, nonnegative=False)


# Ranking codes. A float32 (or narrower) cost converted to float64 is exact and leaves the low
# 29 mantissa bits zero; OR-ing an entry's position into those bits makes every code distinct
# without changing the order of distinct costs. Read as int64, the codes of non-negative costs
# sort like the costs; negative costs (sign bit set) need their magnitude bits flipped first.
_POSITION_BITS = 29
_MAGNITUDE_FLIP = (2**63 - 1) ^ (2**_POSITION_BITS - 1)  # bits 29..62
_NEVER_CODE = 0x7FF0000000000000  # float64 +inf: codes at or above it are never selected
_NO_CODE = -(2**63)  # below every code: a row threshold that takes nothing
_CONSTANTS: OrderedDict[tuple[object, ...], Tensor] = OrderedDict()
_CONSTANTS_SIZE = 32


def cheapest_mask(
    costs: Tensor, budget: int, *, nonnegative: bool = False, keep: Tensor | None = None
) -> Tensor:
    """Select exactly ``min(budget, available)`` entries with the smallest costs.

    The cost-space twin of :func:`top_c_mask` (cost = -score), and the kernel that it and
    :class:`~specselect.selectors.TetrisSelector` run. No argument checks: callers check.

    Args:
        costs: ``[B, N]`` float; ``+inf`` = never selected, ``-inf`` = taken before anything
            else. Costs must not decrease from an entry to any entry that depends on it.
        budget: static Python int >= 0.
        nonnegative: promise that every cost is ``-inf``, ``+inf`` or ``>= +0.0`` (not
            ``-0.0``), e.g. the absolute cumulative log-probabilities of validated draft
            log-probs. It saves four elementwise passes; a broken promise gives a wrong mask.
        keep: optional ``[B]`` bool; rows outside it get an empty mask *after* the selection,
            so their entries still take budget (how TETRIS absorbs inactive rows).

    Returns:
        ``[B, N]`` bool mask.

    Float32 CPU costs in eager mode go to the fused kernel of :mod:`specselect.native` when it
    is available; everything else (accelerators, ``torch.compile``, other dtypes) runs
    :func:`cheapest_mask_torch`. Both give the same mask.
    """
    return _cheapest(costs, budget, nonnegative, keep)[0]


def cheapest_selection(
    costs: Tensor, budget: int, *, nonnegative: bool = False, keep: Tensor | None = None
) -> Selection:
    """:func:`cheapest_mask` as a :class:`Selection`: the mask and each row's count (``[B]``).

    The fused CPU kernel counts while it writes the mask, which saves a reduction.
    """
    mask, counts = _cheapest(costs, budget, nonnegative, keep)
    return Selection(lengths=mask.sum(dim=1) if counts is None else counts, mask=mask)


def _cheapest(
    costs: Tensor, budget: int, nonnegative: bool, keep: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """``([B, N] mask, [B] counts or None)``: the fused kernel if it serves, else PyTorch."""
    if 0 < budget < costs.numel() and native.usable_for(costs, keep):
        return native.run(costs, budget, keep)
    return cheapest_mask_torch(costs, budget, nonnegative=nonnegative, keep=keep), None


def cheapest_mask_torch(
    costs: Tensor, budget: int, *, nonnegative: bool = False, keep: Tensor | None = None
) -> Tensor:
    """:func:`cheapest_mask` in PyTorch operators only: any device, capturable, compilable.

    How: every entry gets a distinct int64 code ordered by (cost, column, row); the
    ``budget``-th smallest code is found with ``kthvalue`` and everything up to it is taken. As
    the codes are distinct, exactly ``budget`` entries pass, ties included, without a tie pass.
    float64 costs have no spare bits for the position and take :func:`_cheapest_mask_float64`.
    """
    rows, cols = costs.shape
    n = rows * cols
    if budget <= 0 or n == 0:  # static edge cases: no selection needed
        return torch.zeros(costs.shape, dtype=torch.bool, device=costs.device)
    if not nonnegative:  # NaN is never selected, like +inf (a NaN's sign bit would rank it first)
        costs = costs.masked_fill(costs.isnan(), float("inf"))
    if budget >= n:
        return _keep_rows(costs < float("inf"), keep)
    if costs.dtype == torch.float64 or n > 2**_POSITION_BITS:
        return _keep_rows(_cheapest_mask_float64(costs.to(torch.float64), budget), keep)
    codes = _ranking_codes(costs, nonnegative=nonnegative)
    # Clamp: if fewer than ``budget`` entries are available, stop before the never-selected.
    kth = torch.kthvalue(codes.reshape(-1), budget).values.clamp(max=_NEVER_CODE - 1)
    if keep is None:
        return codes <= kth
    # One broadcast comparison instead of a comparison and a broadcast ``&``.
    return codes <= torch.where(keep, kth, _NO_CODE).unsqueeze(1)


def cheapest_per_row(costs: Tensor, count: int) -> Tensor:
    """Select each row's ``min(count, available)`` cheapest entries (``[B, N]`` → bool mask).

    The per-request counterpart of :func:`cheapest_mask` (what EAGLE-2 and SGLang do with draft
    trees: every request keeps its own best ``count`` nodes). Same ranking codes, same tie
    rule, so the result is closed under prerequisites; ``kthvalue`` runs along each row.
    """
    cols = costs.shape[1]
    if count <= 0 or cols == 0:
        return torch.zeros(costs.shape, dtype=torch.bool, device=costs.device)
    if count >= cols:
        return costs < float("inf")
    if costs.dtype == torch.float64:  # no spare bits for positions: rank in float32
        costs = costs.to(torch.float32)
    codes = _ranking_codes(costs, nonnegative=False)
    kth = torch.kthvalue(codes, count, dim=1, keepdim=True).values.clamp(max=_NEVER_CODE - 1)
    return codes <= kth


def _keep_rows(mask: Tensor, keep: Tensor | None) -> Tensor:
    """``mask`` (``[B, N]`` bool) with the rows outside ``keep`` (``[B]`` bool) cleared."""
    return mask if keep is None else mask & keep.unsqueeze(1)


def _ranking_codes(costs: Tensor, *, nonnegative: bool) -> Tensor:
    """``[B, N]`` int64 codes, distinct, ordered by (cost, column, row); see :func:`cheapest_mask`.

    ``costs`` is ``[B, N]`` float32/float16/bfloat16. With ``nonnegative`` the caller promises
    no negative values and no ``-0.0`` (which would rank apart from ``+0.0``).
    """
    rows, cols = costs.shape
    wide = costs.to(torch.float64)  # [B, N], a fresh tensor (costs is narrower): safe to modify
    bits = wide.view(torch.int64)
    if not nonnegative:
        wide += 0.0  # -0.0 becomes +0.0: equal costs need equal bits
        bits ^= (bits >> 63) & _MAGNITUDE_FLIP  # negative floats: larger magnitude ranks first
    positions = cached_constant(("positions", rows, cols, costs.device), _position_codes)
    return bits.bitwise_or_(positions)


def _position_codes(rows: int, cols: int, device: torch.device) -> Tensor:
    """``[rows, cols]`` int64 ``j * rows + i``: the column-major position that breaks ties."""
    return torch.arange(rows * cols, device=device).view(cols, rows).t().contiguous()


def cached_constant(key: tuple[object, ...], build: Callable[..., Tensor]) -> Tensor:
    """``build(*key[1:])``, cached under ``key``: for small constant tensors used every step.

    A cached tensor saves a few kernel launches per call; nothing may modify it in place. The
    cache is bypassed while compiling or tracing (the constant then lives in the graph; a fake
    tensor must never be cached) and while a CUDA graph is being captured: inside a capture
    the kernel that fills a tensor is only recorded, so a tensor cached then would hold garbage
    until the graph replays. Once ``_CONSTANTS_SIZE`` entries are held the oldest non-CUDA one
    is dropped; CUDA entries are kept for good, because a captured graph may read them and does
    not keep them alive itself.
    """
    tracing = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    cached = None if tracing else _CONSTANTS.get(key)
    if cached is not None:
        return cached
    value = build(*key[1:])
    if not tracing and type(value) is Tensor and not _capturing(value.device):
        if len(_CONSTANTS) >= _CONSTANTS_SIZE:
            _evict_one()
        _CONSTANTS[key] = value
    return value


def _evict_one() -> None:
    """Drop the oldest cached constant that no CUDA graph can depend on."""
    for old_key, old_value in _CONSTANTS.items():
        if old_value.device.type != "cuda":
            del _CONSTANTS[old_key]
            return


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _cheapest_mask_float64(costs: Tensor, budget: int) -> Tensor:
    """:func:`cheapest_mask` for ``[B, N]`` float64 costs: threshold, then a tie pass.

    Everything strictly below the ``budget``-th smallest cost ``tau`` is taken; of the entries
    equal to ``tau`` (never ``+inf``), the first ``budget - taken`` in column-major order are.
    """
    rows, cols = costs.shape
    tau = torch.kthvalue(costs.reshape(-1), budget).values
    below = costs < tau
    tied = (costs == tau) & (costs < float("inf"))
    remaining = budget - below.sum()
    # Inclusive rank of each tied entry in column-major order (column first, then row).
    rank = tied.t().reshape(-1).cumsum(dim=0).view(cols, rows).t()
    return below | (tied & (rank <= remaining))


def observed_outcomes(
    lengths: Tensor,  # [B] int64 selected tokens per row
    num_accepted: Tensor,  # [B] int accepted tokens per row
    width: int,
) -> tuple[Tensor, Tensor]:  # ([B, K] bool, [B, K] bool)
    """Which draft positions were tested by the target this step, and which passed.

    Position ``j`` of row ``i`` is *tested* if it was selected and everything before it was
    accepted (``j <= num_accepted[i] < lengths[i]``, or ``j < lengths[i]`` when all passed). It
    *passed* if ``j < num_accepted[i]``. Positions after the first rejection say nothing about
    acceptance given an accepted prefix, so they are not observations.
    """
    positions = torch.arange(width, device=lengths.device).unsqueeze(0)  # [1, K]
    accepted = num_accepted.to(torch.int64).unsqueeze(1)  # [B, 1]
    tested = (positions <= accepted) & (positions < lengths.unsqueeze(1))
    return tested, positions < accepted


def tree_outcomes(
    selected: Tensor,  # [B, N] bool, closed under ancestors
    parents: Tensor,  # [B, N] int64, -1 = child of the root
    accepted: Tensor,  # [B, N] bool, the accepted root-to-node path
) -> tuple[Tensor, Tensor]:  # ([B, N] bool, [B, N] bool)
    """Which draft-tree nodes the target tested this step, and which passed.

    A selected node was tested if its parent is the root or on the accepted path, and no
    earlier sibling was accepted (verification tries siblings in index order and stops at the
    first accepted one). It passed if it is on the accepted path.
    """
    has_parent = parents >= 0
    parent_on_path = accepted.gather(1, parents.clamp(min=0)) & has_parent
    nodes = parents.shape[1]
    earlier = torch.ones(nodes, nodes, dtype=torch.bool, device=parents.device).tril(-1)
    siblings = (parents.unsqueeze(2) == parents.unsqueeze(1)) & earlier  # [B, N, N]
    beaten = (siblings & accepted.unsqueeze(1)).any(dim=2)  # an earlier sibling was accepted
    tested = selected & (~has_parent | parent_on_path) & ~beaten
    return tested, accepted & tested


class Selector(abc.ABC):
    """Base class of every selector.

    A decoding loop calls, once per step:

    1. :meth:`draft_length` — how many tokens to draft per request;
    2. :meth:`select` — which of the drafted tokens (or draft-tree nodes) the target verifies;
    3. :meth:`update` — feedback after verification (accepted counts), for adaptive selectors.

    Subclasses implement :meth:`_select` (chains) and, if ``supports_trees``,
    :meth:`_select_tree`; the base class checks the arguments, applies the optional acceptance
    ``estimator`` to the draft log-probabilities, feeds it the outcomes, and resets per-request
    state when a batch slot starts serving a new request.
    """

    name: ClassVar[str] = "selector"
    supports_trees: ClassVar[bool] = False
    estimator: AcceptanceEstimator | None = None

    @abc.abstractmethod
    def draft_length(self, num_active: int) -> int:
        """Tokens to draft per active request this step, given ``num_active`` active requests."""

    def select(
        self,
        draft_logprobs: Tensor,
        active: Tensor | None = None,
        *,
        parents: Tensor | None = None,
        request_ids: Tensor | None = None,
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
                slot's id changes, per-request state of that slot is reset (:meth:`reset_rows`).

        Returns:
            A :class:`Selection` on the input's device.
        """
        draft_logprobs = check_logprobs("draft_logprobs", draft_logprobs)
        rows, width = draft_logprobs.shape
        active = check_active(active, rows, draft_logprobs.device)
        if request_ids is not None:
            self._follow_requests(
                check_row_ints("request_ids", request_ids, rows, draft_logprobs.device)
            )
        if parents is not None:
            if not self.supports_trees:
                raise TypeError(
                    f"{type(self).__name__} does not select draft-tree nodes (parents=...); "
                    "use a selector with supports_trees, e.g. 'tetris' or 'fixed'"
                )
            from specselect.tree import check_parents, path_sums  # tree imports nothing here

            parents = check_parents(parents, rows=rows, width=width)
            positions = path_sums(torch.ones_like(draft_logprobs), parents).to(torch.int64) - 1
        scores = draft_logprobs
        if self.estimator is not None:
            scores = self.estimator.estimate(draft_logprobs, None if parents is None else positions)
        self._last = _LastSelect(
            draft_logprobs, scores, parents, None if parents is None else positions
        )
        if parents is None:
            return self._select(scores, active)
        return self._select_tree(scores, active, parents)

    @abc.abstractmethod
    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        """Selection on checked arguments (``[B, K]`` log-probs, optional ``[B]`` bool)."""

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor
    ) -> Selection:
        """Tree selection (``[B, N]`` node log-probs and parents); only if ``supports_trees``."""
        raise NotImplementedError

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
        :meth:`_update`.
        """
        check_counts(
            "num_accepted", num_accepted, selection.lengths.shape[0], selection.lengths.device
        )
        if accepted_nodes is not None:
            check_tensor("accepted_nodes", accepted_nodes, rank=2)
            if accepted_nodes.dtype != torch.bool or accepted_nodes.shape != selection.mask.shape:
                raise ValueError(
                    f"accepted_nodes must be a bool tensor of shape {tuple(selection.mask.shape)}"
                )
        self._accepted_nodes = accepted_nodes
        last = getattr(self, "_last", None)
        if self.estimator is not None and last is not None:
            tested, passed = self.outcomes(selection, num_accepted)
            self.estimator.learn(last.logprobs, tested, passed, last.positions)
        self._update(selection, num_accepted)

    def outcomes(self, selection: Selection, num_accepted: Tensor) -> tuple[Tensor, Tensor]:
        """``([B, K] tested, [B, K] passed)`` of the last step (see :func:`observed_outcomes`
        and :func:`tree_outcomes`)."""
        last = getattr(self, "_last", None)
        if last is None or last.parents is None:
            return observed_outcomes(selection.lengths, num_accepted, selection.mask.shape[1])
        accepted = getattr(self, "_accepted_nodes", None)
        if accepted is None:
            raise ValueError(
                f"{type(self).__name__} learns from its outcomes: after a tree selection, call "
                "update(selection, num_accepted, accepted_nodes=...) with the accepted path"
            )
        return tree_outcomes(selection.mask, last.parents, accepted)

    def _update(self, selection: Selection, num_accepted: Tensor) -> None:  # noqa: B027
        """Adaptive selectors override this; the default keeps no state."""

    def reset(self) -> None:
        """Forget all state learned from feedback (start of a new generation)."""
        self._request_ids: Tensor | None = None
        if self.estimator is not None:
            self.estimator.reset()

    def reset_rows(self, rows: Tensor) -> None:
        """Forget per-request state of ``rows`` (``[B]`` bool): their slots hold new requests."""
        if self.estimator is not None:
            self.estimator.reset_rows(rows)

    @property
    def last_scores(self) -> Tensor | None:
        """``[B, K]`` the log-scores the last :meth:`select` ranked: the estimator's estimates
        of the acceptance log-probabilities, or the draft log-probs without an estimator."""
        last = getattr(self, "_last", None)
        return None if last is None else last.scores

    def _follow_requests(self, request_ids: Tensor) -> None:
        previous = getattr(self, "_request_ids", None)
        if previous is not None and previous.shape == request_ids.shape:
            self.reset_rows(request_ids != previous)
        elif previous is not None:
            self.reset()
        self._request_ids = request_ids.clone()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def mask_inactive(lengths: Tensor, active: Tensor | None) -> Tensor:
    """Zero the lengths of inactive rows (``lengths`` ``[B]``, ``active`` ``[B]`` bool)."""
    return lengths if active is None else lengths * active.to(lengths.dtype)
