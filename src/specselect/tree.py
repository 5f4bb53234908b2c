"""Draft trees: one padded representation for every request of a batch, and its derived buffers.

A batch of draft trees is described by ``parents [B, N]``: node ``j`` of request ``i`` is a
child of node ``parents[i, j]``, or of the *root* — the last token the target already produced,
whose token is not part of the tree — when ``parents[i, j] == -1``. Parents always come first
(``parents[i, j] < j``), so any order that respects indices respects ancestry. Padding nodes
are ordinary nodes whose draft log-probability is ``-inf``: no selector takes them, and their
descendants inherit ``-inf`` path scores.

A chain of ``K`` drafted tokens is the tree ``parents[j] = j - 1``; see :func:`chain_parents`.

Everything a target pass and a verifier need is derived once, by :func:`build_tree_buffers`, as
a few named buffers (the same idea as Medusa's tree buffers, batched and per request):

* ``ancestors [B, N, N]`` bool — ``ancestors[i, j, t]``: node ``t`` is ``j`` or an ancestor of
  ``j``. It is the attention mask among tree nodes (a node sees itself and its ancestors; every
  node also sees the root and the cache);
* ``depth [B, N]`` int64 — 1 for children of the root; position id of a node = root position +
  depth;
* ``paths [B, N, D]`` int64 — the root-to-node path of every node (node indices by depth,
  ``-1`` beyond the node's depth), used to read out the accepted path. ``D`` is a static bound
  on the depth, so that no shape depends on the trees' values and nothing is read back to the
  host: the trees' depth where the caller knows it (a draft tree's spec), else ``N``, the
  deepest a tree of ``N`` nodes can be (a chain).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specselect._checks import _values_checkable, check_int, check_integer_tensor, check_tensor
from specselect.constants import arange_constant

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree every row gets in tree mode (drafting:
    :mod:`specselect.hf.tree_draft`).

    Level 1 holds the ``branch`` children of the root (the last emitted token); each further
    level expands the ``width`` nodes of the previous level with the best path scores,
    ``branch`` children each, after one draft pass over those frontier nodes. A step thus costs
    ``depth`` draft passes and yields :attr:`num_nodes` nodes per row.

    Args:
        depth: levels below the root (draft passes per step).
        branch: children per expanded node.
        width: frontier nodes expanded per level (levels 2..depth).
        sampled_children: when sampling, draw each node's children independently from ``q``
            (SpecInfer-style multi-candidate verification); ``False`` takes the top-``branch``
            tokens of ``q`` instead (deterministic children, verified by recursive rejection).
            Greedy decoding always uses the top-``branch`` tokens.
    """

    depth: int
    branch: int
    width: int
    sampled_children: bool = True

    def __post_init__(self) -> None:
        for name in ("depth", "branch", "width"):
            check_int(f"TreeSpec.{name}", getattr(self, name), minimum=1)
        if not isinstance(self.sampled_children, bool):
            raise TypeError(
                "TreeSpec.sampled_children must be a bool, "
                f"got {type(self.sampled_children).__name__}"
            )

    def level_sizes(self, depth: int | None = None) -> tuple[int, ...]:
        """Nodes per level for the first ``depth`` levels, ``0..self.depth`` (default: all)."""
        levels = self._levels(depth)
        sizes = [self.branch]
        for _ in range(1, levels):
            sizes.append(min(self.width, sizes[-1]) * self.branch)
        return tuple(sizes[:levels])

    def _levels(self, depth: int | None) -> int:
        """``depth`` checked against the tree: levels beyond ``self.depth`` are never drafted."""
        if depth is None:
            return self.depth
        levels = check_int("depth", depth, minimum=0)
        if levels > self.depth:
            raise ValueError(
                f"depth must be <= TreeSpec.depth = {self.depth} (the tree has no deeper "
                f"levels), got {levels}"
            )
        return levels

    @property
    def num_nodes(self) -> int:
        """``N``: nodes per row (the root excluded)."""
        return sum(self.level_sizes())

    def fed_nodes(self, depth: int | None = None) -> int:
        """Frontier nodes fed to the draft in one step of the first ``depth`` levels
        (``0..self.depth``; default: all)."""
        sizes = self.level_sizes(depth)
        return sum(min(self.width, size) for size in sizes[:-1])


