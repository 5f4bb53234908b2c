"""Tests of the dynamic-window baselines: DSD, confidence threshold and HF's heuristic schedule.

Expected values are derived in the tests from the published rules (the goodput formula, the EMA
recurrence, the +2 / -1 schedule), written out by hand, not taken from the code under test.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specselect import (
    DSDSelector,
    HeuristicSelector,
    Selection,
    Selector,
    TetrisSelector,
    ThresholdSelector,
    make_selector,
)
from specselect.cost import CostModel, PassCost
from test_cost import hand_pass

NEG_INF = float("-inf")

# Small constructor arguments for each selector under test.
KWARGS: dict[str, dict[str, Any]] = {
    "dsd": {"max_k": 5, "interval": 3, "alpha0": 0.8},
    "threshold": {"max_k": 5, "threshold": 0.3},
    "heuristic": {"k0": 3, "max_k": 6},
}
CLASSES: dict[str, type[Selector]] = {
    "dsd": DSDSelector,
    "threshold": ThresholdSelector,
    "heuristic": HeuristicSelector,
}


def logprobs(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[B, K]`` log of the given probabilities (probability 0 becomes ``-inf``)."""
    return torch.tensor(rows, dtype=dtype).log()


def selection_of(lengths: list[int], width: int) -> Selection:
    return Selection.from_lengths(torch.tensor(lengths), width)


