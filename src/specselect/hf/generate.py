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
:func:`~specselect.verify_tree.tree_rejection_verify` picks the accepted path (``_tree_step``);
emission, statistics, retiring and compaction are shared with chain steps.

Host syncs per step (everything else stays on the device):

* **the verify width** — ``int(max(selected lengths))`` after selection. The target pass must
  have a concrete shape; a static width of ``k + 1`` would avoid the sync but verify padding for
  every row whenever the selector chose short windows.
* **one small read-back after verification** — a ``[6, B_a]`` int64 tensor (finished flags,
  selected, accepted and written counts, and both caches' valid counts) in one ``.tolist()``:
  which rows retire (their rows must leave the batch), how many stay active (the next
  ``draft_length`` takes a Python int), the per-step statistics, and whether to compact.

Selectors may sync on their own (DSD reads its acceptance statistics every ``interval`` steps),
and argument checks read values only for CPU tensors (:mod:`specselect._checks`). Setup adds a
few one-off syncs: prompt checks and one read after the prefill (so its time is not billed to
the first step). Cache widths come from tensor shapes and need no sync.

Time is split at the sync points: ``draft_seconds`` (drafting and selection, up to the width
read), ``verify_seconds`` (target pass, verification, bookkeeping, up to the read-back) and
``other_seconds`` (retiring rows and compaction); ``prefill_seconds`` is the prompt pass.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import GenerationConfig

from specselect._checks import check_int, check_tensor
from specselect.hf.cache import RaggedCache, causal_block_mask, forward_block
from specselect.hf.compat import ModelHandle, check_context_fits, check_pair
from specselect.hf.draft import ChainDrafter, DraftChain, SamplingParams
from specselect.hf.options import GenerationOptions, resolve_options
from specselect.hf.tree_draft import DraftTree, TreeDrafter, TreeSpec
from specselect.metrics import StepCounts, Totals
from specselect.sampling import check_generator
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.selection import NEG_INF, Selection, Selector, available_lengths, prefix_mask
from specselect.tree import TreeBuffers, build_tree_buffers, path_sums
from specselect.verify import greedy_verify, rejection_verify
from specselect.verify_tree import TreeVerdict, tree_greedy_verify, tree_rejection_verify

#: Default hole budget of the fullest row before a cache is compacted.
DEFAULT_CACHE_SLACK = 64


@dataclass
class GenerationStats:
    """What happened during one ``speculative_generate`` call (metrics as in DESIGN.md).

    Per row: ``verified``/``accepted``/``emitted`` totals, ``generated`` new tokens in
    ``sequences``, ``row_steps`` steps the row was active (always the first ``row_steps[i]``
    steps). ``emitted`` counts accepted + 1 per active row and step. When an accepted draft
    token is EOS the target's extra token after it is dropped from ``sequences``, so a row's
    emitted count can exceed its real new tokens (``generated``) by one.
    """

    steps: list[StepCounts] = field(default_factory=list)
    verified: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    accepted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    emitted: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    generated: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    row_steps: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [B]
    verified_per_step: list[Tensor] = field(default_factory=list)  # each [B], 0 if inactive
    accepted_per_step: list[Tensor] = field(default_factory=list)  # each [B], 0 if inactive
    cache_widths: list[tuple[int, int]] = field(default_factory=list)  # (target, draft) per step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def totals(self) -> Totals:
        """Run totals; ``extra`` holds the time split and the peak cache widths."""
        widths = self.cache_widths or [(0, 0)]
        extra = {
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "prefill_seconds": self.prefill_seconds,
            "max_target_cache": float(max(w[0] for w in widths)),
            "max_draft_cache": float(max(w[1] for w in widths)),
        }
        return replace(Totals.of(self.steps), extra=extra)


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
        attention_mask: ``[B, P]`` 0/1 (default all ones); every row's last column must be 1.
        selector: any :class:`~specselect.selection.Selector`; it is ``reset()`` first.
        max_new_tokens: new tokens per row (default: ``generation_config``'s, else 20).
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature, applied identically to both models (as are the
            next two).
        top_k: keep the ``top_k`` most likely tokens when sampling.
        top_p: nucleus sampling threshold.
        eos_token_id: id or ids that end a row (``[]``: none; ``None``: the config's).
        pad_token_id: fills rows after their EOS (default: the config's, else the first EOS).
        generator: ``torch.Generator`` for sampling (another device gets a generator seeded
            from it).
        generation_config: HF ``GenerationConfig`` (default ``target.generation_config``);
            explicit arguments override its fields.
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
    check_pair(t_handle.model, d_handle.model, tokenizer)
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a specselect Selector, got {type(selector).__name__}")
    cache_slack = check_int("cache_slack", cache_slack)
    check_tree_mode(tree, selector)
    input_ids, attention_mask = check_prompts(input_ids, attention_mask, t_handle)
    options = resolve_options(
        generation_config,
        getattr(target, "generation_config", None),
        input_ids.shape[1],
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if tree is not None and tree.branch > t_handle.vocab:
        raise ValueError(
            f"TreeSpec.branch ({tree.branch}) exceeds the vocabulary size ({t_handle.vocab})"
        )
    longest = input_ids.shape[1] + options.max_new_tokens + cache_slack
    check_context_fits("target", t_handle.model, longest)
    check_context_fits("draft", d_handle.model, longest)
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
    input_ids: object, attention_mask: object, target: ModelHandle
) -> tuple[Tensor, Tensor]:
    """Validate the prompts; return them on the target's device (mask as int64).

    Value checks (ids in range, mask 0/1 and left-padded) read the data once, at setup.
    """
    ids = check_tensor("input_ids", input_ids, rank=2)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {ids.dtype}")
    if ids.shape[0] == 0:
        raise ValueError("input_ids is an empty batch: expected shape [B, P] with B >= 1")
    if ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens: expected shape [B, P] with P >= 1")
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.int64)
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


class _Loop:
    """State of one generation: both models' sides, the output buffer and the statistics.

    Tensors are on the target's input device unless named for the draft. Rows are *active rows*
    (``B_a`` of them, in the original order); ``self.rows`` maps them to the caller's rows.
    """

    def __init__(
        self,
        target: ModelHandle,
        draft: ModelHandle,
        selector: Selector,
        options: GenerationOptions,
        generators: dict[torch.device, torch.Generator | None],
        cache_slack: int,
        tree: TreeSpec | None = None,
    ) -> None:
        self.target, self.draft, self.selector = target, draft, selector
        self.tree = tree
        self.options = options
        self.params: SamplingParams = options.sampling
        self.device = target.device
        self.generator = generators[target.device]
        self.draft_generator = generators[draft.device]
        self.slack = cache_slack
        self.eos = torch.tensor(options.eos_token_ids, dtype=torch.int64, device=self.device)
        self.stats = GenerationStats()

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

    # ----------------------------------------------------------------- one step
    def _step(self) -> int:
        """One draft-select-verify step; returns the tokens written (for the progress bar)."""
        start = time.perf_counter()
        num_active = len(self.row_ids)
        k = check_int("selector.draft_length()", self.selector.draft_length(num_active))
        # Positions >= remaining - 1 are masked anyway: do not draft them (host-known counts).
        most = max(self.options.max_new_tokens - self.generated_host[r] for r in self.row_ids)
        k = min(k, most - 1)
        chain = self.drafter.draft(k).to(self.device)
        logprobs = self._mask_unemittable(chain, _selection_scores(chain))  # [B_a, k]
        selection = self.selector.select(self._to_full(logprobs, NEG_INF), self.active_full)
        # A selector that broke its contract must not be able to overflow a row.
        lengths = torch.minimum(self._to_active(selection.lengths), available_lengths(logprobs))
        width = 1 + int(lengths.max())  # host sync 1: the verify width
        drafted = time.perf_counter()

        tokens = chain.tokens[:, : width - 1]  # [B_a, W - 1]
        block = torch.cat([self.pending.unsqueeze(1), tokens], dim=1)  # [B_a, W]
        logits = forward_block(self.target, self.cache, block, prefix_mask(lengths + 1, width))
        num_accepted, next_token = self._verify(chain, lengths, logits.to(self.device), width)
        self.cache.commit(prefix_mask(num_accepted + 1, width))
        written, finished = self._emit(tokens, num_accepted, next_token, width)
        self.drafter.advance(
            k, num_accepted.to(self.draft.device), next_token.to(self.draft.device)
        )
        self.pending = next_token
        self.selector.update(selection, self._to_full(num_accepted, 0))
        return self._finish_step(start, drafted, finished, lengths, num_accepted, written)

    def _finish_step(
        self,
        start: float,
        drafted: float,
        finished: Tensor,  # [B_a] bool
        lengths: Tensor,  # [B_a] verified per row
        num_accepted: Tensor,  # [B_a]
        written: Tensor,  # [B_a]
    ) -> int:
        """The step's read-back, statistics, retirement and compaction (chain and tree alike)."""
        report = torch.stack(
            [
                finished.to(torch.int64),
                lengths,
                num_accepted,
                written,
                self.cache.count,
                self.drafter.cache.count.to(self.device),
            ]
        ).tolist()  # host sync 2: the step's read-back
        verified_at = time.perf_counter()

        counts, retired_slots = self._record(report)
        self._retire_and_compact(report)
        done = time.perf_counter()
        self.stats.draft_seconds += drafted - start
        self.stats.verify_seconds += verified_at - drafted
        self.stats.other_seconds += done - verified_at
        self.stats.steps.append(replace(counts, seconds=done - start))
        self.stats.cache_widths.append((self.cache.width, self.drafter.cache.width))
        return sum(report[3]) + retired_slots

    # ----------------------------------------------------------------- one tree step
    def _tree_step(self) -> int:
        """One step with draft trees: draft, select nodes, one target pass, walk the tree.

        Same bookkeeping and host syncs as :meth:`_step`. The target pass sends each row's root
        (the pending token) and its selected nodes, selected nodes first and padded to the
        largest selection (padding columns become holes), with the tree's ancestor mask and
        positions ``root position + depth``; both caches keep only the accepted path.
        """
        start = time.perf_counter()
        assert self.tree is not None and isinstance(self.drafter, TreeDrafter)
        most = max(self.options.max_new_tokens - self.generated_host[r] for r in self.row_ids)
        depth = min(self.tree.depth, most - 1)  # deeper nodes could not be emitted by any row
        draft = (
            self.drafter.draft_tree(replace(self.tree, depth=depth)).to(self.device)
            if depth > 0
            else self._empty_tree()
        )
        buffers = build_tree_buffers(draft.parents)
        selection: Selection | None = None
        if depth > 0:
            scores = self._mask_unemittable_nodes(draft, buffers, self._tree_scores(draft))
            selection = self.selector.select(
                self._to_full(scores, NEG_INF),
                self.active_full,
                parents=self._to_full(draft.parents, -1),
            )
            # A selector that broke its contract must not verify nodes no row can emit.
            usable = path_sums(scores, draft.parents) > NEG_INF
            selected = self._to_active(selection.mask) & usable  # [B_a, N]
        else:
            selected = torch.zeros_like(draft.tokens, dtype=torch.bool)
        lengths = selected.sum(dim=1)
        width = 1 + int(lengths.max()) if depth > 0 else 1  # host sync 1: the verify width
        drafted = time.perf_counter()

        # Selected nodes first, in index order (so parents stay before children).
        order = torch.sort((~selected).to(torch.uint8), dim=1, stable=True).indices
        order = order[:, : width - 1]  # [B_a, W - 1]
        logits = self._tree_target_pass(draft, buffers, selected, order)
        verdict = self._tree_verify(draft, buffers, selected, logits, order, depth)
        nodes = torch.arange(draft.tokens.shape[1], device=self.device)
        on_path = (nodes.view(1, -1, 1) == verdict.path.unsqueeze(1)).any(dim=2)  # [B_a, N]
        root = torch.ones_like(lengths, dtype=torch.bool).unsqueeze(1)
        self.cache.commit(torch.cat([root, on_path.gather(1, order)], dim=1))
        accepted_tokens = verdict.accepted_tokens(draft.tokens)[:, :depth]  # [B_a, depth]
        written, finished = self._emit(
            accepted_tokens, verdict.num_accepted, verdict.next_token, depth + 1
        )
        d = self.draft.device
        if depth > 0:
            self.drafter.advance_tree(
                verdict.path[:, :depth].to(d), verdict.last_node.to(d), verdict.next_token.to(d)
            )
        else:
            self.drafter.skip(verdict.next_token.to(d))
        self.pending = verdict.next_token
        if selection is not None:
            self.selector.update(
                selection,
                self._to_full(verdict.num_accepted, 0),
                accepted_nodes=self._to_full(on_path, False),
            )
        return self._finish_step(start, drafted, finished, lengths, verdict.num_accepted, written)

    def _empty_tree(self) -> DraftTree:
        """A tree without nodes, for steps where no row can emit a draft token."""
        rows = len(self.row_ids)
        none = torch.zeros(rows, 0, dtype=torch.int64, device=self.device)
        probs = None
        if self.params.do_sample:
            probs = torch.zeros(rows, 1, self.target.vocab, device=self.device)
        return DraftTree(none, none.float(), none, none, probs)

    def _tree_scores(self, draft: DraftTree) -> Tensor:  # -> [B_a, N]
        """Node scores for the selector: causal ones for sampled children (see
        :func:`_selection_scores`); raw log q for deterministic (top-k) children."""
        if not self.drafter.sampled:
            return draft.logprobs
        assert draft.probs is not None
        expected = expected_self_logprob(draft.probs)  # [B_a, N + 1]
        return causal_logprobs(draft.logprobs, expected.gather(1, draft.parents + 1), draft.parents)

    def _mask_unemittable_nodes(
        self, draft: DraftTree, buffers: TreeBuffers, scores: Tensor
    ) -> Tensor:  # [B_a, N] -> [B_a, N]
        """``-inf`` for nodes that could not be emitted: depth >= remaining, or below an EOS."""
        remaining = self.options.max_new_tokens - self.generated  # [B_a]
        cut = draft.depth >= remaining.unsqueeze(1)
        if self.eos.numel():
            nodes = draft.tokens.shape[1]
            eye = torch.eye(nodes, dtype=torch.bool, device=self.device)
            is_eos = torch.isin(draft.tokens, self.eos)  # [B_a, N]
            cut = cut | (buffers.ancestors & ~eye & is_eos.unsqueeze(1)).any(dim=2)
        return scores.masked_fill(cut, NEG_INF)

    def _tree_target_pass(
        self,
        draft: DraftTree,
        buffers: TreeBuffers,
        selected: Tensor,  # [B_a, N] bool
        order: Tensor,  # [B_a, W - 1] int64 node sent in each block column after the root
    ) -> Tensor:  # [B_a, W, V]
        """The target's logits for ``[root, nodes order]`` per row, with the tree mask."""
        rows, nodes = draft.tokens.shape
        count = order.shape[1]
        among = buffers.ancestors.gather(1, order.unsqueeze(2).expand(-1, -1, nodes))
        among = among.gather(2, order.unsqueeze(1).expand(-1, count, -1))  # [B_a, W-1, W-1]
        sees_root = torch.ones(rows, count, 1, dtype=torch.bool, device=self.device)
        root_row = torch.zeros(rows, 1, count + 1, dtype=torch.bool, device=self.device)
        root_row[:, :, 0] = True
        block_mask = torch.cat([root_row, torch.cat([sees_root, among], dim=2)], dim=1)
        first = torch.ones(rows, 1, dtype=torch.bool, device=self.device)
        logits = forward_block(
            self.target,
            self.cache,
            torch.cat([self.pending.unsqueeze(1), draft.tokens.gather(1, order)], dim=1),
            torch.cat([first, selected.gather(1, order)], dim=1),
            depth=torch.cat(
                [torch.zeros_like(first, dtype=torch.int64), draft.depth.gather(1, order)], dim=1
            ),
            block_mask=block_mask,
        )
        return logits.to(self.device)

    def _tree_verify(
        self,
        draft: DraftTree,
        buffers: TreeBuffers,
        selected: Tensor,  # [B_a, N] bool
        logits: Tensor,  # [B_a, W, V]
        order: Tensor,  # [B_a, W - 1] int64
        depth: int,
    ) -> TreeVerdict:
        """Greedy path matching or lossless tree sampling on the target's block output."""
        values = logits if not self.params.do_sample else self.params.probs(logits)
        rows, nodes = draft.tokens.shape
        # Back to one column per node (column j + 1 = after node j); unselected nodes get 0.
        per_node = values.new_zeros(rows, nodes, values.shape[2])
        per_node = per_node.scatter(
            1, order.unsqueeze(2).expand(-1, -1, values.shape[2]), values[:, 1:]
        )
        full = torch.cat([values[:, :1], per_node], dim=1)  # [B_a, N + 1, V]
        if not self.params.do_sample:
            return tree_greedy_verify(draft.tokens, selected, buffers, full)
        assert draft.probs is not None and self.tree is not None
        return tree_rejection_verify(
            draft.tokens,
            selected,
            buffers,
            draft.probs,
            full,
            sampled_children=self.drafter.sampled,
            max_depth=depth,
            max_children=self.tree.branch,
            generator=self.generator,
        )

    def _mask_unemittable(self, chain: DraftChain, logprobs: Tensor) -> Tensor:  # -> [B_a, k]
        """``-inf`` for draft positions that could not be emitted (see the module docstring)."""
        k = logprobs.shape[1]
        columns = torch.arange(k, device=self.device)
        remaining = self.options.max_new_tokens - self.generated  # [B_a]
        cut = columns.unsqueeze(0) >= (remaining - 1).unsqueeze(1)
        if self.eos.numel():
            is_eos = torch.isin(chain.tokens, self.eos).to(torch.int64)
            cut = cut | ((is_eos.cumsum(dim=1) - is_eos) > 0)  # strictly after the first EOS
        return logprobs.masked_fill(cut, NEG_INF)

    def _verify(
        self,
        chain: DraftChain,
        lengths: Tensor,  # [B_a]
        logits: Tensor,  # [B_a, W, V]
        width: int,
    ) -> tuple[Tensor, Tensor]:
        tokens = chain.tokens[:, : width - 1]
        if not self.params.do_sample:
            return greedy_verify(tokens, lengths, logits)
        assert chain.probs is not None
        return rejection_verify(
            tokens,
            lengths,
            chain.probs[:, : width - 1],
            self.params.probs(logits),
            self.generator,
        )

    def _emit(
        self,
        tokens: Tensor,  # [B_a, W - 1]
        num_accepted: Tensor,  # [B_a]
        next_token: Tensor,  # [B_a]
        width: int,
    ) -> tuple[Tensor, Tensor]:  # written [B_a] int64, finished [B_a] bool
        """Write accepted drafts + the target's token into the output, cut after the first EOS."""
        columns = torch.arange(width, device=self.device).unsqueeze(0)  # [1, W]
        padded = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
        emitted = torch.where(columns == num_accepted.unsqueeze(1), next_token.unsqueeze(1), padded)
        count = num_accepted + 1
        hit_eos = torch.zeros_like(count, dtype=torch.bool)
        if self.eos.numel():
            is_eos = torch.isin(emitted, self.eos) & (columns < count.unsqueeze(1))
            hit_eos = is_eos.any(dim=1)
            first = is_eos.to(torch.int64).argmax(dim=1)
            count = torch.where(hit_eos, first + 1, count)
        slots = self.generated.unsqueeze(1) + columns
        slots = torch.where(columns < count.unsqueeze(1), slots, self.options.max_new_tokens)
        self.out.index_put_((self.rows.unsqueeze(1).expand_as(slots), slots), emitted)
        self.generated = self.generated + count
        return count, hit_eos | (self.generated >= self.options.max_new_tokens)

    # ----------------------------------------------------------------- bookkeeping
    def _record(self, report: list[list[int]]) -> tuple[StepCounts, int]:
        """Per-row statistics of the step; return its counts and the retiring rows' unused slots."""
        finished, lengths, accepted = report[0], report[1], report[2]
        verified_row, accepted_row = [0] * self.batch, [0] * self.batch
        for i, row in enumerate(self.row_ids):
            verified_row[row], accepted_row[row] = lengths[i], accepted[i]
            self.per_row["verified"][row] += lengths[i]
            self.per_row["accepted"][row] += accepted[i]
            self.per_row["emitted"][row] += accepted[i] + 1
            self.per_row["steps"][row] += 1
            self.generated_host[row] += report[3][i]
        self.stats.verified_per_step.append(torch.tensor(verified_row))
        self.stats.accepted_per_step.append(torch.tensor(accepted_row))
        active = len(self.row_ids)
        counts = StepCounts(
            active=active,
            verified=sum(lengths),
            accepted=sum(accepted),
            emitted=sum(accepted) + active,
        )
        unused = sum(
            self.options.max_new_tokens - self.generated_host[row]
            for i, row in enumerate(self.row_ids)
            if finished[i]
        )
        return counts, unused

    def _retire_and_compact(self, report: list[list[int]]) -> None:
        """Drop finished rows from both models' batches; compact caches with too many holes."""
        finished, target_count, draft_count = report[0], report[4], report[5]
        keep = [i for i, f in enumerate(finished) if not f]
        if not keep:
            self.row_ids = []
            return
        if len(keep) < len(finished):
            index = torch.tensor(keep, device=self.device)
            self.cache.compact(index, max(target_count[i] for i in keep))
            self.drafter.keep_rows(index.to(self.draft.device), max(draft_count[i] for i in keep))
            self.rows = self.rows.index_select(0, index)
            self.generated = self.generated.index_select(0, index)
            self.pending = self.pending.index_select(0, index)
            self.row_ids = [self.row_ids[i] for i in keep]
            self.active_full = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
            self.active_full.index_fill_(0, self.rows, True)
            return
        if self.cache.holes(max(target_count)) > self.slack:
            self.cache.compact(None, max(target_count))
        if self.drafter.cache.holes(max(draft_count)) > self.slack:
            self.drafter.keep_rows(None, max(draft_count))

    def _to_full(self, values: Tensor, fill: float) -> Tensor:  # [B_a, ...] -> [B, ...]
        if len(self.row_ids) == self.batch:
            return values
        full = torch.full(
            (self.batch, *values.shape[1:]), fill, dtype=values.dtype, device=values.device
        )
        return full.index_copy(0, self.rows, values)

    def _to_active(self, values: Tensor) -> Tensor:  # [B, ...] -> [B_a, ...]
        if len(self.row_ids) == self.batch:
            return values
        return values.index_select(0, self.rows)


__all__ = [
    "DEFAULT_CACHE_SLACK",
    "GenerationStats",
    "SpeculativeOutput",
    "TreeSpec",
    "speculative_generate",
]


def _selection_scores(chain: DraftChain) -> Tensor:  # -> [B_a, k]
    """What the selector sees: draft log-probs, made causal when the tokens were sampled.

    A selector that judged a *sampled* token by its own probability would bias speculative
    sampling (:mod:`specselect.scores`); greedy drafts are functions of their prefix and may be
    judged by their own probability.
    """
    if chain.probs is None:
        return chain.logprobs
    return causal_logprobs(chain.logprobs, expected_self_logprob(chain.probs))