@dataclass(frozen=True)
class TreeBuffers:
    """Derived buffers of a batch of draft trees (see the module docstring)."""

    parents: Tensor  # [B, N] int64, -1 = child of the root
    ancestors: Tensor  # [B, N, N] bool, ancestor-or-self
    depth: Tensor  # [B, N] int64, >= 1
    paths: Tensor  # [B, N, D] int64, -1 padded; D: a static bound on the depth

    @property
    def max_depth(self) -> int:
        """``D``, the last dimension of :attr:`paths`: the static bound on any node's depth
        they were built with (``N`` by default), not the depth of the deepest node (for
        ``parents [[-1, 0, 0, 1]]`` by default 4, the deepest node being at depth 3; that one
        is ``int(depth.max())``, a host read)."""
        return self.paths.shape[2]

    def attention_mask(self) -> Tensor:
        """``[B, N + 1, N + 1]`` bool mask among the root (column 0) and the tree nodes."""
        rows, n = self.parents.shape
        mask = torch.zeros(rows, n + 1, n + 1, dtype=torch.bool, device=self.parents.device)
        mask[:, :, 0] = True
        mask[:, 1:, 1:] = self.ancestors
        return mask

    def path_scores(self, logprobs: Tensor) -> Tensor:
        """``[B, N]`` sum of ``logprobs`` (``[B, N]``) along each root-to-node path."""
        return path_sums(logprobs, self.parents)


def path_sums(values: Tensor, parents: Tensor) -> Tensor:
    """``[B, N]``: for each node, the sum of ``values`` (``[B, N]``) over its ancestors-or-self.

    Works for chains (where it equals ``cumsum``) and for trees alike; see :func:`path_reduce`.
    """
    return path_reduce(values, parents, torch.add)


def path_minima(values: Tensor, parents: Tensor) -> Tensor:
    """``[B, N]``: for each node, the smallest of ``values`` (``[B, N]``) over its
    ancestors-or-self (on chains, a running minimum). A node whose path holds a ``-inf``
    log-probability gets ``-inf``: nothing may select it."""
    return path_reduce(values, parents, torch.minimum)


def available_nodes(logprobs: Tensor, parents: Tensor) -> Tensor:
    """``[B, N]`` bool: nodes whose path holds no ``-inf`` log-probability (``[B, N]``), the
    nodes a selector may take; for chains, the prefix that ``available_lengths`` counts."""
    return path_minima(logprobs, parents) > NEG_INF


#: The identity element of each ``combine`` that :func:`path_reduce` knows: ``-0.0`` for sums,
#: since ``x + -0.0`` is ``x`` for every float (``+0.0`` would turn a ``-0.0`` into ``+0.0``).
_IDENTITIES: dict[Callable[..., Tensor], float] = {
    torch.add: -0.0,
    torch.minimum: math.inf,
    torch.maximum: -math.inf,
}


