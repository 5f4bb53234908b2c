"""What a call's static KV caches take, and a check, before any work, that the memory is there.

The loop and the profiler preallocate every model's KV cache for the whole call
(:class:`~specselect.hf.kv.ModelCache`: ``[slots, kv heads, capacity, head dim]`` keys and
values per layer, allocated by the first forward pass). Nothing else bounds their size: rotary
models have no position table, so a huge ``max_new_tokens``, prompt, batch or profiling
context would otherwise end in an allocator error in the middle of a prefill, or in the
operating system's OOM killer. :func:`check_memory` refuses such a call up front, with what was
asked and what to lower; all it runs first is one pass of one token per model, into a cache of
one column, which tells what a column holds (:func:`kv_column_bytes`).

The estimate is a *lower bound*: it counts the caches and the largest 4D attention mask a pass
hands the model, not activations, logits or an attention kernel's workspace (the weights are
already resident, outside the free memory). So the check refuses only what cannot fit whatever
the rest needs; a call it lets through may still run out of memory.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from specselect.hf.compat import ModelHandle
from specselect.hf.kv import ModelCache

_GIB = 1 << 30
#: :func:`kv_column_bytes` per model, weight dtype and autocast dtype (a model outlives many
#: calls).
_COLUMN_BYTES: weakref.WeakKeyDictionary[
    torch.nn.Module, dict[tuple[torch.dtype, torch.dtype | None], int]
] = weakref.WeakKeyDictionary()
#: Per-row bookkeeping of a cache besides its keys and values: ``valid`` (a bool per column)
#: and ``count`` (an int64 per row), plus the int64 scalars ``pos`` and ``mark``.
_FLAG_BYTES, _INT_BYTES, _SCALARS = 1, 8, 2


def kv_column_bytes(handle: ModelHandle) -> int:
    """Bytes of one cache column of one row over all layers (keys and values), as the model
    writes them into a :class:`~specselect.hf.kv.ModelCache`: measured once per model, dtype
    and autocast dtype, with a pass of one token into a cache of one column.

    Measured, not read from the config, because configs do not say it alike: multi-query
    attention is a flag in Falcon's and GPTBigCode's (one key/value head, whatever
    ``num_attention_heads`` says), head sizes differ per layer in Gemma 4's, layers that reuse
    an earlier layer's keys and values store none, and quantized weights do not give the
    activations' dtype. An estimate read from configs overcounted the multi-query ones by
    their number of heads, and would have refused calls that fit.
    """
    known = _COLUMN_BYTES.setdefault(handle.model, {})
    device = handle.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    key = (handle.dtype, autocast)  # what the keys and values come out in
    if key not in known:
        cache = ModelCache(handle, 1, 1, static_span=False)
        cache.reserve(1)
        token = torch.zeros(1, 1, dtype=torch.int64, device=handle.device)  # [1, 1]
        with torch.no_grad():
            cache.forward(token, token.new_ones(1, 1, dtype=torch.bool), last_only=True)
        known[key] = sum(t.nbytes for t in cache.kv.buffers())
    return known[key]


def cache_bytes(handle: ModelHandle, slots: int, capacity: int) -> int:
    """Bytes ``ModelCache(handle, slots, capacity)`` holds once a pass has written it."""
    per_column = kv_column_bytes(handle) + _FLAG_BYTES
    return slots * capacity * per_column + (slots + _SCALARS) * _INT_BYTES


def mask_bytes(handle: ModelHandle, rows: int, width: int, span: int) -> int:
    """Bytes of the ``[rows, 1, width, span]`` attention mask a pass of ``width`` tokens over
    ``span`` cache columns hands the model: bool for ``sdpa``, additive in the model's dtype for
    ``eager``. It scales with the capacity (graph mode attends over all of it) and, for a
    prefill, with the prompt too."""
    element = handle.dtype.itemsize if handle.mask_kind == "eager" else 1
    return rows * width * span * element


@dataclass(frozen=True)
class CacheNeed:
    """One cache a call allocates, and the widest pass it runs (whose mask is the largest)."""

    handle: ModelHandle
    slots: int  # rows allocated
    capacity: int  # columns per row
    width: int  # tokens per row of the widest pass (the prefill's prompt, for the loop)
    span: int  # cache columns that pass attends over


def check_memory(needs: Sequence[CacheNeed], asked: str, lower: str) -> None:
    """Raise ``ValueError`` if the caches of ``needs`` cannot fit in their devices' free memory.

    Per device: every cache (they live together) plus the largest pass mask (one at a time),
    against :func:`available_bytes` (after a garbage collection, if it seems short). Only a
    clear excess is refused: the estimate is a lower bound (see the module doc). Models spread
    over several devices, and devices whose free memory is unknown, are not checked.

    Args:
        needs: the caches the call will allocate.
        asked: what the caller asked for, for the message (sizes and where they came from).
        lower: what the caller can lower, for the message.
    """
    by_device: dict[torch.device, list[CacheNeed]] = {}
    for need in needs:
        devices = {p.device for p in need.handle.model.parameters()}
        if len(devices) == 1:
            by_device.setdefault(devices.pop(), []).append(need)
    for device, group in by_device.items():
        available = available_bytes(device)
        if available is None:  # nothing to check against: no pass to measure the caches
            continue
        caches = sum(cache_bytes(n.handle, n.slots, n.capacity) for n in group)
        mask = max(mask_bytes(n.handle, n.slots, n.width, n.span) for n in group)
        if caches + mask > available:
            # Memory that garbage in reference cycles holds is free to take: collect it and look
            # again before refusing.
            gc.collect()
            available = available_bytes(device)
        if available is not None and caches + mask > available:
            raise ValueError(
                f"{asked} needs at least {_gib(caches + mask)} GiB on {device} for the KV "
                f"caches ({_gib(caches)} GiB) and the largest pass's attention mask "
                f"({_gib(mask)} GiB), but only "
                f"{_gib(available)} GiB is available there (weights, activations and workspace "
                f"need more still): lower {lower}"
            )


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can take, or ``None`` where unknown (no check).

    CUDA: the driver's free memory plus what torch's caching allocator holds unused (freed
    tensors it keeps for reuse). CPU: :func:`host_available_bytes` (the cgroup's limit
    included). Other devices: unknown.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + int(cached)
    if device.type == "cpu":
        return host_available_bytes()
    return None


def host_available_bytes(
    meminfo: str = "/proc/meminfo",
    cgroups: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> int | None:
    """Host memory this process can take without swapping: the smaller of the machine's
    available memory (:func:`machine_available_bytes`) and what its cgroups' memory limits
    leave (:func:`cgroup_available_bytes`; a container or CI runner is often limited far below
    the machine's memory, and the kernel kills a process that exceeds the limit). ``None``
    where neither is known."""
    known = [
        size
        for size in (machine_available_bytes(meminfo), cgroup_available_bytes(cgroups, cgroup_root))
        if size is not None
    ]
    return min(known) if known else None


def machine_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's memory available without swapping: Linux's ``MemAvailable`` (free memory
    plus reclaimable caches), else the free physical pages ``os.sysconf`` reports, else
    ``None``."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf, or names it does not know
        return None


# A cgroup's memory files: limit, usage, and the memory.stat key of its inactive file cache.
_CGROUP_V2 = ("memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
# cgroup v1 writes "no limit" as the largest page-aligned int64 (2^63 - 4096 with 4 KiB pages).
_NO_V1_LIMIT = 2**62


def cgroup_available_bytes(
    cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int | None:
    """What the memory limits of this process's cgroups leave it, or ``None`` where no limit
    is set (or none can be read).

    ``cgroups`` lists the process's cgroups (``0::/path`` for cgroup v2, ``N:memory:/path``
    for v1's memory controller), mounted under ``root`` (v2) or ``root/memory`` (v1). A limit
    on the cgroup or on any ancestor applies, so this is the smallest over them of the limit
    (``memory.max``, ``max`` = none; v1: ``memory.limit_in_bytes``) less the working set: the
    usage (``memory.current``; v1: ``memory.usage_in_bytes``) less the inactive file cache
    (``memory.stat``), which the kernel reclaims before it refuses memory.
    """
    try:
        lines = Path(cgroups).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    left: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            base, files = Path(root), _CGROUP_V2
        elif "memory" in controllers.split(","):
            base, files = Path(root) / "memory", _CGROUP_V1
        else:
            continue
        left += [n for d in _cgroup_dirs(base, path) if (n := _cgroup_left(d, files)) is not None]
    return min(left) if left else None


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The cgroup ``path``'s directory under ``base`` and its ancestors up to ``base``; just
    ``base`` where the path is not there (a container's mount shows its own cgroup as the
    root)."""
    dirs = [base.joinpath(*PurePosixPath(path).parts[1:])]
    if not dirs[0].is_dir():
        return [base]
    while dirs[-1] != base:
        dirs.append(dirs[-1].parent)
    return dirs


def _cgroup_left(directory: Path, files: tuple[str, str, str]) -> int | None:
    """One cgroup's limit less its working set, or ``None`` where it sets no limit."""
    limit_file, usage_file, inactive = files
    try:
        text = (directory / limit_file).read_text(encoding="ascii").strip()
        limit = None if text == "max" else int(text)
        if limit is None or limit >= _NO_V1_LIMIT:
            return None
        usage = int((directory / usage_file).read_text(encoding="ascii"))
        return max(limit - usage + _memory_stat(directory, inactive), 0)
    except (OSError, ValueError):  # no such files (no limit here), or not numbers
        return None


def _memory_stat(directory: Path, key: str) -> int:
    """``key``'s value in the cgroup's ``memory.stat``; 0 where it cannot be read."""
    try:
        for line in (directory / "memory.stat").read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _gib(size: int) -> str:
    return f"{size / _GIB:.2f}"


__all__ = [
    "CacheNeed",
    "available_bytes",
    "cache_bytes",
    "cgroup_available_bytes",
    "check_memory",
    "host_available_bytes",
    "kv_column_bytes",
    "machine_available_bytes",
    "mask_bytes",
]
