"""Draft probability, its calibration and each request's acceptance history in one online model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specselect._checks import check_int, check_mask, check_real
from specselect.constants import cached_constant
from specselect.estimators.base import (
    EPS,
    AcceptanceEstimator,
    Cached,
    check_estimate_arguments,
    check_state_device,
)
from specselect.estimators.calibrated import CalibratedDraft
from specselect.lookup import LOOKUP_FEATURES

LOGIT_MAX = 12.0  # the draft-probability feature is clamped to +-LOGIT_MAX (q = 0 or 1 stay finite)
TOKEN_FEATURES = 3  # draft log-odds, calibrated log-odds, position / 8
BATCH_DECAY = 0.95  # per-step factor on the batch's accepted / rejected counts
FEATURE_DECAY = 0.99  # per-step factor on the per-token features' running moments
ADAGRAD_FLOOR = 1e-2  # initial sum of squared gradients of each feature weight
VARIANCE_FLOOR = 0.1  # a feature's variance is taken as at least this when standardising


class RequestHistory(AcceptanceEstimator):
    """Online logistic regression on the draft probability, its calibration, the request's
    history and the position.

    Requests differ: on the shipped pair the draft agrees with the target on 78% of prose tokens
    but 49% of code tokens, at similar draft probabilities, and a request that is copying a
    repeated pattern keeps accepting for a while. Each batch slot therefore keeps decayed Beta
    estimates of its own request's acceptance rate at several time scales (``request_decays``:
    a fast one that follows the last step or two, a slow one for the request's character),
    ``rate = (hits + a) / (trials + a + b)`` with ``a + b = strength`` and ``a / (a + b)`` the
    batch's running rate. A logistic model combines the features

    ``[logit q, logit(calibrated q), position / 8, 1, logit(rate) for each time scale]``

    where ``calibrated q`` comes from a :class:`CalibratedDraft` table. Its weights start at
    ``[draft_weight, calibrated_weight, 0, 0, history_weight, ...]`` and follow one gradient
    step of the log-loss per verification step, over the positions the target tested.

    When the loop passes per-token ``features`` (``[B, K, features]``; specselect's loops pass
    :func:`~specselect.lookup.lookup_features`, whether each token continues an n-gram of the
    context as the context did), the model adds one term per feature. Each feature is
    standardised by its running mean and variance (so that one step size fits features of any
    scale), and its weight starts at 0 (a cold start is the model without features) and learns
    by AdaGrad with step ``feature_lr``: a feature that fires rarely still learns quickly from
    the steps where it does. On the shipped pair the prompt-lookup features raise the share of
    the fixed-to-oracle gap TETRIS closes by about ten points (docs/estimators.md).

    The calibration table is refreshed when the model learns, so that its part of an estimate is
    a lookup; each row's history term is recomputed at the start of an estimate (a few
    operations over ``[B, S]``), because the shared state it depends on (weights, batch rate)
    may have learned from a batch of another size since. State is allocated
    on the first call and then updated in place (see :mod:`specselect.estimators.base`).

    Args:
        calibration: the token-level calibration (a default :class:`CalibratedDraft` if omitted).
        request_decays: per-step factors on each request's counts, one per time scale.
        strength: pseudo-observations of the batch rate in each request's Beta estimate.
        lr: step size of the logistic regression.
        history_weight: initial weight of each history feature.
        draft_weight: initial weight of the draft probability's log-odds.
        calibrated_weight: initial weight of the calibrated probability's log-odds.
        features: how many per-token features it reads when a loop supplies them (0: none,
            it then ignores them).
        feature_lr: AdaGrad step size of the feature weights.
    """

    name = "history"

    @property
    def capturable(self) -> bool:
        return self.calibration.capturable

    def __init__(
        self,
        calibration: CalibratedDraft | None = None,
        request_decays: Sequence[float] = (0.5, 0.9),
        strength: float = 1.0,
        lr: float = 0.1,
        history_weight: float = 0.5,
        draft_weight: float = 0.0,
        calibrated_weight: float = 1.0,
        features: int = LOOKUP_FEATURES,
        feature_lr: float = 0.3,
    ) -> None:
        if calibration is not None and not isinstance(calibration, CalibratedDraft):
            raise TypeError(
                f"calibration must be a CalibratedDraft or None, got {type(calibration).__name__}"
            )
        self.calibration = calibration if calibration is not None else CalibratedDraft()
        if isinstance(request_decays, str) or not isinstance(request_decays, Sequence):
            raise TypeError(
                f"request_decays must be a sequence of floats, got {type(request_decays).__name__}"
            )
        if len(request_decays) == 0:
            raise ValueError("request_decays must hold at least one decay factor")
        self.request_decays = tuple(
            check_real(f"request_decays[{i}]", d, low=0.0, high=1.0)
            for i, d in enumerate(request_decays)
        )
        self.strength = check_real("strength", strength, low=0.0, open_low=True)
        self.lr = check_real("lr", lr, low=0.0, open_low=True)
        self.history_weight = check_real("history_weight", history_weight)
        self.draft_weight = check_real("draft_weight", draft_weight)
        self.calibrated_weight = check_real("calibrated_weight", calibrated_weight)
        self.features = check_int("features", features)
        self.feature_lr = check_real("feature_lr", feature_lr, low=0.0, open_low=True)
        # Shared state: [F] weights, [2] decayed accepted / rejected counts of the whole batch,
        # [S] the request decays.
        self._weights: Tensor | None = None
        self._batch: Tensor | None = None
        self._decays: Tensor | None = None
        # Feature state, [5, F]: the feature weights, AdaGrad's sums of squared gradients, and
        # decayed sums of 1, x and x^2 over the selectable tokens (the running moments).
        self._feature_state: Tensor | None = None
        # Per-slot state, one set per batch size met (see _state), and the current batch's.
        self._slots: dict[int, _Slots] = {}
        self._current: _Slots | None = None
        self._estimated = Cached()  # features and log-probabilities of the last estimate

    @property
    def uses_features(self) -> bool:
        return self.features > 0

    @property
    def _initial_weights(self) -> list[float]:
        history = [self.history_weight] * len(self.request_decays)
        return [self.draft_weight, self.calibrated_weight, 0.0, 0.0, *history]

    def reset(self) -> None:
        self.calibration.reset()
        self._estimated.clear()
        if self._weights is None or self._batch is None:
            return
        self._weights.copy_(torch.tensor(self._initial_weights))
        self._batch.copy_(torch.tensor(_BATCH_PRIOR))
        if self._feature_state is not None:
            self._feature_state.copy_(_fresh_feature_state(self.features, torch.device("cpu")))
        self.reset_requests()

    def reset_rows(self, rows: Tensor) -> None:
        slots = self._current
        if slots is None:
            return
        rows = check_mask("rows", rows, (slots.counts.shape[1],), slots.counts.device)
        self._estimated.clear()  # the features of these rows change
        slots.counts.masked_fill_(rows.view(1, -1, 1), 0.0)

    def reset_requests(self) -> None:
        self._estimated.clear()
        for slots in self._slots.values():
            slots.counts.zero_()

    def to(self, device: torch.device) -> None:
        self.calibration.to(device)
        if self._weights is None or self._batch is None or self._decays is None:
            return
        self._weights, self._batch = self._weights.to(device), self._batch.to(device)
        self._decays = self._decays.to(device)
        if self._feature_state is not None:
            self._feature_state = self._feature_state.to(device)
        self._slots = {size: slots.to(device) for size, slots in self._slots.items()}
        if self._current is not None:  # the batch the next reset_rows addresses
            self._current = self._slots[self._current.counts.shape[1]]

    def request_counts(self) -> Tensor | None:
        """``[2, B, S]`` decayed accepted / rejected counts of each slot of the last batch, per
        time scale (``None`` before any); diagnostics: the live tensor, do not modify it."""
        return None if self._current is None else self._current.counts

    def _state(self, batch: int, device: torch.device) -> tuple[Tensor, _Slots]:
        """``(weights [F], the per-slot state of a batch of this size)``, allocated when first
        needed. Each batch size keeps its own per-slot tensors, never rebound: a CUDA graph
        captured for a batch size reads them when it replays, also after other sizes ran."""
        if self._weights is None or self._batch is None or self._decays is None:
            self._weights = torch.tensor(self._initial_weights, device=device)
            self._batch = torch.tensor(_BATCH_PRIOR, device=device)
            self._decays = torch.tensor(self.request_decays, device=device)
            self._feature_state = _fresh_feature_state(self.features, device)
            self._slots.clear()
        check_state_device(self, self._weights, device)
        slots = self._slots.get(batch)
        if slots is None:
            slots = self._slots[batch] = _Slots.zeros(batch, len(self.request_decays), device)
        self._current = slots
        return self._weights, slots

    def _refresh_rows(self, slots: _Slots) -> None:
        """Recompute each row's history log-odds and its term of the model, in place (what
        :meth:`learn`'s gradient reads too: the values the estimate used)."""
        assert self._weights is not None and self._batch is not None
        # Kept inside (0, 1): a batch that never (or always) accepts decays one count to 0,
        # and a rate of exactly 0 or 1 would give an infinite log-odds, then NaN weights. Steps
        # that test nothing (every row inactive) decay both counts alike, which leaves their
        # ratio as it was: the exact ratio, however small the counts (a floor on the total
        # turned ~330 such steps into a rate near 0); the prior's if nothing is left at all.
        total = self._batch.sum()
        batch_rate = torch.where(total > 0, self._batch[0] / total, _BATCH_PRIOR[0])
        batch_rate = batch_rate.clamp(EPS, 1 - EPS)
        accepted = torch.add(slots.counts[0], batch_rate, alpha=self.strength)  # [B, S]
        rejected = torch.add(slots.counts[1], batch_rate, alpha=-self.strength).add_(self.strength)
        torch.sub(accepted.log_(), rejected.log_(), out=slots.history)
        bias = self._weights[TOKEN_FEATURES].expand(slots.row_terms.shape)  # [B]
        weights = self._weights[TOKEN_FEATURES + 1 :]  # [S] (the feature weights live apart)
        torch.addmv(bias, slots.history, weights, out=slots.row_terms)

    def _token_features(self, draft_logprobs: Tensor, positions: Tensor | None) -> Tensor:
        """``[3, B, K]``: the draft's log-odds, the calibrated log-odds, position / 8, in the
        model's float32 whatever the input's dtype (float64 features would not multiply the
        float32 weights; half-precision ones are widened exactly)."""
        q = draft_logprobs.exp()
        calibrated = self.calibration.logits(draft_logprobs, positions, q=q)  # [B, K] float32
        draft = (draft_logprobs - torch.log1p(-q)).clamp_(-LOGIT_MAX, LOGIT_MAX)  # [B, K]
        draft = draft.to(calibrated.dtype)
        if positions is None:  # chains: one position per column
            key = ("history_columns", draft_logprobs.shape[1], draft_logprobs.device)
            position = cached_constant(key, _scaled_columns).expand(draft.shape)
        else:
            position = positions.to(draft.dtype) / 8
        return torch.stack([draft, calibrated, position])

    def _log_probabilities(
        self, draft_logprobs: Tensor, positions: Tensor | None, features: Tensor | None
    ) -> Tensor:
        """``[B, K]`` ``log sigmoid(features @ weights)``, kept (with the features) for learn."""
        weights, slots = self._state(draft_logprobs.shape[0], draft_logprobs.device)
        self._refresh_rows(slots)
        token = self._token_features(draft_logprobs, positions)  # [3, B, K]
        flat = token.view(TOKEN_FEATURES, -1)  # [3, B * K]
        z = (weights[:TOKEN_FEATURES] @ flat).view(draft_logprobs.shape)  # [B, K]
        extra = self._standardised(features)  # [B, K, F] or None
        if extra is not None:
            assert self._feature_state is not None
            z.add_(extra @ self._feature_state[0])
        log_p = torch.nn.functional.logsigmoid(z.add_(slots.row_terms.unsqueeze(1)))
        self._estimated.keep((draft_logprobs, positions, features), (token, extra, log_p))
        return log_p

    def _standardised(self, features: Tensor | None) -> Tensor | None:
        """``[B, K, F]`` features less their running mean, over their running standard
        deviation, in float32; ``None`` when there are none to read. The variance is floored
        at :data:`VARIANCE_FLOOR`: a feature that is nearly always 0 (few matches) must not
        turn its rare 1s into huge inputs."""
        if features is None or self.features == 0:
            return None
        if features.shape[2] != self.features:
            raise ValueError(
                f"{type(self).__name__} reads {self.features} features per token, got "
                f"features of shape {list(features.shape)}"
            )
        assert self._feature_state is not None
        mean, variance = _moments(self._feature_state[2:])  # [F], [F]
        return (features.to(torch.float32) - mean) * variance.clamp(min=VARIANCE_FLOOR).rsqrt()

    def estimate(
        self,
        draft_logprobs: Tensor,
        positions: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        check_estimate_arguments(draft_logprobs, positions, features)
        log_p = self._log_probabilities(draft_logprobs, positions, features)
        return torch.where(draft_logprobs > float("-inf"), log_p, float("-inf"))

    def _learn(
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None,
        features: Tensor | None,
    ) -> None:
        weights, slots = self._state(draft_logprobs.shape[0], draft_logprobs.device)
        assert self._batch is not None and self._decays is not None
        key = (draft_logprobs, positions, features)
        cached = self._estimated.take(key)
        if cached is None:
            self._log_probabilities(draft_logprobs, positions, features)
            cached = self._estimated.take(key)
        token, extra, log_p = cached
        # passed implies tested, so tested ^ passed are the rejections.
        outcomes = torch.stack([passed, tested ^ passed]).to(weights.dtype)  # [2, B, K]
        error = log_p.exp().sub_(outcomes[0]).mul_(tested)  # [B, K] (p - passed) where tested
        per_row = outcomes.sum(dim=2)  # [2, B]
        totals = per_row.sum(dim=1)  # [2]
        scale = 1 / totals.sum().clamp(min=1)
        if extra is not None and features is not None:
            self._learn_features(extra, error * scale, features, draft_logprobs > float("-inf"))
        gradient = _gradient(error, token, slots.history)  # [F]
        weights.sub_(gradient.mul_(self.lr * scale))
        slots.counts.mul_(self._decays).add_(per_row.unsqueeze(2))
        self._batch.mul_(BATCH_DECAY).add_(totals)
        self.calibration.add_outcomes(draft_logprobs, positions, outcomes)

    def _learn_features(
        self, extra: Tensor, error: Tensor, features: Tensor, finite: Tensor
    ) -> None:
        """One AdaGrad step of the feature weights from the standardised ``extra`` features
        (``[B, K, F]``) and the per-token ``error`` (``[B, K]``, normalised), then the running
        moments take in the raw ``features`` of every selectable token (``finite``)."""
        state = self._feature_state
        assert state is not None
        weights, squares, moments = state[0], state[1], state[2:]  # [F], [F], [3, F]
        gradient = (extra * error.unsqueeze(2)).sum(dim=(0, 1))  # [F]
        squares.addcmul_(gradient, gradient)
        weights.addcdiv_(gradient, squares.sqrt(), value=-self.feature_lr)
        seen = features.to(torch.float32) * finite.unsqueeze(2)  # [B, K, F]
        step = torch.stack([finite.sum().expand(self.features), seen.sum(dim=(0, 1))])  # [2, F]
        step = torch.cat([step, (seen * seen).sum(dim=(0, 1)).unsqueeze(0)])  # [3, F]
        moments.mul_(FEATURE_DECAY).add_(step)


@dataclass(frozen=True)
class _Slots:
    """Per-slot state of one batch size: decayed counts, and what the next estimate reads."""

    counts: Tensor  # [2, B, S] decayed accepted / rejected counts per time scale
    history: Tensor  # [B, S] history log-odds
    row_terms: Tensor  # [B] bias + history term of each row

    def to(self, device: torch.device) -> _Slots:
        return _Slots(self.counts.to(device), self.history.to(device), self.row_terms.to(device))

    @staticmethod
    def zeros(batch: int, scales: int, device: torch.device) -> _Slots:
        return _Slots(
            counts=torch.zeros(2, batch, scales, device=device),
            history=torch.empty(batch, scales, device=device),
            row_terms=torch.empty(batch, device=device),
        )


_BATCH_PRIOR = (0.7, 0.3)  # one pseudo-observation at acceptance rate 0.7 before any evidence


def _fresh_feature_state(features: int, device: torch.device) -> Tensor:  # -> [5, F]
    """Feature weights 0, AdaGrad's floor, and no moments yet (see :func:`_moments`)."""
    state = torch.zeros(5, features, device=device)
    state[1] = ADAGRAD_FLOOR
    return state


def _moments(sums: Tensor) -> tuple[Tensor, Tensor]:  # [3, F] -> [F], [F]
    """Mean and variance from decayed sums of 1, x and x^2: 0 and 1 before any token."""
    count = sums[0]
    seen = count > 0
    mean = torch.where(seen, sums[1] / count.clamp(min=1e-12), 0.0)
    variance = torch.where(seen, sums[2] / count.clamp(min=1e-12) - mean * mean, 1.0)
    return mean, variance


def _scaled_columns(width: int, device: torch.device) -> Tensor:
    """``[width]`` float32: position / 8 of each chain column."""
    return torch.arange(width, device=device, dtype=torch.float32) / 8


def _gradient(error: Tensor, features: Tensor, history: Tensor) -> Tensor:
    """``[F]`` unnormalised log-loss gradient ``sum_{b,k} error[b, k] * x[b, k, :]``, in the
    weights' order: token features (``[3, B, K]``), bias, history (``[B, S]``)."""
    token = features.view(TOKEN_FEATURES, -1) @ error.view(-1)  # [3]
    per_row = error.sum(dim=1)  # [B]
    return torch.cat([token, per_row.sum().unsqueeze(0), per_row @ history])
