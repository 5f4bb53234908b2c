"""Verification of draft trees: greedy path matching and lossless multi-candidate sampling.

The target scores a whole batch of trees in one pass (see :mod:`specselect.tree` for the masks):
column 0 of its output is the prediction after the root (the last emitted token) and column
``j + 1`` the prediction after node ``j``. Verification then walks each tree from the root and
keeps one root-to-node path; the request emits that path plus one target token.

Greedy: a node survives if it is selected, equals the target's argmax after its parent, and so do
all its ancestors; the deepest survivor (lowest index among equals) ends the accepted path.

Sampling: at the current node, the selected children are tried in index order against a running
target distribution ``r`` (initially ``p``): child ``x`` proposed from ``q_c`` is accepted with
probability ``min(1, r(x) / q_c(x))``; a rejection replaces ``r`` by ``norm(max(r - q_c, 0))``.
If no child is accepted, the next token is drawn from the final ``r``. With ``q_c`` the draft
distribution at the parent this is SpecInfer's multi-round rejection for children drawn
independently from ``q``; with ``q_c`` a point mass on the child it is recursive rejection for
deterministic (top-k) children. Either way the emitted tokens follow the target exactly,
provided which children are verified does not depend on the values of the sampled children
(:mod:`specselect.scores`).

Chains are trees too, but :mod:`specselect.verify` decides all chain positions at once without
this walk, so the chain path keeps its vectorised special case and shares the building blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specselect._checks import _values_checkable, check_int, check_same_device, check_tensor
from specselect.constants import arange_constant
from specselect.sampling import (
    check_generator,
    check_logits,
    check_probs,
    compute_dtype,
    sample_from,
)
from specselect.tree import TreeBuffers
from specselect.verify import (
    _check_draft_probs,
    _check_tokens_and_target,
    gather_columns,
    residual_probs,
)


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying one tree per row.

    Attributes:
        num_accepted: ``[B]`` int64 accepted draft tokens (the depth of the last accepted node).
        next_token: ``[B]`` int64 target token emitted after the accepted path.
        last_node: ``[B]`` int64 index of the last accepted node, ``-1`` for the root.
        path: ``[B, D]`` int64 accepted node indices by depth, ``-1`` padded.
    """

    num_accepted: Tensor
    next_token: Tensor
    last_node: Tensor
    path: Tensor

    def accepted_tokens(self, tokens: Tensor) -> Tensor:
        """``[B, D]`` the accepted draft tokens (``tokens`` ``[B, N]``), ``-1`` padded."""
        picked = tokens.gather(1, self.path.clamp(min=0))
        return torch.where(self.path >= 0, picked, torch.full_like(picked, -1))


def _verdict(buffers: TreeBuffers, last_node: Tensor, next_token: Tensor) -> TreeVerdict:
    if buffers.parents.shape[1] == 0:  # empty trees: nothing to accept
        empty_path = buffers.paths.new_zeros(last_node.shape[0], 0)
        return TreeVerdict(torch.zeros_like(last_node), next_token, last_node, empty_path)
    has_node = last_node >= 0
    node = last_node.clamp(min=0)
    depth = buffers.depth.gather(1, node.unsqueeze(1)).squeeze(1) * has_node
    path = buffers.paths[torch.arange(node.shape[0], device=node.device), node]  # [B, D]
    path = torch.where(has_node.unsqueeze(1), path, torch.full_like(path, -1))
    return TreeVerdict(depth, next_token, last_node, path)


def _check_tree_args(
    tokens: object, selected: object, buffers: TreeBuffers, target_name: str, target: object
) -> tuple[Tensor, Tensor, Tensor]:
    """Check the arguments both tree verifiers share; return int64 tokens, selected, target.

    Tokens and target go through the same checks as chains' (:mod:`specselect.verify`), so a
    tree accepts exactly what a chain accepts; the tree adds the node count of ``buffers``.
    """
    rows, nodes = buffers.parents.shape
    ids, target_t = _check_tokens_and_target(
        "tokens", tokens, target_name, target, layout="[B, N + 1, V]"
    )
    if ids.shape != (rows, nodes):
        raise ValueError(
            f"tokens must have shape [{rows}, {nodes}] (one per node of buffers), got "
            f"{tuple(ids.shape)}"
        )
    check_same_device("buffers", buffers.parents, "tokens", ids)
    chosen = check_tensor("selected", selected, rank=2)
    if chosen.shape != (rows, nodes) or chosen.dtype != torch.bool:
        raise ValueError(
            f"selected must be a bool tensor of shape [{rows}, {nodes}], got "
            f"{chosen.dtype} {tuple(chosen.shape)}"
        )
    check_same_device("selected", chosen, "tokens", ids)
    return ids, chosen, target_t


