"""Selector specs and the registry: the one parser of ``NAME+ESTIMATOR``, and the class-level
hooks through which comparison grids build every registered selector."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from specselect.cost import default_cost_model
from specselect.estimators import ESTIMATORS, NO_ESTIMATOR
from specselect.metrics import Totals
from specselect.registry import SelectorSpec, make_selector, parse_spec, spec_estimators
from specselect.replay import ResultRow, SelectorConfig, selector_grid
from specselect.selection import grid_depends_on_extra
from specselect.selectors import SELECTORS, FixedWindowSelector


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fixed", SelectorSpec("fixed", None)),
        ("tetris+none", SelectorSpec("tetris", NO_ESTIMATOR)),
        ("tetris+calibrated", SelectorSpec("tetris", "calibrated")),
        ("oracle", SelectorSpec("oracle", None)),  # names are the caller's to check
    ],
)
def test_parse_spec(spec: str, expected: SelectorSpec) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("", ValueError, "needs a selector name"),
        ("tetris+", ValueError, "'tetris\\+' needs a selector name and an estimator around"),
        ("+history", ValueError, "around '\\+'"),
        ("tetris+magic", ValueError, "unknown estimator 'magic'; expected one of none, "),
        ("tetris+history+draft", ValueError, "unknown estimator 'history\\+draft'"),
        (None, TypeError, "must be a str"),
    ],
)
def test_parse_spec_rejects(spec: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_spec(spec)  # type: ignore[arg-type]


def test_spec_estimators_are_none_and_the_registry() -> None:
    assert spec_estimators() == [NO_ESTIMATOR, *sorted(ESTIMATORS)]


GRID_POINTS = list(itertools.product((1, 3), (0, 2), (None, 5)))


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_grid_kwargs_build_the_selector(name: str) -> None:
    """At every grid point a selector's hook names its own constructor arguments (or declines a
    fixed budget it has no parameter for), and ``grid_extra`` says whether they depend on
    ``extra``: what a grid labels and repeats."""
    cls = SELECTORS[name]
    for k, extra, budget in GRID_POINTS:
        kwargs = cls.grid_kwargs(k, extra, budget)
        if kwargs is None:
            assert budget is not None, f"{name} has no configuration at k={k}, extra={extra}"
            continue
        selector = cls(**kwargs, **cls.spec_kwargs(None, default_cost_model()))
        assert selector.draft_length(4) <= k + extra
    depends_on_extra = cls.grid_kwargs(2, 0, None) != cls.grid_kwargs(2, 1, None)
    assert depends_on_extra == grid_depends_on_extra(cls)


class Windowed(FixedWindowSelector):
    """A selector of one's own with the grid's parameters and one of its own."""

    name = "windowed"

    def __init__(self, k: int, extra: int = 0, p: float = 0.5, budget: int | None = None):
        super().__init__(k)
        self.extra, self.p, self.budget = extra, p, budget


class Unset(FixedWindowSelector):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__(1)
        self.p = p


class Required(FixedWindowSelector):
    def __init__(self, max_k: int, p: float) -> None:
        super().__init__(max_k)
        self.p = p


class NeedsCost(FixedWindowSelector):
    """Requires a cost model, which its spec_kwargs supplies (a grid must not ask for it)."""

    def __init__(self, k: int, cost_model: object) -> None:
        super().__init__(k)
        self.cost_model = cost_model

    @classmethod
    def spec_kwargs(cls, estimator: str | None, cost_model: object) -> dict[str, Any]:
        return {"cost_model": cost_model}


class OwnMapping(FixedWindowSelector):
    """Takes extra, but its own grid_kwargs never sets it: one configuration per k."""

    def __init__(self, k: int, extra: int = 2) -> None:
        super().__init__(k)
        self.extra = extra

    @classmethod
    def grid_kwargs(cls, k: int, extra: int, budget: int | None) -> dict[str, Any] | None:
        return {"k": k} if budget is None else None


class SaysNoExtra(Windowed):
    grid_extra = False  # its configurations keep their own extra


def test_the_default_grid_kwargs_set_parameters_by_name() -> None:
    """A selector of one's own that takes k and extra got only k at every extra (its rows
    labelled with an extra it never saw)."""
    assert Windowed.grid_kwargs(3, 2, None) == {"k": 3, "extra": 2}
    assert Windowed.grid_kwargs(3, 2, 7) == {"k": 3, "extra": 2, "budget": 7}
    assert grid_depends_on_extra(Windowed)
    assert FixedWindowSelector.grid_kwargs(3, 2, 7) is None  # no budget parameter
    assert not grid_depends_on_extra(FixedWindowSelector)
    with pytest.raises(TypeError, match="its constructor takes none of them: override"):
        Unset.grid_kwargs(3, 2, None)
    with pytest.raises(TypeError, match="its constructor requires p: override"):
        Required.grid_kwargs(3, 2, None)
    assert NeedsCost.grid_kwargs(2, 1, None) == {"k": 2}
    assert not grid_depends_on_extra(OwnMapping)  # its grid_kwargs, not its constructor
    assert SaysNoExtra.grid_kwargs(3, 2, None) == {"k": 3}
    assert not grid_depends_on_extra(SaysNoExtra)


TAKE_AN_ESTIMATOR = {"tetris", "threshold"}


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_spec_kwargs_take_estimators_where_the_selector_has_one(name: str) -> None:
    cls = SELECTORS[name]
    kwargs = cls.grid_kwargs(2, 1, None)
    assert kwargs is not None
    for estimator in spec_estimators():
        if name not in TAKE_AN_ESTIMATOR:
            with pytest.raises(ValueError, match=f"'{name}' takes no estimator"):
                cls.spec_kwargs(estimator, None)
            continue
        selector = cls(**kwargs, **cls.spec_kwargs(estimator, None))
        if estimator == NO_ESTIMATOR:
            assert selector.estimator is None
            assert getattr(selector, "guard", None) is None  # tetris+none: the paper, no guard
        else:
            assert selector.estimator is not None and selector.estimator.name == estimator


@pytest.mark.parametrize(
    "spec", [f"{name}+{e}" for name in sorted(TAKE_AN_ESTIMATOR) for e in spec_estimators()]
)
def test_make_selector_takes_the_specs_compare_takes(spec: str) -> None:
    """``make_selector("tetris+none", ...)`` builds what ``specselect compare`` builds for
    that spec (one parser, one meaning of the estimator part)."""
    kwargs = SELECTORS[parse_spec(spec).name].grid_kwargs(2, 1, None)
    assert kwargs is not None
    compared = SelectorConfig(spec, 2, 1, None, kwargs).build()
    assert repr(make_selector(spec, **kwargs)) == repr(compared)


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "match"),
    [
        ("fixed", {}, TypeError, r"selector 'fixed' needs k, e\.g\. make_selector\('fixed', k="),
        ("threshold", {"max_k": 3}, TypeError, "selector 'threshold' needs threshold, e.g."),
        ("tetris+none", {}, TypeError, r"selector 'tetris\+none' needs k"),
        ("tetris+none", {"k": 2, "guard": True}, TypeError, "already sets guard; to choose"),
        ("fixed+history", {"k": 2}, ValueError, r"'fixed\+history': 'fixed' takes no estimator"),
        ("nope", {}, ValueError, "unknown selector 'nope'; expected one of dsd, "),
        ("fixed", {"window": 2}, TypeError, "'fixed' does not take window; it takes k"),
    ],
)
def test_make_selector_rejects(
    name: str, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make_selector(name, **kwargs)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_repr_is_the_constructor_arguments_in_short(name: str) -> None:
    """No internal state (``capture_token``), no cost model samples, no object addresses."""
    cls = SELECTORS[name]
    kwargs = cls.grid_kwargs(2, 1, None)
    assert kwargs is not None
    text = repr(cls(**kwargs, **cls.spec_kwargs(None, default_cost_model())))
    assert text.startswith(f"{cls.__name__}(") and len(text) < 200, text
    assert "capture_token" not in text and " at 0x" not in text, text
    assert all(f"{key}={value!r}" in text for key, value in kwargs.items()), text


def test_the_papers_tetris_repr_builds_it_again() -> None:
    """It shows ``guard=None``, which the constructor refused (it took True or False)."""
    paper = make_selector("tetris+none", k=3, extra=2)
    again = eval(repr(paper), {"TetrisSelector": SELECTORS["tetris"]})
    assert repr(again) == repr(paper) and again.guard is None and again.estimator is None


class _NeedsEstimator(SELECTORS["threshold"]):  # type: ignore[misc,valid-type]
    """A selector whose spec sets one of its required arguments (none shipped does)."""

    name = "needy"

    def __init__(self, max_k: int, threshold: float, estimator: object) -> None:
        super().__init__(max_k, threshold, estimator=estimator)  # type: ignore[arg-type]


def test_make_selector_hint_leaves_out_what_the_spec_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The "e.g." call of a missing-argument error works when followed: it does not name the
    spec's own arguments, which would be refused as already set."""
    monkeypatch.setitem(SELECTORS, "needy", _NeedsEstimator)
    with pytest.raises(TypeError) as error:
        make_selector("needy+none", max_k=3)
    hint = "make_selector('needy+none', max_k=..., threshold=...)"
    assert str(error.value) == f"selector 'needy+none' needs threshold, e.g. {hint}"
    assert make_selector("needy+none", max_k=3, threshold=0.5).estimator is None


