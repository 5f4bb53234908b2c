"""The contract every registered selector keeps, and the no-host-sync checks.

Parametrized over ``specselect.selectors.SELECTORS`` itself: a selector registered without an
entry in ``SELECTOR_KWARGS`` fails here, so no new selector skips the contract.

No host sync is checked three ways: ``torch.compile(..., fullgraph=True)`` (a data-dependent
read of a tensor is a graph break, which fullgraph turns into an error); running on the ``meta``
device (which has no data to read back); and, when CUDA is present, CUDA's sync debug mode.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import pickle
import threading

import pytest
import torch

from conftest import OneDevicePerOp, random_logprobs
from specselect import _checks, make_selector, set_device_value_checks
from specselect._checks import trusted_values
from specselect.estimators import AcceptanceEstimator
from specselect.selection import (
    CaptureToken,
    Selection,
    Selector,
    prefix_mask,
    window_selection,
    window_tree_selection,
)
from specselect.selectors import SELECTORS
from specselect.tree import available_nodes, chain_parents

# Small, valid constructor arguments for every registered selector.
SELECTOR_KWARGS: dict[str, dict[str, object]] = {
    "tetris": {"k": 2, "extra": 2},
    "fixed": {"k": 3},
    "dsd": {"max_k": 4},
    "threshold": {"max_k": 4, "threshold": 0.3},
    "heuristic": {"k0": 2, "max_k": 5},
}
NAMES = sorted(SELECTORS)
# Configurations that run other code than their selector's defaults, held to the same contract:
# name -> (registered selector, constructor arguments).
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "tetris-goodput": ("tetris", {"k": 2, "extra": 2, "budget": "goodput"}),
}
CONFIGS = NAMES + sorted(VARIANTS)
BATCH = 5
# Constructor parameters that must be >= 0 (or >= 1) and those that are probabilities.
NON_NEGATIVE_PARAMS = ("k", "extra", "budget", "max_k", "k0", "interval", "context")
PROBABILITY_PARAMS = ("threshold", "alpha0")
ACTIVE = torch.tensor([True, False, True, True, False])


def make(name: str) -> Selector:
    """A fresh selector built from the tables (fails for a selector missing from them)."""
    if name in VARIANTS:
        base, kwargs = VARIANTS[name]
        return SELECTORS[base](**kwargs)
    if name not in SELECTOR_KWARGS:
        pytest.fail(f"selector {name!r} is registered but has no entry in SELECTOR_KWARGS")
    return SELECTORS[name](**SELECTOR_KWARGS[name])


def drafted(selector: Selector, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """``[BATCH, K]`` float32 log-probs for the selector's window, with some ``-inf`` cuts.

    Row 0 is cut after its first token and then continues with certain (log q = 0) tokens, which
    a selector must still not take.
    """
    width = max(selector.draft_length(BATCH), 3)
    logprobs = random_logprobs(BATCH, width, seed=seed, cut=0.15)
    logprobs[0] = 0.0
    logprobs[0, 1] = -math.inf
    logprobs[3] = -math.inf
    return logprobs.to(device)


def accepted_for(selection: Selection, seed: int) -> torch.Tensor:
    """``[B]`` int64 accepted counts between 0 and the selected lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = selection.lengths.cpu()
    fraction = torch.rand(lengths.shape, generator=gen, dtype=torch.float64)
    return (lengths * fraction).floor().to(torch.int64).to(selection.lengths.device)


def num_active(active: torch.Tensor | None) -> int:
    return BATCH if active is None else int(active.sum())


def observe(
    selector: Selector,
    selection: Selection,
    accepted: torch.Tensor,
    active: torch.Tensor | None,
    tree: bool = False,
) -> None:
    """``observe`` as a loop calls it: the active rows' counts as host ints, and which rows
    they are (for a chain-shaped tree, the deepest verified depth is the verified count)."""
    rows = [True] * BATCH if active is None else active.tolist()
    verified = [v for v, row in zip(selection.lengths.tolist(), rows, strict=True) if row]
    passed = [a for a, row in zip(accepted.tolist(), rows, strict=True) if row]
    selector.observe(verified, passed, deepest=verified if tree else None, active=rows)


def test_every_registered_selector_has_kwargs() -> None:
    missing = sorted(set(SELECTORS) - set(SELECTOR_KWARGS))
    assert not missing, f"add constructor arguments for {missing} to SELECTOR_KWARGS"


# --------------------------------------------------------------------------------------------
# The contract


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("with_active", [False, True])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_contract(name: str, with_active: bool, dtype: torch.dtype, check_prefix_selection) -> None:
    """Valid prefix selections over a few steps with feedback in between, from log-probs of
    any floating dtype (the learned estimators keep float32 state)."""
    selector = make(name)
    active = ACTIVE if with_active else None
    for step in range(3):
        logprobs = drafted(selector, seed=step).to(dtype)
        bound = selector.max_selected(logprobs.shape[1], num_active(active))
        selection = selector.select(logprobs, active)
        check_prefix_selection(selection, logprobs)
        assert int(selection.lengths.max()) <= bound, "max_selected() is no bound"
        assert int(selection.lengths[0]) <= 1, "took a token after a -inf"
        assert int(selection.lengths[3]) == 0, "took a -inf token"
        if active is not None:
            assert not bool(selection.mask[~active].any()), "selected an inactive row"
        selector.update(selection, accepted_for(selection, step))
    selector.reset()


