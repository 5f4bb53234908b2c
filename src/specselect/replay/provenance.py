"""Checks before reusing recorded traces: do they fit this run, its models and its prompts?

A replay describes the pair the traces were recorded from, not the pair at hand. Recording once
and replaying many grids is the point of traces, so a trace file outlives the run that wrote
it; these checks stop a later run from silently reporting another pair, other prompts, a
shorter output or a smaller draft window than it asked for. Each raises
:class:`TraceMismatchError` with a one-line message that starts with ``name`` (the caller's name
for the traces, e.g. a file path) and says what to do.

:func:`reuse_traces` is the policy built from them, the one that ``specselect compare --traces``
and the benchmarks' trace caches apply: recorded traces serve a run when they hold its window
and output length, come from its models and from its prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int
from specselect.cost import CostModel
from specselect.models import TINY_PAIR_DIR
from specselect.replay.traces import Traces, describe_model

__all__ = [
    "TraceMismatchError",
    "check_trace_models",
    "check_trace_prompts",
    "check_trace_shape",
    "cost_model_differences",
    "model_differences",
    "reuse_traces",
]

_SHIPPED = TINY_PAIR_DIR.parts[-3:]
"""The tail of the shipped pair's directory (``specselect/models/tiny_pair``), the same in every
installation."""


class TraceMismatchError(ValueError):
    """Recorded traces do not fit the run that wants to reuse them."""


def check_trace_shape(
    traces: Traces, *, max_k: int, max_new_tokens: int, name: str = "traces"
) -> None:
    """The traces hold at least ``max_k`` draft tokens per position and ``max_new_tokens``
    output tokens per request (replay can take a smaller window, never a larger one or
    another output length).

    Raises:
        TraceMismatchError: they do not.
    """
    if traces.max_k < max_k:
        raise TraceMismatchError(
            f"{name} hold max_k={traces.max_k} draft tokens; this grid "
            f"needs {max_k} (record again into a new file)"
        )
    if traces.max_new_tokens != max_new_tokens:
        raise TraceMismatchError(
            f"{name} were recorded with max_new_tokens="
            f"{traces.max_new_tokens}, not {max_new_tokens}"
        )


def model_differences(
    traces: Traces, target: torch.nn.Module, draft: torch.nn.Module, *, compare_paths: bool = True
) -> list[str]:
    """How the models the traces were recorded from differ from ``target`` and ``draft``.

    Compares the fields :func:`~specselect.replay.describe_model` stored at recording (older
    trace files hold fewer, or none: what is absent is not compared). Paths compare resolved,
    and the shipped pair's models (:data:`specselect.models.TINY_PAIR_DIR`) match wherever
    specselect was installed when they were recorded: a reinstall moves them but they stay the
    same. ``compare_paths=False`` skips paths, for other models that move but stay the same.

    Returns:
        one ``"<role> <field> <stored> (this run: <current>)"`` per difference; empty if none.
    """
    return [
        f"{role} {key} {stored!r} (this run: {current!r})"
        for role, model in (("target", target), ("draft", draft))
        for key, stored, current in _stored_fields(traces.meta.get(role), model)
        if not _same_field(key, stored, current, compare_paths)
    ]


#: What of :func:`describe_model`'s fields says which models a cost model priced (a path or a
#: dtype does not: the same models measured elsewhere, or in another dtype, are still them).
COST_FIELDS = ("class", "parameters")


def cost_model_differences(traces: Traces, cost: CostModel) -> list[str]:
    """Where the models ``cost`` was measured on are not described as the traces' models are.

    A cost model of other models prices a replay of these traces as a what-if: as if their
    passes cost what those models' cost. Compared per role (target, draft), by
    :data:`COST_FIELDS`; a model the cost model describes in free text (a hand-made file) is
    listed, since nothing shows it is the traces'. What either side does not record is not
    compared (a hand-made model without a source, older trace files).

    Returns:
        one ``"<role> <field> <cost model's> (the traces': <recorded>)"`` per difference, or
        ``"<role> described as <text> (the traces': <class>, <parameters>)"``.
    """
    measured = {} if cost.source is None else cost.source.models
    differences = []
    for role in ("target", "draft"):
        mine, recorded = measured.get(role), traces.meta.get(role)
        if mine is None or not isinstance(recorded, dict):
            continue
        if not isinstance(mine, Mapping):
            fields = [f"{recorded.get(key)!r}" for key in COST_FIELDS]
            differences.append(f"{role} described as {mine!r} (the traces': {', '.join(fields)})")
            continue
        differences += [
            f"{role} {key} {mine[key]!r} (the traces': {recorded[key]!r})"
            for key in COST_FIELDS
            if key in mine and key in recorded and mine[key] != recorded[key]
        ]
    return differences


def check_trace_models(
    traces: Traces,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    *,
    compare_paths: bool = True,
    name: str = "traces",
) -> None:
    """The traces were recorded from ``target`` and ``draft`` (see :func:`model_differences`).

    Without this, new models would replay (or, live, run on the prompt ids of) another pair.

    Raises:
        TraceMismatchError: naming every difference.
    """
    differences = model_differences(traces, target, draft, compare_paths=compare_paths)
    if differences:
        raise TraceMismatchError(
            f"{name} were recorded from other models: "
            f"{'; '.join(differences)}; record again into a new file"
        )


def check_trace_prompts(
    traces: Traces,
    prompt_ids: Sequence[Tensor],
    texts: Sequence[str] | None = None,
    *,
    name: str = "traces",
) -> None:
    """The traces' first requests were recorded from exactly these prompt token ids.

    Args:
        traces: the recorded traces.
        prompt_ids: token ids of this run's prompts (``[P_i]`` each), at most one per request
            the traces hold.
        texts: the prompts' texts, quoted in the error to say which prompt differs.
        name: how the error names the traces.

    Raises:
        TraceMismatchError: more prompts than recorded requests, or the first prompt whose ids
            differ.
    """
    if len(prompt_ids) > traces.num_requests:
        raise TraceMismatchError(
            f"{name} hold {traces.num_requests} requests, fewer than the {len(prompt_ids)} "
            "prompts to check"
        )
    for index, (mine, recorded) in enumerate(zip(prompt_ids, traces.prompt_ids, strict=False)):
        if not torch.equal(mine.to(torch.int64), recorded.to(torch.int64)):
            quoted = f" ({texts[index][:30]!r})" if texts is not None else ""
            raise TraceMismatchError(
                f"{name} were recorded from other prompts: this run's prompt "
                f"{index}{quoted} does not tokenize to the recorded "
                "token ids; record again into a new file"
            )


def _stored_fields(stored: Any, model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """``(field, stored, current)`` for the fields the traces hold (older files hold fewer)."""
    if not isinstance(stored, dict):
        return []
    current = describe_model(model)
    return [(key, stored[key], value) for key, value in current.items() if key in stored]


def _same_field(key: str, stored: Any, current: Any, compare_paths: bool) -> bool:
    if key != "name_or_path":
        return bool(stored == current)
    return not compare_paths or _same_path(Path(str(stored)), Path(str(current)))


def _same_path(stored: Path, current: Path) -> bool:
    """The same model directory: equal resolved paths, or the same model of the shipped pair
    (``.../specselect/models/tiny_pair/target`` in two installations)."""
    if stored.resolve() == current.resolve():
        return True
    shipped = current.resolve().parent == TINY_PAIR_DIR.resolve()
    return shipped and stored.parent.parts[-3:] == _SHIPPED and stored.name == current.name


def reuse_traces(
    traces: Traces,
    *,
    max_k: int,
    max_new_tokens: int,
    target: torch.nn.Module | None = None,
    draft: torch.nn.Module | None = None,
    prompt_ids: Sequence[Tensor] | None = None,
    texts: Sequence[str] | None = None,
    partial: bool = False,
    name: str = "traces",
) -> Traces:
    """The traces of this run's requests, once they are shown to serve it.

    Recorded traces serve a run that replays at most ``max_k`` draft tokens per position and
    ``max_new_tokens`` tokens per request (:func:`check_trace_shape`), on the models they were
    recorded from (:func:`check_trace_models`, when ``target`` and ``draft`` are given) and on
    the prompts they were recorded from, in order (:func:`check_trace_prompts`, when
    ``prompt_ids`` are given). A run may use the first requests of a longer recording: the
    result holds the requests of ``prompt_ids``, all of them without it.

    Args:
        traces: the recorded traces (e.g. from :func:`~specselect.replay.load_traces`).
        max_k: the largest window the run replays (``k + extra`` of its grid).
        max_new_tokens: the run's output length.
        target: the run's target, given with ``draft``; None: the models are not checked (a
            replay of the traces alone is about the models they were recorded from).
        draft: the run's draft, given with ``target``.
        prompt_ids: token ids of the run's prompts (``[P_i]`` each); None: not checked.
        texts: the prompts' texts, quoted in an error to say which prompt differs.
        partial: with more prompts than the traces hold, use the requests they hold (a caller
            may warn) rather than raise.
        name: how errors name the traces (e.g. ``"--traces 'run.pt'"``).

    Raises:
        TraceMismatchError: the traces do not serve the run (the message says why).
        ValueError: only one of ``target`` and ``draft``; sizes < 1; no prompt in
            ``prompt_ids``, or ``texts`` of another length.
    """
    if (target is None) != (draft is None):
        raise ValueError("reuse_traces takes target and draft together, or neither")
    check_int("max_k", max_k, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if prompt_ids is not None:
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; pass None to check no prompt")
        prompt_ids = [torch.as_tensor(ids) for ids in prompt_ids]  # (lists, as recorded)
        if texts is not None and len(texts) != len(prompt_ids):
            raise ValueError(
                f"texts must hold one text per prompt ({len(prompt_ids)}), got {len(texts)}"
            )
    check_trace_shape(traces, max_k=max_k, max_new_tokens=max_new_tokens, name=name)
    if target is not None and draft is not None:
        check_trace_models(traces, target, draft, name=name)
    if prompt_ids is None:
        return traces
    used = min(len(prompt_ids), traces.num_requests) if partial else len(prompt_ids)
    check_trace_prompts(traces, prompt_ids[:used], texts, name=name)
    return traces if used == traces.num_requests else traces.subset(range(used))
