"""The draft's ranking while it predicts and orders acceptance better, else a learned one."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specselect._checks import check_probability, check_real, checked_already
from specselect.estimators.base import (
    EPS,
    AcceptanceEstimator,
    Cached,
    check_estimate_arguments,
    check_state_device,
    read_state,
)
from specselect.estimators.guard import BINS, histogram_auc, score_cells
from specselect.estimators.history import RequestHistory

LOG_EPS = math.log(EPS)  # a token's log-loss is capped at -log(EPS) (a probability-0 mistake)
# The first entries of the statistics vector: decayed log-losses of the draft's probability and
# of the learned estimate, and the decayed count of tested tokens. The rest are each ranking's
# decayed histograms of the scores that passed and failed (see _split).
DRAFT, LEARNED, TESTED = range(3)
RANKINGS = 2  # the draft's probability, the learned estimate (DRAFT and LEARNED index them too)


class RankingChoice(AcceptanceEstimator):
    """The draft's own probability (the paper's ranking) or a learned estimate, per step: the
    draft's while it has both predicted and ordered the recently tested tokens' acceptance
    better, else the learned one.

    Which one ranks better depends on the pair. On the shipped pair the draft is badly
    under-confident and acceptance is not even monotone in its probability; a learned estimate
    (:class:`RequestHistory`) closes four times more of the gap to the oracle. On a better
    calibrated pair the draft's probability was the better ranking in every configuration
    measured, and a learned estimate lost up to 1.2 points of tokens per step. Neither is safe
    alone.

    Both are scored on the same evidence, the tokens the target tested (did it accept them?),
    in two ways: the decayed log-loss of the probability each gave them, and the AUC of each
    one's scores (the chance that a passing token was scored above a failing one, from decayed
    histograms as :class:`~specselect.estimators.RankingGuard` keeps them). The draft's ranking
    is kept only while it wins on both counts; the learned estimate is used once its log-loss
    is lower than the draft's by ``margin`` nats per token, or its AUC is higher. Until then —
    in particular before any evidence — the scores are the draft log-probabilities themselves,
    so a short run is the paper's TETRIS, not standard SD.

    The log-loss because TETRIS compares *cumulative* probabilities across requests and depths,
    which the calibration of each token's estimate changes: a draft that is under-confident on
    some requests ranks the same tokens within a request correctly (its AUC hardly suffers) and
    still gives the budget to the wrong requests. The AUC too because the log-loss also charges
    the learned estimate for its learning curve: its scale starts off (its prior shifts every
    token's log-odds alike) while its order already beats the draft's. On a pair whose draft
    is roughly calibrated, the log-loss alone kept the draft's ranking for the first 5 to 9
    steps and cost 3 points of the fixed-to-oracle gap. A calibrated draft wins on both counts
    and keeps its ranking.

    Everything is a handful of device operations per step on persistent tensors updated in
    place; the choice is a ``torch.where`` on a device flag: no sync, static shapes.

    Args:
        learned: the learned estimator (a default :class:`RequestHistory` if omitted).
        margin: nats per token by which the learned log-loss must beat the draft's (the
            AUCs are compared as they are).
        decay: per-step factor on the statistics. A short memory, because the learned
            estimate improves as it learns: statistics that remember its first steps keep
            the draft's ranking after the learned one has overtaken it (0.99 did so for 18 of
            47 steps on one pair, 0.9 for 13); much shorter memories let noise flip the
            choice on a calibrated draft.
    """

    name = "choice"

    @property
    def capturable(self) -> bool:
        return self.learned.capturable

    def __init__(
        self,
        learned: AcceptanceEstimator | None = None,
        margin: float = 0.0,
        decay: float = 0.9,
    ) -> None:
        if learned is not None and not isinstance(learned, AcceptanceEstimator):
            raise TypeError(
                f"learned must be an AcceptanceEstimator or None, got {type(learned).__name__}"
            )
        self.learned = learned if learned is not None else RequestHistory()
        self.margin = check_real("margin", margin, low=0.0)
        self.decay = check_probability("decay", decay)
        self._stats: Tensor | None = None  # [3 + 4 * BINS], see DRAFT, LEARNED, TESTED, _split
        self._learned_estimate = Cached()  # the last estimate's learned scores, for learn

    def reset(self) -> None:
        self.learned.reset()
        self._learned_estimate.clear()
        if self._stats is not None:
            self._stats.zero_()

    def reset_rows(self, rows: Tensor) -> None:
        self.learned.reset_rows(rows)

    def reset_requests(self) -> None:
        self.learned.reset_requests()

    def _state(self, device: torch.device) -> Tensor:
        if self._stats is None:
            self._stats = _fresh_stats(device)
        check_state_device(self, self._stats, device)
        return self._stats

    def to(self, device: torch.device) -> None:
        self.learned.to(device)
        if self._stats is not None:
            self._stats = self._stats.to(device)

    def _read(self, device: torch.device) -> Tensor:
        return read_state(self._stats, device, _fresh_stats)

    def log_losses(self, device: torch.device | str = "cpu") -> Tensor:
        """``[2]`` recent log-loss per tested token of the draft's probability and of the
        learned estimate (decayed averages; 0 before any evidence)."""
        stats, _ = _split(self._read(torch.device(device)))
        # The exact ratio however far the counts decayed (steps that test nothing shrink both
        # alike); a floor on the count would report ~0 after a long idle stretch.
        tested = stats[TESTED]
        return torch.where(tested > 0, stats[:TESTED] / tested, 0.0)

    def aucs(self, device: torch.device | str = "cpu") -> Tensor:
        """``[2]`` recent AUC of the draft's probability and of the learned estimate on the
        tested tokens (0.5 before a token passed and one failed)."""
        _, histograms = _split(self._read(torch.device(device)))
        return histogram_auc(histograms)

    def uses_learned(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim bool: whether the next estimate is the learned one (it predicts the tested
        tokens' outcomes better, or it orders them better)."""
        stats, histograms = _split(self._read(torch.device(device)))
        predicts = stats[LEARNED] < stats[DRAFT] - self.margin * stats[TESTED]
        aucs = histogram_auc(histograms)  # [2]
        return predicts | (aucs[LEARNED] > aucs[DRAFT])

    @property
    def uses_features(self) -> bool:
        return self.learned.uses_features

    def estimate(
        self,
        draft_logprobs: Tensor,
        positions: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        check_estimate_arguments(draft_logprobs, positions, features)
        learned = self._learned_scores(draft_logprobs, positions, features)  # [B, K]
        self._learned_estimate.keep((draft_logprobs, positions, features), learned)
        return torch.where(self.uses_learned(draft_logprobs.device), learned, draft_logprobs)

    def _learn(
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None,
        features: Tensor | None,
    ) -> None:
        learned = self._learned_estimate.take((draft_logprobs, positions, features))
        if learned is None:
            learned = self._learned_scores(draft_logprobs, positions, features)
        state = self._state(draft_logprobs.device)
        stats, histograms = _split(state)
        rankings = torch.stack([draft_logprobs, learned])  # [2, B, K]
        step = torch.cat([_log_losses(rankings, tested, passed), tested.sum().view(1)])  # [3]
        state.mul_(self.decay)
        stats.add_(step)
        # Each ranking's two histograms in one scatter: failing tokens in the second half.
        cells = score_cells(rankings).add_(passed.logical_not(), alpha=BINS)  # [2, B, K]
        weights = tested.to(state.dtype).expand(rankings.shape)  # [2, B, K]
        flat = histograms.view(RANKINGS, 2 * BINS)  # [2, 2 * BINS]
        flat.scatter_add_(1, cells.view(RANKINGS, -1), weights.reshape(RANKINGS, -1))
        # Its public learn: an estimator of one's own may implement learn itself. Trusted:
        # this learn checked the arguments.
        with checked_already():
            self.learned.learn(draft_logprobs, tested, passed, positions, *self._given(features))

    def _learned_scores(
        self, draft_logprobs: Tensor, positions: Tensor | None, features: Tensor | None
    ) -> Tensor:  # [B, K]
        with checked_already():  # checked by this estimator's estimate or learn
            return self.learned.estimate(draft_logprobs, positions, *self._given(features))

    def _given(self, features: Tensor | None) -> tuple[Tensor, ...]:
        """The features for the learned estimator if it reads them (one written before they
        existed takes no such argument)."""
        return (features,) if features is not None and self.learned.uses_features else ()


def _fresh_stats(device: torch.device) -> Tensor:  # -> [3 + 4 * BINS]
    """Statistics before any evidence (see :func:`_split`)."""
    return torch.zeros(TESTED + 1 + RANKINGS * 2 * BINS, device=device)


def _split(state: Tensor) -> tuple[Tensor, Tensor]:
    """Views of the statistics vector: ``[3]`` log-losses and count (DRAFT, LEARNED, TESTED),
    ``[2, 2, BINS]`` histograms of each ranking's scores that passed (0) and failed (1)."""
    return state[: TESTED + 1], state[TESTED + 1 :].view(RANKINGS, 2, BINS)


def _log_losses(rankings: Tensor, tested: Tensor, passed: Tensor) -> Tensor:  # -> [R]
    """Summed log-loss of each ranking's probabilities (``[R, B, K]`` log-probabilities) on
    the tested tokens (``[B, K]`` masks), each token's loss capped at ``-log(EPS)``."""
    log_rejected = torch.log1p(-rankings.exp())  # [R, B, K] log(1 - p)
    log_likelihood = torch.where(passed, rankings, log_rejected).clamp_(min=LOG_EPS)
    return -(log_likelihood * tested).sum(dim=(1, 2))