def _walk_bound(name: str, value: object, nodes: int) -> int:
    """The static loop bound for ``max_depth``/``max_children``: an int >= 1, or ``N`` if None.

    Capping at ``N`` loses nothing (no tree of ``N`` nodes is deeper or has more children) and
    keeps the unrolled loop small.
    """
    return nodes if value is None else min(check_int(name, value, minimum=1), nodes)


def _check_within_bounds(
    selected: Tensor,  # [B, N] bool
    buffers: TreeBuffers,
    max_depth: int | None,
    max_children: int | None,
) -> None:
    """Raise if the walk's static bounds would skip selected nodes (a value check).

    The walk visits ``max_depth`` levels and ``max_children`` children per node; a selected node
    beyond them would silently never be verified, so the bounds are promises the caller must
    keep. Runs only where :mod:`specselect._checks` allows reading values.
    """
    if not (selected.numel() and _values_checkable(selected) and _values_checkable(buffers.depth)):
        return
    if max_depth is not None:
        deep = selected & (buffers.depth > max_depth)  # [B, N]
        if bool(deep.any()):
            row, node = (int(v) for v in deep.nonzero()[0])
            raise ValueError(
                f"max_depth = {max_depth}, but selected node {node} of row {row} is at depth "
                f"{int(buffers.depth[row, node])}: the walk would never verify it"
            )
    if max_children is not None:
        # [B, N + 1]: selected children of the root (column 0) and of each node.
        counts = torch.zeros(
            selected.shape[0], selected.shape[1] + 1, dtype=torch.int64, device=selected.device
        ).scatter_add_(1, buffers.parents + 1, selected.to(torch.int64))
        over = counts > max_children  # [B, N + 1]
        if bool(over.any()):
            row, column = (int(v) for v in over.nonzero()[0])
            parent = "the root" if column == 0 else f"node {column - 1}"
            raise ValueError(
                f"max_children = {max_children}, but {parent} of row {row} has "
                f"{int(counts[row, column])} selected children: the walk would never verify "
                "the later ones"
            )


def _deepest(key: Tensor) -> Tensor:  # [B, N] int64, 0 = not a candidate -> [B]
    """Index of each row's largest positive key, ``-1`` where no key is positive."""
    if key.shape[1] == 0:
        return torch.full(key.shape[:1], -1, dtype=torch.int64, device=key.device)
    best = key.argmax(dim=1)
    return torch.where(key.gather(1, best.unsqueeze(1)).squeeze(1) > 0, best, -1)


def tree_greedy_verify(
    tokens: Tensor,  # [B, N] int64
    selected: Tensor,  # [B, N] bool, closed under ancestors
    buffers: TreeBuffers,
    target_logits: Tensor,  # [B, N + 1, V]
) -> TreeVerdict:
    """Accept the deepest selected path whose every token equals the target's argmax."""
    tokens, selected, target_logits = _check_tree_args(
        tokens, selected, buffers, "target_logits", target_logits
    )
    target_logits = check_logits("target_logits", target_logits)
    argmax = target_logits.argmax(dim=-1)  # [B, N + 1]
    expected = argmax.gather(1, buffers.parents + 1)  # [B, N]: prediction after each parent
    good = selected & (tokens == expected)  # [B, N]
    # A node survives if none of its ancestors-or-self is bad.
    survives = ~(buffers.ancestors & ~good.unsqueeze(1)).any(dim=2)  # [B, N]
    nodes = tokens.shape[1]
    # Deepest survivor, lowest index among equals: one argmax over a combined key.
    index = arange_constant(nodes, tokens.device)
    key = torch.where(survives, buffers.depth * (nodes + 1) + (nodes - index), 0)  # [B, N]
    last = _deepest(key)
    next_token = argmax.gather(1, (last + 1).unsqueeze(1)).squeeze(1)
    return _verdict(buffers, last, next_token)


