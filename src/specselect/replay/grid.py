"""Selector grids and comparisons: the configurations ``specselect compare`` replays.

:func:`selector_grid` expands selector specs (``"tetris+history"``, ``"fixed"``, ``"oracle"``)
over ``k`` / ``extra`` / ``budget`` grids into :class:`SelectorConfig` s, and
:func:`compare_replay` replays each configuration over the same traces.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specselect._checks import check_int
from specselect.cost import CostModel
from specselect.estimators import ESTIMATORS
from specselect.replay.engine import ReplayResult, replay
from specselect.replay.oracle import OracleSelector
from specselect.replay.traces import Traces
from specselect.selection import Selector

__all__ = [
    "DEFAULT_THRESHOLD",
    "NO_ESTIMATOR",
    "SelectorConfig",
    "compare_replay",
    "selector_grid",
    "split_spec",
]

DEFAULT_THRESHOLD = 0.4
"""Confidence threshold for selectors that need one (HF's ``assistant_confidence_threshold``)."""


@dataclass(frozen=True)
class SelectorConfig:
    """One selector configuration of a comparison grid.

    Attributes:
        name: registry name, or ``"oracle"``.
        k: the mean window (budget per request) the configuration is compared at.
        extra: drafted tokens beyond ``k``; None for selectors without that notion (fixed SD).
        budget: absolute budget ``C`` per step; None = the selector's default.
        kwargs: constructor arguments (a cost model is added at build time when the selector
            takes one).
    """

    name: str
    k: int
    extra: int | None
    budget: int | None
    kwargs: dict[str, Any]

    @property
    def label(self) -> str:
        parts = [self.name, f"k={self.k}"]
        if self.extra is not None:
            parts.append(f"extra={self.extra}")
        if self.budget is not None:
            parts.append(f"C={self.budget}")
        return " ".join(parts)

    def build(self, cost_model: CostModel | None = None) -> Selector:
        """A fresh selector (the oracle, or from the registry via ``make_selector``)."""
        if self.name == OracleSelector.name:
            return OracleSelector(**self.kwargs)
        from specselect.registry import make_selector
        from specselect.selectors import SELECTORS

        base, estimator = split_spec(self.name)
        kwargs = dict(self.kwargs)
        if "cost_model" in _parameters(SELECTORS[base]) and cost_model is not None:
            kwargs["cost_model"] = cost_model
        return make_selector(base, **kwargs, **_estimator_kwargs(base, estimator))


NO_ESTIMATOR = "none"
"""Spec suffix for a selector without acceptance estimator or guard (``tetris+none``: the
paper's TETRIS)."""


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"tetris+history"`` -> ``("tetris", "history")``; ``"fixed"`` -> ``("fixed", None)``."""
    base, _, estimator = spec.partition("+")
    return base, estimator or None


def _estimator_kwargs(base: str, estimator: str | None) -> dict[str, Any]:
    """Constructor arguments that select ``estimator`` for selector ``base``."""
    if estimator is None:
        return {}
    from specselect.selectors import SELECTORS

    takes_guard = "guard" in _parameters(SELECTORS[base])
    if estimator == NO_ESTIMATOR:
        return {"estimator": None, **({"guard": False} if takes_guard else {})}
    return {"estimator": estimator}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def _grid_kwargs(
    name: str, params: dict[str, inspect.Parameter], k: int, extra: int, budget: int | None
) -> tuple[dict[str, Any], bool]:
    """Map the grid point ``(k, extra, budget)`` onto a selector's own parameters.

    Returns ``(kwargs, uses_extra)``. The mapping: ``k`` and ``k0`` (a starting window) get
    ``k``; ``extra`` gets ``extra``; ``max_k`` gets ``k + extra`` (dynamic selectors may draft as
    far as TETRIS does); ``budget`` gets ``budget``; a ``threshold`` without a default gets
    :data:`DEFAULT_THRESHOLD`. Any other required parameter is an error.
    """
    offers: dict[str, Any] = {"k": k, "k0": k, "extra": extra, "max_k": k + extra}
    if budget is not None:
        offers["budget"] = budget
    kwargs = {p: v for p, v in offers.items() if p in params}
    if "threshold" in params and params["threshold"].default is inspect.Parameter.empty:
        kwargs["threshold"] = DEFAULT_THRESHOLD
    missing = [
        p
        for p, spec in params.items()
        if p not in kwargs
        and p != "cost_model"
        and spec.default is inspect.Parameter.empty
        and spec.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if missing:
        raise ValueError(
            f"selector {name!r} needs {', '.join(missing)}, which a compare grid "
            "(k, extra, budget) cannot set"
        )
    return kwargs, "extra" in kwargs or "max_k" in kwargs


def selector_grid(
    names: Sequence[str],
    ks: Sequence[int],
    extras: Sequence[int],
    budgets: Sequence[int] = (),
) -> list[SelectorConfig]:
    """Every configuration of ``names`` over the ``k`` / ``extra`` / ``budget`` grids.

    Selectors without an ``extra`` notion (fixed SD) get one configuration per ``k``; only
    selectors taking ``budget`` are repeated over ``budgets`` (in addition to their default
    budget). ``"oracle"`` is accepted besides the registry names, and a name may carry an
    acceptance estimator for selectors that take one: ``"tetris+calibrated"``,
    ``"tetris+history"`` (TETRIS's default), ``"tetris+none"`` (the paper: no estimator, no
    guard).

    Raises:
        ValueError: unknown selector name, empty or negative grids.
    """
    from specselect.registry import available_selectors
    from specselect.selectors import SELECTORS

    known: dict[str, type[Selector]] = {**SELECTORS, OracleSelector.name: OracleSelector}
    estimators = [NO_ESTIMATOR, *sorted(ESTIMATORS)]
    for grid_name, grid, minimum in (("k", ks, 1), ("extra", extras, 0), ("budget", budgets, 0)):
        for value in grid:
            check_int(f"{grid_name} grid value", value, minimum=minimum)
    if not ks or not extras:
        raise ValueError("the k and extra grids must not be empty")
    configs: list[SelectorConfig] = []
    seen: set[tuple[Any, ...]] = set()
    for name in names:
        base, estimator = split_spec(name)
        if base not in known:
            raise ValueError(
                f"unknown selector {name!r}; expected one of "
                f"{', '.join([*available_selectors(), OracleSelector.name])}, optionally with "
                f"+estimator ({', '.join(estimators)}) for selectors that take one"
            )
        params = _parameters(known[base])
        if estimator is not None and ("estimator" not in params or estimator not in estimators):
            raise ValueError(
                f"selector spec {name!r}: {base!r} takes no estimator"
                if "estimator" not in params
                else f"selector spec {name!r}: unknown estimator {estimator!r}; expected one of "
                f"{', '.join(estimators)}"
            )
        for k in ks:
            for extra in extras:
                for budget in [None, *budgets] if "budget" in params else [None]:
                    kwargs, uses_extra = _grid_kwargs(name, params, k, extra, budget)
                    key = (name, k, extra if uses_extra else None, budget)
                    if key not in seen:
                        seen.add(key)
                        configs.append(SelectorConfig(name, k, key[2], budget, kwargs))
    return configs


def compare_replay(
    traces: Traces,
    configs: Sequence[SelectorConfig],
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    progress: bool = False,
) -> list[tuple[SelectorConfig, ReplayResult]]:
    """Replay every configuration over the same traces (each with a fresh selector)."""
    cost_model = CostModel() if cost_model is None else cost_model
    results = []
    iterator: Any = configs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(configs, desc="replaying", unit="config", leave=False)
    for config in iterator:
        selector = config.build(cost_model)
        results.append((config, replay(traces, selector, slots, cost_model, context)))
    return results
