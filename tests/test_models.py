"""The shipped tiny pair: files, offline loading, shared vocabulary, prompts, and quality; the
loaders of pair directories and prompt files that every entry point shares.

The quality check re-measures the pair's greedy agreement with a loop written here (not the
training script's) and compares it with the range that ``card.json`` states, so a broken
package-data copy, a wrong dtype cast or a retrained pair without an updated card fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import Tensor

import specselect.models as models
from specselect.hf.compat import cache_argument
from specselect.models import (
    PAIR_PARTS,
    TINY_PAIR_DIR,
    load_models,
    load_pair,
    load_prompts,
    load_tiny_pair,
    read_prompts,
)


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads((TINY_PAIR_DIR / "card.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple]:
    """Loaded once per module, with the hub switched off as in CI."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield load_tiny_pair()


@pytest.mark.parametrize("name", ["target", "draft"])
def test_weights_are_stored_in_fp16(name: str) -> None:
    with safe_open(TINY_PAIR_DIR / name / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118
    assert dtypes == {"F16"}


def test_loads_in_float32_eval_mode_on_cpu(pair: tuple) -> None:
    target, draft, _ = pair
    for model in (target, draft):
        assert not model.training
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert target.num_parameters() > 4 * draft.num_parameters()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_argument_casts_weights(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, draft, _ = load_tiny_pair(dtype=dtype)
    assert {p.dtype for m in (target, draft) for p in m.parameters()} == {dtype}


def test_models_share_the_tokenizer_vocab(pair: tuple, card: dict) -> None:
    target, draft, tok = pair
    eos = tok.eos_token_id
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert len(tok) == card["tokenizer"]["vocab_size"]
    assert eos == tok.pad_token_id == card["tokenizer"]["eos_id"]
    for model in (target, draft):
        assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
        assert model.generation_config.pad_token_id == eos
        assert model.get_input_embeddings().weight.shape[0] == len(tok)


def test_tokenizer_pads_left_and_starts_with_eos(pair: tuple) -> None:
    _, _, tok = pair
    texts = ["def f(x):\n    return x", "x"]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc.input_ids, enc.attention_mask  # [2, T]
    assert tok.padding_side == "left"
    assert mask[1, 0] == 0 and mask[1, -1] == 1  # short row is padded on the left
    first_real = mask.long().argmax(dim=1)
    assert torch.equal(ids[torch.arange(2), first_real], torch.full((2,), tok.eos_token_id))
    assert tok.decode(ids[0], skip_special_tokens=True) == texts[0]


def test_prompts_come_from_held_out_files(card: dict) -> None:
    prompts = load_prompts()
    held_out = set(card["corpus"]["held_out_files"])
    assert len(prompts) == card["prompts"]["count"] == 40
    assert [p["kind"] for p in prompts].count("code") == 20
    assert [p["kind"] for p in prompts].count("prose") == 20
    for p in prompts:
        assert set(p) == {"text", "kind", "source"}
        assert p["source"] in held_out, p["source"]
        if p["kind"] == "code":
            assert p["text"].lstrip().startswith("def ")
        else:
            assert 150 <= len(p["text"]) <= 300
    assert len({p["text"] for p in prompts}) == len(prompts)


def test_missing_files_raise_a_clear_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "TINY_PAIR_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tiny pair file .*missing"):
        load_tiny_pair()
    with pytest.raises(FileNotFoundError, match=r"prompts\.jsonl"):
        load_prompts()


@pytest.mark.parametrize(
    ("suffix", "content", "expected"),
    [
        (".txt", "a\n\n b \n", ["a", " b "]),
        (".txt", "a\r\nb\r\n", ["a", "b"]),
        (".txt", "a\x0cb\n", ["a\x0cb"]),  # a form feed does not end a line
        (".jsonl", '{"text": "x = 1"}\n\n{"text": "y", "kind": "code"}\n', ["x = 1", "y"]),
        (".JSONL", '{"text": "x = 1"}\n', ["x = 1"]),  # not the JSON line as a prompt
        # JSON strings may hold U+2028 unescaped; it does not end a line
        (".jsonl", '{"text": "a\u2028b"}\n', ["a\u2028b"]),
        # a byte-order mark (Windows editors) is no part of the first prompt, nor JSON
        (".txt", "\ufeffhello\r\nsecond\r\n", ["hello", "second"]),
        (".jsonl", '\ufeff{"text": "x"}\n', ["x"]),
    ],
)
def test_read_prompts(tmp_path: Path, suffix: str, content: str, expected: list[str]) -> None:
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(content.encode("utf-8"))
    assert read_prompts(path) == expected


BAD_PROMPTS = {
    "missing": (None, FileNotFoundError, "prompts file '{path}' does not exist"),
    "empty": (b"\n \n", ValueError, "prompts file '{path}' holds no prompts"),
    "not utf-8": (b"\xff\xfe prompt", ValueError, "cannot read prompts file '{path}'"),
    "bad json": (b'{"text": "ok"}\n\n{not json\n', ValueError, "{path}:3: not valid JSON"),
    "no text": (b'{"text": "ok"}\n{"prompt": "x"}\n', ValueError, "{path}:2: expected an object"),
    "text not a string": (b'{"text": 1}\n', ValueError, "{path}:1: expected an object"),
}


@pytest.mark.parametrize("reader", ["read_prompts", "load_prompts"])
@pytest.mark.parametrize("case", BAD_PROMPTS)
def test_bad_prompts_files_name_the_file_and_line(tmp_path: Path, case: str, reader: str) -> None:
    """A prompts file and a pair directory's prompts are read alike: a bad one is an error
    naming the file (and the line)."""
    content, error, message = BAD_PROMPTS[case]
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error) as raised:
        read_prompts(path) if reader == "read_prompts" else load_prompts(tmp_path)
    assert message.format(path=path) in str(raised.value)


