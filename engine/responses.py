"""`/generate` answers → typed results, with every check the engine client makes (`engine.client` uses and
re-exports all of this): SGLang's JSON (`parse_generation`, `parse_score`: vectorised, falling back to the
item-by-item `parse_score_items` for anything it cannot read, so the error names the entry) and the binary
log-prob body of `engine.wire` (`parse_generation_arrays`, `parse_score_arrays`: the same checks and messages).
Pure; unit-tested on hand-written protocol JSON (tests/unit/test_client_parsing.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any, Sequence

import numpy as np

from engine import wire


class EngineError(Exception):
    """Base class of every error the engine client raises."""


class EngineRequestError(EngineError):
    """The server rejected the request (4xx, or a non-retryable 5xx). Not retried."""

    def __init__(self, status: int, message: str, url: str = ""):
        self.status, self.message, self.url = status, message, url
        super().__init__(f"HTTP {status} from {url}: {message}")


class EngineUnavailable(EngineError):
    """The server could not be reached (or kept answering 502/503/504) after all retries."""


class EngineResponseError(EngineError):
    """The server answered 200 but the body is malformed: wrong lengths, nulls, non-finite log-probs."""


@dataclass
class Generation:
    """One sampled completion. `output_logprobs[t]` = rollout log π(output_ids[t] | prefix) as the engine saw it."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    rid: str | None


@dataclass
class ScoreResult:
    """Teacher log-probs of the response tokens `input_ids[start:]` (L of them), each given its full prefix.

    token_logprobs: (L,) float32, log P(ids[start+j] | ids[:start+j]).
    topk_ids: (L, K) int64 and topk_logprobs: (L, K) float32, the teacher's top-K at each position, sorted
    descending (K = the requested top_k; shape (L, 0) when top_k == 0).
    """

    token_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    weight_version: str | None = None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_finish_reason(fr: Any) -> str:
    """`{"type": "stop"|"length"|"abort", ...}` (or a bare string) → the type string."""
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length", "abort"):
        raise EngineResponseError(f"unknown finish_reason {fr!r}")
    return kind


def parse_generation(obj: dict, rid: str | None = None, want_logprobs: bool = True) -> Generation:
    """One `/generate` response object → `Generation`; checks that log-probs match the output tokens."""
    try:
        meta = obj["meta_info"]
        output_ids = [int(t) for t in obj["output_ids"]]
    except (KeyError, TypeError, ValueError) as e:
        raise EngineResponseError(f"generate response lacks output_ids/meta_info: {e!r}") from None
    logprobs: list[float] = []
    if want_logprobs:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(output_ids):
            got = len(entries) if isinstance(entries, list) else entries
            raise EngineResponseError(f"output_token_logprobs has {got} entries for {len(output_ids)} output tokens")
        for j, (entry, tok) in enumerate(zip(entries, output_ids)):
            if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not _finite(entry[0]) or entry[1] != tok:
                raise EngineResponseError(f"output_token_logprobs[{j}] = {entry!r} is not a finite log-prob of token {tok}")
            logprobs.append(float(entry[0]))
    return Generation(
        output_ids=output_ids, output_logprobs=logprobs, finish_reason=parse_finish_reason(meta.get("finish_reason")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)), completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        weight_version=meta.get("weight_version"), rid=meta.get("id", rid),
    )


def _score_meta(obj: Any, n: int) -> dict:
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        raise EngineResponseError("score response lacks meta_info")
    if "prompt_tokens" in meta and int(meta["prompt_tokens"]) != n:
        raise EngineResponseError(f"server saw {meta['prompt_tokens']} prompt tokens, we sent {n}")
    return meta


def _need(name: str, got: Any, L: int, what: str = "") -> None:
    if not isinstance(got, int) or got < L:
        raise EngineResponseError(f"{name} has {got} entries, need at least {L}{what}")


_SEQ_TYPES = frozenset({list, tuple})
_LP, _ID = itemgetter(0), itemgetter(1)


