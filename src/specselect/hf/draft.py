"""Chain drafting: ``k`` autoregressive draft passes for every active row at once.

The draft model keeps its own :class:`~specselect.hf.cache.RaggedCache`. Its cache lags the
sequence by a short *backlog* of tokens it has not processed yet: always the pending token (the
target's last correction or bonus token), plus the last draft token of a row that accepted all
``k`` drafts — the draft proposed that token from its previous pass but never ran on it. The
first draft pass of a step feeds the whole backlog (right-aligned, holes on the left, so the last
column is every row's pending token), each later pass feeds the token just drafted. Steps that
draft nothing (``k = 0``) let the backlog grow; the next pass absorbs it like a small prefill.

Token choice and its probabilities use :mod:`specselect.sampling`, with the same processing the
target's distributions get at verification, which is what keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specselect.hf.cache import RaggedCache, causal_block_mask, forward_block
from specselect.hf.compat import ModelHandle
from specselect.sampling import logits_to_probs, sample_from

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: greedy, or sampling with temperature / top-k / top-p."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def probs(self, logits: Tensor) -> Tensor:  # [..., V] -> [..., V] float32+
        """The processed distribution tokens are sampled from (sampling mode)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class DraftChain:
    """The tokens drafted in one step, with what selection and verification need."""

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
        batch: rows.
        vocab: the target's logit width (draft logits are aligned to it).
        params: token choice, identical to the target's.
        generator: RNG on the draft's device (sampling only).
    """

    def __init__(
        self,
        handle: ModelHandle,
        batch: int,
        vocab: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        self.handle = handle
        self.cache = RaggedCache(batch, handle.device)
        self.vocab = vocab
        self.params = params
        self.generator = generator
        self.backlog = torch.zeros(batch, 0, dtype=torch.int64, device=handle.device)  # [B, F]
        self.backlog_valid = torch.zeros(batch, 0, dtype=torch.bool, device=handle.device)
        self._last: Tensor | None = None  # [B] the last drafted token (never fed to the draft)

    def prefill(
        self,
        context: Tensor,  # [B, P] int64
        context_valid: Tensor,  # [B, P] bool
        pending: Tensor,  # [B] int64
    ) -> None:
        """Process the prompt except its last token, which becomes the backlog."""
        if context.shape[1]:
            forward_block(
                self.handle,
                self.cache,
                self._embeddable(context),
                context_valid,
                block_mask=causal_block_mask(context_valid),
                last_only=True,
            )
            self.cache.commit(context_valid)
        self.backlog = pending.unsqueeze(1)
        self.backlog_valid = torch.ones_like(self.backlog, dtype=torch.bool)

    def draft(self, k: int) -> DraftChain:
        """Draft ``k`` tokens per row in ``k`` forward passes (the first one feeds the backlog)."""
        batch, device = self.cache.batch, self.handle.device
        if k == 0:
            probs = (
                torch.zeros(batch, 0, self.vocab, device=device) if self.params.do_sample else None
            )
            empty = torch.zeros(batch, 0, device=device)
            return DraftChain(empty.to(torch.int64), empty, probs)
        tokens: list[Tensor] = []
        logprobs: list[Tensor] = []
        step_probs: list[Tensor] = []  # one [B, V] per pass (sampling only)
        feed, feed_valid, depth = self.backlog, self.backlog_valid, None
        base = self.backlog_valid.sum(dim=1, keepdim=True)  # [B, 1] depth of the first draft token
        for j in range(k):
            logits = forward_block(
                self.handle,
                self.cache,
                self._embeddable(feed),
                feed_valid,
                depth=depth,
                last_only=True,
            )
            token, logprob, prob = pick_tokens(
                align_vocab(logits[:, -1], self.vocab), self.params, self.generator
            )
            tokens.append(token)
            logprobs.append(logprob)
            if prob is not None:
                step_probs.append(prob)
            if j + 1 < k:
                feed, depth = token.unsqueeze(1), base + j
                feed_valid = torch.ones_like(feed, dtype=torch.bool)
        self._last = tokens[-1]
        stacked = torch.stack(step_probs, dim=1) if self.params.do_sample else None
        return DraftChain(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), stacked)

    def advance(self, k: int, num_accepted: Tensor, next_token: Tensor) -> None:
        """Commit the accepted drafts and set the next backlog.

        Args:
            k: tokens drafted this step.
            num_accepted: ``[B]`` accepted draft tokens per row (on the draft's device).
            next_token: ``[B]`` the target's correction or bonus token (on the draft's device).
        """
        pending = next_token.unsqueeze(1)
        if k == 0:  # the draft ran nothing: the backlog just grows
            self.backlog = torch.cat([self.backlog, pending], dim=1)
            self.backlog_valid = torch.cat(
                [self.backlog_valid, torch.ones_like(pending, dtype=torch.bool)], dim=1
            )
            return
        fed = torch.arange(k - 1, device=num_accepted.device)  # drafts 0..k-2 were fed back
        self.cache.commit(
            torch.cat([self.backlog_valid, fed.unsqueeze(0) < num_accepted.unsqueeze(1)], dim=1)
        )
        unseen = num_accepted == k  # the last draft was accepted but never fed
        assert self._last is not None
        self.backlog = torch.stack([torch.where(unseen, self._last, 0), next_token], dim=1)
        self.backlog_valid = torch.stack([unseen, torch.ones_like(unseen)], dim=1)

    def keep_rows(self, rows: Tensor | None, width: int) -> None:
        """Keep only ``rows`` (``[B']`` int64, or ``None`` for all) and compact the cache."""
        self.cache.compact(rows, width)
        if rows is not None:
            self.backlog = self.backlog.index_select(0, rows)
            self.backlog_valid = self.backlog_valid.index_select(0, rows)

    def _embeddable(self, tokens: Tensor) -> Tensor:  # [B, W] -> [B, W]
        """Clamp ids to the draft's embedding rows.

        Only a target padding row the draft lacks can exceed them (see :func:`align_vocab`); the
        draft then conditions on a stand-in token, which may lower acceptance but cannot change
        the output.
        """
        if self.handle.vocab >= self.vocab:
            return tokens
        return tokens.clamp(max=self.handle.vocab - 1)
