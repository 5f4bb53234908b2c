"""Acceptance estimators: convergence on synthetic streams, per-request resets, the guard, the
default's choice between the draft's ranking and a learned one, and capture in a graph."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from conftest import OneDevicePerOp, distrust, paper_tetris
from specselect import Selection, TetrisSelector
from specselect.estimators import (
    ESTIMATORS,
    AcceptanceEstimator,
    CalibratedDraft,
    DraftProbability,
    RankingChoice,
    RankingGuard,
    RequestHistory,
    make_estimator,
    observed_outcomes,
    tree_outcomes,
)
from specselect.estimators.history import VARIANCE_FLOOR
from specselect.estimators.synthetic import CALIBRATIONS, synthetic_traces
from specselect.replay import Traces, iter_replay
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


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["never-accepted", "always-accepted"])
@pytest.mark.parametrize("cls", [RequestHistory, RankingChoice])
def test_estimates_stay_finite_when_every_draft_fails_or_passes(cls, rate: float) -> None:
    """A batch that never (or always) accepts decays one of its running counts below float32's
    range (0.95 per step: 2100 steps); the estimates must stay finite log-probabilities and
    follow the evidence, and the guard's histograms must keep taking them."""
    estimator, guard = cls(), RankingGuard()
    run_stream(estimator, lambda q, rows: torch.full_like(q, rate), steps=2100, guard=guard)
    estimates = estimator.estimate(torch.full((ROWS, WIDTH), 0.5).log())
    assert torch.isfinite(estimates).all() and (estimates <= 0).all()
    p = estimates.exp()
    assert bool((p < 0.05).all()) if rate == 0 else bool((p > 0.95).all())
    assert torch.isfinite(guard.auc())


def remembering_history() -> RequestHistory:
    """A history whose calibration never forgets (so that only the batch rate could move)."""
    return RequestHistory(CalibratedDraft(decay=1.0))


@pytest.mark.parametrize(
    "make",
    [remembering_history, lambda: RankingChoice(remembering_history(), decay=0.9)],
    ids=["history", "choice"],
)
def test_an_idle_stretch_keeps_what_was_learned(
    make: Callable[[], RequestHistory | RankingChoice],
) -> None:
    """Steps that test nothing (every row inactive) decay the evidence without changing its
    ratios. After 400 of them (the batch's counts below 1e-4; the choice's tested count below
    1e-12) the estimates and the reported log-losses are those after 200, which fell below
    neither (a floor on those totals made every history estimate collapse)."""
    estimator = make()
    gen = run_stream(estimator, under_confident, steps=100)
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).log()
    nothing = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    snapshots = []
    for _ in range(2):
        for _ in range(200):
            estimator.learn(logprobs, nothing, nothing)
        losses = estimator.log_losses() if isinstance(estimator, RankingChoice) else None
        snapshots.append((estimator.estimate(logprobs), losses))
    (estimates, losses), (later_estimates, later_losses) = snapshots
    assert torch.allclose(later_estimates, estimates, atol=1e-4)
    if losses is not None:
        assert torch.allclose(later_losses, losses, rtol=1e-4) and bool((losses > 0).all())


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["never-accepted", "always-accepted"])
def test_guard_keeps_its_verdict_while_one_outcome_fades(rate: float) -> None:
    """Once a batch stops failing (or passing), that outcome's histogram decays towards
    float32's smallest values (decay 0.9: 400 steps; the default 0.99 takes ~4500); the AUC is
    still the ratio of what is left, not ~0 (an inverted ranking, which made the guard fall
    back)."""
    guard = RankingGuard(decay=0.9)
    run_stream(DraftProbability(), under_confident, steps=100, guard=guard)
    assert float(guard.auc()) > 0.6
    run_stream(DraftProbability(), lambda q, rows: torch.full_like(q, rate), 400, 1, guard)
    assert float(guard.auc()) > guard.min_auc and bool(guard.trusted())


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["never-accepted", "always-accepted"])
def test_guard_trusts_scores_that_no_failure_speaks_against(rate: float) -> None:
    """Only passes from the start: nothing ranked wrong, so a draft that is always right keeps
    its scores, though their AUC reads 0.5. Only failures still read as no signal (the fixed
    window wastes less than a large budget would)."""
    guard = RankingGuard()
    run_stream(DraftProbability(), lambda q, rows: torch.full_like(q, rate), 100, 0, guard)
    assert float(guard._histograms.sum()) > guard.min_observations  # type: ignore[union-attr]
    assert float(guard.auc()) == 0.5
    assert bool(guard.trusted()) == (rate == 1.0)