def _json_columns(entries: list, width: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """JSON `[lp, id, text]` items → their (log-prob, id) columns as float64 arrays, (n,) for a list of items or
    (n, width) for a list of rows of `width` items; C-level iteration (map/itemgetter/fromiter), no per-item Python
    code. None when anything is not a list of numbers of that shape (a null, a short item, a ragged row): the caller
    then falls back to the item-by-item parser, whose error names the entry."""
    try:
        if width is None:
            items = entries
        else:
            if entries and set(map(len, entries)) != {width}:
                return None
            items = list(chain.from_iterable(entries))
        if items and not set(map(type, items)) <= _SEQ_TYPES:
            return None
        n = len(items)
        lp, ids = np.fromiter(map(_LP, items), np.float64, n), np.fromiter(map(_ID, items), np.float64, n)
    except (TypeError, IndexError, ValueError, OverflowError):
        return None
    shape = (len(entries),) if width is None else (len(entries), width)
    return lp.reshape(shape), ids.reshape(shape)


def _checked_score(meta: dict, input_ids: Sequence[int], start: int, top_k: int, lp: np.ndarray, tok: np.ndarray,
                   top_lp: np.ndarray | None, top_ids: np.ndarray | None, show, show_top) -> ScoreResult:
    """The checks of `parse_score_items`, vectorised over the tail arrays (lp, tok: (L,); top_*: (L, top_k) or None
    when nothing is wanted); the first bad entry in the same order gets the same message. `show(j)` / `show_top(j, k)`
    give the entry as received, for the message."""
    want = np.asarray(input_ids[start:], dtype=np.int64)
    bad = ~np.isfinite(lp) | (tok != want)
    if bad.any():
        j = int(bad.argmax())
        pos = start + j
        if not np.isfinite(lp[j]):
            raise EngineResponseError(f"input_token_logprobs entry for position {pos} is {show(j)!r}, not a finite log-prob")
        raise EngineResponseError(f"input_token_logprobs entry for position {pos} is token {show(j)[1]}, sent {input_ids[pos]}")
    token_lp = lp.astype(np.float32)
    if top_lp is None:
        return ScoreResult(token_lp, np.zeros((len(want), top_k), np.int64), np.zeros((len(want), top_k), np.float32),
                           meta.get("weight_version"))
    if top_lp.shape[1] != top_k:
        raise EngineResponseError(f"input_top_logprobs entry for position {start} has {top_lp.shape[1]} items, want {top_k}")
    bad = ~np.isfinite(top_lp)
    if top_ids.dtype.kind == "f":  # JSON numbers: an id must be a whole number (null → NaN is not)
        bad |= ~np.isfinite(top_ids) | (top_ids != np.trunc(top_ids)) | (np.abs(top_ids) >= 2.0**62)
    if bad.any():
        j, k = divmod(int(bad.argmax()), top_k)
        raise EngineResponseError(f"input_top_logprobs[{start + j}][{k}] = {show_top(j, k)!r} is not [finite logprob, id, _]")
    return ScoreResult(token_lp, top_ids.astype(np.int64), top_lp.astype(np.float32), meta.get("weight_version"))


def parse_score(obj: dict, input_ids: Sequence[int], start: int, top_k: int) -> ScoreResult:
    """One SGLang JSON scoring response → `ScoreResult` aligned to the response tokens `input_ids[start:]`
    (L = n - start), vectorised: the tail of `input_token_logprobs` / `input_top_logprobs` (robust to both entry-0
    conventions; entry 0 may be `null`) becomes one float64 array each, checked as a whole (finite log-probs, token
    ids equal to `input_ids`, top-k width, whole-number ids). What it cannot read as numbers (ragged rows, a missing
    field, text in an item) goes to `parse_score_items`, so every error message is the item-by-item one. Read as
    float64, a bool or a numeric string where a number belongs is taken as that number (no server emits either; a
    log-prob above 0 is refused by `student.scoring.check_scores`)."""
    n, L = len(input_ids), len(input_ids) - start
    meta = _score_meta(obj, n)
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) < L or L == 0:
        return parse_score_items(obj, input_ids, start, top_k)
    off_t, off_top = len(entries) - L, 0
    tail = _json_columns(entries[off_t:], None)
    if tail is None:
        return parse_score_items(obj, input_ids, start, top_k)
    top: tuple[np.ndarray, np.ndarray] | tuple[None, None] = (None, None)
    if top_k > 0:
        tops = meta.get("input_top_logprobs")
        if not isinstance(tops, list) or len(tops) < L:
            return parse_score_items(obj, input_ids, start, top_k)
        off_top = len(tops) - L
        top = _json_columns(tops[off_top:], top_k)
        if top is None:
            return parse_score_items(obj, input_ids, start, top_k)
    return _checked_score(meta, input_ids, start, top_k, tail[0], tail[1], top[0], top[1],
                          lambda j: entries[off_t + j], lambda j, k: tops[off_top + j][k])


