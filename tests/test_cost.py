"""Tests of the cost model: its formula, the fit (knee included), argument checks, cost files,
``CostModel.measure`` on tiny CPU models, and the shipped measured model.

Expected fits come from the formula written out by hand or from ``scipy.optimize.nnls`` (a dev
dependency, independent of the numpy-only solver under test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import plant_timings
from hf_models import left_padded_prompts, tiny_model
from specselect import make_selector
from specselect.cost import (
    COST_FORMAT,
    COST_VERSION,
    CostFileError,
    CostModel,
    CostSample,
    CostSource,
    PassCost,
    default_cost_model,
)
from specselect.hf import emulate_on_cpu, speculative_generate
from specselect.hf.kv import ModelCache, aligned

CONTEXTS = (128.0, 512.0)
BATCHES = (1, 4, 16, 64)
WIDTHS = (1, 2, 4, 8)
# Every term present, and a verification knee at 64 tokens: what the fit must recover.
TRUE = CostModel(
    PassCost(1.5e-3, per_row=2e-5, per_row_context=1e-8),
    PassCost(
        1e-2,
        per_row=1e-4,
        per_token=2e-5,
        per_row_context=3e-8,
        per_token_context=1e-9,
        knee=64,
        beyond_knee=1e-4,
    ),
)


def hand_pass(cost: PassCost, rows: int, tokens: int, context: float) -> float:
    """The module docstring's formula, written out independently."""
    return (
        cost.fixed
        + cost.per_row * rows
        + cost.per_token * tokens
        + cost.per_row_context * rows * context
        + cost.per_token_context * tokens * context
        + cost.beyond_knee * max(0.0, tokens - cost.knee)
    )


def grid_samples(
    model: CostModel,
    contexts: tuple[float, ...] = CONTEXTS,
    noise: Callable[[int], float] = lambda i: 1.0,
) -> list[CostSample]:
    """Samples timed by ``model`` (times ``noise(i)``) over the module's grid."""
    out: list[CostSample] = []
    for context in contexts:
        for batch in BATCHES:
            if model.draft is not None:
                seconds = 3 * hand_pass(model.draft, batch, batch, context)
                out.append(CostSample("draft", batch, 3, context, seconds))
            for width in WIDTHS:
                seconds = hand_pass(model.verify, batch, batch * width, context)
                out.append(CostSample("verify", batch, batch * width, context, seconds))
    return [dataclasses.replace(s, seconds=s.seconds * noise(i)) for i, s in enumerate(out)]


GOOD = grid_samples(TRUE)


# --- the formula ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "tokens", "context"), [(1, 1, 0.0), (8, 40, 512.0), (64, 512, 3e3)]
)
def test_predictions_follow_the_formula(batch: int, tokens: int, context: float) -> None:
    assert TRUE.verify_time(batch, tokens, context) == pytest.approx(
        hand_pass(TRUE.verify, batch, tokens, context)
    )
    assert TRUE.draft_time(batch, 3, context) == pytest.approx(
        3 * hand_pass(TRUE.draft, batch, batch, context)
    )
    window, verified = 3, 2 * batch
    assert TRUE.step_time(batch, window, verified, context) == pytest.approx(
        TRUE.draft_time(batch, window, context) + TRUE.verify_time(batch, verified + batch, context)
    )


def test_linear_is_the_old_three_coefficient_form() -> None:
    model = CostModel.linear((1e-3, 2e-5, 3e-9), (1e-2, 4e-5, 5e-9))
    assert model.draft_time(8, 3, 100.0) == pytest.approx(3 * (1e-3 + 2e-5 * 8 + 3e-9 * 800))
    assert model.verify_time(8, 40, 100.0) == pytest.approx(1e-2 + 4e-5 * 40 + 5e-9 * 4000)
    assert CostModel.linear(None, (1e-2, 0.0, 0.0)).draft is None


def test_nothing_to_run_takes_no_time() -> None:
    assert TRUE.draft_time(0, 5) == TRUE.draft_time(5, 0) == 0.0
    assert TRUE.verify_time(0, 0) == 0.0
    assert TRUE.step_time(0, 3, 0) == 0.0


# --- fit on good data -----------------------------------------------------------------------


def test_fit_recovers_every_term_and_the_knee() -> None:
    fitted = CostModel.fit(GOOD)
    for fitted_pass, true_pass in ((fitted.draft, TRUE.draft), (fitted.verify, TRUE.verify)):
        assert fitted_pass is not None and true_pass is not None
        for f in dataclasses.fields(PassCost):
            assert getattr(fitted_pass, f.name) == pytest.approx(
                getattr(true_pass, f.name), rel=1e-6, abs=1e-15
            ), f.name
    assert max(fitted.relative_errors()) < 1e-9
    assert fitted.samples == tuple(GOOD)


