"""Tree verification: greedy against a reference walk; sampling lossless by chi-square."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _stats import ALPHA, chi_square_pvalue
from conftest import paper_tetris
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.tree import build_tree_buffers, chain_parents
from specselect.verify import greedy_verify
from specselect.verify_tree import tree_greedy_verify, tree_rejection_verify


def reference_greedy(parents, tokens, selected, argmax) -> tuple[int, int]:
    """Walk every path from the root through selected children that match the target's argmax
    after their parent, and end at the deepest node reached (lowest index among equals).

    Siblings may hold the same token (random trees do): any matching path is the target's own
    greedy continuation, and the deepest one accepts the most tokens.
    """

    def deepest(node: int, depth: int) -> tuple[int, int]:  # (depth, -index) of the end
        best = (depth, -node)
        for j in range(len(parents)):
            if parents[j] == node and selected[j] and tokens[j] == argmax[node + 1]:
                best = max(best, deepest(j, depth + 1))
        return best

    depth, minus_end = deepest(-1, 0)
    return depth, argmax[-minus_end + 1]


@st.composite
def greedy_cases(draw: st.DrawFn):
    rows, nodes, vocab = draw(st.integers(1, 3)), draw(st.integers(0, 7)), 3
    parents = torch.tensor(
        [[draw(st.integers(-1, j - 1)) for j in range(nodes)] for _ in range(rows)],
        dtype=torch.int64,
    ).reshape(rows, nodes)
    tokens = torch.tensor(
        draw(st.lists(st.integers(0, vocab - 1), min_size=rows * nodes, max_size=rows * nodes)),
        dtype=torch.int64,  # an empty list would make a float tensor
    ).reshape(rows, nodes)
    keep = torch.tensor(
        draw(st.lists(st.booleans(), min_size=rows * nodes, max_size=rows * nodes)),
        dtype=torch.bool,
    )
    buffers = build_tree_buffers(parents)
    # Close the random choice under ancestors: a node is selected iff its whole path is kept.
    keep = keep.reshape(rows, nodes)
    selected = ~(buffers.ancestors & ~keep.unsqueeze(1)).any(dim=2)
    logits = torch.randn(
        rows, nodes + 1, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
    )
    return parents, tokens, selected, logits


@settings(max_examples=80, deadline=None)
@given(greedy_cases())
def test_greedy_matches_reference_walk(case) -> None:
    parents, tokens, selected, logits = case
    verdict = tree_greedy_verify(tokens, selected, build_tree_buffers(parents), logits)
    argmax = logits.argmax(-1)
    for i in range(parents.shape[0]):
        depth, nxt = reference_greedy(
            parents[i].tolist(), tokens[i].tolist(), selected[i].tolist(), argmax[i].tolist()
        )
        assert (int(verdict.num_accepted[i]), int(verdict.next_token[i])) == (depth, nxt)
        path = [j for j in verdict.path[i].tolist() if j >= 0]
        assert len(path) == depth
        assert all(selected[i, j] for j in path)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 6), st.integers(0, 999))
def test_greedy_on_a_chain_equals_chain_verification(rows, width, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (rows, width), generator=gen)
    logits = torch.randn(rows, width + 1, 3, generator=gen)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    selected = torch.arange(width) < lengths.unsqueeze(1)
    verdict = tree_greedy_verify(
        tokens, selected, build_tree_buffers(chain_parents(rows, width)), logits
    )
    accepted, nxt = greedy_verify(tokens, lengths, logits)
    assert torch.equal(verdict.num_accepted, accepted)
    assert torch.equal(verdict.next_token, nxt)


# A depth-2 tree with two children per node: root -> {0, 1}; 0 -> {2, 3}; 1 -> {4, 5}.
PARENTS = [-1, -1, 0, 0, 1, 1]


def _sampled_tree_step(sampled: bool, selected_nodes: list[int] | str, rows: int, seed: int):
    """Draft one tree per row, verify it, return the first two emitted tokens and the target.

    ``selected_nodes`` is a fixed node list, or ``"tetris-causal"`` / ``"tetris-raw"``: TETRIS
    (k = 2) over the batch on causal scores (:mod:`specselect.scores`) or on raw draft
    probabilities.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = 4
    p_root = torch.softmax(2 * torch.randn(vocab, generator=gen), -1)
    q_root = torch.softmax(2 * torch.randn(vocab, generator=gen), -1)
    p_next = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)  # given last token
    q_next = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)
    if sampled:
        first = torch.multinomial(q_root.expand(rows, vocab), 2, True, generator=gen)  # [B, 2]
        second = torch.multinomial(q_next[first.reshape(-1)], 2, True, generator=gen)
    else:  # deterministic top-2 children
        first = q_root.topk(2).indices.expand(rows, 2)
        second = q_next[first.reshape(-1)].topk(2).indices
    tokens = torch.cat([first, second.reshape(rows, 4)], dim=1)  # [B, 6] in PARENTS order
    parents = torch.tensor(PARENTS).expand(rows, 6)
    buffers = build_tree_buffers(parents)
    root_q, root_p = q_root.expand(rows, 1, vocab), p_root.expand(rows, 1, vocab)
    draft_probs = torch.cat([root_q, q_next[tokens]], dim=1)  # [B, 7, V]
    target_probs = torch.cat([root_p, p_next[tokens]], dim=1)
    if isinstance(selected_nodes, str):
        parent_dist = draft_probs.gather(  # node j was drawn from its parent's q
            1, (parents + 1).unsqueeze(2).expand(-1, -1, vocab)
        )  # [B, 6, V]
        token_lp = parent_dist.gather(2, tokens.unsqueeze(2)).squeeze(2).log()
        scores = token_lp
        if selected_nodes == "tetris-causal":
            scores = causal_logprobs(token_lp, expected_self_logprob(parent_dist), parents)
        selected = paper_tetris(k=2).select(scores, parents=parents).mask
    else:
        selected = torch.zeros(rows, 6, dtype=torch.bool)
        selected[:, selected_nodes] = True
    verdict = tree_rejection_verify(
        tokens,
        selected,
        buffers,
        draft_probs,
        target_probs,
        sampled_children=sampled,
        max_depth=2,
        max_children=2,
        generator=gen,
    )
    emitted = torch.cat([verdict.accepted_tokens(tokens), verdict.next_token.unsqueeze(1)], 1)
    # Put the next token right after the accepted path, then read the first two tokens; a row
    # that emitted one token continues with a plain target sample, as the next step would.
    t1 = torch.where(verdict.num_accepted >= 1, emitted[:, 0], verdict.next_token)
    t2 = torch.where(
        verdict.num_accepted >= 2,
        emitted[:, 1],
        torch.where(
            verdict.num_accepted == 1,
            verdict.next_token,
            torch.multinomial(p_next[t1], 1, generator=gen).squeeze(1),
        ),
    )
    joint = (p_root.unsqueeze(1) * p_next).reshape(-1)  # [V * V]
    return t1 * vocab + t2, joint, verdict


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-children", "top-k-children"])
@pytest.mark.parametrize(
    "selected_nodes", [[0, 1, 2, 3, 4, 5], [0, 1, 2], [0], [], "tetris-causal"]
)
def test_tree_sampling_is_lossless(sampled: bool, selected_nodes: list[int] | str) -> None:
    assert _pvalue(sampled, selected_nodes) > ALPHA


def test_tetris_on_raw_tree_scores_is_not_lossless() -> None:
    """The same test sees the bias of ranking sampled children by their own probability."""
    assert _pvalue(True, "tetris-raw") < ALPHA


def _pvalue(sampled: bool, selected_nodes: list[int] | str) -> float:
    pairs, joint, _ = _sampled_tree_step(sampled, selected_nodes, rows=60_000, seed=1)
    return chi_square_pvalue(torch.bincount(pairs, minlength=joint.numel()), joint)


def test_more_children_accept_more() -> None:
    """Multi-candidate verification must actually use the extra candidates."""
    one = _sampled_tree_step(True, [0, 2], rows=20_000, seed=2)[2].num_accepted.float().mean()
    all_ = _sampled_tree_step(True, list(range(6)), rows=20_000, seed=2)[2]
    assert all_.num_accepted.float().mean() > one + 0.05


def test_bad_shapes_are_rejected() -> None:
    buffers = build_tree_buffers(chain_parents(2, 3))
    with pytest.raises(ValueError, match="target_logits must have shape"):
        tree_greedy_verify(
            torch.zeros(2, 3, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
            buffers,
            torch.zeros(2, 3, 5),
        )
    with pytest.raises(ValueError, match="selected must be a bool tensor"):
        tree_greedy_verify(
            torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), buffers, torch.zeros(2, 4, 5)
        )


