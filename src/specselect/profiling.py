"""Measuring a :class:`~specselect.cost.CostModel` on real models, and plotting the fit.

:meth:`CostModel.measure <specselect.cost.CostModel.measure>` (through :func:`measure_samples`)
times the forward passes the HF loop makes, the way it makes them: each pass goes through
:meth:`specselect.hf.ModelCache.forward` (static KV cache, 4D mask, explicit positions) as a
*stage* of a :class:`specselect.hf.graphs.StageRunner`, eagerly or captured in a CUDA graph and
replayed. For every context length and batch size of the grid it times

* one draft pass: one token per row, logits of the last column only (as the drafter runs);
* one verification pass per width ``W``: ``W`` tokens per row, all logits (as the verify stage
  runs; in the loop ``W = k + 1``, the pending token and ``k`` drafts, or on a CPU in eager
  mode the widest row's selection plus one).

Each pass writes the same cache columns again and again (the write position is rewound between
calls), over a cache whose first ``context`` columns per row count as tokens of the sequence:
they hold zeros instead of real keys and values, which costs the same. A pass attends over
the columns the loop's pass would at that many written columns (eagerly the written ones and
its own rounded up to :data:`~specselect.hf.kv.SPAN_ALIGNMENT`; in graph mode the whole
capacity, ``context`` plus the widest pass, aligned likewise). Every timing is
synchronised with the device. The first calls of a shape are warm-up (graph mode captures
there); then every shape of a context is timed once per round, ``repeats`` rounds, so that a
slow spell of a shared machine slows every shape a little rather than one shape a lot. A
shape's sample is the median of its calls, or their minimum
(:data:`~specselect.cost.STATISTICS`). The verification, selection and bookkeeping around the
passes are not timed: next to a model's forward they are small, and they do not depend on the
model.

Contexts are timed one after another (each needs its own caches), so a machine that gets busier
while the later contexts are timed makes passes look as if they cost in proportion to the
context, and the fit of several contexts then prices verification at context 0 as free, which
:meth:`CostModel.fit <specselect.cost.CostModel.fit>` refuses. Then the grid is timed once more
with the contexts in reverse order and each shape keeps the faster of its two samples
(interference only adds time; ``details["measurements"]`` of the source says 2). If the fit is
still free, the error shows the times per context and what to change.

:func:`plot_cost_model` draws the samples against the fitted model (matplotlib, optional);
:func:`format_cost_model` summarises a model in a few lines.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specselect._checks import check_int, check_usable_device
from specselect.cost import STATISTICS, CostModel, CostSample, CostSource, PassCost, _fit_kind

if TYPE_CHECKING:
    from specselect.hf.compat import ModelHandle
    from specselect.hf.graphs import Mode, StageRunner
    from specselect.hf.kv import ModelCache
    from specselect.hf.memory import CacheNeed

__all__ = ["check_grid", "format_cost_model", "measure_samples", "plot_cost_model"]


def measure_samples(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    *,
    device: str | torch.device | None,
    dtype: torch.dtype | None,
    batch_sizes: Sequence[int],
    widths: Sequence[int],
    contexts: Sequence[int],
    cuda_graphs: bool | None,
    repeats: int,
    warmup: int,
    statistic: str,
    progress: bool,
    note: str,
) -> tuple[list[CostSample], CostSource]:
    """The timings behind :meth:`CostModel.measure <specselect.cost.CostModel.measure>` (which
    documents the arguments), and what they were measured on."""
    from specselect.hf.generate import graph_mode

    batches, width_grid, context_grid = check_grid(batch_sizes, widths, contexts)
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=1)
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    if not isinstance(note, str):
        raise TypeError(f"note must be a str, got {type(note).__name__}")
    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    handles = _prepared(models, device, dtype, batches, width_grid, context_grid)
    mode = graph_mode(cuda_graphs, handles["target"], handles.get("draft"), ())
    vocab = min(h.vocab for h in handles.values())
    load_before = _load_average()
    shapes = len(batches) * (len(width_grid) + ("draft" in handles))
    from tqdm.auto import tqdm

    calls = len(context_grid) * shapes * (warmup + repeats)

    def time_contexts(order: Sequence[int], done: Callable[[int], object]) -> list[CostSample]:
        samples: list[CostSample] = []
        for context in order:  # one context's caches at a time: freed before the next
            passes = _passes(handles, batches, width_grid, context, vocab, mode)
            samples += _time_round_robin(passes, repeats, warmup, done, statistic)
            del passes
        return samples

    with (
        torch.no_grad(),
        tqdm(total=calls, desc="profiling", unit="pass", disable=not progress) as bar,
    ):
        samples, measurements = time_contexts(context_grid, bar.update), 1
        free = _fits_free_verification(samples)
        if free and len(context_grid) > 1:
            bar.total += calls
            samples = _faster(samples, time_contexts(context_grid[::-1], bar.update))
            measurements, free = 2, _fits_free_verification(samples)
    if free:
        raise ValueError(_free_verification_message(samples, measurements, load_before))
    grid = {
        "batch_sizes": batches,
        "widths": width_grid,
        "contexts": context_grid,
        "repeats": repeats,
        "warmup": warmup,
        "statistic": statistic,
    }
    return samples, _source(models, handles["target"], mode, grid, note, measurements, load_before)


def _prepared(
    models: dict[str, torch.nn.Module],
    device: str | torch.device | None,
    dtype: torch.dtype | None,
    batches: list[int],
    widths: list[int],
    contexts: list[int],
) -> dict[str, ModelHandle]:
    """Each model checked, then moved to ``device`` and ``dtype``, as a handle; refused before
    any pass if the grid's longest context does not fit a model, or its caches the memory."""
    from specselect.hf.compat import ModelHandle, check_context_fits
    from specselect.hf.memory import check_memory

    for name, model in models.items():
        ModelHandle.of(name, model)  # the checks, before anything moves
        _move(model, device, dtype)
    handles = {name: ModelHandle.of(name, model) for name, model in models.items()}
    for name, handle in handles.items():
        check_context_fits(
            name,
            handle,
            max(contexts) + max(widths),
            "the largest context plus the widest verify pass",
            "lower contexts or widths",
        )
    check_memory(
        _memory_needs(handles, batches, widths, max(contexts)),
        f"profiling at context {max(contexts)} with batch sizes {batches} (the caches of "
        "every batch size are allocated together)",
        "the largest context, batch size or width",
    )
    return handles