def path_reduce(
    values: Tensor, parents: Tensor, combine: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """Combine ``values`` (``[B, N]``) over each node's ancestors-or-self with ``combine``.

    ``parents`` (``[B, N]``) as :func:`check_parents` accepts them: node ``j``'s parent in
    ``[-1, j)``, ``-1`` for a root. ``combine`` is ``torch.add``, ``torch.minimum`` or
    ``torch.maximum`` (a ``ValueError`` otherwise). Pointer jumping:
    after round ``r`` every node holds the combination over its ``2**r`` nearest
    ancestors-or-self and points ``2**r`` levels up, so ``ceil(log2(N))`` rounds of gathers
    cover any depth, with no host sync and no ``[B, N, N]`` intermediate. Above the roots sits a
    sentinel column holding ``combine``'s identity and pointing at itself, so a round is two
    gathers and ``combine``, with no masking: a step of a tree loop runs several of these, and
    on a GPU every operation is a kernel. Results are float32 or wider.

    Raises:
        ValueError: ``combine`` is another function, or ``parents`` is not a forest of
            ``values``' shape on its device (:func:`check_parents`; its values are read where
            that costs no sync). A parent out of range would otherwise wrap around, silently.
    """
    identity = _IDENTITIES.get(combine)
    if identity is None:
        raise ValueError(
            f"combine must be torch.add, torch.minimum or torch.maximum, got {combine!r}"
        )
    rows, nodes = check_tensor("values", values, rank=2).shape
    parents = check_parents(parents, rows=rows, width=nodes, device=values.device)
    dtype = torch.promote_types(values.dtype, torch.float32)
    rounds = max(nodes - 1, 0).bit_length()
    if rounds == 0:
        return values.to(dtype, copy=True)
    total = F.pad(values.to(dtype), (0, 1), value=identity)  # [B, N + 1]
    up = _sentinel_parents(parents)  # [B, N + 1]
    for round_ in range(rounds):
        total = combine(total, total.gather(1, up))
        if round_ + 1 < rounds:
            up = up.gather(1, up)
    return total[:, :nodes]


def _sentinel_parents(parents: Tensor) -> Tensor:  # [B, N] -> [B, N + 1] int64
    """``parents`` with a sentinel column ``N`` above the roots: a root's ``-1`` and the
    sentinel's own become ``N``, so walking up is a gather that never leaves the tensor."""
    nodes = parents.shape[1]
    return F.pad(parents.to(torch.int64), (0, 1), value=-1).remainder_(nodes + 1)


def sibling_rank(parents: Tensor) -> Tensor:
    """``[B, N]`` int64: 1 + the number of earlier nodes with the same parent (1-based)."""
    nodes = parents.shape[1]
    earlier = torch.ones(nodes, nodes, dtype=torch.bool, device=parents.device).tril(-1)
    same = parents.unsqueeze(2) == parents.unsqueeze(1)  # [B, N, N]
    return (same & earlier).sum(dim=2) + 1


def chain_parents(rows: int, width: int, device: torch.device | str = "cpu") -> Tensor:
    """``[rows, width]`` parents of chains: ``parents[:, j] = j - 1``."""
    rows, width = check_int("rows", rows), check_int("width", width)
    return (torch.arange(width, device=device) - 1).expand(rows, width).contiguous()


def check_parents(
    parents: object,
    *,
    rows: int | None = None,
    width: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Check that ``parents`` describes a forest hanging from each row's root (on ``device``,
    where given: the draft log-probabilities').

    Raises:
        TypeError: not an integer tensor.
        ValueError: wrong shape or device, a parent index outside ``[-1, j)`` for node ``j`` (a
            child before its parent, a self-loop, or a cycle all show up this way).
    """
    t = check_integer_tensor("parents", parents, rank=2)
    if device is not None and t.device != device:
        raise ValueError(f"parents is on {t.device}, expected {device} (draft_logprobs' device)")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"parents must have {rows} rows (one tree per request), got {t.shape[0]}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"parents must have {width} columns (one per node), got {t.shape[1]}")
    if _values_checkable(t) and t.numel():
        index = torch.arange(t.shape[1], device=t.device)
        bad = (t < -1) | (t >= index)
        if bool(bad.any()):
            row, node = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"parents[{row}, {node}] = {int(t[row, node])}: every node's parent must be -1 "
                f"(the root) or an earlier node in [0, {node}); nodes must come after their "
                "parents, which also rules out cycles"
            )
    return t.to(torch.int64)


def build_tree_buffers(parents: Tensor, max_depth: int | None = None) -> TreeBuffers:
    """Derive the ancestor mask, depths and root-to-node paths from ``parents`` ``[B, N]``.

    Every node walks up to the root at once, ``D`` steps of one gather each (``D`` =
    ``max_depth``, a static bound on the trees' depth such as a draft tree's spec gives; by
    default ``N``, the deepest a tree of ``N`` nodes can be): ``O(B·N·D)`` work and memory
    besides the ``[B, N, N]`` ancestor mask, and no host sync.

    Raises:
        ValueError: a node deeper than ``max_depth`` (a value check, where values are
            readable: its path would be cut).
    """
    parents = check_parents(parents)
    rows, n = parents.shape
    bound = n if max_depth is None else check_int("max_depth", max_depth)
    # up[i, j, s]: the ancestor s levels above node j (s = 0: j itself; N above the root).
    node_ids = arange_constant(n, parents.device).expand(rows, n)  # [B, N]
    jump = _sentinel_parents(parents)  # [B, N + 1]: one gather a level
    node = node_ids
    steps = []
    for _ in range(bound):
        steps.append(node)
        node = jump.gather(1, node)
    if max_depth is not None and _values_checkable(node) and bool((node < n).any()):
        row, deep = (int(v) for v in (node < n).nonzero()[0])
        raise ValueError(f"node {deep} of row {row} is deeper than max_depth = {max_depth}")
    up = torch.stack(steps, dim=2) if steps else node.new_zeros(rows, n, 0)  # [B, N, D]
    on_path = up < n  # [B, N, D]
    depth = on_path.sum(dim=2)  # [B, N]
    # paths[i, j, d]: the ancestor at depth d + 1, i.e. depth - 1 - d levels above j.
    levels = arange_constant(bound, parents.device)  # [D]
    above = (depth.unsqueeze(2) - 1 - levels).clamp(min=0)  # [B, N, D]
    paths = torch.where(levels < depth.unsqueeze(2), up.gather(2, above), -1)  # [B, N, D]
    # Every entry marks an ancestor-or-self (one above the root marks the node itself again):
    # all writes are True, so their order does not matter, and the table stays bool.
    marked = torch.where(on_path, up, node_ids.unsqueeze(2))  # [B, N, D]
    ancestors = torch.zeros(rows, n, n, dtype=torch.bool, device=parents.device)
    ancestors.scatter_(2, marked, torch.ones_like(marked, dtype=torch.bool))  # [B, N, N]
    return TreeBuffers(parents=parents, ancestors=ancestors, depth=depth, paths=paths)
