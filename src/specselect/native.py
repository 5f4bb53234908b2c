"""The optional fused CPU kernel for top-``C`` selection, compiled on first use.

On a CPU, PyTorch pays a few microseconds of dispatch per operator and has no fused kernel for
"the ``C`` cheapest entries of a matrix", so :func:`~specselect.selection.cheapest_mask` costs
about eight tensor passes and a ``kthvalue``. ``_native/cheapest.c`` does the same selection
in a few passes (integer keys, a radix select, the mask and per-row counts): at ``B = 1024,
K = 16`` the paper's TETRIS ``select`` takes 75 µs with it and 206 µs without on one CPU
thread, against 959 µs for ``cumsum → topk(C) → count`` (``benchmarks/bench_selectors.py``).

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
Set ``SPECSELECT_NATIVE=0`` to never build or use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["available", "cheapest_mask", "disabled", "status"]

_LOG = logging.getLogger("specselect")
_SOURCE = "cheapest.c"
_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120


class _State:
    """What loading found (once per process): the kernel function, or why there is none."""

    loaded = False
    function: Callable[..., int] | None = None
    reason = "not loaded yet"
    suspended = 0  # depth of ``disabled()`` blocks


def available() -> bool:
    """Whether the fused CPU kernel is usable (builds and loads it on the first call)."""
    _load()
    return _State.function is not None


def status() -> str:
    """One line: the fused kernel's library path, or why the PyTorch kernel is used instead."""
    _load()
    return _State.reason


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch kernel inside this block even where the fused one could serve.

    For comparisons and debugging; selections are the same either way. The switch is
    process-wide (every thread sees it while the block runs).
    """
    _State.suspended += 1
    try:
        yield
    finally:
        _State.suspended -= 1


def usable_for(costs: Tensor, keep: Tensor | None) -> bool:
    """Whether :func:`cheapest_mask` may serve these (already checked) arguments."""
    return (
        not _State.suspended
        and costs.device.type == "cpu"
        and costs.dtype == torch.float32
        and costs.numel() < 2**31  # the kernel's histograms count in 32 bits
        and (keep is None or keep.device.type == "cpu")
        and not costs.requires_grad
        and not torch.compiler.is_compiling()
        and available()
    )


def cheapest_mask(costs: Tensor, budget: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The fused kernel: ``([B, N] bool mask, [B] int64 counts)``; see
    :func:`specselect.selection.cheapest_mask` for the contract.

    Args:
        costs: ``[B, N]`` float32 CPU tensor (made contiguous if it is not).
        budget: Python int >= 0.
        keep: optional ``[B]`` bool CPU tensor.

    Call only when :func:`usable_for` says so.
    """
    function = _State.function
    if function is None:
        raise RuntimeError(f"the fused selection kernel is not available: {_State.reason}")
    if costs.dim() != 2 or costs.dtype != torch.float32 or costs.device.type != "cpu":
        raise ValueError(f"costs must be a [B, N] float32 CPU tensor, got {_describe(costs)}")
    rows, cols = costs.shape
    if keep is not None and (
        keep.shape != (rows,) or keep.dtype != torch.bool or keep.device.type != "cpu"
    ):
        raise ValueError(f"keep must be a [{rows}] bool CPU tensor, got {_describe(keep)}")
    costs = costs.contiguous()  # both stay referenced until the call returns
    keep = None if keep is None else keep.contiguous()
    mask = torch.empty((rows, cols), dtype=torch.bool)
    counts = torch.empty(rows, dtype=torch.int64)
    keep_ptr = None if keep is None else keep.data_ptr()
    if function(costs.data_ptr(), rows, cols, budget, keep_ptr, mask.data_ptr(), counts.data_ptr()):
        raise MemoryError(f"the fused selection kernel could not allocate {rows * cols} keys")
    return mask, counts


def _describe(t: Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _load() -> None:
    if _State.loaded:
        return
    _State.loaded = True
    if os.environ.get("SPECSELECT_NATIVE", "1").strip().lower() in {"0", "false", "no", "off"}:
        _State.reason = "disabled by SPECSELECT_NATIVE=0; using the PyTorch kernel"
        return
    try:
        library = _build()
        function = ctypes.CDLL(str(library)).specselect_cheapest_mask
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
        # OSError: no compiler, unwritable cache, unloadable library; RuntimeError: no home
        # directory; AttributeError: a library without the kernel's symbol.
        _State.reason = f"fused kernel unavailable ({error}); using the PyTorch kernel"
        _LOG.warning("specselect: %s", _State.reason)
        return
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
    _State.function = function
    _State.reason = f"fused kernel {library}"


def _compiler() -> list[str]:
    """``$CC``, else the compiler Python was built with, else ``cc`` (as an argument list)."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _build() -> Path:
    """Compile ``_native/cheapest.c`` into the cache unless an identical build is there."""
    source = (resources.files("specselect") / "_native" / _SOURCE).read_bytes()
    compiler = _compiler()
    key = hashlib.sha256(
        b"\0".join(
            [source, shlex.join(compiler).encode(), shlex.join(_FLAGS).encode(), _platform_tag()]
        )
    ).hexdigest()[:16]
    cache = Path(os.environ.get("SPECSELECT_CACHE_DIR") or Path.home() / ".cache" / "specselect")
    library = cache / f"cheapest-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        source_path = Path(scratch) / _SOURCE
        source_path.write_bytes(source)
        built = Path(scratch) / library.name
        result = subprocess.run(
            [*compiler, *_FLAGS, str(source_path), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(f"{shlex.join(compiler)} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, library)  # atomic: concurrent builders cannot leave a torn library
    return library


def _platform_tag() -> bytes:
    return f"{platform.system()}-{platform.machine()}-{platform.python_implementation()}".encode()
