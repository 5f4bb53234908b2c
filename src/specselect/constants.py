"""A small cache of constant tensors (column indices, position codes, fillers) used every step.

Building a constant such as ``arange(K)`` costs a kernel launch or two per call; selectors and
estimators run every decoding step, so they look such tensors up here instead. The cache knows
about tracing and CUDA graph capture, where caching a freshly built tensor would be wrong (see
:func:`cached_constant`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from specselect._checks import capturing

__all__ = ["arange_constant", "cached_constant"]

_CONSTANTS: OrderedDict[tuple[object, ...], Tensor] = OrderedDict()
_CONSTANTS_SIZE = 64


def cached_constant(key: tuple[object, ...], build: Callable[..., Tensor]) -> Tensor:
    """``build(*key[1:])``, cached under ``key``: for small constant tensors used every step.

    A cached tensor saves a few kernel launches per call; nothing may modify it in place. The
    cache is bypassed while compiling or tracing (the constant then lives in the graph; a fake
    tensor must never be cached) and while a CUDA graph is being captured: inside a capture
    the kernel that fills a tensor is only recorded, so a tensor cached then would hold garbage
    until the graph replays. Once ``_CONSTANTS_SIZE`` entries are held the oldest non-CUDA one
    is dropped; CUDA entries are kept for good, because a captured graph may read them and does
    not keep them alive itself.
    """
    tracing = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    cached = None if tracing else _CONSTANTS.get(key)
    if cached is not None:
        return cached
    value = build(*key[1:])
    if not tracing and type(value) is Tensor and not capturing(value.device):
        if len(_CONSTANTS) >= _CONSTANTS_SIZE:
            _evict_one()
        _CONSTANTS[key] = value
    return value


def arange_constant(size: int, device: torch.device) -> Tensor:  # [size] int64
    """``arange(size)`` on ``device``, cached (:func:`cached_constant`)."""
    return cached_constant(("arange", size, device), _arange)


def _arange(size: int, device: torch.device) -> Tensor:
    return torch.arange(size, device=device)


def _evict_one() -> None:
    """Drop the oldest cached constant that no CUDA graph can depend on."""
    for old_key, old_value in _CONSTANTS.items():
        if old_value.device.type != "cuda":
            del _CONSTANTS[old_key]
            return
