"""The state of one generation, declared in one place, and the bookkeeping every step shares.

:class:`GenerationState` holds everything a generation needs from its first step to its last:
the caller's rows and the *slots* that serve them, the output buffer, the target's
:class:`~specselect.hf.kv.ModelCache`, the draft side (a drafter with its own cache, or none for
plain decoding), the step's persistent input/output buffers and the statistics. It also does
what chain, tree and plain steps share: emitting tokens (:meth:`GenerationState.emit`), the
step's report and its one read-back, the per-row statistics, retiring rows and making room in
the caches.

Slots: a generation runs ``size`` slots, the batch bucket (:func:`~specselect.hf.graphs.
bucket_for`): exactly the active rows in eager mode, the smallest captured bucket that holds them
in graph mode. A slot serves one caller row or is *inactive* (a finished row, or padding up to
the bucket); inactive slots run through the forward passes but write nothing that counts (their
tokens are holes, their output goes to a scratch row). When the active rows fit a smaller
bucket, the state *shrinks*: the slots that stay are gathered to the front of every buffer, in
the same copy that compacts the caches. With a ``limit`` below the batch (continuous batching),
rows beyond it wait, and at the start of each step :meth:`GenerationState.admit` gives the free
slots to the next of them; the state shrinks only once no row waits.

Tensors on the device are per slot (``[slots]``, used as ``[:size]`` views) or per caller row;
every list is a host mirror that the host keeps exact from the step's one read-back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, overload

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from specselect.constants import arange_constant
from specselect.hf.compat import ModelHandle
from specselect.hf.draft import ChainDrafter, SamplingParams
from specselect.hf.graphs import bucket_for
from specselect.hf.kv import ModelCache, host_index
from specselect.hf.options import GenerationOptions
from specselect.lookup import LOOKUP_WINDOW, push_tokens
from specselect.metrics import StepCounts, Totals

#: Rows of a step's report, per slot: finished, verified, accepted, written, the target's and
#: the draft's cache counts, the deepest verified depth (a chain's verified count), and whether
#: sampling met a NaN in the slot's distributions.
FINISHED, VERIFIED, ACCEPTED, WRITTEN, TARGET_COUNT, DRAFT_COUNT, DEEPEST, NAN = range(8)
REPORT_ROWS = NAN + 1
#: What the host keeps per caller row (GenerationState.per_row).
PER_ROW = ("verified", "accepted", "emitted", "steps", "first_step")


class PerStep(Sequence[Tensor]):
    """Per step, a ``[B]`` int64 count for every caller row, 0 where the row was not active
    (waiting for a slot, or finished): ``stats.accepted_per_step[t][row]``.

    Kept as the active rows' entries only, and a step's dense tensor is built when it is read:
    a long queue through a few slots (``slots=``) runs many steps, and a dense ``[B]`` tensor
    per step would take memory in proportion to steps times rows.
    """

    def __init__(self, batch: int = 0) -> None:
        self.batch = batch
        self._steps: list[tuple[list[int], list[int]]] = []  # per step: (rows, counts)

    def append(self, rows: list[int], counts: list[int]) -> None:
        """Add a step: ``counts[i]`` for caller row ``rows[i]``, 0 for the rows not listed."""
        if len(rows) != len(counts):
            raise ValueError(f"rows and counts must pair up, got {len(rows)} and {len(counts)}")
        self._steps.append((rows, counts))

    def stacked(self) -> Tensor:  # [T, B] int64
        """Every step's counts as one ``[steps, B]`` tensor (what ``torch.stack`` made of the
        lists these were; ``torch.stack(list(per_step))`` works too)."""
        dense = torch.zeros(len(self._steps), self.batch, dtype=torch.int64)
        steps = [t for t, (rows, _) in enumerate(self._steps) for _ in rows]
        rows = [row for rows, _ in self._steps for row in rows]
        counts = [count for _, counts in self._steps for count in counts]
        dense[steps, rows] = torch.tensor(counts, dtype=torch.int64)
        return dense

    def __len__(self) -> int:
        return len(self._steps)

    @overload
    def __getitem__(self, index: int) -> Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[Tensor]: ...
    def __getitem__(self, index: int | slice) -> Tensor | list[Tensor]:
        if isinstance(index, slice):
            return [self._dense(step) for step in self._steps[index]]
        return self._dense(self._steps[index])

    def _dense(self, step: tuple[list[int], list[int]]) -> Tensor:  # [B] int64
        rows, counts = step
        dense = torch.zeros(self.batch, dtype=torch.int64)
        dense[rows] = torch.tensor(counts, dtype=torch.int64)
        return dense

    def __repr__(self) -> str:
        return f"PerStep({len(self)} steps of [{self.batch}])"


@dataclass
class GenerationStats:
    """What happened during one ``speculative_generate`` call (metrics of docs/concepts.md).

    ``steps`` holds one :class:`~specselect.metrics.StepCounts` per step (active rows,
    verified, accepted and emitted tokens, the step's wall seconds); :attr:`totals` sums them.
    Per row: ``verified``/``accepted``/``emitted`` totals, ``generated`` new tokens in
    ``sequences``, ``row_steps`` steps the row was active, consecutive ones from step
    ``first_step`` (0 unless the row waited for a slot). Per step and row,
    ``verified_per_step`` and ``accepted_per_step`` (:class:`PerStep`: 0 for the rows not
    active in the step). ``emitted`` counts accepted + 1
    per active row and step. When an accepted draft token is EOS the target's extra token
    after it is dropped from ``sequences``, so a row's emitted count can exceed its real new
    tokens (``generated``) by one.

    Time: ``draft_seconds`` (drafting and the selector's scores), ``select_seconds``
    (selection when it runs between the stages; graph mode replays a capturable selector's
    with the verify pass, which then counts it), ``verify_seconds`` (target pass,
    verification, the device bookkeeping and the selector's update) and ``other_seconds``
    (admitting waiting rows, planning and compaction before the draft, the read-back and the
    host's bookkeeping after it: retiring rows, and the previous step's statistics, taken once
    this step's stages are launched) are device times on a GPU (CUDA events, read once at the
    end) and wall times on a CPU; ``prefill_seconds`` is the first rows' prompt pass.
    ``totals.seconds`` (and so ``totals.goodput``) is the steps' time: the first prefill is
    left out.
    ``cache_widths`` holds the columns in use in each model's cache after each step,
    ``draft_depths`` each step's draft length (a tree's depth; 0 for a plain step);
    ``compactions`` counts cache compactions (both models), ``depth_cuts`` the steps that
    drafted less than the selector asked because the caches had no room for more (a larger
    ``cache_slack`` avoids them). ``mode`` is how the stages ran at
    the end of the call: ``"eager"``, ``"cuda"`` (CUDA graphs) or ``"trace"`` (graph mode
    emulated on a CPU, :func:`~specselect.hf.emulate_on_cpu`); ``"eager"`` also after a failed
    capture made a graph-mode call go on eagerly. ``captures`` counts the graphs this call
    captured (0 in eager mode).
    """

    steps: list[StepCounts] = field(default_factory=list)
    verified: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    accepted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    emitted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    generated: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    row_steps: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    first_step: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    verified_per_step: PerStep = field(default_factory=PerStep)  # each [B], 0 if inactive
    accepted_per_step: PerStep = field(default_factory=PerStep)  # each [B], 0 if inactive
    cache_widths: list[tuple[int, int]] = field(default_factory=list)  # (target, draft) per step
    draft_depths: list[int] = field(default_factory=list)  # per step; 0: a plain decoding step
    draft_seconds: float = 0.0
    select_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    prefill_seconds: float = 0.0
    compactions: int = 0
    depth_cuts: int = 0
    captures: int = 0
    mode: str = "eager"

    @property
    def totals(self) -> Totals:
        """Run totals; ``extra`` holds the time split and the peak cache widths."""
        widths = self.cache_widths or [(0, 0)]
        extra = {
            "draft_seconds": self.draft_seconds,
            "select_seconds": self.select_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "prefill_seconds": self.prefill_seconds,
            "max_target_cache": float(max(w[0] for w in widths)),
            "max_draft_cache": float(max(w[1] for w in widths)),
        }
        return replace(Totals.of(self.steps), extra=extra)


class Buffers:
    """Persistent tensors for a step's inputs and outputs, one per (name, shape, dtype).

    A captured stage reads and writes memory at the addresses it saw when it was captured, so
    everything that crosses a stage boundary (drafted tokens, the selection, verdicts, the
    report) lives here and is written in place.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._store: dict[tuple[str, tuple[int, ...], torch.dtype], Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        key = (name, shape, dtype)
        tensor = self._store.get(key)
        if tensor is None:
            # Allocated outside any tracing mode: the buffer must outlive the stage that first
            # asks for it, not become an op of its trace.
            with _disable_current_modes():
                tensor = torch.zeros(shape, dtype=dtype, device=self.device)
            self._store[key] = tensor
        return tensor

    def names(self) -> set[str]:
        """The names of the buffers allocated so far (any shape)."""
        return {name for name, _, _ in self._store}


class PhaseClock:
    """Per-phase time of every step without extra host syncs.

    On a CPU the host waits for every op, so ``perf_counter`` laps are the phases' times. On a
    GPU the host runs ahead of the device, so laps record CUDA events instead, and their
    elapsed times are read once, in :meth:`totals`, after the generation's last sync.
    """

    def __init__(self, device: torch.device, phases: int) -> None:
        self.cuda = device.type == "cuda"
        self.phases = phases
        self._sums = [0.0] * phases
        self._laps: list[object] = []
        self._steps: list[list[object]] = []

    def lap(self) -> None:
        """Mark the start of the step (first call) or the end of its next phase."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._laps.append(event)
        else:
            self._laps.append(time.perf_counter())
        if len(self._laps) == self.phases + 1:
            self._steps.append(self._laps)
            self._laps = []

    def totals(self) -> list[float]:
        """Seconds spent in each phase over all steps (waits once, on a GPU, for the last lap's
        event: a device-wide sync would break another thread's capture on the device)."""
        if self.cuda and self._steps:
            self._steps[-1][-1].synchronize()  # type: ignore[attr-defined]
        for laps in self._steps:
            for phase in range(self.phases):
                start, end = laps[phase], laps[phase + 1]
                if self.cuda:
                    self._sums[phase] += start.elapsed_time(end) / 1000  # type: ignore[attr-defined]
                else:
                    self._sums[phase] += end - start  # type: ignore[operator]
        self._steps = []
        return list(self._sums)


@dataclass(frozen=True)
class Layout:
    """What a :class:`GenerationState` is allocated for; a later call that needs no more (and
    not much less: attention spans the whole capacity) can reuse it, captured graphs included."""

    slots: int  # rows of every per-slot buffer and cache
    capacity: int  # cache columns per row
    batch: int  # caller rows the output buffer holds
    max_new_tokens: int  # output columns (plus a scratch column)
    eos: int  # EOS ids (their number is part of the captured code)
    lookup: bool = False  # keep each slot's recent tokens (the selector reads lookup features)

    def serves(self, need: Layout) -> bool:
        """Whether buffers allocated for ``self`` can serve a call that needs ``need``."""
        return (
            self.slots >= need.slots
            and need.capacity <= self.capacity <= 2 * need.capacity
            and self.batch >= need.batch
            and self.max_new_tokens >= need.max_new_tokens
            and self.eos == need.eos
            and self.lookup >= need.lookup
        )


class Advance(NamedTuple):
    """What a step adds to the progress bar: the tokens it wrote, and the budget its finished
    rows leave unused (taken off the bar's total, which counts ``max_new_tokens`` per row)."""

    tokens: int
    unused: int


NO_ADVANCE = Advance(0, 0)


@dataclass(frozen=True)
class StepReport:
    """A step's read-back and what its statistics need from the moment it was read (the state
    moves on before :meth:`GenerationState.account` turns it into statistics)."""

    report: list[list[int]]  # [REPORT_ROWS][size], see FINISHED .. DEEPEST
    slot_rows: list[int]  # per slot: the caller row it served in the step, or -1
    depth: int  # the step's draft depth (0: a plain step)
    seconds: float  # the step's wall time
    cache_widths: tuple[int, int]  # columns in use in the target's and the draft's cache


class GenerationState:
    """Everything a generation holds (see the module doc): buffers allocated once for a
    :class:`Layout`, and per-call state set by :meth:`start`.

    Args:
        target: the checked target model.
        drafter: the draft side, or ``None`` for plain decoding.
        layout: what to allocate for.
        graphs: whether buckets are graph buckets (padded) rather than exact batch sizes.
    """

    def __init__(
        self, target: ModelHandle, drafter: ChainDrafter | None, layout: Layout, graphs: bool
    ) -> None:
        device = target.device
        self.device, self.layout, self.graphs = device, layout, graphs
        slots = self.slots = layout.slots
        self.target = ModelCache(target, slots, layout.capacity, static_span=graphs)
        self.drafter = drafter
        self.io = Buffers(device)
        # Output: rows beyond the call's batch take the tokens of inactive slots, and the last
        # column the tokens that are not written.
        self.out = torch.zeros(
            layout.batch + 1, layout.max_new_tokens + 1, dtype=torch.int64, device=device
        )
        self.max_new = torch.zeros((), dtype=torch.int64, device=device)
        self.eos = torch.zeros(layout.eos, dtype=torch.int64, device=device)
        # Per slot (device): the caller row it serves (>= B: none), whether it is active, its
        # new tokens so far, and the token both models have yet to consume.
        self.rows = torch.zeros(slots, dtype=torch.int64, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, dtype=torch.int64, device=device)
        self.pending = torch.zeros(slots, dtype=torch.int64, device=device)
        # Per slot, for the selector's lookup features: the last LOOKUP_WINDOW tokens of the
        # prompt and output, right-aligned, and how many of them there are.
        self.window = torch.zeros(
            slots if layout.lookup else 0, LOOKUP_WINDOW, dtype=torch.int64, device=device
        )
        self.filled = torch.zeros(slots if layout.lookup else 0, dtype=torch.int64, device=device)
        # Flat, so that the [REPORT_ROWS, size] view of any bucket is contiguous: a copy into a
        # strided pinned view would go through a pageable temporary and lose its asynchrony.
        self.report_host = (
            torch.zeros(REPORT_ROWS * slots, dtype=torch.int64).pin_memory()
            if device.type == "cuda"
            else None
        )
        self.done = torch.cuda.Event() if device.type == "cuda" else None
        # Per call (set by start): the options, the caller's rows, the slots in use and the
        # host mirrors, kept exact from the steps' read-backs.
        self.options = GenerationOptions(0, SamplingParams(), (), 0)
        self.batch = self.size = 0
        self.stats = GenerationStats()
        self.slot_rows: list[int] = []  # per slot: caller row, or -1 (inactive)
        self.generated_host: list[int] = []  # per caller row
        self.counts: tuple[list[int], list[int]] = ([], [])  # per slot: target, draft count
        self.per_row: dict[str, list[int]] = {}  # per caller row: verified, accepted, ...
        self.limit = 0  # the most rows active at once
        self.prompts: tuple[Tensor, Tensor] = (self.rows[:0], self.active[:0])  # ids, bool mask
        # (until every row is admitted: see drop_prompts)
        self.lengths: list[int] = []  # per caller row: context (prompt but its last) tokens
        self.spans: list[int] = []  # per caller row: columns from its first context token on
        self.admitted = 0  # rows that have had a slot (rows are admitted in order)
        self.steps_read = 0  # steps read back so far: the step a row admitted now starts at

    def start(
        self, options: GenerationOptions, input_ids: Tensor, attention_mask: Tensor, limit: int
    ) -> None:
        """Begin a generation of the ``[B, P]`` left-padded prompts, at most ``limit`` rows at
        once: reset the per-call state (buffers stay). :meth:`admit` then starts the rows."""
        batch = input_ids.shape[0]
        self.options, self.batch = options, batch
        self.limit = min(batch, limit)
        self.stats = GenerationStats(
            verified_per_step=PerStep(batch), accepted_per_step=PerStep(batch)
        )
        self.out.fill_(options.pad_token_id)
        self.max_new.fill_(options.max_new_tokens)
        self.eos.copy_(torch.tensor(options.eos_token_ids, dtype=torch.int64))
        size = self.size = max(bucket_for(self.limit, self.graphs), 1)  # slots in use (bucket)
        self.rows.fill_(batch)
        self.active.zero_()
        self.generated.zero_()
        self.pending.zero_()
        self.prompts = (input_ids.to(self.device), attention_mask.to(self.device).bool())
        # Setup read: each row's context (prompt but its last token) length and span.
        context = self.prompts[1][:, :-1]  # [B, P - 1]
        span = context.shape[1] - context.to(torch.int64).argmax(dim=1) if context.numel() else 0
        span = torch.where(context.any(dim=1), span, 0)  # columns from the first kept one on
        self.lengths, self.spans = torch.stack([context.sum(dim=1), span]).tolist()
        self.admitted = 0  # rows 0 .. admitted - 1 have had a slot
        self.slot_rows = [-1] * size
        self.generated_host = [0] * batch
        self.counts = ([0] * size, [0] * size)
        self.per_row = {name: [0] * batch for name in PER_ROW}
        self.steps_read = 0
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def admit(self) -> None:
        """Give the free slots to the rows waiting, in row order, while fewer than ``limit`` are
        active: prefill both models on their prompts (eager, between steps; no host read).

        The first call starts a generation's first rows; later ones take a finished row's slot
        (continuous batching), so a batch larger than ``limit`` never waits for its slowest
        row to start the next one."""
        if self.admitted == self.batch:  # (most steps)
            return
        free = [slot for slot, row in enumerate(self.slot_rows) if row < 0]
        take = min(len(free), self.batch - self.admitted, self.limit - self.num_active)
        if take <= 0:
            return
        slots, rows = free[:take], list(range(self.admitted, self.admitted + take))
        self.admitted += take
        for row in rows:
            self.per_row["first_step"][row] = self.steps_read
        ids, mask = self.prompts
        if self.admitted == self.batch:
            self.drop_prompts()
        index = host_index(rows, self.device)  # [n]
        ids, mask = ids.index_select(0, index), mask.index_select(0, index)  # [n, P]
        prompt = ids.shape[1]
        width = max(self.spans[row] for row in rows)  # context columns the rows need
        context = ids[:, prompt - 1 - width : prompt - 1]  # [n, width]
        valid = mask[:, prompt - 1 - width : prompt - 1]
        self.target.admit(slots, context, valid)
        if self.drafter is not None:
            d = self.drafter.handle.device
            self.drafter.admit(slots, context.to(d), valid.to(d), ids[:, -1].to(d))
        where = host_index(slots, self.device)  # [n]
        self.rows[where] = index
        self.active[where] = True
        self.generated[where] = 0
        self.pending[where] = ids[:, -1]
        self._start_window(where, ids, mask)
        for slot, row in zip(slots, rows, strict=True):
            self.slot_rows[slot] = row
            self.counts[0][slot] = self.counts[1][slot] = self.lengths[row]

    def drop_prompts(self) -> None:
        """Let go of the caller's prompts (every row admitted, or the call over)."""
        self.prompts = (self.rows[:0], self.active[:0])

    def _start_window(self, slots: Tensor, ids: Tensor, mask: Tensor) -> None:
        """The recent tokens of the slots ``slots`` (``[n]``) from their left-padded prompts
        (``[n, P]`` ids and bool mask; the last token included), when the layout keeps them:
        the tokens the mask keeps, in order (a mask may also leave out tokens between the
        prompt's first and last, which the models do not see either)."""
        if not self.layout.lookup:
            return
        width = LOOKUP_WINDOW
        # A stable sort of the 0/1 mask puts the kept columns last, in their order.
        kept = mask.to(torch.int64).argsort(dim=1, stable=True)  # [n, P]
        tail = ids.gather(1, kept)[:, -width:].to(torch.int64)  # [n, <= W]
        window = torch.zeros(ids.shape[0], width, dtype=torch.int64, device=self.device)
        window[:, width - tail.shape[1] :] = tail
        self.window[slots] = window
        self.filled[slots] = mask.sum(dim=1).clamp(max=width)

    @property
    def unfinished(self) -> bool:
        """Whether any row is still generating or waiting for a slot."""
        return self.admitted < self.batch or self.num_active > 0

    # ------------------------------------------------------------------ host-side facts
    def caches(self) -> list[ModelCache]:
        """Both models' caches (the target's only, for plain decoding)."""
        return [self.target] + ([self.drafter.cache] if self.drafter is not None else [])

    @property
    def num_active(self) -> int:
        return sum(row >= 0 for row in self.slot_rows)

    @property
    def most_remaining(self) -> int:
        """Most tokens any active row may still emit (host-known, no sync)."""
        return max(
            self.options.max_new_tokens - self.generated_host[row]
            for row in self.slot_rows
            if row >= 0
        )

    # ------------------------------------------------------------------ inside stages
    def remaining(self) -> Tensor:  # [size] int64
        """Tokens each slot may still emit (0 for inactive slots)."""
        size = self.size
        return (self.max_new - self.generated[:size]) * self.active[:size]

    def is_eos(self, tokens: Tensor) -> Tensor:  # [...] int64 -> [...] bool
        """Which tokens are EOS ids, by broadcast comparison: ``torch.isin`` sorts and
        deduplicates many ids, which reads their unique count back (a sync on a GPU)."""
        return (tokens.unsqueeze(-1) == self.eos).any(dim=-1)

    def emit(
        self,
        tokens: Tensor,  # [b, W - 1] int64 the accepted-path tokens (first num_accepted count)
        num_accepted: Tensor,  # [b]
        next_token: Tensor,  # [b]
    ) -> tuple[Tensor, Tensor]:  # written [b] int64, finished [b] bool
        """Write accepted drafts + the target's token into the output, cut after the first EOS.

        Updates the slots' ``generated`` and ``active`` flags in place; inactive slots write
        nothing (their columns go to the scratch row).
        """
        size, width = tokens.shape[0], tokens.shape[1] + 1
        active = self.active[:size]
        columns = arange_constant(width, self.device).unsqueeze(0)  # [1, W]
        padded = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
        emitted = torch.where(columns == num_accepted.unsqueeze(1), next_token.unsqueeze(1), padded)
        count = num_accepted + 1
        hit_eos = torch.zeros_like(active)
        if self.eos.numel():
            is_eos = self.is_eos(emitted) & (columns < count.unsqueeze(1))
            hit_eos = is_eos.any(dim=1)
            first = is_eos.to(torch.int64).argmax(dim=1)
            count = torch.where(hit_eos, first + 1, count)
        count = count * active
        slots = self.generated[:size].unsqueeze(1) + columns
        slots = torch.where(columns < count.unsqueeze(1), slots, self.max_new)
        self.out.index_put_((self.rows[:size].unsqueeze(1).expand_as(slots), slots), emitted)
        self.generated[:size].add_(count)
        if self.layout.lookup:
            push_tokens(self.window[:size], self.filled[:size], emitted, count)
        finished = active & (hit_eos | (self.generated[:size] >= self.max_new))
        active &= ~finished
        return count, finished

    def write_report(
        self,
        finished: Tensor,  # [b] bool
        verified: Tensor,  # [b] int64
        num_accepted: Tensor,  # [b] int64
        written: Tensor,  # [b] int64
        deepest: Tensor,  # [b] int64
        nan_rows: Tensor | None = None,  # [b] bool, sampling: a NaN in the slot's distributions
    ) -> None:
        """Collect what the host must know after the step into the report buffer."""
        size = self.size
        draft_count = (
            self.drafter.cache.count[:size].to(self.device)
            if self.drafter is not None
            else torch.zeros_like(written)
        )
        rows = {
            FINISHED: finished.to(torch.int64),
            VERIFIED: verified,
            ACCEPTED: num_accepted,
            WRITTEN: written,
            TARGET_COUNT: self.target.count[:size],
            DRAFT_COUNT: draft_count,
            DEEPEST: deepest,
            NAN: (  # greedy: a zero row, allocated once
                self.io("no_nan", (size,), torch.int64)
                if nan_rows is None
                else nan_rows.to(torch.int64)
            ),
        }
        report = torch.stack([rows[row] for row in range(REPORT_ROWS)])  # [REPORT_ROWS, b]
        self.io("report", (REPORT_ROWS, size), torch.int64).copy_(report)

    # ------------------------------------------------------------------ between stages
    def to_full(self, values: Tensor, fill: float) -> Tensor:  # [size, ...] -> [B, ...]
        """Per-slot values as per-caller-row values (``fill`` for rows no slot serves)."""
        full = torch.full(
            (self.batch + 1, *values.shape[1:]), fill, dtype=values.dtype, device=values.device
        )
        return full.index_copy_(0, self.rows[: self.size], values)[: self.batch]

    def to_slots(self, values: Tensor) -> Tensor:  # [B, ...] -> [size, ...]
        """Per-caller-row values as per-slot values (inactive slots read row 0: mask them)."""
        return values.index_select(0, self.rows[: self.size].clamp(max=self.batch - 1))

    def active_rows(self) -> Tensor:  # [B] bool
        """Which caller rows are still generating (the selector's ``active`` flags)."""
        return self.to_full(self.active[: self.size], False)

    def read_back(self) -> list[list[int]]:
        """The step's report on the host: the loop's one sync per step.

        On a GPU it goes through pinned memory: one asynchronous copy and one event wait.
        """
        report = self.io("report", (REPORT_ROWS, self.size), torch.int64)
        if self.report_host is None or self.done is None:
            return report.tolist()
        host = self.report_host[: REPORT_ROWS * self.size].view(REPORT_ROWS, self.size)
        host.copy_(report, non_blocking=True)
        self.done.record()
        self.done.synchronize()
        return host.tolist()

    # ------------------------------------------------------------------ on the host
    def retire(self, report: list[list[int]], depth: int, seconds: float) -> StepReport:
        """Bring the host mirrors the next step plans with up to date from a step's read-back
        (cache counts, new tokens per row, finished rows retired), and return the step's
        report for :meth:`account`.

        This is all the host must do between the read-back and the next step's first launch,
        while the device waits; the statistics can wait until that launch has been made."""
        served = list(self.slot_rows)
        self.steps_read += 1
        # Only a served row's: idle and padding slots run holes through the models, whose
        # distributions mean nothing (half precision may overflow there).
        nan_rows = [row for row, flag in zip(served, report[NAN], strict=True) if flag and row >= 0]
        if nan_rows:
            row = nan_rows[0]
            raise RuntimeError(
                f"sampling met a NaN in row {row}'s distribution (step {self.steps_read}): the "
                "target's or the draft's logits hold +inf or NaN, or logits / temperature "
                "overflow; generate() refuses such a distribution too ('probability tensor "
                "contains either inf, nan or element < 0') rather than draw from it"
            )
        written, finished = report[WRITTEN], report[FINISHED]
        self.counts = (report[TARGET_COUNT], report[DRAFT_COUNT])
        for slot, row in enumerate(served):
            if row >= 0:
                self.generated_host[row] += written[slot]
                if finished[slot]:
                    self.slot_rows[slot] = -1
        draft_used = self.drafter.cache.used if self.drafter is not None else 0
        return StepReport(report, served, depth, seconds, (self.target.used, draft_used))

    def account(self, step: StepReport) -> Advance:
        """A retired step's statistics (per row and per step); returns the tokens it wrote and
        the unused budget of the rows it finished (the progress bar's advance)."""
        report = step.report
        finished, verified, accepted = report[FINISHED], report[VERIFIED], report[ACCEPTED]
        written = report[WRITTEN]
        rows, verified_row, accepted_row = [], [], []  # per active row, in slot order
        tokens = unused = 0
        per_row = self.per_row
        for slot, row in enumerate(step.slot_rows):
            if row < 0:
                continue
            rows.append(row)
            verified_row.append(verified[slot])
            accepted_row.append(accepted[slot])
            per_row["verified"][row] += verified[slot]
            per_row["accepted"][row] += accepted[slot]
            per_row["emitted"][row] += accepted[slot] + 1
            per_row["steps"][row] += 1
            tokens += written[slot]
            if finished[slot]:  # its count is final: retire() saw its last tokens
                unused += self.options.max_new_tokens - self.generated_host[row]
        self.stats.verified_per_step.append(rows, verified_row)
        self.stats.accepted_per_step.append(rows, accepted_row)
        active, accepted_sum = len(rows), sum(accepted_row)
        self.stats.steps.append(
            StepCounts(
                active=active,
                verified=sum(verified_row),
                accepted=accepted_sum,
                emitted=accepted_sum + active,
                seconds=step.seconds,
            )
        )
        self.stats.cache_widths.append(step.cache_widths)
        self.stats.draft_depths.append(step.depth)
        return Advance(tokens, unused)

    def columns_left(self) -> tuple[int, int]:
        """The most columns per row the next step can write to the target's and the draft's
        cache (``0`` without a draft), compaction included: each capacity less the most any
        slot of the next bucket holds. A step within them never overflows (:meth:`make_room`)."""
        keep = self._slots_to_keep(self._next_size())
        target = self.target.capacity - _most_held(self.counts[0], keep)
        if self.drafter is None:
            return target, 0
        return target, self.drafter.cache.capacity - _most_held(self.counts[1], keep)

    def make_room(self, target_width: int, draft_width: int) -> None:
        """Before a step writing ``target_width`` / ``draft_width`` columns: shrink to a smaller
        bucket if the active rows fit one, and compact every cache the step would overflow."""
        new_size = self._next_size()
        shrink = new_size < self.size
        caches: list[tuple[ModelCache, int, list[int]]] = [
            (self.target, target_width, self.counts[0])
        ]
        if self.drafter is not None:
            caches.append((self.drafter.cache, draft_width, self.counts[1]))
        if not shrink:  # most steps: only the caches the step would overflow move
            caches = [entry for entry in caches if entry[0].room() < entry[1]]
            if not caches:
                return
        keep = self._slots_to_keep(new_size)
        for cache, width, counts in caches:
            used = _most_held(counts, keep)
            if used + width > cache.capacity:
                raise RuntimeError(  # plan() cuts the depth to columns_left(): a bug
                    f"internal error: a step needs {used + width} cache columns per row, more "
                    f"than the {cache.capacity} the caches hold after compaction"
                )
            rows = host_index(keep, cache.count.device)
            if cache is self.target:
                cache.compact(rows, used)
            else:
                assert self.drafter is not None
                self.drafter.keep_rows(rows, used)
            self.stats.compactions += 1
        if shrink:
            self._shrink(keep)

    def _next_size(self) -> int:
        """The next step's batch size: the bucket that holds the active rows."""
        return max(bucket_for(self.num_active, self.graphs), 1)

    def _slots_to_keep(self, size: int) -> list[int]:
        """The slots of the next bucket: every active slot, then inactive ones as padding."""
        active = [slot for slot, row in enumerate(self.slot_rows) if row >= 0]
        idle = [slot for slot, row in enumerate(self.slot_rows) if row < 0]
        return (active + idle)[:size] if size < self.size else list(range(self.size))

    def _shrink(self, keep: list[int]) -> None:
        """Move the kept slots to the front of every per-slot buffer (caches are done)."""
        index = host_index(keep, self.device)
        size = len(keep)
        for buffer in (self.rows, self.active, self.generated, self.pending):
            buffer[:size] = buffer.index_select(0, index)
        if self.layout.lookup:
            for buffer in (self.window, self.filled):
                buffer[:size] = buffer.index_select(0, index)
        self.slot_rows = [self.slot_rows[slot] for slot in keep]
        self.counts = tuple([counts[slot] for slot in keep] for counts in self.counts)  # type: ignore[assignment]
        self.size = size

    def result(self, input_ids: Tensor) -> Tensor:
        """``[B, P + new]``: the prompts and the generated tokens (pad after EOS)."""
        new = max(self.generated_host)
        stats = self.stats
        stats.verified, stats.accepted, stats.emitted = (
            torch.tensor(self.per_row[name]) for name in ("verified", "accepted", "emitted")
        )
        stats.generated = torch.tensor(self.generated_host)
        stats.row_steps = torch.tensor(self.per_row["steps"])
        stats.first_step = torch.tensor(self.per_row["first_step"])
        return torch.cat([input_ids, self.out[: self.batch, :new]], dim=1)


def _most_held(counts: list[int], slots: list[int]) -> int:
    """The most columns any of ``slots`` holds in a cache (its columns after compaction)."""
    return max(counts[slot] for slot in slots)


__all__ = [
    "NO_ADVANCE",
    "REPORT_ROWS",
    "Advance",
    "Buffers",
    "GenerationState",
    "GenerationStats",
    "Layout",
    "PerStep",
    "PhaseClock",
    "StepReport",
]