@pytest.mark.parametrize("name", CONFIGS)
def test_bad_logprobs_raise(name: str) -> None:
    selector = make(name)
    good = drafted(selector, seed=0)
    cases: list[tuple[object, type[Exception]]] = [
        (good[0], ValueError),  # rank 1
        (good.unsqueeze(0), ValueError),  # rank 3
        (torch.zeros(BATCH, 3, dtype=torch.int64), TypeError),
        (good.tolist(), TypeError),
    ]
    for bad_value in (math.nan, math.inf, 0.5):
        bad = good.clone()
        bad[1, 0] = bad_value
        cases.append((bad, ValueError))
    for value, error in cases:
        with pytest.raises(error, match="draft_logprobs"):
            selector.select(value)  # type: ignore[arg-type]


def test_a_threads_trusted_block_leaves_other_threads_checks_on() -> None:
    """``trusted_values`` (a loop skipping checks of its own tensors) holds in its thread only:
    two threads entering and leaving in crossed order must not leave checks off for anyone
    (a process-wide flag restored out of order did)."""
    entered, left = threading.Barrier(2), threading.Barrier(2)
    first_out = threading.Event()

    def loop(leaves_first: bool) -> None:
        with trusted_values():
            entered.wait()
            if not leaves_first:
                first_out.wait()
        if leaves_first:
            first_out.set()
        left.wait()

    threads = [threading.Thread(target=loop, args=(first,)) for first in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bad = torch.tensor([[math.nan, -0.5]])
    with pytest.raises(ValueError, match="draft_logprobs"):
        SELECTORS["fixed"](k=2).select(bad)
    with trusted_values():  # and the block still skips them in its own thread
        SELECTORS["fixed"](k=2).select(bad)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    ("active", "error"),
    [
        (torch.ones(BATCH + 1, dtype=torch.bool), ValueError),
        (torch.ones(BATCH, 1, dtype=torch.bool), ValueError),
        (torch.ones(BATCH, dtype=torch.int64), TypeError),
        ([True] * BATCH, TypeError),
    ],
    ids=["long", "rank2", "int64", "list"],
)
def test_bad_active_raises(name: str, active: object, error: type[Exception]) -> None:
    selector = make(name)
    with pytest.raises(error, match="active"):
        selector.select(drafted(selector, seed=0), active)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    ("width", "num_active", "param", "error"),
    [(-1, 2, "width", ValueError), (4, -1, "num_active", ValueError), (4.0, 2, "width", TypeError)],
    ids=["width", "num_active", "float"],
)
def test_bad_plan_arguments_raise(
    name: str, width: object, num_active: object, param: str, error: type[Exception]
) -> None:
    """The host-side planning calls name the argument they reject."""
    selector = make(name)
    with pytest.raises(error, match=param):
        selector.max_selected(width, num_active)  # type: ignore[arg-type]
    if param == "num_active":
        with pytest.raises(error, match=param):
            selector.draft_length(num_active)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    ("accepted", "error"),
    [
        (torch.zeros(BATCH + 1, dtype=torch.int64), ValueError),
        (torch.zeros(BATCH, dtype=torch.float32), TypeError),
        (torch.full((BATCH,), -1, dtype=torch.int64), ValueError),
    ],
    ids=["batch", "float", "negative"],
)
def test_bad_feedback_raises(name: str, accepted: torch.Tensor, error: type[Exception]) -> None:
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    with pytest.raises(error, match="num_accepted"):
        selector.update(selection, accepted)


@pytest.mark.parametrize("name", CONFIGS)
def test_update_rejects_more_accepted_than_selected(name: str) -> None:
    """An over-count is an error where values are readable (CPU), not "all accepted" or an
    acceptance estimate above 1; the state is left as it was."""
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    too_many = selection.lengths.clone()
    too_many[2] += 1
    with pytest.raises(ValueError, match=r"num_accepted must be <= selection.lengths.*\[2\]"):
        selector.update(selection, too_many)
    selector.update(selection, selection.lengths)  # everything accepted is fine


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    "rows", [[True, False], torch.tensor([1, 0]), torch.ones(2, 2, dtype=torch.bool)]
)
def test_reset_rows_checks_its_mask(name: str, rows: object) -> None:
    selector = make(name)
    selector.select(drafted(selector, seed=0))
    with pytest.raises((TypeError, ValueError), match="rows"):
        selector.reset_rows(rows)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["tetris", "tetris+history", "tetris+calibrated"])
def test_request_ids_of_a_new_batch_size_keep_what_was_learned(spec: str) -> None:
    """Ids of another number of slots start a new batch: every slot's per-request state is
    new, but what was learned across requests stays, as when no ids are passed (a full reset
    wiped it)."""
    logprobs = random_logprobs(4, 3, seed=0)

    def trained(ids: bool) -> Selector:
        selector = make_selector(spec, k=2)
        for _ in range(30):
            request_ids = torch.arange(4) if ids else None
            selection = selector.select(logprobs, request_ids=request_ids)
            selector.update(selection, selection.lengths)  # everything accepted
        return selector

    probe = random_logprobs(6, 3, seed=1)
    with_ids, without_ids, fresh = trained(True), trained(False), make_selector(spec, k=2)
    with_ids.select(probe, request_ids=torch.arange(6))
    without_ids.select(probe)
    fresh.select(probe)
    assert torch.equal(with_ids.last_scores, without_ids.last_scores)
    assert not torch.allclose(with_ids.last_scores, fresh.last_scores)


