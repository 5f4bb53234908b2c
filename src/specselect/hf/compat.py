"""Checks that a HuggingFace model pair can run the batched speculative loop.

The loop keeps each model's KV cache across steps with *holes* (columns of rejected or padding
tokens masked out of attention) and passes explicit position ids. That only works if

* the model is a decoder-only causal LM whose ``forward`` takes its KV cache (``cache``, or
  ``past_key_values`` before transformers 5.24), ``attention_mask`` and ``position_ids``
  (otherwise it cannot be driven token block by token block);
* its attention kernel takes arbitrary masks: ``sdpa`` and ``eager`` do; FlashAttention kernels
  only know left/right padding and causal masks, so holes (and, for trees, 4D masks) are
  impossible there;
* every layer is an attention layer, full or sliding-window: a sliding window counts cache
  *columns*, and with holes columns are not tokens, so a row must stay within the window
  (:func:`check_context_fits`); recurrent (linear-attention, Mamba) and convolutional layers
  fold rejected tokens into their state, which no mask can undo, and chunked or compressed
  attention is not what the loop's masks express;
* the model is causal (:func:`check_causal`): a position's logits do not depend on the tokens
  after it, or one pass over a block of drafts could not equal decoding them one by one;
* both models share the tokenizer: the same special token ids and the same vocabulary, except
  for padding rows at the end of an embedding matrix (checked against ``len(tokenizer)``).

Every failure is a ``ValueError``/``TypeError`` raised before any generation work: the static
checks first, then the causality check, which runs each model on a few tokens.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Sized
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

#: Attention implementations that take a custom (2D with holes, or 4D) attention mask.
MASKABLE_ATTENTION = ("sdpa", "eager")
_REQUIRED_FORWARD_ARGS = ("attention_mask", "position_ids")
#: The forward argument that takes the KV cache: ``cache`` from transformers 5.24 on (where
#: ``past_key_values`` still works, with a deprecation warning), ``past_key_values`` before.
CACHE_ARGS = ("cache", "past_key_values")
#: The special ids whose disagreement shows another tokenizer. Not the pad id: padding is a
#: decoding setting ("pad = EOS" is a common idiom), which a call may set anyway.
_SPECIAL_IDS = ("bos_token_id", "eos_token_id")
_GENERATION_HOOKS = ("can_generate", "get_output_embeddings")
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
#: Config dropouts of classification or summary heads (GPT-2's ``summary_first_dropout``),
#: which the causal LM's forward never applies.
_HEAD_ONLY_DROPOUT = ("summary_", "classifier_")


def check_causal_lm(name: str, model: object) -> nn.Module:
    """Raise unless ``model`` is a decoder-only HF causal LM the loop can drive (see module doc).

    Args:
        name: the argument name (``"target"`` or ``"draft"``) used in messages.
        model: the candidate model.
    """
    if isinstance(model, nn.Module) and hasattr(model, "_orig_mod"):  # torch.compile's wrapper
        raise TypeError(
            f"{name} is a torch.compile wrapper ({type(model).__name__}); pass the model itself "
            f"({name}._orig_mod): speculative_generate drives its forward through its own "
            "caches and masks (cuda_graphs=True captures its passes on a GPU)"
        )
    if isinstance(model, nn.Module) and callable(getattr(model, "get_base_model", None)):
        raise TypeError(  # PEFT's wrapper: its forward takes neither positions nor a cache
            f"{name} is a PEFT wrapper ({type(model).__name__}); pass {name}.get_base_model(), "
            f"whose layers keep the adapters active, or {name}.merge_and_unload() (faster). "
            "Adapters that add virtual tokens (prompt or prefix tuning) cannot be used: the "
            "loop drives the model's own forward"
        )
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"{name} must be a HuggingFace causal LM (an nn.Module with a .config), "
            f"got {type(model).__name__}"
        )
    can_generate, head = (getattr(model, name, None) for name in _GENERATION_HOOKS)
    # Either shows a language-model head: a model of its own that does not mix in
    # GenerationMixin still has one, and a headless or classifying model has neither.
    if callable(can_generate) and callable(head) and not can_generate() and head() is None:
        raise TypeError(
            f"{name} ({type(model).__name__}) has no language-model head to generate with: "
            "speculative_generate needs a causal LM (an ...ForCausalLM, as "
            "AutoModelForCausalLM loads)"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; only decoder-only causal LMs work")
    params = inspect.signature(model.forward).parameters
    missing = [arg for arg in _REQUIRED_FORWARD_ARGS if arg not in params]
    if not any(arg in params for arg in CACHE_ARGS):
        missing.insert(0, " or ".join(CACHE_ARGS))
    if missing:
        raise ValueError(
            f"{name} ({type(model).__name__}) does not support a KV cache driven from outside: "
            f"its forward() lacks {', '.join(missing)}"
        )
    impl = attention_implementation(model)
    if impl not in MASKABLE_ATTENTION:
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}, which cannot take custom attention masks "
            f"(KV holes, tree masks); load it with attn_implementation='sdpa' or 'eager' "
            "(e.g. from_pretrained(..., attn_implementation='sdpa') or "
            "model.set_attn_implementation('sdpa'))"
        )
    kinds = set(getattr(config, "layer_types", None) or ())
    unsupported = sorted(kinds - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(
            f"{name} has layers of type {', '.join(unsupported)}; speculative_generate supports "
            "full and sliding-window attention layers only: they skip rejected tokens by "
            "masking, while a recurrent or convolutional state cannot be rolled back, and other "
            "attention patterns (chunked, compressed, indexed) are not what its masks express"
        )
    if any(p.is_meta for p in model.parameters()):  # it would fail deep inside a first pass
        raise ValueError(
            f"{name} has weights on the meta device (no values: built under "
            "torch.device('meta'), or offloaded by accelerate, which the loop does not "
            "support); load its weights onto one device first"
        )
    return model


#: Models :func:`check_causal` found causal: its probe runs a forward pass, once per model.
_CAUSAL: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_PROBE_LOCK = threading.Lock()  # the probe switches a model's modes and back
_PROBE_TOKENS = 8  # a bidirectional model's first position sees them all
_INF = float("inf")
_PROBE_TOLERANCE = 1e-3  # of the logits' range; a causal model's two rows agree exactly


def check_causal(name: str, handle: ModelHandle) -> None:
    """Raise unless the logits of ``handle``'s model at a position ignore the tokens after it.

    A step verifies a block of tokens in one pass and keeps every position's logits, which
    equals decoding them one at a time only for a causal LM. A bidirectional encoder loaded as
    a causal LM (BERT-style ``...ForCausalLM`` or ``...LMHeadModel`` classes with
    ``config.is_decoder=False``) passes every static check, and neither configs nor modules
    say so alike across families; under the loop's causal masks it computes what ``generate``
    does not, and the output differed silently. So the model runs, without a cache and with
    its own masks, on two rows that share their first token and no later one: a causal
    model's first logits are the same in both. One pass of one shape, so both rows go through
    the same kernels whatever the dtype, autocast or TF32 setting (rounding cannot tell them
    apart: on every family of the tests they agree exactly, while random BERTs at the default
    initialisation move them by about 1e-2 of their range, ten times the tolerance). Non-finite
    logits must be the same in both rows. In evaluation mode, since dropout would tell the rows
    apart; the modules' modes are restored after. Once per model object: a model changed
    afterwards (its ``config.is_decoder`` set) is not checked again.
    """
    model = handle.model
    with _PROBE_LOCK:
        if model in _CAUSAL:
            return
        first, other = _probe_rows(model, handle)
        finite = first.isfinite() & other.isfinite()  # [V]
        same = torch.where(finite, True, (first == other) | (first.isnan() & other.isnan()))
        change = torch.where(finite, (first - other).abs(), 0).max()
        # The range, not the largest magnitude: an offset common to all logits changes nothing.
        scale = torch.where(finite, first, -_INF).max() - torch.where(finite, first, _INF).min()
        moved, spread, agree = torch.stack([change, scale, same.all()]).tolist()  # one read
        if not agree or moved > _PROBE_TOLERANCE * spread:
            raise ValueError(
                f"{name} ({type(model).__name__}) is not a causal LM: its logits at a position "
                f"change with the tokens after it (by up to {moved:.3g}, in logits spanning "
                f"{spread:.3g}), so verifying a block of tokens in one pass cannot equal "
                "generating them one by one. A BERT-style model used as a causal LM needs "
                "config.is_decoder=True (e.g. from_pretrained(..., is_decoder=True))"
            )
        _CAUSAL.add(model)


def _probe_rows(model: nn.Module, handle: ModelHandle) -> tuple[Tensor, Tensor]:
    """``([V], [V])`` float32: the first position's logits of two rows of ``_PROBE_TOKENS``
    tokens that share their first token and no other position's, in one pass in evaluation
    mode."""
    rows = input_rows(model)
    ids = torch.linspace(rows // 4, rows // 2, _PROBE_TOKENS, device=handle.device).long()
    other = torch.cat([ids[:1], (ids[1:] + rows // 2) % rows])  # [N] another id at each later
    ids = torch.stack([ids, other])  # [2, N]: position information alone need not tell
    keep = {"logits_to_keep": 0} if handle.keeps_logits else {}  # 0: every position
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, **keep).logits  # no mask: all seen
    finally:
        for module, training in modes:
            module.training = training
    return logits[0, 0].float(), logits[1, 0].float()


def warn_dropout(name: str, model: nn.Module) -> None:
    """Warn if ``model`` would decode with dropout: a dropout module in training mode with a
    probability above 0, or a dropout rate above 0 in its config (which attention layers apply
    functionally, in training mode) with a module in training mode. Its output is then
    random, so no greedy run repeats, and neither ``generate``'s output nor this loop's is the
    model's."""
    with _PROBE_LOCK:  # not while another call's probe has switched the model to eval
        training = [module for module in model.modules() if module.training]
    if not training:
        return
    config = text_config(model)
    rates = [
        value
        for key, value in vars(config).items()
        if ("dropout" in key or key.endswith("pdrop"))
        and not key.startswith(_HEAD_ONLY_DROPOUT)  # heads a causal LM does not run
        and isinstance(value, (int, float))
    ]
    dropping = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in training)
    if dropping or any(rate > 0 for rate in rates):
        warnings.warn(
            f"{name} is in training mode with dropout, so its output is random (greedy "
            f"decoding does not repeat): call {name}.eval() first (from_pretrained returns "
            "models in evaluation mode; from_config does not)",
            UserWarning,
            stacklevel=3,
        )


