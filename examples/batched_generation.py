"""Batched speculative generation with a HuggingFace target/draft pair.

Runs the shipped tiny pair (random tiny Llama models if it is not installed) on 8 prompts of
different lengths: greedy with TETRIS, checked token by token against ``target.generate``, the
same through 3 slots (continuous batching), then sampling at temperature 0.8 with top-p 0.95.
Prints the statistics of each run. Runs on one CPU thread (fastest for models this small).

    python examples/batched_generation.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specselect import make_selector
from specselect.hf import speculative_generate


def load_models():
    """(target, draft, prompts as (input_ids, attention_mask), decode function)."""
    try:
        from specselect.models import load_prompts, load_tiny_pair

        target, draft, tokenizer = load_tiny_pair()
        texts = [p["text"] for p in load_prompts()[:8]]
    except FileNotFoundError:
        return random_models()
    tokenizer.padding_side = "left"  # speculative_generate needs left padding, like generate
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return target, draft, (enc["input_ids"], enc["attention_mask"]), tokenizer.decode


def random_models():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.25,
        pad_token_id=0,
        eos_token_id=1,
    )
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()  # a noisy copy of the target agrees often
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.std().clamp_min(1e-3) * torch.randn_like(p))
    lengths = torch.arange(3, 19, 2)
    ids = torch.randint(3, 256, (8, 17))
    mask = (torch.arange(17) >= 17 - lengths.unsqueeze(1)).long()
    return target, draft, (torch.where(mask.bool(), ids, 0), mask), lambda t: str(t.tolist())


def report(name: str, out) -> None:
    totals = out.stats.totals
    print(
        f"{name}: {totals.steps} steps, {totals.emitted} tokens emitted, "
        f"{totals.tokens_per_step:.2f} tokens/step, VSR {totals.vsr:.2f}, "
        f"{totals.goodput:.0f} tokens/s "
        f"(draft {out.stats.draft_seconds:.2f}s, verify {out.stats.verify_seconds:.2f}s)"
    )


def main() -> None:
    # Tiny models on a CPU: threads contending for the cores slow each pass down (several times
    # over on a busy machine), so one thread is fastest, as in `specselect compare --threads 1`.
    torch.set_num_threads(1)
    target, draft, (input_ids, attention_mask), decode = load_models()
    prompt_width = input_ids.shape[1]

    greedy = speculative_generate(
        target,
        draft,
        input_ids,
        attention_mask,
        selector=make_selector("tetris", k=3, extra=2),
        max_new_tokens=48,
    )
    reference = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=48)
    report("greedy, TETRIS", greedy)
    print("identical to target.generate:", torch.equal(greedy.sequences, reference))
    print("first continuation:", repr(decode(greedy.sequences[0, prompt_width:])))

    # Continuous batching: at most 3 rows at once; each waiting row takes the slot of the first
    # row to finish, as a server would serve a queue of requests.
    queued = speculative_generate(
        target,
        draft,
        input_ids,
        attention_mask,
        selector=make_selector("tetris", k=3, extra=2),
        max_new_tokens=48,
        slots=3,
    )
    report("greedy, TETRIS, 3 slots", queued)
    print("identical to target.generate:", torch.equal(queued.sequences, reference))

    sampled = speculative_generate(
        target,
        draft,
        input_ids,
        attention_mask,
        selector=make_selector("fixed", k=3),
        max_new_tokens=48,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        generator=torch.Generator().manual_seed(0),
    )
    report("sampling, fixed k=3", sampled)
    print("per-row accepted draft tokens:", sampled.stats.accepted.tolist())


if __name__ == "__main__":
    main()
