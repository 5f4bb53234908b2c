"""Write ``h100-graph-tinyllama-1.1b-bf16.json``: a cost model of CUDA-graph forwards on an H100.

The numbers below were captured by hand, not by ``specselect profile``: in November 2026, on one
H100 80GB HBM3 (torch 2.11.0+cu130, transformers 5.17.0), HF ``LlamaForCausalLM`` forwards were
captured in a CUDA graph (``torch.cuda.graph`` after two warm-up calls on a side stream) and
replayed, with random weights in bfloat16, transformers' ``StaticCache`` (512 columns, a
128-token prompt), a ``[B, 1, W, 512]`` boolean mask and explicit position ids. The target has
TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 key-value heads, vocabulary
32000); the draft is a 74M Llama (hidden 768, 4 layers), timed at one token per row only.
Each figure is milliseconds per forward at batch ``B`` and tokens per row ``W``.

They are fitted like any measurement (:meth:`specselect.cost.CostModel.fit`), so the file
carries the raw figures as its samples. Run from the repository root::

    python benchmarks/costs/h100_graph.py
"""

from __future__ import annotations

from pathlib import Path

from specselect.cost import CostModel, CostSample, CostSource

CONTEXT = 128.0  # tokens of the prompt in the cache (the cache had 512 columns)

# ms per forward of the 1.1B target: {B: (W=1, W=4, W=8)}
TARGET_MS = {
    1: (3.22, 3.65, 3.73),
    8: (4.40, 4.89, 4.94),
    32: (7.83, 8.47, 8.81),
    64: (11.97, 13.39, 14.53),
}
WIDTHS = (1, 4, 8)
# ms per forward of the 74M draft, one token per row: {B: ms}
DRAFT_MS = {1: 0.51, 8: 0.60, 32: 0.86, 64: 1.18}

NOTE = (
    "Hand-captured CUDA graphs of HF forwards, not measured by specselect profile: "
    "LlamaForCausalLM with TinyLlama-1.1B's shape (target) and a 74M Llama (draft, one token "
    "per row), random weights, bfloat16, one H100 80GB HBM3, November 2026; each forward "
    "captured with torch.cuda.graph after two warm-up calls and replayed, over transformers' "
    "StaticCache of 512 columns holding a 128-token prompt, with a [B, 1, W, 512] boolean mask "
    "and explicit position ids. One figure per batch size and width (no repeats recorded)."
)


def samples() -> list[CostSample]:
    out = [CostSample("draft", b, 1, CONTEXT, ms / 1e3) for b, ms in DRAFT_MS.items()]
    for batch, times in TARGET_MS.items():
        for width, ms in zip(WIDTHS, times, strict=True):
            out.append(CostSample("verify", batch, batch * width, CONTEXT, ms / 1e3))
    return out


def main() -> None:
    source = CostSource(
        hardware="NVIDIA H100 80GB HBM3",
        dtype="bfloat16",
        mode="cuda",
        versions={"torch": "2.11.0+cu130", "transformers": "5.17.0"},
        models={
            "target": "LlamaForCausalLM, TinyLlama-1.1B shape (hidden 2048, 22 layers, GQA 32/4, "
            "vocab 32000), random weights",
            "draft": "LlamaForCausalLM, 74M (hidden 768, 4 layers), random weights",
        },
        grid={
            "batch_sizes": sorted(TARGET_MS),
            "widths": list(WIDTHS),
            "contexts": [CONTEXT],
            "cache_columns": 512,
        },
        details={"measured_at": "2026-11", "captured_by": "hand"},
        note=NOTE,
    )
    model = CostModel.fit(samples(), source=source)
    path = model.save(Path(__file__).resolve().parent / "h100-graph-tinyllama-1.1b-bf16.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
