"""TETRIS, fixed-window and the top-C kernel: optimality, exact counts, tie order, edge cases.

Oracles are independent of the code under test: a brute force over every prefix allocation
(optimality), a plain Python sort by (score desc, column, row) (the exact mask, ties included),
hand-worked tie cases, and the reference formulation ``cumsum -> topk(C) -> per-row count``
(on tie-free inputs, where ``topk``'s arbitrary tie order cannot matter).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import (
    active_masks,
    distrust,
    logprob_matrices,
    logprob_values,
    paper_tetris,
    random_logprobs,
)
from specselect import FixedWindowSelector, native, top_c_mask
from specselect._checks import trusted_values
from specselect.cost import CostModel, PassCost
from specselect.estimators import RankingGuard
from specselect.selectors import TetrisSelector
from specselect.selectors.goodput import SPREAD_DECAY, GoodputPlanner, StepTimes, default_costs
from specselect.topc import cheapest_mask, cheapest_mask_torch, cheapest_per_row
from specselect.tree import chain_parents, path_sums

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOW_PRECISION = [torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------------------------
# Oracles


def cumulative_probs(logprobs: torch.Tensor) -> list[list[float]]:
    """``exp`` of the cumulative log-probabilities, as float64 Python floats."""
    scores = torch.cumsum(logprobs, dim=1).to(torch.float64)
    return scores.exp().tolist()


def finite_prefix(logprobs: torch.Tensor) -> list[int]:
    """Per row: positions before the first ``-inf``."""
    out = []
    for row in logprobs.tolist():
        n = 0
        while n < len(row) and row[n] > -math.inf:
            n += 1
        out.append(n)
    return out


def brute_force_optimum(probs: list[list[float]], available: list[int], budget: int) -> float:
    """Best sum of prefix probabilities over every allocation with total <= budget."""
    best = 0.0
    for lengths in itertools.product(*(range(a + 1) for a in available)):
        if sum(lengths) <= budget:
            value = sum(sum(row[:n]) for row, n in zip(probs, lengths, strict=True))
            best = max(best, value)
    return best


def sorted_order_mask(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The first ``budget`` entries by (score desc, column asc, row asc), ``-inf`` never."""
    rows, cols = scores.shape
    values = scores.to(torch.float64).tolist()
    entries = [
        (-values[i][j], j, i) for i in range(rows) for j in range(cols) if values[i][j] > -math.inf
    ]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for _, j, i in sorted(entries)[:budget]:
        mask[i, j] = True
    return mask


def reference_lengths(logprobs: torch.Tensor, budget: int) -> torch.Tensor:
    """The reference formulation: cumsum -> flattened topk(C) -> per-row count."""
    rows, cols = logprobs.shape
    scores = torch.cumsum(logprobs.to(torch.float64), dim=1).reshape(-1)
    values, index = scores.topk(min(budget, scores.numel()))
    taken = index[values > -math.inf]
    return torch.bincount(taken // cols, minlength=rows)


def objective(selection_mask: torch.Tensor, probs: list[list[float]]) -> float:
    return sum(
        p
        for row, sel in zip(probs, selection_mask.tolist(), strict=True)
        for p, s in zip(row, sel, strict=True)
        if s
    )


# --------------------------------------------------------------------------------------------
# Optimality and exact count


@SETTINGS
@given(data=st.data(), logprobs=logprob_matrices(max_rows=4, max_cols=5))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tetris_is_optimal_and_exact(
    data: st.DataObject, logprobs: torch.Tensor, dtype: torch.dtype, check_prefix_selection
) -> None:
    """Objective equals the brute-force optimum; exactly min(C, available) tokens, prefixes.

    float64 runs the threshold-and-tie-pass kernel, float32 the ranking-code kernel; in both the
    objective is measured on the scores the selector saw (float32 cumsum for float32 inputs).
    """
    logprobs = logprobs.to(dtype)
    rows, cols = logprobs.shape
    budget = data.draw(st.integers(0, rows * cols + 2), label="budget")
    selection = paper_tetris(k=1, extra=0, budget=budget).select(logprobs)

    check_prefix_selection(selection, logprobs)
    available = finite_prefix(logprobs)
    assert int(selection.lengths.sum()) == min(budget, sum(available))
    probs = cumulative_probs(logprobs)
    best = brute_force_optimum(probs, available, budget)
    assert objective(selection.mask, probs) == pytest.approx(best, rel=1e-9, abs=1e-300)


@SETTINGS
@given(data=st.data(), logprobs=logprob_matrices(max_rows=5, max_cols=6))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_top_c_mask_matches_sorted_order(
    data: st.DataObject, logprobs: torch.Tensor, dtype: torch.dtype
) -> None:
    """The exact mask, ties included: first C by (score desc, column, row)."""
    scores = torch.cumsum(logprobs, dim=1).to(dtype)
    budget = data.draw(st.integers(0, scores.numel() + 2), label="budget")
    assert torch.equal(top_c_mask(scores, budget), sorted_order_mask(scores, budget))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-if-available", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_top_c_mask_takes_strided_scores(fused: bool, dtype: torch.dtype) -> None:
    """A transposed (non-contiguous) view selects like its contiguous copy."""
    scores = random_logprobs(6, 9, seed=11).cumsum(dim=1).t().to(dtype)  # [9, 6], strided
    with contextlib.nullcontext() if fused else native.disabled():
        strided = top_c_mask(scores, 20)
    assert torch.equal(strided, sorted_order_mask(scores.contiguous(), 20))


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_top_c_mask_any_scores(data: st.DataObject, dtype: torch.dtype) -> None:
    """General scores: any sign, +inf (always first) and -inf (never), signed zeros."""
    rows = data.draw(st.integers(1, 4), label="rows")
    cols = data.draw(st.integers(1, 5), label="cols")
    pool = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, math.inf, -math.inf])
    value = st.one_of(pool, st.floats(-1e3, 1e3, allow_nan=False))
    values = data.draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    scores = torch.tensor(values, dtype=torch.float64).reshape(rows, cols).to(dtype)
    budget = data.draw(st.integers(0, rows * cols + 1), label="budget")
    assert torch.equal(top_c_mask(scores, budget), sorted_order_mask(scores, budget))


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("nonnegative", [True, False])
def test_ranking_codes_agree_with_float64_kernel(data: st.DataObject, nonnegative: bool) -> None:
    """The float32 ranking-code kernel, the float64 tie-pass kernel and the sort-based codes
    that serve functorch transforms (``torch.vmap``, where ``view(dtype)`` has no batching rule
    on torch 2.11) give the same masks, per batch and per row."""
    rows = data.draw(st.integers(1, 5), label="rows")
    cols = data.draw(st.integers(1, 6), label="cols")
    pool = [0.0, 0.5, 1.0, 3.0, math.inf, -math.inf]
    pool += [] if nonnegative else [-0.0, -0.5, -3.0]
    low = 0.0 if nonnegative else -50.0
    value = st.one_of(st.sampled_from(pool), st.floats(low, 50.0, allow_nan=False, width=32))
    values = data.draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    costs = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    budget = data.draw(st.integers(0, rows * cols), label="budget")
    fast = cheapest_mask_torch(costs, budget, nonnegative=nonnegative)
    exact = cheapest_mask(costs.to(torch.float64), budget)
    assert torch.equal(fast, exact)
    assert torch.equal(cheapest_mask(costs, budget, nonnegative=nonnegative), exact)  # fused
    mapped = torch.vmap(lambda c: cheapest_mask_torch(c, budget, nonnegative=nonnegative))
    assert torch.equal(mapped(costs.unsqueeze(0))[0], fast)
    count = data.draw(st.integers(0, cols), label="count")
    per_row = cheapest_per_row(costs, count)
    assert torch.equal(
        torch.vmap(lambda c: cheapest_per_row(c, count))(costs.unsqueeze(0))[0], per_row
    )


