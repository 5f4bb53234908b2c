"""A cost model of draft and verification time, measured on real models and fitted with a knee.

Dynamic-window selectors (DSD, goodput budgets) trade expected accepted tokens against time,
and trace replay turns a selector's choices into modelled seconds. Both need to know what a
forward pass costs on *this* hardware, in *this* mode (eager or CUDA graphs), with *these*
models: a draft pass takes 6.5 ms eager and 0.6 ms in a CUDA graph at batch 8 on an H100, so
no guessed constant serves everyone. :meth:`CostModel.measure` (and ``specselect profile``)
times the real models and fits; :meth:`CostModel.save` / :meth:`CostModel.load` keep the
result as JSON with what it was measured on.

Shape of one forward pass (:class:`PassCost`), in seconds, for ``rows`` rows holding
``tokens`` tokens in total at ``context`` tokens already cached per row::

    fixed + per_row * rows + per_token * tokens
          + per_row_context * rows * context + per_token_context * tokens * context
          + beyond_knee * max(0, tokens - knee)

Why this shape: a pass streams the weights once whatever its size (``fixed``), reads each row's
cache and builds its masks (``per_row``, ``per_row_context``), and computes per token. On an
accelerator the token terms are flat while the pass is memory-bound and grow once it becomes
compute-bound: the *knee*. The fit places it (or none) where it explains the measurements best.
Every term is >= 0, so time never falls as a pass grows.

* A **draft pass** processes one token per row (``tokens = rows``), so ``per_token`` is folded
  into ``per_row``; ``draft_time(batch, tokens)`` is ``tokens`` sequential passes. (The first
  pass of a step also feeds the backlog, usually 2 tokens per row; it is priced as the others.)
* A **verification pass** processes every row's pending token and its drafts: ``tokens`` in
  total, at least one per row.

Context terms are fitted only when the samples span several context lengths; a model measured
at one context predicts the same time at every context (the HF loop's static caches attend over
their whole capacity, so its passes cost the same at every context up to it).

:func:`default_cost_model` is the measured CPU model of the shipped pair that ``specselect
compare``, trace replay and DSD use when given no other.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specselect._checks import check_int

if TYPE_CHECKING:
    import torch

#: ``"format"`` of a cost file, and the version this release reads and writes.
COST_FORMAT = "specselect-cost-model"
COST_VERSION = 1

#: The shipped pair's measured CPU cost model (package data beside the pair).
SHIPPED_COST_FILE = "cost-cpu.json"

#: :meth:`CostModel.measure`'s default grid: batch sizes, verification widths (tokens per row),
#: context lengths, and timed and warm-up calls per shape. Widths up to 8 cover windows up to
#: ``k + extra = 7``; batch sizes up to 32, ``specselect compare``'s default slots.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_WIDTHS = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (128,)
#: The cached tokens per row a time is priced at when the caller gives no ``context``.
PRICED_CONTEXT = 512.0
DEFAULT_REPEATS = 7
DEFAULT_WARMUP = 2

#: How :meth:`CostModel.measure` summarises a shape's timed calls. The median is robust to the
#: odd slow call; on a shared machine, where other processes preempt a short pass in a good
#: fraction of its calls (interference only ever adds time), the minimum is the reproducible
#: figure.
STATISTICS = ("median", "min")

# Singular values of the column-normalised design matrix below this fraction of the largest count
# as zero in ``fit``: a direction the samples determine this weakly would amplify timing noise by
# more than 1e9, so it is treated as not varying at all.
_RCOND = 1e-9

# A knee is kept only if it explains much more than noise would: an F test of the drop in squared
# error against the error left per degree of freedom ``d``. Noise alone always lowers the error a
# little, more so as the knee is the best of several candidates, so the test is at the 0.5% level
# (about 5% over ten candidates). F(1, d) quantiles at 0.995 (scipy.stats.f.ppf(0.995, 1, d))
# for d = 1..30; beyond, the value at 30 (a little stricter than the exact ones). A spurious
# knee would tell a goodput budget that verification is free up to a size where it is not.
_KNEE_F = (
    16210.72, 198.5, 55.55, 31.33, 22.78, 18.63, 16.24, 14.69, 13.61, 12.83,
    12.23, 11.75, 11.37, 11.06, 10.8, 10.58, 10.38, 10.22, 10.07, 9.94,
    9.83, 9.73, 9.63, 9.55, 9.48, 9.41, 9.34, 9.28, 9.23, 9.18,
)  # fmt: skip


# Squared relative error per sample below which a fit is exact (an RMS relative error of 1e-6,
# far below any timer's noise): what a knee would remove there is rounding, not a knee.
_NEGLIGIBLE = 1e-12


class CostFileError(ValueError):
    """A cost file that cannot be read as a cost model; the message names the file and why."""


def _check_real(name: str, value: object, *, allow_inf: bool = False) -> float:
    """``value`` as a float, or raise unless it is a finite (or +inf) real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float >= 0, got {type(value).__name__}")
    number = _float_or_inf(value) if isinstance(value, int) else float(value)
    if math.isnan(number) or number < 0 or (math.isinf(number) and not allow_inf):
        expected = "a float >= 0 or inf" if allow_inf else "a finite float >= 0"
        shown = _huge(value) if isinstance(value, int) and math.isinf(number) else value
        raise ValueError(f"{name} must be {expected}, got {shown}")
    return number


