"""Graph mode (``cuda_graphs``), plain decoding and the loop's host reads.

On the CPU, graph mode runs in *trace* mode (``emulate_on_cpu``): each stage runs eagerly on
first use (the warm-up a CUDA capture follows), is traced with ``make_fx`` on its second and
the traced graph is replayed afterwards, with the live buffers as its constants. That reproduces
what a CUDA graph replay does: the recorded ops run again on whatever the buffers hold, so a
host value baked into a stage, or data passed outside the persistent buffers, gives a wrong
result here too, and a host read inside a stage raises. The same tests run with real CUDA
graphs when a GPU is present.

Fixtures: ``test_generate_greedy.case`` (tiny random Llama / GPT-2 pairs, left-padded prompts,
an EOS id that stops about half of the rows mid-run, and ``generate()``'s greedy output).
"""

from __future__ import annotations

import contextlib
import gc
import traceback
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import specselect.hf.generate as hf_generate
from greedy_cases import MAX_NEW, NOISE, VOCAB, case, cuda_case, greedy_reference
from hf_models import EOS_ID, PAD_ID, left_padded_prompts, tiny_pair
from specselect import FixedWindowSelector, TetrisSelector, make_selector, native
from specselect.capture_contract import recording_checked
from specselect.estimators import DraftProbability
from specselect.hf import HostReads, TreeSpec, emulate_on_cpu, graphs, speculative_generate
from specselect.hf.compat import ModelHandle, check_causal, graph_obstacle
from specselect.hf.generate import (
    CPU_EAGER_READS_PER_STEP,
    DEFAULT_CACHE_SLACK,
    HOST_READS_PER_STEP,
    graph_mode,
    release_workspace,
)
from specselect.hf.graphs import StageRunner
from specselect.hf.kv import SPAN_ALIGNMENT
from specselect.hf.steps import Step
from specselect.selection import Selection, Selector

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
T = TypeVar("T")

# (selector spec, tree): selectors captured with the verify pass (fixed, paper TETRIS, the
# default TETRIS, which learns in place, DSD per window, the heuristic on its device copy of
# the windows) and run eagerly between the stages (the goodput budget plans on the host),
# chains and trees. DSD re-chooses its window every other step, and the heuristic its windows
# every step, from what observe() brings.
PAPER = {"name": "tetris", "k": 3, "extra": 2, "estimator": None, "guard": False}


class DearDraft:
    """Step times (duck-typed) under which the goodput budget's prior (acceptance 0.7) does not
    pay for a draft pass but certain acceptance would: it plans plain steps, and probes."""

    def draft_time(self, batch: int, tokens: int) -> float:
        return 0.9 * tokens

    def verify_time(self, batch: int, tokens: int) -> float:
        return 1.0


CONFIGS = {
    "fixed": ({"name": "fixed", "k": 3}, None),
    "tetris": ({"name": "tetris", "k": 3, "extra": 2}, None),
    "goodput": ({"name": "tetris", "k": 3, "extra": 2, "budget": "goodput"}, None),
    "goodput-probes": (
        {"name": "tetris", "k": 3, "extra": 2, "budget": "goodput", "cost_model": DearDraft()},
        None,
    ),
    "tetris-tree": ({"name": "tetris", "k": 3, "extra": 2}, TreeSpec(3, 2, 2)),
    # Sampling drafts the top tokens as children instead of draws (verified as point masses).
    "tetris-tree-top": (
        {"name": "tetris", "k": 3, "extra": 2},
        TreeSpec(3, 2, 2, sampled_children=False),
    ),
    "paper-tree": (PAPER, TreeSpec(3, 2, 2)),
    "dsd": ({"name": "dsd", "max_k": 4, "interval": 2}, None),
    "dsd-tree": ({"name": "dsd", "max_k": 3, "interval": 2}, TreeSpec(3, 2, 2)),
    "heuristic": ({"name": "heuristic", "k0": 2, "max_k": 4}, None),
    "heuristic-tree": ({"name": "heuristic", "k0": 1, "max_k": 3}, TreeSpec(3, 2, 2)),
    "plain": (None, None),
}


def new_selector(config: str):
    """A new selector of one of CONFIGS (``None`` for plain decoding)."""
    spec, _ = CONFIGS[config]
    return None if spec is None else make_selector(**spec)


def run(target, draft, ids, mask, config: str, eos: object, selector=None, **kwargs: object):
    """speculative_generate with one of CONFIGS (MAX_NEW tokens unless given), with a new
    selector unless given one."""
    _, tree = CONFIGS[config]
    selector = new_selector(config) if selector is None else selector
    kwargs = {"max_new_tokens": MAX_NEW, "pad_token_id": PAD_ID, **kwargs}
    return speculative_generate(
        target, draft, ids, mask, selector=selector, tree=tree, eos_token_id=eos, **kwargs
    )


