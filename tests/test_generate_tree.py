"""Tree mode of ``speculative_generate``: tree passes, the tree drafter, greedy identity,
lossless sampling and argument errors.

Fixtures come from tests/hf_models.py (tiny random Llama and GPT-2, noisy-copy drafts) and reuse
the chain tests' cases: ``test_generate_greedy.case`` (prompts, an EOS id the target produces,
``generate()``'s greedy output) and ``test_generate_sampling``'s exact target distributions.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from _stats import ALPHA, chi_square_pvalue
from greedy_cases import (
    MAX_NEW,
    MAX_PROMPT,
    SEEDS,
    assert_covers_both_endings,
    case,
    verify_pass_widths,
)
from hf_models import (
    ARCHS,
    PAD_ID,
    left_padded_prompts,
    tiny_model,
)
from sampling_cases import assert_follows_target, interleaved_prompts, sampling_pair
from specselect import FixedWindowSelector, make_selector
from specselect.hf import (
    ModelCache,
    SamplingParams,
    TreeDrafter,
    TreeSpec,
    emulate_on_cpu,
    speculative_generate,
)
from specselect.hf import steps as steps_module
from specselect.hf.compat import ModelHandle
from specselect.tree import build_tree_buffers
from specselect.verify_tree import tree_rejection_verify

TREE = TreeSpec(depth=4, branch=2, width=2)
GREEDY_VOCAB = 128


def random_parents(rows: int, nodes: int, gen: torch.Generator) -> torch.Tensor:  # [B, N]
    """Random trees: node ``j``'s parent is uniform over the root and nodes ``0 .. j - 1``."""
    parents = torch.empty(rows, nodes, dtype=torch.int64)
    for j in range(nodes):
        parents[:, j] = torch.randint(-1, j, (rows,), generator=gen)
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    """Root-to-``node`` path (node indices), from a row's parent list."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("arch", ARCHS)
def test_one_tree_pass_equals_sequential_paths(arch: str) -> None:
    """Every node's logits from ONE batched pass over [root, nodes] (tree mask, positions root +
    depth, a real cache prefix behind left-padded prompts) equal decoding its path alone."""
    model = tiny_model(arch, 3).float()
    handle = ModelHandle.of("model", model)
    gen = torch.Generator().manual_seed(3)
    batch, nodes = 4, 7
    ids, mask = left_padded_prompts(batch, 2, 7, GREEDY_VOCAB, 3)
    parents = random_parents(batch, nodes, gen)
    tokens = torch.randint(3, GREEDY_VOCAB, (batch, nodes), generator=gen)
    buffers = build_tree_buffers(parents)
    depth = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), buffers.depth], dim=1)
    cache = ModelCache(handle, batch, 64)
    with torch.no_grad():
        context, valid = ids[:, :-1], mask[:, :-1].bool()
        cache.reserve(context.shape[1])
        cache.forward(context, valid)
        cache.commit(valid)
        block = torch.cat([ids[:, -1:], tokens], dim=1)
        cache.reserve(block.shape[1])
        logits = cache.forward(
            block,
            torch.ones_like(block, dtype=torch.bool),
            depth=depth,
            block_mask=buffers.attention_mask(),
        )  # [B, N + 1, V]
        for row in range(batch):
            prompt = ids[row][mask[row].bool()]
            for node in range(-1, nodes):
                path = path_to(parents[row].tolist(), node)
                seq = torch.cat([prompt, tokens[row, path]]).unsqueeze(0)
                expected = model(seq).logits[0, -1]
                assert (logits[row, node + 1] - expected).abs().max() <= 1e-5


def draft_logprobs(model: nn.Module, sequence: list[int]) -> torch.Tensor:  # [V]
    return torch.log_softmax(model(torch.tensor([sequence])).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_drafter_expands_its_own_top_children(arch: str) -> None:
    """Drafting is invisible to the identity tests (the target corrects any draft), so check it
    directly. Over several steps with random accepted paths (including leaves, which the draft
    never ran on, and the root alone) each node is one of the top-``branch`` tokens of the draft
    model run from scratch on the row's sequence plus the node's path, with that log-prob."""
    model = tiny_model(arch, 5)
    spec = TreeSpec(depth=3, branch=2, width=2)
    batch = 3
    ids, mask = left_padded_prompts(batch, 1, 6, GREEDY_VOCAB, 5)
    sequences = [ids[r][mask[r].bool()].tolist() for r in range(batch)]
    drafter = TreeDrafter(
        ModelHandle.of("draft", model), batch, 128, GREEDY_VOCAB, SamplingParams(), None
    )
    active = torch.ones(batch, dtype=torch.bool)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        drafter.reset()
        drafter.admit(list(range(batch)), ids[:, :-1], mask[:, :-1].bool(), ids[:, -1])
        for step in range(4):
            drafter.cache.reserve(drafter.tree_footprint(spec))
            tree = drafter.draft_tree(active, spec)
            buffers = build_tree_buffers(tree.parents)
            assert tree.tokens.shape == (batch, spec.num_nodes)
            for row in range(batch):
                parents = tree.parents[row].tolist()
                for node in range(spec.num_nodes):
                    prefix = tree.tokens[row, path_to(parents, parents[node])].tolist()
                    logprobs = draft_logprobs(model, sequences[row] + prefix)
                    top = logprobs.topk(spec.branch).indices.tolist()
                    assert int(tree.tokens[row, node]) in top
                    got = float(tree.logprobs[row, node])
                    assert abs(got - float(logprobs[tree.tokens[row, node]])) < 1e-4
            # Row 0 accepts a deepest node (a leaf: never fed), row 1 nothing, row 2 random.
            deepest = int(tree.depth[0].argmax()) + step % 2
            last = torch.tensor(
                [deepest, -1, int(torch.randint(0, spec.num_nodes, (1,), generator=gen))]
            )
            path = torch.where(
                (last >= 0).unsqueeze(1), buffers.paths[torch.arange(batch), last.clamp(min=0)], -1
            )
            next_token = torch.randint(3, GREEDY_VOCAB, (batch,), generator=gen)
            drafter.advance_tree(tree, path, last, next_token)
            drafter.advanced(spec.depth)
            for row in range(batch):
                node = int(last[row])
                accepted = path_to(tree.parents[row].tolist(), node) if node >= 0 else []
                sequences[row] += [*tree.tokens[row, accepted].tolist(), int(next_token[row])]


SELECTORS = {
    "tetris": lambda: make_selector("tetris", k=3, extra=2),  # history estimator + guard
    "tetris-paper": lambda: make_selector("tetris", k=3, extra=2, estimator=None, guard=False),
    "fixed": lambda: make_selector("fixed", k=3),
    # The window selectors: a window is a depth, learned from the accepted paths.
    "dsd": lambda: make_selector("dsd", max_k=3),
    "threshold": lambda: make_selector("threshold", max_k=3, threshold=0.1),
    "heuristic": lambda: make_selector("heuristic", k0=2, max_k=4),
}
BUDGETED = ("tetris", "tetris-paper", "fixed")  # C = 3 nodes per active request


@functools.cache
def run(arch: str, seed: int, selector_name: str):
    """Tree ``speculative_generate`` on :func:`case`, once per case and selector."""
    target, draft, ids, mask, eos, _ = case(arch, seed)
    return speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=SELECTORS[selector_name](),
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
        tree=TREE,
    )


@pytest.mark.parametrize("selector_name", sorted(SELECTORS))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_matches_generate(arch: str, seed: int, selector_name: str) -> None:
    reference = case(arch, seed)[5]
    out = run(arch, seed, selector_name)
    assert torch.equal(out.sequences, reference)
    stats = out.stats
    totals = stats.totals
    assert totals.tokens_per_step > 1.5, "the drafts must be accepted often"
    # The budget: C = 3 nodes per active request, globally (TETRIS) or per request (fixed).
    for step, verified in zip(stats.steps, stats.verified_per_step, strict=True):
        assert step.verified <= 3 * step.active or selector_name not in BUDGETED
        if selector_name == "fixed":
            assert int(verified.max()) <= 3
    assert int(stats.accepted.sum()) == totals.accepted
    assert (stats.accepted <= stats.verified).all()


@pytest.mark.parametrize("selector_name", sorted(SELECTORS))
def test_greedy_tree_cases_cover_both_endings(selector_name: str) -> None:
    assert_covers_both_endings(
        (run(arch, seed, selector_name), case(arch, seed)[4]) for arch in ARCHS for seed in SEEDS
    )


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize(
    ("selector_name", "rows", "tree", "widest", "cut"),
    [
        ("fixed", 8, TREE, 3, False),
        ("tetris-paper", 1, TREE, 3, False),
        ("tetris-paper", 8, TREE, TREE.num_nodes, True),
        ("threshold", 1, None, 3, True),
        ("tetris-paper", 8, None, 5, True),
    ],
    ids=["fixed-tree", "paper-tree-1", "paper-tree-8", "threshold-chain", "paper-chain"],
)
def test_verify_pass_sends_only_what_can_be_selected(
    selector_name: str, rows: int, tree: TreeSpec | None, widest: int, cut: bool, graphs: bool
) -> None:
    """In graph mode the target's verify pass has a static width: the pending token and the
    tokens a row may select: a chain's whole draft (``k + extra`` for TETRIS), of a tree ``k``
    nodes for fixed SD, ``k * active`` for TETRIS when the tree has more nodes (one row), the
    whole tree otherwise. Eagerly on a CPU, where reading the selection is free, each pass
    holds the pending token and the widest row's selection (``cut``: narrower than the static
    width at some step). The output stays generate()'s."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    with verify_pass_widths(target) as widths, emulate_on_cpu():
        out = speculative_generate(
            target,
            draft,
            ids[:rows],
            mask[:rows],
            selector=SELECTORS[selector_name](),
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            pad_token_id=PAD_ID,
            tree=tree,
            cuda_graphs=graphs,
        )
    assert torch.equal(out.sequences, reference[:rows])
    if graphs:  # (replays do not call forward)
        assert max(widths) == 1 + widest
    else:  # one pass per step
        assert widths == [1 + int(verified.max()) for verified in out.stats.verified_per_step]
        full = max(out.stats.draft_depths)  # the steps that drafted at the static width
        steps = zip(widths, out.stats.draft_depths, strict=True)
        assert any(width < 1 + widest for width, depth in steps if depth == full) == cut


