"""A reward model served by the embedded engine (`python -m engine.server` / `alloy serve` on a
`LlamaForSequenceClassification` checkpoint made here from the tiny Llama), on loopback:

- SGLang's `/classify` shape: `text` (a str → one object, a list → a list), `input_ids` (a list → one object, a list
  of lists → a list), each `{"embedding": [logits], "meta_info": {"id", "finish_reason", "prompt_tokens", ...}}`;
  scores equal HF's `AutoModelForSequenceClassification` forward on the same ids (1e-5, CPU float32), an input
  ending in pad ids included (read at its last non-pad token, as HF); a batch equals one-by-one; a 2-label model answers 2 logits and `/v1/classify` its softmax and label;
- the guards: the API key (401), a bad body (400 naming the field), an input over the context (400), a body over
  the limit (413); /generate and /v1/chat/completions on it are 400 saying it is a reward model (and /classify on a
  generation server likewise); /get_model_info says `is_generation: false`;
- `EngineClient.classify` / `classify_logits` against it, and `alloy serve` starting it.
- concurrent requests share forwards (engine/reward_model.py, "Batching"): 8 requests at once answer each its
  own scores (as when sent one by one) in fewer forwards than requests; in process, a request that fails
  fails alone (the shared round is retried one by one) and `abort` (a rid, or all) fails queued requests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine_proc import REFERENCE_NUMERICS, REPO, EngineProc, engine_flags, http, make_reward_model

pytestmark = pytest.mark.integration

KEY = "rm-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["hello there", "a longer answer, with more words in it.", "x", "the same words, again and again."]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    return make_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def rm_server(rm_dir, tmp_path_factory):
    proc = EngineProc(rm_dir, tmp_path_factory.mktemp("rm-log") / "server.log", api_key=KEY).start()
    yield proc.wait_healthy()
    proc.kill()


@pytest.fixture(scope="module")
def hf_rm(rm_dir):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()


def post(server, path, body, headers=AUTH):
    status, raw = http(server.url, path, json.dumps(body).encode(), headers=headers)
    return status, json.loads(raw) if raw else None


def hf_scores(model, ids_list) -> list[list[float]]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].tolist() for ids in ids_list]


def test_classify_shapes_match_sglang_and_hf(rm_server, hf_rm, rm_dir):
    from infra.tokenizer import load_tokenizer

    tok = load_tokenizer(rm_dir)
    ids = [tok(t).input_ids for t in TEXTS]
    ref = hf_scores(hf_rm, ids)
    tol = 1e-5 if REFERENCE_NUMERICS else 5e-2

    status, one = post(rm_server, "/classify", {"text": TEXTS[0]})  # a str: one object
    assert status == 200 and isinstance(one, dict), one
    assert set(one) == {"embedding", "meta_info"} and len(one["embedding"]) == 1
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(ids[0]) and meta["finish_reason"] == {"type": "length", "length": 0}
    assert isinstance(meta["id"], str) and meta["weight_version"] == "w0" and meta["e2e_latency"] >= 0
    assert abs(one["embedding"][0] - ref[0][0]) < tol

    status, batch = post(rm_server, "/classify", {"text": TEXTS, "rid": "b"})  # a list: a list, in order
    assert status == 200 and isinstance(batch, list) and len(batch) == len(TEXTS)
    assert [o["meta_info"]["id"] for o in batch] == [f"b_{i}" for i in range(len(TEXTS))]
    for o, r, i in zip(batch, ref, ids):
        assert abs(o["embedding"][0] - r[0]) < tol and o["meta_info"]["prompt_tokens"] == len(i)
    # the same scores one by one (the batch is padded; padding changes nothing) and from token ids
    singles = [post(rm_server, "/classify", {"input_ids": i})[1] for i in ids]
    assert all(isinstance(o, dict) for o in singles)
    assert max(abs(s["embedding"][0] - b["embedding"][0]) for s, b in zip(singles, batch)) < tol
    status, by_ids = post(rm_server, "/classify", {"input_ids": ids})
    assert status == 200 and [o["embedding"][0] for o in by_ids] == pytest.approx(
        [o["embedding"][0] for o in batch], abs=tol)
    assert len({round(o["embedding"][0], 4) for o in batch}) == len(TEXTS)  # scores that differ, not a constant
    # an input ending with the pad id is read where HF reads it: the last token that is not the pad id
    pad = hf_rm.config.pad_token_id
    padded = ids[1] + [pad, pad]
    status, out = post(rm_server, "/classify", {"input_ids": [padded, ids[2]]})
    assert status == 200 and abs(out[0]["embedding"][0] - hf_scores(hf_rm, [padded])[0][0]) < tol
    assert abs(out[0]["embedding"][0] - ref[1][0]) < tol


def test_two_labels_and_v1_classify(tiny_model_dir, tmp_path):
    rm2 = make_reward_model(tiny_model_dir, tmp_path / "rm2", num_labels=2, seed=1)
    proc = EngineProc(rm2, tmp_path / "server.log").start().wait_healthy()
    try:
        status, out = post(proc, "/classify", {"text": TEXTS[:2]}, headers={})
        assert status == 200 and [len(o["embedding"]) for o in out] == [2, 2]
        status, v1 = post(proc, "/v1/classify", {"model": "any", "input": TEXTS[:2]}, headers={})
        assert status == 200, v1
        assert v1["object"] == "list" and v1["id"].startswith("classify-") and v1["model"] == str(rm2)
        for d, o in zip(v1["data"], out):
            probs = torch.softmax(torch.tensor(o["embedding"]), 0).tolist()
            assert d["probs"] == pytest.approx(probs, abs=1e-5) and d["num_classes"] == 2
            assert d["label"] == f"LABEL_{int(torch.tensor(o['embedding']).argmax())}"
        assert v1["usage"]["prompt_tokens"] == sum(o["meta_info"]["prompt_tokens"] for o in out)
        assert v1["usage"]["completion_tokens"] == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("body,needle", [
    ({}, "exactly one of text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ({"text": 5}, "text must be"),
    ({"text": [["query", "doc"]]}, "cross-encoder"),
    ({"input_ids": [1, "x"]}, "input_ids[1]"),
    ({"input_ids": [[1, 2], [10**6]]}, "input_ids[1][0]"),
    ({"input_ids": [1] * 5000}, "context length"),
    ({"text": "a", "image_data": "x.png"}, "image_data"),
    ([1, 2], "JSON object"),
])
def test_bad_classify_bodies_are_400_naming_the_field(rm_server, body, needle):
    status, out = post(rm_server, "/classify", body)
    assert status == 400 and needle in out["error"]["message"], out


def test_guards_and_refusals(rm_server, rm_dir):
    assert post(rm_server, "/classify", {"text": "a"}, headers={})[0] == 401
    assert post(rm_server, "/classify", {"text": "a"}, headers={"Authorization": "Bearer wrong"})[0] == 401
    status, _ = http(rm_server.url, "/classify", b"{" + b" " * (7 * 2**20) + b"}", headers=AUTH)
    assert status == 413
    for path, body in [("/generate", {"text": "a"}), ("/v1/chat/completions", {"messages": [{"role": "user",
                       "content": "a"}]}), ("/v1/completions", {"prompt": "a"}),
                       ("/update_weights_from_disk", {"model_path": str(rm_dir)})]:
        status, out = post(rm_server, path, body)
        assert status == 400, (path, out)
        assert "reward model (LlamaForSequenceClassification)" in out["error"]["message"]
        assert "/classify" in out["error"]["message"]
    status, raw = http(rm_server.url, "/get_model_info", method="GET", headers=AUTH)
    info = json.loads(raw)
    assert status == 200 and info["is_generation"] is False and info["model_path"] == str(rm_dir)
    status, raw = http(rm_server.url, "/get_server_info", method="GET", headers=AUTH)
    assert status == 200 and json.loads(raw)["num_labels"] == 1
    status, raw = http(rm_server.url, "/v1/models", method="GET", headers=AUTH)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == str(rm_dir)
    assert http(rm_server.url, "/health_generate", method="GET")[0] == 200


def test_client_classify(rm_server, hf_rm, rm_dir):
    from engine.client import EngineClient, EngineRequestError
    from infra.tokenizer import load_tokenizer

    tok = load_tokenizer(rm_dir)
    ids = [tok(t).input_ids for t in TEXTS]
    ref = [r[0] for r in hf_scores(hf_rm, ids)]
    tol = 1e-5 if REFERENCE_NUMERICS else 5e-2
    client = EngineClient(rm_server.url, api_key=KEY)

    async def calls():
        by_text = await client.classify(TEXTS, batch_size=3)  # two requests, answers in order
        by_ids = await client.classify(ids)
        logits = await client.classify_logits(TEXTS[:1])
        wrong = EngineClient(rm_server.url, api_key="wrong", max_retries=0)
        try:
            with pytest.raises(EngineRequestError) as refused:
                await wrong.classify(TEXTS)
        finally:
            await wrong.aclose()
        return by_text, by_ids, logits, refused.value

    by_text, by_ids, logits, refused = client.run_sync(calls())
    assert by_text == pytest.approx(ref, abs=tol) and by_ids == pytest.approx(ref, abs=tol)
    assert logits == [[pytest.approx(ref[0], abs=tol)]] and refused.status == 401


def test_classify_on_a_generation_server_is_400(tiny_model_dir, tmp_path):
    from engine.client import EngineClient, EngineRequestError

    proc = EngineProc(tiny_model_dir, tmp_path / "server.log").start().wait_healthy()
    try:
        status, out = post(proc, "/classify", {"text": "a"}, headers={})
        assert status == 400 and "generation model" in out["error"]["message"], out
        client = EngineClient(proc.url)
        with pytest.raises(EngineRequestError, match="reward model"):
            client.run_sync(client.classify(["a"]))
        status, raw = http(proc.url, "/get_model_info", method="GET")
        assert json.loads(raw)["is_generation"] is True
    finally:
        proc.kill()


def test_alloy_serve_serves_a_reward_model(rm_dir, tmp_path):
    from engine.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "alloy.cli", "serve", "--model", str(rm_dir), "--port", str(port),
           *engine_flags()]
    with open(tmp_path / "serve.log", "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    server = EngineProc(rm_dir, tmp_path / "serve.log")
    server.proc, server.port, server.url = proc, port, f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy()
        status, out = post(server, "/classify", {"text": TEXTS[0]}, headers={})
        assert status == 200 and len(out["embedding"]) == 1
    finally:
        server.kill()


# -- concurrent requests share forwards (engine/reward_model.py, "Batching") ----------------------------------------
def _requests(rm_dir, n=8):
    """`n` requests of 1-3 inputs each, of different lengths (token ids of the char tokenizer's texts)."""
    from infra.tokenizer import load_tokenizer

    tok = load_tokenizer(rm_dir)
    return [[tok(TEXTS[(i + k) % len(TEXTS)] + " " * i).input_ids for k in range(1 + i % 3)] for i in range(n)]


def _server_info(server) -> dict:
    status, raw = http(server.url, "/get_server_info", method="GET", headers=AUTH)
    assert status == 200
    return json.loads(raw)


def test_concurrent_classify_requests_share_forwards(rm_server, rm_dir):
    import asyncio

    import aiohttp

    requests = _requests(rm_dir)
    # serial: one request at a time, each its own forward(s)
    serial = [[o["embedding"] for o in post(rm_server, "/classify", {"input_ids": ids})[1]] for ids in requests]
    before = _server_info(rm_server)

    async def fire():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async def one(ids):
                async with session.post(rm_server.url + "/classify", json={"input_ids": ids}) as r:
                    assert r.status == 200, await r.text()
                    return [o["embedding"] for o in await r.json()]
            return await asyncio.gather(*(one(ids) for ids in requests))

    together = asyncio.run(fire())
    after = _server_info(rm_server)
    tol = 1e-5 if REFERENCE_NUMERICS else 5e-2
    for got, ref in zip(together, serial):  # each request its own scores, in its order
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g == pytest.approx(r, abs=tol)
    assert after["classify_requests"] - before["classify_requests"] == len(requests)
    forwards = after["classify_forwards"] - before["classify_forwards"]
    assert 1 <= forwards < len(requests), (before, after)
    assert after["classify_shared_rounds"] > before["classify_shared_rounds"]
    assert after["batch_window_s"] > 0


@pytest.fixture()
def rm_local(rm_dir):
    from engine.reward_model import RewardModel

    model = RewardModel(str(rm_dir))
    model.start()
    assert model.ready.wait(120), model.load_error
    yield model
    model.stop()


def test_queued_requests_share_one_round_and_score_as_alone(rm_local, rm_dir):
    import asyncio

    requests = _requests(rm_dir)
    alone = [rm_local.score_sync(ids) for ids in requests]
    rm_local.stats.update(forwards=0, rounds=0, shared_rounds=0, requests=0)

    async def together():
        return await asyncio.gather(*(rm_local.score(ids) for ids in requests))

    out = asyncio.run(together())
    tol = 1e-5 if REFERENCE_NUMERICS else 5e-2
    for got, ref in zip(out, alone):
        assert len(got) == len(ref) and all(g == pytest.approx(r, abs=tol) for g, r in zip(got, ref))
    # queued in one loop turn: one round, and the 8 requests' 16 short inputs fit one forward
    assert rm_local.stats["rounds"] == 1 and rm_local.stats["shared_rounds"] == 1
    assert rm_local.stats["forwards"] == 1 and rm_local.stats["requests"] == len(requests)


def test_a_failing_request_fails_alone_and_aborts_reach_queued_requests(rm_local, rm_dir):
    import asyncio

    from engine.protocol import ProtocolError

    requests = _requests(rm_dir, 4)
    alone = [rm_local.score_sync(ids) for ids in requests]
    bad = [[1, 2, rm_local.vocab_size + 7]]  # an id past the embedding: the forward raises

    async def run():
        calls = [rm_local.score(ids) for ids in requests[:2]] + [rm_local.score(bad)] + \
                [rm_local.score(requests[2], rids=["keep"]), rm_local.score(requests[3], rids=["gone_0", "gone_1"])]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0)  # all queued; the collector waits out its window
        rm_local.abort("gone_1", message="by the test")
        return await asyncio.gather(*tasks, return_exceptions=True)

    retried = rm_local.stats["retried_rounds"]
    a, b, err, keep, gone = asyncio.run(run())
    tol = 1e-5 if REFERENCE_NUMERICS else 5e-2
    for got, ref in zip([a, b, keep], [alone[0], alone[1], alone[2]]):
        assert not isinstance(got, BaseException), got
        assert all(g == pytest.approx(r, abs=tol) for g, r in zip(got, ref))
    assert isinstance(err, Exception) and not isinstance(err, ProtocolError)
    assert isinstance(gone, ProtocolError) and gone.status == 503 and "by the test" in gone.message
    assert rm_local.stats["retried_rounds"] == retried + 1

    async def abort_all():
        task = asyncio.ensure_future(rm_local.score(requests[0]))
        await asyncio.sleep(0)
        rm_local.abort(None, abort_all=True, message="server shutting down")
        return await asyncio.gather(task, return_exceptions=True)

    (res,) = asyncio.run(abort_all())
    assert isinstance(res, ProtocolError) and "server shutting down" in res.message
    rm_local.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(rm_local.score(requests[0]))
