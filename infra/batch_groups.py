"""Rows cut into padded groups of bounded size, by length (pure, no torch): the trainers' token-budget micro-batches
(training/batching.py) and the reward-model server's forwards (engine/reward_model.py) use the same cut."""
from __future__ import annotations

from typing import Sequence


def token_budget_groups(lengths: Sequence[int], max_tokens: int, max_rows: int | None = None) -> list[list[int]]:
    """Row indices sorted by length (stable) and cut, greedily in that order, into consecutive groups whose padded
    size len(group) × its longest row stays ≤ `max_tokens`; a row longer than `max_tokens` is a group of its own.
    Token-budget micro-batches: each group is one forward and backward, so a step's peak activation memory follows
    the budget, not the batch, and rows of similar length share a group (little padding).

    Greedy gives the fewest groups of any cut of the sorted order: a group's padded size is (its rows) × (its last
    row), so dropping a group's first rows keeps it within the budget, and by induction the k-th greedy group ends
    no earlier than the k-th group of any other cut.
    Example: lengths [5, 2, 9, 3], max_tokens 8 → sorted 2, 3, 5, 9 → [[1, 3], [0], [2]] (2·3 = 6 ≤ 8, then
    3·5 = 15 > 8; 2·9 > 8; 9 > 8 alone).
    `max_rows`: also at most this many rows a group (a forward's batch dimension, e.g. the reward-model server's)."""
    if max_tokens < 1:
        raise ValueError(f"token_budget_groups: max_tokens must be >= 1, got {max_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"token_budget_groups: max_rows must be >= 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:  # ascending: the row added is the group's longest
        if cur and ((len(cur) + 1) * lengths[i] > max_tokens or (max_rows is not None and len(cur) >= max_rows)):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups
