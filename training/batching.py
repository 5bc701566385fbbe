"""Rows of a training batch grouped by length, so that fewer padded positions go through the model (pure, no torch).

A padded micro-batch costs rows × its longest row; grouping rows of similar length (sorting by length before splitting
into micro-batches, or forwarding a batch in a few length buckets) removes most of the padding. Both trainers use
these: the student's `opd_update` (micro-batches) and the specialists' PPO step (length buckets of one batch).
With a token budget (`micro_batch_tokens`) every trainer cuts a step's rows into micro-batches of bounded padded size
instead (`token_budget_groups`), base SFT included.
"""
from __future__ import annotations

from typing import Sequence

from infra.batch_groups import token_budget_groups  # noqa: F401 (the trainers' cut; the engine's reward model's too)

MAX_BUCKETS = 4  # forward calls per micro-batch at most, in both trainers (each bucket is one more forward call)


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
    positions (exact). Another bucket is only taken if it saves at least `min_saving` of the unbucketed positions per
    bucket added (each bucket is one more forward call). One group when rows are few or of equal length.

    The dynamic programme best[k][j] = min_i best[k-1][i] + (j - i)·s[j-1] over the sorted lengths s has a cost that
    satisfies the quadrangle inequality ((b-a)·s[c-1] <= (b-a)·s[d-1] for a <= b <= c <= d), so the leftmost best cut
    never moves left as j grows and each layer is solved by divide and conquer: O(K·n·log n) instead of O(K·n²)
    (the same cuts, ties broken to the left as before; tests/unit/test_batching.py checks it against the plain loop).
    """
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
    for k in range(1, min(max_buckets, n) + 1):
        prev, cur, cuts = best[k - 1], best[k], cut[k]
        stack = [(k, n, k - 1, n - 1)]  # (j_lo, j_hi, i_lo, i_hi): solve j in [j_lo, j_hi] with cuts in [i_lo, i_hi]
        while stack:
            j_lo, j_hi, i_lo, i_hi = stack.pop()
            if j_lo > j_hi:
                continue
            j = (j_lo + j_hi) // 2
            top, s_j = srt[j - 1], inf
            arg = i_lo
            for i in range(i_lo, min(i_hi, j - 1) + 1):
                c = prev[i] + (j - i) * top
                if c < s_j:
                    s_j, arg = c, i
            cur[j], cuts[j] = s_j, arg
            stack.append((j_lo, j - 1, i_lo, arg))
            stack.append((j + 1, j_hi, arg, i_hi))
    k_best = 1
    for k in range(2, min(max_buckets, n) + 1):
        saving = best[k_best][n] - best[k][n]
        if saving > 0 and saving >= min_saving * one * (k - k_best):
            k_best = k
    bounds, j = [], n
    for k in range(k_best, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return [order[i:j] for i, j in reversed(bounds)]


def step_micro_batches(backend, lengths: Sequence[int]) -> list[list[int]] | None:
    """This rank's token-budget micro-batches of one optimizer step: `token_budget_groups(lengths,
    backend.settings.micro_batch_tokens)`, led by empty groups so that every rank backwards the same number of
    micro-batches (the most any rank has: a collective under W > 1, where ZeRO-2/3 reduce in every backward; an
    empty group is a zero-loss pass). None when the backend has no budget (the trainer's fixed split)."""
    budget = backend.settings.micro_batch_tokens
    if budget is None:
        return None
    groups = token_budget_groups(lengths, budget)
    count = len(groups) if backend.world_size == 1 else int(backend.all_reduce_max(len(groups)))
    return [[] for _ in range(count - len(groups))] + groups