@pytest.mark.parametrize("max_new", [1, 2, 5])
@pytest.mark.parametrize("do_sample", [False, True])
def test_short_generations_cut_the_tree(max_new: int, do_sample: bool) -> None:
    """With 1 token left no tree is drafted (plain decoding); with few left the tree is cut.
    Greedy output still equals generate(); sampled rows have the right length and no EOS."""
    target, draft, ids, mask, _, _ = case("gpt2", 0)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=SELECTORS["tetris-paper"](),
        max_new_tokens=max_new,
        do_sample=do_sample,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
        tree=TREE,
    )
    assert out.sequences.shape == (ids.shape[0], MAX_PROMPT + max_new)
    if not do_sample:
        reference = target.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, eos_token_id=[]
        )
        assert torch.equal(out.sequences, reference)
    assert int(out.stats.accepted.max()) <= max_new - 1


def test_sampled_trees_keep_a_float64_drafts_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's distributions reach tree verification in the draft's precision when it is
    above float32 (as on chains): rounding q there would bias the acceptance ratios q/p."""
    target, draft, ids, mask, _, _ = case("gpt2", 0)
    seen: list[bool] = []  # per call: q in float64 and not rounded to float32

    def spy(tokens, selected, buffers, draft_probs, *args, **kwargs):  # type: ignore[no-untyped-def]
        rounded = draft_probs.to(torch.float32).to(draft_probs.dtype)
        seen.append(draft_probs.dtype == torch.float64 and not torch.equal(rounded, draft_probs))
        return tree_rejection_verify(tokens, selected, buffers, draft_probs, *args, **kwargs)

    monkeypatch.setattr(steps_module, "tree_rejection_verify", spy)
    speculative_generate(
        target.double(),
        draft.double(),
        ids,
        mask,
        selector=SELECTORS["tetris-paper"](),
        max_new_tokens=6,
        do_sample=True,
        generator=torch.Generator().manual_seed(0),
        tree=TREE,
    )
    assert seen and all(seen)


def test_tetris_moves_budget_between_trees() -> None:
    """TETRIS spends its global budget unevenly: some step gives a row more than k nodes."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=SELECTORS["tetris-paper"](),
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
        tree=TREE,
    )
    assert max(int(v.max()) for v in out.stats.verified_per_step) > 3


