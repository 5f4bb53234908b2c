"""Static KV caches whose rows advance by different amounts: holes, positions, compaction.

In batched speculative decoding every row accepts a different number of tokens per step, but a
forward pass appends the same number of columns to every row. :class:`ModelCache` keeps one
model's keys and values in buffers preallocated for the whole generation (``[slots, heads,
capacity, head_dim]`` per layer) and, per row, which columns hold tokens of the row's sequence:

* ``valid [slots, capacity]`` bool — column ``c`` of row ``i`` holds a token of the sequence.
  Every other column is a *hole* (left padding, padding of a block, a rejected draft token, a
  column not written yet) that the attention mask hides. Holes keep finite keys/values (zeros,
  or values computed from real inputs), so masking them is exact;
* ``count [slots]`` — committed valid columns, which is also the position id of the row's next
  token (positions are passed explicitly, so holes do not shift them: ``generate``'s
  ``cumsum(attention_mask) - 1`` rule);
* ``pos`` — ONE write position shared by all rows and layers, a 0-dim device tensor. A forward
  pass of ``W`` tokens writes columns ``pos .. pos + W - 1`` of every row and advances it;
* ``mark`` — the first column not yet committed (a device tensor too).

Every per-step operation reads these positions on the device, so a pass can be captured once in a
CUDA graph and replayed at any position. The host keeps an exact mirror of ``pos``
(:attr:`ModelCache.used`): it only ever grows by widths the host chose, so it needs no sync.

A step appends *blocks* (one forward pass each, :meth:`ModelCache.forward`) and finally
:meth:`ModelCache.commit` keeps any subset of the columns appended since the last commit: a
chain keeps a prefix of its block, a draft tree the accepted path. Commits never move data.

Holes accumulate, so before a step that would run past ``capacity`` the caller compacts
(:meth:`ModelCache.compact`, eagerly, between steps): the valid columns of the rows that stay are
gathered into a left-padded layout, dropping finished rows in the same copy. A row that starts
mid-generation in a freed slot (continuous batching) is prefilled on a cache of its own, whose
keys and values are copied into the slot's last written columns (:meth:`ModelCache.admit`).

What this relies on in transformers: a model's attention layers call
``cache.update(key_states, value_states, layer_idx)`` (the cache is ``forward``'s ``cache``
argument, ``past_key_values`` before 5.24) with ``[B, heads, W, head_dim]`` states and attend
over what it returns; a 4D ``attention_mask`` is used as given (``sdpa`` takes
it as a bool mask, ``eager`` as an additive one); ``position_ids`` are used as given. All three
are checked on every family the tests build (greedy output equal to ``generate``'s); layers
that reuse an earlier layer's keys and values (``num_kv_shared_layers``) get no cache layer.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes
from transformers.cache_utils import Cache, CacheLayerMixin

from specselect.constants import arange_constant, cached_constant
from specselect.hf.compat import ModelHandle

#: A pass attends over a multiple of this many columns: in eager mode over the columns written
#: so far rounded up to it (or the whole capacity, if less), in graph mode over the whole
#: capacity, which the loop then allocates as a multiple of it. PyTorch's memory-efficient
#: attention copies a mask whose rows are not 16-element aligned, once per layer and pass.
SPAN_ALIGNMENT = 16


def aligned(columns: int) -> int:
    """``columns`` rounded up to a multiple of :data:`SPAN_ALIGNMENT`."""
    return -(-columns // SPAN_ALIGNMENT) * SPAN_ALIGNMENT


class _SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys and values; writes go to the owner's current columns."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        # Weak: a strong reference back would make every cache a reference cycle, whose
        # gigabytes of buffers only the cycle collector frees, whenever it happens to run.
        self.owner = weakref.proxy(owner)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate ``[slots, heads, capacity, head_dim]`` on the first write (the prefill, or
        the first stage after a one-token prompt), when the layer's heads, head size, dtype and
        device are known.

        Allocated outside any tracing mode: the buffers must outlive the stage that first writes
        them, not become an op of its trace (a CUDA graph never captures this call: its stages
        run once eagerly before they are captured).
        """
        heads = key_states.shape[1]
        shape = (self.owner.slots, heads, self.owner.capacity)
        with _disable_current_modes():
            self.keys = key_states.new_zeros((*shape, key_states.shape[-1]))
            self.values = value_states.new_zeros((*shape, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Write ``[B, heads, W, D]`` at the owner's ``columns``; return this layer's keys and
        values over the owner's ``span`` first columns (the attention mask hides the holes)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        rows, span = key_states.shape[0], self.owner.span
        keys, values = self.keys[:rows, :, :span], self.values[:rows, :, :span]
        columns = self.owner.columns.to(keys.device)
        keys.index_copy_(2, columns, key_states.to(keys.dtype))
        values.index_copy_(2, columns, value_states.to(values.dtype))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        # Models read this only to make position ids or masks, and both are always passed in.
        return 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def get_max_cache_shape(self) -> int:  # the name in older transformers releases
        return self.owner.capacity


class SlotCache(Cache):
    """The ``past_key_values`` object handed to the model: one :class:`_SlotLayer` per layer.

    ``columns`` (``[W]`` int64, on the model's input device) says where the current pass writes,
    ``span`` how many leading columns it attends over; :class:`ModelCache` sets both.
    """

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.span = capacity
        self.columns = torch.zeros(0, dtype=torch.int64)
        self.slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self.slot_layers))

    def buffers(self) -> list[Tensor]:
        """Every allocated key and value buffer (``[slots, heads, capacity, head_dim]``)."""
        layers = self.slot_layers
        return [t for layer in layers for t in (layer.keys, layer.values) if t is not None]

    def written(self) -> bool:
        """Whether every layer has been written (the model really uses this cache)."""
        return all(layer.is_initialized for layer in self.slot_layers)

    def allocate_like(self, other: SlotCache) -> None:
        """Allocate the layers not written yet as ``other``'s written ones (heads, head size,
        dtype, device): before a copy from ``other`` into a cache no pass has written."""
        for mine, theirs in zip(self.slot_layers, other.slot_layers, strict=True):
            if not mine.is_initialized and theirs.keys is not None and theirs.values is not None:
                mine.lazy_initialization(theirs.keys, theirs.values)