def make_fx_traces_generators() -> bool:
    """Whether this torch's make_fx records ops that take a torch.Generator (2.7 does not)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    generator = torch.Generator()
    try:
        make_fx(lambda: torch.rand(1, generator=generator))()
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize(
    ("arch", "config", "rows"),
    [
        ("llama", "fixed", 3),
        ("gpt2", "tetris", 5),
        ("llama", "tetris-tree", 3),
        ("gpt2", "paper-tree", 3),
        ("gpt2", "plain", 5),
    ],
)
def test_emulated_graphs_match_generate(arch: str, config: str, rows: int) -> None:
    """Trace-mode graphs give generate()'s output with batches between buckets (3 -> 4,
    5 -> 8), rows retiring mid-run (EOS) and buckets shrinking; a second call with other
    prompts of the same shape replays the kept captures instead of making new ones."""
    target, draft, ids, mask, eos, reference = case(arch, 0)
    release_workspace(target)
    with emulate_on_cpu():
        first = run(target, draft, ids[:rows], mask[:rows], config, eos, cuda_graphs=True)
        second = run(target, draft, ids[-rows:], mask[-rows:], config, eos, cuda_graphs=True)
    release_workspace(target)
    assert first.stats.mode == "trace"
    assert torch.equal(first.sequences, reference[:rows])
    assert torch.equal(second.sequences, reference[-rows:])
    assert first.stats.captures > 0
    assert second.stats.captures < first.stats.captures
    assert min(first.stats.generated.tolist()) < MAX_NEW  # a row retired early


@pytest.mark.parametrize("config", ["plain", "fixed"])
def test_emulated_graphs_with_one_token_prompts(config: str) -> None:
    """One-token prompts leave nothing to prefill, so the caches' buffers are allocated by the
    first pass inside a stage: they must outlive it (a trace that allocated them would replay
    into fresh buffers, losing every step's keys, or those of the first steps of a second
    call, which here has other prompts)."""
    target, draft, ids, mask, _, _ = case("llama", 0)
    ids, mask = ids[:, -1:], mask[:, -1:]
    release_workspace(target)
    for rows in (slice(0, 3), slice(3, 6)):
        reference = target.generate(
            ids[rows],
            attention_mask=mask[rows],
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=[],
        )
        with emulate_on_cpu():
            out = run(
                target,
                draft,
                ids[rows],
                mask[rows],
                config,
                [],
                max_new_tokens=12,
                cuda_graphs=True,
            )
        assert torch.equal(out.sequences, reference)
    release_workspace(target)


def test_a_kept_workspace_captures_selection_per_batch_size() -> None:
    """Captured selection maps slots to the caller's rows, whose number is baked into the
    graph: a kept workspace serving a call of another batch size must not replay it. Here the
    size-2 bucket is first captured by a 2-row call and then reached by a 4-row call whose rows
    2 and 3 outlive rows 0 and 1 (EOS): a replay of the 2-row graph would index row 3 out of
    bounds (or, with other rows, select for the wrong ones). Selection must equal eager mode's.
    """
    target, draft, ids, mask, eos, reference = case("llama", 0)
    new = 24  # rows 1 and 4 stop at EOS after 9 and 6 tokens, rows 0 and 2 run to the end
    calls = ([0, 0, 0, 0], [0, 2], [1, 4, 0, 2])  # 4 equal rows never shrink to 2 slots
    release_workspace(target)
    with emulate_on_cpu():
        outs = [
            run(
                target,
                draft,
                ids[rows],
                mask[rows],
                "fixed",
                eos,
                cuda_graphs=True,
                max_new_tokens=new,
            )
            for rows in calls
        ]
    rows = calls[-1]
    eager = run(target, draft, ids[rows], mask[rows], "fixed", eos, max_new_tokens=new)
    release_workspace(target)
    for rows, out in zip(calls, outs, strict=True):
        assert torch.equal(out.sequences, reference[rows, : ids.shape[1] + new])
    assert outs[-1].stats.captures < outs[0].stats.captures  # the workspace was kept
    assert torch.equal(outs[-1].stats.verified, eager.stats.verified)


def test_an_eager_call_leaves_the_kept_workspace() -> None:
    """Eager calls keep nothing and drop nothing: graph mode's next call still replays."""
    target, draft, ids, mask, eos, reference = case("gpt2", 0)
    release_workspace(target)
    with emulate_on_cpu():
        first = run(target, draft, ids[:3], mask[:3], "plain", eos, cuda_graphs=True)
        eager = run(target, draft, ids[:3], mask[:3], "plain", eos, cuda_graphs=False)
        again = run(target, draft, ids[:3], mask[:3], "plain", eos, cuda_graphs=True)
    release_workspace(target)
    for out in (first, eager, again):
        assert torch.equal(out.sequences, reference[:3])
    assert first.stats.captures > 0 and again.stats.captures == 0


@pytest.mark.parametrize("first", ["inference", "moved"])
def test_a_kept_workspace_survives_the_callers_changes(first: str) -> None:
    """A workspace kept by a call under ``torch.inference_mode()`` serves a later call outside
    it (its buffers are ordinary tensors, updated in place); a target whose weights moved (to
    another dtype and back: new memory) gets a new workspace, whose graphs read the weights
    where they are now."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    context = torch.inference_mode() if first == "inference" else contextlib.nullcontext()
    with emulate_on_cpu():
        with context:
            before = run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
        if first == "moved":
            target.double().float()
        after = run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
        replay = run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
    release_workspace(target)
    for out in (before, after, replay):
        assert torch.equal(out.sequences, reference[:3])
    assert (after.stats.captures == before.stats.captures) == (first == "moved")
    assert replay.stats.captures == 0


@pytest.mark.skipif(
    not make_fx_traces_generators(),
    reason="this torch's make_fx cannot trace a generator argument (CPU trace mode)",
)
def test_a_new_generator_per_call_replays_the_kept_graphs() -> None:
    """The graphs draw from the workspace's own generator, which takes the caller's state and
    gives it back: a fresh seeded generator per call samples what eager mode samples, leaves
    the caller's generator where eager mode does, and replays the graphs (no new captures)."""
    target, draft, ids, mask, _, _ = case("llama", 0)

    def sample(graphs: bool) -> tuple[Any, torch.Tensor]:
        generator = torch.Generator().manual_seed(5)
        config = (target, draft, ids[:2], mask[:2], "fixed", [])
        out = run(*config, do_sample=True, generator=generator, cuda_graphs=graphs)
        return out, generator.get_state()

    eager, state = sample(False)
    release_workspace(target)
    with emulate_on_cpu():
        calls = [sample(True) for _ in range(3)]
    release_workspace(target)
    for out, after in calls:
        assert torch.equal(out.sequences, eager.sequences)
        assert torch.equal(after, state)
    assert calls[0][0].stats.captures > 0 and calls[2][0].stats.captures == 0


def test_graph_mode_aligns_the_attention_span() -> None:
    """Every graph-mode pass attends over the whole cache capacity: it is a multiple of
    SPAN_ALIGNMENT columns (memory-efficient attention copies a mask with unaligned rows), the
    least that holds the prompt, the new tokens and the slack."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    with emulate_on_cpu():
        out = run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
    capacity = hf_generate._WORKSPACES[target].state.layout.capacity
    release_workspace(target)
    assert torch.equal(out.sequences, reference[:3])
    needed = ids.shape[1] + MAX_NEW + DEFAULT_CACHE_SLACK
    assert capacity % SPAN_ALIGNMENT == 0 and needed <= capacity < needed + SPAN_ALIGNMENT


def test_greedy_trees_keep_no_draft_distributions() -> None:
    """Only sampling needs the draft's distributions (``[slots, nodes + 1, vocab]`` per tree
    shape, hundreds of MB at a real vocabulary): greedy tree steps allocate no buffer for them."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    with emulate_on_cpu():
        out = run(target, draft, ids[:3], mask[:3], "paper-tree", eos, cuda_graphs=True)
    names = hf_generate._WORKSPACES[target].state.io.names()
    release_workspace(target)
    assert torch.equal(out.sequences, reference[:3])
    assert "tree_tokens" in names and "tree_probs" not in names


