"""Tests of the cost model: its invariant and ``CostModel.fit``.

Expected fits come from the formulas written out by hand or from ``scipy.optimize.nnls`` (a dev
dependency, independent of the numpy-only solver under test).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls

from specselect.cost import DEFAULT_DRAFT, DEFAULT_VERIFY, CostModel, CostSample

TRUE = CostModel(draft_coef=(1.5e-3, 2.0e-6, 1.0e-10), verify_coef=(1.5e-2, 4.0e-5, 2.0e-9))
BATCHES = (1, 4, 16)
VERIFY_SIZES = ((1, 5), (8, 40), (32, 160))  # (batch, tokens): k = 4 plus the bonus token
CONTEXTS = (256.0, 1024.0, 4096.0)


def draft(batch: int, tokens: int, context: float, model: CostModel = TRUE) -> CostSample:
    """A draft sample timed exactly by ``model``."""
    return CostSample("draft", batch, tokens, context, model.draft_time(batch, tokens, context))


def verify(batch: int, tokens: int, context: float, model: CostModel = TRUE) -> CostSample:
    """A verification sample timed exactly by ``model``."""
    return CostSample("verify", batch, tokens, context, model.verify_time(batch, tokens, context))


GOOD_DRAFT = [draft(b, 4, c) for b in BATCHES for c in CONTEXTS]
GOOD_VERIFY = [verify(b, t, c) for b, t in VERIFY_SIZES for c in CONTEXTS]


def design(samples: list[CostSample]) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares problem of the module docstring's formulas, written out independently."""
    if samples[0].kind == "draft":
        x = [[1.0, s.batch, s.batch * s.context] for s in samples]
        y = [s.seconds / s.tokens for s in samples]
    else:
        x = [[1.0, s.tokens, s.tokens * s.context] for s in samples]
        y = [s.seconds for s in samples]
    return np.array(x), np.array(y)


# --- fit on good data ----------------------------------------------------------------------


def test_fit_recovers_exact_coefficients() -> None:
    fitted = CostModel.fit(GOOD_DRAFT + GOOD_VERIFY)
    assert fitted.draft_coef == pytest.approx(TRUE.draft_coef, rel=1e-6)
    assert fitted.verify_coef == pytest.approx(TRUE.verify_coef, rel=1e-6)
    # The reviewer's point of comparison: one-context data predicted 0.034 s here.
    assert fitted.verify_time(8, 40, 2048) == pytest.approx(TRUE.verify_time(8, 40, 2048))


def test_fit_accepts_a_generator_and_any_order() -> None:
    samples = GOOD_VERIFY[::-1] + GOOD_DRAFT
    fitted = CostModel.fit(s for s in samples)
    assert fitted.verify_coef == pytest.approx(TRUE.verify_coef, rel=1e-6)


# --- a. samples that do not determine the coefficients -------------------------------------

ONE_CONTEXT_VERIFY = [verify(b, t, 512.0) for b, t in VERIFY_SIZES]
RANK_DEFICIENT = {
    # kind, samples replacing that kind's good ones, what the message must say
    "verify at one context": ("verify", ONE_CONTEXT_VERIFY, "same context length (512)"),
    "draft at one context": ("draft", [draft(b, 4, 512.0) for b in BATCHES], "same context"),
    "draft at one batch": ("draft", [draft(8, 4, c) for c in CONTEXTS], "same batch (8)"),
    "verify at one size": ("verify", [verify(8, 40, c) for c in CONTEXTS], "same tokens (40)"),
    "three identical": ("verify", [verify(8, 40, 512.0)] * 3, "same tokens (40) and the same"),
    # draft tokens do not count: the fit is on time per pass
    "draft only tokens vary": ("draft", [draft(8, t, 512.0) for t in (1, 4, 9)], "same batch"),
    # tokens * context is the same for all three: it cannot be told from the fixed cost
    "constant product": (
        "verify",
        [verify(1, t, 4096.0 / t) for t in (4, 8, 16)],
        "tokens * context = a + b * tokens",
    ),
}


@pytest.mark.parametrize(("kind", "samples", "says"), RANK_DEFICIENT.values(), ids=RANK_DEFICIENT)
def test_fit_rejects_samples_that_do_not_vary(
    kind: str, samples: list[CostSample], says: str
) -> None:
    others = GOOD_VERIFY if kind == "draft" else GOOD_DRAFT
    with pytest.raises(ValueError, match=f"cannot determine the {kind} coefficients") as info:
        CostModel.fit(samples + others)
    assert says in str(info.value)


@pytest.mark.parametrize("kind", ["draft", "verify"])
def test_fit_needs_three_samples_of_each_kind(kind: str) -> None:
    few = (GOOD_DRAFT if kind == "draft" else GOOD_VERIFY)[:2]
    others = GOOD_VERIFY if kind == "draft" else GOOD_DRAFT
    with pytest.raises(ValueError, match=f"at least 3 '{kind}' samples, got 2"):
        CostModel.fit(few + others)


# --- b. non-negative least squares, not clipping --------------------------------------------


