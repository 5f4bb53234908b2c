"""Selector grids and comparisons: the configurations ``specselect compare`` replays.

:func:`selector_grid` expands selector specs (``"tetris+history"``, ``"fixed"``, ``"oracle"``)
over ``k`` / ``extra`` / ``budget`` grids into :class:`SelectorConfig` s, and
:func:`compare_replay` replays each configuration over the same traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specselect._checks import check_int
from specselect.cost import CostModel, default_cost_model
from specselect.estimators import NO_ESTIMATOR
from specselect.registry import available_selectors, parse_spec, spec_estimators
from specselect.replay.engine import ReplayResult, replay
from specselect.replay.oracle import OracleSelector
from specselect.replay.traces import Traces
from specselect.selection import Selector, constructor_parameters, grid_depends_on_extra
from specselect.selectors import SELECTORS
from specselect.selectors.goodput import GOODPUT
from specselect.selectors.threshold import DEFAULT_THRESHOLD

__all__ = [
    "DEFAULT_THRESHOLD",
    "GOODPUT",
    "NO_ESTIMATOR",
    "SelectorConfig",
    "compare_replay",
    "selector_grid",
]


@dataclass(frozen=True)
class SelectorConfig:
    """One selector configuration of a comparison grid.

    Attributes:
        name: selector spec: a registry name or ``"oracle"``, optionally with ``+estimator``.
        k: the mean window (budget per request) the configuration is compared at.
        extra: drafted tokens beyond ``k``; None for selectors without that notion (fixed SD).
        budget: absolute budget ``C`` per step, :data:`GOODPUT` for the goodput budget
            (``C`` chosen every step for modelled goodput); None = the selector's default.
        kwargs: constructor arguments at this grid point (the selector's
            :meth:`~specselect.selection.Selector.grid_kwargs`); the spec's estimator and the
            comparison's cost model are added at build time
            (:meth:`~specselect.selection.Selector.spec_kwargs`).
    """

    name: str
    k: int
    extra: int | None
    budget: int | str | None
    kwargs: dict[str, Any]

    @property
    def label(self) -> str:
        parts = [self.name, f"k={self.k}"]
        if self.extra is not None:
            parts.append(f"extra={self.extra}")
        if self.budget is not None:
            parts.append(f"C={self.budget}")
        return " ".join(parts)

    @property
    def replay_only(self) -> bool:
        """Whether its selector needs what only replay knows (the oracle): a live comparison
        replays it instead of running it."""
        return _selector_class(parse_spec(self.name)[0]).replay_only

    def build(self, cost_model: CostModel | None = None) -> Selector:
        """A fresh selector (the oracle, or a registered selector)."""
        base, estimator = parse_spec(self.name)
        cls = _selector_class(base)
        return cls(**self.kwargs, **cls.spec_kwargs(estimator, cost_model))

    @property
    def arguments(self) -> dict[str, Any]:
        """Every argument its constructor gets, defaults included, in its order, but the
        ``cost_model`` a comparison adds at build time (its report names that): what results
        record, so that a parameter outside the grid (a selector's own ``p``) is not lost."""
        base, estimator = parse_spec(self.name)
        cls = _selector_class(base)
        given = {**_spec_arguments(cls, cls.spec_kwargs(estimator, None)), **self.kwargs}
        return {
            name: given[name]
            for name in constructor_parameters(cls)
            if name in given and name != "cost_model"
        }


def _selector_class(name: str) -> type[Selector]:
    """The class a comparison knows by ``name``: a registered selector or the oracle."""
    if name == OracleSelector.name:
        return OracleSelector
    if name in SELECTORS:
        return SELECTORS[name]
    raise ValueError(
        f"unknown selector {name!r}; expected one of "
        f"{', '.join([*available_selectors(), OracleSelector.name])}, optionally with "
        f"+estimator ({', '.join(spec_estimators())}) for selectors that take one"
    )


def selector_grid(
    names: Sequence[str],
    ks: Sequence[int],
    extras: Sequence[int],
    budgets: Sequence[int | str] = (),
) -> list[SelectorConfig]:
    """Every configuration of ``names`` over the ``k`` / ``extra`` / ``budget`` grids.

    Each selector maps a grid point onto its own parameters
    (:meth:`~specselect.selection.Selector.grid_kwargs`). Selectors whose configuration does not
    depend on ``extra`` (fixed SD; :func:`~specselect.selection.grid_depends_on_extra`) get one
    configuration per ``k``; only selectors that take a fixed budget are repeated over
    ``budgets`` (in addition to their default budget). A budget may also be :data:`GOODPUT`:
    the selectors that have a goodput budget
    (:meth:`~specselect.selection.Selector.goodput_grid_kwargs`: TETRIS) then add a
    configuration with it at every ``k`` and ``extra``, planned with the comparison's cost
    model. ``"oracle"`` is accepted besides the registry names, and a name may carry
    an acceptance estimator for selectors that take one: ``"tetris+calibrated"``,
    ``"tetris+history"`` (the learned request-history estimate, no choice; the guard stays),
    ``"tetris+none"`` (the paper: no estimator, no guard); see
    :func:`~specselect.registry.parse_spec`. Specs that
    configure the same selector (``"tetris"`` and ``"tetris+choice"``, its default estimator)
    give one set of configurations, under the first spelling, as repeated grid values give one.

    Raises:
        ValueError: unknown selector name or estimator, an estimator for a selector that takes
            none, empty or negative grids, a :data:`GOODPUT` budget that no selector has.
        TypeError: a selector whose constructor the default
            :meth:`~specselect.selection.Selector.grid_kwargs` cannot configure by name.
    """
    for grid_name, grid, minimum in (("k", ks, 1), ("extra", extras, 0)):
        for value in grid:
            check_int(f"{grid_name} grid value", value, minimum=minimum)
    for budget_value in budgets:
        if isinstance(budget_value, str) and budget_value != GOODPUT:
            raise ValueError(
                f"budget grid values must be ints or {GOODPUT!r}, got {budget_value!r}"
            )
        if budget_value != GOODPUT:
            check_int("budget grid value", budget_value)
    if not ks or not extras:
        raise ValueError("the k and extra grids must not be empty")
    configs: list[SelectorConfig] = []
    seen: set[tuple[Any, ...]] = set()
    resolved: list[tuple[type[Selector], dict[str, Any]]] = []  # of the specs kept
    for name in names:
        base, estimator = parse_spec(name)
        cls = _selector_class(base)
        try:
            spec = (cls, _spec_arguments(cls, cls.spec_kwargs(estimator, None)))
        except ValueError as exc:
            raise ValueError(f"selector spec {name!r}: {exc}") from None
        if spec in resolved:  # another spelling of a spec before it, e.g. tetris+choice
            continue
        resolved.append(spec)
        grid_budgets: list[int | str | None] = [None, *budgets]
        for k in ks:
            for extra in extras:
                for budget in grid_budgets:
                    kwargs = (
                        cls.goodput_grid_kwargs(k, extra)
                        if isinstance(budget, str)  # GOODPUT, checked above
                        else cls.grid_kwargs(k, extra, budget)
                    )
                    key = (name, k, extra if grid_depends_on_extra(cls) else None, budget)
                    if kwargs is not None and key not in seen:
                        seen.add(key)
                        configs.append(SelectorConfig(name, k, key[2], budget, kwargs))
    if GOODPUT in budgets and all(config.budget != GOODPUT for config in configs):
        raise ValueError(
            f"budget {GOODPUT!r} adds the goodput budget to the selectors that have one "
            f"(TETRIS), and none of {', '.join(map(repr, names))} has one"
        )
    return configs


def _spec_arguments(cls: type[Selector], spec_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments with defaults of ``cls``'s constructor as a spec sets them (the defaults
    where it sets none): two specs configure the same selector iff these are equal."""
    return {
        name: spec_kwargs.get(name, param.default)
        for name, param in constructor_parameters(cls).items()
        if param.default is not param.empty
    }


def compare_replay(
    traces: Traces,
    configs: Sequence[SelectorConfig],
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    progress: bool = False,
    refill: bool = True,
) -> list[tuple[SelectorConfig, ReplayResult]]:
    """Replay every configuration over the same traces (each with a fresh selector).

    ``cost_model`` prices the steps and is given to selectors that take one (DSD); None:
    :func:`~specselect.cost.default_cost_model`. ``refill`` as in
    :func:`~specselect.replay.replay`: ``False`` replays static batches, as
    :func:`~specselect.replay.compare_live` runs them by default.
    """
    cost_model = default_cost_model() if cost_model is None else cost_model
    results = []
    iterator: Any = configs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(configs, desc="replaying", unit="config", leave=False)
    for config in iterator:
        selector = config.build(cost_model)
        result = replay(traces, selector, slots, cost_model, context, refill=refill)
        results.append((config, result))
    return results
