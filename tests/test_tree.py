"""Tree representation: derived buffers against a plain-Python walk up the parent links."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specselect.selection import chain_scores
from specselect.tree import (
    TreeSpec,
    build_tree_buffers,
    chain_parents,
    check_parents,
    path_minima,
    path_reduce,
    path_sums,
)


@st.composite
def forests(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 3))
    nodes = draw(st.integers(0, 7))
    parents = [[draw(st.integers(-1, j - 1)) for j in range(nodes)] for _ in range(rows)]
    return torch.tensor(parents, dtype=torch.int64).reshape(rows, nodes)


def walk_up(parents: list[int], node: int) -> list[int]:
    """Root-to-node path by following parent links (the reference)."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@settings(max_examples=60, deadline=None)
@given(forests(), st.booleans())
def test_buffers_match_parent_walk(parents: torch.Tensor, bounded: bool) -> None:
    """Also with ``max_depth`` the trees' depth (a draft tree's spec): the same buffers, the
    paths cut to that bound."""
    deepest = max(
        (len(walk_up(row, j)) for row in parents.tolist() for j in range(len(row))), default=0
    )
    buffers = build_tree_buffers(parents, max_depth=deepest if bounded else None)
    rows, nodes = parents.shape
    assert buffers.max_depth == (deepest if bounded else nodes)
    for i in range(rows):
        links = parents[i].tolist()
        for j in range(nodes):
            path = walk_up(links, j)
            assert buffers.depth[i, j] == len(path)
            assert buffers.paths[i, j, : len(path)].tolist() == path
            assert (buffers.paths[i, j, len(path) :] == -1).all()
            expected = torch.zeros(nodes, dtype=torch.bool)
            expected[path] = True
            assert torch.equal(buffers.ancestors[i, j], expected)


def test_max_depth_is_the_static_bound_n() -> None:
    """``paths``' last dimension is ``N`` whatever the trees' shape (no value-dependent shape),
    and ``max_depth`` reports that bound, not the deepest node's depth."""
    buffers = build_tree_buffers(torch.tensor([[-1, 0, 0, 1]]))
    assert buffers.paths.shape == (1, 4, 4)
    assert buffers.max_depth == 4
    assert int(buffers.depth.max()) == 3


def test_a_node_deeper_than_max_depth_is_refused() -> None:
    """Its path would be cut."""
    with pytest.raises(ValueError, match=r"node 3 of row 0 is deeper than max_depth = 2"):
        build_tree_buffers(torch.tensor([[-1, 0, -1, 1]]), max_depth=2)


@settings(max_examples=40, deadline=None)
@given(forests(), st.randoms(use_true_random=False))
def test_path_scores_sum_logprobs_along_the_path(parents: torch.Tensor, rnd) -> None:
    rows, nodes = parents.shape
    probs = torch.tensor(
        [[rnd.choice([0.0, 0.3, 1.0, rnd.random()]) for _ in range(nodes)] for _ in range(rows)],
        dtype=torch.float64,
    ).reshape(rows, nodes)
    scores = build_tree_buffers(parents).path_scores(probs.log())
    for i in range(rows):
        for j in range(nodes):
            # In log space: a product of small probabilities can be subnormal, where its
            # relative error is far above rtol (hypothesis found 1.7e-314).
            expected = probs[i, walk_up(parents[i].tolist(), j)].log().sum()
            assert torch.isclose(scores[i, j], expected, rtol=1e-12, atol=0)


@settings(max_examples=40, deadline=None)
@given(forests(), st.randoms(use_true_random=False))
def test_path_reduce_combines_each_nodes_ancestors(parents: torch.Tensor, rnd) -> None:
    """Minima and maxima over the walk up to the root, exactly (-inf and zeros of both signs
    among the values; equal as floats, the sign of a zero left unchecked); sums up to
    rounding."""
    rows, nodes = parents.shape
    choices = [0.0, -0.0, float("-inf"), -1.5, 2.0]
    values = torch.tensor(
        [[rnd.choice([*choices, rnd.gauss(0, 1)]) for _ in range(nodes)] for _ in range(rows)]
    ).reshape(rows, nodes)
    for combine, reduce in [
        (torch.minimum, torch.min),
        (torch.maximum, torch.max),
        (torch.add, torch.sum),
    ]:
        reduced = path_reduce(values, parents, combine)
        assert reduced.shape == values.shape and reduced.dtype == torch.float32
        for i in range(rows):
            for j in range(nodes):
                expected = reduce(values[i, walk_up(parents[i].tolist(), j)])
                if combine is torch.add:
                    assert torch.isclose(reduced[i, j], expected, rtol=1e-5, atol=1e-6)
                else:
                    assert reduced[i, j] == expected


