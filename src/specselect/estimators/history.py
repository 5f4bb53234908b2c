"""Calibrated token probability combined with each request's own acceptance history."""

from __future__ import annotations

import torch
from torch import Tensor

from specselect.estimators.base import EPS, AcceptanceEstimator, check_rows, clamp_log
from specselect.estimators.calibrated import CalibratedDraft, _check_unit

FEATURES = 4  # bias, logit(calibrated q), logit(request rate), position / 8


def _logit(p: Tensor) -> Tensor:
    p = p.clamp(EPS, 1 - EPS)
    return p.log() - (-p).log1p()


class RequestHistory(AcceptanceEstimator):
    """Online logistic regression on the calibrated probability and the request's history.

    Requests differ: on code, a draft may agree with the target far more often than on prose,
    at the same draft probability. Each batch slot keeps a decayed Beta estimate of its own
    request's acceptance rate (``rate = (hits + a) / (trials + a + b)``, ``a + b = strength``,
    ``a / (a + b)`` = the batch's running rate). A logistic model combines
    ``[1, logit(calibrated q), logit(rate), position / 8]``; its weights start at
    ``[0, 1, 0, 0]`` (the calibrated estimate alone) and follow one gradient step of the log-loss
    per verification step, over the positions the target tested.

    Args:
        calibration: the token-level calibration (a default :class:`CalibratedDraft` if omitted).
        request_decay: per-step factor on each request's counts (lower = more recent history).
        strength: pseudo-observations of the batch rate in each request's Beta estimate.
        lr: step size of the logistic regression.
    """

    name = "history"

    def __init__(
        self,
        calibration: CalibratedDraft | None = None,
        request_decay: float = 0.8,
        strength: float = 2.0,
        lr: float = 0.1,
    ) -> None:
        self.calibration = calibration if calibration is not None else CalibratedDraft()
        self.request_decay = _check_unit("request_decay", request_decay, closed_low=False)
        if not strength > 0:
            raise ValueError(f"strength must be > 0, got {strength}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.strength = float(strength)
        self.lr = float(lr)
        self.reset()

    def reset(self) -> None:
        self.calibration.reset()
        self._weights: Tensor | None = None  # [F]
        self._hits: Tensor | None = None  # [B] decayed accepted tokens of each slot's request
        self._trials: Tensor | None = None  # [B] decayed tested tokens
        self._batch_rate: Tensor | None = None  # 0-dim running acceptance rate of all requests

    def reset_rows(self, rows: Tensor) -> None:
        if self._hits is None or self._trials is None:
            return
        rows = check_rows(rows, self._hits.shape[0])
        self._hits = torch.where(rows, 0.0, self._hits)
        self._trials = torch.where(rows, 0.0, self._trials)

    def _state(self, batch: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Shared weights and batch rate persist; per-slot counts follow the batch shape."""
        if self._weights is None or self._batch_rate is None or self._weights.device != device:
            self._weights = torch.tensor([0.0, 1.0, 0.0, 0.0], device=device)
            self._batch_rate = torch.tensor(0.7, device=device)
        if self._hits is None or self._trials is None or self._hits.shape[0] != batch:
            self._hits = torch.zeros(batch, device=device)
            self._trials = torch.zeros(batch, device=device)
        return self._weights, self._hits, self._trials, self._batch_rate

    def _features(self, draft_logprobs: Tensor) -> Tensor:  # [B, K] -> [B, K, F]
        _, hits, trials, batch_rate = self._state(draft_logprobs.shape[0], draft_logprobs.device)
        calibrated = self.calibration.probabilities(draft_logprobs)  # [B, K]
        a = self.strength * batch_rate
        rate = (hits + a) / (trials + self.strength)  # [B]
        width = draft_logprobs.shape[1]
        position = torch.arange(width, device=draft_logprobs.device, dtype=torch.float32) / 8
        return torch.stack(
            [
                torch.ones_like(calibrated),
                _logit(calibrated),
                _logit(rate).unsqueeze(1).expand_as(calibrated),
                position.unsqueeze(0).expand_as(calibrated),
            ],
            dim=2,
        )

    def estimate(self, draft_logprobs: Tensor) -> Tensor:
        weights = self._state(draft_logprobs.shape[0], draft_logprobs.device)[0]
        p = torch.sigmoid(self._features(draft_logprobs) @ weights)
        return clamp_log(p, draft_logprobs > float("-inf"))

    def _learn(self, draft_logprobs: Tensor, tested: Tensor, passed: Tensor) -> None:
        weights, hits, trials, batch_rate = self._state(
            draft_logprobs.shape[0], draft_logprobs.device
        )
        features = self._features(draft_logprobs)  # [B, K, F]
        p = torch.sigmoid(features @ weights)  # [B, K]
        error = (p - passed.to(p.dtype)) * tested.to(p.dtype)  # [B, K]
        count = tested.sum().clamp(min=1).to(p.dtype)
        gradient = (error.unsqueeze(2) * features).sum(dim=(0, 1)) / count  # [F]
        self._weights = weights - self.lr * gradient
        step_hits = (tested & passed).sum(dim=1).to(hits.dtype)
        step_trials = tested.sum(dim=1).to(trials.dtype)
        self._hits = self.request_decay * hits + step_hits
        self._trials = self.request_decay * trials + step_trials
        observed = step_hits.sum() / step_trials.sum().clamp(min=1)
        any_tested = step_trials.sum() > 0
        self._batch_rate = torch.where(any_tested, 0.95 * batch_rate + 0.05 * observed, batch_rate)
        self.calibration._learn(draft_logprobs, tested, passed)
