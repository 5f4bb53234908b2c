"""Greedy speculative generation is token-identical to the target's own greedy decoding.

Fixtures (tests/hf_models.py): tiny random Llama (rotary positions) and GPT-2 (learned absolute
positions) targets, vocab 128, hidden 64, 2 layers; the draft is a noisy copy of the target. With
the noise levels below the draft's greedy token equals the target's on about 75% (Llama) and
75-85% (GPT-2) of positions along the target's greedy text, so every selector sees long accepted
runs, partial acceptance and rejections.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import ClassVar

import pytest
import torch
from transformers import GenerationConfig

from greedy_cases import (
    BATCH,
    MAX_NEW,
    MAX_PROMPT,
    MIN_PROMPT,
    NOISE,
    SEEDS,
    VOCAB,
    assert_covers_both_endings,
    case,
)
from hf_models import (
    ARCHS,
    MORE_ARCHS,
    PAD_ID,
    left_padded_prompts,
    noisy_copy,
    tiny_model,
    tiny_pair,
)
from specselect import make_selector
from specselect.hf import (
    ChainDrafter,
    DraftChain,
    ModelCache,
    SamplingParams,
    TreeSpec,
    speculative_generate,
)
from specselect.hf import generate as hf_generate
from specselect.hf.compat import ModelHandle
from specselect.selectors import SELECTORS
from specselect.selectors.fixed import FixedWindowSelector

#: Small constructor arguments for every registered selector; a new selector must be added here.
SELECTOR_KWARGS: dict[str, dict[str, object]] = {
    # extra=3: more rows end inside an accepted run than with extra=2 (see
    # assert_covers_both_endings).
    "tetris": {"k": 3, "extra": 3},
    "fixed": {"k": 3},
    "dsd": {"max_k": 4, "interval": 4},
    "threshold": {"max_k": 4, "threshold": 0.1},
    "heuristic": {"k0": 2, "max_k": 5},
}


def build_selector(name: str):
    if name not in SELECTOR_KWARGS:
        pytest.fail(f"selector {name!r} is registered but has no entry in SELECTOR_KWARGS")
    return make_selector(name, **SELECTOR_KWARGS[name])


@functools.cache
def run(arch: str, seed: int, selector_name: str):
    """``speculative_generate`` on :func:`case`, once per case and selector."""
    target, draft, ids, mask, eos, _ = case(arch, seed)
    return speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector(selector_name),
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
    )


@pytest.mark.parametrize("selector_name", sorted(SELECTORS))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate(arch: str, seed: int, selector_name: str) -> None:
    _, _, _, _, eos, reference = case(arch, seed)
    out = run(arch, seed, selector_name)
    assert out.sequences.shape == reference.shape
    assert torch.equal(out.sequences, reference)
    stats = out.stats
    totals = stats.totals
    assert totals.emitted == int(stats.emitted.sum()) == totals.accepted + totals.active
    assert (
        totals.verified == int(stats.verified.sum()) >= totals.accepted == int(stats.accepted.sum())
    )
    new_tokens = [
        row.index(eos) + 1 if eos in row else MAX_NEW for row in reference[:, MAX_PROMPT:].tolist()
    ]
    assert stats.generated.tolist() == new_tokens
    assert torch.all(stats.emitted - stats.generated <= 1)


@pytest.mark.parametrize("selector_name", sorted(SELECTORS))
def test_greedy_cases_cover_both_endings(selector_name: str) -> None:
    assert_covers_both_endings(
        (run(arch, seed, selector_name), case(arch, seed)[4]) for arch in ARCHS for seed in SEEDS
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_assisted_generation_batch_1(arch: str) -> None:
    """At batch size 1 the output equals HF's assisted generation (and plain greedy)."""
    target, draft = tiny_pair(arch, 3, noise=NOISE[arch])
    ids, mask = left_padded_prompts(3, 2, 9, VOCAB, 3)
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1, mask[row].bool()]
        assisted = target.generate(
            prompt, assistant_model=draft, do_sample=False, max_new_tokens=30, eos_token_id=[]
        )
        ours = speculative_generate(
            target,
            draft,
            prompt,
            selector=build_selector("fixed"),
            max_new_tokens=30,
            eos_token_id=[],
        )
        assert torch.equal(ours.sequences, assisted)


