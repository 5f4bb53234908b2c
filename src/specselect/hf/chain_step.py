"""One chain step: draft a chain per row, select a prefix, verify it flat, keep what is accepted.

Steps 1 to 6 of :mod:`specselect.hf.generate` for ``tree=None``. :class:`ChainSteps` adds the
chain-specific part of a step to :class:`~specselect.hf.step_state.StepState`: the draft length,
the selector's scores (:func:`_selection_scores`) with unemittable positions masked, the one
flat target pass over ``[pending token, selected drafts]``, greedy or rejection verification and
both caches' chain bookkeeping (the target keeps the accepted prefix, the draft advances by it).
Emission, the read-back, statistics, retiring and compaction are the shared ones of
:class:`~specselect.hf.step_state.StepState`. Host sync here: the verify width in
:meth:`ChainSteps._step`.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from specselect._checks import check_int
from specselect.hf.cache import forward_block
from specselect.hf.draft import DraftChain
from specselect.hf.step_state import StepState
from specselect.scores import causal_logprobs, expected_self_logprob
from specselect.selection import NEG_INF, available_lengths, prefix_mask
from specselect.verify import greedy_verify, rejection_verify


class ChainSteps(StepState):
    """Chain steps (flat verification) on top of the shared generation state."""

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

    def _mask_unemittable(self, chain: DraftChain, logprobs: Tensor) -> Tensor:  # -> [B_a, k]
        """``-inf`` for draft positions that could not be emitted (step 2 of
        :mod:`specselect.hf.generate`)."""
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


def _selection_scores(chain: DraftChain) -> Tensor:  # -> [B_a, k]
    """What the selector sees: draft log-probs, made causal when the tokens were sampled.

    A selector that judged a *sampled* token by its own probability would bias speculative
    sampling (:mod:`specselect.scores`); greedy drafts are functions of their prefix and may be
    judged by their own probability.
    """
    if chain.probs is None:
        return chain.logprobs
    return causal_logprobs(chain.logprobs, expected_self_logprob(chain.probs))


__all__ = ["ChainSteps"]
