"""A small linear cost model of draft and verification time.

Dynamic-window selectors (DSD) trade expected accepted tokens against time, and trace replay
turns a selector's choices into modelled seconds. Both need a cost model that can be fitted to
a real deployment from a handful of timings, with no dependency beyond numpy.

Model (seconds):

* drafting ``tokens`` tokens for ``batch`` requests is ``tokens`` sequential draft forward passes:
  ``draft_time = tokens * (d0 + d1 * batch + d2 * batch * context)``;
* verifying is one target forward pass over ``tokens`` tokens in total (all rows, bonus tokens
  included): ``verify_time = v0 + v1 * tokens + v2 * tokens * context``.

``context`` is the mean context length; the ``* context`` terms model attention over the cache.

All coefficients are >= 0, and ``v0`` or ``v1`` is > 0: a speculative step over a non-empty batch
then takes time at every context length and window (window 0 leaves only the verification pass,
``v0 + v1 * tokens`` at context 0), so modelled goodput stays finite.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from specselect._checks import check_int

# Defaults resemble a 7B target with a ~20x smaller draft on one modern GPU at small batch: the
# target pass is dominated by its fixed cost (weights streamed once per pass), the draft pass is
# ~10x cheaper. Fit to your own timings for anything quantitative.
DEFAULT_DRAFT = (1.5e-3, 2.0e-6, 1.0e-10)
DEFAULT_VERIFY = (1.5e-2, 4.0e-5, 2.0e-9)

# Singular values of the column-normalised design matrix below this fraction of the largest count
# as zero in ``fit``: a direction the samples determine this weakly would amplify timing noise by
# more than 1e9, so it is treated as not varying at all.
_RCOND = 1e-9


@dataclass(frozen=True)
class CostSample:
    """One measured forward: ``kind`` is ``"draft"`` or ``"verify"``; see the module docstring.

    ``batch`` and ``tokens`` are ints >= 1 (a draft sample's ``tokens`` is its number of
    sequential passes; a verification sample's, the tokens of its one pass, bonus tokens included);
    ``context`` and ``seconds`` are finite floats >= 0. :meth:`CostModel.fit` checks all of this.
    """

    kind: str
    batch: int
    tokens: int
    context: float
    seconds: float


@dataclass(frozen=True)
class CostModel:
    """Predicts draft and verification time; see the module docstring for the formulas.

    Raises:
        ValueError: a coefficient is negative or not finite, or ``v0 = v1 = 0`` (a verification
            pass over a non-empty batch would be free at context 0, and so would a step with
            window 0: replay goodput and DSD's goodput would be infinite).
    """

    draft_coef: tuple[float, float, float] = DEFAULT_DRAFT
    verify_coef: tuple[float, float, float] = DEFAULT_VERIFY

    def __post_init__(self) -> None:
        for name in ("draft_coef", "verify_coef"):
            coef = getattr(self, name)
            if len(coef) != 3 or any((not np.isfinite(c)) or c < 0 for c in coef):
                raise ValueError(f"{name} must be three finite non-negative floats, got {coef}")
        if _free_verification(self.verify_coef):
            raise ValueError(
                f"verify_coef = {self.verify_coef} makes a verification pass free at context 0: "
                "v0 (fixed cost) or v1 (cost per token) must be > 0, or a speculative step "
                "could take no time and have infinite goodput"
            )

    def draft_time(self, batch: int, tokens: int, context: float = 512.0) -> float:
        """Seconds to draft ``tokens`` tokens (sequential passes) for ``batch`` requests."""
        d0, d1, d2 = self.draft_coef
        return tokens * (d0 + d1 * batch + d2 * batch * context)

    def verify_time(self, batch: int, tokens: int, context: float = 512.0) -> float:
        """Seconds for one target pass over ``tokens`` tokens in total (``batch`` requests)."""
        v0, v1, v2 = self.verify_coef
        if batch == 0:
            return 0.0
        return v0 + v1 * tokens + v2 * tokens * context

    def step_time(self, batch: int, window: int, verified: int, context: float = 512.0) -> float:
        """One speculative step: draft ``window`` tokens per row, verify ``verified`` + bonus."""
        return self.draft_time(batch, window, context) + self.verify_time(
            batch, verified + batch, context
        )

    @classmethod
    def fit(cls, samples: Iterable[CostSample]) -> CostModel:
        """Non-negative least-squares fit of both formulas to measured samples.

        Each kind needs samples that determine all three of its coefficients: draft samples must
        vary ``batch`` and ``context`` independently, verification samples ``tokens`` and
        ``context`` (draft ``tokens`` only divides the time: they fit the time per pass). With
        one context length, say, the ``* context`` term cannot be told apart from the term
        without it, and any split between the two fits equally well but extrapolates
        differently; ``fit`` raises rather than pick one. Three such samples (not three
        repetitions of one) are the minimum.

        Coefficients are constrained to be >= 0 (a negative slope is noise, not a property of
        hardware) by solving the constrained problem exactly, not by clipping the unconstrained
        solution: clipping one coefficient leaves the others fitted to a term that is gone.

        Raises:
            ValueError: a sample is invalid (the message names it as ``samples[i].field``: see
                :class:`CostSample`); a kind's samples do not determine its three coefficients
                (the message says what does not vary); or the verification samples fit
                ``v0 = v1 = 0``, which the constructor rejects.
            TypeError: a sample's ``batch`` or ``tokens`` is not an int, or its ``context`` or
                ``seconds`` not a real number.
        """
        by_kind: dict[str, list[CostSample]] = {"draft": [], "verify": []}
        for i, s in enumerate(samples):
            _check_sample(i, s)
            by_kind[s.kind].append(s)
        coefs = {kind: _fit_one(kind, rows) for kind, rows in by_kind.items()}
        if _free_verification(coefs["verify"]):
            raise ValueError(
                f"the 'verify' samples fit verify_coef = {coefs['verify']}: no fixed cost and no "
                "cost per token, so a verification pass at context 0 would be free; check the "
                "samples' seconds, or set the coefficients by hand"
            )
        return cls(draft_coef=coefs["draft"], verify_coef=coefs["verify"])


def _free_verification(coef: tuple[float, float, float]) -> bool:
    """Whether ``v0 + v1 * tokens`` (the pass at context 0) is 0 for every token count."""
    return coef[0] == 0 and coef[1] == 0


def _check_sample(i: int, s: CostSample) -> None:
    """Raise, naming ``samples[i].field``, unless ``s`` is a sample that the formulas can use."""
    name = f"samples[{i}]"
    if s.kind not in ("draft", "verify"):
        raise ValueError(f"{name}.kind must be 'draft' or 'verify', got {s.kind!r}")
    # A pass with no request or no token measures nothing the formulas describe; a draft sample
    # with 0 tokens would also divide by 0 when turned into time per pass.
    check_int(f"{name}.batch", s.batch, minimum=1)
    check_int(f"{name}.tokens", s.tokens, minimum=1)
    _check_real(f"{name}.context", s.context)
    _check_real(f"{name}.seconds", s.seconds)


def _check_real(name: str, value: object) -> None:
    """Raise unless ``value`` is a finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float >= 0, got {type(value).__name__}")
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {value}")


def _fit_one(kind: str, rows: list[CostSample]) -> tuple[float, float, float]:
    """Fit one formula's three coefficients (>= 0) to the samples of one kind."""
    if len(rows) < 3:
        raise ValueError(f"fit needs at least 3 {kind!r} samples, got {len(rows)}")
    if kind == "draft":
        # seconds / tokens = d0 + d1 * batch + d2 * batch * context
        x = np.array([[1.0, r.batch, r.batch * r.context] for r in rows])
        y = np.array([r.seconds / r.tokens for r in rows])
    else:
        x = np.array([[1.0, r.tokens, r.tokens * r.context] for r in rows])
        y = np.array([r.seconds for r in rows])
    # Columns differ in scale by up to ~1e6 (1 against batch * context); normalising them makes
    # the rank test scale-free and the solves well conditioned, and leaves the signs alone.
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    scaled = x / norms
    _check_rank(kind, rows, scaled)
    c0, c1, c2 = (float(c) for c in _nonnegative_lstsq(scaled, y) / norms)
    return (c0, c1, c2)


def _check_rank(kind: str, rows: list[CostSample], x: np.ndarray) -> None:
    """Raise, saying what does not vary, unless the samples determine all columns of ``x``."""
    rank = int(np.linalg.lstsq(x, np.zeros(len(x)), rcond=_RCOND)[2])
    if rank == x.shape[1]:
        return
    size = "batch" if kind == "draft" else "tokens"
    sizes = np.array([getattr(r, size) for r in rows], dtype=float)
    contexts = np.array([r.context for r in rows], dtype=float)
    if _constant(sizes) and _constant(contexts):
        problem = (
            f"all {kind!r} samples have the same {size} ({sizes[0]:g}) and the same context "
            f"length ({contexts[0]:g}); vary both"
        )
    elif _constant(contexts):
        problem = (
            f"all {kind!r} samples have the same context length ({contexts[0]:g}), so the "
            f"{size} * context term cannot be told apart from the {size} term; vary it"
        )
    elif _constant(sizes):
        problem = (
            f"all {kind!r} samples have the same {size} ({sizes[0]:g}), so the {size} term "
            f"cannot be told apart from the fixed cost; vary it"
        )
    else:
        problem = (
            f"across the {kind!r} samples, {size} * context = a + b * {size} for some a, b "
            f"(rank {rank} of 3), so the three terms cannot be told apart; vary {size} and the "
            "context length independently"
        )
    raise ValueError(
        f"fit cannot determine the {kind} coefficients: {problem}, or set the coefficients by "
        "hand with CostModel(draft_coef=..., verify_coef=...)"
    )


def _constant(values: np.ndarray) -> bool:
    """Whether ``values`` are all equal, up to the relative tolerance of the rank test."""
    return bool(np.ptp(values) <= _RCOND * np.max(np.abs(values)))


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin ||x c - y||`` over ``c >= 0``, for a full-column-rank ``x`` with few columns.

    The optimum is the unconstrained least-squares solution on its own support (the columns
    whose coefficient is positive), and every feasible candidate's residual is at least the
    optimum's, so the best feasible solution over all supports is the optimum: 2^3 = 8 small
    solves for three columns, with no iteration to converge and no dependency beyond numpy.
    """
    columns = x.shape[1]
    best, best_residual = np.zeros(columns), float(y @ y)  # the empty support
    for support in itertools.product((False, True), repeat=columns):
        if not any(support):
            continue
        mask = np.array(support)
        coef = np.zeros(columns)
        coef[mask] = np.linalg.lstsq(x[:, mask], y, rcond=None)[0]
        if (coef < 0).any():
            continue
        r = y - x @ coef
        if float(r @ r) < best_residual:
            best, best_residual = coef, float(r @ r)
    return best
