"""Build selectors by name (used by the CLI and by configuration files)."""

from __future__ import annotations

import inspect
from typing import Any

from specselect.selection import Selector
from specselect.selectors import SELECTORS


def available_selectors() -> list[str]:
    """Names accepted by :func:`make_selector`."""
    return sorted(SELECTORS)


def make_selector(name: str, **kwargs: Any) -> Selector:
    """Create a selector by registry name, e.g. ``make_selector("tetris", k=3, extra=2)``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
        TypeError: keyword arguments the selector does not take.
    """
    try:
        cls = SELECTORS[name]
    except KeyError:
        raise ValueError(
            f"unknown selector {name!r}; expected one of {', '.join(available_selectors())}"
        ) from None
    params = inspect.signature(cls).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(
            f"selector {name!r} does not take {', '.join(unknown)}; "
            f"it takes {', '.join(params) or 'no arguments'}"
        )
    return cls(**kwargs)