@dataclass(frozen=True)
class PassCost:
    """Seconds of one forward pass; see the module docstring for the formula and its terms.

    Attributes:
        fixed: seconds of a pass whatever its size (weights streamed once, kernel launches).
        per_row: seconds per row (reading its cache, its masks).
        per_token: seconds per token of the pass below the knee.
        per_row_context: seconds per row and cached token.
        per_token_context: seconds per token and cached token (attention scores).
        knee: tokens in the pass beyond which each token costs ``beyond_knee`` more; ``inf``
            for none.
        beyond_knee: extra seconds per token beyond the knee.

    Raises:
        TypeError: a field is not a real number.
        ValueError: a field is negative, NaN or infinite (``knee`` may be ``inf``).
    """

    fixed: float
    per_row: float = 0.0
    per_token: float = 0.0
    per_row_context: float = 0.0
    per_token_context: float = 0.0
    knee: float = math.inf
    beyond_knee: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = _check_real(
                f"PassCost.{f.name}", getattr(self, f.name), allow_inf=f.name == "knee"
            )
            object.__setattr__(self, f.name, value)

    def seconds(self, rows: int, tokens: int, context: float) -> float:
        """The formula, for arguments the caller has checked."""
        beyond = max(0.0, tokens - self.knee) if self.beyond_knee else 0.0
        return self._formula(rows, tokens, context, beyond)

    def seconds_of_tokens(self, rows: int, tokens: np.ndarray, context: float) -> np.ndarray:
        """:meth:`seconds` at every count of ``tokens`` (an int array) at once: a table of
        thousands of entries (the goodput budget's, at large batches) in one numpy pass."""
        beyond = np.maximum(0.0, tokens - self.knee) if self.beyond_knee else 0.0
        return self._formula(rows, tokens, context, beyond)

    def _formula(self, rows: int, tokens: Any, context: float, beyond: Any) -> Any:
        """The terms of the module docstring, for ``tokens`` (and ``beyond``, the tokens past
        the knee) as numbers or arrays alike."""
        return (
            self.fixed
            + self.per_row * rows
            + self.per_token * tokens
            + (self.per_row_context * rows + self.per_token_context * tokens) * context
            + self.beyond_knee * beyond
        )

    def is_free_at_context_zero(self) -> bool:
        """Whether a pass over a non-empty batch costs nothing at context 0."""
        return self.fixed == 0 and self.per_row == 0 and self.per_token == 0


@dataclass(frozen=True)
class CostSample:
    """One measured forward: ``kind`` is ``"draft"`` or ``"verify"``; see the module docstring.

    ``batch`` and ``tokens`` are ints >= 1 (a draft sample's ``tokens`` is its number of
    sequential passes; a verification sample's, the tokens of its one pass, at least one per
    row); ``context`` and ``seconds`` are finite floats >= 0. :meth:`CostModel.fit` checks all of
    this.
    """

    kind: str
    batch: int
    tokens: int
    context: float
    seconds: float


@dataclass(frozen=True)
class CostSource:
    """What a cost model was measured on, as recorded in its file.

    Attributes:
        hardware: the device's name (a GPU's model, or the CPU's and its thread count).
        dtype: the models' dtype (``"float32"``, ``"bfloat16"``, ...).
        mode: how passes ran: ``"eager"``, ``"cuda"`` (CUDA graphs) or ``"trace"`` (the CPU
            emulation of graph mode, for tests).
        versions: package versions (``torch``, ``transformers``, ``specselect``, ``python``).
        models: a description of each model (``"target"``, ``"draft"``).
        grid: the measured grid (``batch_sizes``, ``widths``, ``contexts``, ``repeats``).
        details: anything else worth keeping (threads, load averages, date).
        note: free text: how the numbers were obtained, when they were not measured by
            :meth:`CostModel.measure`.
    """

    hardware: str
    dtype: str
    mode: str
    versions: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, Any] = field(default_factory=dict)
    grid: Mapping[str, Any] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        """Refuse fields of the wrong type here, not when a report or a comparison reads
        them (a file's are checked when it loads, with the file named)."""
        for name, kind, expected in (
            ("hardware", str, "a str"),
            ("dtype", str, "a str"),
            ("mode", str, "a str"),
            ("versions", Mapping, "a mapping"),
            ("models", Mapping, "a mapping"),
            ("grid", Mapping, "a mapping"),
            ("details", Mapping, "a mapping"),
            ("note", str, "a str"),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"CostSource.{name} must be {expected}, got {type(value).__name__}")