@pytest.mark.parametrize(
    ("costs", "cheapest"),
    [
        ([1.0 + 1e-10, 1.0, 5.0], 1),  # the first two are one float32
        ([2e-46, 1e-46, 1.0], 1),  # both below float32's smallest: 0
        ([1e39, 2e39, math.inf], 0),  # beyond float32's range: +inf, never selected
    ],
    ids=["float32-tie", "float32-underflow", "float32-overflow"],
)
def test_cheapest_per_row_ranks_float64_costs_in_float64(costs: list[float], cheapest: int) -> None:
    """Costs that float32 cannot tell apart (or cannot hold) keep their float64 order."""
    mask = cheapest_per_row(torch.tensor([costs], dtype=torch.float64), 1)
    assert mask.tolist() == [[j == cheapest for j in range(len(costs))]]


@SETTINGS
@given(data=st.data())
def test_cheapest_per_row_matches_sorted_order(data: st.DataObject) -> None:
    """Each row's ``count`` cheapest costs (NaN of either sign and +inf never), ties by column,
    from values that are close, equal, signed zeros, infinite or beyond float32's range, in
    float64, float32 and float16 (each ranked as its own values)."""
    rows = data.draw(st.integers(1, 4), label="rows")
    cols = data.draw(st.integers(1, 6), label="cols")
    near = [1.0, 1.0 + 2**-40, 1.0 - 2**-40, 1e-46, 2e-46, 1e39, -1e39, 0.0, -0.0]
    pool = st.sampled_from([*near, math.inf, -math.inf, math.nan, -math.nan])
    value = st.one_of(pool, st.floats(-50.0, 50.0, allow_nan=False))
    values = data.draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.float16]))
    costs = torch.tensor(values, dtype=torch.float64).reshape(rows, cols).to(dtype)
    count = data.draw(st.integers(0, cols + 1), label="count")
    exact = costs.to(torch.float64)
    expected = torch.cat([sorted_order_mask(-row.unsqueeze(0), count) for row in exact])
    assert torch.equal(cheapest_per_row(costs, count), expected)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_top_c_mask_is_closed_on_trees(data: st.DataObject) -> None:
    """Tree scores (a node's parent sits in a lower column): the mask keeps every ancestor."""
    rows = data.draw(st.integers(1, 3), label="rows")
    nodes = data.draw(st.integers(1, 7), label="nodes")
    parents = [data.draw(st.integers(-1, j - 1), label=f"parent{j}") for j in range(nodes)]
    logq = data.draw(st.lists(logprob_values(), min_size=rows * nodes, max_size=rows * nodes))
    logq_t = torch.tensor(logq, dtype=torch.float32).reshape(rows, nodes)
    scores = torch.empty(rows, nodes)
    for j, parent in enumerate(parents):
        scores[:, j] = logq_t[:, j] + (scores[:, parent] if parent >= 0 else 0.0)
    budget = data.draw(st.integers(0, rows * nodes), label="budget")
    mask = top_c_mask(scores, budget)
    assert int(mask.sum()) == min(budget, int((scores > -math.inf).sum()))
    for j, parent in enumerate(parents):
        if parent >= 0:
            assert bool((~mask[:, j] | mask[:, parent]).all()), "a node without its parent"


# --------------------------------------------------------------------------------------------
# Hand-worked ties

HALF = math.log(0.5)
NEG = -math.inf
TIE_CASES = {
    # Identical rows: the best column fills first (rows 0, 1, 2), then column 1 from row 0.
    "all_equal": ([[HALF] * 3] * 3, 4, [[1, 1, 0], [1, 0, 0], [1, 0, 0]]),
    # Probability-1 tokens: every score is 0.
    "prob_one": ([[0.0] * 3] * 2, 3, [[1, 1, 0], [1, 0, 0]]),
    # A zero probability cuts row 0 after one token even though later scores would tie.
    "prob_zero": ([[0.0, NEG, 0.0], [0.0, 0.0, 0.0]], 4, [[1, 0, 0], [1, 1, 1]]),
    "prob_zero_small_budget": ([[0.0, NEG, 0.0], [0.0, 0.0, 0.0]], 2, [[1, 0, 0], [1, 0, 0]]),
    # Three certain tokens, then five tied at 0.5 for two slots: (1, 0) is shallowest; of the
    # column-1 ties (0, 1) and (1, 1), row 0 wins.
    "tie_at_threshold": (
        [[0.0, HALF, HALF], [HALF, 0.0, 0.0], [0.0, 0.0, HALF]],
        5,
        [[1, 1, 0], [1, 0, 0], [1, 1, 0]],
    ),
    # Row 0 all certain; the budget runs out in column 1 among the rows with a 1.
    "deep_row_first": (
        [[0.0] * 4, [0.0, 0.0, NEG, 0.0], [HALF] * 4],
        5,
        [[1, 1, 1, 0], [1, 1, 0, 0], [0] * 4],
    ),
}


@pytest.mark.parametrize("case", sorted(TIE_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW_PRECISION])
def test_tie_order_exact_mask(case: str, dtype: torch.dtype) -> None:
    logprobs, budget, expected = TIE_CASES[case]
    logprobs = torch.tensor(logprobs, dtype=dtype)
    selection = paper_tetris(k=1, budget=budget).select(logprobs)
    expected_mask = torch.tensor(expected, dtype=torch.bool)
    assert torch.equal(selection.mask, expected_mask)
    assert torch.equal(selection.lengths, expected_mask.sum(dim=1))


# --------------------------------------------------------------------------------------------
# Inactive rows


@SETTINGS
@given(data=st.data(), logprobs=logprob_matrices(max_rows=5, max_cols=5))
@pytest.mark.parametrize("explicit_budget", [False, True])
def test_inactive_rows_take_no_budget(
    data: st.DataObject, logprobs: torch.Tensor, explicit_budget: bool
) -> None:
    """With an active mask, the result equals running on the active rows alone.

    Default budget: ``k * num_active``; explicit budget: the same ``C`` for the active rows.
    """
    rows, cols = logprobs.shape
    active = data.draw(active_masks(rows), label="active")
    k = data.draw(st.integers(0, cols + 1), label="k")
    budget = data.draw(st.integers(0, rows * cols + 1), label="budget") if explicit_budget else None
    selector = paper_tetris(k=k, extra=2, budget=budget)
    full = selector.select(logprobs.to(torch.float32), active)
    alone = selector.select(logprobs[active].to(torch.float32))
    assert torch.equal(full.lengths[active], alone.lengths)
    assert torch.equal(full.mask[active], alone.mask)
    assert int(full.lengths[~active].abs().sum()) == 0
    assert not bool(full.mask[~active].any())


def test_default_budget_is_k_times_active_rows() -> None:
    logprobs = torch.zeros(4, 6)  # all certain: every row could take all 6
    active = torch.tensor([True, False, True, False])
    selection = paper_tetris(k=2, extra=4).select(logprobs, active)
    assert selection.lengths.tolist() == [2, 0, 2, 0]


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_default_budget_equals_explicit(rows: int, k: int) -> None:
    logprobs = random_logprobs(rows, k + 2, seed=rows * 10 + k, cut=0.1)
    default = paper_tetris(k=k, extra=2).select(logprobs)
    explicit = paper_tetris(k=k, extra=2, budget=k * rows).select(logprobs)
    assert torch.equal(default.mask, explicit.mask)


# --------------------------------------------------------------------------------------------
# Edge cases


def test_budget_larger_than_available_takes_everything_available() -> None:
    logprobs = torch.tensor([[-0.1, NEG, -0.2], [-0.3, -0.4, -0.5], [NEG, -0.1, -0.1]])
    selection = paper_tetris(k=1, budget=100).select(logprobs)
    assert selection.lengths.tolist() == [1, 3, 0]


@pytest.mark.parametrize("shape", [(3, 4), (1, 5), (5, 0), (0, 3)])
def test_zero_budget_selects_nothing(shape: tuple[int, int]) -> None:
    selection = paper_tetris(k=0, extra=3).select(torch.zeros(shape))
    assert selection.mask.shape == shape
    assert not bool(selection.mask.any())
    assert selection.lengths.shape == (shape[0],)


def test_single_row() -> None:
    logprobs = torch.tensor([[-0.1, -0.2, -0.3, -0.4]])
    assert paper_tetris(k=2, extra=2).select(logprobs).lengths.tolist() == [2]


