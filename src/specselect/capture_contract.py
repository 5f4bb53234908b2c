"""The check that a selector's recorded work replays right: :func:`recording_checked`.

A loop that gets a :attr:`~specselect.selection.Selector.capture_key` records ``select`` and
``update`` once (a CUDA graph, or a trace) and replays the recording every later step: tensor
operations only, on the tensors the recording saw, with none of the Python around them. Three
mistakes in a selector then give wrong statistics while greedy output stays identical, so
nothing else would show them:

- state *rebound* while recorded (``self.total = self.total + x``): the replay reads the old
  tensor and writes a new one the selector never looks at again, so the state never advances;
- a host value changed while recorded (``self.steps += 1``): a replay runs no Python;
- tensor state without the selector's ``capture_token`` in its key: another selector with an
  equal key replays graphs recorded on this one's tensors, and updates them.

Each is visible while the recording runs, once per captured key, so the check costs nothing
per step. What it cannot see is a host value that changes *outside* the recording (in
``observe``) and is read inside it without being part of the key: the key's docs say so.
"""

from __future__ import annotations

import contextlib
import enum
import math
import types
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from specselect.selection import Selector

#: The selector's attributes that ``select`` and ``update`` set every call by design (the last
#: call's inputs, answer and outcomes): not state a selection depends on.
PER_CALL = frozenset({"_last", "_answered", "_step_outcomes", "_device"})

#: How deep the walk follows attributes (selector -> estimator -> its parts -> their state).
_DEPTH = 6

_HOST = (bool, int, float, str, bytes, type(None), torch.device, torch.dtype, enum.Enum)


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
        now = after.get(path, _GONE)
        if isinstance(held, torch.Tensor):
            if now is not held:
                raise TypeError(
                    f"{name}.{path} was rebound while select/update were being recorded for "
                    "replay: a replay would keep updating the old tensor. Update state in "
                    "place (copy_, add_, index_put_), or return no capture_key"
                )
        # None -> a value is host state made on first use, which code outside the recording
        # can make as well (the heuristic's windows, by observe); a tensor made so is not.
        elif held is not None and not _same(held, now):
            raise TypeError(
                f"{name}.{path} changed ({held!r} -> {now!r}) while select/update were being "
                "recorded for replay, which runs no Python: keep the value in a tensor updated "
                "in place, or change it in observe() and make it part of capture_key"
            )
    added = [
        path
        for path, value in after.items()
        if isinstance(value, Tensor) and not isinstance(before.get(path), Tensor)
    ]
    tensors = [path for path, value in after.items() if isinstance(value, torch.Tensor)]
    if added:
        raise TypeError(
            f"{name}.{added[0]} was created while select/update were being recorded for "
            "replay: allocate state in the first call for a shape (a loop records a shape only "
            "after one call), or return no capture_key"
        )
    if tensors and not _holds(selector.capture_key, selector.capture_token):
        raise TypeError(
            f"{name} keeps tensors ({name}.{tensors[0]}) but its capture_key "
            f"{selector.capture_key!r} lacks its capture_token: another {name} with an equal "
            "key would replay graphs recorded on this one's tensors; include "
            "self.capture_token in the key"
        )


_GONE = object()
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type, torch.nn.Module)


def _state(selector: Selector) -> dict[str, Any]:
    """Every tensor (by identity) and host value (by value, numpy arrays copied) reachable from
    the selector's attributes, but the per-call ones, by attribute path."""
    leaves: dict[str, Any] = {}
    seen: set[int] = set()
    for name, value in vars(selector).items():
        if name not in PER_CALL:
            _walk(value, name, leaves, seen, _DEPTH)
    return leaves


def _walk(value: Any, path: str, leaves: dict[str, Any], seen: set[int], depth: int) -> None:
    if isinstance(value, (torch.Tensor, *_HOST)):
        leaves[path] = value
    elif isinstance(value, np.ndarray):
        leaves[path] = value.copy()
    elif depth == 0 or id(value) in seen or isinstance(value, _CODE):
        return
    elif isinstance(value, list | tuple):
        seen.add(id(value))
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", leaves, seen, depth - 1)
    elif isinstance(value, dict):
        seen.add(id(value))
        for key, item in value.items():
            _walk(item, f"{path}[{key!r}]", leaves, seen, depth - 1)
    elif hasattr(value, "__dict__"):
        seen.add(id(value))
        for name, item in vars(value).items():
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


def _holds(key: Hashable, token: int) -> bool:
    """Whether ``token`` is ``key`` or inside it (tuples, nested)."""
    if isinstance(key, tuple):
        return any(_holds(part, token) for part in key)
    return type(key) is int and key == token
