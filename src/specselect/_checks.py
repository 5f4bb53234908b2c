"""Argument checks shared by every public entry point.

Shape, rank and dtype checks are free: they read tensor metadata only. Value checks (NaN, +inf,
positive log-probabilities) must read the data, which on an accelerator is a host sync. They
therefore run when the data already lives on the host (CPU tensors, outside ``torch.compile``)
and, on accelerators, only when :func:`set_device_value_checks` turned them on for debugging.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

_DEVICE_VALUE_CHECKS = False
# Per thread (and per asyncio task): one thread's loop leaving its block must not turn the
# checks back on, or leave them off, for another thread's calls.
_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("trusted_values", default=False)


def set_device_value_checks(enabled: bool) -> None:
    """Also check tensor *values* (NaN, +inf, log-prob > 0) on accelerators.

    Off by default because each check is a device-to-host sync, which the selectors promise not to
    make. Turn it on while debugging a new integration.
    """
    global _DEVICE_VALUE_CHECKS
    if not isinstance(enabled, bool):  # bool("false") is True: a typo would switch them on
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
    _DEVICE_VALUE_CHECKS = enabled


@contextlib.contextmanager
def trusted_values() -> Iterator[None]:
    """Skip value checks inside the block: for a loop passing tensors it made itself.

    Argument checks exist for callers' tensors; in a decoding loop they would only re-read (and,
    on the CPU, spend time on) values the loop computed. Shape and dtype checks still run; the
    host outcomes a loop read back itself (:meth:`~specselect.selection.Selector.observe`) pass
    unchecked.
    """
    with _trust(True):
        yield


def checked_already() -> contextlib.AbstractContextManager[None]:
    """:func:`trusted_values` around a call whose tensor arguments the caller has just checked
    (a selector passing its checked draft to its estimator), so that the callee's own checks
    do not read them again. Nothing under ``torch.compile``, which cannot trace the flag and
    reads no values anyway."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else trusted_values()


def distrusted() -> contextlib.AbstractContextManager[None]:
    """Value checks back on inside a loop's :func:`trusted_values` block, for what code defined
    outside specselect returned (a selector's answer, an estimator's scores): a loop trusts the
    tensors it made itself, not those. Nothing under ``torch.compile`` (see
    :func:`checked_already`)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _trust(False)


@contextlib.contextmanager
def _trust(trusted: bool) -> Iterator[None]:
    token = _TRUSTED.set(trusted)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def outside_autograd(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` without autograd and outside inference mode: for the selectors' and
    estimators' entry points, whose state tensors outlive the call.

    Under autograd (draft log-probs that require grad) the state would become part of a graph,
    and an in-place update of it would fail at every later step; made under the caller's
    ``torch.inference_mode()`` it would be an inference tensor, which no later step or
    ``reset()`` outside inference mode may update in place. Inputs from either mode are read
    as they are. Nothing changes under ``torch.compile``, which traces the method in the
    caller's mode."""

    @functools.wraps(method)
    def plain(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # Compilation first: Dynamo cannot trace torch.is_inference_mode_enabled().
        if torch.compiler.is_compiling():
            return method(*args, **kwargs)
        # (The loop runs in that mode already: entering it again costs microseconds a step.)
        if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return plain


def values_trusted() -> bool:
    """Whether the caller is inside :func:`trusted_values`."""
    return _TRUSTED.get()


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
    anywhere, if asked for). Compilation first: Dynamo cannot trace the trusted flag (a
    ContextVar); the flag before the costlier readability checks, for the loop's sake."""
    return (
        not torch.compiler.is_compiling()
        and not _TRUSTED.get()
        and readable_eagerly(t)
        and (
            t.device.type == "cpu"
            # (never inside a CUDA graph capture, where a read would break the capture)
            or (_DEVICE_VALUE_CHECKS and not capturing(t.device))
        )
    )


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (only recorded,
    nothing runs: no value can be read, and a tensor made now holds garbage until replay)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_probability(name: str, value: object) -> float:
    """Return ``value`` as a float in [0, 1], or raise."""
    return check_real(name, value, low=0.0, high=1.0)


