"""The memory check: caches that cannot fit are refused before any work, with a clear error.

Nothing large is ever allocated here: the available memory is monkeypatched small, and the
estimate is checked against what real small caches allocate.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import specselect.profiling
from hf_models import ARCHS, MORE_ARCHS, left_padded_prompts, tiny_model, tiny_pair
from specselect import make_selector
from specselect.cost import CostModel
from specselect.hf import TreeSpec, speculative_generate
from specselect.hf import memory as hf_memory
from specselect.hf.compat import ModelHandle
from specselect.hf.kv import ModelCache
from specselect.hf.memory import (
    CacheNeed,
    available_bytes,
    cache_bytes,
    cgroup_available_bytes,
    check_memory,
    host_available_bytes,
    machine_available_bytes,
    mask_bytes,
)

VOCAB = 128
SLOTS, CAPACITY, WIDTH = 3, 40, 5


def written_cache(model: nn.Module, static_span: bool = True) -> ModelCache:
    """A small cache after one pass of ``WIDTH`` tokens (which allocates its layers)."""
    cache = ModelCache(ModelHandle.of("target", model), SLOTS, CAPACITY, static_span=static_span)
    cache.reserve(WIDTH)
    ids = torch.full((SLOTS, WIDTH), 3, dtype=torch.int64)  # [S, W]
    with torch.no_grad():
        cache.forward(ids, torch.ones(SLOTS, WIDTH, dtype=torch.bool))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS)
def test_cache_estimate_is_what_a_cache_allocates(arch: str, dtype: torch.dtype) -> None:
    """Every tensor a written cache holds, keys and values of every layer included: the
    estimate cannot drift from kv.py (Llama, Qwen2 and Mistral have fewer KV heads than query
    heads; GPT-2 and OPT configs name their sizes differently; Falcon and GPTBigCode store one
    KV head; Gemma 4's head sizes differ per layer, and its last layers store none)."""
    cache = written_cache(tiny_model(arch, 0).to(dtype))
    assert cache.kv.written()
    assert cache_bytes(cache.handle, SLOTS, CAPACITY) == held_bytes(cache)


def held_bytes(cache: ModelCache) -> int:
    """Every tensor ``cache`` holds: keys and values of every layer, flags and counts."""
    own = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    return sum(t.nbytes for t in [*cache.kv.buffers(), *own])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mask_estimate_is_the_mask_a_pass_hands_the_model(attn: str, dtype: torch.dtype) -> None:
    cache = written_cache(tiny_model("llama", 0, attn_implementation=attn).to(dtype))
    columns = torch.arange(WIDTH)  # [W]
    valid = torch.ones(SLOTS, WIDTH, dtype=torch.bool)  # [S, W]
    mask, _ = cache.pass_inputs(columns, valid, None, None, None)
    assert mask_bytes(cache.handle, SLOTS, WIDTH, cache.kv.span) == mask.nbytes


def test_what_a_column_holds_is_measured_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured, not read from the config: this config claims 4 key/value heads where the
    layers store 2, which an estimate from the config would believe. One pass per model: a
    model outlives many calls."""
    model = tiny_model("llama", 0)
    model.config.num_key_value_heads = 4  # read by nothing that shapes the cache
    held = held_bytes(written_cache(model))
    passes = cache_passes(monkeypatch)
    handle = ModelHandle.of("target", model)
    assert cache_bytes(handle, SLOTS, CAPACITY) == held
    assert cache_bytes(handle, 2 * SLOTS, CAPACITY) > held
    assert passes == [1]  # one column, once
    with torch.autocast("cpu", dtype=torch.bfloat16):  # keys and values in bfloat16
        assert cache_bytes(handle, SLOTS, CAPACITY) < held
    assert passes == [1, 1]


def test_no_measuring_pass_where_the_free_memory_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing to check against, so nothing to measure: no one-column pass."""
    set_available(monkeypatch, None)
    passes = cache_passes(monkeypatch)
    generate(*tiny_pair("llama", 0, noise=0.02))
    assert passes and 1 not in passes


def cache_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The capacity of the cache of every ``ModelCache.forward`` from now on, in order."""
    capacities: list[int] = []
    forward = ModelCache.forward

    def recorded(self: ModelCache, *args: Any, **kwargs: Any) -> torch.Tensor:
        capacities.append(self.capacity)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelCache, "forward", recorded)
    return capacities


def set_available(monkeypatch: pytest.MonkeyPatch, size: int | None) -> None:
    monkeypatch.setattr(hf_memory, "available_bytes", lambda device: size)


def need(model: nn.Module) -> CacheNeed:
    return CacheNeed(ModelHandle.of("target", model), SLOTS, CAPACITY, WIDTH, CAPACITY)


def estimate(wanted: CacheNeed) -> int:
    return cache_bytes(wanted.handle, SLOTS, CAPACITY) + mask_bytes(
        wanted.handle, SLOTS, WIDTH, CAPACITY
    )


@pytest.mark.parametrize("spare", [0, -1])
def test_only_an_estimate_beyond_the_available_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch, spare: int
) -> None:
    wanted = need(tiny_model("llama", 0))
    set_available(monkeypatch, estimate(wanted) + spare)
    if spare < 0:
        with pytest.raises(ValueError, match=r"^the ask needs at least .* GiB on cpu.*: lower it$"):
            check_memory([wanted], "the ask", "it")
    else:
        check_memory([wanted], "the ask", "it")


def test_a_dropped_cache_frees_its_buffers_at_once() -> None:
    """No reference cycle: a cache's layers refer back to it weakly, so dropping the cache
    frees its buffers without waiting for the cycle collector."""
    model = tiny_model("llama", 0)
    cache = written_cache(model)
    buffers = [weakref.ref(b) for b in cache.kv.buffers()]
    gc.disable()
    try:
        del cache
        assert [ref() for ref in buffers] == [None] * len(buffers)
    finally:
        gc.enable()


class _Cycle:
    """Garbage that only the cycle collector frees, holding a tensor."""

    def __init__(self) -> None:
        self.me = self
        self.tensor = torch.zeros(4)


def test_garbage_in_cycles_is_collected_before_refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory that garbage in reference cycles holds is available: it is collected and the
    memory looked at again before a refusal."""
    model = tiny_model("llama", 0)
    dropped = weakref.ref(_Cycle().tensor)
    wanted = need(model)
    short = estimate(wanted) - 1
    monkeypatch.setattr(
        hf_memory, "available_bytes", lambda device: short if dropped() is not None else short + 1
    )
    check_memory([wanted], "the ask", "it")
    assert dropped() is None


@pytest.mark.parametrize("spread", [False, True])
def test_a_model_spread_over_devices_is_not_checked(
    monkeypatch: pytest.MonkeyPatch, spread: bool
) -> None:
    """Its layers' caches sit on their layers' devices, which the input device does not tell."""
    model = tiny_model("llama", 0)
    wanted = need(model)
    if spread:
        model.lm_head.to("meta")
    set_available(monkeypatch, 0)
    if spread:
        check_memory([wanted], "the ask", "it")
    else:
        with pytest.raises(ValueError, match="the ask needs"):
            check_memory([wanted], "the ask", "it")


@pytest.fixture(scope="module")
def pair() -> tuple[nn.Module, nn.Module]:
    return tiny_model("llama", 0), tiny_model("llama", 1, layers=1)


@pytest.fixture
def forwards(pair: tuple[nn.Module, nn.Module]) -> Iterator[list[str]]:
    """The names of the models whose forward ran with a cache of more than one column (the
    work the memory check protects; a one-column cache is its own measuring pass, and the
    causality check runs the models without a cache), in order."""
    ran: list[str] = []

    def record(name: str, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.capacity > 1:
            ran.append(name)

    hooks = [
        model.register_forward_pre_hook(
            lambda _, args, kwargs, name=name: record(name, kwargs), with_kwargs=True
        )
        for name, model in zip(("target", "draft"), pair, strict=True)
    ]
    yield ran
    for hook in hooks:
        hook.remove()


def generate(target: nn.Module, draft: nn.Module) -> object:
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    selector = make_selector("tetris", k=2)
    return speculative_generate(target, draft, ids, mask, selector=selector, max_new_tokens=8)


def profile(target: nn.Module, draft: nn.Module) -> object:
    grid = {"batch_sizes": (1, 2), "widths": (1, 2), "contexts": (8, 16)}
    return CostModel.measure(target, draft, repeats=1, warmup=1, progress=False, **grid)


# (caller, what its error names)
CALLERS: list[tuple[Callable[[nn.Module, nn.Module], object], str]] = [
    (
        generate,
        r"speculative_generate with 4 rows of 78 cache columns "
        r"\(prompt 6 \+ max_new_tokens 8 \+ cache_slack 64\)",
    ),
    (profile, r"profiling at context 16 with batch sizes \[1, 2\]"),
]


@pytest.mark.usefixtures("planted_timings")  # profiling fits its timings: noise can be refused
@pytest.mark.parametrize("available", [1 << 10, None, 1 << 40], ids=["short", "unknown", "plenty"])
@pytest.mark.parametrize(("caller", "asked"), CALLERS, ids=["generate", "profile"])
def test_caches_beyond_the_memory_are_refused_before_any_generation_pass(
    monkeypatch: pytest.MonkeyPatch,
    pair: tuple[nn.Module, nn.Module],
    forwards: list[str],
    caller: Callable[[nn.Module, nn.Module], object],
    asked: str,
    available: int | None,
) -> None:
    """Refused when short, before either model runs with its caches; run when the memory is
    there or unknown."""
    set_available(monkeypatch, available)
    if available == 1 << 10:
        says = asked + r".* needs at least [\d.]+ GiB on cpu .* lower"
        with pytest.raises(ValueError, match=says):
            caller(*pair)
        assert forwards == []
    else:
        caller(*pair)
        assert set(forwards) == {"target", "draft"}


@pytest.mark.parametrize("tree", [TreeSpec(3, 2, 2), TreeSpec(10, 8, 4096)], ids=["small", "huge"])
def test_a_tree_step_s_mask_counts(
    monkeypatch: pytest.MonkeyPatch,
    pair: tuple[nn.Module, nn.Module],
    forwards: list[str],
    tree: TreeSpec,
) -> None:
    """A tree of thousands of nodes per row needs a verify mask of nodes by cache columns:
    refused before any forward (it used to draft for minutes, then fail to allocate), where
    a small tree runs in the same memory."""
    set_available(monkeypatch, 1 << 30)
    ids, mask = left_padded_prompts(2, 2, 6, VOCAB, 0)
    run = lambda: speculative_generate(  # noqa: E731
        *pair, ids, mask, selector=make_selector("tetris", k=2), max_new_tokens=4, tree=tree
    )
    if tree.num_nodes < 100:
        run()
        assert set(forwards) == {"target", "draft"}
        return
    with pytest.raises(ValueError, match=rf"\+ {tree.num_nodes + tree.fed_nodes() + 2} for a step"):
        run()
    assert forwards == []


@pytest.mark.usefixtures("planted_timings")
def test_profiling_frees_a_context_s_caches_before_the_next(
    monkeypatch: pytest.MonkeyPatch, pair: tuple[nn.Module, nn.Module]
) -> None:
    """The check counts one context's caches: those of the previous context must be gone."""
    allocate = specselect.profiling._cache_for
    earlier: list[tuple[int, weakref.ref[torch.Tensor]]] = []

    def spy(handle: Any, batch: int, context: int, *args: Any) -> Any:
        alive = [c for c, ref in earlier if c != context and ref() is not None]
        assert alive == [], f"caches of context {alive} still allocated at context {context}"
        cache, runner = allocate(handle, batch, context, *args)
        earlier.extend((context, weakref.ref(b)) for b in cache.kv.buffers())
        return cache, runner

    monkeypatch.setattr(specselect.profiling, "_cache_for", spy)
    profile(*pair)
    assert {c for c, _ in earlier} == {8, 16}


@pytest.mark.parametrize(
    ("meminfo", "sysconf", "expected"),
    [
        ("MemTotal:  8000 kB\nMemAvailable:    2048 kB\n", None, 2048 * 1024),
        (None, {"SC_AVPHYS_PAGES": 5, "SC_PAGE_SIZE": 4096}, 5 * 4096),
        ("MemTotal:  8000 kB\n", {"SC_AVPHYS_PAGES": 5, "SC_PAGE_SIZE": 4096}, 5 * 4096),
        (None, {}, None),
    ],
    ids=["meminfo", "no meminfo", "no MemAvailable", "neither"],
)
def test_machine_memory_from_meminfo_else_sysconf(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    meminfo: str | None,
    sysconf: dict[str, int] | None,
    expected: int | None,
) -> None:
    path = tmp_path / "meminfo"
    if meminfo is not None:
        path.write_text(meminfo, encoding="utf-8")
    if sysconf is not None:

        def fake_sysconf(name: str) -> int:
            if name not in sysconf:
                raise ValueError(f"unrecognized configuration name {name!r}")
            return sysconf[name]

        monkeypatch.setattr(hf_memory.os, "sysconf", fake_sysconf)
    assert machine_available_bytes(str(path)) == expected


GIB = 1 << 30
V2_JOB = {"job/memory.max": f"{4 * GIB}\n", "job/memory.current": f"{GIB}\n"}
V1_JOB = {
    "memory/ci/memory.limit_in_bytes": f"{3 * GIB}\n",
    "memory/ci/memory.usage_in_bytes": f"{GIB}\n",
}
V1_NO_LIMIT = "9223372036854771712\n"  # what cgroup v1 writes for none, with 4 KiB pages


def fake_cgroups(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[str, str]:
    """A ``/proc/self/cgroup`` holding ``membership`` and a cgroup mount holding ``files``
    (paths relative to the mount); returns both paths."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="ascii")
    cgroups = tmp_path / "self-cgroup"
    cgroups.write_text(membership, encoding="ascii")
    return str(cgroups), str(root)


@pytest.mark.parametrize(
    ("membership", "files", "expected"),
    [
        ("0::/job\n", V2_JOB, 3 * GIB),
        (
            "0::/job\n",
            {**V2_JOB, "job/memory.stat": "active_file 7\ninactive_file 1024\n"},
            3 * GIB + 1024,
        ),
        ("0::/job\n", {**V2_JOB, "job/memory.max": "max\n"}, None),
        (
            "0::/job\n",
            {
                **V2_JOB,
                "job/memory.max": "max\n",
                "memory.max": f"{2 * GIB}\n",
                "memory.current": "0\n",
            },
            2 * GIB,
        ),
        (
            "0::/job/step\n",
            {
                **V2_JOB,
                "job/step/memory.max": f"{8 * GIB}\n",
                "job/step/memory.current": f"{GIB}\n",
            },
            3 * GIB,
        ),
        ("0::/elsewhere\n", {"memory.max": f"{GIB}\n", "memory.current": "0\n"}, GIB),
        ("12:cpu:/x\n4:memory:/ci\n0::/\n", V1_JOB, 2 * GIB),
        (
            "4:memory:/ci\n",
            {**V1_JOB, "memory/ci/memory.stat": "total_inactive_file 5\n"},
            2 * GIB + 5,
        ),
        ("4:memory:/ci\n", {**V1_JOB, "memory/ci/memory.limit_in_bytes": V1_NO_LIMIT}, None),
        ("4:memory:/ci\n", {}, None),
        ("0::/job\n", {"job/memory.max": "lots\n", "job/memory.current": "0\n"}, None),
    ],
    ids=[
        "v2 limit less usage",
        "v2 inactive file cache is reclaimable",
        "v2 no limit",
        "v2 limit of an ancestor",
        "v2 smallest over the path",
        "v2 in a container: its mount's root",
        "v1 memory controller",
        "v1 inactive file cache is reclaimable",
        "v1 no limit",
        "no files",
        "not a number",
    ],
)
def test_cgroup_memory_limits(
    tmp_path: Path, membership: str, files: dict[str, str], expected: int | None
) -> None:
    assert cgroup_available_bytes(*fake_cgroups(tmp_path, membership, files)) == expected


@pytest.mark.parametrize(("limit", "expected"), [(GIB, GIB), (64 * GIB, 8 * GIB), (None, 8 * GIB)])
def test_host_memory_is_the_smaller_of_machine_and_cgroup(
    tmp_path: Path, limit: int | None, expected: int
) -> None:
    """A container or CI runner limited below the machine's available memory gets its limit."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {8 * GIB // 1024} kB\n", encoding="ascii")
    files = {} if limit is None else {"memory.max": f"{limit}\n", "memory.current": "0\n"}
    cgroups, root = fake_cgroups(tmp_path, "0::/\n", files)
    assert host_available_bytes(str(meminfo), cgroups, root) == expected


@pytest.mark.parametrize(("device", "known"), [("cpu", True), ("meta", False)])
def test_available_memory_is_known_on_the_host_only(device: str, known: bool) -> None:
    size = available_bytes(torch.device(device))
    assert (size is not None and size > 0) if known else size is None
