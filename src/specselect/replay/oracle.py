"""The oracle: a replay-only per-step upper bound that is told each request's true run length.

:class:`OracleSelector` is a :class:`~specselect.selection.Selector` like any other, except that
:func:`~specselect.replay.replay` hands it the true run lengths before every step
(:meth:`OracleSelector.set_runs`), which no real decoding loop knows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import check_int, check_tensor
from specselect.selection import (
    Selection,
    Selector,
    available_lengths,
    mask_inactive,
    prefix_mask,
)

__all__ = ["OracleSelector"]


class OracleSelector(Selector):
    """Replay-only per-step upper bound: knows each request's true run length.

    Each step it maximises ``sum_i min(L_i, run_i)`` subject to ``sum_i L_i <= C`` and ``L_i <=
    available_i``. Any token beyond ``min(run_i, available_i)`` is a sure rejection, so the optimum
    is to verify only those *useful* tokens, as many as the budget allows: every selected token
    is accepted (VSR = 1). When the budget is short, shallower positions are served first, then
    lower rows, which spreads it over as many requests as possible; every such choice has the
    same value this step.

    It is a bound *per step*, not over a whole run: another allocation leads to other future
    states (other requests ahead or behind), and on some traces a selector ends a run with
    more tokens per step than the oracle. The unbudgeted oracle (``extra=0`` and ``k`` the
    whole window) is a whole-run bound: without a shared budget, accepting every request's
    whole run now is never worse later.

    Args:
        k: mean window; the budget is ``C = k * num_active`` unless ``budget`` is given.
        extra: drafted tokens beyond ``k`` (window ``K = k + extra``), as for TETRIS.
        budget: a fixed total ``C`` per step instead.

    :func:`replay` calls :meth:`set_runs` before every :meth:`select`; no real decoding loop can.
    """

    name = "oracle"
    replay_only = True

    def __init__(self, k: int, extra: int = 2, budget: int | None = None) -> None:
        super().__init__()
        self.k = check_int("k", k)
        self.extra = check_int("extra", extra)
        self.budget = None if budget is None else check_int("budget", budget)
        self._runs: Tensor | None = None

    def draft_length(self, num_active: int) -> int:
        """``k + extra``, or the budget when smaller, as TETRIS drafts: a depth beyond the
        budget could never be verified, and its draft pass would be billed to the bound."""
        check_int("num_active", num_active)
        budget = self.k * num_active if self.budget is None else self.budget
        return min(self.k + self.extra, budget)

    def set_runs(self, runs: Tensor) -> None:
        """Reveal this step's true run lengths, ``runs`` ``[B]`` int64 (used by the next select)."""
        check_tensor("runs", runs, rank=1)
        if runs.dtype.is_floating_point or runs.dtype == torch.bool:
            raise TypeError(f"runs must be an integer tensor, got {runs.dtype}")
        self._runs = runs

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        runs, self._runs = self._runs, None  # one step only: a stale run would be a lie
        rows, width = draft_logprobs.shape
        if runs is None:
            raise ValueError(
                "OracleSelector needs the true run lengths: call set_runs(runs) "
                "before select (replay does)"
            )
        if runs.shape[0] != rows or runs.device != draft_logprobs.device:
            raise ValueError(
                f"runs must have shape [{rows}] on {draft_logprobs.device}, got "
                f"{tuple(runs.shape)} on {runs.device}"
            )
        useful = torch.minimum(available_lengths(draft_logprobs), runs.to(torch.int64))
        useful = mask_inactive(useful.clamp(min=0), active)
        if self.budget is not None:
            budget: Tensor | int = self.budget
        elif active is None:
            budget = self.k * rows
        else:
            budget = self.k * active.sum()
        mask = _fill_levels(prefix_mask(useful, width), budget)
        return Selection.from_lengths(mask.sum(dim=1), width)


def _fill_levels(candidates: Tensor, budget: Tensor | int) -> Tensor:
    """Keep the first ``budget`` candidates in column-major order (position, then row).

    Args:
        candidates: ``[B, K]`` bool, prefix-closed per row.
        budget: Python int or 0-dim integer tensor (no host read either way).

    Returns:
        ``[B, K]`` bool, prefix-closed: a row's position ``j`` comes before its ``j + 1`` in
        column-major order, so it is never dropped while a deeper one is kept.
    """
    rows, width = candidates.shape
    order = candidates.t().reshape(-1).to(torch.int64).cumsum(dim=0)  # column-major rank
    rank = order.reshape(width, rows).t()  # [B, K]
    return candidates & (rank <= budget)