class ModelCache:
    """One model's static KV cache with per-row validity and positions (see the module doc).

    Args:
        handle: the checked model.
        slots: rows allocated (the largest batch this cache serves).
        capacity: columns allocated per row.
        static_span: attend over the whole capacity in every pass (what a captured pass
            needs: one shape at any position); else only over the columns written so far,
            rounded up to a multiple of :data:`SPAN_ALIGNMENT` (eager mode: less attention work
            while the cache is far from full).
    """

    def __init__(
        self, handle: ModelHandle, slots: int, capacity: int, *, static_span: bool = True
    ) -> None:
        device = handle.device
        self.handle = handle
        self.slots, self.capacity = slots, capacity
        self.static_span = static_span
        self.kv = SlotCache(handle.num_layers, slots, capacity)
        self.valid = torch.zeros(slots, capacity, dtype=torch.bool, device=device)
        self.count = torch.zeros(slots, dtype=torch.int64, device=device)
        self.pos = torch.zeros((), dtype=torch.int64, device=device)
        self.mark = torch.zeros((), dtype=torch.int64, device=device)
        self.used = 0  # host mirror of ``pos``: columns written since the last compaction

    # ------------------------------------------------------------------ per step (capturable)
    def forward(
        self,
        input_ids: Tensor,  # [B, W] int64
        block_valid: Tensor,  # [B, W] bool
        *,
        depth: Tensor | None = None,  # [B, W] int64
        block_mask: Tensor | None = None,  # [B, W, W] bool
        past_mask: Tensor | None = None,  # [B, W, T] bool
        last_only: bool = False,
    ) -> Tensor:  # [B, W, V] (or [B, 1, V] with last_only)
        """Run the model on a block of ``W`` new tokens written at ``pos``; return its logits.

        Device work only (the host mirror moves in :meth:`reserve`), so the call can be
        captured in a CUDA graph.

        Args:
            input_ids: the block's tokens, one row per cache row in use (``B <= slots``).
            block_valid: which block columns hold real tokens; the others become holes.
            depth: offset of each token from the row's next position (position id = ``count +
                depth``). Default ``cumsum(block_valid) - 1``: valid tokens in order.
            block_mask: which block tokens each block token sees (itself and its ancestors, for
                a tree). Default: causal order within the block.
            past_mask: which of the ``T`` columns written since the last commit each block
                token may see (a tree drafter's frontier must not see the other branches of the
                same step). Default: all of them. Committed columns are always visible.
            last_only: compute the LM head on the last column only (when the model allows it).
        """
        rows, width = input_ids.shape
        columns = self.pos + arange_constant(width, self.pos.device)  # [W]
        attention_mask, position_ids = self.pass_inputs(
            columns, block_valid, depth, block_mask, past_mask
        )
        self.kv.columns = columns
        extra = {"logits_to_keep": 1} if last_only and self.handle.keeps_logits else {}
        out = self.handle.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{self.handle.cache_arg: self.kv},
            use_cache=True,
            **extra,
        )
        self.valid[:rows].index_copy_(1, columns, block_valid)
        self.pos.add_(width)
        return out.logits[:, -1:] if last_only else out.logits

    def pass_inputs(
        self,
        columns: Tensor,  # [W] int64 where the block is written
        block_valid: Tensor,  # [B, W] bool
        depth: Tensor | None,  # [B, W] int64
        block_mask: Tensor | None,  # [B, W, W] bool
        past_mask: Tensor | None,  # [B, W, T] bool
    ) -> tuple[Tensor, Tensor]:  # [B, 1, W, span] mask, [B, W] int64 positions
        """The 4D attention mask and the position ids of a block written at ``columns``.

        A block token sees the row's valid columns (restricted by ``past_mask`` among this
        step's uncommitted ones) and the block tokens ``block_mask`` allows. A hole also sees
        itself, so no query row is fully masked: such rows come out as NaN in some kernels, and
        a NaN key or value would poison every row that "attends" to it with weight 0. Holes get
        position 0 (never attended, but learned position tables must be indexable).

        Positions past a learned table's end are clamped to its last row. Only draft tokens a
        row can never emit get there: the loop checks up front that every emitted token fits,
        but a chain is as deep as the row with the most tokens left needs, so a row nearer its
        end drafts past it (those tokens are never selected, their logits never read).
        """
        rows, width = block_valid.shape
        device = block_valid.device
        if depth is None:
            depth = block_valid.cumsum(dim=1, dtype=torch.int64) - 1
        # Holes at position 0: a product, not a where, saves building a scalar per pass.
        positions = (self.count[:rows].unsqueeze(1) + depth) * block_valid  # [B, W]
        if self.handle.position_limit is not None:
            positions = positions.clamp_(max=self.handle.position_limit - 1)
        if block_mask is None:
            block_mask = cached_constant(("causal_block", width, device), _causal)  # [W, W]
        itself = cached_constant(("identity_block", width, device), _identity)  # [W, W]
        within = (block_mask & block_valid.unsqueeze(1)) | itself  # [B, W, W]
        span = self.kv.span
        past = self.valid[:rows, :span].unsqueeze(1).expand(rows, width, span)  # [B, W, L]
        if past_mask is not None:
            recent = self.mark + arange_constant(past_mask.shape[2], device)  # [T]
            past = past.index_copy(2, recent, past.index_select(2, recent) & past_mask)
        mask = past.index_copy(2, columns, within.expand(rows, width, width)).unsqueeze(1)
        if self.handle.mask_kind == "eager":
            zero = cached_constant(("zero", self.handle.dtype, device), _zero)  # []
            return torch.where(mask, zero, torch.finfo(self.handle.dtype).min), positions
        return mask, positions

    def commit(self, keep: Tensor) -> None:  # [B, T] bool
        """Keep the subset ``keep`` of the ``T`` columns written since the last commit.

        The kept tokens become part of the rows' sequences (``count`` grows by their number),
        the rest become holes. ``T`` is static: the caller knows how many columns its step
        wrote. Device work only.
        """
        rows, span = keep.shape
        recent = self.mark + arange_constant(span, self.mark.device)  # [T]
        valid = self.valid[:rows]
        kept = keep & valid.index_select(1, recent)
        valid.index_copy_(1, recent, kept)
        self.count[:rows].add_(kept.sum(dim=1))
        self.mark.copy_(self.pos)

    # ------------------------------------------------------------------ between steps (eager)
    def admit(self, slots: list[int], context: Tensor, context_valid: Tensor) -> None:
        """Prefill ``context`` (``[n, W]`` left-padded tokens, ``context_valid`` ``[n, W]``
        bool) into the rows ``slots`` (``n`` of them), replacing whatever they held; the other
        rows are untouched. Eager, between steps, and without a host read.

        Into a cache with nothing written (``pos`` 0: a generation's first admission) and
        ``slots`` its first ``n`` rows, the pass writes straight into the cache. Otherwise the
        pass runs on a cache of its own, ``n`` rows and ``W`` columns, and its keys and values
        are copied into the last ``W`` written columns of ``slots`` (holes for the other rows;
        ``pos`` first moves to ``W`` if fewer are written): the positions a key was computed at
        travel with it, so where it lands does not matter.
        """
        width, rows = context.shape[1], len(slots)
        index = host_index(slots, self.valid.device)  # [n]
        self.valid[index] = False
        self.count[index] = 0
        if width == 0:
            return
        first = self.used == 0 and slots == list(range(rows))
        scratch = None if first else ModelCache(self.handle, rows, width, static_span=False)
        into = self if scratch is None else scratch
        into.reserve(width)
        into.forward(context, context_valid, last_only=True)
        into.commit(context_valid)
        if scratch is None:
            return
        if self.used < width:  # the columns it needs are written for no other row: holes
            self.pos.fill_(width)
            self.mark.fill_(width)
            self._account(width)
        start = self.used - width
        self.kv.allocate_like(scratch.kv)  # (a draft cache no step has written yet)
        for mine, theirs in zip(self.kv.buffers(), scratch.kv.buffers(), strict=True):
            mine[index.to(mine.device), :, start : self.used] = theirs
        self.valid[index, start : self.used] = context_valid.to(self.valid.device)
        self.count[index] = scratch.count.to(self.count.device)

    def check_written(self) -> None:
        """Raise unless the model wrote every layer's keys and values into this cache.

        Called once passes have run: a model that ignores the cache it is given (or keeps its
        own) would otherwise decode from an empty context without an error.
        """
        if self.used and not self.kv.written():
            name = self.handle.model.__class__.__name__  # not type(): the handle holds a proxy
            raise RuntimeError(
                f"{name} ran but did not write its keys and values "
                f"to the cache it was given: it does not append to {self.handle.cache_arg}"
            )

    def rewind(self, pos: int) -> None:
        """Write the next pass at column ``pos`` (``pos`` columns count as written): how the
        profiler times one pass shape again and again. Validity and counts stay as they are."""
        self.pos.fill_(pos)
        self._account(pos)

    def room(self) -> int:
        """Columns still free after ``pos`` (host arithmetic, no sync)."""
        return self.capacity - self.used

    def reserve(self, width: int) -> None:
        """Account on the host for ``width`` columns the next passes will write."""
        if width > self.room():
            raise RuntimeError(
                f"internal error: {width} columns reserved with {self.room()} left; compact first"
            )
        self._account(self.used + width)

    def release(self, width: int) -> None:
        """Give back ``width`` reserved columns that no pass will write after all."""
        if not 0 <= width <= self.used:
            raise RuntimeError(f"internal error: {width} columns released of {self.used} used")
        self._account(self.used - width)

    def _account(self, used: int) -> None:
        self.used = used
        if not self.static_span:
            self.kv.span = min(aligned(used), self.capacity)

    def reset(self) -> None:
        """Empty every row (a new generation): no valid column, positions 0."""
        self.valid.zero_()
        self.count.zero_()
        self.pos.zero_()
        self.mark.zero_()
        self.used = 0
        self.kv.span = self.capacity if self.static_span else 0

    def compact(self, rows: Tensor, width: int) -> None:
        """Gather the valid columns of ``rows`` into a left-padded layout ``width`` wide.

        Args:
            rows: ``[B']`` int64 rows to keep, in their new order (they become rows
                ``0 .. B' - 1``).
            width: ``max(count[rows])``, a host int the caller read at its sync point; row ``i``
                ends up with its valid columns, in order, in the last ``count[i]`` of the first
                ``width`` columns, and ``pos`` moves to ``width``.

        Everything must be committed. One gather per layer into a temporary, copied back in
        place, so the buffers keep their addresses (captured graphs stay valid) and the extra
        memory is one layer's worth.
        """
        if width > self.capacity:
            raise ValueError(f"width {width} exceeds the capacity {self.capacity}")
        valid = self.valid.index_select(0, rows)
        columns = _left_padded_columns(valid, width)  # [B', width]
        kept = rows.shape[0]
        # Every layer's keys and values of one shape share the gather's index: build it once.
        indices: dict[tuple[torch.Size, torch.device], Tensor] = {}
        for buffer in self.kv.buffers():
            where = (buffer.shape, buffer.device)
            if where not in indices:
                indices[where] = _gather_index(buffer.shape, rows, columns, buffer.device)
            buffer[:kept, :, :width] = _gather_kv(buffer, indices[where], kept, width)
        self.valid[:kept, :width] = valid.gather(1, columns)
        self.valid[:, width:] = False
        self.count[:kept] = self.count.index_select(0, rows)
        self.pos.fill_(width)
        self.mark.fill_(width)
        self._account(width)


