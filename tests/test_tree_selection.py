"""Selecting draft-tree nodes: global best C (TETRIS), per-request best n (fixed), and the window
selectors, whose window is a depth (DSD: one for the batch, heuristic: per request, threshold:
confident paths up to ``max_k``). The contract every registered selector keeps on trees is in
``test_selector_contract.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import active_masks, paper_tetris
from specselect import (
    DSDSelector,
    FixedWindowSelector,
    HeuristicSelector,
    TetrisSelector,
    ThresholdSelector,
)
from specselect.cost import CostModel
from specselect.tree import build_tree_buffers, chain_parents, path_sums

SETTINGS = settings(max_examples=60, deadline=None)
POOL = [1.0, 0.5, 0.5, 0.9, 0.25, 0.1, 0.0]  # ties and probability-0 nodes are common


@st.composite
def trees(draw: st.DrawFn, max_rows: int = 3, max_nodes: int = 6):
    rows, nodes = draw(st.integers(1, max_rows)), draw(st.integers(0, max_nodes))
    parents = torch.tensor(
        [[draw(st.integers(-1, j - 1)) for j in range(nodes)] for _ in range(rows)],
        dtype=torch.int64,
    ).reshape(rows, nodes)
    probs = torch.tensor(
        draw(st.lists(st.sampled_from(POOL), min_size=rows * nodes, max_size=rows * nodes)),
        dtype=torch.float64,
    ).reshape(rows, nodes)
    return parents, probs.log()


def closed(mask: torch.Tensor, parents: torch.Tensor) -> bool:
    """Every selected node's parent is selected (or is the root)."""
    has_parent = parents >= 0
    parent_taken = mask.gather(1, parents.clamp(min=0))
    return bool((~mask | ~has_parent | parent_taken).all())


def best_closed_total(scores: list[float], parents: list[int], budget: int) -> float:
    """Brute force: the largest sum of exp(path score) over ancestor-closed sets <= budget."""
    nodes = len(scores)
    best = 0.0
    for size in range(min(budget, nodes) + 1):
        for subset in itertools.combinations(range(nodes), size):
            chosen = set(subset)
            if all(parents[j] < 0 or parents[j] in chosen for j in chosen) and all(
                scores[j] > -math.inf for j in chosen
            ):
                best = max(best, sum(math.exp(scores[j]) for j in chosen))
    return best


