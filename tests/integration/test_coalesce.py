"""`engine.coalesce.Coalescer` against a real embedded engine server on loopback: the one-prompt calls of one loop
turn go out as one `/generate` request, and every caller gets what its own call would have returned (seeded calls:
the same tokens; budgets, stop strings and request ids per call); an error reaches every caller; a cancelled
caller leaves the others theirs; a rollout step coalesces only when no request can be aborted by the clock."""
from __future__ import annotations

import asyncio

import pytest

from domains.registry import load_domain
from engine.client import EngineClient, EngineRequestError
from engine.coalesce import Coalescer
from engine_proc import EngineProc
from infra.models import load_tokenizer
from teachers.april import AprilBuffer
from teachers.rollout import PromptCursor, Roller, rollout_step

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory, reverse_base):
    srv = EngineProc(reverse_base, tmp_path_factory.mktemp("coalesce") / "engine.log").start().wait_healthy()
    yield srv, reverse_base
    srv.kill()


PROMPTS = [[1, 40 + i, 50 + i % 7, 60] for i in range(12)]


def calls(i: int) -> dict:
    """Call i's own settings: budgets, stop strings, seeds and ids differ from call to call."""
    return dict(max_new_tokens=3 + i % 5, temperature=1.0, stop_token_ids=[2], stop=["e"] if i % 3 == 0 else None,
                rid=f"call-{i}", sampling_seed=1000 + 17 * i)


def test_one_turns_calls_are_one_request_and_each_gets_its_own_generation(server):
    srv, _ = server

    async def go():
        client = EngineClient(srv.url)
        try:
            alone = [(await client.generate([p], **calls(i)))[0] for i, p in enumerate(PROMPTS)]
            sent = client.counters["requests"]
            co = Coalescer(client)
            together = await asyncio.gather(*(co.generate([p], **calls(i)) for i, p in enumerate(PROMPTS)))
            return alone, [g[0] for g in together], client.counters["requests"] - sent, co.counters
        finally:
            await client.aclose()

    alone, together, requests, counters = asyncio.run(go())
    assert requests == 1 and counters == {"calls": 12, "requests": 1}
    for a, b in zip(alone, together):  # seeded: the same tokens whatever else shares the batch
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason and b.rid == a.rid
        assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
    assert {len(g.output_ids) for g in together} != {3}  # the per-call budgets were kept


def test_calls_with_different_request_settings_or_a_repeated_id_go_apart(server):
    srv, _ = server

    async def go():
        client = EngineClient(srv.url)
        try:
            co = Coalescer(client)
            cold = [co.generate([p], max_new_tokens=4, temperature=0.0, rid=f"c{i}") for i, p in enumerate(PROMPTS[:3])]
            warm = [co.generate([p], max_new_tokens=4, temperature=1.0, rid=f"w{i}") for i, p in enumerate(PROMPTS[:3])]
            out = await asyncio.gather(*cold, *warm)
            # a repeated id: sent apart, as separate calls would be (the server refuses an id already in flight)
            twice = await asyncio.gather(*(co.generate([PROMPTS[0]], max_new_tokens=2, rid=r, top_k=5)
                                           for r in ("same", "same", "other")), return_exceptions=True)
            greedy = await client.generate([PROMPTS[0]], max_new_tokens=4, temperature=0.0)
            return out, twice, greedy, co.counters
        finally:
            await client.aclose()

    out, twice, greedy, counters = asyncio.run(go())
    assert counters == {"calls": 9, "requests": 5}  # greedy together, sampled together, the three apart
    assert out[0][0].output_ids == greedy[0].output_ids
    assert twice[2][0].rid == "other" and any(not isinstance(t, Exception) for t in twice[:2])
    for t in twice[:2]:
        assert not isinstance(t, Exception) or (isinstance(t, EngineRequestError) and "already in flight" in str(t))


def test_an_error_reaches_every_caller_and_a_cancelled_caller_leaves_the_others_theirs(server):
    srv, _ = server

    async def go():
        client = EngineClient(srv.url, max_retries=0)
        try:
            co = Coalescer(client)
            bad = await asyncio.gather(co.generate([[1, 5]], max_new_tokens=2), co.generate([[1, 10**6]],
                                                                                             max_new_tokens=2),
                                       return_exceptions=True)
            first = asyncio.ensure_future(co.generate([PROMPTS[0]], max_new_tokens=8))
            second = asyncio.ensure_future(co.generate([PROMPTS[1]], max_new_tokens=8))
            await asyncio.sleep(0)  # both queued and sent
            first.cancel()
            return bad, await second, first.cancelled()
        finally:
            await client.aclose()

    bad, second, cancelled = asyncio.run(go())
    assert all(isinstance(e, EngineRequestError) for e in bad)  # the out-of-vocabulary id fails the one request
    assert cancelled and len(second[0].output_ids) >= 1


@pytest.mark.parametrize("over_sampling, coalesced", [(1.0, True), (2.0, False)])
def test_a_rollout_step_coalesces_only_when_no_request_can_be_aborted(server, over_sampling, coalesced):
    srv, base = server
    dom, tok = load_domain("reverse"), load_tokenizer(base)

    async def go():
        client = EngineClient(srv.url)
        try:
            roller = Roller(client, dom, tok, temperature=1.0)
            samples, c = await rollout_step(roller, AprilBuffer(max_staleness=2), PromptCursor(dom, tok, 50, 0),
                                            batch_size=8, over_sampling=over_sampling, max_new_tokens=16, version=0)
            return samples, c, roller.coalescer.counters, client.counters["requests"]
        finally:
            await client.aclose()

    samples, c, co, requests = asyncio.run(go())
    assert len(samples) >= 8 and c["requests"] == int(8 * over_sampling)
    if coalesced:
        assert co == {"calls": 8, "requests": 1} and requests == 1
    else:  # APRIL counts completions as they come, and aborts the rest: one request per episode (+ the abort)
        assert co["calls"] == 0 and requests >= 16


def test_an_unseeded_synchronous_step_is_the_same_on_two_servers_started_with_one_seed(server, tmp_path):
    """The synchronous step is one request, so a server seeded at start samples its batch in one order: two servers
    started with the same `--seed` give the same step, as two `make demo` runs did (docs/results.md)."""
    _, base = server
    dom, tok = load_domain("reverse"), load_tokenizer(base)

    async def step(url: str):
        client = EngineClient(url)
        try:
            roller = Roller(client, dom, tok, temperature=1.0)  # no per-call seeds
            samples, _ = await rollout_step(roller, AprilBuffer(max_staleness=2), PromptCursor(dom, tok, 50, 0),
                                            batch_size=16, over_sampling=1.0, max_new_tokens=16, version=0)
            return [(s.sample_id, s.output_ids) for s in samples]
        finally:
            await client.aclose()

    runs = []
    for i in range(2):
        srv = EngineProc(base, tmp_path / f"seeded-{i}.log", "--seed", "1234").start().wait_healthy()
        try:
            runs.append(asyncio.run(step(srv.url)))
        finally:
            srv.kill()
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert len({tuple(ids) for _, ids in runs[0]}) > 1  # sampled, not one greedy answer repeated