def _source(
    models: dict[str, torch.nn.Module],
    target: ModelHandle,
    mode: str,
    grid: Mapping[str, Any],
    note: str,
    measurements: int,
    load_before: list[float] | None,
) -> CostSource:
    """What the samples were measured on: hardware, dtype, mode, versions, models, the grid,
    and the run's details (how many times the grid was measured, the load averages)."""
    from specselect.replay.traces import describe_model, package_versions

    now = datetime.datetime.now(datetime.timezone.utc)
    details = {
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "measurements": measurements,
        "measured_at": now.isoformat(timespec="seconds"),
    }
    return CostSource(
        hardware=_hardware(target.device),
        dtype=str(target.dtype).replace("torch.", ""),
        mode=mode,
        versions=package_versions(),
        models={name: describe_model(model) for name, model in models.items()},
        grid=grid,
        details=details,
        note=note,
    )


class _Pass:
    """One pass shape to time: its inputs and its stage over a shared cache.

    Passes of one model, batch size and context share a cache and a stage runner (whose
    captures refer to that cache); each writes the same columns, from ``context`` on, at every
    call.
    """

    def __init__(
        self,
        kind: str,
        cache: ModelCache,
        runner: StageRunner,
        width: int,
        context: int,
        vocab: int,
    ) -> None:
        self.kind, self.cache, self.runner = kind, cache, runner
        self.batch, self.width, self.context = cache.slots, width, context
        self.device = cache.pos.device
        generator = torch.Generator().manual_seed(self.batch * 1009 + width * 17 + context)
        ids = torch.randint(vocab, (self.batch, width), generator=generator)  # [B, W]
        self.ids = ids.to(self.device)  # [B, W] int64
        self.valid = torch.ones(self.batch, width, dtype=torch.bool, device=self.device)  # [B, W]
        self.seconds: list[float] = []

    def stage(self) -> None:
        """The pass, as the loop runs it: the drafter needs the last column's logits only."""
        self.cache.forward(self.ids, self.valid, last_only=self.kind == "draft")

    def time_once(self) -> float:
        """Seconds of one synchronised call through the stage runner."""
        self.cache.rewind(self.context)
        self.cache.reserve(self.width)  # (eager mode: the span the loop's pass would attend)
        _synchronize(self.device)
        start = time.perf_counter()
        self.runner((self.kind, self.width), self.stage)
        _synchronize(self.device)
        return time.perf_counter() - start

    def sample(self, statistic: str) -> CostSample:
        """The timed calls' median or minimum; a draft sample is one pass, a verification
        sample one pass over ``batch * width`` tokens."""
        tokens = 1 if self.kind == "draft" else self.batch * self.width
        seconds = statistics.median(self.seconds) if statistic == "median" else min(self.seconds)
        return CostSample(self.kind, self.batch, tokens, float(self.context), seconds)


def _cache_for(
    handle: ModelHandle, batch: int, context: int, widths: Sequence[int], mode: Mode
) -> tuple[ModelCache, StageRunner]:
    """A static cache of ``batch`` rows whose first ``context`` columns count as cached tokens
    (zeros: they cost what real keys and values cost), room for the widest pass, and a stage
    runner for it. Its passes attend over what the loop's would at ``context`` written columns:
    eagerly over those and the pass's own, rounded up to the alignment; in graph mode over the
    whole (aligned) capacity. One eager pass allocates its buffers, as the loop's prefill
    does: never inside a stage."""
    from specselect.hf.graphs import StageRunner
    from specselect.hf.kv import ModelCache

    capacity = _capacity(context, widths)
    cache = ModelCache(handle, slots=batch, capacity=capacity, static_span=mode != "eager")
    cache.valid[:, :context] = True
    cache.count.fill_(context)
    cache.mark.fill_(context)
    cache.rewind(context)
    cache.reserve(1)
    ids = torch.zeros(batch, 1, dtype=torch.int64, device=handle.device)  # [B, 1]
    cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), last_only=True)
    return cache, StageRunner(mode)


def _passes(
    handles: dict[str, ModelHandle],
    batches: Sequence[int],
    widths: Sequence[int],
    context: int,
    vocab: int,
    mode: Mode,
) -> list[_Pass]:
    """Every pass shape at one context, over one cache per model and batch size."""
    passes = []
    for kind, handle, batch, pass_widths in _caches(handles, batches, widths):
        cache, runner = _cache_for(handle, batch, context, pass_widths, mode)
        passes += [_Pass(kind, cache, runner, w, context, vocab) for w in pass_widths]
    return passes


def _caches(
    handles: dict[str, ModelHandle], batches: Sequence[int], widths: Sequence[int]
) -> list[tuple[str, ModelHandle, int, list[int]]]:
    """The caches of one context: per batch size, the draft's (if there is a draft), whose
    passes take one token per row, and the target's, with a pass at each width."""
    kinds = [("draft", "draft", [1]), ("verify", "target", list(widths))]
    return [
        (kind, handles[name], batch, pass_widths)
        for batch in batches
        for kind, name, pass_widths in kinds
        if name in handles
    ]


def _capacity(context: int, widths: Sequence[int]) -> int:
    """Columns per row of a cache at ``context``: room for its widest pass after it, aligned
    as the loop aligns its caches."""
    from specselect.hf.kv import aligned

    return aligned(context + max(widths))


def _memory_needs(
    handles: dict[str, ModelHandle], batches: Sequence[int], widths: Sequence[int], context: int
) -> list[CacheNeed]:
    """What the caches of ``context`` need (:mod:`specselect.hf.memory`): every pass attends
    over its cache's whole capacity."""
    from specselect.hf.memory import CacheNeed

    needs = []
    for _, handle, batch, pass_widths in _caches(handles, batches, widths):
        capacity = _capacity(context, pass_widths)
        needs.append(CacheNeed(handle, batch, capacity, max(pass_widths), capacity))
    return needs


def _time_round_robin(
    passes: list[_Pass],
    repeats: int,
    warmup: int,
    done: Callable[[int], object],
    statistic: str,
) -> list[CostSample]:
    """Warm every pass up, then time ``repeats`` rounds over all of them; one sample each.

    Round-robin rather than one shape after another: a slow spell of a shared machine then
    slows every shape a little instead of one shape a lot, and the medians stay comparable.
    ``done(n)`` is told of every ``n`` calls made (a progress bar).
    """
    for shape in passes:
        for _ in range(warmup):
            shape.time_once()
        done(warmup)
    for _ in range(repeats):
        for shape in passes:
            shape.seconds.append(shape.time_once())
        done(len(passes))
    return [p.sample(statistic) for p in passes]


def _fits_free_verification(samples: list[CostSample]) -> bool:
    """Whether the verification samples fit a pass that is free at context 0, which
    :meth:`CostModel.fit <specselect.cost.CostModel.fit>` refuses."""
    verify = [s for s in samples if s.kind == "verify"]
    return _fit_kind("verify", verify).is_free_at_context_zero()


def _shape(sample: CostSample) -> tuple[str, int, int, float]:
    return sample.kind, sample.batch, sample.tokens, sample.context


def _faster(first: list[CostSample], second: list[CostSample]) -> list[CostSample]:
    """Each shape's faster sample of two measurements of the same grid, in ``first``'s order."""
    again = {_shape(s): s for s in second}
    return [min(s, again[_shape(s)], key=lambda sample: sample.seconds) for s in first]


def _free_verification_message(
    samples: list[CostSample], measurements: int, load_before: list[float] | None
) -> str:
    """Why a measurement cannot be fitted: the smallest verification pass's time per context,
    and what to change."""
    verify = [s for s in samples if s.kind == "verify"]
    smallest = min(verify, key=lambda s: (s.tokens, s.batch))
    times = ", ".join(
        f"{s.seconds * 1e3:.3g} ms at context {s.context:g}"
        for s in sorted(verify, key=lambda s: s.context)
        if (s.batch, s.tokens) == (smallest.batch, smallest.tokens)
    )
    contexts = ", ".join(f"{c:g}" for c in sorted({s.context for s in verify}))
    how = "twice, the second time in reverse order of context" if measurements == 2 else "once"
    loads = [_minute_load(load) for load in (load_before, _load_average())]
    return (
        f"the verification passes timed at contexts {contexts} ({how}) fit a pass that costs "
        "nothing at context 0: their times grow as if only the context cost anything (the "
        f"pass of {smallest.batch} row(s) and {smallest.tokens} token(s) took {times}; load "
        f"average {loads[0]} before, {loads[1]} after). A machine that is busier while some "
        "contexts are timed does this. Profile on an idle machine, time more calls per shape "
        "(repeats, --repeats) or keep their minimum (statistic='min', --statistic min), or "
        "add a short context such as 0 (contexts, --contexts): it times the context-free "
        "cost directly"
    )


def _minute_load(load: list[float] | None) -> str:
    return "unknown" if load is None else f"{load[0]:g}"


def check_grid(
    batch_sizes: object, widths: object, contexts: object
) -> tuple[list[int], list[int], list[int]]:
    """The grid of :func:`measure`, sorted, or the error it would raise (before any timing)."""
    return (
        _grid("batch_sizes", batch_sizes, minimum=1, at_least=2),
        _grid("widths", widths, minimum=1, at_least=2),
        _grid("contexts", contexts, minimum=0, at_least=1),
    )


