"""Acceptance estimators and the ranking guard (see :mod:`specselect.estimators.base`)."""

from __future__ import annotations

from specselect.estimators.base import AcceptanceEstimator, DraftProbability, observed_outcomes
from specselect.estimators.calibrated import CalibratedDraft
from specselect.estimators.guard import RankingGuard
from specselect.estimators.history import RequestHistory

ESTIMATORS: dict[str, type[AcceptanceEstimator]] = {
    DraftProbability.name: DraftProbability,
    CalibratedDraft.name: CalibratedDraft,
    RequestHistory.name: RequestHistory,
}

__all__ = [
    "ESTIMATORS",
    "AcceptanceEstimator",
    "CalibratedDraft",
    "DraftProbability",
    "RankingGuard",
    "RequestHistory",
    "observed_outcomes",
]