@dataclass(frozen=True)
class CostModel:
    """Predicts draft and verification time (see the module docstring).

    Build one with :meth:`measure` (time your models), :meth:`load` (a file from ``specselect
    profile``), :meth:`fit` (your own timings), :meth:`linear` (coefficients by hand), or
    :func:`default_cost_model` (the shipped pair on a CPU).

    Attributes:
        draft: one draft pass; ``None`` for a model of plain decoding (verification only), which
            prices no drafting.
        verify: one verification (target) pass.
        source: what the model was measured on (``None`` for a hand-made model).
        samples: the timings it was fitted to (kept in its file, for plots and checks).
        path: the file it was loaded from (not part of equality).

    Raises:
        TypeError: ``draft`` or ``verify`` is not a :class:`PassCost`, ``source`` not a
            :class:`CostSource`, or a sample not a valid :class:`CostSample` (``ValueError``
            for a value out of range).
        ValueError: a verification pass over a non-empty batch would be free at context 0
            (no fixed, per-row or per-token cost): a step could take no time and have infinite
            goodput.
    """

    draft: PassCost | None
    verify: PassCost
    source: CostSource | None = None
    samples: tuple[CostSample, ...] = ()
    path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, optional in (("draft", True), ("verify", False)):
            value = getattr(self, name)
            if not isinstance(value, PassCost) and not (optional and value is None):
                expected = "a PassCost or None" if optional else "a PassCost"
                raise TypeError(
                    f"CostModel.{name} must be {expected}, got {type(value).__name__} (build "
                    "coefficients with CostModel.linear(draft_coef=..., verify_coef=...))"
                )
        if self.verify.is_free_at_context_zero():
            raise ValueError(
                f"CostModel.verify = {self.verify} makes a verification pass free at context 0: "
                "it needs a fixed, per-row or per-token cost > 0, or a speculative step could "
                "take no time and have infinite goodput"
            )
        if self.source is not None and not isinstance(self.source, CostSource):
            raise TypeError(
                f"CostModel.source must be a CostSource or None, got {type(self.source).__name__}"
            )
        for i, sample in enumerate(self.samples):
            _check_sample(f"samples[{i}]", sample)
        # Plain ints and floats (numpy's would pass the checks, and not save as JSON).
        samples = tuple(
            CostSample(s.kind, int(s.batch), int(s.tokens), float(s.context), float(s.seconds))
            for s in self.samples
        )
        object.__setattr__(self, "samples", samples)
        if self.draft is None and any(s.kind == "draft" for s in samples):
            raise ValueError(
                "CostModel has draft samples but no draft part (draft=None): fit them, or leave "
                "them out"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def linear(
        cls,
        draft_coef: Sequence[float] | None,
        verify_coef: Sequence[float],
    ) -> CostModel:
        """A model without knee from three coefficients per kind (seconds):

        * ``draft_coef = (d0, d1, d2)``: a draft pass costs ``d0 + d1 * batch + d2 * batch *
          context``;
        * ``verify_coef = (v0, v1, v2)``: a verification pass over ``tokens`` costs ``v0 + v1 *
          tokens + v2 * tokens * context``.

        ``draft_coef=None`` gives a model of plain decoding (no drafting).

        Raises:
            TypeError: a coefficient list is not a sequence of three real numbers.
            ValueError: a coefficient is negative or not finite, or ``v0 = v1 = 0``.
        """
        d = None if draft_coef is None else _three("draft_coef", draft_coef)
        v = _three("verify_coef", verify_coef)
        draft = None if d is None else PassCost(d[0], per_row=d[1], per_row_context=d[2])
        return cls(draft, PassCost(v[0], per_token=v[1], per_token_context=v[2]))

    @classmethod
    def fit(cls, samples: Iterable[CostSample], *, source: CostSource | None = None) -> CostModel:
        """Fit both kinds' :class:`PassCost` to measured samples.

        The fit minimises the squared *relative* error (timing noise is roughly proportional to
        the time, and a goodput decision depends on ratios of times) under the constraint that
        every term is >= 0, solved exactly (not by clipping the unconstrained solution, which
        would leave the other terms fitted to one that is gone). The knee is tried at every
        measured size with at least two measured sizes beyond it (rows for drafts, tokens for
        verification) and kept where it explains far more than noise would (an F test at the
        0.5% level): the flat part of a memory-bound pass, then its slope.

        What the samples must vary: draft samples the batch; verification samples the batch
        and the tokens per row independently (``tokens = W * batch`` for one width ``W``
        cannot tell a per-row from a per-token cost). Context terms are fitted only when the
        contexts vary. Without draft samples the model has no draft part (plain decoding).

        Raises:
            ValueError: a sample is invalid (named as ``samples[i].field``: see
                :class:`CostSample`); there is no verification sample; a kind's samples do not
                determine its terms (the message says what does not vary); or the verification
                samples fit a pass that is free at context 0.
            TypeError: a sample's ``batch`` or ``tokens`` is not an int, or its ``context`` or
                ``seconds`` not a real number.
        """
        rows = list(samples)
        by_kind: dict[str, list[CostSample]] = {"draft": [], "verify": []}
        for i, s in enumerate(rows):
            _check_sample(f"samples[{i}]", s)
            by_kind[s.kind].append(s)
        if not by_kind["verify"]:
            raise ValueError(
                "fit needs 'verify' samples (verification passes at several batch sizes and "
                "widths), got none"
            )
        draft = _fit_kind("draft", by_kind["draft"]) if by_kind["draft"] else None
        verify = _fit_kind("verify", by_kind["verify"])
        if verify.is_free_at_context_zero():
            raise ValueError(
                f"the 'verify' samples fit {verify}: no fixed, per-row or per-token cost, so a "
                "verification pass at context 0 would be free; check the samples' seconds"
            )
        return cls(draft, verify, source, tuple(rows))

    @classmethod
    def measure(
        cls,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        contexts: Sequence[int] = DEFAULT_CONTEXTS,
        cuda_graphs: bool | None = None,
        repeats: int = DEFAULT_REPEATS,
        warmup: int = DEFAULT_WARMUP,
        statistic: str = "median",
        progress: bool = True,
        note: str = "",
    ) -> CostModel:
        """Time ``target`` (and ``draft``) the way the HF loop runs them, then :meth:`fit`.

        What is timed, and how: :mod:`specselect.profiling`. Contexts are timed one after
        another; where the samples of several contexts fit a verification pass that is free at
        context 0 (a machine that got busier while the later contexts were timed), the grid is
        timed once more, contexts in reverse order, and each shape keeps its faster sample.

        Args:
            target: HF causal LM (``attn_implementation`` ``"sdpa"`` or ``"eager"``).
            draft: HF causal LM, or ``None`` to measure verification only (a model of plain
                decoding, which prices no drafting).
            device: where to time; the models are moved there in place (``Module.to``).
                Default: where the target is.
            dtype: floating dtype to cast the models to, in place. Default: as they are.
            batch_sizes: rows per pass; at least two sizes (the fit separates a per-row cost
                from the fixed one).
            widths: tokens per row of a verification pass (``k + 1`` in the loop); at least two.
            contexts: tokens already cached per row; several make the fit include context
                terms.
            cuda_graphs: ``None``: CUDA graphs when both models sit whole on a CUDA device (as
                ``speculative_generate``); ``True``: required (raises where impossible);
                ``False``: eager. Under :func:`specselect.hf.emulate_on_cpu`, graph mode runs as
                CPU traces.
            repeats: timed calls per shape.
            warmup: untimed calls per shape before them (at least 1: graph mode captures there).
            statistic: what a sample keeps of a shape's timed calls, ``"median"`` or ``"min"``
                (see :data:`STATISTICS`).
            progress: a tqdm bar over the timed calls.
            note: free text kept in the model's :class:`CostSource`.

        Returns:
            The fitted model, with its samples and source (hardware, dtype, mode, versions, grid,
            threads, the load average before and after, and ``measurements``: 2 where the grid
            was timed again).

        Raises:
            TypeError / ValueError: a bad grid (empty, fewer than two batch sizes or widths,
                duplicates, values < 1, contexts < 0), ``repeats < 1``, ``warmup < 1``, an
                unknown ``statistic``, a model the loop cannot drive, or ``cuda_graphs=True``
                where graphs are impossible.
            ValueError: the timings fit a verification pass that is free at context 0, also
                after timing again: the message shows what was measured and what to change.
        """
        from specselect.profiling import measure_samples

        samples, source = measure_samples(
            target,
            draft,
            device=device,
            dtype=dtype,
            batch_sizes=batch_sizes,
            widths=widths,
            contexts=contexts,
            cuda_graphs=cuda_graphs,
            repeats=repeats,
            warmup=warmup,
            statistic=statistic,
            progress=progress,
            note=note,
        )
        return cls.fit(samples, source=source)

    # ------------------------------------------------------------------ predictions
    def draft_time(self, batch: int, tokens: int, context: float = PRICED_CONTEXT) -> float:
        """Seconds to draft ``tokens`` tokens (sequential passes) for ``batch`` requests.

        Zero when there is nothing to draft (``batch`` or ``tokens`` 0).

        Raises:
            TypeError: ``batch`` or ``tokens`` is not an int, or ``context`` not a real number.
            ValueError: a size is negative or ``context`` is not finite; or this is a model of
                plain decoding (no draft part) and drafting was asked for.
        """
        batch = check_int("batch", batch)
        tokens = check_int("tokens", tokens)
        context = _check_real("context", context)
        if batch == 0 or tokens == 0:
            return 0.0
        if self.draft is None:
            raise ValueError(
                "this cost model has no draft part (measured for plain decoding, draft=None): "
                "it cannot price drafting"
            )
        return tokens * self.draft.seconds(batch, batch, context)

    def verify_time(self, batch: int, tokens: int, context: float = PRICED_CONTEXT) -> float:
        """Seconds for one target pass over ``tokens`` tokens in total (``batch`` requests).

        Every row carries at least its pending token, so ``tokens >= batch``; an empty batch
        (0 rows, 0 tokens) runs no pass and takes 0 s.

        Raises:
            TypeError: ``batch`` or ``tokens`` is not an int, or ``context`` not a real number.
            ValueError: a size is negative, ``tokens < batch``, tokens without rows, or
                ``context`` is not finite.
        """
        batch = check_int("batch", batch)
        tokens = check_int("tokens", tokens)
        context = _check_real("context", context)
        if tokens < batch:
            raise ValueError(
                f"tokens must be >= batch (every row verifies at least its pending token), got "
                f"tokens={tokens} for batch={batch}"
            )
        if batch == 0:
            if tokens:
                raise ValueError(f"tokens must be 0 for an empty batch, got {tokens}")
            return 0.0
        return self.verify.seconds(batch, tokens, context)

    def step_time(
        self, batch: int, window: int, verified: int, context: float = PRICED_CONTEXT
    ) -> float:
        """One speculative step: draft ``window`` tokens per row, verify ``verified`` drafts
        (over the batch) plus one pending token per row.

        The pass is priced by the tokens it verifies, as an engine that packs each row's
        tokens runs it; a loop that pads rows to one width (``speculative_generate``) sends
        more (docs/compare.md, "The goodput budget").

        Raises:
            ValueError: ``verified`` beyond the ``batch * window`` drafted tokens, or a size
                below 0.
        """
        verified = check_int("verified", verified)
        batch = check_int("batch", batch)
        window = check_int("window", window)
        if verified > batch * window:
            raise ValueError(
                f"verified ({verified}) must be at most the batch * window = {batch * window} "
                "drafted tokens"
            )
        return self.draft_time(batch, window, context) + self.verify_time(
            batch, verified + batch, context
        )

    def predict(self, sample: CostSample) -> float:
        """The model's seconds for the pass(es) a sample timed.

        Raises:
            TypeError, ValueError: ``sample`` is not a sample a fit could use (its kind,
                sizes, context and seconds are checked as :meth:`fit` checks them).
        """
        _check_sample("sample", sample)
        if sample.kind == "draft":
            return self.draft_time(sample.batch, sample.tokens, sample.context)
        return self.verify_time(sample.batch, sample.tokens, sample.context)

    def relative_errors(self, samples: Iterable[CostSample] | None = None) -> list[float]:
        """``|predicted / measured - 1|`` per sample (default: the model's own samples).

        A sample measured at 0 s counts as exact when predicted at 0 s, else as infinite.
        """
        errors = []
        for s in self.samples if samples is None else samples:
            predicted = self.predict(s)
            if s.seconds > 0:
                errors.append(abs(predicted / s.seconds - 1.0))
            else:
                errors.append(0.0 if predicted == 0 else math.inf)
        return errors

    # ------------------------------------------------------------------ description
    def describe(self) -> str:
        """One line saying what this model is: its file, hardware, dtype and mode."""
        where = f"{Path(self.path).name}: " if self.path else ""
        if self.source is None:
            if self.samples:
                return f"{where}fitted to {len(self.samples)} samples (source not recorded)"
            return f"{where}hand-made cost model (not measured)"
        s = self.source
        return f"{where}{s.hardware}, {s.dtype}, {_MODE_WORDS.get(s.mode, s.mode)}"

    def summary(self) -> dict[str, Any]:
        """What a report records of this model: where it comes from and its fitted terms."""
        errors = self.relative_errors()
        return {
            "description": self.describe(),
            "file": self.path,
            "hardware": None if self.source is None else self.source.hardware,
            "dtype": None if self.source is None else self.source.dtype,
            "mode": None if self.source is None else self.source.mode,
            "note": None if self.source is None else self.source.note or None,
            "draft": None if self.draft is None else _pass_json(self.draft),
            "verify": _pass_json(self.verify),
            "samples": len(self.samples),
            "max_relative_error": max(errors) if errors else None,
        }

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict[str, Any]:
        """The JSON document :meth:`save` writes (see :meth:`load` for its keys)."""
        return {
            "format": COST_FORMAT,
            "version": COST_VERSION,
            "draft": None if self.draft is None else _pass_json(self.draft),
            "verify": _pass_json(self.verify),
            "source": None if self.source is None else _source_json(self.source),
            "samples": [asdict(s) for s in self.samples],
        }

    def save(self, path: str | Path) -> Path:
        """Write the model as JSON (format :data:`COST_FORMAT`, version :data:`COST_VERSION`),
        making the file's directory if it is missing (as ``save_traces`` does)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return target

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a file written by :meth:`save` (or ``specselect profile``).

        Keys: ``format`` (:data:`COST_FORMAT`), ``version`` (:data:`COST_VERSION`), ``draft``
        (a :class:`PassCost` as an object, ``knee`` ``null`` for none; or ``null``),
        ``verify``, ``source`` (a :class:`CostSource` as an object, or ``null``; its
        ``versions``, ``models``, ``grid``, ``details`` and ``note`` may be left out) and
        ``samples`` (a list of :class:`CostSample` objects). No other key: a misspelt one in a
        hand-edited file would otherwise be ignored.

        Raises:
            FileNotFoundError: there is no such file.
            CostFileError: (a ``ValueError``) the file is not JSON, not a cost model, another
                format version, or has a missing, mistyped or unknown key; the message names
                the file and the key.
        """
        target = Path(path)
        name = f"cost file {str(target)!r}"
        try:
            text = target.read_text(encoding="utf-8-sig")  # an editor's BOM is no JSON
        except UnicodeDecodeError as exc:
            raise CostFileError(f"{name} is not a text file ({exc.reason})") from None
        except IsADirectoryError:
            raise CostFileError(f"{name} is a directory, not a cost file") from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CostFileError(
                f"{name} is not valid JSON (line {exc.lineno}: {exc.msg})"
            ) from None
        except ValueError as exc:  # an integer beyond Python's digit limit for parsing
            raise CostFileError(f"{name} cannot be read as JSON ({exc})") from None
        try:
            model = _from_json(document)
        except (KeyError, TypeError, ValueError) as exc:
            message = exc.args[0] if exc.args else str(exc)
            raise CostFileError(f"{name}: {message}") from None
        return replace(model, path=str(target))


_MODE_WORDS = {"eager": "eager", "cuda": "CUDA graphs", "trace": "graph mode traced on CPU"}


@functools.lru_cache(maxsize=4)
def _load_cached(path: str) -> CostModel:
    return CostModel.load(path)


def default_cost_model() -> CostModel:
    """The measured CPU cost model of the shipped pair (eager, float32, one thread).

    It is what ``specselect compare``, :func:`~specselect.replay.replay`,
    :func:`~specselect.replay.compare_replay`, the live comparisons and
    :class:`~specselect.selectors.dsd.DSDSelector` use when given no cost model. It describes
    the shipped pair on one CPU core, not your models or hardware: measure those with
    ``specselect profile`` (or :meth:`CostModel.measure`) for any claim about them.

    Raises:
        FileNotFoundError: the package data is incomplete (reinstall specselect).
    """
    from specselect import models

    path = models.TINY_PAIR_DIR / SHIPPED_COST_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the shipped cost model {path} is missing; the package data is incomplete. "
            "Reinstall specselect, or pass a cost model of your own (specselect profile)."
        )
    return _load_cached(str(path))


