"""Engine client against a real embedded server subprocess on loopback: generation, scoring alignment against an
in-process forward pass, retries across a server restart on the same port, 4xx without retry, API key."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.client import EngineClient, EngineRequestError
from engine_proc import REFERENCE_NUMERICS, TINY_LP_TOL, EngineProc, forward_logprobs

pytestmark = pytest.mark.integration

KEY = "s3cret-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("engine") / "server.log", api_key=KEY).start()
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def client_for(server, **kw) -> EngineClient:
    return EngineClient(server.url, api_key=KEY, **kw)


def test_generate_logprobs_match_forward(server, model):
    c = client_for(server)
    prompts = [[1, 20, 21, 22], [1, 30, 31]]
    gens = c.run_sync(c.generate(prompts, max_new_tokens=12, temperature=1.0, ignore_eos=True, n=2,
                                 rid="gen-test"))
    assert len(gens) == 4
    for i, g in enumerate(gens):
        prompt = prompts[i // 2]  # prompt-major order
        assert len(g.output_ids) == 12 == g.completion_tokens == len(g.output_logprobs)
        assert g.finish_reason == "length" and g.prompt_tokens == len(prompt) and g.weight_version == "w0"
        lp = forward_logprobs(model, prompt + g.output_ids)
        ref = [lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(g.output_ids)]
        np.testing.assert_allclose(g.output_logprobs, ref, atol=TINY_LP_TOL)
    assert [g.rid for g in gens] == ["gen-test-0-0", "gen-test-0-1", "gen-test-1-0", "gen-test-1-1"]


def test_generate_stops_on_stop_token(server, model):
    c = client_for(server)
    prompt = [1, 40, 41]
    # (as in SGLang, ignore_eos=True would also ignore stop_token_ids)
    greedy = c.run_sync(c.generate([prompt], max_new_tokens=6, temperature=0.0))[0]
    stop_tok = greedy.output_ids[min(2, len(greedy.output_ids) - 1)]
    first = greedy.output_ids.index(stop_tok)
    g = c.run_sync(c.generate([prompt], max_new_tokens=6, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert g.finish_reason == "stop" and g.output_ids == greedy.output_ids[: first + 1]


def test_generate_per_prompt_budgets_and_stop_strings(server, tiny_model_dir):
    from infra.models import load_tokenizer

    c, tok = client_for(server), load_tokenizer(tiny_model_dir)
    prompts = [[1, 20, 21], [1, 30, 31, 32], [1, 40]]
    gens = c.run_sync(c.generate(prompts, max_new_tokens=[2, 5, 3], temperature=0.0, ignore_eos=True, n=2))
    assert [len(g.output_ids) for g in gens] == [2, 2, 5, 5, 3, 3]  # each prompt's own budget (the batch mixes domains)
    # a stop string ends a generation at the first token whose text completes it; that token stays in output_ids
    greedy = c.run_sync(c.generate([prompts[1]], max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    pieces = [tok.decode([t]) for t in greedy.output_ids]
    stop = pieces[min(2, len(pieces) - 1)]
    first = pieces.index(stop)
    g = c.run_sync(c.generate([prompts[1]], max_new_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert g.finish_reason == "stop" and g.output_ids == greedy.output_ids[: first + 1]


def test_score_aligned_to_response_tokens(server, model):
    c = client_for(server)
    seqs = [[1, 20, 21, 22, 23, 24, 25], [1, 50, 51, 52, 53]]
    starts = [4, 2]
    k = 5
    results = c.run_sync(c.score(seqs, starts, top_k=k))
    for ids, s, res in zip(seqs, starts, results):
        L = len(ids) - s
        assert res.token_logprobs.shape == (L,) and res.topk_ids.shape == (L, k) and res.topk_logprobs.shape == (L, k)
        lp = forward_logprobs(model, ids)
        ref = torch.stack([lp[s - 1 + j, ids[s + j]] for j in range(L)]).numpy()
        np.testing.assert_allclose(res.token_logprobs, ref, atol=TINY_LP_TOL)
        ref_top = torch.topk(lp[s - 1: len(ids) - 1], k, dim=-1)
        np.testing.assert_allclose(res.topk_logprobs, ref_top.values.numpy(), atol=TINY_LP_TOL)
        # ids may swap only where two log-probs tie within tolerance
        same = res.topk_ids == ref_top.indices.numpy()
        assert same.mean() > 0.95 or not REFERENCE_NUMERICS  # bf16 ties more often
    single = c.run_sync(c.score(seqs[0], 4))  # one sequence → one result, K = 0
    np.testing.assert_allclose(single.token_logprobs, results[0].token_logprobs,
                               atol=1e-5 if REFERENCE_NUMERICS else TINY_LP_TOL)
    assert single.topk_ids.shape == (3, 0)


def test_retries_across_restart_on_same_port(server):
    c = client_for(server, max_retries=40, backoff_base=0.1, backoff_max=0.5, timeout=30.0)

    async def scenario():
        # In flight when the server dies, and issued while it is down: both must succeed after the restart.
        in_flight = asyncio.create_task(c.generate([[1, 20, 21]], max_new_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.15)
        server.kill()
        while_down = asyncio.create_task(c.generate([[1, 22, 23]], max_new_tokens=4, ignore_eos=True))
        await asyncio.sleep(0.5)
        server.start()
        return await asyncio.gather(in_flight, while_down)

    t0 = time.monotonic()
    a, b = c.run_sync(scenario())
    assert len(a[0].output_ids) == 200 and len(b[0].output_ids) == 4
    assert c.counters["retries"] > 0 and c.counters["errors"] == 0, c.counters
    assert time.monotonic() - t0 < 60


def test_4xx_raises_immediately_without_retry(server):
    c = client_for(server, max_retries=5)
    with pytest.raises(EngineRequestError) as err:  # logprob_start_len >= len(input_ids) is a 400 by protocol
        c.run_sync(c.request("POST", "/generate", {"input_ids": [1, 20, 21], "sampling_params": {"max_new_tokens": 0},
                                                    "return_logprob": True, "logprob_start_len": 3}))
    assert err.value.status == 400 and err.value.message
    assert c.counters == {"requests": 1, "retries": 0, "errors": 1}


def test_api_key_required(server, monkeypatch):
    monkeypatch.delenv("ALLOY_ENGINE_API_KEY", raising=False)
    anon = EngineClient(server.url, max_retries=3)
    with pytest.raises(EngineRequestError) as err:
        anon.run_sync(anon.generate([[1, 20]], max_new_tokens=1))
    assert err.value.status == 401 and anon.counters["retries"] == 0
    monkeypatch.setenv("ALLOY_ENGINE_API_KEY", KEY)  # the env var is the fallback source of the key
    env_client = EngineClient(server.url)
    assert "s3cret" not in repr(env_client)
    info = env_client.run_sync(env_client.model_info())
    assert info["weight_version"] == "w0" and Path(info["model_path"]) == Path(server.model_dir)


def test_update_weights_abort_flush(server, tmp_path):
    from infra.models import init_model_dir

    other = init_model_dir("tiny", tmp_path / "other", seed=1)
    c = client_for(server)

    async def scenario():
        before = await c.score([1, 20, 21, 22], 2)
        await c.update_weights(str(other), version="w1")
        after = await c.score([1, 20, 21, 22], 2)
        info = await c.model_info()
        # 256 x 250 tokens takes > 1 s here (64 run at a time): abort them all 0.1 s in; each returns its
        # partial output (queued ones with no tokens).
        long = asyncio.create_task(c.generate([[1, 20]] * 256, max_new_tokens=250, ignore_eos=True, rid="long"))
        await asyncio.sleep(0.1)
        await c.abort(abort_all=True)
        aborted = await long
        await c.flush_cache()
        await c.update_weights(str(server.model_dir), version="w0")  # leave the module server as it was
        return before, after, info, aborted

    before, after, info, aborted = c.run_sync(scenario())
    assert info["weight_version"] == "w1" and after.weight_version == "w1"
    assert np.abs(before.token_logprobs - after.token_logprobs).max() > 1e-3
    assert all(g.finish_reason == "abort" and len(g.output_ids) < 250 for g in aborted), [(g.finish_reason, len(g.output_ids)) for g in aborted]
    assert all(len(g.output_logprobs) == len(g.output_ids) for g in aborted)
