"""The one engine client: async HTTP to an SGLang-protocol server (Alloy's embedded server or real SGLang).

Every caller (rollouts, teacher scoring, evaluation, the launcher's health checks, reward-model scores on /classify,
chat calls to any OpenAI-compatible URL) goes through `EngineClient`, so
there is one place that owns the HTTP session, timeouts, retries and response validation.

- One `aiohttp.ClientSession` per event loop, created lazily and reused by every request on that loop. A session
  is bound to the loop it was created on, so a client shared by threads with their own loops keeps one per loop.
- Bounded exponential backoff with jitter on connection errors, timeouts, 502/503/504 (a server that is down,
  restarting or still loading). Any other 4xx/5xx raises `EngineRequestError` at once: retrying a bad request
  only repeats it.
- Responses are validated into typed arrays; a malformed or non-finite response raises `EngineResponseError`
  so the caller can drop that sample and count it instead of training on garbage.

Protocol facts (docs/architecture.md, "The engine protocol"): scoring sends `max_new_tokens=0, return_logprob=true,
logprob_start_len=s`; `input_token_logprobs` then has one entry per token s … n-1, where entry 0 is
`[null, id, null]` in current SGLang (older releases filled it). We send `s = start - 1` so the entry for
`input_ids[start]` (the first response token) is entry 1, and keep only the tail aligned to `input_ids[start:]`:
both conventions give the same tail. This is what slime does.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import numbers
import os
import random
import urllib.parse
from typing import Any, Sequence

import aiohttp
import orjson

from engine import wire
from engine.protocol import gc_paused
from engine.responses import (  # noqa: F401  (re-exported: callers import them from the client)
    ChatReply, EngineError, EngineRequestError, EngineResponseError, EngineUnavailable, Generation, ScoreResult,
    _binary_items, parse_chat_reply, parse_classify, parse_finish_reason, parse_generation, parse_generation_arrays,
    parse_score, parse_score_arrays, parse_score_batch, parse_score_items,
)
from infra.http import SessionPerLoop, run_sync  # noqa: F401  (run_sync is re-exported)

log = logging.getLogger(__name__)

API_KEY_ENV = "ALLOY_ENGINE_API_KEY"
RETRY_STATUSES = frozenset({502, 503, 504})
CHAT_RETRY_STATUSES = RETRY_STATUSES | {429}  # an external OpenAI-compatible API's rate limit is worth a retry too
CLASSIFY_BATCH = 64  # inputs per /classify request (more are sent as several requests at once)


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested on hand-written protocol JSON; the response parsers are in engine.responses)
# ---------------------------------------------------------------------------------------------------------------

def backoff_delays(max_retries: int, base: float, max_delay: float, rng: random.Random | None = None) -> list[float]:
    """Sleep before retry i (i = 0 … max_retries-1): d_i = min(max_delay, base · 2^i) · u_i, u_i ~ U[0.5, 1].

    "Equal jitter": at least half the exponential step (so a flapping server is not hammered), at most the cap,
    and the jitter de-synchronises many clients retrying against one restarting server.
    Total wait ≤ Σ_i min(max_delay, base · 2^i).
    """
    rng = rng or random.Random()
    return [min(max_delay, base * 2.0**i) * rng.uniform(0.5, 1.0) for i in range(max_retries)]


def seed_for(seed: int, key: str) -> int:
    """A `sampling_seed` for the call named `key` in a run seeded with `seed`: a stable hash (not Python's
    per-process `hash`), so a rerun with the same seed sends the same seeds."""
    return int.from_bytes(hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=8).digest(), "big") % 2**63


def expand_rids(rid: str | list[str] | None, n_prompts: int, n: int) -> list[str | None]:
    """Request ids of the n_prompts * n expanded requests (prompt-major). A str names the batch: prompt i gets
    `rid-i` (just `rid` for one prompt); sample j of a prompt gets a further `-j` when n > 1. None → no ids."""
    if rid is None:
        return [None] * (n_prompts * n)
    if isinstance(rid, list):
        if len(rid) != n_prompts or len(set(rid)) != n_prompts or not all(isinstance(r, str) and r for r in rid):
            raise ValueError(f"rid must be {n_prompts} unique non-empty strings, got {rid!r}")
        base = rid
    else:
        base = [rid] if n_prompts == 1 else [f"{rid}-{i}" for i in range(n_prompts)]
    return [r if n == 1 else f"{r}-{j}" for r in base for j in range(n)]


GC_PAUSE_BYTES = 2**16


def loads_json(raw: bytes) -> Any:
    """`orjson.loads`, with the cyclic GC paused for a body over 64 KiB (`protocol.gc_paused`: a scoring answer is
    millions of small lists, and the GC's collections during their allocation cost 3-4x the parse itself)."""
    with gc_paused(len(raw) >= GC_PAUSE_BYTES):
        return orjson.loads(raw)


def _error_message(body: Any, raw: bytes) -> str:
    """The reason a server gave for a failed request: `{"error": {"message": ...}}` (the embedded server, OpenAI's
    shape), SGLang's `{"message": ...}` (its weight-update endpoints answer `{"success": false, "message": ...}`) or
    `{"error": "..."}`; else the first 500 characters of the body."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(err, str):
            return err
    return raw[:2000].decode("utf-8", errors="replace")[:500] or "(empty body)"


# ---------------------------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------------------------

class EngineClient:
    """Async client of one engine server. Share one instance per server; it keeps one HTTP session per event loop.

    >>> async with EngineClient("http://127.0.0.1:30000") as c:
    ...     gens = await c.generate([[1, 5, 6]], max_new_tokens=8)
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0, max_retries: int = 5,
                 backoff_base: float = 0.2, backoff_max: float = 5.0, max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout, self.max_retries = float(timeout), int(max_retries)
        self.backoff_base, self.backoff_max = float(backoff_base), float(backoff_max)
        self.max_connections = int(max_connections)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = SessionPerLoop(headers, self.timeout, self.max_connections)
        self._counts = {"requests": 0, "retries": 0, "errors": 0}

    def __repr__(self) -> str:  # never print the key
        return f"EngineClient({self.base_url!r}, api_key={'set' if self._api_key else None})"

    @property
    def counters(self) -> dict[str, int]:
        """{"requests", "retries", "errors"} since creation (a copy, for metrics)."""
        return dict(self._counts)

    # -- session per loop ---------------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        return self._http.get()

    async def aclose(self) -> None:
        """Close this loop's session (other loops' sessions must be closed on their own loop)."""
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def run_sync(self, coro):
        """Run a coroutine of this client from sync code (scripts, tests, Prefect tasks) and close its session."""
        return run_sync(coro, cleanup=self.aclose)

    # -- transport ----------------------------------------------------------------------------------------------
    async def request(self, method: str, path: str, payload: dict | None = None, *, retries: int | None = None,
                       timeout: float | None = None, data: bytes | None = None, accept: str | None = None,
                       retry_statuses: frozenset[int] = RETRY_STATUSES) -> Any:
        """One raw protocol call with bounded retries (the typed methods all go through it). Returns the parsed JSON
        body, or the text when the body is not JSON. `retries`: None → the client's `max_retries` (0: one attempt,
        for a call that must not run twice). `timeout`: seconds for this call, None → the client's. `data`: a raw
        application/octet-stream body instead of `payload`'s JSON. `accept` = `wire.ACCEPT` asks for a binary
        log-prob body, returned as its raw `bytes` (the server may still answer JSON). `retry_statuses`: the HTTP
        statuses retried (502/503/504; a chat call adds 429). Raises `EngineRequestError` on a status it does not
        retry (its `message`: the server's reason), `EngineUnavailable` once the retries are spent."""
        url = f"{self.base_url}{path}"
        retries = self.max_retries if retries is None else retries
        delays: list[float] | None = None  # drawn on the first retry (a fresh RNG per call costs an os.urandom)
        kw: dict[str, Any] = {}
        if payload is not None:
            kw = {"data": orjson.dumps(payload), "headers": {"Content-Type": "application/json"}}
        elif data is not None:
            kw = {"data": data, "headers": {"Content-Type": "application/octet-stream"}}
        if accept is not None:
            kw["headers"] = {**kw.get("headers", {}), "Accept": accept}
        if timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
        self._counts["requests"] += 1
        last = "no attempt"
        for attempt in range(retries + 1):
            try:
                async with self._session().request(method, url, **kw) as resp:
                    raw = await resp.read()
                    if resp.status == 200 and resp.content_type == wire.CONTENT_TYPE:
                        return raw
                    try:
                        body = loads_json(raw) if raw.strip() else None
                    except ValueError:
                        body = None
                    if resp.status == 200:
                        return body if body is not None else raw.decode("utf-8", errors="replace")
                    if resp.status not in retry_statuses:
                        self._counts["errors"] += 1
                        raise EngineRequestError(resp.status, _error_message(body, raw), url)
                    last = f"HTTP {resp.status}: {_error_message(body, raw)}"
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < retries:
                delays = delays or backoff_delays(retries, self.backoff_base, self.backoff_max)
                self._counts["retries"] += 1
                log.debug("engine %s %s failed (%s); retry %d/%d in %.2fs", method, url, last, attempt + 1, retries, delays[attempt])
                await asyncio.sleep(delays[attempt])
        self._counts["errors"] += 1
        raise EngineUnavailable(f"{method} {url} failed after {retries + 1} attempts; last error: {last}")

    # -- generation and scoring ---------------------------------------------------------------------------------
    async def generate(self, input_ids: list[list[int]], *, max_new_tokens: int | Sequence[int],
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                       stop_token_ids: list[int] | None = None,
                       stop: Sequence[str] | Sequence[Sequence[str] | None] | None = None, ignore_eos: bool = False,
                       return_logprob: bool = True, rid: str | list[str] | None = None, n: int = 1,
                       sampling_seed: int | Sequence[int] | None = None, binary: bool = True) -> list[Generation]:
        """Sample completions for a batch of token prompts; returns len(input_ids) * n generations, prompt-major
        (all n samples of prompt 0, then prompt 1, ...). One HTTP call for the whole batch.

        n > 1 is sent as n copies of each prompt (rids suffixed `-j`): the ordering is then ours, not the server's,
        and SGLang's prefix cache still shares the prompt's KV.
        `sampling_seed`: generation k of the call (prompt-major) samples from its own generator seeded with
        `sampling_seed + k`, so its tokens do not depend on which other requests share the server's batch; a
        sequence gives one seed per prompt (generation j of prompt i: `sampling_seed[i] + j`).
        `binary`: ask for the packed log-prob body (`engine.wire`); a server that does not speak it (SGLang)
        answers JSON, parsed as before.
        `max_new_tokens`: one budget for all, or one per prompt (then the sampling params are sent per request).
        `stop`: stop strings (a generation ends once its text contains one; its tokens stay in `output_ids`), or
        one list (or None) per prompt.
        """
        if not input_ids or not all(isinstance(p, list) and p for p in input_ids):
            raise ValueError("input_ids must be a non-empty list of non-empty token lists")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        all_rids = expand_rids(rid, len(input_ids), n)
        prompts = [p for p in input_ids for _ in range(n)]
        budgets = [int(b) for b in max_new_tokens] if isinstance(max_new_tokens, (list, tuple)) else None
        if budgets is not None and len(budgets) != len(input_ids):
            raise ValueError(f"max_new_tokens has {len(budgets)} budgets for {len(input_ids)} prompts")
        params: dict[str, Any] = {"max_new_tokens": int(budgets[0] if budgets else max_new_tokens),
                                  "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k),
                                  "ignore_eos": bool(ignore_eos)}
        if stop_token_ids:
            params["stop_token_ids"] = [int(t) for t in stop_token_ids]
        stops = None  # one list per prompt
        if stop and not isinstance(stop[0], str):
            if len(stop) != len(input_ids):
                raise ValueError(f"stop has {len(stop)} lists for {len(input_ids)} prompts")
            stops = [[str(x) for x in one] if one else None for one in stop]
        elif stop:
            params["stop"] = [str(x) for x in stop]
        seeds = None
        if sampling_seed is not None and not isinstance(sampling_seed, int):
            if len(sampling_seed) != len(input_ids):
                raise ValueError(f"sampling_seed has {len(sampling_seed)} seeds for {len(input_ids)} prompts")
            seeds = [int(x) for x in sampling_seed]
        sampling: dict[str, Any] | list[dict[str, Any]] = params
        if sampling_seed is not None or budgets is not None or stops is not None:
            sampling = [dict(params) for _ in prompts]
            for k, sp in enumerate(sampling):
                if budgets is not None:
                    sp["max_new_tokens"] = budgets[k // n]
                if stops is not None and stops[k // n]:
                    sp["stop"] = stops[k // n]
                if seeds is not None:
                    sp["sampling_seed"] = (seeds[k // n] + k % n) % 2**63
                elif sampling_seed is not None:
                    sp["sampling_seed"] = (int(sampling_seed) + k) % 2**63
        payload: dict[str, Any] = {"input_ids": prompts, "sampling_params": sampling,
                                   "return_logprob": bool(return_logprob)}
        if all_rids[0] is not None:
            payload["rid"] = all_rids
        body = await self.request("POST", "/generate", payload, accept=wire.ACCEPT if binary else None)
        try:
            if isinstance(body, bytes):
                items = _binary_items(body, len(prompts))
                return [parse_generation_arrays(o, a, r, return_logprob) for (o, a), r in zip(items, all_rids)]
            if not isinstance(body, list) or len(body) != len(prompts):
                got = len(body) if isinstance(body, list) else type(body).__name__
                raise EngineResponseError(f"/generate returned {got} results for a batch of {len(prompts)}")
            return [parse_generation(o, r, return_logprob) for o, r in zip(body, all_rids)]
        except EngineResponseError:
            self._counts["errors"] += 1
            raise

    async def score(self, input_ids: list[int] | list[list[int]], start: int | list[int],
                    top_k: int = 0, binary: bool = True) -> ScoreResult | list[ScoreResult]:
        """Log-probs of the response tokens `input_ids[start:]` under this server's model (the teacher call).

        `start` = len(prompt), the index of the first response token (1 ≤ start ≤ len(input_ids)). Sends
        `logprob_start_len = start - 1` so the first scored token is `input_ids[start]`. A list of sequences is
        scored in one HTTP call and returns a list. Raises `EngineResponseError` on a malformed response.
        `binary`: ask for packed float32/int32 arrays (`engine.wire`; Alloy's embedded engine answers with
        them, SGLang ignores the `Accept` header and answers JSON, which is then parsed vectorised).
        """
        single = bool(input_ids) and not isinstance(input_ids[0], list)
        seqs: list[list[int]] = [input_ids] if single else list(input_ids)  # type: ignore[list-item]
        starts = [start] * len(seqs) if isinstance(start, int) else list(start)
        if not seqs or len(starts) != len(seqs):
            raise ValueError(f"score got {len(seqs)} sequences and {len(starts)} starts")
        for i, (s, st) in enumerate(zip(seqs, starts)):
            if not 1 <= st <= len(s):
                raise ValueError(f"sequence {i}: start={st} must be in [1, len(input_ids)={len(s)}] "
                                 "(position 0 has no log-prob)")
        lsl = [st - 1 for st in starts]
        payload: dict[str, Any] = {
            "input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": lsl[0] if len(set(lsl)) == 1 else lsl,
            "top_logprobs_num": int(top_k),
        }
        body = await self.request("POST", "/generate", payload, accept=wire.ACCEPT if binary else None)
        try:
            if isinstance(body, bytes):
                out = parse_score_batch(_binary_items(body, len(seqs)), seqs, starts, int(top_k))
            elif not isinstance(body, list) or len(body) != len(seqs):
                got = len(body) if isinstance(body, list) else type(body).__name__
                raise EngineResponseError(f"/generate (score) returned {got} results for a batch of {len(seqs)}")
            else:
                out = [parse_score(o, s, st, int(top_k)) for o, s, st in zip(body, seqs, starts)]
        except EngineResponseError:
            self._counts["errors"] += 1
            raise
        return out[0] if single else out

    # -- reward models and chat models ---------------------------------------------------------------------------
    async def classify_logits(self, inputs: Sequence[str] | Sequence[Sequence[int]], *,
                              batch_size: int = CLASSIFY_BATCH) -> list[list[float]]:
        """Each input's classification logits from a reward-model server's `POST /classify` (SGLang's native shape,
        so the embedded server and a real SGLang `--is-embedding` server both answer): `inputs` all texts (str,
        tokenized by the server) or all token-id lists. Sent `batch_size` inputs per request, the requests at
        once; the answer in input order. Raises `EngineRequestError` if the server refuses (a generation server:
        400), `EngineResponseError` on a malformed answer."""
        items = list(inputs)
        if not items:
            return []
        texts = all(isinstance(x, str) for x in items)
        if not texts and not all(isinstance(x, Sequence) and not isinstance(x, str) and len(x)
                                 and all(isinstance(t, numbers.Integral) for t in x) for x in items):
            raise ValueError("classify: inputs must be all strings or all non-empty lists of token ids")
        if batch_size < 1:
            raise ValueError(f"classify: batch_size must be >= 1, got {batch_size}")

        async def one(chunk: list) -> list[list[float]]:
            payload = {"text": chunk} if texts else {"input_ids": [list(map(int, x)) for x in chunk]}
            body = await self.request("POST", "/classify", payload)
            try:
                return parse_classify(body, len(chunk))
            except EngineResponseError:
                self._counts["errors"] += 1
                raise

        chunks = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
        return [row for part in await asyncio.gather(*(one(c) for c in chunks)) for row in part]

    async def classify(self, inputs: Sequence[str] | Sequence[Sequence[int]], *,
                       batch_size: int = CLASSIFY_BATCH) -> list[float]:
        """A reward model's score of each input: logit 0 of `classify_logits` (SGLang: `response["embedding"][0]`)."""
        return [row[0] for row in await self.classify_logits(inputs, batch_size=batch_size)]

    def _openai_url(self, path: str) -> str:
        """`path` under the server's OpenAI API: `{base}/v1{path}`, or `{base}{path}` when the base URL already
        ends in /v1 (as OpenAI-compatible URLs are often given)."""
        return path if self.base_url.endswith("/v1") else f"/v1{path}"

    async def chat(self, messages: Sequence[dict], *, model: str | None = None, max_tokens: int | None = 256,
                   temperature: float = 0.0, top_p: float = 1.0, stop: str | Sequence[str] | None = None,
                   seed: int | None = None, extra: dict | None = None,
                   retry_statuses: frozenset[int] = CHAT_RETRY_STATUSES) -> ChatReply:
        """One non-streaming `POST /v1/chat/completions` ({role, content} messages → the first choice's text, its
        finish_reason and the usage) on any OpenAI-compatible server: the embedded server (chat template applied
        there), SGLang, vLLM or a hosted API. The API key goes as `Authorization: Bearer`. `model`: the served
        model's name (None: "default"; the embedded server and SGLang answer whatever the name), `max_tokens`
        None: the server's default. `extra`: more body fields as is. Retries 429 besides 502/503/504
        (`retry_statuses`: another set, e.g. the anti-hack judge's 429 and every 5xx).
        Raises `EngineRequestError` if refused (a reward-model server, a model without a chat template: 400
        with the reason), `EngineResponseError` if the answer has no text."""
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("chat: messages must be a non-empty list of {role, content} dicts")
        payload: dict[str, Any] = {"model": model or "default", "messages": list(messages),
                                   "temperature": float(temperature), "top_p": float(top_p), "stream": False}
        if max_tokens is not None:
            payload["max_tokens"] = int(max_tokens)
        if stop:
            payload["stop"] = [stop] if isinstance(stop, str) else [str(x) for x in stop]
        if seed is not None:
            payload["seed"] = int(seed)
        payload.update(extra or {})
        body = await self.request("POST", self._openai_url("/chat/completions"), payload,
                                  retry_statuses=retry_statuses)
        try:
            return parse_chat_reply(body)
        except EngineResponseError:
            self._counts["errors"] += 1
            raise

    # -- control endpoints --------------------------------------------------------------------------------------
    async def health(self) -> bool:
        """One `GET /health` attempt, no retries: True iff 200."""
        try:
            await self.request("GET", "/health", retries=0, timeout=min(self.timeout, 5.0))
            return True
        except EngineError:
            return False

    async def wait_healthy(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        """Poll `/health` until 200; raise `EngineUnavailable` after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.health():
            if loop.time() >= deadline:
                raise EngineUnavailable(f"{self.base_url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(interval)

    async def model_info(self) -> dict:
        """`GET /get_model_info` → {model_path, tokenizer_path, is_generation, weight_version, ...}."""
        return await self.request("GET", "/get_model_info")

    async def update_weights(self, path: str, version: str | None = None, flush_cache: bool = True,
                             abort_all: bool = False) -> dict:
        """Load new weights from a checkpoint dir on the server's disk; raises `EngineRequestError` if refused."""
        payload: dict[str, Any] = {"model_path": str(path), "flush_cache": flush_cache, "abort_all_requests": abort_all}
        if version is not None:
            payload["weight_version"] = str(version)
        body = await self.request("POST", "/update_weights_from_disk", payload)
        if not (isinstance(body, dict) and body.get("success")):
            msg = body.get("message") if isinstance(body, dict) else body
            raise EngineRequestError(200, f"update_weights_from_disk({path}) refused: {msg}", self.base_url)
        return body

    async def update_weights_from_buffer(self, path: str | None = None, data: bytes | None = None,
                                         version: str | None = None, flush_cache: bool = True,
                                         abort_all: bool = False) -> dict:
        """Copy a weight buffer (engine/weight_buffer.py) into the live embedded server's model in place:
        `path` names a buffer file on the server's machine, or `data` is the buffer itself (sent as the body).
        `version` None: the buffer's own. Raises `EngineRequestError` if refused."""
        if (path is None) == (data is None):
            raise ValueError("update_weights_from_buffer: give exactly one of path or data")
        opts: dict[str, Any] = {"flush_cache": flush_cache, "abort_all_requests": abort_all}
        if version is not None:
            opts["weight_version"] = str(version)
        if path is not None:
            what = str(path)
            body = await self.request("POST", "/update_weights_from_buffer", {"path": what, **opts})
        else:
            what = f"a {len(data)}-byte buffer"
            query = urllib.parse.urlencode({k: (str(v).lower() if isinstance(v, bool) else v) for k, v in opts.items()})
            body = await self.request("POST", f"/update_weights_from_buffer?{query}", data=data)
        if not (isinstance(body, dict) and body.get("success")):
            msg = body.get("message") if isinstance(body, dict) else body
            raise EngineRequestError(200, f"update_weights_from_buffer({what}) refused: {msg}", self.base_url)
        return body

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (by rid) or all; pending `/generate` calls return partial output ("abort")."""
        await self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": bool(abort_all)})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache", {})
