"""The ranking guard: fall back to standard SD when the scores show no signal."""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import (
    check_implies,
    check_int,
    check_logprobs,
    check_mask,
    check_probability,
)
from specselect.estimators.base import check_state_device, read_state

BINS = 64
"""Histogram bins per outcome (passed, failed), equal-width in ``logit p`` over ``[-LOGIT_SPAN,
LOGIT_SPAN]``: fine resolution near 0 and 1, where a peaky draft puts most of its tokens (equal
bins in ``p`` would lump every token above 0.97 together)."""
LOGIT_SPAN = 8.0


def score_cells(log_p: Tensor) -> Tensor:  # [..., N] -> [..., N] int64
    """The histogram bin of each log-probability (see :data:`BINS`).

    ``logit p = log p - log(1 - p)`` is ``-inf`` at ``p = 0`` and ``+inf`` at ``p = 1``; the
    clamp puts them in the first and last bins.
    """
    logits = log_p - torch.log1p(-log_p.exp())
    scaled = logits.add(LOGIT_SPAN).mul_(BINS / (2 * LOGIT_SPAN))
    return scaled.clamp_(0, BINS - 1).to(torch.int64)


def histogram_auc(histograms: Tensor) -> Tensor:  # [..., 2, BINS] -> [...]
    """AUC from the histograms of the scores that passed (row 0) and failed (row 1): the
    chance that a random passing token was scored above a random failing one (ties count
    half); 0.5 when either is empty. Leading dimensions are independent pairs of histograms
    (the default estimator compares two scores' AUCs in one call)."""
    hist_pass, hist_fail = histograms.unbind(-2)  # [..., BINS] each
    # Failing tokens in lower bins, and half of those in the same bin.
    below = torch.sub(torch.cumsum(hist_fail, -1), hist_fail, alpha=0.5)  # [..., BINS]
    wins = (hist_pass * below).sum(-1)  # [...]
    pairs = histograms.sum(dim=-1).prod(dim=-1)  # [...]
    # The exact ratio however few pairs are left: a batch that keeps accepting everything
    # decays the failures towards float32's smallest values, and a floor on ``pairs`` would
    # turn their AUC into ~0 (a ranking that looks inverted) long before they are empty.
    return torch.where(pairs > 0, wins / pairs, 0.5)  # 0 / 0 where empty: not taken


class RankingGuard:
    """Trust a ranking unless recent outcomes show that it has no signal.

    TETRIS helps only if its scores *rank* tokens by their chance of acceptance. The guard keeps
    decayed histograms of the scores of tested tokens that passed and that failed, and computes
    the AUC from them — the probability that a random passing token was scored above a random
    failing one. :meth:`trusted` is a 0-dim bool tensor: the scores are trusted *until* there is
    evidence against them, i.e. while fewer than ``min_observations`` tested tokens were seen,
    while no token failed (nothing ranked wrong), or once the AUC is at least ``min_auc``. A
    selector uses it with ``torch.where``, so the fallback costs no sync.

    Trusting before the evidence is what lets a short run use its ranking at all: a guard that
    waited for evidence made TETRIS standard SD for the first few hundred tested tokens (every
    step of a short batch). With the default estimator (:class:`~specselect.estimators.
    RankingChoice`) the scores start as the draft's own probabilities, so the warm start is the
    paper's TETRIS; the guard then watches whichever ranking the estimator chose, and falls
    back to the fixed window only when that one — the better of the two — has no signal.

    Args:
        min_auc: below this (once there is evidence) the scores are not trusted (0.5 = no
            signal).
        min_observations: tested tokens (since the last reset) before the AUC is believed.
        decay: per-step factor on the histograms.
    """

    def __init__(
        self, min_auc: float = 0.55, min_observations: int = 200, decay: float = 0.99
    ) -> None:
        self.min_auc = check_probability("min_auc", min_auc)
        self.min_observations = check_int("min_observations", min_observations)
        self.decay = check_probability("decay", decay)
        # [2, BINS] decayed histograms of the scores that passed (row 0) and failed (row 1),
        # and [] int64 tested tokens seen, not decayed: the decayed count saturates at
        # tested-per-step / (1 - decay), below min_observations when few tokens are tested per
        # step, and the guard then never left its early phase. Allocated on the first step on
        # the scores' device, then only updated in place.
        self._histograms: Tensor | None = None
        self._tested: Tensor | None = None

    def reset(self) -> None:
        """Forget the evidence (in place: a captured graph keeps its buffers)."""
        if self._histograms is not None and self._tested is not None:
            self._histograms.zero_()
            self._tested.zero_()

    def _state(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(histograms, tested count)``, bound on the first step."""
        if self._histograms is None or self._tested is None:
            self._histograms, self._tested = _no_histograms(device), _no_count(device)
        check_state_device(self, self._histograms, device)
        return self._histograms, self._tested

    def to(self, device: torch.device) -> None:
        """Move the histograms to ``device`` (copies: the evidence is kept); see
        :meth:`~specselect.estimators.AcceptanceEstimator.to`."""
        if self._histograms is not None and self._tested is not None:
            self._histograms, self._tested = self._histograms.to(device), self._tested.to(device)

    def _read(self, device: torch.device) -> tuple[Tensor, Tensor]:
        histograms = read_state(self._histograms, device, _no_histograms)
        return histograms, read_state(self._tested, device, _no_count)

    def observe(self, estimates: Tensor, tested: Tensor, passed: Tensor) -> None:
        """``[B, K]`` estimated log-probabilities and the step's tested / passed masks
        (checked first: a NaN would index no histogram cell)."""
        estimates = check_logprobs("estimates", estimates)
        shape, device = tuple(estimates.shape), estimates.device
        tested_mask = check_mask("tested", tested, shape, device)
        check_implies("passed", check_mask("passed", passed, shape, device), "tested", tested_mask)
        histograms, count = self._state(estimates.device)
        count.add_(tested.sum())
        # One scatter for both histograms: failing tokens land in the second row.
        cells = score_cells(estimates).add_(passed.logical_not(), alpha=BINS)  # [B, K]
        weights = tested.to(histograms.dtype)  # [B, K]
        # reshape, not view: the masks and estimates may be strided (a transposed draft).
        flat = histograms.mul_(self.decay).view(-1)  # [2 * BINS] (own, contiguous state)
        flat.index_add_(0, cells.reshape(-1), weights.reshape(-1))

    def auc(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim AUC of the recent estimates (0.5 when either histogram is empty)."""
        return histogram_auc(self._read(torch.device(device))[0])

    def trusted(self, device: torch.device | str = "cpu") -> Tensor:
        """0-dim bool: too little evidence yet, no failure seen, or AUC >= ``min_auc``.

        Only passes leave no pair to rank and no wrong ranking: a draft that is always right
        keeps its scores (their AUC reads 0.5, which used to send it back to the fixed
        window). Only failures still count as no signal: then the fixed window wastes no more
        than the scores' ranking, and less than a budget above ``k`` per row.
        """
        histograms, count = self._read(torch.device(device))
        early = count < self.min_observations
        no_failures = histograms[1].sum() == 0  # []
        return early | no_failures | (histogram_auc(histograms) >= self.min_auc)


def _no_histograms(device: torch.device) -> Tensor:  # -> [2, BINS]
    return torch.zeros(2, BINS, device=device)


def _no_count(device: torch.device) -> Tensor:  # -> [] int64
    return torch.zeros((), dtype=torch.int64, device=device)
