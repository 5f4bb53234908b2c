"""Calibrated token probability combined with each request's own acceptance history."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specselect.estimators.base import (
    EPS,
    AcceptanceEstimator,
    check_rows,
    clamp_log,
    default_positions,
)
from specselect.estimators.calibrated import CalibratedDraft, _check_unit


def _logit(p: Tensor) -> Tensor:
    p = p.clamp(EPS, 1 - EPS)
    return p.log() - (-p).log1p()


class RequestHistory(AcceptanceEstimator):
    """Online logistic regression on the calibrated probability and the request's history.

    Requests differ: on the shipped pair the draft agrees with the target on 78% of prose tokens
    but 49% of code tokens, at similar draft probabilities, and a request that is copying a
    repeated pattern keeps accepting for a while. Each batch slot therefore keeps decayed Beta
    estimates of its own request's acceptance rate at two time scales (``request_decays``: a
    fast one that follows the last step or two, a slow one for the request's character),
    ``rate = (hits + a) / (trials + a + b)`` with ``a + b = strength`` and ``a / (a + b)`` the
    batch's running rate. A logistic model combines
    ``[1, logit(calibrated q), logit(rate) for each time scale, position / 8]``. Its weights
    start at ``[0, 1, history_weight, ..., 0]`` and follow one gradient step of the log-loss per
    verification step, over the positions the target tested.

    Args:
        calibration: the token-level calibration (a default :class:`CalibratedDraft` if omitted).
        request_decays: per-step factors on each request's counts, one per time scale.
        strength: pseudo-observations of the batch rate in each request's Beta estimate.
        lr: step size of the logistic regression.
        history_weight: initial weight of each history feature.
    """

    name = "history"

    def __init__(
        self,
        calibration: CalibratedDraft | None = None,
        request_decays: Sequence[float] = (0.5, 0.9),
        strength: float = 1.0,
        lr: float = 0.1,
        history_weight: float = 0.5,
    ) -> None:
        self.calibration = calibration if calibration is not None else CalibratedDraft()
        if len(request_decays) == 0:
            raise ValueError("request_decays must hold at least one decay factor")
        self.request_decays = tuple(
            _check_unit("request_decays", d, closed_low=True) for d in request_decays
        )
        if not strength > 0:
            raise ValueError(f"strength must be > 0, got {strength}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.strength = float(strength)
        self.lr = float(lr)
        self.history_weight = float(history_weight)
        self.reset()

    def reset(self) -> None:
        self.calibration.reset()
        self._weights: Tensor | None = None  # [F]
        self._hits: Tensor | None = None  # [B, S] decayed accepted tokens per time scale
        self._trials: Tensor | None = None  # [B, S] decayed tested tokens
        self._batch_rate: Tensor | None = None  # 0-dim running acceptance rate of all requests
        self._estimated: tuple[Tensor, Tensor | None, Tensor, Tensor] | None = None

    def reset_rows(self, rows: Tensor) -> None:
        if self._hits is None or self._trials is None:
            return
        rows = check_rows(rows, self._hits.shape[0]).unsqueeze(1)
        self._estimated = None  # the features of these rows change
        self._hits = torch.where(rows, 0.0, self._hits)
        self._trials = torch.where(rows, 0.0, self._trials)

    def _state(self, batch: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Shared weights and batch rate persist; per-slot counts follow the batch shape."""
        scales = len(self.request_decays)
        if self._weights is None or self._batch_rate is None or self._weights.device != device:
            history = [self.history_weight] * scales
            self._weights = torch.tensor([0.0, 1.0, *history, 0.0], device=device)
            self._batch_rate = torch.tensor(0.7, device=device)
            self._decays = torch.tensor(self.request_decays, device=device)  # [S], made once
        if self._hits is None or self._trials is None or self._hits.shape[0] != batch:
            self._hits = torch.zeros(batch, scales, device=device)
            self._trials = torch.zeros(batch, scales, device=device)
        return self._weights, self._hits, self._trials, self._batch_rate

    def _features(self, draft_logprobs: Tensor, positions: Tensor | None) -> Tensor:
        """``[B, K, F]`` features of each token (see the class docstring)."""
        _, hits, trials, batch_rate = self._state(draft_logprobs.shape[0], draft_logprobs.device)
        calibrated = self.calibration.probabilities(draft_logprobs, positions)  # [B, K]
        rates = (hits + self.strength * batch_rate) / (trials + self.strength)  # [B, S]
        rows, width = calibrated.shape
        history = _logit(rates).unsqueeze(1).expand(rows, width, -1)  # [B, K, S]
        position = default_positions(draft_logprobs, positions).to(torch.float32) / 8
        return torch.cat(
            [
                torch.ones_like(calibrated).unsqueeze(2),
                _logit(calibrated).unsqueeze(2),
                history,
                position.unsqueeze(2),
            ],
            dim=2,
        )

    def estimate(self, draft_logprobs: Tensor, positions: Tensor | None = None) -> Tensor:
        weights = self._state(draft_logprobs.shape[0], draft_logprobs.device)[0]
        features = self._features(draft_logprobs, positions)
        p = torch.sigmoid(features @ weights)
        # A selector learns from the very tensors it estimated: keep the work for ``learn``.
        self._estimated = (draft_logprobs, positions, features, p)
        return clamp_log(p, draft_logprobs > float("-inf"))

    def _features_and_probs(
        self, draft_logprobs: Tensor, positions: Tensor | None, weights: Tensor
    ) -> tuple[Tensor, Tensor]:  # ([B, K, F], [B, K])
        """Features and probabilities of these tokens, reused from :meth:`estimate` if it just
        saw the same tensors (nothing it depends on changes in between)."""
        cached = self._estimated
        if cached is not None and cached[0] is draft_logprobs and cached[1] is positions:
            return cached[2], cached[3]
        features = self._features(draft_logprobs, positions)
        return features, torch.sigmoid(features @ weights)

    def learn(
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None = None,
    ) -> None:
        weights, hits, trials, batch_rate = self._state(
            draft_logprobs.shape[0], draft_logprobs.device
        )
        features, p = self._features_and_probs(draft_logprobs, positions, weights)
        self._estimated = None
        error = (p - passed.to(p.dtype)) * tested.to(p.dtype)  # [B, K]
        count = tested.sum().clamp(min=1).to(p.dtype)
        gradient = (error.unsqueeze(2) * features).sum(dim=(0, 1)) / count  # [F]
        self._weights = weights - self.lr * gradient
        step_hits = (tested & passed).sum(dim=1, keepdim=True).to(hits.dtype)  # [B, 1]
        step_trials = tested.sum(dim=1, keepdim=True).to(trials.dtype)
        self._hits = self._decays * hits + step_hits
        self._trials = self._decays * trials + step_trials
        observed = step_hits.sum() / step_trials.sum().clamp(min=1)
        any_tested = step_trials.sum() > 0
        self._batch_rate = torch.where(any_tested, 0.95 * batch_rate + 0.05 * observed, batch_rate)
        self.calibration.learn(draft_logprobs, tested, passed, positions)
