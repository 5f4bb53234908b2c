"""A batched KV cache whose rows advance by different amounts: holes, positions, compaction.

In batched speculative decoding every row accepts a different number of tokens per step, but a
HuggingFace ``DynamicCache`` grows all rows by the same number of columns. :class:`RaggedCache`
wraps one and keeps, per row, which columns hold tokens of the row's sequence:

* ``valid [B, L]`` bool — column ``c`` of row ``i`` holds a token of the sequence. Every other
  column is a *hole* (left padding, padding of a block, a rejected draft token) that the 2D
  attention mask hides. Holes keep finite keys/values computed from real inputs, so masking them
  is exact (DESIGN.md measured identical logits);
* ``count [B]`` — committed valid columns, which is also the position id of the row's next token
  (positions are given explicitly, so holes do not shift them; this is ``generate``'s
  ``cumsum(attention_mask) - 1`` rule).

A step appends *blocks* (one forward pass each: :meth:`block_inputs`, the model call, then
:meth:`extend`) and finally :meth:`commit` keeps any subset of the columns appended since the last
commit. A chain keeps a prefix of its block (the pending token and the accepted draft tokens); a
draft tree would send ``N`` nodes with a ``[B, N, N]`` ancestor mask (:meth:`block_inputs` builds
the 4D mask) and keep the accepted path. Commits never move data.

Holes cost memory and attention time, so :meth:`compact` gathers the valid columns of chosen
rows into a left-padded layout (and drops finished rows in the same copy); the caller does so
when the widest row has more than a stated slack of holes, which bounds the cache width by
``max(count) + slack``.

What this relies on in transformers (checked at run time by :meth:`check_layers`): a
``DynamicCache`` whose layers are plain ``DynamicLayer`` objects storing ``keys``/``values`` as
``[B, heads, L, head_dim]`` tensors that ``update`` grows by concatenation along dim -2 and that
may be replaced by tensors of another ``B``/``L`` between forward passes (``get_seq_length`` reads
the shape). Per-layer devices are respected, so a cache split by accelerate's ``device_map``
works.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from specselect.hf.compat import ModelHandle


class RaggedCache:
    """A ``DynamicCache`` plus per-row validity and positions (see the module docstring).

    Args:
        batch: number of rows.
        device: device of the bookkeeping tensors (the model's input device).
    """

    def __init__(self, batch: int, device: torch.device) -> None:
        self.kv = DynamicCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # [B, L]
        self.count = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
        self._mark = 0  # first column not yet committed
        self._checked = False

    @property
    def width(self) -> int:
        """Columns in the cache (``L``), holes included; a host int read from a shape."""
        return self.valid.shape[1]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def block_inputs(
        self,
        block_valid: Tensor,  # [B, W] bool
        depth: Tensor | None = None,  # [B, W] int64
        block_mask: Tensor | None = None,  # [B, W, W] bool
        *,
        past_mask: Tensor | None = None,  # [B, W, L] bool
        mask_kind: str = "sdpa",
        dtype: torch.dtype = torch.float32,
    ) -> tuple[Tensor, Tensor]:
        """Attention mask and position ids for a forward pass over a block of ``W`` new tokens.

        Args:
            block_valid: ``[B, W]`` which block columns hold real tokens (the others become holes).
            depth: ``[B, W]`` offset of each token from the row's next position: position id =
                ``count + depth``. Default ``cumsum(block_valid) - 1``: valid tokens in order.
            block_mask: ``[B, W, W]`` bool, which block tokens each block token sees (itself and
                its ancestors, for a tree). ``None`` means causal order within the block.
            past_mask: ``[B, W, L]`` bool, which cache columns each block token may see, on top
                of ``valid`` (needs ``block_mask``). A tree drafter needs it: the frontier nodes
                of one level must not see the other branches' uncommitted columns of the same
                step. ``None``: every valid column.
            mask_kind: the attention implementation; a 4D mask is bool for ``"sdpa"`` and
                additive (0 / dtype min) for ``"eager"``.
            dtype: the model's activation dtype (for the additive mask).

        Returns:
            ``attention_mask`` — ``[B, L + W]`` (0/1, the model adds causality) without a
            ``block_mask``, else ``[B, 1, W, L + W]`` — and ``position_ids`` ``[B, W]``. Holes get
            position 0 (they are never attended, but learned position tables must be indexable).
        """
        if depth is None:
            depth = block_valid.to(torch.int64).cumsum(dim=1) - 1
        positions = torch.where(block_valid, self.count.unsqueeze(1) + depth, 0)
        if block_mask is None:
            if past_mask is not None:
                raise ValueError("past_mask needs a block_mask (a 4D attention mask)")
            return torch.cat([self.valid, block_valid], dim=1).to(torch.int64), positions
        past = self.valid.unsqueeze(1).expand(-1, block_valid.shape[1], -1)  # [B, W, L]
        if past_mask is not None:
            past = past & past_mask
        return _four_d_mask(past, block_valid, block_mask, mask_kind, dtype), positions

    def extend(self, block_valid: Tensor) -> None:  # [B, W] bool
        """Record that a forward pass appended ``block_valid.shape[1]`` columns to ``kv``.

        The new columns are valid but uncommitted: later blocks of the same step attend to them,
        and :meth:`commit` decides which ones stay.

        Raises:
            RuntimeError: the model did not grow its cache by exactly ``W`` columns (it ignores
                ``past_key_values``, or uses a cache layout this class does not support).
        """
        self.valid = torch.cat([self.valid, block_valid], dim=1)
        self.check_layers()

    def commit(self, keep: Tensor) -> None:  # [B, T] bool
        """Keep the subset ``keep`` of the ``T`` columns appended since the last commit.

        ``keep`` must be a subset of those columns' ``block_valid``; the kept tokens become part
        of the rows' sequences (``count`` grows by their number), the rest become holes.
        """
        span = self.width - self._mark
        if keep.shape != (self.batch, span):
            raise ValueError(
                f"keep must have shape {[self.batch, span]} (columns since the last commit), "
                f"got {tuple(keep.shape)}"
            )
        kept = keep & self.valid[:, self._mark :]
        self.valid = torch.cat([self.valid[:, : self._mark], kept], dim=1)
        self.count = self.count + kept.sum(dim=1)
        self._mark = self.width

    def holes(self, max_count: int) -> int:
        """Hole columns of the fullest row, given ``max_count = max(count)`` read by the caller."""
        return self.width - max_count

    def compact(self, rows: Tensor | None, width: int) -> None:
        """Gather the valid columns of ``rows`` into a left-padded cache of ``width`` columns.

        Args:
            rows: ``[B']`` int64 rows to keep, in their new order, or ``None`` for all rows.
            width: ``max(count[rows])`` (a host int the caller read at its sync point); row ``i``
                ends up with its valid columns, in order, in the last ``count[i]`` columns.

        One gather per layer (``index_select`` on a flattened view), done layer by layer, so the
        extra memory is one layer's cache. Everything must be committed first.
        """
        if self._mark != self.width:
            raise RuntimeError("compact() needs every appended column committed first")
        valid = self.valid if rows is None else self.valid.index_select(0, rows)
        columns = _left_padded_columns(valid, width)  # [B', width]
        for layer in self.kv.layers:
            assert isinstance(layer, DynamicLayer)  # check_layers() admits no other kind
            keys, values = layer.keys, layer.values  # a DynamicLayer sets both or neither
            if keys is None or values is None or keys.numel() == 0:
                continue
            layer.keys = _gather_kv(keys, rows, columns)
            layer.values = _gather_kv(values, rows, columns)
        self.valid = valid.gather(1, columns)
        if rows is not None:
            self.count = self.count.index_select(0, rows)
        self._mark = self.width

    def check_layers(self) -> None:
        """Raise unless ``kv`` matches the bookkeeping and uses only plain ``DynamicLayer``s."""
        if not self._checked and self.kv.layers:
            kinds = sorted({type(layer).__name__ for layer in self.kv.layers})
            if kinds != [DynamicLayer.__name__]:
                raise RuntimeError(
                    f"the model filled a cache with {', '.join(kinds)} layers; KV holes need plain "
                    "DynamicLayer layers (full attention, no quantisation or offloading)"
                )
            self._checked = True
        if self.kv.get_seq_length() != self.width:
            raise RuntimeError(
                f"the model's KV cache holds {self.kv.get_seq_length()} columns where "
                f"{self.width} were expected: it does not append to past_key_values"
            )


def forward_block(
    handle: ModelHandle,
    cache: RaggedCache,
    input_ids: Tensor,  # [B, W] int64
    block_valid: Tensor,  # [B, W] bool
    *,
    depth: Tensor | None = None,  # [B, W] int64
    block_mask: Tensor | None = None,  # [B, W, W] bool
    past_mask: Tensor | None = None,  # [B, W, L] bool
    last_only: bool = False,
) -> Tensor:  # [B, W, V] (or [B, 1, V] with last_only)
    """Run ``handle``'s model on a block of new tokens appended to ``cache``; return its logits.

    The block's columns are appended to the cache (uncommitted, see :meth:`RaggedCache.commit`).
    ``last_only`` computes the LM head on the last column only, when the model allows it; the
    drafter needs nothing else. ``depth``, ``block_mask`` and ``past_mask`` are as in
    :meth:`RaggedCache.block_inputs`.
    """
    attention_mask, position_ids = cache.block_inputs(
        block_valid,
        depth,
        block_mask,
        past_mask=past_mask,
        mask_kind=handle.mask_kind,
        dtype=handle.dtype,
    )
    extra = {"logits_to_keep": 1} if last_only and handle.keeps_logits else {}
    out = handle.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache.kv,
        use_cache=True,
        **extra,
    )
    cache.extend(block_valid)
    return out.logits[:, -1:] if last_only else out.logits


def _four_d_mask(
    past: Tensor,  # [B, W, L] bool
    block_valid: Tensor,  # [B, W] bool
    block_mask: Tensor,  # [B, W, W] bool
    mask_kind: str,
    dtype: torch.dtype,
) -> Tensor:  # [B, 1, W, L + W]
    """Every block token sees its ``past`` cache columns and the block tokens it may see.

    A hole also sees itself, so no query row is fully masked: such rows come out as NaN in some
    kernels (eager attention in float64, the math SDPA of older torch), and a NaN key or value
    poisons every row that "attends" to it with weight 0 (0 * NaN = NaN).
    """
    width = block_valid.shape[1]
    itself = torch.eye(width, dtype=torch.bool, device=block_mask.device)
    within = (block_mask & block_valid.unsqueeze(1)) | itself  # [B, W, W]
    mask = torch.cat([past, within], dim=2).unsqueeze(1)
    if mask_kind == "eager":
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.finfo(dtype).min)
    return mask


def causal_block_mask(block_valid: Tensor) -> Tensor:  # [B, W] -> [B, W, W] bool
    """Causal order within a block, as an explicit mask (a chain is a tree without branches)."""
    width = block_valid.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=block_valid.device).tril()
    return causal.expand(block_valid.shape[0], width, width)


def _left_padded_columns(valid: Tensor, width: int) -> Tensor:  # [B, L] -> [B, width] int64
    """Source column of each slot of a left-padded layout ``width`` wide.

    A stable sort of the validity flags lists each row's holes first and then its valid columns,
    both in column order; the last ``width`` entries are the row's valid columns preceded by as
    many holes as it needs for padding (holes hold finite values, so padding stays harmless).
    """
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
    return order[:, valid.shape[1] - width :]


def _gather_kv(
    states: Tensor,  # [B, H, L, D]
    rows: Tensor | None,  # [B'] int64
    columns: Tensor,  # [B', W] int64
) -> Tensor:  # [B', H, W, D]
    """``out[b, h, w] = states[rows[b], h, columns[b, w]]`` as one ``index_select`` (one copy)."""
    batch, heads, length, dim = states.shape
    device = states.device
    columns = columns.to(device)
    source = torch.arange(batch, device=device) if rows is None else rows.to(device)
    head_ids = torch.arange(heads, device=device)
    flat = (source.view(-1, 1, 1) * heads + head_ids.view(1, -1, 1)) * length + columns.unsqueeze(1)
    picked = states.reshape(batch * heads * length, dim).index_select(0, flat.reshape(-1))
    return picked.view(columns.shape[0], heads, columns.shape[1], dim)