class PerRowBonus(AcceptanceEstimator):
    """A third-party estimator with per-row state that knows nothing of reset_requests."""

    def __init__(self) -> None:
        self.bonus: torch.Tensor | None = None  # [B]

    def estimate(
        self,
        draft_logprobs: torch.Tensor,
        positions: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.bonus is None:
            self.bonus = torch.zeros(draft_logprobs.shape[0])
        return draft_logprobs + self.bonus.unsqueeze(1)

    def _learn(
        self,
        draft_logprobs: torch.Tensor,
        tested: torch.Tensor,
        passed: torch.Tensor,
        positions: torch.Tensor | None,
        features: torch.Tensor | None,
    ) -> None:
        assert self.bonus is not None
        self.bonus -= 0.01

    def reset(self) -> None:
        self.bonus = None


def test_request_ids_of_a_new_batch_size_reset_an_estimator_without_reset_requests() -> None:
    """By default reset_requests forgets everything: safe for per-row state it cannot see."""
    selector = SELECTORS["tetris"](2, 1, estimator=PerRowBonus(), guard=False)
    selection = selector.select(random_logprobs(4, 3, seed=0), request_ids=torch.arange(4))
    selector.update(selection, selection.lengths)
    selection = selector.select(random_logprobs(6, 3, seed=1), request_ids=torch.arange(4, 10))
    assert selection.lengths.shape == (6,)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("mode", ["autograd", "inference mode"])
def test_state_outlives_the_callers_autograd_and_inference_mode(name: str, mode: str) -> None:
    """Draft log-probs that require grad, or steps under the caller's inference mode, leave
    state that later steps and reset() update in place outside either: the learned estimators'
    state joined the autograd graph (every later select failed), or was an inference tensor
    (reset() outside inference mode failed)."""
    selector = make(name)
    context = torch.inference_mode() if mode == "inference mode" else contextlib.nullcontext()
    with context:
        for step in range(3):
            logprobs = drafted(selector, seed=step).requires_grad_(mode == "autograd")
            selection = selector.select(logprobs, ACTIVE)
            accepted = accepted_for(selection, step)
            selector.update(selection, accepted)
            observe(selector, selection, accepted, ACTIVE)
    selector.reset()
    for step in range(2):
        selection = selector.select(drafted(selector, seed=step))
        assert not selection.mask.requires_grad
        selector.update(selection, accepted_for(selection, step))


@pytest.mark.parametrize("name", CONFIGS)
def test_strided_draft_logprobs_select_as_contiguous_ones(name: str) -> None:
    """A column-major draft (a transposed ``[K, B]`` buffer) selects and learns as its
    contiguous copy does (the ranking guard flattened it with view(), and failed)."""
    strided, contiguous = make(name), make(name)
    for step in range(3):
        logprobs = drafted(contiguous, seed=step)
        column_major = logprobs.t().contiguous().t()
        assert not column_major.is_contiguous()
        mine, theirs = strided.select(column_major), contiguous.select(logprobs)
        assert torch.equal(mine.mask, theirs.mask) and mine.mask.is_contiguous()
        accepted = accepted_for(theirs, step)
        strided.update(mine, accepted)
        contiguous.update(theirs, accepted)


def test_a_float64_tree_selection_is_contiguous_and_learns() -> None:
    """The float64 top-C mask came back transposed, and the guard's update failed on it."""
    selector = make_selector("tetris", k=2)
    logprobs = torch.tensor([[-0.1, -0.2, -0.3], [-0.5, -0.1, -0.2]], dtype=torch.float64)
    selection = selector.select(logprobs, parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]]))
    assert selection.mask.is_contiguous() and bool(selection.mask[0, 0])
    accepted = torch.tensor([[True, False, False], [False, False, False]])
    selector.update(selection, torch.tensor([1, 0]), accepted_nodes=accepted)


def test_tree_tensors_on_another_device_are_named() -> None:
    """parents and accepted_nodes are checked for their device as the other inputs are (they
    failed inside an index op, naming neither)."""
    selector = make_selector("tetris", k=2)
    logprobs, parents = random_logprobs(2, 3, seed=0), torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    with pytest.raises(ValueError, match=r"parents is on meta, expected cpu"):
        selector.select(logprobs, parents=parents.to("meta"))
    selection = selector.select(logprobs, parents=parents)
    nothing = torch.zeros(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"accepted_nodes is on meta, expected cpu"):
        selector.update(selection, torch.zeros(2, dtype=torch.int64), accepted_nodes=nothing)


@pytest.mark.parametrize("name", CONFIGS)
def test_update_takes_one_feedback_per_select(name: str) -> None:
    """A second update for one select would learn the step twice: an error; the next select
    takes feedback again."""
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    selector.update(selection, selection.lengths)
    with pytest.raises(ValueError, match="already called for the last select"):
        selector.update(selection, selection.lengths)
    selection = selector.select(drafted(selector, seed=1))
    selector.update(selection, selection.lengths)


