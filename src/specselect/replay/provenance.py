"""Checks before reusing recorded traces: do they fit this run, its models and its prompts?

A replay describes the pair the traces were recorded from, not the pair at hand. Recording once
and replaying many grids is the point of traces, so a trace file outlives the run that wrote
it; these checks stop a later run from silently reporting another pair, other prompts, a
shorter output or a smaller draft window than it asked for. Each raises
:class:`TraceMismatchError` with a one-line message that starts with ``name`` (the caller's name
for the traces, e.g. a file path) and says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specselect.replay.traces import Traces, describe_model

__all__ = [
    "TraceMismatchError",
    "check_trace_models",
    "check_trace_prompts",
    "check_trace_shape",
    "model_differences",
]


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
    trace files hold fewer, or none: what is absent is not compared). Paths compare resolved;
    ``compare_paths=False`` skips them, for models that move but stay the same (a reinstalled
    package's shipped pair).

    Returns:
        one ``"<role> <field> <stored> (this run: <current>)"`` per difference; empty if none.
    """
    return [
        f"{role} {key} {stored!r} (this run: {current!r})"
        for role, model in (("target", target), ("draft", draft))
        for key, stored, current in _stored_fields(traces.meta.get(role), model)
        if not _same_field(key, stored, current, compare_paths)
    ]


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
    return not compare_paths or Path(str(stored)).resolve() == Path(str(current)).resolve()
