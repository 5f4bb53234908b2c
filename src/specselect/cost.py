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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# Defaults resemble a 7B target with a ~20x smaller draft on one modern GPU at small batch: the
# target pass is dominated by its fixed cost (weights streamed once per pass), the draft pass is
# ~10x cheaper. Fit to your own timings for anything quantitative.
DEFAULT_DRAFT = (1.5e-3, 2.0e-6, 1.0e-10)
DEFAULT_VERIFY = (1.5e-2, 4.0e-5, 2.0e-9)


@dataclass(frozen=True)
class CostSample:
    """One measured forward: ``kind`` is ``"draft"`` or ``"verify"``; see the module docstring."""

    kind: str
    batch: int
    tokens: int
    context: float
    seconds: float


@dataclass(frozen=True)
class CostModel:
    """Predicts draft and verification time; see the module docstring for the formulas."""

    draft_coef: tuple[float, float, float] = DEFAULT_DRAFT
    verify_coef: tuple[float, float, float] = DEFAULT_VERIFY

    def __post_init__(self) -> None:
        for name in ("draft_coef", "verify_coef"):
            coef = getattr(self, name)
            if len(coef) != 3 or any((not np.isfinite(c)) or c < 0 for c in coef):
                raise ValueError(f"{name} must be three finite non-negative floats, got {coef}")

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
        """Least-squares fit of both formulas to measured samples (needs >= 3 of each kind).

        Coefficients are clipped at 0: a negative slope is noise, not a property of hardware.
        """
        by_kind: dict[str, list[CostSample]] = {"draft": [], "verify": []}
        for s in samples:
            if s.kind not in by_kind:
                raise ValueError(f"CostSample.kind must be 'draft' or 'verify', got {s.kind!r}")
            by_kind[s.kind].append(s)
        coefs = []
        for kind, rows in by_kind.items():
            if len(rows) < 3:
                raise ValueError(f"fit needs at least 3 {kind!r} samples, got {len(rows)}")
            coefs.append(_fit_one(kind, rows))
        return cls(draft_coef=coefs[0], verify_coef=coefs[1])


def _fit_one(kind: str, rows: list[CostSample]) -> tuple[float, float, float]:
    if kind == "draft":
        # seconds / tokens = d0 + d1 * batch + d2 * batch * context
        x = np.array([[1.0, r.batch, r.batch * r.context] for r in rows])
        y = np.array([r.seconds / max(r.tokens, 1) for r in rows])
    else:
        x = np.array([[1.0, r.tokens, r.tokens * r.context] for r in rows])
        y = np.array([r.seconds for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    c0, c1, c2 = (float(max(c, 0.0)) for c in coef)
    return (c0, c1, c2)