class _Redefined(SELECTORS["fixed"]):  # type: ignore[misc,valid-type]
    """Stands for a class defined twice (a re-run notebook cell): same module and name."""

    name = "mine"


class _Tetris(SELECTORS["fixed"]):  # type: ignore[misc,valid-type]
    """Another class under a shipped selector's name."""

    name = "tetris"


class _Unnamed(SELECTORS["fixed"]):  # type: ignore[misc,valid-type]
    """Forgot its own name: it would share its parent's capture keys."""


@pytest.mark.parametrize(
    ("name", "cls", "error", "match"),
    [
        ("a+b", SELECTORS["fixed"], ValueError, "without whitespace, '\\+' or ','"),
        ("a,b", SELECTORS["fixed"], ValueError, "without whitespace"),
        ("my selector", SELECTORS["fixed"], ValueError, "without whitespace"),
        ("", SELECTORS["fixed"], ValueError, "must be non-empty"),
        (3, SELECTORS["fixed"], TypeError, "SELECTORS: a name must be a str, got int"),
        ("oracle", SELECTORS["fixed"], ValueError, "'oracle' cannot be registered; it means"),
        ("tetris", _Tetris, ValueError, "already registered as specselect.selectors"),
        ("mine", SELECTORS["fixed"](2), TypeError, "the class, not an instance"),
        ("mine", int, TypeError, "must be a subclass of Selector"),
        ("mine", SELECTORS["fixed"].__mro__[1], TypeError, "is abstract; it must implement"),
        ("-mine", _Redefined, ValueError, "not start with '-'"),
        ("mine", _Unnamed, ValueError, r"_Unnamed.name is 'fixed', inherited; set name = 'mine'"),
        ("fixed", _Redefined, ValueError, r"_Redefined.name is 'mine'; set name = 'fixed'"),
    ],
)
def test_registering_what_a_lookup_cannot_use_is_refused(
    name: object, cls: object, error: type[Exception], match: str
) -> None:
    """Names that specs and ``--selectors`` would split, a name meaning something else, a class
    of the wrong kind, or a shipped selector silently replaced: refused at the assignment, and
    the registry is unchanged."""
    before = dict(SELECTORS)
    with pytest.raises(error, match=match):
        SELECTORS[name] = cls  # type: ignore[index]
    assert dict(SELECTORS) == before


