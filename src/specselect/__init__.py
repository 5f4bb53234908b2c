"""specselect: choose which draft tokens the target verifies in batched speculative decoding."""

from specselect._checks import set_device_value_checks
from specselect.registry import available_selectors, make_selector
from specselect.selection import Selection, Selector, top_c_mask
from specselect.selectors import (
    DSDSelector,
    FixedWindowSelector,
    HeuristicSelector,
    TetrisSelector,
    ThresholdSelector,
)

__version__ = "0.1.0"

__all__ = [
    "DSDSelector",
    "FixedWindowSelector",
    "HeuristicSelector",
    "Selection",
    "Selector",
    "TetrisSelector",
    "ThresholdSelector",
    "__version__",
    "available_selectors",
    "make_selector",
    "set_device_value_checks",
    "top_c_mask",
]
