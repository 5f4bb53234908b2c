"""Tests of specselect.verify: greedy matching and lossless speculative sampling of chains.

Statistical tests use chi-square goodness of fit (or an exact binomial test) at the suite's
significance level (tests/_stats.py) with fixed seeds, so they are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from _stats import ALPHA, chi_square_pvalue
from specselect.selection import prefix_mask
from specselect.tree import build_tree_buffers, chain_parents
from specselect.verify import (
    acceptance_probs,
    greedy_verify,
    rejection_verify,
    residual_probs,
)
from specselect.verify_tree import tree_greedy_verify, tree_rejection_verify


def one_hot_logits(target_tokens: list[list[int]], vocab: int) -> torch.Tensor:
    """``[B, K + 1, V]`` logits whose argmax at column j is ``target_tokens[i][j]``."""
    tokens = torch.tensor(target_tokens)
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float32) * 5.0 - 1.0


def random_probs(*shape: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """Random distributions over the last dim, each with ``zeros`` random tokens at 0."""
    weights = torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.3
    if zeros:
        dropped = torch.rand(*shape, generator=gen).argsort(dim=-1)[..., :zeros]
        weights = weights.scatter(-1, dropped, 0.0)
    return weights / weights.sum(dim=-1, keepdim=True)


# --- greedy --------------------------------------------------------------------------------

GREEDY_CASES = {
    # name: (draft tokens, target argmax per column, length, expected accepted)
    "all accepted -> bonus": ([1, 2, 3, 4], [1, 2, 3, 4, 5], 4, 4),
    "prefix accepted -> bonus from column L": ([1, 2, 3, 4], [1, 2, 7, 4, 5], 2, 2),
    "first mismatch -> correction": ([1, 2, 3, 4], [1, 9, 3, 4, 5], 4, 1),
    "mismatch at position 0": ([1, 2, 3, 4], [8, 2, 3, 4, 5], 3, 0),
    "later matches do not count": ([1, 2, 3, 4], [1, 0, 3, 4, 5], 4, 1),
    "length 0 -> plain target argmax": ([1, 2, 3, 4], [1, 2, 3, 4, 5], 0, 0),
    "tokens after the prefix are ignored": ([1, 2, 3, 4], [1, 2, 3, 4, 5], 1, 1),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_hand_made(case: str) -> None:
    draft, target, length, accepted = GREEDY_CASES[case]
    num_accepted, next_token = greedy_verify(
        torch.tensor([draft]), torch.tensor([length]), one_hot_logits([target], vocab=10)
    )
    assert num_accepted.tolist() == [accepted]
    assert next_token.tolist() == [target[accepted]]
    assert num_accepted.dtype == next_token.dtype == torch.int64


def test_greedy_rows_are_independent() -> None:
    """All hand-made cases in one batch give the same answers as one by one."""
    drafts, targets, lengths, accepted = zip(*GREEDY_CASES.values(), strict=True)
    num_accepted, next_token = greedy_verify(
        torch.tensor(drafts), torch.tensor(lengths), one_hot_logits(list(targets), vocab=10)
    )
    assert num_accepted.tolist() == list(accepted)
    assert next_token.tolist() == [t[a] for t, a in zip(targets, accepted, strict=True)]


def greedy_reference(draft: list[int], length: int, logits: list[list[float]]) -> tuple[int, int]:
    """One row in plain Python: walk the selected prefix until the first mismatch."""
    argmax = [max(range(len(col)), key=lambda v: (col[v], -v)) for col in logits]
    accepted = 0
    while accepted < length and draft[accepted] == argmax[accepted]:
        accepted += 1
    return accepted, argmax[accepted]


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 6),
    width=st.integers(0, 5),
    vocab=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_matches_per_row_reference(batch: int, width: int, vocab: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    # Rounded logits make argmax ties common, exercising the lowest-id tie rule.
    logits = torch.randint(0, 3, (batch, width + 1, vocab), generator=gen).to(torch.float32)
    num_accepted, next_token = greedy_verify(draft, lengths, logits)
    expected = [
        greedy_reference(d, n, lg)
        for d, n, lg in zip(draft.tolist(), lengths.tolist(), logits.tolist(), strict=True)
    ]
    assert list(zip(num_accepted.tolist(), next_token.tolist(), strict=True)) == expected


# --- rejection sampling: exact cases --------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 2, 3])
def test_rejection_accepts_everything_when_p_equals_q(length: int) -> None:
    """p == q: every selected token is accepted and the bonus comes from column ``length``."""
    gen = torch.Generator().manual_seed(10)
    batch, width, vocab = 50, 3, 5
    probs = random_probs(batch, width + 1, vocab, gen=gen)
    bonus = torch.arange(batch) % vocab
    probs[:, length] = torch.nn.functional.one_hot(bonus, vocab).to(probs.dtype)
    draft = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.full((batch,), length)
    num_accepted, next_token = rejection_verify(draft, lengths, probs[:, :width], probs, gen)
    assert num_accepted.tolist() == lengths.tolist()
    assert next_token.tolist() == bonus.tolist()


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_rejection_of_a_token_the_target_excludes(reject_at: int) -> None:
    """p(x) = 0 forces a rejection; the correction comes from norm(max(p - q, 0))."""
    gen = torch.Generator().manual_seed(11)
    batch, width, vocab = 40, 3, 6
    probs = random_probs(batch, width + 1, vocab, gen=gen)
    draft = torch.randint(0, vocab, (batch, width), generator=gen)
    target = probs.clone()
    excluded = draft[:, reject_at]
    correction = (excluded + 1) % vocab
    target[:, reject_at] = 0.0
    target[torch.arange(batch), reject_at, correction] = 1.0
    lengths = torch.full((batch,), width)
    num_accepted, next_token = rejection_verify(draft, lengths, probs[:, :width], target, gen)
    assert num_accepted.tolist() == [reject_at] * batch
    assert next_token.tolist() == correction.tolist()


def test_degenerate_residual_falls_back_to_p() -> None:
    """A drafted token with q(x) = p(x) = 0 is rejected although p == q: sample from p, no NaN."""
    probs = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]])  # [B=1, K+1=2, V=3]
    support = {1, 2}
    draws = [
        rejection_verify(
            torch.tensor([[0]]),
            torch.tensor([1]),
            probs[:, :1],
            probs,
            torch.Generator().manual_seed(seed),
        )
        for seed in range(30)
    ]
    assert {int(n) for n, _ in draws} == {0}
    assert {int(t) for _, t in draws} == support


def test_residual_probs_reference() -> None:
    gen = torch.Generator().manual_seed(12)
    p = random_probs(20, 7, gen=gen, zeros=2)
    q = random_probs(20, 7, gen=gen, zeros=2)
    residual = np.maximum(p.numpy() - q.numpy(), 0.0)
    np.testing.assert_allclose(
        residual_probs(p, q).numpy(), residual / residual.sum(-1, keepdims=True), rtol=1e-12
    )
    torch.testing.assert_close(residual_probs(p, p), p, rtol=0, atol=0)


def test_acceptance_probs_reference() -> None:
    q = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]])
    p = torch.tensor([[[0.25, 0.75, 0.0], [0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    draft = torch.tensor([[0, 0, 0, 0]])  # q(x) = .5, .2, 0, 0 and p(x) = .25, .6, .5, 0
    got = acceptance_probs(draft, q, p)
    torch.testing.assert_close(got, torch.tensor([[0.5, 1.0, 1.0, 0.0]]))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 8),
    width=st.integers(0, 4),
    vocab=st.integers(2, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_one_hot_distributions_reduce_to_greedy(
    batch: int, width: int, vocab: int, seed: int
) -> None:
    """Temperature -> 0: with one-hot p and q, sampling verification is greedy verification."""
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    logits = torch.randn(batch, width + 1, vocab, generator=gen)
    p = torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(torch.float32)
    q = torch.nn.functional.one_hot(draft, vocab).to(torch.float32)
    sampled = rejection_verify(draft, lengths, q, p, gen)
    greedy = greedy_verify(draft, lengths, logits)
    assert sampled[0].tolist() == greedy[0].tolist()
    assert sampled[1].tolist() == greedy[1].tolist()


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 8),
    width=st.integers(0, 4),
    vocab=st.integers(2, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_rejection_invariants(batch: int, width: int, vocab: int, seed: int) -> None:
    """Accepted tokens and the next token always lie in the target's support at their column."""
    gen = torch.Generator().manual_seed(seed)
    zeros = vocab // 2
    q = random_probs(batch, width, vocab, gen=gen, zeros=zeros).to(torch.float32)
    p = random_probs(batch, width + 1, vocab, gen=gen, zeros=zeros).to(torch.float32)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, width)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    num_accepted, next_token = rejection_verify(draft, lengths, q, p, gen)
    assert bool(((num_accepted >= 0) & (num_accepted <= lengths)).all())
    p_draft = p[:, :width].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    within = torch.arange(width) < num_accepted.unsqueeze(1)
    assert bool((p_draft[within] > 0).all()), "accepted a token the target excludes"
    p_next = p[torch.arange(batch), num_accepted, next_token]
    assert bool((p_next > 0).all()), "emitted a token outside the target's support"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_probabilities(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    q = random_probs(64, 3, 8, gen=gen).to(dtype)
    draft = torch.multinomial(q.float().reshape(-1, 8), 1, generator=gen).reshape(64, 3)
    lengths = torch.full((64,), 3)
    num_accepted, next_token = rejection_verify(draft, lengths, q, q[:, [0, 1, 2, 2]], gen)
    assert num_accepted.tolist() == [3] * 64, "p == q must accept everything in any precision"
    assert next_token.dtype == torch.int64
    assert bool(((next_token >= 0) & (next_token < 8)).all())


# --- rejection sampling: losslessness -------------------------------------------------------

VOCAB, WIDTH, ROWS = 6, 3, 200_000


def markov_tables(gen: torch.Generator) -> torch.Tensor:
    """``[WIDTH + 2, V, V]``: row ``[t, prev]`` is a distribution of sequence position ``t``.

    Distributions depend on the previous token, so a verifier that reads the wrong column (or the
    wrong context) produces a visibly wrong joint distribution. One token per row has
    probability 0, like a top-k cut, to exercise the support of the residual.
    """
    return random_probs(WIDTH + 2, VOCAB, VOCAB, gen=gen, zeros=1)


def inverse_cdf_sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``[N, V]`` → ``[N]``: an independent, fast sampler for drafting in tests."""
    uniform = torch.rand(probs.shape[0], 1, generator=gen, dtype=probs.dtype)
    return (probs.cumsum(-1) <= uniform).sum(-1).clamp(max=probs.shape[-1] - 1)


def draft_step(
    target: torch.Tensor, draft: torch.Tensor, start: int, prev: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample a draft chain from ``q`` and gather the target's columns along it.

    Returns draft tokens ``[N, K]``, draft probs ``[N, K, V]``, target probs ``[N, K + 1, V]``
    for a step whose first draft token is sequence position ``start`` after token ``prev``.
    """
    tokens, q_cols, p_cols = [], [], []
    for j in range(WIDTH):
        q = draft[start + j, prev]  # [N, V]
        p_cols.append(target[start + j, prev])
        prev = inverse_cdf_sample(q, gen)
        tokens.append(prev)
        q_cols.append(q)
    p_cols.append(target[start + WIDTH, prev])
    return torch.stack(tokens, 1), torch.stack(q_cols, 1), torch.stack(p_cols, 1)


def draft_side_lengths(q: torch.Tensor, tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A varying, draft-only selection that never looks at the token it verifies.

    Position j is verified while the draft distribution at j is peaked (max q_j > 0.25, a
    function of tokens 0..j-1), every earlier draft token had q(x_t) > 0.2, and j is below an
    independent random cap in 0..K (so every length 0..K occurs).
    """
    q_x = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, K]
    earlier_confident = torch.cat([torch.ones_like(q_x[:, :1]), q_x[:, :-1]], 1) > 0.2
    peaked = q.amax(dim=-1) > 0.25  # [N, K]
    rule = (earlier_confident & peaked).to(torch.int64).cumprod(1).sum(1)
    cap = torch.randint(0, q.shape[1] + 1, rule.shape, generator=gen)
    return torch.minimum(rule, cap)


def emit(draft: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """``[N, K + 1]`` emitted tokens of a step, padded with -1 after the next token."""
    cols = torch.arange(draft.shape[1] + 1)
    padded = torch.cat([draft, torch.full_like(next_token, -1).unsqueeze(1)], 1)
    out = torch.where(cols < num_accepted.unsqueeze(1), padded, -1)
    return out.scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))


def accepted_count_probs(target: torch.Tensor, draft: torch.Tensor, length: int) -> np.ndarray:
    """Exact distribution of the accepted count for a constant ``length`` (forward recursion).

    ``reach[x]`` = P(the first j draft tokens are accepted and the last one is x); accepting the
    next one with token y has probability q(y) min(1, p(y)/q(y)) = min(p(y), q(y)).
    """
    reach = torch.nn.functional.one_hot(torch.tensor(0), VOCAB).to(torch.float64)
    at_least = [1.0]
    for j in range(length):
        reach = reach @ torch.minimum(target[j], draft[j])
        at_least.append(float(reach.sum()))
    at_least.append(0.0)
    return np.diff(-np.array(at_least))


@pytest.mark.parametrize("length", [0, 1, 2, 3, "draft-side"])
def test_rejection_verify_is_lossless(length: int | str) -> None:
    """Emitted tokens follow the target: first token, first two jointly, and accepted counts.

    Two steps are simulated per row, so the second emitted token exists also when the first step
    emitted a single token. Step one continues pending token 0.
    """
    gen = torch.Generator().manual_seed(14)
    target, draft = markov_tables(gen), markov_tables(gen)

    def step(start: int, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, q, p = draft_step(target, draft, start, prev, gen)
        lengths = (
            draft_side_lengths(q, tokens, gen)
            if length == "draft-side"
            else torch.full((ROWS,), length)
        )
        num_accepted, next_token = rejection_verify(tokens, lengths, q, p, gen)
        return emit(tokens, num_accepted, next_token), num_accepted

    first, num_accepted = step(0, torch.zeros(ROWS, dtype=torch.int64))
    second_step, _ = step(1, first[:, 0])
    second = torch.where(first[:, 1] >= 0, first[:, 1], second_step[:, 0])

    p_first = target[0, 0].numpy()
    joint = (p_first[:, None] * target[1].numpy()).reshape(-1)
    assert chi_square_pvalue(torch.bincount(first[:, 0], minlength=VOCAB), p_first) > ALPHA
    pairs = torch.bincount(first[:, 0] * VOCAB + second, minlength=VOCAB**2)
    assert chi_square_pvalue(pairs, joint) > ALPHA
    if isinstance(length, int):
        observed = torch.bincount(num_accepted, minlength=length + 1)
        assert chi_square_pvalue(observed, accepted_count_probs(target, draft, length)) > ALPHA
    if length not in (0, "draft-side"):
        rate = float(torch.minimum(target[0, 0], draft[0, 0]).sum())  # sum(min(p, q))
        accepted_first = int((num_accepted >= 1).sum())
        assert stats.binomtest(accepted_first, ROWS, rate).pvalue > ALPHA


def test_selection_must_not_look_at_the_verified_token() -> None:
    """Why ``rejection_verify`` documents its losslessness condition (a counterexample).

    ``p = (.5, .5)``, ``q = (.9, .1)``; verifying ``x_0`` only when ``q(x_0) > .2`` emits token 0
    with probability ``.9 * min(1, .5/.9) + .1 * .5 = .55`` instead of ``.5``. The test checks that
    the implementation reproduces this analytical bias (binomial test at ALPHA), i.e. that the
    condition is real and not an artefact of the code.
    """
    gen = torch.Generator().manual_seed(16)
    rows = 100_000
    q = torch.tensor([0.9, 0.1]).expand(rows, 1, 2)
    p = torch.tensor([0.5, 0.5]).expand(rows, 2, 2)
    draft = torch.multinomial(q[:, 0], 1, generator=gen)  # [N, 1]
    lengths = (q[:, 0].gather(-1, draft) > 0.2).to(torch.int64).squeeze(1)
    num_accepted, next_token = rejection_verify(draft, lengths, q, p, gen)
    first = torch.where(num_accepted > 0, draft[:, 0], next_token)
    assert stats.binomtest(int((first == 0).sum()), rows, 0.55).pvalue > ALPHA
    assert stats.binomtest(int((first == 0).sum()), rows, 0.5).pvalue < ALPHA


# --- bad input ------------------------------------------------------------------------------


def valid_args(batch: int = 2, width: int = 3, vocab: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(15)
    return {
        "draft_tokens": torch.randint(0, vocab, (batch, width), generator=gen),
        "lengths": torch.tensor([0, width]),
        "draft_probs": random_probs(batch, width, vocab, gen=gen).float(),
        "target": random_probs(batch, width + 1, vocab, gen=gen).float(),
    }


def call_greedy(a: dict) -> object:
    return greedy_verify(a["draft_tokens"], a["lengths"], a["target"])


def call_rejection(a: dict) -> object:
    return rejection_verify(
        a["draft_tokens"], a["lengths"], a["draft_probs"], a["target"], a.get("generator")
    )


def call_tree(a: dict, *, sampled: bool) -> object:
    """Verify the chain as a tree (parents ``j - 1``): tree verification shares the chain's
    checks of tokens and target, so it must reject the same bad ones."""
    rows, width = a["lengths"].shape[0], a["draft_probs"].shape[1]
    selected = prefix_mask(a["lengths"], width)  # [B, K]
    buffers = build_tree_buffers(chain_parents(rows, width))
    if not sampled:
        return tree_greedy_verify(a["draft_tokens"], selected, buffers, a["target"])
    # [B, K + 1, V]: a tree also has the draft's distribution after its last node (unused here).
    draft = torch.cat([a["draft_probs"], a["draft_probs"][:, -1:]], dim=1)
    return tree_rejection_verify(
        a["draft_tokens"], selected, buffers, draft, a["target"], sampled_children=True
    )


VERIFIERS = {
    # name: (call, name of its target argument, name of its tokens argument)
    "greedy": (call_greedy, "target_logits", "draft_tokens"),
    "rejection": (call_rejection, "target_probs", "draft_tokens"),
    "tree-greedy": (lambda a: call_tree(a, sampled=False), "target_logits", "tokens"),
    "tree-rejection": (lambda a: call_tree(a, sampled=True), "target_probs", "tokens"),
}
CHAIN_VERIFIERS = ("greedy", "rejection")

SHARED_BAD = {
    # name: (change to the valid arguments, error, argument named in the message)
    "tokens rank 1": (lambda a: {"draft_tokens": a["draft_tokens"][0]}, ValueError, "draft_tokens"),
    "float tokens": (
        lambda a: {"draft_tokens": a["draft_tokens"] * 1.0},
        TypeError,
        "draft_tokens",
    ),
    "bool tokens": (lambda a: {"draft_tokens": a["draft_tokens"] > 0}, TypeError, "draft_tokens"),
    "list tokens": (lambda a: {"draft_tokens": [[0, 1, 2]] * 2}, TypeError, "draft_tokens"),
    "token >= V": (lambda a: {"draft_tokens": a["draft_tokens"] + 5}, ValueError, "draft_tokens"),
    "token < 0": (lambda a: {"draft_tokens": a["draft_tokens"] - 5}, ValueError, "draft_tokens"),
    "target rank 2": (lambda a: {"target": a["target"][:, 0]}, ValueError, "target"),
    "target batch": (lambda a: {"target": a["target"][:1]}, ValueError, "target"),
    "target K, not K+1": (lambda a: {"target": a["target"][:, :3]}, ValueError, "target"),
    "integer target": (lambda a: {"target": a["target"].long()}, TypeError, "target"),
    "NaN target": (lambda a: {"target": a["target"] * math.nan}, ValueError, "target"),
    "target device": (lambda a: {"target": a["target"].to("meta")}, ValueError, "target"),
}

LENGTHS_BAD = {
    "lengths rank 2": (lambda a: {"lengths": a["lengths"][None]}, ValueError, "lengths"),
    "float lengths": (lambda a: {"lengths": a["lengths"] * 1.0}, TypeError, "lengths"),
    "lengths batch": (lambda a: {"lengths": torch.tensor([0, 1, 2])}, ValueError, "lengths"),
    "negative length": (lambda a: {"lengths": torch.tensor([-1, 0])}, ValueError, "lengths"),
    "length > K": (lambda a: {"lengths": torch.tensor([0, 4])}, ValueError, "lengths"),
}

BAD_CASES = [(v, c) for v in VERIFIERS for c in SHARED_BAD] + [
    (v, c) for v in CHAIN_VERIFIERS for c in LENGTHS_BAD
]

REJECTION_BAD = {
    "draft_probs V": (lambda a: {"draft_probs": a["draft_probs"][..., :4]}, "draft_probs"),
    "draft_probs K+1": (lambda a: {"draft_probs": a["target"]}, "draft_probs"),
    "draft_probs rank": (lambda a: {"draft_probs": a["draft_probs"][0]}, "draft_probs"),
    "draft_probs < 0": (lambda a: {"draft_probs": -a["draft_probs"]}, "draft_probs"),
    "draft_probs NaN": (lambda a: {"draft_probs": a["draft_probs"] * math.nan}, "draft_probs"),
    "target_probs > 1": (lambda a: {"target": a["target"] * 5.0}, "target_probs"),
    "int draft_probs": (lambda a: {"draft_probs": a["draft_probs"].long()}, "draft_probs"),
    "draft_probs device": (lambda a: {"draft_probs": a["draft_probs"].to("meta")}, "draft_probs"),
    "generator": (lambda a: {"generator": 7}, "generator"),
}


@pytest.mark.parametrize(("verifier", "case"), BAD_CASES)
def test_bad_input_is_rejected(verifier: str, case: str) -> None:
    call, target_name, tokens_name = VERIFIERS[verifier]
    change, error, name = {**SHARED_BAD, **LENGTHS_BAD}[case]
    args = valid_args()
    call(args)  # the unchanged arguments are fine
    args.update(change(args))
    with pytest.raises(
        error, match={"target": target_name, "draft_tokens": tokens_name}.get(name, name)
    ):
        call(args)


@pytest.mark.parametrize("case", list(REJECTION_BAD))
def test_bad_rejection_input_is_rejected(case: str) -> None:
    change, name = REJECTION_BAD[case]
    args = valid_args()
    args.update(change(args))
    with pytest.raises((ValueError, TypeError), match=name):
        call_rejection(args)


@pytest.mark.parametrize("call", [call_greedy, call_rejection])
def test_no_host_sync_on_meta_tensors(call: Callable[[dict], object]) -> None:
    """Meta tensors carry no data: any ``.item()``/``bool()``/``nonzero`` would raise here."""
    args = {k: v.to("meta") for k, v in valid_args(batch=4, width=3, vocab=7).items()}
    args["lengths"] = torch.empty(4, dtype=torch.int64, device="meta")
    num_accepted, next_token = call(args)
    assert num_accepted.shape == next_token.shape == (4,)
    assert num_accepted.dtype == next_token.dtype == torch.int64
