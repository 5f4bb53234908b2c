"""HF's heuristic window schedule, kept per request.

HF's assisted generation grows the number of assistant tokens by 2 after a step in which every
drafted token was accepted and shrinks it by 1 otherwise (never below 1). The rule needs no
model of time or acceptance, which makes it a common baseline; here each request of the batch
follows it independently, so an easy request's window grows while a hard one's shrinks.

State and host syncs: none. The per-request windows live on the host, as Python ints, and
advance there (:func:`next_window`) from the verified and accepted counts a loop already reads
back every step and passes to :meth:`~specselect.selection.Selector.observe`, with the rows
they belong to (its ``active``). :meth:`HeuristicSelector.draft_length`, which must return a
Python int before the draft runs, is then host arithmetic: the largest window among the rows
active at the last step, so that the batch drafts no deeper than some request can use (a
host-side upper bound that grew by 2 per step would reach ``max_k`` within a few steps and
then draft ``max_k`` tokens every step for requests whose windows are far smaller — draft
passes are the dominant cost this selector is meant to save). :meth:`~HeuristicSelector.select`
reads a device copy of the windows, one ``[B]`` tensor per batch size, which ``observe``
refreshes in place with an asynchronous copy (from pinned memory on CUDA): no sync, and the
selection can be captured in a CUDA graph (:attr:`HeuristicSelector.capture_key`).
:meth:`~HeuristicSelector.update` teaches it nothing.

Draft trees. A request's window is a depth: it verifies all its nodes at most that deep, and
the window grows when the accepted path reaches the deepest verified node (``observe``'s
``deepest``) — for a chain, when every verified token was accepted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specselect._checks import check_int, check_tensor
from specselect.selection import (
    ObserveWatch,
    Outcomes,
    Selection,
    Selector,
    window_selection,
    window_tree_selection,
)

GROW = 2  # window change after a step in which every selected token was accepted
SHRINK = 1  # window change after a step with a rejection
FLOOR = 1  # smallest window
PATIENCE = 2  # steps without observe() before the warning that the windows cannot adapt


def next_window(window: int, depth: int, accepted: int, max_k: int | None) -> int:
    """A request's window after one step of the schedule.

    ``depth`` is the deepest draft position the request verified this step (a chain's verified
    count; 0 for nothing) and ``accepted`` the draft tokens it accepted. A request that verified
    nothing — inactive, or cut to 0 by ``-inf`` draft log-probabilities at the end of its
    output — gave no evidence about its acceptance, so its window is kept rather than
    penalised. Otherwise it grows by ``GROW`` when every verified depth was accepted and shrinks
    by ``SHRINK`` (down to ``FLOOR``) otherwise; ``max_k`` caps the result.
    """
    if depth == 0:
        return window
    if accepted >= depth:
        grown = window + GROW
        return grown if max_k is None else min(grown, max_k)
    return max(window - SHRINK, FLOOR)


@dataclass(frozen=True)
class _StagedRows:
    """Rows restarted on the device (:meth:`HeuristicSelector.reset_rows`), on their way to
    the host: copied without a sync, read at the next ``observe`` or ``draft_length``."""

    rows: Tensor  # [B] bool on the host (pinned, for a CUDA copy)
    done: torch.cuda.Event | None  # recorded after the CUDA copy

    def read(self) -> list[bool]:
        """The rows, once the copy has run (long since, after the loop's own read-back)."""
        if self.done is not None:
            self.done.synchronize()
        return self.rows.tolist()


def _staged(rows: Tensor) -> _StagedRows | None:
    """``rows`` (``[B]`` bool) copied to the host: asynchronously from CUDA, into pinned
    memory; ``None`` on the meta device, whose tensors hold no values to copy."""
    if rows.device.type == "meta":
        return None
    if rows.device.type != "cuda":
        return _StagedRows(rows.to("cpu", copy=True), None)
    host = torch.empty(rows.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return _StagedRows(host, done)


class HeuristicSelector(Selector):
    """Per-request windows following HF's heuristic schedule (``+2`` / ``-1``, floor 1).

    Each request starts with window ``k0``; after a step it grows by 2 if all its selected tokens
    were accepted and shrinks by 1 (floor 1) otherwise, capped at ``max_k``. ``select`` verifies
    ``min(window, available)`` tokens of every active request.

    The windows learn from :meth:`~specselect.selection.Selector.observe` (host numbers, with
    ``active=`` naming the rows; see the module docstring), so a loop must call it after every
    step, as ``speculative_generate`` and replay do; :meth:`update` teaches it nothing, and a
    loop that never observes is warned once per generation.

    Per-request state is indexed by batch row and created by the first :meth:`select` or
    :meth:`observe` after construction or :meth:`reset`, for that call's batch size. A later
    call with a different batch size raises ``ValueError``: silently starting over would hide a
    loop that reorders or drops rows. Call :meth:`reset` between generations, and
    :meth:`reset_rows` (or pass ``request_ids`` to :meth:`select`) when a batch slot is handed
    to a new request.

    Args:
        k0: initial window of every request (>= 1).
        max_k: cap of every window (>= ``k0``); ``None`` for no cap, as in HF, where a request
            that keeps accepting everything drafts ever longer windows.
    """

    name = "heuristic"
    supports_trees = True

    def __init__(self, k0: int = 4, max_k: int | None = None) -> None:
        super().__init__()
        self.k0 = check_int("k0", k0, minimum=FLOOR)
        self.max_k = None if max_k is None else check_int("max_k", max_k, minimum=FLOOR)
        if self.max_k is not None and self.max_k < self.k0:
            raise ValueError(f"max_k must be >= k0 ({self.k0}) or None, got {self.max_k}")
        # batch size -> [B] int64 device copy of the windows, which select reads: updated in
        # place (also by reset), never rebound but by a move, so that a graph replays on it.
        self._copies: dict[int, Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every request's window; the next call starts a new batch at ``k0``."""
        super().reset()
        self._windows: list[int] | None = None  # per batch row: the one source of truth
        self._rows: list[int] = []  # the rows active at the last observed step
        self._staged: list[_StagedRows] = []  # device-side restarts the host has yet to apply
        self._watch = ObserveWatch(type(self).__name__, PATIENCE, "its windows")
        for copy in self._copies.values():
            copy.fill_(self.k0)

    def reset_requests(self) -> None:
        """Every window is per request: :meth:`reset`."""
        self.reset()

    def reset_rows(self, rows: Tensor) -> None:
        """Restart the windows of ``rows`` (``[B]`` bool) at ``k0``: their slots hold new requests.

        The device copy restarts at once (the next :meth:`select` uses ``k0``), the host's
        windows at the next :meth:`observe` or :meth:`draft_length`: ``rows`` reaches the host
        by an asynchronous copy from CUDA (a plain one from elsewhere), so no sync, but nothing
        that a CUDA graph could hold either. No-op before the state exists (every row will
        start at ``k0`` anyway).
        """
        check_tensor("rows", rows, rank=1)
        if rows.dtype != torch.bool:
            raise TypeError(f"rows must be a bool tensor, got {rows.dtype}")
        if self._windows is None:
            return
        self._check_batch(rows.shape[0], "rows")
        self._copy(rows.shape[0], rows.device).masked_fill_(rows, self.k0)
        staged = _staged(rows)
        if staged is not None:
            self._staged.append(staged)

    def draft_length(self, num_active: int) -> int:
        """The largest window of the rows active at the last observed step (host arithmetic, no
        read); 0 when nothing is active.

        Finished rows and empty slots keep stale windows, which must not make the whole batch
        draft more than any active request can use. A slot refilled since then starts at ``k0``
        when it is selected; if the other windows are all shorter, it verifies that many tokens
        in its first step. Before any observed step (a new batch), ``k0``. A row that finished
        at the last step still counts this once: ``observe`` reports the step's rows.
        """
        check_int("num_active", num_active)
        self._watch.planned()
        if num_active == 0:
            return 0
        windows = self._current()
        if windows is None:
            return self.k0
        return max((windows[row] for row in self._rows), default=0) or self.k0

    @property
    def capture_key(self) -> Hashable:
        """Its :attr:`capture_token`: :meth:`select` reads nothing but the device copy of the
        windows, a tensor per batch size that :meth:`observe` (and :meth:`reset`) update in
        place outside any graph."""
        return (self.name, self.capture_token)

    def windows(self) -> list[int] | None:
        """Each row's current window (a copy; ``None`` before the first call)."""
        windows = self._current()
        return None if windows is None else list(windows)

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        return window_selection(draft_logprobs, active, self._device_windows(draft_logprobs))

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        windows = self._device_windows(draft_logprobs)  # [B]
        return window_tree_selection(draft_logprobs, active, parents, depth, windows)

    def _observe(self, outcomes: Outcomes) -> None:
        self._watch.observed()
        rows = self._observed_rows(len(outcomes.verified), outcomes.active)
        windows = self._current()
        assert windows is not None  # created by _observed_rows
        for row, depth, passed in zip(rows, outcomes.deepest, outcomes.accepted, strict=True):
            windows[row] = next_window(windows[row], depth, passed, self.max_k)
        self._rows = rows
        self._upload()

    def _observed_rows(self, entries: int, active: Sequence[bool] | None) -> list[int]:
        """The batch rows of ``observe``'s entries (creating the windows for the batch they
        describe): those ``active`` marks, or every row when there are as many entries."""
        batch = entries if active is None else len(active)
        if active is None and self._windows is not None and entries != len(self._windows):
            raise ValueError(
                f"HeuristicSelector.observe needs active=: its windows are per row, and "
                f"{entries} entries do not say which of the batch's {len(self._windows)} rows "
                "they are"
            )
        self._ensure(batch, "active")
        if active is None:
            return list(range(batch))
        return [row for row, flag in enumerate(active) if flag]

    def _move_state(self, device: torch.device) -> None:
        super()._move_state(device)
        self._copies = {batch: copy.to(device) for batch, copy in self._copies.items()}

    def _ensure(self, batch: int, argument: str) -> None:
        """Create the ``batch`` windows at ``k0`` if none exist; a mismatch is an error."""
        if self._windows is None:
            self._windows = [self.k0] * batch
        self._check_batch(batch, argument)

    def _check_batch(self, batch: int, argument: str) -> None:
        held = 0 if self._windows is None else len(self._windows)
        if batch != held:
            raise ValueError(
                f"{argument} has {batch} rows, but HeuristicSelector holds windows for {held} "
                f"rows: {argument} must have one entry per batch row, or, for a new batch, "
                "call reset() first"
            )

    def _current(self) -> list[int] | None:
        """The host windows with the staged device-side restarts applied (``None`` before any
        state)."""
        windows = self._windows
        if windows is not None:
            for staged in self._staged:
                for row, restarted in enumerate(staged.read()):
                    if restarted:
                        windows[row] = self.k0
        self._staged.clear()
        return windows

    def _device_windows(self, draft_logprobs: Tensor) -> Tensor:  # -> [B] int64
        """The device copy of the windows for ``draft_logprobs``' rows (no read: restarts
        staged by ``reset_rows`` are in the copy already)."""
        batch = draft_logprobs.shape[0]
        self._ensure(batch, "draft_logprobs")
        return self._copy(batch, draft_logprobs.device)

    def _copy(self, batch: int, device: torch.device) -> Tensor:  # -> [B] int64
        """The device copy for ``batch`` rows, made (from the host windows) on first use."""
        copy = self._copies.get(batch)
        if copy is None:
            copy = self._copies[batch] = torch.empty(batch, dtype=torch.int64, device=device)
            self._upload()
        return copy

    def _upload(self) -> None:
        """Copy the host windows into the device copy of their batch size, without a sync:
        asynchronously, from pinned memory on CUDA, whose caching host allocator keeps that
        memory until the copy has run."""
        windows = self._windows
        copy = None if windows is None else self._copies.get(len(windows))
        if copy is None:
            return
        host = torch.tensor(windows, dtype=torch.int64)  # [B]
        copy.copy_(host.pin_memory() if copy.is_cuda else host, non_blocking=True)
