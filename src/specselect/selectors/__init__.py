"""The selectors. A new selector is one module here and one line in ``SELECTORS``."""

from __future__ import annotations

from specselect.selection import Selector
from specselect.selectors.dsd import DSDSelector
from specselect.selectors.fixed import FixedWindowSelector
from specselect.selectors.heuristic import HeuristicSelector
from specselect.selectors.tetris import TetrisSelector
from specselect.selectors.threshold import ThresholdSelector

SELECTORS: dict[str, type[Selector]] = {
    TetrisSelector.name: TetrisSelector,
    FixedWindowSelector.name: FixedWindowSelector,
    DSDSelector.name: DSDSelector,
    ThresholdSelector.name: ThresholdSelector,
    HeuristicSelector.name: HeuristicSelector,
}

__all__ = [
    "SELECTORS",
    "DSDSelector",
    "FixedWindowSelector",
    "HeuristicSelector",
    "TetrisSelector",
    "ThresholdSelector",
]