@pytest.mark.parametrize("name", CONFIGS)
def test_update_answers_a_select(name: str) -> None:
    """Feedback without a select since the last reset would be lost (nothing knows what was
    drafted), and the selection of an earlier step learned against the last step's draft:
    errors, where they used to pass."""
    selector = make(name)
    feedback = Selection.from_lengths(torch.ones(BATCH, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"update answers a select\(\)"):
        selector.update(feedback, torch.ones(BATCH, dtype=torch.int64))
    selection = selector.select(drafted(selector, seed=0))
    selector.reset()
    with pytest.raises(ValueError, match=r"update answers a select\(\)"):
        selector.update(selection, selection.lengths)
    stale = selector.select(drafted(selector, seed=1))
    selector.select(drafted(selector, seed=2))
    with pytest.raises(ValueError, match=r"the selection of an earlier select\(\)"):
        selector.update(stale, stale.lengths)


class OneAnswer(Selector):
    """Fills and returns one Selection every step, as a selector with static output buffers
    (for CUDA graphs) may: its answer is always the last select's, never a stale one."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = Selection.from_lengths(torch.zeros(BATCH, dtype=torch.int64), 3)

    def draft_length(self, num_active: int) -> int:
        return 3

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        self.answer.lengths.fill_(1)
        self.answer.mask.copy_(prefix_mask(self.answer.lengths, 3))
        return self.answer


class Broken(Selector):
    """A selector of one's own whose answer breaks the contract in one way (``how``)."""

    supports_trees = True

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def draft_length(self, num_active: int) -> int:
        return 3

    def _max_selected(self, width: int, num_active: int) -> int:
        return 1 if self.how == "over its bound" else width

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        rows, width = draft_logprobs.shape
        lengths = torch.full((rows,), width, dtype=torch.int64)
        if self.how == "too long":
            return Selection(lengths + 2, prefix_mask(lengths, width))
        if self.how == "not a prefix":
            mask = torch.zeros(rows, width, dtype=torch.bool)
            mask[:, 1] = True
            return Selection(torch.ones(rows, dtype=torch.int64), mask)
        if self.how == "int32":
            return Selection(lengths.to(torch.int32), prefix_mask(lengths, width))
        if self.how == "a tuple":
            return (lengths, prefix_mask(lengths, width))  # type: ignore[return-value]
        return Selection.from_lengths(lengths, width)  # everything: past -inf, inactive rows

    def _select_tree(self, draft_logprobs, active, parents, depth) -> Selection:
        mask = torch.zeros_like(draft_logprobs, dtype=torch.bool)
        if self.how == "over its bound":
            mask[1:, :2] = True  # a path of two nodes (not in row 0, past its -inf): one declared
        else:
            mask[:, -1] = True  # a deepest node without its ancestors
        return Selection.from_mask(mask)


@pytest.mark.parametrize("inside_a_loop", [False, True], ids=["called", "in-a-loop"])
@pytest.mark.parametrize(
    ("how", "tree", "says"),
    [
        ("too long", False, "Broken selected a mask that is not a prefix of each row"),
        ("not a prefix", False, "Broken selected a mask that is not a prefix of each row"),
        ("int32", False, r"Broken selected lengths torch.int32 \(5,\)"),
        ("everything", False, "Broken selected a token at or after a -inf"),
        ("orphan", True, "Broken selected a mask that is not closed under ancestors"),
        ("over its bound", True, r"Broken selected 2 tokens in a row, more than its max_sel"),
    ],
)
def test_a_selector_s_broken_answer_is_named(
    how: str, tree: bool, says: str, inside_a_loop: bool
) -> None:
    """select checks what _select returned (a loop clamped it silently, cut a tree's
    selection to the verify pass it sized by max_selected, or verified a node without its
    parent); the message names the selector. Inside a loop's trusted block too: the loops
    trust the tensors they made, not a user's selector's answer."""
    logprobs = torch.full((BATCH, 3), -0.5)
    logprobs[0, 1] = -math.inf
    parents = torch.tensor([[-1, 0, 1]] * BATCH) if tree else None
    loop = trusted_values() if inside_a_loop else contextlib.nullcontext()
    with loop, pytest.raises(RuntimeError, match=says):
        Broken(how).select(logprobs, parents=parents)


def test_a_selector_that_answers_no_selection_is_named() -> None:
    with pytest.raises(TypeError, match=r"Broken must select a specselect Selection.*got tuple"):
        Broken("a tuple").select(torch.full((BATCH, 3), -0.5))


def test_an_inactive_row_must_select_nothing() -> None:
    with pytest.raises(RuntimeError, match="Broken selected tokens in an inactive row"):
        Broken("everything").select(torch.full((BATCH, 3), -0.5), ACTIVE)


class NoSuper(Selector):
    def __init__(self) -> None:  # forgets super().__init__()
        self.k = 2

    def draft_length(self, num_active: int) -> int:
        return self.k

    def _select(self, draft_logprobs: torch.Tensor, active: torch.Tensor | None) -> Selection:
        return Selection.from_lengths(torch.zeros(draft_logprobs.shape[0], dtype=torch.int64), 3)


def test_a_selector_that_skips_super_init_is_told() -> None:
    with pytest.raises(TypeError, match=r"NoSuper.__init__ must call super\(\).__init__\(\)"):
        NoSuper().select(torch.full((BATCH, 3), -0.5))


class Reshaping(AcceptanceEstimator):
    """Estimates that are no log-probabilities, of another shape, or finite where the draft is
    -inf (``how``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def estimate(self, draft_logprobs, positions=None, features=None) -> torch.Tensor:
        if self.how == "shape":
            return draft_logprobs[:, :1]
        if self.how == "positive":
            return draft_logprobs.exp()
        return draft_logprobs.clamp(min=-30.0)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("positive", "contains positive values"),
        ("shape", r"has shape \(5, 1\), expected"),
        ("finite", "must stay -inf where"),
    ],
)
@pytest.mark.parametrize("inside_a_loop", [False, True], ids=["called", "in-a-loop"])
def test_an_estimate_that_breaks_its_contract_is_named_at_select(
    how: str, says: str, inside_a_loop: bool
) -> None:
    """Positive estimates failed only in update, under the guard's argument name; a [B, 1]
    estimate gave a [B, 1] selection (update then blamed the batch); a finite one for a -inf
    token let TETRIS select past it. Inside a loop's trusted block too."""
    logprobs = torch.tensor([[-0.1, -math.inf, -0.2]] * BATCH)
    selector = SELECTORS["tetris"](2, 1, estimator=Reshaping(how), guard=False)
    loop = trusted_values() if inside_a_loop else contextlib.nullcontext()
    with loop, pytest.raises(ValueError, match=f"Reshaping.estimate's output {says}"):
        selector.select(logprobs)


def test_update_takes_an_answer_object_reused_every_step() -> None:
    selector = OneAnswer()
    for seed in range(3):
        selection = selector.select(random_logprobs(BATCH, 3, seed=seed))
        selector.update(selection, selection.lengths)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_selector_pickles_with_what_it_learned(name: str) -> None:
    """Saved or sent to another process after some steps (the record of the last select keeps
    weak references, which do not pickle), it selects as the original does."""
    selector = make(name)
    for seed in range(3):
        selection = selector.select(drafted(selector, seed=seed))
        accepted = accepted_for(selection, seed)
        selector.update(selection, accepted)
        observe(selector, selection, accepted, None)
    copy_ = pickle.loads(pickle.dumps(selector))
    probe = drafted(selector, seed=9)
    assert torch.equal(copy_.select(probe).mask, selector.select(probe).mask)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_copy_gets_a_capture_token_of_its_own(name: str, how: str) -> None:
    """A graph mode loop keys its captured selection on ``capture_key``: a copy sharing the
    original's token would replay the graph recorded on the original's state."""
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    selector.update(selection, selection.lengths)
    copied = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    }[how](selector)
    assert copied.capture_token != selector.capture_token
    key = selector.capture_key
    if key is not None and any(isinstance(part, CaptureToken) for part in key):  # stateful
        assert copied.capture_key != key


