"""What one verification step observed: which draft tokens (or tree nodes) were tested, and which
passed. Estimators, the ranking guard and the replay's reliability statistics learn from these."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["observed_outcomes", "tree_outcomes"]


def observed_outcomes(
    lengths: Tensor,  # [B] int64 selected tokens per row
    num_accepted: Tensor,  # [B] int accepted tokens per row
    width: int,
) -> tuple[Tensor, Tensor]:  # ([B, K] bool, [B, K] bool)
    """Which draft positions were tested by the target this step, and which passed.

    Position ``j`` of row ``i`` is *tested* if it was selected and everything before it was
    accepted (``j <= num_accepted[i] < lengths[i]``, or ``j < lengths[i]`` when all passed). It
    *passed* if ``j < num_accepted[i]``. Positions after the first rejection say nothing about
    acceptance given an accepted prefix, so they are not observations.
    """
    positions = torch.arange(width, device=lengths.device).unsqueeze(0)  # [1, K]
    accepted = num_accepted.to(torch.int64).unsqueeze(1)  # [B, 1]
    tested = (positions <= accepted) & (positions < lengths.unsqueeze(1))
    return tested, positions < accepted


def tree_outcomes(
    selected: Tensor,  # [B, N] bool, closed under ancestors
    parents: Tensor,  # [B, N] int64, -1 = child of the root
    accepted: Tensor,  # [B, N] bool, the accepted root-to-node path
) -> tuple[Tensor, Tensor]:  # ([B, N] bool, [B, N] bool)
    """Which draft-tree nodes the target tested this step, and which passed.

    A selected node was *tested* if its parent is the root or on the accepted path, and it
    *passed* if it is on the accepted path itself: its outcome answers "is this node on the
    path, given that its parent is?". A later sibling of the accepted child failed that test;
    it is not left out.

    That is the quantity TETRIS multiplies. It scores a node by the product of the per-node
    estimates along its root path, and the expected number of accepted tokens is the sum over
    the selected nodes of ``P(node on the accepted path)``. A node is on the path only if its
    parent is, so that probability is exactly the product of ``P(a on path | parent of a on
    path)`` over the nodes ``a`` of its root path (the chain rule; nothing is assumed
    independent). This needs only that the accepted nodes form one root-to-node path, which
    both verifiers produce: greedy verification keeps the deepest path of argmax matches, and
    sampling tries the selected children of the current node in index order and descends into
    the first one accepted, so that a later sibling is on the path only if every earlier one
    was rejected. Counting a later sibling only when no earlier one was accepted would learn
    ``P(on path | parent on path, no earlier sibling accepted)`` instead, too high by the
    factor ``1 / P(no earlier sibling accepted | parent on path)``: when the first child wins
    half the time and the second wins 60% of the rest, the second is on the path 30% of the
    time, not 60%, and TETRIS would rank it (and every node below it) as if it were 60%.

    On a chain every node is its parent's only child, and the outcomes are
    :func:`observed_outcomes`.
    """
    has_parent = parents >= 0  # [B, N]
    parent_on_path = accepted.gather(1, parents.clamp(min=0)) & has_parent  # [B, N]
    tested = selected & (~has_parent | parent_on_path)  # [B, N]
    return tested, accepted & tested