@pytest.mark.parametrize(("decay", "per_step"), [(0.99, 1), (0.9, 10)])
def test_the_guard_counts_every_tested_token_however_few_per_step(
    decay: float, per_step: int
) -> None:
    """The early phase ends after ``min_observations`` tested tokens, however they are spread
    over steps. Uninformative scores (all alike: AUC 0.5) must then be distrusted; the decayed
    count, which saturates at ``per_step / (1 - decay)`` = 100 here, kept the guard trusting
    them forever."""
    guard = RankingGuard(decay=decay)
    scores = torch.full((1, per_step), -0.5)
    tested = torch.ones(1, per_step, dtype=torch.bool)

    def steps(n: int) -> None:
        for step in range(n):
            passed = (torch.arange(per_step).view(1, -1) + step) % 2 == 0  # [1, per_step]
            guard.observe(scores, tested, passed)

    steps(guard.min_observations // per_step - 1)
    assert bool(guard.trusted())  # still early
    steps(1)
    assert float(guard.auc()) == 0.5 and not bool(guard.trusted())
    guard.reset()
    steps(1)
    assert bool(guard.trusted())  # early again: the count was forgotten too


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


def test_guard_trusts_until_the_evidence_says_otherwise() -> None:
    """Before ``min_observations`` tested tokens the scores are trusted, even uninformative
    ones: the warm start is the ranking itself, not standard SD."""

    def no_signal(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.full_like(q, 0.7)

    guard = RankingGuard(min_observations=10_000)
    run_stream(DraftProbability(), no_signal, steps=20, guard=guard)
    assert abs(float(guard.auc()) - 0.5) < 0.1 and bool(guard.trusted())


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimates_keep_minus_inf_and_stay_log_probabilities(name: str) -> None:
    estimator = ESTIMATORS[name]()
    logprobs = torch.tensor([[-0.1, -2.0, float("-inf")], [0.0, -30.0, -1.0]])
    out = estimator.estimate(logprobs)
    assert out.shape == logprobs.shape
    assert torch.equal(out == float("-inf"), logprobs == float("-inf"))
    assert (out <= 0).all()


def bad_outcomes(x: torch.Tensor) -> dict[str, tuple]:
    """``learn`` arguments for ``[1, 2]`` log-probs ``x``, each wrong in one way."""
    yes, no = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)
    return {
        "passed-untested": ((x, no, yes), ValueError, "passed must imply tested"),
        "mask-shape": ((x, yes[:, :1], yes[:, :1]), ValueError, r"tested must have shape \[1, 2\]"),
        "mask-dtype": ((x, yes, yes.float()), TypeError, "passed must be a bool tensor"),
        "mask-device": ((x, yes.to("meta"), yes), ValueError, "tested is on meta"),
        "positions-shape": ((x, yes, yes, torch.zeros(2, dtype=torch.int64)), ValueError, "rank 2"),
        "positions-dtype": ((x, yes, yes, torch.zeros(1, 2)), TypeError, "positions must be an"),
        "logprobs-dtype": ((x.to(torch.int64), yes, yes), TypeError, "draft_logprobs must be a"),
        "logprobs-nan": ((x.clone().fill_(math.nan), yes, yes), ValueError, "contains NaN"),
        "logprobs-posinf": ((x.clone().fill_(math.inf), yes, yes), ValueError, r"contains \+inf"),
        "logprobs-positive": ((x + 3, yes, yes), ValueError, "contains positive values"),
        "positions-negative": (
            (x, yes, yes, -torch.ones(1, 2, dtype=torch.int64)),
            ValueError,
            "positions must be >= 0",
        ),
    }


@pytest.mark.parametrize("case", sorted(bad_outcomes(torch.zeros(1, 2))))
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_learn_refuses_inconsistent_outcomes_before_changing_state(name: str, case: str) -> None:
    """Every estimator's ``learn`` checks its arguments first: a pass that was not tested (it
    counted as an acceptance and a rejection) and masks of another shape, dtype or device (a
    scatter used to fail after the counts had decayed) leave what was learned untouched."""
    estimator = ESTIMATORS[name]()
    x = torch.tensor([[-0.1, -2.0]])
    estimator.learn(x, torch.ones(1, 2, dtype=torch.bool), torch.tensor([[True, False]]))
    before = estimator.estimate(x)
    arguments, error, match = bad_outcomes(x)[case]
    with pytest.raises(error, match=match):
        estimator.learn(*arguments)
    assert torch.equal(estimator.estimate(x), before)


BAD_ESTIMATES = {  # estimate arguments for [1, 2] log-probs x, each wrong in one way
    "logprobs-rank": (lambda x: (x[0],), ValueError, "draft_logprobs must have rank 2"),
    "logprobs-nan": (lambda x: (x.clone().fill_(math.nan),), ValueError, "contains NaN"),
    "logprobs-positive": (lambda x: (x + 3,), ValueError, "contains positive values"),
    "positions-dtype": (lambda x: (x, torch.zeros(1, 2)), TypeError, "positions must be an"),
    "positions-negative": (
        lambda x: (x, -torch.ones(1, 2, dtype=torch.int64)),
        ValueError,
        "positions must be >= 0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ESTIMATES))
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimate_refuses_what_is_no_log_probability(name: str, case: str) -> None:
    """Called directly, every estimator checks what ``select`` checks for it: a NaN estimate
    used to reach the selection silently, and one NaN learned made every later estimate NaN."""
    estimator = ESTIMATORS[name]()
    arguments, error, match = BAD_ESTIMATES[case]
    with pytest.raises(error, match=match):
        estimator.estimate(*arguments(torch.tensor([[-0.1, -2.0]])))


@pytest.mark.parametrize(
    ("estimates", "passed", "match"),
    [
        (torch.tensor([[math.nan, -1.0]]), None, "estimates contains NaN"),
        (torch.tensor([[0.5, -1.0]]), None, "estimates contains positive values"),
        (torch.tensor([[-0.5, -1.0]]), torch.tensor([[True, True]]), "passed must imply tested"),
    ],
    ids=["nan", "positive", "untested-pass"],
)
def test_ranking_guard_checks_what_it_observes(estimates, passed, match: str) -> None:
    """A NaN score used to fail deep in an index_add, a pass outside the tested tokens to be
    counted as a pass."""
    guard = RankingGuard()
    tested = torch.tensor([[True, False]])
    with pytest.raises(ValueError, match=match):
        guard.observe(estimates, tested, tested if passed is None else passed)


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (torch.zeros(3, dtype=torch.int64), TypeError, "rows must be a bool tensor"),
        (torch.zeros(2, dtype=torch.bool), ValueError, r"rows must have shape \[3\]"),
        (torch.zeros(3, dtype=torch.bool, device="meta"), ValueError, "rows is on meta"),
    ],
    ids=["dtype", "shape", "device"],
)
def test_reset_rows_checks_its_mask(rows: torch.Tensor, error: type[Exception], match: str):
    """The same mask check as a selector's ``active`` (it raised another exception type for a
    wrong dtype, and let a mask on another device through)."""
    history = RequestHistory()
    history.estimate(torch.zeros(3, 2))
    with pytest.raises(error, match=match):
        history.reset_rows(rows)


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
    ("factory", "error", "match"),
    [
        (lambda: CalibratedDraft(bins=0), ValueError, "bins"),
        (lambda: CalibratedDraft(decay=1.5), ValueError, "decay"),
        (lambda: CalibratedDraft(decay=0), ValueError, r"decay must be a finite float in \(0, 1\]"),
        (lambda: CalibratedDraft(prior=0), ValueError, "prior"),
        (lambda: CalibratedDraft(prior=math.inf), ValueError, "prior must be a finite float > 0"),
        (
            lambda: CalibratedDraft(prior="4"),
            TypeError,
            "prior must be a finite float > 0, got str",
        ),
        (lambda: RequestHistory(lr=0), ValueError, "lr"),
        (lambda: RequestHistory(lr=math.inf), ValueError, "lr must be a finite float > 0, got inf"),
        (lambda: RequestHistory(lr="0.1"), TypeError, "lr must be a finite float > 0, got str"),
        (lambda: RequestHistory(strength=math.inf), ValueError, "strength must be a finite"),
        (lambda: RequestHistory(history_weight=math.nan), ValueError, "history_weight must be"),
        (lambda: RequestHistory(draft_weight=-math.inf), ValueError, "draft_weight must be"),
        (lambda: RequestHistory(calibrated_weight=math.nan), ValueError, "calibrated_weight"),
        (lambda: RequestHistory(calibration="calibrated"), TypeError, "calibration must be"),
        (lambda: RequestHistory(request_decays=(0.5, 1.5)), ValueError, r"request_decays\[1\]"),
        (lambda: RequestHistory(request_decays=(math.nan,)), ValueError, "request_decays"),
        (lambda: RequestHistory(request_decays=()), ValueError, "request_decays"),
        (lambda: RequestHistory(request_decays=0.5), TypeError, "request_decays must be a seq"),
        (lambda: RankingGuard(min_auc=2), ValueError, "min_auc"),
        (lambda: RankingGuard(min_auc=math.nan), ValueError, "min_auc"),
        (lambda: RankingGuard(decay=math.nan), ValueError, "decay"),
        (lambda: RankingChoice(margin=-1), ValueError, "margin"),
        (lambda: RankingChoice(margin=math.inf), ValueError, "margin must be a finite float >= 0"),
        (lambda: RankingChoice(learned="history"), TypeError, "learned must be"),
        (lambda: RankingChoice(decay=2), ValueError, "decay"),
        (lambda: RequestHistory(features=-1), ValueError, "features must be >= 0"),
        (lambda: RequestHistory(features=2.0), TypeError, "features must be an int"),
        (lambda: RequestHistory(feature_lr=0), ValueError, "feature_lr"),
        (lambda: RequestHistory(feature_lr=math.nan), ValueError, "feature_lr"),
    ],
)
def test_bad_estimator_arguments(factory, error: type[Exception], match: str) -> None:
    """Every hyperparameter is a finite number in its range: an infinite or NaN one made every
    estimate NaN, and TETRIS then silently selected nothing."""
    with pytest.raises(error, match=match):
        factory()


