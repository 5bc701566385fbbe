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
without the log-prob lists, and each array's `offset` counts from the start of the data section (the embedded
server writes every float32 array first, then every int32 one; a reader goes by the offsets). The arrays of an
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
class _Packer:
    """The data section of one body, gathered as two flat lists (float32 values, int32 values) and converted once
    each at the end (`sections`): all float32 arrays first, then all int32 arrays, each array's values back to back
    in the order they were added. An array's values are checked against its shape as they are added."""

    def __init__(self):
        self.floats: list = []
        self.ints: list = []
        self._int_descs: list[list] = []

    def add(self, values, shape: tuple[int, ...], dtype: str) -> list:
        """Append `values` (flat) as one array of `shape`; returns its descriptor (int32 offsets are final only
        after `sections`)."""
        flat = self.floats if dtype == "<f4" else self.ints
        start = len(flat)
        flat.extend(values)
        count = shape[0] * shape[1] if len(shape) == 2 else shape[0]
        if len(flat) - start != count:
            raise ValueError(f"binary log-prob body: {len(flat) - start} values for an array of shape {shape}")
        desc = [dtype, list(shape), start * 4]
        if dtype == "<i4":
            self._int_descs.append(desc)
        return desc

    def sections(self) -> list[bytes]:
        """The data section's bytes (float32 values, then int32 values); fixes the int32 arrays' offsets."""
        f, i = np.array(self.floats, dtype="<f4"), np.array(self.ints, dtype="<i4")
        for desc in self._int_descs:
            desc[2] += f.nbytes
        return [f.tobytes(), i.tobytes()]


def _f32(rows: list) -> list:
    """Log-probs (float or None) → floats, `None` → NaN."""
    return [np.nan if v is None else v for v in rows] if None in rows else rows


def _rows(rows: list, width: int, fill) -> list:
    """Rows of `width` values (or None) → their values, flat; a None row is `width` × `fill`."""
    out: list = []
    for r in rows:
        if r is None:
            out += [fill] * width
        elif len(r) != width:
            raise ValueError(f"binary log-prob body: a row of {len(r)} values, want {width}")
        else:
            out += r
    return out


def _top_rows(entries: list, k: int) -> tuple[list, list]:
    """[(vals, ids) | None] → (vals, ids) flat; a None row is NaN / -1."""
    return _rows([None if e is None else e[0] for e in entries], k, np.nan), \
        _rows([None if e is None else e[1] for e in entries], k, -1)


def _seq_arrays(pack: _Packer, spec: SeqSpec, res: SeqResult, n_out: int) -> dict[str, list]:
    """The descriptors of one sequence's arrays (the same numbers `protocol.build_output` writes as JSON lists)."""
    if not spec.return_logprob:
        return {}
    n_in = len(res.in_logprobs)
    ids_in = spec.input_ids[spec.logprob_start:spec.logprob_start + n_in]
    out_lp, out_ids = res.out_logprobs[:n_out], res.output_ids[:n_out]
    a = {"input_token_logprobs": pack.add(_f32(res.in_logprobs), (n_in,), "<f4"),
         "input_token_ids": pack.add(ids_in, (len(ids_in),), "<i4"),
         "output_token_logprobs": pack.add(out_lp, (len(out_lp),), "<f4"),
         "output_token_ids": pack.add(out_ids, (len(out_ids),), "<i4")}
    k = spec.top_logprobs_num
    if k > 0:
        for side, entries in (("input", res.in_top), ("output", res.out_top[:n_out])):
            vals, ids = _top_rows(entries, k)
            a[f"{side}_top_logprobs"] = pack.add(vals, (len(entries), k), "<f4")
            a[f"{side}_top_ids"] = pack.add(ids, (len(entries), k), "<i4")
    if spec.token_ids_logprob is not None:
        t = len(spec.token_ids_logprob)
        a["token_ids_logprob"] = pack.add(spec.token_ids_logprob, (t,), "<i4")
        for name, rows in (("input_token_ids_logprobs", res.in_ids_logprobs),
                           ("output_token_ids_logprobs", res.out_ids_logprobs[:n_out])):
            a[name] = pack.add(_rows(rows, t, np.nan), (len(rows), t), "<f4")
    return a


def build_binary(tokenizer, items: list[tuple[SeqSpec, SeqResult, float | None]], weight_version: str,
                 token_text: TokenText, single: bool) -> bytes:
    """The binary body for finished sequences `(spec, result, e2e_latency)`, in response order: the arrays of the
    whole answer converted in one go (`_Packer`), not one numpy array per sequence and name."""
    pack, head_items = _Packer(), []
    for spec, res, latency in items:
        obj = build_output(tokenizer, spec, res, weight_version, latency, token_text, logprobs=False)
        head_items.append({"obj": obj, "arrays": _seq_arrays(pack, spec, res, len(res.output_ids))})
    return _body(single, head_items, pack)


def _body(single: bool, head_items: list[dict], pack: _Packer) -> bytes:
    chunks = pack.sections()  # first: it fixes the int32 offsets the header carries
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