@SETTINGS
@given(trees(max_rows=1, max_nodes=7), st.integers(0, 8))
def test_tetris_tree_selection_is_optimal_closed_and_exact(tree, budget: int) -> None:
    parents, logprobs = tree
    selection = paper_tetris(k=0, budget=budget).select(logprobs, parents=parents)
    scores = path_sums(logprobs, parents)
    available = int((scores > -math.inf).sum())
    assert int(selection.lengths.sum()) == min(budget, available)
    assert closed(selection.mask, parents)
    got = float(scores[selection.mask].exp().sum())
    optimum = best_closed_total(scores[0].tolist(), parents[0].tolist(), budget)
    assert math.isclose(got, optimum, rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(trees(), st.integers(0, 4), st.data())
def test_tree_selections_are_closed_with_exact_counts(tree, k: int, data) -> None:
    parents, logprobs = tree
    rows = parents.shape[0]
    active = data.draw(active_masks(rows))
    scores = path_sums(logprobs, parents)
    available = (scores > -math.inf) & active.unsqueeze(1)
    tetris = paper_tetris(k=k).select(logprobs, active, parents=parents)
    fixed = FixedWindowSelector(k=k).select(logprobs, active, parents=parents)
    for selection in (tetris, fixed):
        assert closed(selection.mask, parents)
        assert not (selection.mask & ~available).any()
        assert torch.equal(selection.lengths, selection.mask.sum(1))
    budget = k * int(active.sum())
    assert int(tetris.lengths.sum()) == min(budget, int(available.sum()))
    assert torch.equal(fixed.lengths, available.sum(1).clamp(max=k))


@SETTINGS
@given(trees(), st.integers(0, 4))
def test_per_request_baseline_keeps_each_rows_best_nodes(tree, k: int) -> None:
    parents, logprobs = tree
    mask = FixedWindowSelector(k=k).select(logprobs, parents=parents).mask
    scores = path_sums(logprobs, parents)
    for i in range(parents.shape[0]):
        taken, left = scores[i][mask[i]], scores[i][~mask[i] & (scores[i] > -math.inf)]
        if len(taken) and len(left):
            assert taken.min() >= left.max()


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 6), st.integers(0, 4), st.integers(0, 99))
def test_chain_trees_reproduce_the_flat_selection(rows: int, width: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.tensor(POOL).log()[torch.randint(0, len(POOL), (rows, width), generator=gen)]
    parents = chain_parents(rows, width)
    for selector in (paper_tetris(k=k, extra=1), FixedWindowSelector(k=k)):
        flat = selector.select(logprobs)
        tree = selector.select(logprobs, parents=parents)
        assert torch.equal(flat.mask, tree.mask)
        assert torch.equal(flat.lengths, tree.lengths)


# A chain-shaped tree whose last token is certain (log q = 0). Pointer jumping sums node 3's
# path as (x3 + x2) + (x1 + x0) and node 2's as (x2 + x1) + x0: float32 puts node 3 an ulp above.
CERTAIN_LAST = torch.tensor([[-0.8689103126525879, -0.5925653576850891, -0.04841522127389908, 0.0]])


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedWindowSelector(3),
        lambda: paper_tetris(k=3, extra=1),
        lambda: TetrisSelector(k=1, extra=3, budget=3),  # the default estimator and guard
    ],
    ids=["fixed", "tetris-paper", "tetris-default"],
)
def test_a_certain_child_never_outranks_its_parent(make) -> None:
    parents = chain_parents(1, 4)
    sums = path_sums(CERTAIN_LAST, parents)
    assert sums[0, 3] > sums[0, 2], "the input no longer shows the rounding this test is about"
    selection = make().select(CERTAIN_LAST, parents=parents)
    assert selection.mask.tolist() == [[True, True, True, False]]


def test_path_sums_agree_with_the_ancestor_matrix() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1, 5]])
    values = torch.rand(1, 7, dtype=torch.float64)
    buffers = build_tree_buffers(parents)
    via_matrix = (buffers.ancestors.double() * values.unsqueeze(1)).sum(2)
    assert torch.allclose(path_sums(values, parents), via_matrix)


class ChainOnly(FixedWindowSelector):
    supports_trees = False


def test_selectors_without_tree_support_refuse_trees() -> None:
    with pytest.raises(TypeError, match="does not select draft-tree nodes"):
        ChainOnly(2).select(torch.zeros(2, 3), parents=chain_parents(2, 3))


# --------------------------------------------------------------------------------------------
# The window selectors on trees: a window is a depth. Expected masks come from walking every
# path up to the root, not from the pointer jumping under test.


def depths_and_weakest(parents: torch.Tensor, logprobs: torch.Tensor):
    """``([B, N] depth, [B, N] smallest log-prob on each node's path)``, by walking up from every
    node to the root."""
    rows, nodes = parents.shape
    depth = torch.zeros(rows, nodes, dtype=torch.int64)
    weakest = torch.full((rows, nodes), math.inf, dtype=logprobs.dtype)
    for i, j in itertools.product(range(rows), range(nodes)):
        t = j
        while t >= 0:
            depth[i, j] += 1
            weakest[i, j] = min(weakest[i, j], logprobs[i, t])
            t = int(parents[i, t])
    return depth, weakest


@SETTINGS
@given(trees(), st.integers(1, 4), st.data())
def test_dsd_verifies_every_node_up_to_one_depth(tree, max_k: int, data) -> None:
    parents, logprobs = tree
    rows = parents.shape[0]
    active = data.draw(active_masks(rows))
    selector = DSDSelector(max_k=max_k)
    window = selector.draft_length(rows)
    depth, weakest = depths_and_weakest(parents, logprobs)
    expected = (weakest > -math.inf) & (depth <= window) & active.unsqueeze(1)
    assert torch.equal(selector.select(logprobs, active, parents=parents).mask, expected)