@pytest.mark.parametrize("with_active", [False, True])
def test_empty_draft_window(with_active: bool) -> None:
    active = torch.tensor([True, False, True]) if with_active else None
    selection = paper_tetris(k=3, extra=0).select(torch.zeros(3, 0), active)
    assert selection.mask.shape == (3, 0)
    assert selection.lengths.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_inputs_match_float32(dtype: torch.dtype) -> None:
    """16-bit inputs are ranked in float32 (chain_scores upcasts): same as upcasting first."""
    logprobs = random_logprobs(16, 8, seed=3, cut=0.05).to(dtype)
    selector = paper_tetris(k=4, extra=4)
    active = torch.arange(16) % 5 != 0
    for act in (None, active):
        low = selector.select(logprobs, act)
        high = selector.select(logprobs.to(torch.float32), act)
        assert torch.equal(low.mask, high.mask)
        assert low.lengths.dtype == torch.int64


def test_select_leaves_the_input_untouched() -> None:
    logprobs = random_logprobs(4, 5, seed=0, cut=0.1)
    before = logprobs.clone()
    paper_tetris(k=2, extra=3).select(logprobs, torch.tensor([True, False, True, True]))
    assert torch.equal(logprobs, before)


# --------------------------------------------------------------------------------------------
# Reference formulation


@pytest.mark.parametrize(
    ("rows", "cols", "budget"),
    [(1, 4, 2), (8, 8, 32), (64, 8, 256), (33, 16, 12 * 33), (16, 5, 200), (64, 16, 1)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cut", [0.0, 0.1])
def test_matches_reference_formulation_without_ties(
    rows: int, cols: int, budget: int, dtype: torch.dtype, cut: float
) -> None:
    logprobs = random_logprobs(rows, cols, seed=rows * cols + budget, cut=cut, dtype=dtype)
    scores = torch.cumsum(logprobs, dim=1)
    finite = scores[scores > -math.inf]
    assert finite.unique().numel() == finite.numel(), "precondition: no ties"
    selection = paper_tetris(k=1, budget=budget).select(logprobs)
    assert torch.equal(selection.lengths, reference_lengths(logprobs, budget))


# --------------------------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"k": -1}, ValueError, "k"),
        ({"k": 2, "extra": -1}, ValueError, "extra"),
        ({"k": 2, "budget": -3}, ValueError, "budget"),
        ({"k": 2.5}, TypeError, "k"),
        ({"k": True}, TypeError, "k"),
    ],
)
def test_tetris_rejects_bad_arguments(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        paper_tetris(**kwargs)


@pytest.mark.parametrize(
    ("scores", "budget", "error", "name"),
    [
        (torch.zeros(2, 2), -1, ValueError, "budget"),
        (torch.zeros(2, 2), 1.0, TypeError, "budget"),
        (torch.zeros(4), 1, ValueError, "scores"),
        (torch.zeros(2, 2, dtype=torch.int64), 1, TypeError, "scores"),
        ([[0.0]], 1, TypeError, "scores"),
        (torch.tensor([[0.5, math.nan]]), 1, ValueError, "scores contains NaN"),
    ],
)
def test_top_c_mask_rejects_bad_arguments(scores, budget, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        top_c_mask(scores, budget)


@pytest.mark.parametrize(
    ("k", "extra", "budget", "active", "depth"),
    [
        (3, 2, None, 7, 5),  # k + extra
        (3, 2, None, 2, 5),
        (3, 2, None, 1, 3),  # one row, C = k: standard SD's window
        (1, 4, None, 2, 2),  # C = k * active = 2
        (3, 2, 4, 7, 4),  # an absolute budget below k + extra
        (3, 2, 9, 1, 5),
        (0, 2, None, 5, 0),  # C = 0: nothing could be verified
    ],
)
def test_tetris_drafts_no_deeper_than_its_budget(
    k: int, extra: int, budget: int | None, active: int, depth: int
) -> None:
    assert paper_tetris(k=k, extra=extra, budget=budget).draft_length(active) == depth


@SETTINGS
@given(
    data=st.data(),
    logprobs=logprob_matrices(max_rows=4, max_cols=7),
    k=st.integers(0, 3),
    budget=st.none() | st.integers(0, 6),
)
def test_tokens_beyond_the_draft_length_are_never_selected(
    data: st.DataObject, logprobs: torch.Tensor, k: int, budget: int | None
) -> None:
    """Why :meth:`TetrisSelector.draft_length` may stop below ``k + extra``: the selection of
    the full draft never reaches past it, so the shorter draft selects the same tokens."""
    rows, width = logprobs.shape
    assume(width >= k)
    active = data.draw(active_masks(rows))
    selector = paper_tetris(k=k, extra=width - k, budget=budget)
    depth = selector.draft_length(int(active.sum()))
    full = selector.select(logprobs, active).mask  # [B, W]
    assert not full[:, depth:].any()
    short = selector.select(logprobs[:, :depth].contiguous(), active).mask  # [B, depth]
    assert torch.equal(short, full[:, :depth])


# --------------------------------------------------------------------------------------------
# Fixed window


@SETTINGS
@given(data=st.data(), logprobs=logprob_matrices(max_rows=5, max_cols=6))
def test_fixed_window_lengths(data: st.DataObject, logprobs: torch.Tensor) -> None:
    """lengths = min(k, available) for active rows, 0 for inactive ones."""
    rows, cols = logprobs.shape
    k = data.draw(st.integers(0, cols + 2), label="k")
    active = data.draw(st.one_of(st.none(), active_masks(rows)), label="active")
    selection = FixedWindowSelector(k).select(logprobs, active)
    expected = [min(k, a) for a in finite_prefix(logprobs)]
    if active is not None:
        expected = [n if on else 0 for n, on in zip(expected, active.tolist(), strict=True)]
    assert selection.lengths.tolist() == expected
    assert FixedWindowSelector(k).draft_length(rows) == k


# --------------------------------------------------------------------------------------------
# The goodput budget


class PassCosts:
    """A cost model by hand (duck-typed: the two methods the goodput budget calls, and
    ``step_time`` for replay), with a knee: a verification pass costs ``fixed + per_row * rows``
    up to ``knee`` tokens (memory-bound: more tokens are free), then ``beyond`` per token more.
    ``knee=0`` makes it linear in the tokens."""

    def __init__(
        self, fixed: float, per_row: float, knee: float, beyond: float, draft: float
    ) -> None:
        self.fixed, self.per_row, self.knee, self.beyond, self.draft = (
            fixed,
            per_row,
            knee,
            beyond,
            draft,
        )

    def draft_time(self, batch: int, tokens: int, context: float = 0.0) -> float:
        return tokens * self.draft * (1 + 0.01 * batch)

    def verify_time(self, batch: int, tokens: int, context: float = 0.0) -> float:
        return self.fixed + self.per_row * batch + self.beyond * max(0.0, tokens - self.knee)

    def step_time(self, batch: int, window: int, verified: int, context: float = 0.0) -> float:
        return self.draft_time(batch, window) + self.verify_time(batch, verified + batch)


COST_SHAPES = {
    # Verification dominated by its fixed cost: verify nearly everything.
    "flat": PassCosts(fixed=10.0, per_row=0.1, knee=0, beyond=0.01, draft=1.0),
    # Every token costs about as much as its chance is worth: verify the likely ones.
    "steep": PassCosts(fixed=1.0, per_row=0.1, knee=0, beyond=0.8, draft=0.5),
    # Free up to 12 tokens, then expensive: C stops at the knee unless a token is very likely.
    "knee": PassCosts(fixed=2.0, per_row=0.05, knee=12, beyond=1.5, draft=0.2),
    # Drafting dominates: the budget matters little, the draft passes are sunk.
    "draft-heavy": PassCosts(fixed=0.5, per_row=0.0, knee=3, beyond=0.2, draft=5.0),
}


def goodput_tetris(costs: object, k: int = 2, extra: int = 2, **kwargs: object) -> TetrisSelector:
    """The goodput budget on the paper's scores (the draft probabilities, exactly)."""
    return paper_tetris(k=k, extra=extra, budget="goodput", cost_model=costs, **kwargs)


def brute_force_goodput(
    probs: list[list[float]], available: list[int], active: list[bool], passes: int, costs
) -> tuple[float, int]:
    """(best goodput, smallest total C reaching it) over every prefix allocation of the active
    rows, straight from the objective: (sum of selected probabilities + a) / step time."""
    rows = [i for i, on in enumerate(active) if on]
    a = len(rows)
    if a == 0:
        return 0.0, 0
    draft = costs.draft_time(a, passes) if passes else 0.0
    best, best_c = -math.inf, 0
    for lengths in itertools.product(*(range(available[i] + 1) for i in rows)):
        c = sum(lengths)
        gained = sum(sum(probs[i][:n]) for i, n in zip(rows, lengths, strict=True))
        value = (gained + a) / (draft + costs.verify_time(a, c + a))
        if value > best * (1 + 1e-12) or (value >= best * (1 - 1e-12) and c < best_c):
            best, best_c = max(best, value), c
    return best, best_c


def goodput_of(
    mask: torch.Tensor, probs: list[list[float]], active: list[bool], passes: int, costs
):
    a = sum(active)
    draft = costs.draft_time(a, passes) if passes else 0.0
    return (objective(mask, probs) + a) / (draft + costs.verify_time(a, int(mask.sum()) + a))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), logprobs=logprob_matrices(max_rows=4, max_cols=4, min_cols=1))
