"""What batched speculative decoding costs on a GPU, and what it gains with a trained pair.

Part **a** — cost at realistic shapes (random weights, so acceptance means nothing and every
step is timed at its full static width): a TinyLlama-1.1B-shape target (hidden 2048, 22 layers,
GQA 32/4, vocab 32000) and a ~70M draft (hidden 768, 4 layers), bf16, for each batch size:

* ms per plain decode step: HF eager ``generate`` and specselect's graph-mode plain decoding
  (``selector=None``);
* ms per speculative step, split into draft / select / verify / bookkeeping, for fixed k=3,
  default TETRIS (k=3, extra=2), paper TETRIS and one tree shape, in graph mode;
* the break-even tokens per step: a step's time over a plain step's time (graph mode, and HF
  eager ``generate``).

Every row of part a is on one basis: ms per decode step, prefill excluded, the median over
``--repeats`` calls. For specselect, a call's step time is its steps' summed wall time over their
number (its ``stats``; the split is that of the median call). HF ``generate`` reports no steps, so
its step time is the median of a ``--steps``-token call minus the median of a one-token call (the
prefill, which emits the first token), over the ``--steps - 1`` tokens left.

Part **b** — end to end with a trained pair: a >= 100M-parameter Llama target trained on the
installed packages' Python sources with the shipped 4096-token tokenizer, and a <= 1/10 draft
distilled from it (KL), both trained here in a few minutes (``--train-minutes``,
``--distill-minutes``) or loaded from ``--cache-dir``. For each batch size, on held-out prompts
(greedy, ``--max-new-tokens``): tokens/s of HF eager ``generate``, graph-mode plain decoding,
HF assisted generation (batch 1), and ``speculative_generate`` with every registered selector
(chains), one tree shape and TETRIS with the goodput budget, eager and graph mode; tokens per
step, VSR, rows identical to ``generate``. The goodput budget plans with a cost model of the
pair measured first in each mode (``CostModel.measure``: the run's batch sizes, widths 1..8),
printed, and written beside ``--output`` as ``<output>-cost-eager.json`` and
``-cost-graph.json``. Its graph row against fixed SD's is the budget's wall-clock check.
Every row runs to ``--max-new-tokens``, so a static batch lasts as long as its slowest row;
``--refill N`` runs ``N * B`` prompts through ``B`` slots instead (continuous batching,
``speculative_generate(..., slots=B)``: a finished row's slot takes the next prompt), and HF
``generate`` in ``N`` static batches of ``B``: the schedule where a selector's higher mean
tokens per step can shorten the run.

Part **s** — selection alone: µs per ``select`` + ``update`` at ``K = 8`` drafted tokens per row,
for fixed k=3, paper and default TETRIS, eager and replayed from a CUDA graph (captured after a
warm-up step, as the loop does), and whether every replayed selection equals the eager one
(two selectors fed the same random steps); and the same step compiled by ``torch.compile``
(Inductor fuses the element-wise work into a few kernels), captured and replayed, with the same
check.

Every timed call follows an untimed warm-up call of the same shape (graph mode captures there;
later calls replay). Times are medians of ``--repeats`` calls, synchronised.

Each part is meant to fit one command of at most 10 minutes on an H100. Measured there: part a
took 85 s and part s 103 s (its ``torch.compile`` cells included). Part b tokenizes for about
half a minute, trains for ``--train-minutes`` + ``--distill-minutes`` (4 by default) and then
measures, most of the time in the eager rows: one command measured ``--batch-sizes 1,8`` and
most of 32; ``--batch-sizes 32,64 --repeats 1`` measured 32 and two rows of 64. So give 32 and
64 a command each (a fresh machine trains its pair again); ``--refill`` multiplies each
batch's rows. Part b's rows also give a call's steps (in a static batch its slowest row's: no
row stops early) and their split, so a selector that raises the mean tokens per step without
shortening the batch shows it. Every row is
printed, and written to ``--output``, as soon as it is measured, and the parts stop measuring
once ``--time-limit`` seconds have passed (540 by default; 0 for none), so a command stopped at
a time limit still returns what it measured. A faster way of selecting that fails in part s
(a capture, a compilation) is reported in its cell, with the error on stderr.

    python benchmarks/bench_gpu.py --part s --output s.md
    python benchmarks/bench_gpu.py --part a --output a.md
    python benchmarks/bench_gpu.py --part b --cache-dir /tmp/specselect-pair --output b.md
    python benchmarks/bench_gpu.py --smoke --device cpu   # tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specselect import TreeSpec, make_selector
from specselect._checks import trusted_values
from specselect.cost import CostModel
from specselect.hf import emulate_on_cpu, release_workspace, speculative_generate
from specselect.hf.graphs import StageRunner
from specselect.selectors import SELECTORS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import selector_kwargs

# ------------------------------------------------------------------------------ shapes

TARGET_1B = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632, "vocab": 32000}
DRAFT_70M = {"hidden": 768, "layers": 4, "heads": 12, "kv_heads": 4, "ffn": 2048, "vocab": 32000}
# Part b: a 107M target and a 7.9M draft on the shipped 4096-token tokenizer.
TARGET_100M = {"hidden": 768, "layers": 16, "heads": 12, "kv_heads": 4, "ffn": 2048, "vocab": 4096}
DRAFT_9M = {"hidden": 384, "layers": 4, "heads": 6, "kv_heads": 2, "ffn": 1024, "vocab": 4096}
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}


def llama(shape: dict[str, int], vocab: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A Llama with ``shape`` (random weights, sdpa attention, eval mode)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab or shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=shape["hidden"] < 512,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(
    fn: Callable[[], Any], device: torch.device, repeats: int
) -> list[tuple[float, Any]]:
    """(seconds, result) of each of ``repeats`` calls, after one untimed warm-up."""
    fn()
    runs = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        runs.append((time.perf_counter() - start, result))
    return runs


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after one untimed warm-up; the last result."""
    runs = timed_runs(fn, device, repeats)
    return statistics.median(seconds for seconds, _ in runs), runs[-1][1]


