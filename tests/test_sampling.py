"""Tests of specselect.sampling: logit warping against plain per-row references, and the sampler.

Statistical tests use chi-square goodness of fit at the suite's significance level (tests/_stats.py)
with fixed seeds, so they are deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _stats import ALPHA, chi_square_pvalue
from specselect.sampling import logits_to_probs, sample_from, warp_logits


def reference_warp(
    row: np.ndarray, temperature: float, top_k: int | None, top_p: float | None
) -> np.ndarray:
    """One row, the textbook way: divide, keep the k largest (ties kept), then the nucleus."""
    x = row.astype(np.float64) / temperature
    if top_k is not None and top_k < len(x):
        kth_largest = sorted(x, reverse=True)[top_k - 1]
        x = np.where(x >= kth_largest, x, -np.inf)
    if top_p is not None:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        kept, mass = set(), 0.0
        for token in sorted(range(len(x)), key=lambda v: -probs[v]):
            kept.add(token)
            mass += probs[token]
            if mass >= top_p:
                break
        x = np.array([x[v] if v in kept else -np.inf for v in range(len(x))])
    return x


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (5, None), (None, 0.8)])
def test_min_p_is_hfs_warper_after_the_others(
    min_p: float, top_k: int | None, top_p: float | None
) -> None:
    """As generate() applies it: after temperature, top-k and top-p, a token less likely than
    min_p times its row's most likely one is removed (that one always stays)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = random_logits(6, 8, seed=3)  # [B, V]
    before = warp_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p)
    got = warp_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = before if min_p == 0.0 else MinPLogitsWarper(min_p)(None, before.clone())
    assert torch.equal(got, expected)
    assert torch.isfinite(got).sum(dim=-1).min() >= 1
    if 0.0 < min_p < 1.0 and top_k is None and top_p is None:  # the case removes something
        assert torch.isinf(got).sum() > torch.isinf(before).sum()


def random_logits(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Continuous random logits (no ties) with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("top_k", [None, 1, 3, 8, 20])
@pytest.mark.parametrize("top_p", [None, 0.05, 0.6, 0.95, 1.0])
def test_warp_logits_matches_reference(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    logits = random_logits(3, 4, 8, seed=1)  # [B, K, V]
    got = warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    expected = np.stack(
        [reference_warp(row, temperature, top_k, top_p) for row in logits.reshape(-1, 8).numpy()]
    ).reshape(3, 4, 8)
    assert got.shape == logits.shape
    np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(expected))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (2, None), (None, 0.5), (4, 0.7)])
def test_logits_to_probs_is_softmax_of_warped(top_k: int | None, top_p: float | None) -> None:
    logits = random_logits(5, 7, seed=2)
    probs = logits_to_probs(logits, temperature=0.8, top_k=top_k, top_p=top_p)
    warped = warp_logits(logits, temperature=0.8, top_k=top_k, top_p=top_p)
    reference = np.exp(warped.numpy() - warped.numpy().max(axis=-1, keepdims=True))
    reference /= reference.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(probs.numpy(), reference, rtol=1e-12, atol=1e-15)
    assert bool(((probs == 0) == torch.isinf(warped)).all()), "removed tokens must get exactly 0"


@pytest.mark.parametrize(("top_k", "kept"), [(1, [1, 2]), (2, [1, 2]), (3, [0, 1, 2])])
def test_top_k_keeps_all_ties_at_the_boundary(top_k: int, kept: list[int]) -> None:
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    finite = torch.isfinite(warp_logits(logits, top_k=top_k))
    assert finite.tolist() == [v in kept for v in range(4)]


@pytest.mark.parametrize("top_p", [1e-9, 0.01])
def test_top_p_always_keeps_the_most_likely_token(top_p: float) -> None:
    logits = random_logits(6, 10, seed=3)
    finite = torch.isfinite(warp_logits(logits, top_p=top_p))
    assert finite.sum(dim=-1).tolist() == [1] * 6
    assert bool(finite.gather(-1, logits.argmax(dim=-1, keepdim=True)).all())


