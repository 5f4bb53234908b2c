"""Generation options, resolved the way ``model.generate`` resolves them.

``speculative_generate`` reads the same fields as ``model.generate`` and merges them in the same
order (transformers' ``GenerationMixin._prepare_generation_config``): the fields the caller's
``generation_config`` sets, then the target's own ``generation_config`` for the fields still
unset, then transformers' global defaults (``top_k=50``, ``max_length=20``, ...) for the rest, and
finally the explicit keyword arguments. Skipping a step changes the output: without the global
defaults sampling would ignore ``top_k=50``; without the model's config a caller's
``generation_config`` would drop its EOS id. Options the speculative loop does not implement
(beam search, repetition penalties, ...) raise instead of being silently ignored, because the
output would then differ from ``generate``'s.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from specselect._checks import check_int
from specselect.hf.draft import SamplingParams
from specselect.sampling import check_min_p, check_temperature, check_top_p


class _Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


#: An argument the caller did not give (``None`` can be a real value: ``eos_token_id=None``
#: means "no EOS" to ``generate``, not "the config's").
UNSET: Any = _Unset()

#: ``generate``'s default when neither ``max_new_tokens`` nor ``max_length`` is set: its global
#: default ``max_length`` (20), counted from the end of the prompt.
DEFAULT_MAX_NEW_TOKENS = 20

# Fields whose non-neutral values change generate's output, in greedy decoding and sampling
# alike, in ways the loop does not reproduce: other decoding modes (beam, contrastive, constrained,
# DoLa), logits processors, stopping criteria, and input rewriting (token healing). The last
# neutral value is the one to suggest.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None, 0, 0.0),
    "constraints": (None,),
    "force_words_ids": (None,),
    "dola_layers": (None,),
    "repetition_penalty": (None, 1, 1.0),
    "encoder_repetition_penalty": (None, 1, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "guidance_scale": (None, 1, 1.0),
    "exponential_decay_length_penalty": (None,),
    "remove_invalid_values": (None, False),
    "watermarking_config": (None,),
    "token_healing": (None, False),
    "stop_strings": (None,),
    "max_time": (None,),
    "is_assistant": (None, False),
    # HF's mixture of the target's and the draft's distributions: not the target's.
    "assistant_ensemble_weight": (None,),
}

# HF's own assisted-generation settings: here the selector decides what is drafted and
# verified, so a caller's config that sets one (to other than its global default) is warned
# that it is ignored. Only the caller's: a model's config may carry them from its training.
_HF_SPECULATION = (
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_early_exit",
    "assistant_lookbehind",
    "target_lookbehind",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "use_mtp",
    "speculation_type",
)

# Outputs generate() adds with return_dict_in_generate; the loop returns sequences and its own
# statistics only.
_UNSUPPORTED_OUTPUTS: dict[str, tuple[object, ...]] = {
    "output_scores": (None, False),
    "output_logits": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
}

# Why _reject_unsupported refuses a field of each table (completing "... by
# speculative_generate,").
_NOT_A_DECODING_MODE = (
    "which implements greedy decoding and sampling with temperature/top-k/top-p/min-p only"
)
_NOT_AN_OUTPUT = (
    "which returns the sequences and its own statistics only (no scores, logits, attentions "
    "or hidden states)"
)

# The keyword arguments that only sampling reads: a greedy call given one (other than its
# global default) is warned, as generate() warns, since it is ignored.
_SAMPLING_ARGUMENTS = ("temperature", "top_k", "top_p", "min_p")

# Warpers generate() applies only when sampling: they change nothing in greedy decoding, where
# generate() ignores them too.
_UNSUPPORTED_WHEN_SAMPLING: dict[str, tuple[object, ...]] = {
    "top_h": (None,),
    "typical_p": (None, 1, 1.0),
    "epsilon_cutoff": (None, 0, 0.0),
    "eta_cutoff": (None, 0, 0.0),
}


@dataclass(frozen=True)
class GenerationOptions:
    """Resolved options of one ``speculative_generate`` call."""

    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]  # empty: no early stop
    pad_token_id: int
    # The pad id a missing attention mask is inferred from (None: the mask is all ones).
    mask_pad_token_id: int | None = None


def resolve_options(
    generation_config: GenerationConfig | None,
    default_config: GenerationConfig | None,
    prompt_width: int,
    position_limit: int | None = None,
    **overrides: Any,
) -> GenerationOptions:
    """Merge ``generation_config``, ``default_config``, global defaults and ``overrides``.

    Args:
        generation_config: the caller's config (its set fields win), or ``None``.
        default_config: the target model's ``generation_config`` (may be ``None``); it fills the
            fields ``generation_config`` leaves unset.
        prompt_width: padded prompt length, to turn an explicit ``max_length`` into new tokens.
        position_limit: the target config's ``max_position_embeddings``, which caps the default
            length (prompt plus the default ``max_length`` new tokens), as in ``generate``.
        overrides: ``max_new_tokens``, ``max_length``, ``do_sample``, ``temperature``,
            ``top_k``, ``top_p``, ``min_p``, ``eos_token_id``, ``pad_token_id``; they override
            everything. ``None`` means not given, except for ``eos_token_id``, where it means
            "no EOS" as in ``generate`` and :data:`UNSET` means not given.
    """
    config, explicit_max_length = merge_generation_config(
        generation_config, default_config, overrides
    )
    do_sample = config.do_sample
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    _reject_unsupported(config, _UNSUPPORTED, _NOT_A_DECODING_MODE)
    _reject_unsupported(config, _UNSUPPORTED_OUTPUTS, _NOT_AN_OUTPUT)
    if do_sample:
        _reject_unsupported(config, _UNSUPPORTED_WHEN_SAMPLING, _NOT_A_DECODING_MODE)
    else:
        _warn_ignored_sampling_arguments(overrides)
    _warn_ignored_speculation_settings(generation_config)
    eos = _token_ids("eos_token_id", config.eos_token_id)
    pad = config.pad_token_id
    pad = None if pad is None else check_int("pad_token_id", pad)
    return GenerationOptions(
        max_new_tokens=_max_new_tokens(config, explicit_max_length, prompt_width, position_limit),
        sampling=_sampling(config),
        eos_token_ids=eos,
        pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
        mask_pad_token_id=pad if pad is not None and pad not in eos else None,
    )


def merge_generation_config(
    generation_config: GenerationConfig | None,
    default_config: GenerationConfig | None,
    overrides: dict[str, Any],
) -> tuple[GenerationConfig, bool]:
    """The merged config and whether ``max_length`` was set before the global defaults.

    Mirrors ``GenerationMixin._prepare_generation_config``: a copy of the caller's config (or an
    empty one) takes the model config's values for its unset (``None``) fields, then the global
    defaults for those still unset, then every given keyword argument. Neither input is modified.
    ``generate`` counts a ``max_length`` set by the caller or the model from the start of the
    prompt, but its global default of 20 from the end: the flag tells them apart.
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            "generation_config must be a transformers.GenerationConfig, "
            f"got {type(generation_config).__name__}"
        )
    config = GenerationConfig() if generation_config is None else copy.deepcopy(generation_config)
    if isinstance(default_config, GenerationConfig):
        config.update(**default_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    explicit_max_length = config.max_length is not None or overrides.get("max_length") is not None
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    for key, value in overrides.items():
        if value is UNSET or (value is None and key != "eos_token_id"):
            continue
        setattr(config, key, value)
    return config, explicit_max_length


def _max_new_tokens(
    config: GenerationConfig,
    explicit_max_length: bool,
    prompt_width: int,
    position_limit: int | None,
) -> int:
    """``max_new_tokens``, else an explicit ``max_length - prompt_width``, else the default
    (20), the total capped at ``position_limit`` as in ``generate``.

    An explicit ``max_length``, or the capped default, that leaves no room after the prompt
    raises, as in ``generate``.
    """
    if config.max_new_tokens is not None:  # >= 1, as in generate()
        return check_int("max_new_tokens", config.max_new_tokens, minimum=1)
    if config.max_length is None:
        return DEFAULT_MAX_NEW_TOKENS
    max_length = check_int("max_length", config.max_length)
    if not explicit_max_length:  # generate() adds the default to the prompt, up to the limit
        if position_limit is not None and position_limit <= prompt_width:
            raise ValueError(
                f"the default length (max_length {max_length} new tokens) is capped at the "
                f"target's max_position_embeddings ({position_limit}), which the padded prompt "
                f"({prompt_width}) already reaches, as in generate(); set max_new_tokens"
            )
        new = (
            max_length if position_limit is None else min(max_length, position_limit - prompt_width)
        )
        capped = (
            f" (generate()'s {max_length}, capped at the positions)" if new < max_length else ""
        )
        warnings.warn(
            f"no length given: generating {new} new tokens per row{capped}, as generate() "
            "does; pass max_new_tokens to choose",
            UserWarning,
            stacklevel=4,
        )
        return new
    if max_length <= prompt_width:
        raise ValueError(
            f"max_length ({max_length}) must exceed the padded prompt length ({prompt_width}): "
            "it counts the prompt, as in generate(); increase it or set max_new_tokens instead"
        )
    return max_length - prompt_width


def _sampling(config: GenerationConfig) -> SamplingParams:
    """Greedy, or the warpers ``generate`` applies when sampling (top-k 0 keeps everything)."""
    if not config.do_sample:
        return SamplingParams(do_sample=False)
    temperature = 1.0 if config.temperature is None else check_temperature(config.temperature)
    top_k = None if config.top_k is None else check_int("top_k", config.top_k)  # 0: every token
    top_p = None if config.top_p is None else check_top_p(config.top_p)
    min_p = None if config.min_p is None else check_min_p(config.min_p)
    return SamplingParams(
        True, temperature, top_k or None, None if top_p == 1.0 else top_p, min_p if min_p else None
    )


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    """An id, a list of ids or a tensor of ids as a tuple of ints (empty for ``None``)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(check_int(name, v) for v in items)


def _reject_unsupported(
    config: GenerationConfig, fields: dict[str, tuple[object, ...]], why: str
) -> None:
    """Raise for the first field of ``fields`` whose value is not one of its neutral values,
    saying ``why`` the loop does not support it (completing "... by speculative_generate,").

    The value may come from the target's ``generation_config`` rather than the caller's, so the
    message says so: leaving the field unset in the caller's config would inherit it again.
    """
    for field, neutral in fields.items():
        value = getattr(config, field, None)
        if not any(value is n or value == n for n in neutral):
            raise ValueError(
                f"generation_config.{field}={value!r} is not supported by speculative_generate, "
                f"{why}: {_switch_off_hint(field, neutral[-1])}"
            )


def _warn_ignored_sampling_arguments(overrides: dict[str, Any]) -> None:
    """Warn, as ``generate`` does, when greedy decoding is given sampling arguments it ignores.

    Only the keyword arguments: the values that come from a ``GenerationConfig``, the
    caller's or the model's, were validated (and warned about) by transformers as they were
    merged.
    """
    ignored = _non_default(_SAMPLING_ARGUMENTS, overrides.get)
    if ignored:
        verb = "applies" if len(ignored) == 1 else "apply"
        warnings.warn(
            f"{', '.join(ignored)} only {verb} when sampling; do_sample is False, so "
            f"{'it is' if len(ignored) == 1 else 'they are'} ignored, as in generate() (pass "
            "do_sample=True to sample)",
            UserWarning,
            stacklevel=4,
        )


def _non_default(fields: tuple[str, ...], value_of: Callable[[str], Any]) -> list[str]:
    """``field=value`` for each of ``fields`` set (not ``None``) to other than transformers'
    global default."""
    defaults = GenerationConfig._get_default_generation_params()
    return [
        f"{field}={value!r}"
        for field in fields
        if (value := value_of(field)) is not None and value != defaults.get(field)
    ]


def _warn_ignored_speculation_settings(generation_config: GenerationConfig | None) -> None:
    """Warn when the caller's config sets HF's own assisted-generation settings, which
    ``generate`` reads with an ``assistant_model`` and this loop does not (its selector
    decides)."""
    if generation_config is None:
        return
    ignored = _non_default(_HF_SPECULATION, lambda field: getattr(generation_config, field, None))
    if ignored:
        warnings.warn(
            f"generation_config sets HF's assisted-generation settings {', '.join(ignored)}, "
            "which speculative_generate ignores: its selector chooses what to draft and "
            "verify (e.g. make_selector('fixed', k=...) for a fixed window, "
            "make_selector('threshold', ...) for a confidence threshold)",
            UserWarning,
            stacklevel=4,
        )


def _switch_off_hint(field: str, neutral: object) -> str:
    """How to switch ``field`` off; ``None`` in the caller's config would inherit the model's."""
    if neutral is None:
        return f"unset it (if it comes from target.generation_config, set {field}=None there)"
    return f"set {field}={neutral!r} (an unset field takes target.generation_config's value)"