@pytest.mark.parametrize("shape", sorted(COST_SHAPES))
def test_goodput_budget_matches_brute_force(
    data: st.DataObject, logprobs: torch.Tensor, shape: str, check_prefix_selection
) -> None:
    """The chosen C is the brute-force best over every allocation (the smallest on ties); the
    selection is exactly the C best entries in the top-C kernel's order (ties included), so
    exact count and prefixes; inactive rows take nothing and do not count."""
    costs = COST_SHAPES[shape]
    rows, cols = logprobs.shape
    active = data.draw(st.one_of(st.none(), active_masks(rows)), label="active")
    on = [True] * rows if active is None else active.tolist()
    selection = goodput_tetris(costs).select(logprobs, active)

    check_prefix_selection(selection, logprobs)
    probs = cumulative_probs(logprobs)
    best, best_c = brute_force_goodput(probs, finite_prefix(logprobs), on, cols, costs)
    assert int(selection.lengths.sum()) == best_c
    assert goodput_of(selection.mask, probs, on, cols, costs) == pytest.approx(best, rel=1e-9)
    scores = torch.cumsum(logprobs, dim=1).masked_fill(~torch.tensor(on).unsqueeze(1), NEG)
    assert torch.equal(selection.mask, sorted_order_mask(scores, best_c))
    assert torch.equal(selection.mask, top_c_mask(scores, best_c))


@pytest.mark.parametrize("shape", sorted(COST_SHAPES))
@pytest.mark.parametrize("seed", range(4))
def test_goodput_budget_on_trees_matches_brute_force(shape: str, seed: int) -> None:
    """Trees: the C best nodes by path score, closed under ancestors, C the best over every C;
    the draft passes priced are the tree's depth."""
    costs = COST_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    rows, nodes = 3, 6
    parents = torch.stack(
        [torch.randint(-1, max(j, 0), (rows,), generator=gen) for j in range(nodes)], dim=1
    )
    logprobs = random_logprobs(rows, nodes, seed=seed, cut=0.1, dtype=torch.float64)
    active = torch.tensor([True, seed % 2 == 0, True])
    selection = goodput_tetris(costs).select(logprobs, active, parents=parents)

    scores = path_sums(logprobs, parents).masked_fill(~active.unsqueeze(1), NEG)  # [B, N]
    depth = path_sums(torch.ones_like(logprobs), parents)
    flat = sorted(scores.flatten().exp().tolist(), reverse=True)
    a, passes = int(active.sum()), int(depth.max())
    values = [
        (sum(flat[:c]) + a) / (costs.draft_time(a, passes) + costs.verify_time(a, c + a))
        for c in range(int((scores > NEG).sum()) + 1)
    ]
    best_c = values.index(max(values))
    assert torch.equal(selection.mask, sorted_order_mask(scores, best_c))
    parent_taken = selection.mask.gather(1, parents.clamp(min=0))
    assert bool((~selection.mask | (parents < 0) | parent_taken).all()), "an orphan node"


def test_goodput_budget_prices_what_it_verifies() -> None:
    """By hand: one row, probabilities 0.9, 0.5, 0.1. With a flat pass the whole chain pays;
    with 1 s per pass and 1 s per token only the 0.9 does: (1 + 0.9) / 3 s beats 1 / 2 s
    (nothing) and (1 + 1.4) / 4 s (two)."""
    logprobs = torch.tensor([[math.log(0.9), math.log(0.5 / 0.9), math.log(0.1 / 0.5)]])
    flat = PassCosts(fixed=1.0, per_row=0.0, knee=100, beyond=0.0, draft=0.0)
    steep = PassCosts(fixed=1.0, per_row=0.0, knee=0, beyond=1.0, draft=0.0)
    assert goodput_tetris(flat, k=1, extra=2).select(logprobs).lengths.tolist() == [3]
    assert goodput_tetris(steep, k=1, extra=2).select(logprobs).lengths.tolist() == [1]


def test_goodput_budget_ranks_the_estimators_scores() -> None:
    """With an estimator, E(C) sums the estimates, not the draft probabilities: an estimator
    that says everything passes makes the whole window worth verifying."""
    from specselect.estimators import AcceptanceEstimator

    class Certain(AcceptanceEstimator):
        def estimate(self, draft_logprobs, positions=None):
            return torch.where(draft_logprobs > NEG, 0.0, NEG)

        def learn(self, draft_logprobs, tested, passed, positions=None):
            pass

    logprobs = torch.full((2, 3), math.log(0.05))
    costs = COST_SHAPES["steep"]
    raw = goodput_tetris(costs, k=1, extra=2).select(logprobs)
    learned = TetrisSelector(
        1, 2, budget="goodput", cost_model=costs, estimator=Certain(), guard=False
    ).select(logprobs)
    assert raw.lengths.tolist() == [0, 0]
    assert learned.lengths.tolist() == [3, 3]


def test_goodput_budget_capture_key() -> None:
    """Captured per object: its planner and estimator state are its own (its device tables
    are built by the warm-up run that precedes every capture; the loop's keys hold the batch
    and the draft width)."""
    selector = goodput_tetris(COST_SHAPES["steep"], k=2, extra=3)
    other = goodput_tetris(COST_SHAPES["steep"], k=2, extra=3)
    assert selector.capture_key is not None and selector.capture_key != other.capture_key


def feed(selector: TetrisSelector, steps: int, rows: int, accepted_fraction: float) -> None:
    """``steps`` outcomes where each row verifies the whole window and accepts a fraction."""
    for _ in range(steps):
        window = selector.draft_length(rows)
        accepted = round(window * accepted_fraction)
        selector.observe([window] * rows, [accepted] * rows)


@pytest.mark.parametrize("shape", sorted(COST_SHAPES))
def test_goodput_depth_follows_acceptance(shape: str) -> None:
    """On the host, from observe(): high acceptance drafts deeper than low acceptance, always
    within [0, k + extra]; the first choice comes from the prior."""
    k, extra, rows = 2, 4, 4
    high, low = (
        goodput_tetris(COST_SHAPES[shape], k, extra),
        goodput_tetris(COST_SHAPES[shape], k, extra),
    )
    assert high.draft_length(rows) == low.draft_length(rows)  # nothing observed yet
    feed(high, 30, rows, 1.0)
    feed(low, 30, rows, 0.0)
    assert 0 <= low.draft_length(rows) <= high.draft_length(rows) <= k + extra
    assert low.draft_length(rows) < high.draft_length(rows) or shape == "draft-heavy"


