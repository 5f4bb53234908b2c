"""The selectors. A new selector is one module here and one line in ``SELECTORS``."""

from __future__ import annotations

from specselect.selection import Selector
from specselect.selectors.fixed import FixedWindowSelector
from specselect.selectors.tetris import TetrisSelector

SELECTORS: dict[str, type[Selector]] = {
    TetrisSelector.name: TetrisSelector,
    FixedWindowSelector.name: FixedWindowSelector,
}

__all__ = ["SELECTORS", "FixedWindowSelector", "TetrisSelector"]
