"""The two step strategies: chains (and plain decoding) and draft trees.

A step is the same five parts for both (the skeleton is :meth:`Step.run`):

1. **plan** (host): the draft length or tree shape, from the selector and the rows' remaining
   tokens, and the cache columns the step will write; the state makes room first
   (:meth:`~specselect.hf.state.GenerationState.make_room`);
2. **draft** (a stage): the draft model proposes a chain or a tree per slot; the scores the
   selector will see are computed here, with unemittable positions masked;
3. **select**: ``selector.select`` on the caller's rows, eagerly between the stages, or captured
   with the verify stage when the selector allows it (its
   :attr:`~specselect.selection.Selector.capture_key`);
4. **verify** (a stage): one target pass over the pending token and every drafted token a row
   may select, the unselected ones as holes (a static width, so the step needs no sync to know
   it; :meth:`Step.narrow` cuts it where a read is free), then greedy or lossless sampling
   verification, both caches' commits, emission and the report;
5. **update**: ``selector.update`` (eager, or captured with selection), then the state's one
   read-back, ``selector.observe`` with the verified, accepted and deepest verified counts
   it brought back, and which of the caller's rows they are, and the host mirrors the next plan
   needs (rows retired, cache counts). The step's statistics wait until the next step's stages
   are launched (:meth:`Step.settle`): on a GPU the device would otherwise idle while the host
   takes them.

Stages (2 and 4) run through a :class:`~specselect.hf.graphs.StageRunner`: eagerly, or captured
per (bucket, widths) and replayed. They exchange data only through the state's persistent
buffers (``state.io``), and take every position from device tensors.

Plain decoding is a chain step with no drafter and no selector: no draft stage, a verify stage
one column wide.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specselect._checks import check_int
from specselect.capture_contract import recording_checked
from specselect.constants import arange_constant, cached_constant
from specselect.hf.draft import ChainDrafter, SamplingParams
from specselect.hf.graphs import StageRunner
from specselect.hf.state import (
    ACCEPTED,
    DEEPEST,
    FINISHED,
    NO_ADVANCE,
    VERIFIED,
    WRITTEN,
    Advance,
    GenerationState,
    PhaseClock,
    StepReport,
)
from specselect.hf.tree_draft import DraftTree, TreeDrafter
from specselect.lookup import LOOKUP_FEATURES, chain_paths, lookup_features
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.selection import (
    NEG_INF,
    Selection,
    Selector,
    available_lengths,
    draftable_depth,
    prefix_mask,
)
from specselect.tree import TreeBuffers, TreeSpec, build_tree_buffers, path_sums
from specselect.verify import greedy_verify, rejection_verify
from specselect.verify_tree import TreeVerdict, tree_greedy_verify, tree_rejection_verify

#: The phases of a step, timed by its :class:`~specselect.hf.state.PhaseClock`.
PHASES = ("prepare", "draft", "select", "verify", "finish")
#: The stage that replays a capturable selector's work with the verify pass.
SELECT_VERIFY = "select+verify"
#: The report rows ``selector.observe`` gets, in its arguments' order.
OBSERVED = (VERIFIED, ACCEPTED, DEEPEST)


@dataclass(frozen=True)
class Plan:
    """What the host decided for one step (everything a stage's shapes depend on)."""

    width: int  # draft length k (chains) or tree depth (trees); 0 = no drafting
    target_columns: int  # cache columns the verify pass writes
    draft_columns: int  # cache columns the draft stage writes
    key: Hashable  # capture key of both stages (the runner adds the bucket size); the verify
    # stage's adds ``target_columns``, which only it depends on (a tree's nodes sent)


class Step(abc.ABC):
    """One step strategy over a :class:`~specselect.hf.state.GenerationState`.

    Args:
        state: the generation's state.
        runner: runs the draft and verify stages (eager or captured).
        selector: chooses what the target verifies (``None``: plain decoding).
        params: token choice (greedy or sampling), shared by both models.
        generator: RNG on the target's device (sampling).
        clock: per-phase timing (:data:`PHASES`).
    """

    def __init__(
        self,
        state: GenerationState,
        runner: StageRunner,
        selector: Selector | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        clock: PhaseClock,
    ) -> None:
        self.state = state
        self.runner = runner
        self.selector = selector
        self.params = params
        self.generator = generator
        self.clock = clock
        self.selection: Selection | None = None  # the current step's, for update()
        self._unaccounted: StepReport | None = None  # read back, statistics not yet taken

    def run(self) -> Advance:
        """One step; returns the progress bar's advance of the step it accounted (the previous
        one: see :meth:`settle`).

        The clock laps between the phases of :data:`PHASES`: preparation (plan, compaction),
        draft, select, verify, and the host's bookkeeping after the read-back.
        """
        state, clock, drafter = self.state, self.clock, self.state.drafter
        start = _now()
        clock.lap()
        plan = self._prepare()
        clock.lap()
        if plan.width:
            draft_key = ("draft", state.size, plan.key, self.reads_features)
            self.runner(draft_key, lambda: self.draft(plan))
        clock.lap()
        capture = self._selector_capture()
        if capture is None:
            self.select(plan)
            plan = self.narrow(plan)
            clock.lap()
            key = ("verify", state.size, plan.key, plan.target_columns)
            self.runner(key, lambda: self.verify(plan))
            self.update()
        else:  # selection and feedback are replayed with the verify pass
            clock.lap()
            selector = self.selector
            assert selector is not None  # a capture key is the selector's
            # The selector sees the caller's rows: their number is part of the captured code.
            self.runner(
                (SELECT_VERIFY, state.size, state.batch, plan.key, plan.target_columns, capture),
                lambda: self._select_verify_update(plan),
                recording=lambda: recording_checked(selector),
            )
        clock.lap()
        advance = self.settle()  # the last step's statistics, while the device runs this one
        report = state.read_back()  # the step's one host sync
        if self.selector is not None:  # the same feedback on the host: no sync of its own
            self._observe(report)
        if drafter is not None:
            drafter.advanced(plan.width)
        self._unaccounted = state.retire(report, plan.width, _now() - start)
        clock.lap()
        return advance

    def settle(self) -> Advance:
        """Account the last step read back, if not yet (its statistics); returns its progress
        bar advance (none if there was none).

        :meth:`run` accounts a step during the next one, after that one's stages are launched:
        on a GPU the host then works while the device runs them, where right after the
        read-back the device would wait for it. The loop settles the last step at the end."""
        step, self._unaccounted = self._unaccounted, None
        return NO_ADVANCE if step is None else self.state.account(step)

    def _observe(self, report: list[list[int]]) -> None:
        """``selector.observe`` with the step's outcomes, per active caller row in row order
        (before the next step plans: a host planner's next draft length depends on them), the
        tokens each row may still emit (0 once finished) and whether rows wait for a slot."""
        assert self.selector is not None
        state = self.state
        served = sorted((row, slot) for slot, row in enumerate(state.slot_rows) if row >= 0)
        slots = [slot for _, slot in served]  # the active rows' slots, in row order
        active = [False] * state.batch  # the caller's rows, as select sees them
        for row, _ in served:
            active[row] = True
        verified, accepted, deepest = ([report[r][s] for s in slots] for r in OBSERVED)
        limit, written, finished = state.options.max_new_tokens, report[WRITTEN], report[FINISHED]
        remaining = [
            0 if finished[slot] else limit - state.generated_host[row] - written[slot]
            for row, slot in served
        ]
        waiting = state.admitted < state.batch
        self.selector.observe(
            verified, accepted, deepest, active=active, remaining=remaining, waiting=waiting
        )

    def _prepare(self) -> Plan:
        """Start waiting rows in free slots, plan the step and give it its cache columns
        (compacting, or absorbing a full draft backlog, first when needed)."""
        state = self.state
        state.admit()  # rows waiting for a slot take the free ones
        plan = self.plan()
        state.make_room(plan.target_columns, plan.draft_columns)
        state.target.reserve(plan.target_columns)
        drafter = state.drafter
        if drafter is not None:
            drafter.cache.reserve(plan.draft_columns)
            if drafter.must_absorb(plan.width):
                drafter.absorb(state.size)
        return plan

    def _select_verify_update(self, plan: Plan) -> None:
        """Selection, the verify stage and the selector's feedback, as one capturable stage."""
        self.select(plan)
        self.verify(plan)
        self.update()

    def _selector_capture(self) -> Hashable | None:
        """The selector's capture key when its work is captured with the verify pass (graph
        mode, a capturable selector), else ``None``: it runs eagerly between the stages."""
        if self.runner.mode == "eager" or self.selector is None:
            return None
        return self.selector.capture_key

    @staticmethod
    def captured_selector(key: Hashable) -> Hashable | None:
        """The selector capture key inside a stage key, or ``None`` for the other stages."""
        if isinstance(key, tuple) and key and key[0] == SELECT_VERIFY:
            return key[-1]
        return None

    def plan(self) -> Plan:
        """Decide the step's widths (host only): the depth the selector asks for, as deep as
        the caches have room for.

        A step writes its columns beside the row holding the most; rows that drift apart
        could need more than ``cache_slack`` leaves, and rather than fail mid-run (losing the
        call's work) the step drafts less, which only costs speed (``stats.depth_cuts``)."""
        depth = self.requested_depth()
        target_left, draft_left = self.state.columns_left()
        plan = self.plan_at(depth)
        while plan.width and not (
            plan.target_columns <= target_left and plan.draft_columns <= draft_left
        ):
            plan = self.plan_at(plan.width - 1)
        if plan.width < depth:
            self.state.stats.depth_cuts += 1
        return plan

    @abc.abstractmethod
    def requested_depth(self) -> int:
        """The draft length (a tree's depth) the selector asks for, cut to what any row can
        still emit; 0 for a plain step."""

    @abc.abstractmethod
    def plan_at(self, depth: int) -> Plan:
        """The step's widths when drafting ``depth`` tokens (a tree ``depth`` deep)."""

    @abc.abstractmethod
    def draft(self, plan: Plan) -> None:
        """The draft stage: propose, and write tokens and selection scores to ``state.io``."""

    @abc.abstractmethod
    def select(self, plan: Plan) -> None:
        """Run the selector and write the per-slot selection to ``state.io`` (eagerly, or in
        the verify stage with a capturable selector)."""

    def narrow(self, plan: Plan) -> Plan:
        """The plan with its verify pass cut to the widest row's selection, after an eager
        :meth:`select` on a CPU (:attr:`reads_widths`); elsewhere unchanged, the static width.

        The selector's bound is often the whole draft (a budgeted TETRIS row may take every
        token; a threshold keeps what clears it), so the unused cache columns go back to the
        target's cache instead of being sent as holes."""
        if not self.reads_widths or plan.width == 0:  # (plain decoding drafts nothing)
            return plan
        widest = int(self._selected_counts(plan).max())  # a host read, free on a CPU
        unused = plan.target_columns - 1 - widest
        if unused <= 0:
            return plan
        self.state.target.release(unused)
        return replace(plan, target_columns=1 + widest)

    @abc.abstractmethod
    def _selected_counts(self, plan: Plan) -> Tensor:  # -> [b] int64
        """The draft tokens (nodes) each slot's selection verifies, after :meth:`select`."""

    @property
    def reads_widths(self) -> bool:
        """Whether :meth:`narrow` may read the selection on the host: only eagerly on a CPU.

        The static verify width spares an accelerator the sync such a read costs, and costs
        little where a pass's time is flat in its width. On a CPU a read waits for nothing and
        a pass's compute grows with every column it sends, holes included."""
        return self.runner.mode == "eager" and self.state.device.type == "cpu"

    @abc.abstractmethod
    def verify(self, plan: Plan) -> None:
        """The verify stage: target pass, verification, commits, emission, report."""

    def update(self) -> None:
        """Feed the selector the outcome of its selection, if it selected (eagerly, or in the
        verify stage with a capturable selector)."""
        if self.selector is None or self.selection is None:
            return
        state = self.state
        num_accepted = state.to_full(self._io("num_accepted", (state.size,)), 0)
        self.selector.update(self.selection, num_accepted, accepted_nodes=self._accepted_nodes())

    def _accepted_nodes(self) -> Tensor | None:
        """``[B, N]`` bool: each row's accepted draft-tree path, after a tree selection (the
        selector's ``update`` needs it); ``None`` for chains."""
        return None

    # ------------------------------------------------------------------ shared stage parts
    @property
    def reads_features(self) -> bool:
        """Whether the selector reads lookup features (the draft stage then computes them)."""
        return self.selector is not None and self.selector.uses_features

    def _lookup(self, tokens: Tensor, paths: Tensor) -> None:
        """The draft tokens' lookup features (``[b, N]`` tokens, ``[b, N, D]`` or ``[N, D]``
        paths) into ``state.io``, for a selector that reads them (in the draft stage: the
        window holds the committed tokens then)."""
        if not self.reads_features:
            return
        state = self.state
        size, nodes = tokens.shape
        features = lookup_features(state.window[:size], state.filled[:size], tokens, paths)
        self._io("features", (size, nodes, LOOKUP_FEATURES), torch.float32).copy_(features)

    def _features(self, nodes: int) -> Tensor | None:  # -> [B, N, F] or None
        """What :meth:`_lookup` wrote, per caller row (``None`` if the selector reads none)."""
        if not self.reads_features:
            return None
        state = self.state
        features = self._io("features", (state.size, nodes, LOOKUP_FEATURES), torch.float32)
        return state.to_full(features, 0.0)

    def _io(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.int64) -> Tensor:
        return self.state.io(name, shape, dtype)

    def _unemittable(self, depth: Tensor, below_eos: Tensor) -> Tensor:  # -> [b, N] bool
        """Draft positions (``depth``, 1 for the first draft token) no row could emit: at a
        depth >= the row's remaining tokens (the last token a row may emit is the target's),
        or below a drafted EOS (``below_eos``, ``[b, N]``). The selector sees them at ``-inf``,
        so no selection wastes the target's pass on them."""
        return (depth >= self.state.remaining().unsqueeze(-1)) | below_eos

    def _finish(
        self,
        tokens: Tensor,  # [b, W - 1] accepted-path tokens (the first num_accepted count)
        num_accepted: Tensor,  # [b]
        next_token: Tensor,  # [b]
        verified: Tensor,  # [b]
        deepest: Tensor,  # [b] the deepest verified depth (a chain's verified count)
    ) -> None:
        """Emission, the next pending token and the report (the end of every verify stage)."""
        state = self.state
        written, finished = state.emit(tokens, num_accepted, next_token)
        state.pending[: state.size] = next_token
        self._io("num_accepted", (state.size,)).copy_(num_accepted)
        nan_rows = (
            self._io("nan_rows", (state.size,), torch.bool) if self.params.do_sample else None
        )
        state.write_report(finished, verified, num_accepted, written, deepest, nan_rows)

    def _target_probs(self, logits: Tensor, drafts: Tensor) -> Tensor:  # [b, W, V]
        """The target's processed distribution (sampling), and, for the report, the rows where
        it or the drafts' (``[b, ..., V]``) hold a NaN: drawing from them would give junk
        without a word, where ``generate`` raises."""
        probs = self.params.probs(logits)
        # A NaN survives a sum: one reduction, no [b, W, V] mask.
        nan_rows = probs.sum(dim=-1).isnan().flatten(1).any(dim=1)  # [b]
        nan_rows |= drafts.sum(dim=-1).isnan().flatten(1).any(dim=1)
        self._io("nan_rows", (self.state.size,), torch.bool).copy_(nan_rows)
        return probs

    def _verify_chain(self, k: int, sent: int) -> None:
        """The flat verify stage (chain steps, and tree steps without a tree).

        Target pass over ``[pending, first sent of the k drafts]`` (unselected ones as holes;
        every selection fits in ``sent``), verification, commits, emission and the report.
        ``k = 0`` is a plain decoding step.
        """
        state = self.state
        size = state.size
        active = state.active[:size]
        drafted = self._io("tokens", (size, k))  # [b, k]
        lengths = self._io("lengths", (size,)) if k else torch.zeros_like(state.pending[:size])
        sent_tokens = drafted[:, :sent]  # [b, sent]
        block = torch.cat([state.pending[:size].unsqueeze(1), sent_tokens], dim=1)  # [b, sent + 1]
        valid = prefix_mask(lengths + 1, sent + 1) & active.unsqueeze(1)
        logits = state.target.forward(block, valid).to(state.device)  # [b, sent + 1, V]
        if not self.params.do_sample:  # reads no column past a row's selection
            num_accepted, next_token = greedy_verify(sent_tokens, lengths, logits)
        else:
            # Sampling draws for every column: verifying at the drafted width (columns not
            # sent as zero logits, never read) keeps the random stream the same, sent or not.
            logits = F.pad(logits, (0, 0, 0, k - sent)) if sent < k else logits  # [b, k + 1, V]
            probs = self._draft_probs(size, k, logits)
            num_accepted, next_token = rejection_verify(
                drafted, lengths, probs, self._target_probs(logits, probs), self.generator
            )
        state.target.commit(prefix_mask(num_accepted + 1, sent + 1))
        drafter = state.drafter
        if isinstance(drafter, ChainDrafter):
            d = drafter.handle.device
            drafter.advance(k, drafted.to(d), num_accepted.to(d), next_token.to(d))
        self._finish(drafted, num_accepted, next_token, lengths, lengths)

    def _draft_probs(self, size: int, k: int, like: Tensor) -> Tensor:  # [b, k, V]
        """The persistent buffer of the drafts' distributions (``like``: anything ``[..., V]``)."""
        return self._io("probs", (size, k, like.shape[-1]), self._probs_dtype())

    def _probs_dtype(self) -> torch.dtype:
        """dtype of the draft's distributions (the processed draft logits)."""
        drafter = self.state.drafter
        return drafter.probs_dtype if drafter is not None else torch.float32


class ChainStep(Step):
    """Chain steps: draft ``k`` tokens per slot, select a prefix, verify it flat.

    With ``selector=None`` (no drafter) every step is a plain decoding step.
    """

    def requested_depth(self) -> int:
        if self.selector is None:
            return 0
        state = self.state
        k = check_int("selector.draft_length()", self.selector.draft_length(state.num_active))
        return draftable_depth(k, state.most_remaining)

    def plan_at(self, depth: int) -> Plan:
        drafter = self.state.drafter
        draft_columns = drafter.footprint(depth) if drafter is not None else 0
        backlog = drafter.width if drafter is not None else 0
        return Plan(depth, depth + 1, draft_columns, ("chain", depth, backlog))

    def draft(self, plan: Plan) -> None:
        state = self.state
        drafter = state.drafter
        assert isinstance(drafter, ChainDrafter)
        size, k = state.size, plan.width
        active = state.active[:size].to(drafter.handle.device)
        chain = drafter.draft(active, k).to(state.device)
        self._io("tokens", (size, k)).copy_(chain.tokens)
        if chain.probs is not None:
            self._draft_probs(size, k, chain.probs).copy_(chain.probs)
        expected = None if chain.probs is None else expected_self_logprob(chain.probs)  # [b, k]
        scores = self._mask_unemittable(chain.tokens, _selection_scores(chain.logprobs, expected))
        self._io("scores", (size, k), torch.float32).copy_(scores)
        self._lookup(chain.tokens, cached_constant(("chain_paths", k, state.device), chain_paths))

    def select(self, plan: Plan) -> None:
        state = self.state
        size, k = state.size, plan.width
        lengths = self._io("lengths", (size,))
        if self.selector is None:
            lengths.zero_()
            return
        scores = self._io("scores", (size, k), torch.float32)
        self.selection = self.selector.select(
            state.to_full(scores, NEG_INF), state.active_rows(), features=self._features(k)
        )
        # A selector that broke its contract must not be able to overflow a row.
        chosen = state.to_slots(self.selection.lengths) * state.active[:size]
        lengths.copy_(torch.minimum(chosen, available_lengths(scores)))

    def _selected_counts(self, plan: Plan) -> Tensor:  # -> [b] int64
        return self._io("lengths", (self.state.size,))

    def verify(self, plan: Plan) -> None:
        self._verify_chain(plan.width, plan.target_columns - 1)

    def _mask_unemittable(self, tokens: Tensor, scores: Tensor) -> Tensor:  # [b, k] -> [b, k]
        """The unemittable positions of a chain (see :meth:`Step._unemittable`) at ``-inf``."""
        depth = arange_constant(scores.shape[1] + 1, scores.device)[1:]  # [k] 1..k
        is_eos = self.state.is_eos(tokens)  # [b, k]
        below_eos = is_eos.cumsum(dim=1, dtype=torch.int64) > is_eos  # after the first EOS
        return scores.masked_fill(self._unemittable(depth, below_eos), NEG_INF)


class TreeStep(Step):
    """Tree steps: draft a tree per slot, select nodes, verify all nodes with the tree mask.

    The verify pass sends each slot's root (the pending token) and the nodes a row may select
    (``selector.max_selected``; on a CPU in eager mode the widest row's selection), each row's
    selected nodes first, in index order (parents before children), the others as holes, with
    the tree's ancestor mask and positions ``root position + depth``; both caches keep only the
    accepted path.
    """

    def __init__(self, *args: Any, tree: TreeSpec, **kwargs: Any) -> None:
        """:class:`Step`'s arguments, and the shape drafted every step (cut to the plan's
        depth)."""
        super().__init__(*args, **kwargs)
        self.tree = tree

    def requested_depth(self) -> int:
        state = self.state
        assert self.selector is not None
        # The selector's draft length caps the depth (no selector verifies deeper than it
        # drafts a chain); deeper nodes than a row's remaining tokens are unemittable.
        window = check_int("selector.draft_length()", self.selector.draft_length(state.num_active))
        return draftable_depth(min(self.tree.depth, window), state.most_remaining)

    def plan_at(self, depth: int) -> Plan:
        drafter, state = self._drafter(), self.state
        assert self.selector is not None
        if depth == 0:  # no row can emit a draft token: a plain step
            return Plan(0, 1, drafter.footprint(0), ("tree", 0, drafter.width))
        spec = replace(self.tree, depth=depth)
        # The verify pass sends the nodes a row may select (the selector's host bound), not
        # the whole tree: the holes would cost compute where a pass is compute-bound.
        bound = self.selector.max_selected(spec.num_nodes, state.num_active)
        sent = min(spec.num_nodes, check_int("selector.max_selected()", bound))
        key = ("tree", depth, drafter.width)
        return Plan(depth, 1 + sent, drafter.tree_footprint(spec), key)

    def draft(self, plan: Plan) -> None:
        state = self.state
        drafter = self._drafter()
        active = state.active[: state.size].to(drafter.handle.device)
        tree = drafter.draft_tree(active, self._spec(plan)).to(state.device)
        buffers = build_tree_buffers(tree.parents, max_depth=plan.width)  # (the spec's depth)
        stored, stored_buffers = self._trees(plan)
        stored.copy_(tree)
        stored_buffers.ancestors.copy_(buffers.ancestors)
        stored_buffers.paths.copy_(buffers.paths)
        scores = self._mask_unemittable_nodes(
            tree, buffers, self._tree_scores(tree, drafter.sampled)
        )
        self._io("scores", (*scores.shape,), torch.float32).copy_(scores)
        self._lookup(tree.tokens, buffers.paths)

    def select(self, plan: Plan) -> None:
        self.selection = None
        if plan.width == 0 or self.selector is None:
            return
        state = self.state
        size, nodes = state.size, self._spec(plan).num_nodes
        scores = self._io("scores", (size, nodes), torch.float32)
        parents = self._trees(plan)[0].parents
        self.selection = self.selector.select(
            state.to_full(scores, NEG_INF),
            state.active_rows(),
            parents=state.to_full(parents, -1),
            features=self._features(nodes),
        )
        # A selector that broke its contract must not verify nodes no row can emit, nor more
        # nodes than the verify pass holds (the first ones in index order stay closed under
        # ancestors: parents come first).
        usable = path_sums(scores, parents) > NEG_INF
        selected = state.to_slots(self.selection.mask) & usable & state.active[:size].unsqueeze(1)
        sent = plan.target_columns - 1
        if sent < nodes:
            selected = selected & (selected.to(torch.int64).cumsum(dim=1) <= sent)  # [b, N]
        self._io("selected", (size, nodes), torch.bool).copy_(selected)

    def _selected_counts(self, plan: Plan) -> Tensor:  # -> [b] int64
        selected = self._io("selected", (self.state.size, self._spec(plan).num_nodes), torch.bool)
        return selected.sum(dim=1)

    def verify(self, plan: Plan) -> None:
        if plan.width == 0:
            self._verify_chain(0, 0)
            return
        state = self.state
        size, nodes = state.size, self._spec(plan).num_nodes
        tree, buffers = self._trees(plan)
        selected = self._io("selected", (size, nodes), torch.bool)
        active = state.active[:size].unsqueeze(1)
        # The block: the root and every node, or the root and the W nodes sent.
        sent = _sent_nodes(selected, plan.target_columns - 1)  # [b, W + 1] or None
        root = torch.zeros(size, 1, dtype=torch.int64, device=state.device)
        ids = torch.cat([state.pending[:size].unsqueeze(1), tree.tokens], dim=1)  # [b, N + 1]
        valid = torch.cat([active, selected & active], dim=1)  # [b, N + 1]
        depth = torch.cat([root, tree.depth], dim=1)  # [b, N + 1]
        logits = state.target.forward(
            _pick(ids, sent),
            _pick(valid, sent),
            depth=_pick(depth, sent),
            block_mask=_pick_square(buffers.attention_mask(), sent),
        ).to(state.device)  # [b, W + 1, V]
        logits = _place(logits, sent, nodes + 1)  # [b, N + 1, V]
        verdict = self._verdict(tree, buffers, selected, logits, plan.width)
        node_ids = arange_constant(nodes, state.device)
        on_path = (node_ids.view(1, -1, 1) == verdict.path.unsqueeze(1)).any(dim=2)  # [b, N]
        kept = torch.cat([torch.ones_like(active), on_path], dim=1)  # [b, N + 1]
        state.target.commit(_pick(kept, sent))
        drafter = self._drafter()
        d = drafter.handle.device
        drafter.advance_tree(
            tree.to(d),
            verdict.path[:, : plan.width].to(d),
            verdict.last_node.to(d),
            verdict.next_token.to(d),
        )
        self._io("on_path", (size, nodes), torch.bool).copy_(on_path)
        accepted = verdict.accepted_tokens(tree.tokens)[:, : plan.width]  # [b, depth]
        deepest = torch.where(selected, tree.depth, 0).amax(dim=1)  # [b]
        self._finish(
            accepted, verdict.num_accepted, verdict.next_token, selected.sum(dim=1), deepest
        )

    def _accepted_nodes(self) -> Tensor:  # [B, N] bool
        state = self.state
        assert self.selection is not None
        nodes = self.selection.mask.shape[1]
        return state.to_full(self._io("on_path", (state.size, nodes), torch.bool), False)

    # ------------------------------------------------------------------ helpers
    def _drafter(self) -> TreeDrafter:
        drafter = self.state.drafter
        assert isinstance(drafter, TreeDrafter)
        return drafter

    def _spec(self, plan: Plan) -> TreeSpec:
        return replace(self.tree, depth=plan.width)

    def _trees(self, plan: Plan) -> tuple[DraftTree, TreeBuffers]:
        """The persistent buffers holding this step's draft trees and their derived buffers.

        Shapes follow from the plan alone, so the verify stage finds what the draft stage wrote
        even when both are replays.
        """
        state = self.state
        spec = self._spec(plan)
        size, nodes, fed = state.size, spec.num_nodes, spec.fed_nodes()
        vocab = state.target.handle.vocab

        def io(name: str, *shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return self._io(f"tree_{name}", (size, *shape), dtype)

        probs = None  # only sampling verifies against the draft's distributions
        if self.params.do_sample:
            probs = io("probs", nodes + 1, vocab, dtype=self._probs_dtype())
        tree = DraftTree(
            tokens=io("tokens", nodes),
            logprobs=io("logprobs", nodes, dtype=torch.float32),
            parents=io("parents", nodes),
            depth=io("depth", nodes),
            probs=probs,
            fed=io("fed", nodes, dtype=torch.bool),
            fed_ids=io("fed_ids", fed),
        )
        buffers = TreeBuffers(
            parents=tree.parents,
            ancestors=io("ancestors", nodes, nodes, dtype=torch.bool),
            depth=tree.depth,
            paths=io("paths", nodes, spec.depth),
        )
        return tree, buffers

    def _verdict(
        self,
        tree: DraftTree,
        buffers: TreeBuffers,
        selected: Tensor,  # [b, N] bool
        logits: Tensor,  # [b, N + 1, V]
        depth: int,
    ) -> TreeVerdict:
        """Greedy path matching or lossless tree sampling on the target's block output."""
        if not self.params.do_sample:
            return tree_greedy_verify(tree.tokens, selected, buffers, logits)
        assert tree.probs is not None
        return tree_rejection_verify(
            tree.tokens,
            selected,
            buffers,
            tree.probs,
            self._target_probs(logits, tree.probs),
            sampled_children=self._drafter().sampled,
            max_depth=depth,
            max_children=self.tree.branch,
            generator=self.generator,
        )

    def _tree_scores(self, tree: DraftTree, sampled: bool) -> Tensor:  # -> [b, N]
        """Node scores for the selector (:func:`_selection_scores`): a sampled node was drawn
        from its parent's distribution (``tree.probs`` row ``parent + 1``, the root's first);
        deterministic (top-k) children are judged by their own log q."""
        expected = None
        if sampled:
            assert tree.probs is not None
            expected = expected_self_logprob(tree.probs).gather(1, tree.parents + 1)  # [b, N]
        return _selection_scores(tree.logprobs, expected, tree.parents)

    def _mask_unemittable_nodes(
        self, tree: DraftTree, buffers: TreeBuffers, scores: Tensor
    ) -> Tensor:  # [b, N] -> [b, N]
        """The unemittable nodes of a tree (see :meth:`Step._unemittable`) at ``-inf``."""
        nodes = tree.tokens.shape[1]
        eye = torch.eye(nodes, dtype=torch.bool, device=scores.device)
        is_eos = self.state.is_eos(tree.tokens)  # [b, N]
        below_eos = (buffers.ancestors & ~eye & is_eos.unsqueeze(1)).any(dim=2)  # [b, N]
        return scores.masked_fill(self._unemittable(tree.depth, below_eos), NEG_INF)


def _sent_nodes(selected: Tensor, width: int) -> Tensor | None:  # [b, N] -> [b, width + 1]
    """Columns of ``[root, N nodes]`` a tree's verify pass sends, or ``None`` for all of them
    (``width == N``): the root, then ``width`` nodes, the selected ones first and each group
    in index order (a stable sort), so that parents still come before their children."""
    rows, nodes = selected.shape
    if width == nodes:
        return None
    order = torch.sort((~selected).to(torch.int8), dim=1, stable=True).indices  # [b, N]
    root = torch.zeros(rows, 1, dtype=torch.int64, device=selected.device)
    return torch.cat([root, order[:, :width] + 1], dim=1)


def _pick(values: Tensor, sent: Tensor | None) -> Tensor:  # [b, M] -> [b, W]
    """The columns ``sent`` of ``values`` (all of them for ``None``)."""
    return values if sent is None else values.gather(1, sent)


def _pick_square(mask: Tensor, sent: Tensor | None) -> Tensor:  # [b, M, M] -> [b, W, W]
    """``mask[b][sent[b]][:, sent[b]]``: the sub-matrix among the columns sent."""
    if sent is None:
        return mask
    rows, width = sent.shape
    size = mask.shape[1]
    picked = mask.gather(1, sent.unsqueeze(2).expand(rows, width, size))  # [b, W, M]
    return picked.gather(2, sent.unsqueeze(1).expand(rows, width, width))


def _place(values: Tensor, sent: Tensor | None, size: int) -> Tensor:  # -> [b, size, V]
    """``[b, W, V]`` values of the columns ``sent`` placed among ``size`` columns of zeros
    (the columns not sent: unselected nodes, whose logits no verification reads)."""
    if sent is None:
        return values
    rows, width, vocab = values.shape
    placed = values.new_zeros(rows, size, vocab)
    return placed.scatter_(1, sent.unsqueeze(2).expand(rows, width, vocab), values)


def _selection_scores(
    logprobs: Tensor,  # [b, n] log q of each drafted token (node)
    expected: Tensor | None,  # [b, n] expected self log-prob of the distribution it came from
    parents: Tensor | None = None,  # [b, n] for a tree
) -> Tensor:  # -> [b, n]
    """What the selector sees, for chains and trees alike: draft log-probs, made causal when
    the tokens were sampled (``expected`` given).

    A selector that judged a *sampled* token by its own probability would bias speculative
    sampling (:mod:`specselect.scores`); greedy drafts are functions of their prefix and may be
    judged by their own probability. A NaN (draft logits at +inf or NaN) becomes ``-inf``, a
    token never selected: ranked, it would fail an estimator's table lookup. Greedy output
    does not depend on the draft; sampling verification reports the NaN in its distribution.
    """
    scores = logprobs if expected is None else causal_logprobs(logprobs, expected, parents)
    return scores.masked_fill(scores.isnan(), -math.inf)  # (-inf stays -inf: never selected)


def _now() -> float:
    return time.perf_counter()


__all__ = ["PHASES", "ChainStep", "Plan", "Step", "TreeStep"]