def test_goodput_depth_extremes() -> None:
    """Certain acceptance and free drafting: the deepest window; no acceptance and drafting
    that costs: no draft (a plain step), then a probe once the failures have decayed; reset
    forgets the evidence."""
    free_draft = PassCosts(fixed=1.0, per_row=0.0, knee=1000, beyond=0.0, draft=0.0)
    paid_draft = PassCosts(fixed=1.0, per_row=0.0, knee=1000, beyond=0.0, draft=0.1)
    deep, shallow = goodput_tetris(free_draft, k=2, extra=3), goodput_tetris(paid_draft, 2, 3)
    feed(deep, 20, 4, 1.0)
    assert deep.draft_length(4) == 5
    depths = []
    for _ in range(60):
        depths.append(shallow.draft_length(4))
        shallow.observe([depths[-1]] * 4, [0] * 4)
    # Depth 1 at most, a third of the steps or more plain (before depth 0 existed, every step
    # drafted), and probes between them: a plain step learns nothing.
    assert max(depths[-20:]) == 1
    assert depths[-20:].count(0) >= 7
    assert shallow.draft_length(0) == 0
    shallow.reset()  # back to the prior's choice
    assert shallow.draft_length(4) == goodput_tetris(paid_draft, 2, 3).draft_length(4) > 1


def test_goodput_depth_probes_only_where_drafting_could_pay() -> None:
    """A prior that says "do not draft" must not stop learning: after ``probe_every`` plain
    steps the planner drafts one token, and certain acceptance then takes it deep. Where even
    certain acceptance loses to a plain step, it never drafts."""
    steep = COST_SHAPES["steep"]  # at 4 rows the prior's 0.7 does not pay for a pass
    learner = goodput_tetris(steep, k=2, extra=3)
    assert learner.draft_length(4) == 0
    depths = []
    for _ in range(12):
        depths.append(learner.draft_length(4))
        learner.observe([depths[-1]] * 4, [depths[-1]] * 4)  # everything drafted is accepted
    assert depths[:5] == [0, 0, 0, 0, 1]  # the probe after probe_every = 4 plain steps
    assert depths[-1] == 5
    hopeless = PassCosts(fixed=1.0, per_row=0.0, knee=1000, beyond=0.0, draft=10.0)
    never = goodput_tetris(hopeless, k=2, extra=3)
    for _ in range(20):
        assert never.draft_length(4) == 0
        never.observe([0] * 4, [0] * 4)


def probe_run(selector: TetrisSelector, steps: int, tree: bool = False) -> tuple[list, list]:
    """(draft depths, tokens verified) of ``steps`` steps of 4 rows whose draft gives each
    token probability 0.6 and is always right, through select, update and observe."""
    rows, depths, verified = 4, [], []
    for _ in range(steps):
        depths.append(selector.draft_length(rows))
        logprobs = torch.full((rows, depths[-1]), math.log(0.6))
        parents = chain_parents(rows, depths[-1]) if tree else None
        selection = selector.select(logprobs, parents=parents)
        nodes = selection.mask if tree else None
        selector.update(selection, selection.lengths, accepted_nodes=nodes)
        verified.append(selection.lengths.tolist())
        # (chain-shaped trees: each row's deepest verified depth is its node count)
        selector.observe(verified[-1], verified[-1], verified[-1] if tree else None)
    return depths, [sum(lengths) for lengths in verified]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_probe_verifies_what_it_drafted(tree: bool) -> None:
    """Through select: a probe's tokens are verified even where the estimates say they do not
    pay (the paper's ranking of 0.6-probability tokens under steep costs, which never changes),
    or a probe would teach nothing. Probes come every ``probe_every`` steps that verified
    nothing, also while the planner drafts but the budget verifies nothing."""
    depths, verified = probe_run(goodput_tetris(COST_SHAPES["steep"], k=2, extra=3), 30, tree)
    assert depths[:5] == [0, 0, 0, 0, 1] and verified[4] == 4
    idle = 0
    for depth, count in zip(depths, verified, strict=True):
        if idle >= 4:  # a probe: it drafts, and verifies everything it drafted
            assert depth >= 1 and count == 4 * depth
        idle = 0 if count else idle + 1
    assert verified.count(0) < 25  # probes came again after the first


def test_a_probe_belongs_to_the_step_that_planned_it() -> None:
    """The probe flag is set by draft_length and holds until the next one: select changes no
    host state and reads the flag on the device, so one captured selection serves probes and
    the budget's own choices alike."""
    selector = goodput_tetris(COST_SHAPES["steep"], k=2, extra=3)
    for _ in range(4):
        assert selector.draft_length(4) == 0
        selector.observe([0] * 4, [0] * 4)
    assert selector.draft_length(4) == 1
    probe_key = selector.capture_key
    logprobs = torch.full((4, 1), math.log(0.6))
    for _ in range(2):  # the probe, as often as the step selects
        assert selector.select(logprobs).lengths.tolist() == [1] * 4
    selector.observe([1] * 4, [1] * 4)
    assert selector.draft_length(4) >= 1  # verified something: no probe
    assert selector.select(logprobs).lengths.tolist() == [0] * 4  # the budget's own choice
    assert selector.capture_key == probe_key


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_goodput_guard_fallback_verifies_what_was_drafted(tree: bool) -> None:
    """While the guard distrusts the scores, the goodput budget verifies everything drafted
    (the planner's depth, which comes from observed acceptance) in the active rows, not the
    fixed window ``k``, which would cap a nearly-always-right draft whose scores rank nothing."""
    untrusted = RankingGuard(min_auc=1.0, min_observations=0)
    selector = TetrisSelector(
        1, 3, budget="goodput", cost_model=COST_SHAPES["steep"], estimator=None, guard=untrusted
    )
    distrust(untrusted)
    logprobs = torch.full((3, 4), math.log(0.6))
    logprobs[2, 2:] = -math.inf  # row 2 drafted only 2 usable tokens
    parents = chain_parents(3, 4) if tree else None
    active = torch.tensor([True, False, True])
    lengths = selector.select(logprobs, active, parents=parents).lengths.tolist()
    assert lengths == [4, 0, 2]
    untrusted.reset()  # trusted again: the budget's own choice, as without a guard
    own = goodput_tetris(COST_SHAPES["steep"], k=1, extra=3).select(
        logprobs, active, parents=parents
    )
    trusted = selector.select(logprobs, active, parents=parents)
    assert trusted.lengths.tolist() == own.lengths.tolist() != lengths


def test_probes_let_the_default_estimator_learn_a_good_draft() -> None:
    """The default estimator learns from what probes verify: its estimates rise, the budget
    verifies without probes, and the depth goes up to what an always-right draft deserves. The
    guard, which sees only passes, keeps trusting the scores (a fallback to the fixed window
    would verify 2 of the 5 tokens per row)."""
    selector = TetrisSelector(2, 3, budget="goodput", cost_model=COST_SHAPES["steep"])
    depths, verified = probe_run(selector, 240)  # past the guard's 200 tested tokens
    assert depths[:5] == [0, 0, 0, 0, 1] and verified[4] == 4
    assert depths[-1] == 5 and verified[-5:] == [20] * 5


def brute_force_depth(
    accept: list[float], verify: list[float], width: float, active: int, costs
) -> int:
    """The K (smallest on ties) with the best goodput when each of ``active`` rows accepts
    depth j with probability prod(accept[:j]) and has ``width`` tokens verified at depth j with
    probability prod(verify[:j]), straight from the objective, one K at a time."""
    best, best_k = -math.inf, 0
    for depth in range(len(accept) + 1):  # 0: a plain step, no draft pass
        accepted = sum(math.prod(accept[:j]) for j in range(1, depth + 1)) * active
        tokens = sum(math.prod(verify[:j]) for j in range(1, depth + 1)) * active * width + active
        low, share = math.floor(tokens), tokens - math.floor(tokens)  # a fractional count
        verifying = (1 - share) * costs.verify_time(active, low) + share * costs.verify_time(
            active, low + 1
        )
        drafting = costs.draft_time(active, depth) if depth else 0.0
        value = (accepted + active) / (drafting + verifying)
        if value > best * (1 + 1e-12):
            best, best_k = value, depth
    return best_k


@pytest.mark.parametrize("shape", sorted(COST_SHAPES))
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("verified", [0.5, 1.0])
@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("active", [1, 5])
def test_goodput_depth_matches_brute_force(
    shape: str, fraction: float, verified: float, width: int, active: int
) -> None:
    selector = goodput_tetris(COST_SHAPES[shape], k=2, extra=3)
    for _ in range(10):  # rows verify a fraction of the window and accept a fraction of that
        window = selector.draft_length(active)
        deepest = round(window * verified)
        nodes, accepted = deepest * width, round(deepest * fraction)
        selector.observe([nodes] * active, [accepted] * active, [deepest] * active)
    planner = selector.planner
    model = planner.acceptance().tolist(), planner.verification().tolist(), planner.width()
    assert planner.best_depth(active) == brute_force_depth(*model, active, COST_SHAPES[shape])


