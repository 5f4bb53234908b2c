"""Acceptance estimators: convergence on synthetic streams, per-request resets, the guard."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specselect import Selection, TetrisSelector
from specselect.estimators import (
    ESTIMATORS,
    CalibratedDraft,
    DraftProbability,
    RankingGuard,
    RequestHistory,
    observed_outcomes,
    tree_outcomes,
)
from specselect.tree import chain_parents

ROWS, WIDTH = 32, 6


def run_stream(
    estimator,
    acceptance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    seed: int = 0,
    guard: RankingGuard | None = None,
) -> torch.Generator:
    """Feed ``steps`` verification outcomes drawn from a known acceptance model.

    ``acceptance(q, rows)`` gives the true probability that a token of draft probability ``q`` is
    accepted given its predecessors were, for each row; every position is selected, so the
    estimator sees exactly the censoring a real loop produces (nothing after a rejection).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(ROWS)
    for _ in range(steps):
        logprobs = torch.rand(ROWS, WIDTH, generator=gen).clamp(min=1e-3).log()
        estimates = estimator.estimate(logprobs)
        accept = torch.rand(ROWS, WIDTH, generator=gen) < acceptance(logprobs.exp(), rows)
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        outcomes = observed_outcomes(torch.full((ROWS,), WIDTH), num_accepted, WIDTH)
        estimator.learn(logprobs, *outcomes)
        if guard is not None:
            guard.observe(estimates, *outcomes)
    return gen


