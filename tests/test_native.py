"""The fused CPU kernel (:mod:`specselect.native`): same masks as the PyTorch kernel, and a
loader that falls back to PyTorch, never to a wrong answer.

The PyTorch kernel (:func:`~specselect.topc.cheapest_mask_torch`) is itself checked against
independent oracles in ``test_tetris.py``; here it is the oracle for the fused one, on the
inputs where the two could disagree: ties (equal costs, ``-0.0`` against ``+0.0``), ``±inf``,
negative costs, budgets beyond what is available, rows cleared by ``keep``, and sizes large
enough for every radix digit to matter.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from conftest import paper_tetris, random_logprobs
from specselect import native, top_c_mask
from specselect.topc import cheapest_counts, cheapest_mask_torch, cheapest_per_row

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# NaN (either sign: -NaN's sign bit would rank it first in a naive code) is never selected.
COST_POOL = [0.0, -0.0, 0.5, 1.0, 3.0, -0.5, -3.0, math.inf, -math.inf, math.nan, -math.nan]


@pytest.fixture(scope="module")
def fused() -> None:
    """Skip where no C compiler is usable, unless CI asks for the kernel (then fail)."""
    if not native.available():
        if os.environ.get("SPECSELECT_REQUIRE_NATIVE") == "1":
            pytest.fail(f"SPECSELECT_REQUIRE_NATIVE=1 but {native.status()}")
        pytest.skip(native.status())


def assert_kernels_agree(costs: torch.Tensor, budget: int, keep: torch.Tensor | None) -> None:
    mask, counts = native.cheapest_mask(costs, budget, keep)
    expected = cheapest_mask_torch(costs, budget, keep=keep)
    assert torch.equal(mask, expected)
    assert torch.equal(counts, expected.sum(dim=1))


@SETTINGS
@given(data=st.data())
def test_fused_kernel_matches_pytorch_kernel(fused: None, data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 6), label="rows")
    cols = data.draw(st.integers(1, 6), label="cols")
    value = st.one_of(st.sampled_from(COST_POOL), st.floats(-50.0, 50.0, allow_nan=False, width=32))
    values = data.draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    costs = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    budget = data.draw(st.integers(0, rows * cols + 2), label="budget")
    keep = data.draw(st.none() | st.lists(st.booleans(), min_size=rows, max_size=rows))
    keep_rows = None if keep is None else torch.tensor(keep)
    assert_kernels_agree(costs, budget, keep_rows)
    assert not native.cheapest_mask(costs, budget, keep_rows)[0][costs.isnan()].any()


@pytest.mark.parametrize("levels", [None, 7, 1])  # continuous, seven values, all equal
@pytest.mark.parametrize("budget_fraction", [0.01, 0.5, 0.75, 1.0])
def test_fused_kernel_matches_at_scale(fused: None, levels: int | None, budget_fraction: float):
    """B = 1024, K = 16 chains: the threshold falls deep inside a radix digit, or in a tie."""
    costs = random_logprobs(1024, 16, seed=3).cumsum(dim=1).neg()
    if levels is not None:
        costs = (costs * levels / costs.max()).round()
    keep = torch.rand(1024, generator=torch.Generator().manual_seed(4)) < 0.9
    budget = int(budget_fraction * costs.numel())
    assert_kernels_agree(costs, budget, None)
    assert_kernels_agree(costs, budget, keep)


def test_fused_kernel_takes_non_contiguous_costs(fused: None) -> None:
    costs = random_logprobs(16, 8, seed=5).cumsum(dim=1).neg().t()  # [8, 16], strided
    assert_kernels_agree(costs, 40, None)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("with_active", [False, True])
def test_selectors_select_the_same_with_either_kernel(fused: None, tree: bool, with_active: bool):
    logprobs = random_logprobs(64, 7, seed=6, cut=0.1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(64, 7) if tree else None
    active = torch.arange(64) % 5 != 0 if with_active else None
    selector = paper_tetris(k=3, extra=2)
    fast = selector.select(logprobs, active, parents=parents)
    with native.disabled():
        slow = selector.select(logprobs, active, parents=parents)
    assert torch.equal(fast.mask, slow.mask)
    assert torch.equal(fast.lengths, slow.lengths)


def test_disabled_block_uses_the_pytorch_kernel(fused: None) -> None:
    """Inside the block the PyTorch kernel serves, and available() and status() say so."""
    costs = torch.rand(4, 4)
    assert native.usable_for(costs, None) and native.available()
    with native.disabled():
        assert not native.usable_for(costs, None) and not native.available()
        assert native.status().startswith("disabled by specselect.native.disabled()")
        with native.disabled():
            assert not native.usable_for(costs, None)
        assert not native.usable_for(costs, None)
    assert native.usable_for(costs, None) and native.available()
    assert "disabled" not in native.status()


@pytest.mark.parametrize(
    "costs",
    [
        torch.rand(4, 4, dtype=torch.float64),
        torch.rand(4, 4, dtype=torch.float16),
        torch.rand(4, 4, device="meta"),
        torch.rand(4, 4, requires_grad=True),
    ],
    ids=["float64", "float16", "meta", "requires_grad"],
)
def test_fused_kernel_serves_only_float32_cpu_eager(costs: torch.Tensor) -> None:
    assert not native.usable_for(costs, None)


# --------------------------------------------------------------------------------------------
# The loader


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[None]:
    """A loader that has not run yet, with an empty cache; the real state comes back after."""
    monkeypatch.setattr(native._State, "loaded", False)
    monkeypatch.setattr(native._State, "function", None)
    monkeypatch.setattr(native._State, "reason", "not loaded yet")
    monkeypatch.setenv("SPECSELECT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECSELECT_NATIVE", raising=False)
    yield


def test_loader_can_be_disabled(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSELECT_NATIVE", "0")
    assert not native.available()
    assert "SPECSELECT_NATIVE=0" in native.status()
    assert not native.usable_for(torch.rand(2, 2), None)


def test_an_unknown_setting_warns_and_keeps_the_default(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPECSELECT_NATIVE", "maybe")
    with caplog.at_level(logging.WARNING, logger=native._LOG.name):
        native.available()
    assert "SPECSELECT_NATIVE='maybe' is neither on" in caplog.text
    assert "disabled" not in native.status()


def garbling_compiler(tmp_path: Path) -> str:
    """A compiler that fails with a message no text encoding decodes (bytes 0xff 0xfe)."""
    script = tmp_path / "garbling-cc"
    script.write_text("#!/bin/sh\nprintf 'error \\377\\376' >&2\nexit 1\n", encoding="utf-8")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "compiler",
    [lambda _: "/nonexistent/specselect-cc", garbling_compiler],
    ids=["missing", "undecodable-message"],
)
def test_loader_falls_back_when_the_compiler_fails(
    fresh_loader: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    compiler: Callable[[Path], str],
) -> None:
    monkeypatch.setenv("CC", compiler(tmp_path))
    with caplog.at_level(logging.WARNING, logger="specselect"):
        assert not native.available()
    assert "using the PyTorch kernel" in native.status()
    assert "using the PyTorch kernel" in caplog.text
    costs = torch.tensor([[0.1, 0.5], [0.2, 0.3]])
    mask, counts = cheapest_counts(costs, 3)  # still right, from the PyTorch kernel
    assert mask.tolist() == [[True, False], [True, True]]
    assert counts.tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="not available"):
        native.cheapest_mask(costs, 3)


def test_loader_builds_once_and_reuses_the_cache(
    fused: None, fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    assert native.available()
    built = list((tmp_path / "cache").glob("cheapest-*.so"))
    assert len(built) == 1 and str(built[0]) in native.status()

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached library should have been reused")

    monkeypatch.setattr(native._State, "loaded", False)
    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    assert native.available()


@pytest.mark.parametrize(
    ("costs", "keep", "name"),
    [
        (torch.rand(4, 4, dtype=torch.float64), None, "costs"),
        (torch.rand(16), None, "costs"),
        (torch.rand(4, 4), torch.ones(4, dtype=torch.int64), "keep"),
        (torch.rand(4, 4), torch.ones(3, dtype=torch.bool), "keep"),
    ],
)
def test_fused_kernel_rejects_what_it_cannot_read(
    fused: None, costs: torch.Tensor, keep: torch.Tensor | None, name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        native.cheapest_mask(costs, 2, keep)


def test_tracing_and_fake_tensors_never_reach_the_fused_kernel(fused: None) -> None:
    """ctypes reads raw memory: fake tensors have none, and tracers would not record the call
    (a traced graph would bake one input's mask in as a constant)."""
    with FakeTensorMode():
        fake = top_c_mask(torch.randn(4, 5), 3)  # would write through a null pointer
    assert isinstance(fake, FakeTensor) and fake.shape == (4, 5)
    traced = make_fx(lambda s: top_c_mask(s, 3))(torch.randn(4, 5))
    batch = torch.randn(2, 4, 5)
    for scores in batch:
        assert torch.equal(traced(scores), top_c_mask(scores, 3))
    mapped = torch.vmap(lambda s: top_c_mask(s, 3))(batch)
    assert torch.equal(mapped, torch.stack([top_c_mask(s, 3) for s in batch]))


class BitCasts(TorchFunctionMode):
    """Counts ``Tensor.view(dtype)`` calls: bit casts."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.view and any(
            isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values())
        ):
            self.count += 1
        return func(*args, **kwargs)


def test_vmap_needs_no_bit_cast() -> None:
    """torch 2.11 has no batching rule for ``Tensor.view(dtype)`` ("Batching rule not
    implemented for aten::view.dtype"): under ``torch.vmap`` the kernels rank without one.
    ``test_ranking_codes_agree_with_float64_kernel`` checks that the masks stay the same."""
    batch = torch.randn(2, 4, 5)
    with native.disabled(), BitCasts() as eager:  # the PyTorch kernel does bit-cast
        top_c_mask(batch[0], 3)
    assert eager.count > 0, "the counter misses bit casts"
    with BitCasts() as mapped:
        torch.vmap(lambda s: top_c_mask(s, 3))(batch)
        torch.vmap(lambda s: cheapest_per_row(s, 2))(batch)
    assert mapped.count == 0


def test_loader_is_thread_safe(fused: None, fresh_loader: None) -> None:
    """Threads that race to the first use all get the kernel, none a half-loaded state."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: native.available(), range(8)))
    assert all(results)


def test_loader_rebuilds_a_corrupt_cached_library(fused: None, fresh_loader: None) -> None:
    library = native._build()  # built, not loaded (a loaded file must not be overwritten)
    library.write_bytes(b"not a shared library")
    assert native.available(), native.status()
    assert str(library) in native.status()
    assert_kernels_agree(torch.rand(8, 4), 10, None)


def test_loader_falls_back_to_cc_when_pythons_compiler_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conda Python names its own cross compiler, absent on most machines."""
    monkeypatch.delenv("CC", raising=False)
    real = native.sysconfig.get_config_var
    monkeypatch.setattr(
        native.sysconfig,
        "get_config_var",
        lambda name: "x86_64-conda-linux-gnu-cc -pthread" if name == "CC" else real(name),
    )
    monkeypatch.setattr(
        native.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "gcc" else None
    )
    assert native._compiler() == ["gcc"]
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(OSError, match="no C compiler"):
        native._compiler()