def test_fit_finds_the_knee_of_a_flat_then_growing_pass() -> None:
    """Verification flat at 10 ms up to 64 tokens, then 0.1 ms per token, with 3% noise: both
    parts are fitted, and predictions hold in both regimes at sizes that were not measured."""
    knee = CostModel(PassCost(2e-3), PassCost(1e-2, knee=64, beyond_knee=1e-4))
    rng = np.random.default_rng(0)
    noisy = grid_samples(knee, (256.0,), lambda i: math.exp(0.03 * rng.standard_normal()))
    fitted = CostModel.fit(noisy).verify
    assert fitted.knee == 64
    assert fitted.beyond_knee == pytest.approx(1e-4, rel=0.1)
    assert fitted.fixed == pytest.approx(1e-2, rel=0.1)
    assert fitted.per_token * 64 < 0.1 * fitted.fixed  # the flat part is flat
    for batch, tokens in ((3, 30), (48, 300)):  # below and beyond the knee
        expected = hand_pass(knee.verify, batch, tokens, 256.0)
        assert fitted.seconds(batch, tokens, 256.0) == pytest.approx(expected, rel=0.1)


def test_fit_finds_no_knee_in_straight_lines() -> None:
    """No knee where the data have none, with or without noise (a spurious knee would tell a
    goodput budget that verification is free where it is not)."""
    straight = CostModel(PassCost(2e-3, per_row=1e-4), PassCost(1e-2, per_row=1e-4, per_token=1e-4))
    rng = np.random.default_rng(1)
    for noise in (0.0, 0.03):
        samples = grid_samples(
            straight, (256.0,), lambda i, noise=noise: math.exp(noise * rng.standard_normal())
        )
        fitted = CostModel.fit(samples)
        assert fitted.verify.knee == math.inf and fitted.verify.beyond_knee == 0.0
        assert fitted.draft is not None and fitted.draft.knee == math.inf


def test_one_context_fits_no_context_terms() -> None:
    """Measured at one context, the model predicts the same time at every context."""
    fitted = CostModel.fit(grid_samples(TRUE, (256.0,)))
    assert fitted.verify.per_row_context == fitted.verify.per_token_context == 0.0
    assert fitted.verify_time(8, 32, 10.0) == fitted.verify_time(8, 32, 5000.0)


def test_without_draft_samples_the_model_prices_plain_decoding() -> None:
    plain = CostModel.fit([s for s in GOOD if s.kind == "verify"])
    assert plain.draft is None
    assert plain.step_time(8, 0, 0, 128.0) == pytest.approx(plain.verify_time(8, 8, 128.0))
    with pytest.raises(ValueError, match="no draft part"):
        plain.draft_time(8, 3)