def parse_generation_arrays(obj: dict, arrays: dict[str, np.ndarray], rid: str | None = None,
                            want_logprobs: bool = True) -> Generation:
    """One item of a binary body (`engine.wire`) → `Generation`, with the checks of `parse_generation`."""
    g = parse_generation(obj, rid, want_logprobs=False)
    if want_logprobs:
        n = len(g.output_ids)
        lp, tok = arrays.get("output_token_logprobs"), arrays.get("output_token_ids")
        if lp is None or tok is None or lp.shape != (n,) or tok.shape != (n,):
            got = None if lp is None else lp.shape
            raise EngineResponseError(f"output_token_logprobs has shape {got} for {n} output tokens")
        logprobs = lp.tolist()
        # a completion is a few dozen tokens: plain lists beat numpy's per-call cost; the sum of finite float32
        # values is finite (no overflow in float64), a NaN or inf makes it not; a miss finds the entry with numpy
        if tok.tolist() != g.output_ids or not math.isfinite(sum(logprobs)):
            bad = ~np.isfinite(lp) | (tok != np.asarray(g.output_ids, dtype=np.int64))
            if bad.any():
                j = int(bad.argmax())
                raise EngineResponseError(f"output_token_logprobs[{j}] = {[float(lp[j]), int(tok[j])]!r} is not a "
                                          f"finite log-prob of token {g.output_ids[j]}")
        g.output_logprobs = logprobs
    return g


def parse_score_arrays(obj: dict, arrays: dict[str, np.ndarray], input_ids: Sequence[int], start: int,
                       top_k: int) -> ScoreResult:
    """One item of a binary body (`engine.wire`) → `ScoreResult`, with the checks and messages of
    `parse_score` (the arrays' NaN stands for JSON's null)."""
    n, L = len(input_ids), len(input_ids) - start
    meta = _score_meta(obj, n)
    lp, tok = arrays.get("input_token_logprobs"), arrays.get("input_token_ids")
    if lp is None or tok is None or lp.ndim != 1 or tok.shape != lp.shape:
        raise EngineResponseError("binary score response lacks input_token_logprobs / input_token_ids (1-D, equal "
                                  "lengths)")
    _need("input_token_logprobs", len(lp), L, f" (tokens {start}..{n - 1})")
    lp, tok = lp[len(lp) - L:], tok[len(tok) - L:]
    top_lp = top_ids = None
    if top_k > 0 and L > 0:
        top_lp, top_ids = arrays.get("input_top_logprobs"), arrays.get("input_top_ids")
        if top_lp is None or top_ids is None or top_lp.ndim != 2 or top_ids.shape != top_lp.shape:
            raise EngineResponseError("binary score response lacks input_top_logprobs / input_top_ids (2-D, equal "
                                      "shapes)")
        _need("input_top_logprobs", len(top_lp), L)
        top_lp, top_ids = top_lp[len(top_lp) - L:], top_ids[len(top_ids) - L:]
    return _checked_score(meta, input_ids, start, top_k, lp, tok, top_lp, top_ids,
                          lambda j: [float(lp[j]), int(tok[j])],
                          lambda j, k: [float(top_lp[j, k]), int(top_ids[j, k])])


