"""The ``specselect`` command line: ``compare`` and ``profile`` (also ``python -m specselect``).

``compare`` answers the question a user brings: on *my* models and prompts, which selector wins
and by how much? It only wires library pieces together — :func:`specselect.models.load_models`
and :func:`specselect.models.read_prompts` (the inputs), :func:`specselect.replay.record_traces`
and :func:`specselect.replay.reuse_traces` (traces recorded now, or earlier for this run),
:func:`specselect.replay.compare_replay` (exact greedy replay, every selector and the oracle),
``speculative_generate`` for ``--mode live``, and :func:`specselect.report.write_report`.
``compare --import`` imports a user's module first, so that selectors and estimators it
registers can be compared by name. ``profile`` measures what the models' forward passes cost
on this hardware (:meth:`specselect.cost.CostModel.measure`) and writes the cost model that
``compare --cost-model`` reads.

User errors (a bad argument, a missing model directory, an empty or unreadable prompts file, an
unknown selector, an invalid grid value, traces recorded from other models or prompts, an
unusable ``--out`` or ``--device``, an ``--import`` that does not exist) print one line on
stderr and exit with status 2, without a traceback. They are found before any model runs, so
that a mistake never costs a recording.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from specselect import __version__
from specselect._checks import check_usable_device
from specselect._registries import RegistrationError
from specselect.cost import CostFileError, CostModel, default_cost_model
from specselect.replay import (
    OracleSelector,
    ResultRow,
    SelectorConfig,
    TraceMismatchError,
    Traces,
    compare_live,
    compare_replay,
    cost_model_differences,
    load_traces,
    record_traces,
    reuse_traces,
    save_traces,
    selector_grid,
    traces_summary,
)
from specselect.replay.traces import check_positions, package_versions
from specselect.report import (
    PLOT_FILES,
    PLOTS_SKIPPED,
    format_table,
    matplotlib_missing,
    write_report,
)
from specselect.selectors.goodput import GOODPUT

EXIT_USAGE = 2
#: The largest integer an option takes: sizes beyond it failed inside torch (an int64 overflow)
#: or Python (``OverflowError``) with a traceback; none comes near it in a real run.
LARGEST_INT = 2**31 - 1
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_DEVICE, DEFAULT_DTYPE = "cpu", "float32"  # --device and --dtype of compare and profile
SHIPPED = "shipped tiny pair"
PLOT_SUFFIX = ".png"
"""``profile`` writes its plot next to ``--out``, with this suffix."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What ``torch.manual_seed`` accepts: the range ``--seed`` took while it seeded torch."""
SEED_DEPRECATED = (
    "--seed is deprecated and has no effect: compare draws no random numbers (replay and live "
    "runs are greedy), and leaves torch's random state as it was"
)


class UsageError(Exception):
    """A problem with the user's input: reported on stderr, exit status 2, no traceback."""


# --------------------------------------------------------------------------------------------
# Argument parsing
# --------------------------------------------------------------------------------------------


def int_list_option(
    option: str, minimum: int, names: tuple[str, ...] = (), at_least: int = 1
) -> Any:
    """An argparse ``type`` for comma-separated ints ``>= minimum``, or any of ``names``
    (duplicates dropped), at least ``at_least`` distinct ones."""
    expected = "integers" + "".join(f" or {name!r}" for name in names)

    def parse(text: str) -> list[int | str]:
        values: list[int | str] = []
        for item in text.split(","):
            item = item.strip()
            if item in names:
                if item not in values:
                    values.append(item)
                continue
            try:
                value = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{option} expects comma-separated {expected}, got {item!r}"
                ) from None
            if value < minimum:
                raise argparse.ArgumentTypeError(
                    f"{option} values must be >= {minimum}, got {value}"
                )
            if value > LARGEST_INT:
                raise argparse.ArgumentTypeError(
                    f"{option} values must be <= {LARGEST_INT}, got {value}"
                )
            if value not in values:
                values.append(value)
        if len(values) < at_least:
            raise argparse.ArgumentTypeError(
                f"{option} needs at least {at_least} distinct values, got {text!r}"
            )
        return values

    return parse