def weighted_design(samples: list[CostSample], terms: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The relative least-squares problem of ``CostModel.fit`` (no knee), written out."""
    columns = {
        "fixed": lambda s: 1.0,
        "per_row": lambda s: float(s.batch),
        "per_token": lambda s: float(s.tokens),
    }
    x = np.array([[columns[t](s) / s.seconds for t in terms] for s in samples])
    return x, np.ones(len(samples))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e-3, 1.0), min_size=16, max_size=16))
def test_fit_is_the_nonnegative_relative_least_squares_optimum(seconds: list[float]) -> None:
    """Arbitrary timings at one context: no fit with all terms >= 0 has a smaller relative
    squared error than ``fit``'s (scipy's NNLS without knee is a candidate; a knee can only
    do better)."""
    verify = [s for s in grid_samples(TRUE, (256.0,)) if s.kind == "verify"]
    samples = [dataclasses.replace(s, seconds=y) for s, y in zip(verify, seconds, strict=True)]
    fitted = CostModel.fit(samples)
    mine = sum((fitted.predict(s) / s.seconds - 1) ** 2 for s in samples)
    x, y = weighted_design(samples, ["fixed", "per_row", "per_token"])
    coef = nnls(x, y)[0]
    theirs = float(np.sum((x @ coef - y) ** 2))
    assert mine <= theirs * (1 + 1e-9) + 1e-12
    terms = dataclasses.astuple(fitted.verify)
    assert min(terms) >= 0
    if fitted.verify.knee == math.inf:
        assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-12)


# --- samples that do not determine the terms -----------------------------------------------

ONE_CONTEXT = (256.0,)
RANK_DEFICIENT = {
    # samples, what the message must say
    "verify at one batch": (
        [s for s in grid_samples(TRUE, ONE_CONTEXT) if s.kind == "draft" or s.batch == 4],
        "verify pass's per_row term: all 'verify' samples have the same batch (4)",
    ),
    "verify at one width": (
        [
            s
            for s in grid_samples(TRUE, ONE_CONTEXT)
            if s.kind == "draft" or s.tokens == 2 * s.batch
        ],
        "per_token term: across the 'verify' samples tokens = a + b * batch",
    ),
    "draft at one batch": (
        [s for s in GOOD if s.kind == "verify" or s.batch == 16],
        "draft pass's per_row term: all 'draft' samples have the same batch (16)",
    ),
    # batch * context is the same for every sample: the context term is the fixed cost
    "context tied to the batch": (
        [dataclasses.replace(s, context=1024.0 / s.batch) for s in GOOD],
        "draft pass's per_row_context term: the 'draft' samples do not vary the context "
        "independently of the sizes",
    ),
    "one verification sample": (
        [s for s in GOOD if s.kind == "draft"] + [s for s in GOOD if s.kind == "verify"][:1],
        "all 'verify' samples have the same batch (1)",
    ),
}


@pytest.mark.parametrize(("samples", "says"), RANK_DEFICIENT.values(), ids=RANK_DEFICIENT)
def test_fit_says_what_the_samples_do_not_vary(samples: list[CostSample], says: str) -> None:
    with pytest.raises(ValueError, match="fit cannot determine") as info:
        CostModel.fit(samples)
    assert says in str(info.value)


@pytest.mark.parametrize(
    "samples", [[], [s for s in GOOD if s.kind == "draft"]], ids=["none", "drafts only"]
)
def test_fit_needs_verification_samples(samples: list[CostSample]) -> None:
    with pytest.raises(ValueError, match="fit needs 'verify' samples"):
        CostModel.fit(samples)


# --- sample validation ----------------------------------------------------------------------

INVALID = [
    # index into GOOD (0: a draft sample, 1: a verification sample), field, value, error
    (0, "seconds", -0.001, ValueError),
    (1, "seconds", math.nan, ValueError),
    (1, "seconds", math.inf, ValueError),
    (0, "context", math.nan, ValueError),
    (1, "context", -1.0, ValueError),
    (0, "tokens", 0, ValueError),
    (1, "tokens", 0, ValueError),
    (0, "batch", 0, ValueError),
    (1, "batch", -2, ValueError),
    (0, "batch", 2.0, TypeError),
    (1, "tokens", True, TypeError),
    (1, "seconds", "1.0", TypeError),
    (0, "kind", "prefill", ValueError),
]


@pytest.mark.parametrize(("index", "field", "value", "error"), INVALID)
def test_fit_names_the_invalid_sample(index: int, field: str, value: object, error: type) -> None:
    samples = list(GOOD)
    samples[index] = dataclasses.replace(samples[index], **{field: value})
    with pytest.raises(error, match=rf"^samples\[{index}\]\.{field} must"):
        CostModel.fit(samples)


def test_fit_rejects_a_verification_sample_with_fewer_tokens_than_rows() -> None:
    samples = list(GOOD)
    samples[6] = dataclasses.replace(samples[6], batch=8, tokens=4)
    with pytest.raises(ValueError, match=r"samples\[6\]\.tokens must be >= its batch \(8\)"):
        CostModel.fit(samples)


def test_fit_accepts_zero_seconds_and_zero_context() -> None:
    """A timer's resolution can give 0 s, and an empty cache has context 0: both are valid."""
    samples = list(GOOD)
    samples[0] = dataclasses.replace(samples[0], seconds=0.0)
    samples[9] = dataclasses.replace(samples[9], context=0.0)
    CostModel.fit(samples)


# --- argument checks (issue: verify_time(-3, -5) returned 0.0148 s) --------------------------

BAD_SIZES = [
    # method, args, error, message
    ("verify_time", (-3, -5), ValueError, "batch must be >= 0, got -3"),
    ("draft_time", (-3, -5), ValueError, "batch must be >= 0, got -3"),
    ("draft_time", (3, -5), ValueError, "tokens must be >= 0, got -5"),
    ("verify_time", (8, 4), ValueError, "tokens must be >= batch"),
    ("verify_time", (0, 4), ValueError, "tokens must be 0 for an empty batch"),
    ("verify_time", (2.0, 4), TypeError, "batch must be an int, got float"),
    ("draft_time", (2, True), TypeError, "tokens must be an int, got bool"),
    ("draft_time", ("2", 3), TypeError, "batch must be an int, got str"),
    ("verify_time", (2, 4, math.nan), ValueError, "context must be a finite float >= 0"),
    ("verify_time", (2, 4, math.inf), ValueError, "context must be a finite float >= 0"),
    ("draft_time", (2, 4, -1.0), ValueError, "context must be a finite float >= 0"),
    ("draft_time", (2, 4, "long"), TypeError, "context must be a float >= 0, got str"),
    ("step_time", (2, 3, -1), ValueError, "verified must be >= 0, got -1"),
    ("step_time", (-2, 3, 1), ValueError, "batch must be >= 0, got -2"),
    # More verified than drafted: a step no loop can make, which it priced.
    ("step_time", (2, 1, 50), ValueError, "verified (50) must be at most the batch * window = 2"),
    ("step_time", (2, 0, 5), ValueError, "verified (5) must be at most the batch * window = 0"),
    ("predict", (CostSample("drafts", 1, 1, 0.0, 0.1),), ValueError, "sample.kind must be"),
    ("predict", (CostSample("verify", 4, 2, 0.0, 0.1),), ValueError, "sample.tokens must be >="),
    ("predict", ((1, 1, 0.0),), TypeError, "sample must be a CostSample, got tuple"),
]


@pytest.mark.parametrize(("method", "args", "error", "says"), BAD_SIZES)
def test_predictions_reject_bad_sizes(method: str, args: tuple, error: type, says: str) -> None:
    with pytest.raises(error, match=re_escape(says)):
        getattr(TRUE, method)(*args)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


