"""Standard speculative decoding: the same window for every request."""

from __future__ import annotations

from collections.abc import Hashable

from torch import Tensor

from specselect._checks import check_int
from specselect.selection import (
    Selection,
    Selector,
    tree_scores,
    window_selection,
)
from specselect.topc import cheapest_per_row


class FixedWindowSelector(Selector):
    """Draft and verify ``k`` tokens per active request (standard SD).

    Rows whose drafts contain ``-inf`` log-probabilities are cut before the first ``-inf``. With
    draft trees (``parents=``) every request keeps its own best ``k`` nodes by path score — the
    per-request budget of EAGLE-2 and SGLang — closed under ancestors.
    """

    name = "fixed"
    supports_trees = True

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = check_int("k", k)

    def draft_length(self, num_active: int) -> int:
        check_int("num_active", num_active)
        return self.k

    def _max_selected(self, width: int, num_active: int) -> int:
        return min(width, self.k)

    @property
    def capture_key(self) -> Hashable:
        """Stateless: the window is all a captured selection depends on."""
        return (self.name, self.k)

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        return window_selection(draft_logprobs, active, self.k)

    def _select_tree(
        self, draft_logprobs: Tensor, active: Tensor | None, parents: Tensor, depth: Tensor
    ) -> Selection:
        mask = cheapest_per_row(tree_scores(draft_logprobs, parents).neg(), self.k)
        return Selection.from_mask(mask, active)
