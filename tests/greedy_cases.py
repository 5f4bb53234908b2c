"""Greedy generation cases shared by the greedy, tree and graph-mode tests: tiny random pairs
(tests/hf_models.py), left-padded prompts, an EOS id the target really produces, and
``generate()``'s greedy output to compare with."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import pytest
import torch

from hf_models import PAD_ID, left_padded_prompts, tiny_pair
from specselect.hf.kv import ModelCache

NOISE = {"llama": 0.02, "gpt2": 0.04}
SEEDS = (0, 1)
BATCH, MIN_PROMPT, MAX_PROMPT, VOCAB = 8, 1, 12, 128
MAX_NEW = 40


@functools.cache
def case(arch: str, seed: int):
    """Models, prompts, an EOS id the target really produces, and generate()'s greedy output.

    The EOS id is chosen from the target's greedy continuations so that about half of the rows
    stop early (often on an accepted draft token) and the others run to ``MAX_NEW``.
    """
    target, draft = tiny_pair(arch, seed, noise=NOISE[arch])
    ids, mask = left_padded_prompts(BATCH, MIN_PROMPT, MAX_PROMPT, VOCAB, seed)
    free = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[]
    )
    eos = pick_eos(free[:, MAX_PROMPT:])
    return target, draft, ids, mask, eos, greedy_reference(target, ids, mask, eos)


def cuda_case(rows: int):
    """``case("llama", 0)`` on the GPU, its prompts tiled to ``rows`` rows, with generate()'s
    greedy output computed there (its EOS stops about half of the rows mid-run)."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    target, draft = (copy.deepcopy(m).cuda() for m in (target, draft))
    tiles = -(-rows // ids.shape[0])
    ids, mask = (t.repeat(tiles, 1)[:rows].cuda() for t in (ids, mask))
    return target, draft, ids, mask, eos, greedy_reference(target, ids, mask, eos)


def greedy_reference(target, ids: torch.Tensor, mask: torch.Tensor, eos: object) -> torch.Tensor:
    """``generate()``'s greedy output, ``MAX_NEW`` tokens, the tiny models' pad id."""
    return target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
    )


def pick_eos(continuations: torch.Tensor) -> int:  # [B, MAX_NEW]
    """The token whose first occurrence falls mid-continuation in closest to half of the rows."""
    best, best_score = 0, None
    for token in range(3, VOCAB):
        hits = continuations == token
        first = torch.where(hits.any(dim=1), hits.to(torch.int64).argmax(dim=1), MAX_NEW)
        stopped = int(((first >= 3) & (first < MAX_NEW - 5)).sum())
        early = int((first < 3).sum())
        score = (early, abs(stopped - BATCH // 2))
        if best_score is None or score < best_score:
            best, best_score = token, score
    return best


def row_endings(stats, eos: int, sequences: torch.Tensor, prompt: int) -> list[str]:
    """How each row ended: inside an accepted run at EOS or at max_new_tokens, or otherwise."""
    endings = []
    for row in range(sequences.shape[0]):
        first = int(stats.first_step[row])
        last = first + int(stats.row_steps[row]) - 1
        start = sum(int(stats.accepted_per_step[t][row]) + 1 for t in range(first, last))
        accepted = int(stats.accepted_per_step[last][row])
        new = sequences[row, prompt:].tolist()
        eos_at = new.index(eos) if eos in new else None
        if eos_at is not None and start <= eos_at < start + accepted:
            endings.append("eos_accepted")
        elif eos_at is None and accepted >= 1 and start + accepted + 1 == MAX_NEW:
            endings.append("max_new_in_run")
        else:
            endings.append("other")
    return endings


def assert_covers_both_endings(outputs) -> None:
    """Across ``outputs`` (``(output, eos)`` pairs) some row ended inside an accepted run at EOS
    and some at ``MAX_NEW``: the endings the identity must survive really happened. Checked over
    all cases at once, since which single case produces them depends on the random weights (and
    so on the transformers version)."""
    seen: set[str] = set()
    for out, eos in outputs:
        seen.update(row_endings(out.stats, eos, out.sequences, MAX_PROMPT))
    assert {"eos_accepted", "max_new_in_run"} <= seen, seen


@contextlib.contextmanager
def verify_pass_widths(target) -> Iterator[list[int]]:
    """The width of every pass ``target`` verifies with inside the block (its prefill, which
    computes last logits only, excluded): a spy on the loop's cache."""
    widths: list[int] = []
    forward = ModelCache.forward
    embedding = target.get_input_embeddings().weight  # (a draft may share target's config)

    def spy(self: ModelCache, input_ids: torch.Tensor, *args: object, **kwargs: object):
        # (The cache holds a weak proxy of the model: compare what it delegates to.)
        if self.handle.model.get_input_embeddings().weight is embedding and not kwargs.get(
            "last_only"
        ):
            widths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelCache, "forward", spy)
        yield widths