# ------------------------------------------------------------------------------ part a


@dataclass
class StepCost:
    """ms per step of one configuration at one batch size."""

    label: str
    batch: int
    total: float
    split: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of(label: str, batch: int, stats: Any) -> StepCost:
        """ms per step of one call's ``stats`` (the first rows' prefill excluded; with
        ``--refill``, the prefills of rows started mid-run are in "bookkeeping"), split by
        phase."""
        steps = max(len(stats.steps), 1)
        split = {
            "draft": stats.draft_seconds,
            "select": stats.select_seconds,
            "verify": stats.verify_seconds,
            "bookkeeping": stats.other_seconds,
        }
        total = sum(s.seconds for s in stats.steps)
        return StepCost(
            label, batch, 1000 * total / steps, {k: 1000 * v / steps for k, v in split.items()}
        )


def median_cost(costs: list[StepCost]) -> StepCost:
    """The call whose ms/step is the median (the lower middle one of an even count): a whole
    call, so that its split still adds up to its total."""
    return sorted(costs, key=lambda cost: cost.total)[(len(costs) - 1) // 2]


def speculative_configs(k: int) -> list[tuple[str, dict[str, Any] | None, TreeSpec | None]]:
    """(label, selector kwargs or None for plain decoding, tree) of part a."""
    paper = {"name": "tetris", "k": k, "extra": 2, "estimator": None, "guard": False}
    return [
        ("plain (graph)", None, None),
        (f"fixed k={k}", {"name": "fixed", "k": k}, None),
        (f"default TETRIS k={k} extra=2", {"name": "tetris", "k": k, "extra": 2}, None),
        (f"paper TETRIS k={k} extra=2", paper, None),
        (f"fixed k={k} tree(3,2,2)", {"name": "fixed", "k": k}, TreeSpec(3, 2, 2)),
    ]


def step_costs(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    batch: int,
    args: argparse.Namespace,
) -> list[StepCost]:
    """Part a at one batch size: HF eager generate, then every config in graph mode."""
    device = target.device
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(1, target.config.vocab_size, (batch, args.prompt), generator=gen)
    ids, mask = prompt.to(device), torch.ones_like(prompt).to(device)
    new = args.steps

    def generate(tokens: int) -> float:
        """Median seconds of an HF ``generate`` call that emits ``tokens`` tokens per row."""
        seconds, _ = timed(
            lambda: target.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                eos_token_id=None,
                pad_token_id=0,
            ),
            device,
            args.repeats,
        )
        return seconds

    decode = (generate(new) - generate(1)) / (new - 1)  # the prefill emits the first token
    costs = [StepCost("HF generate (eager)", batch, 1000 * decode)]
    for label, spec, tree in speculative_configs(args.k):
        selector = None if spec is None else make_selector(**spec)

        def call(selector: Any = selector, tree: TreeSpec | None = tree) -> Any:
            return speculative_generate(
                target,
                draft,
                ids,
                mask,
                selector=selector,
                tree=tree,
                max_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
                cuda_graphs=args.graphs,
            )

        runs = timed_runs(call, device, args.repeats)
        costs.append(median_cost([StepCost.of(label, batch, out.stats) for _, out in runs]))
    release_workspace(target)
    return costs