def test_generation_config_fields_are_used_and_overridden() -> None:
    target, draft, ids, mask, eos, reference = case("llama", 0)
    config = GenerationConfig(max_new_tokens=7, eos_token_id=[], pad_token_id=PAD_ID)
    out = speculative_generate(
        target, draft, ids, mask, selector=build_selector("tetris"), generation_config=config
    )
    assert out.sequences.shape[1] == MAX_PROMPT + 7
    override = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("tetris"),
        generation_config=config,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
    )
    assert torch.equal(override.sequences, reference)
    by_length = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("fixed"),
        progress=True,
        generation_config=GenerationConfig(max_length=MAX_PROMPT + 5, eos_token_id=[]),
    )  # max_length counts the padded prompt, as in generate()
    short = target.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[])
    assert torch.equal(by_length.sequences, short)


def test_caller_config_is_merged_with_the_model_config() -> None:
    """As in generate(), a caller's generation_config only overrides the fields it sets: the
    others (here EOS and pad) come from target.generation_config, the rest from the global
    defaults (greedy). min_p, a sampling-only warper, is ignored by both in greedy decoding."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    for model in (target, draft):  # the models must keep sharing special ids
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=PAD_ID, min_p=0.2)
    config = GenerationConfig(max_new_tokens=MAX_NEW)
    assert torch.equal(
        target.generate(ids, attention_mask=mask, generation_config=config), reference
    )
    out = speculative_generate(
        target, draft, ids, mask, selector=build_selector("fixed"), generation_config=config
    )
    assert torch.equal(out.sequences, reference)


def test_explicit_eos_none_means_no_eos_as_in_generate() -> None:
    """generate(eos_token_id=None) ignores the configs' EOS; so must speculative_generate, while
    leaving the argument out uses the configs' EOS in both."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    for model in (target, draft):
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=PAD_ID)
    kwargs = {"selector": build_selector("fixed"), "max_new_tokens": MAX_NEW}
    no_eos = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    assert not torch.equal(no_eos, reference)  # the EOS really stops rows
    ours = speculative_generate(target, draft, ids, mask, eos_token_id=None, **kwargs)
    assert torch.equal(ours.sequences, no_eos)
    assert torch.equal(
        speculative_generate(target, draft, ids, mask, **kwargs).sequences, reference
    )


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_missing_mask_is_inferred_like_generate(pad_is_eos: bool) -> None:
    """Without attention_mask, generate() masks the pad tokens when the pad id is set and is not
    an EOS id (else it attends to everything, and both warn): left-padded prompts give the
    masked output."""
    target, draft, ids, mask, _, _ = case("gpt2", 0)
    eos = [PAD_ID] if pad_is_eos else []
    kwargs = {"max_new_tokens": 12, "eos_token_id": eos, "pad_token_id": PAD_ID}
    reference = target.generate(ids, **kwargs)
    masked = target.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(reference, masked) != pad_is_eos  # the mask really matters here
    with (
        pytest.warns(UserWarning, match="cannot be inferred")
        if pad_is_eos
        else (contextlib.nullcontext())
    ):
        out = speculative_generate(target, draft, ids, selector=build_selector("tetris"), **kwargs)
    assert torch.equal(out.sequences, reference)