def random_logprobs(seed: int, batch: int = 6, width: int = 6) -> torch.Tensor:
    """``[B, K]`` random log-probs with some ``-inf`` entries, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(batch, width, generator=gen, dtype=torch.float64)
    probs[torch.rand(batch, width, generator=gen) < 0.15] = 0.0
    return probs.log()


def first_neg_inf(row: list[float]) -> int:
    """Index of the first ``-inf`` in ``row`` (its length if none), by a plain loop."""
    for j, value in enumerate(row):
        if value == NEG_INF:
            return j
    return len(row)


# ---------------------------------------------------------------------------------------------
# Contract shared by the three selectors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KWARGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_never_selects_neg_inf_or_beyond(name: str, seed: int) -> None:
    selector = make_selector(name, **KWARGS[name])
    draft = random_logprobs(seed)
    selector.draft_length(draft.shape[0])
    selection = selector.select(draft)
    assert selection.lengths.dtype == torch.int64
    for i, row in enumerate(draft.tolist()):
        assert int(selection.lengths[i]) <= first_neg_inf(row)
    expected_mask = torch.arange(draft.shape[1]) < selection.lengths.unsqueeze(1)
    assert torch.equal(selection.mask, expected_mask)


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_inactive_rows_get_nothing_and_active_rows_are_unchanged(name: str) -> None:
    draft = logprobs([[0.9, 0.9, 0.9, 0.9, 0.9]] * 4)
    active = torch.tensor([True, False, True, False])
    full = make_selector(name, **KWARGS[name])
    masked = make_selector(name, **KWARGS[name])
    for selector in (full, masked):
        selector.draft_length(4)
    everyone = full.select(draft).lengths
    lengths = masked.select(draft, active).lengths
    assert everyone.min() > 0, "the fixture must select something for every row"
    assert torch.equal(lengths, torch.where(active, everyone, 0))


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_registry_round_trip(name: str) -> None:
    selector = make_selector(name, **KWARGS[name])
    assert type(selector) is CLASSES[name]
    assert CLASSES[name].name == name
    for key, value in KWARGS[name].items():
        assert getattr(selector, key) == value
    assert repr(selector).startswith(f"{CLASSES[name].__name__}(")


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_select_and_update_read_no_device_values(name: str) -> None:
    """On ``meta`` tensors any read of a value fails, so passing proves there is none."""
    selector = make_selector(name, **KWARGS[name])
    selector.draft_length(3)
    draft = torch.empty(3, 5, device="meta")
    active = torch.empty(3, dtype=torch.bool, device="meta")
    selection = selector.select(draft, active)
    assert selection.lengths.device.type == "meta"
    selector.update(selection, torch.empty(3, dtype=torch.int64, device="meta"))
    assert selector.select(draft, active).mask.shape == (3, 5)


BAD_ARGS = [
    ("dsd", {"max_k": -1}, ValueError, "max_k"),
    ("dsd", {"max_k": 2.5}, TypeError, "max_k"),
    ("dsd", {"interval": 0}, ValueError, "interval"),
    ("dsd", {"alpha0": 1.5}, ValueError, "alpha0"),
    ("dsd", {"alpha0": -0.1}, ValueError, "alpha0"),
    ("dsd", {"alpha0": "high"}, TypeError, "alpha0"),
    ("dsd", {"context": -1.0}, ValueError, "context"),
    ("dsd", {"context": math.inf}, ValueError, "context"),
    ("dsd", {"context": "long"}, TypeError, "context"),
    ("dsd", {"cost_model": (1, 2, 3)}, TypeError, "cost_model"),
    ("threshold", {"max_k": -2, "threshold": 0.5}, ValueError, "max_k"),
    ("threshold", {"max_k": 4, "threshold": 1.01}, ValueError, "threshold"),
    ("threshold", {"max_k": 4, "threshold": -0.5}, ValueError, "threshold"),
    ("threshold", {"max_k": 4, "threshold": None}, TypeError, "threshold"),
    ("heuristic", {"k0": 0}, ValueError, "k0"),
    ("heuristic", {"k0": True}, TypeError, "k0"),
    ("heuristic", {"max_k": 0}, ValueError, "max_k"),
    ("heuristic", {"k0": 5, "max_k": 3}, ValueError, "max_k"),
]


@pytest.mark.parametrize(("name", "kwargs", "error", "argument"), BAD_ARGS)
def test_bad_constructor_arguments(
    name: str, kwargs: dict[str, Any], error: type[Exception], argument: str
) -> None:
    with pytest.raises(error, match=argument):
        make_selector(name, **kwargs)


# ---------------------------------------------------------------------------------------------
# DSD
# ---------------------------------------------------------------------------------------------


def hand_goodput(alpha: float, k: int, batch: int, cost: CostModel, context: float) -> float:
    """The paper's goodput written out from the terms (independent of CostModel methods)."""
    assert cost.draft is not None
    emitted = batch * (k + 1 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha))
    draft = k * hand_pass(cost.draft, batch, batch, context)
    verify = hand_pass(cost.verify, batch, batch * (k + 1), context)
    return emitted / (draft + verify)


def hand_window(alpha: float, batch: int, max_k: int, cost: CostModel, context: float) -> int:
    values = [hand_goodput(alpha, k, batch, cost, context) for k in range(max_k + 1)]
    best = max(values)
    runner_up = max((v for v in values if v != best), default=-math.inf)
    assert best - runner_up > 1e-9 * best, "test case has a near tie; pick another"
    return values.index(best)


# A target pass dominated by its fixed cost (weights streamed once per pass), a draft ~10x cheaper.
GPU_LIKE = CostModel.linear((1.5e-3, 2.0e-6, 1.0e-10), (1.5e-2, 4.0e-5, 2.0e-9))
EXPENSIVE_DRAFT = CostModel.linear((1e-2, 1e-5, 0.0), (1.5e-2, 4e-5, 0.0))
LINEAR_VERIFY = CostModel.linear((1e-4, 0.0, 0.0), (1e-3, 1e-3, 1e-7))
# Verification flat up to 64 tokens, then 1 ms per token: windows stop growing at the knee.
KNEE = CostModel(PassCost(1e-3), PassCost(1e-2, knee=64, beyond_knee=1e-3))

