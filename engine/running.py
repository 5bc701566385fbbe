"""The engine's running batch: decoding rows grouped in segments of similar width, each with its own KV cache.

A `Segment` is what the whole batch used to be: rows left-padded to one width T in a `BatchKVCache`, their
attention mask in a preallocated bool buffer, their positions and last tokens, and *holes* (rows that finished
but still sit in the cache until a copy is worth it). The `RunningBatch` holds up to `max_segments` of them.

Why segments: an APRIL step resumes partials of a few hundred tokens next to dozens of 15-token prompts. In one
left-padded cache every short row carried the long rows' width: a prefill zero-filled `G × L_max` columns, every
merge and compaction copied them, and decode attention had to be cut into width buckets (bench/april.py). With a
segment per width class (`batching.width_segments`), a prefill writes each class at its own width, new rows join
the segment of their width (a copy of that segment only) or start one, and a compaction copies one segment.
A decode step still runs every projection and the MLP once over all rows; only attention is per segment.

Rows of the whole batch are numbered segment by segment (the order `seqs`, `inputs` and the decode logits use).
"""
from __future__ import annotations

import torch

from engine.batching import attention_buckets, similar_width
from engine.kv_cache import BatchKVCache, leading_pad_columns, merge_masks, row_leads

_MASK_SPARE = 64  # mask columns allocated ahead, so decode steps only slice the mask buffer
_HOLES_TO_COMPACT = 0.25  # a segment compacts once this share of its rows are holes