def test_observe_gets_each_rows_deepest_verified_depth() -> None:
    """The loop's host feedback carries, per active row, the depth of the deepest node the row
    verified: what the selector's own device view of its selection says (host planners read a
    tree's outcome per depth from it)."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    selector = SELECTORS["tetris-paper"]()
    active: list[torch.Tensor] = []  # [B] bool per step
    expected: list[list[int]] = []
    observed: list[list[int]] = []
    select, update, observe = selector.select, selector.update, selector.observe

    def spy_select(draft_logprobs: torch.Tensor, rows: torch.Tensor, **kwargs: object):
        active.append(rows)
        return select(draft_logprobs, rows, **kwargs)  # type: ignore[arg-type]

    def spy_update(selection, *args: object, **kwargs: object) -> None:
        depths = selector._selected_depths(selection)  # [B]
        expected.append(depths[active[-1]].tolist())
        update(selection, *args, **kwargs)  # type: ignore[arg-type]

    def spy_observe(verified, accepted, deepest=None, active=None, **kwargs: object) -> None:
        observed.append(list(deepest))
        observe(verified, accepted, deepest, active, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        for name, spy in (("select", spy_select), ("update", spy_update), ("observe", spy_observe)):
            patch.setattr(selector, name, spy)
        speculative_generate(
            target, draft, ids, mask, selector=selector, max_new_tokens=MAX_NEW,
            eos_token_id=eos, pad_token_id=PAD_ID, tree=TREE,
        )  # fmt: skip
    assert observed[: len(expected)] == expected
    assert len(expected) >= len(observed) - 1  # the last step may be a plain one
    assert len({d for step in expected for d in step}) > 2, "depths must vary"


ROWS_PER_PROMPT = 3000


@pytest.mark.parametrize(
    ("sampled_children", "selector_name", "config"),
    [
        (True, "tetris-paper", {"temperature": 1.0}),
        (False, "tetris-paper", {"temperature": 1.0}),
        (True, "fixed", {"temperature": 0.7, "top_k": 5}),
    ],
)
def test_tree_sampling_follows_target_distribution(
    sampled_children: bool,
    selector_name: str,
    config: dict[str, float],
) -> None:
    """Chi-square goodness of fit (at ``ALPHA``, fixed seed) of the first two tokens
    (jointly) and the third token against the exact target distribution; the tree is
    depth 2 x branch 2 x width 2 (MAX_NEW = 3 caps the depth at 2)."""
    target, draft = sampling_pair()
    ids, mask = interleaved_prompts(ROWS_PER_PROMPT)
    width = ids.shape[1]
    selector = make_selector("tetris", k=3, extra=1, estimator=None, guard=False)
    if selector_name == "fixed":
        selector = make_selector("fixed", k=3)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=selector,
        max_new_tokens=3,
        do_sample=True,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(4321),
        tree=TreeSpec(depth=3, branch=2, width=2, sampled_children=sampled_children),
        **config,
    )
    totals = out.stats.totals
    # Siblings share one accepted slot, so tree VSR is lower than a chain's.
    assert 0.1 < totals.vsr < 0.95, "the fixture must exercise both acceptance and rejection"
    assert max(int(v.max()) for v in out.stats.accepted_per_step) == 2
    new = out.sequences[:, width:]
    assert_follows_target(target, new, config)


def constant_lm(probs: list[float], seed: int) -> LlamaForCausalLM:
    """A causal LM whose next-token distribution is always ``probs``, whatever the context:
    the exact target distribution of every generated token is then ``probs`` itself (a forward
    hook replaces the logits, so ``forward`` keeps its signature)."""
    model = tiny_model("llama", seed, vocab=len(probs), hidden=32).eval()
    fixed = torch.tensor(probs).log()

    def constant_logits(module: object, args: object, out: Any) -> Any:
        out.logits = torch.zeros_like(out.logits) + fixed
        return out

    model.register_forward_hook(constant_logits)
    return model


def test_tree_sampling_stays_lossless_when_a_level_outgrows_the_width() -> None:
    """With ``width`` < nodes per level the drafter chooses which sampled nodes to expand; by
    their own log q, a later sibling's verification would depend on its own token (its
    rivals' children compete with it for the budget): first-token frequency of token 2 was
    0.105 against p = 0.149 (chi-square p ~ 1e-20 at these 6000 rows). Chi-square at ``ALPHA``,
    fixed seed; constant models make the exact target distribution ``p``."""
    p, q = [0.03, 0.084, 0.149, 0.737], [0.423, 0.126, 0.023, 0.428]
    target, draft = constant_lm(p, seed=0), constant_lm(q, seed=1)
    rows = 6000
    out = speculative_generate(
        target,
        draft,
        torch.tensor([[2, 1, 3]]).expand(rows, -1).contiguous(),
        selector=make_selector("fixed", k=3),
        max_new_tokens=3,
        do_sample=True,
        top_k=0,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(3),
        tree=TreeSpec(depth=2, branch=3, width=1),
    )
    first = torch.bincount(out.sequences[:, 3], minlength=len(p))
    assert chi_square_pvalue(first, torch.tensor(p, dtype=torch.float64)) > ALPHA


@pytest.mark.parametrize("field", ["depth", "branch", "width"])
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_tree_spec_rejects_bad_sizes(field: str, value: object, error: type) -> None:
    sizes: dict[str, object] = {"depth": 2, "branch": 2, "width": 2, field: value}
    with pytest.raises(error, match=f"TreeSpec.{field}"):
        TreeSpec(**sizes)  # type: ignore[arg-type]


def test_tree_spec_counts_nodes() -> None:
    assert TreeSpec(4, 2, 2).num_nodes == 2 + 3 * 2 * 2
    assert TreeSpec(3, 1, 3).num_nodes == 3  # a chain
    assert TreeSpec(3, 2, 3).level_sizes() == (2, 4, 6)  # the first frontier has only 2 nodes


class ChainOnly(FixedWindowSelector):
    supports_trees = False


def test_tree_mode_rejects_selectors_it_cannot_serve() -> None:
    target, draft, ids, mask, _, _ = case("llama", 0)
    with pytest.raises(TypeError, match="supports_trees"):
        speculative_generate(target, draft, ids, mask, selector=ChainOnly(3), tree=TREE)


def test_tree_mode_rejects_bad_tree_arguments() -> None:
    target, draft, ids, mask, _, _ = case("llama", 0)
    selector = SELECTORS["fixed"]()
    call = functools.partial(speculative_generate, target, draft, ids, mask, max_new_tokens=4)
    with pytest.raises(TypeError, match="tree must be a TreeSpec"):
        call(selector=selector, tree=(2, 2, 2))
    with pytest.raises(ValueError, match="branch"):
        call(selector=selector, tree=TreeSpec(2, 999, 1))


def test_tree_mode_needs_maskable_attention() -> None:
    target = tiny_model("llama", 0)
    draft = tiny_model("llama", 1)
    draft.config._attn_implementation = "flash_attention_2"
    ids, mask = left_padded_prompts(2, 1, 4, GREEDY_VOCAB, 0)
    with pytest.raises(ValueError, match="tree masks"):
        speculative_generate(target, draft, ids, mask, selector=SELECTORS["fixed"](), tree=TREE)


def test_selection_scores_keep_never_and_hide_nan() -> None:
    """What the selector sees: ``-inf`` (a token outside top-k/top-p, never to be verified)
    stays ``-inf`` and a NaN (draft logits at +inf) becomes it; finite scores pass unchanged.
    (Mapping NaN alone must not turn ``-inf`` into the lowest finite float, which a budget
    would then select.)"""
    from specselect.hf.steps import _selection_scores

    scores = _selection_scores(torch.tensor([[-math.inf, math.nan, -1.5, 0.0]]), None)
    assert scores.tolist() == [[-math.inf, -math.inf, -1.5, 0.0]]
