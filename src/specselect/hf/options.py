"""Generation options: explicit keyword arguments over a ``GenerationConfig``, HF-style.

``speculative_generate`` reads the same fields as ``model.generate``: a ``generation_config``
(default: the target's own), whose fields any explicit keyword argument overrides. Options the
speculative loop does not implement (beam search, repetition penalties, ...) raise instead of being
silently ignored, because the output would then differ from ``generate``'s.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from specselect._checks import check_int
from specselect.hf.draft import SamplingParams
from specselect.sampling import check_temperature, check_top_p

#: ``generate``'s default when neither ``max_new_tokens`` nor ``max_length`` is set.
DEFAULT_MAX_NEW_TOKENS = 20

# Fields whose non-neutral values change generate's output in ways the loop does not reproduce.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "encoder_repetition_penalty": (None, 1, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "typical_p": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "epsilon_cutoff": (None, 0, 0.0),
    "eta_cutoff": (None, 0, 0.0),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "stop_strings": (None,),
    "guidance_scale": (None, 1, 1.0),
}


@dataclass(frozen=True)
class GenerationOptions:
    """Resolved options of one ``speculative_generate`` call."""

    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]  # empty: no early stop
    pad_token_id: int


def resolve_options(
    generation_config: GenerationConfig | None,
    default_config: GenerationConfig | None,
    prompt_width: int,
    **overrides: Any,
) -> GenerationOptions:
    """Merge ``overrides`` (keyword arguments, ``None`` = not given) over a generation config.

    Args:
        generation_config: the caller's config, or ``None`` for ``default_config``.
        default_config: the target model's ``generation_config`` (may be ``None``).
        prompt_width: padded prompt length, to turn an explicit ``max_length`` into new tokens.
        overrides: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``eos_token_id``, ``pad_token_id``.
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            "generation_config must be a transformers.GenerationConfig, "
            f"got {type(generation_config).__name__}"
        )
    base = generation_config if generation_config is not None else default_config
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    _reject_unsupported(config)
    eos = _token_ids("eos_token_id", config.eos_token_id)
    pad = config.pad_token_id
    pad_id = check_int("pad_token_id", pad) if pad is not None else (eos[0] if eos else 0)
    return GenerationOptions(
        max_new_tokens=_max_new_tokens(config, prompt_width),
        sampling=_sampling(config),
        eos_token_ids=eos,
        pad_token_id=pad_id,
    )


def _max_new_tokens(config: GenerationConfig, prompt_width: int) -> int:
    """``max_new_tokens``, else ``max_length - prompt_width``, else generate's default of 20."""
    if config.max_new_tokens is not None:
        return check_int("max_new_tokens", config.max_new_tokens)
    if config.max_length is not None:
        max_length = check_int("max_length", config.max_length)
        return max(0, max_length - prompt_width)
    return DEFAULT_MAX_NEW_TOKENS


def _sampling(config: GenerationConfig) -> SamplingParams:
    if not bool(config.do_sample):
        return SamplingParams(do_sample=False)
    temperature = 1.0 if config.temperature is None else check_temperature(config.temperature)
    top_k = config.top_k
    top_k = None if top_k in (None, 0) else check_int("top_k", top_k, minimum=1)
    top_p = None if config.top_p is None else check_top_p(config.top_p)
    return SamplingParams(True, temperature, top_k, None if top_p == 1.0 else top_p)


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    """An id, a list of ids or a tensor of ids as a tuple of ints (empty for ``None``)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(check_int(name, v) for v in items)


def _reject_unsupported(config: GenerationConfig) -> None:
    for field, neutral in _UNSUPPORTED.items():
        value = getattr(config, field, None)
        if not any(value is n or value == n for n in neutral):
            raise ValueError(
                f"generation_config.{field}={value!r} is not supported by speculative_generate "
                "(only greedy decoding and sampling with temperature/top-k/top-p are)"
            )