class _RecordsTo:
    """Stands in for a tensor and records the ``non_blocking`` of each ``.to()``."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> _RecordsTo:
        self.calls.append(non_blocking)
        return self


@pytest.mark.parametrize(("device", "expected"), [("cpu", False), ("cuda:0", True)])
def test_draft_chain_copies_to_the_host_synchronously(device: str, expected: bool) -> None:
    """A device-to-host copy with non_blocking=True may be read before it lands (CUDA draft, CPU
    target): copies to the CPU must block; copies to an accelerator may overlap."""
    parts = [_RecordsTo() for _ in range(3)]
    DraftChain(*parts).to(torch.device(device))  # type: ignore[arg-type]
    assert [p.calls for p in parts] == [[expected]] * 3


def test_vocabularies_differing_by_padding_rows() -> None:
    """A draft with fewer logit rows than the target (its padding) still gives generate()'s output.

    The random target does emit ids the draft cannot embed; the draft then sees a stand-in token,
    which may cost acceptance but never changes the output.
    """
    target = tiny_model("llama", 5)
    draft_vocab = 120
    config = target.config.__class__(**{**target.config.to_dict(), "vocab_size": draft_vocab})
    draft = type(target)(config).eval()
    state = {
        name: value[:draft_vocab] if ("embed_tokens" in name or "lm_head" in name) else value
        for name, value in noisy_copy(target, 0.02, 6).state_dict().items()
    }
    draft.load_state_dict(state)
    ids, mask = left_padded_prompts(BATCH, 2, 10, draft_vocab, 5)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
    assert (reference[:, 10:] >= draft_vocab).any()
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("tetris"),
        max_new_tokens=30,
        eos_token_id=[],
        tokenizer=range(draft_vocab),
    )
    assert torch.equal(out.sequences, reference)
    assert out.stats.totals.accepted > 0


def forward(cache: ModelCache, tokens: torch.Tensor, valid: torch.Tensor, **kwargs):
    """One pass through ``cache`` with its host-side reservation, as the loop makes it."""
    cache.reserve(tokens.shape[1])
    return cache.forward(tokens, valid, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compaction_and_block_masks_keep_logits(arch: str, attn: str) -> None:
    """Cache primitives: holes, compaction (with row dropping and reordering) and an explicit
    ``[B, W, W]`` block mask are exact.

    A static cache with rejected columns, compacted and with a row dropped, must give the same
    next-token logits as a clean forward pass over each row's real tokens, with the default
    (causal) block mask and with the same mask given explicitly (the tree path).
    """
    model = tiny_model(arch, 7, attn_implementation=attn)
    handle = ModelHandle.of("model", model)
    gen = torch.Generator().manual_seed(7)
    batch, width = 3, 5
    cache = ModelCache(handle, batch, 40)
    kept_tokens: list[list[int]] = [[] for _ in range(batch)]
    with torch.inference_mode():
        for _ in range(4):  # blocks of 5 tokens, keeping a random prefix of each row
            block = torch.randint(3, VOCAB, (batch, width), generator=gen)
            forward(cache, block, torch.ones(batch, width, dtype=torch.bool))
            keep_n = torch.randint(1, width + 1, (batch,), generator=gen)
            cache.commit(torch.arange(width).unsqueeze(0) < keep_n.unsqueeze(1))
            for row in range(batch):
                kept_tokens[row] += block[row, : int(keep_n[row])].tolist()
        assert cache.used == 4 * width
        probe = torch.randint(3, VOCAB, (batch, 2), generator=gen)
        valid = torch.ones(2, 2, dtype=torch.bool)
        causal = torch.ones(2, 2, dtype=torch.bool).tril().expand(2, 2, 2)
        rows = torch.tensor([2, 0])
        longest = max(len(kept_tokens[r]) for r in rows.tolist())
        cache.compact(rows, longest)
        assert cache.used == longest
        assert cache.count[:2].tolist() == [len(kept_tokens[r]) for r in rows.tolist()]
        implicit = forward(cache, probe[rows], valid)
        cache.commit(torch.zeros(2, 2, dtype=torch.bool))  # drop the probe again
        explicit = forward(cache, probe[rows], valid, block_mask=causal)
        for i, row in enumerate(rows.tolist()):
            clean = model(torch.tensor([kept_tokens[row] + probe[row].tolist()])).logits[0, -2:]
            torch.testing.assert_close(implicit[i], clean, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(explicit[i], clean, rtol=1e-4, atol=1e-4)


LONG_NEW, LONG_SLACK = 520, 16


@pytest.mark.parametrize("arch", ARCHS)
def test_long_run_compacts_within_capacity(arch: str) -> None:
    """500+ tokens with many rejections: the caches never hold more than their stated capacity
    (``prompt + max_new_tokens + cache_slack`` columns per row), they are compacted in place
    several times, and the output is still generate()'s.

    A noisier draft (VSR about 0.25) leaves most of each verified window rejected, so without
    compaction the written columns would outgrow the capacity.
    """
    target, draft = tiny_pair(arch, 11, noise=3 * NOISE[arch])
    ids, mask = left_padded_prompts(3, 3, 10, VOCAB, 11)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("fixed"),
        max_new_tokens=LONG_NEW,
        eos_token_id=[],
        cache_slack=LONG_SLACK,
    )
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=LONG_NEW, eos_token_id=[])
    assert torch.equal(out.sequences, reference)
    stats = out.stats
    assert stats.totals.vsr < 0.4, "the run must reject a lot to create holes"
    capacity = ids.shape[1] + LONG_NEW + LONG_SLACK
    assert max(max(widths) for widths in stats.cache_widths) <= capacity
    written = sum(int(v.max()) + 1 for v in stats.verified_per_step)
    assert ids.shape[1] + written > capacity  # without compaction it would have overflowed
    assert stats.compactions >= 3


class StallingSelector(FixedWindowSelector):
    """Drafts ``k`` tokens for the first ``steps`` steps, then nothing (as DSD does when the
    draft stops being accepted)."""

    def __init__(self, k: int, steps: int) -> None:
        super().__init__(k)
        self.steps = steps
        self.calls = 0

    def draft_length(self, num_active: int) -> int:
        self.calls += 1
        return self.k if self.calls <= self.steps else 0


@pytest.mark.parametrize(
    ("k", "steps", "tree"), [(6, 4, None), (10, 3, None), (8, 5, TreeSpec(8, 1, 1))]
)
def test_a_full_draft_backlog_is_absorbed_within_capacity(
    k: int, steps: int, tree: TreeSpec | None
) -> None:
    """Steps that draft nothing let the draft's backlog grow until it is absorbed in a pass of
    its own (MAX_BACKLOG columns): the step plans those columns, compacting first when the
    draft's cache lacks them, instead of failing. Long drafts first fill the cache with holes."""
    target, draft, ids, mask, _, _ = case("llama", 0)
    kwargs = {"max_new_tokens": MAX_NEW, "eos_token_id": [], "pad_token_id": PAD_ID}
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=StallingSelector(k, steps),
        tree=tree,
        cache_slack=0,
        **kwargs,
    )
    reference = target.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize(
    ("dtype", "attn"), [(torch.float64, "eager"), (torch.float64, "sdpa"), (torch.bfloat16, "sdpa")]
)
def test_other_dtypes_and_eager_attention(dtype: torch.dtype, attn: str) -> None:
    """float64 (either kernel) is identical to generate(); bfloat16 runs and stays well-formed.

    In half precision the two loops batch their forward passes differently, so near-ties in the
    logits (gaps below the format's resolution) may resolve differently: only the format of the
    output is checked there.
    """
    target, draft = (m.to(dtype) for m in tiny_pair("gpt2", 0, noise=NOISE["gpt2"]))
    for model in (target, draft):
        model.set_attn_implementation(attn)
    ids, mask = left_padded_prompts(BATCH, MIN_PROMPT, MAX_PROMPT, VOCAB, 0)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("tetris"),
        max_new_tokens=20,
        eos_token_id=[],
    )
    assert out.sequences.shape == (BATCH, MAX_PROMPT + 20)
    assert torch.equal(out.sequences[:, :MAX_PROMPT], ids)
    assert int(out.sequences.min()) >= 0 and int(out.sequences.max()) < VOCAB
    if dtype == torch.float64:
        reference = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize(
    "tree", [None, TreeSpec(depth=3, branch=2, width=2)], ids=["chain", "tree"]
)
@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_more_architectures(arch: str, tree: TreeSpec | None) -> None:
    """Qwen2, Mistral (its sliding window is longer than the run), OPT and the families of
    ``FAMILIES`` match generate() too, through accepted and rejected drafts alike."""
    target, draft = tiny_pair(arch, 0, noise=0.02)
    ids, mask = left_padded_prompts(BATCH, MIN_PROMPT, MAX_PROMPT, VOCAB, 0)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=build_selector("tetris"),
        max_new_tokens=24,
        eos_token_id=[],
        tree=tree,
    )
    assert torch.equal(out.sequences, reference)
    totals = out.stats.totals
    assert 0.3 < totals.vsr < 1.0, "every draft accepted, or almost none: a path went untested"
    assert len(set(reference[:, MAX_PROMPT:].flatten().tolist())) > 3  # not one token on repeat