def part_a(args: argparse.Namespace, device: torch.device) -> Iterator[str]:
    target_shape = SMOKE | {"vocab": 512} if args.smoke else TARGET_1B
    draft_shape = SMOKE | {"vocab": 512, "layers": 1} if args.smoke else DRAFT_70M
    target = llama(target_shape).to(device, args.dtype)
    draft = llama(draft_shape, seed=1).to(device, args.dtype)
    print(
        f"part a: target {params(target) / 1e6:.0f}M, draft {params(draft) / 1e6:.0f}M, "
        f"{args.dtype}, prompt {args.prompt}, {args.steps} new tokens",
        file=sys.stderr,
    )
    yield (
        "| B | configuration | ms/step (median, prefill excluded) | draft | select | verify "
        "| bookkeeping | break-even vs graph plain | vs HF generate |"
    )
    yield "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    with torch.no_grad():
        for batch in args.batch_sizes:
            if out_of_time(args):
                yield time_limit_note(args, f"batch sizes from {batch} on")
                return
            costs = step_costs(target, draft, batch, args)
            hf, plain = costs[0].total, costs[1].total
            for cost in costs:
                split = " | ".join(
                    f"{cost.split[k]:.2f}" if cost.split else ""
                    for k in ("draft", "select", "verify", "bookkeeping")
                )
                yield (
                    f"| {batch} | {cost.label} | {cost.total:.2f} | {split} "
                    f"| {cost.total / plain:.2f} | {cost.total / hf:.2f} |"
                )
            print(f"  batch {batch} done", file=sys.stderr)


# ------------------------------------------------------------------------------ part s


def selection_configs(k: int, width: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, selector kwargs) of part s; TETRIS drafts ``width`` tokens per row."""
    extra = width - k
    return [
        (f"fixed k={k}", {"name": "fixed", "k": k}),
        (
            f"paper TETRIS k={k} extra={extra}",
            {"name": "tetris", "k": k, "extra": extra} | {"estimator": None, "guard": False},
        ),
        (f"default TETRIS k={k} extra={extra}", {"name": "tetris", "k": k, "extra": extra}),
    ]


@dataclass
class SelectionSteps:
    """Static input and output buffers of a select + update step, and its inputs per step."""

    logprobs: Tensor  # [B, K] the draft log-probs the next step selects from
    draws: Tensor  # [B] accepted tokens, capped by the selected length
    mask: Tensor  # [B, K] bool: the last step's selection
    inputs: list[tuple[Tensor, Tensor]]  # per step: ([B, K] log-probs, [B] draws)

    @staticmethod
    def random(batch: int, width: int, steps: int, device: torch.device) -> SelectionSteps:
        gen = torch.Generator().manual_seed(batch)
        inputs = [
            (
                torch.rand(batch, width, generator=gen).log().to(device),
                torch.randint(0, width + 1, (batch,), generator=gen).to(device),
            )
            for _ in range(steps)
        ]
        return SelectionSteps(
            inputs[0][0].clone(),
            inputs[0][1].clone(),
            torch.zeros(batch, width, dtype=torch.bool, device=device),
            inputs,
        )

    def load(self, step: int) -> None:
        logprobs, draws = self.inputs[step]
        self.logprobs.copy_(logprobs)
        self.draws.copy_(draws)

    def stage(self, selector: Any) -> Callable[[], None]:
        """One select + update on the static buffers (capturable: no host reads)."""

        def run() -> None:
            selection = selector.select(self.logprobs)
            selector.update(selection, torch.minimum(selection.lengths, self.draws))
            self.mask.copy_(selection.mask)

        return run


#: The faster ways of part s, beside eager: the column labels of their times.
WAYS = ("replayed", "compiled")


@dataclass
class SelectionCost:
    """µs per select + update at one batch size: eager, and each of :data:`WAYS` that ran,
    with whether it selected exactly what the eager selector did at every step, or the error
    that stopped it."""

    eager: float
    times: dict[str, float]
    same: dict[str, bool]
    errors: dict[str, str] = field(default_factory=dict)


def selection_cost(
    spec: dict[str, Any], batch: int, width: int, device: torch.device, steps: int, fuse: bool
) -> SelectionCost:
    """Eager, replayed and (with ``fuse``) compiled select + update of ``spec``, each with its
    own selector, all fed the same steps. Compiled: ``torch.compile`` fuses the selector's
    element-wise work into a few kernels (Inductor); on a GPU the compiled step is then
    captured and replayed like the plain one, after two warm-up calls (compilation happens
    outside the capture; on the CPU, trace mode cannot trace a compiled function, so it runs
    as compiled)."""
    buffers = SelectionSteps.random(batch, width, steps, device)
    eager, graphed, compiled = (make_selector(**spec) for _ in range(3))
    key = graphed.capture_key
    runner = StageRunner("cuda" if device.type == "cuda" else "trace")
    ways: dict[str, Callable[[int], None]] = {}  # name -> a call at a step
    if key is not None:
        ways["replayed"] = lambda step: runner(key, buffers.stage(graphed))
        if fuse:
            # Every cell compiles the same function for another selector: forget the last
            # cell's compilations, or their count would reach Dynamo's recompile limit.
            torch._dynamo.reset()
            fused = torch.compile(buffers.stage(compiled), fullgraph=True)
            replays = device.type == "cuda"
            ways["compiled"] = lambda step: (
                runner(("compiled", key), fused) if replays and step >= 2 else fused()
            )
    same = dict.fromkeys(ways, True)
    errors: dict[str, str] = {}
    with torch.no_grad(), trusted_values():
        for step in range(steps):  # the selections, step by step (and the captures' warm-up)
            buffers.load(step)
            buffers.stage(eager)()
            expected = buffers.mask.clone()
            for name, way in list(ways.items()):
                try:
                    way(step)
                except Exception as err:  # a failed capture or compilation: report it, go on
                    errors[name] = f"{type(err).__name__}: {err}"
                    del ways[name]
                    continue
                same[name] = same[name] and torch.equal(buffers.mask, expected)
        eager_us = _per_call_us(buffers.stage(eager), device, steps)
        times = {
            name: _per_call_us(lambda way=way: way(steps), device, steps)
            for name, way in ways.items()
        }
    return SelectionCost(eager_us, times, same, errors)


def _per_call_us(call: Callable[[], None], device: torch.device, calls: int) -> float:
    """µs per call over ``calls`` back-to-back calls (synchronised at both ends only: what a
    loop that does not wait for the selection pays)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    sync(device)
    return 1e6 * (time.perf_counter() - start) / calls


