"""The engine server's header deadline, kept here rather than left to aiohttp, plus `serve`, which runs an app with it.

A client gets `timeout_s` to send a request's headers, counted from the connection's start or from the end of the
app's handling of its previous request; an idle keep-alive connection is closed as late. aiohttp's own
`keepalive_timeout` does not do this on every version we allow: before 3.14.4 it is armed only after a response, so a
client that connects and sends half its headers was never dropped (measured: aiohttp 3.9.5 to 3.14.3 fail
tests/integration/test_engine_hardening.py's half-sent-headers test, 3.14.4 and 3.14.5 pass). So each connection's
protocol is aiohttp's own (`runner.server()`, a public protocol factory) wrapped by `HeaderDeadline`, which holds the
timer. The timer is armed when the connection opens and whenever the app finishes a request, and cancelled while the
app handles one (`track_requests`, a middleware: aiohttp calls the app as soon as a request's headers are complete).
When it fires, the connection is closed, unless a response is still being written to the client: then it waits
`timeout_s` more (the response itself has no time limit). The body's deadline is engine.request_guards' (408).
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger("alloy.engine.server")


class HeaderDeadline(asyncio.Protocol):
    """aiohttp's protocol for one connection (`inner`, which every event goes to) plus the header timer."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float):
        self.inner, self.timeout_s = inner, timeout_s
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.in_app = 0  # requests the app is handling now (aiohttp handles one at a time per connection)

    def connection_made(self, transport):
        self.transport = transport
        self.inner.connection_made(transport)
        self._arm()

    def connection_lost(self, exc):
        self._disarm()
        self.inner.connection_lost(exc)

    def data_received(self, data):
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def request_started(self) -> None:
        self.in_app += 1
        self._disarm()

    def request_ended(self) -> None:
        self.in_app -= 1
        if not self.in_app and not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        if self.in_app or self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():  # the previous response is still on its way out
            self._arm()
            return
        log.debug("no complete request headers from %s within %g s (--read-timeout-s); closing the connection",
                  self.transport.get_extra_info("peername"), self.timeout_s)
        self.transport.close()


@web.middleware
async def track_requests(request: web.Request, handler):
    """Stops the connection's header timer while the app handles `request` and restarts it after."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, HeaderDeadline):  # e.g. an app served some other way (tests' in-process servers)
        return await handler(request)
    conn.request_started()
    try:
        return await handler(request)
    finally:
        conn.request_ended()


async def _serve(app: web.Application, host: str, port: int, timeout_s: float, shutdown_timeout: float) -> None:
    # aiohttp's keep-alive timer is left as a backstop only, at twice ours (ours always fires first)
    runner = web.AppRunner(app, handle_signals=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=2 * timeout_s)
    await runner.setup()
    try:
        factory = runner.server
        server = await asyncio.get_running_loop().create_server(lambda: HeaderDeadline(factory(), timeout_s),
                                                                host, port, backlog=128)
        try:
            await asyncio.get_running_loop().create_future()  # serve until cancelled
        finally:
            server.close()  # stop listening; runner.cleanup then shuts the open connections down gracefully
    finally:
        await runner.cleanup()


def serve(app: web.Application, host: str, port: int, timeout_s: float, shutdown_timeout: float) -> None:
    """`web.run_app(app, host=host, port=port, shutdown_timeout=shutdown_timeout, handle_signals=True,
    access_log=None)` with the header deadline: runs until SIGTERM/SIGINT or a `web.GracefulExit` raised from a loop
    callback, then shuts down as run_app does (on_shutdown, in-flight requests get `shutdown_timeout`, on_cleanup)."""
    app.middlewares.insert(0, track_requests)  # outermost: it spans the whole of the app's handling
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, host, port, timeout_s, shutdown_timeout))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        # the main task first (its cleanup is the graceful shutdown), then whatever is left, as run_app does
        for tasks in ([] if main.done() else [main], asyncio.all_tasks(loop)):
            for task in tasks:
                task.cancel()
            for result in loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True)):
                if isinstance(result, Exception):
                    log.error("while shutting down: %r", result)
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