def attention_implementation(model: nn.Module) -> str:
    """The attention kernel name stored in the model's config (``"sdpa"``, ``"eager"``, ...)."""
    config = model.config
    return str(getattr(config, "_attn_implementation", None) or "eager")


def sliding_window(model: nn.Module) -> int | None:
    """The sliding-window size of ``model``'s attention layers, or ``None`` if all are full.

    Families differ in how they declare it: Mistral-style configs use ``sliding_window`` alone,
    newer configs list ``layer_types`` (and keep ``sliding_window`` set even when unused).
    """
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and "sliding_attention" not in kinds:
        return None
    return int(window)


def check_context_fits(
    name: str,
    handle: ModelHandle,
    longest: int,
    needs: str = "the longest prompt plus max_new_tokens, less the last new token (never fed)",
    lower: str = "shorten the prompt or lower max_new_tokens",
) -> None:
    """Raise if a row of ``longest`` tokens fed to the model (a generation's last new token
    never is) exceeds what the model of ``handle`` serves; ``needs`` says where ``longest``
    comes from and ``lower`` what the caller can change, for the message.

    Two limits: a learned table of absolute positions (GPT-2's ``n_positions``, OPT's
    ``max_position_embeddings``) cannot embed positions past its end, and a sliding window
    changes the attention once a sequence outgrows it. The loop passes its own masks, which
    carry no window, so a row must stay within the window to see what ``generate`` sees.
    (Rotary models have no table and extrapolate, as they do under ``generate``.)
    """
    check_position_table(name, handle.position_limit, longest, needs, lower)
    window = sliding_window(handle.model)
    if window is not None and longest > window:
        raise ValueError(
            f"{name} uses sliding-window attention (window {window}); the loop attends with "
            f"full masks, so a row must stay within the window, and {needs} needs {longest}: "
            f"{lower}"
        )