def _grid(name: str, values: object, *, minimum: int, at_least: int) -> list[int]:
    """A grid as a list of distinct ints >= ``minimum``, at least ``at_least`` of them."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    grid = [check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values)]
    if len(set(grid)) != len(grid):
        raise ValueError(f"{name} holds duplicates: {grid}")
    if len(grid) < at_least:
        why = {
            "batch_sizes": "the fit separates a per-row cost from the fixed one",
            "widths": "the fit separates a per-token cost from a per-row one",
        }.get(name, "nothing to measure otherwise")
        raise ValueError(
            f"{name} must hold at least {at_least} value(s) ({why}), got {len(grid)}: {grid}"
        )
    return sorted(grid)


def _move(model: torch.nn.Module, device: str | torch.device | None, dtype: object) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if device is not None:
        model.to(check_usable_device("device", device))
    if dtype is not None:
        model.to(dtype)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing must include it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (a busy machine times slower), where known."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    threads = torch.get_num_threads()
    return f"CPU {_cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# ---------------------------------------------------------------------------- plot


def plot_cost_model(model: CostModel, path: str | Path) -> Path:
    """Measured against fitted times: draft seconds per pass against the batch size, and
    verification seconds against the tokens in the pass (one series per width), one line style
    per context length. Needs matplotlib and a model with samples.

    Raises:
        ValueError: the model has no samples to show.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not model.samples:
        raise ValueError("the cost model has no samples to plot (it was not measured or fitted)")
    kinds = [k for k in ("draft", "verify") if any(s.kind == k for s in model.samples)]
    fig = Figure(figsize=(5.2 * len(kinds) + 0.6, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        _plot_kind(ax, model, kind)
    title = model.describe()
    errors = model.relative_errors()
    fig.suptitle(
        f"{title}\npoints: measured, lines: fitted (max relative error {max(errors):.1%})",
        fontsize=10,
    )
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def _plot_kind(ax: Any, model: CostModel, kind: str) -> None:
    samples = [s for s in model.samples if s.kind == kind]
    contexts = sorted({s.context for s in samples})
    styles = ["-", "--", ":", "-."]
    series: dict[tuple[float, int], list[CostSample]] = {}
    for s in samples:
        per_row = s.tokens // s.batch if kind == "verify" else 1
        series.setdefault((s.context, per_row), []).append(s)
    for index, ((context, per_row), points) in enumerate(sorted(series.items())):
        points.sort(key=lambda s: s.batch)
        xs = [s.batch if kind == "draft" else s.tokens for s in points]
        per_pass = [s.tokens if kind == "draft" else 1 for s in points]
        measured = [s.seconds / n * 1e3 for s, n in zip(points, per_pass, strict=True)]
        fitted = [model.predict(s) / n * 1e3 for s, n in zip(points, per_pass, strict=True)]
        label = f"W={per_row}" if kind == "verify" else "draft"
        if len(contexts) > 1:
            label += f", context {context:g}"
        color = f"C{index % 10}"
        ax.plot(xs, measured, "o", color=color, label=label)
        ax.plot(xs, fitted, styles[contexts.index(context) % 4], color=color)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the pass" if kind == "draft" else "tokens in the pass")
    ax.set_ylabel("ms per pass")
    ax.set_title("draft pass (1 token per row)" if kind == "draft" else "verification pass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


# ---------------------------------------------------------------------------- text


def format_cost_model(model: CostModel) -> str:
    """A few lines for a terminal: what the model is, its passes in ms, and its fit error."""
    lines = [f"cost model: {model.describe()}"]
    if model.source is not None and model.source.note:
        lines.append(f"note: {model.source.note}")
    for name, cost in (("draft pass", model.draft), ("verify pass", model.verify)):
        if cost is not None:
            lines.append(
                f"{name}: {_pass_text(cost, 'rows' if name == 'draft pass' else 'tokens')}"
            )
    errors = sorted(model.relative_errors())
    if errors:
        lines.append(
            f"fit: relative error median {statistics.median(errors):.1%}, max {errors[-1]:.1%} "
            f"over {len(errors)} samples"
        )
    return "\n".join(lines)


def _pass_text(cost: PassCost, size: str) -> str:
    """``fixed + terms`` in ms, and the knee, e.g. ``2.91 ms + 0.11 ms/row; knee at 16 rows``."""
    terms = [f"{cost.fixed * 1e3:.3g} ms"]
    units = {
        "per_row": "row",
        "per_token": "token",
        "per_row_context": "row x context token",
        "per_token_context": "token x context token",
    }
    terms += [
        f"{getattr(cost, name) * 1e3:.3g} ms/{unit}"
        for name, unit in units.items()
        if getattr(cost, name)
    ]
    text = " + ".join(terms)
    if cost.beyond_knee:
        text += (
            f"; knee at {cost.knee:g} {size}, then +{cost.beyond_knee * 1e3:.3g} ms per one more"
        )
    return text