@pytest.mark.parametrize(
    "tree", [None, TreeSpec(depth=6, branch=2, width=2)], ids=["chain", "tree"]
)
@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_runs_to_the_end_of_a_learned_position_table(arch: str, tree: TreeSpec | None) -> None:
    """Prompt plus new tokens fill a learned position table exactly. Rows that accept more
    reach their end first while the others still draft 6 deep, so they draft past the table:
    those positions must still embed (the tokens are never emitted)."""
    target, draft = tiny_pair(arch, 0, noise=0.02, positions=32)
    ids, mask = left_padded_prompts(BATCH, MIN_PROMPT, 8, VOCAB, 0)
    max_new = 32 - ids.shape[1]
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=[])
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=FixedWindowSelector(6),
        max_new_tokens=max_new,
        eos_token_id=[],
        tree=tree,
    )
    assert torch.equal(out.sequences, reference)
    steps = out.stats.row_steps.tolist()
    assert min(steps) < max(steps), "every row ended at the same step: nothing drafted past"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_block_keeps_accepted_path(arch: str, attn: str) -> None:
    """The cache operation trees need: a block of tree nodes with an ancestor mask and per-node
    depths gives each node the logits of its root-to-node path, and committing only the accepted
    path leaves a cache equal to one that saw just that path.

    Tree per row: root r, children a and b of r, c child of b (nodes [r, a, b, c]); path r-b-c.
    """
    model = tiny_model(arch, 8, attn_implementation=attn)
    handle = ModelHandle.of("model", model)
    gen = torch.Generator().manual_seed(8)
    batch = 2
    prefix = torch.randint(3, VOCAB, (batch, 4), generator=gen)
    nodes = torch.randint(3, VOCAB, (batch, 4), generator=gen)
    probe = torch.randint(3, VOCAB, (batch, 1), generator=gen)
    ancestors = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool
    ).expand(batch, 4, 4)
    depth = torch.tensor([0, 1, 1, 2]).expand(batch, 4)
    all_valid = torch.ones(batch, 4, dtype=torch.bool)
    cache = ModelCache(handle, batch, 16)
    with torch.inference_mode():
        forward(cache, prefix, all_valid)
        cache.commit(all_valid)
        tree = forward(cache, nodes, all_valid, depth=depth, block_mask=ancestors)  # [B, 4, V]
        cache.commit(torch.tensor([True, False, True, True]).expand(batch, 4))
        after = forward(cache, probe, torch.ones(batch, 1, dtype=torch.bool))
        for row in range(batch):
            for node, path in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
                seq = torch.cat([prefix[row], nodes[row, path]]).unsqueeze(0)
                torch.testing.assert_close(
                    tree[row, node], model(seq).logits[0, -1], rtol=1e-4, atol=1e-4
                )
            seq = torch.cat([prefix[row], nodes[row, [0, 2, 3]], probe[row]]).unsqueeze(0)
            torch.testing.assert_close(
                after[row, 0], model(seq).logits[0, -1], rtol=1e-4, atol=1e-4
            )


