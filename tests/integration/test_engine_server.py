"""The embedded SGLang-protocol server as a real subprocess on loopback, spoken to with plain urllib (no EngineClient):
response shapes, scoring alignment against an in-process forward, sampling controls, control endpoints (abort,
weight update, flush, health), auth, and 4xx errors for malformed requests."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from engine_proc import REFERENCE_NUMERICS, TINY_LP_TOL, EngineProc, forward_logprobs, http, json_body
from engine.launcher import log_tail

pytestmark = pytest.mark.integration

KEY = "test-key-123"
VOCAB = 100  # infra.tokenizer: char-level, 100 ids, eos = 2


def Server(model_dir: Path, log_path: Path, *extra: str) -> EngineProc:
    """`python -m engine.server` on a free loopback port (started; call wait_healthy)."""
    return EngineProc(model_dir, log_path, "--max-body-mb", "0.5", *extra).start()


def call(base: str, path: str, body=None, *, method: str = "POST", raw: bytes | None = None,
         headers: dict | None = None, timeout: float = 60.0):
    """One HTTP request → (status, parsed JSON body or raw text or None)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    status, payload = http(base, path, data, method=method, headers=headers, timeout=timeout)
    return status, json_body(payload)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    buffers = tmp_path_factory.mktemp("weight-buffers")  # where /update_weights_from_buffer may read
    srv = Server(tiny_model_dir, tmp_path_factory.mktemp("engine-server") / "server.log", "--weight-buffer-dir",
                 str(buffers))
    srv.buffer_dir = buffers
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def gen(server, body, expect: int = 200):
    status, out = call(server.url, "/generate", body)
    assert status == expect, out
    return out


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(forward_logprobs(model, ids)[-1].argmax()))
    return ids[len(prompt):]


# -- generation ------------------------------------------------------------------------------------------------------
def test_single_input_ids_response_shape_and_greedy_matches_forward(server, model):
    prompt = [1, 40, 41, 42, 43]
    out = gen(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                               "ignore_eos": True},
                       "return_logprob": True, "top_logprobs_num": 3, "rid": "shape-1"})
    assert set(out) == {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "e2e_latency"):
        assert key in m, key
    assert m["id"] == "shape-1" and m["weight_version"] == "w0"
    assert m["finish_reason"] == {"type": "length", "length": 8}
    assert m["prompt_tokens"] == 5 and m["completion_tokens"] == 8 == len(out["output_ids"])
    if REFERENCE_NUMERICS:  # CPU float32 only: another dtype/device may break near-ties differently
        assert out["output_ids"] == greedy_reference(model, prompt, 8)
    # logprob_start_len = -1 on a generation: one input entry, the last prompt token, with a null log-prob
    assert m["input_token_logprobs"] == [[None, 43, None]] and m["input_top_logprobs"] == [None]
    lp = forward_logprobs(model, prompt + out["output_ids"])
    for t, (triple, top) in enumerate(zip(m["output_token_logprobs"], m["output_top_logprobs"])):
        tok = out["output_ids"][t]
        assert triple[1:] == [tok, None]
        assert abs(triple[0] - lp[len(prompt) - 1 + t, tok].item()) < TINY_LP_TOL
        vals = [e[0] for e in top]
        assert len(top) == 3 and vals == sorted(vals, reverse=True) and all(e[2] is None for e in top)
        assert top[0][1] == tok  # greedy: the chosen token is the top-1
    from infra.models import load_tokenizer

    assert out["text"] == load_tokenizer(server_model_dir(server)).decode(out["output_ids"], skip_special_tokens=True)


def server_model_dir(server) -> str:
    return call(server.url, "/get_model_info", method="GET")[1]["model_path"]