@pytest.mark.parametrize("name", CONFIGS)
def test_observe_refuses_outcomes_the_last_select_cannot_have(name: str) -> None:
    """More rows than the batch, or more verified tokens than were drafted: a host planner
    would have learned from them."""
    selector = make(name)
    logprobs = drafted(selector, seed=0)
    selection = selector.select(logprobs)
    selector.update(selection, selection.lengths)
    width = logprobs.shape[1]
    with pytest.raises(ValueError, match=f"at most the {width} draft tokens"):
        selector.observe([width + 1] * BATCH, [0] * BATCH)
    with pytest.raises(ValueError, match=f"the last select\\(\\) had {BATCH} rows"):
        selector.observe([1] * (BATCH + 1), [0] * (BATCH + 1))


@pytest.mark.parametrize("name", CONFIGS)
def test_update_for_another_batch_asks_for_reset(name: str) -> None:
    selector = make(name)
    selector.select(drafted(selector, seed=0))
    other = Selection.from_lengths(torch.ones(BATCH + 1, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"selection.*shape.*call reset\(\)"):
        selector.update(other, torch.zeros(BATCH + 1, dtype=torch.int64))
    selector.reset()
    logprobs = random_logprobs(BATCH + 1, max(selector.draft_length(BATCH + 1), 3), seed=1)
    selection = selector.select(logprobs)
    selector.update(selection, selection.lengths)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_empty_batch(name: str, tree: bool) -> None:
    """No request at all: an empty selection, and feedback on it, like any other batch."""
    selector = make(name)
    parents = torch.zeros(0, 5, dtype=torch.int64) if tree else None
    for _ in range(2):
        selection = selector.select(torch.zeros(0, 5), parents=parents)
        assert selection.lengths.shape == (0,) and selection.mask.shape == (0, 5)
        accepted_nodes = torch.zeros(0, 5, dtype=torch.bool) if tree else None
        selector.update(selection, torch.zeros(0, dtype=torch.int64), accepted_nodes=accepted_nodes)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_step_with_nothing_drafted_learns_nothing(name: str, tree: bool) -> None:
    """A plain step (``K = 0``: the goodput budget's choice when drafting does not pay, or the
    last token of every row) selects nothing and tested nothing: after it, the selector ranks
    as if it had not happened (its estimator used to count it, decaying what it had learned)."""
    trained = make(name)
    parents = chain_parents(BATCH, 3) if tree else None
    for seed in range(6):
        logprobs = drafted(trained, seed=seed)[:, :3]
        selection = trained.select(logprobs, parents=parents)
        accepted = accepted_for(selection, seed)
        path = torch.arange(3) < accepted.unsqueeze(1) if tree else None  # [B, 3]
        trained.update(selection, accepted, accepted_nodes=path)
        observe(trained, selection, accepted, None, tree=tree)
    untouched = copy.deepcopy(trained)
    empty_parents = torch.zeros(BATCH, 0, dtype=torch.int64) if tree else None
    selection = trained.select(torch.zeros(BATCH, 0), parents=empty_parents)
    assert selection.lengths.tolist() == [0] * BATCH and selection.mask.shape == (BATCH, 0)
    nodes = torch.zeros(BATCH, 0, dtype=torch.bool) if tree else None
    trained.update(selection, torch.zeros(BATCH, dtype=torch.int64), accepted_nodes=nodes)
    trained.observe([0] * BATCH, [0] * BATCH)
    probe = drafted(trained, seed=9)[:, :3]
    after, before = trained.select(probe, parents=parents), untouched.select(probe, parents=parents)
    assert torch.equal(after.mask, before.mask)
    if trained.last_scores is not None:
        assert torch.equal(trained.last_scores, untouched.last_scores)


# --------------------------------------------------------------------------------------------
# Draft trees


def random_tree(seed: int, rows: int = BATCH, nodes: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, N] parents, [B, N] float32 node log-probs)``: random forests, some ``-inf`` nodes,
    row 3 all ``-inf``."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack(
        [torch.randint(-1, max(j, 0), (rows,), generator=gen) for j in range(nodes)], dim=1
    )
    logprobs = random_logprobs(rows, nodes, seed=seed, cut=0.15)
    logprobs[3] = -math.inf
    return parents, logprobs


