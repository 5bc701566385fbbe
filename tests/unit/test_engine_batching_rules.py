"""The engine's pure batching decisions (`engine.batching`), on hand-made cases."""
from __future__ import annotations

import pytest

from engine.batching import attention_buckets, attention_groups, prefill_group, similar_width, width_segments
from engine.prefill import plan

pytestmark = pytest.mark.unit


def test_prefill_group_takes_the_shortest_of_similar_length():
    # lengths 15, 400, 12, 20, 300: the short ones go first (shortest first); adding 300 would pad 12, 15, 20 to
    # 300 (853 padding tokens of 1200: over the 256 allowance and over a third) → 300 and 400 wait
    assert prefill_group([15, 400, 12, 20, 300], max_tokens=16384) == [2, 0, 3]
    # the padded budget binds: 3 rows of ≤ 20 tokens = 60 > 50, so only two
    assert prefill_group([15, 400, 12, 20, 300], max_tokens=50) == [2, 0]
    # a long sequence alone is always taken, whatever the budget
    assert prefill_group([500], max_tokens=10) == [0]
    # the long ones group together once the short ones are gone: 300 and 400 pad 100 tokens (≤ 256)
    assert prefill_group([400, 300], max_tokens=16384) == [1, 0]
    # 10 and 200: 190 padding tokens, within the allowance (another forward would cost more)
    assert prefill_group([200, 10], max_tokens=16384) == [1, 0]
    # 10, 10, 10 and 200: 570 padding > 256 and > 800 / 3 → 200 waits
    assert prefill_group([10, 10, 10, 200], max_tokens=16384) == [0, 1, 2]
    assert prefill_group([], max_tokens=10) == []
    # ties keep arrival order
    assert prefill_group([7, 7, 7], max_tokens=100) == [0, 1, 2]


def test_attention_buckets_split_short_rows_from_long_ones():
    # t = 421 columns; rows sorted by leading padding descending: six rows of width 21, two of width 421
    lead = [400] * 6 + [0, 0]
    # one bucket reads 8 · 421 = 3368 row-columns, these two 6 · 21 + 2 · 421 = 968
    assert attention_buckets(lead, 421) == [(0, 6, 400), (6, 8, 0)]
    # the first column of a bucket is its smallest lead, so a row out of order (row 5) is still covered
    assert attention_buckets([400, 400, 400, 400, 0, 400, 0], 421) == [(0, 4, 400), (4, 7, 0)]


def test_attention_buckets_none_when_splitting_does_not_pay():
    assert attention_buckets([0], 100) is None  # one row
    assert attention_buckets([3, 2, 1, 0], 30) is None  # every width under min_width: one bucket
    assert attention_buckets([100, 90, 80, 0], 200) is None  # 100..200 wide: within 2x of each other
    # one short row among long ones saves under 30% of the row-columns: not worth a second SDPA call
    assert attention_buckets([350, 10, 0, 0, 0], 400) is None


def test_attention_buckets_cap_the_number_of_buckets():
    # widths 50, 110, 230, 470, 950, 1000: every step doubles, but at most 4 buckets (the last takes the rest)
    t = 1000
    lead = [t - w for w in (50, 110, 230, 470, 950, 1000)]
    got = attention_buckets(lead, t, max_buckets=4)
    assert [(s, e) for s, e, _ in got] == [(0, 1), (1, 2), (2, 3), (3, 6)]
    assert got[-1][2] == 0  # the widest row's lead


def test_attention_groups_pad_only_short_prompts_of_similar_length():
    # 12, 13, 15, 16 share one padded call (4 padding tokens); 70, 90, 400 (≥ 64) each alone; the two 300s together
    # (equal lengths need no mask); shortest first throughout
    assert attention_groups([15, 12, 400, 16, 300, 300, 13, 70, 90]) == [[1, 6, 0, 3], [7], [8], [4, 5], [2]]
    # 10, 60, 63 pad 56 tokens: one group; the two 64s are long and equal: together, unpadded
    assert attention_groups([10, 60, 63, 64, 64]) == [[0, 1, 2], [3, 4]]
    # 10 × 3 + 200 (short of long_from=250) would pad 570 > 256 and > a third: two groups
    assert attention_groups([10, 10, 10, 200], long_from=250) == [[0, 1, 2], [3]]
    assert attention_groups([]) == []
    # every index exactly once
    lens = [3, 80, 80, 5, 7, 300, 64, 63, 1]
    assert sorted(i for g in attention_groups(lens) for i in g) == list(range(len(lens)))


def test_prefill_plan_indexes_each_prompts_packed_tokens():
    # prompts of 2, 3, 2 tokens packed as [a a b b b c c]: one group (2 padding tokens), shortest first (prompts 0
    # and 2, then 1), left-padded to 3 columns
    (gr,) = plan([2, 3, 2])
    assert gr.tokens.tolist() == [0, 1, 5, 6, 2, 3, 4] and (gr.g, gr.length) == (3, 3)
    assert gr.at.tolist() == [1, 2, 4, 5, 6, 7, 8]  # row r's tokens at r·3 + (3 − n) …
    # causal ∧ real keys, padding queries attend to themselves: row 0 (1 pad column)
    assert gr.mask[0, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    # equal lengths: no padding, no mask (the causal kernel); a long prompt alone
    a, b = plan([4, 4, 100])
    assert a.at is None and a.mask is None and a.tokens.tolist() == list(range(8))
    assert b.at is None and b.tokens.tolist() == list(range(8, 108))


def test_width_segments_group_prompts_of_similar_width():
    # widths under 48 count as 48: 5 … 90 stay together (90 ≤ 2 · 48); 97 > 96 starts a segment based at 97,
    # which takes up to 194; 400 starts a third
    assert width_segments([5, 12, 40, 90, 97, 150, 194, 400]) == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert width_segments([13] * 5) == [[0, 1, 2, 3, 4]]
    assert width_segments([]) == []
    assert width_segments([10, 30], min_width=8, ratio=2.0) == [[0], [1]]  # 30 > 2 · 10
    with pytest.raises(ValueError, match=r"lengths\[1\] = 3 < 7"):
        width_segments([7, 3])


def test_similar_width_is_the_segment_rule_both_ways():
    assert similar_width(20, 96) and similar_width(96, 20)  # 96 ≤ 2 · 48
    assert not similar_width(20, 97) and not similar_width(97, 20)
    assert similar_width(300, 600) and not similar_width(300, 601)
