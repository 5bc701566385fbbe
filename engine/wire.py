"""The binary log-prob transport: `/generate` answers with packed little-endian float32/int32 arrays, on request.

SGLang's JSON stays the default. A client that wants the binary body sends `Accept: application/x-alloy-logprobs`
(and `application/json` beside it, so an SGLang server, which ignores `Accept` and answers JSON, still works); the
client then parses by the response's `Content-Type`. The embedded server answers binary only for a non-streaming
request without `return_text_in_logprobs` (per-token text has no place in the arrays); otherwise JSON.

Body layout (every integer little-endian):

    MAGIC (8 bytes, b"ALLOYLP1")  |  H: uint32, the header's length  |  header: H bytes of JSON
    zero padding to a multiple of 8  |  data: the arrays' bytes, back to back (each a multiple of 4 bytes)

The header is `{"single": bool, "items": [{"obj": {...}, "arrays": {name: [dtype, shape, offset]}}, ...]}`: one
item per response object, in SGLang's order; `obj` is SGLang's response object (`text`, `output_ids`, `meta_info`)
without the log-prob lists, and each array's `offset` counts from the start of the data section. The arrays of an
item with `return_logprob` (n_in = entries for input tokens start … N-1, n_out = output tokens, k = top_logprobs_num,
t = len(token_ids_logprob)); a `null` of the JSON (entry 0 of the input lists) is NaN, its ids -1:

    input_token_logprobs  <f4 (n_in,)     input_token_ids  <i4 (n_in,)
    output_token_logprobs <f4 (n_out,)    output_token_ids <i4 (n_out,)
    input_top_logprobs    <f4 (n_in, k)   input_top_ids    <i4 (n_in, k)     (k > 0)
    output_top_logprobs   <f4 (n_out, k)  output_top_ids   <i4 (n_out, k)    (k > 0)
    input_token_ids_logprobs <f4 (n_in, t)  output_token_ids_logprobs <f4 (n_out, t)  token_ids_logprob <i4 (t,)

float32 loses nothing: the engine computes log-probs in float32 (the JSON carries the same float32 values widened to
doubles), and the client's arrays are float32 either way.
"""
from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import numpy as np
import orjson

from engine.protocol import SeqResult, SeqSpec, TokenText, build_output

CONTENT_TYPE = "application/x-alloy-logprobs"
ACCEPT = f"{CONTENT_TYPE}, application/json;q=0.5"  # what a client sends to ask for it
MAGIC = b"ALLOYLP1"
DTYPES = {"<f4": np.dtype("<f4"), "<i4": np.dtype("<i4")}
ARRAY_NAMES = frozenset({
    "input_token_logprobs", "input_token_ids", "output_token_logprobs", "output_token_ids", "input_top_logprobs",
    "input_top_ids", "output_top_logprobs", "output_top_ids", "input_token_ids_logprobs", "output_token_ids_logprobs",
    "token_ids_logprob"})
_HEAD = struct.Struct("<8sI")
MAX_HEADER_BYTES = 64 * 2**20


class WireError(ValueError):
    """A binary body that does not follow the layout above (the client turns it into an EngineResponseError)."""


def wants_binary(accept: str | None) -> bool:
    """True when an `Accept` header lists the binary media type with a non-zero q."""
    for part in (accept or "").split(","):
        media, *params = [p.strip() for p in part.split(";")]
        if media.lower() == CONTENT_TYPE:
            q = next((p[2:] for p in params if p.lower().startswith("q=")), "1")
            try:
                return float(q) > 0
            except ValueError:
                return True
    return False


# -- server side ----------------------------------------------------------------------------------------------------
def _f32(rows: list, width: int | None) -> np.ndarray:
    """Log-probs → float32 array, `None` entries (or rows) → NaN."""
    if width is None:
        return np.array([np.nan if v is None else v for v in rows], dtype="<f4")
    out = np.full((len(rows), width), np.nan, dtype="<f4")
    full = [i for i, r in enumerate(rows) if r is not None]
    if full:
        out[full] = np.array([rows[i] for i in full], dtype="<f4").reshape(len(full), width)
    return out