def test_a_kept_workspace_does_not_keep_the_models_alive() -> None:
    """The workspace kept on the target must let both models be freed (it is dropped with the
    target), as in eager mode: it holds them weakly."""
    target, draft = tiny_pair("llama", 0, noise=NOISE["llama"])
    ids, mask = left_padded_prompts(2, 2, 6, VOCAB, 0)
    with emulate_on_cpu():
        run(target, draft, ids, mask, "fixed", [], cuda_graphs=True, max_new_tokens=4)
    models = [weakref.ref(target), weakref.ref(draft)]
    del target, draft
    gc.collect()
    assert [model() for model in models] == [None, None]


class OpaqueEstimator(DraftProbability):
    """The draft's probabilities, from an estimator that does not say it is capturable."""

    @property
    def capturable(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("config", "captured"),
    [
        ("fixed", True),
        ("paper-tree", True),
        ("tetris", True),
        ("dsd-tree", True),
        ("heuristic", True),
        ("heuristic-tree", True),
        ("goodput", True),
        ("opaque", False),
    ],
)
def test_selection_is_captured_only_for_capturable_selectors(config: str, captured: bool) -> None:
    """Graph mode replays select + update inside the verify graph when the selector has a
    capture_key (fixed, the paper's TETRIS, the default TETRIS, DSD, the heuristic, the
    goodput budget), and runs them eagerly otherwise (an estimator that is not capturable)."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    keys: list[object] = []
    runner_call = StageRunner.__call__

    def spy(self: StageRunner, key: object, stage: object, **kwargs: object) -> None:
        keys.append(key)
        runner_call(self, key, stage, **kwargs)  # type: ignore[arg-type]

    selector = None
    if config == "opaque":  # an estimator that does not declare itself capturable
        config, selector = "tetris", TetrisSelector(3, 2, estimator=OpaqueEstimator())
    with emulate_on_cpu(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(StageRunner, "__call__", spy)
        config_run = (target, draft, ids[:2], mask[:2], config, eos, selector)
        run(*config_run, cuda_graphs=True, max_new_tokens=6)
    release_workspace(target)
    names = {key[0] for key in keys}  # type: ignore[index]
    assert ("select+verify" in names) == captured
    assert ("verify" in names) == (not captured)


def learned_state(selector) -> list[torch.Tensor]:
    """What the default TETRIS has learned: its estimator's log-losses and calibration table,
    its guard's AUC."""
    estimator = selector.estimator
    table = estimator.learned.calibration.table()
    return [estimator.log_losses(), table, selector.guard.auc()]


def planned_state(selector) -> list[torch.Tensor]:
    """What the goodput budget has learned: its depth model, and its estimator's state."""
    planner = selector.planner
    model = [torch.from_numpy(planner.acceptance()), torch.from_numpy(planner.verification())]
    return model + learned_state(selector)


def heuristic_windows(selector) -> list[torch.Tensor]:
    """The heuristic's per-request windows (on the host)."""
    return [torch.tensor(selector.windows())]


@pytest.mark.parametrize(
    ("config", "state"),
    [
        ("tetris", learned_state),
        ("goodput", planned_state),
        ("goodput-probes", planned_state),
        ("heuristic", heuristic_windows),
        ("heuristic-tree", heuristic_windows),
    ],
)
def test_captured_learning_selector_learns_as_in_eager_mode(
    config: str, state: Callable[..., list[torch.Tensor]]
) -> None:
    """A selector whose captured select + update replays on state it keeps in place (the
    default TETRIS learns on the device every step; the goodput budget also plans its depth on
    the host; the heuristic's windows learn on the host and reach the graphs through its
    device copy) verifies in graph mode what it does in eager
    mode, step by step, and ends each call with the same learned state. One selector serves
    calls of 4, 2 and 4 rows in turn (each batch size keeps its own per-request state, which
    its graphs replay on; the 4-row graphs are replayed by the third call); both give
    generate()'s output."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    calls = (slice(0, 4), slice(4, 6), slice(2, 6))

    def generations(cuda_graphs: bool) -> list[tuple[object, list[torch.Tensor]]]:
        selector = new_selector(config)
        results = []
        for rows in calls:
            out = run(
                target, draft, ids[rows], mask[rows], config, eos, selector, cuda_graphs=cuda_graphs
            )
            results.append((out, state(selector)))
        return results

    release_workspace(target)
    with emulate_on_cpu():
        traced = generations(True)
    release_workspace(target)
    eager = generations(False)
    for rows, (graph_out, graph_state), (eager_out, eager_state) in zip(
        calls, traced, eager, strict=True
    ):
        assert graph_out.stats.mode == "trace"
        assert torch.equal(graph_out.sequences, eager_out.sequences)
        assert torch.equal(eager_out.sequences, reference[rows])
        assert len(graph_out.stats.verified_per_step) == len(eager_out.stats.verified_per_step)
        for graph_step, eager_step in zip(
            graph_out.stats.verified_per_step, eager_out.stats.verified_per_step, strict=True
        ):
            assert torch.equal(graph_step, eager_step)
        for graph_value, eager_value in zip(graph_state, eager_state, strict=True):
            torch.testing.assert_close(graph_value, eager_value)


def test_a_replaced_workspace_is_freed_before_the_new_one_is_allocated() -> None:
    """A call the kept workspace cannot serve (here: another sampling mode) replaces it, and
    the old caches' memory is free before the new ones are allocated."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    release_workspace(target)
    old: list[weakref.ref[torch.Tensor]] = []
    alive_at_allocation: list[int] = []
    allocate = hf_generate.GenerationState.__init__

    def spy(self: object, *args: object, **kwargs: object) -> None:
        alive_at_allocation.append(sum(ref() is not None for ref in old))
        allocate(self, *args, **kwargs)  # type: ignore[arg-type]

    with emulate_on_cpu(), pytest.MonkeyPatch.context() as patch:
        run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
        old.extend(
            weakref.ref(b) for b in hf_generate._WORKSPACES[target].state.target.kv.buffers()
        )
        patch.setattr(hf_generate.GenerationState, "__init__", spy)
        run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True, do_sample=True)
    release_workspace(target)
    assert old and alive_at_allocation == [0]


