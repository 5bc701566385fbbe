"""The running batch's KV cache: left-padded rows in preallocated buffers, with row select / merge / trim.

Continuous batching needs three things a stock `DynamicCache` does not give cheaply:

- **Append without copying the whole cache.** `DynamicLayer.update` does `torch.cat([keys, new])` every step,
  an O(T) copy per layer per token. `GrowableLayer` keeps keys/values in a buffer `(B, H, capacity, D)`, writes
  the new column in place and returns a view `[:, :, :T]`; the buffer grows geometrically when full.
- **Merge** newly prefilled rows into the running batch. Rows are left-padded to a common length T (zeros in K/V,
  0 in the attention mask), so every row's next token is written at the same column T. Each row carries its own
  `position_ids`, so padding never shifts RoPE positions.
- **Select** the rows that are still running (finished ones leave) and **trim** the leading columns that are
  padding in every remaining row, so a long-gone long prompt does not keep the cache wide.

Shapes: keys/values `(B, H_kv, T, D)`; attention mask `(B, T)` (nonzero = real token). Only full-attention caches
(the Llama/Qwen2 families we serve); sliding-window layers would need per-row windows and are not handled here.

`engine.decode.FusedDecoder` is the decode step that appends to this cache for Llama/Qwen2 models.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_SPARE = 32  # columns of head-room allocated on every (re)build, so most steps write in place


def _grow(capacity: int, need: int) -> int:
    """New capacity ≥ need: ×1.5 plus a constant, so growth copies are amortised O(1) per token."""
    return max(need, capacity + capacity // 2 + _MIN_SPARE)


class GrowableLayer(DynamicLayer):
    """One layer's KV in a buffer `(B, H, capacity, D)`; `length` columns are valid. `keys`/`values` are views."""

    def __init__(self):
        super().__init__()
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self._k = key_states.new_zeros((b, h, 0, dk))
        self._v = value_states.new_zeros((b, value_states.shape[1], 0, value_states.shape[3]))
        self.length = 0
        self.is_initialized = True

    def set_buffers(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Adopt buffers whose first `length` columns are valid (used by select/merge/trim)."""
        self._k, self._v, self.length = k, v, length
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True
        self.keys, self.values = k[:, :, :length], v[:, :, :length]

    def _reserve(self, need: int) -> None:
        cap = self._k.shape[2]
        if need <= cap:
            return
        new_cap = _grow(cap, need)
        k = self._k.new_zeros(self._k.shape[:2] + (new_cap, self._k.shape[3]))
        v = self._v.new_zeros(self._v.shape[:2] + (new_cap, self._v.shape[3]))
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write `(B, H, q, D)` new states at columns [length, length+q); return views of all valid columns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, q = self.length, key_states.shape[2]
        self._reserve(start + q)
        self._k[:, :, start : start + q] = key_states
        self._v[:, :, start : start + q] = value_states
        self.length = start + q
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:  # not used by the engine; keep the parent's contract
        if tokens_to_remove < 0 and self.is_initialized:
            self.set_buffers(self._k, self._v, max(0, self.length + tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.set_buffers(self._k[indices], self._v[indices], self.length)


class BatchKVCache(Cache):
    """A `Cache` of `GrowableLayer`s, one per decoder layer, plus the batch-level row operations."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[GrowableLayer() for _ in range(num_layers)])

    @property
    def seq_len(self) -> int:
        return self.layers[0].length if self.layers and self.layers[0].is_initialized else 0

    def select_rows(self, rows: torch.Tensor, drop_left: int = 0, spare: int = _MIN_SPARE) -> None:
        """Keep batch rows `rows` (1-D long) and drop the first `drop_left` columns; re-allocate with head-room."""
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            n = layer.length - drop_left
            k_valid = layer._k[rows, :, drop_left : layer.length]
            v_valid = layer._v[rows, :, drop_left : layer.length]
            k = k_valid.new_zeros(k_valid.shape[:2] + (n + spare, k_valid.shape[3]))
            v = v_valid.new_zeros(v_valid.shape[:2] + (n + spare, v_valid.shape[3]))
            k[:, :, :n] = k_valid
            v[:, :, :n] = v_valid
            layer.set_buffers(k, v, n)

    def merge(self, other: "BatchKVCache", spare: int = _MIN_SPARE, order: torch.Tensor | None = None,
              keep: torch.Tensor | None = None, drop_left: int = 0) -> None:
        """Append `other`'s rows below ours, in one copy. The shorter side is left-padded with zero columns to
        T = max length. `keep` (1-D long, None = all): only these rows of ours survive (finished rows leave in the
        same copy), and `drop_left` leading columns of ours (padding in every kept row) are dropped with them.
        `order` (Ka+Bb,) long: row r of the result is row `order[r]` of [kept ours; theirs] (None: ours, then
        theirs); the rows are written straight to their places, so reordering costs no extra copy."""
        ba = self.layers[0]._k.shape[0] if keep is None else keep.shape[0]
        bb = other.layers[0]._k.shape[0]
        dest_a, dest_b = slice(0, ba), slice(ba, ba + bb)  # destination rows of ours and of theirs
        if order is not None:
            dest = torch.empty_like(order)
            dest[order] = torch.arange(order.shape[0], device=order.device)
            dest_a, dest_b = dest[:ba], dest[ba:]
        src_a = slice(None) if keep is None else keep
        for mine, theirs in zip(self.layers, other.layers):
            la, lb = mine.length - drop_left, theirs.length
            t = max(la, lb)
            k = mine._k.new_zeros((ba + bb, mine._k.shape[1], t + spare, mine._k.shape[3]))
            v = mine._v.new_zeros((ba + bb, mine._v.shape[1], t + spare, mine._v.shape[3]))
            k[dest_a, :, t - la : t] = mine._k[src_a, :, drop_left : mine.length]
            v[dest_a, :, t - la : t] = mine._v[src_a, :, drop_left : mine.length]
            k[dest_b, :, t - lb : t] = theirs._k[:, :, :lb]
            v[dest_b, :, t - lb : t] = theirs._v[:, :, :lb]
            mine.set_buffers(k, v, t)


def merge_masks(mask_a: torch.Tensor, mask_b: torch.Tensor) -> torch.Tensor:
    """Stack two left-padded attention masks `(Ba, Ta)`, `(Bb, Tb)` → `(Ba+Bb, max(Ta, Tb))`, padding on the left."""
    t = max(mask_a.shape[1], mask_b.shape[1])
    out = mask_a.new_zeros((mask_a.shape[0] + mask_b.shape[0], t))
    out[: mask_a.shape[0], t - mask_a.shape[1] :] = mask_a
    out[mask_a.shape[0] :, t - mask_b.shape[1] :] = mask_b
    return out


def row_leads(mask: torch.Tensor) -> torch.Tensor:
    """Leading padding columns of each row of a left-padded `mask` `(B, T)` (its first real column), `(B,)` long."""
    return mask.int().argmax(dim=1)


def leading_pad_columns(mask: torch.Tensor) -> int:
    """Number of leading columns that are padding (0) in every row of `mask` `(B, T)`."""
    if mask.shape[0] == 0:
        return mask.shape[1]
    used = mask.any(dim=0)
    nz = torch.nonzero(used)
    return int(nz[0, 0]) if nz.numel() else mask.shape[1]

