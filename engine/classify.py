"""Reward models on the embedded server: SGLang's `/classify` (and its vLLM-style `/v1/classify`), request parsing,
answers and the routes of a server whose checkpoint is a sequence-classification model.

A checkpoint whose `config.json` names a `...ForSequenceClassification` architecture (`is_classifier_checkpoint`)
is served by `engine.reward_model.RewardModel` instead of the generation engine. Checked against SGLang's source
(http_server.py `classify_request`, io_struct.EmbeddingReqInput, tokenizer_manager's BatchEmbeddingOutput branch,
openai/serving_classify.py):

- `POST /classify` takes an `EmbeddingReqInput`: exactly one of `text` (a str, or a list of str for a batch) or
  `input_ids` (a list of ints, or a list of lists); `rid` (a str, or one per input), `sampling_params` (a dummy in
  SGLang: ignored). Text is tokenized like /generate's (`tokenizer(text).input_ids`, special tokens as the
  tokenizer adds them). The answer is one object per input (a list, in order, for a batch):
  `{"embedding": [logit_0, ..., logit_{num_labels-1}], "meta_info": {"id", "finish_reason": {"type": "length",
  "length": 0}, "prompt_tokens", "completion_tokens": 0, "weight_version", "e2e_latency"}}`. A reward model's
  score is `embedding[0]` (num_labels = 1): the head's output where HF's forward reads it (the last token that is
  not the pad id; engine/reward_model.py says where that differs from SGLang). Cross-encoder pairs (`text` as a list of lists), images, audio and
  input embeddings are 400.
- `POST /v1/classify` (vLLM 0.7's shape): `{"model"?, "input": str | [str] | [int] | [[int]]}` →
  `{"id": "classify-…", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}],
  "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}`, `probs` the
  softmax of the logits and `label` the config's `id2label` of the largest (a 1-label reward model: probs [1.0];
  use /classify for its score).
- Limits as /generate's: every input shorter than the model's context, at most `max_seqs` inputs and
  `max_total_tokens` tokens in one request, ids inside the vocabulary; the body limit, API key and read timeouts
  are the server's middlewares (engine/request_guards.py).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.protocol import Limits, ProtocolError, _check_lengths, _prompts, _rids
from engine.request_guards import LIMITS, json_body

UNSUPPORTED = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path")
FINISHED = {"type": "length", "length": 0}  # what SGLang reports for a prefill-only (embedding/reward) request


def checkpoint_architecture(model_dir: str | Path) -> str | None:
    """`architectures[0]` of `model_dir/config.json`, or None (no readable config, or none named)."""
    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0] if archs and isinstance(archs[0], str) else None


def is_classifier_checkpoint(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a sequence-classification model (a reward model): served on /classify."""
    return (checkpoint_architecture(model_dir) or "").endswith("ForSequenceClassification")


@dataclass
class ClassifyRequest:
    """A parsed request: the token ids of each input (in answer order), their rids, and whether the answer is one
    object (a single input) or a list."""

    inputs: list[tuple[int, ...]]
    rids: list[str]
    is_single: bool


def _check_inputs(inputs: list[tuple[int, ...]], limits: Limits) -> None:
    if len(inputs) > limits.max_seqs:
        raise ProtocolError(f"the request has {len(inputs)} inputs, over the limit of {limits.max_seqs}")
    for i, ids in enumerate(inputs):
        _check_lengths(ids, 0, limits, "" if len(inputs) == 1 else f"[{i}]")
    total = sum(len(ids) for ids in inputs)
    if total > limits.max_total_tokens:
        raise ProtocolError(f"the request has {total} tokens, over the server's max_total_tokens="
                            f"{limits.max_total_tokens} (split the batch)")


