"""Reusing recorded traces (:func:`specselect.replay.reuse_traces`, the policy that ``specselect
compare --traces`` and the benchmarks' trace caches share), and the randomness of a comparison:
none, so that a run is reproducible without a seed and leaves torch's random state alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from specselect.cost import CostModel, CostSource
from specselect.models import TINY_PAIR_DIR
from specselect.replay import (
    TraceMismatchError,
    Traces,
    compare_live,
    compare_replay,
    cost_model_differences,
    describe_model,
    record_traces,
    reuse_traces,
    selector_grid,
)
from test_replay import build_tiny_pair, random_prompts

VOCAB = 64
MAX_NEW_TOKENS = 4
MAX_K = 3


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    """A tiny pair, its prompts and their traces (3 requests), and another model (a larger
    vocabulary: more parameters)."""
    target, draft = build_tiny_pair(seed=3, vocab=VOCAB)
    prompts = random_prompts(VOCAB, (5, 3, 4), seed=1)
    traces = record_traces(target, draft, prompts, MAX_NEW_TOKENS, MAX_K)
    other, _ = build_tiny_pair(seed=3, vocab=VOCAB + 1)
    return {"target": target, "draft": draft, "prompts": prompts, "traces": traces, "other": other}


def _cost_model_of(models: dict[str, Any]) -> CostModel:
    """A cost model whose source describes ``models`` (as ``specselect profile`` records them)."""
    source = CostSource("a CPU", "float32", "eager", models=models)
    return replace(CostModel.linear((1e-3, 0.0, 0.0), (1e-2, 1e-4, 0.0)), source=source)


def test_cost_model_differences_name_other_models(recording: dict[str, Any]) -> None:
    """Class and parameter count tell a cost model of other models; a path or a dtype does not
    (the same models, measured elsewhere or in another dtype); free text cannot show that it
    describes the traces' models; a hand-made model has nothing to compare."""
    traces = recording["traces"]
    mine = {role: describe_model(recording[role]) for role in ("target", "draft")}
    moved = {
        role: {**d, "name_or_path": "/elsewhere", "dtype": "bfloat16"} for role, d in mine.items()
    }
    assert cost_model_differences(traces, _cost_model_of(moved)) == []
    assert cost_model_differences(traces, CostModel.linear((1e-3, 0, 0), (1e-2, 0, 0))) == []
    other = {**mine, "target": describe_model(recording["other"])}
    (difference,) = cost_model_differences(traces, _cost_model_of(other))
    theirs, recorded = other["target"]["parameters"], mine["target"]["parameters"]
    assert difference == f"target parameters {theirs} (the traces': {recorded})"
    text = {**mine, "draft": "a 74M Llama"}
    (difference,) = cost_model_differences(traces, _cost_model_of(text))
    assert difference.startswith("draft described as 'a 74M Llama' (the traces': 'Llama")