def test_a_busy_workspace_is_not_shared() -> None:
    """While a call uses the kept workspace (here: its lock held, as by another thread), a
    second call on the same target runs in a workspace of its own and leaves the kept one as
    it was."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    with emulate_on_cpu():
        run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
        kept = hf_generate._WORKSPACES[target]
        graphs = dict(kept.runner._graphs)
        with kept.lock:
            out = run(target, draft, ids[3:6], mask[3:6], "fixed", eos, cuda_graphs=True)
        assert hf_generate._WORKSPACES[target] is kept
        assert kept.runner._graphs == graphs
        assert out.stats.captures > 0  # its own workspace captured anew
        again = run(target, draft, ids[3:6], mask[3:6], "fixed", eos, cuda_graphs=True)
    release_workspace(target)
    assert torch.equal(out.sequences, reference[3:6])
    assert torch.equal(again.sequences, reference[3:6])
    assert again.stats.captures < out.stats.captures  # the kept workspace, free again


class _BrokenCaptureKey(FixedWindowSelector):
    """A selector whose capture_key raises (a user's bug)."""

    @property
    def capture_key(self) -> Hashable:
        raise RuntimeError("broken capture_key")


def test_a_call_that_fails_to_set_up_releases_the_workspace() -> None:
    """A call that raises while choosing its workspace (here: the selector's capture_key)
    leaves no workspace locked: the next call reuses the kept one instead of capturing in a
    workspace of its own every time."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    with emulate_on_cpu():
        with pytest.raises(RuntimeError, match="broken capture_key"):
            run(
                target,
                draft,
                ids[:3],
                mask[:3],
                "fixed",
                eos,
                _BrokenCaptureKey(3),
                cuda_graphs=True,
            )
        kept = hf_generate._WORKSPACES.get(target)
        assert kept is None or not kept.lock.locked()
        run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
        again = run(target, draft, ids[:3], mask[:3], "fixed", eos, cuda_graphs=True)
    release_workspace(target)
    assert torch.equal(again.sequences, reference[:3])
    assert again.stats.captures == 0  # the kept workspace's graphs, replayed


class _ReadsTheHost(FixedWindowSelector):
    """Captured with the verify pass (fixed SD's capture_key), but reads a device value in
    select (a user's bug): at every step, or at its first only."""

    def __init__(self, k: int, once: bool) -> None:
        super().__init__(k)
        self.once, self.reads = once, 0

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        if not (self.once and self.reads):
            self.reads += 1
            if bool(draft_logprobs.isnan().any()):  # a host read
                raise AssertionError("no NaN here")
        return super()._select(draft_logprobs, active)


@pytest.mark.parametrize("once", [False, True])
def test_a_host_read_in_a_captured_selector_says_what_to_do(once: bool) -> None:
    """Also when it reads only at a key's first use (CUDA captures there; trace mode traced
    a key's second use only, and missed it)."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    release_workspace(target)
    says = r"host read inside a captured stage \(aten::_local_scalar_dense\).*capture_key None"
    selector = _ReadsTheHost(3, once)
    with emulate_on_cpu(), pytest.raises(RuntimeError, match=says):
        run(target, draft, ids[:3], mask[:3], "fixed", eos, selector, cuda_graphs=True)
    release_workspace(target)


def test_a_kept_workspace_keeps_the_captures_of_the_last_selectors() -> None:
    """A new default TETRIS per call records its own select + verify graphs (they replay on
    its state); the kept workspace holds those of the last KEPT_SELECTORS selectors only, so a
    loop that makes a selector per call does not pile up graphs."""
    target, draft, ids, mask, eos, reference = case("llama", 0)
    release_workspace(target)
    tokens = []
    with emulate_on_cpu():
        for _ in range(hf_generate.KEPT_SELECTORS + 2):
            selector = make_selector("tetris", k=3, extra=2)
            tokens.append(selector.capture_token)
            out = run(target, draft, ids[:2], mask[:2], "tetris", eos, selector, cuda_graphs=True)
            assert torch.equal(out.sequences, reference[:2])
    runner = hf_generate._WORKSPACES[target].runner
    kept = {Step.captured_selector(key) for key in runner._graphs} - {None}
    release_workspace(target)
    assert {key[-1] for key in kept} == set(tokens[-hf_generate.KEPT_SELECTORS :])


def test_a_selector_used_again_is_kept_before_older_ones() -> None:
    """The kept captures are those of the selectors used most recently: a long-lived selector
    used between new ones keeps its graphs (the oldest other selector's go)."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    release_workspace(target)
    long_lived = make_selector("tetris", k=3, extra=2)
    with emulate_on_cpu(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_generate, "KEPT_SELECTORS", 2)
        for selector in (long_lived, None, long_lived, None):
            config = (target, draft, ids[:2], mask[:2], "tetris", eos, selector)
            run(*config, cuda_graphs=True, max_new_tokens=4)
    workspace = hf_generate._WORKSPACES[target]
    runner = workspace.runner
    captured = {Step.captured_selector(key) for key in [*runner._graphs, *runner._warm]}
    release_workspace(target)
    assert long_lived.capture_key in workspace.selectors
    assert long_lived.capture_key in captured


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not make_fx_traces_generators(),
                reason="this torch's make_fx cannot trace a generator argument (CPU trace mode)",
            ),
        ),
        pytest.param("cuda", marks=needs_cuda),
    ],
)
@pytest.mark.parametrize("config", ["tetris", "tetris-tree", "tetris-tree-top"])
def test_graphs_sample_like_eager_mode(device: str, config: str) -> None:
    """With the same generator seed, graph mode (CPU: trace mode) samples the same tokens as
    eager mode, chains and trees: the stages consume the generator in the same order, captured
    or not, and a replay draws fresh numbers. (Two rows: their batch sizes, 2 then 1, are
    graph buckets, so both modes draw tensors of the same shapes.) One learning selector
    serves both calls."""
    if device == "cuda":
        target, draft, ids, mask, _, _ = cuda_case(2)
    else:
        target, draft, ids, mask, _, _ = case("llama", 0)
    selector = new_selector(config)

    def sample(**kwargs: object) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(5)
        call = (target, draft, ids[:2], mask[:2], config, [], selector)
        return run(*call, do_sample=True, generator=generator, **kwargs).sequences

    with emulate_on_cpu() if device == "cpu" else contextlib.nullcontext():
        graphed = sample(cuda_graphs=True)
    release_workspace(target)
    assert torch.equal(graphed, sample(cuda_graphs=False))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize(
    ("arch", "attn", "dtype", "config"),
    [
        ("gpt2", "sdpa", torch.float32, "tetris"),
        ("llama", "eager", torch.float32, "tetris-tree"),
        ("llama", "sdpa", torch.bfloat16, "tetris"),
        ("gpt2", "eager", torch.bfloat16, "paper-tree"),
    ],
    ids=["gpt2", "eager-attention", "bf16", "gpt2-eager-bf16-tree"],
)
def test_graphs_match_eager_mode_beyond_fp32_llama(
    device: str, arch: str, attn: str, dtype: torch.dtype, config: str
) -> None:
    """Learned positions (GPT-2), additive masks (eager attention) and bfloat16, beside the
    fp32 Llama of the other tests: graph mode (CPU: trace mode) is token-identical to eager
    mode, and in fp32 to generate(). Graph mode's passes differ from eager mode's only by the
    inactive rows that pad a batch to its bucket; generate()'s have no holes and other
    widths, and in bfloat16, whose rounding depends on the shapes, its output differs here."""
    target, draft = tiny_pair(arch, 0, noise=NOISE[arch], attn_implementation=attn)
    target, draft = target.to(device, dtype), draft.to(device, dtype)
    ids, mask = (t[:3].to(device) for t in left_padded_prompts(8, 1, 12, VOCAB, 0))
    selector = new_selector(config)
    eager = run(target, draft, ids, mask, config, EOS_ID, cuda_graphs=False)
    with emulate_on_cpu() if device == "cpu" else contextlib.nullcontext():
        graphed = run(target, draft, ids, mask, config, EOS_ID, selector, cuda_graphs=True)
    release_workspace(target)
    assert graphed.stats.captures > 0
    assert torch.equal(graphed.sequences, eager.sequences)
    if dtype == torch.float32:
        assert torch.equal(eager.sequences, greedy_reference(target, ids, mask, EOS_ID))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_decoding_matches_generate(arch: str) -> None:
    """selector=None decodes one token per step with the same caches; no draft is needed."""
    target, _, ids, mask, eos, reference = case(arch, 0)
    out = run(target, None, ids, mask, "plain", eos)
    assert torch.equal(out.sequences, reference)
    totals = out.stats.totals
    assert totals.verified == 0 and totals.tokens_per_step == 1.0


