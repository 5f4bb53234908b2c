"""One selector configuration's result in a comparison: :class:`ResultRow`.

Replay comparisons (:func:`~specselect.replay.compare_replay`), live comparisons
(:func:`~specselect.replay.compare_live`) and the reports (:mod:`specselect.report`) share this
one row type. It holds the :class:`~specselect.replay.SelectorConfig` it measured rather than a
copy of its fields, so that the label, ``k``, ``extra`` and budget of a row cannot drift from the
configuration that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from specselect.metrics import Totals
from specselect.replay.engine import ReplayResult
from specselect.replay.grid import SelectorConfig

if TYPE_CHECKING:
    from specselect.hf import TreeSpec

__all__ = ["MEASURED", "MODELLED", "ResultRow"]

MODELLED = "modelled"
"""``goodput_kind`` of a replayed row: its seconds come from a cost model."""
MEASURED = "measured"
"""``goodput_kind`` of a live row: its seconds are wall-clock time."""


@dataclass(frozen=True)
class ResultRow:
    """One selector configuration's totals in a comparison.

    Attributes:
        config: the configuration measured (name, ``k``, ``extra``, budget, constructor
            arguments).
        totals: the run's totals (``seconds`` modelled in replay, measured in live runs).
        goodput_kind: :data:`MODELLED` or :data:`MEASURED`.
        calibration: reliability-diagram bins of the scores the selector ranked, as
            ``{"predicted", "observed", "tokens"}``: for a replayed row, what the method
            ``ReplayResult.calibration()`` returned
            (:meth:`~specselect.replay.ReplayResult.calibration`); empty for a live row (a live
            run keeps no scores).
        tree: the draft-tree shape of a live tree run; None for chains. A tree's shape, not
            ``extra``, sets what is drafted, so a tree row has no ``extra``.
    """

    config: SelectorConfig
    totals: Totals
    goodput_kind: str = MODELLED
    calibration: list[dict[str, float]] = field(default_factory=list)
    tree: TreeSpec | None = None

    @classmethod
    def replayed(cls, config: SelectorConfig, result: ReplayResult) -> ResultRow:
        """The row of a replay: modelled goodput, with the replay's calibration bins."""
        return cls(config, result.totals, MODELLED, result.calibration())

    @property
    def selector(self) -> str:
        """The configuration's name, with the tree shape for tree runs (``tetris tree(3,2,2)``)."""
        if self.tree is None:
            return self.config.name
        return f"{self.config.name} tree({self.tree.depth},{self.tree.branch},{self.tree.width})"

    @property
    def k(self) -> int:
        """The mean window the row is compared at (fixed SD at this ``k`` is its baseline)."""
        return self.config.k

    @property
    def extra(self) -> int | None:
        """Drafted tokens beyond ``k``; None for selectors without that notion and for trees."""
        return None if self.tree is not None else self.config.extra

    @property
    def budget(self) -> int | str | None:
        """Absolute budget per step (or ``"goodput"``); None = the selector's default."""
        return self.config.budget

    @property
    def params(self) -> dict[str, Any]:
        """The JSON-compatible constructor arguments of the configuration, defaults included
        (:attr:`~specselect.replay.SelectorConfig.arguments`); others (a cost model, an
        estimator object) as their type's name."""
        return {
            key: value
            if isinstance(value, bool | int | float | str | None)
            else type(value).__name__
            for key, value in self.config.arguments.items()
        }

    @property
    def label(self) -> str:
        """``selector k=.. [extra=..] [C=..]``: unique within a comparison."""
        return replace(self.config, name=self.selector, extra=self.extra).label