def accepted_path(selection: Selection, parents: torch.Tensor, seed: int) -> torch.Tensor:
    """``[B, N]`` bool: a random accepted root-to-node path through selected nodes, by walking
    down from the root and stopping at random (a stand-in for tree verification)."""
    gen = torch.Generator().manual_seed(seed)
    mask = selection.mask.cpu()
    path = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        current = -1
        while torch.rand((), generator=gen) < 0.7:
            children = [j for j in range(mask.shape[1]) if parents[i, j] == current and mask[i, j]]
            if not children:
                break
            current = children[int(torch.randint(len(children), (), generator=gen))]
            path[i, current] = True
    return path.to(selection.mask.device)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("with_active", [False, True])
def test_tree_contract(name: str, with_active: bool) -> None:
    """Every registered selector selects draft-tree nodes: closed under ancestors, exact counts,
    nothing below a ``-inf`` node, nothing in inactive rows; and it learns from the accepted
    paths over a few steps."""
    selector = make(name)
    assert selector.supports_trees
    active = ACTIVE if with_active else None
    for step in range(4):
        parents, logprobs = random_tree(seed=step)
        bound = selector.max_selected(logprobs.shape[1], num_active(active))
        selection = selector.select(logprobs, active, parents=parents)
        assert int(selection.lengths.max()) <= bound, "max_selected() is no bound"
        assert selection.mask.shape == logprobs.shape and selection.mask.dtype == torch.bool
        assert selection.lengths.dtype == torch.int64
        assert torch.equal(selection.lengths, selection.mask.sum(dim=1))
        has_parent = parents >= 0
        parent_taken = selection.mask.gather(1, parents.clamp(min=0))
        assert bool((~selection.mask | ~has_parent | parent_taken).all()), "an orphan node"
        assert not (selection.mask & ~available_nodes(logprobs, parents)).any()
        if active is not None:
            assert not bool(selection.mask[~active].any()), "selected an inactive row"
        path = accepted_path(selection, parents, seed=step)
        selector.update(selection, path.sum(dim=1), accepted_nodes=path)