def test_goodput_depth_model_by_hand() -> None:
    """Depth rates are pooled over the rows that drafted the depth: a row that accepted 1 of
    a 3-deep draft reached depths 1 and 2 and passed depth 1, whatever the budget verified of
    it, and one that verified nothing reached depth 1 and failed it; untried depths shrink to
    the depth above (prior 0.7 for acceptance, 1 for verification, strength 2)."""
    planner = goodput_tetris(COST_SHAPES["flat"], k=2, extra=1).planner
    assert planner.depth(3) == 3  # the draft these outcomes come from
    planner.observe([3, 1, 0], [1, 1, 0], [3, 1, 0])
    # accepted: depth 1 passed by 2 of 3 reached; depth 2: 0 of 2; depth 3: none reached
    first = (2 + 2 * 0.7) / (3 + 2)
    second = (0 + 2 * first) / (2 + 2)
    assert planner.acceptance().tolist() == pytest.approx([first, second, second])
    # verified: depth 1 by 2 of 3 rows; depth 2 by 1 of 2 open to it; depth 3 by 1 of 1
    first = (2 + 2 * 1.0) / (3 + 2)
    second = (1 + 2 * first) / (2 + 2)
    third = (1 + 2 * second) / (1 + 2)
    assert planner.verification().tolist() == pytest.approx([first, second, third])
    assert planner.width() == 1.0


def test_goodput_depth_model_counts_drafted_depths_no_row_verified() -> None:
    """A depth is reached by the rows that accepted the one above it in a step that drafted
    it, whatever the budget verified: here no row verified depth 2 of a 3-deep draft, and the
    row that accepted depth 1 failed depth 2. A chain drafted shallower than planned (the
    loop cuts a draft no row could emit) counts as drafted as planned: a row that accepted
    all of it failed the next depth (select changes no host state, so a captured selection
    replays exactly)."""
    planner = goodput_tetris(COST_SHAPES["flat"], k=2, extra=1).planner
    assert planner.depth(2) == 3
    planner.observe([1, 1], [1, 0], [1, 1])
    first = (1 + 2 * 0.7) / (2 + 2)
    second = (0 + 2 * first) / (1 + 2)
    assert planner.acceptance().tolist() == pytest.approx([first, second, second])
    selector = goodput_tetris(COST_SHAPES["flat"], k=2, extra=1)
    for width in (1, 0):
        selector.reset()
        assert selector.draft_length(1) == 3
        selector.select(torch.full((1, width), math.log(0.9)))
        selector.observe([width], [width])  # accepted everything drafted, if anything
        first = (width + 2 * 0.7) / (1 + 2)  # depth 1 reached, passed if drafted
        rates = [first] + [(0 + 2 * first) / (1 + 2)] * 2 if width else [first] * 3
        assert selector.planner.acceptance().tolist() == pytest.approx(rates)


def test_goodput_depth_weighs_what_verification_costs() -> None:
    """At the same acceptance, the less of each depth the budget verifies, the deeper it pays
    to draft; and a tree, whose depths verify several nodes, drafts shallower."""
    planner = goodput_tetris(COST_SHAPES["knee"], k=2, extra=3).planner
    accept = np.array([0.7, 0.6, 0.6, 0.6, 0.6])
    everything = planner.best_depth(4, accept, np.ones(5), 1.0)
    accepted_only = planner.best_depth(4, accept, accept, 1.0)
    tree = planner.best_depth(4, accept, np.ones(5), 3.0)
    assert accepted_only > everything > tree


@pytest.mark.parametrize(
    ("rates", "match"),
    [
        ([0.7, 0.6], "acceptance must hold 5 probabilities in \\[0, 1\\], one per depth"),
        ([0.7, 0.6, math.nan, 0.6, 0.6], "acceptance must hold 5 probabilities"),
        ([0.7, 1.5, 0.6, 0.6, 0.6], "acceptance must hold 5 probabilities"),
    ],
)
def test_goodput_depth_refuses_rates_that_are_no_probabilities(
    rates: list[float], match: str
) -> None:
    """Given rates are checked (a NaN once chose its own depth), and any sequence serves."""
    planner = goodput_tetris(COST_SHAPES["knee"], k=2, extra=3).planner
    with pytest.raises(ValueError, match=match):
        planner.best_depth(4, rates, np.ones(5), 1.0)
    rates = [0.7, 0.6, 0.6, 0.6, 0.6]
    assert planner.best_depth(4, rates, [1.0] * 5, 1.0) == planner.best_depth(
        4, np.array(rates), np.ones(5), 1.0
    )


def test_goodput_planner_refuses_negative_outcomes() -> None:
    """A negative count is refused before the model changes (it used to be clipped to 0)."""
    planner = goodput_tetris(COST_SHAPES["knee"], k=2, extra=3).planner
    planner.observe([3, 1], [2, 0], [3, 1])
    before = planner.acceptance().tolist()
    with pytest.raises(ValueError, match="must be counts >= 0, got \\[1, 2\\], \\[-1, 1\\]"):
        planner.observe([1, 2], [-1, 1], [1, 2])
    assert planner.acceptance().tolist() == before


def test_goodput_depth_model_counts_what_the_budget_left_out() -> None:
    """The bias the model avoids: when the budget verifies depth 2 on one row of two and the
    target accepts everything verified, depth 2 yielded one token per two rows that drafted
    it. A model of the verified tokens alone would value it at one per row."""
    planner = goodput_tetris(COST_SHAPES["flat"], k=1, extra=1).planner
    for _ in range(200):
        planner.depth(2)  # (whatever it chooses: row 0 verified 2, so 2 were drafted)
        planner.observe([2, 1], [2, 1], [2, 1])
    # Steady state of the decayed counts: 2 rows per step / (1 - 0.8) = 10 reached depth 1
    # and 2, 10 passed (and verified) depth 1, 5 depth 2; shrunk by 2 pseudo-observations.
    first = (10 + 2 * 0.7) / (10 + 2)
    assert planner.acceptance().tolist() == pytest.approx([first, (5 + 2 * first) / 12])
    first = (10 + 2 * 1.0) / (10 + 2)
    assert planner.verification().tolist() == pytest.approx([first, (5 + 2 * first) / 12])


def test_goodput_depth_model_reads_trees_per_depth() -> None:
    """A tree row that verified 5 nodes down to depth 2 of a 3-deep draft and accepted 2
    reached depth 3 and failed it (it yielded nothing); its width is 5 nodes per 2 depths."""
    planner = goodput_tetris(COST_SHAPES["flat"], k=2, extra=1).planner
    planner.observe([5, 4], [2, 0], deepest=[2, 3])
    # depth 1: 1 passed of 2 reached; depth 2: 1 of 1; depth 3: 0 of 1
    first = (1 + 2 * 0.7) / (2 + 2)
    second = (1 + 2 * first) / (1 + 2)
    third = (0 + 2 * second) / (1 + 2)
    assert planner.acceptance().tolist() == pytest.approx([first, second, third])
    assert planner.width() == pytest.approx(9 / 5)


