"""Tiny random HuggingFace models and prompts for the generation tests.

Random models with the default initialiser (std 0.02) have almost flat next-token distributions:
greedy decoding then hinges on logit gaps of ~1e-4, where the float rounding of a differently
shaped (but mathematically equal) forward can flip an argmax. The models here use a larger
initialiser so their distributions are peaky, like trained models, and the draft is a *noisy
copy* of the target (same architecture, Gaussian noise on every weight) so that it agrees with
the target often — an unrelated random draft would accept almost nothing and leave the
acceptance paths of the loop untested.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
ARCHS = ("llama", "gpt2")  # rotary and learned absolute positions: the main test matrix
#: Families built from transformers' own configs at the sizes of :func:`_family_config`, each
#: for what it adds to what the loop relies on (see ``specselect.hf.kv``).
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": {},  # soft-capped logits and attention scores, alternating sliding windows
    "gemma3_text": {},  # q/k norms, local and global rotary bases
    "gemma4_text": {  # head sizes that differ per layer; the last layers reuse earlier KV
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 16,
    },
    "deepseek_v3": {  # multi-head latent attention: keys and values of different sizes
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "head_dim": None,  # the rotary part's size is qk_rope_head_dim
    },
    "phi3": {},  # fused q/k/v projection
    "qwen3": {},  # q/k norms
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "olmo2": {},  # norms after attention and MLP
    "starcoder2": {},  # biases, a sliding window
    "gpt_neox": {},  # partial rotary, parallel residual
    "falcon": {"head_dim": None},  # multi-query attention, parallel attention and MLP
    "stablelm": {},  # partial rotary
    "cohere": {},  # scaled logits, parallel attention and MLP
    "gpt_bigcode": {},  # multi-query attention, learned absolute positions
    "bert": {"is_decoder": True},  # an encoder family, causal as a decoder
}
#: Checked more lightly: Qwen2, Mistral, OPT, and the families this transformers release has.
MORE_ARCHS = ("qwen2", "mistral", "opt", *(f for f in FAMILIES if f in CONFIG_MAPPING))


def tiny_model(
    arch: str,
    seed: int,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 2,
    init_range: float = 0.25,
    attn_implementation: str = "sdpa",
    positions: int = 2048,
) -> PreTrainedModel:
    """A random causal LM of family ``arch`` (see ``ARCHS`` and ``MORE_ARCHS``); ``positions``
    is the length of GPT-2's and OPT's learned position tables (and Llama's nominal context;
    Qwen2 and Mistral keep their configs' defaults)."""
    torch.manual_seed(seed)
    ids = {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID}
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
            initializer_range=init_range,
            **ids,
        )
        model: PreTrainedModel = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=positions,
            initializer_range=init_range,
            **ids,
        )
        model = GPT2LMHeadModel(config)
    elif arch in FAMILIES:
        model = AutoModelForCausalLM.from_config(
            _family_config(arch, vocab, hidden, layers, init_range, positions)
        )
    elif arch in MORE_ARCHS:
        model = AutoModelForCausalLM.from_config(
            _more_config(arch, vocab, hidden, layers, init_range, positions)
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + MORE_ARCHS}")
    if not model._supports_sdpa:  # Gemma 2: soft-capped attention scores need eager
        attn_implementation = "eager"
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def _more_config(
    arch: str, vocab: int, hidden: int, layers: int, init_range: float, positions: int
):
    """Qwen2 (biased q/k/v), Mistral (sliding window 4096 by default), OPT (learned positions)."""
    ids = {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID}
    if arch == "opt":
        return OPTConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            ffn_dim=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            word_embed_proj_dim=hidden,
            init_std=init_range,
            max_position_embeddings=positions,
            **ids,
        )
    config_class = Qwen2Config if arch == "qwen2" else MistralConfig
    return config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=init_range,
        **ids,
    )


def _family_config(
    arch: str, vocab: int, hidden: int, layers: int, init_range: float, positions: int
) -> PretrainedConfig:
    """A small config of family ``arch`` (see ``FAMILIES``, where ``None`` leaves a size to the
    config, which may derive it). Output embeddings are untied: tied to a large initialiser,
    Gemma's scaled input embeddings make the model repeat its last token forever, a run with
    nothing to reject."""
    sizes = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": positions,
        "initializer_range": init_range,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
    }
    merged = {**sizes, **FAMILIES[arch]}
    return AutoConfig.for_model(arch, **{k: v for k, v in merged.items() if v is not None})


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """A copy of ``model`` with N(0, ``noise`` * std(w)) added to every weight tensor ``w``."""
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            scale = p.std() if p.numel() > 1 else p.abs()
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise * scale)
    return clone


def tiny_pair(
    arch: str, seed: int, *, noise: float = 0.15, **kwargs: object
) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(target, draft): a tiny random target and its noisy copy."""
    target = tiny_model(arch, seed, **kwargs)  # type: ignore[arg-type]
    return target, noisy_copy(target, noise, seed + 1000)


def left_padded_prompts(
    batch: int, min_len: int, max_len: int, vocab: int, seed: int
) -> tuple[Tensor, Tensor]:
    """``(input_ids [batch, max_len], attention_mask [batch, max_len])``, left-padded.

    Lengths spread evenly over ``[min_len, max_len]`` so every batch mixes short and long rows;
    tokens avoid the special ids so that no prompt contains EOS.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, batch).round().to(torch.int64)
    lengths = lengths[torch.randperm(batch, generator=gen)]
    tokens = torch.randint(3, vocab, (batch, max_len), generator=gen)
    positions = torch.arange(max_len).unsqueeze(0)
    mask = positions >= (max_len - lengths).unsqueeze(1)
    return torch.where(mask, tokens, PAD_ID), mask.to(torch.int64)
