"""Prompt-lookup features: the device computation against a direct search, the window the loop
keeps, the features replay derives from traces, and what synthetic traces must not reveal."""

from __future__ import annotations

import pytest
import torch

from specselect.estimators.synthetic import CALIBRATIONS, synthetic_traces
from specselect.lookup import (
    LOOKUP_WINDOW,
    MAX_NGRAM,
    chain_paths,
    lookup_features,
    lookup_matches,
    push_tokens,
)
from specselect.replay import Traces
from specselect.tree import build_tree_buffers

CPU = torch.device("cpu")


def direct_match(context: list[int], path: list[int], token: int) -> tuple[int, bool]:
    """The definition, searched the slow way: the longest suffix (<= MAX_NGRAM tokens) of
    ``context + path`` with an earlier occurrence whose follower lies in ``context``, and
    whether the follower of its most recent occurrence is ``token``."""
    sequence = context + path
    for n in range(MAX_NGRAM, 0, -1):
        if len(sequence) < n:
            continue
        suffix = sequence[len(sequence) - n :]
        for follower in range(len(context) - 1, n - 1, -1):
            if sequence[follower - n : follower] == suffix:
                return n, context[follower] == token
    return 0, False


def right_aligned(contexts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, width] window, [B] filled)``; the unfilled columns hold a token id, which must not
    count."""
    window = torch.full((len(contexts), width), 1, dtype=torch.int64)
    for row, context in enumerate(contexts):
        if context:
            window[row, width - len(context) :] = torch.tensor(context)
    return window, torch.tensor([len(c) for c in contexts])


def random_case(gen: torch.Generator, tree: bool) -> tuple:
    """A small random batch over a tiny vocabulary (many matches), chain or tree drafts."""
    rows, width, vocab = 3, int(torch.randint(4, 12, (1,), generator=gen)), 3
    lengths = torch.randint(0, width + 1, (rows,), generator=gen).tolist()
    contexts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]
    nodes = int(torch.randint(1, 7, (1,), generator=gen))
    tokens = torch.randint(vocab, (rows, nodes), generator=gen)
    if tree:  # parents before children; -1: a child of the root
        columns = [torch.randint(-1, j, (rows,), generator=gen) for j in range(nodes)]
        paths = build_tree_buffers(torch.stack(columns, dim=1)).paths
    else:
        paths = chain_paths(nodes, CPU).expand(rows, nodes, nodes)
    return contexts, width, tokens, paths


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_matches_equal_a_direct_search(tree: bool) -> None:
    gen = torch.Generator().manual_seed(1 + tree)
    seen = set()
    for _ in range(150):
        contexts, width, tokens, paths = random_case(gen, tree)
        window, filled = right_aligned(contexts, width)
        length, agrees = lookup_matches(window, filled, tokens, paths)
        for row, context in enumerate(contexts):
            for node in range(tokens.shape[1]):
                path = [int(tokens[row, i]) for i in paths[row, node].tolist() if i >= 0]
                expected = direct_match(context, path[:-1], path[-1])
                assert (int(length[row, node]), bool(agrees[row, node])) == expected
                seen.add(expected)
    # Every length, with and without agreement, was exercised.
    assert {(n, a) for n in range(1, MAX_NGRAM + 1) for a in (False, True)} <= seen


def test_features_spell_out_the_match() -> None:
    """``[agrees, contradicts, agrees * length / M, length / M]``, by hand: the context
    ``5 6 7 5 6`` continues ``5 6`` with 7."""
    window, filled = right_aligned([[5, 6, 7, 5, 6]], 8)
    tokens = torch.tensor([[7, 9, 8]])  # 7 agrees (match "5 6"), then "5 6 7" continues 5
    features = lookup_features(window, filled, tokens, chain_paths(3, CPU))
    expected = [[1.0, 0.0, 0.5, 0.5], [0.0, 1.0, 0.0, 0.75], [0.0, 0.0, 0.0, 0.0]]
    assert features[0].tolist() == expected


def test_push_tokens_keeps_the_most_recent_tokens() -> None:
    window = torch.tensor([[0, 0, 1, 2], [3, 4, 5, 6]])
    filled = torch.tensor([2, 4])
    push_tokens(window, filled, torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([2, 0]))
    assert window.tolist() == [[1, 2, 7, 8], [3, 4, 5, 6]]
    assert filled.tolist() == [4, 4]
    push_tokens(window, filled, torch.tensor([[13, 14, 15], [16, 17, 18]]), torch.tensor([3, 3]))
    assert window.tolist() == [[8, 13, 14, 15], [6, 16, 17, 18]]


def test_trace_features_are_each_positions_context() -> None:
    """Replay's features at position ``t`` read the prompt and the first ``t`` outputs, the
    last LOOKUP_WINDOW of them: a prompt longer than the window is cut."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, (n,), generator=gen) for n in (LOOKUP_WINDOW + 40, 3)]
    output = torch.randint(4, (2, 12), generator=gen)
    drafts = torch.randint(4, (2, 12, 3), generator=gen)
    traces = Traces(prompts, output, drafts, torch.zeros(2, 12, 3))
    features = traces.lookup_features  # [N, T, K, F]
    assert features.shape == (2, 12, 3, 4)
    for n in range(2):
        for t in range(12):
            context = (prompts[n].tolist() + output[n, :t].tolist())[-LOOKUP_WINDOW:]
            for j in range(3):
                path = drafts[n, t, :j].tolist()
                length, agrees = direct_match(context, path, int(drafts[n, t, j]))
                assert features[n, t, j, 3] == length / MAX_NGRAM
                assert features[n, t, j, 0] == float(agrees)


