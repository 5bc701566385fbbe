"""OpenAI-compatible `/v1/chat/completions` and `/v1/completions` on the embedded server: request validation into the
engine's sequence specs, and the answers (whole, or as SSE chunks). Pure: no HTTP, no torch (the handlers are
engine/openai_routes.py; generation runs through the same scheduler as /generate).

Requests (OpenAI's fields; SGLang's extensions `top_k`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`):
- chat: `messages` [{role, content}], content a string or a list of `{"type": "text", "text"}` parts (joined with
  "\\n"); rendered with the tokenizer's chat template (`add_generation_prompt=True`, then tokenized without added
  special tokens: the template writes its own, as `infra.chat` renders every stage's prompts). A tokenizer without
  a chat template is a 400 naming it (no silent fallback: a model never sees a rendering it was not trained on);
  /v1/completions takes a raw prompt. The template's end-of-turn token (`infra.chat.end_of_turn_ids`) stops a
  chat answer besides the model's EOS ids.
- completions: `prompt` a string, a list of strings, a list of token ids or a list of such lists (one choice set
  per prompt; strings tokenized as /generate's `text`).
- `max_tokens` (or `max_completion_tokens`): default the most the context and the server's token budget leave:
  min(context - longest prompt - 1, (max_total_tokens - the request's prompt tokens) / its sequences).
  `temperature` (1.0; 0 is greedy), `top_p`, `n` (choices per prompt), `stop` (a string or a list; not part of the
  text), `seed` (choice j samples from its own generator seeded `seed + j`: reproducible whatever else runs),
  `stream`, `stream_options.include_usage`. Fields that would change sampling but are not implemented
  (`presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs`, `tools`, `response_format` other than text,
  `echo`, `suffix`, `best_of` > 1) are 400 at anything but their neutral value; other unknown fields are ignored,
  as OpenAI-compatible servers do.
Answers: OpenAI's objects with `usage` ({prompt_tokens: each prompt once, completion_tokens: every generated token,
stop token included, as /generate's meta_info counts them, total_tokens}) and `finish_reason` "stop" | "length"
(| "abort" when the server shut down under it).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import (MAX_N, MAX_STOP_STRS, Limits, ProtocolError, SamplingSpec, SeqSpec, _bool, _check_lengths,
                             _int, _num, _token_list)

# OpenAI fields we do not implement, with the value that means "off" (None is always fine)
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
           "tools": [], "functions": [], "echo": False, "suffix": "", "best_of": 1, "min_tokens": 0,
           "repetition_penalty": 1.0, "min_p": 0.0, "regex": "", "json_schema": "", "ebnf": ""}


@dataclass
class OpenAIRequest:
    """Sequences to run, prompt-major: sequence k is sample k % n of prompt k // n (= choice index k)."""

    kind: str  # "chat" | "completion"
    id: str
    seqs: list[SeqSpec]
    n: int
    prompt_tokens: int  # every prompt counted once (the usage's prompt_tokens)
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


# -- requests ---------------------------------------------------------------------------------------------------
def _check_neutral(body: dict) -> None:
    for key, off in NEUTRAL.items():
        v = body.get(key)
        if v is not None and v != off and not (key == "logprobs" and v == 0):
            raise ProtocolError(f"{key}={v!r:.60} is not supported by the embedded engine (only {off!r} or null)")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise ProtocolError("response_format: only {\"type\": \"text\"} is supported by the embedded engine")


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProtocolError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, "
                                    f"got {kind!r:.40} (the embedded engine reads text only)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ProtocolError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` checked and reduced to [{role, content}] (content as text)."""
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ProtocolError(f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ProtocolError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        out.append({"role": role, "content": "" if content is None else message_text(content, f"messages[{i}]")})
    return out


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The ids of `messages` rendered by the tokenizer's chat template with the assistant's turn opened."""
    from infra.chat import uses_template

    if not uses_template(tokenizer):
        raise ProtocolError("messages: the model's tokenizer has no chat template, so /v1/chat/completions cannot "
                            "render them (send a raw prompt to /v1/completions, or serve a checkpoint whose "
                            "tokenizer_config.json or chat_template.jinja has one)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. roles must alternate) names the problem
        raise ProtocolError(f"messages: the chat template refused them: {type(e).__name__}: {e}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def completion_prompts(prompt: Any, tokenizer, vocab: int) -> list[tuple[int, ...]]:
    """`prompt` (str, [str], [int] or [[int]]) → one id tuple per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ProtocolError("prompt must be a non-empty string, list of strings, list of token ids or list of lists")
    if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
        return [_token_list(prompt, "prompt", vocab)]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids = tuple(tokenizer(p).input_ids)
            if not ids:
                raise ProtocolError(f"prompt[{i}] is empty (no tokens)")
            out.append(_token_list(list(ids), f"prompt[{i}] tokens", vocab))
        else:
            out.append(_token_list(p, f"prompt[{i}]", vocab))
    return out


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRS or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRS} of them")
    return tuple(stops)


def _max_tokens(body: dict, prompts: list[tuple[int, ...]], n: int, limits: Limits) -> int:
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    if body.get(key) is not None:
        return _int(body[key], key, lo=0)
    longest, count = max(len(p) for p in prompts), len(prompts) * n
    budget = (limits.max_total_tokens - n * sum(len(p) for p in prompts)) // count
    default = min(limits.context_len - longest - 1, budget)
    if default < 1:
        raise ProtocolError(f"max_tokens: the prompts ({longest} tokens, {count} sequences) leave no room to "
                            f"generate (context {limits.context_len}, max_total_tokens {limits.max_total_tokens})")
    return default


