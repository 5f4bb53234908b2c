"""Batched speculative generation for HuggingFace causal LMs, lossless, with any selector.

One *step* for every active row (:mod:`specselect.hf.steps` has the details):

1. ``k = selector.draft_length(active rows)``, capped at what any row can still emit; the
   draft proposes ``k`` tokens per row in ``k`` forward passes
   (:class:`~specselect.hf.draft.ChainDrafter`), or one tree per row
   (:class:`~specselect.hf.tree_draft.TreeDrafter`). Positions that could not be emitted
   (``j >= remaining - 1``, and everything after a drafted EOS) get ``-inf`` scores.
2. ``selection = selector.select(scores, active)``. When sampling, the selector sees causal
   scores (:func:`~specselect.scores.causal_logprobs`) instead of the raw log q: judging a
   sampled token by its own probability would bias the output.
3. One target pass over the pending token and all ``k`` drafts (or the tree nodes a row may
   select), the unselected ones as holes: a static width, so the host needs no sync to know it
   (an eager step on a CPU, where a read is free, sends only the widest row's selection).
4. Greedy or lossless sampling verification; each row emits its accepted drafts plus the
   target's token (cut after an EOS); both caches keep the accepted tokens' entries, the rest
   become holes.
5. ``selector.update(selection, num_accepted)``, then ONE read-back (finished flags and
   counts) on which the host retires rows, calls ``selector.observe`` with the counts (and
   the rows they are) and plans the next step.

Both models keep static KV caches (:mod:`specselect.hf.kv`) preallocated for the whole call:
``prompt + max_new_tokens + cache_slack`` columns per row, compacted in place between steps
when the next step would not fit. Rows live in *slots*; finished rows leave the batch (in graph
mode, once the active rows fit a smaller batch bucket; until then they ride along as inactive
slots). The draft and verify passes of a step are *stages* that read every position from device
tensors, so with ``cuda_graphs`` each stage is captured once per (bucket, widths) in a CUDA graph
and replayed (:mod:`specselect.hf.graphs`). Eager and graph mode run the same code.

Host syncs per step: exactly one, the read-back of a ``[8, slots]`` int64 report into pinned
memory (``GenerationState.read_back``): which rows finished, the per-row statistics (also what
``selector.observe`` gets), both caches' valid counts (for compaction), and which rows sampled
from a distribution holding NaN (an error). Everything else
stays on the device, except on a CPU, where a read waits for nothing: there an eager drafting
step also reads its widest selection, so that its verify pass sends no more tokens (nodes) than
that (``CPU_EAGER_READS_PER_STEP``). transformers adds no reads of its own, because every pass
gets a 4D attention mask. Selectors that plan on the host (DSD, the goodput budget, HF's
heuristic schedule) learn from ``observe``, which also says which of the caller's rows the
counts are, without a read of their own. Argument checks read values only for CPU tensors
outside the loop (:mod:`specselect._checks`; the loop switches them off for the tensors it makes
itself). Setup adds a few one-off reads (prompt checks, a seed for a generator of another
device, the prompts' lengths).

Plain decoding: ``selector=None`` decodes one token per step with the same caches, stages and
graphs (no draft model needed), so speculation's own gain is measured against a baseline that
shares every other cost.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Hashable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import GenerationConfig

from specselect._checks import check_int, check_tensor, trusted_values
from specselect.hf.compat import (
    ModelHandle,
    check_causal,
    check_context_fits,
    check_pair,
    graph_obstacle,
    warn_dropout,
)
from specselect.hf.draft import ChainDrafter
from specselect.hf.graphs import (
    Mode,
    StageRunner,
    bucket_for,
    capture_failure,
    emulating_on_cpu,
)
from specselect.hf.kv import aligned
from specselect.hf.memory import CacheNeed, check_memory
from specselect.hf.options import UNSET, GenerationOptions, resolve_options
from specselect.hf.state import (
    Advance,
    GenerationState,
    GenerationStats,
    Layout,
    PhaseClock,
)
from specselect.hf.steps import PHASES, ChainStep, Step, TreeStep
from specselect.hf.tree_draft import TreeDrafter
from specselect.metrics import Totals
from specselect.sampling import check_generator
from specselect.selection import Selector
from specselect.tree import TreeSpec

_REGISTER = "register_generator_state"

#: Host reads (syncs on an accelerator) per step of the loop itself: the read-back.
HOST_READS_PER_STEP = 1
#: Host reads per drafting step run eagerly on a CPU, chain or tree: the read-back, and the
#: widest selection, which sizes the verify pass (``Step.narrow``; a CPU read waits for no
#: device).
CPU_EAGER_READS_PER_STEP = 2

#: Default cache columns per row beyond prompt + max_new_tokens (holes between compactions).
DEFAULT_CACHE_SLACK = 64


@dataclass
class SpeculativeOutput:
    """``sequences`` ``[B, prompt_len + new]`` (left-padded prompts, pad after EOS) and stats."""

    sequences: Tensor  # [B, P + N] int64
    stats: GenerationStats


def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    input_ids: Tensor,  # [B, P] integer token ids
    attention_mask: Tensor | None = None,  # [B, P] 0/1
    *,
    selector: Selector | None,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_token_id: Any = UNSET,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    generation_config: GenerationConfig | None = None,
    progress: bool = False,
    tokenizer: Sized | None = None,
    cache_slack: int = DEFAULT_CACHE_SLACK,
    tree: TreeSpec | None = None,
    cuda_graphs: bool | None = None,
    slots: int | None = None,
) -> SpeculativeOutput:
    """Generate with ``target``, drafting with ``draft``, verifying what ``selector`` chooses.

    Greedy output is token-identical to ``target.generate(do_sample=False)`` (up to float
    rounding of a differently batched forward); sampled output follows the target's processed
    distribution exactly, whatever the selector does, because selectors see only draft-side
    information.

    Args:
        target: HF causal LM (``attn_implementation`` ``"sdpa"`` or ``"eager"``).
        draft: HF causal LM sharing ``target``'s tokenizer; may sit on another device. Unused
            (and may be ``None``) with ``selector=None``.
        input_ids: ``[B, P]`` left-padded prompts, ``B >= 1``.
        attention_mask: ``[B, P]`` 0/1; every row's last column must be 1. Default, as in
            ``generate``: ``input_ids != pad_token_id`` when the pad id is set and is not an EOS
            id, else all ones.
        selector: any :class:`~specselect.selection.Selector` (it is ``reset()`` first) but a
            replay-only one (the oracle), or ``None`` for plain autoregressive decoding with
            the same caches and graphs.
        max_new_tokens: new tokens per row, at least 1. Default, as in ``generate``: the
            merged config's ``max_new_tokens``, else its ``max_length`` minus the padded prompt
            length, else 20, the default capped at the target's ``max_position_embeddings``.
        max_length: prompt plus new tokens, as ``generate``'s: counted from the padded
            prompt's first column; ``max_new_tokens`` wins when both are given.
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature, applied identically to both models (as are the
            next two).
        top_k: keep the ``top_k`` most likely tokens when sampling (unset anywhere: 50, as in
            ``generate``; 0 keeps every token).
        top_p: nucleus sampling threshold.
        min_p: when sampling, drop the tokens less likely than ``min_p`` times the most likely
            one (after the above), as ``generate``'s ``min_p``.
        eos_token_id: id or ids that end a row. Not given: the configs' (as ``generate``);
            ``None`` or ``[]``: no EOS (as ``generate`` with an explicit ``None``).
        pad_token_id: fills rows after their EOS (default: the config's, else the first EOS).
        generator: ``torch.Generator`` for sampling (another device gets a generator seeded
            from it).
        generation_config: HF ``GenerationConfig``, merged as ``generate`` does: its unset
            fields come from ``target.generation_config``, then from transformers' global
            defaults; explicit arguments override all of them.
        progress: show a tqdm bar of generated tokens.
        tokenizer: only needed when the models' vocabulary sizes differ (padding rows): its
            ``len()`` is the shared vocabulary both must cover, and prompt ids must be below
            it.
        cache_slack: cache columns per row beyond ``prompt + max_new_tokens``; the caches are
            compacted when a step would not fit, so more slack means fewer compactions. A step
            that would not fit even then drafts less (``stats.depth_cuts``, and a warning).
        tree: draft a tree per row instead of a chain (:class:`~specselect.TreeSpec`), at
            most ``selector.draft_length()`` deep; the selector must support trees
            (``supports_trees``), and its budget counts tree nodes (the root excluded).
        cuda_graphs: capture the draft and verify passes in CUDA graphs and replay them.
            ``None`` (default): when both models sit on the same CUDA device and can be
            captured (no dynamic RoPE or LongRoPE, no ``torch.autocast`` around the call, no
            failed capture earlier in the process); if a capture fails, a warning says why,
            and this and every later call in the process go on eagerly. ``True``: required
            (raises, saying why, where impossible); ``False``: eager.
        slots: generate at most this many rows at once (continuous batching): the first
            ``slots`` rows start together, and each row left waits, in row order, for the
            first slot a finished row frees, instead of for the whole batch. The caches and
            every pass are ``slots`` rows wide (in graph mode, the bucket that holds them); the
            selector still sees every row, the waiting ones inactive. ``None`` (default):
            every row at once.

    Returns:
        :class:`SpeculativeOutput` with ``sequences`` and :class:`GenerationStats`.

    Raises:
        TypeError: an argument of the wrong type; a model the loop cannot drive (no causal-LM
            head, a PEFT or ``torch.compile`` wrapper); a replay-only selector; a tree for a
            selector without ``supports_trees``.
        ValueError: a model whose forward takes no ``position_ids`` or KV cache from outside
            (Mamba, Bloom's ALiBi), or that is not causal (its logits at a position depend on
            later tokens), or has layers the loop cannot roll back; a bad value (shapes, ids outside
            the vocabulary, right padding, lengths beyond the caches or the models' positions,
            caches beyond free memory), an option ``generate`` has and this loop does not (other
            decoding modes, logits processors, scores and other extra outputs),
            ``cuda_graphs=True`` where graphs are impossible, or a selector another call is
            using. All before any generation.
        RuntimeError: mid-run, a sampling distribution holding NaN (as ``generate``), or a
            selector defined outside specselect that returned an answer breaking its contract
            (checked on a CPU; an estimator's broken scores are a ``ValueError``).
    """
    t_handle, d_handle, vocab = _checked_models(target, draft, selector, tokenizer)
    cache_slack = check_int("cache_slack", cache_slack)
    limit = None if slots is None else check_int("slots", slots, minimum=1)
    if not isinstance(progress, bool):  # a truthy string would show a bar
        raise TypeError(f"progress must be True or False, got {progress!r}")
    check_tree_mode(tree, selector)
    options = resolve_options(
        generation_config,
        getattr(target, "generation_config", None),
        check_tensor("input_ids", input_ids, rank=2).shape[1],
        _position_limit(target),
        max_new_tokens=max_new_tokens,
        max_length=max_length,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    input_ids, attention_mask = check_prompts(
        input_ids, attention_mask, t_handle, options.mask_pad_token_id, vocab
    )
    if tree is not None and tree.branch > vocab:
        raise ValueError(f"TreeSpec.branch ({tree.branch}) exceeds the vocabulary size ({vocab})")
    # Tokens a row feeds the models: its last new token is emitted, never fed back.
    fed = int(attention_mask.sum(dim=1).max()) + options.max_new_tokens - 1
    models = named_models(t_handle, d_handle)
    for name, handle in models:
        check_context_fits(name, handle, fed)
    generators = split_generator(generator, *(handle.device for _, handle in models))
    mode = graph_mode(cuda_graphs, t_handle, d_handle, generators.values())
    for name, handle in models:  # after the static checks: it runs the model
        warn_dropout(name, handle.model)
        check_causal(name, handle)
    loop = _Loop(
        t_handle,
        d_handle,
        selector,
        options,
        generators,
        cache_slack,
        tree,
        mode,
        fall_back=cuda_graphs is None,
        limit=input_ids.shape[0] if limit is None else limit,
    )
    with _claimed(selector):
        return loop.run(input_ids, attention_mask, progress)


# The selectors a call is using, by id (alive while in use): a selector holds one generation's
# state, so two concurrent calls sharing one would reset and feed it under each other.
_SELECTORS_IN_USE: set[int] = set()
_SELECTORS_LOCK = threading.Lock()


@contextlib.contextmanager
def _claimed(selector: Selector | None) -> Iterator[None]:
    """Hold ``selector`` for one call, or raise if another call (another thread) holds it."""
    if selector is None:
        yield
        return
    with _SELECTORS_LOCK:
        if id(selector) in _SELECTORS_IN_USE:
            raise ValueError(
                f"selector {selector!r} is in use by another speculative_generate call: a "
                "selector holds one generation's state, so give each concurrent call its own"
            )
        _SELECTORS_IN_USE.add(id(selector))
    try:
        yield
    finally:
        with _SELECTORS_LOCK:
            _SELECTORS_IN_USE.discard(id(selector))


def _position_limit(target: object) -> int | None:
    """The target config's ``max_position_embeddings`` (which caps ``generate``'s default
    length), if it is an int."""
    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _checked_models(
    target: object, draft: object, selector: object, tokenizer: object
) -> tuple[ModelHandle, ModelHandle | None, int]:
    """The models' handles (the draft's only with a selector) and the vocabulary size they
    share (``len(tokenizer)`` where the pair's widths differ by padding rows), after the checks
    that need no prompt: the selector's kind, the tokenizer's type, the shared vocabulary."""
    if selector is not None and not isinstance(selector, Selector):
        raise TypeError(
            f"selector must be a specselect Selector or None, got {type(selector).__name__}"
        )
    if selector is not None and selector.replay_only:
        raise TypeError(
            f"selector {type(selector).__name__} is replay-only: it selects with each "
            "request's true acceptance, which only replay (specselect.replay) knows; "
            "speculative_generate needs a selector that decides from the draft's side"
        )
    t_handle = ModelHandle.of("target", target)
    if selector is not None and draft is None:
        raise TypeError(
            "draft must be a HuggingFace causal LM for a selector to draft with, got None "
            "(draft=None is for plain decoding, selector=None)"
        )
    d_handle = None if selector is None else ModelHandle.of("draft", draft)
    if tokenizer is not None and not isinstance(tokenizer, Sized):
        raise TypeError(
            "tokenizer must be a tokenizer (or any object with a len(): the shared vocabulary "
            f"size) or None, got {type(tokenizer).__name__}"
        )
    vocab = t_handle.vocab
    if d_handle is not None:
        vocab = check_pair(t_handle.model, d_handle.model, tokenizer)
    return t_handle, d_handle, vocab


def named_models(target: ModelHandle, draft: ModelHandle | None) -> list[tuple[str, ModelHandle]]:
    """The call's models with the argument names its messages use (no draft: plain decoding)."""
    return [("target", target)] + ([("draft", draft)] if draft is not None else [])


def graph_mode(
    cuda_graphs: object,
    target: ModelHandle,
    draft: ModelHandle | None,
    generators: Any,
) -> Mode:
    """``"cuda"``, ``"eager"`` (or ``"trace"`` under :func:`~specselect.hf.graphs.
    emulate_on_cpu`) for the ``cuda_graphs`` argument; raises if ``True`` cannot be served."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if cuda_graphs is False:
        return "eager"
    if emulating_on_cpu():
        return "trace"
    reasons = [capture_failure(), _autocast_obstacle()]
    reasons += [graph_obstacle(h.model, name) for name, h in named_models(target, draft)]
    if draft is not None and draft.device != target.device:
        # A graph records the stream of one device: the other model would run outside it.
        reasons.append(f"target sits on {target.device} and draft on {draft.device}")
    reason = next((r for r in reasons if r is not None), None)
    user_generator = any(g is not None for g in generators)
    if reason is None and user_generator and not hasattr(torch.cuda.CUDAGraph, _REGISTER):
        reason = f"torch {torch.__version__} cannot replay a user generator in a CUDA graph"
    if reason is None:
        return "cuda"
    if cuda_graphs:
        raise ValueError(f"cuda_graphs=True, but {reason}; pass cuda_graphs=False (or None)")
    return "eager"


def _autocast_obstacle() -> str | None:
    """Why autocast rules graph mode out, or ``None``: its cached casts of the weights are freed
    when the ``torch.autocast`` block ends, while replays would go on reading them."""
    return "torch.autocast is enabled for CUDA" if torch.is_autocast_enabled("cuda") else None


def weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """Where ``model``'s parameters and buffers live: what its captured passes read."""
    return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


def check_tree_mode(tree: object, selector: Selector | None) -> None:
    """Raise unless ``tree`` is ``None`` or a :class:`TreeSpec` that ``selector`` can serve.

    Tree mode ranks draft-tree nodes, which selectors with ``supports_trees`` do (every
    registered one); they learn from the accepted path, which the loop passes to
    ``selector.update(..., accepted_nodes=...)``. ``selector.draft_length()`` caps the depth of
    each step's trees.
    """
    if tree is None:
        return
    if not isinstance(tree, TreeSpec):
        raise TypeError(f"tree must be a TreeSpec or None, got {type(tree).__name__}")
    if selector is None:
        raise ValueError("tree mode drafts trees, which plain decoding (selector=None) has none of")
    if not selector.supports_trees:
        raise TypeError(
            f"tree mode needs a selector that selects draft-tree nodes; "
            f"{type(selector).__name__} does not (supports_trees is False); every selector "
            "specselect ships does"
        )


def check_prompts(
    input_ids: object,
    attention_mask: object,
    target: ModelHandle,
    mask_pad_token_id: int | None = None,
    vocab: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Validate the prompts; return them on the target's device (mask as int64). Token ids
    must be below ``vocab``, the pair's shared vocabulary (default: the target's width): an id
    of a padding row only one model has would reach the other as a stand-in token.

    Without ``attention_mask`` the mask is ``input_ids != mask_pad_token_id``, as ``generate``
    infers it (it does so when the pad id is set and is not an EOS id), else all ones. Value
    checks (ids in range, mask 0/1 and left-padded) read the data once, at setup.
    """
    ids = check_tensor("input_ids", input_ids, rank=2)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {ids.dtype}")
    if ids.shape[0] == 0:
        raise ValueError("input_ids is an empty batch: expected shape [B, P] with B >= 1")
    if ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens: expected shape [B, P] with P >= 1")
    for name, tensor in (("input_ids", ids), ("attention_mask", attention_mask)):
        if isinstance(tensor, Tensor) and tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device, which holds no data: pass real tokens (they "
                f"move to the target's device, {target.device})"
            )
    inferred = attention_mask is None and mask_pad_token_id is not None
    if attention_mask is None and mask_pad_token_id is None and ids.shape[0] > 1:
        warnings.warn(  # as generate() warns: padded rows would attend to their pads
            "attention_mask is None and cannot be inferred from input_ids (the pad id is unset "
            "or an EOS id), so every token is attended, pads included: pass the tokenizer's "
            "attention_mask",
            UserWarning,
            stacklevel=3,
        )
    if attention_mask is None:
        pad = mask_pad_token_id
        mask = torch.ones_like(ids, dtype=torch.int64) if pad is None else ids.ne(pad)
    else:
        mask = check_tensor("attention_mask", attention_mask, rank=2)
        if mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, "
                f"got {tuple(mask.shape)}"
            )
    # Compare before any conversion: an integer cast would truncate 0.5 to 0 and 1.7 to 1.
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            "attention_mask must contain only 0 and 1 (in any dtype; fractions such as 0.5 are "
            "not a mask)"
        )
    ids, mask = ids.to(target.device, torch.int64), mask.to(target.device, torch.int64)
    if not bool(mask[:, -1].all()):
        raise ValueError(_unpadded_reason(mask, mask_pad_token_id if inferred else None))
    vocab = target.vocab if vocab is None else vocab
    if not bool(((ids >= 0) & (ids < vocab)).all()):
        raise ValueError(
            f"input_ids must be token ids in [0, {vocab}), the shared vocabulary (len(tokenizer) "
            f"where tokenizer= is given, else the models' logit width); got ids from "
            f"{int(ids.min())} to {int(ids.max())}"
        )
    return ids, mask


def _unpadded_reason(mask: Tensor, inferred_from: int | None) -> str:
    """Why some row of ``mask`` (``[B, P]`` 0/1) does not end in a 1, for its error: an empty
    row (no prompt at all), a mask inferred from a pad id that ends a row, or right padding.
    Read only once the check has failed."""
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()  # the empty rows
    if empty:
        source = "given" if inferred_from is None else f"inferred from pad_token_id={inferred_from}"
        return (
            f"prompt row {empty[0]} is empty: its attention_mask ({source}) is all 0; every row "
            "needs at least one prompt token"
        )
    if inferred_from is not None:
        return (
            f"attention_mask is None, so it is inferred from pad_token_id={inferred_from} as "
            "generate() does, but some row of input_ids ends with that id (right padding?): "
            "left-pad the prompts and pass attention_mask"
        )
    return (
        "attention_mask must be left-padded: the last column of every row must be 1 "
        "(set tokenizer.padding_side = 'left')"
    )


def split_generator(
    generator: torch.Generator | None, *devices: torch.device
) -> dict[torch.device, torch.Generator | None]:
    """One generator per device: ``generator`` where it fits, seeded copies elsewhere.

    A generator produces random numbers on one device type only; when the draft and the target
    sit on different devices, the other one gets a fresh generator seeded from ``generator``
    (one draw, at setup), so runs stay reproducible.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
    result: dict[torch.device, torch.Generator | None] = {}
    for device in devices:
        if generator is None or generator.device.type == device.type:
            result[device] = generator
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            result[device] = torch.Generator(device=device).manual_seed(seed)
        check_generator(result[device], device)
    return result


@dataclass
class _Workspace:
    """A generation state and its captured graphs, kept on the target for the next call."""

    key: tuple[Any, ...]  # what the captured code depends on besides the layout
    draft: weakref.ReferenceType[torch.nn.Module] | None
    state: GenerationState
    runner: StageRunner
    #: What the stages draw random numbers from, per device (``None``: the device's default
    #: generator): the workspace's own, registered with its graphs. A call copies its caller's
    #: generators' states in and back out, so a fresh generator per call replays the graphs.
    generators: dict[torch.device, torch.Generator | None]
    #: Capture keys of the selectors whose work was captured, the most recent last.
    selectors: list[Hashable] = field(default_factory=list)
    #: Held by the call using it: a concurrent call on the same target gets its own workspace.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def retain(self, capture: Hashable | None) -> None:
        """Keep the captures of the last :data:`KEPT_SELECTORS` capturable selectors
        (``capture``: this call's selector's capture key).

        A stateful selector's captures are its own (its key holds its
        :attr:`~specselect.selection.Selector.capture_token`): a loop that gets a new selector
        every call would otherwise keep every old one's verify graphs.
        """
        if capture is None:
            return
        if capture in self.selectors:  # used again: now the most recent
            self.selectors.remove(capture)
        self.selectors.append(capture)
        if len(self.selectors) > KEPT_SELECTORS:
            old = self.selectors.pop(0)
            self.runner.forget(lambda key: Step.captured_selector(key) == old)


#: Selectors whose captures a kept workspace holds (see :meth:`_Workspace.retain`).
KEPT_SELECTORS = 4


#: Graph-mode workspaces by target model (one each): captures are costly, so a later call of the
#: same shape replays them. Eager mode allocates per call and keeps nothing.
_WORKSPACES: weakref.WeakKeyDictionary[torch.nn.Module, _Workspace] = weakref.WeakKeyDictionary()


def release_workspace(target: torch.nn.Module) -> None:
    """Free the caches, buffers and CUDA graphs kept for ``target`` by graph-mode calls.

    ``speculative_generate(..., cuda_graphs=...)`` keeps them so that the next call of a
    compatible shape replays its graphs instead of capturing them again; they are also freed
    when ``target`` is, or replaced by an incompatible graph-mode call (eager calls leave them).
    """
    _WORKSPACES.pop(target, None)


class _Loop:
    """One generation: setup, the prefill, and one step after another."""

    def __init__(
        self,
        target: ModelHandle,
        draft: ModelHandle | None,
        selector: Selector | None,
        options: GenerationOptions,
        generators: dict[torch.device, torch.Generator | None],
        cache_slack: int,
        tree: TreeSpec | None,
        mode: Mode,
        fall_back: bool,
        limit: int,
    ) -> None:
        self.target, self.draft, self.selector = target, draft, selector
        self.options, self.generators = options, generators
        self.slack, self.tree, self.mode = cache_slack, tree, mode
        self.fall_back = fall_back  # a failed capture falls back to eager mode
        self.limit = limit  # the most rows generated at once

    def run(self, input_ids: Tensor, attention_mask: Tensor, progress: bool) -> SpeculativeOutput:
        """The call, its selector reset, in the modes the loop needs.

        ``no_grad`` rather than inference mode: returned tensors stay ordinary tensors that
        callers may modify in place, as with ``generate()``, and a caller's inference mode
        would make a kept workspace's buffers inference tensors, which a later call outside it
        could not update in place. Value checks are off for the tensors the loop makes. On a
        GPU the loop runs with the target's device current: its stream is where the graphs are
        captured and where the read-back's event is recorded."""
        if self.selector is not None:
            self.selector.reset()
        device = self.target.device
        current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(False), torch.no_grad(), trusted_values(), current:
            return self._run(input_ids, attention_mask, progress)

    def _run(self, input_ids: Tensor, attention_mask: Tensor, progress: bool) -> SpeculativeOutput:
        workspace = self._workspace(input_ids)
        own = [  # (the caller's generator, the workspace's) per device
            (given, used)
            for device, given in self.generators.items()
            if given is not None and (used := workspace.generators[device]) not in (None, given)
        ]
        try:
            for given, used in own:
                used.set_state(given.get_state())
            return self._generate(workspace, input_ids, attention_mask, progress)
        finally:
            workspace.state.drop_prompts()  # a kept workspace keeps no caller's tensors
            for given, used in own:
                given.set_state(used.get_state())  # the caller's generator advanced as drawn
            workspace.lock.release()

    def _generate(
        self, workspace: _Workspace, input_ids: Tensor, attention_mask: Tensor, progress: bool
    ) -> SpeculativeOutput:
        state, runner = workspace.state, workspace.runner
        captured = runner.captures
        state.start(self.options, input_ids, attention_mask, self.limit)
        clock = PhaseClock(self.target.device, phases=len(PHASES))
        generator = workspace.generators[self.target.device]
        args = (state, runner, self.selector, self.options.sampling, generator, clock)
        step = ChainStep(*args) if self.tree is None else TreeStep(*args, tree=self.tree)
        start = time.perf_counter()
        state.admit()  # the first rows' prompts
        for handle in (self.target, self.draft):  # timed to its end: a one-off setup sync
            if handle is not None and handle.device.type == "cuda":
                # The stream's, not the device's: a device-wide sync is illegal while another
                # thread's call captures a graph on that device, and would break its capture.
                torch.cuda.current_stream(handle.device).synchronize()
        state.stats.prefill_seconds = time.perf_counter() - start
        self._steps(state, step, progress)
        stats = state.stats
        seconds = dict(zip(PHASES, clock.totals(), strict=True))
        stats.draft_seconds, stats.select_seconds = seconds["draft"], seconds["select"]
        stats.verify_seconds = seconds["verify"]
        stats.other_seconds = seconds["prepare"] + seconds["finish"]
        stats.captures, stats.mode = runner.captures - captured, runner.mode
        if stats.depth_cuts:
            warnings.warn(
                f"cache_slack={self.slack} left no room for the draft the selector asked for at "
                f"{stats.depth_cuts} of {len(stats.steps)} steps, which drafted less (rows that "
                "drift apart need more columns): pass a larger cache_slack (default "
                f"{DEFAULT_CACHE_SLACK}) for speed; greedy output is the same either way, and "
                "sampling follows the target's distribution either way",
                UserWarning,
                stacklevel=5,
            )
        return SpeculativeOutput(state.result(input_ids), stats)

    def _workspace(self, input_ids: Tensor) -> _Workspace:
        """The state (caches sized for the whole call) and the stage runner, locked for this
        call: the target's kept workspace when it serves this call (graph mode) and no other
        call is using it, else a new one (kept in graph mode unless the kept one is busy)."""
        graphs = self.mode != "eager"
        # Read before any lock is taken (a selector's property may raise, and a lock taken
        # here is released only once the call is under way); eager mode never reads it.
        capture = self.selector.capture_key if graphs and self.selector is not None else None
        batch, prompt = input_ids.shape
        layout = self._layout(batch, prompt, graphs)
        key = self._workspace_key()
        draft = None if self.draft is None else self.draft.model
        kept = _WORKSPACES.get(self.target.model) if graphs else None
        busy = kept is not None and not kept.lock.acquire(blocking=False)
        if kept is not None and not busy:
            if (
                kept.key == key
                and (kept.draft() if kept.draft is not None else None) is draft
                and kept.state.layout.serves(layout)
                and kept.runner.mode == self.mode  # not fallen back to eager mode
            ):
                kept.runner.fall_back = self.fall_back
                kept.retain(capture)
                return kept
            kept.lock.release()
            # Replaced: free the old buffers before allocating. Captured graphs hold reference
            # cycles (traced modules, graph pools), so only the collector frees them.
            _WORKSPACES.pop(self.target.model, None)
            kept = None
            gc.collect()
        self._check_memory(layout, prompt)
        workspace = self._new_workspace(key, layout)
        workspace.lock.acquire()
        if graphs and not busy:
            _WORKSPACES[self.target.model] = workspace
            workspace.retain(capture)
        return workspace

    def _workspace_key(self) -> tuple[Any, ...]:
        """What a kept workspace must have been made for to serve this call."""
        return (
            self.mode,
            self.target.facts(),
            None if self.draft is None else self.draft.facts(),
            self.tree,
            self.options.sampling,
            # Graphs record the weights' addresses: a model whose weights moved (to the CPU
            # and back, another dtype and back) must not replay them.
            weight_addresses(self.target.model),
            None if self.draft is None else weight_addresses(self.draft.model),
            # Which devices draw from a generator of their own (the workspace's: see
            # _Workspace.generators), not which generator: a new one per call replays too.
            *(g is not None for g in self.generators.values()),
        )

    def _new_workspace(self, key: tuple[Any, ...], layout: Layout) -> _Workspace:
        """A workspace for ``layout``: state, drafter, stage runner and generators.

        The state holds the models weakly: a kept workspace must not keep them alive. Graph
        mode (one device) draws from generators of the workspace's own; eager mode, which
        keeps nothing, from the caller's (one per device type: a draft and a target on two
        GPUs share it, and their draws must not repeat each other's).
        """
        graphs = self.mode != "eager"
        generators = self.generators
        if graphs:
            generators = {
                device: None if given is None else torch.Generator(device=device)
                for device, given in self.generators.items()
            }
        drafter = self._drafter(layout, generators)
        state = GenerationState(self.target.weak(), drafter, layout, graphs)
        runner = StageRunner(
            self.mode,
            list(generators.values()),
            fall_back=self.fall_back,
            device=self.target.device,
        )
        draft_ref = None if self.draft is None else weakref.ref(self.draft.model)
        return _Workspace(key, draft_ref, state, runner, generators)

    def _layout(self, batch: int, prompt: int, graphs: bool) -> Layout:
        """What this call needs allocated: slots for its bucket, cache columns for the longest
        row plus the slack (and a step's tree)."""
        capacity = prompt + self.options.max_new_tokens + self.slack + self._tree_columns()
        if graphs:  # every pass attends over the whole capacity: keep its rows aligned
            capacity = aligned(capacity)
        return Layout(
            slots=max(bucket_for(min(batch, self.limit), graphs), 1),
            capacity=capacity,
            batch=batch,
            max_new_tokens=self.options.max_new_tokens,
            eos=len(self.options.eos_token_ids),
            lookup=self.selector is not None and self.selector.uses_features,
        )

    def _tree_columns(self) -> int:
        """Cache columns a step's tree needs beside a full row (0 for chains)."""
        return 0 if self.tree is None else self.tree.num_nodes + self.tree.fed_nodes() + 2

    def _check_memory(self, layout: Layout, prompt: int) -> None:
        """Refuse caches that cannot fit before allocating them (:mod:`specselect.hf.memory`).

        The widest mask is the prefill's (``prompt - 1`` tokens over the whole capacity in
        graph mode, over them rounded up to the alignment eagerly) or a tree step's (its root and
        nodes over the whole capacity; the draft's ancestor table of a tree, nodes by nodes,
        is no larger): a tree spec of thousands of nodes must be refused here, not after
        minutes of drafting.
        """
        eager_span = min(aligned(prompt - 1), layout.capacity)
        passes = [(prompt - 1, layout.capacity if self.mode != "eager" else eager_span)]
        if self.tree is not None:
            passes.append((1 + self.tree.num_nodes, layout.capacity))
        width, span = max(passes, key=lambda tokens_span: tokens_span[0] * tokens_span[1])
        needs = [
            CacheNeed(handle, layout.slots, layout.capacity, width, span)
            for handle in (self.target, self.draft)
            if handle is not None
        ]
        new, tree = self.options.max_new_tokens, self._tree_columns()
        padding = layout.capacity - prompt - new - self.slack - tree
        rows = f"{layout.batch} rows" + (
            f" ({layout.slots} cache slots)" if layout.slots != layout.batch else ""
        )
        asked = (
            f"speculative_generate with {rows} of {layout.capacity} cache columns (prompt "
            f"{prompt} + max_new_tokens {new} + cache_slack {self.slack}"
            + (f" + {tree} for a step's tree" if tree else "")
            + (f" + {padding} to align them" if padding else "")
            + ")"
        )
        check_memory(
            needs, asked, "the batch size, the prompt length, max_new_tokens or cache_slack"
        )

    def _drafter(
        self, layout: Layout, generators: dict[torch.device, torch.Generator | None]
    ) -> ChainDrafter | None:
        if self.draft is None:
            return None
        generator = generators[self.draft.device]
        vocab, params = self.target.vocab, self.options.sampling
        args = (self.draft.weak(), layout.slots, layout.capacity, vocab, params, generator)
        static = self.mode != "eager"
        if self.tree is None:
            return ChainDrafter(*args, static_span=static)
        return TreeDrafter(*args, self.tree.sampled_children, static_span=static)

    def _steps(self, state: GenerationState, step: Step, progress: bool) -> None:
        total = state.batch * self.options.max_new_tokens
        plain = self.selector is None
        desc = "plain decoding" if plain else "speculative"
        with tqdm(total=total, disable=not progress, unit="tok", desc=desc) as bar:
            first = True
            while state.unfinished:
                _advance(bar, step.run())
                if first:  # every model has run by now
                    for cache in state.caches():
                        cache.check_written()
                    first = False
                if progress and not plain and state.stats.steps:  # (the steps accounted so far)
                    totals = Totals.of(state.stats.steps)
                    bar.set_postfix(tps=f"{totals.tokens_per_step:.2f}", vsr=f"{totals.vsr:.2f}")
            _advance(bar, step.settle())


def _advance(bar: tqdm, advance: Advance) -> None:  # type: ignore[type-arg]
    """Count a step's tokens, and take the budget of rows that stopped early off the total (a
    rate over tokens never generated would overstate the speed)."""
    if advance.unused:
        bar.total -= advance.unused
        bar.refresh()
    bar.update(advance.tokens)


__all__ = [
    "CPU_EAGER_READS_PER_STEP",
    "DEFAULT_CACHE_SLACK",
    "HOST_READS_PER_STEP",
    "GenerationStats",
    "SpeculativeOutput",
    "TreeSpec",
    "release_workspace",
    "speculative_generate",
]
