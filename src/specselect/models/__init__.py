"""The tiny trained target/draft pair shipped with specselect.

Why ship a pair: selectors, verification and the HF loop need a draft that agrees with its
target *often but not always* to be tested and demonstrated offline. Random models agree only
by chance, and downloading real checkpoints is not allowed in tests or CI. The pair in
``tiny_pair/`` (about 14 MB of fp16 safetensors) was trained on the Python standard library by
``scripts/train_tiny_pair.py``; ``tiny_pair/MODEL_CARD.md`` records how and what it measures.
It is a toy for correctness tests and relative comparisons of selectors, not for speed or
quality claims about real models. ``tiny_pair/cost-cpu.json`` is its cost model measured on one
CPU thread (``specselect profile``), the default of :func:`specselect.cost.default_cost_model`.

``transformers`` is imported lazily so that ``import specselect.models`` (e.g. to read
:data:`TINY_PAIR_DIR`) stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["TINY_PAIR_DIR", "load_prompts", "load_tiny_pair"]

TINY_PAIR_DIR: Path = Path(__file__).resolve().parent / "tiny_pair"
"""Package directory holding ``target/``, ``draft/``, ``tokenizer/``, ``prompts.jsonl``, the
model card (``MODEL_CARD.md``, ``card.json``) and the measured CPU cost model
(``cost-cpu.json``)."""

_REQUIRED = (
    "target/config.json",
    "target/model.safetensors",
    "draft/config.json",
    "draft/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "prompts.jsonl",
)


def _pair_file(relative: str) -> Path:
    """Path of a shipped file, or a FileNotFoundError that says how to recreate the pair.

    Reads the module-level :data:`TINY_PAIR_DIR` at call time so tests can point it elsewhere.
    """
    path = TINY_PAIR_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"tiny pair file {path} is missing; the package data under {TINY_PAIR_DIR} is "
            "incomplete. Reinstall specselect, or recreate it with "
            "`python scripts/train_tiny_pair.py` from a source checkout."
        )
    return path


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    return dtype


def _check_device(device: object) -> torch.device:
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device must name a torch device (e.g. 'cpu'), got {device!r}") from err


def load_tiny_pair(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attn_implementation: str = "sdpa",
) -> tuple[LlamaForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load the shipped ``(target, draft, tokenizer)``, offline, in eval mode.

    The weights are stored in fp16 and cast to ``dtype`` on load; use float32 on CPU (fp16
    matmuls there are slow and the card's numbers were measured in float32). Both models share
    the tokenizer, whose single special token ``<|endoftext|>`` is EOS, BOS and pad; it pads on
    the left and starts every encoded text with that token, as every training file started.
    SDPA attention is the default because tree verification needs custom 4D masks, which
    FlashAttention kernels do not take.
    """
    dtype = _check_dtype(dtype)
    device = _check_device(device)
    if not isinstance(attn_implementation, str):
        raise TypeError(
            f"attn_implementation must be a str, got {type(attn_implementation).__name__}"
        )
    for rel in _REQUIRED:
        _pair_file(rel)
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    target, draft = (
        LlamaForCausalLM.from_pretrained(
            TINY_PAIR_DIR / name,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
        )
        # transformers decorates PreTrainedModel.to with functools.wraps, whose typeshed stub
        # (_Wrapped) does not bind ``self``, so mypy checks ``device`` against ``self``.
        .to(device)  # type: ignore[arg-type]
        .eval()
        for name in ("target", "draft")
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        TINY_PAIR_DIR / "tokenizer", local_files_only=True
    )
    return target, draft, tokenizer


def load_prompts() -> list[dict[str, str]]:
    """The 40 shipped prompts: ``{"text", "kind", "source"}`` with kind ``"code"`` or ``"prose"``.

    They come only from stdlib files that were held out of training (``source`` names the file;
    ``card.json`` lists all held-out files), so the pair has never seen them.
    """
    lines = _pair_file("prompts.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
