"""Batched speculative generation for HuggingFace causal LMs, lossless, with any selector.

One *step* for the ``B_a`` active rows (finished rows are dropped from both models' batches, so
they cost nothing; the selector keeps seeing the full batch with ``active`` flags, so per-row
selector state stays aligned with the caller's rows):

1. ``k = selector.draft_length(B_a)``, capped at what any row can still emit; the draft proposes
   ``k`` tokens per row in ``k`` forward passes (:class:`~specselect.hf.draft.ChainDrafter`)
   and its tokens and log-probabilities (plus ``q`` when sampling) move to the target's device,
   where selection and verification run.
2. Draft positions that could not be emitted get ``-inf`` log-probability: ``j >= remaining - 1``
   (the end-of-row convention shared with trace replay) and every position after a drafted EOS.
3. ``selection = selector.select(draft_logprobs, active)``. When sampling, the selector sees
   causal scores (:func:`~specselect.scores.causal_logprobs`) instead of the raw log q: judging
   a sampled token by its own probability would bias the output.
4. One target pass over ``[pending token, selected drafts]``, rows padded to the longest
   selection (padding columns become KV holes).
5. :func:`~specselect.verify.greedy_verify` or :func:`~specselect.verify.rejection_verify`;
   each row emits its accepted drafts plus the target's token (cut after an EOS); both caches
   keep the accepted tokens' entries, the rest become holes.
6. ``selector.update(selection, num_accepted)``; rows that emitted EOS or reached
   ``max_new_tokens`` retire; caches are compacted when the fullest row has more than
   ``cache_slack`` holes (so a cache is never wider than ``max(valid) + cache_slack`` after a
   step).

With ``tree=TreeSpec(...)`` a step drafts one tree per row instead
(:class:`~specselect.hf.tree_draft.TreeDrafter`), the selector picks tree nodes (``parents=``),
the target runs once over the root and the selected nodes with the tree mask, and
:func:`~specselect.verify_tree.tree_greedy_verify` or
:func:`~specselect.verify_tree.tree_rejection_verify` picks the accepted path; emission,
statistics, retiring and compaction are shared with chain steps.

This module is the entry point: :func:`speculative_generate`, its argument checks, its output
(:class:`SpeculativeOutput`; :class:`GenerationStats` is re-exported from
:mod:`specselect.hf.step_state`) and the driver ``_Loop`` (prefill, then one step after
another). A chain step (1 to 6 above) is :class:`~specselect.hf.chain_step.ChainSteps`, a tree
step :class:`~specselect.hf.tree_step.TreeSteps`; what both share (the generation state,
emission, the read-back, statistics, retiring and compaction) is
:class:`~specselect.hf.step_state.StepState`.

Host syncs per step (everything else stays on the device):

* **the verify width** — ``int(max(selected lengths))`` after selection (``ChainSteps._step``,
  ``TreeSteps._tree_step``). The target pass must have a concrete shape; a static width of
  ``k + 1`` would avoid the sync but verify padding for every row whenever the selector chose
  short windows.
* **one small read-back after verification** — a ``[6, B_a]`` int64 tensor (finished flags,
  selected, accepted and written counts, and both caches' valid counts) in one ``.tolist()``
  (``StepState._finish_step``): which rows retire (their rows must leave the batch), how many
  stay active (the next ``draft_length`` takes a Python int), the per-step statistics, and
  whether to compact.

Outside specselect's own code, transformers may add reads of its own: with SDPA attention and
a 2D attention mask it checks on the host whether the mask can be dropped
(``_ignore_causal_mask_sdpa``), once per chain draft pass after the first and per target pass
one column wide. Eager attention and tree passes (which pass 4D masks) do not.

Selectors may sync on their own (DSD reads its acceptance statistics every ``interval`` steps),
and argument checks read values only for CPU tensors (:mod:`specselect._checks`). Setup adds a
few one-off syncs: prompt checks (:func:`check_prompts`), a seed drawn from ``generator`` for a
device of another type (:func:`split_generator`) and one read after the prefill
(``_Loop._prefill``, so its time is not billed to the first step). Cache widths come from
tensor shapes and need no sync.

Time is split at the sync points: ``draft_seconds`` (drafting and selection, up to the width
read), ``verify_seconds`` (target pass, verification, bookkeeping, up to the read-back) and
``other_seconds`` (retiring rows and compaction); ``prefill_seconds`` is the prompt pass.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import GenerationConfig

from specselect._checks import check_int, check_tensor
from specselect.hf.cache import RaggedCache, causal_block_mask, forward_block
from specselect.hf.chain_step import ChainSteps
from specselect.hf.compat import ModelHandle, check_context_fits, check_pair
from specselect.hf.draft import ChainDrafter
from specselect.hf.options import resolve_options
from specselect.hf.step_state import GenerationStats
from specselect.hf.tree_draft import TreeDrafter, TreeSpec
from specselect.hf.tree_step import TreeSteps
from specselect.metrics import Totals
from specselect.sampling import check_generator
from specselect.selection import Selector

#: Default hole budget of the fullest row before a cache is compacted.
DEFAULT_CACHE_SLACK = 64


@dataclass
class SpeculativeOutput:
    """``sequences`` ``[B, prompt_len + new]`` (left-padded prompts, pad after EOS) and stats."""

    sequences: Tensor  # [B, P + N] int64
    stats: GenerationStats


def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: Tensor,  # [B, P] int64
    attention_mask: Tensor | None = None,  # [B, P] 0/1
    *,
    selector: Selector,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    generation_config: GenerationConfig | None = None,
    progress: bool = False,
    tokenizer: Sized | None = None,
    cache_slack: int = DEFAULT_CACHE_SLACK,
    tree: TreeSpec | None = None,
) -> SpeculativeOutput:
    """Generate with ``target``, drafting with ``draft``, verifying what ``selector`` chooses.

    Greedy output is token-identical to ``target.generate(do_sample=False)`` (up to float
    rounding of a differently batched forward); sampled output follows the target's processed
    distribution exactly, whatever the selector does, because selectors see only draft-side
    information.

    Args:
        target: HF causal LM (``attn_implementation`` ``"sdpa"`` or ``"eager"``).
        draft: HF causal LM sharing ``target``'s tokenizer; may sit on another device.
        input_ids: ``[B, P]`` left-padded prompts, ``B >= 1``.
        attention_mask: ``[B, P]`` 0/1; every row's last column must be 1. Default, as in
            ``generate``: ``input_ids != pad_token_id`` when the pad id is set and is not an EOS
            id, else all ones.
        selector: any :class:`~specselect.selection.Selector`; it is ``reset()`` first.
        max_new_tokens: new tokens per row (default: ``generation_config``'s, else 20).
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature, applied identically to both models (as are the
            next two).
        top_k: keep the ``top_k`` most likely tokens when sampling (unset anywhere: 50, as in
            ``generate``; 0 keeps every token).
        top_p: nucleus sampling threshold.
        eos_token_id: id or ids that end a row (``[]``: none; ``None``: the config's).
        pad_token_id: fills rows after their EOS (default: the config's, else the first EOS).
        generator: ``torch.Generator`` for sampling (another device gets a generator seeded
            from it).
        generation_config: HF ``GenerationConfig``, merged as ``generate`` does: its unset
            fields come from ``target.generation_config``, then from transformers' global
            defaults; explicit arguments override all of them.
        progress: show a tqdm bar of generated tokens.
        tokenizer: only needed when the models' vocabulary sizes differ (padding rows): its
            ``len()`` is the shared vocabulary both must cover.
        cache_slack: holes allowed in the fullest row of a cache before it is compacted.
        tree: draft a tree per row instead of a chain (:class:`~specselect.hf.TreeSpec`); the
            selector must support trees (``supports_trees``: TETRIS, fixed), and its budget
            counts tree nodes (the root excluded).

    Returns:
        :class:`SpeculativeOutput` with ``sequences`` and :class:`GenerationStats`.
    """
    t_handle, d_handle = ModelHandle.of("target", target), ModelHandle.of("draft", draft)
    if tokenizer is not None and not isinstance(tokenizer, Sized):
        raise TypeError(
            "tokenizer must be a tokenizer (or any object with a len(): the shared vocabulary "
            f"size) or None, got {type(tokenizer).__name__}"
        )
    check_pair(t_handle.model, d_handle.model, tokenizer)
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a specselect Selector, got {type(selector).__name__}")
    cache_slack = check_int("cache_slack", cache_slack)
    check_tree_mode(tree, selector)
    options = resolve_options(
        generation_config,
        getattr(target, "generation_config", None),
        check_tensor("input_ids", input_ids, rank=2).shape[1],
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    input_ids, attention_mask = check_prompts(
        input_ids, attention_mask, t_handle, options.mask_pad_token_id
    )
    if tree is not None and tree.branch > t_handle.vocab:
        raise ValueError(
            f"TreeSpec.branch ({tree.branch}) exceeds the vocabulary size ({t_handle.vocab})"
        )
    for name, handle in (("target", t_handle), ("draft", d_handle)):
        check_context_fits(
            name, handle.model, input_ids.shape[1], options.max_new_tokens, cache_slack
        )
    generators = split_generator(generator, t_handle.device, d_handle.device)
    selector.reset()
    # no_grad rather than inference_mode: returned tensors stay ordinary tensors that callers may
    # modify in place, as with generate().
    with torch.no_grad():
        loop = _Loop(t_handle, d_handle, selector, options, generators, cache_slack, tree)
        return loop.run(input_ids, attention_mask, progress)


def check_tree_mode(tree: object, selector: Selector) -> None:
    """Raise unless ``tree`` is ``None`` or a :class:`TreeSpec` that ``selector`` can serve.

    Tree mode ranks draft-tree nodes, which only selectors with ``supports_trees`` can do;
    acceptance estimators and the ranking guard learn from the accepted path, which the loop
    passes to ``selector.update(..., accepted_nodes=...)``.
    """
    if tree is None:
        return
    if not isinstance(tree, TreeSpec):
        raise TypeError(f"tree must be a TreeSpec or None, got {type(tree).__name__}")
    if not selector.supports_trees:
        raise TypeError(
            f"tree mode needs a selector that selects draft-tree nodes; "
            f"{type(selector).__name__} does not (supports_trees is False): use 'tetris' or "
            "'fixed'"
        )


def check_prompts(
    input_ids: object,
    attention_mask: object,
    target: ModelHandle,
    mask_pad_token_id: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Validate the prompts; return them on the target's device (mask as int64).

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
    inferred = attention_mask is None and mask_pad_token_id is not None
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
    ids, mask = ids.to(target.device, torch.int64), mask.to(target.device, torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must contain only 0 and 1")
    if inferred and not bool(mask[:, -1].all()):
        raise ValueError(
            f"attention_mask is None, so it is inferred from pad_token_id={mask_pad_token_id} as "
            "generate() does, but some row of input_ids ends with that id (right padding?): "
            "left-pad the prompts and pass attention_mask"
        )
    if not bool(mask[:, -1].all()):
        raise ValueError(
            "attention_mask must be left-padded: the last column of every row must be 1 "
            "(set tokenizer.padding_side = 'left')"
        )
    if not bool(((ids >= 0) & (ids < target.vocab)).all()):
        raise ValueError(f"input_ids must be token ids in [0, {target.vocab})")
    return ids, mask


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


class _Loop(ChainSteps, TreeSteps):
    """One generation's driver: setup, the prefill and the step loop.

    The state and the bookkeeping shared by both step kinds come from
    :class:`~specselect.hf.step_state.StepState`; a chain step is
    :meth:`~specselect.hf.chain_step.ChainSteps._step`, a tree step
    :meth:`~specselect.hf.tree_step.TreeSteps._tree_step`.
    """

    # ----------------------------------------------------------------- setup and driver
    def run(self, input_ids: Tensor, attention_mask: Tensor, progress: bool) -> SpeculativeOutput:
        batch, max_new = input_ids.shape[0], self.options.max_new_tokens
        self.batch = batch
        self.out = torch.full(
            (batch, max_new + 1), self.options.pad_token_id, dtype=torch.int64, device=self.device
        )  # last column: scratch for tokens that are not written
        self.row_ids = list(range(batch))  # host copy of self.rows
        self.rows = torch.arange(batch, device=self.device)  # [B_a]
        self.active_full: Tensor | None = None  # [B] flags for the selector; None = all active
        self.generated = torch.zeros(batch, dtype=torch.int64, device=self.device)  # [B_a]
        self.generated_host = [0] * batch
        self.per_row = {name: [0] * batch for name in ("verified", "accepted", "emitted", "steps")}
        if max_new > 0:
            start = time.perf_counter()
            self._prefill(input_ids, attention_mask)
            self.stats.prefill_seconds = time.perf_counter() - start
            self._steps(progress)
        new = max(self.generated_host)
        self.stats.verified, self.stats.accepted, self.stats.emitted = (
            torch.tensor(self.per_row[name]) for name in ("verified", "accepted", "emitted")
        )
        self.stats.generated = torch.tensor(self.generated_host)
        self.stats.row_steps = torch.tensor(self.per_row["steps"])
        sequences = torch.cat([input_ids, self.out[:, :new]], dim=1)
        return SpeculativeOutput(sequences=sequences, stats=self.stats)

    def _prefill(self, input_ids: Tensor, attention_mask: Tensor) -> None:
        """Run both models on the prompt except its last token, which becomes pending."""
        batch = input_ids.shape[0]
        context, valid = input_ids[:, :-1], attention_mask[:, :-1].bool()
        self.cache = RaggedCache(batch, self.device)
        if context.shape[1]:
            forward_block(
                self.target,
                self.cache,
                context,
                valid,
                block_mask=causal_block_mask(valid),
                last_only=True,
            )
            self.cache.commit(valid)
        self.pending = input_ids[:, -1]  # [B_a]
        if self.tree is None:
            self.drafter = ChainDrafter(
                self.draft, batch, self.target.vocab, self.params, self.draft_generator
            )
        else:
            self.drafter = TreeDrafter(
                self.draft,
                batch,
                self.target.vocab,
                self.params,
                self.draft_generator,
                self.tree.sampled_children,
            )
        d = self.draft.device
        self.drafter.prefill(context.to(d), valid.to(d), self.pending.to(d))
        int(self.cache.count.max())  # sync once: the prefill's time is not the first step's

    def _steps(self, progress: bool) -> None:
        total = self.batch * self.options.max_new_tokens
        with tqdm(total=total, disable=not progress, unit="tok", desc="speculative") as bar:
            while self.row_ids:
                bar.update(self._step() if self.tree is None else self._tree_step())
                if progress:
                    totals = Totals.of(self.stats.steps)
                    bar.set_postfix(tps=f"{totals.tokens_per_step:.2f}", vsr=f"{totals.vsr:.2f}")


__all__ = [
    "DEFAULT_CACHE_SLACK",
    "GenerationStats",
    "SpeculativeOutput",
    "TreeSpec",
    "speculative_generate",
]
