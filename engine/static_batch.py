"""The running batch in static, preallocated device memory: what a CUDA-graph decode step needs.

`running.RunningBatch` (segments of left-padded caches that grow, merge and compact) suits the CPU, where a step's
cost is its arithmetic and every padded column costs. On a GPU a small model's decode step is bound by the host:
~15 kernel launches per layer, shapes that change every step, and host syncs. Here the rows live in one KV pool per
layer, `(R, H_kv, C, D)` allocated once (grown ×2 on demand), and a step has a fixed shape:

- row r holds its tokens at columns `0 … pos[r]` (no left padding: column = RoPE position); rows `0 … n-1` are live,
  packed (a finished row is replaced by the last live row: one copy of that row's columns, per layer);
- a step runs `b = batch_bucket(n)` rows over `t = column_bucket(max pos + 1)` columns; rows n … b-1 are padding
  (token 0 at position 0 of an unused row, results ignored), and attention masks the columns past each row's
  position, so the step's tensors have the same shapes and addresses for every (b, t): one CUDA graph per pair
  (`engine.cuda_graphs`);
- the step's inputs (`last`, `pos`) are device buffers the step reads in place; after a step the sampled tokens are
  written into `last` and `pos` advances on the device, so the host builds no tensor per step.

The same code runs eagerly on the CPU (tests compare it with the segment path), where it is not the default.
"""
from __future__ import annotations

import torch

from engine.batching import batch_bucket, column_bucket

_MIN_COLUMNS = 64


def _pow2(n: int, smallest: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return size


class KVPool:
    """Keys and values of every layer, `(rows, H_kv, columns, D)` each, plus the step's input buffers."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.rows = self.columns = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.last = self.pos = self.row_index = self.col_index = None
        self.generation = 0  # bumped when the buffers move (a captured graph reads the old ones: recapture)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def reserve(self, rows: int, columns: int, keep_rows: int) -> bool:
        """Room for `rows` × `columns` (rows rounded up to a batch bucket, columns to a power of two ≥ 64); the first
        `keep_rows` rows keep their contents. Returns True when the buffers were reallocated."""
        if rows <= self.rows and columns <= self.columns:
            return False
        new_r = max(self.rows, batch_bucket(rows))
        new_c = max(self.columns, _pow2(columns, _MIN_COLUMNS))
        shape = (new_r, self.kv_heads, new_c, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if keep_rows:
            for new, old in zip(k + v, self.k + self.v):
                new[:keep_rows, :, : self.columns] = old[:keep_rows]
        last = torch.zeros(new_r, dtype=torch.long, device=self.device)
        pos = torch.zeros(new_r, dtype=torch.long, device=self.device)
        if keep_rows:
            last[:keep_rows], pos[:keep_rows] = self.last[:keep_rows], self.pos[:keep_rows]
        self.k, self.v, self.last, self.pos = k, v, last, pos
        self.row_index = torch.arange(new_r, device=self.device)
        self.col_index = torch.arange(new_c, device=self.device)
        self.rows, self.columns = new_r, new_c
        self.generation += 1
        return True

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, columns: int) -> None:
        """Row `src[i]` → row `dst[i]` (keys/values of the first `columns` columns, `last`, `pos`); 1-D long."""
        for buf in self.k + self.v:
            buf[dst, :, :columns] = buf[src, :, :columns]
        self.last[dst] = self.last[src]
        self.pos[dst] = self.pos[src]

    def free(self) -> None:
        self.k, self.v = [], []
        self.last = self.pos = self.row_index = self.col_index = None
        self.rows = self.columns = 0
        self.generation += 1


class StaticBatch:
    """The running rows over a `KVPool`, with `running.RunningBatch`'s interface (`seqs`, `holes`, `live`, `drop`,
    `clear`, `changed`) so admission, aborts and weight updates treat both the same. Row i of `seqs` is pool row i.
    `max_pos` (host) is the largest position among live rows: it picks the step's column bucket without a sync."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._seqs: list = []
        self.max_pos = 0
        self.changed = True

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def live(self) -> int:
        return len(self._seqs)

    @property
    def seqs(self) -> list:
        return self._seqs

    @property
    def holes(self) -> set[int]:
        return set()  # finished rows leave at once (a row copy), never decoded along

    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the next step: the batch bucket of the live rows and the column bucket of the
        longest; the next token of each row is written at its `pos`, so columns ≥ max_pos + 1."""
        return batch_bucket(len(self._seqs)), column_bucket(self.max_pos + 1, self.pool.columns)

    def slots_for(self, prompt_lens: list[int], max_new: list[int]) -> torch.Tensor:
        """Reserve pool rows for new rows (after the live ones) with room for their prompts and new tokens; returns
        their row indices (g,) on the device, for the prefill to write into."""
        n, g = len(self._seqs), len(prompt_lens)
        need = max(p + m for p, m in zip(prompt_lens, max_new))
        self.pool.reserve(n + g, max(need, self.max_pos + 1), keep_rows=n)
        return self.pool.row_index[n: n + g]

    def add(self, seqs: list, last: torch.Tensor, pos: torch.Tensor) -> None:
        """Rows prefilled into the slots `slots_for` gave (in order) join: their last tokens and positions (g,)."""
        n, g = len(self._seqs), len(seqs)
        self.pool.last[n: n + g] = last
        self.pool.pos[n: n + g] = pos
        self._seqs = self._seqs + list(seqs)
        self.max_pos = max([self.max_pos] + [len(s.spec.input_ids) + len(s.result.output_ids) - 1 for s in seqs])
        self.changed = True

    def advance(self, ids: torch.Tensor) -> None:
        """After a step: the live rows' sampled tokens (n,) are their next inputs, one position further."""
        n = len(self._seqs)
        self.pool.last[:n] = ids
        self.pool.pos[:n] += 1
        self.max_pos += 1

    def drop(self, dead: set[int]) -> None:
        """Rows `dead` finished: the last live rows move into their places (one copy per moved row and layer, of
        the columns in use), so the live rows stay 0 … n-1."""
        if not dead:
            return
        n = len(self._seqs)
        keep_n = n - len(dead)
        holes = sorted(i for i in dead if i < keep_n)  # places to fill, below the new end
        movers = [i for i in range(keep_n, n) if i not in dead]  # live rows above it
        seqs = list(self._seqs)
        if holes:
            dst = torch.tensor(holes, dtype=torch.long, device=self.pool.device)
            src = torch.tensor(movers, dtype=torch.long, device=self.pool.device)
            self.pool.move_rows(dst, src, min(self.pool.columns, self.max_pos + 2))
            for d, s in zip(holes, movers):
                seqs[d] = seqs[s]
        self._seqs = seqs[:keep_n]
        self.pool.pos[keep_n:n] = 0  # padding rows decode at position 0 of their own row
        self.pool.last[keep_n:n] = 0
        self.max_pos = max((len(s.spec.input_ids) + len(s.result.output_ids) - 1 for s in self._seqs), default=0)
        self.changed = True

    def clear(self) -> None:
        if self._seqs:
            self.drop(set(range(len(self._seqs))))
        self.max_pos = 0
        self.changed = True