def test_a_model_directory_is_recorded_as_an_absolute_path(
    recording: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model loaded from a relative directory is described by its absolute path: the same
    directory named from another working directory was refused as another model."""
    from transformers import AutoModelForCausalLM

    recording["draft"].save_pretrained(tmp_path / "pair" / "draft")
    monkeypatch.chdir(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained("pair/draft")
    assert describe_model(loaded)["name_or_path"] == str((tmp_path / "pair" / "draft").resolve())
    assert describe_model(recording["draft"])["name_or_path"] == "LlamaForCausalLM"  # (no dir)


def _reuse(recording: dict[str, Any], **changes: Any) -> Traces:
    """``reuse_traces`` of the recording for the run it was recorded for, with ``changes``."""
    run = {
        "max_k": MAX_K,
        "max_new_tokens": MAX_NEW_TOKENS,
        "target": recording["target"],
        "draft": recording["draft"],
        "prompt_ids": recording["prompts"],
        "name": "cached.pt",
    }
    return reuse_traces(recording["traces"], **{**run, **changes})


def test_traces_serve_the_run_they_were_recorded_for(recording: dict[str, Any]) -> None:
    assert _reuse(recording) is recording["traces"]
    assert _reuse(recording, max_k=MAX_K - 1) is recording["traces"]  # a smaller window
    shape_only = {"target": None, "draft": None, "prompt_ids": None}
    assert _reuse(recording, **shape_only) is recording["traces"]


def test_reuse_takes_prompts_as_recording_takes_them(recording: dict[str, Any]) -> None:
    """Lists of ids serve as tensors do (record_traces takes both; lists failed on .to)."""
    as_lists = [p.tolist() for p in recording["prompts"]]
    assert _reuse(recording, prompt_ids=as_lists) is recording["traces"]


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"max_k": -3}, "max_k must be >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"texts": ["one"]}, r"texts must hold one text per prompt \(3\), got 1"),
    ],
)
def test_reuse_refuses_bad_arguments(recording: dict[str, Any], changes: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _reuse(recording, **changes)


def _other_prompt(recording: dict[str, Any]) -> list[torch.Tensor]:
    first, *rest = recording["prompts"]
    return [first + 1, *rest]  # [P_0] each


MISMATCHES: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "window": (lambda r: {"max_k": MAX_K + 1}, "^cached.pt hold max_k=3 draft tokens"),
    "output length": (
        lambda r: {"max_new_tokens": MAX_NEW_TOKENS + 1},
        "^cached.pt were recorded with max_new_tokens=4, not 5",
    ),
    "models": (
        lambda r: {"target": r["other"]},
        "^cached.pt were recorded from other models: target parameters",
    ),
    "prompts": (
        lambda r: {"prompt_ids": _other_prompt(r), "texts": ["abc", "", ""]},
        "^cached.pt were recorded from other prompts: this run's prompt 0 \\('abc'\\)",
    ),
    "more prompts": (
        lambda r: {"prompt_ids": [*r["prompts"], r["prompts"][0]]},
        "^cached.pt hold 3 requests, fewer than the 4 prompts",
    ),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_traces_that_do_not_serve_the_run(recording: dict[str, Any], case: str) -> None:
    changes, message = MISMATCHES[case]
    with pytest.raises(TraceMismatchError, match=message):
        _reuse(recording, **changes(recording))


@pytest.mark.parametrize(("prompts", "partial", "used"), [(2, False, 2), (5, True, 3)])
def test_a_run_uses_the_requests_of_its_prompts(
    recording: dict[str, Any], prompts: int, partial: bool, used: int
) -> None:
    """Fewer prompts: the first requests; more, with ``partial``: the requests held."""
    ids = [*recording["prompts"], *recording["prompts"]][:prompts]
    reused = _reuse(recording, prompt_ids=ids, partial=partial)
    assert reused.num_requests == used
    assert torch.equal(reused.output_ids, recording["traces"].output_ids[:used])


def test_models_go_together(recording: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="target and draft together"):
        _reuse(recording, draft=None)


@pytest.mark.parametrize(
    ("recorded", "serves"),
    [
        ("/old/venv/lib/python3.11/site-packages/specselect/models/tiny_pair/{role}", True),
        ("/a/checkout/src/specselect/models/tiny_pair/{role}", True),
        ("/old/venv/lib/python3.11/site-packages/specselect/models/tiny_pair/other", False),
        ("/somewhere/tiny_pair/{role}", False),
    ],
)
def test_the_shipped_pair_matches_wherever_it_was_installed(
    recording: dict[str, Any], recorded: str, serves: bool
) -> None:
    """A reinstall moves the shipped pair but it stays the same: its traces still serve it
    (paths of other models must match, as the other cases show)."""
    target, draft = recording["target"], recording["draft"]
    meta = dict(recording["traces"].meta)
    for role, model in (("target", target), ("draft", draft)):
        model.config._name_or_path = str(TINY_PAIR_DIR / role)  # as load_tiny_pair loads it
        meta[role] = {**meta[role], "name_or_path": recorded.format(role=role)}
    traces = replace(recording["traces"], meta=meta)
    try:
        if serves:
            assert _reuse({**recording, "traces": traces}) is traces
        else:
            with pytest.raises(TraceMismatchError, match="target name_or_path"):
                _reuse({**recording, "traces": traces})
    finally:
        for model in (target, draft):
            model.config._name_or_path = ""


def test_a_comparison_draws_no_random_numbers(recording: dict[str, Any]) -> None:
    """Recording, replay and live runs are greedy: they leave torch's random state as it was
    (``specselect compare`` needs no seed; its --seed is deprecated)."""
    pytest.importorskip("specselect.hf")
    configs = selector_grid(["fixed", "tetris", "dsd", "oracle"], [1], [1])
    target, draft, prompts = recording["target"], recording["draft"], recording["prompts"]
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    traces = record_traces(target, draft, prompts, MAX_NEW_TOKENS, MAX_K)
    compare_replay(traces, configs, slots=2)
    compare_live(target, draft, traces, configs, slots=2)
    assert torch.equal(torch.random.get_rng_state(), before)
