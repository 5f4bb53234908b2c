"""One tree step: draft a tree per row, select nodes, verify with the tree mask, keep a path.

The ``tree=TreeSpec(...)`` counterpart of :mod:`specselect.hf.chain_step`. :class:`TreeSteps`
adds the tree-specific part of a step to :class:`~specselect.hf.step_state.StepState`: drafting
a tree (:class:`~specselect.hf.tree_draft.TreeDrafter`), node scores with unemittable nodes
masked, the selector's choice of nodes (``parents=``), one target pass over the root and the
selected nodes with the tree's ancestor mask, :func:`~specselect.verify_tree.tree_greedy_verify`
or :func:`~specselect.verify_tree.tree_rejection_verify`, and both caches keeping only the
accepted path. Emission, the read-back, statistics, retiring and compaction are the shared ones
of :class:`~specselect.hf.step_state.StepState`. Host sync here: the verify width in
:meth:`TreeSteps._tree_step`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor

from specselect.hf.cache import forward_block
from specselect.hf.step_state import StepState
from specselect.hf.tree_draft import DraftTree, TreeDrafter
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.selection import NEG_INF, Selection
from specselect.tree import TreeBuffers, build_tree_buffers, path_sums
from specselect.verify_tree import TreeVerdict, tree_greedy_verify, tree_rejection_verify


class TreeSteps(StepState):
    """Tree steps (tree-mask verification) on top of the shared generation state."""

    def _tree_step(self) -> int:
        """One step with draft trees: draft, select nodes, one target pass, walk the tree.

        Same bookkeeping and host syncs as
        :meth:`~specselect.hf.chain_step.ChainSteps._step`. The target pass sends each row's
        root (the pending token) and its selected nodes, selected nodes first and padded to the
        largest selection (padding columns become holes), with the tree's ancestor mask and
        positions ``root position + depth``; both caches keep only the accepted path.
        """
        start = time.perf_counter()
        assert self.tree is not None and isinstance(self.drafter, TreeDrafter)
        sampled = self.drafter.sampled  # children drawn independently from q
        most = max(self.options.max_new_tokens - self.generated_host[r] for r in self.row_ids)
        depth = min(self.tree.depth, most - 1)  # deeper nodes could not be emitted by any row
        draft = (
            self.drafter.draft_tree(replace(self.tree, depth=depth)).to(self.device)
            if depth > 0
            else self._empty_tree()
        )
        buffers = build_tree_buffers(draft.parents)
        selection: Selection | None = None
        if depth > 0:
            scores = self._mask_unemittable_nodes(draft, buffers, self._tree_scores(draft, sampled))
            selection = self.selector.select(
                self._to_full(scores, NEG_INF),
                self.active_full,
                parents=self._to_full(draft.parents, -1),
            )
            # A selector that broke its contract must not verify nodes no row can emit.
            usable = path_sums(scores, draft.parents) > NEG_INF
            selected = self._to_active(selection.mask) & usable  # [B_a, N]
        else:
            selected = torch.zeros_like(draft.tokens, dtype=torch.bool)
        lengths = selected.sum(dim=1)
        width = 1 + int(lengths.max()) if depth > 0 else 1  # host sync 1: the verify width
        drafted = time.perf_counter()

        # Selected nodes first, in index order (so parents stay before children).
        order = torch.sort((~selected).to(torch.uint8), dim=1, stable=True).indices
        order = order[:, : width - 1]  # [B_a, W - 1]
        logits = self._tree_target_pass(draft, buffers, selected, order)
        verdict = self._tree_verify(draft, buffers, selected, logits, order, depth, sampled)
        nodes = torch.arange(draft.tokens.shape[1], device=self.device)
        on_path = (nodes.view(1, -1, 1) == verdict.path.unsqueeze(1)).any(dim=2)  # [B_a, N]
        root = torch.ones_like(lengths, dtype=torch.bool).unsqueeze(1)
        self.cache.commit(torch.cat([root, on_path.gather(1, order)], dim=1))
        accepted_tokens = verdict.accepted_tokens(draft.tokens)[:, :depth]  # [B_a, depth]
        written, finished = self._emit(
            accepted_tokens, verdict.num_accepted, verdict.next_token, depth + 1
        )
        d = self.draft.device
        if depth > 0:
            self.drafter.advance_tree(
                verdict.path[:, :depth].to(d), verdict.last_node.to(d), verdict.next_token.to(d)
            )
        else:
            self.drafter.skip(verdict.next_token.to(d))
        self.pending = verdict.next_token
        if selection is not None:
            self.selector.update(
                selection,
                self._to_full(verdict.num_accepted, 0),
                accepted_nodes=self._to_full(on_path, False),
            )
        return self._finish_step(start, drafted, finished, lengths, verdict.num_accepted, written)

    def _empty_tree(self) -> DraftTree:
        """A tree without nodes, for steps where no row can emit a draft token."""
        rows = len(self.row_ids)
        none = torch.zeros(rows, 0, dtype=torch.int64, device=self.device)
        probs = None
        if self.params.do_sample:
            probs = torch.zeros(rows, 1, self.target.vocab, device=self.device)
        return DraftTree(none, none.float(), none, none, probs)

    def _tree_scores(self, draft: DraftTree, sampled: bool) -> Tensor:  # -> [B_a, N]
        """Node scores for the selector: causal ones for sampled children (see
        :func:`~specselect.hf.chain_step._selection_scores`); raw log q for deterministic
        (top-k) children. ``sampled`` is the drafter's :attr:`TreeDrafter.sampled`."""
        if not sampled:
            return draft.logprobs
        assert draft.probs is not None
        expected = expected_self_logprob(draft.probs)  # [B_a, N + 1]
        return causal_logprobs(draft.logprobs, expected.gather(1, draft.parents + 1), draft.parents)

    def _mask_unemittable_nodes(
        self, draft: DraftTree, buffers: TreeBuffers, scores: Tensor
    ) -> Tensor:  # [B_a, N] -> [B_a, N]
        """``-inf`` for nodes that could not be emitted: depth >= remaining, or below an EOS."""
        remaining = self.options.max_new_tokens - self.generated  # [B_a]
        cut = draft.depth >= remaining.unsqueeze(1)
        if self.eos.numel():
            nodes = draft.tokens.shape[1]
            eye = torch.eye(nodes, dtype=torch.bool, device=self.device)
            is_eos = torch.isin(draft.tokens, self.eos)  # [B_a, N]
            cut = cut | (buffers.ancestors & ~eye & is_eos.unsqueeze(1)).any(dim=2)
        return scores.masked_fill(cut, NEG_INF)

    def _tree_target_pass(
        self,
        draft: DraftTree,
        buffers: TreeBuffers,
        selected: Tensor,  # [B_a, N] bool
        order: Tensor,  # [B_a, W - 1] int64 node sent in each block column after the root
    ) -> Tensor:  # [B_a, W, V]
        """The target's logits for ``[root, nodes order]`` per row, with the tree mask."""
        rows, nodes = draft.tokens.shape
        count = order.shape[1]
        among = buffers.ancestors.gather(1, order.unsqueeze(2).expand(-1, -1, nodes))
        among = among.gather(2, order.unsqueeze(1).expand(-1, count, -1))  # [B_a, W-1, W-1]
        sees_root = torch.ones(rows, count, 1, dtype=torch.bool, device=self.device)
        root_row = torch.zeros(rows, 1, count + 1, dtype=torch.bool, device=self.device)
        root_row[:, :, 0] = True
        block_mask = torch.cat([root_row, torch.cat([sees_root, among], dim=2)], dim=1)
        first = torch.ones(rows, 1, dtype=torch.bool, device=self.device)
        logits = forward_block(
            self.target,
            self.cache,
            torch.cat([self.pending.unsqueeze(1), draft.tokens.gather(1, order)], dim=1),
            torch.cat([first, selected.gather(1, order)], dim=1),
            depth=torch.cat(
                [torch.zeros_like(first, dtype=torch.int64), draft.depth.gather(1, order)], dim=1
            ),
            block_mask=block_mask,
        )
        return logits.to(self.device)

    def _tree_verify(
        self,
        draft: DraftTree,
        buffers: TreeBuffers,
        selected: Tensor,  # [B_a, N] bool
        logits: Tensor,  # [B_a, W, V]
        order: Tensor,  # [B_a, W - 1] int64
        depth: int,
        sampled: bool,  # the drafter's TreeDrafter.sampled
    ) -> TreeVerdict:
        """Greedy path matching or lossless tree sampling on the target's block output."""
        values = logits if not self.params.do_sample else self.params.probs(logits)
        rows, nodes = draft.tokens.shape
        # Back to one column per node (column j + 1 = after node j); unselected nodes get 0.
        per_node = values.new_zeros(rows, nodes, values.shape[2])
        per_node = per_node.scatter(
            1, order.unsqueeze(2).expand(-1, -1, values.shape[2]), values[:, 1:]
        )
        full = torch.cat([values[:, :1], per_node], dim=1)  # [B_a, N + 1, V]
        if not self.params.do_sample:
            return tree_greedy_verify(draft.tokens, selected, buffers, full)
        assert draft.probs is not None and self.tree is not None
        return tree_rejection_verify(
            draft.tokens,
            selected,
            buffers,
            draft.probs,
            full,
            sampled_children=sampled,
            max_depth=depth,
            max_children=self.tree.branch,
            generator=self.generator,
        )


__all__ = ["TreeSteps"]