def valid_tree_args(rows: int = 2, vocab: int = 5) -> dict:
    """Arguments both tree verifiers accept: node 3 sits at depth 3, node 0 has two children."""
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 2]]).expand(rows, 4)
    logits = torch.randn(rows, 5, vocab, generator=gen)
    return {
        "tokens": torch.randint(0, vocab, (rows, 4), generator=gen),
        "selected": torch.ones(rows, 4, dtype=torch.bool),
        "buffers": build_tree_buffers(parents),
        "target": logits,
        "draft_probs": torch.softmax(torch.randn(rows, 5, vocab, generator=gen), -1),
    }


def call_tree_greedy(a: dict) -> object:
    return tree_greedy_verify(a["tokens"], a["selected"], a["buffers"], a["target"])


def call_tree_rejection(a: dict) -> object:
    return tree_rejection_verify(
        a["tokens"],
        a["selected"],
        a["buffers"],
        a["draft_probs"],
        torch.softmax(a["target"], -1) if a["target"].is_floating_point() else a["target"],
        sampled_children=True,
        max_depth=a.get("max_depth", 3),
        max_children=a.get("max_children", 2),
    )


# Bad tokens and targets: test_verify.py runs its table through both tree verifiers too.
TREE_REJECTION_BAD = {
    "selected device": (lambda a: {"selected": a["selected"].to("meta")}, "selected is on"),
    "draft_probs N + 1": (lambda a: {"draft_probs": torch.full((2, 9, 5), 0.2)}, "draft_probs"),
    "draft_probs V": (lambda a: {"draft_probs": a["draft_probs"][..., :3]}, "draft_probs"),
    "draft_probs NaN": (lambda a: {"draft_probs": a["draft_probs"] * math.nan}, "draft_probs"),
    "draft_probs device": (lambda a: {"draft_probs": a["draft_probs"].to("meta")}, "draft_probs"),
    "max_depth float": (lambda a: {"max_depth": 2.5}, "max_depth must be an int"),
    "max_depth < 1": (lambda a: {"max_depth": -5}, "max_depth must be >= 1"),
    "max_children 0": (lambda a: {"max_children": 0}, "max_children must be >= 1"),
    "max_children < 0": (lambda a: {"max_children": -3}, "max_children must be >= 1"),
    "node deeper than max_depth": (
        lambda a: {"max_depth": 2},
        r"max_depth = 2, but selected node 3 of row 0 is at depth 3",
    ),
    "more children than max_children": (
        lambda a: {"max_children": 1},
        r"max_children = 1, but node 0 of row 0 has 2 selected children",
    ),
}


@pytest.mark.parametrize("case", list(TREE_REJECTION_BAD))
def test_bad_tree_rejection_input_is_rejected(case: str) -> None:
    change, name = TREE_REJECTION_BAD[case]
    args = valid_tree_args()
    call_tree_rejection(args)  # the unchanged arguments are fine
    args.update(change(args))
    with pytest.raises((ValueError, TypeError), match=name):
        call_tree_rejection(args)


@pytest.mark.parametrize("call", [call_tree_greedy, call_tree_rejection])
def test_tree_checks_read_no_values_on_meta_tensors(call: Callable[[dict], object]) -> None:
    """Meta tensors carry no data: a value check (or any host read) would raise here. The
    selection breaks both walk bounds, which only a value check could see."""
    args = {
        k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in valid_tree_args().items()
    }
    args["buffers"] = build_tree_buffers(torch.tensor([[-1, 0, 0, 2]] * 2, device="meta"))
    verdict = call({**args, "max_depth": 1, "max_children": 1})
    assert verdict.num_accepted.shape == verdict.next_token.shape == (2,)


def test_tree_sampling_computes_in_the_wider_input_dtype() -> None:
    """Like chains, the walk runs in the wider of draft_probs' and target_probs' dtypes: which
    input carries float64 does not change the draws (float32 uniforms would)."""
    a = valid_tree_args(rows=64)
    # Values exact in float32, so that only the dtypes differ between the runs.
    target = torch.softmax(a["target"], -1).float().double()

    def run(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        verdict = tree_rejection_verify(
            a["tokens"],
            a["selected"],
            a["buffers"],
            draft,
            target,
            sampled_children=True,
            generator=torch.Generator().manual_seed(3),
        )
        return torch.stack([verdict.num_accepted, verdict.next_token])

    draft = a["draft_probs"].float().double()
    assert torch.equal(run(draft.float(), target), run(draft, target))
    assert torch.equal(run(draft, target.float()), run(draft, target))
