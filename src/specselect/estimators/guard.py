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
        self._passed: Tensor | None = None  # [BINS] decayed histogram of estimates that passed
        self._failed: Tensor | None = None  # [BINS] ... that failed

    def _state(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._passed is None or self._failed is None or self._passed.device != device:
            self._passed = torch.zeros(BINS, device=device)
            self._failed = torch.zeros(BINS, device=device)
        return self._passed, self._failed

    def observe(self, estimates: Tensor, tested: Tensor, passed: Tensor) -> None:
        """``[B, K]`` estimated log-probabilities and the step's tested / passed masks."""
        hist_pass, hist_fail = self._state(estimates.device)
        p = estimates.exp().nan_to_num(0.0)
        cells = (p * BINS).to(torch.int64).clamp(0, BINS - 1).reshape(-1)
        hist_pass.mul_(self.decay).index_add_(0, cells, (tested & passed).reshape(-1).float())
        hist_fail.mul_(self.decay).index_add_(0, cells, (tested & ~passed).reshape(-1).float())

    def auc(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim AUC of the recent estimates (0.5 when either histogram is empty)."""
        hist_pass, hist_fail = self._state(torch.device(device))
        below = torch.cumsum(hist_fail, 0) - hist_fail  # failing estimates in lower bins
        wins = (hist_pass * (below + 0.5 * hist_fail)).sum()
        pairs = hist_pass.sum() * hist_fail.sum()
        return torch.where(pairs > 0, wins / pairs.clamp(min=1e-12), 0.5)

    def trusted(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim bool: enough observations and AUC >= ``min_auc``."""
        hist_pass, hist_fail = self._state(torch.device(device))
        enough = hist_pass.sum() + hist_fail.sum() >= self.min_observations
        return enough & (self.auc(device) >= self.min_auc)
