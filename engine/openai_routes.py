"""The OpenAI-compatible endpoints of the embedded server (the protocol is engine/openai_api.py):

- `POST /v1/chat/completions`, `POST /v1/completions`: generation through the engine's scheduler, exactly as
  /generate's sequences (`engine.seq_waits.run_seqs`; streamed with `seq_updates`): whole answers, or with
  `stream: true` SSE `data: {chunk}` lines, a chat's first chunk per choice carrying the assistant role, each
  choice's last its finish_reason, then (with `stream_options.include_usage`) a usage chunk, then `data: [DONE]`.
- `GET /v1/models`: the served model (`--served-model-name`, default the model path), on a reward-model server too.
Errors are the server's (`{"error": {"message"}}` with a 4xx naming the field: the `openai` client raises its
`BadRequestError` / `AuthenticationError` on them).
"""
from __future__ import annotations

import time
from contextlib import aclosing

import orjson
from aiohttp import web

from engine.openai_api import (OpenAIRequest, chunk, parse_chat, parse_completion, response, streamable_text,
                               usage_chunk)
from engine.protocol import TokenText, output_text
from engine.request_guards import LIMITS, json_body
from engine.scheduler import Seq
from engine.seq_waits import run_seqs, seq_updates

READY = web.AppKey("openai_ready", object)  # server._engine_ready
LIMITS_OF = web.AppKey("openai_limits", object)  # server._limits(engine, app) -> protocol.Limits
TEXT = web.AppKey("openai_token_text", dict)


def model_name(request: web.Request, engine) -> str:
    """The name this server answers to (`--served-model-name`, else the model path, as SGLang)."""
    return request.app[LIMITS].get("served_model_name") or engine.model_path


def _token_text(request: web.Request, engine) -> TokenText:
    box = request.app[TEXT]
    if box.get("tok") is not engine.tokenizer:
        box["tok"], box["tt"] = engine.tokenizer, TokenText(engine.tokenizer)
    return box["tt"]


async def _answer(request: web.Request, parse) -> web.StreamResponse:
    engine = request.app[READY](request)
    req = parse(await json_body(request), engine.tokenizer, request.app[LIMITS_OF](engine, request.app))
    seqs = [Seq(spec) for spec in req.seqs]
    model = model_name(request, engine)
    if req.stream:
        return await _stream(request, engine, req, seqs, model)
    await run_seqs(request, engine, seqs)
    tt = _token_text(request, engine)
    texts = [output_text(engine.tokenizer, s.spec, s.result, token_text=tt) for s in seqs]
    body = response(req, model, texts, [s.result.finish_reason for s in seqs],
                    sum(len(s.result.output_ids) for s in seqs))
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _stream(request: web.Request, engine, req: OpenAIRequest, seqs: list, model: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    tt = _token_text(request, engine)
    sent = [""] * len(seqs)
    if req.kind == "chat":  # the role first, as OpenAI streams it
        for k in range(len(seqs)):
            await resp.write(_sse(chunk(req, model, k, "", role=True)))
    async with aclosing(seq_updates(engine, seqs)) as updates:  # closing it aborts what has not finished
        async for latest in updates:
            for k, n in latest.items():
                s = seqs[k]
                if n is None:  # finished: the final text (stop string and stop token trimmed)
                    text = output_text(engine.tokenizer, s.spec, s.result, token_text=tt)
                else:
                    text = streamable_text(output_text(engine.tokenizer, s.spec, s.result, upto=n, token_text=tt),
                                           s.spec.sampling.stop_strs)
                delta = text[len(sent[k]):] if text.startswith(sent[k]) else ""
                if delta:
                    sent[k] += delta
                if delta or n is None:
                    await resp.write(_sse(chunk(req, model, k, delta if (delta or req.kind != "chat") else None,
                                                s.result.finish_reason if n is None else None)))
    if req.include_usage:
        await resp.write(_sse(usage_chunk(req, model, sum(len(s.result.output_ids) for s in seqs))))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _answer(request, parse_chat)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _answer(request, parse_completion)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model, as SGLang lists it."""
    engine = request.app[READY](request)
    name = model_name(request, engine)
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "alloy", "root": name,
        "max_model_len": engine.context_len}]})


def add_model_route(app: web.Application, engine_ready) -> None:
    """GET /v1/models (every server); `engine_ready(request)`: the app's model once loaded, else the server's 503."""
    app[READY] = engine_ready
    app.router.add_get("/v1/models", models)


def add_routes(app: web.Application, engine_ready, limits) -> None:
    """The OpenAI-compatible endpoints of a generation server; `limits(engine, app)`: the request limits."""
    add_model_route(app, engine_ready)
    app[LIMITS_OF] = limits
    app[TEXT] = {}
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
