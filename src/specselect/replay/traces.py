"""Greedy traces: the :class:`Traces` container, its file format, and recording.

A trace holds, per request, the target's greedy output ``y[0:T]`` and, at every output position
``t``, the draft's ``max_k``-token greedy continuation of ``prompt + y[:t]`` with the
log-probability of each drafted token; the run lengths (:func:`match_runs`) are derived from
them. :func:`record_traces` records them from a target/draft pair (see :mod:`specselect.replay`
for why one recording per prompt replays any selector exactly); :func:`save_traces` and
:func:`load_traces` store them in one ``.pt`` file.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int, check_integer_tensor, check_logprobs
from specselect.lookup import LOOKUP_WINDOW, chain_paths, lookup_features
from specselect.selection import leading_run

TRACE_FORMAT = "specselect-traces"
TRACE_VERSION = 1

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Traces",
    "describe_model",
    "greedy_continue",
    "left_pad",
    "load_traces",
    "match_runs",
    "record_traces",
    "save_traces",
    "traces_summary",
]


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


def match_runs(draft_tokens: Tensor, output_ids: Tensor) -> Tensor:
    """Leading drafted tokens that equal the target's output, per position.

    Args:
        draft_tokens: ``[N, T, K]`` int64 — the draft's continuation from each position ``t``.
        output_ids: ``[N, T]`` int64 — the target's greedy output.

    Returns:
        ``[N, T]`` int64 ``run[n, t] = max j`` with ``draft_tokens[n, t, :j] == output_ids[n,
        t:t + j]``. Positions past the end of the output never match, so a run never claims a
        token the request cannot emit.
    """
    n, length, width = draft_tokens.shape
    pad = torch.full((n, width), -1, dtype=output_ids.dtype, device=output_ids.device)
    padded = torch.cat([output_ids, pad], dim=1)  # [N, T + K]
    # target[n, t, j] = output[n, t + j] (or -1 past the end)
    target = padded.unfold(1, width, 1)[:, :length]  # [N, T, K]
    return leading_run(draft_tokens == target)


@dataclass(frozen=True)
class Traces:
    """Greedy traces of ``N`` requests, each ``T = max_new_tokens`` tokens long.

    Attributes:
        prompt_ids: ``N`` 1-D int64 tensors, the prompts (used for context lengths).
        output_ids: ``[N, T]`` int64, the target's greedy output (EOS does not stop it).
        draft_tokens: ``[N, T, K_max]`` int64, the draft's greedy continuation at each position.
        draft_logprobs: ``[N, T, K_max]`` float32, the draft's log-probability of each of them.
        meta: JSON-compatible description (models, dtype, versions, ...): str keys, values
            that a JSON round trip gives back as they are (else a ``TypeError``).
    """

    prompt_ids: list[Tensor]
    output_ids: Tensor  # [N, T] int64
    draft_tokens: Tensor  # [N, T, K_max] int64
    draft_logprobs: Tensor  # [N, T, K_max] float32
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_integer_tensor("output_ids", self.output_ids, rank=2, what="of token ids")
        check_integer_tensor("draft_tokens", self.draft_tokens, rank=3, what="of token ids")
        # Values too (a replay trusts them: its selectors skip their own checks, and a NaN
        # ranked as a score turns into an index far out of bounds).
        check_logprobs("draft_logprobs", self.draft_logprobs, rank=3)
        n, length = self.output_ids.shape
        if n == 0:  # a replay of nothing would report zeros as if they were measured
            raise ValueError("traces must hold at least one request, got 0")
        if length == 0:
            raise ValueError("output_ids must hold at least one new token per request, got 0")
        if self.draft_tokens.shape[:2] != (n, length):
            raise ValueError(
                f"draft_tokens must have shape [{n}, {length}, K_max] to match output_ids, got "
                f"{tuple(self.draft_tokens.shape)}"
            )
        if self.draft_logprobs.shape != self.draft_tokens.shape:
            raise ValueError(
                f"draft_logprobs must have the shape of draft_tokens "
                f"{tuple(self.draft_tokens.shape)}, got {tuple(self.draft_logprobs.shape)}"
            )
        if len(self.prompt_ids) != n:
            raise ValueError(
                f"prompt_ids must hold {n} prompts (one per request), got {len(self.prompt_ids)}"
            )
        for i, prompt in enumerate(self.prompt_ids):
            check_integer_tensor(f"prompt_ids[{i}]", prompt, rank=1, what="of token ids")
        _check_meta(self.meta)

    @property
    def num_requests(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def max_new_tokens(self) -> int:
        return int(self.output_ids.shape[1])

    @property
    def max_k(self) -> int:
        return int(self.draft_tokens.shape[2])

    @cached_property
    def runs(self) -> Tensor:
        """``[N, T]`` int64 run lengths (see :func:`match_runs`), derived, never stored apart."""
        return match_runs(self.draft_tokens, self.output_ids)

    @cached_property
    def prompt_lengths(self) -> Tensor:
        """``[N]`` int64 prompt lengths."""
        return torch.tensor([int(p.numel()) for p in self.prompt_ids], dtype=torch.int64)

    @cached_property
    def lookup_features(self) -> Tensor:
        """``[N, T, K_max, F]`` float32 prompt-lookup features of every drafted token (see
        :func:`specselect.lookup.lookup_features`), as the decoding loop computes them: the
        context at position ``t`` is the prompt and the first ``t`` output tokens, its last
        :data:`~specselect.lookup.LOOKUP_WINDOW` searched."""
        return torch.stack(
            [
                _request_lookup_features(prompt, output, drafts)
                for prompt, output, drafts in zip(
                    self.prompt_ids, self.output_ids, self.draft_tokens, strict=True
                )
            ]
        )

    def subset(self, indices: Sequence[int]) -> Traces:
        """The traces of the requests ``indices`` (each in ``0 .. N - 1``), in that order; the
        meta's request count follows."""
        chosen = [check_int(f"indices[{i}]", value) for i, value in enumerate(indices)]
        beyond = [i for i in chosen if i >= self.num_requests]
        if beyond:
            raise ValueError(
                f"indices must be in 0..{self.num_requests - 1} (the traces hold "
                f"{self.num_requests} requests), got {beyond[0]}"
            )
        index = torch.tensor(chosen, dtype=torch.int64)
        meta = dict(self.meta)
        if "num_requests" in meta:
            meta["num_requests"] = len(chosen)
        return Traces(
            prompt_ids=[self.prompt_ids[i] for i in chosen],
            output_ids=self.output_ids[index],
            draft_tokens=self.draft_tokens[index],
            draft_logprobs=self.draft_logprobs[index],
            meta=meta,
        )


