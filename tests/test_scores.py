"""Causal scores: sampled drafts stay lossless under TETRIS; raw draft probabilities do not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _stats import ALPHA, chi_square_pvalue
from conftest import paper_tetris
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.tree import build_tree_buffers
from specselect.verify import rejection_verify


@st.composite
def scored_drafts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    probs = st.sampled_from([0.0, 0.05, 0.5, 0.9, 1.0])
    token = torch.tensor(draw(st.lists(probs, min_size=rows * width, max_size=rows * width)))
    expected = torch.tensor(
        draw(st.lists(st.floats(0.01, 1.0), min_size=rows * width, max_size=rows * width))
    )
    return token.reshape(rows, width).log(), expected.reshape(rows, width).log()


@settings(max_examples=80, deadline=None)
@given(scored_drafts())
def test_causal_scores_are_logprobs_of_the_running_minimum(drafts) -> None:
    token, expected = (t.double() for t in drafts)
    out = causal_logprobs(token, expected)
    assert (out <= 0).all() and not out.isnan().any()
    before = torch.cat([torch.zeros(token.shape[0], 1, dtype=token.dtype), token.cumsum(1)], 1)
    reference = torch.cummin(before[:, :-1] + expected, dim=1).values
    assert torch.allclose(out.cumsum(1).exp(), reference.exp(), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(scored_drafts(), st.data())
def test_position_j_ignores_the_token_drawn_at_j(drafts, data) -> None:
    token, expected = drafts
    j = data.draw(st.integers(0, token.shape[1] - 1))
    changed = token.clone()
    changed[:, j] = data.draw(st.sampled_from([0.0, -0.01, -3.0, float("-inf")]))
    keep = slice(0, j + 1)
    assert torch.equal(
        causal_logprobs(token, expected)[:, keep], causal_logprobs(changed, expected)[:, keep]
    )


def test_expected_self_logprob_is_log_sum_of_squares() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(expected_self_logprob(q).exp(), torch.tensor([0.5, 1.0]))


def _first_emitted_token(
    causal: bool, rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TETRIS-selected, rejection-verified step over a batch of sampled 2-token drafts.

    Rows cycle through four prompts with different draft/target distributions, so the budget
    really moves between rows. Returns each row's prompt, its first emitted token, and the
    target's distribution of that token per prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab, prompts = 5, 4
    p0 = torch.softmax(3 * torch.randn(prompts, vocab, generator=gen), -1)
    q0 = torch.softmax(3 * torch.randn(prompts, vocab, generator=gen), -1)
    p1 = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)  # next given token
    q1 = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)
    prompt = torch.arange(rows) % prompts
    x0 = torch.multinomial(q0[prompt], 1, generator=gen).squeeze(1)
    x1 = torch.multinomial(q1[x0], 1, generator=gen).squeeze(1)
    tokens = torch.stack([x0, x1], 1)  # [B, 2]
    draft_probs = torch.stack([q0[prompt], q1[x0]], 1)  # [B, 2, V]
    target_probs = torch.stack([p0[prompt], p1[x0], p1[x1]], 1)  # [B, 3, V]
    token_lp = draft_probs.gather(2, tokens.unsqueeze(2)).squeeze(2).log()
    scores = causal_logprobs(token_lp, expected_self_logprob(draft_probs)) if causal else token_lp
    selection = paper_tetris(k=1, extra=1).select(scores)
    accepted, bonus = rejection_verify(tokens, selection.lengths, draft_probs, target_probs, gen)
    first = torch.where(accepted > 0, x0, bonus)
    return prompt, first, p0


def _first_token_pvalue(causal: bool) -> float:
    """Each prompt's first tokens against its own target distribution, in one test."""
    prompt, first, p0 = _first_emitted_token(causal, rows=80_000, seed=0)
    vocab = p0.shape[1]
    counts = torch.bincount(prompt * vocab + first, minlength=p0.numel()).view_as(p0)
    return chi_square_pvalue(counts, p0)  # [prompts, V] strata


def test_tetris_on_causal_scores_is_lossless() -> None:
    assert _first_token_pvalue(causal=True) > ALPHA


def test_tetris_on_raw_draft_probabilities_is_not_lossless() -> None:
    """The same test has the power to see the bias that the causal scores remove."""
    assert _first_token_pvalue(causal=False) < ALPHA


@pytest.mark.parametrize("rows", [1, 7])
def test_causal_scores_keep_shapes(rows: int) -> None:
    out = causal_logprobs(torch.zeros(rows, 0), torch.zeros(rows, 0))
    assert out.shape == (rows, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.data())
def test_tree_node_ignores_its_own_and_later_siblings_tokens(nodes: int, data) -> None:
    parents = torch.tensor([[data.draw(st.integers(-1, j - 1)) for j in range(nodes)]])
    token = torch.rand(1, nodes, dtype=torch.float64).log()
    expected = torch.rand(1, nodes, dtype=torch.float64).clamp(min=0.05).log()
    j = data.draw(st.integers(0, nodes - 1))
    changed = token.clone()
    changed[0, j] = data.draw(st.sampled_from([0.0, -3.0, float("-inf")]))
    before = causal_logprobs(token, expected, parents)
    after = causal_logprobs(changed, expected, parents)
    descendants = build_tree_buffers(parents).ancestors[0, :, j]  # nodes below (or at) j
    descendants[j] = False
    # Only j's descendants may change: not j, not its siblings, nothing elsewhere.
    assert torch.equal(before[0, ~descendants], after[0, ~descendants])
    assert (before <= 0).all()


def test_later_siblings_are_discounted() -> None:
    parents = torch.tensor([[-1, -1, -1]])
    token = torch.zeros(1, 3)
    expected = torch.full((1, 3), 0.5).log()
    scores = causal_logprobs(token, expected, parents).exp()[0]
    assert torch.allclose(scores, torch.tensor([0.5, 0.25, 0.125]))


CAUSAL_BAD = {
    # name: (token_logprobs, expected_logprobs, parents, error, message)
    "expected one column": (torch.zeros(2, 3), torch.zeros(2, 1), None, ValueError, "shape of"),
    "expected rank 1": (torch.zeros(2, 3), torch.zeros(3), None, ValueError, "expected_logprobs"),
    "positive expected": (torch.zeros(2, 3), torch.ones(2, 3), None, ValueError, "positive"),
    "positive token": (torch.ones(2, 3), torch.zeros(2, 3), None, ValueError, "token_logprobs"),
    "NaN token": (torch.full((2, 3), math.nan), torch.zeros(2, 3), None, ValueError, "NaN"),
    "integer token": (
        torch.zeros(2, 3, dtype=torch.long),
        torch.zeros(2, 3),
        None,
        TypeError,
        "token_logprobs",
    ),
    "parent out of range": (
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([[-1, 5, 0]] * 2),
        ValueError,
        r"parents\[0, 1\] = 5",
    ),
    "parents rows": (
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([[-1, 0, 0]]),
        ValueError,
        "parents must have 2 rows",
    ),
    "parents width": (
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([[-1, 0]] * 2),
        ValueError,
        "parents must have 3 columns",
    ),
    "expected device": (
        torch.zeros(2, 3),
        torch.zeros(2, 3, device="meta"),
        None,
        ValueError,
        "expected_logprobs is on meta",
    ),
}


@pytest.mark.parametrize("case", list(CAUSAL_BAD))
def test_causal_logprobs_rejects_bad_input(case: str) -> None:
    token, expected, parents, error, message = CAUSAL_BAD[case]
    with pytest.raises(error, match=message):
        causal_logprobs(token, expected, parents)