def parse_score_batch(items: Sequence[tuple[dict, dict[str, np.ndarray]]], seqs: Sequence[Sequence[int]],
                      starts: Sequence[int], top_k: int) -> list[ScoreResult]:
    """The items of one binary scoring body → one `ScoreResult` per sequence: exactly `parse_score_arrays` of each
    item (same values, dtypes and shapes, the same error for the first bad item), checked batch-wise: the tails of
    every item are concatenated and checked in a few numpy calls (a call per item and check costs more than the
    check itself on a batch of short responses). Anything the fast path does not take as it is (a missing or
    mis-typed array, an empty response, a bad entry) goes item by item through `parse_score_arrays`."""
    slow = lambda: [parse_score_arrays(o, a, s, st, top_k) for (o, a), s, st in zip(items, seqs, starts)]  # noqa: E731
    lps, toks, tlps, tids, metas, lengths = [], [], [], [], [], []
    for (obj, arrays), ids, start in zip(items, seqs, starts):
        meta = obj.get("meta_info") if type(obj) is dict else None
        L = len(ids) - start
        if type(meta) is not dict or L <= 0 or ("prompt_tokens" in meta and meta["prompt_tokens"] != len(ids)):
            return slow()
        lp, tok = arrays.get("input_token_logprobs"), arrays.get("input_token_ids")
        if (lp is None or tok is None or lp.dtype != _F4 or tok.dtype != _I4 or lp.ndim != 1
                or tok.shape != lp.shape or len(lp) < L):
            return slow()
        lps.append(lp[len(lp) - L:])
        toks.append(tok[len(tok) - L:])
        if top_k > 0:
            tl, ti = arrays.get("input_top_logprobs"), arrays.get("input_top_ids")
            if (tl is None or ti is None or tl.dtype != _F4 or ti.dtype != _I4 or tl.ndim != 2
                    or ti.shape != tl.shape or len(tl) < L or tl.shape[1] != top_k):
                return slow()
            tlps.append(tl[len(tl) - L:])
            tids.append(ti[len(ti) - L:])
        metas.append(meta)
        lengths.append(L)
    if not lengths:
        return []
    want = np.fromiter(chain.from_iterable(ids[start:] for ids, start in zip(seqs, starts)), np.int64,
                       sum(lengths))
    lp, tok = np.concatenate(lps), np.concatenate(toks)
    if not (np.isfinite(lp).all() and np.array_equal(tok, want)):
        return slow()
    token_lp = lp.astype(np.float32)
    bounds = np.cumsum([0] + lengths).tolist()
    spans = list(zip(bounds, bounds[1:]))
    if top_k > 0:
        top_lp = np.concatenate(tlps)
        if not np.isfinite(top_lp).all():
            return slow()
        top_lp, top_ids = top_lp.astype(np.float32), np.concatenate(tids).astype(np.int64)
        return [ScoreResult(token_lp[a:b], top_ids[a:b], top_lp[a:b], m.get("weight_version"))
                for (a, b), m in zip(spans, metas)]
    return [ScoreResult(token_lp[a:b], np.zeros((b - a, 0), np.int64), np.zeros((b - a, 0), np.float32),
                        m.get("weight_version")) for (a, b), m in zip(spans, metas)]


_F4, _I4 = np.dtype("<f4"), np.dtype("<i4")


