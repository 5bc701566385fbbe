"""The binary log-prob transport (`engine.wire`) against a real embedded server: the same request answered as
SGLang JSON and as packed arrays gives bit-identical tensors (scoring batches with several prompts and starts, top-k;
generation), JSON stays the default, the binary body is only sent to a client that asks, and a damaged binary body
is refused with a clear error."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from engine import wire
from engine.client import (EngineClient, EngineResponseError, _binary_items, parse_score, parse_score_arrays,
                           parse_score_batch)
from engine_proc import EngineProc, http

pytestmark = pytest.mark.integration

SEQS = [[1, 20, 21, 22, 23, 24], [1, 30, 31, 32], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 51]]
STARTS = [3, 1, 5, 3]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("engine") / "server.log").start()
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def score_payload(top_k: int) -> bytes:
    return orjson.dumps({"input_ids": SEQS, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                         "return_logprob": True, "logprob_start_len": [s - 1 for s in STARTS],
                         "top_logprobs_num": top_k, "token_ids_logprob": [2, 5, 50], "rid": "t"})


@pytest.mark.parametrize("top_k", [0, 5])
def test_score_json_and_binary_are_identical(server, top_k):
    c = EngineClient(server.url)
    by_json = c.run_sync(c.score(SEQS, STARTS, top_k=top_k, binary=False))
    by_bin = c.run_sync(c.score(SEQS, STARTS, top_k=top_k, binary=True))
    assert len(by_json) == len(by_bin) == len(SEQS)
    for a, b, s, st in zip(by_json, by_bin, SEQS, STARTS):
        assert a.token_logprobs.shape == (len(s) - st,) and a.topk_ids.shape == (len(s) - st, top_k)
        for x, y in ((a.token_logprobs, b.token_logprobs), (a.topk_ids, b.topk_ids), (a.topk_logprobs, b.topk_logprobs)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)  # float-exact, not approximately
        assert a.weight_version == b.weight_version == "w0"


def test_raw_bodies_carry_the_same_numbers_and_json_is_the_default(server):
    """Every array of the binary body equals the JSON lists of the same request (null ↔ NaN / -1), including
    token_ids_logprob; without the Accept header the server answers SGLang's JSON."""
    status, raw_json = http(server.url, "/generate", score_payload(4))
    assert status == 200
    objs = orjson.loads(raw_json)
    status, raw_bin = http(server.url, "/generate", score_payload(4), headers={"Accept": wire.ACCEPT})
    assert status == 200 and raw_bin.startswith(wire.MAGIC)
    single, items = wire.decode(raw_bin)
    assert single is False and len(items) == len(objs) == len(SEQS)
    for o, (obj, arr) in zip(objs, items):
        m = o["meta_info"]
        assert {k: v for k, v in m.items() if "logprob" not in k and k != "e2e_latency"} == \
               {k: v for k, v in obj["meta_info"].items() if k != "e2e_latency"}
        lp = np.array([np.nan if e[0] is None else e[0] for e in m["input_token_logprobs"]], np.float32)
        np.testing.assert_array_equal(arr["input_token_logprobs"], lp)
        assert arr["input_token_ids"].tolist() == [e[1] for e in m["input_token_logprobs"]]
        rows = m["input_top_logprobs"]
        assert rows[0] is None and np.isnan(arr["input_top_logprobs"][0]).all() and (arr["input_top_ids"][0] == -1).all()
        np.testing.assert_array_equal(arr["input_top_logprobs"][1:], np.array([[x[0] for x in r] for r in rows[1:]], np.float32).reshape(-1, 4))
        assert arr["input_top_ids"][1:].tolist() == [[x[1] for x in r] for r in rows[1:]]
        ids_rows = m["input_token_ids_logprobs"]
        np.testing.assert_array_equal(arr["input_token_ids_logprobs"][1:],
                                      np.array([[x[0] for x in r] for r in ids_rows[1:]], np.float32).reshape(-1, 3))
        assert arr["token_ids_logprob"].tolist() == [2, 5, 50]
        assert arr["output_token_logprobs"].shape == (0,) and arr["output_top_logprobs"].shape == (0, 4)


