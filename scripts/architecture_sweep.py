"""Run every causal LM class of the installed transformers through speculative_generate.

For each model type that ``AutoModelForCausalLM`` knows, the sweep builds a small random model
(the sizes of ``SIZES``; keys a config does not take are ignored or kept as attributes) and a
noisy copy of it as the draft, and compares greedy output with ``generate`` for fixed k = 3,
TETRIS and a draft tree, three left-padded prompts, 24 new tokens. Each type runs in a process
of its own, its address space capped (``--memory-gb``: some configs' default sizes ask for tens
of GiB), since some builds crash. Statuses:

* ``match``: all three equal ``generate``'s output;
* ``refused``: specselect itself raised a ``ValueError``/``TypeError`` (the reason is
  printed): a model the loop cannot drive, refused before any generation work;
* ``DIFFERS``: output differs from ``generate``'s without an error (a bug to fix);
* ``ERROR``: anything else was raised, also a ``ValueError`` from inside a model (a bug to
  fix, or a model that fails outside the loop too); ``crashed``: the process ended without an
  answer (its exit code and last error line are printed).

The runs that ended worst are named (ERROR, then DIFFERS, then refused).
* ``not built`` / ``no generate`` / ``too big``: the generic sizes do not fit this type, or
  its own ``generate`` failed on them: not a verdict on the loop.

    python scripts/architecture_sweep.py                 # every type, a markdown table
    python scripts/architecture_sweep.py llama bert      # some types
    python scripts/architecture_sweep.py --jobs 4        # 4 processes at a time (default 2)
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import traceback
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "ffn_dim": 128,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "initializer_range": 0.25,
    "init_std": 0.25,
    "tie_word_embeddings": False,
}
MAX_PARAMETERS = 30_000_000
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specselect"
TIMEOUT_S = 300


RESULT = "sweep result:"  # marks the child's answer among whatever the model prints
RUNS = ("fixed", "tetris", "tree")


def sweep_one(model_type: str) -> tuple[str, str]:
    """``(status, detail)`` of one model type (see the module doc)."""
    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # --jobs processes share the cores
    try:
        target, draft = build_pair(model_type)
    except Exception as error:  # any build failure is reported, not raised
        return "not built", f"{type(error).__name__}: {error}"
    if sum(p.numel() for p in target.parameters()) > MAX_PARAMETERS:
        return "too big", "the generic sizes do not apply to this config"
    ids, mask = prompts()
    try:
        with torch.no_grad():
            reference = target.generate(
                ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None
            )
    except Exception as error:
        return "no generate", f"{type(error).__name__}: {error}"
    outcomes = {run: speculative_run(run, target, draft, ids, mask, reference) for run in RUNS}
    for status in ("ERROR", "DIFFERS", "refused"):  # the worst outcome of the three runs
        runs = [run for run, (got, _) in outcomes.items() if got == status]
        if runs:
            return status, f"{', '.join(runs)}: {outcomes[runs[0]][1]}"
    return "match", ""


def build_pair(model_type: str) -> tuple[Any, Any]:
    """A small random target of ``model_type`` (SDPA where it has it) and a noisy copy."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(small_config(model_type)).eval()
    if getattr(target, "_supports_sdpa", False):
        target.set_attn_implementation("sdpa")
    draft = type(target)(target.config).eval()
    draft.load_state_dict(target.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in draft.parameters():
            scale = weight.std() if weight.numel() > 1 else weight.abs()
            noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
            weight.add_(noise * 0.15 * scale)
    return target, draft


def small_config(model_type: str) -> Any:
    """``model_type``'s config at ``SIZES``; where a config refuses a size it does not name
    (a read-only property, a check across fields), at the sizes its constructor names only."""
    import inspect

    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **SIZES)
    except Exception:
        config_class = type(AutoConfig.for_model(model_type))
        named = inspect.signature(config_class.__init__).parameters
        return config_class(**{key: value for key, value in SIZES.items() if key in named})


def prompts() -> tuple[Any, Any]:
    """Three left-padded prompts of 4, 9 and 6 tokens: ``([3, 9] ids, [3, 9] mask)``."""
    import torch

    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([4, 9, 6])
    mask = (torch.arange(9) >= 9 - lengths.unsqueeze(1)).long()
    return torch.randint(3, 128, (3, 9), generator=generator) * mask, mask


def speculative_run(
    run: str, target: Any, draft: Any, ids: Any, mask: Any, reference: Any
) -> tuple[str, str]:
    """``(status, detail)`` of one run: ``refused`` only for a ``ValueError``/``TypeError``
    that specselect itself raised (one raised inside a model's forward is an ``ERROR``)."""
    import torch

    from specselect import FixedWindowSelector, TetrisSelector, speculative_generate
    from specselect.hf import TreeSpec

    selector = FixedWindowSelector(3) if run == "fixed" else TetrisSelector(3, 2)
    tree = TreeSpec(depth=3, branch=2, width=2) if run == "tree" else None
    try:
        out = speculative_generate(
            target, draft, ids, mask, selector=selector, max_new_tokens=24, eos_token_id=None,
            tree=tree,
        )  # fmt: skip
    except Exception as error:
        raised_in = traceback.extract_tb(error.__traceback__)[-1].filename
        ours = raised_in.startswith(str(PACKAGE)) and isinstance(error, (ValueError, TypeError))
        return ("refused", str(error)) if ours else ("ERROR", f"{type(error).__name__}: {error}")
    return ("match", "") if torch.equal(out.sequences, reference) else ("DIFFERS", "")


def run_child(model_type: str, memory_gb: int) -> tuple[str, str]:
    """:func:`sweep_one` of ``model_type`` in a process of its own: ``(status, detail)``; a
    process that ends without an answer is ``crashed``, with its exit code and last error."""
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--one", model_type, "--memory-gb", str(memory_gb)],
            capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "timed out", f"over {TIMEOUT_S} s"
    answers = [line for line in child.stdout.splitlines() if line.startswith(RESULT)]
    if not answers:
        last = (child.stderr.strip().splitlines() or [""])[-1]
        return "crashed", f"exit code {child.returncode}: {last}"
    status, _, detail = answers[-1].removeprefix(RESULT).strip().partition("\t")
    return status, detail


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("types", nargs="*", help="model types (default: every causal LM type)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time (default 2)")
    parser.add_argument(
        "--memory-gb", type=int, default=8, help="address space per process (default 8 GiB)"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's model type
    args = parser.parse_args()
    if args.one:
        limit = args.memory_gb << 30  # a config's default sizes may ask for tens of GiB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        status, detail = sweep_one(args.one)
        print(f"{RESULT} {status}\t{' '.join(detail.split())[:200]}")
        return
    if args.jobs < 1 or args.memory_gb < 1:
        parser.error(f"--jobs and --memory-gb must be >= 1, got {args.jobs}, {args.memory_gb}")
    from tqdm.auto import tqdm
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(args.jobs) as pool:  # threads: each waits on its process
        verdicts = list(
            tqdm(
                pool.map(run_child, types, [args.memory_gb] * len(types)),
                total=len(types),
                desc="model types",
            )
        )
    print("| model type | status | detail |\n| --- | --- | --- |")
    for model_type, (status, detail) in zip(types, verdicts, strict=True):
        print(f"| {model_type} | {status} | {detail.replace('|', '/')} |")
    counts = Counter(status for status, _ in verdicts)
    print("\n" + ", ".join(f"{status}: {n}" for status, n in counts.most_common()))


if __name__ == "__main__":
    main()