def test_default_tetris_starts_as_the_papers_ranking() -> None:
    """No evidence yet: the default TETRIS ranks by the draft probabilities, as the paper does
    (it used to fall back to standard SD's fixed window until its guard trusted an estimate)."""
    logprobs = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, 0.1]]))
    raw = TetrisSelector(k=2, extra=2, estimator=None, guard=False).select(logprobs)
    assert raw.lengths.tolist() == [4, 0]  # the paper's TETRIS on the raw draft probabilities
    assert TetrisSelector(k=2, extra=2).select(logprobs).lengths.tolist() == [4, 0]


def test_a_short_default_run_is_not_standard_sd() -> None:
    """``examples/custom_loop.py`` as a new user runs it: 8 requests, 4 steps. The default
    TETRIS used to print ``[3] * 8`` (standard SD's window) at every step; it now starts with
    the paper's choice and never falls back to the fixed window."""
    torch.manual_seed(0)
    default = TetrisSelector(k=3, extra=2)
    for step in range(4):
        logprobs = torch.rand(8, 5).log()  # [8, 5]
        selection = default.select(logprobs)
        assert selection.lengths.tolist() != [3] * 8
        if step == 0:
            paper = paper_tetris(k=3, extra=2).select(logprobs)
            assert torch.equal(selection.mask, paper.mask)
        num_accepted = torch.minimum(selection.lengths, torch.randint(0, 6, (8,)))
        default.update(selection, num_accepted)


@pytest.mark.parametrize(
    ("budget", "lengths"), [(0, [0, 0, 0]), (1, [1, 0, 0]), (4, [2, 1, 1]), (9, [2, 2, 2])]
)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_tetris_guard_fallback_keeps_a_fixed_budget(budget: int, lengths: list, tree: bool):
    """Untrusted, TETRIS falls back to standard SD's windows trimmed to the budget,
    shallowest positions first (then lower rows), and still closed under ancestors."""
    untrusted = RankingGuard(min_auc=1.0, min_observations=0)
    selector = TetrisSelector(k=2, extra=2, budget=budget, guard=untrusted)  # resets the guard
    distrust(untrusted)
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
    guard = selector.guard
    assert float(guard._histograms.sum()) > guard.min_observations  # type: ignore[union-attr]
    assert bool(guard.trusted())  # on evidence, not as the warm start
    # Acceptance 0.4 + 0.6 q lifts a middling row's estimates (q = 0.38: ~0.6 each) above a
    # long shot followed by certainties, which the raw draft probabilities rank the other way;
    # the fallback window would be [2, 2]. (Rows of 0.95 and 0.05 gave [4, 0] whether the
    # estimator was used or not.)
    middling = torch.log(torch.tensor([[0.38] * 4, [0.03, 0.99, 0.99, 0.99]]))
    assert paper_tetris(k=2, extra=2).select(middling).lengths.tolist() == [3, 1]
    assert selector.select(middling).lengths.tolist() == [4, 0]


