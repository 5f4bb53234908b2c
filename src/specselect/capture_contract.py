"""The check that a selector's recorded work replays right: :func:`recording_checked`.

A loop that gets a :attr:`~specselect.selection.Selector.capture_key` records ``select`` and
``update`` once (a CUDA graph, or a trace) and replays the recording every later step: tensor
operations only, on the tensors the recording saw, with none of the Python around them. Three
mistakes in a selector then give wrong statistics while greedy output stays identical, so
nothing else would show them:

- state *rebound* while recorded (``self.total = self.total + x``): the replay reads the old
  tensor and writes a new one the selector never looks at again, so the state never advances;
- a host value changed while recorded (``self.steps += 1``, ``self.seen.append(x)``): a
  replay runs no Python;
- tensor state without the selector's ``capture_token`` in its key: another selector with an
  equal key replays graphs recorded on this one's tensors, and updates them.

Each is visible while the recording runs, once per captured key, so the check costs nothing
per step. What it cannot see happens *outside* the recording: a host value changed in
``observe`` and read inside without being part of the key, or a tensor rebound by ``reset``
(graphs recorded before keep the old one). A per-step scratch tensor kept past ``update``
looks like rebound state: clear it (``None``) before ``update`` returns.

The walk follows the selector's attributes into objects, containers (up to
:data:`MAX_WALKED` entries each; longer ones by their length only) and ``__slots__``, to a
depth of 6, and leaves out each selector's per-call attributes (:data:`PER_CALL`), so that a
selector built on another one is checked as a whole.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import math
import types
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specselect.selection import CaptureToken, Selector

#: The selector's attributes that ``select`` and ``update`` set every call by design (the last
#: call's inputs, answer and outcomes): not state a selection depends on.
PER_CALL = frozenset({"_last", "_answered", "_step_outcomes", "_device"})

#: How deep the walk follows attributes (selector -> estimator -> its parts -> their state).
_DEPTH = 6

#: Containers longer than this are compared by length only (a walk must stay cheap).
MAX_WALKED = 1000

_HOST = (bool, int, float, str, bytes, type(None), torch.device, torch.dtype, enum.Enum, np.generic)


@contextlib.contextmanager
def recording_checked(selector: Selector) -> Iterator[None]:
    """Run the recording of ``selector``'s ``select`` and ``update`` inside this block; on
    leaving it, raise if the recording broke what replaying it needs (see the module doc).

    Raises:
        TypeError: naming the selector's class, the attribute, and what to do instead.
    """
    before = _state(selector)
    yield
    after = _state(selector)
    name = type(selector).__name__
    for path, held in before.items():
        _check_kept(f"{name}.{path}", held, after.get(path, _GONE))
    added = [
        path
        for path, value in after.items()
        if isinstance(value, Tensor) and not isinstance(before.get(path), Tensor)
    ]
    if added:
        raise TypeError(
            f"{name}.{added[0]} was created while select/update were being recorded for "
            "replay: allocate state in the first call for a shape (a loop records a shape only "
            "after one call), or return no capture_key"
        )
    tensors = [path for path, value in after.items() if isinstance(value, Tensor)]
    if tensors and not _holds(selector.capture_key, _tokens(selector)):
        raise TypeError(
            f"{name} keeps tensors ({name}.{tensors[0]}) but its capture_key "
            f"{selector.capture_key!r} lacks its capture_token: another {name} with an equal "
            "key would replay graphs recorded on this one's tensors; include "
            "self.capture_token in the key (a tuple may hold it)"
        )


def _check_kept(where: str, held: Any, now: Any) -> None:
    """Refuse a tensor of the state rebound, or a host value of it changed, while recorded."""
    if isinstance(held, Tensor):
        if now is not held:
            raise TypeError(
                f"{where} was rebound while select/update were being recorded for replay: a "
                "replay would keep updating the old tensor. Update state in place (copy_, "
                "add_, index_put_), clear a per-step scratch tensor before update returns, or "
                "return no capture_key"
            )
    # None -> a value is host state made on first use, which code outside the recording can
    # make as well (the heuristic's windows, by observe); a tensor made so is "created" above.
    elif held is not None and not _same(held, now):
        raise TypeError(
            f"{where} changed ({held!r} -> {now!r}) while select/update were being recorded "
            "for replay, which runs no Python: keep the value in a tensor updated in place, or "
            "change it in observe() and make it part of capture_key"
        )


_GONE = object()
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type, types.ModuleType)


def _state(selector: Selector) -> dict[str, Any]:
    """Every tensor (by identity) and host value (by value, numpy arrays copied) reachable from
    the selector's attributes, but the per-call ones, by attribute path; and each container's
    length, at ``path#len``."""
    leaves: dict[str, Any] = {}
    for name, value in _attributes(selector):
        _walk(value, name, leaves, set(), _DEPTH)
    return leaves


def _attributes(value: object) -> list[tuple[str, Any]]:
    """An object's attributes (``__dict__`` and ``__slots__``), a selector's per-call ones left
    out; none for an object that will not say (a dead weak proxy)."""
    try:
        items = list(vars(value).items()) if hasattr(value, "__dict__") else []
        slots = [n for c in type(value).__mro__ for n in getattr(c, "__slots__", ())]
        items += [(n, getattr(value, n)) for n in slots if n != "__weakref__" and hasattr(value, n)]
    except Exception:
        return []
    if isinstance(value, Selector):
        items = [(name, item) for name, item in items if name not in PER_CALL]
    return items


def _walk(value: Any, path: str, leaves: dict[str, Any], seen: set[int], depth: int) -> None:
    if type(value) in weakref.ProxyTypes:  # maybe dead: isinstance would touch it and raise
        return
    if isinstance(value, (Tensor, *_HOST)):
        leaves[path] = value
    elif isinstance(value, np.ndarray):
        leaves[path] = value.copy()
    elif depth == 0 or id(value) in seen or isinstance(value, _CODE):
        return
    elif isinstance(value, list | tuple | dict | set | frozenset | collections.deque):
        seen.add(id(value))
        leaves[f"{path}#len"] = len(value)
        if len(value) > MAX_WALKED:
            return
        if isinstance(value, set | frozenset):
            leaves[f"{path}#items"] = frozenset(value)
            return
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _walk(item, f"{path}[{key!r}]", leaves, seen, depth - 1)
    else:
        seen.add(id(value))
        for name, item in _attributes(value):
            _walk(item, f"{path}.{name}", leaves, seen, depth - 1)


def _same(held: Any, now: Any) -> bool:
    if isinstance(held, np.ndarray):
        return (
            isinstance(now, np.ndarray)
            and held.shape == now.shape
            and bool(((held == now) | ((held != held) & (now != now))).all())
        )
    if isinstance(held, float) and isinstance(now, float) and math.isnan(held):
        return math.isnan(now)
    return type(held) is type(now) and bool(held == now)


def _tokens(selector: Selector) -> set[int]:
    """The capture tokens that make a key the selector's own: its own, and those of the
    selectors it holds (a wrapper keyed by its inner selector's key)."""
    held = [
        value
        for _, value in _attributes(selector)
        if type(value) not in weakref.ProxyTypes and isinstance(value, Selector)
    ]
    return {selector.capture_token, *(inner.capture_token for inner in held)}


def _holds(key: Hashable, tokens: set[int]) -> bool:
    """Whether one of ``tokens`` is ``key`` or inside it (tuples, nested), as a capture token:
    an int equal to one is not."""
    if isinstance(key, tuple):
        return any(_holds(part, tokens) for part in key)
    return isinstance(key, CaptureToken) and key in tokens