def test_text_and_batches_keep_order(server, model):
    from infra.models import load_tokenizer

    tok = load_tokenizer(server_model_dir(server))
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    texts = ["hello", "a much longer prompt here", "xy"]
    single = gen(server, {"text": texts[0], "sampling_params": sp})
    assert isinstance(single, dict) and single["meta_info"]["prompt_tokens"] == len(tok(texts[0]).input_ids)
    batch = gen(server, {"text": texts, "sampling_params": sp})
    assert isinstance(batch, list) and len(batch) == 3
    assert batch[0]["output_ids"] == single["output_ids"]
    for t, o in zip(texts, batch):  # padded batch decoding equals each prompt alone (order preserved)
        ids = tok(t).input_ids
        assert o["meta_info"]["prompt_tokens"] == len(ids)
        if REFERENCE_NUMERICS:
            assert o["output_ids"] == greedy_reference(model, ids, 6)
    by_ids = gen(server, {"input_ids": [tok(t).input_ids for t in texts], "sampling_params": sp, "rid": ["a", "b", "c"]})
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in batch]
    assert [o["meta_info"]["id"] for o in by_ids] == ["a", "b", "c"]
    # per-item sampling params
    per = gen(server, {"input_ids": [[1, 5, 6], [1, 7]], "sampling_params": [
        {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}]})
    assert [o["meta_info"]["completion_tokens"] for o in per] == [2, 5]


def test_greedy_equals_tiny_temperature_and_top_k_top_p(server):
    prompt = [1, 60, 61, 62]
    base = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    greedy = gen(server, base)["output_ids"]
    for sp in ({"temperature": 1e-7}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-9}):
        out = gen(server, {**base, "sampling_params": {**base["sampling_params"], **sp}})
        assert out["output_ids"] == greedy, sp
    # top_k = 4 at T = 1: every sampled token is among the 4 best (reported log-probs at T=1 keep the order)
    out = gen(server, {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 4,
                       "sampling_params": {"max_new_tokens": 30, "temperature": 1.0, "top_k": 4, "ignore_eos": True,
                                           "sampling_seed": 3}})
    for tok, top in zip(out["output_ids"], out["meta_info"]["output_top_logprobs"]):
        assert tok in [e[1] for e in top]
    # a seeded sample is reproducible
    again = gen(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 30, "temperature": 1.0,
                                                                  "top_k": 4, "ignore_eos": True, "sampling_seed": 3}})
    assert again["output_ids"] == out["output_ids"]


