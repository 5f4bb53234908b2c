"""HF's heuristic window schedule, kept per request.

HF's assisted generation grows the number of assistant tokens by 2 after a step in which every
drafted token was accepted and shrinks it by 1 otherwise (never below 1). The rule needs no
model of time or acceptance, which makes it a common baseline; here each request of the batch
follows it independently, so an easy request's window grows while a hard one's shrinks.

State and host syncs. The per-request windows live in one ``[B]`` int64 tensor on the device of
the selector's inputs and are advanced there by :meth:`HeuristicSelector.update` without reading
them back; :meth:`~HeuristicSelector.select` never reads them either. Only
:meth:`HeuristicSelector.draft_length`, which must return a Python int before the draft runs,
reads the largest window back: one small sync per step. The alternative, a host-side upper
bound that grows by 2 per step, reaches ``max_k`` within a few steps and then drafts ``max_k``
tokens every step for requests whose windows are far smaller — draft passes are the dominant
cost this selector is meant to save.

Draft trees. A request's window is a depth: it verifies all its nodes at most that deep, and
the window grows when the accepted path reaches the deepest selected node — for a chain, when
every selected token was accepted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int, check_tensor
from specselect.selection import Selection, Selector, available_lengths, mask_inactive
from specselect.tree import available_nodes

GROW = 2  # window change after a step in which every selected token was accepted
SHRINK = 1  # window change after a step with a rejection
FLOOR = 1  # smallest window


def next_windows(
    windows: Tensor,  # [B] int64: current per-request windows
    lengths: Tensor,  # [B] int64: tokens selected this step (deepest selected node, in a tree)
    num_accepted: Tensor,  # [B] int: tokens accepted this step
    max_k: int | None,
) -> Tensor:
    """``[B]`` int64 windows after one step of the schedule.

    A request that verified nothing — inactive, or cut to 0 by ``-inf`` draft log-probabilities at
    the end of its output — gave no evidence about its acceptance, so its window is kept rather
    than penalised. The others grow by ``GROW`` when every selected token was accepted and shrink
    by ``SHRINK`` (down to ``FLOOR``) otherwise; ``max_k`` caps the result.
    """
    all_accepted = num_accepted.to(lengths.dtype) >= lengths
    grown = windows + GROW
    if max_k is not None:
        grown = grown.clamp(max=max_k)
    shrunk = (windows - SHRINK).clamp(min=FLOOR)
    stepped = torch.where(all_accepted, grown, shrunk)
    return torch.where(lengths > 0, stepped, windows)


class HeuristicSelector(Selector):
    """Per-request windows following HF's heuristic schedule (``+2`` / ``-1``, floor 1).

    Each request starts with window ``k0``; after a step it grows by 2 if all its selected tokens
    were accepted and shrinks by 1 (floor 1) otherwise, capped at ``max_k``. ``select`` verifies
    ``min(window, available)`` tokens of every active request.

    Per-request state is indexed by batch row and created by the first :meth:`select` or
    :meth:`update` after construction or :meth:`reset`, for that call's batch size and device.
    A later call with a different batch size or device raises ``ValueError``: silently starting
    over would hide a loop that reorders or drops rows. Call :meth:`reset` between generations,
    and :meth:`reset_rows` when a batch slot is handed to a new request.

    :meth:`draft_length` reads the largest window back from the device (one sync per step, see
    the module docstring).

    Args:
        k0: initial window of every request (>= 1).
        max_k: cap of every window (>= ``k0``); ``None`` for no cap, as in HF, where a request
            that keeps accepting everything drafts ever longer windows.
    """

    name = "heuristic"
    supports_trees = True
    grid_extra = True

    def __init__(self, k0: int = 4, max_k: int | None = None) -> None:
        super().__init__()
        self.k0 = check_int("k0", k0, minimum=FLOOR)
        self.max_k = None if max_k is None else check_int("max_k", max_k, minimum=FLOOR)
        if self.max_k is not None and self.max_k < self.k0:
            raise ValueError(f"max_k must be >= k0 ({self.k0}) or None, got {self.max_k}")
        self.reset()

    def reset(self) -> None:
        """Forget every request's window; the next call starts a new batch at ``k0``."""
        super().reset()
        self._windows: Tensor | None = None  # [B] int64, the only per-request state
        self._active: Tensor | None = None  # [B] bool rows active at the last select (None: all)

    def reset_rows(self, rows: Tensor) -> None:
        """Restart the windows of ``rows`` (``[B]`` bool) at ``k0``: their slots hold new requests.

        No-op before the state exists (every row will start at ``k0`` anyway).
        """
        check_tensor("rows", rows, rank=1)
        if rows.dtype != torch.bool:
            raise TypeError(f"rows must be a bool tensor, got {rows.dtype}")
        if self._windows is None:
            return
        windows = self._state(rows.shape[0], rows.device, "rows")
        self._windows = torch.where(rows, self.k0, windows)

    def draft_length(self, num_active: int) -> int:
        """The largest window of the rows active at the last select (one device read); 0 when
        nothing is active.

        Finished rows and empty slots keep stale windows, which must not make the whole batch
        draft more than any active request can use. A slot refilled since then starts at ``k0``
        when it is selected; if the other windows are all shorter, it verifies that many tokens
        in its first step. With no row active at the last select (a new batch), ``k0``. A row
        that finished at the last step still counts this once: only ``select`` learns which
        rows are active.
        """
        check_int("num_active", num_active)
        if num_active == 0:
            return 0
        if self._windows is None:
            return self.k0
        windows = self._windows
        if self._active is not None:
            windows = windows.masked_fill(~self._active, 0)  # windows are >= 1 where active
        return int(windows.max()) or self.k0

    def windows(self) -> Tensor | None:
        """``[B]`` int64 current windows (a view of the state; ``None`` before the first call)."""
        return self._windows

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        windows = self._state(draft_logprobs.shape[0], draft_logprobs.device, "draft_logprobs")
        self._active = active
        lengths = torch.minimum(available_lengths(draft_logprobs), windows)
        return Selection.from_lengths(mask_inactive(lengths, active), draft_logprobs.shape[1])

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        windows = self._state(draft_logprobs.shape[0], draft_logprobs.device, "draft_logprobs")
        self._active = active
        available = available_nodes(draft_logprobs, parents)  # [B, N]
        return Selection.from_mask(available & (depth <= windows.unsqueeze(1)), active)

    def _update(
        self, selection: Selection, num_accepted: Tensor, accepted_nodes: Tensor | None
    ) -> None:
        lengths = selection.lengths
        windows = self._state(lengths.shape[0], lengths.device, "selection.lengths")
        depths = self._selected_depths(selection)  # [B]
        self._windows = next_windows(windows, depths, num_accepted, self.max_k)

    @classmethod
    def grid_kwargs(cls, k: int, extra: int, budget: int | None) -> dict[str, Any] | None:
        """Windows start at ``k`` and grow up to ``k + extra``, as far as TETRIS drafts."""
        return {"k0": k, "max_k": k + extra} if budget is None else None

    def _move_state(self, device: torch.device) -> None:
        super()._move_state(device)
        if self._windows is not None:
            self._windows = self._windows.to(device)

    def _state(self, batch: int, device: torch.device, argument: str) -> Tensor:
        """The ``[batch]`` windows, created at ``k0`` on first use; a mismatch is an error."""
        if self._windows is None:
            self._windows = torch.full((batch,), self.k0, dtype=torch.int64, device=device)
        windows = self._windows
        if windows.shape[0] != batch or windows.device != device:
            raise ValueError(
                f"{argument} has {batch} rows on {device}, but HeuristicSelector holds windows "
                f"for {windows.shape[0]} rows on {windows.device}; call reset() before a new batch"
            )
        return windows
