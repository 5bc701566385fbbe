"""Length grouping of training rows (training/batching.py) and the specialists' bucketed forward (teachers/ppo_step.py):
less padding, the same values."""
from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch

import teachers.ppo_step as ppo_step
from training.batching import length_buckets, length_sorted_split, padded_positions, padding_fraction
from infra.models import build_model
from teachers.april import Sample
from teachers.ppo_step import build_batch, token_logprobs

pytestmark = pytest.mark.unit


def test_length_sorted_split_sizes_order_and_cover():
    lengths = [5, 3, 9, 3, 7, 1, 9]
    for parts in (1, 2, 3, 7, 9):
        groups = length_sorted_split(lengths, parts)
        assert [len(g) for g in groups] == [len(a) for a in np.array_split(np.arange(len(lengths)), parts)]
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(lengths)))
        assert [lengths[i] for i in flat] == sorted(lengths)
    assert length_sorted_split(lengths, 7)[1:3] == [[1], [3]]  # equal lengths keep their order (stable)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        length_sorted_split(lengths, 0)


def brute_force(lengths, k):
    """Least padded positions over every split of the sorted rows into at most k consecutive groups."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = padded_positions(lengths, [order])
    for m in range(1, k):
        for cuts in itertools.combinations(range(1, len(order)), m):
            bounds = (0, *cuts, len(order))
            best = min(best, padded_positions(lengths, [order[a:b] for a, b in zip(bounds, bounds[1:])]))
    return best


def test_length_buckets_are_optimal_and_cover_every_row():
    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        groups = length_buckets(lengths, 3, min_saving=0.0)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and len(groups) <= 3
        assert padded_positions(lengths, groups) == brute_force(lengths, 3)
    assert length_buckets([4, 4, 4], 4) == [[0, 1, 2]]  # nothing to save: one forward
    assert length_buckets([], 4) == []
    # a bucket that saves under min_saving of the unbucketed positions is not worth a forward call
    assert len(length_buckets([100] * 20 + [101], 4, min_saving=0.05)) == 1  # saves 0.9%
    assert len(length_buckets([100] * 20 + [101], 4, min_saving=0.0)) == 2


def test_padding_fraction_falls_on_a_demo_like_batch():
    """64 rows: prompts of 8–40 tokens (the demo's domains differ in length), responses of 1–16 tokens."""
    rng = random.Random(1)
    lengths = [rng.randint(8, 40) + rng.randint(1, 16) for _ in range(64)]
    strided = [list(a) for a in np.array_split(np.arange(64), 4)]  # micro-batches in sample order (before)
    assert padding_fraction(lengths, length_sorted_split(lengths, 4)) < padding_fraction(lengths, strided) / 3
    assert padding_fraction(lengths, length_buckets(lengths, 4)) < padding_fraction(lengths, [list(range(64))]) / 2
    assert padding_fraction([3, 3], [[0, 1]]) == 0.0


def test_bucketed_forward_gives_the_unbucketed_log_probs_and_entropy(monkeypatch):
    model = build_model("nano", 64, 0, 1, 2, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, o) in enumerate([(3, 2), (12, 9), (4, 1), (20, 6), (2, 3), (11, 11)]):
        ids = torch.randint(3, 64, (p + o,), generator=g).tolist()
        samples.append(Sample(f"s{i}", f"r{i}", ids[:p], ids[p:], [-1.0] * o, [0] * o, "d", {}, "stop"))
    batch = build_batch(samples, pad_id=0, rewards=[0.0] * len(samples))
    assert len(length_buckets(batch.attention_mask.sum(1).tolist(), ppo_step.MAX_BUCKETS)) > 1
    with torch.no_grad():
        lp, ent = ppo_step._logp_and_entropy(model, batch, with_entropy=True, temperature=0.8)
        monkeypatch.setattr(ppo_step, "MAX_BUCKETS", 1)
        lp1, ent1 = ppo_step._logp_and_entropy(model, batch, with_entropy=True, temperature=0.8)
        ref = token_logprobs(model, batch, 0.8)
    on = batch.mask != 0
    torch.testing.assert_close(lp[on], lp1[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[on], ent1[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref, lp1)
    # every position that predicts a real token (prompt or response) is the same; padding: 0 when bucketed
    real = torch.nn.functional.pad(batch.attention_mask[:, 1:], (0, 1)).bool()
    torch.testing.assert_close(lp[real], lp1[real], rtol=1e-5, atol=1e-5)


def _buckets_by_the_plain_loop(lengths, max_buckets, min_saving):
    """The O(K·n²) dynamic programme `length_buckets` replaced, as the reference it must equal."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n == 0:
        return []
    srt = [lengths[i] for i in order]
    inf = float("inf")
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
        if saving > 0 and saving >= min_saving * (n * srt[-1]) * (k - k_best):
            k_best = k
    bounds, j = [], n
    for k in range(k_best, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [order[i:j] for i, j in reversed(bounds)]


def test_length_buckets_equal_the_plain_dynamic_programme():
    """Divide and conquer gives the very groups of the O(K·n²) loop: random batches, many ties, 1..6 buckets."""
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(1, 70)
        hi = rng.choice([3, 20, 400])  # few distinct lengths (ties everywhere) to all distinct
        lengths = [rng.randint(1, hi) for _ in range(n)]
        k, saving = rng.randint(1, 6), rng.choice([0.0, 0.01, 0.05])
        assert length_buckets(lengths, k, saving) == _buckets_by_the_plain_loop(lengths, k, saving), (lengths, k)


def test_length_buckets_scale():
    """2,048 rows in 4 buckets: well under 2 s (measured here: 0.03 s; the plain loop 1.8 s)."""
    rng = random.Random(1)
    lengths = [rng.randint(1, 4096) for _ in range(2048)]
    t0 = time.perf_counter()
    groups = length_buckets(lengths, 4)
    assert time.perf_counter() - t0 < 1.0 and sorted(i for g in groups for i in g) == list(range(2048))


def test_token_budget_groups_by_hand():
    from training.batching import token_budget_groups

    # sorted 2 (row 1), 3 (row 3), 5 (row 0), 9 (row 2): 2·3 = 6 ≤ 8; adding 5 → 3·5 = 15 > 8; 5 alone; 9 > 8 alone
    assert token_budget_groups([5, 2, 9, 3], 8) == [[1, 3], [0], [2]]
    # a budget that fits everything: one group, sorted
    assert token_budget_groups([5, 2, 9, 3], 36) == [[1, 3, 0, 2]]  # 4 · 9 = 36
    assert token_budget_groups([5, 2, 9, 3], 35) == [[1, 3, 0], [2]]  # 4 · 9 = 36 > 35; 3 · 5 = 15
    # equal lengths: floor(budget / length) rows a group, ties keep their order
    assert token_budget_groups([4] * 5, 8) == [[0, 1], [2, 3], [4]]
    # every row longer than the budget: one row each
    assert token_budget_groups([10, 11], 3) == [[0], [1]]
    assert token_budget_groups([], 8) == []
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_budget_groups([1], 0)


def test_token_budget_groups_keep_the_budget_and_every_row_once():
    from training.batching import token_budget_groups

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 200)
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        flat = [lengths[i] for g in groups for i in g]
        assert flat == sorted(lengths)  # consecutive runs of the sorted order
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1
        # fewest groups of any cut of the sorted order (a plain DP over cuts)
        s, n = sorted(lengths), len(lengths)
        best = [0] + [n + 1] * n
        for j in range(1, n + 1):
            for i in range(j):
                if (j - i) * s[j - 1] <= budget or j - i == 1:
                    best[j] = min(best[j], best[i] + 1)
        assert len(groups) == best[n]