@pytest.mark.parametrize("name", CONFIGS)
def test_chain_shaped_trees_select_and_learn_as_chains(name: str) -> None:
    """A chain is the tree ``parents[j] = j - 1``: over several steps with feedback (``update``
    and ``observe``), a selector fed chain-shaped trees makes the same selections as one fed
    the chains, so it also learns the same from the same outcomes."""
    flat, tree = make(name), make(name)
    for step in range(6):
        window = flat.draft_length(BATCH)
        assert tree.draft_length(BATCH) == window
        logprobs = random_logprobs(BATCH, max(window, 1), seed=step, cut=0.1)
        parents = chain_parents(BATCH, logprobs.shape[1])
        a = flat.select(logprobs, ACTIVE if step % 2 else None)
        b = tree.select(logprobs, ACTIVE if step % 2 else None, parents=parents)
        assert torch.equal(a.mask, b.mask), f"step {step}"
        assert torch.equal(a.lengths, b.lengths)
        accepted = accepted_for(a, step)
        flat.update(a, accepted)
        path = torch.arange(logprobs.shape[1]) < accepted.unsqueeze(1)  # [B, K]
        tree.update(b, accepted, accepted_nodes=path)
        observe(flat, a, accepted, ACTIVE if step % 2 else None)
        observe(tree, b, accepted, ACTIVE if step % 2 else None, tree=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_tree_update_checks_the_accepted_path(name: str) -> None:
    selector = make(name)
    parents = torch.tensor([[-1, -1, 0]] * BATCH)
    logprobs = torch.tensor([[-0.1, -0.1, -math.inf]] * BATCH)  # node 2: never selected
    selection = selector.select(logprobs, parents=parents)
    assert selection.mask[:, 0].all()
    outside = torch.tensor([False, False, True]).expand(BATCH, 3)
    with pytest.raises(ValueError, match="accepted_nodes must be selected nodes"):
        selector.update(selection, outside.sum(dim=1), accepted_nodes=outside)
    first = torch.tensor([True, False, False]).expand(BATCH, 3)
    with pytest.raises(ValueError, match="accepted_nodes must hold num_accepted nodes"):
        selector.update(selection, first.sum(dim=1) + 1, accepted_nodes=first)
    with pytest.raises(ValueError, match="accepted_nodes must be a bool tensor"):
        selector.update(selection, first.sum(dim=1), accepted_nodes=first.float())
    selector.update(selection, first.sum(dim=1), accepted_nodes=first)
    # A loop's path is checked against the tree: two siblings, or a node without its parent,
    # are no path from the root.
    selector.select(torch.full((BATCH, 3), -0.1), parents=parents)
    everything = Selection.from_mask(torch.ones(BATCH, 3, dtype=torch.bool))
    for nodes in ([True, True, False], [False, False, True]):
        bad = torch.tensor(nodes).expand(BATCH, 3)
        with pytest.raises(ValueError, match="accepted_nodes must be a path from the root"):
            selector.update(everything, bad.sum(dim=1), accepted_nodes=bad)
    path = torch.tensor([True, False, True]).expand(BATCH, 3)
    selector.update(everything, path.sum(dim=1), accepted_nodes=path)


def _bad_constructor_cases() -> list[tuple[str, str, object]]:
    """(selector, parameter, bad value) for every checked parameter a selector takes."""
    cases = []
    for name in NAMES:
        params = inspect.signature(SELECTORS[name]).parameters
        cases += [(name, p, -1) for p in NON_NEGATIVE_PARAMS if p in params]
        cases += [(name, p, v) for p in PROBABILITY_PARAMS if p in params for v in (-0.1, 1.5)]
    return cases


@pytest.mark.parametrize(("name", "param", "value"), _bad_constructor_cases())
def test_constructor_rejects_out_of_range(name: str, param: str, value: object) -> None:
    kwargs = {**SELECTOR_KWARGS.get(name, {}), param: value}
    with pytest.raises(ValueError, match=param):
        SELECTORS[name](**kwargs)


def test_every_selector_has_a_checked_parameter() -> None:
    """Guards the test above against silently covering nothing for a selector that has
    parameters: name its range-checked ones in NON_NEGATIVE_PARAMS or PROBABILITY_PARAMS."""
    covered = {name for name, _, _ in _bad_constructor_cases()}
    with_params = {n for n in NAMES if inspect.signature(SELECTORS[n]).parameters}
    assert with_params <= covered, f"no range check tested for {sorted(with_params - covered)}"


# --------------------------------------------------------------------------------------------
# No host sync


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("name", ["tetris", "tetris-goodput", "fixed"])
def test_compiles_without_graph_breaks(name: str, grad: bool) -> None:
    """fullgraph=True fails on any graph break (a host read of a tensor value is one).

    Backend "eager": Dynamo alone finds the graph breaks; no code generation keeps this quick.
    Under no_grad too, as a decoding loop calls it (Dynamo could not trace the check that
    skips entering no_grad again, and every compiled cell of bench_gpu's part s failed).
    """
    torch._dynamo.reset()  # each case compiles the same code for another selector
    selector = make(name)
    compiled = torch.compile(selector.select, fullgraph=True, backend="eager")
    logprobs = drafted(selector, seed=1)
    for active in (None, ACTIVE):
        with torch.set_grad_enabled(grad):
            got = compiled(logprobs, active)
        want = selector.select(logprobs, active)
        assert torch.equal(got.lengths, want.lengths)
        assert torch.equal(got.mask, want.mask)


def test_direct_calls_check_the_callers_tensors_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called directly on a CPU, select and update check the values they are given; the
    default's estimator, its two rankings and its guard are handed checked tensors and must
    not read them again (they did: 3 reads per select and 8 per update, now 1 and 2)."""
    reads = []
    for method in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(tensor: torch.Tensor, *args: object, _original: object = original) -> object:
            reads.append(tensor.shape)
            return _original(tensor, *args)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, method, counted)
    selector = make("tetris")
    for seed in range(4):
        logprobs = drafted(selector, seed=seed)
        reads.clear()
        selection = selector.select(logprobs, ACTIVE)
        assert len(reads) <= 1, reads  # the draft's log-probs (active is a bool: no values)
        accepted = selection.lengths.clamp(max=1)
        reads.clear()
        selector.update(selection, accepted)
        assert len(reads) <= 2, reads  # num_accepted: >= 0, and <= the lengths


@pytest.mark.parametrize("name", CONFIGS)
def test_runs_on_meta_tensors(name: str) -> None:
    """The meta device holds no data: any host read of a value would raise."""
    selector = make(name)
    logprobs = drafted(selector, seed=2, device="meta")
    rows, width = logprobs.shape
    parents = random_tree(seed=2, nodes=width)[0].to("meta")
    for active, tree in itertools.product((None, ACTIVE.to("meta")), (None, parents)):
        selection = selector.select(logprobs, active, parents=tree)
        assert selection.lengths.device.type == "meta"
        assert selection.lengths.shape == (rows,)
        assert selection.lengths.dtype == torch.int64
        assert selection.mask.shape == (rows, width)
        assert selection.mask.dtype == torch.bool
        accepted = torch.zeros(rows, dtype=torch.int64, device="meta")
        nodes = None if tree is None else torch.zeros_like(selection.mask)
        selector.update(selection, accepted, accepted_nodes=nodes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync check: needs a CUDA device")
@pytest.mark.parametrize("name", CONFIGS)
def test_no_sync_on_cuda(name: str) -> None:
    """select and update under CUDA's sync debug mode ("error": any sync raises)."""
    selector = make(name)
    logprobs = drafted(selector, seed=3, device="cuda")
    active = ACTIVE.cuda()
    parents = random_tree(seed=3, nodes=logprobs.shape[1])[0].cuda()
    for tree in (None, parents):  # warm-up: lazy CUDA init and cached constants
        selector.select(logprobs, active, parents=tree)
    accepted = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
    no_path = torch.zeros(logprobs.shape, dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for act, tree in itertools.product((None, active), (None, parents)):
            selection = selector.select(logprobs, act, parents=tree)
            selector.update(selection, accepted, accepted_nodes=None if tree is None else no_path)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", CONFIGS)
def test_state_moves_with_the_inputs_to_another_device(name: str) -> None:
    """Inputs on another device than the last select's: the selector moves its state there
    before reading it (no op mixes devices, as none may on a GPU: "meta" stands in for one),
    also when a slot's request changes at the move; and it draws a new capture token once, so
    that no graph recorded on the old tensors replays for it."""
    selector = make(name)
    requests = torch.arange(BATCH)
    for seed in range(4):
        selection = selector.select(drafted(selector, seed=seed), ACTIVE, request_ids=requests)
        accepted = accepted_for(selection, seed)
        selector.update(selection, accepted)
        observe(selector, selection, accepted, ACTIVE)
    token = selector.capture_token
    logprobs = drafted(selector, seed=4).to("meta")  # the window is read while state is on cpu
    requests = torch.tensor([0, 7, 2, 3, 4], device="meta")
    tokens = []
    with OneDevicePerOp():
        for _ in range(2):
            selection = selector.select(logprobs, ACTIVE.to("meta"), request_ids=requests)
            selector.update(selection, torch.zeros_like(selection.lengths))
            tokens.append(selector.capture_token)
    assert tokens[0] != token and tokens[1] == tokens[0]


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        (torch.tensor([7, 1, 2]), ValueError, "lengths must be <= width = 5"),
        (torch.tensor([2, -1, 2]), ValueError, "lengths must be >= 0"),
        (torch.tensor([1.0, 2.0]), TypeError, "lengths must be an integer tensor"),
        (torch.tensor([[1, 2]]), ValueError, "lengths must have rank 1"),
    ],
)
def test_selection_from_lengths_refuses_lengths_its_mask_cannot_hold(
    lengths: torch.Tensor, error: type, match: str
) -> None:
    """Lengths and mask would disagree (``num_verified`` counting tokens that are not there),
    or a float would be truncated."""
    with pytest.raises(error, match=match):
        Selection.from_lengths(lengths, 5)


