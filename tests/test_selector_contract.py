"""The contract every registered selector keeps, and the no-host-sync checks.

Parametrized over ``specselect.selectors.SELECTORS`` itself: a selector registered without an
entry in ``SELECTOR_KWARGS`` fails here, so no new selector skips the contract.

No host sync is checked three ways: ``torch.compile(..., fullgraph=True)`` (a data-dependent
read of a tensor is a graph break, which fullgraph turns into an error); running on the ``meta``
device (which has no data to read back); and, when CUDA is present, CUDA's sync debug mode.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from conftest import random_logprobs
from specselect.selection import Selection, Selector
from specselect.selectors import SELECTORS

# Small, valid constructor arguments for every registered selector.
SELECTOR_KWARGS: dict[str, dict[str, object]] = {
    "tetris": {"k": 2, "extra": 2},
    "fixed": {"k": 3},
    "dsd": {"max_k": 4},
    "threshold": {"max_k": 4, "threshold": 0.3},
    "heuristic": {"k0": 2, "max_k": 5},
}
NAMES = sorted(SELECTORS)
BATCH = 5
# Constructor parameters that must be >= 0 (or >= 1) and those that are probabilities.
NON_NEGATIVE_PARAMS = ("k", "extra", "budget", "max_k", "k0", "interval", "context")
PROBABILITY_PARAMS = ("threshold", "alpha0")
ACTIVE = torch.tensor([True, False, True, True, False])


def make(name: str) -> Selector:
    """A fresh selector built from the table (fails for a selector missing from it)."""
    if name not in SELECTOR_KWARGS:
        pytest.fail(f"selector {name!r} is registered but has no entry in SELECTOR_KWARGS")
    return SELECTORS[name](**SELECTOR_KWARGS[name])


def drafted(selector: Selector, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """``[BATCH, K]`` float32 log-probs for the selector's window, with some ``-inf`` cuts.

    Row 0 is cut after its first token and then continues with certain (log q = 0) tokens, which
    a selector must still not take.
    """
    width = max(selector.draft_length(BATCH), 3)
    logprobs = random_logprobs(BATCH, width, seed=seed, cut=0.15)
    logprobs[0] = 0.0
    logprobs[0, 1] = -math.inf
    logprobs[3] = -math.inf
    return logprobs.to(device)


def accepted_for(selection: Selection, seed: int) -> torch.Tensor:
    """``[B]`` int64 accepted counts between 0 and the selected lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = selection.lengths.cpu()
    fraction = torch.rand(lengths.shape, generator=gen, dtype=torch.float64)
    return (lengths * fraction).floor().to(torch.int64).to(selection.lengths.device)


def test_every_registered_selector_has_kwargs() -> None:
    missing = sorted(set(SELECTORS) - set(SELECTOR_KWARGS))
    assert not missing, f"add constructor arguments for {missing} to SELECTOR_KWARGS"


# --------------------------------------------------------------------------------------------
# The contract


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_active", [False, True])
def test_contract(name: str, with_active: bool, check_prefix_selection) -> None:
    """Valid prefix selections over a few steps with feedback in between."""
    selector = make(name)
    active = ACTIVE if with_active else None
    for step in range(3):
        logprobs = drafted(selector, seed=step)
        selection = selector.select(logprobs, active)
        check_prefix_selection(selection, logprobs)
        assert int(selection.lengths[0]) <= 1, "took a token after a -inf"
        assert int(selection.lengths[3]) == 0, "took a -inf token"
        if active is not None:
            assert not bool(selection.mask[~active].any()), "selected an inactive row"
        selector.update(selection, accepted_for(selection, step))
    selector.reset()


