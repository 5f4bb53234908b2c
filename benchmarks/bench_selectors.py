"""Time every registered selector's ``select`` against the reference top-C formulation.

Budget rule: for a draft window ``K``, TETRIS verifies ``k = K - extra`` tokens per request on
average with ``extra = min(4, K // 2)`` (``K = 4, 8, 16`` give ``k = 2, 4, 12``), so the
budget is ``C = k * B``. The other selectors get windows of the same size: fixed ``k``, DSD and
threshold ``max_k = K``, heuristic ``k0 = k``, ``max_k = K``.

Columns: ``tetris`` is the paper's selector through ``select`` (argument checks included), on
CPU with the fused kernel of :mod:`specselect.native` when it could be built;
``tetris_pytorch`` the same with the fused kernel turned off (the PyTorch kernel that also
runs on accelerators and under ``torch.compile``); ``tetris_kernel`` the selection without the
argument checks; ``tetris_default`` the default selector (``TetrisSelector(k, extra)``: its
default estimator, the ranking choice, and its guard).

The reference formulation is what TETRIS computes, written the obvious way: cumulative
log-probabilities, a flattened ``topk(C)`` and a per-row count (``bincount``). The table also
shows it with ``topk(sorted=False)`` and, when ``torch_scatter`` is importable, with the count
done by ``scatter_max``; all three compute the same lengths. "fastest ref / tetris" is the
speed-up of TETRIS over the fastest of them on that row (named in "fastest ref"), not over the
sorted ``topk``, whose sorting TETRIS does not need. "same" says whether TETRIS's lengths equal
the reference's on the same input (continuous random draft probabilities, so ties, where
``topk``'s order is arbitrary, are practically absent). A method that does not run on a
configuration (``tetris_pytorch`` off the CPU) leaves its cell empty.

Timing: every method runs in the same process on the same input, in rounds; a round runs each
method ``--block`` times back to back, so a change in machine load hits all methods alike. The
table reports the median over all timed calls, in microseconds per call. On CUDA each call is
timed with CUDA events after a synchronize.

    python benchmarks/bench_selectors.py                 # CPU, and CUDA when present
    python benchmarks/bench_selectors.py --threads 1 --rounds 40 --output table.md
    python benchmarks/bench_selectors.py --profile       # op breakdown of TETRIS, B=1024 K=16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _args import at_least, output_file
from torch import Tensor

from specselect import native
from specselect.selection import Selector, chain_scores
from specselect.selectors import SELECTORS

try:  # optional: pip install torch-scatter (compiles from source, minutes)
    from torch_scatter import scatter_max
except ImportError:  # pragma: no cover - depends on the environment
    scatter_max = None


@dataclass(frozen=True)
class Config:
    device: str
    batch: int
    window: int  # K, drafted per request

    @property
    def extra(self) -> int:
        return min(4, self.window // 2)

    @property
    def k(self) -> int:
        return self.window - self.extra

    @property
    def budget(self) -> int:
        return self.k * self.batch


def selector_kwargs(name: str, cfg: Config) -> dict[str, object] | None:
    """Constructor arguments of a registered selector at this size (``None``: defaults)."""
    table: dict[str, dict[str, object]] = {
        # The paper's kernel (what the reference formulation computes); the default estimator
        # and guard are timed separately as "tetris_default".
        "tetris": {"k": cfg.k, "extra": cfg.extra, "estimator": None, "guard": False},
        "fixed": {"k": cfg.k},
        "dsd": {"max_k": cfg.window},
        "threshold": {"max_k": cfg.window, "threshold": 0.3},
        "heuristic": {"k0": cfg.k, "max_k": cfg.window},
    }
    return table.get(name)


def reference_lengths(logprobs: Tensor, budget: int, *, sorted_topk: bool = True) -> Tensor:
    """``[B]`` lengths: cumsum -> flattened topk(C) -> per-row count."""
    rows, cols = logprobs.shape
    index = chain_scores(logprobs).reshape(-1).topk(budget, sorted=sorted_topk).indices
    return torch.bincount(index // cols, minlength=rows)


def reference_lengths_scatter(logprobs: Tensor, budget: int) -> Tensor:
    """Like :func:`reference_lengths`, with the per-row count as ``scatter_max`` of column + 1."""
    rows, cols = logprobs.shape
    index = chain_scores(logprobs).reshape(-1).topk(budget, sorted=False).indices
    lengths, _ = scatter_max(index % cols + 1, index // cols, dim=0, dim_size=rows)
    return lengths


def make_input(cfg: Config, seed: int) -> Tensor:
    """``[B, K]`` float32 draft log-probabilities, continuous (no ties in practice)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(cfg.batch, cfg.window, generator=gen).clamp_min(1e-6)
    return probs.log().to(cfg.device)


def make_methods(cfg: Config, logprobs: Tensor) -> dict[str, Callable[[], object]]:
    """Every method to time, as zero-argument callables on the same input."""
    methods: dict[str, Callable[[], object]] = {
        "ref": lambda: reference_lengths(logprobs, cfg.budget),
        "ref_unsorted": lambda: reference_lengths(logprobs, cfg.budget, sorted_topk=False),
    }
    if scatter_max is not None:
        methods["ref_scatter"] = lambda: reference_lengths_scatter(logprobs, cfg.budget)
    for name in sorted(SELECTORS):
        selector = build(name, cfg)
        if selector is None:
            continue
        selector.draft_length(cfg.batch)  # window-based selectors decide their window here
        methods[name] = _bind(selector.select, logprobs)
        if name == "tetris":  # the kernel alone, without the argument checks of ``select``
            methods["tetris_kernel"] = _bind(selector._select, logprobs, None)
            if native.available() and torch.device(cfg.device).type == "cpu":
                methods["tetris_pytorch"] = _without_fused_kernel(selector.select, logprobs)
            default = SELECTORS["tetris"](k=cfg.k, extra=cfg.extra)  # ranking choice + guard
            methods["tetris_default"] = _bind(default.select, logprobs)
    return methods


