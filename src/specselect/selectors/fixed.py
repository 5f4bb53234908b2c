"""Standard speculative decoding: the same window for every request."""

from __future__ import annotations

from torch import Tensor

from specselect._checks import check_int
from specselect.selection import Selection, Selector, available_lengths, mask_inactive


class FixedWindowSelector(Selector):
    """Draft and verify ``k`` tokens per active request (standard SD).

    Rows whose drafts contain ``-inf`` log-probabilities are cut before the first ``-inf``.
    """

    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = check_int("k", k)

    def draft_length(self, num_active: int) -> int:
        check_int("num_active", num_active)
        return self.k

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        lengths = available_lengths(draft_logprobs).clamp(max=self.k)
        return Selection.from_lengths(mask_inactive(lengths, active), draft_logprobs.shape[1])
