"""The HuggingFace wing: batched speculative generation on top of the selectors.

:func:`speculative_generate` drives a target/draft pair of HF causal LMs with any
:class:`~specselect.selection.Selector` (or none, for plain decoding); :mod:`specselect.hf.kv`
holds the static KV caches with per-row holes, positions and compaction, and
:mod:`specselect.hf.graphs` the capture and replay of the loop's stages in CUDA graphs.
"""

from specselect.hf.compat import MASKABLE_ATTENTION, ModelHandle, check_causal_lm, check_pair
from specselect.hf.draft import ChainDrafter, DraftChain, SamplingParams
from specselect.hf.generate import (
    DEFAULT_CACHE_SLACK,
    SpeculativeOutput,
    release_workspace,
    speculative_generate,
)
from specselect.hf.graphs import HostReads, emulate_on_cpu
from specselect.hf.kv import ModelCache
from specselect.hf.state import GenerationStats
from specselect.hf.tree_draft import DraftTree, TreeDrafter
from specselect.tree import TreeSpec

__all__ = [
    "DEFAULT_CACHE_SLACK",
    "MASKABLE_ATTENTION",
    "ChainDrafter",
    "DraftChain",
    "DraftTree",
    "GenerationStats",
    "HostReads",
    "ModelCache",
    "ModelHandle",
    "SamplingParams",
    "SpeculativeOutput",
    "TreeDrafter",
    "TreeSpec",
    "check_causal_lm",
    "check_pair",
    "emulate_on_cpu",
    "release_workspace",
    "speculative_generate",
]