def under_confident(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return 0.4 + 0.6 * q  # like the shipped pair: low-probability drafts are often accepted


def calibration_error(estimator, truth) -> float:
    """Mean absolute error of the estimates over a fresh batch of draft probabilities."""
    q = torch.linspace(0.01, 0.99, 99).unsqueeze(1).expand(99, WIDTH)  # every q, every position
    estimated = estimator.estimate(q.log()).exp()
    return float((estimated - truth(q)).abs().mean())


def test_observed_outcomes_stop_at_the_first_rejection() -> None:
    tested, passed = observed_outcomes(torch.tensor([3, 3, 0, 2]), torch.tensor([1, 3, 0, 2]), 4)
    assert tested.tolist() == [
        [True, True, False, False],  # accepted 1 of 3: position 1 was the rejection
        [True, True, True, False],  # all 3 accepted
        [False, False, False, False],  # nothing selected
        [True, True, False, False],
    ]
    assert passed.tolist()[0] == [True, False, False, False]


@pytest.mark.parametrize("cls", [CalibratedDraft, RequestHistory])
def test_estimators_converge_to_the_true_acceptance(cls) -> None:
    estimator = cls()
    before = calibration_error(estimator, lambda q: under_confident(q, torch.arange(len(q))))
    run_stream(estimator, under_confident, steps=400)
    after = calibration_error(estimator, lambda q: under_confident(q, torch.arange(len(q))))
    assert after < 0.05  # stated bound after 400 steps of 32 requests
    assert after < before / 2  # it learned (the raw draft probability is 0.2 off)


def test_request_history_separates_easy_and_hard_requests() -> None:
    """Same draft probabilities, different requests: the history must tell them apart."""

    def by_row(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        easy = (rows % 2 == 0).unsqueeze(1)
        return torch.where(easy, 0.9, 0.3).expand_as(q)

    history = RequestHistory()
    run_stream(history, by_row, steps=300)
    q = torch.full((ROWS, WIDTH), 0.5).log()
    estimates = history.estimate(q).exp()[:, 0]
    assert estimates[0::2].mean() > estimates[1::2].mean() + 0.3
    calibrated = CalibratedDraft()
    run_stream(calibrated, by_row, steps=300)
    same = calibrated.estimate(q).exp()[:, 0]
    assert torch.allclose(same[0::2], same[1::2])  # token-level calibration cannot see it


def test_reset_rows_forgets_only_those_requests() -> None:
    def by_row(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.where((rows < ROWS // 2).unsqueeze(1), 0.95, 0.05).expand_as(q)

    history = RequestHistory()
    run_stream(history, by_row, steps=100)
    q = torch.full((ROWS, WIDTH), 0.5).log()
    before = history.estimate(q).exp()[:, 0]
    refilled = torch.zeros(ROWS, dtype=torch.bool)
    refilled[0] = True  # slot 0 now holds a new request
    history.reset_rows(refilled)
    after = history.estimate(q).exp()[:, 0]
    assert after[0] < before[0] - 0.1  # its strong history is gone
    assert torch.equal(after[1:], before[1:])


def test_guard_falls_back_when_draft_probabilities_carry_no_signal() -> None:
    def no_signal(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.full_like(q, 0.7)

    guard = RankingGuard()
    run_stream(DraftProbability(), no_signal, steps=200, guard=guard)
    assert abs(float(guard.auc()) - 0.5) < 0.05
    assert not bool(guard.trusted())

    informative = RankingGuard()
    run_stream(DraftProbability(), under_confident, steps=200, guard=informative)
    assert float(informative.auc()) > 0.6
    assert bool(informative.trusted())


def test_guard_needs_evidence_before_trusting() -> None:
    guard = RankingGuard(min_observations=10_000)
    run_stream(DraftProbability(), under_confident, steps=20, guard=guard)
    assert float(guard.auc()) > 0.6 and not bool(guard.trusted())


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimates_keep_minus_inf_and_stay_log_probabilities(name: str) -> None:
    estimator = ESTIMATORS[name]()
    logprobs = torch.tensor([[-0.1, -2.0, float("-inf")], [0.0, -30.0, -1.0]])
    out = estimator.estimate(logprobs)
    assert out.shape == logprobs.shape
    assert torch.equal(out == float("-inf"), logprobs == float("-inf"))
    assert (out <= 0).all()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators_run_on_meta_tensors(name: str) -> None:
    """Nothing reads a value back: the whole step runs on tensors without data."""
    estimator = ESTIMATORS[name]()
    logprobs = torch.empty(4, 5, device="meta")
    estimator.estimate(logprobs)
    lengths = torch.empty(4, dtype=torch.int64, device="meta")
    estimator.learn(logprobs, *observed_outcomes(lengths, lengths, 5))
    estimator.reset_rows(torch.empty(4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: CalibratedDraft(bins=0), "bins"),
        (lambda: CalibratedDraft(decay=1.5), "decay"),
        (lambda: CalibratedDraft(prior=0), "prior"),
        (lambda: RequestHistory(lr=0), "lr"),
        (lambda: RequestHistory(request_decays=(0.5, 1.5)), "request_decays"),
        (lambda: RequestHistory(request_decays=()), "request_decays"),
        (lambda: RankingGuard(min_auc=2), "min_auc"),
    ],
)
def test_bad_estimator_arguments(factory, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


def test_tetris_guard_falls_back_to_the_fixed_window_until_trusted() -> None:
    selector = TetrisSelector(k=2, extra=2, estimator="calibrated", guard=True)
    logprobs = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1]]))
    assert selector.select(logprobs).lengths.tolist() == [2, 2]  # no evidence yet: fixed k
    raw = TetrisSelector(k=2, extra=2, estimator=None, guard=False).select(logprobs)
    assert raw.lengths.tolist() == [4, 0]  # the paper's TETRIS on the raw draft probabilities


@pytest.mark.parametrize(
    ("budget", "lengths"), [(0, [0, 0, 0]), (1, [1, 0, 0]), (4, [2, 1, 1]), (9, [2, 2, 2])]
)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_tetris_guard_fallback_keeps_a_fixed_budget(budget: int, lengths: list, tree: bool):
    """Untrusted, TETRIS falls back to standard SD's windows trimmed to the budget,
    shallowest positions first (then lower rows), and still closed under ancestors."""
    selector = TetrisSelector(k=2, extra=2, budget=budget)  # no evidence yet: untrusted
    logprobs = torch.log(torch.full((3, 4), 0.5))
    parents = torch.tensor([[-1, 0, 1, 2]] * 3) if tree else None  # a chain, as a tree
    selection = selector.select(logprobs, parents=parents)
    assert selection.lengths.tolist() == lengths
    assert torch.equal(selection.mask, Selection.from_lengths(selection.lengths, 4).mask)


def test_tetris_uses_the_estimator_once_the_guard_trusts_it() -> None:
    selector = TetrisSelector(
        k=2, extra=2, estimator="calibrated", guard=RankingGuard(min_observations=50)
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # an informative stream: acceptance grows with q
        logprobs = torch.rand(ROWS, 4, generator=gen).clamp(min=1e-3).log()
        selection = selector.select(logprobs)
        accept = torch.rand(ROWS, 4, generator=gen) < under_confident(logprobs.exp(), None)
        run = accept.to(torch.int64).cumprod(1).sum(1)  # accepted if all 4 were verified
        selector.update(selection, torch.minimum(run, selection.lengths))
    assert bool(selector.guard.trusted())
    confident = torch.log(torch.tensor([[0.95] * 4, [0.05] * 4]))
    assert selector.select(confident).lengths.tolist() == [4, 0]


def test_request_ids_reset_the_slots_that_change_hands() -> None:
    history = RequestHistory()
    selector = TetrisSelector(k=2, extra=1, estimator=history)
    logprobs = torch.full((3, 3), -0.1)
    for _ in range(5):
        selection = selector.select(logprobs, request_ids=torch.tensor([7, 8, 9]))
        selector.update(selection, selection.lengths)
    assert (history._trials > 0).all()
    selector.select(logprobs, request_ids=torch.tensor([7, 10, 9]))  # slot 1 holds request 10
    assert (history._trials.sum(1) > 0).tolist() == [True, False, True]


def test_unknown_estimator_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="estimator must be"):
        TetrisSelector(k=2, estimator="oracle")


def test_tree_outcomes_follow_the_accepted_path() -> None:
    # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; accepted path: 0 -> 3
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    selected = torch.tensor([[True, True, True, True, True]])
    accepted = torch.tensor([[True, False, False, True, False]])
    tested, passed = tree_outcomes(selected, parents, accepted)
    # node 1 comes after the accepted sibling 0: never tried; node 4's parent was not accepted
    assert tested.tolist() == [[True, False, True, True, False]]
    assert passed.tolist() == [[True, False, False, True, False]]


def test_estimators_on_chain_shaped_trees_match_the_flat_path() -> None:
    """A chain is the tree parents[j] = j - 1: same estimates, outcomes and selections."""
    flat, tree = TetrisSelector(k=2, extra=2), TetrisSelector(k=2, extra=2)
    parents = chain_parents(ROWS, 4)
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        logprobs = torch.rand(ROWS, 4, generator=gen).clamp(min=1e-3).log()
        a = flat.select(logprobs)
        b = tree.select(logprobs, parents=parents)
        assert torch.equal(a.mask, b.mask)
        accept = torch.rand(ROWS, 4, generator=gen) < under_confident(logprobs.exp(), None)
        num_accepted = torch.minimum(accept.to(torch.int64).cumprod(1).sum(1), a.lengths)
        flat.update(a, num_accepted)
        path = torch.arange(4) < num_accepted.unsqueeze(1)
        tree.update(b, num_accepted, accepted_nodes=path)
    assert torch.allclose(flat.estimator._weights, tree.estimator._weights)


def test_tree_update_needs_the_accepted_path() -> None:
    selector = TetrisSelector(k=1, extra=1)
    parents = torch.tensor([[-1, -1, 0]])
    selection = selector.select(torch.full((1, 3), -0.5), parents=parents)
    with pytest.raises(ValueError, match="accepted_nodes"):
        selector.update(selection, torch.tensor([1]))
    with pytest.raises(ValueError, match="accepted_nodes must be a bool tensor"):
        selector.update(selection, torch.tensor([1]), accepted_nodes=torch.ones(1, 2))
    selector.update(
        selection, torch.tensor([1]), accepted_nodes=torch.tensor([[True, False, False]])
    )


def test_outcomes_take_the_accepted_path_as_an_argument() -> None:
    """The accepted path reaches ``outcomes`` as an argument: nothing from one update lingers
    on the selector for a later call."""
    selector = TetrisSelector(k=1, extra=1)
    parents = torch.tensor([[-1, -1, 0]])
    selection = selector.select(torch.full((1, 3), -0.5), parents=parents)
    path = torch.tensor([[True, False, False]])
    selector.update(selection, torch.tensor([1]), accepted_nodes=path)
    got = selector.outcomes(selection, torch.tensor([1]), path)
    expected = tree_outcomes(selection.mask, parents, path)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with pytest.raises(ValueError, match="accepted_nodes"):
        selector.outcomes(selection, torch.tensor([1]))


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-4, 1 - 1e-4)
    return torch.log(p / (1 - p))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_history_model_matches_the_dense_feature_matrix(tree: bool) -> None:
    """Estimates and one learning step equal the model written densely from its definition:
    ``X = [1, logit(q_cal), logit(rate_s)..., position / 8]`` (``[B, K, F]``),
    ``p = sigmoid(X @ w)``, ``w -= lr * sum(tested * (p - passed) * X) / tested.sum()``."""
    gen = torch.Generator().manual_seed(7)
    estimator = RequestHistory()
    run_stream(estimator, lambda q, rows: q.sqrt(), steps=5)  # non-trivial weights and rates
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).log()
    positions = torch.randint(0, 4, (ROWS, WIDTH), generator=gen) if tree else None
    depth = torch.arange(WIDTH).expand(ROWS, WIDTH) if positions is None else positions
    strength, rate = estimator.strength, estimator._batch_rate
    rates = (estimator._hits + strength * rate) / (estimator._trials + strength)  # [B, S]
    dense = torch.cat(
        [
            torch.ones(ROWS, WIDTH, 1),
            _logit(estimator.calibration.probabilities(logprobs, positions)).unsqueeze(2),
            _logit(rates).unsqueeze(1).expand(ROWS, WIDTH, rates.shape[1]),
            (depth.to(torch.float32) / 8).unsqueeze(2),
        ],
        dim=2,
    )
    weights = estimator._weights.clone()
    p = torch.sigmoid(dense @ weights)
    torch.testing.assert_close(
        estimator.estimate(logprobs, positions), p.clamp(1e-4, 1 - 1e-4).log()
    )
    tested = torch.rand(ROWS, WIDTH, generator=gen) < 0.7
    passed = tested & (torch.rand(ROWS, WIDTH, generator=gen) < 0.5)
    estimator.learn(logprobs, tested, passed, positions)
    error = (p - passed.float()) * tested.float()
    gradient = (error.unsqueeze(2) * dense).sum(dim=(0, 1)) / tested.sum()
    torch.testing.assert_close(estimator._weights, weights - estimator.lr * gradient)


@pytest.mark.parametrize("name", ["calibrated", "history"])
def test_estimates_follow_an_input_buffer_refilled_in_place(name: str) -> None:
    """Loops with static buffers (CUDA graphs) refill one tensor every step: no estimate may
    come from a cache keyed on the tensor's identity."""
    reused, fresh = ESTIMATORS[name](), ESTIMATORS[name]()
    for estimator in (reused, fresh):
        run_stream(estimator, under_confident, steps=3)
    buffer = torch.full((ROWS, WIDTH), -3.0)
    reused.estimate(buffer)
    buffer.fill_(-0.01)
    torch.testing.assert_close(reused.estimate(buffer), fresh.estimate(buffer.clone()))
