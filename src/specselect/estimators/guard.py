"""A guard on ranking quality: fall back to standard SD when estimates stop discriminating."""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import check_int, check_probability

BINS = 32


class RankingGuard:
    """Online AUC of the estimated acceptance probabilities against observed outcomes.

    TETRIS helps only if its estimates *rank* tokens by their chance of acceptance. The guard
    keeps decayed histograms of the estimates of tested tokens that passed and that failed, and
    computes the AUC — the probability that a random passing token had a higher estimate than a
    random failing one — from them. :meth:`trusted` is a 0-dim bool tensor: enough evidence and
    ``AUC >= min_auc``. A selector uses it with ``torch.where``, so the fallback costs no sync.

    Args:
        min_auc: below this the estimates are not trusted (0.5 = no signal).
        min_observations: decayed count of tested tokens needed before trusting anything.
        decay: per-step factor on the histograms.
    """

    def __init__(
        self, min_auc: float = 0.55, min_observations: int = 200, decay: float = 0.99
    ) -> None:
        self.min_auc = check_probability("min_auc", min_auc)
        self.min_observations = check_int("min_observations", min_observations)
        self.decay = check_probability("decay", decay)
        self.reset()

    def reset(self) -> None:
        # [2, BINS] decayed histograms of the estimates that passed (row 0) and failed (row 1)
        self._histograms: Tensor | None = None

    def _state(self, device: torch.device) -> Tensor:
        if self._histograms is None or self._histograms.device != device:
            self._histograms = torch.zeros(2, BINS, device=device)
        return self._histograms

    def observe(self, estimates: Tensor, tested: Tensor, passed: Tensor) -> None:
        """``[B, K]`` estimated log-probabilities and the step's tested / passed masks."""
        histograms = self._state(estimates.device)
        cells = (estimates.exp() * BINS).to(torch.int64).clamp_(0, BINS - 1)  # [B, K]
        # One scatter for both histograms: failing tokens land in the second row.
        cells = cells.add_(passed.logical_not(), alpha=BINS).reshape(-1)
        weights = tested.reshape(-1).to(histograms.dtype)
        histograms.mul_(self.decay).view(-1).index_add_(0, cells, weights)

    def auc(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim AUC of the recent estimates (0.5 when either histogram is empty)."""
        hist_pass, hist_fail = self._state(torch.device(device))
        below = torch.cumsum(hist_fail, 0) - hist_fail  # failing estimates in lower bins
        wins = (hist_pass * (below + 0.5 * hist_fail)).sum()
        pairs = hist_pass.sum() * hist_fail.sum()
        return torch.where(pairs > 0, wins / pairs.clamp(min=1e-12), 0.5)

    def trusted(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim bool: enough observations and AUC >= ``min_auc``."""
        enough = self._state(torch.device(device)).sum() >= self.min_observations
        return enough & (self.auc(device) >= self.min_auc)
