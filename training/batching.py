"""Rows of a training batch grouped by length, so that fewer padded positions go through the model (pure, no torch).

A padded micro-batch costs rows × its longest row; grouping rows of similar length (sorting by length before splitting
into micro-batches, or forwarding a batch in a few length buckets) removes most of the padding. Both trainers use
these: the student's `opd_update` (micro-batches) and the specialists' PPO step (length buckets of one batch).
"""
from __future__ import annotations

from typing import Sequence


def padded_positions(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Positions the model computes when each group of row indices is padded to its longest row."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if len(g))


def padding_fraction(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """Share of computed positions that are padding (0 = none), for rows grouped as `groups`."""
    total = padded_positions(lengths, groups)
    real = sum(lengths[i] for g in groups for i in g)
    return 0.0 if total == 0 else 1.0 - real / total


def length_sorted_split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices sorted by length (stable: equal lengths keep their order), then split into `parts` consecutive
    groups of sizes as `numpy.array_split` gives (sizes differ by at most one; some empty if rows < parts)."""
    if parts < 1:
        raise ValueError(f"length_sorted_split: parts must be >= 1, got {parts}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n, out, start = len(order), [], 0
    for p in range(parts):
        size = n // parts + (1 if p < n % parts else 0)
        out.append(order[start:start + size])
        start += size
    return out


def length_buckets(lengths: Sequence[int], max_buckets: int = 4, min_saving: float = 0.05) -> list[list[int]]:
    """Row indices in at most `max_buckets` groups of consecutive lengths (sorted), chosen to minimise the padded
    positions (exact, dynamic programming over the sorted lengths). Another bucket is only taken if it saves at
    least `min_saving` of the unbucketed positions per bucket added (each bucket is one more forward call). One group when rows are
    few or of equal length."""
    if max_buckets < 1:
        raise ValueError(f"length_buckets: max_buckets must be >= 1, got {max_buckets}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n == 0:
        return []
    srt = [lengths[i] for i in order]
    one = n * srt[-1]
    inf = float("inf")
    # best[k][j]: least padded positions of the first j sorted rows in k buckets; cut[k][j]: where the last starts
    best = [[inf] * (n + 1) for _ in range(max_buckets + 1)]
    cut = [[0] * (n + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0
    for k in range(1, max_buckets + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                c = best[k - 1][i] + (j - i) * srt[j - 1]
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k_best = 1
    for k in range(2, max_buckets + 1):
        saving = best[k_best][n] - best[k][n]
        if saving > 0 and saving >= min_saving * one * (k - k_best):
            k_best = k
    bounds, j = [], n
    for k in range(k_best, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return [order[i:j] for i, j in reversed(bounds)]
