"""Confidence threshold: each request keeps its draft tokens until the draft becomes unsure.

This is the rule behind HF's ``assistant_confidence_threshold`` and the DISCO family of dynamic
draft lengths: a token the draft itself finds unlikely is likely to be rejected, and so is
everything after it, so verification stops before it. Unlike TETRIS there is no budget: each
request is judged alone, so the number of verified tokens per step varies with the batch. In a
draft tree the same rule holds along every root-to-node path: a node is verified when every
node on its path, itself included, is confident.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int, check_probability
from specselect.cost import CostModel
from specselect.estimators import AcceptanceEstimator, make_estimator
from specselect.selection import (
    NEG_INF,
    Selection,
    Selector,
    estimator_kwargs,
    leading_run,
    window_selection,
)
from specselect.tree import path_minima

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEFAULT_THRESHOLD = 0.4
"""The threshold a comparison grid gives :class:`ThresholdSelector` (HF's default
``assistant_confidence_threshold``)."""


def confident_prefix(
    draft_logprobs: Tensor,  # [B, K] log q of each drafted token
    log_threshold: float,
) -> Tensor:
    """``[B]`` int64: drafted tokens before the first one with ``log q < log_threshold``.

    ``log_threshold`` is a Python scalar (no host-to-device copy, no sync), ideally exact in the
    input's dtype (see :func:`dtype_log_threshold`). A ``log_threshold`` of ``-inf`` (threshold
    0) keeps every token here, ``-inf`` log-probabilities included; callers combine the result
    with :func:`~specselect.selection.available_lengths`.
    """
    return leading_run(draft_logprobs >= log_threshold)


def dtype_log_threshold(threshold: float, dtype: torch.dtype) -> float:
    """``log(threshold)`` computed in ``dtype`` on the CPU, returned as an exact Python float.

    A caller holding probabilities in ``dtype`` gets ``log q`` of the probability *rounded to*
    ``dtype``; ``math.log(threshold)`` rounded to ``dtype`` differs from that for about one
    threshold in five, and a token exactly at the threshold would then be dropped.
    """
    return float(torch.tensor(threshold, dtype=dtype).log())


class ThresholdSelector(Selector):
    """Draft ``max_k`` tokens; verify each request's prefix of tokens with ``q >= threshold``.

    A token whose draft probability equals the threshold is kept (for log-probabilities taken
    of probabilities held in the input's dtype: see :func:`dtype_log_threshold`).
    ``threshold = 0`` verifies every available token (standard SD with window ``max_k``);
    ``threshold = 1`` verifies only tokens the draft was certain of.

    With draft trees (``parents=``) a node is verified when every node on its root path, itself
    included, has ``q >= threshold`` and it is at most ``max_k`` deep. That is the chain rule
    applied to every path: the smallest probability on the path counts, not their product, so a
    chain-shaped tree selects what the chain does. The selection is closed under ancestors,
    since a node's path contains its parent's.

    Args:
        max_k: tokens drafted per request, and the most any request verifies.
        threshold: smallest draft probability a verified token may have, in ``[0, 1]``.
        estimator: optional acceptance estimator (instance or registry name); the threshold
            then applies to the estimated acceptance probability instead of ``q``.
    """

    name = "threshold"
    supports_trees = True

    def __init__(
        self,
        max_k: int,
        threshold: float,
        estimator: AcceptanceEstimator | str | None = None,
    ) -> None:
        super().__init__()
        self.max_k = check_int("max_k", max_k)
        self.estimator = make_estimator(estimator)
        self.threshold = check_probability("threshold", threshold)
        # Host-side, once: ``select`` then only looks the value up (compiles without breaks).
        self._log_thresholds = {dt: dtype_log_threshold(self.threshold, dt) for dt in FLOAT_DTYPES}

    def draft_length(self, num_active: int) -> int:
        check_int("num_active", num_active)
        return self.max_k

    def _log_threshold(self, dtype: torch.dtype) -> float:
        """``log(threshold)`` exact in ``dtype`` (see :func:`dtype_log_threshold`)."""
        log_threshold = self._log_thresholds.get(dtype)
        if log_threshold is None:  # a rarer floating dtype: computed on the host, no device read
            log_threshold = dtype_log_threshold(self.threshold, dtype)
        return log_threshold

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        confident = confident_prefix(draft_logprobs, self._log_threshold(draft_logprobs.dtype))
        return window_selection(draft_logprobs, active, confident.clamp(max=self.max_k))

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        # The least confident node of each path. Widening to float32 keeps every value, and the
        # threshold is exact in the input's dtype: the comparison is the chain rule's.
        weakest = path_minima(draft_logprobs, parents)  # [B, N]
        log_threshold = self._log_threshold(draft_logprobs.dtype)
        mask = (weakest > NEG_INF) & (weakest >= log_threshold) & (depth <= self.max_k)
        return Selection.from_mask(mask, active)

    @classmethod
    def grid_kwargs(cls, k: int, extra: int, budget: int | None) -> dict[str, Any] | None:
        """Up to ``k + extra`` tokens, as far as TETRIS drafts, at :data:`DEFAULT_THRESHOLD`."""
        if budget is not None:
            return None
        return {"max_k": k + extra, "threshold": DEFAULT_THRESHOLD}

    @classmethod
    def spec_kwargs(cls, estimator: str | None, cost_model: CostModel | None) -> dict[str, Any]:
        return estimator_kwargs(estimator)
