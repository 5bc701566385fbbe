"""Engine client: response parsing and alignment on hand-written SGLang-protocol JSON, and the backoff schedule."""
import asyncio
import math
import random

import numpy as np
import pytest

from engine.client import (
    EngineClient,
    EngineUnavailable,
    EngineResponseError,
    backoff_delays,
    expand_rids,
    parse_finish_reason,
    parse_generation,
    parse_score,
    run_sync,
)

pytestmark = pytest.mark.unit

# prompt = [1, 10, 11], response = [12, 13]; start = 3, so the client sends logprob_start_len = 2 and the server
# returns entries for tokens 2..4: [ids[2] (entry 0), ids[3], ids[4]].
IDS = [1, 10, 11, 12, 13]
START = 3


def score_obj(entry0, tops0=None, top=None, prompt_tokens=5):
    meta = {
        "id": "r0", "prompt_tokens": prompt_tokens, "completion_tokens": 0, "weight_version": "v3",
        "finish_reason": {"type": "length", "length": 0},
        "input_token_logprobs": [entry0, [-0.5, 12, None], [-1.25, 13, None]],
        "output_token_logprobs": [],
    }
    if top is not None:
        meta["input_top_logprobs"] = [tops0] + top
    return {"text": "", "output_ids": [], "meta_info": meta}


def test_score_entry0_null_current_sglang():
    res = parse_score(score_obj([None, 11, None]), IDS, START, top_k=0)
    assert res.token_logprobs.dtype == np.float32 and res.token_logprobs.tolist() == [-0.5, -1.25]
    assert res.topk_ids.shape == (2, 0) and res.topk_logprobs.shape == (2, 0)
    assert res.weight_version == "v3"


def test_score_entry0_filled_older_sglang_gives_same_tail():
    old = parse_score(score_obj([-3.0, 11, None]), IDS, START, top_k=0)
    new = parse_score(score_obj([None, 11, None]), IDS, START, top_k=0)
    np.testing.assert_array_equal(old.token_logprobs, new.token_logprobs)


def test_score_older_convention_without_the_extra_entry():
    """A server that returns exactly L entries (no leading entry) is also aligned by taking the tail."""
    obj = score_obj([None, 11, None])
    obj["meta_info"]["input_token_logprobs"] = obj["meta_info"]["input_token_logprobs"][1:]
    assert parse_score(obj, IDS, START, 0).token_logprobs.tolist() == [-0.5, -1.25]


def test_score_topk_aligned_and_typed():
    top = [
        [[-0.5, 12, None], [-1.0, 40, None]],
        [[-0.25, 7, None], [-1.25, 13, None]],
    ]
    res = parse_score(score_obj([None, 11, None], tops0=None, top=top), IDS, START, top_k=2)
    assert res.topk_ids.dtype == np.int64 and res.topk_logprobs.dtype == np.float32
    assert res.topk_ids.tolist() == [[12, 40], [7, 13]]
    assert res.topk_logprobs.tolist() == [[-0.5, -1.0], [-0.25, -1.25]]


def test_score_start_at_end_is_empty():
    obj = score_obj([None, 13, None])
    obj["meta_info"]["input_token_logprobs"] = [[None, 13, None]]
    res = parse_score(obj, IDS, len(IDS), top_k=3)
    assert res.token_logprobs.shape == (0,) and res.topk_ids.shape == (0, 3)


@pytest.mark.parametrize("bad, msg", [
    ([float("nan"), 12, None], "not a finite log-prob"),
    ([float("inf"), 12, None], "not a finite log-prob"),
    ([None, 12, None], "not a finite log-prob"),
    ([-0.5, 99, None], "is token 99, sent 12"),
])
def test_score_bad_entry_raises(bad, msg):
    obj = score_obj([None, 11, None])
    obj["meta_info"]["input_token_logprobs"][1] = bad
    with pytest.raises(EngineResponseError, match=msg):
        parse_score(obj, IDS, START, 0)