def _causal(width: int, device: torch.device) -> Tensor:  # [W, W] bool
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def _identity(width: int, device: torch.device) -> Tensor:  # [W, W] bool
    return torch.eye(width, dtype=torch.bool, device=device)


def _zero(dtype: torch.dtype, device: torch.device) -> Tensor:  # [] dtype
    return torch.zeros((), dtype=dtype, device=device)


def host_index(values: list[int], device: torch.device) -> Tensor:  # -> [len] int64
    """Host ints as an index tensor on ``device`` without a sync: a copy from pageable memory
    would wait for the device, one from pinned memory is asynchronous."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _left_padded_columns(valid: Tensor, width: int) -> Tensor:  # [B, L] -> [B, width] int64
    """Source column of each slot of a left-padded layout ``width`` wide.

    A stable sort of the validity flags lists each row's holes first and then its valid columns,
    both in column order; the last ``width`` entries are the row's valid columns preceded by as
    many holes as it needs for padding (holes hold finite values, so padding stays harmless).
    """
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
    return order[:, valid.shape[1] - width :]


def _gather_index(
    shape: torch.Size,  # [S, H, L, D] of the states gathered
    rows: Tensor,  # [B'] int64
    columns: Tensor,  # [B', W] int64
    device: torch.device,
) -> Tensor:  # [B' * H * W] int64
    """The rows of ``states.reshape(S * H * L, D)`` that :func:`_gather_kv` picks: for each kept
    row ``b``, head ``h`` and slot ``w``, row ``rows[b]``'s column ``columns[b, w]``."""
    _, heads, length, _ = shape
    head_ids = torch.arange(heads, device=device)
    source = rows.to(device).view(-1, 1, 1)
    flat = (source * heads + head_ids.view(1, -1, 1)) * length + columns.to(device).unsqueeze(1)
    return flat.reshape(-1)


def _gather_kv(states: Tensor, index: Tensor, kept: int, width: int) -> Tensor:
    """``[S, H, L, D] -> [kept, H, width, D]``: the rows :func:`_gather_index` chose, as one
    ``index_select``."""
    slots, heads, length, dim = states.shape
    picked = states.reshape(slots * heads * length, dim).index_select(0, index)
    return picked.view(kept, heads, width, dim)


__all__ = ["ModelCache", "SlotCache", "host_index"]