# ---------------------------------------------------------------------------- checks


def _three(name: str, value: object) -> tuple[float, float, float]:
    """Three reals >= 0, or a TypeError/ValueError naming ``name``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of three floats >= 0, got {value!r}")
    if len(value) != 3:
        raise ValueError(f"{name} must hold three floats, got {len(value)}: {value!r}")
    a, b, c = (_check_real(f"{name}[{i}]", v) for i, v in enumerate(value))
    return (a, b, c)


def _check_sample(name: str, s: object) -> None:
    """Raise, naming ``<name>.field``, unless ``s`` is a sample that the fit can use."""
    if not isinstance(s, CostSample):
        raise TypeError(f"{name} must be a CostSample, got {type(s).__name__}")
    if s.kind not in ("draft", "verify"):
        raise ValueError(f"{name}.kind must be 'draft' or 'verify', got {s.kind!r}")
    # A pass with no request or no token measures nothing the formulas describe; a draft sample
    # with 0 tokens would also divide by 0 when turned into time per pass.
    check_int(f"{name}.batch", s.batch, minimum=1)
    check_int(f"{name}.tokens", s.tokens, minimum=1)
    if s.kind == "verify" and s.tokens < s.batch:
        raise ValueError(
            f"{name}.tokens must be >= its batch ({s.batch}): a verification pass carries at "
            f"least one token per row, got {s.tokens}"
        )
    _check_real(f"{name}.context", s.context)
    _check_real(f"{name}.seconds", s.seconds)


# ---------------------------------------------------------------------------- fitting

# Terms of each kind in fitting order; ``per_row`` before ``per_token`` so that a rank failure
# is reported on the term that the samples cannot tell apart from the ones before it.
_TERMS = {
    "draft": ("fixed", "per_row", "per_row_context"),
    "verify": ("fixed", "per_row", "per_token", "per_row_context", "per_token_context"),
}
_CONTEXT_TERMS = ("per_row_context", "per_token_context")


def _size(s: CostSample) -> int:
    """Tokens of one pass: a draft pass processes one token per row."""
    return s.batch if s.kind == "draft" else s.tokens


def _column(term: str, rows: list[CostSample]) -> np.ndarray:
    batch = np.array([r.batch for r in rows], dtype=float)
    size = np.array([_size(r) for r in rows], dtype=float)
    context = np.array([r.context for r in rows], dtype=float)
    values = {
        "fixed": np.ones(len(rows)),
        "per_row": batch,
        "per_token": size,
        "per_row_context": batch * context,
        "per_token_context": size * context,
    }
    return values[term]


def _fit_kind(kind: str, rows: list[CostSample]) -> PassCost:
    """Fit one kind's :class:`PassCost` (terms >= 0, best knee) to its samples."""
    contexts = {r.context for r in rows}
    terms = [t for t in _TERMS[kind] if len(contexts) > 1 or t not in _CONTEXT_TERMS]
    seconds = np.array([r.seconds / (r.tokens if kind == "draft" else 1) for r in rows])
    # Relative least squares: each row divided by its own time (a 0 s row by the smallest
    # positive time, so that it still counts and divides by nothing).
    positive = seconds[seconds > 0]
    scale = np.where(seconds > 0, seconds, positive.min() if positive.size else 1.0)
    base = np.stack([_column(t, rows) for t in terms], axis=1) / scale[:, None]
    y = seconds / scale
    _check_rank(kind, rows, terms, base)
    coef, error = _nonnegative_lstsq(base, y)
    knee, beyond, knee_error = math.inf, 0.0, error
    freedom = len(rows) - base.shape[1] - 1  # degrees of freedom left with a knee
    sizes = np.array([_size(r) for r in rows], dtype=float)
    # A knee needs two measured sizes beyond it: with one, its slope just absorbs that point.
    for candidate in sorted(set(sizes.tolist()))[:-2] if freedom > 0 else []:
        design = np.column_stack([base, np.maximum(0.0, sizes - candidate) / scale])
        if _rank(design) < design.shape[1]:
            continue
        with_knee, candidate_error = _nonnegative_lstsq(design, y)
        if with_knee[-1] > 0 and candidate_error < knee_error:
            knee, beyond, knee_error, knee_coef = (
                candidate,
                float(with_knee[-1]),
                candidate_error,
                with_knee[:-1],
            )
    critical = _KNEE_F[min(freedom, len(_KNEE_F)) - 1] if freedom > 0 else math.inf
    gain = error - knee_error
    if gain > _NEGLIGIBLE * len(rows) and gain * freedom > critical * knee_error:
        coef = knee_coef
    else:
        knee, beyond = math.inf, 0.0
    values = dict.fromkeys(_TERMS["verify"], 0.0)
    values.update({t: float(c) for t, c in zip(terms, coef, strict=True)})
    return PassCost(**values, knee=knee, beyond_knee=beyond)


