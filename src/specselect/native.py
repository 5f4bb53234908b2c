"""The optional fused CPU kernel for top-``C`` selection, compiled on first use.

On a CPU, PyTorch pays a few microseconds of dispatch per operator and has no fused kernel for
"the ``C`` cheapest entries of a matrix", so :func:`~specselect.topc.cheapest_mask` costs
about eight tensor passes and a ``kthvalue``. ``_native/cheapest.c`` does the same selection
in a few passes (integer keys, a radix select, the mask and per-row counts): at ``B = 1024,
K = 16`` on one CPU thread the paper's TETRIS ``select`` (argument checks included) took a
median 77 µs with it and 201 µs without, against 173 µs for the plain PyTorch formulation
``cumsum → topk(C, sorted=False) → count`` (950 µs with a sorted ``topk``), so about 2.2x
faster than the fastest direct formulation (``python benchmarks/bench_selectors.py --threads
1``; the speed table of the selectors guide, ``docs/selectors.md``, lists these and smaller
batches).

It is plain C99 with no Python or torch headers, so it needs only a C compiler (``$CC``, else
the one Python was built with, else ``cc``) and compiles in well under a second the first time
it is needed; the shared library is cached under ``$SPECSELECT_CACHE_DIR`` (default
``~/.cache/specselect``), keyed by the source, the compiler and the platform. Without a
compiler, the PyTorch kernel runs instead: the results are identical (the tests compare the
two), only slower; :func:`status` says which one is in use and why. The build happens inside
the first selection that needs it; a server that cannot afford that pause on its first step
calls :func:`available` at start-up.

The fused kernel serves float32 CPU tensors in eager mode only. Under ``torch.compile``, on
accelerators and on meta tensors the PyTorch kernel runs, which keeps selection capturable.
Set ``SPECSELECT_NATIVE=0`` to never build or use it. One known difference: under
``torch.set_flush_denormal(True)`` the PyTorch kernel sees subnormal costs as zero, while the
fused kernel compares their bits (costs from log-probabilities are never subnormal).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from specselect._checks import readable_eagerly

__all__ = ["available", "cheapest_mask", "disabled", "run", "status", "usable_for"]

_LOG = logging.getLogger("specselect")
_SOURCE = "cheapest.c"
_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120


class _State:
    """What loading found (once per process): the kernel function, or why there is none."""

    lock = threading.Lock()  # one loader at a time; guards ``suspended`` too
    loaded = False
    function: Callable[..., int] | None = None
    reason = "not loaded yet"
    suspended = 0  # depth of ``disabled()`` blocks, over all threads


def available() -> bool:
    """Whether the fused CPU kernel is usable now (builds and loads it on the first call):
    False inside :func:`disabled`."""
    _load()
    return _State.function is not None and not _State.suspended


def status() -> str:
    """One line: the fused kernel's library path, or why the PyTorch kernel is used instead
    (also inside :func:`disabled`)."""
    _load()
    if _State.function is not None and _State.suspended:
        return f"disabled by specselect.native.disabled(): the PyTorch kernel ({_State.reason})"
    return _State.reason


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch kernel inside this block even where the fused one could serve.

    For comparisons and debugging; selections are the same either way. The switch is
    process-wide (every thread sees it while the block runs).
    """
    with _State.lock:
        _State.suspended += 1
    try:
        yield
    finally:
        with _State.lock:
            _State.suspended -= 1


def usable_for(costs: Tensor, keep: Tensor | None) -> bool:
    """Whether :func:`cheapest_mask` may serve these (already checked) arguments.

    Only plain, materialised CPU float32 tensors in eager mode: ctypes reads raw memory, which
    fake, meta, functorch-wrapped and lazily negated tensors do not have, and which tracers
    (``torch.compile``, ``make_fx``, ``torch.jit.trace``) would not see.
    """
    return (
        readable_eagerly(costs)  # first: it also keeps Dynamo away from the checks below
        and not _State.suspended
        and costs.device.type == "cpu"
        and costs.dtype == torch.float32
        and costs.numel() < 2**31  # the kernel's histograms count in 32 bits
        and (keep is None or (type(keep) is Tensor and keep.device.type == "cpu"))
        and not costs.requires_grad
        and not costs.is_neg()
        and not torch.jit.is_tracing()
        and available()
    )