DSD_CASES = [
    # (alpha, batch, max_k, cost model, context)
    (0.7, 1, 8, GPU_LIKE, 512.0),
    (0.9, 8, 8, GPU_LIKE, 512.0),
    (0.9, 256, 8, GPU_LIKE, 2048.0),
    (0.5, 64, 8, GPU_LIKE, 512.0),
    (0.0, 4, 8, GPU_LIKE, 512.0),
    (1.0, 16, 6, GPU_LIKE, 512.0),
    (0.8, 4, 8, EXPENSIVE_DRAFT, 512.0),
    (0.95, 32, 10, LINEAR_VERIFY, 100.0),
    (1.0, 32, 10, LINEAR_VERIFY, 100.0),
    (0.9, 16, 8, KNEE, 512.0),
]


@pytest.mark.parametrize(("alpha", "batch", "max_k", "cost", "context"), DSD_CASES)
def test_dsd_window_maximises_hand_computed_goodput(
    alpha: float, batch: int, max_k: int, cost: CostModel, context: float
) -> None:
    selector = DSDSelector(max_k=max_k, cost_model=cost, alpha0=alpha, context=context)
    assert selector.draft_length(batch) == hand_window(alpha, batch, max_k, cost, context)


def test_dsd_cases_cover_zero_interior_and_max_windows() -> None:
    """Guard on the table above: it must exercise both ends of the range and the middle."""
    windows = {(hand_window(a, b, m, c, x), m) for a, b, m, c, x in DSD_CASES}
    assert any(w == 0 for w, _ in windows)
    assert any(w == m for w, m in windows)
    assert any(0 < w < m for w, m in windows)


def test_dsd_ties_go_to_the_smallest_window() -> None:
    """alpha = 0 and a cost that ignores the window: every window has the same goodput."""
    flat = CostModel.linear((0.0, 0.0, 0.0), (1e-2, 0.0, 0.0))
    assert {hand_goodput(0.0, k, 4, flat, 512.0) for k in range(9)} == {400.0}
    assert DSDSelector(max_k=8, cost_model=flat, alpha0=0.0).draft_length(4) == 0


def test_dsd_alpha_near_one_is_continuous_with_the_limit() -> None:
    """Just below 1 the closed form loses precision; the window must match alpha = 1."""
    cost = LINEAR_VERIFY
    near, exact = (DSDSelector(10, cost, alpha0=a, context=100.0) for a in (1 - 1e-12, 1.0))
    assert near.draft_length(32) == exact.draft_length(32) == hand_window(1.0, 32, 10, cost, 100)


def hand_ema(alpha0: float, steps: list[tuple[list[int], list[int]]]) -> float:
    alpha = alpha0
    for lengths, accepted in steps:
        if sum(lengths) > 0:
            alpha = 0.85 * alpha + 0.15 * sum(accepted) / sum(lengths)
    return alpha


EMA_STEPS = [
    ([3, 3, 0], [3, 1, 0]),  # observed 4/6; the third row is inactive
    ([2, 2, 2], [0, 0, 0]),  # observed 0
    ([0, 0, 0], [0, 0, 0]),  # nothing verified: no observation, alpha kept
    ([4, 1, 2], [4, 1, 2]),  # observed 1
    ([5, 0, 5], [2, 0, 3]),  # observed 1/2
]


@pytest.mark.parametrize("num_steps", range(len(EMA_STEPS) + 1))
def test_dsd_ema_after_updates(num_steps: int) -> None:
    selector = DSDSelector(alpha0=0.6)
    for lengths, accepted in EMA_STEPS[:num_steps]:
        selector.observe(lengths, accepted)
    expected = hand_ema(0.6, EMA_STEPS[:num_steps])
    assert selector.acceptance_estimate() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_dsd_window_is_rechosen_only_every_interval_steps() -> None:
    cost, batch, max_k, interval = GPU_LIKE, 8, 8, 3
    selector = DSDSelector(max_k=max_k, cost_model=cost, interval=interval, alpha0=0.95)
    rejections = ([2] * batch, [0] * batch)  # every step observes acceptance 0
    history: list[tuple[list[int], list[int]]] = []
    expected_windows, windows = [], []
    known_alpha = 0.95
    for step in range(3 * interval + 1):
        if step % interval == 0:
            known_alpha = hand_ema(0.95, history)
        expected_windows.append(hand_window(known_alpha, batch, max_k, cost, 512.0))
        windows.append(selector.draft_length(batch))
        selector.observe(*rejections)
        history.append(rejections)
    assert windows == expected_windows
    assert len(set(windows)) > 2, "the case must make the window change at several re-choices"


