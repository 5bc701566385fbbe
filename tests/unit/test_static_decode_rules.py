"""The static decode path's pure pieces: its shape buckets and memory sizing (`engine.batching`), and sampling without
host syncs (`engine.sampling.sample_tokens` given the host's flags), on hand-made cases."""
from __future__ import annotations

import pytest
import torch

from engine.batching import batch_bucket, column_bucket, running_rows_for_memory
from engine.sampling import sample_tokens

pytestmark = pytest.mark.unit


def test_batch_bucket_is_the_smallest_captured_size_at_or_above():
    # every size to 8, then steps of 8 to 64, of 16 to 256, of 64 beyond
    assert [batch_bucket(n) for n in (1, 2, 3, 7, 8)] == [1, 2, 3, 7, 8]
    assert [batch_bucket(n) for n in (9, 16, 17, 63, 64)] == [16, 16, 24, 64, 64]
    assert [batch_bucket(n) for n in (65, 80, 81, 255, 256)] == [80, 80, 96, 256, 256]
    assert [batch_bucket(n) for n in (257, 320, 321)] == [320, 320, 384]
    with pytest.raises(ValueError, match="at least one row"):
        batch_bucket(0)


def test_column_bucket_is_a_power_of_two_within_the_pool():
    assert column_bucket(1, 512) == 64  # at least 64
    assert column_bucket(64, 512) == 64
    assert column_bucket(65, 512) == 128
    assert column_bucket(300, 512) == 512
    assert column_bucket(300, 384) == 384  # never past the pool
    with pytest.raises(ValueError, match="the pool has 384"):
        column_bucket(385, 384)


def test_running_rows_for_memory():
    # medium: 12 layers × 2 (k, v) × 8 kv heads × 64 dims × 2 bytes = 24,576 bytes a token; 512-token rows = 12.58 MB
    per_token = 2 * 12 * 8 * 64 * 2
    assert per_token == 24576
    assert running_rows_for_memory(256, 1e9, per_token, 512) == 79  # ⌊1e9 / 12,582,912⌋
    assert running_rows_for_memory(64, 1e9, per_token, 512) == 64  # the request binds
    assert running_rows_for_memory(256, 1e3, per_token, 512) == 1  # never below one row


def _rows(b: int, v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 3
    temp = torch.tensor([0.0, 1.0, 0.7, 1e-7, 1.3, 0.9, 0.0, 1.0][:b])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.3, 0.8, 1.0][:b])
    top_k = torch.tensor([-1, 5, -1, 3, 0, 50, 2, 1000][:b])
    uniform = torch.rand(b, generator=g)
    return logits, temp, top_p, top_k, uniform


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_without_syncs_picks_the_same_tokens(seed):
    """With the host's flags, every row's token is the one the syncing path picks (greedy rows: argmax)."""
    logits, temp, top_p, top_k, uniform = _rows(8, 40, seed)
    sampled = temp >= 1e-6
    flags = (bool(sampled.any()), bool(((top_p < 1) | ((top_k > 0) & (top_k < 40)))[sampled].any()))
    assert flags == (True, True)
    assert torch.equal(sample_tokens(logits, temp, top_p, top_k, uniform, flags=flags),
                       sample_tokens(logits, temp, top_p, top_k, uniform))
    # no row filters: the unsorted CDF on both paths
    ones, whole = torch.ones(8), torch.full((8,), -1)
    assert torch.equal(sample_tokens(logits, temp, ones, whole, uniform, flags=(True, False)),
                       sample_tokens(logits, temp, ones, whole, uniform))
    # all greedy: argmax, no draw
    zeros = torch.zeros(8)
    assert torch.equal(sample_tokens(logits, zeros, top_p, top_k, uniform, flags=(False, False)),
                       logits.argmax(-1))


def test_prompt_logprobs_of_a_batch_match_each_prompt_alone():
    """`prompt_logprobs` reads several prompts' log-probs (chosen, top-k of two sizes, requested ids) in one copy:
    each is what the definition gives for that prompt alone, entry j = log_softmax(row K - n + start + j)[ids[...]]."""
    from engine.sampling import prompt_logprobs

    g = torch.Generator().manual_seed(0)
    K, V = 6, 11
    logits = torch.randn(3, K, V, generator=g)
    asks = [(0, (1, 2, 3, 4, 5), 1, 2, None), (1, (7, 8, 9), 0, 0, (3, 4)), (2, (5, 6, 7, 8, 9, 10), 3, 4, (0,)),
            (2, (1, 2), 1, 3, (9,))]  # the last: start = n - 1, nothing to score
    out = prompt_logprobs(logits, asks)
    for (row, ids, st, k, tid), (chosen, top, by_id) in zip(asks, out):
        n = len(ids)
        logp = torch.log_softmax(logits[row], -1)
        want = [float(logp[K - n + p, ids[p + 1]]) for p in range(st, n - 1)]
        assert chosen == pytest.approx(want, abs=1e-6)
        if k == 0:
            assert top is None
        else:
            assert len(top) == len(want)
            for j, (vals, top_ids) in enumerate(top):
                v, i = torch.topk(logp[K - n + st + j], k)
                assert top_ids == i.tolist() and vals == pytest.approx(v.tolist(), abs=1e-6)
        if tid is None:
            assert by_id is None
        else:
            assert by_id == [pytest.approx([float(logp[K - n + p, t]) for t in tid], abs=1e-6) for p in range(st, n - 1)]
    assert out[3] == ([], [], [])
