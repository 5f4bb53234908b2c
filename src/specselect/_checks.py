"""Argument checks shared by every public entry point.

Shape, rank and dtype checks are free: they read tensor metadata only. Value checks (NaN, +inf,
positive log-probabilities) must read the data, which on an accelerator is a host sync. They
therefore run when the data already lives on the host (CPU tensors, outside ``torch.compile``)
and, on accelerators, only when :func:`set_device_value_checks` turned them on for debugging.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

_DEVICE_VALUE_CHECKS = False
_TRUSTED = False


def set_device_value_checks(enabled: bool) -> None:
    """Also check tensor *values* (NaN, +inf, log-prob > 0) on accelerators.

    Off by default because each check is a device-to-host sync, which the selectors promise not to
    make. Turn it on while debugging a new integration.
    """
    global _DEVICE_VALUE_CHECKS
    _DEVICE_VALUE_CHECKS = bool(enabled)


@contextlib.contextmanager
def trusted_values() -> Iterator[None]:
    """Skip value checks inside the block: for a loop passing tensors it made itself.

    Argument checks exist for callers' tensors; in a decoding loop they would only re-read (and,
    on the CPU, spend time on) values the loop computed. Shape and dtype checks still run.
    """
    global _TRUSTED
    before, _TRUSTED = _TRUSTED, True
    try:
        yield
    finally:
        _TRUSTED = before


def readable_eagerly(t: Tensor) -> bool:
    """Whether ``t``'s memory can be read right now: a real tensor (not fake, meta or
    functorch-wrapped) outside ``torch.compile`` and tracing dispatch modes (``make_fx``).

    Value checks read it through PyTorch; the fused CPU kernel through a raw pointer.
    """
    return (
        not torch.compiler.is_compiling()  # first: Dynamo cannot trace the checks below
        and type(t) is Tensor
        and t.device.type != "meta"
        and _get_current_dispatch_mode() is None
        and not is_functorch_wrapped_tensor(t)
    )


def _values_checkable(t: Tensor) -> bool:
    """Whether reading ``t``'s values is cheap and possible: readable, on the CPU (or
    anywhere, if asked for)."""
    return not _TRUSTED and readable_eagerly(t) and (t.device.type == "cpu" or _DEVICE_VALUE_CHECKS)


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_probability(name: str, value: object) -> float:
    """Return ``value`` as a float in [0, 1], or raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def check_tensor(name: str, value: object, *, rank: int) -> Tensor:
    """Raise unless ``value`` is a tensor of the given rank."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != rank:
        raise ValueError(
            f"{name} must have rank {rank}, got shape {tuple(value.shape)} (rank {value.dim()})"
        )
    return value


def check_logprobs(name: str, value: object, *, rank: int = 2) -> Tensor:
    """Check a tensor of log-probabilities: floating, no NaN, no +inf, nothing above 0.

    ``-inf`` is allowed and means "probability 0: never select".
    """
    t = check_tensor(name, value, rank=rank)
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor of log-probabilities, got {t.dtype}"
        )
    if _values_checkable(t) and t.numel() and not t.max().item() <= 0:  # NaN fails too
        if bool(torch.isnan(t).any()):
            raise ValueError(f"{name} contains NaN; expected log-probabilities in [-inf, 0]")
        if bool(torch.isposinf(t).any()):
            raise ValueError(f"{name} contains +inf; expected log-probabilities in [-inf, 0]")
        worst = float(t.max())
        raise ValueError(
            f"{name} contains positive values (max {worst:g}); expected log-probabilities in "
            "[-inf, 0]"
        )
    return t


def check_no_nan(name: str, t: Tensor) -> Tensor:
    """Raise if the floating tensor ``t`` holds a NaN (a value check: see the module doc)."""
    if _values_checkable(t) and t.numel() and bool(t.isnan().any()):
        raise ValueError(f"{name} contains NaN")
    return t


def check_active(active: object, batch: int, device: torch.device) -> Tensor | None:
    """Check an optional active-row mask: a bool tensor of shape ``[batch]`` on ``device``."""
    if active is None:
        return None
    t = check_tensor("active", active, rank=1)
    if t.dtype != torch.bool:
        raise TypeError(f"active must be a bool tensor, got {t.dtype}")
    if t.shape[0] != batch:
        raise ValueError(
            f"active must have shape [{batch}] (one flag per row), got {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"active is on {t.device} but draft_logprobs is on {device}")
    return t


def check_integer_tensor(name: str, value: object, *, rank: int, what: str = "") -> Tensor:
    """Raise unless ``value`` is an integer (not bool) tensor of the given rank.

    ``what`` completes the message ("of token ids"): floats would be truncated and bools read as
    0/1 by the indexing that follows, so both are type errors rather than conversions.
    """
    t = check_tensor(name, value, rank=rank)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor{what and ' ' + what}, got {t.dtype}")
    return t


def check_same_device(name: str, t: Tensor, reference_name: str, reference: Tensor) -> Tensor:
    """Raise unless ``t`` lives on ``reference``'s device (a metadata check)."""
    if t.device != reference.device:
        raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")
    return t


def check_row_ints(name: str, value: object, batch: int, device: torch.device) -> Tensor:
    """Check a per-row integer tensor of shape ``[batch]`` on ``device`` (any values)."""
    t = check_integer_tensor(name, value, rank=1)
    if t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [{batch}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def check_counts(name: str, value: object, batch: int, device: torch.device) -> Tensor:
    """Check a per-row integer count tensor of shape ``[batch]``: values >= 0."""
    t = check_row_ints(name, value, batch, device)
    if _values_checkable(t) and t.numel() and bool((t < 0).any()):
        raise ValueError(f"{name} must be >= 0, got min {int(t.min())}")
    return t


def check_at_most(name: str, t: Tensor, bound_name: str, bound: Tensor) -> Tensor:
    """Raise if any ``t[i] > bound[i]`` (two ``[B]`` tensors; a value check: see the module doc)."""
    if _values_checkable(t) and _values_checkable(bound) and t.numel():
        over = t > bound  # [B]
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise ValueError(
                f"{name} must be <= {bound_name}, got {name}[{i}] = {int(t[i])} > "
                f"{bound_name}[{i}] = {int(bound[i])}"
            )
    return t
