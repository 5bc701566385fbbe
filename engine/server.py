"""Alloy's embedded engine server: the SGLang native HTTP API (subset) over a HF causal LM on CPU or a CUDA GPU, and
its OpenAI-compatible endpoints; or, for a sequence-classification checkpoint, a reward model on SGLang's /classify.

    python -m engine.server --model DIR --port P [--host 127.0.0.1] [--api-key KEY] [--max-running-requests 256]
        [--max-total-tokens N] [--log-level info] [--weight-version V] [--threads T] [--weights-buffer PATH]
        [--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16] [--mem-fraction-static F]
        [--max-logprob-entries N] [--weight-buffer-dir DIR ...]

Device and dtype (engine/device.py): auto = CUDA in bfloat16 when torch sees a GPU, else CPU in float32; weights,
KV cache and sampling all live there. `--mem-fraction-static F` (SGLang's name; CUDA only) caps this process's
CUDA allocator at F of the GPU's memory, so several servers can share one GPU by the placement plan's fractions;
a model that does not fit its fraction after load and warm-up fails to load (exit 1, a message naming
mem_fraction_static, the GB needed and allowed). /get_server_info reports `device`, `dtype` and, on CUDA, the
process's peak/current memory (`cuda_max_memory_allocated_bytes`, `cuda_memory_reserved_bytes`).

Endpoints (docs/architecture.md, "The engine protocol"): POST /generate, GET /health, GET /health_generate,
GET /get_model_info, GET /get_server_info, POST /update_weights_from_disk, POST /update_weights_from_buffer,
POST /abort_request, POST /flush_cache, and SGLang's in-memory weight updates (engine/sglang_updates.py): POST
/update_weights_from_tensor (CUDA IPC / shared-memory handles), POST /init_weights_update_group, POST
/update_weights_from_distributed, POST /destroy_weights_update_group; OpenAI's POST /v1/chat/completions, POST
/v1/completions and GET /v1/models (engine/openai_routes.py). A reward-model checkpoint (config architecture
`...ForSequenceClassification`) is served instead on POST /classify and POST /v1/classify (engine/classify.py,
engine/reward_model.py) beside /health*, /get_model_info (`is_generation: false`), /get_server_info and /v1/models;
its /generate, /v1/chat/completions, /v1/completions and weight updates are 400 naming why (and a generation
server's /classify likewise).
The port is bound at once; /health and /health_generate answer 503 until the model is loaded (then 200), and
/generate answers 503 meanwhile (clients retry 503). If the model fails to load, the process exits with status 1
(as SGLang does), so a launcher sees the failure instead of a server that answers 503 forever.

Auth as in SGLang (`srt/utils/auth.py`): with `--api-key`, every path requires `Authorization: Bearer KEY`
(or `x-api-key: KEY`) except paths starting with /health, /ready, /metrics (probes carry no secrets); a miss is
HTTP 401 with SGLang's body `{"error": "Unauthorized"}`. Every other error is `{"error": {"message": ...}}` with a
4xx status that names the bad field. Continuous batching lives in `engine.scheduler`; request validation
and response shapes in `engine.protocol`; the error and auth middlewares, the body limit and the bounded body
reads in `engine.request_guards`.

Hardening: a body over the limit (`--max-body-mb`, by default derived from --max-total-tokens, see
`engine.request_guards.body_limit_bytes`) is 413; an `application/octet-stream` weight buffer
(/update_weights_from_buffer) may be as large as the model's state dict plus its header (`weight_buffer.state_bytes`). A client gets `--read-timeout-s` (30 s) to send a request's headers, counted from the
connection's start or the end of its previous response (a connection whose next request's headers are not complete
by then is closed: `engine.header_deadline`'s own per-connection timer, as aiohttp's `keepalive_timeout` misses a
connection's first request before aiohttp 3.14.4), and again as long for its body (408, then the connection is closed);
the response itself (a long /generate) has no time limit. Header lines over 8190 bytes or over 128 headers are
400 (aiohttp's defaults). Bound to a non-loopback address without an API key, the server logs a WARNING.
A /generate whose answer would carry over --max-logprob-entries (log-prob, id) entries is 400 (engine.protocol);
/update_weights_from_buffer reads only regular files inside --weight-buffer-dir (engine.buffer_paths).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import sys
import time
import uuid
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from engine import wire
from engine.buffer_paths import buffer_dirs, check_buffer_path
from engine.client import API_KEY_ENV
from engine.header_deadline import serve
from engine.protocol import (GC_PAUSE_PAIRS, Limits, ProtocolError, SamplingSpec, SeqSpec, TokenText, build_output,
                                   gc_paused, logprob_pairs, parse_generate)
# body_limit_bytes and is_loopback are part of this module's API too (imported from here by callers and tests)
from engine.device import (DTYPE_ALIASES, DTYPE_CHOICES, DeviceError, check_device_name, check_mem_fraction, dtype_name,
                           memory_info)
from engine.request_guards import (BODY_BYTES_PER_SEQ, BODY_BYTES_PER_TOKEN, LIMITS, auth_middleware, body_limit_bytes,
                                   buffer_body, errors_middleware, is_loopback, json_body)
from engine.classify import add_routes as add_classify_routes
from engine.classify import checkpoint_architecture, is_classifier_checkpoint, refusal
from engine.openai_routes import add_model_route
from engine.openai_routes import add_routes as add_openai_routes
from engine.reward_model import RewardModel
from engine.scheduler import Engine, Seq
from engine.seq_waits import WAKEUPS, resolver, run_seqs, seq_updates
from engine.sglang_updates import add_routes as add_sglang_update_routes
from infra.choices import (MAX_LOGPROB_ENTRIES, MAX_PREFILL_TOKENS, MAX_RUNNING_REQUESTS, MAX_TOTAL_TOKENS,
                           READ_TIMEOUT_S)

log = logging.getLogger("alloy.engine.server")

ENGINE = web.AppKey("engine", Engine)
TOKEN_TEXT = web.AppKey("token_text", dict)
HEALTH_CHECK_TIMEOUT_S = 20.0
# max_running_requests: running sequences (default and its rationale in infra.choices); admission is
# bounded by max_total_tokens (reserved prompt + max_new_tokens) anyway.
DEFAULTS = dict(max_running_requests=MAX_RUNNING_REQUESTS, max_total_tokens=MAX_TOTAL_TOKENS,
                max_prefill_tokens=MAX_PREFILL_TOKENS, threads=None, weight_version="default", seed=0, max_body_mb=None,
                max_seqs=4096, read_timeout_s=READ_TIMEOUT_S, weights_buffer=None, device="auto", dtype="auto",
                mem_fraction_static=None, max_logprob_entries=MAX_LOGPROB_ENTRIES, weight_buffer_dirs=None,
                decode_path=None, cuda_graph=None, served_model_name=None)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _engine_ready(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if not engine.ready.is_set():
        if engine.load_error:
            raise ProtocolError(f"the model failed to load: {engine.load_error}", status=503)
        raise ProtocolError("the server is still loading the model", status=503)
    return engine


def _limits(engine: Engine, app: web.Application) -> Limits:
    return Limits(vocab_size=engine.vocab_size, context_len=engine.context_len,
                  max_total_tokens=engine.max_total_tokens, max_seqs=app[LIMITS]["max_seqs"],
                  max_logprob_entries=app[LIMITS]["max_logprob_entries"])


def _token_text(app: web.Application, engine: Engine) -> TokenText:
    cache = app[TOKEN_TEXT]
    if "tt" not in cache:
        cache["tt"] = TokenText(engine.tokenizer)
    return cache["tt"]


# -- handlers -------------------------------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    engine = _engine_ready(request)
    t0 = time.perf_counter()
    req = parse_generate(await json_body(request), engine.tokenizer, _limits(engine, request.app))
    seqs = [Seq(spec) for spec in req.seqs]
    if req.stream:
        return await _stream(request, engine, req.is_single, seqs)
    await run_seqs(request, engine, seqs)
    tt = _token_text(request.app, engine)
    if wire.wants_binary(request.headers.get("Accept")) and not any(s.spec.return_text_in_logprobs for s in seqs):
        # packed float32/int32 log-probs (engine.wire), only for a client that asks; SGLang's JSON otherwise
        body = wire.build_binary(engine.tokenizer, [(s.spec, s.result, s.e2e_latency) for s in seqs],
                                 engine.weight_version, tt, req.is_single)
        return web.Response(body=body, content_type=wire.CONTENT_TYPE)
    with gc_paused(sum(logprob_pairs(s.spec, s.result) for s in seqs) >= GC_PAUSE_PAIRS):
        outs = [build_output(engine.tokenizer, s.spec, s.result, engine.weight_version, s.e2e_latency, tt) for s in seqs]
        resp = web.json_response(outs[0] if req.is_single else outs, dumps=_dumps)
    log.debug("POST /generate %s: %d seq(s), %d prompt / %d output tokens, %.3fs", seqs[0].spec.rid, len(seqs),
              sum(len(s.spec.input_ids) for s in seqs), sum(len(s.result.output_ids) for s in seqs),
              time.perf_counter() - t0)
    return resp


async def _stream(request: web.Request, engine: Engine, is_single: bool, seqs: list[Seq]) -> web.StreamResponse:
    """SSE like SGLang: `data: {...}\\n\\n` chunks with the cumulative text/output_ids/meta_info of one sequence
    (with "index" for a batch), finish_reason null until its last chunk, then `data: [DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    tt = _token_text(request.app, engine)
    async with aclosing(seq_updates(engine, seqs)) as updates:  # closing it aborts what has not finished
        async for latest in updates:
            for i, n in latest.items():
                s = seqs[i]
                obj = build_output(engine.tokenizer, s.spec, s.result, engine.weight_version,
                                   s.e2e_latency if n is None else None, tt, upto=n)
                if not is_single:
                    obj["index"] = i
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].ready.is_set() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """200 once a one-token greedy generation goes through the scheduler (as SGLang), 503 while loading/stuck; on a
    reward model, once a one-token input is scored."""
    engine = request.app[ENGINE]
    if not engine.ready.is_set():
        return web.Response(status=503)
    if not engine.is_generation:
        try:
            await asyncio.wait_for(engine.score([(0,)]), HEALTH_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)
    spec = SeqSpec(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=(0,),
                   sampling=SamplingSpec(max_new_tokens=1, temperature=0.0), logprob_start=0)
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    seq = Seq(spec, on_done=resolver(request, fut))
    engine.submit([seq])
    try:
        await asyncio.wait_for(fut, HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        engine.abort_seqs([seq], "health check timed out")
        return web.Response(status=503)
    ok = (seq.result.finish_reason or {}).get("type") != "abort"
    return web.Response(status=200 if ok else 503)


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]  # is_generation: false for a reward model, as SGLang reports embedding models
    return web.json_response({"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                              "is_generation": engine.is_generation, "weight_version": engine.weight_version})


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) of this server process, every thread (benchmarks read it)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def get_server_info(request: web.Request) -> web.Response:
    engine = _engine_ready(request)
    if not engine.is_generation:  # a reward model (engine/reward_model.py): its batching limits and counters
        return web.json_response({
            "model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path, "version": "alloy-embedded",
            "weight_version": engine.weight_version, "is_generation": False, **engine.server_info(),
            "process_cpu_seconds": round(process_cpu_seconds(), 6), "device": str(engine.device),
            "dtype": dtype_name(engine.dtype), "mem_fraction_static": engine.mem_fraction_static,
            **memory_info(engine.device)})
    return web.json_response({
        "model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path, "weight_version": engine.weight_version,
        "max_running_requests": engine.max_running_requests, "max_total_tokens": engine.max_total_tokens,
        "context_length": engine.context_len, "vocab_size": engine.vocab_size, "version": "alloy-embedded",
        "decode_steps": engine.steps, "decode_rows": engine.decode_rows, "bucketed_decode_steps": engine.bucketed_steps,
        "decode_segments": engine.decode_segments, "decode_holes": engine.decode_holes,
        "prefill_forwards": engine.prefill_forwards, "prefill_tokens": engine.prefill_tokens,
        "prefill_padded_tokens": engine.prefill_padded_tokens, "prefill_seconds": round(engine.prefill_seconds, 6),
        "decode_seconds": round(engine.decode_seconds, 6), "engine_cpu_seconds": round(engine.engine_cpu_seconds, 6),
        "idle_seconds": round(engine.idle_seconds, 6), "process_cpu_seconds": round(process_cpu_seconds(), 6),
        "device": str(engine.device), "dtype": dtype_name(engine.dtype),
        "mem_fraction_static": engine.mem_fraction_static, **memory_info(engine.device),
        "decode_path": "static" if engine._static else "segments", "decode_cpu_seconds": round(engine.decode_cpu_seconds, 6),
        **engine.graph_info(),
    })


async def _weights_request(request: web.Request, path_key: str, hint: str = "") -> tuple[str, str | None, bool]:
    """(path, weight_version, abort_all_requests) of a JSON weight-update body, each field checked."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    path = body.get(path_key)
    if not isinstance(path, str) or not path:
        raise ProtocolError(f"{path_key} must be a non-empty string{hint}")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ProtocolError("weight_version must be a string or null")
    for key in ("flush_cache", "abort_all_requests"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ProtocolError(f"{key} must be true or false")
    return path, version, bool(body.get("abort_all_requests", False))


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = _engine_ready(request)
    path, version, abort_all = await _weights_request(request, "model_path")
    fut = engine.update_weights(path, version, abort_all=abort_all)
    success, message = await asyncio.wrap_future(fut)
    log.info("update_weights_from_disk %s: success=%s %s", path, success, message)
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0},
                             status=200 if success else 400)


def _flag(value: str | None, key: str) -> bool | None:
    if value is None:
        return None
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ProtocolError(f"{key} must be true or false, got {value!r}")


async def update_weights_from_buffer(request: web.Request) -> web.Response:
    """New weights as a weight buffer (engine/weight_buffer.py), copied into the live model in place: a JSON
    body {"path", "weight_version"?, "flush_cache"?, "abort_all_requests"?} names a buffer file on this machine
    (a regular file inside --weight-buffer-dir, else 400: engine/buffer_paths.py);
    an `application/octet-stream` body is the buffer itself (options then in the query string). Without a
    weight_version the buffer's own is used. Ordering as /update_weights_from_disk."""
    from engine.weight_buffer import WeightBufferError, read_buffer

    engine = _engine_ready(request)
    loop = asyncio.get_running_loop()
    if request.headers.get("Content-Type", "").split(";")[0].strip().lower() == "application/octet-stream":
        q = request.query
        version, abort_all = q.get("weight_version"), _flag(q.get("abort_all_requests"), "abort_all_requests")
        _flag(q.get("flush_cache"), "flush_cache")
        source: Any = await buffer_body(request, engine)
        what = f"a {len(source)}-byte body"
    else:
        path, version, abort_all = await _weights_request(
            request, "path", " (or send the buffer as application/octet-stream)")
        source = check_buffer_path(path, request.app[LIMITS]["buffer_dirs"])  # 400 outside the buffer dirs
        what = path
    try:
        buf_version, tensors = await loop.run_in_executor(None, read_buffer, source)
    except (OSError, WeightBufferError) as e:
        message = f"Failed to read the weight buffer {what}: {type(e).__name__}: {e}"
        log.info("update_weights_from_buffer %s: success=False %s", what, message)
        return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
    fut = engine.update_weights_from_tensors(tensors, version if version is not None else buf_version,
                                             abort_all=bool(abort_all), source=f"weight buffer {what}")
    success, message = await asyncio.wrap_future(fut)
    log.info("update_weights_from_buffer %s: success=%s %s", what, success, message)
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0},
                             status=200 if success else 400)


async def abort_request(request: web.Request) -> web.Response:
    engine = _engine_ready(request)
    body = await json_body(request, allow_empty=True)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("rid must be a string")
    if not isinstance(abort_all, bool):
        raise ProtocolError("abort_all must be true or false")
    if abort_all or rid:
        engine.abort(rid or None, abort_all=abort_all)
    log.debug("abort_request rid=%r abort_all=%s", rid, abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    # The embedded engine keeps no prefix cache across requests, so there is nothing to flush.
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be performed.)\n")


# -- app ------------------------------------------------------------------------------------------------------------
def build_app(model_dir: str, api_key: str | None = None, **limits) -> web.Application:
    """The aiohttp app. `limits`: max_running_requests, max_total_tokens, max_prefill_tokens, threads,
    weight_version, seed, max_body_mb, max_seqs, device, dtype, mem_fraction_static, max_logprob_entries,
    weight_buffer_dirs, served_model_name (defaults in DEFAULTS). A checkpoint whose config names a
    `...ForSequenceClassification` architecture is served as a reward model (engine/reward_model.py, /classify);
    any other as a generation model (engine/scheduler.py, /generate and the OpenAI endpoints). The
    engine thread starts (and loads the model) on app startup. A device/dtype/fraction the engine cannot use raises
    `engine.device.DeviceError` here."""
    unknown = set(limits) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"build_app got unknown limits {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **{k: v for k, v in limits.items() if v is not None}}
    cfg["body_limit"] = (int(cfg["max_body_mb"] * 2**20) if cfg["max_body_mb"] is not None
                         else body_limit_bytes(cfg["max_total_tokens"], cfg["max_seqs"]))
    cfg["buffer_dirs"] = buffer_dirs(cfg["weight_buffer_dirs"])
    reward = is_classifier_checkpoint(model_dir)  # a ...ForSequenceClassification checkpoint: /classify
    if reward and cfg["weights_buffer"]:
        raise DeviceError("--weights-buffer: a reward model's weights are not updated by buffers")
    engine = (RewardModel(str(model_dir), max_total_tokens=cfg["max_total_tokens"],
                          max_prefill_tokens=cfg["max_prefill_tokens"], threads=cfg["threads"],
                          weight_version=cfg["weight_version"], device=cfg["device"], dtype=cfg["dtype"],
                          mem_fraction_static=cfg["mem_fraction_static"]) if reward else
              Engine(str(model_dir), max_running_requests=cfg["max_running_requests"],
                     max_total_tokens=cfg["max_total_tokens"], max_prefill_tokens=cfg["max_prefill_tokens"],
                     threads=cfg["threads"], weight_version=cfg["weight_version"], seed=cfg["seed"],
                     weights_buffer=cfg["weights_buffer"], device=cfg["device"], dtype=cfg["dtype"],
                     mem_fraction_static=cfg["mem_fraction_static"], decode_path=cfg["decode_path"],
                     cuda_graph=cfg["cuda_graph"]))
    middlewares = [errors_middleware] + ([auth_middleware(api_key)] if api_key else [])
    app = web.Application(client_max_size=cfg["body_limit"], middlewares=middlewares)
    app[ENGINE] = engine
    app[TOKEN_TEXT] = {}
    app[WAKEUPS] = {}
    app[LIMITS] = cfg
    for method in ("POST", "PUT"):
        app.router.add_route(method, "/abort_request", abort_request)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    if reward:  # engine/classify.py; what needs a generation model is a 400 that says so
        add_classify_routes(app, _engine_ready)
        add_model_route(app, _engine_ready)
        refuse = refusal(f"a reward model ({checkpoint_architecture(model_dir)})",
                         "it scores inputs on POST /classify (or /v1/classify); generation and weight updates "
                         "need a generation (causal LM) checkpoint")
        for path in GENERATION_ONLY:
            app.router.add_route("*", path, refuse)
        return _with_lifecycle(app, engine)
    for method in ("POST", "PUT"):
        app.router.add_route(method, "/generate", generate)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_buffer", update_weights_from_buffer)
    add_sglang_update_routes(app, _engine_ready)  # SGLang's tensor / distributed weight updates
    add_openai_routes(app, _engine_ready, _limits)  # /v1/chat/completions, /v1/completions, /v1/models
    refuse = refusal(f"a generation model ({checkpoint_architecture(model_dir) or 'causal LM'})",
                     "/classify needs a sequence-classification (reward model) checkpoint")
    for path in ("/classify", "/v1/classify"):
        app.router.add_route("*", path, refuse)
    return _with_lifecycle(app, engine)


def _with_lifecycle(app: web.Application, engine) -> web.Application:
    """Start the engine (and load the model) on app startup; abort and stop it on shutdown."""

    async def on_startup(_app):
        engine.start()

    async def on_shutdown(_app):
        log.info("shutting down: aborting in-flight requests")
        engine.abort(None, abort_all=True, message="server shutting down")

    async def on_cleanup(_app):
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        log.info("engine stopped")

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


# the paths of a generation server a reward-model server answers with a 400 naming why
GENERATION_ONLY = ("/generate", "/v1/chat/completions", "/v1/completions", "/update_weights_from_disk",
                   "/update_weights_from_buffer", "/update_weights_from_tensor", "/init_weights_update_group",
                   "/update_weights_from_distributed", "/destroy_weights_update_group")


def _default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    # One intra-op thread per spare core, keeping one core for the HTTP loop and tokenization: with every core in
    # the OpenMP pool, each forward waits at barriers for a thread the OS has descheduled (measured: 10x slower
    # steps on a busy 2-core box).
    return int(env) if env.isdigit() and int(env) > 0 else max(1, min(4, (os.cpu_count() or 2) - 1))


def main(argv: list[str] | None = None, prog: str = "python -m engine.server") -> None:
    """Run the server; `prog` is the name its --help and errors use (`alloy serve` from the CLI)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint dir (weights + tokenizer): a causal LM, or a "
                   "sequence-classification reward model (served on /classify)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (except /health*); default: "
                   "the ALLOY_ENGINE_API_KEY environment variable (keeps the key out of `ps`)")
    p.add_argument("--max-running-requests", type=int, default=DEFAULTS["max_running_requests"],
                   help="sequences decoded at once (the rest queue)")
    p.add_argument("--max-total-tokens", type=int, default=DEFAULTS["max_total_tokens"],
                   help="token budget (prompt + max_new_tokens) of the running batch; also the per-request cap")
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULTS["max_prefill_tokens"],
                   help="padded tokens per prefill/scoring forward")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default $OMP_NUM_THREADS, else cores - 1, at most 4)")
    p.add_argument("--weight-version", default=DEFAULTS["weight_version"])
    p.add_argument("--weights-buffer", default=None, metavar="PATH",
                   help="a weight buffer (engine/weight_buffer.py) copied into the model right after loading "
                        "--model; its version replaces --weight-version (how a supervisor restart keeps pushed weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--max-body-mb", type=float, default=DEFAULTS["max_body_mb"],
                   help="larger request bodies get HTTP 413; default: the largest request the protocol accepts, "
                        f"--max-total-tokens x {BODY_BYTES_PER_TOKEN} B (a token id as JSON, or text) + 4096 "
                        f"sequences x {BODY_BYTES_PER_SEQ} B (rid, sampling_params) + 1 MiB "
                        f"(6 MiB at the default --max-total-tokens)")
    p.add_argument("--max-logprob-entries", type=int, default=DEFAULTS["max_logprob_entries"], metavar="N",
                   help="a /generate whose answer would carry more (log-prob, id) entries, positions x (1 + "
                        "top_logprobs_num + len(token_ids_logprob)) summed over its sequences, is HTTP 400")
    p.add_argument("--weight-buffer-dir", action="append", default=None, metavar="DIR", dest="weight_buffer_dirs",
                   help="/update_weights_from_buffer reads only regular files inside DIR (repeatable; default "
                        "/dev/shm, where trainers write their buffers); other paths are HTTP 400")
    p.add_argument("--read-timeout-s", type=float, default=DEFAULTS["read_timeout_s"],
                   help="seconds a client gets to send a request's headers (from connect or its previous response) "
                        "and again for its body; a stalled request is dropped (the response time is not limited)")
    p.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N: "
                   "where the weights, KV cache and sampling live")
    p.add_argument("--dtype", default="auto", help=f"{' | '.join(DTYPE_CHOICES)}: the weights' dtype (auto: bfloat16 "
                   "on cuda, float32 on cpu)")
    p.add_argument("--mem-fraction-static", type=float, default=None, metavar="F",
                   help="CUDA only (SGLang's name): cap this process at F of the GPU's memory (several servers share "
                        "one GPU by the placement plan's fractions); refuse to start if the model and warm-up need "
                        "more. Ignored on cpu")
    p.add_argument("--decode-path", default=None, choices=["auto", "static", "segments"],
                   help="Llama/Qwen2 decode steps: static (one preallocated KV pool, fixed-shape steps, CUDA graphs on "
                        "a GPU), segments (growing per-width caches, the CPU's fastest) or auto (static on cuda; "
                        "default, or $ALLOY_ENGINE_DECODE_PATH)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="SGLang's name: run the static decode step eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="SGLang's name: the model id /v1/models lists and the /v1 answers carry (default: --model)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_running_requests < 1 or args.max_total_tokens < 2 or args.max_prefill_tokens < 1:
        p.error("--max-running-requests, --max-total-tokens and --max-prefill-tokens must be positive")
    if not args.read_timeout_s > 0 or (args.max_body_mb is not None and not args.max_body_mb > 0):
        p.error("--read-timeout-s and --max-body-mb must be positive")
    if args.max_logprob_entries < 1:
        p.error("--max-logprob-entries must be positive")
    args.dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)  # fp32 / bf16 / fp16: the trainers' names work too
    if args.dtype not in DTYPE_CHOICES:
        p.error(f"--dtype must be one of {' | '.join(DTYPE_CHOICES)} (or {', '.join(DTYPE_ALIASES)}), "
                f"got {args.dtype!r}")
    try:
        check_device_name(args.device)
        check_mem_fraction(args.mem_fraction_static)
    except DeviceError as e:
        p.error(str(e).replace("mem_fraction_static", "--mem-fraction-static (mem_fraction_static)", 1)
                .replace("device must", "--device must", 1))
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        app = _build_main_app(args)
    except DeviceError as e:  # e.g. --device cuda on a machine without CUDA: fail fast, before binding the port
        p.exit(2, f"{prog}: error: {e}\n")
    engine = app[ENGINE]
    if engine.mem_fraction_static is not None and engine.device.type != "cuda":
        log.info("--mem-fraction-static %g ignored: the engine runs on %s", engine.mem_fraction_static, engine.device)
    _serve(app, args)


def _build_main_app(args) -> web.Application:
    return build_app(args.model, api_key=args.api_key, max_running_requests=args.max_running_requests,
                    max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
                    threads=args.threads or _default_threads(), weight_version=args.weight_version, seed=args.seed,
                    max_body_mb=args.max_body_mb, read_timeout_s=args.read_timeout_s,
                    weights_buffer=args.weights_buffer, device=args.device, dtype=args.dtype,
                    mem_fraction_static=args.mem_fraction_static, max_logprob_entries=args.max_logprob_entries,
                    weight_buffer_dirs=args.weight_buffer_dirs, decode_path=args.decode_path,
                    cuda_graph=False if args.disable_cuda_graph else None, served_model_name=args.served_model_name)


def _serve(app: web.Application, args) -> None:
    """Run `app` until SIGTERM/SIGINT; exit 1 if the model failed to load."""
    engine = app[ENGINE]
    watchers: list[asyncio.Task] = []

    async def exit_on_load_failure(_app):
        # Like SGLang: a model that cannot load is fatal (exit non-zero) so launchers fail fast instead of polling
        # a server that answers 503 forever. GracefulExit (a SystemExit) raised from a loop callback stops `serve`
        # cleanly, exactly as aiohttp's own SIGTERM handler does (raised in a task it would also log a traceback).
        def graceful_exit():
            raise web.GracefulExit()

        async def watch():
            while not engine.ready.is_set():
                if engine.load_error is not None:
                    log.error("model failed to load, exiting: %s", engine.load_error)
                    asyncio.get_running_loop().call_soon(graceful_exit)
                    return
                await asyncio.sleep(0.05)
        watchers.append(asyncio.create_task(watch()))  # keep a reference: the loop holds tasks only weakly

    app.on_startup.append(exit_on_load_failure)
    log.info("alloy engine server on http://%s:%d (model %s on %s in %s, api key %s, body limit %d bytes, "
             "read timeout %g s, answers up to %d log-prob entries, weight buffers from %s)", args.host, args.port,
             args.model, engine.device, dtype_name(engine.dtype), "on" if args.api_key else "off",
             app[LIMITS]["body_limit"], args.read_timeout_s, app[LIMITS]["max_logprob_entries"],
             ", ".join(app[LIMITS]["buffer_dirs"]))
    if not args.api_key and not is_loopback(args.host):
        log.warning("listening on %s:%d, which is not a loopback address, WITHOUT an API key: anyone who can reach "
                    "it can generate, abort requests and load weights from any path (/update_weights_from_disk). "
                    "Set --api-key or %s (engine.api_key in the pipeline config), or bind --host 127.0.0.1",
                    args.host, args.port, API_KEY_ENV)
    # serve (like web.run_app) turns SIGTERM/SIGINT into a graceful shutdown: on_shutdown aborts in-flight requests
    # (they return their partial output), on_cleanup joins the engine thread. It also holds the header deadline
    # (engine.header_deadline): a connection whose next request's headers have not arrived --read-timeout-s after it
    # opened or the app finished its previous request is closed (an idle one, or half-sent headers).
    serve(app, args.host, args.port, args.read_timeout_s, shutdown_timeout=5.0)
    if engine.load_error is not None:
        sys.exit(1)
    log.info("server stopped")


if __name__ == "__main__":
    main()
