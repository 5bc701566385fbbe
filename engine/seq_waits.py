"""Waiting for engine sequences from the server's event loop: the one way every HTTP handler that generates (SGLang's
/generate, OpenAI's /v1/chat/completions and /v1/completions: engine/openai_routes.py) submits `Seq`s to the engine
thread and gets their results back, whole (`run_seqs`) or as they grow (`seq_updates`, for streaming).

The engine thread calls `Seq.on_done` / `Seq.on_token`; these callbacks must be thread-safe and cheap, so they only
hand a wake-up to the loop (`Wakeups`: one `call_soon_threadsafe` per burst of finished sequences, not per
sequence). A client that goes away (the handler is cancelled) aborts its sequences, freeing their batch slots.
Split out of engine/server.py so the OpenAI handlers reuse it instead of a second submit-and-wait path.
"""
from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

if TYPE_CHECKING:
    from engine.scheduler import Engine, Seq

WAKEUPS = web.AppKey("wakeups", dict)  # {"w": the app's `Wakeups` of the running loop}; set by server.build_app


class Wakeups:
    """Resolves request futures on the event loop from the engine thread with one loop wake-up per burst: a
    decode step that finishes 30 sequences schedules one callback, not 30 (each `call_soon_threadsafe` writes to
    the loop's self-pipe and takes the GIL from the HTTP thread; per sequence it was ~10% of the engine thread's
    time under APRIL's abort bursts)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future] = []
        self._scheduled = False

    def resolver(self, fut: asyncio.Future):
        """A thread-safe `Seq.on_done` that resolves `fut`."""
        def done(_seq: "Seq") -> None:
            with self._lock:
                self._pending.append(fut)
                if self._scheduled:
                    return
                self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # loop already closed: nobody is waiting any more
                pass
        return done

    def _flush(self) -> None:
        with self._lock:
            futs, self._pending, self._scheduled = self._pending, [], False
        for f in futs:
            if not f.done():
                f.set_result(None)


def resolver(request: web.Request, fut: asyncio.Future):
    """`Seq.on_done` for a future of this request's loop (the app's `Wakeups`, made on first use)."""
    box = request.app[WAKEUPS]
    loop = asyncio.get_running_loop()
    if box.get("w") is None or box["w"].loop is not loop:
        box["w"] = Wakeups(loop)
    return box["w"].resolver(fut)


def all_done(request: web.Request, fut: asyncio.Future, seqs: list["Seq"]):
    """`Seq.on_done` for every sequence of one request: resolves `fut` (through `resolver`) once all of `seqs` have
    finished, so a batch wakes the event loop once, not once per burst of finished sequences (a sampled batch ends
    over many decode steps). Counts distinct sequences (a repeated call changes nothing)."""
    resolve = resolver(request, fut)
    lock, waiting = threading.Lock(), {id(s) for s in seqs}

    def done(seq: "Seq") -> None:
        with lock:
            waiting.discard(id(seq))
            last = not waiting
        if last:
            resolve(seq)
    return done


async def run_seqs(request: web.Request, engine: "Engine", seqs: list["Seq"]) -> None:
    """Submit `seqs` and return once every one has finished (their `result`s are then complete). If the handler is
    cancelled (the client went away), the sequences are aborted so they stop taking batch slots."""
    fut = asyncio.get_running_loop().create_future()
    on_done = all_done(request, fut, seqs)
    for s in seqs:
        s.on_done = on_done
    engine.submit(seqs)
    try:
        await fut
    except asyncio.CancelledError:  # client went away: free the batch slots
        engine.abort_seqs(seqs, "client disconnected")
        raise


async def seq_updates(engine: "Engine", seqs: list["Seq"]) -> AsyncIterator[dict[int, int | None]]:
    """Submit `seqs` and yield their progress until all have finished: each item is {index in seqs: n}, where n is
    the number of output tokens the sequence has now (`Seq.result.output_ids[:n]` is final), or None once it has
    finished. Coalesced: only the newest state of each sequence since the last item (a slow client skips
    intermediate states, never the end). The caller turns them into SSE chunks; if it stops iterating (the client
    went away), the sequences are aborted."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass

    for i, s in enumerate(seqs):
        s.on_token = lambda _s, n, i=i: post((i, n))
        s.on_done = lambda _s, i=i: post((i, None))
    engine.submit(seqs)
    remaining = len(seqs)
    finished = False
    try:
        while remaining:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            latest: dict[int, int | None] = {}
            for i, n in items:
                latest[i] = None if (n is None or latest.get(i, 0) is None) else n
            remaining -= sum(n is None for n in latest.values())
            yield latest
        finished = True
    finally:
        if not finished:  # cancelled, a write failed, or the caller stopped early
            engine.abort_seqs(seqs, "client disconnected")