def test_request_ids_reset_the_slots_that_change_hands() -> None:
    selector = TetrisSelector(k=2, extra=1)
    history = selector.estimator.learned  # the default's learned estimate
    logprobs = torch.full((3, 3), -0.1)
    for _ in range(5):
        selection = selector.select(logprobs, request_ids=torch.tensor([7, 8, 9]))
        selector.update(selection, selection.lengths)
    seen = history.request_counts().sum(dim=(0, 2)) > 0  # [B]: tested tokens per slot
    assert seen.all()
    selector.select(logprobs, request_ids=torch.tensor([7, 10, 9]))  # slot 1 holds request 10
    seen = history.request_counts().sum(dim=(0, 2)) > 0
    assert seen.tolist() == [True, False, True]


def test_unknown_estimator_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="estimator must be an AcceptanceEstimator, None or"):
        TetrisSelector(k=2, estimator="oracle")
    with pytest.raises(TypeError, match=r"estimator must be .*, got 3"):  # was a ValueError
        TetrisSelector(k=2, estimator=3)  # type: ignore[arg-type]


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
    assert torch.allclose(flat.estimator.learned._weights, tree.estimator.learned._weights)


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
    ``X = [logit q, logit q_cal, position / 8, 1, logit(rate_s)...]`` (``[B, K, F]``),
    ``p = sigmoid(X @ w)``, ``w -= lr * sum(tested * (p - passed) * X) / tested.sum()``."""
    gen = torch.Generator().manual_seed(7)
    estimator = RequestHistory(draft_weight=0.5)  # every feature in use
    run_stream(estimator, lambda q, rows: q.sqrt(), steps=5)  # non-trivial weights and rates
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).log()
    positions = torch.randint(0, 4, (ROWS, WIDTH), generator=gen) if tree else None
    depth = torch.arange(WIDTH).expand(ROWS, WIDTH) if positions is None else positions
    accepted, rejected = estimator.request_counts()  # [B, S] each
    batch_rate = estimator._batch[0] / estimator._batch.sum()
    rates = (accepted + estimator.strength * batch_rate) / (
        accepted + rejected + estimator.strength
    )  # [B, S]
    q = logprobs.exp()
    dense = torch.cat(
        [
            torch.log(q / (1 - q)).unsqueeze(2),
            _logit(estimator.calibration.probabilities(logprobs, positions)).unsqueeze(2),
            (depth.to(torch.float32) / 8).unsqueeze(2),
            torch.ones(ROWS, WIDTH, 1),
            _logit(rates).unsqueeze(1).expand(ROWS, WIDTH, rates.shape[1]),
        ],
        dim=2,
    )
    weights = estimator._weights.clone()
    p = torch.sigmoid(dense @ weights)
    torch.testing.assert_close(estimator.estimate(logprobs, positions), p.log())
    tested = torch.rand(ROWS, WIDTH, generator=gen) < 0.7
    passed = tested & (torch.rand(ROWS, WIDTH, generator=gen) < 0.5)
    estimator.learn(logprobs, tested, passed, positions)
    error = (p - passed.float()) * tested.float()
    gradient = (error.unsqueeze(2) * dense).sum(dim=(0, 1)) / tested.sum()
    torch.testing.assert_close(estimator._weights, weights - estimator.lr * gradient)


def feature_stream(estimator, steps: int, seed: int = 0) -> torch.Generator:
    """Outcomes that only a per-token feature predicts: a token whose first feature is 1 is
    accepted with probability 0.9, any other with 0.3, whatever the draft says."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logprobs, features = feature_batch(gen)
        accepted = torch.rand(ROWS, WIDTH, generator=gen) < feature_truth(features)
        num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
        estimator.estimate(logprobs, None, features)
        outcomes = observed_outcomes(torch.full((ROWS,), WIDTH), num_accepted, WIDTH)
        estimator.learn(logprobs, *outcomes, None, features)
    return gen


def feature_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, K] log-probs, [B, K, 4] features)``: a binary first feature, three of noise."""
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).clamp(min=1e-3).log()
    features = torch.rand(ROWS, WIDTH, 4, generator=gen)
    features[..., 0] = (features[..., 0] < 0.3).float()
    return logprobs, features


def feature_truth(features: torch.Tensor) -> torch.Tensor:
    return torch.where(features[..., 0] > 0, 0.9, 0.3)


def test_history_learns_a_feature_that_predicts_acceptance() -> None:
    """With features the model learns what they say (a positive weight on the predictive
    one) and ranks fresh tokens far better than without them; a cold model is the model
    without features (their weights start at 0)."""
    with_features, without = RequestHistory(), RequestHistory(features=0)
    gen = torch.Generator().manual_seed(5)
    logprobs, features = feature_batch(gen)
    cold = RequestHistory()
    torch.testing.assert_close(cold.estimate(logprobs, None, features), cold.estimate(logprobs))
    for estimator in (with_features, without):
        feature_stream(estimator, steps=30)
    assert with_features._feature_state[0, 0] > 1.0  # the predictive feature's weight
    aucs = []
    for estimator in (with_features, without):
        scores = estimator.estimate(logprobs, None, features).flatten()
        aucs.append(rank_auc(scores, feature_truth(features).flatten() > 0.5))
    assert aucs[0] > 0.95 and aucs[1] < 0.6


def test_history_feature_terms_match_their_definition() -> None:
    """The feature part of the model, written out: features standardised by the decayed
    moments of the selectable tokens' features (mean, variance floored at VARIANCE_FLOOR), a term
    ``standardised @ w_f`` in the log-odds, and one AdaGrad step
    ``w_f -= feature_lr * g / sqrt(0.01 + sum of g^2)`` with ``g`` the log-loss gradient over
    the tested tokens, normalised like the other weights'."""
    estimator = RequestHistory()
    feature_stream(estimator, steps=4)  # non-trivial moments and weights
    gen = torch.Generator().manual_seed(9)
    logprobs, features = feature_batch(gen)
    logprobs[0, 3:] = float("-inf")  # not selectable: not in the moments
    state = estimator._feature_state.clone()  # [5, F]
    weights, squares, sums = state[0], state[1], state[2:]
    mean = sums[1] / sums[0]
    variance = (sums[2] / sums[0] - mean**2).clamp(min=VARIANCE_FLOOR)
    scaled = (features - mean) / variance.sqrt()
    without = RequestHistory(features=0)  # the same model but for the feature term
    without._weights, without._batch, without._decays = (
        estimator._weights.clone(),
        estimator._batch.clone(),
        estimator._decays.clone(),
    )
    without._slots = {ROWS: estimator._slots[ROWS].to(torch.device("cpu"))}
    without.calibration = estimator.calibration
    z = _logit(without.estimate(logprobs).exp()) + scaled @ weights
    estimate = estimator.estimate(logprobs, None, features)
    finite = logprobs > float("-inf")
    torch.testing.assert_close(estimate[finite], torch.sigmoid(z)[finite].log())
    tested = finite & (torch.rand(ROWS, WIDTH, generator=gen) < 0.7)
    passed = tested & (torch.rand(ROWS, WIDTH, generator=gen) < 0.5)
    estimator.learn(logprobs, tested, passed, None, features)
    error = (torch.sigmoid(z) - passed.float()) * tested.float()
    gradient = (error.unsqueeze(2) * scaled).sum(dim=(0, 1)) / tested.sum()
    expected = weights - estimator.feature_lr * gradient / (squares + gradient**2).sqrt()
    torch.testing.assert_close(estimator._feature_state[0], expected)
    seen = features[finite]  # [selectable, F]
    step = torch.stack([finite.sum().expand(4).float(), seen.sum(0), (seen**2).sum(0)])
    torch.testing.assert_close(estimator._feature_state[2:], sums * 0.99 + step)


