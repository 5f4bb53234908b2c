"""The selectors. A new selector is one module here and one line in ``SELECTORS``."""

from __future__ import annotations

from specselect._registries import Registry
from specselect.selection import Selector
from specselect.selectors.dsd import DSDSelector
from specselect.selectors.fixed import FixedWindowSelector
from specselect.selectors.heuristic import HeuristicSelector
from specselect.selectors.tetris import TetrisSelector
from specselect.selectors.threshold import ThresholdSelector

SELECTORS: Registry[Selector] = Registry(
    "SELECTORS",
    "selector",
    Selector,
    {
        TetrisSelector.name: TetrisSelector,
        FixedWindowSelector.name: FixedWindowSelector,
        DSDSelector.name: DSDSelector,
        ThresholdSelector.name: ThresholdSelector,
        HeuristicSelector.name: HeuristicSelector,
    },
    # specselect.replay.OracleSelector's name (replay/ imports this module, not the reverse)
    reserved={"oracle": "the oracle, the replay-only bound every comparison includes"},
)
"""Selectors by name, for :func:`specselect.registry.make_selector` and comparisons:
``SELECTORS["mine"] = Mine`` registers one. A name must be free of whitespace, ``+`` and ``,``
(and not ``"oracle"``), the class a concrete :class:`~specselect.selection.Selector`; a name
taken by another class is refused (``del SELECTORS[name]`` first to replace it), but the same
class defined again (a re-run notebook cell) replaces it."""

__all__ = [
    "SELECTORS",
    "DSDSelector",
    "FixedWindowSelector",
    "HeuristicSelector",
    "TetrisSelector",
    "ThresholdSelector",
]
