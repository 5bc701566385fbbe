"""`specialists.deterministic_rollouts` on a real engine server: three APRIL steps (2× over-sampling, partials
resumed) give the same samples and the same buffer whether the server is idle or busy with other clients'
requests that share its batches (so its batches, timings and the order of completions all differ)."""
from __future__ import annotations

import asyncio

import pytest

from domains.registry import load_domain
from engine_proc import EngineProc
from engine.client import EngineClient
from infra.models import load_tokenizer
from teachers.april import AprilBuffer
from teachers.rollout import PromptCursor, Roller, rollout_step

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory, reverse_base):
    root, base = tmp_path_factory.mktemp("det-rollouts"), reverse_base  # varied lengths: the cut leaves partials
    srv = EngineProc(base, root / "engine.log").start().wait_healthy()
    yield srv, base
    srv.kill()


async def three_steps(url: str, base, *, busy: bool) -> tuple[list, list, dict]:
    dom, tok = load_domain("reverse"), load_tokenizer(base)
    client = EngineClient(url)
    buffer, cursor = AprilBuffer(max_staleness=10), PromptCursor(dom, tok, 200, 0)
    stop = asyncio.Event()

    async def other_client(j: int) -> None:  # unseeded batch-mates of every length
        i = 0
        while not stop.is_set():
            await client.generate([[1, 5 + (i + j) % 7, 9]] * 3, max_new_tokens=3 + (i * 5 + j) % 13)
            i += 1

    others = [asyncio.ensure_future(other_client(j)) for j in range(3)] if busy else []
    samples, counters = [], []
    try:
        for version in range(3):
            roller = Roller(client, dom, tok, temperature=1.0, seed=7)
            got, c = await rollout_step(roller, buffer, cursor, batch_size=8, over_sampling=2.0, max_new_tokens=16,
                                        version=version, deterministic=True)
            samples.append([(s.sample_id, s.output_ids, s.token_versions, s.finish_reason) for s in got])
            counters.append(c)
    finally:
        stop.set()
        await asyncio.gather(*others)
        await client.aclose()
    return samples, counters, buffer.state_dict()


def test_seeded_token_count_steps_do_not_depend_on_the_servers_other_work(server):
    srv, base = server
    idle = asyncio.run(three_steps(srv.url, base, busy=False))
    busy = asyncio.run(three_steps(srv.url, base, busy=True))
    samples, counters, state = idle
    print("counters", counters)
    assert busy[1] == counters and busy[0] == samples  # same requests, same finished samples in request order
    # partials: same ids, tokens and token versions (their log-probs differ by float rounding at most: a row's
    # logits are computed in batches of different shapes)
    strip = lambda st: [{k: v for k, v in p.items() if k != "output_logprobs"} for p in st["partials"]]  # noqa: E731
    assert strip(busy[2]) == strip(state) and busy[2]["counters"] == state["counters"]
    for a, b in zip(busy[2]["partials"], state["partials"]):
        assert a["output_logprobs"] == pytest.approx(b["output_logprobs"], abs=1e-4)
    # the step really was APRIL: partials were left and resumed, more than the batch target finished at times
    assert sum(c["partials"] for c in counters) > 0 and sum(c["resumed"] for c in counters) > 0
    assert all(c["requests"] == 16 and c["finished"] >= 8 for c in counters)