def test_time_split_covers_the_whole_step() -> None:
    """The phases of a step (planning and compaction, draft, select, verify, the read-back's
    bookkeeping) are each timed and together make up the steps' time."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    stats = run(target, draft, ids, mask, "tetris", eos, max_new_tokens=12).stats
    phases = [stats.draft_seconds, stats.select_seconds, stats.verify_seconds, stats.other_seconds]
    assert min(phases) > 0
    steps = sum(step.seconds for step in stats.steps)
    assert 0.9 * steps <= sum(phases) <= steps + 0.1


#: More EOS ids than torch.isin compares one by one: it would sort and deduplicate them, which
#: on a GPU reads the unique count back (a sync). One id repeated, which these runs never
#: produce, so that the rows run to their length.
MANY_EOS = (EOS_ID,) * 32


def count_reads(max_new_tokens: int, config: str, eos: tuple[int, ...], graphs: bool):
    """(host reads, steps, drafting steps) of one generation on the CPU, eager or in trace
    mode."""
    target, draft = tiny_pair("llama", 0, noise=NOISE["llama"])
    ids, mask = left_padded_prompts(4, 2, 8, VOCAB, 0)
    with HostReads() as reads, emulate_on_cpu():
        out = run(
            target, draft, ids, mask, config, list(eos), max_new_tokens=max_new_tokens,
            cuda_graphs=graphs,
        )  # fmt: skip
    drafting = sum(depth > 0 for depth in out.stats.draft_depths)
    return reads.count, out.stats.totals.steps, drafting


def causality_check_reads() -> int:
    """Host reads of the causality check of a pair like count_reads' (a first call on a
    model runs it once; the model's own forward reads the host too)."""
    target, draft = tiny_pair("llama", 0, noise=NOISE["llama"])
    with HostReads() as reads:
        for name, model in (("target", target), ("draft", draft)):
            check_causal(name, ModelHandle.of(name, model))
    return reads.count


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize(
    ("config", "eos"),
    [(config, ()) for config in sorted(CONFIGS)]
    + [(config, MANY_EOS) for config in ("fixed", "tetris-tree", "plain")],
    ids=lambda value: f"{len(value)}-eos" if isinstance(value, tuple) else value,
)
def test_host_reads_per_step(config: str, eos: tuple[int, ...], graphs: bool) -> None:
    """Every extra step costs exactly the documented host reads (.item(), .tolist(),
    int()/bool() of a tensor, data-dependent shapes), also with many EOS ids: in graph mode
    HOST_READS_PER_STEP, the read-back, as on an accelerator; eagerly on a CPU, a drafting
    step, chain or tree, also reads its widest selection (CPU_EAGER_READS_PER_STEP; a step
    that drafts nothing, such as a run's last or a goodput budget's plain step, has none to
    read). Two runs of different lengths separate the per-step reads from the one-off setup
    reads."""
    short_reads, short_steps, short_drafting = count_reads(6, config, eos, graphs)
    long_reads, long_steps, long_drafting = count_reads(30, config, eos, graphs)
    assert long_steps > short_steps
    assert HOST_READS_PER_STEP == 1 and CPU_EAGER_READS_PER_STEP == 2
    extra = 0 if graphs else CPU_EAGER_READS_PER_STEP - HOST_READS_PER_STEP  # per drafting step

    def step_reads(steps: int, drafting: int) -> int:
        return HOST_READS_PER_STEP * steps + extra * drafting

    assert long_reads - short_reads == step_reads(long_steps, long_drafting) - step_reads(
        short_steps, short_drafting
    )
    setup = short_reads - step_reads(short_steps, short_drafting)
    probes = causality_check_reads()
    assert probes <= 2 * 3  # per model: its verdict, and what its one forward pass reads
    assert setup <= 8 + probes  # checks, lengths, and the models' first call


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize("config", ["fixed", "goodput", "tetris-tree", "plain"])
def test_each_step_launches_before_the_last_one_is_accounted(
    config: str, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a step's read-back and the next step's first launch (where a GPU waits for the
    host) the loop does not take the step's statistics: it takes them after that launch, and
    the last step's at the end, each step's exactly once and in order (the statistics equal
    those of every step)."""
    events: list[str] = []
    state_class = hf_generate.GenerationState

    def spy(owner: type, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    spy(state_class, "read_back")
    spy(state_class, "account")
    spy(StageRunner, "__call__")
    target, draft, ids, mask, eos, _ = case("llama", 0)
    with emulate_on_cpu():
        out = run(target, draft, ids, mask, config, eos, cuda_graphs=graphs)
    steps = events.count("read_back")
    assert steps == len(out.stats.steps) == len(out.stats.draft_depths) > 3
    assert events.count("account") == steps
    after_read = [events[i + 1] for i, event in enumerate(events[:-1]) if event == "read_back"]
    assert after_read == ["__call__"] * (steps - 1) + ["account"]
    accounted = [events[: i + 1].count("read_back") for i, e in enumerate(events) if e == "account"]
    assert accounted == list(range(1, steps + 1))
    assert int(out.stats.row_steps.max()) == steps


def test_cuda_graphs_errors() -> None:
    """Models on the CPU, whether or not the machine has a GPU: cuda_graphs=True is an error
    that says why, None runs eagerly."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    with pytest.raises(ValueError, match=r"cuda_graphs=True, but target is on cpu"):
        run(target, draft, ids, mask, "fixed", eos, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or None"):
        run(target, draft, ids, mask, "fixed", eos, cuda_graphs="yes")
    assert run(target, draft, ids, mask, "fixed", eos).stats.mode == "eager"


def test_plain_decoding_takes_no_tree_and_a_draft_only_with_a_selector() -> None:
    target, draft, ids, mask, _, _ = case("llama", 0)
    with pytest.raises(ValueError, match="tree mode drafts trees"):
        speculative_generate(target, draft, ids, mask, selector=None, tree=TreeSpec(2, 2, 2))
    with pytest.raises(TypeError, match="draft must be a HuggingFace causal LM"):
        speculative_generate(target, None, ids, mask, selector=make_selector("fixed", k=2))


#: Functions that make a tensor from nothing: without ``device=``, on the host.
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.eye, torch.tensor,
    torch.as_tensor, torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm,
}  # fmt: skip


class HostMadeTensors(TorchFunctionMode):
    """Records every op that mixes a tensor made on the host with the loop's tensors.

    On a CPU every tensor is on the CPU, so a tensor made without ``device=`` (``torch.arange(k)``
    in a stage) works beside the models' tensors here, and on a GPU fails ("expected all tensors
    on the same device"), in eager mode as in graph mode. Host-made: what a factory makes without
    a device, a ``.to("cpu")``, and whatever is computed from host-made tensors alone; every other
    tensor (the models', the caller's, what the loop makes with ``device=``) is the device's.
    Copies (``copy_``, ``.to(device)``) are how host data reaches the device: not mixes. 0-dim
    host tensors may join device ops, as CUDA reads them as scalars.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mixes: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hosts = [t for t in tensors if getattr(t, "_host_made", False)]
        if func in FACTORIES:
            made_here = kwargs.get("device") is None
        elif func in (torch.Tensor.cpu, torch.Tensor.cuda):
            made_here = func is torch.Tensor.cpu
        elif func is torch.Tensor.to:  # with a device ("cpu" by name: the host), or a cast
            named = [
                a for a in (*args[1:], kwargs.get("device")) if isinstance(a, str | torch.device)
            ]
            made_here = named == ["cpu"] if named else bool(hosts)
            if out is args[0] and not made_here:  # already there on a CPU; a copy on a GPU
                out = out.view_as(out)
        else:
            made_here = bool(hosts) and len(hosts) == len(tensors)
            mixed = hosts and not made_here and any(t.dim() for t in hosts)
            if mixed and func is not torch.Tensor.copy_:
                self.mixes.append(f"{getattr(func, '__name__', func)} at {_call_site()}")
        if made_here:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t._host_made = True  # type: ignore[attr-defined]
        return out


def _call_site() -> str:
    """The innermost frames of specselect's code on the stack."""
    frames = [f for f in traceback.extract_stack() if "/specselect/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3])


def test_host_made_tensors_are_found() -> None:
    """The check below finds a host-made tensor joining a device tensor, and nothing else."""
    device_tensor = torch.zeros(3)
    with HostMadeTensors() as check:
        torch.arange(3) + device_tensor  # a CPU tensor beside a GPU one, on a GPU
        torch.arange(3, device=device_tensor.device) + device_tensor
        torch.tensor(2.0) * device_tensor  # a 0-dim host tensor is a scalar
        device_tensor.copy_(torch.ones(3))  # a copy from the host
        torch.ones(3).to(device_tensor.device) * device_tensor
    assert len(check.mixes) == 1 and check.mixes[0].startswith("add")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "trace"])