BAD_CONSTRUCTION: list[tuple[Callable[[], Any], type, str]] = [
    (lambda: CostModel.linear("abc", (1e-2, 0.0, 0.0)), TypeError, "draft_coef must be a sequence"),
    (
        lambda: CostModel.linear((1.0, 2.0), (1e-2, 0.0, 0.0)),
        ValueError,
        "draft_coef must hold three",
    ),
    (
        lambda: CostModel.linear((1.0, "x", 0.0), (1e-2, 0.0, 0.0)),
        TypeError,
        "draft_coef[1] must be a float",
    ),
    (
        lambda: CostModel.linear((1.0, 0.0, -1.0), (1e-2, 0.0, 0.0)),
        ValueError,
        "draft_coef[2] must be a finite",
    ),
    (
        lambda: CostModel.linear(None, (math.nan, 0.0, 0.0)),
        ValueError,
        "verify_coef[0] must be a finite",
    ),
    (
        lambda: CostModel("abc", PassCost(1.0)),
        TypeError,
        "CostModel.draft must be a PassCost or None",
    ),  # type: ignore[arg-type]
    (lambda: CostModel(None, (1, 2, 3)), TypeError, "CostModel.verify must be a PassCost"),  # type: ignore[arg-type]
    (lambda: CostModel(None, PassCost(1.0), source="cpu"), TypeError, "CostModel.source must be"),  # type: ignore[arg-type]
    (
        lambda: CostModel(None, PassCost(1.0), samples=(1,)),
        TypeError,
        "samples[0] must be a CostSample",
    ),  # type: ignore[arg-type]
    (
        lambda: CostSource("cpu", "float32", "eager", models=["target"]),
        TypeError,
        "CostSource.models must be a mapping, got list",
    ),  # type: ignore[arg-type]
    (lambda: CostSource(3, "float32", "eager"), TypeError, "CostSource.hardware must be a str"),  # type: ignore[arg-type]
    (lambda: PassCost("abc"), TypeError, "PassCost.fixed must be a float >= 0, got str"),  # type: ignore[arg-type]
    (lambda: PassCost(1.0, per_row=-1e-3), ValueError, "PassCost.per_row must be a finite"),
    (lambda: PassCost(1.0, per_token=math.inf), ValueError, "PassCost.per_token must be a finite"),
    (lambda: PassCost(1.0, knee=math.nan), ValueError, "PassCost.knee must be a float >= 0 or inf"),
    (lambda: PassCost(1.0, knee=-4), ValueError, "PassCost.knee must be a float >= 0 or inf"),
    (lambda: PassCost(10**5000), ValueError, "PassCost.fixed must be a finite float >= 0, got an"),
]


@pytest.mark.parametrize(("build", "error", "says"), BAD_CONSTRUCTION)
def test_construction_rejects_bad_terms(build: Callable[[], Any], error: type, says: str) -> None:
    with pytest.raises(error, match=re_escape(says)):
        build()


@pytest.mark.parametrize("verify", [PassCost(0.0), PassCost(0.0, per_token_context=1e-9)])
def test_constructor_rejects_free_verification(verify: PassCost) -> None:
    with pytest.raises(ValueError, match="free at context 0"):
        CostModel(PassCost(0.0), verify)


@pytest.mark.parametrize(
    "model",
    [
        CostModel.linear((0.0, 0.0, 0.0), (1e-2, 0.0, 0.0)),
        CostModel.linear((1e-3, 0.0, 0.0), (0.0, 1e-5, 0.0)),
        CostModel(None, PassCost(0.0, per_row=1e-4)),
        TRUE,
    ],
)
def test_every_valid_model_prices_a_nonempty_step(model: CostModel) -> None:
    """Window 0, nothing verified but the pending token, empty cache: the cheapest step."""
    assert model.step_time(batch=1, window=0, verified=0, context=0.0) > 0


@pytest.mark.parametrize(
    "seconds",
    [lambda s: 0.0, lambda s: 1e-9 * s.tokens * s.context],
    ids=["zero", "attention only"],
)
def test_fit_rejects_a_free_verification_result(seconds: Callable[[CostSample], float]) -> None:
    samples = [
        dataclasses.replace(s, seconds=seconds(s)) if s.kind == "verify" else s for s in GOOD
    ]
    with pytest.raises(ValueError, match="the 'verify' samples fit"):
        CostModel.fit(samples)


# --- cost files -----------------------------------------------------------------------------

SOURCE = CostSource(
    hardware="test bench",
    dtype="float32",
    mode="eager",
    versions={"torch": "x"},
    models={"target": {"class": "T"}},
    grid={"batch_sizes": [1, 4]},
    details={"threads": 1},
    note="synthetic",
)