@SETTINGS
@given(trees(), st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), st.integers(1, 4))
def test_threshold_verifies_nodes_whose_whole_path_is_confident(tree, threshold, max_k) -> None:
    parents, logprobs = tree
    depth, weakest = depths_and_weakest(parents, logprobs)
    confident = (weakest >= math.log(threshold)) if threshold > 0 else torch.ones_like(depth) > 0
    expected = confident & (weakest > -math.inf) & (depth <= max_k)
    selection = ThresholdSelector(max_k, threshold).select(logprobs, parents=parents)
    assert torch.equal(selection.mask, expected)


# root -> {0, 1}; 0 -> {2, 3}; 2 -> {4}: depths 1, 1, 2, 2, 3. Row 1: the same with node 1 at
# probability 0.
TREE = torch.tensor([[-1, -1, 0, 0, 2]] * 2)
TREE_DEPTH = torch.tensor([1, 1, 2, 2, 3])
TREE_LOGPROBS = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5], [0.9, 0.0, 0.7, 0.6, 0.5]]).log()


def path(*nodes_per_row: list[int]) -> torch.Tensor:
    """``[2, 5]`` bool accepted paths from node lists."""
    out = torch.zeros(2, 5, dtype=torch.bool)
    for row, nodes in enumerate(nodes_per_row):
        out[row, nodes] = True
    return out


def test_heuristic_tree_windows_are_per_request_depths() -> None:
    """Row 0 accepts down to the deepest selected level (grows by 2), row 1 stops short
    (shrinks by 1): the windows are depths, learned from the accepted path's length and the
    deepest verified depth (observe's ``deepest``)."""
    selector = HeuristicSelector(k0=2, max_k=6)
    first = selector.select(TREE_LOGPROBS, parents=TREE)
    available = ~TREE_LOGPROBS.isneginf()
    assert torch.equal(first.mask, (TREE_DEPTH <= 2) & available)  # 4 nodes, 3 in row 1
    accepted = path([0, 2], [0])
    selector.update(first, accepted.sum(dim=1), accepted_nodes=accepted)
    selector.observe(first.lengths.tolist(), accepted.sum(dim=1).tolist(), deepest=[2, 2])
    assert selector.windows() == [4, 1]
    second = selector.select(TREE_LOGPROBS, parents=TREE)
    assert second.mask.tolist() == [[True] * 5, [True, False, False, False, False]]


def test_dsd_tree_acceptance_is_per_depth() -> None:
    """DSD's estimate moves by accepted / deepest selected depth: the chain rule per level, not
    accepted / selected nodes (siblings compete for one level)."""
    flat_target = CostModel.linear((1e-3, 0.0, 0.0), (1e-2, 0.0, 0.0))  # windows cost little
    selector = DSDSelector(max_k=2, cost_model=flat_target, alpha0=0.5)
    assert selector.draft_length(2) == 2, "the case needs a window of 2"
    selection = selector.select(TREE_LOGPROBS, parents=TREE)
    assert selection.lengths.tolist() == [4, 3]
    accepted = path([0, 2], [0])
    selector.update(selection, accepted.sum(dim=1), accepted_nodes=accepted)
    selector.observe(selection.lengths.tolist(), accepted.sum(dim=1).tolist(), deepest=[2, 2])
    observed = (2 + 1) / (2 + 2)  # accepted path lengths over deepest verified depths
    assert selector.acceptance_estimate() == pytest.approx(0.85 * 0.5 + 0.15 * observed)
    # Node counts are no depths: after a tree selection, observe must be told the depths.
    with pytest.raises(ValueError, match="needs deepest= after a tree selection"):
        selector.observe(selection.lengths.tolist(), accepted.sum(dim=1).tolist())


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        (torch.tensor([[-1, 2, 0]]), r"parents\[0, 1\] = 2"),
        (torch.tensor([[-1, 0]]), "3 columns"),
        (torch.tensor([[-1, 0, 1], [-1, 0, 1]]), "1 rows"),
    ],
)
def test_bad_parents_are_rejected(parents: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paper_tetris(k=1).select(torch.zeros(1, 3), parents=parents)
