"""Online calibration of the draft probability, per draft position."""

from __future__ import annotations

import torch
from torch import Tensor

from specselect._checks import check_int
from specselect.constants import cached_constant
from specselect.estimators.base import AcceptanceEstimator, clamp_log, logit


def _check_unit(name: str, value: float, *, closed_low: bool) -> float:
    value = float(value)
    low_ok = value >= 0 if closed_low else value > 0
    if not (low_ok and value <= 1):
        raise ValueError(f"{name} must be in {'[' if closed_low else '('}0, 1], got {value}")
    return value


class CalibratedDraft(AcceptanceEstimator):
    """Acceptance rate observed for draft tokens of similar probability at the same position.

    Draft probabilities ``q`` are cut into ``bins`` equal-width bins; positions ``>= positions - 1``
    share the last position bucket. Each (position, bin) cell keeps exponentially decayed counts of
    tested and accepted tokens; its estimate is the accepted fraction, shrunk towards the bin's
    own ``q`` by ``prior`` pseudo-observations, so that it starts as the raw draft probability and
    moves to the observed rate as evidence arrives. The estimate is deliberately *not* forced to
    increase with ``q``: on the shipped pair acceptance is not monotone in the draft's
    confidence (tokens drafted at q ~ 0.05 are accepted more often than tokens at q ~ 0.15), and
    an isotonic fit measured a calibration error of 0.23 against 0.08 for plain bins.

    Args:
        bins: number of probability bins.
        positions: number of position buckets.
        prior: pseudo-observations at the bin's own probability.
        decay: per-step factor on all counts (1 = never forget).
    """

    name = "calibrated"

    def __init__(
        self, bins: int = 10, positions: int = 8, prior: float = 4.0, decay: float = 0.995
    ) -> None:
        self.bins = check_int("bins", bins, minimum=1)
        self.positions = check_int("positions", positions, minimum=1)
        if not prior > 0:
            raise ValueError(f"prior must be > 0, got {prior}")
        self.prior = float(prior)
        self.decay = _check_unit("decay", decay, closed_low=False)
        self.reset()

    def reset(self) -> None:
        self._hits: Tensor | None = None  # [P, bins] decayed accepted counts
        self._trials: Tensor | None = None  # [P, bins] decayed tested counts
        self._last_cells: tuple[Tensor, Tensor | None, Tensor] | None = None

    def _cells(
        self, draft_logprobs: Tensor, positions: Tensor | None, *, reuse: bool = False
    ) -> Tensor:  # -> [B, K]
        """Flat (position bucket, probability bin) cell of each token.

        A selector learns from the very tensors it just estimated, so :meth:`learn` passes
        ``reuse=True`` to take the cells the last estimate computed for the same tensors (and
        then forgets them). Estimates always recompute: a caller may refill one input buffer
        in place from step to step.
        """
        last = self._last_cells
        if reuse and last is not None and last[0] is draft_logprobs and last[1] is positions:
            return last[2]
        q = draft_logprobs.exp()  # NaN-free inputs (checked by selectors): q in [0, 1]
        column = (q * self.bins).to(torch.int64).clamp_(0, self.bins - 1)
        if positions is None:  # chains: the row offset of column j is a constant
            offsets = cached_constant(
                (
                    "calibration_offsets",
                    draft_logprobs.shape[1],
                    self.positions,
                    self.bins,
                    draft_logprobs.device,
                ),
                _position_offsets,
            )
            cells = column.add_(offsets)
        else:
            cells = column.add_(positions.clamp(max=self.positions - 1), alpha=self.bins)
        self._last_cells = (draft_logprobs, positions, cells)
        return cells

    def _state(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._hits is None or self._trials is None or self._hits.device != device:
            shape = (self.positions * self.bins,)
            self._hits = torch.zeros(shape, dtype=torch.float32, device=device)
            self._trials = torch.zeros(shape, dtype=torch.float32, device=device)
        return self._hits, self._trials

    def table(self, device: torch.device | str = "cpu") -> Tensor:
        """``[positions, bins]`` current estimates."""
        hits, trials = self._state(torch.device(device))
        centers = (torch.arange(self.bins, device=hits.device) + 0.5) / self.bins  # [bins]
        prior = centers.repeat(self.positions)  # [P * bins]
        rate = (hits + self.prior * prior) / (trials + self.prior)
        return rate.view(self.positions, self.bins)

    def probabilities(self, draft_logprobs: Tensor, positions: Tensor | None = None) -> Tensor:
        """``[B, K]`` calibrated acceptance probabilities (for other estimators to build on)."""
        return _lookup(self.table(draft_logprobs.device), self._cells(draft_logprobs, positions))

    def logits(self, draft_logprobs: Tensor, positions: Tensor | None = None) -> Tensor:
        """``[B, K]`` logits of :meth:`probabilities` (clamped to ``[EPS, 1 - EPS]``), taken on
        the ``positions × bins`` table before the lookup: a few dozen entries, not ``B · K``."""
        table = logit(self.table(draft_logprobs.device))
        return _lookup(table, self._cells(draft_logprobs, positions))

    def estimate(self, draft_logprobs: Tensor, positions: Tensor | None = None) -> Tensor:
        finite = draft_logprobs > float("-inf")
        return clamp_log(self.probabilities(draft_logprobs, positions), finite)

    def learn(
        self,
        draft_logprobs: Tensor,
        tested: Tensor,
        passed: Tensor,
        positions: Tensor | None = None,
    ) -> None:
        hits, trials = self._state(draft_logprobs.device)
        cells = self._cells(draft_logprobs, positions, reuse=True).reshape(-1)
        self._last_cells = None
        hits.mul_(self.decay).index_add_(0, cells, (tested & passed).reshape(-1).to(hits.dtype))
        trials.mul_(self.decay).index_add_(0, cells, tested.reshape(-1).to(trials.dtype))


def _position_offsets(width: int, positions: int, bins: int, device: torch.device) -> Tensor:
    """``[width]`` int64: ``min(j, positions - 1) * bins``, the first cell of column ``j``."""
    return torch.arange(width, device=device).clamp(max=positions - 1) * bins


def _lookup(table: Tensor, cells: Tensor) -> Tensor:
    """``table`` (``[P, bins]``) at flat ``cells`` (``[B, K]`` int64) → ``[B, K]``.

    ``index_select`` on the flattened cells: ~3× faster on CPU than advanced indexing.
    """
    return table.reshape(-1).index_select(0, cells.reshape(-1)).view(cells.shape)