def _request_lookup_features(
    prompt: Tensor,  # [P] int64
    output: Tensor,  # [T] int64
    drafts: Tensor,  # [T, K] int64
) -> Tensor:  # -> [T, K, F] float32
    """One request's lookup features at every position, its positions as one batch."""
    length, width = drafts.shape
    prompt = prompt.to(output.device, torch.int64)
    pad = torch.full((LOOKUP_WINDOW,), -1, dtype=torch.int64, device=output.device)
    sequence = torch.cat([pad, prompt, output.to(torch.int64)])  # [W + P + T]
    # Position t's window ends right before output token t: at W + P + t.
    ends = LOOKUP_WINDOW + prompt.numel() + torch.arange(length, device=output.device)  # [T]
    columns = ends.unsqueeze(1) - LOOKUP_WINDOW + torch.arange(LOOKUP_WINDOW, device=ends.device)
    windows = sequence[columns]  # [T, W]
    filled = (prompt.numel() + torch.arange(length, device=ends.device)).clamp(max=LOOKUP_WINDOW)
    paths = chain_paths(width, drafts.device)
    return lookup_features(windows, filled, drafts.to(torch.int64), paths)


def save_traces(traces: Traces, path: str | Path) -> Path:
    """Write ``traces`` to one ``.pt`` file (plain tensors, lists and JSON-like metadata).

    Raises:
        IsADirectoryError: ``path`` is a directory (torch's own error names no path).
        TypeError: ``traces.meta`` no longer holds JSON values (see :class:`Traces`).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a directory; name the .pt file to write")
    _check_meta(traces.meta)  # again: the dict may have changed since the traces were made
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        # A JSON round trip turns str subclasses (torch.__version__) into plain strings, which
        # weights_only unpickling accepts.
        "meta": json.loads(json.dumps(traces.meta)),
        "prompt_ids": [p.to(torch.int64).cpu() for p in traces.prompt_ids],
        "output_ids": traces.output_ids.cpu(),
        "draft_tokens": traces.draft_tokens.cpu(),
        "draft_logprobs": traces.draft_logprobs.cpu(),
    }
    torch.save(payload, path)
    return path


def load_traces(path: str | Path) -> Traces:
    """Read a file written by :func:`save_traces` (safely: ``weights_only`` unpickling).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: the path is a directory.
        ValueError: the file is not a specselect trace file of a supported version (the
            message names the file and what was expected, never torch's advice to unpickle
            it unsafely).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"trace file {str(path)!r} is a directory, not a trace file")
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    not_traces = ValueError(
        f"{str(path)!r} is not a specselect trace file (expected one written by "
        "specselect.replay.save_traces or specselect compare --traces)"
    )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch raises several types for corrupt or foreign files
        raise not_traces from None
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise not_traces
    if payload.get("version") != TRACE_VERSION:
        raise ValueError(
            f"{str(path)!r} has trace format version {payload.get('version')!r}; this "
            f"specselect reads version {TRACE_VERSION}"
        )
    try:
        return Traces(
            prompt_ids=list(payload["prompt_ids"]),
            output_ids=payload["output_ids"],
            draft_tokens=payload["draft_tokens"],
            draft_logprobs=payload["draft_logprobs"],
            meta=dict(payload["meta"]),
        )
    except (KeyError, TypeError, ValueError) as exc:  # a missing field, a wrong shape
        raise ValueError(
            f"{str(path)!r} is a damaged specselect trace file ({type(exc).__name__}: {exc})"
        ) from None