def test_load_prompts_of_a_pair_directory(tmp_path: Path) -> None:
    records = [{"text": "def f():", "kind": "code"}, {"text": "Some prose.", "n": 2}]
    (tmp_path / "prompts.jsonl").write_text(
        "\n".join(map(json.dumps, records)) + "\n", encoding="utf-8"
    )
    assert load_prompts(tmp_path) == records
    assert load_prompts(TINY_PAIR_DIR) == load_prompts()


@pytest.mark.parametrize("missing", PAIR_PARTS)
def test_pair_directory_needs_its_parts(tmp_path: Path, missing: str) -> None:
    for part in PAIR_PARTS:
        if part != missing:
            (tmp_path / part).mkdir()
    with pytest.raises(FileNotFoundError, match=f"has no {missing}/ \\(a pair directory holds"):
        load_pair(tmp_path)


def test_load_pair_reads_the_shipped_layout(pair: tuple) -> None:
    """The shipped pair is a pair directory: load_pair gives what load_tiny_pair gives."""
    target, draft, tokenizer = load_pair(TINY_PAIR_DIR)
    for mine, shipped in zip((target, draft), pair[:2], strict=True):
        assert type(mine) is type(shipped) and not mine.training
        assert mine.config._attn_implementation == "sdpa"
        for a, b in zip(mine.parameters(), shipped.parameters(), strict=True):
            assert torch.equal(a, b)
    assert tokenizer("def f(x):")["input_ids"] == pair[2]("def f(x):")["input_ids"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
        ({"dtype": torch.int64}, ValueError, "floating-point"),
        ({"device": 0.5}, TypeError, "device must be a str"),
        ({"device": "no-such-device"}, ValueError, "device must name"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_tiny_pair(**kwargs)


@pytest.mark.parametrize(
    "files",
    [[], ["config.json"], ["vocab.txt"], ["spiece.model"], ["merges.txt", "vocab.json"]],
    ids=["empty", "config-only", "bert-vocab", "sentencepiece", "bpe"],
)
def test_a_directory_without_tokenizer_files_is_named(tmp_path: Path, files: list[str]) -> None:
    """load_models refuses a tokenizer directory with no tokenizer file before loading
    anything (some transformers releases build a tokenizer of a few tokens from the config
    alone), and accepts every kind of saved tokenizer file."""
    for name in files:
        (tmp_path / name).write_text("{}", encoding="utf-8")
    if any(name != "config.json" for name in files):
        models._check_tokenizer_files(tmp_path, given=True)  # no error
        return
    with pytest.raises(OSError, match=r"holds no tokenizer files \(none of tokenizer\*"):
        load_models(tmp_path, tmp_path)
    with pytest.raises(OSError, match="the target's: the tokenizer is read from there"):
        load_models(tmp_path, tmp_path)
    with pytest.raises(OSError, match=r"^(?!.*the target's)"):
        load_models(tmp_path, tmp_path, tokenizer=tmp_path)


@torch.no_grad()
def _greedy_tokens(model: torch.nn.Module, ids: Tensor, mask: Tensor, n: int) -> Tensor:
    """``n`` greedy tokens per row of a left-padded batch, EOS not special.

    # ids [P, T], mask [P, T] -> [P, n]
    """
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    tokens = []
    for _ in range(n):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [P, 1]
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        cache = cache_argument(model)  # transformers 5.24 renamed past_key_values
        out = model(
            input_ids=nxt, attention_mask=mask, use_cache=True, **{cache: getattr(out, cache)}
        )
    return torch.cat(tokens, dim=1)


def test_greedy_agreement_is_in_the_card_range(pair: tuple, card: dict) -> None:
    """Draft argmax vs the target's greedy text, position by position, over all prompts.

    The card measured each prompt alone; here they are batched with left padding for speed.
    RoPE attention depends only on relative positions and padding is masked out, so the
    numbers agree up to float rounding, which the card's tolerance covers.
    """
    target, draft, tok = pair
    n = card["test"]["tokens_per_prompt"]
    enc = tok([p["text"] for p in load_prompts()], padding=True, return_tensors="pt")
    ids, mask = enc.input_ids, enc.attention_mask  # [P, T]
    cont = _greedy_tokens(target, ids, mask, n)  # [P, n]
    full = torch.cat([ids, cont], dim=1)  # [P, T + n]
    full_mask = torch.cat([mask, torch.ones_like(cont)], dim=1)  # [P, T + n]
    with torch.no_grad():
        logits = draft(input_ids=full, attention_mask=full_mask, use_cache=False).logits
    predicted = logits[:, ids.shape[1] - 1 : -1].argmax(-1)  # [P, n]
    agreement = (predicted == cont).double().mean().item()
    assert card["test"]["low"] <= agreement <= card["test"]["high"], agreement
    # A distilled draft agrees far more often than chance, and not always.
    assert 0.3 < agreement < 0.98


def test_card_files_agree(card: dict) -> None:
    text = (TINY_PAIR_DIR / "MODEL_CARD.md").read_text(encoding="utf-8")
    m = card["measurements"]
    for value in (m["greedy_agreement"], m["mean_acceptance_t1"], card["test"]["measured"]):
        assert str(value) in text
    assert card["test"]["low"] < card["test"]["measured"] < card["test"]["high"]
    # The recipe's point: the draft is distilled, so it must not beat its target.
    assert card["target"]["held_out_loss"] < card["draft"]["held_out_loss"]
