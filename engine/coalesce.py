"""One-prompt `generate` calls made in the same event-loop turn, sent to the engine as one `/generate` request.

A specialist's rollout runs one episode per prompt, and each episode asks the engine for its completion with its own
call: 64 prompts were 64 HTTP requests, each parsed, scheduled and answered on its own. The engine batches them
anyway (continuous batching), so the requests only cost CPU on both sides: on a 2-core machine about a quarter of a
specialist step (`docs/tuning.md`, "Specialists"). `Coalescer.generate` has `EngineClient.generate`'s signature for
one prompt; the calls of one loop turn that share their sampling settings (temperature, top-p/k, stop ids, ...) go
out as one request, each keeping its own budget, stop strings, request id and seed (the protocol's per-request
sampling parameters), and each caller gets its own `Generation` back.

Only for a batch with no abort by the clock: a coalesced request answers when its *last* item is done, so a caller
that counts completions as they arrive (APRIL's over-sampling, `teachers.april.collect_batch` with a batch target
below the request count) would see them all at once. `teachers.rollout.rollout_step` coalesces only when every
request runs to its end (synchronous rollouts, or `deterministic_rollouts`). An abort (`abort_all`) still reaches
every item: the request then answers with each item's partial output (finish_reason "abort"), as separate calls do.

A caller that is cancelled while its request is in flight gets nothing; the request runs on for the others. An
error of the request (after the client's own retries) is every caller's error.
"""
from __future__ import annotations

import asyncio
from typing import NamedTuple, Sequence

from engine.client import EngineClient, Generation


class _Call(NamedTuple):
    """One queued call: what stays its own inside a shared request, and where its answer goes."""
    prompt: list[int]
    budget: int
    stop: list[str] | None
    rid: str | None
    seed: int | None
    answer: asyncio.Future


class Coalescer:
    """`generate([prompt], ...)` calls of one loop turn → one `client.generate(prompts, ...)`; other calls (several
    prompts, n > 1) pass through unchanged. `counters`: {"calls", "requests"} (how many calls, how many were sent)."""

    def __init__(self, client: EngineClient):
        self.client = client
        self._queued: dict[tuple, list[_Call]] = {}
        self.counters = {"calls": 0, "requests": 0}

    async def generate(self, input_ids: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                       stop: Sequence[str] | None = None, ignore_eos: bool = False, return_logprob: bool = True,
                       rid: str | None = None, n: int = 1, sampling_seed: int | None = None,
                       binary: bool = True) -> list[Generation]:
        if len(input_ids) != 1 or n != 1 or isinstance(max_new_tokens, (list, tuple)) \
                or (sampling_seed is not None and not isinstance(sampling_seed, int)) \
                or (rid is not None and not isinstance(rid, str)) or (stop and not isinstance(stop[0], str)):
            self.counters["calls"] += 1
            self.counters["requests"] += 1
            return await self.client.generate(
                input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                stop_token_ids=stop_token_ids, stop=stop, ignore_eos=ignore_eos, return_logprob=return_logprob,
                rid=rid, n=n, sampling_seed=sampling_seed, binary=binary)
        if not input_ids[0] or not isinstance(input_ids[0], list):
            raise ValueError("input_ids must be a non-empty list of non-empty token lists")
        # calls that can share one request: the same request-wide settings, and ids/seeds all given or all absent
        key = (float(temperature), float(top_p), int(top_k), tuple(int(t) for t in stop_token_ids or ()),
               bool(ignore_eos), bool(return_logprob), bool(binary), rid is None, sampling_seed is None)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self._queued.get(key)
        if queue is None:
            queue = self._queued[key] = []
            loop.call_soon(self._send, key)
        queue.append(_Call(list(input_ids[0]), int(max_new_tokens), list(stop) if stop else None, rid, sampling_seed,
                           fut))
        self.counters["calls"] += 1
        return [await fut]

    def _send(self, key: tuple) -> None:
        calls = self._queued.pop(key)
        rids = [c.rid for c in calls]
        if rids[0] is not None and len(set(rids)) != len(rids):  # one request wants unique ids: send them apart
            for c in calls:
                self._post(key, [c])
        else:
            self._post(key, calls)

    def _post(self, key: tuple, calls: list[_Call]) -> None:
        temperature, top_p, top_k, stop_ids, ignore_eos, return_logprob, binary, no_rid, no_seed = key
        stops = [c.stop for c in calls]
        self.counters["requests"] += 1
        coro = self.client.generate(
            [c.prompt for c in calls], max_new_tokens=[c.budget for c in calls], temperature=temperature,
            top_p=top_p, top_k=top_k, stop_token_ids=list(stop_ids) or None, stop=stops if any(stops) else None,
            ignore_eos=ignore_eos, return_logprob=return_logprob, rid=None if no_rid else [c.rid for c in calls],
            sampling_seed=None if no_seed else [c.seed for c in calls], binary=binary)
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: _deliver(t, [c.answer for c in calls]))


def _deliver(task: asyncio.Task, futures: list[asyncio.Future]) -> None:
    if task.cancelled():
        for f in futures:
            if not f.done():
                f.cancel()
        return
    exc = task.exception()
    for i, f in enumerate(futures):
        if f.done():  # its caller was cancelled
            continue
        if exc is not None:
            f.set_exception(exc)
        else:
            f.set_result(task.result()[i])
