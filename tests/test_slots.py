"""Continuous batching: ``speculative_generate(..., slots=N)`` generates at most ``N`` rows at
once, and a waiting row takes the first slot a finished row frees.

A row admitted mid-run is prefilled on a cache of its own and copied into its slot beside rows
that are many steps in (:meth:`~specselect.hf.kv.ModelCache.admit`); its output must still be
``generate()``'s, greedy, and follow the target's distribution, sampling. Eager mode and graph
mode (trace mode on the CPU: buckets, static buffers, the same captured stages).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from greedy_cases import BATCH, MAX_NEW, NOISE, case, cuda_case
from hf_models import PAD_ID, tiny_pair
from sampling_cases import MAX_NEW as SAMPLED_NEW
from sampling_cases import assert_follows_target, interleaved_prompts, sampling_pair
from specselect import FixedWindowSelector, make_selector
from specselect.hf import (
    HostReads,
    TreeSpec,
    emulate_on_cpu,
    release_workspace,
    speculative_generate,
)
from specselect.hf.generate import HOST_READS_PER_STEP
from specselect.hf.state import PerStep
from specselect.selection import Outcomes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIGS = {
    "fixed": ({"name": "fixed", "k": 3}, None),
    "tetris": ({"name": "tetris", "k": 3, "extra": 2}, None),
    "tetris-tree": ({"name": "tetris", "k": 3, "extra": 2}, TreeSpec(3, 2, 2)),
    "plain": (None, None),
}


def generate(config: str, slots: int | None, graphs: bool, arch: str = "llama", **kwargs):
    """One greedy call on the shared greedy case (8 rows, EOS ends about half of them early)."""
    target, draft, ids, mask, eos, _ = case(arch, 0)
    with emulate_on_cpu():
        return run((target, draft, ids, mask, eos), config, slots, graphs, **kwargs)


def run(inputs: tuple, config: str, slots: int | None, graphs: bool, **kwargs):
    """speculative_generate of ``(target, draft, ids, mask, eos)`` with one of CONFIGS."""
    spec, tree = CONFIGS[config]
    target, draft, ids, mask, eos = inputs
    return speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=None if spec is None else make_selector(**spec),
        tree=tree,
        max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW),
        eos_token_id=eos,
        pad_token_id=PAD_ID,
        cuda_graphs=graphs,
        slots=slots,
        **kwargs,
    )


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rows_admitted_mid_run_equal_generate(
    arch: str, config: str, slots: int, graphs: bool
) -> None:
    """Every row equals generate()'s, whether it started with the first ones or took a slot a
    finished row freed; never more than ``slots`` rows run at once, and the call takes more
    steps than a batch running every row at once (rows wait)."""
    out = generate(config, slots, graphs, arch)
    _, _, _, _, _, reference = case(arch, 0)
    assert torch.equal(out.sequences, reference)
    stats = out.stats
    assert max(step.active for step in stats.steps) == slots
    assert len(stats.steps) > len(generate(config, None, graphs, arch).stats.steps)
    # Each row is active in the steps first_step .. first_step + row_steps - 1, and only then.
    first, last = stats.first_step, stats.first_step + stats.row_steps  # [B] each
    assert first[:slots].eq(0).all() and first[slots:].gt(0).all()
    for t, (step, verified) in enumerate(zip(stats.steps, stats.verified_per_step, strict=True)):
        active = (first <= t) & (t < last)  # [B]
        assert step.active == int(active.sum())
        assert verified[~active].eq(0).all() and int(verified.sum()) == step.verified


@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_cuda_rows_admitted_mid_run_equal_generate(config: str, graphs: bool) -> None:
    """fp32 on a GPU: a row's prefill on a cache of its own and its copy into a freed slot,
    between eager steps or replayed stages, give generate()'s output."""
    target, draft, ids, mask, eos, reference = cuda_case(BATCH)
    out = run((target, draft, ids, mask, eos), config, 3, graphs)
    release_workspace(target)
    assert out.stats.mode == ("cuda" if graphs else "eager")
    assert torch.equal(out.sequences, reference)
    assert max(step.active for step in out.stats.steps) == 3


class LateDrafter(FixedWindowSelector):
    """Fixed SD that drafts nothing for its first steps (as DSD or the goodput budget may when
    drafting does not pay): the draft model runs no pass until then."""

    def __init__(self, idle: int) -> None:
        super().__init__(k=3)
        self.idle = idle

    def draft_length(self, num_active: int) -> int:
        self.idle -= 1
        return 0 if self.idle >= 0 else super().draft_length(num_active)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
def test_a_row_admitted_before_the_draft_ever_ran(graphs: bool) -> None:
    """The first rows' one-token prompts give the draft nothing to prefill, and no step drafts
    at first: the draft's cache is unwritten when the third row, with a longer prompt, takes the
    second row's slot (the second row stops at EOS after two tokens). Its prefill is copied into
    a cache allocated then; the output is generate()'s."""
    target, draft = tiny_pair("llama", 0, noise=NOISE["llama"])
    ids = torch.tensor([[0, 0, 0, 0, 5], [0, 0, 0, 0, 7], [9, 10, 11, 12, 13]])
    mask = (ids != PAD_ID).to(torch.int64)
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "pad_token_id": PAD_ID}
    free = target.generate(ids, do_sample=False, eos_token_id=[], **kwargs)
    eos = int(free[1, ids.shape[1] + 1])  # the second row's second token
    reference = target.generate(ids, do_sample=False, eos_token_id=eos, **kwargs)
    assert (reference[1, ids.shape[1] + 2 :] == PAD_ID).all()  # it does stop early
    with emulate_on_cpu():
        out = speculative_generate(
            target,
            draft,
            ids,
            selector=LateDrafter(idle=4),
            eos_token_id=eos,
            cuda_graphs=graphs,
            slots=2,
            **kwargs,
        )
    assert out.stats.draft_depths[:3] == [0, 0, 0]
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
def test_slots_keep_one_host_read_per_step(graphs: bool) -> None:
    """Admissions read nothing back: every row's prompt length is read once, at the start. Two
    calls of different lengths separate the per-step reads from the setup reads (eagerly on a
    CPU a chain step also reads its widest selection, which plain decoding does not have). Both
    replay every stage: a capture would add reads of its own."""
    for warm_up in (30, 6, 30, 6):  # every stage shape either call runs is captured
        generate("plain", 3, graphs, max_new_tokens=warm_up)

    def reads(max_new_tokens: int) -> tuple[int, int]:
        with HostReads() as counted:
            out = generate("plain", 3, graphs, max_new_tokens=max_new_tokens)
        assert out.stats.captures == 0
        return counted.count, len(out.stats.steps)

    short_reads, short_steps = reads(6)
    long_reads, long_steps = reads(30)
    assert long_steps > short_steps
    assert long_reads - short_reads == HOST_READS_PER_STEP * (long_steps - short_steps)