def _rank(x: np.ndarray) -> int:
    """Numerical rank of ``x`` after normalising its columns (so the test is scale-free)."""
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    return int(np.linalg.matrix_rank(x / norms, tol=_RCOND * np.sqrt(x.shape[0])))


def _check_rank(kind: str, rows: list[CostSample], terms: list[str], x: np.ndarray) -> None:
    """Raise, saying which term the samples cannot tell apart, unless ``x`` has full rank."""
    for count in range(1, len(terms) + 1):
        if _rank(x[:, :count]) == count:
            continue
        term = terms[count - 1]
        raise ValueError(
            f"fit cannot determine the {kind} pass's {term} term: {_why(kind, rows, term)}"
        )


def _why(kind: str, rows: list[CostSample], term: str) -> str:
    """What the samples would have to vary to determine ``term``."""
    first = rows[0]
    if term == "per_row":
        return f"all {kind!r} samples have the same batch ({first.batch}); vary it"
    if term == "per_token":
        return (
            "across the 'verify' samples tokens = a + b * batch, so a per-token cost cannot be "
            "told apart from a per-row one; vary the tokens per row (widths) independently of "
            "the batch"
        )
    return (
        f"the {kind!r} samples do not vary the context independently of the sizes; measure "
        "every size at each context"
    )


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """``argmin ||x c - y||`` over ``c >= 0`` and its squared residual, for a full-rank ``x``
    with few columns.

    The optimum is the unconstrained least-squares solution on its own support (the columns
    whose coefficient is positive), and every feasible candidate's residual is at least the
    optimum's, so the best feasible solution over all supports is the optimum: at most 2^6
    small solves, with no iteration to converge and no dependency beyond numpy. Supports are
    tried from the smallest, and a larger one must do better by more than rounding: a term the
    data do not need stays exactly 0 instead of taking a coefficient of 1e-20.
    """
    columns = x.shape[1]
    best, best_residual = np.zeros(columns), float(y @ y)  # the empty support
    tolerance = 1e-12 * best_residual
    supports = sorted(itertools.product((False, True), repeat=columns), key=sum)
    for support in supports[1:]:
        mask = np.array(support)
        coef = np.zeros(columns)
        coef[mask] = np.linalg.lstsq(x[:, mask], y, rcond=None)[0]
        if (coef < 0).any():
            continue
        r = y - x @ coef
        if float(r @ r) < best_residual - tolerance:
            best, best_residual = coef, float(r @ r)
    return best, best_residual


