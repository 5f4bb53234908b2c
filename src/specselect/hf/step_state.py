"""The state of one generation and the bookkeeping that chain and tree steps share.

:class:`StepState` holds a generation's state (both models' sides, the active rows, the output
buffer, the statistics) and what every step does after its own drafting and verification:
writing the emitted tokens into the output (:meth:`StepState._emit`), the step's one read-back
(host sync 2 of :mod:`specselect.hf.generate`, in :meth:`StepState._finish_step`), the
per-row statistics (:class:`GenerationStats`), retiring finished rows and compacting both caches.
Chain steps (:class:`~specselect.hf.chain_step.ChainSteps`) and tree steps
(:class:`~specselect.hf.tree_step.TreeSteps`) build on it; it lives apart from
:mod:`specselect.hf.generate` so that the step modules never import the entry point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from specselect.hf.cache import RaggedCache
from specselect.hf.compat import ModelHandle
from specselect.hf.draft import ChainDrafter, SamplingParams
from specselect.hf.options import GenerationOptions
from specselect.hf.tree_draft import TreeSpec
from specselect.metrics import StepCounts, Totals
from specselect.selection import Selector


@dataclass
class GenerationStats:
    """What happened during one ``speculative_generate`` call (metrics as in DESIGN.md).

    Per row: ``verified``/``accepted``/``emitted`` totals, ``generated`` new tokens in
    ``sequences``, ``row_steps`` steps the row was active (always the first ``row_steps[i]``
    steps). ``emitted`` counts accepted + 1 per active row and step. When an accepted draft
    token is EOS the target's extra token after it is dropped from ``sequences``, so a row's
    emitted count can exceed its real new tokens (``generated``) by one.
    """

    steps: list[StepCounts] = field(default_factory=list)
    verified: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    accepted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    emitted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    generated: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    row_steps: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    verified_per_step: list[Tensor] = field(default_factory=list)  # each [B], 0 if inactive
    accepted_per_step: list[Tensor] = field(default_factory=list)  # each [B], 0 if inactive
    cache_widths: list[tuple[int, int]] = field(default_factory=list)  # (target, draft) per step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def totals(self) -> Totals:
        """Run totals; ``extra`` holds the time split and the peak cache widths."""
        widths = self.cache_widths or [(0, 0)]
        extra = {
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "prefill_seconds": self.prefill_seconds,
            "max_target_cache": float(max(w[0] for w in widths)),
            "max_draft_cache": float(max(w[1] for w in widths)),
        }
        return replace(Totals.of(self.steps), extra=extra)


class StepState:
    """State of one generation: both models' sides, the output buffer and the statistics.

    Tensors are on the target's input device unless named for the draft. Rows are *active rows*
    (``B_a`` of them, in the original order); ``self.rows`` maps them to the caller's rows.
    The attributes declared below are set at the start of a run (``_Loop.run`` and
    ``_Loop._prefill`` in :mod:`specselect.hf.generate`).
    """

    batch: int  # B, the caller's rows
    out: Tensor  # [B, max_new_tokens + 1] int64; last column: scratch
    row_ids: list[int]  # host copy of rows
    rows: Tensor  # [B_a] caller's row of each active row
    active_full: Tensor | None  # [B] flags for the selector; None = all active
    generated: Tensor  # [B_a] new tokens written per active row
    generated_host: list[int]  # [B] host copy, per caller's row
    per_row: dict[str, list[int]]  # per caller's row: verified, accepted, emitted, steps
    cache: RaggedCache  # the target's cache
    drafter: ChainDrafter  # a TreeDrafter in tree mode
    pending: Tensor  # [B_a] the token both models have yet to consume

    def __init__(
        self,
        target: ModelHandle,
        draft: ModelHandle,
        selector: Selector,
        options: GenerationOptions,
        generators: dict[torch.device, torch.Generator | None],
        cache_slack: int,
        tree: TreeSpec | None = None,
    ) -> None:
        self.target, self.draft, self.selector = target, draft, selector
        self.tree = tree
        self.options = options
        self.params: SamplingParams = options.sampling
        self.device = target.device
        self.generator = generators[target.device]
        self.draft_generator = generators[draft.device]
        self.slack = cache_slack
        self.eos = torch.tensor(options.eos_token_ids, dtype=torch.int64, device=self.device)
        self.stats = GenerationStats()

    def _emit(
        self,
        tokens: Tensor,  # [B_a, W - 1]
        num_accepted: Tensor,  # [B_a]
        next_token: Tensor,  # [B_a]
        width: int,
    ) -> tuple[Tensor, Tensor]:  # written [B_a] int64, finished [B_a] bool
        """Write accepted drafts + the target's token into the output, cut after the first EOS."""
        columns = torch.arange(width, device=self.device).unsqueeze(0)  # [1, W]
        padded = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
        emitted = torch.where(columns == num_accepted.unsqueeze(1), next_token.unsqueeze(1), padded)
        count = num_accepted + 1
        hit_eos = torch.zeros_like(count, dtype=torch.bool)
        if self.eos.numel():
            is_eos = torch.isin(emitted, self.eos) & (columns < count.unsqueeze(1))
            hit_eos = is_eos.any(dim=1)
            first = is_eos.to(torch.int64).argmax(dim=1)
            count = torch.where(hit_eos, first + 1, count)
        slots = self.generated.unsqueeze(1) + columns
        slots = torch.where(columns < count.unsqueeze(1), slots, self.options.max_new_tokens)
        self.out.index_put_((self.rows.unsqueeze(1).expand_as(slots), slots), emitted)
        self.generated = self.generated + count
        return count, hit_eos | (self.generated >= self.options.max_new_tokens)

    def _finish_step(
        self,
        start: float,
        drafted: float,
        finished: Tensor,  # [B_a] bool
        lengths: Tensor,  # [B_a] verified per row
        num_accepted: Tensor,  # [B_a]
        written: Tensor,  # [B_a]
    ) -> int:
        """The step's read-back, statistics, retirement and compaction (chain and tree alike)."""
        report = torch.stack(
            [
                finished.to(torch.int64),
                lengths,
                num_accepted,
                written,
                self.cache.count,
                self.drafter.cache.count.to(self.device),
            ]
        ).tolist()  # host sync 2: the step's read-back
        verified_at = time.perf_counter()

        counts, retired_slots = self._record(report)
        self._retire_and_compact(report)
        done = time.perf_counter()
        self.stats.draft_seconds += drafted - start
        self.stats.verify_seconds += verified_at - drafted
        self.stats.other_seconds += done - verified_at
        self.stats.steps.append(replace(counts, seconds=done - start))
        self.stats.cache_widths.append((self.cache.width, self.drafter.cache.width))
        return sum(report[3]) + retired_slots

    # ----------------------------------------------------------------- bookkeeping
    def _record(self, report: list[list[int]]) -> tuple[StepCounts, int]:
        """Per-row statistics of the step; return its counts and the retiring rows' unused slots."""
        finished, lengths, accepted = report[0], report[1], report[2]
        verified_row, accepted_row = [0] * self.batch, [0] * self.batch
        for i, row in enumerate(self.row_ids):
            verified_row[row], accepted_row[row] = lengths[i], accepted[i]
            self.per_row["verified"][row] += lengths[i]
            self.per_row["accepted"][row] += accepted[i]
            self.per_row["emitted"][row] += accepted[i] + 1
            self.per_row["steps"][row] += 1
            self.generated_host[row] += report[3][i]
        self.stats.verified_per_step.append(torch.tensor(verified_row))
        self.stats.accepted_per_step.append(torch.tensor(accepted_row))
        active = len(self.row_ids)
        counts = StepCounts(
            active=active,
            verified=sum(lengths),
            accepted=sum(accepted),
            emitted=sum(accepted) + active,
        )
        unused = sum(
            self.options.max_new_tokens - self.generated_host[row]
            for i, row in enumerate(self.row_ids)
            if finished[i]
        )
        return counts, unused

    def _retire_and_compact(self, report: list[list[int]]) -> None:
        """Drop finished rows from both models' batches; compact caches with too many holes."""
        finished, target_count, draft_count = report[0], report[4], report[5]
        keep = [i for i, f in enumerate(finished) if not f]
        if not keep:
            self.row_ids = []
            return
        if len(keep) < len(finished):
            index = torch.tensor(keep, device=self.device)
            self.cache.compact(index, max(target_count[i] for i in keep))
            self.drafter.keep_rows(index.to(self.draft.device), max(draft_count[i] for i in keep))
            self.rows = self.rows.index_select(0, index)
            self.generated = self.generated.index_select(0, index)
            self.pending = self.pending.index_select(0, index)
            self.row_ids = [self.row_ids[i] for i in keep]
            self.active_full = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
            self.active_full.index_fill_(0, self.rows, True)
            return
        if self.cache.holes(max(target_count)) > self.slack:
            self.cache.compact(None, max(target_count))
        if self.drafter.cache.holes(max(draft_count)) > self.slack:
            self.drafter.keep_rows(None, max(draft_count))

    def _to_full(self, values: Tensor, fill: float) -> Tensor:  # [B_a, ...] -> [B, ...]
        if len(self.row_ids) == self.batch:
            return values
        full = torch.full(
            (self.batch, *values.shape[1:]), fill, dtype=values.dtype, device=values.device
        )
        return full.index_copy(0, self.rows, values)

    def _to_active(self, values: Tensor) -> Tensor:  # [B, ...] -> [B_a, ...]
        if len(self.row_ids) == self.batch:
            return values
        return values.index_select(0, self.rows)


__all__ = ["GenerationStats", "StepState"]
