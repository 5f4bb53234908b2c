"""The top-``C`` kernel: exactly ``C`` entries of a ``[B, N]`` matrix, best first, no sort.

Every budgeted selection (TETRIS over chains and trees, the per-request best nodes of draft
trees, :func:`top_c_mask`) comes down to "the ``C`` cheapest entries, ties to shallower
columns, then lower rows". Here that is a linear-time selection over distinct integer ranking
codes, in PyTorch operators (any device, capturable, compilable), or the fused CPU kernel of
:mod:`specselect.native` where it serves. Pure tensor code, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from specselect import native
from specselect._checks import check_int, check_no_nan, check_tensor
from specselect.constants import cached_constant

__all__ = [
    "cheapest_counts",
    "cheapest_mask",
    "cheapest_mask_torch",
    "cheapest_per_row",
    "top_c_mask",
]


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


def cheapest_counts(
    costs: Tensor, budget: int, *, nonnegative: bool = False, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`cheapest_mask` and each row's count: ``([B, N] bool mask, [B] int64 counts)``.

    The fused CPU kernel counts while it writes the mask, which saves a reduction.
    """
    mask, counts = _cheapest(costs, budget, nonnegative, keep)
    return mask, mask.sum(dim=1) if counts is None else counts


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
        return costs < float("inf")  # False for NaN too
    # NaN is never selected, like +inf (a NaN's sign bit would rank it first).
    costs = costs.masked_fill(costs.isnan(), float("inf"))
    if costs.dtype == torch.float64:
        # No spare bits for positions, and rounding to float32 would tie distinct costs (and
        # turn those beyond its range into +inf): threshold and tie pass in float64.
        return _cheapest_per_row_float64(costs, count)
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
    if _under_functorch(costs):
        return _sorted_ranking_codes(costs)
    rows, cols = costs.shape
    wide = costs.to(torch.float64)  # [B, N], a fresh tensor (costs is narrower): safe to modify
    bits = wide.view(torch.int64)
    if not nonnegative:
        wide += 0.0  # -0.0 becomes +0.0: equal costs need equal bits
        bits ^= (bits >> 63) & _MAGNITUDE_FLIP  # negative floats: larger magnitude ranks first
    positions = cached_constant(("positions", rows, cols, costs.device), _position_codes)
    return bits.bitwise_or_(positions)


def _under_functorch(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a functorch transform (``torch.vmap``, ``torch.func.grad``).

    Torch 2.11 (and older) has no batching rule for ``Tensor.view(dtype)``, the bit cast that
    ranking codes are made of. Dynamo cannot trace this check, and its graphs bit-cast fine.
    """
    return not torch.compiler.is_compiling() and is_functorch_wrapped_tensor(t)


def _sorted_ranking_codes(costs: Tensor) -> Tensor:
    """:func:`_ranking_codes` without a bit cast: the same order, from a stable sort.

    ``[B, N]`` float costs -> ``[B, N]`` int64 codes: each entry's rank in (cost, column, row)
    order, plus ``_NEVER_CODE`` for ``+inf`` and NaN, which are never selected. ``-0.0`` and
    ``+0.0`` compare equal, so they tie by position as in the bit codes. A sort is
    ``O(n log n)`` rather than linear: this path serves only transforms that cannot bit-cast.
    """
    rows, cols = costs.shape
    column_major = costs.t().reshape(-1)  # [N * B], entry (i, j) at j * B + i
    order = torch.sort(column_major, stable=True).indices  # equal costs keep that order
    ranks = order.argsort().view(cols, rows).t()  # [B, N]
    never = ~(costs < float("inf"))  # [B, N], +inf and NaN
    return torch.where(never, ranks + _NEVER_CODE, ranks)


def _position_codes(rows: int, cols: int, device: torch.device) -> Tensor:
    """``[rows, cols]`` int64 ``j * rows + i``: the column-major position that breaks ties."""
    return torch.arange(rows * cols, device=device).view(cols, rows).t().contiguous()


def _cheapest_mask_float64(costs: Tensor, budget: int) -> Tensor:
    """:func:`cheapest_mask` for ``[B, N]`` float64 costs without NaN: the entries in
    column-major order (column first, then row), as one row of :func:`_cheapest_per_row_float64`.
    """
    rows, cols = costs.shape
    column_major = costs.t().reshape(1, -1)  # [1, N * B]
    return _cheapest_per_row_float64(column_major, budget).view(cols, rows).t().contiguous()


def _cheapest_per_row_float64(costs: Tensor, count: int) -> Tensor:
    """Each row's ``count`` cheapest entries of ``[B, N]`` float64 costs without NaN, for
    ``0 < count < N``: threshold, then a tie pass.

    Everything strictly below the row's ``count``-th smallest cost ``tau`` is taken; of the
    entries equal to ``tau`` (never ``+inf``), the first ``count - taken`` in column order are.
    """
    tau = torch.kthvalue(costs, count, dim=1, keepdim=True).values  # [B, 1]
    below = costs < tau  # [B, N]
    tied = (costs == tau) & (costs < float("inf"))  # [B, N]
    remaining = count - below.sum(dim=1, keepdim=True)  # [B, 1]
    return below | (tied & (tied.cumsum(dim=1) <= remaining))  # inclusive rank among ties