def test_json_round_trip_keeps_predictions_and_metadata(tmp_path: Path) -> None:
    model = CostModel.fit(GOOD, source=SOURCE)
    assert model.draft is not None and model.draft.knee == math.inf  # written as null
    path = model.save(tmp_path / "cost.json")
    loaded = CostModel.load(path)
    assert loaded == model
    assert loaded.path == str(path) and model.path is None
    assert loaded.source == SOURCE and loaded.samples == model.samples
    for batch, tokens, context in ((1, 1, 0.0), (16, 64, 128.0), (64, 512, 700.0)):
        assert loaded.verify_time(batch, tokens, context) == model.verify_time(
            batch, tokens, context
        )
        assert loaded.draft_time(batch, 3, context) == model.draft_time(batch, 3, context)
    assert loaded.describe() == "cost.json: test bench, float32, eager"


def test_a_source_without_its_optional_fields_loads(tmp_path: Path) -> None:
    """Hardware, dtype and mode describe every model; the rest may be left out by hand."""
    document = CostModel.fit(GOOD, source=SOURCE).to_json()
    for key in ("versions", "models", "grid", "details", "note"):
        document = mutate(document, f"source.{key}", DELETE)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    source = CostModel.load(path).source
    assert source is not None and source.hardware == SOURCE.hardware
    assert source.note == "" and source.grid == {}


def test_save_makes_the_files_directory(tmp_path: Path) -> None:
    """As save_traces does (a FileNotFoundError before)."""
    model = CostModel.fit(GOOD, source=SOURCE)
    assert CostModel.load(model.save(tmp_path / "new" / "dir" / "cost.json")) == model


def test_a_cost_file_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """As an editor on Windows saves it; json refused it ("Unexpected UTF-8 BOM")."""
    model = CostModel.fit(GOOD, source=SOURCE)
    path = model.save(tmp_path / "cost.json")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert CostModel.load(path) == model


def test_a_plain_decoding_model_round_trips(tmp_path: Path) -> None:
    model = CostModel.linear(None, (1e-2, 1e-5, 0.0))
    assert CostModel.load(model.save(tmp_path / "plain.json")) == model


def mutate(document: dict, path: str, value: Any) -> dict:
    """``document`` with the key at dotted ``path`` set to ``value`` (``DELETE``: removed)."""
    copy = json.loads(json.dumps(document))
    *parents, last = path.split(".")
    node: Any = copy
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return copy


DELETE = object()
FREE = {f.name: 0.0 for f in dataclasses.fields(PassCost)}
BAD_FILES = {
    # mutation of a good document (path, value), what the message must say
    "another format": (("format", "other"), "not a specselect cost model"),
    "another version": (("version", COST_VERSION + 1), f"format version {COST_VERSION + 1}"),
    "version as text": (("version", "1"), "'version' must be an integer"),
    "no verify": (("verify", DELETE), "missing key 'verify'"),
    "no draft": (("draft", DELETE), "missing key 'draft'"),
    "no source": (("source", DELETE), "missing key 'source'"),
    "verify not an object": (("verify", [1, 2]), "'verify' must be an object"),
    "term as text": (("verify.fixed", "fast"), "'verify.fixed' must be a number"),
    "missing term": (("draft.per_row", DELETE), "missing key 'draft.per_row'"),
    "negative term": (("verify.per_token", -1.0), "'verify': PassCost.per_token must be"),
    "free verification": (("verify", {**FREE, "per_token_context": 1e-9}), "free at context 0"),
    "source without hardware": (("source.hardware", DELETE), "missing key 'source.hardware'"),
    "mode as a number": (("source.mode", 3), "'source.mode' must be a string"),
    "samples not a list": (("samples", {}), "'samples' must be a list"),
    "sample field mistyped": (("samples.2.batch", 1.5), "'samples[2].batch' must be an integer"),
    "sample out of range": (("samples.3.seconds", -1.0), "samples[3].seconds must be"),
    "term beyond floats": (("verify.fixed", 10**400), "'verify.fixed' must be a finite number"),
    "sample beyond floats": (("samples.1.context", 10**400), "'samples[1].context' must be a"),
    "misspelt term": (("verify.fixd", 1e-3), "unknown key 'verify.fixd'"),
    "unknown top-level key": (("cost", 1.0), "unknown key 'cost'"),
    "unknown source key": (("source.hw", "x"), "unknown key 'source.hw'"),
    "unknown sample key": (("samples.0.secs", 1.0), "unknown key 'samples[0].secs'"),
}


@pytest.mark.parametrize(("change", "says"), BAD_FILES.values(), ids=BAD_FILES)
def test_load_names_the_file_and_the_problem(tmp_path: Path, change: tuple, says: str) -> None:
    good = CostModel.fit(GOOD, source=SOURCE).to_json()
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(mutate(good, *change)), encoding="utf-8")
    with pytest.raises(CostFileError) as info:
        CostModel.load(path)
    message = str(info.value)
    assert message.startswith(f"cost file {str(path)!r}")
    assert says in message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "is not valid JSON (line 1"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"version": 1' + "0" * 5000 + "}", "cannot be read as JSON"),  # beyond int parsing
    ],
)
def test_load_rejects_what_is_not_a_cost_document(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CostFileError, match=re_escape(says)):
        CostModel.load(path)


def test_load_of_a_missing_file_or_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CostModel.load(tmp_path / "nowhere.json")
    with pytest.raises(CostFileError, match="is a directory"):
        CostModel.load(tmp_path)


