"""The metrics every benchmark, test and report uses (see docs/concepts.md).

Per step, summed over active requests: ``verified`` (selected draft tokens), ``accepted`` (draft
tokens accepted before the first rejection), ``emitted`` (accepted + one target token per active
request), ``active`` (active requests). Ratios are always taken over totals, never averaged over
steps: a mean of per-step ratios over-weights nearly empty steps.
"""

from __future__ import annotations

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
        """Verification success rate: accepted / verified (0 when nothing was verified)."""
        return self.accepted / self.verified if self.verified else 0.0

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

    def as_dict(self) -> dict[str, float]:
        return {
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
