"""Tree drafting (EAGLE-2 style): a few wide draft passes grow one static-shape tree per row.

A :class:`TreeSpec` ``(depth, branch, width)`` describes the tree every row gets:

* level 1 holds the ``branch`` children of the root (the pending token): the top-``branch``
  tokens of the draft distribution ``q`` after the root, or ``branch`` independent draws from
  ``q`` when sampling with ``sampled_children``;
* each further level expands the ``width`` nodes of the previous level with the best path scores
  (sum of log q from the root), ``branch`` children each, after ONE draft pass over those
  ``width`` frontier nodes per row.

So a step costs ``depth`` draft passes (the first also absorbs the backlog, as in chain
drafting) and yields ``N = branch + sum over later levels of min(width, previous level) * branch``
nodes per row (``branch + (depth - 1) * width * branch`` when ``width <= branch``). Shapes are
static: rows are never trimmed, and nodes a row cannot use are masked later by the loop
(``-inf`` scores).

The draft's cache follows the same backlog rule as :class:`~specselect.hf.draft.ChainDrafter`
(which this class extends): the frontier nodes were fed to the draft, the leaves were not. After
verification only the accepted path's frontier columns are committed; if the last accepted node
was never fed (a leaf, or a node outside every frontier) it joins the pending token in the next
backlog. What the commit needs (which nodes were fed, in which cache column) travels with the
:class:`DraftTree`, so drafting and verification can be separate captured stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from specselect.constants import arange_constant
from specselect.hf.compat import ModelHandle
from specselect.hf.draft import ChainDrafter, SamplingParams, align_vocab, move
from specselect.sampling import sample_from
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.tree import TreeSpec, path_sums


@dataclass(frozen=True)
class DraftTree:
    """One step's draft trees, one per row, nodes level by level (parents come first).

    ``B`` is the step's rows (inactive ones are drafted from holes), ``N`` the nodes per row
    (:meth:`~specselect.tree.TreeSpec.level_sizes` summed), ``V`` the target's logit width
    and ``T`` the frontier nodes fed to the draft in the step
    (:meth:`~specselect.tree.TreeSpec.fed_nodes`). Every row has the same nodes per level;
    which nodes each row expands, and so ``parents``, differ.

    Attributes:
        tokens: ``[B, N]`` int64, each node's token.
        logprobs: ``[B, N]`` float32 or wider, ``log q`` of each node's token under its
            parent's ``q`` (greedy: the unprocessed log-softmax; sampling: the processed
            ``q``).
        parents: ``[B, N]`` int64, the parent's node index, ``-1`` for children of the root.
        depth: ``[B, N]`` int64, each node's level, ``>= 1`` (the same in every row).
        probs: ``[B, N + 1, V]`` float32 or wider (the draft's dtype, at least float32), the
            processed ``q`` after the root (column 0) and after node ``j`` (column ``j + 1``),
            zero for nodes that were not fed; ``None`` when greedy.
        fed: ``[B, N]`` bool, the node was fed to the draft (a frontier node): its draft cache
            entry exists, and its children were drafted from it.
        fed_ids: ``[B, T]`` int64, the node fed in each draft cache column after the backlog,
            frontier by frontier (what
            :meth:`~specselect.hf.tree_draft.TreeDrafter.advance_tree` commits along the
            accepted path).
    """

    tokens: Tensor  # [B, N] int64
    logprobs: Tensor  # [B, N] float32: log q of each node's token under its parent's q
    parents: Tensor  # [B, N] int64, -1 = child of the root
    depth: Tensor  # [B, N] int64, >= 1
    probs: Tensor | None  # [B, N + 1, V]: q after the root (col 0) and after node j (col j + 1)
    fed: Tensor  # [B, N] bool: the node was fed to the draft (a frontier node)
    fed_ids: Tensor  # [B, T] int64: the node fed in each cache column after the backlog

    def to(self, device: torch.device) -> DraftTree:
        return DraftTree(
            move(self.tokens, device),
            move(self.logprobs, device),
            move(self.parents, device),
            move(self.depth, device),
            None if self.probs is None else move(self.probs, device),
            move(self.fed, device),
            move(self.fed_ids, device),
        )

    def copy_(self, other: DraftTree) -> None:
        """Fill these trees' tensors in place with ``other``'s (persistent buffers, which a
        captured stage reads); ``probs`` where both hold them (only sampling drafts them)."""
        for part in fields(self):
            mine, theirs = getattr(self, part.name), getattr(other, part.name)
            if mine is not None and theirs is not None:
                mine.copy_(theirs)


def pick_children(
    logits: Tensor,  # [B, F, V]
    count: int,
    params: SamplingParams,
    sampled: bool,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor | None]:  # [B, F, count] x2, [B, F, V] | None
    """``count`` children of each of ``F`` nodes per row: ``(tokens, log q(token), q)``.

    Greedy: the top-``count`` tokens, scored by the unprocessed log-softmax (as chain drafting
    scores its argmax). Sampling: ``q`` is the processed distribution, which verification needs
    whole; children are ``count`` independent draws from it (``sampled``) or its top-``count``
    tokens (a token outside the top-k/top-p support gets log q = -inf and is never verified).
    """
    if not params.do_sample:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(count, dim=-1)
        return top.indices, top.values, None
    probs = params.probs(logits)  # [B, F, V]
    if sampled:
        expanded = probs.unsqueeze(2).expand(-1, -1, count, -1)  # [B, F, count, V]
        tokens = sample_from(expanded, generator)
        return tokens, probs.gather(2, tokens).log(), probs
    top = probs.topk(count, dim=-1)
    return top.indices, top.values.log(), probs


class TreeDrafter(ChainDrafter):
    """The draft model's side of the tree loop: chain bookkeeping plus :meth:`draft_tree`.

    Args:
        handle: the checked draft model.
        slots: rows allocated.
        capacity: columns per row of the draft's cache.
        vocab: the target's logit width (draft logits are aligned to it).
        params: token choice, identical to the target's.
        generator: RNG on the draft's device (sampling only).
        sampled_children: see :class:`TreeSpec` (sampling only).
        static_span: see :class:`~specselect.hf.kv.ModelCache` (``True`` for graph mode).
    """

    def __init__(
        self,
        handle: ModelHandle,
        slots: int,
        capacity: int,
        vocab: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        sampled_children: bool = True,
        *,
        static_span: bool = True,
    ) -> None:
        super().__init__(handle, slots, capacity, vocab, params, generator, static_span=static_span)
        self.sampled = sampled_children and params.do_sample

    def tree_footprint(self, spec: TreeSpec) -> int:
        """Cache columns a step drafting ``spec`` writes: the backlog, then every frontier."""
        return self.width + spec.fed_nodes()

    def draft_tree(self, active: Tensor, spec: TreeSpec) -> DraftTree:  # active [b] bool
        """Draft one tree per slot in ``spec.depth`` passes (the first one feeds the backlog).

        Inactive slots feed holes. Device work only.
        """
        sizes = spec.level_sizes()
        nodes = sum(sizes)
        batch, device = active.shape[0], self.handle.device
        backlog_valid = self.backlog_valid[:batch, : self.width] & active.unsqueeze(1)
        base = backlog_valid.sum(dim=1, keepdim=True)  # [B, 1] depth offset of level 1
        logits = self.cache.forward(
            self._embeddable(self.backlog[:batch, : self.width]), backlog_valid, last_only=True
        )
        dist = align_vocab(logits[:, -1:], self.vocab)  # [B, 1, V]
        strict = torch.zeros(batch, nodes, nodes, dtype=torch.bool, device=device)  # ancestors
        fed = torch.zeros(batch, nodes, dtype=torch.bool, device=device)
        after = None
        if self.params.do_sample:
            after = torch.zeros(batch, nodes + 1, self.vocab, dtype=self.probs_dtype, device=device)
        fed_ids = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        frontier = torch.full((batch, 1), -1, dtype=torch.int64, device=device)  # [B, F] parents
        levels = _Levels()
        for level, size in enumerate(sizes, start=1):
            token, logprob, probs = pick_children(
                dist, spec.branch, self.params, self.sampled, self.generator
            )  # [B, F, branch]
            if after is not None and probs is not None:
                after = _scatter_rows(after, frontier + 1, probs)
            parent = frontier.unsqueeze(2).expand_as(token).reshape(batch, size)
            strict = _inherit_ancestors(strict, parent, levels.nodes)
            levels.add(token, logprob, parent, probs if self.sampled else None)
            if level == spec.depth:
                break
            # Sampled children are expanded by their causal scores, which do not depend on their
            # own tokens: expanding by log q would make a later sibling's verification depend on
            # its own token (through its rivals' children), which biases the output.
            ranking = levels.causal_scores() if self.sampled else levels.scores[-1]
            offset = levels.nodes - size
            frontier = ranking.topk(min(spec.width, size), dim=1).indices + offset  # [B, F']
            fed = fed.scatter(1, frontier, True)
            at = base - 1 + level  # [B, 1] the frontier's depth argument
            logits = self._feed_frontier(levels, frontier, strict, fed_ids, active, at)
            dist = align_vocab(logits, self.vocab)  # [B, F', V]
            fed_ids = torch.cat([fed_ids, frontier], dim=1)
        depth = _level_of_nodes(sizes, device).expand(batch, -1)  # [B, N]
        return DraftTree(
            torch.cat(levels.tokens, dim=1),
            torch.cat(levels.logprobs, dim=1),
            torch.cat(levels.parents, dim=1),
            depth,
            after,
            fed,
            fed_ids,
        )

    def _feed_frontier(
        self,
        levels: _Levels,
        frontier: Tensor,  # [B, F] int64: the nodes to expand
        strict: Tensor,  # [B, N, N] bool strict ancestors
        fed_ids: Tensor,  # [B, T] int64 nodes fed earlier this step
        active: Tensor,  # [B] bool
        depth: Tensor,  # [B, 1] int64: the frontier's depth argument of ModelCache.forward
    ) -> Tensor:  # [B, F, V] logits
        """One draft pass over the frontier nodes, each seeing the backlog and its own fed
        ancestors only (a block-diagonal mask: siblings do not see each other)."""
        batch, width = frontier.shape
        feed = torch.cat(levels.tokens, dim=1).gather(1, frontier)  # [B, F]
        eye = torch.eye(width, dtype=torch.bool, device=frontier.device)
        return self.cache.forward(
            self._embeddable(feed),
            active.unsqueeze(1).expand(batch, width),
            depth=depth.expand_as(feed),
            block_mask=eye.expand(batch, -1, -1),
            past_mask=_frontier_past(strict, frontier, fed_ids, self.width),
        )

    def advance_tree(
        self,
        tree: DraftTree,
        path: Tensor,  # [B, D] int64, -1 padded
        last_node: Tensor,  # [B] int64, -1 = root
        next_token: Tensor,  # [B] int64
    ) -> None:
        """Commit the accepted path's draft entries and set the next backlog.

        All tensors on the draft's device; device work only.
        """
        rows = next_token.shape[0]
        on_path = (tree.fed_ids.unsqueeze(2) == path.unsqueeze(1)).any(dim=2)  # [B, T]
        self.cache.commit(torch.cat([self.backlog_valid[:rows, : self.width], on_path], dim=1))
        node = last_node.clamp(min=0).unsqueeze(1)
        unseen = (last_node >= 0) & ~tree.fed.gather(1, node).squeeze(1)
        token = tree.tokens.gather(1, node).squeeze(1)
        self.backlog[:rows, 0] = torch.where(unseen, token, 0)
        self.backlog[:rows, 1] = next_token
        self.backlog_valid[:rows, 0] = unseen
        self.backlog_valid[:rows, 1].fill_(True)


@dataclass
class _Levels:
    """The levels of one step's trees drafted so far, each ``[B, size]``."""

    tokens: list[Tensor] = field(default_factory=list)  # int64
    logprobs: list[Tensor] = field(default_factory=list)  # log q under the parent's q
    parents: list[Tensor] = field(default_factory=list)  # int64 global node index, -1 = root
    scores: list[Tensor] = field(default_factory=list)  # path scores (sum of log q)
    expected: list[Tensor] = field(default_factory=list)  # sampled: log E_q[q] of each q

    @property
    def nodes(self) -> int:
        """Nodes drafted so far (a new level's first global index)."""
        return sum(level.shape[1] for level in self.tokens)

    def add(
        self,
        token: Tensor,  # [B, F, branch] int64
        logprob: Tensor,  # [B, F, branch]
        parent: Tensor,  # [B, F * branch] int64
        probs: Tensor | None,  # [B, F, V]: the q each was drawn from, when sampled
    ) -> None:
        """Append a level: ``branch`` children of each of ``F`` frontier nodes."""
        shape = parent.shape
        self.tokens.append(token.reshape(shape))
        self.logprobs.append(logprob.reshape(shape))
        self.parents.append(parent)
        self.scores.append(_child_scores(self.scores, parent, self.logprobs[-1]))
        if probs is not None:
            own = expected_self_logprob(probs).unsqueeze(2).expand_as(logprob)  # [B, F, br]
            self.expected.append(own.reshape(shape))

    def causal_scores(self) -> Tensor:  # [B, size of the last level]
        """Causal path scores (:func:`~specselect.scores.causal_logprobs`) of the newest
        level (sampled levels only)."""
        tree_parents = torch.cat(self.parents, dim=1)
        increments = causal_logprobs(
            torch.cat(self.logprobs, dim=1), torch.cat(self.expected, dim=1), tree_parents
        )
        return path_sums(increments, tree_parents)[:, -self.logprobs[-1].shape[1] :]


def _level_of_nodes(sizes: tuple[int, ...], device: torch.device) -> Tensor:  # [N] int64
    """Depth (1-based level) of each node of a tree with ``sizes`` nodes per level, built from
    device ops alone (a tensor made from a host list could not be captured in a CUDA graph)."""
    node = torch.arange(sum(sizes), device=device)
    depth = torch.ones_like(node)
    start = 0
    for size in sizes[:-1]:
        start += size
        depth += node >= start
    return depth


def _scatter_rows(
    buffer: Tensor,  # [B, M, V]
    index: Tensor,  # [B, F] int64
    rows: Tensor,  # [B, F, V]
) -> Tensor:  # [B, M, V]
    """``buffer[b, index[b, f]] = rows[b, f]``, out of place."""
    return buffer.scatter(1, index.unsqueeze(2).expand_as(rows), rows.to(buffer.dtype))


def _child_scores(
    previous: list[Tensor],  # per level [B, size]
    parent: Tensor,  # [B, S] int64 global node index, -1 = root
    logprobs: Tensor,  # [B, S]
) -> Tensor:  # [B, S]
    """Path scores of a new level: the parent's path score plus the child's log q."""
    if not previous:
        return logprobs.float()
    known = torch.cat(previous, dim=1)
    return known.gather(1, parent.clamp(min=0)) + logprobs


def _inherit_ancestors(
    strict: Tensor,  # [B, N, N] bool
    parent: Tensor,  # [B, S] int64
    offset: int,
) -> Tensor:  # [B, N, N]
    """Strict ancestors of the new nodes ``offset .. offset + S``: the parent's plus the parent."""
    nodes = strict.shape[1]
    safe = parent.clamp(min=0)
    inherited = strict.gather(1, safe.unsqueeze(2).expand(-1, -1, nodes))  # [B, S, N]
    # A comparison, not F.one_hot: one_hot checks its values on the host (a sync).
    itself = safe.unsqueeze(2) == arange_constant(nodes, parent.device)  # [B, S, N]
    strict = strict.clone()
    strict[:, offset : offset + parent.shape[1]] = (inherited | itself) & (parent >= 0).unsqueeze(2)
    return strict


def _frontier_past(
    strict: Tensor,  # [B, N, N] bool
    chosen: Tensor,  # [B, F] int64 frontier nodes
    fed_ids: Tensor,  # [B, T] int64 nodes fed earlier this step (after the backlog's columns)
    backlog: int,
) -> Tensor:  # [B, F, backlog + T] bool
    """Which of this step's uncommitted cache columns a frontier node may see: the backlog and,
    among the fed nodes, only its own ancestors (committed columns are always visible)."""
    batch, count = chosen.shape
    nodes = strict.shape[1]
    rows = strict.gather(1, chosen.unsqueeze(2).expand(-1, -1, nodes))  # [B, F, N]
    ancestors = rows.gather(2, fed_ids.unsqueeze(1).expand(-1, count, -1))  # [B, F, T]
    before = torch.ones(batch, count, backlog, dtype=torch.bool, device=chosen.device)
    return torch.cat([before, ancestors], dim=2)