def build(name: str, cfg: Config) -> Selector | None:
    kwargs = selector_kwargs(name, cfg)
    try:
        return SELECTORS[name](**(kwargs or {}))
    except (TypeError, ValueError) as err:
        print(f"skipping {name}: no benchmark arguments and the defaults fail ({err})")
        return None


def _bind(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: fn(*args)


def _without_fused_kernel(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    def call() -> object:
        with native.disabled():
            return fn(*args)

    return call


def time_methods(
    methods: dict[str, Callable[[], object]], device: str, rounds: int, block: int
) -> dict[str, float]:
    """Median microseconds per call of each method.

    Each round runs every method ``block`` times back to back (the first call of a block is a
    warm-up and is not recorded), so methods alternate often enough that a change in machine
    load hits all of them, while each call still finds warm caches as in a tight loop.
    ``block = 1`` interleaves single calls: caches then start cold for every call, which
    penalises methods made of many small kernels.
    """
    samples: dict[str, list[float]] = {name: [] for name in methods}
    timer = _time_cuda if device.startswith("cuda") else _time_cpu
    for _ in range(rounds):
        for name, fn in methods.items():
            fn()
            samples[name].extend(timer(fn) for _ in range(block))
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def _time_cpu(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_cuda(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def same_result(cfg: Config, logprobs: Tensor) -> bool:
    """TETRIS lengths equal the reference lengths on this input."""
    tetris = build("tetris", cfg).select(logprobs)  # type: ignore[union-attr]
    return torch.equal(tetris.lengths, reference_lengths(logprobs, cfg.budget))


#: The reference formulations, all computing the same lengths (the count ignores topk's order).
REFERENCES = ("ref", "ref_unsorted", "ref_scatter")
#: The leading columns of a row, then the methods' times, then :data:`TRAILER`.
CONFIG_COLUMNS = ("device", "B", "K", "k", "C")
TRAILER = ("fastest ref", "fastest ref / tetris", "same")


def row_cells(cfg: Config, micros: dict[str, float], same: bool) -> dict[str, str]:
    """The cells of one configuration's row, by column; the speed-up is over the fastest
    reference that ran (sorting the top ``C`` is work TETRIS does not need, so the sorted
    ``ref`` alone would flatter it)."""
    fastest = min((name for name in REFERENCES if name in micros), key=micros.__getitem__)
    config = (cfg.device, cfg.batch, cfg.window, cfg.k, cfg.budget)
    cells = dict(zip(CONFIG_COLUMNS, map(str, config), strict=True))
    cells |= {f"{name} µs": f"{value:.1f}" for name, value in micros.items()}
    speedup = micros[fastest] / micros["tetris"]
    trailer = (fastest, f"{speedup:.1f}x", "yes" if same else "NO")
    return cells | dict(zip(TRAILER, trailer, strict=True))


def markdown_table(rows: list[dict[str, str]]) -> list[str]:
    """The rows as a markdown table whose header is the union of their columns (in order of
    first appearance): configurations time different methods (``tetris_pytorch`` only on
    CPU, ``ref_scatter`` only with ``torch_scatter``); a method a row lacks is an empty cell."""
    timed = dict.fromkeys(c for row in rows for c in row if c not in CONFIG_COLUMNS + TRAILER)
    header = [*CONFIG_COLUMNS, *timed, *TRAILER]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return lines + ["| " + " | ".join(row.get(c, "") for c in header) + " |" for row in rows]


def run(args: argparse.Namespace) -> str:
    rows: list[dict[str, str]] = []
    for device in args.devices:
        for batch in args.batches:
            for window in args.windows:
                cfg = Config(device, batch, window)
                logprobs = make_input(cfg, seed=batch * 100 + window)
                methods = make_methods(cfg, logprobs)
                micros = time_methods(methods, device, args.rounds, args.block)
                rows.append(row_cells(cfg, micros, same_result(cfg, logprobs)))
                print(markdown_table(rows)[-1], flush=True)
    rule = "Budget: k = K - min(4, K // 2), C = k * B (TETRIS k and extra = K - k)."
    return "\n".join([rule, "", *markdown_table(rows)])


def profile_tetris(device: str, batch: int, window: int) -> None:
    """Print the op breakdown of TETRIS ``select`` at one size (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = Config(device, batch, window)
    logprobs = make_input(cfg, seed=0)
    selector = build("tetris", cfg)
    assert selector is not None
    for _ in range(20):
        selector.select(logprobs)
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(100):
            selector.select(logprobs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    parser.add_argument("--devices", nargs="+", default=default_devices)
    parser.add_argument("--batches", nargs="+", type=at_least(1), default=[1, 8, 64, 256, 1024])
    parser.add_argument("--windows", nargs="+", type=at_least(1), default=[4, 8, 16])
    parser.add_argument("--rounds", type=at_least(1), default=20, help="rounds over all methods")
    parser.add_argument(
        "--block", type=at_least(1), default=20, help="timed calls per method per round"
    )
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    parser.add_argument(
        "--output", type=output_file, default=None, help="also write the table to this file"
    )
    parser.add_argument("--profile", action="store_true", help="profile TETRIS, then exit")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"torch_scatter {'yes' if scatter_max is not None else 'no'}"
    )
    print(f"selection kernel on CPU: {native.status()}")
    if args.profile:
        for device in args.devices:
            profile_tetris(device, 1024, 16)
        return
    table = run(args)
    print()
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
