"""Chain drafting: ``k`` autoregressive draft passes for every slot at once.

The draft model keeps its own :class:`~specselect.hf.kv.ModelCache`. Its cache lags the
sequence by a short *backlog* of tokens it has not processed yet: always the pending token (the
target's last correction or bonus token), plus the last draft token of a row that accepted all
``k`` drafts — the draft proposed that token from its previous pass but never ran on it. The
first draft pass of a step feeds the whole backlog (holes where a row has fewer tokens, the last
valid column being every row's pending token), each later pass feeds the token just drafted.
Steps that draft nothing (``k = 0``) let the backlog grow by the pending token; the next pass
absorbs it like a small prefill (and a backlog :data:`MAX_BACKLOG` wide is absorbed at once).

The backlog is a buffer of static width whose first ``width`` columns are in use; ``width`` is a
host int (2 after a drafting step), part of a drafting stage's capture key.

Token choice and its probabilities use :mod:`specselect.sampling`, with the same processing the
target's distributions get at verification, which is what keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specselect.constants import arange_constant
from specselect.hf.compat import ModelHandle
from specselect.hf.kv import ModelCache, host_index
from specselect.sampling import logits_to_probs, sample_from

NEG_INF = float("-inf")

#: Backlog columns a drafter keeps before it absorbs them in a pass of their own.
MAX_BACKLOG = 16


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: greedy, or sampling with temperature / top-k / top-p / min-p."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def probs(self, logits: Tensor) -> Tensor:  # [..., V] -> [..., V] float32+
        """The processed distribution tokens are sampled from (sampling mode)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass(frozen=True)
class DraftChain:
    """The tokens drafted in one step, with what selection and verification need.

    ``B`` is the step's rows (inactive ones are drafted from holes, and nothing selects their
    tokens), ``k`` the draft passes, ``V`` the target's logit width (draft logits are aligned
    to it).

    Attributes:
        tokens: ``[B, k]`` int64, the drafted token at each position.
        logprobs: ``[B, k]`` float32 or wider, ``log q`` of each drafted token: greedy, the
            draft's unprocessed log-softmax; sampling, the log of the processed ``q`` it was
            drawn from.
        probs: ``[B, k, V]`` float32 or wider (the draft's dtype, at least float32), the
            processed ``q`` at each position, which rejection sampling needs whole; ``None``
            when greedy.
    """

    tokens: Tensor  # [B, k] int64
    logprobs: Tensor  # [B, k] float32: log q of each drafted token
    probs: Tensor | None  # [B, k, V] float32: full q per position (sampling only)

    def to(self, device: torch.device) -> DraftChain:
        probs = None if self.probs is None else move(self.probs, device)
        return DraftChain(move(self.tokens, device), move(self.logprobs, device), probs)