@pytest.mark.parametrize("name", CONFIGS)
def test_update_refuses_lengths_that_do_not_count_the_mask(name: str) -> None:
    """Two more than selected, with as many accepted: the guard counted 6 tokens tested and
    passed where 2 were selected."""
    selector = make(name)
    selection = selector.select(drafted(selector, seed=0))
    wrong = Selection(selection.lengths + 2, selection.mask)
    with pytest.raises(ValueError, match=r"selection.lengths\[0\] = .* lengths must count"):
        selector.update(wrong, wrong.lengths)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_device_value_checks_take_a_bool_only(value: object) -> None:
    """``bool("false")`` is True: a non-bool would switch the checks on by mistake."""
    with pytest.raises(TypeError, match="enabled must be True or False"):
        set_device_value_checks(value)  # type: ignore[arg-type]
    assert _checks._DEVICE_VALUE_CHECKS is False  # still off


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda lp: window_selection(lp, None, -1), ValueError, "window must be >= 0, got -1"),
        (lambda lp: window_selection(lp, None, 1.5), TypeError, "window must be an int"),
        (
            lambda lp: window_selection(lp, None, torch.tensor([1, 2, 3])),
            ValueError,
            r"window must have shape \[2\]",
        ),
        (
            lambda lp: window_selection(lp, None, torch.tensor([1, -2])),
            ValueError,
            "window must be >= 0, got min -2",
        ),
        (
            lambda lp: window_tree_selection(
                lp, None, chain_parents(2, 3), torch.arange(1, 4).expand(2, 3), -2
            ),
            ValueError,
            "window must be >= 0",
        ),
        (lambda lp: chain_parents(2, -1), ValueError, "width must be >= 0, got -1"),
        (lambda lp: chain_parents(2.0, 3), TypeError, "rows must be an int"),
    ],
)
def test_window_helpers_refuse_a_bad_window(call, error: type, match: str) -> None:
    """A negative window would select nothing silently; a window of another batch would
    fail deep inside torch."""
    with pytest.raises(error, match=match):
        call(torch.full((2, 3), -0.5))
