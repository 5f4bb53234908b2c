"""The tiny trained target/draft pair shipped with specselect, and the loaders of model pairs and
prompt files that every entry point shares.

Why ship a pair: selectors, verification and the HF loop need a draft that agrees with its
target *often but not always* to be tested and demonstrated offline. Random models agree only
by chance, and downloading real checkpoints is not allowed in tests or CI. The pair in
``tiny_pair/`` (about 14 MB of fp16 safetensors) was trained on the Python standard library by
``scripts/train_tiny_pair.py``; ``tiny_pair/MODEL_CARD.md`` records how and what it measures.
It is a toy for correctness tests and relative comparisons of selectors, not for speed or
quality claims about real models. ``tiny_pair/cost-cpu.json`` is its cost model measured on one
CPU thread (``specselect profile``), the default of :func:`specselect.cost.default_cost_model`.

One home for reading models and prompts: :func:`load_models` loads a target, a draft and a
tokenizer from local directories (``specselect compare --target/--draft``), :func:`load_pair`
a *pair directory* laid out like the shipped one (``target/``, ``draft/``, ``tokenizer/``,
``prompts.jsonl``; the benchmarks' ``--pair``), :func:`load_tiny_pair` the shipped pair;
:func:`read_prompts` reads a prompts file (``specselect compare --prompts``) and
:func:`load_prompts` a pair directory's ``prompts.jsonl``, with the same checks and errors.

``transformers`` is imported lazily so that ``import specselect.models`` (e.g. to read
:data:`TINY_PAIR_DIR`) stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import (
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

__all__ = [
    "PAIR_PARTS",
    "PROMPTS_FILE",
    "TINY_PAIR_DIR",
    "load_causal_lm",
    "load_models",
    "load_pair",
    "load_prompts",
    "load_tiny_pair",
    "read_prompts",
]

TINY_PAIR_DIR: Path = Path(__file__).resolve().parent / "tiny_pair"
"""Package directory holding ``target/``, ``draft/``, ``tokenizer/``, ``prompts.jsonl``, the
model card (``MODEL_CARD.md``, ``card.json``) and the measured CPU cost model
(``cost-cpu.json``)."""

PAIR_PARTS = ("target", "draft", "tokenizer")
"""The model directories of a pair directory (:func:`load_pair`), as in :data:`TINY_PAIR_DIR`."""
PROMPTS_FILE = "prompts.jsonl"
"""A pair directory's prompts (:func:`load_prompts`)."""

