"""Shared HTTP plumbing: one aiohttp session per event loop, and running a coroutine from sync code."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Awaitable, Callable

import aiohttp

from infra.procs import run_async


class SessionPerLoop:
    """One `aiohttp.ClientSession` per event loop, created lazily (sessions are bound to the loop that made them).

    `get()` inside a coroutine returns this loop's session; `aclose()` closes it. Sessions of loops that have
    closed are forgotten (they can be neither used nor closed any more).
    """

    def __init__(self, headers: dict | None = None, timeout_s: float = 60.0, max_connections: int = 100):
        self.headers, self.timeout_s, self.max_connections = dict(headers or {}), float(timeout_s), int(max_connections)
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        for other in [lp for lp in self._sessions if lp.is_closed()]:
            del self._sessions[other]
        sess = self._sessions.get(loop)
        if sess is None or sess.closed:
            sess = aiohttp.ClientSession(headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                         connector=aiohttp.TCPConnector(limit=self.max_connections))
            self._sessions[loop] = sess
        return sess

    async def aclose(self) -> None:
        """Close this loop's session (other loops' sessions must be closed on their own loop)."""
        sess = self._sessions.pop(asyncio.get_running_loop(), None)
        if sess is not None and not sess.closed:
            await sess.close()


def run_sync(coro: Awaitable, cleanup: Callable[[], Awaitable] | None = None):
    """Run a coroutine to completion from sync code, then await `cleanup()` on the same loop (e.g. closing that
    loop's sessions). Inside a running event loop (an async Prefect task calling a sync helper) `asyncio.run` is
    not allowed, so the coroutine then runs on a fresh loop in a helper thread."""

    async def runner():
        try:
            return await coro
        finally:
            if cleanup is not None:
                await cleanup()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_async(runner())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alloy-run-sync") as ex:
        return ex.submit(asyncio.run, runner()).result()
