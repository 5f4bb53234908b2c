"""The sampling pair and its exact target distributions, shared by the chain and tree sampling
tests: a tiny-vocabulary pair (vocab 8, hidden 32, 2 layers; the draft a noisy copy of the
target), two left-padded prompts interleaved row by row, and a chi-square check of the first
three generated tokens against the target's distribution after HuggingFace's own warpers."""

from __future__ import annotations

import functools

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from _stats import ALPHA, chi_square_pvalue
from hf_models import PAD_ID, tiny_pair

VOCAB = 8
PROMPTS = ([5, 3, 7, 4, 6], [6, 4])  # different lengths: the second is left-padded
MAX_NEW = 3


@functools.cache
def sampling_pair():
    """The target and its noisy draft (built once per process)."""
    return tiny_pair("llama", 0, noise=0.3, vocab=VOCAB, hidden=32, init_range=0.15)


def hf_probs(logits: torch.Tensor, config: dict[str, float]) -> torch.Tensor:  # [N, V] -> [N, V]
    """Target distribution after HF's warpers, in generate()'s order (temperature, k, p,
    min-p)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(config["temperature"])])
    if "top_k" in config:
        warpers.append(TopKLogitsWarper(int(config["top_k"])))
    if "top_p" in config:
        warpers.append(TopPLogitsWarper(config["top_p"]))
    if "min_p" in config:
        warpers.append(MinPLogitsWarper(config["min_p"]))
    return torch.softmax(warpers(None, logits.double()), dim=-1)


def exact_distributions(target, prompt: list[int], config) -> tuple[torch.Tensor, torch.Tensor]:
    """``joint [V, V]`` of the first two tokens and ``third [V]``, by enumerating prefixes."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
    seqs = torch.cat([torch.tensor(prompt).expand(VOCAB * VOCAB, -1), pairs], dim=1)
    with torch.no_grad():
        logits = target(seqs).logits[:, -3:]  # predictions for tokens 1, 2, 3
    first = hf_probs(logits[0, 0:1], config)[0]  # [V]
    second = hf_probs(logits[:, 1], config).view(VOCAB, VOCAB, VOCAB)  # [a, b | a]: take b=any
    second = second[:, 0]  # the prediction for token 2 depends only on token 1 (row a*V + 0)
    joint = first.unsqueeze(1) * second  # [a, b]
    third = hf_probs(logits[:, 2], config)  # [a*V + b, c]
    return joint, (joint.reshape(-1, 1) * third).sum(dim=0)


def interleaved_prompts(rows_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: ``PROMPTS`` alternating row by row, left-padded."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS) * rows_per_prompt, width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(PROMPTS):
        ids[i :: len(PROMPTS), width - len(prompt) :] = torch.tensor(prompt)
        mask[i :: len(PROMPTS), width - len(prompt) :] = 1
    return ids, mask


def assert_follows_target(target, new: torch.Tensor, config: dict[str, float]) -> None:
    """The first two new tokens (jointly) and the third of each prompt's rows of
    :func:`interleaved_prompts` fit the exact target distribution (chi-square, ``ALPHA``)."""
    for i, prompt in enumerate(PROMPTS):
        joint, third = exact_distributions(target, prompt, config)
        rows = new[i :: len(PROMPTS)]
        observed_joint = torch.bincount(rows[:, 0] * VOCAB + rows[:, 1], minlength=VOCAB**2)
        assert chi_square_pvalue(observed_joint, joint.reshape(-1)) > ALPHA
        assert chi_square_pvalue(torch.bincount(rows[:, 2], minlength=VOCAB), third) > ALPHA