def test_score_too_few_entries_or_wrong_prompt_count_raises():
    obj = score_obj([None, 11, None])
    obj["meta_info"]["input_token_logprobs"] = [[-1.25, 13, None]]
    with pytest.raises(EngineResponseError, match="need at least 2"):
        parse_score(obj, IDS, START, 0)
    with pytest.raises(EngineResponseError, match="4 prompt tokens, we sent 5"):
        parse_score(score_obj([None, 11, None], prompt_tokens=4), IDS, START, 0)


def test_score_topk_wrong_width_or_nan_raises():
    top = [[[-0.5, 12, None]], [[-0.25, 7, None], [-1.25, 13, None]]]
    with pytest.raises(EngineResponseError, match="has 1 items, want 2"):
        parse_score(score_obj([None, 11, None], top=top), IDS, START, top_k=2)
    top = [[[-0.5, 12, None], [math.nan, 40, None]], [[-0.25, 7, None], [-1.25, 13, None]]]
    with pytest.raises(EngineResponseError, match=r"input_top_logprobs\[3\]\[1\]"):
        parse_score(score_obj([None, 11, None], top=top), IDS, START, top_k=2)


def test_generation_parsed_and_validated():
    obj = {"text": None, "output_ids": [5, 6, 2], "meta_info": {
        "id": "abc", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4, "completion_tokens": 3,
        "weight_version": "7", "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 2, None]]}}
    g = parse_generation(obj, "abc")
    assert (g.output_ids, g.output_logprobs, g.finish_reason) == ([5, 6, 2], [-0.1, -0.2, -0.3], "stop")
    assert (g.prompt_tokens, g.completion_tokens, g.weight_version, g.rid) == (4, 3, "7", "abc")
    obj["meta_info"]["output_token_logprobs"][1] = [float("-inf"), 6, None]
    with pytest.raises(EngineResponseError, match=r"output_token_logprobs\[1\]"):
        parse_generation(obj)
    obj["meta_info"]["output_token_logprobs"] = obj["meta_info"]["output_token_logprobs"][:2]
    with pytest.raises(EngineResponseError, match="2 entries for 3 output tokens"):
        parse_generation(obj)
    assert parse_generation(obj, want_logprobs=False).output_logprobs == []


def test_finish_reasons():
    assert parse_finish_reason({"type": "length", "length": 8}) == "length"
    assert parse_finish_reason({"type": "abort", "message": "x"}) == "abort"
    assert parse_finish_reason("stop") == "stop"
    with pytest.raises(EngineResponseError):
        parse_finish_reason(None)


def test_backoff_schedule_bounded_and_exponential():
    d = backoff_delays(8, base=0.2, max_delay=1.0, rng=random.Random(0))
    caps = [0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert len(d) == 8
    for x, cap in zip(d, caps):
        assert 0.5 * cap <= x <= cap
    assert sum(d) <= sum(caps)
    assert backoff_delays(0, 0.2, 1.0) == []


def test_expand_rids_prompt_major():
    assert expand_rids(None, 2, 2) == [None] * 4
    assert expand_rids("r", 1, 1) == ["r"]
    assert expand_rids("r", 2, 1) == ["r-0", "r-1"]
    assert expand_rids("r", 2, 2) == ["r-0-0", "r-0-1", "r-1-0", "r-1-1"]
    assert expand_rids(["a", "b"], 2, 2) == ["a-0", "a-1", "b-0", "b-1"]
    with pytest.raises(ValueError, match="2 unique non-empty strings"):
        expand_rids(["a", "a"], 2, 1)


def test_refused_connection_retries_then_unavailable():
    """Nothing listens on a fresh port: 2 retries with tiny backoff, then EngineUnavailable; counters say so."""
    from engine.launcher import free_port

    c = EngineClient(f"http://127.0.0.1:{free_port()}", api_key="k", max_retries=2, backoff_base=0.01, backoff_max=0.02)
    with pytest.raises(EngineUnavailable, match="after 3 attempts"):
        c.run_sync(c.model_info())
    assert c.counters == {"requests": 1, "retries": 2, "errors": 1}
    assert c.run_sync(c.health()) is False


def test_one_session_per_loop_and_run_sync_inside_a_loop():
    c = EngineClient("http://127.0.0.1:9")

    async def sessions():
        return c._session(), c._session()

    a1, a2 = c.run_sync(sessions())
    b1, _ = c.run_sync(sessions())
    assert a1 is a2 and a1 is not b1 and a1.closed and b1.closed  # run_sync closes its loop's session

    async def inside_a_loop():  # a sync helper called from async code must not trip over the running loop
        return run_sync(asyncio.sleep(0, result=5))

    assert asyncio.run(inside_a_loop()) == 5


def _random_score_obj(rng, n_tokens: int, start: int, k: int, entry0=None):
    ids = [int(x) for x in rng.integers(0, 100, n_tokens)]
    tail = [[float(rng.normal()) - 3.0, ids[p], None] for p in range(start, n_tokens)]
    tops = [[[float(v), int(t), None] for v, t in zip(np.sort(rng.normal(size=k))[::-1] - 2.0,
                                                         rng.choice(100, k, replace=False))] for _ in tail]
    meta = {"prompt_tokens": n_tokens, "weight_version": "v", "input_token_logprobs": [[entry0, ids[start - 1], None]] + tail,
            "input_top_logprobs": [None] + tops}
    return {"meta_info": meta}, ids


@pytest.mark.parametrize("k", [0, 1, 7])
def test_vectorised_json_parse_equals_the_item_parser(k):
    """`parse_score` (orjson lists → one numpy conversion) gives the very arrays of `parse_score_items`."""
    from engine.client import parse_score_items

    rng = np.random.default_rng(k)
    for n, start in ((12, 4), (5, 1), (30, 29)):
        obj, ids = _random_score_obj(rng, n, start, k)
        a, b = parse_score(obj, ids, start, k), parse_score_items(obj, ids, start, k)
        for x, y in ((a.token_logprobs, b.token_logprobs), (a.topk_ids, b.topk_ids), (a.topk_logprobs, b.topk_logprobs)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def _corrupt(obj, how):
    m = obj["meta_info"]
    if how == "nan_token":
        m["input_token_logprobs"][3][0] = math.nan
    elif how == "null_token":
        m["input_token_logprobs"][2] = [None, m["input_token_logprobs"][2][1], None]
    elif how == "wrong_id":
        m["input_token_logprobs"][4][1] = 7777
    elif how == "null_id_top":
        m["input_top_logprobs"][2][1][1] = None
    elif how == "inf_top":
        m["input_top_logprobs"][5][0][0] = -math.inf
    elif how == "float_id_top":
        m["input_top_logprobs"][1][2][1] = 3.5
    elif how == "ragged_top":
        m["input_top_logprobs"][3] = m["input_top_logprobs"][3][:-1]
    elif how == "short_item":
        m["input_token_logprobs"][2] = [-1.0]
    elif how == "null_row":
        m["input_top_logprobs"][4] = None
    elif how == "too_few":
        m["input_token_logprobs"] = m["input_token_logprobs"][:3]
    elif how == "no_top":
        del m["input_top_logprobs"]
    elif how == "string_item":
        m["input_token_logprobs"][2] = "x"
    return obj


@pytest.mark.parametrize("how", ["nan_token", "null_token", "wrong_id", "null_id_top", "inf_top", "float_id_top",
                                 "ragged_top", "short_item", "null_row", "too_few", "no_top", "string_item"])
def test_vectorised_json_parse_refuses_with_the_item_parsers_message(how):
    from engine.client import parse_score_items

    obj, ids = _random_score_obj(np.random.default_rng(1), 12, 4, 3)
    obj = _corrupt(obj, how)
    with pytest.raises(EngineResponseError) as old:
        parse_score_items(obj, ids, 4, 3)
    with pytest.raises(EngineResponseError) as new:
        parse_score(obj, ids, 4, 3)
    assert str(new.value) == str(old.value)