@pytest.mark.parametrize("name", ["calibrated", "history", "choice"])
def test_reset_forgets_everything_learned(name: str) -> None:
    """After reset an estimator estimates as a new one, its feature weights and moments
    included (the loop resets its selector at every call)."""
    estimator, fresh = make_estimator(name), make_estimator(name)
    assert estimator is not None and fresh is not None
    feature_stream(estimator, steps=5)
    estimator.reset()
    logprobs, features = feature_batch(torch.Generator().manual_seed(9))
    expected = fresh.estimate(logprobs, None, features)
    torch.testing.assert_close(estimator.estimate(logprobs, None, features), expected)


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        (torch.zeros(ROWS, WIDTH), ValueError, "features must have rank 3"),
        (torch.zeros(ROWS, WIDTH + 1, 4), ValueError, r"\[B, K\] = \[32, 6\]"),
        (torch.zeros(ROWS, WIDTH, 4, dtype=torch.int64), TypeError, "floating-point"),
        (torch.full((ROWS, WIDTH, 4), math.nan), ValueError, "features must be finite"),
        (torch.zeros(ROWS, WIDTH, 3), ValueError, "reads 4 features per token"),
    ],
)
def test_bad_features_get_a_clear_error(features, error: type[Exception], match: str) -> None:
    """Through a selector's select (wrong shapes and values: before anything is learned)
    and through an estimator's learn."""
    logprobs = torch.full((ROWS, WIDTH), -0.5)
    with pytest.raises(error, match=match):
        TetrisSelector(3, 2).select(logprobs, features=features)
    estimator = RequestHistory()
    tested = torch.ones(ROWS, WIDTH, dtype=torch.bool)
    with pytest.raises(error, match=match):
        estimator.learn(logprobs, tested, tested, None, features)


