"""Pure batching decisions of the engine: which waiting sequences prefill together, and how a decode step splits
the running batch's attention by row width. No tensors of the model here; both are tested by hand-made cases.

Why: the running batch is one left-padded KV cache `(B, H, T, D)`. When a few rows are long (an APRIL partial
resumed with 400 tokens) and most are short (fresh prompts of 15), a padded forward makes every row pay for T:
a prefill group padded to the longest prompt, and a decode step whose attention reads all T columns of every row.
On CPU that padding was most of the cost of resumed partials (bench/april.py). Grouping prefills by length and
splitting decode attention into width buckets makes each row pay roughly for its own length.
"""
from __future__ import annotations

from typing import Sequence


def prefill_group(lengths: Sequence[int], max_tokens: int, pad_allowance: int = 256) -> list[int]:
    """Indices (into `lengths`) of the sequences to prefill together, shortest first.

    Starts at the shortest and adds the next-shortest while the padded size `L_max · n` stays within `max_tokens`
    and the padding the group carries stays within `pad_allowance` tokens or a third of its padded size. Each
    forward has a fixed cost (≈ 1.5 ms on CPU for the tiny preset, about what 256 padded tokens cost), so a few
    padded tokens are cheaper than another forward, but a 400-token partial must not pad 30 short prompts to
    400. The first sequence is always taken, whatever its length; the others wait for the next step.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if not order:
        return []
    group, total = [order[0]], lengths[order[0]]
    for i in order[1:]:
        n = len(group) + 1
        padded = lengths[i] * n  # sorted: the newcomer is the longest
        pad = padded - total - lengths[i]
        if padded > max_tokens or (pad > pad_allowance and 3 * pad > padded):
            break
        group.append(i)
        total += lengths[i]
    return group


def attention_buckets(lead: Sequence[int], t: int, max_buckets: int = 4, min_saving: float = 0.3,
                      min_width: int = 48) -> list[tuple[int, int, int]] | None:
    """Split decode attention over rows into contiguous buckets `(start, end, first_column)`, or None for one
    bucket (attend over all `t` columns).

    `lead[i]` is the number of leading padding columns of row i in a cache of `t` columns (row i's real tokens are
    columns `lead[i] … t-1`); rows should be sorted by `lead` descending (shortest first) for buckets to help, but
    any order is correct: a bucket attends from the smallest lead among its rows, so no real column is skipped.
    Greedy: a new bucket starts when a row is more than twice as wide as the first row of the current bucket
    (widths under `min_width` count as `min_width`: tiny rows are not worth a bucket of their own). Buckets are
    used only when they save at least `min_saving` of the row-columns `B · t` that one bucket reads.
    """
    b = len(lead)
    if b < 2:
        return None
    buckets: list[list[int]] = [[0, 1]]
    base = max(t - lead[0], min_width)
    for i in range(1, b):
        w = max(t - lead[i], min_width)
        if w > 2 * base and len(buckets) < max_buckets:
            buckets.append([i, i + 1])
            base = w
        else:
            buckets[-1][1] = i + 1
    if len(buckets) == 1:
        return None
    out = [(s, e, min(lead[s:e])) for s, e in buckets]
    cost = sum((e - s) * (t - c) for s, e, c in out)
    full = b * (t - min(lead))
    return out if cost <= (1.0 - min_saving) * full else None


def attention_groups(lengths: Sequence[int], long_from: int = 64, pad_allowance: int = 256) -> list[list[int]]:
    """Partition all sequences of one packed prefill into attention groups (indices into `lengths`), shortest first.

    The projections and the MLP of a packed prefill run on every real token at once; only attention needs a
    sequence's own tokens together. Short prompts of similar length attend together in one padded call (groups cut
    as in `prefill_group`, padding ≤ `pad_allowance` tokens or a third); a sequence of `long_from` tokens or more
    attends alone, with SDPA's mask-free causal kernel, since padding a long row costs O(L²) in attention and a
    masked call materialises an (L, L) mask per row. Equal lengths never need a mask, whatever their length.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    short = [i for i in order if lengths[i] < long_from]
    groups: list[list[int]] = []
    while short:
        pick = set(prefill_group([lengths[i] for i in short], 1 << 62, pad_allowance))
        groups.append([i for j, i in enumerate(short) if j in pick])
        short = [i for j, i in enumerate(short) if j not in pick]
    for i in order:  # long: alone, or with the ones of exactly its length (no mask needed)
        if lengths[i] >= long_from:
            if groups and groups[-1] and lengths[groups[-1][0]] == lengths[i] >= long_from:
                groups[-1].append(i)
            else:
                groups.append([i])
    return groups


