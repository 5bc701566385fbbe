"""The SGLang weight sync's HTTP calls (engine/sglang_sync.py `post`, `get_json`), sent through EngineClient, against
a small aiohttp server on loopback that answers as SGLang's weight-update endpoints do: `{"success", "message"}` with
HTTP 200 or 400. Checks the API key header, the one attempt per POST, the per-call timeout, and that every error
names the endpoint and carries SGLang's message."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from engine.client import EngineClient
from engine.sglang_sync import SGLangTensorSync, WeightSyncError, make_sync

pytestmark = pytest.mark.unit

KEY = "k-123"


async def serve(hits: list):
    """A loopback server: /ok succeeds, /refused is SGLang's 400, /busy a 503, /slow sleeps, /get_server_info
    answers a GET. Every request is recorded as (method, path, Authorization header)."""

    async def handle(request: web.Request) -> web.Response:
        hits.append((request.method, request.path, request.headers.get("Authorization")))
        if request.path == "/ok":
            body = await request.json()
            return web.json_response({"success": True, "message": f"loaded {body['weight_version']}"})
        if request.path == "/refused":
            return web.json_response({"success": False, "message": "Please discard the whole weights."}, status=400)
        if request.path == "/busy":
            return web.Response(status=503, text="loading")
        if request.path == "/slow":
            await asyncio.sleep(1.5)
        return web.json_response({"cuda_device_uuid": "GPU-x"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def noop(version, flush_cache):
    return None


def test_post_and_get_go_through_the_engine_client():
    async def run():
        hits: list = []
        runner, url = await serve(hits)
        sync = SGLangTensorSync(url, noop, api_key=KEY, timeout_s=30)
        quick = SGLangTensorSync(url, noop, client=sync.client, timeout_s=0.3)  # the per-call timeout
        try:
            assert isinstance(sync.client, EngineClient)
            assert await sync.post("/ok", {"weight_version": "7"}) == "loaded 7"
            with pytest.raises(WeightSyncError, match=r"SGLang /refused failed \(HTTP 400\): Please discard"):
                await sync.post("/refused", {})
            with pytest.raises(WeightSyncError, match=r"SGLang /busy at .*HTTP 503: loading"):
                await sync.post("/busy", {})
            with pytest.raises(WeightSyncError, match="SGLang /slow at .*TimeoutError"):
                await quick.post("/slow", {})
            assert await sync.get_json("/get_server_info") == {"cuda_device_uuid": "GPU-x"}
            assert await sync.get_json("/busy") == {}
        finally:
            await sync.aclose()
            await runner.cleanup()
        assert [h[:2] for h in hits] == [("POST", "/ok"), ("POST", "/refused"), ("POST", "/busy"), ("POST", "/slow"),
                                         ("GET", "/get_server_info"), ("GET", "/busy")]  # one attempt each
        assert {h[2] for h in hits} == {f"Bearer {KEY}"}

    asyncio.run(run())


def test_unreachable_server_names_the_endpoint():
    async def run():
        sync = make_sync("tensor", "http://127.0.0.1:9", noop, timeout_s=2)
        try:
            with pytest.raises(WeightSyncError, match=r"SGLang /update_weights_from_tensor at http://127.0.0.1:9"):
                await sync.post("/update_weights_from_tensor", {})
            assert await sync.get_json("/get_server_info") == {}
        finally:
            await sync.aclose()

    asyncio.run(run())


def test_a_given_client_is_used_and_left_open():
    async def run():
        hits: list = []
        runner, url = await serve(hits)
        client = EngineClient(url, api_key=KEY)
        sync = make_sync("distributed", url, noop, client=client, timeout_s=2)
        try:
            assert sync.client is client
            assert await sync.post("/ok", {"weight_version": "1"}) == "loaded 1"
            session = client._session()
            await sync.aclose()
            assert not session.closed  # the caller's session stays theirs to close
            assert (await client.request("GET", "/get_server_info"))["cuda_device_uuid"] == "GPU-x"
        finally:
            await client.aclose()
            await runner.cleanup()

    asyncio.run(run())
