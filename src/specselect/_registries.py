"""The checked name -> class mapping behind ``SELECTORS`` and ``ESTIMATORS``.

A registry is written by users (``SELECTORS["mine"] = Mine``) and read by parsers that split on
``,`` and ``+`` (selector specs, ``--selectors``): a name with those characters, a class of the
wrong kind or a second class under a taken name would fail far from the line that caused it,
or silently replace a shipped selector. Each is refused at the assignment instead.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: A name survives selector specs and comma-separated lists (no ``+``, ``,`` or whitespace)
#: and the command line (no leading ``-``, which argparse reads as an option).
_NAME = re.compile(r"[^\s+,\-][^\s+,]*")


class RegistrationError(Exception):
    """A registration the registry refuses. Raised as :class:`RefusedName` (a ``ValueError``)
    or :class:`RefusedClass` (a ``TypeError``), so that ``except ValueError`` still works and a
    caller importing a user's module (``compare --import``) can tell the registry's refusal
    from an error of the module's own code."""


class RefusedName(RegistrationError, ValueError):
    """A name, or a name taken by another class."""


class RefusedClass(RegistrationError, TypeError):
    """A name that is not a str, or a class that is not a concrete subclass of the base."""


class Registry(MutableMapping[str, type[T]], Generic[T]):
    """Classes by name, refusing what would break a later lookup.

    ``registry[name] = cls`` requires a name without whitespace, ``+`` or ``,`` (nor a
    leading ``-``) that is not reserved, and a concrete subclass of the registry's base class
    whose class attribute ``name`` is that name (capture keys and reports use it: a subclass
    that inherits its parent's would replay the parent's CUDA graphs). A name already taken by
    another class is refused (``del registry[name]`` first to replace it), except by a class
    of the same module and qualified name: the same class defined again, as re-running a
    notebook cell does. ``update`` checks every entry before it registers any.

    A mutable mapping, not a ``dict``: ``dict(registry)`` or :meth:`copy` gives one.
    """

    def __init__(
        self,
        label: str,
        kind: str,
        base: type,  # abstract: only subclasses are registered
        entries: Mapping[str, type[T]],
        reserved: Mapping[str, str],
    ) -> None:
        """``label`` is how users reach it ("SELECTORS") and ``kind`` what it holds
        ("selector"), for errors; ``reserved`` maps names that mean something else where the
        registry's names are read to what they mean."""
        self._label = label
        self._kind = kind
        self._base = base
        self._reserved = dict(reserved)
        self._entries: dict[str, type[T]] = {}
        self.update(entries)

    def __getitem__(self, name: str) -> type[T]:
        return self._entries[name]

    def __setitem__(self, name: str, cls: type[T]) -> None:
        self.update({name: cls})

    def update(self, *args: Any, **kwargs: type[T]) -> None:  # type: ignore[override]
        """Register every entry, or none: all are checked first."""
        entries = dict(*args, **kwargs)
        for name, cls in entries.items():
            self._check(name, cls)
        self._entries.update(entries)

    def copy(self) -> dict[str, type[T]]:
        """The entries as a plain ``dict`` (registering in it registers nothing here)."""
        return dict(self._entries)

    def __copy__(self) -> dict[str, type[T]]:
        return self.copy()

    def __or__(self, other: Mapping[str, type[T]]) -> dict[str, type[T]]:
        return {**self._entries, **other}

    def __ior__(self, other: Mapping[str, type[T]]) -> Registry[T]:
        """``registry |= {...}`` registers, checked, as :meth:`update` does (without it Python
        would rebind the name to the plain ``dict`` of ``|`` and register nothing)."""
        self.update(other)
        return self

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"{self._label}({', '.join(self._entries)})"

    def _check(self, name: Any, cls: Any) -> None:
        """Refuse what a later lookup could not use (see the class docstring)."""
        self._check_name(name)
        self._check_class(name, cls)
        held = self._entries.get(name)
        if held is not None and _qualified(held) != _qualified(cls):
            raise RefusedName(
                f"{self._kind} {name!r} is already registered as {_qualified(held)}; to replace "
                f"it with {_qualified(cls)}, delete the entry first (del {self._label}[{name!r}])"
            )

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str):
            raise RefusedClass(f"{self._label}: a name must be a str, got {type(name).__name__}")
        if _NAME.fullmatch(name) is None:
            raise RefusedName(
                f"{self._label}: a name must be non-empty, without whitespace, '+' or ',' "
                "(selector specs and comma-separated lists split on them) and not start with "
                f"'-' (an option on the command line), got {name!r}"
            )
        if name in self._reserved:
            raise RefusedName(
                f"{self._label}: {name!r} cannot be registered; it means {self._reserved[name]}"
            )

    def _check_class(self, name: str, cls: object) -> None:
        base = self._base.__name__
        if not (isinstance(cls, type) and issubclass(cls, self._base)):
            raise RefusedClass(
                f"{self._kind} {name!r} must be a subclass of {base} (the class, not an "
                f"instance), got {cls!r}"
            )
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            raise RefusedClass(
                f"{self._kind} {name!r}: {cls.__name__} is abstract; it must implement {missing}"
            )
        own = getattr(cls, "name", None)
        if own != name:
            inherited = "" if "name" in vars(cls) else ", inherited"
            raise RefusedName(
                f"{self._label}[{name!r}]: {cls.__name__}.name is {own!r}{inherited}; set "
                f"name = {name!r} in the class (capture keys and reports use it)"
            )


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