def test_the_written_document_has_the_documented_keys(tmp_path: Path) -> None:
    document = json.loads(
        CostModel.fit(GOOD, source=SOURCE).save(tmp_path / "c.json").read_text(encoding="utf-8")
    )
    assert document["format"] == COST_FORMAT and document["version"] == COST_VERSION
    assert set(document) == {"format", "version", "draft", "verify", "source", "samples"}
    assert document["verify"]["knee"] == 64
    assert document["draft"]["knee"] is None


# --- measuring tiny CPU models --------------------------------------------------------------

MEASURE_GRID = {"batch_sizes": (1, 2, 4), "widths": (1, 4), "contexts": (16,), "repeats": 5}


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[Any, Any]:
    target = tiny_model("llama", seed=0, layers=2)
    draft = tiny_model("llama", seed=1, layers=1)
    return target, draft


@pytest.fixture(scope="module")
def measured(tiny_pair: tuple[Any, Any]) -> CostModel:
    return CostModel.measure(*tiny_pair, progress=False, note="test", **MEASURE_GRID)


def test_measure_times_the_grid_and_fits(measured: CostModel) -> None:
    kinds = [(s.kind, s.batch, s.tokens, s.context) for s in measured.samples]
    expected = [
        (kind, b, tokens, 16.0)
        for b in (1, 2, 4)
        for kind, tokens in [("draft", 1), ("verify", b), ("verify", 4 * b)]
    ]
    assert kinds == expected
    assert all(s.seconds > 0 for s in measured.samples)
    source = measured.source
    assert source is not None
    assert (source.mode, source.dtype, source.note) == ("eager", "float32", "test")
    assert source.hardware.startswith("CPU ") and "thread" in source.hardware
    assert {"torch", "transformers", "specselect", "python"} <= set(source.versions)
    assert source.grid["batch_sizes"] == [1, 2, 4] and source.grid["repeats"] == 5
    assert source.grid["statistic"] == "median"
    assert set(source.models) == {"target", "draft"}
    assert source.details["threads"] >= 1 and "load_average_before" in source.details


PLANTED_GRID = {**MEASURE_GRID, "contexts": (16, 48), "repeats": 3}
# Calls of one measurement of PLANTED_GRID: per context, 3 batch sizes x (a draft pass and 2
# widths) x (2 warm-up and 3 timed calls).
CALLS_PER_MEASUREMENT = 90
# Passes that cost per token, a sixth of it at context 16 spent on attention: if the machine is 3x
# slower while context 48 is timed, that looks like attention alone, and the fit is free.
COMPUTE_BOUND = CostModel(
    PassCost(1e-4, per_row=1e-3), PassCost(2e-5, per_token=1e-3, per_token_context=1e-5)
)


def assert_measures(measured: CostModel, planted: CostModel, measurements: int = 1) -> None:
    """``measured`` timed what ``planted`` says (``measurements`` times), and fits it."""
    assert measured.source is not None
    assert measured.source.details["measurements"] == measurements
    assert [s.seconds for s in measured.samples] == pytest.approx(
        [planted.predict(s) for s in measured.samples], rel=1e-9
    )
    assert max(measured.relative_errors()) < 1e-6
    for kind in ("draft", "verify"):
        fitted, true = (getattr(m, kind) for m in (measured, planted))
        assert dataclasses.asdict(fitted) == pytest.approx(
            dataclasses.asdict(true), rel=1e-4, abs=1e-12
        ), kind


def test_measure_fits_what_each_pass_takes(
    tiny_pair: tuple[Any, Any], planted_timings: CostModel
) -> None:
    """Each sample is the time of its own pass shape, and the fit of them is the model that
    timed them. How well a fit explains real timings is the machine's: tiny models on a shared
    CPU are mostly fixed per-call cost and noise, so the clock here is one that only the passes
    move, by what ``planted_timings`` says each takes (at two contexts: every term is fitted)."""
    assert_measures(CostModel.measure(*tiny_pair, progress=False, **PLANTED_GRID), planted_timings)


