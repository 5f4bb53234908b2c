"""The selection contract: what a selector receives, what it returns, and the shared kernels.

A *selector* decides, each step, which drafted tokens the target model verifies. It sees only
draft-side information (the draft's log-probabilities), so any selection keeps speculative
sampling lossless. Everything here is pure tensor code on the input's device with no host sync,
so that a decoding loop can call it between two forward passes, or capture it in a CUDA graph.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from specselect._checks import check_active, check_counts, check_logprobs

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Selection:
    """Which drafted tokens to verify.

    Attributes:
        lengths: ``[B]`` int64 — tokens selected per request (on the input's device).
        mask: ``[B, K]`` bool — the selected positions. For chains it is a prefix mask
            (``mask[i, j] == (j < lengths[i])``); for draft trees it is a node mask closed under
            ancestors, and ``lengths`` counts the selected nodes.
    """

    lengths: Tensor  # [B] int64
    mask: Tensor  # [B, K] bool

    @classmethod
    def from_lengths(cls, lengths: Tensor, width: int) -> Selection:
        """Build the prefix selection of ``lengths`` (``[B]``) over ``width`` draft positions."""
        lengths = lengths.to(torch.int64)
        return cls(lengths=lengths, mask=prefix_mask(lengths, width))

    @property
    def num_verified(self) -> Tensor:
        """0-dim int64 tensor: draft tokens (or tree nodes) the target verifies this step."""
        return self.lengths.sum()


def prefix_mask(lengths: Tensor, width: int) -> Tensor:
    """``[B, width]`` bool mask with the first ``lengths[i]`` entries of row ``i`` set."""
    positions = torch.arange(width, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def chain_scores(draft_logprobs: Tensor) -> Tensor:
    """Cumulative log draft probability of each chain prefix.

    Args:
        draft_logprobs: ``[B, K]`` log q of each drafted token (``-inf`` = never select).

    Returns:
        ``[B, K]`` float scores, non-increasing along each row because every log q <= 0; at
        least float32 so that long chains of half-precision inputs do not lose their order.
    """
    dtype = torch.promote_types(draft_logprobs.dtype, torch.float32)
    return draft_logprobs.to(dtype).cumsum(dim=1)


def available_lengths(draft_logprobs: Tensor) -> Tensor:
    """``[B]`` int64: drafted tokens before the first ``-inf`` (the selectable prefix)."""
    return (draft_logprobs > NEG_INF).to(torch.int64).cumprod(dim=1).sum(dim=1)


def top_c_mask(scores: Tensor, budget: int) -> Tensor:
    """Select exactly ``min(budget, available)`` entries with the largest scores.

    Args:
        scores: ``[B, N]`` float; ``-inf`` marks entries that are never selected. Scores must not
            increase from an entry to any entry that depends on it (along a chain, or from a tree
            node to its children, where a child always has a larger index than its parent).
        budget: a static Python int (the total count, not per row).

    Returns:
        ``[B, N]`` bool mask.

    Why this is prefix- (ancestor-) closed: an entry is taken only if its score is at least the
    ``budget``-th best score ``tau``. Everything it depends on has a score >= its own, so it is
    taken too — except among entries *equal* to ``tau``, where only some fit. Those ties are
    settled in column-major order (lower index first, then lower row), and an entry's
    prerequisites always sit in lower columns, so they win every tie against it.

    Why ``kthvalue`` and not ``topk``: only the threshold is needed, and a selection (O(n)) is
    far cheaper than a large-k sorted ``topk``; the budget is a Python int, so no value is read
    back to the host.
    """
    rows, cols = scores.shape
    n = rows * cols
    available = scores > NEG_INF
    if budget <= 0 or n == 0:
        return torch.zeros_like(available)
    if budget >= n:
        return available
    tau = torch.kthvalue(scores.reshape(-1), n - budget + 1).values  # budget-th largest
    above = scores > tau
    tied = (scores == tau) & available
    remaining = budget - above.sum()
    # Inclusive rank of each tied entry in column-major order.
    rank = tied.t().cumsum(dim=0).t()
    return above | (tied & (rank <= remaining))


class Selector(abc.ABC):
    """Base class of every selector.

    A decoding loop calls, once per step:

    1. :meth:`draft_length` — how many tokens to draft per request;
    2. :meth:`select` — which of the drafted tokens the target verifies;
    3. :meth:`update` — feedback after verification (accepted counts), for adaptive selectors.

    Subclasses implement :meth:`_select`; the base class checks the arguments.
    """

    name: ClassVar[str] = "selector"

    @abc.abstractmethod
    def draft_length(self, num_active: int) -> int:
        """Tokens to draft per active request this step, given ``num_active`` active requests."""

    def select(self, draft_logprobs: Tensor, active: Tensor | None = None) -> Selection:
        """Choose the draft tokens to verify.

        Args:
            draft_logprobs: ``[B, K]`` log-probability the draft gave each drafted token
                (``-inf`` = never select this token or anything after it).
            active: optional ``[B]`` bool; inactive rows get length 0 and take no budget.

        Returns:
            A :class:`Selection` on the input's device.
        """
        draft_logprobs = check_logprobs("draft_logprobs", draft_logprobs)
        active = check_active(active, draft_logprobs.shape[0], draft_logprobs.device)
        return self._select(draft_logprobs, active)

    @abc.abstractmethod
    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        """Selection on checked arguments (``[B, K]`` log-probs, optional ``[B]`` bool)."""

    def update(self, selection: Selection, num_accepted: Tensor) -> None:
        """Feedback after verification: ``num_accepted`` ``[B]`` accepted draft tokens per row.

        Stateless selectors ignore it; adaptive ones override :meth:`_update`.
        """
        check_counts("num_accepted", num_accepted, selection.lengths.shape[0],
                     selection.lengths.device)
        self._update(selection, num_accepted)

    def _update(self, selection: Selection, num_accepted: Tensor) -> None:  # noqa: B027
        """Adaptive selectors override this; the default keeps no state."""

    def reset(self) -> None:  # noqa: B027
        """Forget all state learned from feedback (start of a new generation)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def mask_inactive(lengths: Tensor, active: Tensor | None) -> Tensor:
    """Zero the lengths of inactive rows (``lengths`` ``[B]``, ``active`` ``[B]`` bool)."""
    return lengths if active is None else lengths * active.to(lengths.dtype)
