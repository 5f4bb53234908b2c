"""What a verification step observed: the tested / passed masks of chains and draft trees, and
that an estimator fed a tree's outcomes learns what TETRIS's path product needs."""

from __future__ import annotations

import pytest
import torch

from specselect.estimators import CalibratedDraft, observed_outcomes, tree_outcomes
from specselect.selection import tree_scores
from specselect.tree import chain_parents

# root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}
PARENTS = [-1, -1, 0, 0, 1]


# (selected, accepted, tested, passed), one digit per node
CASES = {
    # node 1 lost the slot to its earlier sibling 0: a failure, not "untested"; likewise node 2
    # to its later sibling 3; node 4's parent is off the path
    "earlier-sibling-accepted": ("11111", "10010", "11110", "10010"),
    "later-sibling-accepted": ("11111", "01001", "11001", "01001"),
    "nothing-accepted": ("11111", "00000", "11000", "00000"),
    "unselected-siblings-untested": ("10100", "10000", "10100", "10000"),
}


def _nodes(digits: str) -> torch.Tensor:  # -> [1, N] bool
    return torch.tensor([[d == "1" for d in digits]])


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_tree_outcomes_observe_every_selected_child_of_the_path(
    case: tuple[str, str, str, str],
) -> None:
    """Every selected child of the root or of an accepted node is tested; it passed iff it is
    on the accepted path."""
    selected, accepted, tested, passed = (_nodes(digits) for digits in case)
    got_tested, got_passed = tree_outcomes(selected, torch.tensor([PARENTS]), accepted)
    assert torch.equal(got_tested, tested)
    assert torch.equal(got_passed, passed)


def test_chain_outcomes_are_unchanged_as_a_tree() -> None:
    """A chain is the tree ``parents[j] = j - 1``: every (selected length, accepted count) pair
    has the same outcomes through ``tree_outcomes`` as through ``observed_outcomes``."""
    width = 4
    pairs = [(n, a) for n in range(width + 1) for a in range(n + 1)]
    lengths, accepted = (torch.tensor(column) for column in zip(*pairs, strict=True))  # [B]
    columns = torch.arange(width).unsqueeze(0)  # [1, K]
    selected = columns < lengths.unsqueeze(1)  # [B, K]
    path = columns < accepted.unsqueeze(1)  # [B, K]
    as_tree = tree_outcomes(selected, chain_parents(len(pairs), width), path)
    as_chain = observed_outcomes(lengths, accepted, width)
    for tree_mask, chain_mask in zip(as_tree, as_chain, strict=True):
        assert torch.equal(tree_mask, chain_mask)


def test_tree_estimates_multiply_to_the_expected_accepted_length() -> None:
    """An estimator fed a tree's outcomes learns P(node on the path | parent on the path), so
    the product along each path (TETRIS's score) is the node's chance to be accepted, and their
    sum the expected accepted length.

    Tree: root -> {0, 1}, 0 -> {2}, 1 -> {3}, each node in its own cell of the calibration
    table (distinct draft probabilities or depths). The target takes node 0 half the time,
    else node 1 60% of the time, and each one's child 70% of the time after it: node 1 is on
    the path 30% of the time. Learning it only when node 0 lost would estimate 60%, and the
    expected accepted length 1.87 instead of 1.36.
    """
    rows, steps = 64, 200
    parents = torch.tensor([[-1, -1, 0, 1]]).expand(rows, -1)  # [B, N]
    positions = torch.tensor([[0, 0, 1, 1]]).expand(rows, -1)  # [B, N] depth - 1
    logprobs = torch.tensor([[0.95, 0.25, 0.65, 0.45]]).log().expand(rows, -1)  # [B, N]
    selected = torch.ones(rows, 4, dtype=torch.bool)  # [B, N]
    estimator = CalibratedDraft(decay=1.0)
    gen = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(steps):
        first, second, below = (torch.rand(rows, generator=gen) for _ in range(3))  # [B] each
        take_0 = first < 0.5
        take_1 = ~take_0 & (second < 0.6)
        deeper = below < 0.7
        path = torch.stack([take_0, take_1, take_0 & deeper, take_1 & deeper], dim=1)  # [B, N]
        lengths.append(path.sum(dim=1))
        estimator.learn(logprobs, *tree_outcomes(selected, parents, path), positions)
    estimates = estimator.estimate(logprobs, positions)  # [B, N]
    assert estimates[0, 1].exp().item() == pytest.approx(0.3, abs=0.02)
    expected = tree_scores(estimates, parents).exp().sum(dim=1)  # [B]
    observed = torch.cat(lengths).double().mean().item()
    assert observed == pytest.approx(1.36, abs=0.03)
    assert expected[0].item() == pytest.approx(observed, abs=0.03)
