"""Calibrated token probability combined with each request's own acceptance history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specselect.constants import cached_constant
from specselect.estimators.base import (
    AcceptanceEstimator,
    check_rows,
    clamp_log,
    logit,
)
from specselect.estimators.calibrated import CalibratedDraft, _check_unit


class _Features(NamedTuple):
    """The model's features ``[1, logit(calibrated q), logit(rate) per time scale, position/8]``
    in factored form."""

    calibrated: Tensor  # [B, K] logit of the calibrated probability
    history: Tensor  # [B, S] logit of each time scale's acceptance rate of the row's request
    position: Tensor  # [K] (chains) or [B, K] (trees): position / 8


def _scaled_columns(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, device=device, dtype=torch.float32) / 8


def _gradient(error: Tensor, features: _Features) -> Tensor:
    """``[F]``: ``sum_{b,k} error[b, k] * feature[b, k, :]`` (unnormalised log-loss gradient),
    one feature group at a time; ``error`` is ``[B, K]``."""
    per_row = error.sum(dim=1)  # [B]
    return torch.cat(
        [
            per_row.sum().unsqueeze(0),
            (error * features.calibrated).sum().unsqueeze(0),
            per_row @ features.history,  # [S]
            (error * features.position).sum().unsqueeze(0),
        ]
    )


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
        self._estimated: tuple[Tensor, Tensor | None, _Features, Tensor] | None = None

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

    def _features(self, draft_logprobs: Tensor, positions: Tensor | None) -> _Features:
        """The features of each token (see the class docstring), kept factored: the history
        features are per row and the position feature per column, so that no ``[B, K, F]``
        tensor is ever built."""
        _, hits, trials, batch_rate = self._state(draft_logprobs.shape[0], draft_logprobs.device)
        calibrated = self.calibration.logits(draft_logprobs, positions)  # [B, K]
        rates = (hits + self.strength * batch_rate) / (trials + self.strength)  # [B, S]
        if positions is None:  # chains: one position per column
            position = cached_constant(
                ("history_positions", draft_logprobs.shape[1], draft_logprobs.device),
                _scaled_columns,
            )
        else:
            position = positions.to(torch.float32) / 8
        return _Features(calibrated, logit(rates), position)

    def _probabilities(self, features: _Features, weights: Tensor) -> Tensor:
        """``[B, K]`` sigmoid of the linear model, summed feature group by feature group."""
        scales = len(self.request_decays)
        bias = weights[0].expand(features.history.shape[0])  # [B]: a 0-dim one loses B = 0
        row_terms = torch.addmv(bias, features.history, weights[2 : 2 + scales])  # [B]
        base = features.position * weights[-1] + row_terms.unsqueeze(1)  # [B, K]
        return torch.sigmoid(torch.addcmul(base, features.calibrated, weights[1]))

    def estimate(self, draft_logprobs: Tensor, positions: Tensor | None = None) -> Tensor:
        weights = self._state(draft_logprobs.shape[0], draft_logprobs.device)[0]
        features = self._features(draft_logprobs, positions)
        p = self._probabilities(features, weights)
        # A selector learns from the very tensors it estimated: keep the work for ``learn``.
        self._estimated = (draft_logprobs, positions, features, p)
        return clamp_log(p, draft_logprobs > float("-inf"))

    def _features_and_probs(
        self, draft_logprobs: Tensor, positions: Tensor | None, weights: Tensor
    ) -> tuple[_Features, Tensor]:
        """Features and ``[B, K]`` probabilities of these tokens, reused from :meth:`estimate`
        if it just saw the same tensors (nothing it depends on changes in between)."""
        cached = self._estimated
        if cached is not None and cached[0] is draft_logprobs and cached[1] is positions:
            return cached[2], cached[3]
        features = self._features(draft_logprobs, positions)
        return features, self._probabilities(features, weights)

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
        gradient = _gradient(error, features) / count  # [F]
        self._weights = weights - self.lr * gradient
        step_hits = (tested & passed).sum(dim=1, keepdim=True).to(hits.dtype)  # [B, 1]
        step_trials = tested.sum(dim=1, keepdim=True).to(trials.dtype)
        self._hits = self._decays * hits + step_hits
        self._trials = self._decays * trials + step_trials
        observed = step_hits.sum() / step_trials.sum().clamp(min=1)
        any_tested = step_trials.sum() > 0
        self._batch_rate = torch.where(any_tested, 0.95 * batch_rate + 0.05 * observed, batch_rate)
        self.calibration.learn(draft_logprobs, tested, passed, positions)