def test_dsd_between_rechoices_follows_the_number_of_active_requests() -> None:
    """Between reads the cached estimate is re-optimised for the current batch, not re-read."""
    cost = GPU_LIKE
    selector = DSDSelector(max_k=8, cost_model=cost, interval=10, alpha0=0.9)
    assert selector.draft_length(8) == hand_window(0.9, 8, 8, cost, 512.0)
    selector.observe([4] * 8, [0] * 8)
    got = selector.draft_length(256)
    assert got == hand_window(0.9, 256, 8, cost, 512.0)
    assert got != selector.draft_length(8), "batch size must matter in this case"


@pytest.mark.parametrize(
    ("make", "steps"),
    [
        (lambda: DSDSelector(max_k=4, cost_model=GPU_LIKE, interval=3), 3 + 1),
        (lambda: HeuristicSelector(k0=2, max_k=4), 2 + 1),
        (lambda: TetrisSelector(2, 2, budget="goodput", cost_model=GPU_LIKE), 4 + 1),
    ],
    ids=["dsd", "heuristic", "goodput-tetris"],
)
def test_warns_once_when_observe_is_never_called(make: Callable[[], Selector], steps: int) -> None:
    """DSD, the heuristic and the goodput budget learn from observe() alone: a loop that only
    calls update() would keep their prior windows forever, so after ``steps`` unobserved steps
    (DSD: interval + 1; the heuristic: 3; the goodput budget: 5) they say so, once per
    generation; a loop that observes every step hears nothing."""
    selector = make()
    for observed in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(20):
                if step == steps:
                    assert len(caught) == 0, "warned before the last tolerated step"
                selection = selector.select(torch.zeros(2, selector.draft_length(2)))
                selector.update(selection, selection.lengths)
                if observed:
                    selector.observe(selection.lengths.tolist(), selection.lengths.tolist())
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(messages) == (0 if observed else 1)
        assert observed or f"learns from observe(): {steps} steps passed" in messages[0]
        selector.reset()


def test_dsd_select_is_window_clipped_by_available() -> None:
    selector = DSDSelector(max_k=8, cost_model=GPU_LIKE, alpha0=0.7)
    window = selector.draft_length(3)
    assert 0 < window < 6, "the case needs a window strictly inside the drafted width"
    cut = [0.5] * (window - 1) + [0.0] * (7 - window)  # available: window - 1
    draft = logprobs([[0.5] * 6, [0.5, 0.0, 0.5, 0.5, 0.5, 0.5], cut])
    lengths = selector.select(draft).lengths
    assert lengths.tolist() == [window, 1, window - 1]


def test_dsd_reset_forgets_feedback() -> None:
    selector = DSDSelector(max_k=8, cost_model=GPU_LIKE, interval=1, alpha0=0.9)
    first = selector.draft_length(4)
    for _ in range(5):
        selector.observe([3] * 4, [0] * 4)
    assert selector.draft_length(4) < first
    selector.reset()
    assert selector.acceptance_estimate() == 0.9
    assert selector.draft_length(4) == first


# ---------------------------------------------------------------------------------------------
# Threshold
# ---------------------------------------------------------------------------------------------