class Segment:
    """Rows `seqs` decoding together over one left-padded `cache` (T columns); `mask` (b, T) nonzero = real."""

    def __init__(self, seqs: list, cache: BatchKVCache, mask: torch.Tensor | None, pos: torch.Tensor,
                 last: torch.Tensor, buckets: bool = True):
        self.seqs, self.cache, self.pos, self.last = seqs, cache, pos, last
        self.holes: set[int] = set()  # rows that finished but are still in the cache (see RunningBatch.drop)
        self.use_buckets = buckets
        self.set_mask(mask)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return self.cache.seq_len

    @property
    def live(self) -> int:
        return len(self.seqs) - len(self.holes)

    # -- the attention mask -----------------------------------------------------------------------------------------
    def full_mask(self) -> torch.Tensor:
        """(b, T) bool, True = real token."""
        if self.mask is None:
            return torch.ones((len(self.seqs), self.width), dtype=torch.bool, device=self.pos.device)
        return self.mask[:, : self.width]

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """Adopt the segment's mask (b, T) (any dtype, nonzero = real token; T = the cache's seq_len).

        Stored as a bool buffer (b, T + spare) whose columns ≥ T are already True: every decode step appends one
        real token per row, so a step only slices the buffer (no per-step `cat` of the mask) and passes it to SDPA
        as a ready 4-D mask (b, 1, 1, T+1), which skips transformers' per-step mask construction. No padding at
        all → None: decode steps then take attention's unmasked path.
        """
        self.buckets = None
        if mask is None or bool(mask.all()):
            self.mask, self.lead = None, [0] * len(self.seqs)
            return
        b, t = mask.shape
        buf = torch.ones((b, t + _MASK_SPARE), dtype=torch.bool, device=mask.device)
        buf[:, :t] = mask
        self.mask = buf
        self.lead = row_leads(buf[:, :t]).tolist()
        if self.use_buckets:
            self.buckets = attention_buckets(self.lead, t + 1)

    def step_mask(self, sdpa: bool) -> torch.Tensor | None:
        """The attention mask for a decode step over T cached + 1 new column: (b, 1, 1, T+1) bool for SDPA, else
        the 2-D (b, T+1) long mask that any attention implementation builds its own mask from."""
        if self.mask is None:
            return None
        need = self.width + 1
        if need > self.mask.shape[1]:
            self.set_mask(self.mask[:, : need - 1].clone())
            if self.mask is None:
                return None
        if sdpa:
            return self.mask[:, None, None, :need]
        return self.mask[:, :need].long()

    # -- rows leaving and joining -----------------------------------------------------------------------------------
    def live_pad_columns(self) -> int:
        """Leading columns that are padding for every live row (what a compaction would trim)."""
        return min(lead for i, lead in enumerate(self.lead) if i not in self.holes)

    def wants_compaction(self) -> bool:
        """Holes are decoded along until they are a quarter of the rows or the live rows could drop half the
        columns: compacting copies the segment, which per finished row cost more than decoding a few dead rows.
        (One cache for the whole batch compacted at half: every copy carried the longest row's width. APRIL at
        B = 64 decoded 9.7 holes per step of 45 rows that way, 3.3 of 39 with segments and a quarter.)"""
        return len(self.holes) >= _HOLES_TO_COMPACT * len(self.seqs) or 2 * self.live_pad_columns() >= self.width

    def take_live(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Drop the holes from the bookkeeping (`seqs`, `pos`, `last`). Returns the kept rows (K,) long, the leading
        columns that are padding in every kept row, and the kept rows' mask without them; the caller drops the
        same rows and columns from the cache, in its one copy (`select_rows` or `merge`)."""
        live = [i for i in range(len(self.seqs)) if i not in self.holes]
        idx = torch.tensor(live, dtype=torch.long, device=self.pos.device)
        mask = self.full_mask()[idx]
        drop = leading_pad_columns(mask)
        self.seqs, self.holes = [self.seqs[i] for i in live], set()
        self.pos, self.last = self.pos[idx], self.last[idx]
        return idx, drop, mask[:, drop:]

    def compact(self) -> None:
        """Remove the holes and trim the padding columns no remaining row uses (one copy of this segment)."""
        idx, drop, mask = self.take_live()
        self.cache.select_rows(idx, drop)
        self.set_mask(mask)

    def absorb(self, other: "Segment") -> None:
        """Take `other`'s rows in, in one copy of both caches; our holes leave in the same copy. Rows end up sorted
        by leading padding, descending (shortest first), which is what decode attention buckets need."""
        if other.holes:
            other.compact()
        keep, drop, mine = self.take_live() if self.holes else (None, 0, self.full_mask())
        merged = merge_masks(mine, other.full_mask())
        order = torch.argsort(row_leads(merged), descending=True, stable=True)
        if bool((order == torch.arange(order.shape[0], device=order.device)).all()):
            order = None
        self.cache.merge(other.cache, order=order, keep=keep, drop_left=drop)
        seqs, pos, last = self.seqs + other.seqs, torch.cat([self.pos, other.pos]), torch.cat([self.last, other.last])
        if order is not None:
            merged, pos, last = merged[order], pos[order], last[order]
            seqs = [seqs[i] for i in order.tolist()]
        self.seqs, self.pos, self.last = seqs, pos, last
        self.set_mask(merged)


class RunningBatch:
    """The running rows as segments of similar width (at most `max_segments`; 1 = one left-padded batch, what a
    model without the fused decode step needs, since the HF forward takes one cache)."""

    def __init__(self, max_segments: int = 4, min_width: int = 48, ratio: float = 2.0):
        if max_segments < 1:
            raise ValueError(f"max_segments must be ≥ 1, got {max_segments}")
        self.max_segments, self.min_width, self.ratio = max_segments, min_width, ratio
        self.segs: list[Segment] = []
        self._seqs: list | None = None
        self.changed = True  # membership changed since the last `params` (per-row sampling tensors)

    def __bool__(self) -> bool:
        return bool(self.segs)

    def __len__(self) -> int:
        return sum(len(s) for s in self.segs)

    @property
    def live(self) -> int:
        return sum(s.live for s in self.segs)

    @property
    def seqs(self) -> list:
        """Every row's Seq (holes included), segment by segment."""
        if self._seqs is None:
            self._seqs = [q for s in self.segs for q in s.seqs]
        return self._seqs

    @property
    def holes(self) -> set[int]:
        out, base = set(), 0
        for s in self.segs:
            out |= {base + i for i in s.holes}
            base += len(s)
        return out

    def spans(self) -> list[tuple[int, int, Segment]]:
        """(start, end, segment): each segment's rows in the batch's numbering."""
        out, base = [], 0
        for s in self.segs:
            out.append((base, base + len(s), s))
            base += len(s)
        return out

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(last tokens (B,), their positions (B,)) of every row: the next decode step's input."""
        if len(self.segs) == 1:
            return self.segs[0].last, self.segs[0].pos
        return torch.cat([s.last for s in self.segs]), torch.cat([s.pos for s in self.segs])

    def advance(self, ids: torch.Tensor) -> None:
        """After a decode step: every row's next input is its sampled token (ids (B,)), one position further."""
        for a, b, s in self.spans():
            s.last, s.pos = ids[a:b], s.pos + 1

    def _membership_changed(self) -> None:
        self._seqs, self.changed = None, True

    def clear(self) -> None:
        self.segs = []
        self._membership_changed()

    def add(self, seg: Segment) -> None:
        """New rows (a prefilled segment without holes) join the segment of the most similar width if it is
        similar enough (`batching.similar_width`), else start their own; over `max_segments`, the two segments of
        the closest widths merge (the narrower is padded to the wider)."""
        fits = [s for s in self.segs if self.max_segments == 1
                or similar_width(s.width, seg.width, self.min_width, self.ratio)]
        if fits:
            min(fits, key=lambda s: abs(s.width - seg.width)).absorb(seg)
        else:
            self.segs.append(seg)
        self.segs.sort(key=lambda s: s.width)
        while len(self.segs) > self.max_segments:
            i = min(range(len(self.segs) - 1),
                    key=lambda j: len(self.segs[j]) * (self.segs[j + 1].width - self.segs[j].width))
            narrow = self.segs.pop(i)
            self.segs[i].absorb(narrow)  # the next wider one, now at i
            self.segs.sort(key=lambda s: s.width)
        self._membership_changed()

    def drop(self, dead: set[int]) -> None:
        """Rows `dead` (batch numbering) finished: they become holes of their segment; a segment with no live row
        leaves, one that `wants_compaction` is compacted (a copy of that segment only)."""
        keep, changed = [], False
        for a, b, s in self.spans():
            s.holes |= {i - a for i in dead if a <= i < b}
            if s.live == 0:
                changed = True
                continue
            if s.holes and s.wants_compaction():
                s.compact()
                changed = True
            keep.append(s)
        self.segs = keep
        if changed:
            self._membership_changed()
