"""The engine's running batch (`engine.running`): which segment new rows join, the segment cap, holes and
compaction, on small real KV caches whose real columns carry each row's own numbers (so every copy is checked)."""
from __future__ import annotations

import pytest
import torch

from engine.kv_cache import BatchKVCache
from engine.running import RunningBatch, Segment

pytestmark = pytest.mark.unit


def _segment(rows: dict[str, int]) -> Segment:
    """Rows named by their key, each with that many real tokens, left-padded; a real column c of row r holds
    float(1000 · id + c) where id is the row's trailing number, so a row's tokens can be read back anywhere."""
    names, lens = list(rows), list(rows.values())
    t = max(lens)
    k = torch.zeros((len(names), 1, t + 4, 2))
    mask = torch.zeros((len(names), t), dtype=torch.long)
    for i, (name, n) in enumerate(rows.items()):
        k[i, 0, t - n:t] = (1000 * int(name[1:]) + torch.arange(n, dtype=torch.float32))[:, None]
        mask[i, t - n:] = 1
    cache = BatchKVCache(1)
    cache.layers[0].set_buffers(k, k.clone(), t)
    pos = torch.tensor(lens, dtype=torch.long)
    return Segment(names, cache, mask, pos, pos.clone())


def _tokens(seg: Segment, name: str) -> list[float]:
    """The real key values of row `name` in its segment, in column order."""
    i = seg.seqs.index(name)
    real = seg.full_mask()[i]
    return seg.cache.layers[0].keys[i, 0, real, 0].tolist()


def _own(name: str, n: int) -> list[float]:
    return [1000.0 * int(name[1:]) + c for c in range(n)]


def test_new_rows_join_the_segment_of_their_width_or_start_one():
    b = RunningBatch(max_segments=4)
    b.add(_segment({"r1": 5, "r2": 12}))
    b.add(_segment({"r3": 300}))  # 300 > 2 · 48: its own segment, and short rows never carry its width
    assert [s.width for s in b.segs] == [12, 300] and len(b) == 3
    b.add(_segment({"r4": 40, "r5": 7}))  # joins the short segment (40 ≤ 2 · 48), one copy of it
    assert [s.width for s in b.segs] == [40, 300]
    assert b.seqs == ["r1", "r5", "r2", "r4", "r3"]  # sorted by padding, descending: shortest first
    for name, n in [("r1", 5), ("r2", 12), ("r3", 300), ("r4", 40), ("r5", 7)]:
        seg = next(s for s in b.segs if name in s.seqs)
        assert _tokens(seg, name) == _own(name, n)
    last, pos = b.inputs()  # every row's next input, in the batch's order
    assert pos.tolist() == [5, 7, 12, 40, 300] and last.tolist() == pos.tolist()
    assert [(a, e) for a, e, _ in b.spans()] == [(0, 4), (4, 5)]


def test_over_the_cap_the_closest_widths_merge():
    b = RunningBatch(max_segments=2)
    b.add(_segment({"r1": 10}))
    b.add(_segment({"r2": 200}))
    b.add(_segment({"r3": 1000}))
    # merging 10 into 200 pads 1 row by 190 columns, 200 into 1000 pads 1 row by 800: the first
    assert [s.width for s in b.segs] == [200, 1000]
    assert b.segs[0].seqs == ["r1", "r2"]
    assert _tokens(b.segs[0], "r1") == _own("r1", 10) and _tokens(b.segs[0], "r2") == _own("r2", 200)
    assert b.segs[0].lead == [190, 0]
    one = RunningBatch(max_segments=1)  # the HF forward's single cache: everything joins
    one.add(_segment({"r1": 10}))
    one.add(_segment({"r2": 500}))
    assert len(one.segs) == 1 and one.segs[0].seqs == ["r1", "r2"]
    with pytest.raises(ValueError, match="max_segments must be ≥ 1"):
        RunningBatch(max_segments=0)


def test_holes_stay_until_a_quarter_then_the_segment_compacts_alone():
    b = RunningBatch()
    b.add(_segment({f"r{i}": 10 + i for i in range(1, 9)}))  # 8 short rows
    b.add(_segment({"r9": 400}))
    b.changed = False
    short, long_ = b.segs
    b.drop({0})  # one hole in 8 rows: decoded along, no copy
    assert short.holes == {0} and len(short) == 8 and not b.changed
    assert b.holes == {0} and b.live == 8
    b.drop({1})  # two of 8 = a quarter: this segment compacts, the long one is not touched
    assert not short.holes and len(short) == 6 and b.changed
    assert short.seqs == [f"r{i}" for i in range(3, 9)] and short.width == 18
    assert all(_tokens(short, f"r{i}") == _own(f"r{i}", 10 + i) for i in range(3, 9))
    assert b.segs[1] is long_ and _tokens(long_, "r9") == _own("r9", 400)
    b.drop({6})  # the long segment's only row: the segment leaves
    assert b.segs == [short] and b.seqs == short.seqs