@pytest.mark.parametrize(
    ("outcomes", "error", "match"),
    [
        (([1, 2], [1]), ValueError, "one entry per active row"),
        (([1, 2], [2, 0]), ValueError, r"accepted\[0\] = 2 > verified\[0\] = 1"),
        (([1, -2], [0, 0]), ValueError, r"verified\[1\] must be >= 0"),
        (([1.5], [0]), TypeError, r"verified\[0\] must be an int"),
        (([True], [0]), TypeError, r"verified\[0\] must be an int"),
        ((torch.tensor([[1]]), [0]), ValueError, r"verified must be 1-D .* shape \(1, 1\)"),
        ((torch.tensor([1], device="meta"), [0]), TypeError, "verified must be host values"),
        ((torch.tensor([1.0]), [0]), TypeError, r"verified\[0\] must be an int"),
        (("12", [0, 0]), TypeError, "verified must be a sequence"),
        (([3, 2], [1, 0], [2]), ValueError, "got 2 verified and 1 deepest"),
        (([3, 2], [2, 0], [1, 1]), ValueError, r"accepted\[0\] = 2 > deepest\[0\] = 1"),
        (([3, 2], [1, 0], [1, 3]), ValueError, r"deepest\[1\] = 3 > verified\[1\] = 2"),
        (([3], [1], (2.0,)), TypeError, r"deepest\[0\] must be an int"),
        (([3, 0], [0, 0], [0, 0]), ValueError, r"deepest\[0\] must be >= 1 where the row"),
        (([3, 2], [1, 0], None, [True, False]), ValueError, "1 rows marked active for 2 entries"),
        (([3, 2], [1, 0], None, [True, 1, True]), TypeError, r"active\[1\] must be a bool"),
        (([3], [1], None, torch.tensor([[True]])), ValueError, "active must be 1-D"),
        (([3], [1], None, "1"), TypeError, "active must be a sequence of bools"),
    ],
)
def test_observe_rejects_bad_outcomes(outcomes: tuple, error: type, match: str) -> None:
    selector = goodput_tetris(COST_SHAPES["flat"])
    with pytest.raises(error, match=match):
        selector.observe(*outcomes)


@pytest.mark.parametrize("trusted", [False, True], ids=["checked", "trusted"])
def test_observe_takes_a_loops_read_back_as_arrays(trusted: bool) -> None:
    """1-D NumPy arrays and CPU tensors (what a loop reads back) plan as lists do, also inside
    trusted_values (a loop's own read-back, taken unchecked)."""
    as_lists, as_arrays = goodput_tetris(COST_SHAPES["flat"]), goodput_tetris(COST_SHAPES["flat"])
    for step in range(4):
        verified, accepted, active = (
            [3, 2, 1 + step % 3],
            [1, 2, step % 2],
            [True, False, True, True],
        )
        as_lists.observe(verified, accepted, active=active)
        with trusted_values() if trusted else contextlib.nullcontext():
            as_arrays.observe(
                np.array(verified), torch.tensor(accepted), active=torch.tensor(active)
            )
        assert as_lists.draft_length(3) == as_arrays.draft_length(3)
    assert as_lists.planner is not None and as_arrays.planner is not None
    assert as_lists.planner.acceptance().tolist() == as_arrays.planner.acceptance().tolist()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": "throughput"}, ValueError, "budget must be an int >= 0, None or 'goodput'"),
        ({"budget": "goodput", "cost_model": object()}, TypeError, "cost_model must have"),
        ({"budget": 3, "cost_model": 1.5}, TypeError, "cost_model must have"),
        ({"k": 0, "extra": 0, "budget": "goodput"}, ValueError, "k \\+ extra must be >= 1"),
        (
            {"budget": "goodput", "cost_model": CostModel.linear(None, (1e-2, 1e-4, 0.0))},
            ValueError,
            "cost_model has no draft part",
        ),
        (
            {"guard": 1},
            TypeError,
            r"guard must be True, False \(or None\) or a RankingGuard, got int",
        ),
        ({"guard": "yes"}, TypeError, r"or a RankingGuard, got str"),
    ],
)
def test_tetris_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TetrisSelector(**{"k": 2, **kwargs})


@pytest.mark.parametrize(
    ("verify", "draft", "error", "match"),
    [
        (lambda b, t: 0.0, lambda b, t: 0.0, ValueError, r"verify_time\(1, 1\) = 0.0"),
        (lambda b, t: math.nan, lambda b, t: 1.0, ValueError, "finite time >= 0"),
        (lambda b, t: 1.0, lambda b, t: -1.0, ValueError, r"draft_time\(1, 1\) must be a finite"),
        (lambda b, t: "1", lambda b, t: 1.0, TypeError, "must return a float"),
    ],
)
def test_goodput_budget_rejects_bad_cost_models(verify, draft, error: type, match: str) -> None:
    """Times come from the user's model: a free, negative or non-numeric time is a clear
    error when first asked for, not a NaN or infinite goodput."""

    class Bad:
        def draft_time(self, batch: int, tokens: int) -> float:
            return draft(batch, tokens)

        def verify_time(self, batch: int, tokens: int) -> float:
            return verify(batch, tokens)

    selector = goodput_tetris(Bad())
    with pytest.raises(error, match=match):
        selector.select(torch.zeros(1, 2))


def test_goodput_budget_never_selects_unavailable_entries() -> None:
    """A measured verify time may dip as a pass grows (noise, a kernel switch); more tokens
    then look cheaper, but ``-inf`` entries and inactive rows must still never be taken."""
    dipping = PassCosts(fixed=10.0, per_row=0.0, knee=0, beyond=-0.5, draft=0.1)
    logprobs = torch.tensor([[-0.1, NEG, NEG], [-0.2, -0.3, NEG], [-0.1, -0.1, -0.1]])
    active = torch.tensor([True, True, False])
    selection = goodput_tetris(dipping, k=1, extra=2).select(logprobs, active)
    assert selection.lengths.tolist() == [1, 2, 0]