def test_a_selector_passes_the_features_to_its_estimator() -> None:
    """Through a selector's select and update (not the estimator's own calls): the default
    TETRIS learns the weight of a feature that predicts acceptance, and its scores follow it."""
    selector = TetrisSelector(3, 2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        logprobs, features = feature_batch(gen)
        accepted = torch.rand(ROWS, WIDTH, generator=gen) < feature_truth(features)
        runs = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        selection = selector.select(logprobs, features=features)
        selector.update(selection, torch.minimum(selection.lengths, runs))
    learned = selector.estimator.learned  # type: ignore[union-attr]
    assert learned._feature_state[0, 0] > 1.0  # the predictive feature's weight
    logprobs, features = feature_batch(gen)
    selector.select(logprobs, features=features)
    scores = selector.last_scores.flatten()
    assert rank_auc(scores, feature_truth(features).flatten() > 0.5) > 0.9


def test_features_reach_only_estimators_that_read_them() -> None:
    """An estimator written before features existed (two arguments) still works under a
    selector given features, and so does the paper's TETRIS (no estimator)."""
    features = torch.zeros(ROWS, WIDTH, 4)
    logprobs = torch.full((ROWS, WIDTH), -0.5)
    for selector in (
        TetrisSelector(3, 2, estimator=ScaledTruth(), guard=False),
        TetrisSelector(3, 2, estimator=RankingChoice(learned=ScaledTruth())),
        paper_tetris(3, 2),
    ):
        assert not selector.uses_features
        selection = selector.select(logprobs, features=features)
        selector.update(selection, torch.zeros(ROWS, dtype=torch.int64))
    assert TetrisSelector(3, 2).uses_features


@pytest.mark.parametrize("name", ["calibrated", "history", "choice"])
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


# --------------------------------------------------------------------------------------------
# The default estimator's choice, on synthetic drafts of known calibration
# --------------------------------------------------------------------------------------------


def choice_over_a_run(traces: Traces, k: int = 3, extra: int = 2) -> list[bool]:
    """Replay the default TETRIS over ``traces``; per step, whether it ranked by the learned
    estimate."""
    selector = TetrisSelector(k, extra)
    choice = selector.estimator
    assert isinstance(choice, RankingChoice)
    return [bool(choice.uses_learned()) for _ in iter_replay(traces, selector, slots=32)]


@pytest.mark.parametrize(
    ("calibration", "learned"), [("calibrated", False), ("under-confident", True)]
)
def test_the_choice_converges_to_the_better_ranking(calibration: str, learned: bool) -> None:
    """On a calibrated draft the draft's probability is the truth and the choice settles on
    it; on a draft under-confident on half the requests, the learned estimate predicts (and
    ranks, see docs/estimators.md) better and the choice settles on it. Settled: the same
    choice over the last half of the run, for three trace seeds."""
    for seed in range(3):
        traces = synthetic_traces(calibration, requests=64, length=48, width=5, seed=seed)
        uses = choice_over_a_run(traces)
        assert len(uses) > 40
        assert uses[len(uses) // 2 :] == [learned] * (len(uses) - len(uses) // 2), seed


def test_the_guard_falls_back_only_when_neither_ranking_has_signal() -> None:
    """Pure noise (an uninformative draft, all requests alike): the guard ends on standard SD.
    With signal in either ranking it trusts the chosen scores."""
    noise = synthetic_traces("uninformative", request_spread=0.0, length=48, width=5)
    calibrated = synthetic_traces("calibrated", length=48, width=5)
    by_request = synthetic_traces("uninformative", request_spread=2.0, length=48, width=5)
    trusted = {}
    for name, traces in (("noise", noise), ("calibrated", calibrated), ("requests", by_request)):
        selector = TetrisSelector(3, 2)
        for _ in iter_replay(traces, selector, slots=32):
            pass
        assert selector.guard is not None
        trusted[name] = bool(selector.guard.trusted())
    assert trusted == {"noise": False, "calibrated": True, "requests": True}


def test_the_choice_follows_the_lower_log_loss() -> None:
    """Fed the same outcomes, the learned estimate is used once its decayed log-loss per
    tested token is below the draft's."""
    choice = RankingChoice(learned=CalibratedDraft())
    gen = run_stream(choice, under_confident, steps=30)
    draft_loss, learned_loss = choice.log_losses().tolist()
    assert learned_loss < draft_loss  # calibration beats an under-confident draft
    assert bool(choice.uses_learned())
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).log()
    expected = choice.learned.estimate(logprobs)
    torch.testing.assert_close(choice.estimate(logprobs), expected)
    fresh = RankingChoice(learned=CalibratedDraft())
    assert not bool(fresh.uses_learned())  # no evidence: the draft's own probabilities
    assert torch.equal(fresh.estimate(logprobs), logprobs)


def by_row(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Even rows accept more often than the draft says, odd rows less: within a row the draft
    orders its tokens right, across rows it does not."""
    return torch.where(rows.unsqueeze(1) % 2 == 0, 0.5 + 0.5 * q, 0.5 * q)


class ScaledTruth(AcceptanceEstimator):
    """Orders the tokens of :func:`by_row` by their true acceptance probability, and claims a
    twentieth of it: the right order at a scale far off, as a learned estimate early on."""

    def estimate(self, draft_logprobs: torch.Tensor, positions=None) -> torch.Tensor:
        rows = torch.arange(draft_logprobs.shape[0])
        return (by_row(draft_logprobs.exp(), rows) / 20).log()

    def learn(self, draft_logprobs, tested, passed, positions=None) -> None:
        pass


def test_the_choice_follows_the_better_order_whatever_its_scale() -> None:
    """A learned estimate that orders the tested tokens better (higher AUC) is used even while
    its scale makes its log-loss worse than the draft's: the log-loss alone kept the draft's
    ranking while a learned estimate's scale was still off, and cost 3 points of the
    fixed-to-oracle gap on a pair with a roughly calibrated draft (docs/estimators.md)."""
    choice = RankingChoice(learned=ScaledTruth())
    gen = run_stream(choice, by_row, steps=20)
    draft_loss, learned_loss = choice.log_losses().tolist()
    draft_auc, learned_auc = choice.aucs().tolist()
    assert learned_loss > draft_loss + 1  # nats per token: the scale is far off
    assert learned_auc > draft_auc + 0.05
    assert bool(choice.uses_learned())
    logprobs = torch.rand(ROWS, WIDTH, generator=gen).log()
    torch.testing.assert_close(choice.estimate(logprobs), choice.learned.estimate(logprobs))
    assert RankingChoice().aucs().tolist() == [0.5, 0.5]  # no evidence: no order preferred


# --------------------------------------------------------------------------------------------
# Capture: select + update traced once, replayed like a CUDA graph
# --------------------------------------------------------------------------------------------


def test_select_and_update_replay_like_eager_calls_when_traced() -> None:
    """A loop that captures ``select`` + ``update`` (CUDA graphs; ``make_fx`` here, which keeps
    live tensors as constants) replays the recorded kernels on the buffers they saw: state
    rebound to a new tensor would freeze in the graph. Replayed steps must select exactly what
    eager calls select, through the estimator's switch from the draft's ranking to the learned
    one, and the traced step may not read anything back to the host. The steps pass lookup
    features, as the loop does: their part of the model is captured too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from specselect.hf.graphs import HostReads

    rows, width, steps = 16, 5, 40
    gen = torch.Generator().manual_seed(0)
    all_logprobs = torch.rand(steps, rows, width, generator=gen).clamp(min=1e-3).log()
    # Calibrated draft probabilities for 10 steps, then half the requests accept nearly
    # everything whatever the draft says: the choice moves to the learned estimate.
    easy = (torch.arange(rows) % 2 == 0).view(1, rows, 1)  # [1, B, 1]
    truth = torch.where(easy, 0.95, 0.2).expand(steps, rows, width).clone()
    truth[:10] = all_logprobs[:10].exp()
    accepts = torch.rand(steps, rows, width, generator=gen) < truth
    all_runs = accepts.to(torch.int64).cumprod(dim=2).sum(dim=2)  # [steps, B]
    all_features = (torch.rand(steps, rows, width, 4, generator=gen) < 0.3).float()
    all_features[..., 0] = accepts.float()  # a telling feature: its weight moves selections
    logprobs = torch.empty(rows, width)  # the loop's input buffers
    features = torch.empty(rows, width, 4)
    runs = torch.empty(rows, dtype=torch.int64)
    chosen = torch.empty(rows, width, dtype=torch.bool)  # the loop's output buffer

    def step(selector: TetrisSelector) -> None:
        selection = selector.select(logprobs, features=features)
        selector.update(selection, torch.minimum(selection.lengths, runs))
        chosen.copy_(selection.mask)

    def load(index: int) -> torch.Tensor:
        logprobs.copy_(all_logprobs[index])
        runs.copy_(all_runs[index])
        features.copy_(all_features[index])
        step(eager)
        return chosen.clone()

    eager, captured = TetrisSelector(3, 2), TetrisSelector(3, 2)
    expected = load(0)
    step(captured)  # a warm-up step allocates the state, as before a CUDA graph capture
    assert torch.equal(chosen, expected)

    def checked() -> None:
        with HostReads(forbid=True, forbid_host_tensors=True):
            step(captured)

    expected = load(1)
    graph = make_fx(checked)()  # tracing runs the step for real
    assert torch.equal(chosen, expected)
    uses = []
    for index in range(2, steps):
        expected = load(index)
        uses.append(bool(eager.estimator.uses_learned()))
        graph()
        assert torch.equal(chosen, expected), index
    assert uses[-1] and not uses[0]  # the replays went through the switch


# --------------------------------------------------------------------------------------------
# Synthetic traces
# --------------------------------------------------------------------------------------------


def first_token_outcomes(traces: Traces) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, accepted)`` of every position's first drafted token, flattened."""
    q = traces.draft_logprobs[:, :, 0].exp().flatten()
    return q, (traces.runs >= 1).flatten().to(q.dtype)


def rank_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC of ``scores`` for binary ``labels`` (continuous scores: no ties)."""
    ranks = scores.argsort().argsort().to(torch.float64) + 1
    positives = labels.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@pytest.mark.parametrize("calibration", CALIBRATIONS)
def test_synthetic_drafts_have_the_calibration_they_claim(calibration: str) -> None:
    traces = synthetic_traces(calibration, requests=200, length=64, width=4, seed=1)
    q, accepted = first_token_outcomes(traces)
    gap = float(accepted.mean() - q.mean())  # > 0: under-confident
    auc = rank_auc(q, accepted)
    if calibration == "calibrated":
        bins = (q * 10).to(torch.int64).clamp(max=9)
        for b in bins.unique():
            inside = bins == b
            if int(inside.sum()) > 500:  # the bin's acceptance rate is its probability
                assert abs(float(accepted[inside].mean() - q[inside].mean())) < 0.05
    elif calibration == "under-confident":
        assert gap > 0.15 and auc > 0.7
    elif calibration == "over-confident":
        assert gap < -0.1 and auc > 0.7
    else:
        assert abs(auc - 0.5) < 0.03


def test_synthetic_traces_replay_consistently() -> None:
    """Overlapping windows agree: the run at ``t`` is ``1 + run at t + 1`` whenever the first
    token was accepted (the same Bernoulli draw decides a position for every window)."""
    traces = synthetic_traces("calibrated", requests=8, length=32, width=6)
    runs = traces.runs  # [N, T]
    accepted = runs[:, :-1] >= 1
    following = torch.minimum(runs[:, 1:] + 1, torch.tensor(6))
    assert torch.equal(runs[:, :-1][accepted], following[accepted])


def test_synthetic_traces_take_numpy_numbers() -> None:
    """Their meta holds plain numbers (Traces refuse what JSON does not give back as it is)."""
    import numpy as np

    traces = synthetic_traces("calibrated", requests=2, length=4, width=2, mean=np.float32(0.5))
    assert traces.meta["synthetic"]["mean"] == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"calibration": "perfect"}, "calibration"),
        ({"calibration": "calibrated", "requests": 0}, "requests"),
        ({"calibration": "calibrated", "request_spread": -1.0}, "request_spread"),
        ({"calibration": "calibrated", "token_spread": math.inf}, "token_spread"),
        ({"calibration": "calibrated", "mean": math.nan}, "mean"),
    ],
)
def test_synthetic_traces_reject_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_traces(**kwargs)


def learned_tensors(selector: TetrisSelector) -> list[torch.Tensor]:
    """The default TETRIS's learned state: guard histograms and count, choice statistics,
    calibration, the lookup features' weights and moments."""
    choice = selector.estimator
    guard = selector.guard
    assert isinstance(choice, RankingChoice) and guard is not None
    history = choice.learned
    assert isinstance(history, RequestHistory)
    state = [guard._histograms, guard._tested, choice._stats, history.calibration._counts]
    return [*state, history._feature_state]


READS = pytest.mark.parametrize(
    "read",
    [
        lambda s, device: s.guard.auc(device),
        lambda s, device: s.guard.trusted(device),
        lambda s, device: s.estimator.log_losses(device),
        lambda s, device: s.estimator.aucs(device),
        lambda s, device: s.estimator.uses_learned(device),
        lambda s, device: s.estimator.learned.calibration.table(device),
    ],
    ids=["auc", "trusted", "log_losses", "aucs", "uses_learned", "table"],
)


@READS
def test_a_reading_on_another_device_keeps_the_learned_state(read: Callable) -> None:
    """A diagnostic read on another device than the state's (the CPU by default, for a
    selector on a GPU; "meta" stands in for it here) copies: it neither discards what was
    learned nor rebinds the tensors a captured select + update keeps updating in place."""
    selector = TetrisSelector(2, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        selection = selector.select(-torch.rand(3, 3, generator=gen))
        selector.update(selection, selection.lengths.clamp(max=1))
    live = learned_tensors(selector)
    saved = [tensor.clone() for tensor in live]
    assert read(selector, "meta").device.type == "meta"
    assert all(a is b for a, b in zip(learned_tensors(selector), live, strict=True))
    for tensor, before in zip(live, saved, strict=True):
        assert torch.equal(tensor, before)


@READS
def test_a_reading_before_the_first_step_binds_no_state(read: Callable) -> None:
    """A diagnostic read before any step reports the defaults on the device asked for (the
    CPU by default) without tying the state to it: the first step may then run elsewhere
    ("meta" stands in for a GPU), where the state is allocated (it used to be refused)."""
    selector = TetrisSelector(2, 1)
    read(selector, "cpu")
    default_tetris_steps(selector, 1, torch.Generator().manual_seed(0), "meta")
    assert [tensor.device.type for tensor in learned_tensors(selector)] == ["meta"] * 5


def default_tetris_steps(
    selector: TetrisSelector,
    steps: int,
    gen: torch.Generator,
    device: str = "cpu",
    requests: tuple[int, ...] = (0, 1, 2),
) -> list[list[int]]:
    """``steps`` select + update calls of 3 requests on ``device``; the selected lengths."""
    lengths = []
    ids = torch.tensor(requests, device=device)
    for _ in range(steps):
        logprobs = -torch.rand(3, 3, generator=gen)
        features = (torch.rand(3, 3, 4, generator=gen) < 0.3).float()  # as the loop gives them
        selection = selector.select(
            logprobs.to(device), request_ids=ids, features=features.to(device)
        )
        selector.update(selection, selection.lengths.clamp(max=1))
        lengths.append(selection.lengths.tolist() if device != "meta" else [])
    return lengths


def test_a_moved_selector_keeps_its_learned_state_in_shape() -> None:
    """The default TETRIS's learned tensors move with the inputs ("meta" stands in for a GPU;
    the values are checked on a GPU below), and its capture key changes once per move."""
    selector = TetrisSelector(2, 1)
    gen = torch.Generator().manual_seed(0)
    default_tetris_steps(selector, 5, gen)
    key = selector.capture_key
    shapes = [tensor.shape for tensor in learned_tensors(selector)]
    with OneDevicePerOp():  # slot 1 gets a new request at the move: reset on the new device
        default_tetris_steps(selector, 1, gen, "meta", requests=(0, 7, 2))
        moved = selector.capture_key
        default_tetris_steps(selector, 2, gen, "meta")
    assert moved != key and selector.capture_key == moved
    assert [tensor.device.type for tensor in learned_tensors(selector)] == ["meta"] * 5
    assert [tensor.shape for tensor in learned_tensors(selector)] == shapes


@pytest.mark.parametrize(
    "use",
    [
        lambda e, x: e.estimate(x),
        lambda e, x: e.learn(x, x > -1, x > -0.5),
    ],
    ids=["estimate", "learn"],
)
@pytest.mark.parametrize("name", ["calibrated", "history", "choice"])
def test_an_estimator_refuses_inputs_on_another_device_than_its_state(
    name: str, use: Callable
) -> None:
    """Only a selector moves state (with ``to``, then a new capture token): used directly, an
    estimator says where its state is instead of rebinding it behind a captured graph."""
    estimator = make_estimator(name)
    assert estimator is not None
    logprobs = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    estimator.learn(logprobs, logprobs > -1, logprobs > -0.5)
    with pytest.raises(ValueError, match=r"keeps its state on cpu, got inputs on meta.*\.to\("):
        use(estimator, logprobs.to("meta"))
    estimator.to(torch.device("meta"))
    use(estimator, logprobs.to("meta"))


def test_the_guard_refuses_outcomes_on_another_device_than_its_state() -> None:
    guard = RankingGuard()
    scores = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    guard.observe(scores, scores > -1, scores > -0.5)
    meta = scores.to("meta")
    with pytest.raises(ValueError, match="RankingGuard keeps its state on cpu"):
        guard.observe(meta, meta > -1, meta > -0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_selector_moved_to_cuda_keeps_what_it_learned() -> None:
    """What the default TETRIS learned on the CPU goes with it to a GPU: it selects as a twin
    that stayed on the CPU (it used to start from scratch there)."""
    moved, stayed = TetrisSelector(2, 1), TetrisSelector(2, 1)
    assert default_tetris_steps(moved, 30, torch.Generator().manual_seed(0)) == (
        default_tetris_steps(stayed, 30, torch.Generator().manual_seed(0))
    )
    after = default_tetris_steps(moved, 10, torch.Generator().manual_seed(1), "cuda")
    assert after == default_tetris_steps(stayed, 10, torch.Generator().manual_seed(1))
    for gpu, cpu in zip(learned_tensors(moved), learned_tensors(stayed), strict=True):
        assert gpu.device.type == "cuda"
        torch.testing.assert_close(gpu.cpu(), cpu)


class LateLearner(AcceptanceEstimator):
    """Orders the tokens of :func:`by_row` backwards for its first ``bad_steps`` steps of
    learning, then by their true acceptance probability: a learning curve."""

    def __init__(self, bad_steps: int) -> None:
        self.bad_steps, self.steps = bad_steps, 0

    def estimate(self, draft_logprobs: torch.Tensor, positions=None) -> torch.Tensor:
        truth = by_row(draft_logprobs.exp(), torch.arange(draft_logprobs.shape[0]))
        return (1 - truth if self.steps < self.bad_steps else truth).clamp(min=1e-3).log()

    def learn(self, draft_logprobs, tested, passed, positions=None) -> None:
        self.steps += 1


def test_the_choice_forgets_the_learning_curve() -> None:
    """After 20 steps of a learned estimate that ranked backwards, the choice switches to it
    within 20 steps of its ranking better: statistics that remember the bad start for long
    keep the draft's ranking after the learned one overtook it (the earlier decay, 0.99,
    switched after 46 steps here; docs/estimators.md)."""
    choice = RankingChoice(learned=LateLearner(bad_steps=20))
    run_stream(choice, by_row, steps=20)
    assert not bool(choice.uses_learned())
    good_steps = 0
    while not bool(choice.uses_learned()) and good_steps < 20:
        run_stream(choice, by_row, steps=1, seed=100 + good_steps)
        good_steps += 1
    assert bool(choice.uses_learned()), "still on the draft's ranking after 20 good steps"