def test_generate_json_and_binary_are_identical(server):
    c = EngineClient(server.url)
    prompts = [[1, 20, 21, 22], [1, 30, 31]]
    kw = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True, n=2, sampling_seed=7)
    a = c.run_sync(c.generate(prompts, binary=False, **kw))
    b = c.run_sync(c.generate(prompts, binary=True, **kw))
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    assert [g.output_logprobs for g in a] == [g.output_logprobs for g in b]  # exact
    assert [(g.finish_reason, g.prompt_tokens, g.completion_tokens) for g in b] == [("length", len(p), 10)
                                                                                   for p in prompts for _ in range(2)]


def test_binary_only_when_asked_and_possible(server):
    one = orjson.dumps({"input_ids": [1, 20, 21], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                        "return_logprob": True, "top_logprobs_num": 2})
    status, raw = http(server.url, "/generate", one, headers={"Accept": wire.ACCEPT})
    single, items = wire.decode(raw)
    assert status == 200 and single is True and items[0][1]["output_top_ids"].shape == (3, 2)
    # q=0 refuses it; per-token text has no place in the arrays: both answer JSON
    status, raw = http(server.url, "/generate", one, headers={"Accept": f"{wire.CONTENT_TYPE};q=0"})
    assert status == 200 and isinstance(orjson.loads(raw), dict)
    with_text = orjson.loads(one) | {"return_text_in_logprobs": True}
    status, raw = http(server.url, "/generate", orjson.dumps(with_text), headers={"Accept": wire.ACCEPT})
    assert status == 200 and orjson.loads(raw)["meta_info"]["output_token_logprobs"][0][2] is not None
    # errors stay JSON whatever the client accepts
    status, raw = http(server.url, "/generate", b'{"input_ids": []}', headers={"Accept": wire.ACCEPT})
    assert status == 400 and "input_ids" in orjson.loads(raw)["error"]["message"]


def test_damaged_binary_body_is_refused(server):
    status, raw = http(server.url, "/generate", score_payload(3), headers={"Accept": wire.ACCEPT})
    assert status == 200 and len(_binary_items(raw, len(SEQS))) == len(SEQS)
    with pytest.raises(EngineResponseError, match=r"malformed binary /generate body: .*truncated body"):
        _binary_items(raw[:-5], len(SEQS))
    with pytest.raises(EngineResponseError, match="data section has .* bytes, its arrays describe"):
        _binary_items(raw + b"\0" * 4, len(SEQS))
    with pytest.raises(EngineResponseError, match="not b'ALLOYLP1'"):
        _binary_items(b"XXXXXXXX" + raw[8:], len(SEQS))
    with pytest.raises(EngineResponseError, match="header is not valid JSON"):
        _binary_items(raw[:12] + b"#" + raw[13:], len(SEQS))
    with pytest.raises(EngineResponseError, match="header length .* exceeds the body"):
        _binary_items(raw[:20], len(SEQS))
    with pytest.raises(EngineResponseError, match="returned 4 results for a batch of 3"):
        _binary_items(raw, 3)
    # a well-formed body with a NaN log-prob is refused by the same check and message as JSON
    _, items = wire.decode(raw)
    obj, arrays = items[0]
    arrays = {k: v.copy() for k, v in arrays.items()}
    arrays["input_token_logprobs"][-1] = np.nan
    with pytest.raises(EngineResponseError, match="entry for position 5 is .*not a finite log-prob"):
        parse_score_arrays(obj, arrays, SEQS[0], STARTS[0], 3)
    arrays["input_token_logprobs"][-1] = -1.0
    arrays["input_token_ids"][-1] = 99
    with pytest.raises(EngineResponseError, match="entry for position 5 is token 99, sent 24"):
        parse_score_arrays(obj, arrays, SEQS[0], STARTS[0], 3)
    arrays["input_token_ids"][-1] = 24
    with pytest.raises(EngineResponseError, match="has 3 items, want 4"):
        parse_score_arrays(obj, arrays, SEQS[0], STARTS[0], 4)
    # and the JSON of the same request parses (vectorised) to the same result
    status, raw_json = http(server.url, "/generate", score_payload(3))
    a = parse_score(orjson.loads(raw_json)[0], SEQS[0], STARTS[0], 3)
    b = parse_score_arrays(*items[0], SEQS[0], STARTS[0], 3)
    np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)