# ---------------------------------------------------------------------------- JSON


def _pass_json(cost: PassCost) -> dict[str, Any]:
    values = asdict(cost)
    values["knee"] = None if math.isinf(cost.knee) else cost.knee
    return values


def _source_json(source: CostSource) -> dict[str, Any]:
    return {f.name: _plain(getattr(source, f.name)) for f in fields(source)}


def _plain(value: Any) -> Any:
    """Mappings as dicts (JSON objects), recursively."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _from_json(document: object) -> CostModel:
    """A model from a parsed cost file; KeyError/TypeError/ValueError name the key at fault."""
    if not isinstance(document, dict):
        raise TypeError(f"expected a JSON object, got {type(document).__name__}")
    if document.get("format") != COST_FORMAT:
        raise ValueError(
            f"not a specselect cost model (its 'format' is {document.get('format')!r}, expected "
            f"{COST_FORMAT!r})"
        )
    version = _key(document, "version", int, "")
    if version != COST_VERSION:
        raise ValueError(
            f"cost file format version {version}; this specselect reads version {COST_VERSION}"
        )
    draft = document.get("draft", _MISSING)
    if draft is _MISSING:
        raise KeyError("missing key 'draft' (an object, or null for plain decoding)")
    source = document.get("source", _MISSING)
    if source is _MISSING:
        raise KeyError("missing key 'source' (an object, or null)")
    samples = _key(document, "samples", list, "")
    _only_keys(document, ("format", "version", "draft", "verify", "source", "samples"), "")
    return CostModel(
        draft=None if draft is None else _pass_from_json(draft, "draft"),
        verify=_pass_from_json(_key(document, "verify", dict, ""), "verify"),
        source=None if source is None else _source_from_json(source),
        samples=tuple(_sample_from_json(s, i) for i, s in enumerate(samples)),
    )


_MISSING = object()
_JSON_TYPES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "an object",
    list: "a list",
}


def _key(obj: object, key: str, kind: type, where: str) -> Any:
    """``obj[key]`` checked to be of JSON type ``kind`` (ints count as numbers)."""
    name = f"{where}{key}"
    if not isinstance(obj, dict):
        raise TypeError(f"{where.rstrip('.')} must be an object, got {type(obj).__name__}")
    if key not in obj:
        raise KeyError(f"missing key {name!r}")
    value = obj[key]
    accepted: tuple[type, ...] = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise TypeError(f"{name!r} must be {_JSON_TYPES[kind]}, got {json.dumps(value)}")
    if kind is float and isinstance(value, int) and not math.isfinite(_float_or_inf(value)):
        raise ValueError(f"{name!r} must be a finite number, got {_huge(value)}")
    return value


def _huge(value: int) -> str:
    """An integer beyond the float range, described by its size: printing it may exceed
    Python's digit limit for int-to-str conversion."""
    return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"


