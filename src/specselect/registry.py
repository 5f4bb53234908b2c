"""Build selectors by name (used by the CLI and by configuration files), and parse selector specs.

A *selector spec* names a selector and, optionally, its acceptance estimator:
``"tetris"``, ``"tetris+calibrated"``, ``"tetris+none"`` (no estimator: the paper's TETRIS).
:func:`parse_spec` is the one parser of that form; what the estimator part means for a given
selector is its :meth:`~specselect.selection.Selector.spec_kwargs`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from specselect.estimators import ESTIMATORS, NO_ESTIMATOR
from specselect.selection import Selector, constructor_parameters
from specselect.selectors import SELECTORS


def available_selectors() -> list[str]:
    """Names accepted by :func:`make_selector`."""
    return sorted(SELECTORS)


def make_selector(name: str, **kwargs: Any) -> Selector:
    """Create a selector by registry name or selector spec, e.g.
    ``make_selector("tetris", k=3, extra=2)``, ``make_selector("tetris+none", k=3)``.

    A spec's estimator part means what it means in ``specselect compare``
    (:meth:`~specselect.selection.Selector.spec_kwargs`): ``"tetris+none"`` is
    ``make_selector("tetris", estimator=None, guard=False)``, the paper's TETRIS.

    Raises:
        ValueError: unknown name (the message lists the known ones), or a bad spec.
        TypeError: keyword arguments the selector does not take, a required one missing, or
            one the spec already sets.
    """
    base, estimator = parse_spec(name)
    cls = selector_class(base)
    params = constructor_parameters(cls)
    keywords = list(params)
    unknown = sorted(set(kwargs) - set(keywords))
    if unknown:
        raise TypeError(
            f"selector {name!r} does not take {', '.join(unknown)}; "
            f"it takes {', '.join(keywords) or 'no arguments'}"
        )
    try:
        spec = cls.spec_kwargs(estimator, None)
    except ValueError as exc:  # an estimator for a selector that takes none
        raise ValueError(f"selector spec {name!r}: {exc}") from None
    clash = sorted(set(spec) & set(kwargs))
    if clash:
        raise TypeError(
            f"selector spec {name!r} already sets {', '.join(clash)}; to choose, use the "
            f"plain name: make_selector({base!r}, {', '.join(f'{p}=...' for p in clash)}, ...)"
        )
    required = [p for p, param in params.items() if param.default is param.empty]
    to_pass = [p for p in required if p not in spec]  # the spec's are set; passing them clashes
    missing = [p for p in to_pass if p not in kwargs]
    if missing:
        raise TypeError(
            f"selector {name!r} needs {', '.join(missing)}, e.g. "
            f"make_selector({name!r}, {', '.join(f'{p}=...' for p in to_pass)})"
        )
    return cls(**spec, **kwargs)


class SelectorSpec(NamedTuple):
    """A parsed selector spec: ``"tetris+calibrated"`` is ``SelectorSpec("tetris", "calibrated")``.

    Attributes:
        name: the selector's name (not checked: comparisons also know the replay-only
            ``"oracle"``).
        estimator: the part after ``+``, a registry name of
            :data:`~specselect.estimators.ESTIMATORS` or
            :data:`~specselect.estimators.NO_ESTIMATOR`; ``None`` without ``+`` (the selector's
            default).
    """

    name: str
    estimator: str | None


def selector_class(name: str) -> type[Selector]:
    """The selector registered as ``name``, or a ``ValueError`` listing the names."""
    try:
        return SELECTORS[name]
    except KeyError:
        raise ValueError(
            f"unknown selector {name!r}; expected one of {', '.join(available_selectors())}, "
            f"optionally with +estimator ({', '.join(spec_estimators())})"
        ) from None


def spec_estimators() -> list[str]:
    """What may follow ``+`` in a selector spec."""
    return [NO_ESTIMATOR, *sorted(ESTIMATORS)]


def parse_spec(spec: str) -> SelectorSpec:
    """Parse ``NAME`` or ``NAME+ESTIMATOR``: ``"fixed"`` -> ``SelectorSpec("fixed", None)``.

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: an empty name or estimator, or an estimator that is not one of
            :func:`spec_estimators`.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a selector spec must be a str, got {type(spec).__name__}")
    name, plus, estimator = spec.partition("+")
    if plus and not (name and estimator):
        raise ValueError(
            f"{spec!r} needs a selector name and an estimator around '+' (e.g. tetris+calibrated)"
        )
    if not name:
        raise ValueError("a selector spec needs a selector name, got ''")
    if not plus:
        return SelectorSpec(name, None)
    if estimator not in ESTIMATORS and estimator != NO_ESTIMATOR:
        raise ValueError(
            f"selector spec {spec!r}: unknown estimator {estimator!r}; expected one of "
            f"{', '.join(spec_estimators())}"
        )
    return SelectorSpec(name, estimator)
