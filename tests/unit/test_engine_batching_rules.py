"""The engine's pure batching decisions (`infra.engine.batching`), on hand-made cases."""
from __future__ import annotations

import pytest

from infra.engine.batching import attention_buckets, prefill_group

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