def test_measure_times_again_when_a_busy_spell_fits_free_verification(
    tiny_pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contexts are timed one after another: 3x slower while the first measurement times
    context 48, passes look as if attention were all they cost, and the fit prices
    verification at context 0 as free. The grid is timed again (the spell is over), each shape
    keeps its faster sample, and the fit is exact."""

    def busy_while_first_timing_48(shape: Any, call: int) -> float:
        return 3.0 if shape.context == 48 and call < CALLS_PER_MEASUREMENT else 1.0

    planted = plant_timings(monkeypatch, busy_while_first_timing_48, COMPUTE_BOUND)
    measured = CostModel.measure(*tiny_pair, progress=False, **PLANTED_GRID)
    assert_measures(measured, planted, measurements=2)


def test_measure_says_what_it_measured_when_verification_stays_free(
    tiny_pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """3x slower whenever context 48 is timed: timing again does not help, and the error shows
    the times per context and what to change."""
    planted = plant_timings(
        monkeypatch, lambda shape, _: 3.0 ** (shape.context == 48), COMPUTE_BOUND
    )
    with pytest.raises(ValueError, match="costs nothing at context 0") as caught:
        CostModel.measure(*tiny_pair, progress=False, **PLANTED_GRID)
    smallest = [CostSample("verify", 1, 1, context, 0.0) for context in (16.0, 48.0)]
    took = [planted.predict(smallest[0]), 3.0 * planted.predict(smallest[1])]
    for says in (
        "contexts 16, 48 (twice, the second time in reverse order of context)",
        f"took {took[0] * 1e3:.3g} ms at context 16, {took[1] * 1e3:.3g} ms at context 48",
        "idle machine",
        "--repeats",
        "--statistic min",
        "--contexts",
    ):
        assert says in str(caught.value)


def test_measured_model_round_trips(measured: CostModel, tmp_path: Path) -> None:
    loaded = CostModel.load(measured.save(tmp_path / "measured.json"))
    assert loaded == measured
    assert loaded.step_time(3, 2, 6, 16.0) == measured.step_time(3, 2, 6, 16.0)


def test_measure_without_draft_prices_plain_decoding(tiny_pair: tuple[Any, Any]) -> None:
    grid = {**MEASURE_GRID, "repeats": 1}
    plain = CostModel.measure(tiny_pair[0], None, progress=False, **grid)
    assert plain.draft is None
    assert {s.kind for s in plain.samples} == {"verify"}
    assert set(plain.source.models) == {"target"}  # type: ignore[union-attr]


def test_measure_in_graph_mode_runs_captured_stages(tiny_pair: tuple[Any, Any]) -> None:
    """Graph mode, emulated on the CPU: every pass is traced once and replayed, which fails on
    a host read inside the stage or a value baked into it."""
    grid = {"batch_sizes": (1, 2), "widths": (1, 2), "contexts": (4,), "repeats": 1}
    with emulate_on_cpu():
        traced = CostModel.measure(*tiny_pair, cuda_graphs=True, warmup=1, progress=False, **grid)
    assert traced.source is not None and traced.source.mode == "trace"
    assert len(traced.samples) == 6


@contextlib.contextmanager
def attended_spans() -> Iterator[list[tuple[int, int, int]]]:
    """``(columns written once the pass is done, columns it attends over, capacity)`` of every
    pass through a :class:`ModelCache` inside the block."""
    spans: list[tuple[int, int, int]] = []
    forward = ModelCache.forward

    def spy(self: ModelCache, *args: Any, **kwargs: Any) -> Any:
        spans.append((self.used, self.kv.span, self.capacity))
        return forward(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelCache, "forward", spy)
        yield spans


@pytest.mark.usefixtures("planted_timings")  # (spans, not times, are what this checks)
def test_profiled_passes_attend_over_what_the_loops_would(tiny_pair: tuple[Any, Any]) -> None:
    """Eagerly a pass attends over the columns written, its own included, rounded up to the
    alignment (and at most the capacity): in the loop, and so in the profiler, whose pass of
    width ``W`` at context ``c`` attends over ``aligned(c + W)`` columns. It used to attend over
    ``c`` plus the widest ``W`` of the grid at every width, 136 columns at context 128 where
    the loop's passes took up to 192 (a tenth less time for 32 rows of the shipped target)."""
    contexts, widths = (5, 40), (1, 2, 20)
    grid = {"batch_sizes": (1, 2), "widths": widths, "contexts": contexts}
    # The memory check's one-token probe of each model (once per model in a process, so only
    # when no earlier test made it) is no profiled pass: let it happen first.
    CostModel.measure(*tiny_pair, repeats=1, warmup=1, progress=False, **grid)
    with attended_spans() as profiled:
        CostModel.measure(*tiny_pair, repeats=1, warmup=1, progress=False, **grid)
    expected = {(c + w, aligned(c + w)) for c in contexts for w in widths}
    assert {(used, span) for used, span, _ in profiled} == expected
    ids, mask = left_padded_prompts(3, 3, 10, 128, 0)
    fixed = make_selector("fixed", k=3)
    with attended_spans() as looped:
        speculative_generate(*tiny_pair, ids, mask, selector=fixed, max_new_tokens=40)
    assert all(span == min(aligned(used), capacity) for used, span, capacity in looped)
    assert len({span for _, span, _ in looped}) >= 3  # spans grow with the written columns


BAD_MEASURE = [
    ({"batch_sizes": []}, ValueError, "batch_sizes must hold at least 2"),
    ({"batch_sizes": [4]}, ValueError, "batch_sizes must hold at least 2"),
    ({"batch_sizes": [1, 1]}, ValueError, "batch_sizes holds duplicates"),
    ({"batch_sizes": 4}, TypeError, "batch_sizes must be a sequence of ints"),
    ({"widths": [0, 2]}, ValueError, "widths[0] must be >= 1"),
    ({"widths": [1, 2.5]}, TypeError, "widths[1] must be an int"),
    ({"contexts": []}, ValueError, "contexts must hold at least 1"),
    ({"contexts": [-1]}, ValueError, "contexts[0] must be >= 0"),
    ({"repeats": 0}, ValueError, "repeats must be >= 1"),
    ({"warmup": 0}, ValueError, "warmup must be >= 1"),
    ({"cuda_graphs": True}, ValueError, "cuda_graphs=True, but target is on cpu"),
    ({"cuda_graphs": "yes"}, TypeError, "cuda_graphs must be True, False or None"),
    ({"dtype": "float32"}, TypeError, "dtype must be a floating torch.dtype"),
    ({"note": 3}, TypeError, "note must be a str"),
    ({"statistic": "mean"}, ValueError, "statistic must be one of median, min, got 'mean'"),
    ({"device": "nope"}, ValueError, "device 'nope' is not a torch device"),
    ({"device": "meta"}, ValueError, "device 'meta': meta tensors hold no values"),
]


@pytest.mark.parametrize(("change", "error", "says"), BAD_MEASURE)
def test_measure_rejects_bad_input_before_timing(
    tiny_pair: tuple[Any, Any], change: dict, error: type, says: str
) -> None:
    with pytest.raises(error, match=re_escape(says)):
        CostModel.measure(*tiny_pair, progress=False, **{**MEASURE_GRID, **change})


def test_measure_names_its_own_arguments_when_a_context_does_not_fit() -> None:
    """A learned position table too short for the grid: the message names contexts and
    widths (it used to say to shorten a prompt and lower max_new_tokens, which measure lacks)."""
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, eos_token_id=0
    )
    target = GPT2LMHeadModel(config).eval()
    says = "the largest context plus the widest verify pass needs 104: lower contexts or widths"
    with pytest.raises(ValueError, match=re_escape(says)):
        CostModel.measure(target, None, progress=False, **{**MEASURE_GRID, "contexts": (0, 100)})