def check_position_table(
    name: str, limit: int | None, longest: int, needs: str, lower: str
) -> None:
    """Raise if ``longest`` positions exceed a learned position table of ``limit`` rows
    (``None``: no table); the message as :func:`check_context_fits` words it."""
    if limit is not None and longest > limit:
        raise ValueError(
            f"{name} embeds at most {limit} positions (learned absolute position embeddings), "
            f"but {needs} needs {longest}: {lower}"
        )


def position_limit(model: nn.Module) -> int | None:
    """Positions a learned absolute position table can embed, or ``None`` without one.

    The table is an ``nn.Embedding`` named like a position embedding (``wpe``,
    ``embed_positions``, ``position_embeddings``); OPT's table has an ``offset`` of 2 rows.
    """
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in _POSITION_TABLES:
            return int(module.num_embeddings) - int(getattr(module, "offset", 0))
    return None


def input_device(model: nn.Module) -> torch.device:
    """Device of the input embeddings: where token ids, masks and position ids must go.

    With accelerate's ``device_map`` the layers may sit on several devices; the embedding is the
    first one, and the rest of the model moves activations itself.
    """
    weight = _input_embedding(model)
    return weight.device if weight is not None else next(model.parameters()).device


def input_rows(model: nn.Module) -> int:
    """Token ids ``model`` embeds: the rows of its input embedding, else its vocabulary."""
    weight = _input_embedding(model)
    return int(weight.shape[0]) if weight is not None else int(text_config(model).vocab_size)