class ObservedDrain(FixedWindowSelector):
    """Fixed SD recording, per observe() call, each active row's accepted tokens and tokens
    left, and whether rows wait for a slot."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.calls: list[tuple[dict[int, tuple[int, int]], bool | None]] = []

    def _observe(self, outcomes: Outcomes) -> None:
        assert outcomes.active is not None and outcomes.remaining is not None
        rows = [row for row, flag in enumerate(outcomes.active) if flag]
        left = zip(outcomes.accepted, outcomes.remaining, strict=True)
        self.calls.append((dict(zip(rows, left, strict=True)), outcomes.waiting))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("tree", [None, TreeSpec(3, 2, 2)], ids=["chain", "tree"])
def test_observe_says_what_each_row_has_left_and_whether_rows_wait(
    tree: TreeSpec | None, slots: int | None, graphs: bool
) -> None:
    """What the goodput budget's drain rule reads: each row's tokens left shrink by what it
    emitted (accepted + 1) until the step that finishes it (by EOS or ``max_new_tokens``)
    reports 0; rows wait for a slot exactly while some row has not started."""
    spy = ObservedDrain(3)
    target, draft, ids, mask, eos, reference = case("llama", 0)
    with emulate_on_cpu():
        out = speculative_generate(
            target,
            draft,
            ids,
            mask,
            selector=spy,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            pad_token_id=PAD_ID,
            cuda_graphs=graphs,
            slots=slots,
            tree=tree,
        )
    assert torch.equal(out.sequences, reference)
    first_step = out.stats.first_step.tolist()
    assert [waiting for _, waiting in spy.calls] == [
        any(start > step for start in first_step) for step in range(len(spy.calls))
    ]
    for row in range(BATCH):
        seen = [call[row] for call, _ in spy.calls if row in call]
        left = [MAX_NEW] + [remaining for _, remaining in seen]
        assert left[-1] == 0 and min(left[:-1]) > 0  # reported until its last step
        emitted = [accepted + 1 for accepted, _ in seen[:-1]]
        assert [a - b for a, b in itertools.pairwise(left[:-1])] == emitted


def test_sampled_rows_admitted_mid_run_follow_the_target() -> None:
    """Sampling stays lossless for rows that take a freed slot: 5,000 rows through 700 slots
    (rows finish after different numbers of steps, so they are admitted into scattered slots),
    chi-square against the exact target distribution (tests/_stats.py's level)."""
    target, draft = sampling_pair()
    ids, mask = interleaved_prompts(2500)
    config = {"temperature": 1.0}
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        selector=make_selector("tetris", k=1, extra=1),
        max_new_tokens=SAMPLED_NEW,
        do_sample=True,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(1234),
        slots=700,
        **config,
    )
    assert max(step.active for step in out.stats.steps) == 700
    assert_follows_target(target, out.sequences[:, ids.shape[1] :], config)


@pytest.mark.parametrize(
    ("slots", "error", "match"),
    [
        (0, ValueError, "slots must be >= 1, got 0"),
        (2.5, TypeError, "slots must be an int, got float"),
        (True, TypeError, "slots must be an int, got bool"),
    ],
)
def test_bad_slots_are_refused(slots: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        generate("fixed", slots, False)  # type: ignore[arg-type]


def test_more_slots_than_rows_is_every_row_at_once() -> None:
    more, every = generate("fixed", BATCH + 5, False), generate("fixed", None, False)
    assert torch.equal(more.sequences, every.sequences)
    assert [s.active for s in more.stats.steps] == [s.active for s in every.stats.steps]


def test_per_step_counts_are_dense_when_read() -> None:
    """Per-step counts keep the active rows' entries only (a long queue through a few slots runs
    many steps) and read as dense [B] tensors, 0 for the rows not listed."""
    per_step = PerStep(4)
    per_step.append([2, 0], [5, 1])
    per_step.append([], [])
    assert len(per_step) == 2
    assert per_step[0].tolist() == [1, 0, 5, 0] and per_step[-1].tolist() == [0, 0, 0, 0]
    assert [counts.tolist() for counts in per_step[:1]] == [[1, 0, 5, 0]]
    assert [counts.tolist() for counts in per_step] == [[1, 0, 5, 0], [0, 0, 0, 0]]
    assert per_step.stacked().tolist() == [[1, 0, 5, 0], [0, 0, 0, 0]]
    assert torch.equal(per_step.stacked(), torch.stack(list(per_step)))
    with pytest.raises(ValueError, match="rows and counts must pair up, got 1 and 2"):
        per_step.append([0], [1, 2])
