"""The metrics every benchmark, test and report uses (see docs/concepts.md).

Per step, summed over active requests: ``verified`` (selected draft tokens), ``accepted`` (draft
tokens accepted before the first rejection), ``emitted`` (accepted + one target token per active
request), ``active`` (active requests). Ratios are always taken over totals, never averaged over
steps: a mean of per-step ratios over-weights nearly empty steps.

A run that verified nothing has no VSR (0 / 0): :attr:`Totals.vsr` is NaN there and
:meth:`Totals.as_dict` writes None, never 0, which would read as "every verified token was
rejected". This is the one place that decides it; reports show an undefined value as ``-``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCounts:
    """Counts of one verification step, summed over the active requests."""

    active: int
    verified: int
    accepted: int
    emitted: int
    seconds: float = 0.0


@dataclass(frozen=True)
class Totals:
    """Totals over a run, with the derived ratios."""

    steps: int = 0
    active: int = 0  # sum over steps of active requests ("request-steps")
    verified: int = 0
    accepted: int = 0
    emitted: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, steps: Iterable[StepCounts]) -> Totals:
        n = active = verified = accepted = emitted = 0
        seconds = 0.0
        for s in steps:
            n += 1
            active += s.active
            verified += s.verified
            accepted += s.accepted
            emitted += s.emitted
            seconds += s.seconds
        return cls(n, active, verified, accepted, emitted, seconds)

    @property
    def vsr(self) -> float:
        """Verification success rate: accepted / verified; NaN (undefined) when nothing was
        verified, as in plain decoding. NaN rather than None keeps it a float that formats and
        propagates (``f"{vsr:.2f}"`` shows ``nan``); :meth:`as_dict` turns it into None."""
        return self.accepted / self.verified if self.verified else math.nan

    @property
    def tokens_per_step(self) -> float:
        """Emitted tokens per active request per step (mean accepted length + 1)."""
        return self.emitted / self.active if self.active else 0.0

    @property
    def accepted_per_request_step(self) -> float:
        """Accepted draft tokens per active request per step (``tokens_per_step - 1``)."""
        return self.accepted / self.active if self.active else 0.0

    @property
    def verified_per_request_step(self) -> float:
        """Verified draft tokens per active request per step: the budget actually spent."""
        return self.verified / self.active if self.active else 0.0

    @property
    def goodput(self) -> float:
        """Emitted tokens per second (wall-clock, or modelled in replay)."""
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | None]:
        """The counts and ratios, JSON-ready: an undefined ratio (:attr:`vsr` without a
        verified token) is None, as JSON has no NaN."""
        values: dict[str, float] = {
            "steps": self.steps,
            "active": self.active,
            "verified": self.verified,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "seconds": self.seconds,
            "vsr": self.vsr,
            "tokens_per_step": self.tokens_per_step,
            "accepted_per_request_step": self.accepted_per_request_step,
            "verified_per_request_step": self.verified_per_request_step,
            "goodput": self.goodput,
            **self.extra,
        }
        return {key: _defined(value) for key, value in values.items()}


def _defined(value: float) -> float | None:
    """``value``, or None where it is undefined (NaN)."""
    return None if isinstance(value, float) and math.isnan(value) else value
