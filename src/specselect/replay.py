"""Exact trace replay of greedy speculative decoding, and the oracle selector.

Under greedy verification the output of speculative decoding is the target's greedy sequence,
whatever the selector does: a selector only changes *how many steps* it takes to emit it. So one
recording per prompt is enough to replay any selector exactly, for free:

* the target's greedy output ``y[0:T]`` (``T = max_new_tokens``; EOS does **not** stop a request,
  every request runs to ``T`` tokens, so that all selectors emit the same tokens);
* for every output position ``t``, the draft's ``max_k``-token greedy continuation of
  ``prompt + y[:t]`` with the log-probability of each drafted token, and the *run length*
  ``run[t]``: how many leading drafted tokens equal ``y[t:]``.

A request at position ``t`` that the selector gives ``L`` tokens accepts ``min(L, run[t])`` of
them (the target accepts a drafted token iff it equals its own greedy token, and the first
``run[t]`` drafted tokens are exactly the target's next tokens), emits one more target token and
advances by ``min(L, run[t]) + 1``. :func:`replay` streams requests through a fixed number of
batch slots, refilling a finished request's slot from the queue, because the composition of the
batch is what a batch-level selector such as TETRIS exploits.

End of a request (the convention the decoding loop follows too): a request that may still emit
``remaining`` tokens offers no draft token at positions ``j >= remaining - 1`` (their log-probs
are ``-inf``), since every step emits accepted + 1 tokens. Runs therefore only need to be exact
inside the output, and are recorded against ``y[0:T]``.

This module is an offline tool: the replay loop reads values back to the host freely, but each
step is vectorised over the batch slots. :class:`OracleSelector` is replay-only: it is handed the
true run lengths, which no real decoding loop knows.
"""

from __future__ import annotations

import inspect
import json
import platform
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specselect._checks import check_int, check_tensor
from specselect.cost import CostModel
from specselect.estimators import ESTIMATORS, observed_outcomes
from specselect.metrics import StepCounts, Totals
from specselect.selection import (
    NEG_INF,
    Selection,
    Selector,
    available_lengths,
    mask_inactive,
    prefix_mask,
)

TRACE_FORMAT = "specselect-traces"
TRACE_VERSION = 1