@pytest.mark.parametrize("name", NAMES)
def test_bad_logprobs_raise(name: str) -> None:
    selector = make(name)
    good = drafted(selector, seed=0)
    cases: list[tuple[object, type[Exception]]] = [
        (good[0], ValueError),  # rank 1
        (good.unsqueeze(0), ValueError),  # rank 3
        (torch.zeros(BATCH, 3, dtype=torch.int64), TypeError),
        (good.tolist(), TypeError),
    ]
    for bad_value in (math.nan, math.inf, 0.5):
        bad = good.clone()
        bad[1, 0] = bad_value
        cases.append((bad, ValueError))
    for value, error in cases:
        with pytest.raises(error, match="draft_logprobs"):
            selector.select(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("active", "error"),
    [
        (torch.ones(BATCH + 1, dtype=torch.bool), ValueError),
        (torch.ones(BATCH, 1, dtype=torch.bool), ValueError),
        (torch.ones(BATCH, dtype=torch.int64), TypeError),
        ([True] * BATCH, TypeError),
    ],
    ids=["long", "rank2", "int64", "list"],
)
def test_bad_active_raises(name: str, active: object, error: type[Exception]) -> None:
    selector = make(name)
    with pytest.raises(error, match="active"):
        selector.select(drafted(selector, seed=0), active)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("accepted", "error"),
    [
        (torch.zeros(BATCH + 1, dtype=torch.int64), ValueError),
        (torch.zeros(BATCH, dtype=torch.float32), TypeError),
        (torch.full((BATCH,), -1, dtype=torch.int64), ValueError),
    ],
    ids=["batch", "float", "negative"],
)
def test_bad_feedback_raises(name: str, accepted: torch.Tensor, error: type[Exception]) -> None:
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    with pytest.raises(error, match="num_accepted"):
        selector.update(selection, accepted)


def _bad_constructor_cases() -> list[tuple[str, str, object]]:
    """(selector, parameter, bad value) for every checked parameter a selector takes."""
    cases = []
    for name in NAMES:
        params = inspect.signature(SELECTORS[name]).parameters
        cases += [(name, p, -1) for p in NON_NEGATIVE_PARAMS if p in params]
        cases += [(name, p, v) for p in PROBABILITY_PARAMS if p in params for v in (-0.1, 1.5)]
    return cases


@pytest.mark.parametrize(("name", "param", "value"), _bad_constructor_cases())
def test_constructor_rejects_out_of_range(name: str, param: str, value: object) -> None:
    kwargs = {**SELECTOR_KWARGS.get(name, {}), param: value}
    with pytest.raises(ValueError, match=param):
        SELECTORS[name](**kwargs)


def test_every_selector_has_a_checked_parameter() -> None:
    """Guards the test above against silently covering nothing for a selector that has
    parameters: name its range-checked ones in NON_NEGATIVE_PARAMS or PROBABILITY_PARAMS."""
    covered = {name for name, _, _ in _bad_constructor_cases()}
    with_params = {n for n in NAMES if inspect.signature(SELECTORS[n]).parameters}
    assert with_params <= covered, f"no range check tested for {sorted(with_params - covered)}"


# --------------------------------------------------------------------------------------------
# No host sync


@pytest.mark.parametrize("name", ["tetris", "fixed"])
def test_compiles_without_graph_breaks(name: str) -> None:
    """fullgraph=True fails on any graph break (a host read of a tensor value is one).

    Backend "eager": Dynamo alone finds the graph breaks; no code generation keeps this quick.
    """
    selector = make(name)
    compiled = torch.compile(selector.select, fullgraph=True, backend="eager")
    logprobs = drafted(selector, seed=1)
    for active in (None, ACTIVE):
        got = compiled(logprobs, active)
        want = selector.select(logprobs, active)
        assert torch.equal(got.lengths, want.lengths)
        assert torch.equal(got.mask, want.mask)


@pytest.mark.parametrize("name", NAMES)
def test_runs_on_meta_tensors(name: str) -> None:
    """The meta device holds no data: any host read of a value would raise."""
    selector = make(name)
    logprobs = drafted(selector, seed=2, device="meta")
    rows, width = logprobs.shape
    for active in (None, ACTIVE.to("meta")):
        selection = selector.select(logprobs, active)
        assert selection.lengths.device.type == "meta"
        assert selection.lengths.shape == (rows,)
        assert selection.lengths.dtype == torch.int64
        assert selection.mask.shape == (rows, width)
        assert selection.mask.dtype == torch.bool
        selector.update(selection, torch.zeros(rows, dtype=torch.int64, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync check: needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_no_sync_on_cuda(name: str) -> None:
    """select and update under CUDA's sync debug mode ("error": any sync raises)."""
    selector = make(name)
    logprobs = drafted(selector, seed=3, device="cuda")
    active = ACTIVE.cuda()
    selector.select(logprobs, active)  # warm-up: lazy CUDA init and cached constants
    accepted = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for act in (None, active):
            selection = selector.select(logprobs, act)
            selector.update(selection, accepted)
    finally:
        torch.cuda.set_sync_debug_mode("default")