@pytest.mark.parametrize(("config", "sample"), [("tetris", False), ("heuristic-tree", True)])
def test_the_loop_makes_its_tensors_on_the_device(config: str, sample: bool, graphs: bool) -> None:
    """Setup, stages and bookkeeping make every tensor they mix with the models' on the models'
    device (``device=``): what no CPU run can see otherwise, and a GPU run would fail on.
    (The fused CPU kernel of :mod:`specselect.native` is host code by design: switched off.)"""
    if sample and graphs and not make_fx_traces_generators():
        pytest.skip("this torch's make_fx cannot trace a generator argument (CPU trace mode)")
    target, draft, ids, mask, eos, _ = case("llama", 0)
    generator = torch.Generator().manual_seed(0) if sample else None
    release_workspace(target)
    with HostMadeTensors() as check, native.disabled(), emulate_on_cpu():
        run(target, draft, ids[:3], mask[:3], config, eos, max_new_tokens=8, cuda_graphs=graphs,
            do_sample=sample, generator=generator)  # fmt: skip
    release_workspace(target)
    assert check.mixes == []


# ---------------------------------------------------------------------------------- on CUDA
@needs_cuda
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_cuda_graphs_match_eager_and_generate(config: str, rows: int) -> None:
    """fp32 on a GPU: CUDA-graph mode is token-identical to eager mode and to generate(), for
    batches on and between buckets, with rows retiring mid-run; a repeated call replays, also
    with the default cuda_graphs=None, which takes graph mode on a GPU."""
    target, draft, ids, mask, eos, reference = cuda_case(rows)
    eager = run(target, draft, ids, mask, config, eos, cuda_graphs=False)
    selector = new_selector(config)  # one for both graph calls: a learning one owns its graphs
    graphed = run(target, draft, ids, mask, config, eos, selector, cuda_graphs=True)
    again = run(target, draft, ids, mask, config, eos, selector)
    release_workspace(target)
    assert graphed.stats.mode == again.stats.mode == "cuda" and graphed.stats.captures > 0
    assert torch.equal(eager.sequences, reference)
    assert torch.equal(graphed.sequences, reference)
    assert torch.equal(again.sequences, reference)
    assert again.stats.captures == 0


def implicit_syncs(call: Callable[[], T]) -> tuple[int, T]:
    """``call()``'s result, and how many synchronising CUDA operations it made as torch's sync
    debug mode reports them (``.item()``, copies to or from pageable host memory, ...)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), result


def wait_for_event() -> None:
    """The read-back's own wait (``GenerationState.read_back``), alone."""
    done = torch.cuda.Event()
    done.record()
    done.synchronize()