def _build(kind: str, body: dict, prompts: list[tuple[int, ...]], limits: Limits,
           extra_stop_ids: frozenset[int] = frozenset()) -> OpenAIRequest:
    _check_neutral(body)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ProtocolError("model must be a string")
    n = _int(body["n"] if body.get("n") is not None else 1, "n", lo=1, hi=MAX_N)
    temperature = _num(body["temperature"] if body.get("temperature") is not None else 1.0, "temperature")
    if temperature < 0:
        raise ProtocolError(f"temperature must be non-negative, got {temperature}")
    top_p = _num(body["top_p"] if body.get("top_p") is not None else 1.0, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int(body["top_k"] if body.get("top_k") is not None else -1, "top_k")
    if top_k != -1 and top_k < 1:
        raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {top_k}")
    seed = body.get("seed")
    if seed is not None:
        seed = _int(seed, "seed")
    stream = _bool(body["stream"] if body.get("stream") is not None else False, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ProtocolError("stream_options must be an object")
    include_usage = _bool((opts or {}).get("include_usage") or False, "stream_options.include_usage")
    stop_ids = frozenset(_token_list(body.get("stop_token_ids") or [], "stop_token_ids", limits.vocab_size,
                                     allow_empty=True)) | extra_stop_ids
    max_new = _max_tokens(body, prompts, n, limits)
    req_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    base = dict(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, stop_strs=_stops(body.get("stop")),
                stop_token_ids=stop_ids,
                ignore_eos=_bool(body["ignore_eos"] if body.get("ignore_eos") is not None else False, "ignore_eos"),
                skip_special_tokens=_bool(body["skip_special_tokens"] if body.get("skip_special_tokens") is not None
                                          else True, "skip_special_tokens"))
    seqs, total = [], 0
    for i, ids in enumerate(prompts):
        try:
            _check_lengths(ids, max_new, limits, "" if len(prompts) == 1 else f"[{i}]")
        except ProtocolError as e:
            raise ProtocolError(e.message.replace("max_new_tokens", "max_tokens")) from None
        for j in range(n):
            k = i * n + j
            sampling = SamplingSpec(**base, seed=None if seed is None else (seed + k) % 2**63)
            rid = f"{req_id}_{k}"
            seqs.append(SeqSpec(rid=rid, input_ids=ids, sampling=sampling, logprob_start=len(ids) - 1,
                                abort_keys=frozenset({rid, req_id})))
            total += len(ids) + max_new
    if len(seqs) > limits.max_seqs:
        raise ProtocolError(f"the request expands to {len(seqs)} sequences (prompts x n), over the limit of "
                            f"{limits.max_seqs}")
    if total > limits.max_total_tokens:
        raise ProtocolError(f"the request needs {total} tokens (prompts + max_tokens, x n), over the server's "
                            f"max_total_tokens={limits.max_total_tokens}")
    return OpenAIRequest(kind=kind, id=req_id, seqs=seqs, n=n, prompt_tokens=sum(len(p) for p in prompts),
                         stream=stream, include_usage=include_usage)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_chat(body: Any, tokenizer, limits: Limits) -> OpenAIRequest:
    """Validate a `/v1/chat/completions` body. Raises ProtocolError naming the field."""
    from infra.chat import end_of_turn_ids

    body = _object(body)
    ids = chat_prompt_ids(tokenizer, chat_messages(body.get("messages")))
    return _build("chat", body, [_token_list(ids, "messages (rendered)", limits.vocab_size)], limits,
                  frozenset(end_of_turn_ids(tokenizer)))


def parse_completion(body: Any, tokenizer, limits: Limits) -> OpenAIRequest:
    """Validate a `/v1/completions` body. Raises ProtocolError naming the field."""
    body = _object(body)
    return _build("completion", body, completion_prompts(body.get("prompt"), tokenizer, limits.vocab_size), limits)


# -- answers ----------------------------------------------------------------------------------------------------
def finish_reason(fr: dict | None) -> str | None:
    """The engine's `{"type": ...}` → OpenAI's "stop" | "length" (| "abort"); None while running."""
    return None if fr is None else fr.get("type")


def usage(req: OpenAIRequest, completion_tokens: int) -> dict:
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": req.prompt_tokens + completion_tokens}


def _choice(req: OpenAIRequest, index: int, text: str, fr: dict | None) -> dict:
    out: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason(fr)}
    if fr and "matched" in fr:
        out["matched_stop"] = fr["matched"]
    if req.kind == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    return out


def response(req: OpenAIRequest, model: str, texts: list[str], finish: list[dict | None],
             completion_tokens: int) -> dict:
    """The whole answer: one choice per sequence (index = prompt x n + sample)."""
    return {"id": req.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model,
            "choices": [_choice(req, k, t, fr) for k, (t, fr) in enumerate(zip(texts, finish))],
            "usage": usage(req, completion_tokens)}


def chunk(req: OpenAIRequest, model: str, index: int, text: str | None, fr: dict | None = None,
          role: bool = False) -> dict:
    """One SSE chunk of a streamed answer: choice `index`'s new text (`text`; None: no content key), its
    finish_reason on its last chunk, the assistant role on a chat's first."""
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason(fr)}
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": req.id, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model, "choices": [choice]}


def usage_chunk(req: OpenAIRequest, model: str, completion_tokens: int) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {"id": req.id, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model, "choices": [], "usage": usage(req, completion_tokens)}


def streamable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running answer's text that is safe to send: cut at the first stop string it contains (the
    final answer is cut there too) and without a tail that could still grow into a stop string (the final answer
    would drop it), so streamed deltas add up to the final text."""
    for s in stops:
        pos = text.find(s)
        if pos >= 0:
            text = text[:pos]
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[:len(text) - hold]