def clean_greedy(model, tokens: list[int], k: int) -> list[int]:
    """The model's greedy continuation of ``tokens``, recomputed from scratch (no cache)."""
    out: list[int] = []
    for _ in range(k):
        logits = model(torch.tensor([tokens + out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_drafter_proposes_its_own_greedy_continuation(arch: str) -> None:
    """The draft side is invisible to the identity tests (the target corrects any draft), so
    check it directly: through windows of 0..4 tokens, random acceptance (including fully
    accepted windows, whose last token the draft never ran on), a dropped row and a compaction,
    every drafted chain equals the draft model's greedy continuation of the row's sequence.
    """
    model = tiny_model(arch, 9)
    batch = 4
    ids, mask = left_padded_prompts(batch, 1, 6, VOCAB, 9)
    sequences = [ids[r][mask[r].bool()].tolist() for r in range(batch)]
    drafter = ChainDrafter(ModelHandle.of("draft", model), batch, 64, VOCAB, SamplingParams(), None)
    gen = torch.Generator().manual_seed(9)
    rows = list(range(batch))
    with torch.no_grad():
        drafter.reset()
        drafter.admit(list(range(batch)), ids[:, :-1], mask[:, :-1].bool(), ids[:, -1])
        for step, k in enumerate([3, 0, 2, 3, 1, 0, 0, 4, 3, 2]):
            active = torch.ones(len(rows), dtype=torch.bool)
            drafter.cache.reserve(drafter.footprint(k))
            tokens = drafter.draft(active, k).tokens if k else torch.zeros(len(rows), 0)
            for i, row in enumerate(rows):
                assert tokens[i].tolist() == clean_greedy(model, sequences[row], k)
            accepted = torch.randint(0, k + 1, (len(rows),), generator=gen)
            accepted[0] = k  # one fully accepted window per step
            next_token = torch.randint(3, VOCAB, (len(rows),), generator=gen)
            drafter.advance(k, tokens.long(), accepted, next_token)
            drafter.advanced(k)
            for i, row in enumerate(rows):
                sequences[row] += tokens[i, : int(accepted[i])].tolist()
                sequences[row].append(int(next_token[i]))
            if step in (4, 7):  # row 1 finishes, then a compaction of the rest
                keep = torch.tensor([0, 2, 3]) if step == 4 else torch.arange(3)
                drafter.keep_rows(keep, int(drafter.cache.count[keep].max()))
                rows = [0, 2, 3]


class _Bar:
    """A stand-in for tqdm that records what the loop tells it."""

    made: ClassVar[list[_Bar]] = []

    def __init__(self, total: int, disable: bool, unit: str, desc: str) -> None:
        self.total, self.n, self.desc, self.postfix = total, 0, desc, None
        _Bar.made.append(self)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        self.n += n

    def refresh(self) -> None:
        pass

    def set_postfix(self, **values: str) -> None:
        self.postfix = values


@pytest.mark.parametrize("selector", ["fixed", None])
def test_the_progress_bar_counts_the_tokens_generated(selector: str | None) -> None:
    """Rows that stop at EOS take their unused budget off the bar's total: the bar used to
    count it as generated, and its rate with it. Plain decoding is labelled so, without the
    speculative statistics."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    new = reference[:, ids.shape[1] :]  # [B, MAX_NEW]
    stops = (new == eos).int().cumsum(dim=1) - (new == eos).int()  # EOS seen before
    generated = int((stops == 0).sum())
    assert generated < new.numel()  # some rows stop early
    _Bar.made.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_generate, "tqdm", _Bar)
        out = speculative_generate(
            target,
            draft if selector else None,
            ids,
            mask,
            selector=build_selector(selector) if selector else None,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            progress=True,
        )
    assert torch.equal(out.sequences, reference)
    (bar,) = _Bar.made
    assert bar.n == bar.total == generated
    assert bar.desc == ("speculative" if selector else "plain decoding")
    assert (bar.postfix is None) == (selector is None)
