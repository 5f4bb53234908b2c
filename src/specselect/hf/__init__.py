"""The HuggingFace wing: batched speculative generation on top of the selectors.

:func:`speculative_generate` drives a target/draft pair of HF causal LMs with any
:class:`~specselect.selection.Selector`; :mod:`specselect.hf.cache` holds the ragged KV-cache
bookkeeping (holes, explicit positions, compaction) that the tree loop reuses.
"""

from specselect.hf.cache import RaggedCache, forward_block
from specselect.hf.compat import MASKABLE_ATTENTION, ModelHandle, check_causal_lm, check_pair
from specselect.hf.draft import ChainDrafter, DraftChain, SamplingParams
from specselect.hf.generate import (
    DEFAULT_CACHE_SLACK,
    GenerationStats,
    SpeculativeOutput,
    speculative_generate,
)
from specselect.hf.tree_draft import DraftTree, TreeDrafter, TreeSpec

__all__ = [
    "DEFAULT_CACHE_SLACK",
    "MASKABLE_ATTENTION",
    "ChainDrafter",
    "DraftChain",
    "DraftTree",
    "GenerationStats",
    "ModelHandle",
    "RaggedCache",
    "SamplingParams",
    "SpeculativeOutput",
    "TreeDrafter",
    "TreeSpec",
    "check_causal_lm",
    "check_pair",
    "forward_block",
    "speculative_generate",
]
