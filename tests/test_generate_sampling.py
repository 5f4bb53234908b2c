"""Speculative sampling is lossless: generated tokens follow the target's own distribution.

On a tiny-vocabulary pair (vocab 8, hidden 32, 2 layers; the draft a noisy copy of the target,
per-token acceptance sum(min(p, q)) ~0.73 at temperature 1) thousands of rows sample the same two
left-padded prompts in one batch. The empirical distribution of the first two generated tokens
(jointly) and of the third token must match the exact target distribution, computed by
enumerating every prefix with the target and processing its logits with HuggingFace's own
temperature/top-k/top-p warpers (an implementation independent of specselect.sampling).
Chi-square goodness of fit at the suite's level ``ALPHA`` (tests/_stats.py), fixed seeds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from _stats import ALPHA, chi_square_pvalue
from hf_models import tiny_pair
from sampling_cases import (
    MAX_NEW,
    assert_follows_target,
    hf_probs,
    interleaved_prompts,
    sampling_pair,
)
from specselect import make_selector
from specselect.hf import speculative_generate

ROWS_PER_PROMPT = 2500

CONFIGS = {
    "t1": {"temperature": 1.0},
    "t0.7-topk5": {"temperature": 0.7, "top_k": 5},
    "t1.3-topp0.8": {"temperature": 1.3, "top_p": 0.8},
    "t1.2-minp0.25": {"temperature": 1.2, "min_p": 0.25},
}


@pytest.fixture(scope="module")
def pair():
    return sampling_pair()


# Selectors that look at draft probabilities (TETRIS as in the paper, TETRIS with its default
# estimator, a confidence threshold) are where a non-causal selection would bias sampling. With
# MAX_NEW = 3 a row drafts at most 2 tokens per step (a third could not be emitted), so the
# parameters make each selector choose among those 2: TETRIS's budget C = k * active is 1 token
# per row, and the threshold verifies 5-90% of what fixed SD does. (With k = 3 every selector
# verified everything drafted, and the four cases were one.)
SELECTORS = {
    "tetris": lambda: make_selector("tetris", k=1, extra=1),
    "tetris-paper": lambda: make_selector("tetris", k=1, extra=1, estimator=None, guard=False),
    "threshold": lambda: make_selector("threshold", max_k=2, threshold=0.2),
    "fixed": lambda: make_selector("fixed", k=2),
}


@pytest.mark.parametrize("selector_name", sorted(SELECTORS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_sampled_tokens_follow_target_distribution(pair, config_name: str, selector_name: str):
    target, draft = pair
    config = CONFIGS[config_name]
    ids, mask = interleaved_prompts(ROWS_PER_PROMPT)
    width = ids.shape[1]
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=SELECTORS[selector_name](),
        max_new_tokens=MAX_NEW,
        do_sample=True,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(1234),
        **config,
    )
    totals = out.stats.totals
    assert 0.3 < totals.vsr < 0.95, "the fixture must exercise both acceptance and rejection"
    if selector_name.startswith("tetris"):  # at most 1 of a row's 2 drafts, and not none
        assert totals.verified <= totals.active < 2 * totals.verified
    new = out.sequences[:, width:]
    assert new.shape == (ids.shape[0], MAX_NEW)
    assert_follows_target(target, new, config)


DEFAULTS_ROWS = 2000


@pytest.mark.parametrize(
    ("model_top_k", "caller_config", "top_k"),
    [
        (None, None, 50),  # generate()'s global default top_k=50
        (20, GenerationConfig(do_sample=True), 20),  # the model's, under a caller's config
    ],
    ids=["global-default", "model-config"],
)
def test_sampling_uses_generate_default_top_k(model_top_k, caller_config, top_k: int) -> None:
    """Unset sampling options resolve as in generate(): the caller's config, then the model's
    generation_config, then transformers' global defaults (top_k=50). On a 128-token vocabulary
    with flat distributions, about half of the full-vocabulary samples fall outside the top 50.
    No token outside the context's top-k may appear (it has probability 0), and the first token
    must follow the top-k distribution: chi-square at ``ALPHA``, fixed seed."""
    target, draft = tiny_pair("llama", 0, noise=0.02, init_range=0.05)
    for model in (target, draft):
        model.generation_config.top_k = model_top_k
    prompt = torch.tensor([[5, 9, 17, 33]])
    out = speculative_generate(
        target,
        draft,
        prompt.expand(DEFAULTS_ROWS, -1).contiguous(),
        selector=make_selector("fixed", k=2),
        max_new_tokens=2,
        do_sample=None if caller_config is not None else True,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(99),
        generation_config=caller_config,
    )
    assert out.stats.totals.accepted > 0, "the draft's tokens must be verified too"
    with torch.no_grad():
        logits = target(out.sequences[:, :-1]).logits[:, -2:]  # [N, 2, V]
    kth = logits.topk(top_k, dim=-1).values[..., -1]  # [N, 2]
    chosen = logits.gather(2, out.sequences[:, -2:].unsqueeze(2)).squeeze(2)
    assert bool((chosen >= kth).all()), "a token outside the top-k was sampled"
    probs = hf_probs(logits[0, 0:1], {"temperature": 1.0, "top_k": top_k})[0]
    observed = torch.bincount(out.sequences[:, -2], minlength=probs.shape[0])
    assert chi_square_pvalue(observed, probs) > ALPHA