def cheapest_mask(costs: Tensor, budget: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The fused kernel: ``([B, N] bool mask, [B] int64 counts)``; see
    :func:`specselect.topc.cheapest_mask` for the contract.

    Args:
        costs: ``[B, N]`` float32 CPU tensor (made contiguous if it is not).
        budget: Python int >= 0.
        keep: optional ``[B]`` bool CPU tensor.

    Raises ``RuntimeError`` where the kernel could not be loaded, ``ValueError`` for
    arguments it cannot read (:func:`usable_for` says which tensors it serves).
    """
    _load()
    if _State.function is None:
        raise RuntimeError(f"the fused selection kernel is not available: {_State.reason}")
    if costs.dim() != 2 or costs.dtype != torch.float32 or costs.device.type != "cpu":
        raise ValueError(f"costs must be a [B, N] float32 CPU tensor, got {_describe(costs)}")
    if keep is not None and (
        keep.shape != costs.shape[:1] or keep.dtype != torch.bool or keep.device.type != "cpu"
    ):
        raise ValueError(
            f"keep must be a [{costs.shape[0]}] bool CPU tensor, got {_describe(keep)}"
        )
    if costs.numel() and not costs.data_ptr():  # no storage behind it (a fake tensor, say)
        raise ValueError("costs has no data in memory; the fused kernel needs a real tensor")
    return run(costs, budget, keep)


def run(costs: Tensor, budget: int, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """:func:`cheapest_mask` without its argument checks, for callers that asked
    :func:`usable_for` (the selection hot path)."""
    function = _State.function
    assert function is not None, "call usable_for() first"
    costs = costs.contiguous()  # both stay referenced until the call returns
    keep = None if keep is None else keep.contiguous()
    rows, cols = costs.shape
    mask = torch.empty((rows, cols), dtype=torch.bool)
    counts = torch.empty(rows, dtype=torch.int64)
    keep_ptr = None if keep is None else keep.data_ptr()
    if function(costs.data_ptr(), rows, cols, budget, keep_ptr, mask.data_ptr(), counts.data_ptr()):
        raise MemoryError(f"the fused selection kernel could not allocate {rows * cols} keys")
    return mask, counts


def _describe(t: Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _load() -> None:
    if _State.loaded:  # the common path takes no lock
        return
    with _State.lock:
        if not _State.loaded:
            _State.function, _State.reason = _find_kernel()
            _State.loaded = True
            if _State.function is None and "SPECSELECT_NATIVE" not in _State.reason:
                _LOG.warning("specselect: %s", _State.reason)


_OFF = frozenset({"0", "false", "no", "off"})  # SPECSELECT_NATIVE values that disable the kernel
_ON = frozenset({"", "1", "true", "yes", "on"})


def _find_kernel() -> tuple[Callable[..., int] | None, str]:
    """The kernel function and a status line, or ``None`` and why there is none."""
    setting = os.environ.get("SPECSELECT_NATIVE", "1").strip().lower()
    if setting in _OFF:
        return None, "disabled by SPECSELECT_NATIVE=0; using the PyTorch kernel"
    if setting not in _ON:
        _LOG.warning(
            "specselect: SPECSELECT_NATIVE=%r is neither on (1, true, yes, on) nor off (0, "
            "false, no, off); using the fused kernel, the default",
            os.environ["SPECSELECT_NATIVE"],
        )
    try:
        library = _build()
        try:
            function = _open(library)
        except (OSError, AttributeError):  # a corrupt or foreign file in the cache: rebuild once
            library.unlink(missing_ok=True)
            library = _build()
            function = _open(library)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
        # OSError: no compiler, unusable cache directory, unloadable library; RuntimeError: no
        # home directory; AttributeError: a library without the kernel's symbol.
        return None, f"fused kernel unavailable ({error}); using the PyTorch kernel"
    return function, f"fused kernel {library}"


def _open(library: Path) -> Callable[..., int]:
    function = ctypes.CDLL(str(library)).specselect_cheapest_mask
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,  # costs
        ctypes.c_int64,  # rows
        ctypes.c_int64,  # cols
        ctypes.c_int64,  # budget
        ctypes.c_void_p,  # keep (NULL: all rows)
        ctypes.c_void_p,  # mask
        ctypes.c_void_p,  # counts
    ]
    return function


def _compiler() -> list[str]:
    """``$CC`` if set; else the first found of the compiler Python was built with, ``cc``,
    ``gcc`` and ``clang`` (as an argument list)."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    candidates = [sysconfig.get_config_var("CC") or "", "cc", "gcc", "clang"]
    for candidate in candidates:
        command = shlex.split(candidate)
        if command and shutil.which(command[0]):
            return command
    raise OSError("no C compiler found (set $CC, or install cc, gcc or clang)")


def _cache_dir() -> Path:
    """``$SPECSELECT_CACHE_DIR``, else ``$XDG_CACHE_HOME/specselect`` (``~/.cache``): made
    private to this user, and refused if someone else owns it (a library planted there would
    be loaded into this process)."""
    explicit = os.environ.get("SPECSELECT_CACHE_DIR")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(explicit) if explicit else Path(base) / "specselect"
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if hasattr(os, "getuid") and cache.stat().st_uid != os.getuid():
        raise OSError(f"the cache directory {cache} belongs to another user")
    return cache


def _build() -> Path:
    """Compile ``_native/cheapest.c`` into the cache unless an identical build is there."""
    source = (resources.files("specselect") / "_native" / _SOURCE).read_bytes()
    if (
        platform.system() == "Darwin"
        and subprocess.run(["xcode-select", "-p"], capture_output=True).returncode
    ):
        # Without the command-line tools, /usr/bin/cc opens an installer dialog instead.
        raise OSError("no Xcode command-line tools (xcode-select --install)")
    compiler = _compiler()
    key = hashlib.sha256(
        b"\0".join([source, shlex.join([*compiler, *_FLAGS]).encode(), _platform_tag()])
    ).hexdigest()[:16]
    cache = _cache_dir()
    library = cache / f"cheapest-{key}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        source_path = Path(scratch) / _SOURCE
        source_path.write_bytes(source)
        built = Path(scratch) / library.name
        result = subprocess.run(
            [*compiler, *_FLAGS, str(source_path), "-o", str(built)],
            capture_output=True,
            text=True,
            errors="replace",  # a message the locale cannot decode must not hide the failure
            timeout=_COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{shlex.join(compiler)} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, library)  # atomic: concurrent builders cannot leave a torn library
    return library


def _platform_tag() -> bytes:
    """What a built library must match besides its source and compiler command."""
    parts = [
        sysconfig.get_platform(),
        platform.machine(),
        platform.python_implementation(),
        str(struct.calcsize("P")),  # 32- or 64-bit process
        "-".join(platform.libc_ver()),  # glibc and musl builds must not share a file
    ]
    return "|".join(parts).encode()