def parse_classify(body: Any, tokenizer, limits: Limits) -> ClassifyRequest:
    """Validate a `/classify` body (SGLang's EmbeddingReqInput). Raises ProtocolError naming the field."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, [], ""):
            raise ProtocolError(f"{key} is not supported by the embedded engine's /classify")
    text = body.get("text")
    if isinstance(text, list) and any(isinstance(t, list) for t in text):
        raise ProtocolError("text as a list of lists (cross-encoder pairs) is not supported by the embedded engine: "
                            "send each pair joined as one string")
    if body.get("sampling_params") is not None and not isinstance(body["sampling_params"], (dict, list)):
        raise ProtocolError("sampling_params must be an object (ignored by /classify)")
    inputs, single = _prompts(body, tokenizer, limits.vocab_size)
    _check_inputs(inputs, limits)
    return ClassifyRequest(inputs=inputs, rids=_rids(body.get("rid"), len(inputs), single), is_single=single)


def parse_v1_classify(body: Any, tokenizer, limits: Limits) -> ClassifyRequest:
    """Validate a `/v1/classify` body (`input`: str, [str], [int] or [[int]]) into the same request."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ProtocolError("model must be a string")
    inp = body.get("input")
    if inp is None or inp == [] or inp == "":
        raise ProtocolError("input must be a non-empty string, list of strings, or list of token ids")
    key = "text" if isinstance(inp, str) or (isinstance(inp, list) and isinstance(inp[0], str)) else "input_ids"
    try:
        inputs, _ = _prompts({key: inp}, tokenizer, limits.vocab_size)
    except ProtocolError as e:
        raise ProtocolError(e.message.replace("text", "input", 1).replace("input_ids", "input", 1)) from None
    _check_inputs(inputs, limits)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("rid must be a string")
    return ClassifyRequest(inputs=inputs, rids=_rids(rid, len(inputs), len(inputs) == 1), is_single=False)


def classify_output(logits: list[float], rid: str, prompt_tokens: int, weight_version: str,
                    e2e_latency: float) -> dict:
    """SGLang's answer object for one input: `{"embedding": logits, "meta_info": {...}}`."""
    return {"embedding": list(logits), "meta_info": {
        "id": rid, "finish_reason": dict(FINISHED), "prompt_tokens": prompt_tokens, "completion_tokens": 0,
        "cached_tokens": 0, "weight_version": weight_version, "e2e_latency": e2e_latency}}


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def v1_classify_response(logits: list[list[float]], prompt_tokens: list[int], model: str,
                         id2label: dict[int, str]) -> dict:
    """The vLLM/SGLang `/v1/classify` answer for the inputs' logits (one list per input)."""
    data = []
    for i, row in enumerate(logits):
        probs = softmax(row)
        best = max(range(len(row)), key=row.__getitem__)
        data.append({"index": i, "label": id2label.get(best, f"LABEL_{best}"), "probs": probs,
                     "num_classes": len(probs)})
    n = sum(prompt_tokens)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                    "prompt_tokens_details": None}}


# -- routes -------------------------------------------------------------------------------------------------------
READY = web.AppKey("classify_ready", object)  # server._engine_ready: the app's model once loaded, else a 503


def _limits(model, app: web.Application) -> Limits:
    return Limits(vocab_size=model.vocab_size, context_len=model.context_len, max_total_tokens=model.max_total_tokens,
                  max_seqs=app[LIMITS]["max_seqs"], max_logprob_entries=app[LIMITS]["max_logprob_entries"])


async def _score(request: web.Request, parse) -> tuple[Any, ClassifyRequest, list[list[float]], float]:
    model = request.app[READY](request)
    t0 = time.perf_counter()
    req = parse(await json_body(request), model.tokenizer, _limits(model, request.app))
    logits = await model.score(req.inputs, req.rids)
    return model, req, logits, time.perf_counter() - t0


async def classify(request: web.Request) -> web.Response:
    """POST /classify (SGLang's native shape): one `{"embedding", "meta_info"}` per input."""
    model, req, logits, dt = await _score(request, parse_classify)
    outs = [classify_output(row, rid, len(ids), model.weight_version, dt)
            for row, rid, ids in zip(logits, req.rids, req.inputs)]
    return web.json_response(outs[0] if req.is_single else outs)


async def v1_classify(request: web.Request) -> web.Response:
    """POST /v1/classify (vLLM's shape): softmax probabilities and the top label per input."""
    model, req, logits, _ = await _score(request, parse_v1_classify)
    name = request.app[LIMITS].get("served_model_name") or model.model_path  # --served-model-name, as SGLang
    return web.json_response(v1_classify_response(logits, [len(ids) for ids in req.inputs], name, model.id2label))


def add_routes(app: web.Application, engine_ready) -> None:
    """/classify and /v1/classify (POST, and PUT as SGLang) on a reward-model server; `engine_ready(request)`: the
    app's `RewardModel` once loaded (else the server's 503)."""
    app[READY] = engine_ready
    for method in ("POST", "PUT"):
        app.router.add_route(method, "/classify", classify)
    app.router.add_post("/v1/classify", v1_classify)


def refusal(what: str, why: str):
    """A handler answering 400 on every call: an endpoint this server's kind of model cannot serve (`what` names the
    model, `why` the endpoint's need and where to go instead)."""
    async def refuse(request: web.Request) -> web.Response:
        raise ProtocolError(f"{request.method} {request.path}: this server serves {what}; {why}")
    return refuse