def _input_embedding(model: nn.Module) -> torch.Tensor | None:
    """The weight of ``model``'s input embedding, if it has one."""
    # Optional methods are read with getattr: torch types unknown Module attributes as
    # ``Tensor | Module``, and a model that is not a PreTrainedModel may lack them.
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if get_embeddings is not None else None
    weight = getattr(embeddings, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def logits_width(model: nn.Module) -> int:
    """Size of the last dimension of ``model``'s logits (rows of its output embedding)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(text_config(model).vocab_size)


def supports_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``forward`` takes ``logits_to_keep`` (skip the LM head on columns not needed)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def special_token_ids(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """bos/eos/pad ids of ``model`` (each a sorted tuple): those of its config and of its
    generation config together. Both count: a user who sets another stop or pad token in the
    generation config (a decoding setting) has not changed the tokenizer the config names."""
    found: dict[str, tuple[int, ...]] = {}
    sources = (model.config, getattr(model, "generation_config", None))
    for key in _SPECIAL_IDS:
        values = [getattr(source, key, None) for source in sources if source is not None]
        ids = {i for value in values if value is not None for i in _normalise_ids(value)}
        if ids:
            found[key] = tuple(sorted(ids))
    return found


def _normalise_ids(value: object) -> tuple[int, ...]:
    """An id, a list of ids or a tensor of ids as a sorted tuple of ints."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(sorted(int(v) for v in items))  # type: ignore[arg-type]


def check_pair(target: nn.Module, draft: nn.Module, tokenizer: Sized | None = None) -> int:
    """Raise unless ``target`` and ``draft`` share a tokenizer; return the shared vocabulary size.

    Begin and end token ids present in both models must have an id in common: a model that names
    other ids uses another tokenizer, while two models of one tokenizer may list different sets
    (a chat model stops at its end-of-turn token too; its draft, a base model, need not). Only
    the target's ids are used. Logit widths may differ only by padding
    rows (embedding matrices rounded up for speed); since a model alone cannot tell padding from a
    different vocabulary, a difference requires ``tokenizer``, and both widths must then cover
    ``len(tokenizer)``.

    Returns:
        ``len(tokenizer)`` if given, else the common logit width.
    """
    target_ids, draft_ids = special_token_ids(target), special_token_ids(draft)
    for key in _SPECIAL_IDS:
        if key in target_ids and key in draft_ids:
            mine, theirs = target_ids[key], draft_ids[key]
            if not set(mine) & set(theirs):
                raise ValueError(
                    f"target and draft do not share a tokenizer: target {key}={list(mine)}, "
                    f"draft {key}={list(theirs)} (no id in common; ids from each model's "
                    "config and generation_config)"
                )
    widths = logits_width(target), logits_width(draft)
    if tokenizer is not None:
        size = len(tokenizer)
        if min(widths) < size:
            raise ValueError(
                f"tokenizer has {size} tokens but the target has {widths[0]} and the draft "
                f"{widths[1]} logit rows; both models must cover the tokenizer's vocabulary"
            )
        return size
    if widths[0] != widths[1]:
        raise ValueError(
            f"target and draft have different vocabulary sizes ({widths[0]} vs {widths[1]} logit "
            "rows); they may differ only by padding rows: pass tokenizer= so the shared "
            "vocabulary can be checked"
        )
    return widths[0]


@dataclass(frozen=True)
class ModelHandle:
    """A checked model and the facts about it that every forward pass needs.

    Computed once per generation so the loop does not inspect signatures or configs per step.
    """

    model: nn.Module
    device: torch.device  # input device (embeddings)
    vocab: int  # logit width
    mask_kind: str  # attention implementation ("sdpa" or "eager")
    dtype: torch.dtype  # activation dtype (for additive masks)
    keeps_logits: bool  # forward() takes logits_to_keep
    cache_arg: str  # the forward() argument that takes the KV cache (see CACHE_ARGS)
    num_layers: int  # attention layers (one KV cache layer each)
    # Positions a learned table embeds (None: no table); see position_limit.
    position_limit: int | None = None

    @classmethod
    def of(cls, name: str, model: object) -> ModelHandle:
        """Check ``model`` with :func:`check_causal_lm` and collect its facts."""
        module = check_causal_lm(name, model)
        weight = next(module.parameters(), None)
        return cls(
            model=module,
            device=input_device(module),
            vocab=logits_width(module),
            mask_kind=attention_implementation(module),
            dtype=weight.dtype if weight is not None else torch.float32,
            keeps_logits=supports_logits_to_keep(module),
            cache_arg=cache_argument(module),
            num_layers=num_layers(module),
            position_limit=position_limit(module),
        )

    def weak(self) -> ModelHandle:
        """This handle with a weak proxy of the model, for state that outlives a call (graph
        mode keeps its caches and graphs on the target): it must not keep the models alive."""
        return replace(self, model=cast(nn.Module, weakref.proxy(self.model)))

    def facts(self) -> tuple[object, ...]:
        """Everything but the model itself: what buffers allocated for the model depend on."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "model")


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache, which is also its output's
    field: the first of :data:`CACHE_ARGS` it declares (``past_key_values`` if neither, for a
    ``forward(**kwargs)``; :func:`check_causal_lm` refuses those)."""
    params = inspect.signature(model.forward).parameters
    return next((arg for arg in CACHE_ARGS if arg in params), CACHE_ARGS[-1])


def num_layers(model: nn.Module) -> int:
    """Decoder layers of ``model`` that keep keys and values: ``num_hidden_layers`` of its
    text config, less its trailing layers that attend over an earlier layer's
    (``num_kv_shared_layers``, as in Gemma 3n and Gemma 4), which write no cache of their own."""
    config = text_config(model)
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return int(config.num_hidden_layers) - int(shared)


def text_config(model: nn.Module) -> Any:
    """The config of ``model``'s language model: the text part of a multimodal config, else
    the config itself (where sizes such as layers, heads and vocabulary are)."""
    # torch's stubs type every Module attribute not declared on nn.Module as Tensor | Module;
    # a HuggingFace model stores its config as a plain attribute.
    config: Any = model.config
    get_text_config = getattr(config, "get_text_config", None)
    return (get_text_config() if get_text_config is not None else None) or config


def _rope_types(config: Any) -> list[str]:
    """The RoPE types of ``config``: ``rope_parameters`` (transformers 5) or ``rope_scaling``,
    one dict or one per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    nested = [p for p in params.values() if isinstance(p, dict)]
    return [
        str(kind)
        for p in [params, *nested]
        if (kind := p.get("rope_type", p.get("type"))) is not None
    ]


def graph_obstacle(model: nn.Module, name: str) -> str | None:
    """Why ``model`` cannot run in CUDA graphs, or ``None`` if it can.

    A captured pass replays fixed kernels on fixed memory: every weight must sit on one CUDA
    device (no CPU offloading or multi-device ``device_map``), and the forward pass must not
    branch on device values, as dynamic RoPE scaling does (it compares the longest position
    with its cached length on the host), and LongRoPE in some transformers 5 releases.
    """
    config = text_config(model) if hasattr(model, "config") else None
    host_read = [k for k in _rope_types(config) if "dynamic" in k or k == "longrope"]
    if host_read:
        return f"{name} uses {host_read[0]!r} RoPE scaling, which reads positions on the host"
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) != 1:
        listed = ", ".join(sorted(str(d) for d in devices))
        return f"{name}'s weights are spread over several devices ({listed})"
    device = next(iter(devices))
    if device.type != "cuda":
        return f"{name} is on {device}, not on a CUDA device"
    return None