@pytest.mark.parametrize("kwargs", [{"temperature": 0.7, "top_k": 5, "top_p": 0.8}, {}])
def test_draft_and_target_shapes_are_warped_identically(kwargs: dict) -> None:
    """Rows are independent: draft ``[B, K, V]`` = the first K columns of target ``[B, K+1, V]``."""
    target = random_logits(3, 5, 16, seed=4, dtype=torch.float32)  # [B, K + 1, V]
    draft = target[:, :4].clone()  # [B, K, V]
    warped_target = warp_logits(target, **kwargs)
    torch.testing.assert_close(warp_logits(draft, **kwargs), warped_target[:, :4], rtol=0, atol=0)
    single = warp_logits(target[2, 1], **kwargs)  # one [V] row
    torch.testing.assert_close(single, warped_target[2, 1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_processed_in_float32(dtype: torch.dtype) -> None:
    logits = random_logits(4, 50, seed=5, dtype=dtype)
    probs = logits_to_probs(logits, temperature=0.9, top_k=20, top_p=0.9)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4), rtol=0, atol=1e-6)
    expected = logits_to_probs(logits.float(), temperature=0.9, top_k=20, top_p=0.9)
    torch.testing.assert_close(probs, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": math.inf}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": -0.1}, ValueError, "top_p"),
        ({"top_p": math.nan}, ValueError, "top_p"),
        ({"top_p": "0.9"}, TypeError, "top_p"),
        ({"min_p": -0.1}, ValueError, "min_p"),
        ({"min_p": 1.5}, ValueError, "min_p"),
        ({"min_p": math.nan}, ValueError, "min_p"),
        ({"min_p": "0.1"}, TypeError, "min_p"),
    ],
)
@pytest.mark.parametrize("function", [warp_logits, logits_to_probs])
def test_bad_settings_are_rejected(function, kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        function(torch.zeros(2, 5), **kwargs)


@pytest.mark.parametrize(
    ("logits", "error", "message"),
    [
        ([[0.0, 1.0]], TypeError, "torch.Tensor"),
        (torch.zeros(2, 5, dtype=torch.int64), TypeError, "floating"),
        (torch.tensor(1.0), ValueError, "vocabulary"),
        (torch.zeros(2, 0), ValueError, "vocabulary"),
        (torch.tensor([[0.0, math.nan]]), ValueError, "NaN"),
        (torch.tensor([[0.0, math.inf]]), ValueError, r"\+inf"),
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), ValueError, "only -inf"),
    ],
)
def test_bad_logits_are_rejected(logits: object, error: type, message: str) -> None:
    with pytest.raises(error, match=f"logits.*{message}|{message}.*logits"):
        warp_logits(logits)


def assert_distribution(samples: torch.Tensor, probs: np.ndarray) -> None:
    """Chi-square goodness of fit at ALPHA; zero-probability tokens must never appear."""
    counts = np.bincount(samples.reshape(-1).numpy(), minlength=len(probs))
    assert len(counts) == len(probs), "sampled a token outside the vocabulary"
    assert chi_square_pvalue(counts, probs) > ALPHA


@pytest.mark.parametrize("scale", [1.0 / 12.0, 1.0, 1000.0])
def test_sample_from_matches_the_distribution(scale: float) -> None:
    """Normalised or not (the residual is passed unnormalised), draws follow the weights."""
    weights = np.array([3.0, 0.0, 1.0, 2.0, 5.0, 1.0]) * scale
    probs = torch.tensor(weights, dtype=torch.float32).expand(60_000, -1)
    samples = sample_from(probs, torch.Generator().manual_seed(6))
    assert samples.shape == (60_000,)
    assert samples.dtype == torch.int64
    assert_distribution(samples, weights)


def test_sample_from_leading_dimensions() -> None:
    """``[N, 2, V]`` → ``[N, 2]``: each of the two columns follows its own distribution."""
    first = np.array([0.1, 0.2, 0.7, 0.0])
    second = np.array([0.0, 0.5, 0.25, 0.25])
    probs = torch.tensor(np.stack([first, second]), dtype=torch.float64).expand(30_000, 2, 4)
    samples = sample_from(probs, torch.Generator().manual_seed(7))
    assert samples.shape == (30_000, 2)
    assert_distribution(samples[:, 0], first)
    assert_distribution(samples[:, 1], second)


def test_sample_from_is_reproducible_with_a_generator() -> None:
    probs = torch.full((1000, 6), 1.0 / 6.0)
    draw = [sample_from(probs, torch.Generator().manual_seed(seed)) for seed in (8, 8, 9)]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2])


@pytest.mark.parametrize(
    ("probs", "generator", "error", "message"),
    [
        (torch.tensor([[0.5, -0.1, 0.6]]), None, ValueError, "probs must be non-negative"),
        (torch.tensor([[0.5, math.nan]]), None, ValueError, "probs contains NaN"),
        (torch.tensor([[1, 0]]), None, TypeError, "probs must be a floating"),
        (torch.tensor(0.5), None, ValueError, "probs must have a last"),
        ("0.5", None, TypeError, "probs must be a torch.Tensor"),
        (torch.ones(1, 3), 123, TypeError, "generator"),
    ],
)
def test_sample_from_rejects_bad_input(
    probs: object, generator: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        sample_from(probs, generator)


def test_no_host_sync_on_meta_tensors() -> None:
    """Meta tensors carry no data: any ``.item()``/``bool()``/``nonzero`` would raise here."""
    logits = torch.empty(3, 4, 50, device="meta")
    probs = logits_to_probs(logits, temperature=0.7, top_k=10, top_p=0.9)
    assert probs.shape == (3, 4, 50)
    assert sample_from(probs).shape == (3, 4)
