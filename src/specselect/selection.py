"""The selection contract: what a selector receives, what it returns, and its base class.

A *selector* decides, each step, which drafted tokens the target model verifies. It sees only
draft-side information (the draft's log-probabilities), so any selection keeps speculative
sampling lossless. Everything here is pure tensor code on the input's device with no host sync,
so that a decoding loop can call it between two forward passes, or capture it in a CUDA graph.
The top-``C`` kernel that budgeted selectors run lives in :mod:`specselect.topc`
(:func:`top_c_mask` is importable from here too).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from specselect._checks import (
    check_active,
    check_counts,
    check_logprobs,
    check_row_ints,
    check_tensor,
)
from specselect.constants import cached_constant
from specselect.estimators import AcceptanceEstimator, observed_outcomes, tree_outcomes
from specselect.topc import top_c_mask as top_c_mask  # public here too
from specselect.tree import check_parents, path_sums

NEG_INF = float("-inf")


@dataclass(frozen=True)
class _LastSelect:
    """What the last ``select`` saw, kept for ``update``."""

    logprobs: Tensor  # [B, K] the draft log-probs
    scores: Tensor  # [B, K] what was ranked (estimates, or the log-probs)
    parents: Tensor | None  # [B, N] for a tree selection
    positions: Tensor | None  # [B, N] depth - 1 of each node, for a tree selection


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
    columns = cached_constant(("columns", width, lengths.device), _columns)  # [1, width]
    return columns < lengths.unsqueeze(1)


def _columns(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, device=device).unsqueeze(0)


def chain_scores(draft_logprobs: Tensor) -> Tensor:
    """Cumulative log draft probability of each chain prefix.

    Args:
        draft_logprobs: ``[B, K]`` log q of each drafted token (``-inf`` = never select).

    Returns:
        ``[B, K]`` float scores, non-increasing along each row because every log q <= 0; at
        least float32 so that long chains of half-precision inputs do not lose their order.
    """
    dtype = torch.promote_types(draft_logprobs.dtype, torch.float32)
    return draft_logprobs.cumsum(dim=1, dtype=dtype)


def available_lengths(draft_logprobs: Tensor) -> Tensor:
    """``[B]`` int64: drafted tokens before the first ``-inf`` (the selectable prefix)."""
    return (draft_logprobs > NEG_INF).cumprod(dim=1).sum(dim=1)  # bool cumprod gives int64


class Selector(abc.ABC):
    """Base class of every selector.

    A decoding loop calls, once per step:

    1. :meth:`draft_length` — how many tokens to draft per request;
    2. :meth:`select` — which of the drafted tokens (or draft-tree nodes) the target verifies;
    3. :meth:`update` — feedback after verification (accepted counts), for adaptive selectors.

    Subclasses implement :meth:`_select` (chains) and, if ``supports_trees``,
    :meth:`_select_tree`; the base class checks the arguments, applies the optional acceptance
    ``estimator`` to the draft log-probabilities, feeds it the outcomes, and resets per-request
    state when a batch slot starts serving a new request.
    """

    name: ClassVar[str] = "selector"
    supports_trees: ClassVar[bool] = False
    estimator: AcceptanceEstimator | None = None

    @abc.abstractmethod
    def draft_length(self, num_active: int) -> int:
        """Tokens to draft per active request this step, given ``num_active`` active requests."""

    def select(
        self,
        draft_logprobs: Tensor,
        active: Tensor | None = None,
        *,
        parents: Tensor | None = None,
        request_ids: Tensor | None = None,
    ) -> Selection:
        """Choose the draft tokens to verify.

        Args:
            draft_logprobs: ``[B, K]`` log-probability the draft gave each drafted token
                (``-inf`` = never select this token or anything after it). With ``parents``,
                ``[B, N]`` per tree node.
            active: optional ``[B]`` bool; inactive rows get length 0 and take no budget.
            parents: optional ``[B, N]`` int: select draft-tree nodes instead of chain
                positions (see :mod:`specselect.tree`); the result is closed under ancestors.
            request_ids: optional ``[B]`` int64 id of the request in each batch slot. When a
                slot's id changes, per-request state of that slot is reset (:meth:`reset_rows`).

        Returns:
            A :class:`Selection` on the input's device.
        """
        draft_logprobs = check_logprobs("draft_logprobs", draft_logprobs)
        rows, width = draft_logprobs.shape
        active = check_active(active, rows, draft_logprobs.device)
        if request_ids is not None:
            self._follow_requests(
                check_row_ints("request_ids", request_ids, rows, draft_logprobs.device)
            )
        if parents is not None:
            if not self.supports_trees:
                raise TypeError(
                    f"{type(self).__name__} does not select draft-tree nodes (parents=...); "
                    "use a selector with supports_trees, e.g. 'tetris' or 'fixed'"
                )
            parents = check_parents(parents, rows=rows, width=width)
            positions = path_sums(torch.ones_like(draft_logprobs), parents).to(torch.int64) - 1
        scores = draft_logprobs
        if self.estimator is not None:
            scores = self.estimator.estimate(draft_logprobs, None if parents is None else positions)
        self._last = _LastSelect(
            draft_logprobs, scores, parents, None if parents is None else positions
        )
        if parents is None:
            return self._select(scores, active)
        return self._select_tree(scores, active, parents)

    @abc.abstractmethod
    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        """Selection on checked arguments (``[B, K]`` log-probs, optional ``[B]`` bool)."""

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor
    ) -> Selection:
        """Tree selection (``[B, N]`` node log-probs and parents); only if ``supports_trees``."""
        raise NotImplementedError

    def update(
        self,
        selection: Selection,
        num_accepted: Tensor,
        *,
        accepted_nodes: Tensor | None = None,
    ) -> None:
        """Feedback after verification: ``num_accepted`` ``[B]`` accepted draft tokens per row.

        After a tree selection, also pass ``accepted_nodes`` (``[B, N]`` bool, the accepted
        root-to-node path) so that estimators know which nodes passed. The acceptance
        estimator, if any, learns from the outcomes; adaptive selectors override
        :meth:`_update`.
        """
        check_counts(
            "num_accepted", num_accepted, selection.lengths.shape[0], selection.lengths.device
        )
        if accepted_nodes is not None:
            check_tensor("accepted_nodes", accepted_nodes, rank=2)
            if accepted_nodes.dtype != torch.bool or accepted_nodes.shape != selection.mask.shape:
                raise ValueError(
                    f"accepted_nodes must be a bool tensor of shape {tuple(selection.mask.shape)}"
                )
        self._accepted_nodes = accepted_nodes
        last = getattr(self, "_last", None)
        if self.estimator is not None and last is not None:
            tested, passed = self.outcomes(selection, num_accepted)
            self.estimator.learn(last.logprobs, tested, passed, last.positions)
        self._update(selection, num_accepted)

    def outcomes(self, selection: Selection, num_accepted: Tensor) -> tuple[Tensor, Tensor]:
        """``([B, K] tested, [B, K] passed)`` of the last step (see :func:`observed_outcomes`
        and :func:`tree_outcomes`)."""
        last = getattr(self, "_last", None)
        if last is None or last.parents is None:
            return observed_outcomes(selection.lengths, num_accepted, selection.mask.shape[1])
        accepted = getattr(self, "_accepted_nodes", None)
        if accepted is None:
            raise ValueError(
                f"{type(self).__name__} learns from its outcomes: after a tree selection, call "
                "update(selection, num_accepted, accepted_nodes=...) with the accepted path"
            )
        return tree_outcomes(selection.mask, last.parents, accepted)

    def _update(self, selection: Selection, num_accepted: Tensor) -> None:  # noqa: B027
        """Adaptive selectors override this; the default keeps no state."""

    def reset(self) -> None:
        """Forget all state learned from feedback (start of a new generation)."""
        self._request_ids: Tensor | None = None
        if self.estimator is not None:
            self.estimator.reset()

    def reset_rows(self, rows: Tensor) -> None:
        """Forget per-request state of ``rows`` (``[B]`` bool): their slots hold new requests."""
        if self.estimator is not None:
            self.estimator.reset_rows(rows)

    @property
    def last_scores(self) -> Tensor | None:
        """``[B, K]`` the log-scores the last :meth:`select` ranked: the estimator's estimates
        of the acceptance log-probabilities, or the draft log-probs without an estimator."""
        last = getattr(self, "_last", None)
        return None if last is None else last.scores

    def _follow_requests(self, request_ids: Tensor) -> None:
        previous = getattr(self, "_request_ids", None)
        if previous is not None and previous.shape == request_ids.shape:
            self.reset_rows(request_ids != previous)
        elif previous is not None:
            self.reset()
        self._request_ids = request_ids.clone()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def mask_inactive(lengths: Tensor, active: Tensor | None) -> Tensor:
    """Zero the lengths of inactive rows (``lengths`` ``[B]``, ``active`` ``[B]`` bool)."""
    return lengths if active is None else lengths * active.to(lengths.dtype)