@pytest.mark.parametrize("calibration", CALIBRATIONS)
def test_synthetic_traces_hide_the_outcomes_from_the_lookup(calibration: str) -> None:
    """Synthetic text is random: hardly any match, so the lookup features cannot tell which
    tokens pass (the old traces, token 0 everywhere, spelled the outcome out; prompts of one
    repeated token matched every request's first draft token, 1/128 of the tokens here)."""
    traces = synthetic_traces(calibration, requests=16, length=32, width=4)
    matched = traces.lookup_features[..., 3] > 0
    assert float(matched.float().mean()) < 0.004


def test_an_empty_batch_has_no_features() -> None:
    """Zero rows (traces of no output, a loop with nothing left) is a shape, not an error."""
    window, filled = torch.zeros(0, 8, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    tokens = torch.zeros(0, 3, dtype=torch.int64)
    assert lookup_features(window, filled, tokens, chain_paths(3, CPU)).shape == (0, 3, 4)


def _push(**changes: object) -> None:
    """push_tokens on a valid call of two rows, with ``changes``."""
    call = {
        "window": torch.zeros(2, 4, dtype=torch.int64),
        "filled": torch.tensor([0, 2]),
        "tokens": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "counts": torch.tensor([3, 1]),
        **changes,
    }
    push_tokens(**call)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "error", "says"),
    [
        ({"counts": torch.tensor([5, 1])}, ValueError, r"counts must be <= the tokens per row"),
        ({"counts": torch.tensor([-1, 1])}, ValueError, r"counts must be >= 0"),
        ({"filled": torch.tensor([0, 9])}, ValueError, r"filled must be <= the window's width"),
        ({"tokens": torch.tensor([1, 2, 3])}, ValueError, r"tokens must have rank 2"),
        ({"tokens": torch.ones(3, 2, dtype=torch.int64)}, ValueError, r"tokens must have shape"),
        ({"window": torch.zeros(2, 4)}, TypeError, r"window must be a \[B, W\] int64 tensor"),
        ({"counts": torch.tensor([1.0, 1.0])}, TypeError, r"counts must be an integer tensor"),
        ({"tokens": torch.tensor([[1, -1, 3], [4, 5, 6]])}, ValueError, r"tokens must be >= 0"),
    ],
)
def test_push_tokens_refuses_bad_input(changes: dict, error: type, says: str) -> None:
    """More counts than tokens repeated the last token and overstated ``filled``; the others
    failed inside an index op or an expand, naming nothing."""
    _push()  # the call itself is valid
    with pytest.raises(error, match=says):
        _push(**changes)


def test_lookup_features_refuse_paths_of_another_shape() -> None:
    window, filled = torch.zeros(2, 8, dtype=torch.int64), torch.tensor([8, 8])
    tokens = torch.ones(2, 3, dtype=torch.int64)
    assert lookup_features(window, filled, tokens, chain_paths(3, window.device)).shape == (2, 3, 4)
    with pytest.raises(ValueError, match=r"paths must be \[B, N, D\] or \[N, D\] with B = 2"):
        lookup_features(window, filled, tokens, chain_paths(4, window.device))


def test_lookup_features_refuse_negative_tokens_and_paths_out_of_range() -> None:
    """A token id of -1 matched the marker of an unreadable window column ("contradicts" with
    an empty window); a path entry out of range failed in an index op, naming nothing."""
    window, filled = torch.zeros(2, 8, dtype=torch.int64), torch.tensor([0, 8])
    tokens = torch.ones(2, 3, dtype=torch.int64)
    paths = chain_paths(3, window.device)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        lookup_features(window, filled, tokens - 2, paths)
    for bad in (paths + 3, paths - 1):
        with pytest.raises(ValueError, match=r"paths must hold node indices in \[-1, 3\)"):
            lookup_features(window, filled, tokens, bad)