def test_default_tetris_computes_a_steps_outcomes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its estimator and its guard learn from the same tested / passed masks: computed once."""
    import specselect.selection as selection

    calls = []
    real = selection.observed_outcomes

    def counted(*args: object) -> object:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(selection, "observed_outcomes", counted)
    selector = TetrisSelector(2, extra=1)
    assert selector.estimator is not None and selector.guard is not None
    chosen = selector.select(torch.rand(4, 3, generator=torch.Generator().manual_seed(0)).log())
    selector.update(chosen, torch.minimum(chosen.lengths, torch.ones(4, dtype=torch.int64)))
    assert len(calls) == 1


# Verification's fixed cost dominates and a draft pass costs a fifth of it: rows that accept
# everything make a deep draft pay, a row that accepts nothing is slowed by every pass.
DRAIN_COSTS = PassCosts(fixed=10.0, per_row=0.1, knee=0, beyond=0.01, draft=2.0)


def drain_steps(
    selector: TetrisSelector, steps: int, rows_accepting: list[bool], left: list[int], **kwargs
) -> list[int]:
    """``steps`` outcomes of ``len(left)`` rows verifying their whole window, the rows of
    ``rows_accepting`` accepting all of it and the others none, each with ``left`` tokens
    still to emit; returns the depths chosen."""
    depths = []
    for _ in range(steps):
        window = selector.draft_length(len(left))
        depths.append(window)
        accepted = [window if good else 0 for good in rows_accepting]
        rows = [True] * len(left)
        selector.observe([window] * len(left), accepted, active=rows, remaining=left, **kwargs)
    return depths


@pytest.mark.parametrize("slowest", ["straggler", "good row"])
def test_a_draining_budget_drafts_for_the_slowest_row(slowest: str) -> None:
    """While requests wait, the depth is the step's goodput (rows that accept everything make
    a deep draft pay). Once none wait, the run lasts as long as its slowest row: when that is a
    row that accepts nothing, a draft pass only slows every step (a plain step, K = 0); when
    it is a row that accepts everything, the deep draft still finishes it soonest."""
    good = [False, True, True, True]
    left = [50, 10, 10, 10] if slowest == "straggler" else [2, 50, 50, 50]
    queued, draining = (goodput_tetris(DRAIN_COSTS, k=2, extra=3) for _ in range(2))
    deep = drain_steps(queued, 12, good, left, waiting=True)
    drained = drain_steps(draining, 12, good, left, waiting=False)
    assert min(deep) >= 3
    if slowest == "straggler":  # plain steps once its failures are known, until a probe
        assert drained[1:5] == [0, 0, 0, 0] and drained.count(0) >= 4
    else:
        assert drained == deep
    unknown = goodput_tetris(DRAIN_COSTS, k=2, extra=3)  # a loop that does not say
    assert drain_steps(unknown, 12, good, left) == deep


def test_a_finished_row_s_next_request_starts_a_fresh_row_model() -> None:
    """A row reported with nothing remaining has finished: the request its slot takes next is
    modelled afresh (ratio 1), not by the finished one's failures; and the finished row no
    longer holds the batch back."""
    good, left = [False, True, True, True], [50, 10, 10, 10]
    selector = goodput_tetris(DRAIN_COSTS, k=2, extra=3)
    drain_steps(selector, 2, good, left, waiting=False)
    planner = selector.planner
    assert planner.row_ratio(0) < 0.3 < 1.0 < planner.row_ratio(1)
    assert selector.draft_length(4) == 0  # the straggler decides
    stuck = copy.deepcopy(selector)
    drain_steps(selector, 1, good, [0, 9, 9, 9], waiting=False)  # it finishes
    drain_steps(stuck, 1, good, [49, 9, 9, 9], waiting=False)  # it does not
    assert selector.planner.row_ratio(0) == 1.0 and stuck.planner.row_ratio(0) < 0.3
    assert selector.draft_length(4) >= 3 and stuck.draft_length(4) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"row_dispersion": 0.0}, "row_dispersion must be a finite float > 0, got 0"),
        ({"row_dispersion": math.nan}, "row_dispersion must be a finite float > 0"),
        ({"row_decay": 1.5}, r"row_decay must be a finite float in \[0, 1\], got 1.5"),
        ({"strength": -1.0}, "strength must be a finite float > 0"),
        ({"probe_every": 0}, "probe_every must be >= 1"),
        ({"prior": 2.0}, r"prior must be a finite float in \[0, 1\]"),
    ],
)
def test_the_planner_refuses_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GoodputPlanner(3, default_costs(), **kwargs)


def test_a_short_streak_among_rows_alike_is_taken_for_chance() -> None:
    """Rows that have accepted alike: one row failing two steps in a row is chance, not a
    straggler, so its ratio stays the pooled model's and the draining batch keeps drafting
    (a plain step would teach nothing about the row). A row that never agreed with the draft
    is told apart at once (the test above)."""
    selector = goodput_tetris(COST_SHAPES["steep"], k=2, extra=3)
    for step in range(10):
        window = selector.draft_length(4)
        accepted = [0 if (row == 0 and step >= 8) else window for row in range(4)]
        selector.observe(
            [window] * 4, accepted, active=[True] * 4, remaining=[40] * 4, waiting=False
        )
    assert selector.planner.row_ratio(0) > 0.9
    assert selector.draft_length(4) > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"remaining": [3]}, ValueError, "remaining must have one entry per entry of verified"),
        ({"remaining": [3, -1]}, ValueError, r"remaining\[1\] must be >= 0"),
        ({"remaining": [3, 2.5]}, TypeError, r"remaining\[1\] must be an int"),
        ({"remaining": [3, 2], "waiting": "no"}, TypeError, "waiting must be True, False or"),
        ({"remaining": [3, 2], "active": None}, ValueError, "remaining needs active="),
        ({"waiting": False}, ValueError, "waiting needs remaining="),
    ],
)
def test_observe_refuses_a_bad_drain_report(kwargs: dict, error: type, match: str) -> None:
    selector = goodput_tetris(COST_SHAPES["flat"], k=2, extra=3)
    selection = selector.select(torch.full((2, selector.draft_length(2)), -0.1))
    selector.update(selection, selection.lengths)
    with pytest.raises(error, match=match):
        selector.observe([1, 1], [1, 1], **({"active": [True, True]} | kwargs))


def test_a_drain_of_finished_rows_plans_for_goodput_again() -> None:
    """Every row reported finished (a serving loop's queue emptied): no row to wait for, so
    the next depth is the step's goodput's (it raised on an empty reduction)."""
    selector = goodput_tetris(COST_SHAPES["flat"], k=2, extra=3)
    drain_steps(selector, 3, [True, True], [5, 5], waiting=False)
    drain_steps(selector, 1, [True, True], [0, 0], waiting=False)
    fresh = goodput_tetris(COST_SHAPES["flat"], k=2, extra=3)
    drain_steps(fresh, 4, [True, True], [5, 5], waiting=True)
    assert selector.draft_length(2) == fresh.draft_length(2)


class DoubledVerify(CostModel):
    """A cost model of one's own: its ``verify_time`` is not CostModel's."""

    def verify_time(self, batch: int, tokens: int, context: float = 512.0) -> float:
        return 2 * super().verify_time(batch, tokens, context)


@pytest.mark.parametrize("knee", [None, 20.0])
def test_goodput_time_tables_are_the_cost_model_s_times(knee: float | None) -> None:
    """A CostModel's verification times are tabled in one numpy pass (a batch of 256 took a
    second one count at a time): the same times as its verify_time, and, for a model that
    overrides verify_time, that method's."""
    cost = CostModel.linear((1e-3, 2e-4, 0.0), (5e-3, 1e-4, 3e-5))
    if knee is not None:
        cost = CostModel(cost.draft, PassCost(5e-3, 1e-4, 3e-5, knee=knee, beyond_knee=1e-3))
    table = StepTimes(cost).verify(7, 60)  # [61]
    assert np.isinf(table[:7]).all()
    assert table[7:].tolist() == [cost.verify_time(7, t) for t in range(7, 61)]
    doubled = DoubledVerify(cost.draft, cost.verify)
    assert StepTimes(doubled).verify(7, 60)[7:].tolist() == (2 * table[7:]).tolist()
    grown = StepTimes(cost)
    grown.verify(7, 20)  # extended later, as the planner does
    assert grown.verify(7, 60).tolist() == table.tolist()


def test_row_ratios_follow_their_formula() -> None:
    """Each row's ratio, recomputed by hand step by step: counts decayed by ``row_decay`` (the
    squared expectations by its square) on drafting steps only; a finished row zeroed; the
    spread from the unfinished rows' distances to their common ratio (``G / (G - 1)``), less
    noise, decayed by ``SPREAD_DECAY`` per drafting step; ``rho = 1 + w (raw - 1)``."""
    planner = GoodputPlanner(3, DRAIN_COSTS, row_decay=0.5, row_dispersion=0.35)
    outcomes = [  # per step: what each of 3 rows would accept of a full window, tokens left
        ([3, 0, 2], [30, 30, 30]),
        ([3, 1, 0], [30, 30, 30]),
        ([0, 0, 0], [30, 30, 30]),
        ([0, 0, 0], [30, 30, 30]),
        ([0, 0, 0], [30, 30, 30]),
        ([0, 0, 0], [30, 30, 30]),
        ([3, 0, 3], [30, 0, 30]),  # row 1 finishes
        ([2, 0, 1], [30, 30, 30]),  # its slot's next request
    ]
    counts = [[0.0, 0.0, 0.0] for _ in range(3)]  # per row: accepted, expected, squared
    spread = terms = 0.0
    depths = []
    for wanted, left in outcomes:
        window = planner.depth(3)
        depths.append(window)
        survival, expected = 1.0, 0.0  # the pooled model's tokens at this depth, before
        for rate in planner.acceptance()[:window]:
            survival *= rate
            expected += survival
        accepted = [min(a, window) for a in wanted]
        planner.observe(
            [window] * 3, accepted, [window] * 3, active=[True] * 3, remaining=left, waiting=False
        )
        if window:
            for row, a in enumerate(accepted):
                c = counts[row]
                c[:] = [0.5 * c[0] + a, 0.5 * c[1] + expected, 0.25 * c[2] + expected]
        for row, r in enumerate(left):
            if r == 0:
                counts[row] = [0.0, 0.0, 0.0]
        going = [c for c in counts if c[1] > 0]
        if window and len(going) >= 2:
            common = sum(c[0] for c in going) / sum(c[1] for c in going)
            excess = sum(
                (c[0] / c[1] - common) ** 2 * len(going) / (len(going) - 1)
                - 0.35 * c[2] / c[1] ** 2
                for c in going
            )
            spread, terms = SPREAD_DECAY * spread + excess, SPREAD_DECAY * terms + len(going)
        tau2 = max(spread / terms, 0.0) if terms else 0.0
        for row, (a, e, e2) in enumerate(counts):
            noise = 0.35 * e2 / e**2 if e > 0 else 0.0
            weight = tau2 / (tau2 + noise) if noise > 0 else 0.0
            expected_rho = 1.0 + weight * ((a / e if e > 0 else 1.0) - 1.0)
            assert planner.row_ratio(row) == pytest.approx(expected_rho, rel=1e-12), (depths, row)
    assert 0 in depths and any(depths)  # plain steps and drafting steps both covered
