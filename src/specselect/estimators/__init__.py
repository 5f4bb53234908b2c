"""Acceptance estimators and the ranking guard (see :mod:`specselect.estimators.base`)."""

from __future__ import annotations

from specselect._registries import Registry
from specselect.estimators.base import AcceptanceEstimator, DraftProbability
from specselect.estimators.calibrated import CalibratedDraft
from specselect.estimators.choice import RankingChoice
from specselect.estimators.guard import RankingGuard
from specselect.estimators.history import RequestHistory
from specselect.estimators.outcomes import observed_outcomes, tree_outcomes

NO_ESTIMATOR = "none"
"""The estimator part of a selector spec that means "no estimator" (``"tetris+none"``: TETRIS as
in the paper, which also drops its ranking guard); see :func:`specselect.registry.parse_spec`."""

ESTIMATORS: Registry[AcceptanceEstimator] = Registry(
    "ESTIMATORS",
    "estimator",
    AcceptanceEstimator,
    {
        DraftProbability.name: DraftProbability,
        CalibratedDraft.name: CalibratedDraft,
        RequestHistory.name: RequestHistory,
        RankingChoice.name: RankingChoice,
    },
    reserved={NO_ESTIMATOR: "no estimator in a selector spec (tetris+none)"},
)
"""Acceptance estimators by name: what may follow ``+`` in a selector spec, besides
:data:`NO_ESTIMATOR`. ``ESTIMATORS["mine"] = Mine`` registers one, under the rules of
:data:`specselect.selectors.SELECTORS`."""

DEFAULT_ESTIMATOR = RankingChoice.name
"""The estimator a :class:`~specselect.TetrisSelector` ranks by unless told otherwise."""


def make_estimator(estimator: AcceptanceEstimator | str | None) -> AcceptanceEstimator | None:
    """An estimator instance from an instance, a registry name, or ``None`` (no estimator)."""
    if estimator is None or isinstance(estimator, AcceptanceEstimator):
        return estimator
    if isinstance(estimator, str) and estimator in ESTIMATORS:
        return ESTIMATORS[estimator]()
    error = ValueError if isinstance(estimator, str) else TypeError
    raise error(
        f"estimator must be an AcceptanceEstimator, None or one of "
        f"{', '.join(sorted(ESTIMATORS))}, got {estimator!r}"
    )


__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "NO_ESTIMATOR",
    "AcceptanceEstimator",
    "CalibratedDraft",
    "DraftProbability",
    "RankingChoice",
    "RankingGuard",
    "RequestHistory",
    "make_estimator",
    "observed_outcomes",
    "tree_outcomes",
]