def parse_score_items(obj: dict, input_ids: Sequence[int], start: int, top_k: int) -> ScoreResult:
    """One scoring response → `ScoreResult` aligned to the response tokens `input_ids[start:]` (L = n - start),
    item by item: the reference parser (`parse_score` falls back to it for anything its vectorised path cannot
    read, so an error names the exact entry), and the "before" of `bench/scoring_transport.py`.

    Takes the last L entries of `input_token_logprobs` / `input_top_logprobs` (robust to both entry-0
    conventions; entry 0 may be `null`), and checks each entry's token id against `input_ids`.
    """
    n, L = len(input_ids), len(input_ids) - start
    meta = _score_meta(obj, n)
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) < L:
        got = len(entries) if isinstance(entries, list) else entries
        raise EngineResponseError(f"input_token_logprobs has {got} entries, need at least {L} (tokens {start}..{n - 1})")
    tail = entries[len(entries) - L:] if L else []
    token_lp = np.empty(L, dtype=np.float32)
    for j, entry in enumerate(tail):
        pos = start + j
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not _finite(entry[0]):
            raise EngineResponseError(f"input_token_logprobs entry for position {pos} is {entry!r}, not a finite log-prob")
        if entry[1] != input_ids[pos]:
            raise EngineResponseError(f"input_token_logprobs entry for position {pos} is token {entry[1]}, sent {input_ids[pos]}")
        token_lp[j] = entry[0]

    topk_ids = np.zeros((L, top_k), dtype=np.int64)
    topk_lp = np.zeros((L, top_k), dtype=np.float32)
    if top_k > 0 and L > 0:
        tops = meta.get("input_top_logprobs")
        if not isinstance(tops, list) or len(tops) < L:
            got = len(tops) if isinstance(tops, list) else tops
            raise EngineResponseError(f"input_top_logprobs has {got} entries, need at least {L}")
        for j, row in enumerate(tops[len(tops) - L:]):
            if not isinstance(row, list) or len(row) != top_k:
                got = len(row) if isinstance(row, list) else row
                raise EngineResponseError(f"input_top_logprobs entry for position {start + j} has {got} items, want {top_k}")
            for k, item in enumerate(row):
                if not isinstance(item, (list, tuple)) or len(item) < 2 or not _finite(item[0]) or not isinstance(item[1], int):
                    raise EngineResponseError(f"input_top_logprobs[{start + j}][{k}] = {item!r} is not [finite logprob, id, _]")
                topk_lp[j, k], topk_ids[j, k] = item[0], item[1]
    return ScoreResult(token_lp, topk_ids, topk_lp, meta.get("weight_version"))


def _binary_items(raw: bytes, batch: int) -> list[tuple[dict, dict[str, np.ndarray]]]:
    """A binary `/generate` body of a batch request → its `batch` items; a malformed body is an EngineResponseError."""
    try:
        _single, items = wire.decode(raw)
    except wire.WireError as e:
        raise EngineResponseError(f"malformed binary /generate body: {e}") from None
    if len(items) != batch:
        raise EngineResponseError(f"/generate returned {len(items)} results for a batch of {batch}")
    return items


# -- /classify and OpenAI chat answers ------------------------------------------------------------------------------
def parse_classify(body: Any, n: int) -> list[list[float]]:
    """A `/classify` answer for a batch of `n` inputs (SGLang's shape: a list of `{"embedding": [logits...],
    "meta_info"}`, in input order) → each input's logits (a reward model's score is entry 0). Raises
    EngineResponseError on a wrong count, a missing or empty embedding, or a non-finite value."""
    if not isinstance(body, list) or len(body) != n:
        got = len(body) if isinstance(body, list) else type(body).__name__
        raise EngineResponseError(f"/classify returned {got} results for a batch of {n}")
    out = []
    for i, obj in enumerate(body):
        emb = obj.get("embedding") if isinstance(obj, dict) else None
        if not isinstance(emb, list) or not emb or not all(_finite(x) for x in emb):
            raise EngineResponseError(f"/classify result {i}: embedding must be a non-empty list of finite numbers, "
                                      f"got {str(emb)[:100]}")
        out.append([float(x) for x in emb])
    return out


@dataclass
class ChatReply:
    """One answer of an OpenAI-compatible `/v1/chat/completions` call (its first choice)."""

    text: str
    finish_reason: str | None  # "stop" | "length" | whatever the server says ("content_filter", "tool_calls", ...)
    prompt_tokens: int | None
    completion_tokens: int | None
    model: str | None


def parse_chat_reply(body: Any) -> ChatReply:
    """`{"choices": [{"message": {"content": str}, "finish_reason"}], "usage"?, "model"?}` → ChatReply. Raises
    EngineResponseError when there is no choice or its content is not text (e.g. only tool calls)."""
    try:
        choice = body["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise EngineResponseError(f"chat answer without choices[0].message.content: {str(body)[:200]}") from None
    if not isinstance(content, str):
        raise EngineResponseError(f"chat answer's content is not text: {str(content)[:200]}")
    use = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    count = lambda k: use.get(k) if isinstance(use.get(k), int) else None  # noqa: E731
    fr = choice.get("finish_reason") if isinstance(choice, dict) else None
    return ChatReply(text=content, finish_reason=fr if isinstance(fr, str) else None,
                     prompt_tokens=count("prompt_tokens"), completion_tokens=count("completion_tokens"),
                     model=body.get("model") if isinstance(body.get("model"), str) else None)
