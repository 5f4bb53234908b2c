"""Bad input to speculative_generate raises a clear error naming what is wrong."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    BertLMHeadModel,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from hf_models import (
    left_padded_prompts,
    tiny_model,
    tiny_pair,
)
from specselect import make_selector
from specselect.hf import TreeSpec, speculative_generate
from specselect.hf.compat import ModelHandle, check_causal
from specselect.replay import OracleSelector
from specselect.selection import Selection

VOCAB = 128


class NoCacheLM(nn.Module):
    """A causal LM whose forward cannot take a KV cache."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, 8)
        self.head = nn.Linear(8, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return self.head(self.embed(input_ids))


class PeftLike(nn.Module):
    """PEFT's wrapper as the loop sees it: a module with ``get_base_model`` whose forward takes
    neither positions nor a cache (peft is not a dependency of the tests)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = model
        self.config = model.config

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class IgnoresCacheLM(NoCacheLM):
    """A causal LM that accepts ``past_key_values`` but never writes to it."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **_):
        return type("Out", (), {"logits": self.head(self.embed(input_ids))})()


class IgnoresNewCacheLM(NoCacheLM):
    """The same, taking its cache as ``cache`` (transformers 5.24's name)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **_):
        return type("Out", (), {"logits": self.head(self.embed(input_ids))})()


@pytest.fixture(scope="module")
def models():
    return tiny_pair("llama", 0, noise=0.02)


def call(models, **overrides: Any):
    """speculative_generate on valid defaults, with some arguments replaced."""
    target, draft = models
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    kwargs: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "input_ids": ids,
        "attention_mask": mask,
        "selector": make_selector("tetris", k=2),
        "max_new_tokens": 4,
    }
    kwargs.update(overrides)
    return speculative_generate(**kwargs)


def with_attn(name: str) -> Callable[[Any], nn.Module]:
    def build(models):
        model = tiny_model("llama", 0)
        model.config._attn_implementation = name
        return model

    return build


def draft_with(**config_changes: Any) -> Callable[[Any], nn.Module]:
    def build(models):
        config = models[0].config.to_dict()
        config.update(config_changes)
        return type(models[0])(type(models[0].config)(**config)).eval()

    return build


def fractional_mask(value: float) -> torch.Tensor:
    """A float mask of the valid prompts with one entry ``value``: an int cast would truncate
    0.5 to 0 and 1.7 to 1 and accept it."""
    mask = left_padded_prompts(4, 2, 6, VOCAB, 0)[1].to(torch.float32)
    mask[0, 2] = value
    return mask


def mask_without_row(row: int) -> torch.Tensor:
    """The valid prompts' mask with row ``row`` all 0: an empty prompt, not right padding."""
    mask = left_padded_prompts(4, 2, 6, VOCAB, 0)[1].clone()
    mask[row] = 0
    return mask


def sliding_window_target(models) -> nn.Module:
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,  # < the longest prompt (6) + max_new_tokens (4),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = MistralForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def bidirectional(models) -> nn.Module:
    """BERT as its authors trained it (``is_decoder=False``), loaded as a causal LM: it passes
    every static check, and its output differed from generate()'s without an error. At the
    default initialisation, where a later token moves the first logits least (a check that
    compared rows holding the same tokens let most such models through)."""
    config = tiny_model("bert", 0).config
    config.is_decoder = False
    config.initializer_range = 0.02
    torch.manual_seed(0)
    return BertLMHeadModel(config).eval()


BIDIRECTIONAL = r"is not a causal LM: its logits at a position change with the tokens after it"


# (id, argument to replace, builder(models) -> value, exception, message pattern)
CASES: list[tuple[str, str, Callable[[Any], Any], type[Exception], str]] = [
    ("mismatched eos", "draft", draft_with(eos_token_id=5), ValueError, "share a tokenizer"),
    ("mismatched vocab", "draft", draft_with(vocab_size=96), ValueError, "vocabulary sizes"),
    # A model without a language-model head failed deep inside (no .logits), or, with a head
    # of another kind (token classification), generated junk; a compiled one was refused as
    # lacking cache arguments (its wrapper's forward takes *args, **kwargs).
    ("no lm head", "draft", lambda m: LlamaModel(m[0].config), TypeError, "no language-model"),
    ("no draft", "draft", lambda m: None, TypeError, r"draft=None is for plain decoding"),
    (
        "classification head",
        "target",
        lambda m: LlamaForTokenClassification(m[0].config),
        TypeError,
        r"\(LlamaForTokenClassification\) has no language-model head",
    ),
    ("compiled", "target", lambda m: torch.compile(m[0]), TypeError, "torch.compile wrapper"),
    (
        "tokenizer not covered",
        "tokenizer",
        lambda m: range(VOCAB + 1),
        ValueError,
        "cover the tokenizer",
    ),
    (
        "empty batch",
        "input_ids",
        lambda m: torch.zeros(0, 5, dtype=torch.int64),
        ValueError,
        "empty batch",
    ),
    (
        "no prompt tokens",
        "input_ids",
        lambda m: torch.zeros(4, 0, dtype=torch.int64),
        ValueError,
        "input_ids has no tokens",
    ),
    ("float ids", "input_ids", lambda m: torch.zeros(4, 6), TypeError, "input_ids"),
    (
        "meta ids",
        "input_ids",
        lambda m: torch.zeros(4, 6, dtype=torch.int64, device="meta"),
        ValueError,
        "input_ids is on the meta device",
    ),
    (
        "meta mask",
        "attention_mask",
        lambda m: torch.ones(4, 6, dtype=torch.int64, device="meta"),
        ValueError,
        "attention_mask is on the meta device",
    ),
    (
        "ids out of range",
        "input_ids",
        lambda m: torch.full((4, 6), VOCAB),
        ValueError,
        r"input_ids must be token ids in \[0, 128\)",
    ),
    ("max_new_tokens < 0", "max_new_tokens", lambda m: -1, ValueError, "max_new_tokens"),
    ("max_new_tokens 0", "max_new_tokens", lambda m: 0, ValueError, "max_new_tokens must be >= 1"),
    ("max_new_tokens float", "max_new_tokens", lambda m: 2.5, TypeError, "max_new_tokens"),
    ("progress string", "progress", lambda m: "no", TypeError, "progress must be True or False"),
    (
        "mask wrong shape",
        "attention_mask",
        lambda m: torch.ones(4, 5, dtype=torch.int64),
        ValueError,
        "attention_mask must have the shape",
    ),
    (
        "mask wrong rank",
        "attention_mask",
        lambda m: torch.ones(4, dtype=torch.int64),
        ValueError,
        "attention_mask must have rank 2",
    ),
    ("mask values", "attention_mask", lambda m: torch.full((4, 6), 2), ValueError, "only 0 and 1"),
    ("fractional mask", "attention_mask", lambda m: fractional_mask(0.5), ValueError, "only 0"),
    ("mask above 1", "attention_mask", lambda m: fractional_mask(1.7), ValueError, "only 0 and 1"),
    (
        "right padding",
        "attention_mask",
        lambda m: torch.tensor([[1, 1, 1, 1, 1, 0]] * 4),
        ValueError,
        "left-padded",
    ),
    (
        "empty prompt row",
        "attention_mask",
        lambda m: mask_without_row(2),
        ValueError,
        r"prompt row 2 is empty: its attention_mask \(given\) is all 0",
    ),
    (
        "model without KV cache",
        "draft",
        lambda m: NoCacheLM(m[0].config),
        ValueError,
        "does not support a KV cache",
    ),
    (
        "PEFT wrapper",
        "target",
        lambda m: PeftLike(m[0]),
        TypeError,
        r"target is a PEFT wrapper \(PeftLike\); pass target.get_base_model\(\)",
    ),
    ("bidirectional target", "target", bidirectional, ValueError, BIDIRECTIONAL),
    ("bidirectional draft", "draft", bidirectional, ValueError, BIDIRECTIONAL),
    (
        "model ignoring its KV cache",
        "draft",
        lambda m: IgnoresCacheLM(m[0].config),
        RuntimeError,
        "does not append to past_key_values",
    ),
    (
        "model ignoring its KV cache, 5.24 naming",
        "draft",
        lambda m: IgnoresNewCacheLM(m[0].config),
        RuntimeError,
        "does not append to cache$",
    ),
    (
        "flash attention target",
        "target",
        with_attn("flash_attention_2"),
        ValueError,
        "cannot take custom attention masks",
    ),
    (
        "flash attention draft",
        "draft",
        with_attn("flash_attention_3"),
        ValueError,
        "draft uses attn_implementation='flash_attention_3'",
    ),
    ("not a model", "target", lambda m: "gpt2", TypeError, "target must be a HuggingFace"),
    (
        "sliding window too short",
        "target",
        sliding_window_target,
        ValueError,
        "sliding-window attention",
    ),
    ("not a selector", "selector", lambda m: "tetris", TypeError, "selector must be"),
    ("generator type", "generator", lambda m: 42, TypeError, "generator must be"),
    ("temperature 0", "temperature", lambda m: 0.0, ValueError, "temperature"),
    ("top_p > 1", "top_p", lambda m: 1.5, ValueError, "top_p"),
    ("min_p > 1", "min_p", lambda m: 1.5, ValueError, r"min_p must be in \[0, 1\]"),
    ("top_k negative", "top_k", lambda m: -3, ValueError, r"top_k must be >= 0, got -3"),
    (
        "beam search config",
        "generation_config",
        lambda m: GenerationConfig(num_beams=2),
        ValueError,
        "num_beams",
    ),
    (
        "config type",
        "generation_config",
        lambda m: {"max_new_tokens": 3},
        TypeError,
        "generation_config must be",
    ),
    ("negative cache slack", "cache_slack", lambda m: -1, ValueError, "cache_slack"),
    ("do_sample not a bool", "do_sample", lambda m: "no", TypeError, "do_sample must be a bool"),
    (
        "do_sample not a bool in config",
        "generation_config",
        lambda m: GenerationConfig(do_sample=1),
        TypeError,
        "do_sample must be a bool",
    ),
    ("tokenizer without len", "tokenizer", lambda m: 5, TypeError, "tokenizer must be"),
    ("oracle", "selector", lambda m: OracleSelector(3), TypeError, "OracleSelector is replay-only"),
    (
        "length penalty config",
        "generation_config",
        lambda m: GenerationConfig(exponential_decay_length_penalty=(2, 3.0)),
        ValueError,
        "exponential_decay_length_penalty",
    ),
    (
        "watermarking config",
        "generation_config",
        lambda m: GenerationConfig(watermarking_config={"greenlist_ratio": 0.5, "bias": 50.0}),
        ValueError,
        "watermarking_config",
    ),
    (
        "max_time config",
        "generation_config",
        lambda m: GenerationConfig(max_time=60.0),
        ValueError,
        "max_time",
    ),
    (
        "scores output",
        "generation_config",
        lambda m: GenerationConfig(output_scores=True, return_dict_in_generate=True),
        ValueError,
        r"output_scores=True .* returns the sequences and its own statistics only",
    ),
    (
        "top_h when sampling",
        "generation_config",
        lambda m: GenerationConfig(do_sample=True, top_h=0.5),
        ValueError,
        "top_h",
    ),
]


# (torch.compile's first use imports modules that warn of their own deprecation)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    ("argument", "build", "error", "pattern"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_raises(models, argument, build, error, pattern) -> None:
    overrides = {argument: build(models)}
    if argument in ("temperature", "top_p", "top_k", "min_p"):
        overrides["do_sample"] = True
    with pytest.raises(error, match=pattern):
        call(models, **overrides)


def test_valid_defaults_run(models) -> None:
    """The baseline every error case modifies is itself valid."""
    out = call(models)
    assert out.sequences.shape == (4, 6 + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_bidirectional_model_is_refused_in_every_dtype(models, dtype: torch.dtype) -> None:
    """Rounding cannot hide it: the check compares two rows of one pass, not passes of two
    lengths (whose kernels differ, so that a tolerance for rounding let bfloat16 through)."""
    model = bidirectional(models).to(dtype)
    with pytest.raises(ValueError, match=BIDIRECTIONAL):
        check_causal("target", ModelHandle.of("target", model))
    causal = copy.deepcopy(models[0]).to(dtype)
    check_causal("target", ModelHandle.of("target", causal))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_model_decoding_with_dropout_warns(models, dropout: float) -> None:
    """Training mode with dropout makes greedy output random (generate's too): a model from
    from_config, not from_pretrained, is in training mode. Its modes are left as they were."""
    config = models[0].config.to_dict() | {"attention_dropout": dropout}
    target = type(models[0])(type(models[0].config)(**config))
    target.load_state_dict(models[0].state_dict())
    target.train()
    target.model.layers[0].eval()  # modes may differ between modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(models, target=target)
    warned = [w for w in caught if "target is in training mode with dropout" in str(w.message)]
    assert len(warned) == (dropout > 0)
    assert all(w.filename == __file__ for w in warned)
    for name, module in target.named_modules():
        assert module.training is not name.startswith("model.layers.0")


def test_a_head_s_dropout_a_causal_lm_never_runs_does_not_warn() -> None:
    """GPT-2's config keeps ``summary_first_dropout`` for its classification heads: with every
    dropout the LM runs at 0, training mode decodes as eval mode does, and is not warned of."""
    off = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, **off)
    assert config.summary_first_dropout > 0
    target = GPT2LMHeadModel(config).train()
    ids, mask = left_padded_prompts(2, 2, 6, VOCAB, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = speculative_generate(target, None, ids, mask, selector=None, max_new_tokens=3)
    assert not [w for w in caught if "training mode with dropout" in str(w.message)]
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    assert torch.equal(out.sequences, expected)


def test_selector_with_negative_draft_length(models) -> None:
    class Broken(type(make_selector("fixed", k=1))):
        def draft_length(self, num_active: int) -> int:
            return -1

    with pytest.raises(ValueError, match=r"selector.draft_length\(\) must be >= 0"):
        call(models, selector=Broken(k=1))


class OffByOne(type(make_selector("fixed", k=1))):  # type: ignore[misc]
    """Fixed SD of one's own whose lengths count one token more than its mask."""

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        chosen = super()._select(draft_logprobs, active)
        return Selection(chosen.lengths + 1, chosen.mask)


def test_a_broken_selector_of_ones_own_is_named_in_the_loop(models) -> None:
    """The loop trusts the tensors it makes, not a selector's answer: it verified the lengths
    of this one and ignored its mask, without a word."""
    with pytest.raises(RuntimeError, match="OffByOne selected a mask that is not a prefix"):
        call(models, selector=OffByOne(k=2))


class CallsAgain(type(make_selector("fixed", k=1))):  # type: ignore[misc]
    """Fixed SD that, mid-call, starts another call with itself (as a second thread would)."""

    def draft_length(self, num_active: int) -> int:
        if not hasattr(self, "refused"):
            self.refused: Exception | None = None
            try:
                call(self.models, selector=self)
            except ValueError as exc:
                self.refused = exc
        return super().draft_length(num_active)


def test_one_selector_serves_one_call_at_a_time(models) -> None:
    """Calls sharing a selector reset and fed it under each other (an update 'already called'
    error in some, wrong statistics in others); the second is refused up front. The first
    goes on, and the selector is free again after it."""
    selector = CallsAgain(k=2)
    selector.models = models
    first = call(models, selector=selector)
    assert "is in use by another speculative_generate call" in str(selector.refused)
    assert torch.equal(call(models, selector=selector).sequences, first.sequences)


@pytest.mark.parametrize(
    ("spec", "tree"),
    [
        ({"name": "tetris", "k": 2}, None),
        ({"name": "fixed", "k": 3}, None),
        ({"name": "fixed", "k": 12}, None),
        ({"name": "tetris", "k": 3}, TreeSpec(3, 2, 2)),  # a tree reserves its columns
    ],
)
def test_a_cache_without_slack_drafts_less_instead_of_failing(
    models, spec: dict[str, Any], tree: TreeSpec | None
) -> None:
    """Rows drift apart, and a chain step's window beside the longest row overflowed caches
    without slack: the call failed late (the work lost), advising a slack no check could know
    up front. Now the step drafts as deep as the caches hold; the output is generate()'s, and
    a warning says how many steps drafted less."""
    target, _ = models
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    new = 30
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tight = call(
            models, selector=make_selector(**spec), cache_slack=0, max_new_tokens=new, tree=tree
        )
    assert torch.equal(tight.sequences, reference)
    said = [str(w.message) for w in caught if "cache_slack=0 left no room" in str(w.message)]
    assert (tight.stats.depth_cuts > 0) == (tree is None) == bool(said)
    roomy = call(models, selector=make_selector(**spec), max_new_tokens=new, tree=tree)
    assert torch.equal(roomy.sequences, reference) and roomy.stats.depth_cuts == 0


@pytest.mark.parametrize("given_as", ["config", "argument"])
def test_max_length_within_the_prompt_raises(models, given_as: str) -> None:
    """An explicit max_length (in a config, or as generate()'s argument) counts the padded
    prompt (width 6): 6 leaves no room, as in generate(), which raises too; 7 gives one new
    token."""

    def length(value: object) -> dict[str, Any]:
        if given_as == "argument":
            return {"max_length": value, "generation_config": GenerationConfig(eos_token_id=[])}
        return {"generation_config": GenerationConfig(max_length=value, eos_token_id=[])}

    with pytest.raises(ValueError, match=r"max_length \(6\) must exceed .* prompt length \(6\)"):
        call(models, max_new_tokens=None, **length(6))
    with pytest.raises(ValueError, match="max_length"):
        ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
        models[0].generate(ids, attention_mask=mask, **length(6))
    assert call(models, max_new_tokens=None, **length(7)).sequences.shape == (4, 7)
    with pytest.raises(TypeError, match="max_length must be an int"):
        call(models, max_new_tokens=None, **length("7"))


# (later transformers releases warn that generate() uses its default length)
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default:UserWarning")
@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_the_default_length_stops_at_the_position_limit(arch: str) -> None:
    """With no length given, generate() makes 20 new tokens but stops the sequence at the
    config's max_position_embeddings: so does the loop (it made 20 beyond a Qwen2 limit, and
    refused a GPT-2 whose table was too short for 20); a prompt at the limit raises. It warns
    that it took the default, as generate() does in later transformers releases."""
    target = tiny_model(arch, seed=0, positions=16)
    target.config.max_position_embeddings = 16  # (Qwen2 keeps its config's default otherwise)
    ids, mask = left_padded_prompts(2, 10, 12, VOCAB, 0)
    with pytest.warns(
        UserWarning, match=r"generating 4 new tokens per row \(generate\(\)'s 20, capped"
    ):
        out = speculative_generate(target, None, ids, mask, selector=None, eos_token_id=[])
    expected = target.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=[])
    assert out.sequences.shape == (2, 16) and torch.equal(out.sequences, expected)
    full, full_mask = left_padded_prompts(2, 16, 16, VOCAB, 0)
    with pytest.raises(ValueError, match=r"capped at the target's max_position_embeddings \(16\)"):
        speculative_generate(target, None, full, full_mask, selector=None, eos_token_id=[])
    with warnings.catch_warnings():  # a length given says nothing
        warnings.simplefilter("error")
        speculative_generate(target, None, ids, mask, selector=None, max_new_tokens=2)


def test_no_length_given_warns_with_the_length_taken(models) -> None:
    says = r"no length given: generating 20 new tokens per row, as generate\(\) does"
    with pytest.warns(UserWarning, match=says):
        out = call(models, max_new_tokens=None)
    assert out.sequences.shape[1] == 6 + 20


def test_model_config_options_are_checked_with_a_caller_config(models) -> None:
    """Options set only in target.generation_config still apply when the caller passes a
    generation_config (generate() merges them), so unsupported ones must raise."""
    target = copy.deepcopy(models[0])
    for field, value in (("repetition_penalty", 1.3), ("no_repeat_ngram_size", 2)):
        target.generation_config = GenerationConfig(**{field: value})
        with pytest.raises(ValueError, match=f"{field}={value}"):
            call((target, models[1]), generation_config=GenerationConfig(max_new_tokens=3))


def test_sampling_only_warpers_do_not_block_greedy_decoding(models) -> None:
    """generate() applies typical_p and friends only when sampling: greedy runs, sampling
    raises."""
    config = GenerationConfig(min_p=0.1, typical_p=0.9, top_h=0.5)
    assert call(models, generation_config=config).sequences.shape == (4, 6 + 4)
    with pytest.raises(ValueError, match=r"top_h=0\.5"):
        call(models, generation_config=config, do_sample=True)


def test_sampling_arguments_of_a_greedy_call_warn(models) -> None:
    """Greedy decoding ignores temperature, top-k and top-p, and says so as generate() does;
    the global defaults (and None) are silent, and so are values from a GenerationConfig,
    which transformers validates (and logs about) itself."""
    with pytest.warns(UserWarning, match=r"temperature=0\.5, top_p=0\.1 only apply when sampling"):
        call(models, temperature=0.5, top_p=0.1)
    with pytest.warns(UserWarning, match=r"top_k=7 only applies when sampling; .* it is ignored"):
        call(models, top_k=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(models, temperature=1.0, top_k=50, top_p=1.0)
        call(models, generation_config=GenerationConfig(temperature=0.5))


def test_hf_assisted_generation_settings_are_ignored_aloud_or_refused(models) -> None:
    """HF's own speculation settings were taken without a word (the selector decides here);
    the ensemble weight, HF's mix of the draft's and the target's distributions, is refused.
    Their global defaults are silent."""
    settings = GenerationConfig(num_assistant_tokens=7, assistant_confidence_threshold=0.9)
    says = r"settings num_assistant_tokens=7, assistant_confidence_threshold=0\.9, which spec"
    with pytest.warns(UserWarning, match=says):
        call(models, generation_config=settings)
    with pytest.raises(ValueError, match=r"generation_config\.assistant_ensemble_weight=0\.5 is"):
        call(models, generation_config=GenerationConfig(assistant_ensemble_weight=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(models, generation_config=GenerationConfig(num_assistant_tokens=20))


def test_prompt_ending_in_pad_without_mask_raises(models) -> None:
    """Without attention_mask the mask is inferred from pad_token_id, as in generate(); a row
    ending with the pad id would then be right-padded, which the loop cannot serve."""
    ids, _ = left_padded_prompts(4, 2, 6, VOCAB, 0)
    ids[1, -1] = 0  # the tiny models' pad id
    with pytest.raises(ValueError, match="inferred from pad_token_id=0"):
        call(models, input_ids=ids, attention_mask=None)


def test_positions_beyond_a_learned_table_raise_before_any_work() -> None:
    """GPT-2 embeds positions from a table of n_positions rows: a prompt plus max_new_tokens
    whose tokens fed back (all but the last new one) go beyond it is refused up front, naming
    the limit (generate() fails deep in the embedding); one more new token than the table has
    rows runs, as under generate() (it was refused)."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    target = GPT2LMHeadModel(config).eval()
    ids, mask = left_padded_prompts(2, 4, 6, VOCAB, 0)
    kwargs = {"selector": None, "eos_token_id": []}
    out = speculative_generate(target, None, ids, mask, max_new_tokens=11, **kwargs)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=11, do_sample=False)
    assert torch.equal(out.sequences, expected)
    with pytest.raises(ValueError, match=r"embeds at most 16 positions .* needs 17"):
        speculative_generate(target, None, ids, mask, max_new_tokens=12, **kwargs)
    with pytest.raises((IndexError, RuntimeError)):  # (the embedding's index error)
        target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)


def test_a_mask_that_cannot_be_inferred_warns(models) -> None:
    """With the pad id an EOS id, generate() cannot infer the mask and warns; so does the loop,
    which then attends to every token, pads included. A mask, an inferable pad id or a single
    prompt (nothing to pad) is silent."""
    with pytest.warns(UserWarning, match="attention_mask is None and cannot be inferred"):
        call(models, attention_mask=None, eos_token_id=0)  # the tiny models' pad id is 0
    ids = left_padded_prompts(4, 2, 6, VOCAB, 0)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(models, eos_token_id=0)
        call(models, attention_mask=None)
        call(models, input_ids=ids[:1, -2:], attention_mask=None, eos_token_id=0)


def test_prompt_ids_beyond_the_tokenizer_are_refused(models) -> None:
    """With ``tokenizer=``, the shared vocabulary is the tokenizer's: an id beyond it names
    a padding row, which the narrower model would see as a stand-in token (it was accepted)."""
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    ids = ids.clamp(max=VOCAB - 9)  # within the tokenizer, but for the id set below
    ids[0, -1] = VOCAB - 4
    with pytest.raises(
        ValueError, match=rf"ids in \[0, {VOCAB - 8}\), .*len\(tokenizer\).* to {VOCAB - 4}"
    ):
        call(models, input_ids=ids, attention_mask=mask, tokenizer=range(VOCAB - 8))
    ids[0, -1] = VOCAB - 9
    call(models, input_ids=ids, attention_mask=mask, tokenizer=range(VOCAB - 8))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_model_without_weights_is_refused(which: str) -> None:
    """Meta weights failed deep inside the first pass (a .item() or a copy out of meta)."""
    target, draft = tiny_pair("llama", 0, noise=0.02)
    models = {"target": target, "draft": draft}
    models[which] = models[which].to("meta")
    with pytest.raises(ValueError, match=f"{which} has weights on the meta device"):
        call((models["target"], models["draft"]))


def _with_infinite_logit(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose logit of token 100 is not finite (a row of its output
    embedding at +inf; fp16 overflow gives such logits)."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[100] = torch.inf
    return broken


@pytest.mark.parametrize(
    ("how", "tree"),
    [("target", None), ("draft", None), ("temperature", None), ("target", TreeSpec(2, 2, 2))],
)
def test_sampling_refuses_a_nan_distribution(models, how: str, tree: TreeSpec | None) -> None:
    """Sampling from a distribution holding NaN (a logit at +inf, or logits / temperature
    overflowing) returned junk tokens without a word; generate() raises there. The step's
    report says so (no sync of its own) and the call raises, naming the row."""
    target, draft = models
    if how == "target":
        target = _with_infinite_logit(target)
    elif how == "draft":
        draft = _with_infinite_logit(draft)
    sampling = {"do_sample": True, "temperature": 1e-38 if how == "temperature" else 1.0}
    with pytest.raises(RuntimeError, match=r"sampling met a NaN in row \d+'s distribution"):
        call((target, draft), tree=tree, **sampling)
    if how != "draft":  # what generate() says of the same target and temperature
        ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
        with pytest.raises(RuntimeError, match=r"probability tensor contains either"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, **sampling)


def test_greedy_output_does_not_depend_on_a_nan_draft(models) -> None:
    """Greedy verification reads the target alone: a draft whose logits hold +inf still gives
    generate()'s output (its NaN confidences are never selected, not an estimator's crash)."""
    target, draft = models
    out = call((target, _with_infinite_logit(draft)), max_new_tokens=6)
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, expected)


def test_a_language_model_of_ones_own_without_generation_mixin_runs(models) -> None:
    """A PreTrainedModel of one's own with an LM head that does not mix in GenerationMixin
    (so can_generate() is False) is a causal LM all the same: it generates what the same
    weights do as a LlamaForCausalLM."""

    class MyLM(LlamaPreTrainedModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = LlamaModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        forward = LlamaForCausalLM.forward

    target = models[0]
    mine = MyLM(target.config).eval()
    mine.load_state_dict(target.state_dict())
    assert not mine.can_generate()
    ids, mask = left_padded_prompts(2, 2, 6, VOCAB, 0)
    kwargs = {"selector": None, "max_new_tokens": 5, "eos_token_id": []}
    out = speculative_generate(mine, None, ids, mask, **kwargs)
    assert torch.equal(
        out.sequences, speculative_generate(target, None, ids, mask, **kwargs).sequences
    )


@pytest.mark.parametrize("key", ["eos_token_id", "pad_token_id"])
def test_a_stop_or_pad_token_set_in_the_generation_config_keeps_the_pair(models, key) -> None:
    """Another stop or pad token in the target's generation config is a decoding setting, not
    another tokenizer: its config still names the draft's ids, so the pair runs (it was
    refused as "do not share a tokenizer") and the output is generate()'s."""
    target, draft = models
    changed = copy.deepcopy(target)
    setattr(changed.generation_config, key, 5)
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    out = call((changed, draft), max_new_tokens=6)
    expected = changed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(out.sequences, expected)


def test_another_pad_token_in_both_target_configs_keeps_the_pair(models) -> None:
    """A pad id is a decoding setting (the "pad = EOS" idiom), not another tokenizer: a target
    whose config and generation config both pad with another id than the draft's pairs, and
    an explicit pad_token_id rules."""
    target, draft = models
    changed = copy.deepcopy(target)
    changed.config.pad_token_id = changed.generation_config.pad_token_id = 5
    ids, mask = left_padded_prompts(4, 2, 6, VOCAB, 0)
    out = call((changed, draft), max_new_tokens=6, pad_token_id=0)
    expected = changed.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0
    )
    assert torch.equal(out.sequences, expected)


def test_a_draft_listing_other_eos_ids_of_one_tokenizer_pairs(models) -> None:
    """A chat target and its base-model draft share a tokenizer but list different EOS sets;
    ids in common show one tokenizer (disjoint ones another), and only the target's are used:
    the output is the one with the target's own draft."""
    target, draft = models
    eos = target.generation_config.eos_token_id
    listed = copy.deepcopy(draft)
    listed.generation_config.eos_token_id = [*([eos] if isinstance(eos, int) else eos), 5]
    out = call((target, listed), max_new_tokens=6)
    assert torch.equal(out.sequences, call(models, max_new_tokens=6).sequences)