THRESHOLD_CASES = [
    # (probabilities of one row, threshold, max_k, tokens kept — by hand)
    ([0.9, 0.5, 0.4, 0.9], 0.5, 8, 2),  # 0.5 is at the threshold: kept; 0.4 is below: cut
    ([0.3, 0.3, 0.3], 0.3, 8, 3),  # every token exactly at the threshold
    ([0.29, 0.9], 0.3, 8, 0),  # first token below
    ([0.9, 0.9, 0.9, 0.9], 0.5, 3, 3),  # capped by max_k
    ([0.01, 1e-4, 0.5], 0.0, 8, 3),  # threshold 0 keeps everything drafted
    ([0.01, 0.0, 0.5], 0.0, 8, 1),  # ... but never a probability-0 (-inf) token or later
    ([1.0, 1.0, 0.999, 1.0], 1.0, 8, 2),  # threshold 1 keeps only certain tokens
    ([0.7, 0.9], 1.0, 8, 0),
    ([0.8, 0.8], 0.5, 0, 0),  # max_k 0: plain decoding
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize(("probs", "threshold", "max_k", "expected"), THRESHOLD_CASES)
def test_threshold_cut_points(
    probs: list[float], threshold: float, max_k: int, expected: int, dtype: torch.dtype
) -> None:
    selector = ThresholdSelector(max_k=max_k, threshold=threshold)
    assert selector.draft_length(1) == max_k
    # log-probs computed the way a caller would: log of the probability in the working dtype
    lengths = selector.select(logprobs([probs], dtype)).lengths
    assert lengths.tolist() == [expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_threshold_keeps_tokens_exactly_at_the_threshold(dtype: torch.dtype) -> None:
    """For ~1 in 5 of these thresholds, ``float(log(p))`` rounded to ``dtype`` differs from
    ``log`` of ``p`` rounded to ``dtype``: a naive comparison would drop at-threshold tokens."""
    thresholds = [i / 1000 for i in range(1, 1001, 7)]
    draft = logprobs([[p, p, p / 2] for p in thresholds], dtype)
    for row, threshold in enumerate(thresholds):
        selection = ThresholdSelector(max_k=3, threshold=threshold).select(draft[row : row + 1])
        assert selection.lengths.tolist() == [2], f"threshold {threshold}"


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_threshold_matches_definition_on_random_rows(threshold: float) -> None:
    draft = random_logprobs(seed=7, batch=32, width=6)
    lengths = ThresholdSelector(max_k=4, threshold=threshold).select(draft).lengths.tolist()
    for row, length in zip(draft.exp().tolist(), lengths, strict=True):
        kept = 0
        while kept < 4 and row[kept] > 0 and row[kept] >= threshold:
            kept += 1
        assert length == kept


# ---------------------------------------------------------------------------------------------
# Heuristic
# ---------------------------------------------------------------------------------------------

# Each step: per row, (verified, accepted); then the expected windows after the step, by hand.
# k0 = 2, max_k = 7. Row 0 accepts everything (2 -> 4 -> 6 -> 7 cap -> 7); row 1 rejects until
# the floor (2 -> 1 -> 1) then recovers; row 2 is inactive at steps 2-3 (verified 0: unchanged).
HEURISTIC_STEPS = [
    ([(2, 2), (2, 0), (2, 1)], [4, 1, 1]),
    ([(4, 4), (1, 0), (0, 0)], [6, 1, 1]),
    ([(6, 6), (1, 1), (0, 0)], [7, 3, 1]),
    ([(7, 7), (3, 2), (1, 1)], [7, 2, 3]),
]


def observe_rows(selector: Selector, outcome: list[tuple[int, int]], **kwargs: Any) -> None:
    """``observe`` one step's (verified, accepted) pairs."""
    selector.observe([v for v, _ in outcome], [a for _, a in outcome], **kwargs)


@pytest.mark.parametrize("num_steps", range(len(HEURISTIC_STEPS) + 1))
def test_heuristic_schedule(num_steps: int) -> None:
    selector = HeuristicSelector(k0=2, max_k=7)
    expected = [2, 2, 2]
    for outcome, after in HEURISTIC_STEPS[:num_steps]:
        observe_rows(selector, outcome)
        expected = after
    draft = torch.zeros(3, 8, dtype=torch.float64)  # probability-1 tokens everywhere
    assert selector.select(draft).lengths.tolist() == expected
    assert selector.draft_length(3) == max(expected)  # drafts exactly the largest window


def test_heuristic_learns_from_observe_alone() -> None:
    """The windows live on the host: update (device tensors) teaches nothing, observe does,
    each entry for the row ``active`` says it is."""
    selector = HeuristicSelector(k0=3, max_k=9)
    draft = torch.zeros(3, 8, dtype=torch.float64)
    selection = selector.select(draft)
    selector.update(selection, selection.lengths)  # everything accepted: no effect
    assert selector.windows() == [3, 3, 3]
    observe_rows(selector, [(3, 3), (3, 1)], active=[True, False, True])
    assert selector.windows() == [5, 3, 2]
    assert selector.select(draft).lengths.tolist() == [5, 3, 2]
    assert selector.draft_length(2) == 5


def test_heuristic_uncapped_grows_without_limit() -> None:
    selector = HeuristicSelector(k0=1)
    for step in range(1, 6):
        observe_rows(selector, [(1 + 2 * (step - 1), 1 + 2 * (step - 1))])
        assert selector.windows() == [1 + 2 * step]
        assert selector.draft_length(1) == 1 + 2 * step


def test_heuristic_select_follows_windows_after_feedback() -> None:
    """The schedule acts through select: windows clipped by what is available."""
    selector = HeuristicSelector(k0=3, max_k=6)
    draft = logprobs([[0.9] * 6, [0.9, 0.9, 0.0, 0.9, 0.9, 0.9]])
    first = selector.select(draft)
    assert first.lengths.tolist() == [3, 2]
    observe_rows(selector, [(3, 3), (2, 2)])  # both accepted all they verified
    assert selector.select(draft).lengths.tolist() == [5, 2]
    assert selector.windows() == [5, 5]


def test_heuristic_drafts_for_active_rows_only() -> None:
    """A finished row's grown window must not make the batch draft more than any active
    request can use; with nothing active at the last step (a new batch), k0."""
    selector = HeuristicSelector(k0=1, max_k=7)
    draft = logprobs([[0.9] * 8, [0.9] * 8])
    for _ in range(3):  # row 0 keeps accepting everything, row 1 nothing
        lengths = selector.select(draft).lengths.tolist()
        selector.observe(lengths, [lengths[0], 0])
    assert selector.windows() == [7, 1]
    assert selector.draft_length(2) == 7
    selector.observe([1], [0], active=[False, True])  # row 0 finished
    assert selector.draft_length(1) == 1
    selector.observe([], [], active=[False, False])
    assert selector.draft_length(2) == 1  # k0


def test_heuristic_new_batch_size_raises_until_reset() -> None:
    selector = HeuristicSelector(k0=2)
    selector.select(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"draft_logprobs.*reset\(\)"):
        selector.select(torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"selection.lengths.*reset\(\)"):
        selector.update(selection_of([1, 1], 4), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"active has 5 rows.*reset\(\)"):
        selector.observe([1], [1], active=[True] + [False] * 4)
    with pytest.raises(ValueError, match=r"needs active=.*2 entries.*3 rows"):
        selector.observe([1, 1], [1, 1])  # which two of the three rows?
    selector.reset()
    assert selector.select(torch.zeros(5, 4)).lengths.tolist() == [2] * 5


def test_heuristic_reset_restores_k0() -> None:
    selector = HeuristicSelector(k0=2, max_k=9)
    for _ in range(3):
        observe_rows(selector, [(2, 2), (2, 0)])
    selector.reset()
    assert selector.windows() is None
    assert selector.draft_length(2) == 2
    assert selector.select(torch.zeros(2, 8)).lengths.tolist() == [2, 2]


@pytest.mark.parametrize("by", ["reset_rows", "request_ids"])
def test_heuristic_reset_rows_restarts_only_those_rows(by: str) -> None:
    """A slot handed to a new request starts at k0, in the next selection and on the host."""
    selector = HeuristicSelector(k0=2, max_k=9)
    draft = torch.zeros(3, 8)
    selector.select(draft, request_ids=torch.tensor([0, 1, 2]))
    for _ in range(2):
        observe_rows(selector, [(2, 2), (2, 2), (2, 0)])
    before = selector.windows()
    assert before == [6, 6, 1]
    if by == "reset_rows":
        selector.reset_rows(torch.tensor([False, True, False]))
        selection = selector.select(draft)
    else:
        selection = selector.select(draft, request_ids=torch.tensor([0, 3, 2]))
    assert selection.lengths.tolist() == [6, 2, 1]
    assert selector.windows() == [6, 2, 1]
    observe_rows(selector, [(6, 6), (2, 2), (1, 1)])
    assert selector.windows() == [8, 4, 3]
    with pytest.raises(TypeError, match="rows"):
        selector.reset_rows(torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="rows"):
        selector.reset_rows(torch.tensor([True, False]))


def test_dsd_probes_when_a_window_of_zero_looks_best() -> None:
    """A window of 0 verifies nothing, so the estimate could never recover; DSD probes with one
    token every other interval, and good probes bring the window back."""
    cost = CostModel.linear((5e-3, 0.0, 0.0), (1.5e-2, 0.0, 0.0))
    selector = DSDSelector(max_k=4, cost_model=cost, interval=4, alpha0=0.01)
    windows = []
    for _ in range(12):
        window = selector.draft_length(2)
        windows.append(window)
        lengths = selector.select(torch.zeros(2, window)).lengths.tolist()
        selector.observe(lengths, lengths)  # everything verified is accepted
    assert windows[:4] == [0, 0, 0, 0]  # the prior says drafting does not pay
    assert windows[4:8] == [1, 1, 1, 1]  # a probe interval
    assert min(windows[8:]) >= 1  # the probes were all accepted: drafting pays after all


@pytest.mark.filterwarnings("ignore:DSDSelector learns from observe")  # (nothing to observe)
def test_dsd_does_not_probe_without_active_rows() -> None:
    """With no active row there is nothing to probe: a window of 0, also at a probe interval
    (it drafted one token for nobody there)."""
    cost = CostModel.linear((5e-3, 0.0, 0.0), (1.5e-2, 0.0, 0.0))
    selector = DSDSelector(max_k=4, cost_model=cost, interval=1, alpha0=0.01)
    assert [selector.draft_length(0) for _ in range(4)] == [0, 0, 0, 0]
    assert [selector.draft_length(2) for _ in range(2)] == [0, 1]  # (probing goes on)


def test_dsd_with_max_k_zero_never_drafts() -> None:
    """``max_k = 0`` is plain decoding: no probe drafts a token it may not draft."""
    selector = DSDSelector(max_k=0, interval=1)
    windows = []
    for _ in range(6):
        windows.append(selector.draft_length(2))
        selector.select(torch.zeros(2, windows[-1]))
        selector.observe([0, 0], [0, 0])
    assert windows == [0] * 6


def test_heuristic_reset_rows_names_a_mask_of_another_batch() -> None:
    """A mask of the wrong length is named as such (not only "call reset()")."""
    selector = HeuristicSelector(k0=2, max_k=4)
    selector.select(torch.full((3, 4), -0.1))
    with pytest.raises(ValueError, match="rows must have one entry per batch row"):
        selector.reset_rows(torch.tensor([True, False]))