def test_n_samples(server):
    outs = gen(server, {"input_ids": [1, 9, 10], "rid": "nn",
                        "sampling_params": {"n": 3, "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}})
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["nn_0", "nn_1", "nn_2"]
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # 3 samples of 12 tokens over ~100 ids never all agree
    greedy = gen(server, {"input_ids": [[1, 9], [1, 11]],
                          "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}})
    assert len(greedy) == 4  # prompt-major: both samples of prompt 0, then prompt 1
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"] and greedy[2]["output_ids"] == greedy[3]["output_ids"]


def test_stop_token_ids_and_ignore_eos(server):
    prompt = [1, 40, 41]
    sp = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    greedy = gen(server, {"input_ids": prompt, "sampling_params": sp})["output_ids"]
    stop = greedy[3]
    first = greedy.index(stop)
    out = gen(server, {"input_ids": prompt, "sampling_params": {**sp, "ignore_eos": False, "stop_token_ids": [stop]}})
    assert out["output_ids"] == greedy[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # ignore_eos also ignores stop_token_ids (SGLang Req.check_finished): runs to the length limit
    out = gen(server, {"input_ids": prompt, "sampling_params": {**sp, "stop_token_ids": [stop]}})
    assert out["output_ids"] == greedy and out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


# -- scoring ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("starts", [[0, 0], [3, 2], [7, 4]])  # s = 0, s > 0, s = len - 1
def test_scoring_matches_forward(server, model, starts):
    seqs = [[1, 20, 21, 22, 23, 24, 25, 26], [1, 50, 51, 52, 53]]
    starts = [min(s, len(x) - 1) for s, x in zip(starts, seqs)]
    k = 4
    outs = gen(server, {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                        "logprob_start_len": starts, "top_logprobs_num": k, "token_ids_logprob": [2, 5, 50]})
    assert len(outs) == 2
    for ids, s, o in zip(seqs, starts, outs):
        m = o["meta_info"]
        assert o["output_ids"] == [] and m["completion_tokens"] == 0
        assert m["finish_reason"] == {"type": "length", "length": 0}
        itl, itop, iids = m["input_token_logprobs"], m["input_top_logprobs"], m["input_token_ids_logprobs"]
        assert len(itl) == len(ids) - s == len(itop) == len(iids)
        assert itl[0] == [None, ids[s], None] and itop[0] is None and iids[0] is None
        lp = forward_logprobs(model, ids)
        for j in range(1, len(ids) - s):
            row = lp[s + j - 1]
            assert itl[j][1:] == [ids[s + j], None]
            assert abs(itl[j][0] - row[ids[s + j]].item()) < TINY_LP_TOL
            vals = [e[0] for e in itop[j]]
            assert len(vals) == k and vals == sorted(vals, reverse=True)
            ref = torch.topk(row, k).values
            assert torch.allclose(torch.tensor(vals), ref, atol=TINY_LP_TOL)
            assert [e[1] for e in iids[j]] == [2, 5, 50]
            assert max(abs(e[0] - row[e[1]].item()) for e in iids[j]) < TINY_LP_TOL


def test_scoring_start_out_of_range_is_400(server):
    for s in (4, 9):
        status, body = call(server.url, "/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 0},
                                                      "return_logprob": True, "logprob_start_len": s})
        assert status == 400 and "logprob_start_len" in body["error"]["message"]


# -- control endpoints -----------------------------------------------------------------------------------------------
def test_health_and_model_info(server, tiny_model_dir):
    assert call(server.url, "/health", method="GET")[0] == 200
    assert call(server.url, "/health_generate", method="GET")[0] == 200
    status, info = call(server.url, "/get_model_info", method="GET")
    assert status == 200 and info["is_generation"] is True and info["weight_version"] in ("w0", "w7")
    assert info["tokenizer_path"] == str(tiny_model_dir)
    status, text = call(server.url, "/flush_cache", {})
    assert status == 200 and "Cache flushed" in text


def test_abort_returns_partial_output(server):
    result = {}

    def long_request():
        # a batch of 16 rows × 240 tokens: seconds of decoding, far longer than the abort below takes
        result["out"] = call(server.url, "/generate", {
            "input_ids": [[1, 30 + i, 31] for i in range(16)], "rid": "long",
            "sampling_params": {"max_new_tokens": 240, "temperature": 1.0, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t0 = time.monotonic()
    t.start()
    steps0 = call(server.url, "/get_server_info", method="GET")[1]["decode_steps"]
    while call(server.url, "/get_server_info", method="GET")[1]["decode_steps"] < steps0 + 3:
        assert time.monotonic() - t0 < 20
        time.sleep(0.01)
    assert call(server.url, "/abort_request", {"rid": "long"})[0] == 200
    t.join(30)
    status, outs = result["out"]
    assert status == 200 and len(outs) == 16
    for o in outs:
        fr = o["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and isinstance(fr["message"], str)
        assert 0 < len(o["output_ids"]) < 240 and o["meta_info"]["completion_tokens"] == len(o["output_ids"])
    # the server is still serving afterwards
    assert gen(server, {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}})["meta_info"]["completion_tokens"] >= 1


def test_update_weights_from_disk(server, tiny_model_dir, tmp_path):
    from infra.models import init_model_dir

    # Randomly initialised tiny models greedily repeat the last token (tied embeddings) whatever the seed, so the
    # weight change shows in a seeded sample (same uniforms, different distributions) and in the log-probs.
    body = {"input_ids": [1, 40, 41, 42], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}}
    before = gen(server, body)
    other = init_model_dir("tiny", tmp_path / "seed7", seed=7)
    try:
        status, res = call(server.url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "w7"})
        assert status == 200 and res["success"] is True, res
        after = gen(server, body)
        assert after["meta_info"]["weight_version"] == "w7"
        assert after["output_ids"] != before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"][0][0] != before["meta_info"]["output_token_logprobs"][0][0]
        info = call(server.url, "/get_model_info", method="GET")[1]
        assert info["weight_version"] == "w7" and info["model_path"] == str(other)
        status, res = call(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert status == 400 and res["success"] is False
    finally:
        status, res = call(server.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                     "weight_version": "w0"})
        assert status == 200 and res["success"] is True
    assert gen(server, body)["output_ids"] == before["output_ids"]


def test_update_weights_from_buffer_equals_disk(server, tiny_model_dir, model, tmp_path):
    from engine.weight_buffer import encode_buffer, write_buffer
    from infra.models import init_model_dir, load_model

    body = {"input_ids": [1, 40, 41, 42], "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}}
    greedy = {"input_ids": [1, 30, 31], "return_logprob": True, "logprob_start_len": 0,
              "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}

    def outputs():
        a, b = gen(server, body), gen(server, greedy)
        return (a["output_ids"], a["meta_info"]["output_token_logprobs"], a["meta_info"]["output_top_logprobs"],
                b["output_ids"], b["meta_info"]["input_token_logprobs"]), a["meta_info"]["weight_version"]

    before, _ = outputs()
    other_dir = init_model_dir("tiny", tmp_path / "seed7", seed=7)
    other = load_model(other_dir).state_dict()
    try:
        assert call(server.url, "/update_weights_from_disk", {"model_path": str(other_dir), "weight_version": "d7"})[0] == 200
        from_disk, _ = outputs()
        assert call(server.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})[0] == 200
        assert outputs()[0] == before
        # a buffer file (the tied LM head left out: the embeddings cover it), its version from the request
        bdir = server.buffer_dir
        buf = bdir / "w.buf"
        write_buffer(buf, {k: v for k, v in other.items() if k != "lm_head.weight"}, 99)
        status, res = call(server.url, "/update_weights_from_buffer", {"path": str(buf), "weight_version": "b7"})
        assert status == 200 and res["success"] is True and "in place" in res["message"], res
        from_buffer, version = outputs()
        assert from_buffer == from_disk and from_buffer != before and version == "b7"
        assert call(server.url, "/get_model_info", method="GET")[1]["weight_version"] == "b7"
        # refused sets leave the weights alone: partial, corrupt, missing
        write_buffer(bdir / "part.buf", {k: v for k, v in model.state_dict().items() if "layers.1." not in k}, 3)
        for path, why in ((bdir / "part.buf", "partial set"), (bdir / "missing.buf", "FileNotFoundError")):
            status, res = call(server.url, "/update_weights_from_buffer", {"path": str(path)})
            assert status == 400 and res["success"] is False and why in res["message"], res
        (bdir / "cut.buf").write_bytes(buf.read_bytes()[:-64])
        status, res = call(server.url, "/update_weights_from_buffer", {"path": str(bdir / "cut.buf")})
        assert status == 400 and "truncated" in res["message"] and str(bdir / "cut.buf") in res["message"], res
        # outside --weight-buffer-dir: refused before anything is opened (tests/integration/test_engine_hardening.py)
        write_buffer(tmp_path / "elsewhere.buf", other, 5)
        status, res = call(server.url, "/update_weights_from_buffer", {"path": str(tmp_path / "elsewhere.buf")})
        assert status == 400 and "--weight-buffer-dir" in res["error"]["message"], res
        assert outputs() == (from_disk, "b7")
        # the buffer as the body (a server on another machine), under a limit sized to the model; its own version
        raw = encode_buffer(model.state_dict(), "w0")
        status, res = call(server.url, "/update_weights_from_buffer", raw=raw,
                           headers={"Content-Type": "application/octet-stream"})
        assert status == 200 and res["success"] is True, res
        assert outputs() == (before, "w0")
        status, res = call(server.url, "/update_weights_from_buffer?abort_all_requests=maybe", raw=raw,
                           headers={"Content-Type": "application/octet-stream"})
        assert status == 400 and "abort_all_requests" in res["error"]["message"]
        status, res = call(server.url, "/update_weights_from_buffer", raw=raw + bytes(4 * len(raw)),
                           headers={"Content-Type": "application/octet-stream"})
        assert status == 413 and "too large" in res["error"]["message"], res
    finally:
        status, res = call(server.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                     "weight_version": "w0"})
        assert status == 200 and res["success"] is True
    assert outputs() == (before, "w0")


# -- errors ----------------------------------------------------------------------------------------------------------
BAD_BODIES = [
    ("json", b"{not json"),
    ("neither", {"sampling_params": {"max_new_tokens": 3}}),
    ("both", {"text": "hi", "input_ids": [1, 2]}),
    ("ids-type", {"input_ids": "abc"}),
    ("ids-elem", {"input_ids": [1, "x"]}),
    ("ids-float", {"input_ids": [1, 2.5]}),
    ("oov", {"input_ids": [1, VOCAB]}),
    ("negative-id", {"input_ids": [1, -1]}),
    ("empty", {"input_ids": []}),
    ("text-type", {"text": 5}),
    ("sp-type", {"input_ids": [1], "sampling_params": "greedy"}),
    ("max-new-neg", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}),
    ("max-new-str", {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}),
    ("max-new-float", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}),
    ("max-new-huge", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}),
    ("temperature", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}),
    ("top-p", {"input_ids": [1], "sampling_params": {"top_p": 0}}),
    ("top-k", {"input_ids": [1], "sampling_params": {"top_k": 0}}),
    ("unknown-param", {"input_ids": [1], "sampling_params": {"bogus": 1}}),
    ("return-logprob", {"input_ids": [1], "return_logprob": "yes"}),
    ("stop-ids", {"input_ids": [1], "sampling_params": {"stop_token_ids": [1000]}}),
    ("rid", {"input_ids": [1], "rid": 5}),
    ("body-list", [1, 2, 3]),
]


@pytest.mark.parametrize("name,body", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_generate_bodies_are_4xx(server, name, body):
    raw = body if isinstance(body, bytes) else None
    status, out = call(server.url, "/generate", None if raw else body, raw=raw)
    assert status == 400, (name, status, out)
    assert isinstance(out["error"]["message"], str) and out["error"]["message"]


def test_oversized_body_is_413(server):
    raw = json.dumps({"input_ids": [1] * 300_000}).encode()  # ~900 KB > --max-body-mb 0.5
    status, out = call(server.url, "/generate", raw=raw)
    assert status == 413 and "too large" in out["error"]["message"]
    assert call(server.url, "/health", method="GET")[0] == 200


def test_bad_control_bodies_are_4xx(server):
    for path, body in (("/update_weights_from_disk", {"model_path": 3}), ("/update_weights_from_disk", [1]),
                       ("/abort_request", {"rid": 7}), ("/abort_request", {"abort_all": "yes"})):
        status, out = call(server.url, path, body)
        assert status == 400 and out["error"]["message"], (path, body, out)
    status, out = call(server.url, "/no_such_endpoint", {})
    assert status == 404 and "error" in out
    status, out = call(server.url, "/generate", method="GET")
    assert status == 405 and "error" in out


def test_api_key(tiny_model_dir, tmp_path):
    srv = Server(tiny_model_dir, tmp_path / "auth.log", "--api-key", KEY)
    try:
        srv.wait_healthy()  # /health needs no key
        body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
        status, out = call(srv.url, "/generate", body)
        assert status == 401 and out == {"error": "Unauthorized"}
        assert call(srv.url, "/generate", body, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(srv.url, "/get_model_info", method="GET")[0] == 401
        assert call(srv.url, "/generate", body, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        assert call(srv.url, "/get_model_info", method="GET", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    finally:
        srv.kill()


def test_model_load_failure_exits_nonzero(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    srv = Server(bad, tmp_path / "bad.log")
    try:
        rc = srv.proc.wait(timeout=60)
    finally:
        srv.kill()
    assert rc != 0, log_tail(srv.log_path)