def move(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``, asynchronously unless the copy goes to the CPU: a device-to-host copy
    with ``non_blocking=True`` returns before the data has arrived, and the host would read it
    unfinished."""
    return t.to(device, non_blocking=torch.device(device).type != "cpu")


def align_vocab(logits: Tensor, width: int) -> Tensor:  # [..., V_d] -> [..., width]
    """Give the draft's logits the target's width.

    Extra draft rows (padding the target lacks) are dropped, so the draft never proposes a token
    the target cannot embed; missing rows get ``-inf`` (probability 0). The proposal distribution
    is then simply the draft's, restricted to the shared vocabulary: rejection sampling is lossless
    for any proposal, so nothing else changes.
    """
    extra = logits.shape[-1] - width
    if extra > 0:
        return logits[..., :width]
    if extra < 0:
        return F.pad(logits, (0, -extra), value=NEG_INF)
    return logits


def pick_tokens(
    logits: Tensor,  # [B, V]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor | None]:  # [B] int64, [B] float32, [B, V] | None
    """Choose one draft token per row: ``(token, log q(token), q)``.

    Greedy drafting takes the argmax and reports the draft's unprocessed log-probability as its
    confidence (``q`` is not needed: greedy verification compares tokens). Sampling draws from
    the processed ``q`` and returns it whole for rejection sampling.
    """
    if not params.do_sample:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = logprobs.argmax(dim=-1)
        return token, logprobs.gather(1, token.unsqueeze(1)).squeeze(1), None
    probs = params.probs(logits)
    token = sample_from(probs, generator)
    return token, probs.gather(1, token.unsqueeze(1)).squeeze(1).log(), probs


class ChainDrafter:
    """The draft model's side of the loop: its cache, its backlog, and chain drafting.

    Args:
        handle: the checked draft model.
        slots: rows allocated.
        capacity: columns per row of the draft's cache.
        vocab: the target's logit width (draft logits are aligned to it).
        params: token choice, identical to the target's.
        generator: RNG on the draft's device (sampling only).
        static_span: see :class:`~specselect.hf.kv.ModelCache` (``True`` for graph mode).
    """

    def __init__(
        self,
        handle: ModelHandle,
        slots: int,
        capacity: int,
        vocab: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        static_span: bool = True,
    ) -> None:
        device = handle.device
        self.handle = handle
        self.cache = ModelCache(handle, slots, capacity, static_span=static_span)
        self.vocab = vocab
        self.params = params
        self.generator = generator
        self.backlog = torch.zeros(slots, MAX_BACKLOG, dtype=torch.int64, device=device)
        self.backlog_valid = torch.zeros(slots, MAX_BACKLOG, dtype=torch.bool, device=device)
        self.width = 0  # backlog columns in use (host)
        # The draft's distributions (processed logits) are kept at least in float32: a ratio
        # q / p of a half-precision q would round.
        self.probs_dtype = torch.promote_types(handle.dtype, torch.float32)

    # ------------------------------------------------------------------ eager
    def reset(self) -> None:
        """A new generation: an empty cache, and backlogs one column wide (the pending token
        :meth:`admit` puts there)."""
        self.cache.reset()
        self.width = 1

    def admit(
        self,
        slots: list[int],
        context: Tensor,  # [n, P] int64
        context_valid: Tensor,  # [n, P] bool
        pending: Tensor,  # [n] int64
    ) -> None:
        """Process new prompts into ``slots`` (eager, between steps): each prompt except its
        last token, which becomes the slot's pending token, the last column of its backlog (the
        draft's first pass reads its logits there)."""
        self.cache.admit(slots, self._embeddable(context), context_valid)
        index = host_index(slots, self.backlog.device)  # [n]
        last = self.width - 1
        self.backlog_valid[index] = False
        self.backlog[index, last] = pending
        self.backlog_valid[index, last] = True

    def footprint(self, k: int) -> int:
        """Cache columns a step drafting ``k`` tokens writes: the backlog, then ``k - 1``; a
        step drafting nothing writes only a full backlog (:meth:`absorb`)."""
        if k:
            return self.width + k - 1
        return self.width if self.must_absorb(0) else 0

    def must_absorb(self, k: int) -> bool:
        """Whether a step drafting ``k`` tokens must first absorb a full backlog."""
        return k == 0 and self.width == MAX_BACKLOG

    def absorb(self, rows: int) -> None:
        """Feed the whole backlog to the draft (a step that drafts nothing, when the backlog is
        full; the caller has reserved its :meth:`footprint`); the next pending token starts a
        new backlog. Eager, and rare."""
        valid = self.backlog_valid[:rows, : self.width]
        tokens = self._embeddable(self.backlog[:rows, : self.width])
        self.cache.forward(tokens, valid, last_only=True)
        self.cache.commit(valid)
        self.width = 0

    def advanced(self, k: int) -> None:
        """Host side of :meth:`advance`: the backlog's new width."""
        self.width = 2 if k else self.width + 1

    def keep_rows(self, rows: Tensor, width: int) -> None:
        """Keep only ``rows`` (``[B']`` int64, moved to the front) and compact the cache."""
        self.cache.compact(rows, width)
        kept = rows.shape[0]
        self.backlog[:kept] = self.backlog.index_select(0, rows)
        self.backlog_valid[:kept] = self.backlog_valid.index_select(0, rows)

    # ------------------------------------------------------------------ inside stages
    def draft(self, active: Tensor, k: int) -> DraftChain:  # active [b] bool
        """Draft ``k >= 1`` tokens per slot in ``k`` forward passes (the first feeds the backlog).

        Inactive slots feed holes. Device work only.
        """
        rows = active.shape[0]
        feed = self.backlog[:rows, : self.width]
        feed_valid = self.backlog_valid[:rows, : self.width] & active.unsqueeze(1)
        depth = None
        base = feed_valid.sum(dim=1, keepdim=True)  # [b, 1] depth of the first draft token
        tokens: list[Tensor] = []
        logprobs: list[Tensor] = []
        step_probs: list[Tensor] = []  # one [b, V] per pass (sampling only)
        for j in range(k):
            logits = self.cache.forward(
                self._embeddable(feed), feed_valid, depth=depth, last_only=True
            )
            token, logprob, prob = pick_tokens(
                align_vocab(logits[:, -1], self.vocab), self.params, self.generator
            )
            tokens.append(token)
            logprobs.append(logprob)
            if prob is not None:
                step_probs.append(prob)
            feed, depth = token.unsqueeze(1), base + j
            feed_valid = active.unsqueeze(1)
        stacked = torch.stack(step_probs, dim=1) if self.params.do_sample else None
        return DraftChain(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), stacked)

    def advance(
        self,
        k: int,
        tokens: Tensor,  # [b, k] int64 this step's drafts
        num_accepted: Tensor,  # [b] on the draft's device
        next_token: Tensor,  # [b] on the draft's device
    ) -> None:
        """Commit the accepted drafts and set the next backlog (device work only)."""
        rows = next_token.shape[0]
        if k == 0:  # the draft ran nothing: the backlog just grows
            self.backlog[:rows, self.width] = next_token
            self.backlog_valid[:rows, self.width].fill_(True)
            return
        fed = arange_constant(k - 1, num_accepted.device)  # drafts 0..k-2 were fed back
        backlog_valid = self.backlog_valid[:rows, : self.width]
        self.cache.commit(
            torch.cat([backlog_valid, fed.unsqueeze(0) < num_accepted.unsqueeze(1)], dim=1)
        )
        unseen = num_accepted == k  # the last draft was accepted but never fed
        self.backlog[:rows, 0] = torch.where(unseen, tokens[:, k - 1], 0)
        self.backlog[:rows, 1] = next_token
        self.backlog_valid[:rows, 0] = unseen
        self.backlog_valid[:rows, 1].fill_(True)

    def _embeddable(self, tokens: Tensor) -> Tensor:  # [B, W] -> [B, W]
        """Clamp ids to the draft's embedding rows.

        Only a target padding row the draft lacks can exceed them (see :func:`align_vocab`); the
        draft then conditions on a stand-in token, which may lower acceptance but cannot change
        the output.
        """
        if self.handle.vocab >= self.vocab:
            return tokens
        return tokens.clamp(max=self.handle.vocab - 1)