def test_registering_again_replaces_only_the_same_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same class again, or a class of the same module and name (defined again), replaces
    the entry; another class needs the entry deleted first. ``none`` is reserved for
    estimators."""
    other = type("Other", (SELECTORS["fixed"],), {"name": "mine", "__module__": __name__})
    monkeypatch.setitem(SELECTORS, "mine", other)
    SELECTORS["mine"] = other
    with pytest.raises(ValueError, match=r"del SELECTORS\['mine'\]"):
        SELECTORS["mine"] = _Redefined
    del SELECTORS["mine"]
    SELECTORS["mine"] = _Redefined
    redefined = type("_Redefined", (SELECTORS["fixed"],), {"__module__": __name__, "name": "mine"})
    redefined.__qualname__ = _Redefined.__qualname__
    SELECTORS["mine"] = redefined
    assert SELECTORS["mine"] is redefined
    assert make_selector("mine", k=2).draft_length(1) == 2
    with pytest.raises(ValueError, match="'none' cannot be registered; it means no estimator"):
        ESTIMATORS[NO_ESTIMATOR] = ESTIMATORS["draft"]


def test_the_registry_is_a_mapping_that_refuses_all_of_a_bad_update() -> None:
    """``update`` registers all its entries or none; ``copy()``, ``copy.copy`` and ``|`` give
    plain dicts, so registering in them changes nothing here."""
    import copy

    before = dict(SELECTORS)
    with pytest.raises(ValueError, match="without whitespace"):
        SELECTORS.update({"mine": _Redefined, "bad name": _Redefined})
    assert dict(SELECTORS) == before
    for plain in (SELECTORS.copy(), copy.copy(SELECTORS), SELECTORS | {}):
        assert type(plain) is dict and plain == before
        plain["mine"] = _Redefined
    assert "mine" not in SELECTORS


def test_or_assignment_registers_checked() -> None:
    """``|=`` registers in the registry itself, checked (it rebound the name to a plain dict,
    registering nothing and checking nothing)."""
    registry = SELECTORS
    with pytest.raises(ValueError, match="without whitespace"):
        registry |= {"bad name": _Redefined}
    registry |= {"mine": _Redefined}
    assert registry is SELECTORS and SELECTORS["mine"] is _Redefined


def test_selectors_wrapping_a_constructor_take_its_keywords() -> None:
    """A selector whose constructor passes ``**kwargs`` to its parent's takes the parent's
    keywords in make_selector and shows them in its repr (it was refused every keyword)."""

    class Wrapped(SELECTORS["tetris"]):  # type: ignore[misc,valid-type]
        name = "wrapped"

        def __init__(self, *args: Any, note: str = "", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.note = note

    SELECTORS["wrapped"] = Wrapped
    selector = make_selector("wrapped", k=3, note="mine")
    assert repr(selector).startswith("Wrapped(note='mine', k=3, extra=2,")
    with pytest.raises(TypeError, match=r"does not take nope; it takes note, k, extra"):
        make_selector("wrapped", k=3, nope=1)
    # Specs differ by the parent's arguments too (they all counted as one configuration).
    specs = ["wrapped", "wrapped+none", "wrapped+calibrated"]
    assert [config.name for config in selector_grid(specs, [2], [1])] == specs


def test_results_record_every_constructor_argument() -> None:
    """A parameter outside the grid (its default ``p``) was in no results row."""
    SELECTORS["windowed"] = Windowed
    try:
        (config,) = selector_grid(["windowed"], [3], [2])
        row = ResultRow(config, Totals())
        assert row.params == {"k": 3, "extra": 2, "p": 0.5, "budget": None}
        (tetris,) = selector_grid(["tetris+none"], [3], [2])
        assert ResultRow(tetris, Totals()).params == {
            "k": 3,
            "extra": 2,
            "budget": None,
            "estimator": None,
            "guard": False,
        }
    finally:
        del SELECTORS["windowed"]