@needs_cuda
@pytest.mark.parametrize("config", ["fixed", "paper-tree"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_one_host_read_per_step(cuda_graphs: bool, config: str) -> None:
    """On a GPU, steps cost HOST_READS_PER_STEP reads, chains and trees, in eager and in graph
    mode (a tree step reads no selection there, unlike on a CPU), and no other synchronising
    operation (torch's sync debug mode: it also sees copies from pageable host memory, which
    no dispatcher hook does); the read-back's event wait counts as whatever that mode makes of
    it."""
    target, draft, ids, mask, _, _ = cuda_case(4)
    per_wait, _ = implicit_syncs(wait_for_event)
    call = (target, draft, ids, mask, config, [])
    counts = []
    # The first calls capture (a capture synchronises; the longer call's larger cache makes
    # the next shorter one capture again); the last two repeat earlier calls exactly (greedy)
    # and only replay, so their difference is the extra steps' reads and nothing else.
    for new in (6, 30, 6, 30, 6):
        with HostReads() as reads:
            syncs, out = implicit_syncs(
                lambda new=new: run(*call, max_new_tokens=new, cuda_graphs=cuda_graphs)
            )
        counts.append((reads.count, out.stats.totals.steps, syncs, out.stats.captures))
    release_workspace(target)
    (
        (long_reads, long_steps, long_syncs, long_new),
        (short_reads, short_steps, short_syncs, short_new),
    ) = counts[3:]
    assert short_new == long_new == 0
    steps = long_steps - short_steps
    assert long_reads - short_reads == HOST_READS_PER_STEP * steps
    assert long_syncs - short_syncs == HOST_READS_PER_STEP * steps * per_wait


def fake_handle(device: str) -> ModelHandle:
    """A model handle on a faked ``device``: graph_mode's checks need no GPU."""
    return ModelHandle(
        model=torch.nn.Linear(2, 2),
        device=torch.device(device),
        vocab=8,
        mask_kind="sdpa",
        dtype=torch.float32,
        keeps_logits=True,
        cache_arg="cache",
        num_layers=1,
    )


@pytest.mark.parametrize("fall_back", [True, False])
def test_a_failed_capture_falls_back_to_eager_mode_unless_required(fall_back: bool) -> None:
    """cuda_graphs=None: a capture that fails warns and the generation goes on eagerly (the
    stage has run for real already, once); cuda_graphs=True: the failure is an error."""
    runs: list[int] = []
    runner = StageRunner("cuda", fall_back=fall_back)

    def broken(self: StageRunner, stage: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StageRunner, "_capture_cuda", broken)
        patch.setattr(graphs, "_BROKEN", None)  # restored after: later tests may capture
        if not fall_back:
            with pytest.raises(RuntimeError, match="not permitted"):
                runner("key", lambda: runs.append(1))
        else:
            with pytest.warns(RuntimeWarning, match="continues in eager mode"):
                runner("key", lambda: runs.append(1))
            runner("key", lambda: runs.append(2))
            assert runs == [1, 2] and runner.mode == "eager" and runner.captures == 0
        assert graphs.capture_failure() == (
            "a CUDA graph capture failed earlier in this process (operation not permitted when "
            "stream is capturing)"
        )
        # A failed capture can leave torch's allocator unable to capture again: later calls
        # run eagerly, or say why not.
        handle = fake_handle("cuda:0")
        patch.setattr(hf_generate, "graph_obstacle", lambda model, name: None)
        assert graph_mode(None, handle, handle, [None]) == "eager"
        with pytest.raises(ValueError, match="a CUDA graph capture failed earlier in this process"):
            graph_mode(True, handle, handle, [None])


@pytest.mark.skipif(
    not make_fx_traces_generators(),
    reason="this torch's make_fx cannot trace a generator argument (CPU trace mode)",
)
def test_a_nan_in_a_padding_slot_is_no_error() -> None:
    """Padding and idle slots run holes through the models, whose distributions mean nothing
    (in half precision they may overflow): a NaN there aborted the call, naming "row -1"."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    original = Step._target_probs

    def flag_idle_slots(self: Step, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        probs = original(self, logits, drafts)
        size = self.state.size
        self.state.io("nan_rows", (size,), torch.bool).logical_or_(~self.state.active[:size])
        return probs

    generator = torch.Generator().manual_seed(0)
    with emulate_on_cpu(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Step, "_target_probs", flag_idle_slots)
        # 3 rows in a bucket of 4: a padding slot at every step.
        out = run(
            target, draft, ids[:3], mask[:3], "fixed", eos, do_sample=True, generator=generator
        )
    assert out.sequences.shape[0] == 3


def test_a_capture_its_check_refuses_is_parked_not_destroyed() -> None:
    """The recording check raises after the capture: the graph was dropped then, destroyed
    while the kept graphs captured on its stream lived on (which can free their workspace)."""
    runner = StageRunner("cuda", fall_back=True)
    captured = object()

    @contextlib.contextmanager
    def refusing() -> Iterator[None]:
        yield
        raise TypeError("a state tensor rebound while recorded")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StageRunner, "_capture_cuda", lambda self, stage: captured)
        with pytest.raises(TypeError, match="rebound while recorded"):
            runner("key", lambda: None, recording=refusing)
    assert runner._parked == [captured] and runner.captures == 0


def test_graph_mode_refuses_autocast() -> None:
    """Autocast's cached casts of the weights are freed when its block ends, while replays would
    read them: graph mode says so (True) or stays eager (None)."""
    handle = fake_handle("cuda:0")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_generate, "graph_obstacle", lambda model, name: None)
        assert graph_mode(None, handle, handle, [None]) == "cuda"
        patch.setattr(torch, "is_autocast_enabled", lambda *device: True)
        assert graph_mode(None, handle, handle, [None]) == "eager"
        with pytest.raises(ValueError, match=r"cuda_graphs=True, but torch\.autocast is enabled"):
            graph_mode(True, handle, handle, [None])


def test_forgotten_graphs_are_destroyed_all_at_once() -> None:
    """forget() parks graphs instead of destroying them one by one (a destroyed graph can take
    its stream's cuBLAS workspace from the graphs left): a forgotten graph stays alive until
    PARKED_GRAPHS are parked, then every graph goes at once, and a key still in use is
    captured again."""
    runner = StageRunner("trace")
    counter = torch.zeros(())

    def stage() -> None:
        counter.add_(1)

    def capture(key: int) -> None:
        for _ in range(2):  # trace mode: a warm-up, then the trace
            runner(key, stage)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs, "PARKED_GRAPHS", 2)
        for key in range(4):
            capture(key)
        captured = runner.captures
        first = weakref.ref(runner._graphs[0])
        for old in range(3):
            runner.forget(lambda key, old=old: key == old)
            gc.collect()
            assert (first() is not None) == (old == 0)  # parked, then destroyed with the rest
            runner(3, stage)  # key 3 replays while fewer than 2 graphs are parked
            assert runner.captures == captured + (old >= 1)
    assert counter.item() == 8 + 3


def test_graph_mode_needs_both_models_on_one_device() -> None:
    """A CUDA graph records one device's stream: a draft on another GPU than the target would
    run outside the capture (twice: for real, then again while capturing) and not be replayed.
    Devices are faked (no GPU needed): each model alone passes the per-model checks."""
    target, draft = fake_handle("cuda:0"), fake_handle("cuda:1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_generate, "graph_obstacle", lambda model, name: None)
        assert graph_mode(True, target, target, [None]) == "cuda"
        assert graph_mode(None, target, draft, [None]) == "eager"
        with pytest.raises(ValueError, match=r"target sits on cuda:0 and draft on cuda:1"):
            graph_mode(True, target, draft, [None])


def test_graph_obstacles_name_the_reason() -> None:
    """Why a model cannot be captured: not on a CUDA device, spread over devices, or a forward
    pass that branches on device values (dynamic RoPE)."""
    model = torch.nn.Linear(2, 2)
    assert graph_obstacle(model, "draft") == "draft is on cpu, not on a CUDA device"
    model.register_buffer("table", torch.zeros(2, device="meta"))
    assert graph_obstacle(model, "target") == (
        "target's weights are spread over several devices (cpu, meta)"
    )
    target, _ = tiny_pair("llama", 0, noise=NOISE["llama"])
    for kind in ("dynamic", "longrope"):
        target.config.rope_parameters = {"rope_type": kind, "factor": 2.0, "rope_theta": 1e4}
        assert graph_obstacle(target, "target") == (
            f"target uses {kind!r} RoPE scaling, which reads positions on the host"
        )


class Counting(FixedWindowSelector):
    """A stateful capturable selector, right (``mistake=None``: it counts its updates in a
    tensor updated in place) or wrong in one of the ways a replay cannot show."""

    def __init__(self, k: int, mistake: str | None = None) -> None:
        super().__init__(k)
        self.mistake = mistake
        self.updates = torch.zeros((), dtype=torch.int64)
        self.host_updates = 0
        self.made: torch.Tensor | None = None
        self.seen: list[int] = []
        self.big = list(range(5000))  # compared by length only: cheap to check
        self.gone = weakref.proxy(torch.nn.Linear(1, 1))  # dead: the walk must not fail on it

    @property
    def capture_key(self) -> Hashable:
        key = (self.name, self.k)
        if self.mistake == "int-token":  # an int equal to the token is not the token
            return (*key, int(self.capture_token))
        return key if self.mistake == "no-token" else (*key, self.capture_token)

    def _update(self, selection: object, num_accepted: torch.Tensor, nodes: object) -> None:
        if self.mistake == "rebound":
            self.updates = self.updates + 1
        else:
            self.updates.add_(1)
        if self.mistake == "host":
            self.host_updates += 1
        if self.mistake == "made":
            self.made = torch.zeros(())
        if self.mistake == "grows":
            self.seen.append(1)


class Composite(FixedWindowSelector):
    """A selector built on another one, keyed by the inner one's key: right under replay."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.inner = Counting(k)

    @property
    def capture_key(self) -> Hashable:
        return ("composite", self.inner.capture_key)

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        return self.inner.select(draft_logprobs, active)

    def _update(self, selection: object, num_accepted: torch.Tensor, nodes: object) -> None:
        self.inner.update(selection, num_accepted)  # type: ignore[arg-type]


def record_one_step(selector: Selector) -> None:
    """One select + update inside :func:`recording_checked`, as a loop records them."""
    draft_logprobs = torch.rand(3, 2).log()
    with recording_checked(selector):
        selection = selector.select(draft_logprobs)
        selector.update(selection, selection.lengths.clamp(max=1))


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("rebound", "Counting.updates was rebound while select/update were being recorded"),
        ("host", r"Counting.host_updates changed \(0 -> 1\) while select/update were"),
        ("made", "Counting.made was created while select/update were being recorded"),
        ("no-token", r"keeps tensors \(Counting.updates\) but its capture_key \('fixed', 2\)"),
        ("int-token", r"keeps tensors \(Counting.updates\) but its capture_key \('fixed', 2, "),
        ("grows", r"Counting.seen#len changed \(0 -> 1\) while select/update were"),
    ],
)
def test_recording_a_selector_refuses_what_a_replay_would_get_wrong(
    mistake: str, message: str
) -> None:
    """Each mistake keeps greedy output identical and makes the statistics wrong under replay,
    so it must be refused while recording; the right selector, and host state made on first
    use (None -> a value), pass."""
    record_one_step(Counting(2))
    record_one_step(Composite(2))  # the inner selector's per-call attributes are its own
    right = Counting(2)
    right.host_updates = None  # type: ignore[assignment]
    with recording_checked(right):
        right.host_updates = 3  # type: ignore[assignment]
    with pytest.raises(TypeError, match=message):
        record_one_step(Counting(2, mistake))


@pytest.mark.parametrize("mistake", [None, "rebound"])
def test_graph_mode_refuses_a_selector_that_rebinds_its_state(mistake: str | None) -> None:
    """Through speculative_generate (trace mode): the right selector counts every step as in
    eager mode, and the wrong one is refused at its first recording, naming the attribute."""
    target, draft, ids, mask, eos, _ = case("llama", 0)
    arguments = (target, draft, ids[:2], mask[:2], "fixed", eos)
    eager = Counting(2, mistake)
    run(*arguments, eager, cuda_graphs=False, max_new_tokens=12)
    assert int(eager.updates) > 2
    with emulate_on_cpu():
        selector = Counting(2, mistake)
        try:
            if mistake is None:
                out = run(*arguments, selector, cuda_graphs=True, max_new_tokens=12)
                assert out.stats.mode == "trace" and out.stats.captures > 0
                assert int(selector.updates) == int(eager.updates)
            else:
                with pytest.raises(TypeError, match=r"Counting\.updates was rebound"):
                    run(*arguments, selector, cuda_graphs=True, max_new_tokens=12)
        finally:
            release_workspace(target)