def test_measure_rejects_what_is_not_a_model() -> None:
    with pytest.raises(TypeError, match="target must be a HuggingFace causal LM"):
        CostModel.measure("gpt2", None, progress=False)


# --- the shipped model ----------------------------------------------------------------------


def test_the_shipped_model_is_a_measured_cpu_model() -> None:
    """What compare, replay and DSD use by default: measured (not guessed) on one CPU thread,
    eager, with its samples, and fitting them within the bound stated in docs/compare.md."""
    model = default_cost_model()
    assert model is default_cost_model()  # read once
    assert model.source is not None and model.draft is not None
    assert (model.source.mode, model.source.dtype) == ("eager", "float32")
    assert model.source.hardware.startswith("CPU ") and model.source.hardware.endswith("1 thread")
    assert model.source.details["threads"] == 1
    assert model.path is not None and model.path.endswith("cost-cpu.json")
    assert len(model.samples) == 30
    errors = model.relative_errors()
    assert statistics.median(errors) < 0.10 and max(errors) < 0.35
    # The fit of its samples, up to rounding: LAPACK's least squares may differ in the last
    # bits between CPUs (seen: 1 ulp on another machine than the one that wrote the file).
    refit = CostModel.fit(model.samples, source=model.source)
    for ours, theirs in ((model.draft, refit.draft), (model.verify, refit.verify)):
        assert ours is not None and theirs is not None
        for field in dataclasses.fields(ours):
            a, b = getattr(ours, field.name), getattr(theirs, field.name)
            assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), (field.name, a, b)
    same_coefficients = dataclasses.replace(refit, draft=model.draft, verify=model.verify)
    assert same_coefficients == model


COST_FILES = Path(__file__).resolve().parents[1] / "benchmarks" / "costs"


@pytest.mark.parametrize(
    ("name", "bound"),
    [("h100-graph-tinyllama-1.1b-bf16.json", 0.10), ("h100-graph-94m-pair-bf16.json", 0.08)],
)
def test_the_h100_cost_files_fit_their_samples_as_documented(name: str, bound: float) -> None:
    """benchmarks/costs' H100 files (graph mode, bfloat16) load, and fit each of their samples
    within the bound docs/compare.md states."""
    model = CostModel.load(COST_FILES / name)
    assert model.source is not None and model.draft is not None
    assert (model.source.mode, model.source.dtype) == ("cuda", "bfloat16")
    assert model.source.hardware.startswith("NVIDIA H100")
    assert max(model.relative_errors()) < bound


def test_samples_are_kept_as_plain_numbers_and_need_their_part() -> None:
    """NumPy numbers pass the checks and are stored as Python's (a save would fail on them);
    draft samples without a draft part are refused (every summary of the model would fail)."""
    exact = [
        CostSample("verify", np.int64(b), np.int64(b * w), np.float64(0.0), 8e-3 + 1e-4 * b * w)
        for b in (1, 2, 4)
        for w in (1, 2)
    ]
    model = CostModel(None, PassCost(8e-3, per_token=1e-4), samples=exact)
    assert all(type(s.batch) is int and type(s.seconds) is float for s in model.samples)
    json.dumps(model.summary())  # plain numbers all the way
    draft = CostSample("draft", 1, 1, 0.0, 1e-3)
    with pytest.raises(ValueError, match="draft samples but no draft part"):
        CostModel(None, PassCost(8e-3), samples=[draft])