def part_s(args: argparse.Namespace, device: torch.device) -> Iterator[str]:
    width = args.select_width
    yield (
        f"K = {width} drafted tokens per row; µs per select + update, {args.select_steps} "
        "steps of random draft log-probs and acceptance."
    )
    yield ""
    yield (
        "| B | selector | eager µs | replayed µs | replay = eager | compiled µs | "
        "compiled = eager |"
    )
    yield "|---:|---|---:|---:|---|---:|---|"
    for batch in args.select_batch_sizes:
        for label, spec in selection_configs(args.k, width):
            if out_of_time(args):
                yield time_limit_note(args, f"{label} at B = {batch} and what follows")
                return
            cost = selection_cost(spec, batch, width, device, args.select_steps, args.compile)
            cells = [f"{cost.eager:.0f}"]
            for name in WAYS:
                if name in cost.errors:
                    print(f"  {label}, B = {batch}, {name}: {cost.errors[name]}", file=sys.stderr)
                    cells += ["**failed** (stderr)", ""]
                    continue
                ran = name in cost.times
                cells += [f"{cost.times[name]:.0f}", _agrees(cost.same[name])] if ran else ["", ""]
            yield f"| {batch} | {label} | " + " | ".join(cells) + " |"
        print(f"  selection batch {batch} done", file=sys.stderr)


def _agrees(same: bool) -> str:
    return "yes" if same else "**no**"


# ------------------------------------------------------------------------------ part b