__all__ = [
    "OracleSelector",
    "ReplayResult",
    "ReplayStep",
    "SelectorConfig",
    "Traces",
    "compare_replay",
    "end_of_row_logprobs",
    "iter_replay",
    "left_pad",
    "load_traces",
    "match_runs",
    "record_traces",
    "replay",
    "save_traces",
    "selector_grid",
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
    matches = (draft_tokens == target).to(torch.int64)
    return matches.cumprod(dim=2).sum(dim=2)


@dataclass(frozen=True)
class Traces:
    """Greedy traces of ``N`` requests, each ``T = max_new_tokens`` tokens long.

    Attributes:
        prompt_ids: ``N`` 1-D int64 tensors, the prompts (used for context lengths).
        output_ids: ``[N, T]`` int64, the target's greedy output (EOS does not stop it).
        draft_tokens: ``[N, T, K_max]`` int64, the draft's greedy continuation at each position.
        draft_logprobs: ``[N, T, K_max]`` float32, the draft's log-probability of each of them.
        meta: JSON-compatible description (models, dtype, versions, ...).
    """

    prompt_ids: list[Tensor]
    output_ids: Tensor  # [N, T] int64
    draft_tokens: Tensor  # [N, T, K_max] int64
    draft_logprobs: Tensor  # [N, T, K_max] float32
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_tensor("output_ids", self.output_ids, rank=2)
        check_tensor("draft_tokens", self.draft_tokens, rank=3)
        check_tensor("draft_logprobs", self.draft_logprobs, rank=3)
        n, length = self.output_ids.shape
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
        if not self.draft_logprobs.is_floating_point():
            raise TypeError(
                f"draft_logprobs must be floating point, got {self.draft_logprobs.dtype}"
            )
        if len(self.prompt_ids) != n:
            raise ValueError(
                f"prompt_ids must hold {n} prompts (one per request), got {len(self.prompt_ids)}"
            )

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

    def subset(self, indices: Sequence[int]) -> Traces:
        """The traces of the requests ``indices``, in that order."""
        index = torch.as_tensor(list(indices), dtype=torch.int64)
        return Traces(
            prompt_ids=[self.prompt_ids[i] for i in index.tolist()],
            output_ids=self.output_ids[index],
            draft_tokens=self.draft_tokens[index],
            draft_logprobs=self.draft_logprobs[index],
            meta=dict(self.meta),
        )


def save_traces(traces: Traces, path: str | Path) -> Path:
    """Write ``traces`` to one ``.pt`` file (plain tensors, lists and JSON-like metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        # A JSON round trip turns str subclasses (torch.__version__) and paths into plain
        # strings, which weights_only unpickling accepts.
        "meta": json.loads(json.dumps(traces.meta, default=str)),
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
        ValueError: the file is not a specselect trace file of a supported version.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt or foreign files
        raise ValueError(f"{str(path)!r} is not a readable trace file: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise ValueError(f"{str(path)!r} is not a specselect trace file")
    if payload.get("version") != TRACE_VERSION:
        raise ValueError(
            f"{str(path)!r} has trace format version {payload.get('version')!r}; this "
            f"specselect reads version {TRACE_VERSION}"
        )
    return Traces(
        prompt_ids=list(payload["prompt_ids"]),
        output_ids=payload["output_ids"],
        draft_tokens=payload["draft_tokens"],
        draft_logprobs=payload["draft_logprobs"],
        meta=dict(payload["meta"]),
    )


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


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


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
        model: a causal LM returning ``.logits`` and ``.past_key_values``.
        contexts: ``b`` non-empty 1-D int64 token tensors.
        steps: tokens to generate per context.

    Returns:
        ``([b, steps] int64 tokens, [b, steps] float32 log-probs)`` on the CPU.
    """
    device = _model_device(model)
    ids, mask = left_pad(contexts, device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    tokens, logprobs = [], []
    cache = None
    step_ids, step_pos = ids, positions
    for _ in range(steps):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        cache = out.past_key_values
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


def _describe_model(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    return {
        "name_or_path": str(getattr(config, "_name_or_path", "") or type(model).__name__),
        "class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _versions() -> dict[str, str]:
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


def _as_prompt(prompt: Tensor | Sequence[int], index: int) -> Tensor:
    t = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).cpu()
    if t.numel() == 0:
        raise ValueError(f"prompts[{index}] is empty; every prompt needs at least one token")
    return t


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
    """Record greedy traces of ``prompts`` (see the module docstring).

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
        meta: extra JSON-compatible metadata stored with the traces.
    """
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("max_k", max_k, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    if len(prompts) == 0:
        raise ValueError("prompts is empty; record_traces needs at least one prompt")
    prompt_ids = [_as_prompt(p, i) for i, p in enumerate(prompts)]
    n = len(prompt_ids)

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
        "target": _describe_model(target),
        "draft": _describe_model(draft),
        "max_new_tokens": max_new_tokens,
        "max_k": max_k,
        "num_requests": n,
        "eos_stops": False,
        "versions": _versions(),
        **(meta or {}),
    }
    return Traces(
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        draft_tokens=draft_tokens.reshape(n, max_new_tokens, max_k),
        draft_logprobs=draft_logprobs.reshape(n, max_new_tokens, max_k),
        meta=info,
    )


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="seq", leave=False)


# --------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------


class OracleSelector(Selector):
    """Replay-only upper bound: knows each request's true run length and spends the budget on it.

    Each step it maximises ``sum_i min(L_i, run_i)`` subject to ``sum_i L_i <= C`` and ``L_i <=
    available_i``. Any token beyond ``min(run_i, available_i)`` is a sure rejection, so the optimum
    is to verify only those *useful* tokens, as many as the budget allows: every selected token
    is accepted (VSR = 1). When the budget is short, shallower positions are served first, then
    lower rows, which spreads it over as many requests as possible; every such choice has the
    same value this step.

    Args:
        k: mean window; the budget is ``C = k * num_active`` unless ``budget`` is given.
        extra: drafted tokens beyond ``k`` (window ``K = k + extra``), as for TETRIS.
        budget: a fixed total ``C`` per step instead.

    :func:`replay` calls :meth:`set_runs` before every :meth:`select`; no real decoding loop can.
    """

    name = "oracle"

    def __init__(self, k: int, extra: int = 2, budget: int | None = None) -> None:
        self.k = check_int("k", k)
        self.extra = check_int("extra", extra)
        self.budget = None if budget is None else check_int("budget", budget)
        self._runs: Tensor | None = None

    def draft_length(self, num_active: int) -> int:
        check_int("num_active", num_active)
        return self.k + self.extra

    def set_runs(self, runs: Tensor) -> None:
        """Reveal this step's true run lengths, ``runs`` ``[B]`` int64 (used by the next select)."""
        check_tensor("runs", runs, rank=1)
        if runs.dtype.is_floating_point or runs.dtype == torch.bool:
            raise TypeError(f"runs must be an integer tensor, got {runs.dtype}")
        self._runs = runs

    def _select(self, draft_logprobs: Tensor, active: Tensor | None) -> Selection:
        runs, self._runs = self._runs, None  # one step only: a stale run would be a lie
        rows, width = draft_logprobs.shape
        if runs is None:
            raise ValueError(
                "OracleSelector needs the true run lengths: call set_runs(runs) "
                "before select (replay does)"
            )
        if runs.shape[0] != rows or runs.device != draft_logprobs.device:
            raise ValueError(
                f"runs must have shape [{rows}] on {draft_logprobs.device}, got "
                f"{tuple(runs.shape)} on {runs.device}"
            )
        useful = torch.minimum(available_lengths(draft_logprobs), runs.to(torch.int64))
        useful = mask_inactive(useful.clamp(min=0), active)
        if self.budget is not None:
            budget: Tensor | int = self.budget
        elif active is None:
            budget = self.k * rows
        else:
            budget = self.k * active.sum()
        mask = _fill_levels(prefix_mask(useful, width), budget)
        return Selection.from_lengths(mask.sum(dim=1), width)


def _fill_levels(candidates: Tensor, budget: Tensor | int) -> Tensor:
    """Keep the first ``budget`` candidates in column-major order (position, then row).

    Args:
        candidates: ``[B, K]`` bool, prefix-closed per row.
        budget: Python int or 0-dim integer tensor (no host read either way).

    Returns:
        ``[B, K]`` bool, prefix-closed: a row's position ``j`` comes before its ``j + 1`` in
        column-major order, so it is never dropped while a deeper one is kept.
    """
    rows, width = candidates.shape
    order = candidates.t().reshape(-1).to(torch.int64).cumsum(dim=0)  # column-major rank
    rank = order.reshape(width, rows).t()  # [B, K]
    return candidates & (rank <= budget)


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


def end_of_row_logprobs(draft_logprobs: Tensor, remaining: Tensor) -> Tensor:
    """Apply the end-of-request convention: no draft token at positions ``j >= remaining - 1``.

    Args:
        draft_logprobs: ``[B, K]`` log-probs.
        remaining: ``[B]`` int64 tokens each request may still emit.

    Returns:
        ``[B, K]`` with ``-inf`` where a verified token could not be emitted (every step emits
        accepted + 1 tokens, so at most ``remaining - 1`` draft tokens can be accepted).
    """
    allowed = prefix_mask((remaining - 1).clamp(min=0), draft_logprobs.shape[1])
    return draft_logprobs.masked_fill(~allowed, NEG_INF)


@dataclass(frozen=True)
class ReplayStep:
    """Everything one replayed step saw and decided (for inspection and tests).

    Attributes:
        index: step number (0-based).
        requests: ``[S]`` int64 request in each slot (``-1`` = empty slot).
        positions: ``[S]`` int64 tokens each slot's request had emitted before the step.
        window: ``K``, the draft length the selector asked for.
        draft_logprobs: ``[S, K]`` what the selector was shown (``-inf`` past the end and in
            empty slots).
        active: ``[S]`` bool.
        runs: ``[S]`` int64 true run lengths, capped at ``remaining - 1`` (0 in empty slots).
        selection: the selector's choice.
        accepted: ``[S]`` int64 ``min(lengths, runs)``.
        counts: the step's :class:`~specselect.metrics.StepCounts` (seconds = modelled).
        context: mean context length used by the cost model.
    """

    index: int
    requests: Tensor  # [S] int64
    positions: Tensor  # [S] int64
    window: int
    draft_logprobs: Tensor  # [S, K]
    active: Tensor  # [S] bool
    runs: Tensor  # [S] int64
    selection: Selection
    accepted: Tensor  # [S] int64
    counts: StepCounts
    context: float


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` measured.

    Attributes:
        steps: per-step counts (``seconds`` = modelled by the cost model).
        windows: draft length ``K`` of each step.
        accepted_per_step: per step, ``[S]`` int64 accepted draft tokens per slot (0 if empty).
        request_verified / request_accepted / request_emitted / request_steps: ``[N]`` int64
            per-request totals; ``request_seconds``: ``[N]`` float64 modelled latency (from
            the request's first step to its last, queueing excluded).
        selector: ``repr`` of the selector.
    """

    steps: list[StepCounts]
    windows: list[int]
    accepted_per_step: list[Tensor]
    request_verified: Tensor  # [N] int64
    request_accepted: Tensor  # [N] int64
    request_emitted: Tensor  # [N] int64
    request_steps: Tensor  # [N] int64
    request_seconds: Tensor  # [N] float64
    selector: str = ""
    reliability: Tensor | None = None  # [3, RELIABILITY_BINS]: predicted sum, passed, tested

    def calibration(self) -> list[dict[str, float]]:
        """Reliability diagram data: per bin of predicted acceptance, the mean prediction, the
        observed acceptance rate and the number of tokens the target tested (bins with none
        are left out)."""
        if self.reliability is None:
            return []
        predicted, passed, tested = self.reliability.tolist()
        return [
            {"predicted": p / n, "observed": a / n, "tokens": n}
            for p, a, n in zip(predicted, passed, tested, strict=True)
            if n > 0
        ]

    @cached_property
    def totals(self) -> Totals:
        """Totals over the run (metrics as defined in :mod:`specselect.metrics`)."""
        return Totals.of(self.steps)


def _check_traces(traces: object) -> Traces:
    if not isinstance(traces, Traces):
        raise TypeError(f"traces must be a specselect.replay.Traces, got {type(traces).__name__}")
    return traces


def _check_selection(selection: Selection, active: Tensor, window: int, selector: Selector) -> None:
    """Replay trusts selectors only after checking the contract it relies on (cheap, offline)."""
    lengths = selection.lengths
    if lengths.shape != active.shape:
        raise RuntimeError(
            f"{selector!r} returned lengths of shape {tuple(lengths.shape)}, "
            f"expected {tuple(active.shape)}"
        )
    bad = ((lengths < 0) | (lengths > window) | (~active & (lengths != 0))).any()
    if bool(bad):
        raise RuntimeError(
            f"{selector!r} returned lengths outside 0..{window} or gave an "
            "inactive slot a non-zero length"
        )


def _draft_window(selector: Selector, num_active: int, max_k: int) -> int:
    window = selector.draft_length(num_active)
    if window > max_k:
        raise ValueError(
            f"{selector!r} asks for a draft window of {window} tokens but the traces hold only "
            f"max_k={max_k}; record them with max_k >= {window}"
        )
    return window


def iter_replay(
    traces: Traces,
    selector: Selector,
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    refill: bool = True,
) -> Iterator[ReplayStep]:
    """Replay ``selector`` over ``traces`` step by step (see :func:`replay`); yields each step."""
    traces = _check_traces(traces)
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a specselect Selector, got {type(selector).__name__}")
    slots = check_int("slots", slots, minimum=1)
    cost_model = CostModel() if cost_model is None else cost_model
    n, length, max_k = traces.num_requests, traces.max_new_tokens, traces.max_k
    prompt_lengths = traces.prompt_lengths
    selector.reset()

    requests = torch.full((slots,), -1, dtype=torch.int64)  # [S]
    positions = torch.zeros(slots, dtype=torch.int64)  # [S]
    queued = 0
    index = 0
    while True:
        free = requests < 0
        if queued < n and (refill or bool(free.all())):
            new = _refill(requests, positions, free, queued, n)
            queued += int(new.sum())
        active = requests >= 0
        num_active = int(active.sum())
        if num_active == 0:
            return
        window = _draft_window(selector, num_active, max_k)
        shown, runs = _offer(traces, requests, positions, window)
        if isinstance(selector, OracleSelector):
            selector.set_runs(runs)
        # Request ids follow requests: a refilled slot gets a new id and its state is reset.
        selection = selector.select(shown, active, request_ids=requests)
        _check_selection(selection, active, window, selector)
        accepted = torch.minimum(selection.lengths, runs)
        selector.update(selection, accepted)
        step_context = (
            _mean_context(prompt_lengths, requests, positions)
            if context is None
            else float(context)
        )
        verified = int(selection.lengths.sum())
        accepted_total = int(accepted.sum())
        counts = StepCounts(
            active=num_active,
            verified=verified,
            accepted=accepted_total,
            emitted=accepted_total + num_active,
            seconds=cost_model.step_time(num_active, window, verified, step_context),
        )
        yield ReplayStep(
            index,
            requests.clone(),
            positions.clone(),
            window,
            shown,
            active,
            runs,
            selection,
            accepted,
            counts,
            step_context,
        )
        positions += torch.where(active, accepted + 1, 0)
        finished = active & (positions >= length)
        requests[finished] = -1
        positions[finished] = 0
        index += 1


def _offer(
    traces: Traces, requests: Tensor, positions: Tensor, window: int
) -> tuple[Tensor, Tensor]:
    """What the selector is shown this step, and the true runs (hidden from real selectors).

    Args:
        traces: the recording.
        requests: ``[S]`` int64 request per slot (``-1`` = empty).
        positions: ``[S]`` int64 tokens emitted so far by each slot's request.
        window: ``K``.

    Returns:
        ``([S, K] log-probs, [S] int64 runs)``: ``-inf`` past each request's end and in empty
        slots; runs capped at ``remaining - 1`` (what can still be accepted), 0 in empty slots.
    """
    length = traces.max_new_tokens
    active = requests >= 0
    req, pos = requests.clamp(min=0), positions.clamp(max=length - 1)
    remaining = torch.where(active, length - positions, 0)
    shown = end_of_row_logprobs(traces.draft_logprobs[req, pos, :window], remaining)
    shown = shown.masked_fill(~active.unsqueeze(1), NEG_INF)
    runs = torch.where(active, traces.runs[req, pos].clamp(max=length - 1 - pos), 0)
    return shown, runs


def _mean_context(prompt_lengths: Tensor, requests: Tensor, positions: Tensor) -> float:
    """Mean context (prompt + emitted tokens) of the active slots, for the cost model."""
    active = requests >= 0
    contexts = prompt_lengths[requests.clamp(min=0)] + positions  # [S]
    return float(contexts[active].double().mean())


def _refill(requests: Tensor, positions: Tensor, free: Tensor, queued: int, n: int) -> Tensor:
    """Put the next queued requests into free slots (lowest slot first); returns ``[S]`` new."""
    free_slots = free.nonzero().squeeze(1)[: n - queued]
    requests[free_slots] = torch.arange(queued, queued + free_slots.numel())
    positions[free_slots] = 0
    new = torch.zeros_like(free)
    new[free_slots] = True
    return new


def replay(
    traces: Traces,
    selector: Selector,
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    refill: bool = True,
) -> ReplayResult:
    """Replay ``selector`` exactly over greedy ``traces`` through ``slots`` batch slots.

    Requests enter in trace order. Each step: empty slots take the next queued requests (with
    ``refill=False``, only when *all* slots are empty — static batches, as
    ``speculative_generate`` runs them); ``K = selector.draft_length(num_active)``; the selector
    sees the ``[slots, K]`` recorded log-probs (``-inf`` past each request's end and in empty
    slots, which are also inactive); each active request accepts ``min(L, run)`` and advances by
    that + 1; ``selector.update`` gets the accepted counts. A slot whose request finished is
    refilled at the next step. The selector receives each slot's request id
    (``request_ids``), so per-request state follows requests: a slot whose id changed is reset.

    Args:
        traces: recorded (or synthetic) traces.
        selector: any :class:`~specselect.selection.Selector`; ``selector.reset()`` is called
            first. An :class:`OracleSelector` is handed the true runs each step.
        slots: batch slots.
        cost_model: prices each step (``CostModel.step_time(active, K, verified, context)``);
            the default :class:`~specselect.cost.CostModel` if None.
        context: context length for the cost model; None uses the mean context (prompt +
            emitted tokens) of the active requests at each step.
        refill: refill slots as soon as they free up (a serving stream) or only in waves.

    Raises:
        ValueError: the selector asks for a window longer than the traces' ``max_k``.
    """
    traces = _check_traces(traces)
    n = traces.num_requests
    steps: list[StepCounts] = []
    windows: list[int] = []
    accepted_per_step: list[Tensor] = []
    per_request = torch.zeros(4, n, dtype=torch.int64)  # verified, accepted, emitted, steps
    reliability = torch.zeros(3, RELIABILITY_BINS, dtype=torch.float64)
    first = torch.full((n,), -1, dtype=torch.int64)
    last = torch.full((n,), -1, dtype=torch.int64)
    for step in iter_replay(traces, selector, slots, cost_model, context, refill=refill):
        steps.append(step.counts)
        windows.append(step.window)
        accepted_per_step.append(step.accepted)
        req = step.requests[step.active]
        stats = torch.stack(
            [
                step.selection.lengths,
                step.accepted,
                step.accepted + 1,
                torch.ones_like(step.accepted),
            ]
        )[:, step.active]
        per_request.index_add_(1, req, stats)
        if selector.last_scores is not None:
            _add_reliability(reliability, selector.last_scores, step)
        first[req] = torch.where(first[req] < 0, step.index, first[req])
        last[req] = step.index
    cumulative = torch.tensor([0.0] + [s.seconds for s in steps], dtype=torch.float64).cumsum(0)
    request_seconds = cumulative[last + 1] - cumulative[first.clamp(min=0)]
    return ReplayResult(
        steps=steps,
        windows=windows,
        accepted_per_step=accepted_per_step,
        request_verified=per_request[0],
        request_accepted=per_request[1],
        request_emitted=per_request[2],
        request_steps=per_request[3],
        request_seconds=request_seconds,
        selector=repr(selector),
        reliability=reliability if reliability[2].sum() > 0 else None,
    )


RELIABILITY_BINS = 10


def _add_reliability(reliability: Tensor, scores: Tensor, step: ReplayStep) -> None:
    """Accumulate predicted vs observed acceptance of the tokens the target tested this step."""
    tested, passed = observed_outcomes(step.selection.lengths, step.accepted, scores.shape[1])
    predicted = scores.exp().nan_to_num(0.0).to(torch.float64)[tested]
    cells = (predicted * RELIABILITY_BINS).to(torch.int64).clamp(0, RELIABILITY_BINS - 1)
    reliability[0].index_add_(0, cells, predicted)
    reliability[1].index_add_(0, cells, passed[tested].to(torch.float64))
    reliability[2].index_add_(0, cells, torch.ones_like(predicted))


# --------------------------------------------------------------------------------------------
# Selector grids and comparison
# --------------------------------------------------------------------------------------------

DEFAULT_THRESHOLD = 0.4
"""Confidence threshold for selectors that need one (HF's ``assistant_confidence_threshold``)."""


@dataclass(frozen=True)
class SelectorConfig:
    """One selector configuration of a comparison grid.

    Attributes:
        name: registry name, or ``"oracle"``.
        k: the mean window (budget per request) the configuration is compared at.
        extra: drafted tokens beyond ``k``; None for selectors without that notion (fixed SD).
        budget: absolute budget ``C`` per step; None = the selector's default.
        kwargs: constructor arguments (a cost model is added at build time when the selector
            takes one).
    """

    name: str
    k: int
    extra: int | None
    budget: int | None
    kwargs: dict[str, Any]

    @property
    def label(self) -> str:
        parts = [self.name, f"k={self.k}"]
        if self.extra is not None:
            parts.append(f"extra={self.extra}")
        if self.budget is not None:
            parts.append(f"C={self.budget}")
        return " ".join(parts)

    def build(self, cost_model: CostModel | None = None) -> Selector:
        """A fresh selector (the oracle, or from the registry via ``make_selector``)."""
        if self.name == OracleSelector.name:
            return OracleSelector(**self.kwargs)
        from specselect.registry import make_selector
        from specselect.selectors import SELECTORS

        base, estimator = split_spec(self.name)
        kwargs = dict(self.kwargs)
        if "cost_model" in _parameters(SELECTORS[base]) and cost_model is not None:
            kwargs["cost_model"] = cost_model
        return make_selector(base, **kwargs, **_estimator_kwargs(base, estimator))


NO_ESTIMATOR = "none"
"""Spec suffix for a selector without acceptance estimator or guard (``tetris+none``: the
paper's TETRIS)."""


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"tetris+history"`` -> ``("tetris", "history")``; ``"fixed"`` -> ``("fixed", None)``."""
    base, _, estimator = spec.partition("+")
    return base, estimator or None


def _estimator_kwargs(base: str, estimator: str | None) -> dict[str, Any]:
    """Constructor arguments that select ``estimator`` for selector ``base``."""
    if estimator is None:
        return {}
    from specselect.selectors import SELECTORS

    takes_guard = "guard" in _parameters(SELECTORS[base])
    if estimator == NO_ESTIMATOR:
        return {"estimator": None, **({"guard": False} if takes_guard else {})}
    return {"estimator": estimator}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def _grid_kwargs(
    name: str, params: dict[str, inspect.Parameter], k: int, extra: int, budget: int | None
) -> tuple[dict[str, Any], bool]:
    """Map the grid point ``(k, extra, budget)`` onto a selector's own parameters.

    Returns ``(kwargs, uses_extra)``. The mapping: ``k`` and ``k0`` (a starting window) get
    ``k``; ``extra`` gets ``extra``; ``max_k`` gets ``k + extra`` (dynamic selectors may draft as
    far as TETRIS does); ``budget`` gets ``budget``; a ``threshold`` without a default gets
    :data:`DEFAULT_THRESHOLD`. Any other required parameter is an error.
    """
    offers: dict[str, Any] = {"k": k, "k0": k, "extra": extra, "max_k": k + extra}
    if budget is not None:
        offers["budget"] = budget
    kwargs = {p: v for p, v in offers.items() if p in params}
    if "threshold" in params and params["threshold"].default is inspect.Parameter.empty:
        kwargs["threshold"] = DEFAULT_THRESHOLD
    missing = [
        p
        for p, spec in params.items()
        if p not in kwargs
        and p != "cost_model"
        and spec.default is inspect.Parameter.empty
        and spec.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if missing:
        raise ValueError(
            f"selector {name!r} needs {', '.join(missing)}, which a compare grid "
            "(k, extra, budget) cannot set"
        )
    return kwargs, "extra" in kwargs or "max_k" in kwargs


def selector_grid(
    names: Sequence[str],
    ks: Sequence[int],
    extras: Sequence[int],
    budgets: Sequence[int] = (),
) -> list[SelectorConfig]:
    """Every configuration of ``names`` over the ``k`` / ``extra`` / ``budget`` grids.

    Selectors without an ``extra`` notion (fixed SD) get one configuration per ``k``; only
    selectors taking ``budget`` are repeated over ``budgets`` (in addition to their default
    budget). ``"oracle"`` is accepted besides the registry names, and a name may carry an
    acceptance estimator for selectors that take one: ``"tetris+calibrated"``,
    ``"tetris+history"`` (TETRIS's default), ``"tetris+none"`` (the paper: no estimator, no
    guard).

    Raises:
        ValueError: unknown selector name, empty or negative grids.
    """
    from specselect.registry import available_selectors
    from specselect.selectors import SELECTORS

    known: dict[str, type[Selector]] = {**SELECTORS, OracleSelector.name: OracleSelector}
    estimators = [NO_ESTIMATOR, *sorted(ESTIMATORS)]
    for grid_name, grid, minimum in (("k", ks, 1), ("extra", extras, 0), ("budget", budgets, 0)):
        for value in grid:
            check_int(f"{grid_name} grid value", value, minimum=minimum)
    if not ks or not extras:
        raise ValueError("the k and extra grids must not be empty")
    configs: list[SelectorConfig] = []
    seen: set[tuple[Any, ...]] = set()
    for name in names:
        base, estimator = split_spec(name)
        if base not in known:
            raise ValueError(
                f"unknown selector {name!r}; expected one of "
                f"{', '.join([*available_selectors(), OracleSelector.name])}, optionally with "
                f"+estimator ({', '.join(estimators)}) for selectors that take one"
            )
        params = _parameters(known[base])
        if estimator is not None and ("estimator" not in params or estimator not in estimators):
            raise ValueError(
                f"selector spec {name!r}: {base!r} takes no estimator"
                if "estimator" not in params
                else f"selector spec {name!r}: unknown estimator {estimator!r}; expected one of "
                f"{', '.join(estimators)}"
            )
        for k in ks:
            for extra in extras:
                for budget in [None, *budgets] if "budget" in params else [None]:
                    kwargs, uses_extra = _grid_kwargs(name, params, k, extra, budget)
                    key = (name, k, extra if uses_extra else None, budget)
                    if key not in seen:
                        seen.add(key)
                        configs.append(SelectorConfig(name, k, key[2], budget, kwargs))
    return configs


def compare_replay(
    traces: Traces,
    configs: Sequence[SelectorConfig],
    slots: int,
    cost_model: CostModel | None = None,
    context: float | None = None,
    *,
    progress: bool = False,
) -> list[tuple[SelectorConfig, ReplayResult]]:
    """Replay every configuration over the same traces (each with a fresh selector)."""
    cost_model = CostModel() if cost_model is None else cost_model
    results = []
    iterator: Any = configs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(configs, desc="replaying", unit="config", leave=False)
    for config in iterator:
        selector = config.build(cost_model)
        results.append((config, replay(traces, selector, slots, cost_model, context)))
    return results


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