def _name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):  # "tetris," or "a,,b": a name lost, as --k refuses "2,,3"
        raise argparse.ArgumentTypeError(
            f"--selectors expects comma-separated selector names, got {text!r}"
        )
    from specselect.registry import parse_spec

    for name in names:
        try:
            parse_spec(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _seed(text: str) -> int:
    """An argparse ``type`` for ``--seed``: an integer in :data:`SEED_RANGE` (a command line
    that ran while ``--seed`` seeded torch runs still; one that failed fails as it did)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed expects an integer, got {text!r}") from None
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"--seed must be between -2**63 and 2**64 - 1 (torch's seed range), got {value}"
        )
    return value


def _tree_spec(text: str) -> Any:
    """``"4,2,2"`` -> ``TreeSpec(depth=4, branch=2, width=2)`` (argparse type)."""
    from specselect import TreeSpec

    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("--tree expects DEPTH,BRANCH,WIDTH, e.g. 4,2,2")
    try:
        depth, branch, width = (int(p) for p in parts)
        return TreeSpec(depth, branch, width)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _path(text: str) -> Path:
    """A path option's value: not empty (``Path("")`` is the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("expects a path, got an empty one")
    return Path(text)


def integer_option(option: str, minimum: int) -> Any:
    """An argparse ``type`` for one integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} expects an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{option} must be >= {minimum}, got {value}")
        if value > LARGEST_INT:
            raise argparse.ArgumentTypeError(f"{option} must be <= {LARGEST_INT}, got {value}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like the command's own: argparse's usage block before the
    error would bury it, and scripts can rely on one line (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


DEFAULT_THREADS = 1
"""``--threads``: one CPU thread. The shipped pair's matrices are too small to split, and on a
busy machine every extra thread waits for a core (measured in docs/compare.md)."""


def _selectors_help() -> str:
    from specselect.registry import available_selectors, spec_estimators

    return (
        f"comma-separated selectors, from: {', '.join(available_selectors())}; each optionally "
        "with +ESTIMATOR for selectors that take one, ESTIMATOR from: "
        f"{', '.join(spec_estimators())} (tetris+none is the paper's TETRIS, "
        "plain tetris uses its default estimator). Fixed SD (the baseline) and the oracle are "
        f"always included (default: {', '.join(default_selectors())})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specselect",
        description="Choose which draft tokens the target verifies in batched speculative "
        "decoding: compare selectors on your models and prompts.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_compare_parser(commands)
    _add_profile_parser(commands)
    return parser


def _add_compare_parser(commands: Any) -> None:
    compare = commands.add_parser(
        "compare",
        help="compare selectors (exact greedy replay, or live generation)",
        description="Record greedy traces of a target/draft pair on a set of prompts and "
        "compare selectors on them: tokens per step, VSR and goodput, each relative to "
        "fixed-window speculative decoding at the same k, with the oracle (a per-step bound) as "
        "the reference. "
        "Defaults to the pair and prompts shipped with specselect.",
    )
    _add_model_arguments(compare.add_argument_group("models and prompts"))
    _add_grid_arguments(compare.add_argument_group("selectors and grids"))
    _add_run_arguments(compare.add_argument_group("run"))
    compare.set_defaults(func=run_compare, prog=compare.prog)


def _add_model_arguments(models: Any) -> None:
    models.add_argument(
        "--target",
        metavar="DIR",
        type=_path,
        help="local HF model directory of the target (its tokenizer is used unless "
        "--tokenizer names another) (default: the shipped tiny pair)",
    )
    models.add_argument(
        "--draft",
        metavar="DIR",
        type=_path,
        help="local HF model directory of the draft (default: the shipped tiny pair)",
    )
    models.add_argument(
        "--tokenizer",
        metavar="DIR",
        type=_path,
        help="local directory of the pair's tokenizer, with --target/--draft (default: --target's)",
    )
    models.add_argument(
        "--prompts",
        metavar="FILE",
        type=_path,
        help=".jsonl (objects with a 'text' field, suffix in any case) or .txt (one prompt per "
        "line; so is any other suffix but .json, which is refused) (default: the shipped prompts)",
    )
    models.add_argument(
        "--limit",
        type=integer_option("--limit", 1),
        metavar="N",
        help="use the first N prompts (default: all)",
    )
    models.add_argument(
        "--traces",
        metavar="FILE",
        type=_path,
        help="reuse traces from this file if it exists (checked against --target/--draft or "
        "--prompts when given, and in live mode), else record them and save them "
        "there, creating its directory as --out does (default: record, and save them as "
        "traces.pt in --out)",
    )


def _add_grid_arguments(grid: Any) -> None:
    grid.add_argument(
        "--selectors", type=_name_list, default=None, metavar="NAMES", help=_selectors_help()
    )
    grid.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first: a module that registers selectors or estimators of its own "
        "(SELECTORS[name] = cls), which --selectors and this help then list. A module name, "
        "found in the working directory first (as python -m finds it), or the path of a .py "
        "file; repeatable",
    )
    grid.add_argument(
        "--k",
        metavar="K,...",
        type=int_list_option("--k", 1),
        default="2,3,4",
        help="mean windows k, the budget per request (default: %(default)s)",
    )
    grid.add_argument(
        "--extra",
        metavar="EXTRA,...",
        type=int_list_option("--extra", 0),
        default="1,2,3",
        help="extra draft tokens beyond k (default: %(default)s)",
    )
    grid.add_argument(
        "--budget",
        metavar="C,...",
        type=int_list_option("--budget", 0, names=(GOODPUT,)),
        default=[],
        help="absolute budgets C (draft tokens verified per step over the batch) "
        "for selectors that take one (TETRIS, oracle), in addition to k * active; "
        f"'{GOODPUT}' adds TETRIS with the goodput budget (C and the draft depth chosen every "
        "step for modelled goodput, under the cost model of the report) (default: none)",
    )


def _add_run_arguments(run: Any) -> None:
    run.add_argument(
        "--slots",
        type=integer_option("--slots", 1),
        default=32,
        metavar="N",
        help="batch slots (default: %(default)s)",
    )
    run.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=integer_option("--max-new-tokens", 1),
        default=64,
        help="tokens generated per request; EOS does not stop a request (default: %(default)s)",
    )
    run.add_argument(
        "--mode",
        choices=("replay", "live"),
        default="replay",
        help="replay: exact greedy replay with modelled goodput; live: run "
        "speculative_generate and measure wall-clock goodput (default: %(default)s)",
    )
    run.add_argument(
        "--refill",
        action="store_true",
        help="--mode live: run the prompts through --slots slots, each finished row's slot "
        "taken by the next prompt (continuous batching, as replay schedules them), instead of "
        "in static batches of --slots",
    )
    run.add_argument(
        "--cost-model",
        metavar="FILE",
        type=_path,
        default=None,
        help="cost model (JSON from specselect profile) that prices replayed steps and that "
        "DSD plans with (default: the shipped pair's, measured on one CPU thread)",
    )
    run.add_argument(
        "--tree",
        type=_tree_spec,
        default=None,
        metavar="DEPTH,BRANCH,WIDTH",
        help="live mode only: also run every selector that supports trees (the oracle aside: "
        "it is replayed) with a draft tree of this shape per request, next to its chain rows; "
        "budgeted selectors (TETRIS, fixed SD) verify as many nodes as their chains do, window "
        "selectors (DSD, the heuristic) the nodes their window reaches (default: chains only)",
    )
    run.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help="torch device for the models (default: %(default)s)",
    )
    run.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help="model dtype (default: %(default)s)",
    )
    run.add_argument(
        "--threads",
        metavar="N",
        type=integer_option("--threads", 0),
        default=DEFAULT_THREADS,
        help="CPU threads torch uses during the run, restored afterwards; 1 is fastest for "
        "small models such as the shipped pair, and on a busy machine; raise it for larger "
        "models on an otherwise idle CPU; 0 keeps torch's setting (one per core, or "
        "OMP_NUM_THREADS) (default: %(default)s)",
    )
    run.add_argument(
        "--seed",
        type=_seed,
        default=None,
        metavar="N",
        help="deprecated, no effect: compare draws no random numbers (replay and live runs are "
        "greedy), so every run is reproducible without a seed",
    )
    run.add_argument(
        "--out",
        metavar="DIR",
        type=_path,
        default=Path("specselect-compare"),
        help="output directory (results.json, report.md, plots, traces.pt), created and "
        "checked for writing before any work (default: %(default)s)",
    )
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars (neither specselect's nor transformers' weight loading)",
    )


def _add_profile_parser(commands: Any) -> None:
    from specselect.cost import (
        DEFAULT_BATCH_SIZES,
        DEFAULT_CONTEXTS,
        DEFAULT_REPEATS,
        DEFAULT_WIDTHS,
        STATISTICS,
    )

    profile = commands.add_parser(
        "profile",
        help="measure what the models' forward passes cost, for compare --cost-model",
        description="Time the target's verification passes and the draft's passes the way "
        "speculative_generate runs them (static caches, eager or CUDA graphs), over a grid of "
        "batch sizes and widths, fit a cost model with a knee, and write it as JSON with a plot "
        "of measured against fitted times next to it. Defaults to the shipped pair.",
    )
    profile.add_argument(
        "--target",
        metavar="DIR",
        type=_path,
        help="local HF model directory of the target (default: the shipped tiny pair)",
    )
    profile.add_argument(
        "--draft",
        metavar="DIR",
        type=_path,
        help="local HF model directory of the draft (default: the shipped tiny pair)",
    )
    profile.add_argument(
        "--device", default=DEFAULT_DEVICE, help="torch device to time on (default: %(default)s)"
    )
    profile.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help="model dtype (default: %(default)s)",
    )
    grids = [
        ("--batch-sizes", "B,...", 1, 2, DEFAULT_BATCH_SIZES, "rows per pass, at least two"),
        ("--widths", "W,...", 1, 2, DEFAULT_WIDTHS, "tokens per row of a verification pass "
         "(k + 1), at least two"),
        ("--contexts", "N,...", 0, 1, DEFAULT_CONTEXTS, "tokens already cached per row; "
         "several add context terms"),
    ]  # fmt: skip
    for option, metavar, minimum, at_least, default, text in grids:
        profile.add_argument(
            option,
            metavar=metavar,
            type=int_list_option(option, minimum, at_least=at_least),
            default=",".join(map(str, default)),
            help=f"{text} (default: %(default)s)",
        )
    profile.add_argument(
        "--repeats",
        metavar="N",
        type=integer_option("--repeats", 1),
        default=DEFAULT_REPEATS,
        help="timed calls per shape, of which a shape keeps one statistic (--statistic) "
        "(default: %(default)s)",
    )
    profile.add_argument(
        "--statistic",
        choices=STATISTICS,
        default="median",
        help="what a shape keeps of its timed calls: the median, or the minimum (on a shared "
        "machine, where other processes preempt many short passes and only ever add time) "
        "(default: %(default)s)",
    )
    profile.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time passes captured in CUDA graphs (--cuda-graphs), or eagerly "
        "(--no-cuda-graphs) (default: graphs on a CUDA device, else eager)",
    )
    profile.add_argument(
        "--threads",
        metavar="N",
        type=integer_option("--threads", 0),
        default=DEFAULT_THREADS,
        help="CPU threads torch uses while timing, restored afterwards; 0 keeps torch's "
        "setting (default: %(default)s)",
    )
    profile.add_argument(
        "--note", default="", help="free text kept in the file (how, why, what was running)"
    )
    profile.add_argument(
        "--out",
        metavar="FILE",
        type=_path,
        default=Path("cost.json"),
        help="the cost model's JSON file (not ending in .png: the plot goes next to it with the "
        "suffix .png) (default: %(default)s)",
    )
    profile.add_argument(
        "--no-plots",
        action="store_true",
        help="skip the PNG plot (a plot already next to --out is removed: it would pass for "
        "this run's fit)",
    )
    profile.add_argument("--quiet", action="store_true", help="no progress bars")
    profile.set_defaults(func=run_profile, prog=profile.prog)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _read_prompts_arg(path: Path) -> list[str]:
    """:func:`specselect.models.read_prompts` with its errors naming ``--prompts``."""
    from specselect.models import read_prompts

    try:
        return read_prompts(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--prompts: {exc}") from None


@dataclass(frozen=True)
class Inputs:
    """Everything ``compare`` needs besides the grid."""

    target: Any
    draft: Any
    tokenizer: Any
    prompts: list[str]
    source: str


def check_model_args(args: argparse.Namespace) -> None:
    """``--target`` and ``--draft`` come together and name HF model directories."""
    if (args.target is None) != (args.draft is None):
        raise UsageError(
            "--target and --draft go together: give both, or neither for the shipped pair"
        )
    if args.target is not None:
        _check_model_dir("--target", args.target)
        _check_model_dir("--draft", args.draft)


def check_tokenizer_arg(args: argparse.Namespace) -> None:
    """``--tokenizer`` (``compare``'s: ``profile`` reads no text) comes with the models'
    directories, and is one."""
    if args.tokenizer is not None:
        if args.target is None:
            raise UsageError("--tokenizer needs --target/--draft (the shipped pair has its own)")
        if not args.tokenizer.is_dir():
            raise UsageError(f"--tokenizer {str(args.tokenizer)!r} is not a directory")


def _check_model_dir(option: str, path: Path) -> None:
    if not path.is_dir():
        raise UsageError(f"{option} {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"{option} {str(path)!r} has no config.json (not an HF model directory)")


def check_device(device: str) -> None:
    """``--device`` names a device this torch can use (torch asserts, with a traceback, if not)."""
    try:
        check_usable_device("--device", device)
    except ValueError as error:
        raise UsageError(str(error)) from None


def load_inputs(args: argparse.Namespace) -> Inputs:
    """Models, tokenizer and prompt texts (the shipped ones unless the user gave their own)."""
    check_model_args(args)
    check_device(args.device)
    given = _read_prompts_arg(args.prompts) if args.prompts is not None else None
    if args.target is not None and given is None:
        raise UsageError("--prompts is required with --target/--draft")
    prompts: list[str]
    if args.target is None:
        target, draft, tokenizer, shipped = _shipped(args)
        prompts = shipped if given is None else given
        source = SHIPPED
    else:
        assert given is not None  # checked above
        prompts = given
        target, draft, tokenizer = _from_dirs(args)
        source = f"target {args.target}, draft {args.draft}"
        if args.tokenizer is not None:
            source += f", tokenizer {args.tokenizer}"
    if args.limit is not None:
        if args.limit > len(prompts):
            _warn(
                f"--limit {args.limit} is more than the {len(prompts)} prompts given; "
                f"using those {len(prompts)}"
            )
        prompts = prompts[: args.limit]
    return Inputs(target, draft, tokenizer, prompts, source)


def _warn(message: str) -> None:
    """One line on stderr: the run goes on, but not quite as asked."""
    print(f"specselect: warning: {message}", file=sys.stderr)


def _shipped(args: argparse.Namespace) -> tuple[Any, Any, Any, list[str]]:
    """The shipped pair and prompts (``specselect.models``), or a usage error saying why not."""
    try:
        from specselect.models import load_prompts, load_tiny_pair
    except ImportError as exc:
        raise UsageError(
            f"the shipped pair is not available ({exc}); pass --target, --draft and --prompts"
        ) from None
    try:
        prompts = [p["text"] for p in load_prompts()]
        target, draft, tokenizer = load_tiny_pair(DTYPES[args.dtype], args.device)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise UsageError(f"cannot load the shipped pair: {exc}") from None
    return target, draft, tokenizer, prompts


def _from_dirs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(target, draft, tokenizer)`` from local directories; the tokenizer is ``--tokenizer``'s,
    else the target's."""
    from specselect.models import load_models

    try:
        return load_models(
            args.target,
            args.draft,
            args.tokenizer,
            dtype=DTYPES[args.dtype],
            device=args.device,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise UsageError(f"cannot load the models: {exc}") from None


def _models_from_dirs(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(target, draft)`` from local directories, without a tokenizer (profiling needs none)."""
    from specselect.models import load_causal_lm

    try:
        target = load_causal_lm(args.target, DTYPES[args.dtype], args.device)
        draft = load_causal_lm(args.draft, DTYPES[args.dtype], args.device)
    except (OSError, ValueError, RuntimeError) as exc:
        raise UsageError(f"cannot load the models: {exc}") from None
    return target, draft


def tokenize(tokenizer: Any, prompts: Sequence[str]) -> list[Tensor]:
    """Token ids of each prompt (the tokenizer's own special tokens included)."""
    ids = []
    for index, text in enumerate(prompts):
        tokens = tokenizer(text)["input_ids"]
        if not tokens:
            raise UsageError(f"prompt {index} tokenizes to nothing: {text[:40]!r}")
        ids.append(torch.tensor(tokens, dtype=torch.int64))
    return ids


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


def obtain_traces(args: argparse.Namespace, max_k: int) -> tuple[Traces, Inputs | None]:
    """Load ``--traces`` if it exists (checked against the run), else record (and save) them."""
    path: Path | None = args.traces
    if path is not None and path.exists():
        traces = _load_traces_arg(path)
        name = f"--traces {str(path)!r}"
        with _as_usage_error():  # the shape first: a mismatch is found before loading models
            reuse_traces(traces, max_k=max_k, max_new_tokens=args.max_new_tokens, name=name)
        inputs = load_inputs(args) if _names_inputs(args) else None
        if inputs is None:
            _warn_unused_model_options(args, name)
        return _requests_to_use(traces, path, inputs, args, max_k), inputs
    # --out's directories are run_compare's to remove; --traces' parent is created for this.
    with contextlib.nullcontext() if path is None else _removed_if_failed(path.parent):
        return _record(args, path, max_k)


def _record(args: argparse.Namespace, path: Path | None, max_k: int) -> tuple[Traces, Inputs]:
    """Record the run's traces and save them to ``path`` (default: ``--out``)."""
    if path is not None:  # before recording, not after: the recording would be lost
        check_writable_dir(f"--traces {str(path)!r}", path.parent)
    inputs = load_inputs(args)
    prompt_ids = tokenize(inputs.tokenizer, inputs.prompts)
    try:
        check_positions(inputs.target, inputs.draft, prompt_ids, args.max_new_tokens, max_k)
    except ValueError as exc:
        raise UsageError(f"--prompts/--max-new-tokens/--k/--extra: {exc}") from None
    traces = record_traces(
        inputs.target,
        inputs.draft,
        prompt_ids,
        args.max_new_tokens,
        max_k,
        progress=not args.quiet,
        meta={"source": inputs.source, "device": args.device},
    )
    option, target = ("--traces", path) if path is not None else ("--out", args.out / "traces.pt")
    try:
        save_traces(traces, target)
    except OSError as exc:
        raise UsageError(f"{option}: cannot write {str(target)!r}: {_reason(exc)}") from None
    return traces, inputs


def _warn_unused_model_options(args: argparse.Namespace, name: str) -> None:
    """Say so when ``--device``/``--dtype`` ask for something a replay of traces, which loads
    no model, does not do (the report records the traces' own device and dtype)."""
    given = [
        f"{option} {value}"
        for option, value, default in (
            ("--device", args.device, DEFAULT_DEVICE),
            ("--dtype", args.dtype, DEFAULT_DTYPE),
        )
        if value != default
    ]
    if given:
        _warn(
            f"{' and '.join(given)} ignored: {name} is replayed without loading the models "
            "(the report gives the device and dtype the traces were recorded with)"
        )


def _load_traces_arg(path: Path) -> Traces:
    """``load_traces`` with its one-line errors naming ``--traces``."""
    if path.is_dir():
        raise UsageError(f"--traces {str(path)!r} is a directory, not a specselect trace file")
    try:
        return load_traces(path)
    except OSError as exc:
        raise UsageError(f"--traces {str(path)!r}: cannot read it: {_reason(exc)}") from None
    except ValueError as exc:
        raise UsageError(f"--traces {exc}") from None


def _names_inputs(args: argparse.Namespace) -> bool:
    """Does the run say which models and prompts it is about, so stored traces must match?

    ``--traces`` alone (replay) takes the traces as the inputs and never loads a model; naming
    models or prompts, or running them live, makes the traces a claim about those to check.
    """
    return args.mode == "live" or args.target is not None or args.prompts is not None


def _requests_to_use(
    traces: Traces, path: Path, inputs: Inputs | None, args: argparse.Namespace, max_k: int
) -> Traces:
    """The traces of the requests this run asks for, checked against its models and prompts
    (:func:`specselect.replay.reuse_traces`: the policy is the library's); a run that asks for
    more requests than they hold warns and uses those."""
    held = traces.num_requests
    limit: int | None = args.limit
    wanted = len(inputs.prompts) if inputs is not None else (limit or held)
    if inputs is None:  # the traces alone: they are the inputs, nothing to check them against
        used = traces if wanted >= held else traces.subset(range(wanted))
    else:
        with _as_usage_error():
            used = reuse_traces(
                traces,
                max_k=max_k,
                max_new_tokens=args.max_new_tokens,
                target=inputs.target,
                draft=inputs.draft,
                prompt_ids=tokenize(inputs.tokenizer, inputs.prompts),
                texts=inputs.prompts,
                partial=True,
                name=f"--traces {str(path)!r}",
            )
    if wanted > held:  # once they are known to serve the run: an error comes alone
        asked = (
            f"--limit {limit} asks for"
            if limit is not None and limit > held
            else f"this run has {wanted} prompts,"
        )
        _warn(
            f"{asked} more requests than --traces {str(path)!r} holds ({held}); using those {held}"
        )
    return used


@contextlib.contextmanager
def _as_usage_error() -> Iterator[None]:
    """The library's trace checks speak for the command line: their one-line messages as
    usage errors."""
    try:
        yield
    except TraceMismatchError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _removed_if_failed(path: Path) -> Iterator[None]:
    """Remove the directories of ``path`` that do not exist yet (as
    :func:`check_writable_dir` creates them) if the block fails while they are still empty: a
    run refused after the check leaves no empty ``--out`` behind. Directories that existed,
    or hold anything, are never removed."""
    missing = []  # deepest first
    for folder in (Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents):
        try:
            if folder.exists():
                break
        except OSError:  # a name too long, a folder we may not look into: leave it be
            break
        missing.append(folder)
    try:
        yield
    except BaseException:
        for folder in missing:
            with contextlib.suppress(OSError):  # not empty, or never created: keep going up
                folder.rmdir()
        raise


def check_writable_dir(option: str, path: Path) -> None:
    """Create ``path`` (and its parents) and write a probe file in it: a bad ``--out`` must
    fail before the work. ``option`` names the argument in the error.

    (``os.access`` is not enough: it says yes to root on read-only mounts, and to nothing on
    paths that do not exist yet.)
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{option}: {str(path)!r} exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(
            f"{option}: cannot create the directory {str(path)!r}: {_reason(exc)}"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:  # the errno can mislead (ENOENT in /proc): say what failed
        raise UsageError(
            f"{option}: the directory {str(path)!r} is not writable (creating a file in it "
            f"failed: {_reason(exc)})"
        ) from None


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


# --------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------


def _selector_names(args: argparse.Namespace) -> list[str]:
    """The selectors of the run; an unknown name is an error about ``--selectors``, checked
    here rather than while parsing it, since ``--import`` (parsed in any order) may register
    it."""
    from specselect.registry import parse_spec, selector_class

    names = args.selectors if args.selectors is not None else default_selectors()
    for base, _ in map(parse_spec, names):
        if base != OracleSelector.name:
            try:
                selector_class(base)
            except ValueError as exc:
                raise UsageError(f"argument --selectors: {exc}") from None
    return list(dict.fromkeys(["fixed", *names, OracleSelector.name]))


def default_selectors() -> list[str]:
    """Every registered selector, plus TETRIS as in the paper and with each estimator."""
    from specselect.estimators import DEFAULT_ESTIMATOR, ESTIMATORS
    from specselect.registry import available_selectors
    from specselect.replay import NO_ESTIMATOR

    others = [name for name in sorted(ESTIMATORS) if name != DEFAULT_ESTIMATOR]  # plain tetris
    return [*available_selectors(), *(f"tetris+{name}" for name in (NO_ESTIMATOR, *others))]


def run_compare(args: argparse.Namespace) -> int:
    """The ``compare`` command (see the module docstring).

    torch's CPU threads (``--threads``) and, with ``--quiet``, transformers' progress bars are
    set for the run only: a caller of :func:`main` gets its own settings back.
    """
    with _run_settings(args), _removed_if_failed(args.out):
        return _compare(args)


@contextlib.contextmanager
def _run_settings(args: argparse.Namespace) -> Iterator[None]:
    """``--threads`` and ``--quiet``'s silence of transformers' bars, for the block only."""
    with contextlib.ExitStack() as settings:
        settings.enter_context(_torch_threads(args.threads))
        if args.quiet:
            settings.enter_context(_no_transformers_progress_bars())
        yield


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count after it
    (``threads=0``: unchanged)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    """transformers' own bars ("Loading weights") off inside the block, as they were after."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no transformers: no bars to silence
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _compare(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    if args.seed is not None:
        _warn(SEED_DEPRECATED)
    check_model_args(args)
    check_tokenizer_arg(args)
    if args.tree is not None and args.mode != "live":
        raise UsageError("--tree needs --mode live: recorded traces hold chains, not trees")
    if args.refill and args.mode != "live":
        raise UsageError("--refill needs --mode live: replay always refills its slots")
    try:
        configs = selector_grid(_selector_names(args), args.k, args.extra, args.budget)
    except (TypeError, ValueError) as exc:  # TypeError: a grid_kwargs that cannot map the grid
        option = "--budget" if str(exc).startswith("budget") else "--selectors"
        raise UsageError(f"argument {option}: {exc}") from None
    max_k = max(args.k) + max(args.extra)
    check_writable_dir("--out", args.out)
    _check_outputs_writable(args.out, traces=args.traces is None)
    cost_model = _cost_model(args)
    _check_buildable(configs, cost_model)
    traces, inputs = obtain_traces(args, max_k)
    cost = _cost_summary(cost_model, traces)
    if args.mode == "live":
        if inputs is None:  # obtain_traces loads the models for live runs
            raise UsageError("--mode live needs the models")
        try:
            rows = compare_live(
                inputs.target,
                inputs.draft,
                traces,
                configs,
                args.slots,
                cost_model,
                args.tree,
                refill=args.refill,
                progress=not args.quiet,
            )
        except ValueError as exc:  # what the models cannot serve (positions, memory), named
            raise UsageError(str(exc)) from None
    else:
        replayed = compare_replay(traces, configs, args.slots, cost_model, progress=not args.quiet)
        rows = [ResultRow.replayed(config, result) for config, result in replayed]
    meta = _meta(args, traces, inputs is not None, cost, time.perf_counter() - began)
    try:
        written = write_report(rows, args.out, meta, plots=_draw_plots(args))
    except OSError as exc:
        what = repr(exc.filename) if exc.filename else "the report"
        raise UsageError(f"--out {str(args.out)!r}: cannot write {what}: {_reason(exc)}") from None
    print(format_table(rows, cost_model=cost["description"]))
    print()
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0


def _check_outputs_writable(out: Path, *, traces: bool) -> None:
    """Refuse, before the work, an ``--out`` where a file the run writes (``traces.pt`` too
    with ``traces``) is a directory: the run would fail after it, with a half-written report."""
    names = ("results.json", "report.md", *PLOT_FILES.values(), *(("traces.pt",) if traces else ()))
    for name in names:
        if (out / name).is_dir():
            raise UsageError(
                f"--out {str(out)!r}: {name!r} there is a directory, and the run writes a file "
                "of that name; remove it or choose another --out"
            )


def _check_buildable(configs: Sequence[SelectorConfig], cost_model: CostModel) -> None:
    """Build every configuration once before any model runs: a selector of one's own whose
    constructor refuses what its grid gives fails here, not after recording."""
    for config in configs:
        try:
            config.build(cost_model)
        except (TypeError, ValueError) as exc:
            raise UsageError(
                f"selector {config.label!r} cannot be built at this grid point ({exc}); a "
                "selector whose constructor does not take the grid's values by name (k, k0, "
                "extra, max_k, budget) overrides the classmethod grid_kwargs"
            ) from None


def _cost_summary(cost: CostModel, traces: Traces) -> dict[str, Any]:
    """What the report records of the cost model (:meth:`CostModel.summary`); marked, in its
    description too, and warned about, when it was not measured on the traces' models."""
    summary = cost.summary()
    differences = cost_model_differences(traces, cost)
    if differences:
        _warn(
            f"the cost model was not measured on the traces' models ({'; '.join(differences)}): "
            "modelled goodput prices these runs as if their passes cost what its models' do, a "
            "what-if"
        )
        summary["description"] += " (of other models: a what-if)"
        summary["other_models"] = differences
    return summary


def _meta(
    args: argparse.Namespace, traces: Traces, loaded: bool, cost: dict[str, Any], seconds: float
) -> dict:
    """What results.json and the report's Setup record of the run (``loaded``: whether this
    run loaded the models, rather than replaying ``--traces`` alone; ``cost``: the cost
    model's summary)."""
    return {
        "command": shlex.join(["specselect", *args.argv]),
        "mode": args.mode,
        "slots": args.slots,
        "refill": args.mode == "replay" or args.refill,
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "extra": args.extra,
        "budget": args.budget,
        **_models_setup(args, traces, loaded),
        "threads": torch.get_num_threads(),
        "cost_model": cost,
        "traces": traces_summary(traces),
        "models": {key: traces.meta.get(key) for key in ("target", "draft", "source")},
        "versions": package_versions(),  # this run's; the recording's are under traces
        "recorded_with": traces.meta.get("versions"),
        "eos": "ignored: every request runs to max_new_tokens",
        "wall_seconds": round(seconds, 2),
    }


def _models_setup(args: argparse.Namespace, traces: Traces, loaded: bool) -> dict[str, str]:
    """``device`` and ``dtype`` of the models: this run's when it loaded them, else what the
    traces recorded (``--device``/``--dtype`` did not apply), left out where they do not say."""
    if loaded:
        return {"device": args.device, "dtype": args.dtype}
    target = traces.meta.get("target")
    recorded = {
        "device": traces.meta.get("device"),
        "dtype": target.get("dtype") if isinstance(target, dict) else None,
    }
    return {key: str(value) for key, value in recorded.items() if value is not None}


def _cost_model(args: argparse.Namespace) -> CostModel:
    """``--cost-model``, or the shipped one (the table, the report and results.json name it)."""
    if args.cost_model is None:
        try:
            return default_cost_model()
        except FileNotFoundError as exc:
            raise UsageError(f"{exc} (or pass --cost-model)") from None
    try:
        model = CostModel.load(args.cost_model)
    except FileNotFoundError:
        raise UsageError(f"--cost-model {str(args.cost_model)!r} does not exist") from None
    except OSError as exc:
        raise UsageError(f"--cost-model {str(args.cost_model)!r}: {_reason(exc)}") from None
    except CostFileError as exc:
        raise UsageError(f"--cost-model: {exc}") from None
    if model.draft is None:
        raise UsageError(
            f"--cost-model {str(args.cost_model)!r} has no draft part (measured for plain "
            "decoding): every selector of a comparison drafts; profile the pair with --draft"
        )
    return model


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    """The ``profile`` command: measure, write the JSON and the plot, print the fit."""
    with _removed_if_failed(args.out.parent):
        return _profile(args)


def _profile(args: argparse.Namespace) -> int:
    from specselect.profiling import check_grid, format_cost_model, plot_cost_model

    check_model_args(args)
    check_device(args.device)
    try:
        check_grid(args.batch_sizes, args.widths, args.contexts)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.cuda_graphs and torch.device(args.device).type != "cuda":
        raise UsageError(f"--cuda-graphs needs a CUDA --device, got {args.device!r}")
    if args.out.is_dir():
        raise UsageError(f"--out {str(args.out)!r} is a directory; name the JSON file to write")
    if args.out.suffix.lower() == PLOT_SUFFIX:  # before the timing: it would be lost
        raise UsageError(
            f"--out {str(args.out)!r} ends in {PLOT_SUFFIX}, the suffix of the plot written next "
            "to it, which would overwrite the cost model; name the JSON file (e.g. cost.json)"
        )
    check_writable_dir(f"--out {str(args.out)!r}", args.out.parent)
    plot = args.out.with_suffix(PLOT_SUFFIX)
    if plot.is_dir() and not args.no_plots:  # before the timing: the plot would fail after it
        raise UsageError(f"--out {str(args.out)!r}: its plot's path {str(plot)!r} is a directory")
    with _run_settings(args):
        target, draft = _shipped(args)[:2] if args.target is None else _models_from_dirs(args)
        try:
            model = CostModel.measure(
                target,
                draft,
                dtype=DTYPES[args.dtype],
                batch_sizes=args.batch_sizes,
                widths=args.widths,
                contexts=args.contexts,
                cuda_graphs=args.cuda_graphs,
                repeats=args.repeats,
                statistic=args.statistic,
                progress=not args.quiet,
                note=args.note,
            )
        except ValueError as exc:  # a grid the fit cannot use, a model the loop cannot drive
            raise UsageError(str(exc)) from None
    written = {"json": model.save(args.out)}
    model = CostModel.load(written["json"])  # what compare --cost-model will read
    _warn_poor_fit(model)
    if _draw_plots(args):
        written["plot"] = plot_cost_model(model, plot)
    elif plot.is_file():  # an earlier run's plot would pass for this model's fit
        plot.unlink()
    print(format_cost_model(model))
    print()
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0


#: ``profile`` warns when its fit misses its own samples by more than these (median, max):
#: the bounds the shipped CPU model is held to (5% and 29% measured).
FIT_WARNING = (0.10, 0.35)


def _warn_poor_fit(model: CostModel) -> None:
    """Say so when the fit misses its own samples by more than :data:`FIT_WARNING`: noisy
    timings (a busy machine) or passes the model's terms do not describe."""
    errors = model.relative_errors()
    median, worst = statistics.median(errors), max(errors)
    if median > FIT_WARNING[0] or worst > FIT_WARNING[1]:
        _warn(
            f"the fit misses its own samples by {median:.0%} at the median and {worst:.0%} at "
            f"most (more than {FIT_WARNING[0]:.0%} and {FIT_WARNING[1]:.0%}): the timings were "
            "noisy or the passes do not follow the model's terms; on a busy machine try "
            "--statistic min, more --repeats, or fewer --threads"
        )


def _draw_plots(args: argparse.Namespace) -> bool:
    """Whether to draw plots: not with ``--no-plots``, nor without matplotlib (then saying so,
    in the library's words)."""
    if args.no_plots:
        return False
    if matplotlib_missing():
        _warn(PLOTS_SKIPPED)
        return False
    return True


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def import_plugins(argv: Sequence[str]) -> None:
    """Import every ``--import`` of ``argv``, before the parser is built: the registrations
    they make are what ``--selectors`` is checked against and ``--help`` lists.

    Raises:
        UsageError: a module or file that does not exist, or a registration that the registry
            refuses (a bad name, a class of the wrong kind). An error raised by the module's
            own code propagates with its traceback: it is the module's to fix.
    """
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command != "compare":  # only compare takes --import: the parser refuses it elsewhere
        return
    early = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    early.add_argument("--import", dest="imports", action="append", default=[])
    try:
        targets = early.parse_known_args(argv)[0].imports
    except (argparse.ArgumentError, SystemExit):  # no value: compare's parser says so
        return
    for target in targets:
        if target.endswith(".py"):
            importing = functools.partial(_import_file, Path(target))
        elif not target or "/" in target or os.sep in target or target.startswith("."):
            raise UsageError(
                f"--import: {target!r} is neither a module name nor a .py file (for a "
                "package, give its name and run from the directory that holds it)"
            )
        else:
            importing = functools.partial(_import_module, target)
        try:
            importing()
        except RegistrationError as exc:  # the registry refused what the module registers
            raise UsageError(f"--import {target}: {exc}") from None


def _import_module(name: str) -> None:
    here = os.getcwd()
    top = name.partition(".")[0]
    held = sys.modules.get(top)
    local = [Path(here, f"{top}.py"), Path(here, top, "__init__.py")]
    if held is not None and any(path.is_file() for path in local):
        where = Path(getattr(held, "__file__", None) or "").resolve()
        if where not in {path.resolve() for path in local}:  # another module of that name
            raise UsageError(
                f"--import: {top!r} names a module already imported ({held.__name__} from "
                f"{str(where)!r}), not the one in the working directory; rename yours"
            )
    try:
        with _first_on_path(here):  # as python -m finds it
            importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(f"{exc.name}.")):
            raise  # the module was found, and imports something missing itself
        raise UsageError(
            f"--import: no module named {name!r} in the working directory or on the Python "
            "path (to import a file, give its path ending in .py)"
        ) from None


def _import_file(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"--import: no file {str(path)!r}")
    held = sys.modules.get(path.stem)
    if held is not None:
        if Path(getattr(held, "__file__", None) or "").resolve() == path.resolve():
            return  # imported already
        raise UsageError(
            f"--import: {str(path)!r} would be imported as {path.stem!r}, which names another "
            "module already imported; rename the file"
        )
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"--import: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its classes pickle and its own imports find it by name
    try:
        with _first_on_path(str(path.resolve().parent)):  # as python file.py runs it
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise


@contextlib.contextmanager
def _first_on_path(folder: str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` inside the block (unless it is on it already)."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added:
            sys.path.remove(folder)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for user errors, without traceback)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        import_plugins(arguments)
    except UsageError as exc:  # only compare imports
        print(f"specselect compare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(arguments)
        if unknown:  # the subcommand's error, pointing at its help, not the top level's
            prog = parser.prog if args.command is None else args.prog
            parser.exit(
                EXIT_USAGE,
                f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see {prog} --help)\n",
            )
    except SystemExit as exc:  # argparse already printed usage and the error on stderr
        return int(exc.code or 0)
    args.argv = arguments
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except UsageError as exc:  # prefixed as argparse prefixes its own: "specselect compare: error:"
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as a filter does
        # Python flushes stdout at exit and would fail again: point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