def _top(entries: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[(vals, ids) | None] → (float32 (n, k), int32 (n, k)); a None row is NaN / -1."""
    lp = np.full((len(entries), k), np.nan, dtype="<f4")
    ids = np.full((len(entries), k), -1, dtype="<i4")
    full = [i for i, e in enumerate(entries) if e is not None]
    if full:
        lp[full] = np.array([entries[i][0] for i in full], dtype="<f4").reshape(len(full), k)
        ids[full] = np.array([entries[i][1] for i in full], dtype="<i4").reshape(len(full), k)
    return lp, ids


def seq_arrays(spec: SeqSpec, res: SeqResult, n_out: int) -> dict[str, np.ndarray]:
    """The arrays of one sequence (the same numbers `protocol.build_output` writes as JSON lists)."""
    if not spec.return_logprob:
        return {}
    n_in = len(res.in_logprobs)
    a = {"input_token_logprobs": _f32(res.in_logprobs, None),
         "input_token_ids": np.array(spec.input_ids[spec.logprob_start:spec.logprob_start + n_in], dtype="<i4"),
         "output_token_logprobs": np.array(res.out_logprobs[:n_out], dtype="<f4"),
         "output_token_ids": np.array(res.output_ids[:n_out], dtype="<i4")}
    k = spec.top_logprobs_num
    if k > 0:
        a["input_top_logprobs"], a["input_top_ids"] = _top(res.in_top, k)
        a["output_top_logprobs"], a["output_top_ids"] = _top(res.out_top[:n_out], k)
    if spec.token_ids_logprob is not None:
        t = len(spec.token_ids_logprob)
        a["token_ids_logprob"] = np.array(spec.token_ids_logprob, dtype="<i4")
        a["input_token_ids_logprobs"] = _f32(res.in_ids_logprobs, t)
        a["output_token_ids_logprobs"] = _f32(res.out_ids_logprobs[:n_out], t)
    return a


def build_binary(tokenizer, items: list[tuple[SeqSpec, SeqResult, float | None]], weight_version: str,
                 token_text: TokenText, single: bool) -> bytes:
    """The binary body for finished sequences `(spec, result, e2e_latency)`, in response order."""
    head_items, chunks, offset = [], [], 0
    for spec, res, latency in items:
        obj = build_output(tokenizer, replace(spec, return_logprob=False), res, weight_version, latency, token_text)
        desc = {}
        for name, arr in seq_arrays(spec, res, len(res.output_ids)).items():
            desc[name] = [arr.dtype.str, list(arr.shape), offset]
            chunks.append(arr.tobytes())
            offset += arr.nbytes
        head_items.append({"obj": obj, "arrays": desc})
    header = orjson.dumps({"single": single, "items": head_items})
    pad = -(len(MAGIC) + 4 + len(header)) % 8
    return b"".join([_HEAD.pack(MAGIC, len(header)), header, b"\0" * pad, *chunks])


# -- client side ----------------------------------------------------------------------------------------------------
def decode(raw: bytes) -> tuple[bool, list[tuple[dict, dict[str, np.ndarray]]]]:
    """A binary body → (single, [(obj, {name: array})]). The arrays are read-only views into `raw`. Every length,
    dtype, shape and bound is checked; a malformed body raises `WireError` naming what is wrong."""
    if len(raw) < _HEAD.size:
        raise WireError(f"binary log-prob body of {len(raw)} bytes is shorter than its {_HEAD.size}-byte preamble")
    magic, h = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise WireError(f"binary log-prob body starts with {magic!r}, not {MAGIC!r}")
    if h > min(MAX_HEADER_BYTES, len(raw) - _HEAD.size):
        raise WireError(f"binary log-prob header length {h} exceeds the body ({len(raw)} bytes)")
    try:
        head = orjson.loads(raw[_HEAD.size:_HEAD.size + h])
    except orjson.JSONDecodeError as e:
        raise WireError(f"binary log-prob header is not valid JSON: {e}") from None
    if not isinstance(head, dict) or not isinstance(head.get("items"), list) or not isinstance(head.get("single"), bool):
        raise WireError("binary log-prob header must be an object with 'single' (bool) and 'items' (list)")
    start = _HEAD.size + h
    start += -start % 8
    data = memoryview(raw)[start:] if start <= len(raw) else memoryview(b"")
    # one read-only view per dtype over the whole data section; an array at a 4-byte aligned offset (every one our
    # server writes) is a slice of it, which costs a fraction of a `frombuffer` per array (a batch answer has
    # hundreds of arrays)
    size = len(data)
    views = {key: np.frombuffer(data, dtype=dt, count=size // dt.itemsize) for key, dt in DTYPES.items()}
    out, end = [], 0
    for i, item in enumerate(head["items"]):
        if not isinstance(item, dict) or not isinstance(item.get("obj"), dict) or not isinstance(item.get("arrays"), dict):
            raise WireError(f"binary log-prob item {i} must be an object with 'obj' and 'arrays' objects")
        arrays = {}
        for name, d in item["arrays"].items():
            arr, stop = _array(data, views, d, i, name)
            arrays[name] = arr
            if stop > end:
                end = stop
        out.append((item["obj"], arrays))
    if end != size:
        raise WireError(f"binary log-prob data section has {size} bytes, its arrays describe {end}")
    return head["single"], out


def _bad_descriptor(i: int, name: str, d: Any) -> WireError:
    return WireError(f"item {i} array {name!r}: descriptor {d!r:.100} is not [dtype ('<f4' or '<i4'), shape (1 or 2 "
                     "sizes), offset]")


def _array(data: memoryview, views: dict[str, np.ndarray], d: Any, i: int, name: str) -> tuple[np.ndarray, int]:
    """One array of item `i` from its descriptor `d` = [dtype, shape, offset]: (read-only array, its end offset)."""
    if name not in ARRAY_NAMES:
        raise WireError(f"item {i} array {name!r}: unknown array name")
    if type(d) is not list or len(d) != 3:
        raise _bad_descriptor(i, name, d)
    key, shape, off = d
    view = views.get(key) if type(key) is str else None
    if view is None or type(shape) is not list or type(off) is not int or off < 0:
        raise _bad_descriptor(i, name, d)
    if len(shape) == 1:
        n = shape[0]
        if type(n) is not int or n < 0:
            raise _bad_descriptor(i, name, d)
        count = n
    elif len(shape) == 2:
        n, k = shape
        if type(n) is not int or type(k) is not int or n < 0 or k < 0:
            raise _bad_descriptor(i, name, d)
        count = n * k
    else:
        raise _bad_descriptor(i, name, d)
    itemsize = view.itemsize
    stop = off + count * itemsize
    if stop > len(data):
        raise WireError(f"item {i} array {name!r}: needs bytes [{off}, {stop}) of a {len(data)}-byte data section "
                        "(truncated body?)")
    if off % itemsize:  # not on the element grid of the shared view: its own view
        arr = np.frombuffer(data, dtype=view.dtype, count=count, offset=off)
    else:
        arr = view[off // itemsize:off // itemsize + count]
    return (arr if len(shape) == 1 else arr.reshape(n, k)), stop