def width_segments(lengths: Sequence[int], min_width: int = 48, ratio: float = 2.0) -> list[list[int]]:
    """Split sequences sorted by length (ascending) into contiguous groups of similar width, for the running
    batch's segments (`engine.running`): a group ends before the first sequence longer than `ratio` times
    its first one (widths under `min_width` count as `min_width`, so short prompts stay together).

    Why: each segment has its own left-padded KV cache, so a short row never carries a long row's columns (no
    zero-filled padding to copy on every merge and compaction, no bucket slicing in decode attention)."""
    groups: list[list[int]] = []
    base = 0
    for i, n in enumerate(lengths):
        if i and n < lengths[i - 1]:
            raise ValueError(f"width_segments needs ascending lengths; lengths[{i}] = {n} < {lengths[i - 1]}")
        w = max(n, min_width)
        if not groups or w > ratio * base:
            groups.append([])
            base = w
        groups[-1].append(i)
    return groups


def similar_width(a: int, b: int, min_width: int = 48, ratio: float = 2.0) -> bool:
    """Whether segments of widths `a` and `b` belong together by the rule of `width_segments`."""
    lo, hi = sorted((max(a, min_width), max(b, min_width)))
    return hi <= ratio * lo


# Batch sizes a static decode step is shaped for (`engine.static_batch`): every size up to 8, then steps of 8 to 64,
# of 16 to 256 and of 64 beyond, as SGLang's `--cuda-graph-bs`. A step of n rows runs at the smallest size ≥ n,
# so a CUDA graph per size covers every batch with at most ~12% padding rows past 64.
def batch_bucket(n: int) -> int:
    """The static decode step's row count for `n` running rows (n ≥ 1): the smallest bucket ≥ n."""
    if n < 1:
        raise ValueError(f"batch_bucket needs at least one row, got {n}")
    for step, upto in ((1, 8), (8, 64), (16, 256)):
        if n <= upto:
            return -(-n // step) * step
    return -(-n // 64) * 64


def column_bucket(t: int, cap: int, smallest: int = 64) -> int:
    """Key/value columns a static decode step attends over when the longest row needs `t` (its position + 1):
    the next power of two ≥ t (at least `smallest`), at most `cap` (the KV pool's columns; t ≤ cap). Powers of
    two: a row's decode crosses O(log T) sizes, so few CUDA graphs are captured, and attention reads < 2× the
    columns it needs."""
    if not 1 <= t <= cap:
        raise ValueError(f"column_bucket: {t} columns needed, the pool has {cap}")
    size = smallest
    while size < t:
        size *= 2
    return min(size, cap)


def running_rows_for_memory(requested: int, budget_bytes: float, bytes_per_token: int, columns: int) -> int:
    """`max_running_requests` that a KV pool of `budget_bytes` holds, each row `columns` tokens of
    `bytes_per_token` (keys and values of every layer): min(requested, ⌊budget / (bytes_per_token · columns)⌋),
    at least 1 (a server that cannot hold one row fails at its first request, naming the memory, not here)."""
    per_row = bytes_per_token * columns
    fit = int(budget_bytes // per_row) if per_row > 0 else requested
    return max(1, min(requested, fit))