def python_sources(limit_mb: float) -> Iterator[str]:
    """Text of the installed Python sources (stdlib and site-packages), tests skipped."""
    roots = {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib")}
    total = 0
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            if {"test", "tests"} & set(path.parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            total += len(text)
            yield text
            if total > limit_mb * 2**20:
                return


#: Files per tokenizer call: a batch is spread over every core by the tokenizer's backend (one
#: file at a time, the 120 MB corpus took about two minutes of a 10-minute run).
TOKENIZE_BATCH = 256


def token_stream(tokenizer: Any, limit_mb: float) -> tuple[Tensor, Tensor]:
    """(train, held-out) int64 token streams; every 50th file is held out."""
    eos = tokenizer.eos_token_id
    streams: tuple[list[int], list[int]] = ([], [])  # train, held out
    files = enumerate(python_sources(limit_mb))
    while chunk := list(itertools.islice(files, TOKENIZE_BATCH)):
        encoded = tokenizer([text for _, text in chunk], add_special_tokens=False)["input_ids"]
        for (i, _), ids in zip(chunk, encoded, strict=True):
            streams[i % 50 == 0].extend([*ids, eos])
    train, held = streams
    return torch.tensor(train), torch.tensor(held)


def batches(stream: Tensor, batch: int, context: int, seed: int) -> Iterator[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=gen)
        yield torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def train(
    model: PreTrainedModel,
    stream: Tensor,
    minutes: float,
    loss_of: Callable[[PreTrainedModel, Tensor], Tensor],
    args: argparse.Namespace,
    lr: float,
) -> int:
    """AdamW with warm-up and cosine decay for a wall-clock budget; returns the steps taken."""
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    start, step = time.perf_counter(), 0
    budget = 60 * minutes
    for batch in batches(stream, args.train_batch, args.context, seed=step):
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            break
        frac = elapsed / budget
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(model, batch.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 200 == 0:
            print(f"    step {step}: loss {loss.item():.3f}", file=sys.stderr)
    model.eval()
    return step


def lm_loss(model: PreTrainedModel, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def distill_loss(target: PreTrainedModel) -> Callable[[PreTrainedModel, Tensor], Tensor]:
    """KL(target || draft) on the batch's positions."""

    def loss(draft: PreTrainedModel, batch: Tensor) -> Tensor:
        with torch.no_grad():
            teacher = torch.log_softmax(target(batch[:, :-1]).logits.float(), dim=-1)
        student = torch.log_softmax(draft(batch[:, :-1]).logits.float(), dim=-1)
        return F.kl_div(student, teacher, log_target=True, reduction="batchmean") / batch.shape[1]

    return loss


def trained_pair(
    args: argparse.Namespace, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedModel, Any, Tensor]:
    """(target, draft, tokenizer, held-out stream): loaded from ``--cache-dir`` (with the
    held-out stream of their corpus: nothing is tokenized again) or trained."""
    from specselect.models import load_tiny_pair

    tokenizer = load_tiny_pair()[2]
    vocab = len(tokenizer)
    shapes = (SMOKE, SMOKE | {"layers": 1}) if args.smoke else (TARGET_100M, DRAFT_9M)
    corpus_mb = 2 if args.smoke else args.corpus_mb
    cache = Path(args.cache_dir) if args.cache_dir else None
    meta = {
        "shapes": shapes,
        "train": args.train_minutes,
        "distill": args.distill_minutes,
        "corpus_mb": corpus_mb,
    }
    stored = cache / "meta.json" if cache is not None else None
    if (
        stored is not None
        and stored.exists()
        and json.loads(stored.read_text(encoding="utf-8")) == json.loads(json.dumps(meta))
    ):
        target = LlamaForCausalLM.from_pretrained(stored.parent / "target").to(device).eval()
        draft = LlamaForCausalLM.from_pretrained(stored.parent / "draft").to(device).eval()
        for model in (target, draft):
            model.set_attn_implementation("sdpa")
        held = torch.load(stored.parent / "held.pt")
        print(f"part b: pair loaded from {stored.parent}", file=sys.stderr)
        return target, draft, tokenizer, held
    start = time.perf_counter()
    train_stream, held = token_stream(tokenizer, corpus_mb)
    print(f"part b: corpus tokenized in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    target = llama(shapes[0], vocab).to(device)
    draft = llama(shapes[1], vocab, seed=1).to(device)
    print(
        f"part b: training a {params(target) / 1e6:.0f}M target and distilling a "
        f"{params(draft) / 1e6:.1f}M draft on {len(train_stream) / 1e6:.1f}M tokens",
        file=sys.stderr,
    )
    steps = train(target, train_stream, args.train_minutes, lm_loss, args, lr=6e-4)
    distilled = train(draft, train_stream, args.distill_minutes, distill_loss(target), args, 2e-3)
    print(f"  {steps} target steps, {distilled} draft steps", file=sys.stderr)
    if cache is not None:
        target.save_pretrained(cache / "target")
        draft.save_pretrained(cache / "draft")
        torch.save(held, cache / "held.pt")
        (cache / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return target, draft, tokenizer, held


@dataclass
class Run:
    batch: int
    method: str
    seconds: float
    tokens: int
    identical: int
    tokens_per_step: float | None = None
    vsr: float | None = None
    steps: int | None = None  # the call's steps (a static batch: its slowest row's)
    cost: StepCost | None = None  # ms per step of the last timed call, split by phase


def held_out_prompts(held: Tensor, batch: int, length: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held) - length, (batch,), generator=gen)
    return torch.stack([held[s : s + length] for s in starts.tolist()])


def end_to_end(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    ids: Tensor,
    args: argparse.Namespace,
    costs: dict[bool, CostModel],
) -> tuple[list[Run], bool]:
    """Part b at one batch size ``B`` (prompts without padding, no EOS: every row runs to the
    end), and whether ``--time-limit`` cut it short. ``ids`` holds ``B`` prompts, or with
    ``--refill N`` ``N * B``: ``speculative_generate`` then runs them through ``B`` slots
    (``slots=B``: a finished row's slot takes the next prompt) and HF in static batches of
    ``B``. ``costs``: the cost model of each mode (graphs or not) measured on this pair, which
    goodput-TETRIS and DSD plan with; a mode without one has no goodput-TETRIS row (and DSD
    plans with the library's default model)."""
    device, rows, new = ids.device, ids.shape[0], args.max_new_tokens
    batch = rows // max(args.refill, 1)  # slots
    mask = torch.ones_like(ids)
    common = {"max_new_tokens": new, "eos_token_id": None, "pad_token_id": 0}

    def in_batches(**kwargs: Any) -> Tensor:  # HF: static batches of B
        return torch.cat(
            [
                target.generate(
                    ids[i : i + batch], attention_mask=mask[i : i + batch], **kwargs, **common
                )
                for i in range(0, rows, batch)
            ]
        )

    seconds, reference = timed(lambda: in_batches(do_sample=False), device, args.repeats)
    tokens = rows * new
    runs = [Run(rows, "HF generate (eager)", seconds, tokens, rows)]

    def same(out: Tensor) -> int:
        return int((out == reference).all(dim=1).sum())

    if batch == 1:
        seconds, out = timed(
            lambda: in_batches(assistant_model=draft, do_sample=False), device, args.repeats
        )
        runs.append(Run(rows, "HF assisted (eager)", seconds, tokens, same(out)))
    slots = batch if args.refill else None
    # (method, label, selector spec, tree): --methods names the methods.
    configs: list[tuple[str, str, dict[str, Any] | None, TreeSpec | None]] = [
        ("plain", "plain", None, None)
    ]
    configs += [
        (name, name, {"name": name, **selector_kwargs(name, args.k)}, None) for name in SELECTORS
    ]
    configs.append(
        ("tree", "tetris tree(3,2,2)", {"name": "tetris", "k": args.k}, TreeSpec(3, 2, 2))
    )
    goodput = {"name": "tetris", "k": args.k, "extra": 2, "budget": "goodput"}
    configs.append(("goodput", GOODPUT_LABEL, goodput, None))
    chosen = [config[1:] for config in configs if config[0] in args.methods]
    cut = False
    for (label, spec, tree), graphs in itertools.product(chosen, args.graph_modes):
        if out_of_time(args):
            cut = True
            break
        planner = label == GOODPUT_LABEL or (spec is not None and spec["name"] == "dsd")
        if planner and graphs in costs:  # goodput-TETRIS and DSD plan with this mode's costs
            spec = {**(spec or {}), "cost_model": costs[graphs]}
        elif label == GOODPUT_LABEL:  # no measured costs in this mode: no row
            continue
        selector = None if spec is None else make_selector(**spec)
        seconds, out = timed(
            lambda s=selector, t=tree, g=graphs: speculative_generate(
                target, draft, ids, mask, selector=s, tree=t, cuda_graphs=g, slots=slots, **common
            ),
            device,
            args.repeats,
        )
        totals = out.stats.totals
        mode = "graph" if graphs else "eager"
        runs.append(
            Run(
                rows,
                f"{label} ({mode})",
                seconds,
                tokens,
                same(out.sequences),
                totals.tokens_per_step,
                totals.vsr,
                len(out.stats.steps),
                StepCost.of(label, batch, out.stats),
            )
        )
    release_workspace(target)
    return runs, cut


#: Part b's row of TETRIS with the goodput budget (k + extra = k + 2 deep at most).
GOODPUT_LABEL = "tetris goodput"
#: What part b can run besides HF's generate (``--methods``).
PART_B_METHODS = ("plain", *SELECTORS, "tree", "goodput")


def pair_costs(
    target: PreTrainedModel, draft: PreTrainedModel, args: argparse.Namespace
) -> Iterator[tuple[bool, CostModel | str]]:
    """Per mode of the run (graphs: False, True), the pair's cost model measured here with
    :meth:`CostModel.measure` (the batch sizes of the run, widths 1..8, the context halfway
    through a call), or why it could not be: what goodput-TETRIS and DSD plan with, so that
    their rows plan with the costs of the mode they run in. A failed measurement is its mode's
    message, not the end of the run."""
    batches = sorted(set(args.batch_sizes))
    if len(batches) < 2:  # the fit separates a per-row cost from the fixed one
        batches.append(2 * batches[0])
    context = args.prompt + args.max_new_tokens // 2
    planners = {"goodput", "dsd"}.intersection(args.methods)
    for graphs in args.graph_modes if planners else ():  # (a model no row plans with: none)
        try:
            yield (
                graphs,
                CostModel.measure(
                    target,
                    draft,
                    batch_sizes=batches,
                    widths=(1, 2, 4, 8),
                    contexts=(context,),
                    cuda_graphs=graphs,
                    repeats=3,
                    warmup=1,
                    progress=False,
                    note=f"bench_gpu.py part b pair, {'graphs' if graphs else 'eager'}",
                ),
            )
        except (RuntimeError, ValueError) as error:
            yield graphs, f"{type(error).__name__}: {error}"


def cost_rows(graphs: bool, model: CostModel | str, args: argparse.Namespace) -> Iterator[str]:
    """A measured cost model's rows (its times at the run's batch sizes, and where its file
    went: beside ``--output``), or why there is none."""
    mode = "graph" if graphs else "eager"
    if isinstance(model, str):
        yield f"| {mode} | | | | | not measured: {model} |"
        return
    where = ""
    if args.output:
        where = str(
            model.save(Path(args.output).with_name(f"{Path(args.output).stem}-cost-{mode}.json"))
        )
    for batch in args.batch_sizes:
        yield (
            f"| {mode} | {batch} | {1e3 * model.draft_time(batch, 1):.2f} "
            f"| {1e3 * model.verify_time(batch, batch):.2f} "
            f"| {1e3 * model.verify_time(batch, 8 * batch):.2f} | {where} |"
        )


def step_columns(run: Run) -> str:
    """Part b's steps and per-step split of a ``speculative_generate`` row (blank for HF's).
    In a static batch the steps are the slowest row's, so a selector that raises the mean
    tokens per step but not the slowest row's takes as many steps, each dearer (the batch's
    makespan); with ``--refill`` they are the call's, which every row's progress shortens."""
    if run.cost is None:
        return " | | | | "
    split = " | ".join(f"{run.cost.split[phase]:.2f}" for phase in SPLIT_PHASES)
    return f"{run.steps} | {split}"


#: The phases of a part b row's split, in ``StepCost.of``'s names.
SPLIT_PHASES = ("draft", "select", "verify", "bookkeeping")


def part_b(args: argparse.Namespace, device: torch.device) -> Iterator[str]:
    target, draft, _, held = trained_pair(args, device)
    target, draft = target.to(args.dtype), draft.to(args.dtype)
    yield f"Cost models of the pair, measured here ({GOODPUT_LABEL} plans with its mode's):"
    yield ""
    yield "| mode | B | draft pass ms | verify ms, 1 token per row | 8 tokens per row | file |"
    yield "|---|---:|---:|---:|---:|---|"
    costs: dict[bool, CostModel] = {}
    for graphs, model in pair_costs(target, draft, args):
        yield from cost_rows(graphs, model, args)
        if isinstance(model, CostModel):
            costs[graphs] = model
    yield ""
    yield (
        "| B | method | s | tok/s | vs generate | vs graph plain | tok/step | VSR | identical "
        "| steps | ms/step: draft | select | verify | bookkeeping |"
    )
    yield "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    with torch.no_grad():
        for batch in args.batch_sizes:
            if out_of_time(args):
                yield time_limit_note(args, f"batch sizes from {batch} on")
                return
            rows = batch * max(args.refill, 1)
            ids = held_out_prompts(held, rows, args.prompt, seed=batch).to(device)
            runs, cut = end_to_end(target, draft, ids, args, costs)
            base = runs[0].tokens / runs[0].seconds
            plain = next((r for r in runs if r.method == "plain (graph)"), None)
            for run in runs:
                rate = run.tokens / run.seconds
                vs_plain = "" if plain is None else f"{rate * plain.seconds / plain.tokens:.2f}x"
                tps = "" if run.tokens_per_step is None else f"{run.tokens_per_step:.2f}"
                # (none verified: plain decoding, or a threshold that drafted nothing)
                vsr = "" if run.vsr is None or math.isnan(run.vsr) else f"{run.vsr:.2f}"
                yield (
                    f"| {batch} | {run.method} | {run.seconds:.3f} | {rate:.0f} "
                    f"| {rate / base:.2f}x | {vs_plain} | {tps} | {vsr} "
                    f"| {run.identical}/{rows} | {step_columns(run)} |"
                )
            if cut:
                yield time_limit_note(args, f"the rest of batch {batch}")
            print(f"  batch {batch} done", file=sys.stderr)


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--part", choices=["a", "b", "s", "all"], default="all")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--batch-sizes",
        default=argparse.SUPPRESS,
        help="parts a and b (default: 1,8,32,64; with --smoke: 1,2)",
    )
    parser.add_argument("--k", type=int, default=3, help="base window of the selectors")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument(
        "--steps", type=int, default=32, help="part a: new tokens (steps), at least 2"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="part b: new tokens")
    parser.add_argument(
        "--refill",
        type=int,
        default=0,
        metavar="N",
        help="part b: N * B prompts per batch size B, through B slots (continuous batching: "
        "speculative_generate(slots=B)); HF generate runs them in N static batches of B. "
        "0: one static batch of B",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=argparse.SUPPRESS,
        help="timed calls (median) per cell (default: 2; with --smoke: 1)",
    )
    parser.add_argument("--cache-dir", help="part b: where the trained pair is kept")
    parser.add_argument(
        "--modes",
        default="eager,graph",
        help="part b: the modes speculative_generate runs in, of eager and graph",
    )
    parser.add_argument(
        "--methods",
        default=",".join(PART_B_METHODS),
        help="part b: what speculative_generate runs besides HF's generate, of "
        f"{', '.join(PART_B_METHODS)} (tree: TETRIS on a (3,2,2) tree; goodput: TETRIS with the "
        "goodput budget)",
    )
    parser.add_argument("--select-batch-sizes", default="1,8,32,64,256", help="part s")
    parser.add_argument("--select-width", type=int, default=8, help="part s: K per row")
    parser.add_argument("--select-steps", type=int, default=200, help="part s: steps timed")
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="part s: skip the torch.compile column (compiling takes a minute per cell; "
        "compiled: %(default)s)",
    )
    parser.add_argument("--corpus-mb", type=float, default=120.0, help="part b: corpus size")
    parser.add_argument("--train-minutes", type=float, default=3.0)
    parser.add_argument("--distill-minutes", type=float, default=1.0)
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--eager",
        dest="graphs",
        action="store_false",
        help="part a in eager mode, not CUDA graphs (graphs: %(default)s)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, batch sizes 1 and 2, one repeat: check the script (a few minutes "
        "on a CPU)",
    )
    parser.add_argument("--output", help="also write the tables to this markdown file")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=540.0,
        help="seconds after which the parts stop measuring (what they measured is printed "
        "already); 0: no limit. The default fits a 10-minute command with room to spare",
    )
    args = parser.parse_args(argv)
    given = vars(args)  # the two defaults that --smoke changes, where not given
    given.setdefault("batch_sizes", "1,2" if args.smoke else "1,8,32,64")
    given.setdefault("repeats", 1 if args.smoke else 2)
    if args.steps < 2:  # part a's HF step time is (steps tokens - 1 token) / (steps - 1)
        parser.error(f"--steps must be at least 2, got {args.steps}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.methods = args.methods.split(",")
    if unknown := sorted(set(args.methods) - set(PART_B_METHODS)):
        parser.error(
            f"--methods: unknown {', '.join(unknown)}; expected {', '.join(PART_B_METHODS)}"
        )
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - {"eager", "graph"}):
        parser.error(f"--modes: unknown {', '.join(unknown)}; expected eager, graph")
    args.graph_modes = [mode == "graph" for mode in ("eager", "graph") if mode in modes]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.select_batch_sizes = [int(b) for b in args.select_batch_sizes.split(",")]
    args.dtype = getattr(torch, args.dtype)
    args.deadline = time.perf_counter() + args.time_limit if args.time_limit > 0 else math.inf
    if args.smoke:
        args.train_minutes, args.distill_minutes = 0.05, 0.05
        args.train_batch, args.context, args.prompt = 4, 64, 16
        args.steps, args.max_new_tokens = 8, 16
        args.select_steps = 12
    return args


#: The parts, in the order they run: (name, title, the function that measures it).
PARTS: tuple[tuple[str, str, Callable[[argparse.Namespace, torch.device], Iterator[str]]], ...] = (
    ("a", "## a. Cost per step at realistic shapes", part_a),
    ("s", "## s. Selection: eager and replayed", part_s),
    ("b", "## b. End to end with a trained pair", part_b),
)


def out_of_time(args: argparse.Namespace) -> bool:
    """Whether ``--time-limit`` has passed: the parts then stop measuring, and what they
    measured is already printed."""
    return time.perf_counter() > args.deadline


def time_limit_note(args: argparse.Namespace, skipped: str) -> str:
    return f"(--time-limit {args.time_limit:g} s reached: {skipped} not measured)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        print("bench_gpu.py measures a CUDA GPU; --smoke checks it elsewhere", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # Each line goes out as soon as it is measured (and to --output, flushed): a run stopped
    # from outside, at a time limit of the machine, keeps every row it finished.
    with contextlib.ExitStack() as stack:
        output = (
            stack.enter_context(open(args.output, "w", encoding="utf-8")) if args.output else None
        )

        def emit(line: str) -> None:
            print(line, flush=True)
            if output is not None:
                output.write(line + "\n")
                output.flush()

        emit(f"# bench_gpu.py on {name}, torch {torch.__version__}")
        # Without a GPU (--smoke), graph mode runs in CPU trace mode: same code, no speed meaning.
        if device.type != "cuda":
            stack.enter_context(emulate_on_cpu())
        for part, title, measure in PARTS:
            if args.part in (part, "all"):
                for line in itertools.chain(("", title, ""), measure(args, device)):
                    emit(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