def test_fit_refits_after_dropping_a_negative_intercept() -> None:
    """0.5, 1.5, 2.5 s at 100, 200, 300 tokens: the unconstrained intercept is -0.5 s.

    Clipping it to 0 and keeping the slope 0.01 puts every prediction 0.5 s too high. With the
    intercept at 0 and no context dependence in the data, the best slope is
    sum(t * y) / sum(t^2) = 1100 / 140000, off by at most 2/7 s.
    """
    data = {100: 0.5, 200: 1.5, 300: 2.5}
    samples = [CostSample("verify", 1, t, c, y) for t, y in data.items() for c in (512.0, 1024.0)]
    fitted = CostModel.fit(GOOD_DRAFT + samples)
    v0, v1, v2 = fitted.verify_coef
    assert v0 == 0.0
    assert v1 == pytest.approx(1100 / 140000)
    assert v2 == pytest.approx(0.0, abs=1e-15)
    errors = [abs(fitted.verify_time(1, s.tokens, s.context) - s.seconds) for s in samples]
    assert max(errors) == pytest.approx(2 / 7)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=9, max_size=9),
    st.lists(st.floats(0.0, 1.0), min_size=9, max_size=9),
)
def test_fit_matches_scipy_nnls(draft_seconds: list[float], verify_seconds: list[float]) -> None:
    """Arbitrary timings on a full-rank grid: the fit is the non-negative least-squares optimum."""
    drafts = [
        dataclasses.replace(s, seconds=y) for s, y in zip(GOOD_DRAFT, draft_seconds, strict=True)
    ]
    verifies = [
        dataclasses.replace(s, seconds=y) for s, y in zip(GOOD_VERIFY, verify_seconds, strict=True)
    ]
    verifies[0] = dataclasses.replace(verifies[0], seconds=1.0)  # not all zero: see item d
    try:
        fitted = CostModel.fit(drafts + verifies)
    except ValueError as error:  # only if v0 = v1 = 0 is optimal: scipy must agree
        assert "the 'verify' samples fit" in str(error)
        x, y = design(verifies)
        best = np.linalg.norm(x @ nnls(x, y)[0] - y)
        attention_only = np.linalg.norm(x[:, 2:] @ nnls(x[:, 2:], y)[0] - y)
        assert attention_only <= best * (1 + 1e-9) + 1e-12
        return
    for samples, coef in ((drafts, fitted.draft_coef), (verifies, fitted.verify_coef)):
        x, y = design(samples)
        expected = nnls(x, y)[0]
        residual, best = np.linalg.norm(x @ coef - y), np.linalg.norm(x @ expected - y)
        assert residual <= best * (1 + 1e-9) + 1e-12
        assert min(coef) >= 0


# --- c. sample validation --------------------------------------------------------------------

INVALID = [
    # index into GOOD_DRAFT + GOOD_VERIFY, field, value, error
    (2, "seconds", -0.001, ValueError),
    (10, "seconds", -1.0, ValueError),
    (3, "seconds", math.nan, ValueError),
    (12, "seconds", math.inf, ValueError),
    (4, "context", math.nan, ValueError),
    (13, "context", -1.0, ValueError),
    (0, "tokens", 0, ValueError),  # was counted as 1 token
    (14, "tokens", 0, ValueError),
    (5, "batch", 0, ValueError),
    (15, "batch", -2, ValueError),
    (1, "batch", 2.0, TypeError),
    (11, "tokens", True, TypeError),
    (6, "seconds", "1.0", TypeError),
    (7, "kind", "prefill", ValueError),
]


@pytest.mark.parametrize(("index", "field", "value", "error"), INVALID)
def test_fit_names_the_invalid_sample(
    index: int, field: str, value: object, error: type[Exception]
) -> None:
    samples = GOOD_DRAFT + GOOD_VERIFY
    samples[index] = dataclasses.replace(samples[index], **{field: value})
    with pytest.raises(error, match=rf"^samples\[{index}\]\.{field} must"):
        CostModel.fit(samples)


def test_fit_accepts_zero_seconds_and_zero_context() -> None:
    """A timer's resolution can give 0 s, and an empty cache has context 0: both are valid."""
    samples = GOOD_DRAFT + GOOD_VERIFY
    samples[0] = dataclasses.replace(samples[0], seconds=0.0)
    samples[9] = dataclasses.replace(samples[9], context=0.0)
    CostModel.fit(samples)


# --- d. a step over a non-empty batch always takes time --------------------------------------


@pytest.mark.parametrize("verify_coef", [(0.0, 0.0, 0.0), (0.0, 0.0, 1e-9)])
def test_constructor_rejects_free_verification(verify_coef: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match=r"verify_coef = .* v0 \(fixed cost\) or v1"):
        CostModel(draft_coef=(0.0, 0.0, 0.0), verify_coef=verify_coef)


@pytest.mark.parametrize(
    ("draft_coef", "verify_coef"),
    [
        ((0.0, 0.0, 0.0), (1e-2, 0.0, 0.0)),
        ((1e-3, 0.0, 0.0), (0.0, 1e-5, 0.0)),
        (DEFAULT_DRAFT, DEFAULT_VERIFY),
    ],
)
def test_every_valid_model_prices_a_nonempty_step(
    draft_coef: tuple[float, float, float], verify_coef: tuple[float, float, float]
) -> None:
    """Window 0, nothing verified but the bonus token, empty cache: the cheapest possible step."""
    model = CostModel(draft_coef, verify_coef)
    assert model.step_time(batch=1, window=0, verified=0, context=0.0) > 0


@pytest.mark.parametrize(
    "seconds",
    [
        lambda s: 0.0,  # all zero
        lambda s: 1e-9 * s.tokens * s.context,  # attention only: free at context 0
    ],
    ids=["zero", "attention only"],
)
def test_fit_rejects_a_free_verification_result(seconds: Callable[[CostSample], float]) -> None:
    samples = [dataclasses.replace(s, seconds=seconds(s)) for s in GOOD_VERIFY]
    with pytest.raises(ValueError, match="the 'verify' samples fit verify_coef"):
        CostModel.fit(GOOD_DRAFT + samples)


def test_fit_allows_free_drafting() -> None:
    """Only the verification pass must cost something; a free draft is a valid (if odd) model."""
    samples = [dataclasses.replace(s, seconds=0.0) for s in GOOD_DRAFT]
    assert CostModel.fit(samples + GOOD_VERIFY).draft_coef == (0.0, 0.0, 0.0)
