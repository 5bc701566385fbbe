"""What the embedded engine server (engine/server.py) does to a request around its handler: bounds and checks.

- `errors_middleware`: every failure becomes a JSON error (`{"error": {"message": ...}}`, a 4xx naming the bad
  field, or a logged 500); a stalled body's 408 also drops the connection.
- `auth_middleware`: the API key as SGLang checks it (`Authorization: Bearer KEY` or `x-api-key: KEY`, probes under
  /health, /ready, /metrics exempt; a miss is 401 `{"error": "Unauthorized"}`).
- `body_limit_bytes`: the largest request body the protocol can need (its derivation below), the default of
  --max-body-mb; `json_body` and `buffer_body` read a JSON body or an octet-stream weight buffer within that limit
  (or the model's buffer size) and within --read-timeout-s.
- `is_loopback`: whether a bind address is reachable from this machine only (the server warns when a server
  reachable from elsewhere has no API key).

Split out of engine/server.py, which builds the app from these (and re-exports `body_limit_bytes`, `is_loopback`);
they log as the server does (`alloy.engine.server`). The app's limits (`LIMITS`) are set by `server.build_app`.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from engine.protocol import ProtocolError

if TYPE_CHECKING:
    from engine.scheduler import Engine

log = logging.getLogger("alloy.engine.server")

LIMITS = web.AppKey("limits", dict)  # the app's limits: `server.DEFAULTS` and what build_app was given, body_limit

# The body limit follows from what `protocol.parse_generate` accepts at all: a request over max_total_tokens tokens
# (prompts + max_new_tokens) or over max_seqs sequences is refused whatever its size, so the largest legitimate body
# is a scoring batch (max_new_tokens = 0) of max_total_tokens input ids split into max_seqs sequences. As JSON a
# token id takes at most 8 bytes ("151935, ": ids under 10^6); 16 bytes a token also covers a `text` prompt (about
# 2-3 JSON-escaped characters a token). Each sequence adds its rid (~45 bytes), a per-item sampling_params object
# (~250 bytes with stop_token_ids) and its logprob_start_len / top_logprobs_num (~20): 1 KiB. 1 MiB more for the
# top-level fields (a shared token_ids_logprob list of ~100k ids). The control endpoints' bodies are a few hundred
# bytes. Defaults (65536 tokens, 4096 seqs): 1 MiB + 4 MiB + 1 MiB = 6 MiB.
BODY_BYTES_PER_TOKEN, BODY_BYTES_PER_SEQ, BODY_BYTES_FIXED = 16, 1024, 2**20


def body_limit_bytes(max_total_tokens: int, max_seqs: int) -> int:
    """The largest request body the server reads (see the derivation above); larger ones get HTTP 413."""
    return max_total_tokens * BODY_BYTES_PER_TOKEN + max_seqs * BODY_BYTES_PER_SEQ + BODY_BYTES_FIXED


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can reach (127.0.0.0/8, ::1, "localhost"); wildcard binds
    (0.0.0.0, ::, "") and host names are not."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure becomes a JSON error; the server never answers a malformed request with a crash."""
    try:
        return await handler(request)
    except ProtocolError as e:
        log.debug("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        resp = _error(e.status, e.message)
        if e.status == 408:  # a stalled body: answer, then drop the connection now (no lingering read of the rest)
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        if e.status == 413:
            return _error(413, f"request body too large: {e.text} (the server's limit, --max-body-mb)")
        return _error(e.status, e.reason, allow)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - logged with traceback; the client gets a 500, the server lives on
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "internal server error (see the server log)")


def auth_middleware(api_key: str):
    key = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key)
        x_key = request.headers.get("x-api-key")
        ok = ok or (x_key is not None and secrets.compare_digest(x_key.encode(), key))
        if not ok:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


async def json_body(request: web.Request, allow_empty: bool = False) -> Any:
    limit, timeout = request.app[LIMITS]["body_limit"], request.app[LIMITS]["read_timeout_s"]
    if request.content_length is not None and request.content_length > limit:  # refuse before reading any of it
        raise ProtocolError(f"request body too large: {request.content_length} bytes, over the server's limit of "
                            f"{limit} bytes (--max-body-mb)", status=413)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()  # raises 413 over client_max_size (a chunked body has no Content-Length)
    except TimeoutError:
        log.warning("%s %s from %s: body not received within %.0f s; closing the connection", request.method,
                    request.path, request.remote, timeout)
        raise ProtocolError(f"request body not received within {timeout:g} s (--read-timeout-s)", status=408) from None
    if not raw.strip() and allow_empty:
        return {}
    try:
        return orjson.loads(raw)  # orjson: the engine's JSON is mostly long int/float lists; 5-10x the stdlib
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"invalid JSON body: {str(e)[:200]}") from None


async def buffer_body(request: web.Request, engine: Engine) -> bytearray:
    """An octet-stream body of at most the model's buffer size (`engine.state_bytes`), read in chunks; each chunk
    must arrive within --read-timeout-s (a large body over a slow link is fine, a stalled one is not)."""
    limit, timeout = engine.state_bytes, request.app[LIMITS]["read_timeout_s"]
    n = request.content_length
    if n is not None and n > limit:
        raise ProtocolError(f"weight buffer body too large: {n} bytes, over {limit} bytes (the model's weights and "
                            "a buffer header)", status=413)
    out = bytearray(n) if n is not None else bytearray()
    got = 0
    try:
        while True:
            async with asyncio.timeout(timeout):
                chunk = await request.content.readany()
            if not chunk:
                break
            if got + len(chunk) > limit:
                raise ProtocolError(f"weight buffer body too large: over {limit} bytes (the model's weights and a "
                                    "buffer header)", status=413)
            out[got:got + len(chunk)] = chunk
            got += len(chunk)
    except TimeoutError:
        raise ProtocolError(f"weight buffer body stalled for {timeout:g} s (--read-timeout-s)", status=408) from None
    if n is not None and got != n:
        raise ProtocolError(f"weight buffer body ended after {got} of {n} bytes")
    return out
