"""specselect: choose which draft tokens the target verifies in batched speculative decoding."""

from typing import TYPE_CHECKING, Any

from specselect._checks import set_device_value_checks
from specselect.cost import CostModel
from specselect.estimators import CalibratedDraft, DraftProbability, RankingGuard, RequestHistory
from specselect.registry import available_selectors, make_selector
from specselect.selection import Selection, Selector, top_c_mask
from specselect.selectors import (
    DSDSelector,
    FixedWindowSelector,
    HeuristicSelector,
    TetrisSelector,
    ThresholdSelector,
)
from specselect.tree import TreeSpec

if TYPE_CHECKING:
    from specselect.hf import SpeculativeOutput, speculative_generate

__version__ = "0.1.0"

_LAZY = {"speculative_generate", "SpeculativeOutput"}


def __getattr__(name: str) -> Any:
    """Lazy exports: the HF loop imports transformers, which takes seconds."""
    if name in _LAZY:
        import specselect.hf as hf

        return getattr(hf, name)
    raise AttributeError(f"module 'specselect' has no attribute {name!r}")


__all__ = [
    "CalibratedDraft",
    "CostModel",
    "DSDSelector",
    "DraftProbability",
    "FixedWindowSelector",
    "HeuristicSelector",
    "RankingGuard",
    "RequestHistory",
    "Selection",
    "Selector",
    "SpeculativeOutput",
    "TetrisSelector",
    "ThresholdSelector",
    "TreeSpec",
    "__version__",
    "available_selectors",
    "make_selector",
    "set_device_value_checks",
    "speculative_generate",
    "top_c_mask",
]