def check_real(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
) -> float:
    """Return ``value`` as a float, or raise unless it is a finite real number in the range:
    ``>= low`` (``> low`` if ``open_low``) and ``<= high``, each bound optional.

    Finite always: an infinite or NaN hyperparameter turns every estimate it touches into NaN,
    which ranks nothing and fails nowhere. A non-number is a ``TypeError``, a number out of
    range a ``ValueError``; both name the argument and the expected range.
    """
    expected = _range_text(low, high, open_low)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite float{expected}, got {type(value).__name__}")
    number = float(value)
    in_range = (
        math.isfinite(number)
        and (low is None or (number > low if open_low else number >= low))
        and (high is None or number <= high)
    )
    if not in_range:
        raise ValueError(f"{name} must be a finite float{expected}, got {value}")
    return number


def _range_text(low: float | None, high: float | None, open_low: bool) -> str:
    """`` in (0, 1]``, `` > 0``, `` <= 1`` or nothing: the range :func:`check_real` expects."""
    if low is not None and high is not None:
        return f" in {'(' if open_low else '['}{low:g}, {high:g}]"
    if low is not None:
        return f" {'>' if open_low else '>='} {low:g}"
    return "" if high is None else f" <= {high:g}"


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
    return None if active is None else check_mask("active", active, (batch,), device)


def check_mask(name: str, value: object, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Check a bool mask of ``shape`` on ``device`` (metadata only: free everywhere)."""
    t = check_tensor(name, value, rank=len(shape))
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
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
    return check_ints(name, value, (batch,), device)


def check_ints(name: str, value: object, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Check an integer tensor of ``shape`` on ``device`` (any values)."""
    t = check_integer_tensor(name, value, rank=len(shape))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def check_counts(name: str, value: object, batch: int, device: torch.device) -> Tensor:
    """Check a per-row integer count tensor of shape ``[batch]``: values >= 0."""
    return check_non_negative(name, check_row_ints(name, value, batch, device))


def check_non_negative(name: str, t: Tensor) -> Tensor:
    """Raise if an integer tensor holds a negative value (a value check: see the module doc)."""
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


def check_implies(name: str, t: Tensor, implied_name: str, implied: Tensor) -> None:
    """Raise if ``t`` is set anywhere ``implied`` is not (two bool masks of one shape; a value
    check: see the module doc)."""
    readable = _values_checkable(t) and _values_checkable(implied) and t.numel()
    if readable and bool((t & ~implied).any()):
        raise ValueError(
            f"{name} must imply {implied_name}: {name} is set where {implied_name} is not"
        )


def check_usable_device(name: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` this torch can use, or a ``ValueError`` naming ``name``
    (torch itself asserts, or fails deep inside a model move, on a device it lacks).

    A device type without a special case here is tried by its backend's ``is_available()``
    and a one-element move, as models are moved: that raises for a type this build does not
    support (``xla`` without torch_xla)."""
    use_cpu = f"use {name} cpu" if name.startswith("--") else f"use {name}='cpu'"
    try:
        parsed = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"{name} {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)"
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name} {device!r}: CUDA is not available (this torch {torch.__version__} has "
                f"no CUDA support or sees no GPU); {use_cpu}"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name} {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{name} {device!r}: MPS is not available; {use_cpu}")
    elif parsed.type == "meta":
        raise ValueError(
            f"{name} {device!r}: meta tensors hold no values, so no model can run on it; {use_cpu}"
        )
    elif parsed.type != "cpu":
        backend = getattr(torch, parsed.type, None)
        is_available = getattr(backend, "is_available", None)
        if callable(is_available) and not is_available():
            raise ValueError(f"{name} {device!r}: {parsed.type} is not available; {use_cpu}")
        try:
            torch.zeros(1).to(parsed)  # [1]
        except (RuntimeError, AssertionError, ValueError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{name} {device!r} is not usable ({reason}); {use_cpu}") from None
    return parsed