_REQUIRED = (
    "target/config.json",
    "target/model.safetensors",
    "draft/config.json",
    "draft/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    PROMPTS_FILE,
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


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


#: Names of the files a saved tokenizer keeps, one of which every saved HF tokenizer has:
#: ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``, ``vocab.json`` or
#: ``vocab.txt``, ``merges.txt``, a sentencepiece ``*.model`` (``spiece.model``, ...), a
#: ``*.tiktoken`` file.
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")


def _check_tokenizer_files(directory: str | Path, given: bool) -> None:
    """Raise ``OSError`` naming the directory when it exists but holds no tokenizer file
    (:data:`TOKENIZER_FILES`). transformers then either blames missing sentencepiece or
    tiktoken packages or, in some 5.x releases, builds a tokenizer of a few tokens from the
    model's config alone, which would tokenize every prompt wrongly without a word."""
    path = Path(directory)
    if path.is_dir() and not any(
        match.is_file() for pattern in TOKENIZER_FILES for match in path.glob(pattern)
    ):
        where = "" if given else " (the target's: the tokenizer is read from there by default)"
        raise OSError(
            f"{str(path)!r}{where} holds no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}): save the tokenizer there with save_pretrained"
            + ("" if given else ", or name its directory (tokenizer=; --tokenizer on the CLI)")
        )


def load_models(
    target: str | Path,
    draft: str | Path,
    tokenizer: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(target, draft, tokenizer)`` from local HF directories, offline, in eval mode.

    Args:
        target: directory of the target causal LM.
        draft: directory of the draft causal LM (it must share the target's vocabulary).
        tokenizer: directory of the tokenizer; None: the target's directory.
        dtype: floating-point dtype the weights are cast to.
        device: where the models are moved.
        attn_implementation: the attention kernel (``"sdpa"``: tree verification needs custom
            4D masks, which FlashAttention kernels do not take); None: transformers' default.

    Raises:
        TypeError, ValueError: a bad ``dtype``, ``device`` or ``attn_implementation``.
        OSError: a directory transformers cannot load (its own message names it).
    """
    from transformers import AutoTokenizer

    # The tokenizer first: it loads in milliseconds, so a wrong directory fails before the models.
    tokenizer_dir = target if tokenizer is None else tokenizer
    _check_tokenizer_files(tokenizer_dir, given=tokenizer is not None)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    loaded = [load_causal_lm(path, dtype, device, attn_implementation) for path in (target, draft)]
    return loaded[0], loaded[1], loaded_tokenizer


def load_causal_lm(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load one causal LM from a local HF directory, offline, in eval mode: what
    :func:`load_models` does for each model, without a tokenizer (timing passes, as
    ``specselect profile`` does, needs none).

    Raises:
        TypeError, ValueError: a bad ``dtype``, ``device`` or ``attn_implementation``.
        OSError: a directory transformers cannot load (its own message names it).
    """
    dtype = _check_dtype(dtype)
    device = _check_device(device)
    _check_attn_implementation(attn_implementation)
    from transformers import AutoModelForCausalLM

    options: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(directory, **options)
    # transformers decorates PreTrainedModel.to with functools.wraps, whose typeshed stub
    # (_Wrapped) does not bind ``self``, so mypy checks ``device`` against ``self``.
    return model.to(device).eval()  # type: ignore[arg-type]


def _check_attn_implementation(attn_implementation: object) -> None:
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(
            f"attn_implementation must be a str or None, got {type(attn_implementation).__name__}"
        )


def load_pair(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(target, draft, tokenizer)`` from a pair directory laid out like the shipped one
    (:data:`PAIR_PARTS`: ``target/``, ``draft/``, ``tokenizer/``; its prompts, in
    ``prompts.jsonl``, are :func:`load_prompts`'s), offline, in eval mode (see
    :func:`load_models`).

    Raises:
        FileNotFoundError: the directory lacks one of :data:`PAIR_PARTS`.
    """
    directory = Path(directory)
    for part in PAIR_PARTS:
        if not (directory / part).is_dir():
            raise FileNotFoundError(
                f"pair directory {str(directory)!r} has no {part}/ (a pair directory holds "
                f"{', '.join(f'{p}/' for p in PAIR_PARTS)} and {PROMPTS_FILE}, as "
                "specselect.models.TINY_PAIR_DIR does)"
            )
    return load_models(
        *(directory / part for part in PAIR_PARTS),
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
    )


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
    for rel in _REQUIRED:
        _pair_file(rel)
    target, draft, tokenizer = load_pair(
        TINY_PAIR_DIR, dtype, device, attn_implementation=attn_implementation
    )
    return target, draft, tokenizer  # type: ignore[return-value]  # the shipped pair is a Llama


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def read_prompts(path: str | Path) -> list[str]:
    """Prompt texts from ``path``: ``.jsonl`` (suffix in any case), one object with a string
    ``text`` field per line; any other suffix, one prompt per line. Blank lines are skipped.

    ``.json`` is refused: read as text, each line of a JSON document would silently become a
    prompt verbatim, and a JSON document is not JSONL.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a ``.json`` file, a file that is not UTF-8 text, one that holds no prompts,
            or a JSONL line that is not an object with a string ``text`` field (naming the file
            and the line).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        raise ValueError(
            f"prompts file {str(path)!r}: a .json file is not a prompts file; expected .txt "
            "(one prompt per line) or .jsonl (one object with a 'text' field per line)"
        )
    if suffix == ".jsonl":
        return [record["text"] for record in _read_records(path)]
    return [line for _, line in _read_lines(path)]


def load_prompts(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """The prompts of a pair directory (its ``prompts.jsonl``) as records with a ``text``
    field, read as :func:`read_prompts` reads JSONL.

    Without ``directory``: the 40 shipped prompts, ``{"text", "kind", "source"}`` with kind
    ``"code"`` or ``"prose"``. They come only from stdlib files that were held out of training
    (``source`` names the file; ``card.json`` lists all held-out files), so the pair has never
    seen them.
    """
    path = _pair_file(PROMPTS_FILE) if directory is None else Path(directory) / PROMPTS_FILE
    return _read_records(path)


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of a prompts file with their 1-based numbers.

    Lines end at ``\\n`` only (``read_text`` has turned ``\\r\\n`` into it): ``str.splitlines``
    would also split at the Unicode line separators that a JSON string may hold unescaped.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM is no part of a prompt
    except FileNotFoundError:
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read prompts file {str(path)!r}: {exc}") from None
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise ValueError(f"prompts file {str(path)!r} holds no prompts")
    return lines


def _read_records(path: Path) -> list[dict[str, Any]]:
    return [_record(path, number, line) for number, line in _read_lines(path)]


def _record(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{path}:{number}: expected an object with a string 'text' field")
    return record