def traces_summary(traces: Traces) -> dict[str, Any]:
    """Draft/target agreement in the traces (what bounds every selector), JSON-compatible."""
    runs = traces.runs.to(torch.float64)
    first = (runs >= 1).to(torch.float64)
    return {
        "requests": traces.num_requests,
        "max_new_tokens": traces.max_new_tokens,
        "max_k": traces.max_k,
        "greedy_agreement": float(first.mean()) if first.numel() else 0.0,
        "mean_run": float(runs.mean()) if runs.numel() else 0.0,
        "mean_prompt_tokens": float(traces.prompt_lengths.double().mean()),
    }


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def left_pad(
    sequences: Sequence[Tensor], device: torch.device | str = "cpu", pad_token_id: int = 0
) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D int64 sequences: ``([b, L] ids, [b, L] int64 attention mask)``.

    Left padding is the layout HF ``generate`` and ``speculative_generate`` expect, so that
    every row's next token sits in the last column.
    """
    width = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, seq in enumerate(sequences):
        n = int(seq.numel())
        if n:
            ids[row, width - n :] = seq
            mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def greedy_continue(
    model: torch.nn.Module, contexts: Sequence[Tensor], steps: int
) -> tuple[Tensor, Tensor]:
    """Greedy continuation of a batch of contexts, with the log-probability of each token.

    Why a loop of our own rather than ``model.generate``: ``generate`` applies the model's
    generation config (EOS stopping, logits processors), which would change what is recorded;
    here every row runs exactly ``steps`` tokens on raw logits, with the left-padding layout and
    position ids (``cumsum(mask) - 1``) that ``generate`` and the decoding loop use.

    Args:
        model: a causal LM returning ``.logits`` and its KV cache (``.cache``, or
            ``.past_key_values`` before transformers 5.24).
        contexts: ``b`` non-empty 1-D int64 token tensors.
        steps: tokens to generate per context.

    Returns:
        ``([b, steps] int64 tokens, [b, steps] float32 log-probs)`` on the CPU.
    """
    device = _model_device(model)
    ids, mask = left_pad(contexts, device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    from specselect.hf.compat import cache_argument, supports_logits_to_keep

    extra = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
    cache_arg = cache_argument(model)
    tokens, logprobs = [], []
    cache = None
    step_ids, step_pos = ids, positions
    for _ in range(steps):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            use_cache=True,
            **{cache_arg: cache},
            **extra,
        )
        cache = getattr(out, cache_arg)
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [b, V]
        token = logp.argmax(dim=-1)  # [b]
        tokens.append(token)
        logprobs.append(logp.gather(1, token.unsqueeze(1)).squeeze(1))
        step_ids = token.unsqueeze(1)
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    if not tokens:
        empty = torch.zeros(len(contexts), 0)
        return empty.to(torch.int64), empty
    return torch.stack(tokens, dim=1).cpu(), torch.stack(logprobs, dim=1).cpu()


def _chunked_continue(
    model: torch.nn.Module,
    contexts: Sequence[Tensor],
    steps: int,
    batch_size: int,
    progress: Callable[[int], None] | None,
) -> tuple[Tensor, Tensor]:
    """:func:`greedy_continue` over many contexts, in length-sorted chunks (less padding)."""
    order = sorted(range(len(contexts)), key=lambda i: int(contexts[i].numel()))
    tokens = torch.zeros(len(contexts), steps, dtype=torch.int64)
    logprobs = torch.zeros(len(contexts), steps, dtype=torch.float32)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        tok, lp = greedy_continue(model, [contexts[i] for i in chunk], steps)
        index = torch.tensor(chunk, dtype=torch.int64)
        tokens[index] = tok
        logprobs[index] = lp
        if progress is not None:
            progress(len(chunk))
    return tokens, logprobs


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """What :func:`record_traces` stores of each model (``meta["target"]``, ``meta["draft"]``):
    its path or name, class, dtype and parameter count, so that a reuse can tell whether a trace
    file was recorded from the models at hand (:func:`~specselect.replay.check_trace_models`)."""
    config = getattr(model, "config", None)
    return {
        "name_or_path": _resolved(
            str(getattr(config, "_name_or_path", "") or type(model).__name__)
        ),
        "class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _resolved(name_or_path: str) -> str:
    """A local model directory as an absolute path (a relative one would name another
    directory from another working directory); a hub name or a class name as it is."""
    path = Path(name_or_path)
    return str(path.resolve()) if path.is_dir() else name_or_path


def package_versions() -> dict[str, str]:
    """Versions of specselect, torch, python and (when installed) transformers: what a recording
    (or a cost measurement) records of the software it ran on."""
    import specselect

    versions = {
        "specselect": specselect.__version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
    }
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:  # recording works with any module that behaves like an HF causal LM
        pass
    return versions


def _as_prompt(prompt: object, index: int, vocab: int | None) -> Tensor:
    """``prompts[index]`` as a ``[P]`` int64 CPU tensor, refused unless it is a 1-D sequence of
    token ids below ``vocab`` (a 2-D prompt used to be flattened into one, float ids
    truncated, and ids beyond the vocabulary failed inside the embedding)."""
    name = f"prompts[{index}]"
    if isinstance(prompt, str | bytes):
        raise TypeError(f"{name} is a string; record_traces takes token ids (tokenize it first)")
    try:
        t = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{name} must be a 1-D tensor or sequence of token ids ({exc})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one prompt's token ids), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty; every prompt needs at least one token")
    t = t.to(torch.int64).cpu()
    low, high = int(t.min()), int(t.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bound = "" if vocab is None else f" and below the vocabulary size {vocab}"
        raise ValueError(f"{name} holds token id {low if low < 0 else high}; ids are >= 0{bound}")
    return t


#: The ``meta`` keys :func:`record_traces` writes itself, which a caller's ``meta`` may not set.
RECORDED_META = (
    "target",
    "draft",
    "max_new_tokens",
    "max_k",
    "num_requests",
    "eos_stops",
    "versions",
)


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of ``model``'s input embedding (ids at or above it fail inside it), if it says."""
    embeddings = getattr(model, "get_input_embeddings", None)
    weight = getattr(embeddings(), "weight", None) if callable(embeddings) else None
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def record_traces(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Tensor | Sequence[int]],
    max_new_tokens: int,
    max_k: int,
    *,
    batch_size: int = 128,
    progress: bool = False,
    meta: dict[str, Any] | None = None,
) -> Traces:
    """Record greedy traces of ``prompts`` (see :mod:`specselect.replay`).

    Two passes: the target's greedy output for all prompts (batched, left-padded), then the
    draft's ``max_k``-token greedy continuation from *every* position ``prompt + output[:t]`` —
    ``N * T`` contexts batched together (sorted by length, ``batch_size`` per forward), so the
    draft runs ``max_k`` passes per chunk instead of one generation per position.

    Args:
        target: causal LM whose greedy output the traces record (HF ``PreTrainedModel``).
        draft: causal LM sharing the target's tokenizer.
        prompts: ``N`` prompts as token ids (1-D tensors or lists), not padded.
        max_new_tokens: ``T``, the output length of every request (EOS does not stop it).
        max_k: draft tokens recorded per position (the largest window any replayed selector may
            ask for).
        batch_size: contexts per draft forward pass.
        progress: show a tqdm progress bar.
        meta: extra JSON-compatible metadata stored with the traces (not the keys of
            :data:`RECORDED_META`, which it records itself).

    Raises:
        TypeError, ValueError: a prompt that is not a non-empty 1-D sequence of token ids
            within the target's vocabulary (named ``prompts[i]``), sizes < 1, a model whose
            learned position table is shorter than the longest prompt plus
            ``max_new_tokens`` (and ``max_k`` for the draft), or ``meta``
            setting a recorded key or holding a value JSON does not give back as it is.
    """
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("max_k", max_k, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    if len(prompts) == 0:
        raise ValueError("prompts is empty; record_traces needs at least one prompt")
    vocab = _vocab_size(target)
    prompt_ids = [_as_prompt(p, i, vocab) for i, p in enumerate(prompts)]
    n = len(prompt_ids)
    check_positions(target, draft, prompt_ids, max_new_tokens, max_k)
    _check_meta({} if meta is None else meta)  # before the recording, not after it
    clash = sorted(set(meta or {}) & set(RECORDED_META))
    if clash:
        raise ValueError(
            f"meta must not set {', '.join(map(repr, clash))}: record_traces records "
            f"{', '.join(RECORDED_META)} itself (reuse checks read them)"
        )

    bar = _progress_bar(n + n * max_new_tokens, "recording traces", progress)
    output_ids, _ = _chunked_continue(
        target, prompt_ids, max_new_tokens, batch_size, bar.update if bar else None
    )
    contexts = [
        torch.cat([prompt_ids[i], output_ids[i, :t]])
        for i in range(n)
        for t in range(max_new_tokens)
    ]
    draft_tokens, draft_logprobs = _chunked_continue(
        draft, contexts, max_k, batch_size, bar.update if bar else None
    )
    if bar is not None:
        bar.close()
    info = {
        "target": describe_model(target),
        "draft": describe_model(draft),
        "max_new_tokens": max_new_tokens,
        "max_k": max_k,
        "num_requests": n,
        "eos_stops": False,
        "versions": package_versions(),
        **(meta or {}),
    }
    return Traces(
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        draft_tokens=draft_tokens.reshape(n, max_new_tokens, max_k),
        draft_logprobs=draft_logprobs.reshape(n, max_new_tokens, max_k),
        meta=info,
    )


def check_positions(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Sized],
    max_new_tokens: int,
    max_k: int,
) -> None:
    """Raise ``ValueError`` if :func:`record_traces` would feed a model more positions than
    its learned table of absolute positions holds (GPT-2's ``n_positions``; it would fail with
    an index error deep in its forward). Rotary models have no table and extrapolate, as under
    ``generate``. The target is fed the longest prompt plus ``max_new_tokens``, less the last
    new token (never fed); the draft, continuing ``max_k`` tokens from each position, ``max_k
    - 1`` more."""
    from specselect.hf.compat import check_position_table, position_limit  # (transformers)

    fed = max(len(p) for p in prompts) + max_new_tokens - 1  # the target's longest row
    needs = "the longest prompt plus max_new_tokens, less the last new token (never fed)"
    lower = "shorten the prompts or lower max_new_tokens"
    check_position_table("the target", position_limit(target), fed, needs, lower)
    check_position_table(
        "the draft",
        position_limit(draft),
        fed + max_k - 1,
        f"{needs}, plus max_k - 1",
        f"{lower} or max_k",
    )


def _check_meta(meta: object) -> None:
    """``meta`` as :class:`Traces` holds it: a dict of str keys whose values a JSON round trip
    gives back as they are (:func:`save_traces` writes them so; a tuple or a tensor would load
    back as something else, and a value JSON cannot hold would make an unreadable file)."""
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    for key, value in meta.items():
        if not isinstance(key, str):
            raise TypeError(f"meta keys must be str (JSON object keys), got {key!r}")
        if not _json_value(value):
            raise TypeError(
                f"meta[{key!r}] must be JSON: dicts with str keys, lists, str, int, float, "
                f"bool or None (save_traces writes it as JSON), got {value!r}"
            )


def _json_value(value: object) -> bool:
    """Whether JSON gives ``value`` back as it is (non-finite floats included: Python's json
    writes and reads them, and older trace files hold them)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(v) for k, v in value.items())
    return False


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="seq", leave=False)
