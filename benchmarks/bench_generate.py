"""Tokens/s and statistics (docs/concepts.md) of ``speculative_generate`` vs plain ``generate``.

For each device (CPU, and CUDA when present) and batch size (default 1, 8, 32) the script runs,
greedily and on the same left-padded prompts:

* ``generate`` — plain batched ``target.generate(do_sample=False)``, the baseline and the
  reference output;
* ``assisted`` — HF assisted generation (``assistant_model=draft``), batch 1 only, since HF
  refuses larger batches;
* one row per registered selector — ``speculative_generate`` with that selector (window sizes
  in ``selector_kwargs``, around ``--k``);
* with ``--tree depth,branch,width``: draft trees against chains at an equal verification budget
  of ``k`` tokens per request — TETRIS as in the paper (no estimator, no guard) on chains
  (``extra=2``) and on trees, and the per-request best-``k`` baseline (``fixed``) on trees (its
  chain row is the ``fixed`` selector row).

Columns: median wall seconds over ``--repeats`` timed runs (after one warm-up run), new tokens
per second (tokens are the reference's new tokens up to and including EOS, the same for every
method that reproduces it), speed-up over ``generate``, tokens per step, VSR, verified draft
tokens per request-step (per active request, like tokens per step), the prefill / draft /
select / verify / other time split of the speculative loop in its last timed run (they add up
to about its wall time; ``s`` is the median's), and how many rows came out identical to
``generate``.

The models are the shipped trained pair (``specselect.models.load_tiny_pair``) when its files
are present, else tiny random Llama models (a noisy copy as draft) built in code. On CPU the
tiny pair's target is only a few times slower than its draft, so wall-clock speed-ups are modest
or negative; the selector comparison is in tokens per step and VSR.

    python benchmarks/bench_generate.py
    python benchmarks/bench_generate.py --batch-sizes 1,8 --max-new-tokens 32 --repeats 1
    python benchmarks/bench_generate.py --device cuda --dtype float16 --output table.md
    python benchmarks/bench_generate.py --batch-sizes 8,32 --selectors fixed --tree 4,2,2
    python benchmarks/bench_generate.py --batch-sizes 8 --repeats 1 --ops --device cpu

``--ops`` adds a table of the operations the loop dispatches per step outside the two models'
forward passes (plain decoding, ``selector=None``, first), counted in one more run, eager: on a
GPU each is a kernel, captured or not, so it is the loop's own share of a step, countable
without one. Views launch nothing and are not counted; nor are builds of cached constants,
which a warmed-up step reuses.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from _args import at_least, int_list, output_file
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from specselect import make_selector
from specselect.constants import cached_constant
from specselect.hf import TreeSpec, speculative_generate
from specselect.selectors import SELECTORS

#: The time split of speculative_generate's statistics, in the table's order: the first rows'
#: prompt pass, then the steps' phases.
SPLIT = ("prefill_seconds", "draft_seconds", "select_seconds", "verify_seconds", "other_seconds")


@dataclass
class Setup:
    """Models and prompts for one device."""

    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: Callable[[int], tuple[Tensor, Tensor]]  # batch -> (input_ids, attention_mask)
    eos: list[int]
    pad: int


@dataclass
class Row:
    device: str
    batch: int
    method: str
    seconds: float
    tokens: int
    identical: int
    stats: dict[str, float] = field(default_factory=dict)
    ops: float | None = None  # --ops: operations outside the models per step


def selector_kwargs(name: str, k: int) -> dict[str, Any]:
    """Window settings of comparable size for each registered selector."""
    table: dict[str, dict[str, Any]] = {
        "tetris": {"k": k, "extra": 2},
        "fixed": {"k": k},
        "dsd": {"max_k": k + 3},
        "threshold": {"max_k": k + 2, "threshold": 0.3},
        "heuristic": {"k0": k, "max_k": k + 4},
    }
    return table.get(name, {"k": k})


def shipped_setup(device: str, dtype: torch.dtype) -> Setup | None:
    """The shipped trained pair and prompts, or None when they are not installed."""
    try:
        from specselect.models import load_prompts, load_tiny_pair

        target, draft, tokenizer = load_tiny_pair(dtype=dtype, device=device)
        prompts_by_kind = [
            [p["text"] for p in load_prompts() if p["kind"] == kind] for kind in ("code", "prose")
        ]
        # code and prose prompts alternate, so every batch size mixes both kinds
        texts = [t for pair in zip(*prompts_by_kind, strict=False) for t in pair]
    except (ImportError, FileNotFoundError) as err:
        print(f"(shipped pair unavailable: {err}; using tiny random models)")
        return None
    tokenizer.padding_side = "left"

    def prompts(batch: int) -> tuple[Tensor, Tensor]:
        chosen = [texts[i % len(texts)] for i in range(batch)]
        enc = tokenizer(chosen, return_tensors="pt", padding=True)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return Setup("shipped tiny pair", target, draft, prompts, [eos], pad)


def random_setup(device: str, dtype: torch.dtype) -> Setup:
    """A random Llama target (vocab 512, hidden 256, 4 layers) and a noisy copy as draft."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        initializer_range=0.1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.std().clamp_min(1e-3))
    target, draft = (m.to(device=device, dtype=dtype) for m in (target, draft))
    gen = torch.Generator().manual_seed(0)

    def prompts(batch: int) -> tuple[Tensor, Tensor]:
        lengths = torch.randint(8, 33, (batch,), generator=gen)
        ids = torch.randint(3, 512, (batch, 32), generator=gen)
        mask = torch.arange(32).unsqueeze(0) >= (32 - lengths).unsqueeze(1)
        return torch.where(mask, ids, 0).to(device), mask.long().to(device)

    return Setup("random tiny Llama pair", target, draft, prompts, [], 0)


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, Any]:
    """Median wall seconds of ``repeats`` runs after one warm-up; returns the last result."""
    result = fn()
    seconds = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def new_tokens(reference: Tensor, prompt_width: int, eos: list[int]) -> int:
    """New tokens of the reference output, up to and including each row's first EOS."""
    total = 0
    for row in reference[:, prompt_width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def identical_rows(output: Tensor, reference: Tensor) -> int:
    if output.shape != reference.shape:
        width = min(output.shape[1], reference.shape[1])
        return int((output[:, :width] == reference[:, :width]).all(dim=1).sum())
    return int((output == reference).all(dim=1).sum())


def bench_batch(setup: Setup, device: str, batch: int, args: argparse.Namespace) -> list[Row]:
    ids, mask = setup.prompts(batch)
    common = {"max_new_tokens": args.max_new_tokens, "eos_token_id": setup.eos}
    rows = []
    seconds, reference = timed(
        lambda: setup.target.generate(
            ids, attention_mask=mask, do_sample=False, pad_token_id=setup.pad, **common
        ),
        device,
        args.repeats,
    )
    tokens = new_tokens(reference, ids.shape[1], setup.eos)
    rows.append(Row(device, batch, "generate", seconds, tokens, batch))
    if batch == 1:
        seconds, out = timed(
            lambda: setup.target.generate(
                ids,
                attention_mask=mask,
                assistant_model=setup.draft,
                do_sample=False,
                pad_token_id=setup.pad,
                **common,
            ),
            device,
            args.repeats,
        )
        rows.append(
            Row(device, batch, "assisted (HF)", seconds, tokens, identical_rows(out, reference))
        )
    runs: list[tuple[str, str, dict[str, Any], TreeSpec | None]] = [
        (name, name, selector_kwargs(name, args.k), None) for name in args.selectors
    ]
    if args.tree is not None:
        paper = {"k": args.k, "extra": 2, "estimator": None, "guard": False}
        tree_label = f"tree({args.tree.depth},{args.tree.branch},{args.tree.width})"
        runs += [
            ("tetris-paper chain", "tetris", paper, None),
            (f"tetris-paper {tree_label}", "tetris", paper, args.tree),
            (f"fixed(k={args.k}) {tree_label}", "fixed", {"k": args.k}, args.tree),
        ]
    for label, name, kwargs, tree in runs:
        selector = make_selector(name, **kwargs)

        def call(
            selector: Any = selector, tree: TreeSpec | None = tree, cuda_graphs: bool | None = None
        ) -> Any:
            return speculative_generate(
                setup.target,
                setup.draft,
                ids,
                mask,
                selector=selector,
                pad_token_id=setup.pad,
                tree=tree,
                cuda_graphs=cuda_graphs,
                **common,
            )

        seconds, out = timed(call, device, args.repeats)
        if tree is None and label == name:
            label = f"{name}(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
        identical = identical_rows(out.sequences, reference)
        row = Row(device, batch, label, seconds, tokens, identical, run_stats(out))
        if args.ops:
            row.ops = ops_per_step(setup, call)
        rows.append(row)
    if args.ops:
        plain = Row(device, batch, "plain (selector=None)", math.nan, tokens, batch)
        plain.ops = ops_per_step(
            setup,
            lambda cuda_graphs: speculative_generate(
                setup.target,
                None,
                ids,
                mask,
                selector=None,
                pad_token_id=setup.pad,
                cuda_graphs=cuda_graphs,
                **common,
            ),
        )
        rows.append(plain)
    return rows


class OpsOutsideModels(TorchDispatchMode):
    """Counts the operations dispatched outside ``models``' forward passes (see the module
    doc): views and cached constants' builds left out."""

    def __init__(self, models: tuple[torch.nn.Module, ...]) -> None:
        super().__init__()
        self.ops = 0
        self._inside = 0  # forward passes under way (a model may call submodules' hooks)
        self._models = models
        self._hooks: list[Any] = []

    def __enter__(self) -> OpsOutsideModels:
        for model in self._models:
            self._hooks.append(model.register_forward_pre_hook(self._enter_model))
            self._hooks.append(model.register_forward_hook(self._leave_model))
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def _enter_model(self, *_: object) -> None:
        self._inside += 1

    def _leave_model(self, *_: object) -> None:
        self._inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not (func.is_view or self._inside or _building_constant(sys._getframe())):
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _building_constant(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside :func:`~specselect.constants.cached_constant`."""
    while frame is not None:
        if frame.f_code is cached_constant.__code__:
            return True
        frame = frame.f_back
    return False


def ops_per_step(setup: Setup, call: Callable[..., Any]) -> float:
    """Operations outside the models per step of ``call(cuda_graphs=False)`` (one untimed run):
    eagerly, since a replayed graph dispatches nothing a dispatch mode sees (and a capture
    under one could fail, which turns graphs off for the rest of the process)."""
    with OpsOutsideModels((setup.target, setup.draft)) as counter:
        out = call(cuda_graphs=False)
    return counter.ops / max(len(out.stats.steps), 1)


def run_stats(out: Any) -> dict[str, float]:
    """Tokens per step, VSR, verified tokens per request-step and the time split of one run
    (per request-step, like tokens per step: summed over the batch they would grow with it)."""
    totals = out.stats.totals
    return {
        "tokens_per_step": totals.tokens_per_step,
        "vsr": totals.vsr,
        "verified_per_request_step": totals.verified_per_request_step,
        **{key: totals.extra[key] for key in SPLIT},
    }


def markdown(rows: list[Row]) -> str:
    """The results as a markdown table; speed-ups are against ``generate`` of the same cell."""
    lines = [
        "| device | B | method | s | tok/s | vs generate | tok/step | VSR | verified/request-step "
        "| prefill/draft/select/verify/other s (last run) | identical rows |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    baseline = {(r.device, r.batch): r.tokens / r.seconds for r in rows if r.method == "generate"}
    for row in rows:
        if math.isnan(row.seconds):  # counted, not timed (--ops)
            continue
        rate = row.tokens / row.seconds
        speedup = rate / baseline[(row.device, row.batch)]
        lines.append(
            f"| {row.device} | {row.batch} | {row.method} | {row.seconds:.2f} | {rate:.0f} "
            f"| {speedup:.2f}x | {stats_cells(row.stats)} | {row.identical}/{row.batch} |"
        )
    return "\n".join(lines)


def ops_markdown(rows: list[Row]) -> str:
    """``--ops``'s table: operations outside the models per step, plain decoding first."""
    lines = ["| device | B | method | ops per step outside the models |", "|---|---:|---|---:|"]
    counted = sorted(
        (r for r in rows if r.ops is not None),
        key=lambda r: (r.device, r.batch, not r.method.startswith("plain")),
    )
    lines += [f"| {r.device} | {r.batch} | {r.method} | {r.ops:.1f} |" for r in counted]
    return "\n".join(lines)


def _defined(value: float) -> str:
    """``value`` to two decimals, or ``-`` where it is undefined (the VSR of a run that
    verified nothing)."""
    return "-" if math.isnan(value) else f"{value:.2f}"


def stats_cells(stats: dict[str, float]) -> str:
    """Tokens/step, VSR, verified/request-step and the time split; empty cells for
    non-speculative rows."""
    if not stats:
        return " | | | "
    split = "/".join(f"{stats[k]:.2f}" for k in SPLIT)
    return (
        f"{stats['tokens_per_step']:.2f} | {_defined(stats['vsr'])} | "
        f"{stats['verified_per_request_step']:.2f} | {split}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", action="append", help="cpu, cuda, ... (default: cpu + cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--k", type=at_least(1), default=3, help="base window of the selectors")
    parser.add_argument("--selectors", default=",".join(sorted(SELECTORS)))
    parser.add_argument(
        "--repeats", type=at_least(1), default=3, help="timed runs (median) per cell"
    )
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    parser.add_argument("--random-models", action="store_true", help="skip the shipped pair")
    parser.add_argument(
        "--output", type=output_file, help="also write the markdown table to this file"
    )
    parser.add_argument(
        "--tree",
        help="depth,branch,width: add tree-vs-chain rows at a budget of k tokens per request",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="also count the operations outside the models per step (one more untimed run each)",
    )
    args = parser.parse_args(argv)
    if args.tree is not None:
        try:
            args.tree = TreeSpec(*(int(v) for v in args.tree.split(",")))
        except (TypeError, ValueError) as err:
            parser.error(f"--tree must be depth,branch,width (three ints >= 1): {err}")
    args.selectors = [s for s in args.selectors.split(",") if s]
    unknown = sorted(set(args.selectors) - set(SELECTORS))
    if unknown:
        parser.error(f"unknown selectors {unknown}; known: {sorted(SELECTORS)}")
    if not args.device:
        args.device = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows: list[Row] = []
    for device in args.device:
        setup = None if args.random_models else shipped_setup(device, dtype)
        setup = setup or random_setup(device, dtype)
        print(f"{device}: {setup.name}, {args.dtype}, max_new_tokens={args.max_new_tokens}")
        with torch.no_grad():
            for batch in args.batch_sizes:
                rows.extend(bench_batch(setup, device, batch, args))
                print(f"  batch {batch} done")
    table = markdown(rows)
    if args.ops:
        table += "\n\n" + ops_markdown(rows)
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