def test_path_reduce_names_the_combines_it_knows() -> None:
    with pytest.raises(ValueError, match=r"combine must be torch\.add, torch\.minimum or"):
        path_reduce(torch.zeros(1, 2), torch.tensor([[-1, 0]]), torch.mul)


def test_chain_is_the_tree_with_parent_j_minus_one() -> None:
    logprobs = torch.rand(3, 5, dtype=torch.float64).log()
    buffers = build_tree_buffers(chain_parents(3, 5))
    assert torch.equal(buffers.depth, torch.arange(1, 6).expand(3, 5))
    assert torch.allclose(buffers.path_scores(logprobs), chain_scores(logprobs))
    assert torch.equal(buffers.ancestors[0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_attention_mask_adds_the_root_column() -> None:
    buffers = build_tree_buffers(torch.tensor([[-1, 0, -1]]))
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(buffers.attention_mask()[0], expected)


@pytest.mark.parametrize(
    ("parents", "error", "match"),
    [
        (torch.tensor([[-1, 2, 0]]), ValueError, r"parents\[0, 1\] = 2"),  # child before parent
        (torch.tensor([[-1, 1]]), ValueError, r"parents\[0, 1\] = 1"),  # self-loop
        (torch.tensor([[-2, 0]]), ValueError, r"parents\[0, 0\] = -2"),
        (torch.tensor([-1, 0]), ValueError, "rank 2"),
        (torch.tensor([[-1.0, 0.0]]), TypeError, "integer tensor"),
        ([[-1, 0]], TypeError, "torch.Tensor"),
    ],
)
def test_parents_that_are_not_a_forest_are_rejected(parents, error, match) -> None:
    with pytest.raises(error, match=match):
        check_parents(parents)


def test_parents_shape_must_match_the_batch() -> None:
    with pytest.raises(ValueError, match="2 rows"):
        check_parents(torch.tensor([[-1, 0]]), rows=2)


SPEC = TreeSpec(depth=3, branch=2, width=3)


@pytest.mark.parametrize(
    ("depth", "sizes", "fed"), [(0, (), 0), (1, (2,), 0), (2, (2, 4), 2), (3, (2, 4, 6), 5)]
)
def test_level_sizes_of_the_first_levels(depth: int, sizes: tuple, fed: int) -> None:
    """Levels hold branch x min(width, previous level) nodes; all but the last are fed."""
    assert SPEC.level_sizes(depth) == sizes
    assert SPEC.fed_nodes(depth) == fed


@pytest.mark.parametrize("method", ["level_sizes", "fed_nodes"])
@pytest.mark.parametrize(
    ("depth", "error", "match"),
    [
        (4, ValueError, r"depth must be <= TreeSpec.depth = 3"),
        (-1, ValueError, "depth must be >= 0"),
        (2.5, TypeError, "depth must be an int"),
    ],
)
def test_levels_beyond_the_tree_are_rejected(method: str, depth, error, match) -> None:
    with pytest.raises(error, match=match):
        getattr(SPEC, method)(depth)


@pytest.mark.parametrize(
    ("parents", "error", "match"),
    [
        ([[-1, 5, 1]], ValueError, r"parents\[0, 1\] = 5"),  # used to wrap around silently
        ([[-1, 0, 2]], ValueError, r"parents\[0, 2\] = 2"),  # a self-loop
        ([[-1.0, 0.0, 1.0]], TypeError, "parents must be an integer tensor"),
        ([[-1, 0]], ValueError, "parents must have 3 columns"),
    ],
)
def test_path_walks_refuse_parents_that_are_no_forest(parents, error, match) -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]])
    for walk in (path_sums, path_minima):
        with pytest.raises(error, match=match):
            walk(values, torch.tensor(parents))