def _float_or_inf(value: int) -> float:
    """``float(value)``, or ``inf`` for an int beyond the float range (a hand-edited file)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _only_keys(obj: dict[str, Any], known: Sequence[str], where: str) -> None:
    """A key the format does not have is an error: a misspelt term in a hand-edited file
    would otherwise be ignored, and the model priced without it."""
    unknown = [key for key in obj if key not in known]
    if unknown:
        raise ValueError(
            f"unknown key {where + unknown[0]!r} (the keys there are {', '.join(known)})"
        )


def _pass_from_json(obj: object, where: str) -> PassCost:
    if not isinstance(obj, dict):
        raise TypeError(f"'{where}' must be an object, got {json.dumps(obj)}")
    _only_keys(obj, [f.name for f in fields(PassCost)], f"{where}.")
    values: dict[str, float] = {}
    for f in fields(PassCost):
        if f.name == "knee" and obj.get("knee", 0) is None:  # JSON has no infinity
            values["knee"] = math.inf
        else:
            values[f.name] = float(_key(obj, f.name, float, f"{where}."))
    try:
        return PassCost(**values)
    except ValueError as exc:
        raise ValueError(f"'{where}': {exc}") from None


_OPTIONAL_SOURCE_KEYS = (
    ("versions", dict),
    ("models", dict),
    ("grid", dict),
    ("details", dict),
    ("note", str),
)


def _source_from_json(obj: object) -> CostSource:
    where = "source."
    if isinstance(obj, dict):
        _only_keys(obj, [f.name for f in fields(CostSource)], where)
    # hardware, dtype and mode describe every model; the rest may be left out by hand.
    given = obj if isinstance(obj, dict) else {}
    optional = {
        name: _key(obj, name, kind, where) for name, kind in _OPTIONAL_SOURCE_KEYS if name in given
    }
    return CostSource(
        hardware=_key(obj, "hardware", str, where),
        dtype=_key(obj, "dtype", str, where),
        mode=_key(obj, "mode", str, where),
        **optional,
    )


def _sample_from_json(obj: object, index: int) -> CostSample:
    where = f"samples[{index}]."
    if isinstance(obj, dict):
        _only_keys(obj, [f.name for f in fields(CostSample)], where)
    sample = CostSample(
        kind=_key(obj, "kind", str, where),
        batch=_key(obj, "batch", int, where),
        tokens=_key(obj, "tokens", int, where),
        context=float(_key(obj, "context", float, where)),
        seconds=float(_key(obj, "seconds", float, where)),
    )
    _check_sample(f"samples[{index}]", sample)
    return sample


__all__ = [
    "COST_FORMAT",
    "COST_VERSION",
    "STATISTICS",
    "CostFileError",
    "CostModel",
    "CostSample",
    "CostSource",
    "PassCost",
    "default_cost_model",
]
