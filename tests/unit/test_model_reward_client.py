"""The rewarders' one HTTP client (domains/model_reward.py) against a stand-in judge on loopback (a tiny aiohttp app
speaking /v1/chat/completions): the batches of one event loop share one session (one kept-alive connection, where a
client per batch opened a new one each step), `aclose()` closes it and a later batch opens another, and evaluation's
one-shot loops (domains/evaluate.py `score_batch`) close their session before the loop ends: nothing is left unclosed."""
import asyncio
import gc
import warnings

import pytest
from aiohttp import web

from domains.base import Example
from domains.model_reward import JudgeRewarder

pytestmark = pytest.mark.unit


class ChatStub:
    """Answers every chat request with "Score: 3/10"; records each request's client port and Authorization."""

    def __init__(self):
        self.ports: list[int] = []
        self.auth: list[str | None] = []

    async def chat(self, request: web.Request) -> web.Response:
        await request.json()
        self.ports.append(request.transport.get_extra_info("peername")[1])
        self.auth.append(request.headers.get("Authorization"))
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "Fine. Score: 3/10"}}]})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


EXS = [Example(domain="polite", prompt="pol:abc=", answer="abc!", difficulty=0)]


def test_one_session_per_loop_across_batches_closed_by_aclose():
    stub = ChatStub()

    async def run():
        async with stub as url:
            rw = JudgeRewarder(url, "Is it polite?", api_key="sk-rw")
            batches = [await rw.score(EXS, ["abc!"], [1], 8) for _ in range(3)]
            session = rw.client()._session()
            await rw.aclose()
            closed = session.closed
            again = await rw.score(EXS, ["abc"], [1], 8)  # usable after aclose: a new session
            await rw.aclose()
            return batches, closed, again, rw.counters

    batches, closed, again, counters = asyncio.run(run())
    assert [b.rewards for b in batches] == [[0.3]] * 3 and again.raw == [0.3]
    assert len(set(stub.ports[:3])) == 1  # the three batches of the loop: one kept-alive connection
    assert stub.ports[3] != stub.ports[0]  # after aclose: a new session, a new connection
    assert closed and counters == {"requests": 4, "retries": 0, "errors": 0}
    assert stub.auth == ["Bearer sk-rw"] * 4


def test_a_one_shot_loop_closes_its_session_as_it_ends():
    """Evaluation scores each batch in an `asyncio.run` of its own (domains/evaluate.py `_run`: in a helper thread
    when a loop is running): `score_batch` closes that loop's session before the loop ends."""
    from domains.evaluate import score_batch

    stub = ChatStub()
    sessions = []

    class Watched(JudgeRewarder):
        async def aclose(self):
            sessions.append(self.client()._session())
            await super().aclose()

    def one_shot(rw) -> object:
        return score_batch(rw, EXS, ["abc!"], [1], 8)

    async def run():
        async with stub as url:
            rw = Watched(url, "Is it polite?")
            loop = asyncio.get_running_loop()
            return [await loop.run_in_executor(None, one_shot, rw) for _ in range(2)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        out = asyncio.run(run())
        gc.collect()
    assert [b.rewards for b in out] == [[0.3], [0.3]]
    assert len(sessions) == 2 and sessions[0] is not sessions[1] and all(s.closed for s in sessions)
    assert not [w for w in caught if "Unclosed" in str(w.message)], [str(w.message) for w in caught]
