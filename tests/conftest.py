"""Shared fixtures and hypothesis strategies.

Selection tests need inputs where the interesting things happen: exact ties, probability-1
tokens (log q = 0), probability-0 tokens (log q = -inf, which must cut a row), and rows that are
all of these. The strategies below draw most values from a small pool so that ties are the
rule rather than the exception, and the rest from a continuous range.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from specselect.cost import CostModel, CostSample, PassCost
from specselect.estimators import ESTIMATORS, RankingGuard
from specselect.selection import Selection
from specselect.selectors import SELECTORS, TetrisSelector

# A test run gates every change, so it must not pass once and fail on the next run: property
# tests draw their examples from a seed derived from each test's name. `pytest
# --hypothesis-profile=explore` draws new ones (and keeps failures in .hypothesis/). Neither
# profile times anything: a deadline per example, or the health check that generating examples
# is too slow, fails on a slow or loaded machine (CI's is neither this one nor idle), not on
# wrong code.
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("deterministic", derandomize=True, **_UNTIMED)
settings.register_profile("explore", derandomize=False, **_UNTIMED)
settings.load_profile("deterministic")

# Probabilities drawn from a pool, so that equal values (and equal cumulative products) are
# common: 1 gives log q = 0, 0 gives log q = -inf.
_POOL = (1.0, 1.0, 0.5, 0.5, 0.25, 0.9, 0.1, 0.0)
LOGPROB_POOL = tuple(math.log(p) if p > 0 else float("-inf") for p in _POOL)


def logprob_values() -> st.SearchStrategy[float]:
    """One log-probability: from the tie-prone pool, or continuous in [-6, 0]."""
    return st.one_of(
        st.sampled_from(LOGPROB_POOL),
        st.floats(min_value=-6.0, max_value=0.0, allow_nan=False, allow_infinity=False),
    )


@st.composite
def logprob_matrices(
    draw: st.DrawFn, max_rows: int = 4, max_cols: int = 5, min_rows: int = 1, min_cols: int = 0
) -> torch.Tensor:
    """``[B, K]`` float64 log-probabilities with ``min_rows <= B <= max_rows``."""
    rows = draw(st.integers(min_rows, max_rows))
    cols = draw(st.integers(min_cols, max_cols))
    values = draw(st.lists(logprob_values(), min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float64).reshape(rows, cols)


@st.composite
def active_masks(draw: st.DrawFn, rows: int) -> torch.Tensor:
    """``[rows]`` bool."""
    return torch.tensor(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))


def random_logprobs(
    rows: int,
    cols: int,
    *,
    seed: int,
    cut: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``[rows, cols]`` continuous log-probabilities (ties have probability 0).

    With probability ``cut`` per entry the value is ``-inf`` (a row that ends early).
    """
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, cols, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    logprobs = probs.log()
    if cut > 0:
        logprobs[torch.rand(rows, cols, generator=gen, dtype=torch.float64) < cut] = -math.inf
    return logprobs.to(dtype=dtype, device=device)


def _check_prefix_selection(selection: Selection, logprobs: torch.Tensor) -> None:
    """Assert the invariants every chain selection has, whatever selected it.

    ``lengths`` is ``[B]`` int64 and ``mask`` ``[B, K]`` bool on the input's device; the mask
    is the prefix mask of ``lengths``; nothing at or after a ``-inf`` draft position is taken.
    """
    rows, cols = logprobs.shape
    assert isinstance(selection, Selection)
    assert selection.lengths.dtype == torch.int64
    assert selection.mask.dtype == torch.bool
    assert selection.lengths.shape == (rows,)
    assert selection.mask.shape == (rows, cols)
    assert selection.lengths.device == logprobs.device
    assert selection.mask.device == logprobs.device
    lengths = selection.lengths.cpu()
    mask = selection.mask.cpu()
    expected = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.equal(mask, expected), "mask is not the prefix mask of lengths"
    finite_prefix = torch.isfinite(logprobs.cpu()).to(torch.int64).cumprod(dim=1).sum(dim=1)
    assert bool((lengths >= 0).all())
    assert bool((lengths <= finite_prefix).all()), "selected a -inf position or beyond"