def tree_rejection_verify(
    tokens: Tensor,  # [B, N] int64
    selected: Tensor,  # [B, N] bool, closed under ancestors
    buffers: TreeBuffers,
    draft_probs: Tensor,  # [B, N + 1, V]
    target_probs: Tensor,  # [B, N + 1, V]
    *,
    sampled_children: bool,
    max_depth: int | None = None,
    max_children: int | None = None,
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """Lossless speculative sampling over a tree (see the module docstring).

    Args:
        tokens: ``[B, N]`` integer draft token of each node, a valid id in ``[0, V)``.
        selected: ``[B, N]`` bool, the nodes the target verified (closed under ancestors).
        buffers: the trees' :class:`~specselect.tree.TreeBuffers`.
        draft_probs: ``[B, N + 1, V]`` draft distribution at the root (column 0) and after each
            node — the distribution that node's children were sampled from. Unused (and not
            checked) when ``sampled_children`` is False.
        target_probs: ``[B, N + 1, V]`` target distributions, same columns, warped like the
            draft's.
        sampled_children: True if each node's children were drawn independently from the
            draft distribution at that node; False for deterministic children (e.g. top-k).
        max_depth: deepest level to walk (static, an int >= 1); defaults to ``N``. No
            selected node may be deeper (checked where values are readable).
        max_children: most selected children of one node (static, an int >= 1); defaults to
            ``N``. No node may have more selected children (checked likewise).
        generator: optional ``torch.Generator``.
    """
    tokens, selected, target_probs = _check_tree_args(
        tokens, selected, buffers, "target_probs", target_probs
    )
    target_probs = check_probs("target_probs", target_probs, rank=3)
    # Deterministic children propose point masses: draft_probs is not read then.
    wide = target_probs.dtype
    if sampled_children:
        draft_probs = _check_draft_probs(
            draft_probs, tuple(target_probs.shape), target_probs, layout="[B, N + 1, V]"
        )
        wide = torch.promote_types(draft_probs.dtype, wide)
    dtype = compute_dtype(wide)  # as for chains: the wider of the two, float32 at least
    check_generator(generator, target_probs.device)
    rows, nodes = tokens.shape
    depth_limit = _walk_bound("max_depth", max_depth, nodes)
    child_limit = _walk_bound("max_children", max_children, nodes)
    _check_within_bounds(selected, buffers, max_depth, max_children)
    device = tokens.device
    batch = torch.arange(rows, device=device)

    current = torch.full((rows,), -1, dtype=torch.int64, device=device)  # last accepted node
    walking = torch.ones(rows, dtype=torch.bool, device=device)
    residual = gather_columns(target_probs, current + 1).to(dtype)  # [B, V]
    # [V] token ids, for the top-token children's point masses (made once, only for them)
    vocab = None if sampled_children else torch.arange(residual.shape[1], device=device)
    for _ in range(depth_limit):
        children = selected & (buffers.parents == current.unsqueeze(1)) & walking.unsqueeze(1)
        order = children.to(torch.int64).cumsum(dim=1)  # [B, N] 1-based rank among children
        moved = torch.zeros_like(walking)
        for m in range(1, child_limit + 1):
            is_mth = children & (order == m)  # [B, N] at most one True per row
            trying = is_mth.any(dim=1) & ~moved  # [B]
            child = is_mth.to(torch.int8).argmax(dim=1)  # [B]
            token = tokens[batch, child]  # [B]
            if sampled_children:
                proposal = gather_columns(draft_probs, current + 1).to(dtype)  # [B, V]
            else:  # the draft proposed its top tokens: all its mass on this one
                # A comparison, not F.one_hot: one_hot checks its values on the host (a sync,
                # which a captured stage must not make).
                assert vocab is not None
                proposal = (vocab == token.unsqueeze(1)).to(dtype)  # [B, V]
            r_x = residual.gather(1, token.unsqueeze(1)).squeeze(1)
            q_x = proposal.gather(1, token.unsqueeze(1)).squeeze(1)
            accept_prob = torch.where(q_x > 0, r_x / q_x, (r_x > 0).to(dtype)).clamp(max=1.0)
            uniform = torch.rand(rows, generator=generator, device=device, dtype=dtype)
            accepted = trying & (uniform < accept_prob)
            rejected = trying & ~accepted
            residual = torch.where(
                rejected.unsqueeze(1), residual_probs(residual, proposal), residual
            )
            current = torch.where(accepted, child, current)
            moved = moved | accepted
        # Rows that accepted a child restart from the target distribution after it.
        residual = torch.where(
            moved.unsqueeze(1), gather_columns(target_probs, current + 1).to(dtype), residual
        )
        walking = walking & moved
    next_token = sample_from(residual, generator)
    return _verdict(buffers, current, next_token)
