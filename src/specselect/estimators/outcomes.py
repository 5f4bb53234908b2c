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

    A selected node was tested if its parent is the root or on the accepted path, and no
    earlier sibling was accepted (verification tries siblings in index order and stops at the
    first accepted one). It passed if it is on the accepted path.
    """
    has_parent = parents >= 0
    parent_on_path = accepted.gather(1, parents.clamp(min=0)) & has_parent
    nodes = parents.shape[1]
    earlier = torch.ones(nodes, nodes, dtype=torch.bool, device=parents.device).tril(-1)
    siblings = (parents.unsqueeze(2) == parents.unsqueeze(1)) & earlier  # [B, N, N]
    beaten = (siblings & accepted.unsqueeze(1)).any(dim=2)  # an earlier sibling was accepted
    tested = selected & (~has_parent | parent_on_path) & ~beaten
    return tested, accepted & tested