@pytest.fixture(scope="session")
def check_prefix_selection() -> Callable[[Selection, torch.Tensor], None]:
    """The invariants of a chain selection, as an assertion function (see its docstring)."""
    return _check_prefix_selection


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    """Run the whole suite on one intra-op thread.

    Every tensor here is tiny: a second thread only adds synchronisation, and on a loaded 2-core
    machine the tiny models' forward passes measured 20-50x slower with two threads.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _plain_terminal() -> Iterator[None]:
    """An 80-column terminal without colours, whatever the machine running the tests has.

    Output the tests read is laid out for the terminal: argparse wraps ``--help`` at
    ``$COLUMNS`` (on a narrow one it breaks hyphenated words such as ``specselect-compare``
    across lines), tqdm trims its bars to it, and Python 3.14's argparse colours help under
    ``$FORCE_COLOR`` even when it is captured. 80 columns is what Python assumes where there is
    no terminal, as in CI.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "80")
        patch.setenv("LINES", "24")
        patch.setenv("PYTHON_COLORS", "0")  # outranks FORCE_COLOR
        patch.setenv("NO_COLOR", "1")
        yield


@pytest.fixture(autouse=True)
def _registries_unchanged() -> Iterator[None]:
    """Whatever a test registers (a doc block's selector, a ``--import``ed module's) is gone
    for the next test in the same worker: parametrized tests read the registries."""
    saved = [dict(registry) for registry in (SELECTORS, ESTIMATORS)]
    yield
    for registry, entries in zip((SELECTORS, ESTIMATORS), saved, strict=True):
        if dict(registry) != entries:
            registry.clear()
            registry.update(entries)


#: What each pass "takes" under :func:`planted_timings`: every term of the formula present.
PLANTED_COSTS = CostModel(
    PassCost(2e-3, per_row=1e-4, per_row_context=2e-6),
    PassCost(8e-3, per_row=2e-4, per_token=3e-4, per_token_context=4e-7),
)


def plant_timings(
    monkeypatch: pytest.MonkeyPatch,
    slowdown: Callable[[Any, int], float] | None = None,
    costs: CostModel = PLANTED_COSTS,
) -> CostModel:
    """Make ``CostModel.measure`` time ``costs`` instead of the machine.

    The passes still run, but the clock of :mod:`specselect.profiling` only moves while one
    does, and by what ``costs`` says it takes, times ``slowdown(shape, call)`` where given: how
    much a busy machine slows the ``call``-th pass (from 0, warm-up included), of pass shape
    ``shape`` (a ``specselect.profiling._Pass``). Without it every sample is exact. Returns
    ``costs``.
    """
    import specselect.profiling as profiling

    clock = [0.0]
    calls = itertools.count()
    run_pass = profiling._Pass.stage

    def timed_pass(shape: profiling._Pass) -> None:
        run_pass(shape)
        tokens = 1 if shape.kind == "draft" else shape.batch * shape.width
        timed = CostSample(shape.kind, shape.batch, tokens, float(shape.context), 0.0)
        call = next(calls)
        clock[0] += costs.predict(timed) * (slowdown(shape, call) if slowdown else 1.0)

    fake_time = type("PlantedTime", (), {"perf_counter": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(profiling._Pass, "stage", timed_pass)
    monkeypatch.setattr(profiling, "time", fake_time)
    return costs


@pytest.fixture
def planted_timings(monkeypatch: pytest.MonkeyPatch) -> CostModel:
    """:func:`plant_timings` on an idle machine: every sample is exact. Real timings of tiny
    models on a shared machine are mostly noise, and a fit of noise can be refused (a
    verification pass "free at context 0") or be arbitrarily far off, which is the machine's
    doing, not the code's. Returns ``PLANTED_COSTS``."""
    return plant_timings(monkeypatch)


def paper_tetris(*args: object, **kwargs: object) -> TetrisSelector:
    """TETRIS exactly as in the paper: ranked by draft probabilities, no estimator, no guard."""
    return TetrisSelector(*args, estimator=None, guard=False, **kwargs)  # type: ignore[arg-type]


class OneDevicePerOp(TorchDispatchMode):
    """Refuses an op (other than a copy) on tensors of two devices, as CUDA does. Tests use
    "meta" to stand in for a GPU, and there an op mixing CPU and meta tensors does not raise:
    it silently does nothing."""

    COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        # 0-dim CPU tensors may join ops on any device (they are read as scalars).
        devices = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1 and func not in self.COPIES:
            raise RuntimeError(f"{func} mixes tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def distrust(guard: RankingGuard) -> None:
    """Make a ``RankingGuard(min_auc=1.0, min_observations=0)`` distrust its scores: one pass
    and one failure at the same score give an AUC of 0.5 < 1. Call it after building the
    selector, whose constructor resets the guard."""
    tie = torch.zeros(1, 2)
    guard.observe(tie, torch.ones(1, 2, dtype=torch.bool), torch.tensor([[True, False]]))