@pytest.mark.parametrize("top_k", [0, 3])
def test_score_batch_is_parse_score_arrays_of_each(server, top_k):
    """`parse_score_batch` (the client's binary path: checked batch-wise) gives every item's `parse_score_arrays`,
    bit for bit, and on a bad item raises that item's error."""
    payload = orjson.loads(score_payload(top_k))
    del payload["token_ids_logprob"]
    status, raw = http(server.url, "/generate", orjson.dumps(payload), headers={"Accept": wire.ACCEPT})
    assert status == 200
    items = _binary_items(raw, len(SEQS))
    each = [parse_score_arrays(o, a, s, st, top_k) for (o, a), s, st in zip(items, SEQS, STARTS)]
    batch = parse_score_batch(items, SEQS, STARTS, top_k)
    for a, b in zip(each, batch):
        for x, y in ((a.token_logprobs, b.token_logprobs), (a.topk_ids, b.topk_ids), (a.topk_logprobs, b.topk_logprobs)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
        assert a.weight_version == b.weight_version
    bad = [(o, {k: v.copy() for k, v in a.items()}) for o, a in items]
    bad[2][1]["input_token_ids"][-1] = 99
    with pytest.raises(EngineResponseError, match="entry for position 8 is token 99, sent 47"):
        parse_score_batch(bad, SEQS, STARTS, top_k)
    if top_k:
        bad[2][1]["input_token_ids"][-1] = 47
        bad[1][1]["input_top_logprobs"][-1, 0] = np.inf
        with pytest.raises(EngineResponseError, match=r"input_top_logprobs\[3\]\[0\] = \[inf"):
            parse_score_batch(bad, SEQS, STARTS, top_k)


def test_decode_reads_arrays_off_the_element_grid():
    """A body whose array sits at an offset that is no multiple of its element size still decodes (its own view);
    a bad descriptor is refused."""
    def body(arrays: dict, data: bytes) -> bytes:
        header = orjson.dumps({"single": True, "items": [{"obj": {}, "arrays": arrays}]})
        pad = -(len(wire.MAGIC) + 4 + len(header)) % 8
        return wire._HEAD.pack(wire.MAGIC, len(header)) + header + b"\0" * pad + data

    data = b"\0\0" + np.array([7, 9], "<i4").tobytes() + np.array([-0.5], "<f4").tobytes()
    single, items = wire.decode(body({"output_token_ids": ["<i4", [2], 2], "output_token_logprobs": ["<f4", [1], 10]},
                                     data))
    assert single is True and items[0][1]["output_token_ids"].tolist() == [7, 9]
    assert items[0][1]["output_token_logprobs"].tolist() == [-0.5]
    for bad in (["<i4", [2], -2], ["<i8", [2], 2], ["<i4", [2, 1, 1], 2], ["<i4", [True], 2], ["<i4", [2]]):
        with pytest.raises(wire.WireError, match="descriptor .* is not"):
            wire.decode(body({"output_token_ids": bad, "output_token_logprobs": ["<f4", [1], 10]}, data))


def test_build_binary_packs_every_array_of_the_answer():
    """`wire.build_binary` (one conversion per dtype for the whole answer) writes the numbers of `build_output`'s
    JSON: null rows → NaN / -1, top-k and token-id rows, the float32 arrays first, then the int32 ones."""
    from engine.protocol import SamplingSpec, SeqResult, SeqSpec, TokenText, build_output

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    spec = SeqSpec(rid="a", input_ids=(1, 20, 21), sampling=SamplingSpec(max_new_tokens=2), return_logprob=True,
                   logprob_start=1, top_logprobs_num=2, token_ids_logprob=(2, 5, 7))
    res = SeqResult(output_ids=[3, 4], out_logprobs=[-0.5, -1.5], out_top=[([-0.1, -0.2], [3, 9]), ([-0.3, -0.4], [4, 1])],
                    out_ids_logprobs=[[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], in_logprobs=[None, -0.25],
                    in_top=[None, ([-0.5, -0.6], [1, 2])], in_ids_logprobs=[None, [-7.0, -8.0, -9.0]],
                    finish_reason={"type": "length", "length": 2})
    plain = SeqSpec(rid="b", input_ids=(1, 2), sampling=SamplingSpec(max_new_tokens=1))
    plain_res = SeqResult(output_ids=[6], finish_reason={"type": "length", "length": 1})
    raw = wire.build_binary(Tok(), [(spec, res, 0.5), (plain, plain_res, None)], "w3", TokenText(Tok()), False)
    single, items = wire.decode(raw)
    assert single is False and items[1][1] == {}
    js = [build_output(Tok(), s, r, "w3", t, TokenText(Tok())) for s, r, t in ((spec, res, 0.5), (plain, plain_res, None))]
    assert items[0][0] == {**js[0], "meta_info": {k: v for k, v in js[0]["meta_info"].items() if "logprob" not in k}}
    assert items[1][0] == js[1]
    a, m = items[0][1], js[0]["meta_info"]
    nan = float("nan")
    np.testing.assert_array_equal(a["input_token_logprobs"], np.array([nan, -0.25], np.float32))
    assert a["input_token_ids"].tolist() == [20, 21] == [e[1] for e in m["input_token_logprobs"]]
    assert a["output_token_logprobs"].tolist() == [-0.5, -1.5] and a["output_token_ids"].tolist() == [3, 4]
    np.testing.assert_array_equal(a["input_top_logprobs"], np.array([[nan, nan], [-0.5, -0.6]], np.float32))
    assert a["input_top_ids"].tolist() == [[-1, -1], [1, 2]] and a["output_top_ids"].tolist() == [[3, 9], [4, 1]]
    np.testing.assert_array_equal(a["output_top_logprobs"], np.array([[-0.1, -0.2], [-0.3, -0.4]], np.float32))
    assert a["token_ids_logprob"].tolist() == [2, 5, 7]
    np.testing.assert_array_equal(a["input_token_ids_logprobs"], np.array([[nan] * 3, [-7, -8, -9]], np.float32))
    assert a["output_token_ids_logprobs"].tolist() == [[-1, -2, -3], [-4, -5, -6]]
    head = orjson.loads(raw[12:12 + wire._HEAD.unpack_from(raw)[1]])
    offsets = {d[0]: [] for d in head["items"][0]["arrays"].values()}
    for d in head["items"][0]["arrays"].values():
        offsets[d[0]].append(d[2])
    assert max(offsets["<f4"]) < min(offsets["<i4"])
    bad = SeqResult(output_ids=[3], out_logprobs=[-0.5], out_top=[([-0.1], [3])], in_logprobs=[None, -0.25],
                    in_top=[None, ([-0.5, -0.6], [1, 2])], finish_reason={"type": "length", "length": 1})
    with pytest.raises(ValueError, match="a row of 1 values, want 2"):
        wire.build_binary(Tok(), [(SeqSpec(rid="c", input_ids=(1, 20, 21), sampling=SamplingSpec(max_new_tokens=1),
                                           return_logprob=True, logprob_start=1, top_logprobs_num=2), bad, None)],
                          "w3", TokenText(Tok()), True)
