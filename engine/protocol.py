"""The SGLang native `/generate` protocol: request validation → per-sequence specs, and the response objects.

Checked against SGLang's source (io_struct.GenerateReqInput, SamplingParams, tokenizer_manager, scheduler):

- Exactly one of `text` / `input_ids`. A str or a flat id list is a single request (response: one object); a list of
  str or a list of id lists is a batch (response: a list, in order). `sampling_params.n > 1` turns even a single
  prompt into a batch: the response is a list of `batch × n` objects, prompt-major (all n samples of prompt 0, then
  prompt 1, ...), as in `TokenizerManager._handle_batch_request`.
- `rid`: a str for a batch becomes `f"{rid}_{i}"` per item (SGLang `_normalize_rid`); a list must have one per
  prompt. With n > 1 SGLang gives every sample a fresh uuid; we give `f"{rid}_{j}"` (or `f"{rid}_{i}_{j}"` when the
  rid was expanded per prompt) so samples stay abortable by rid. Aborting a parent rid aborts all its samples.
- `logprob_start_len = -1` means output tokens only: SGLang then starts the input log-probs at the last prompt
  token for generation (one entry, `[null, id, null]`) and skips them for prefill-only (max_new_tokens = 0)
  requests. `logprob_start_len ≥ len(input_ids)` with `return_logprob` is HTTP 400.
- `input_ids + max_new_tokens ≥ context length` is HTTP 400 (SGLang `_validate_one_request`).
- (Alloy only, never by default) a client that sends `Accept: application/x-alloy-logprobs` gets the log-probs as
  packed float32/int32 arrays instead of these JSON lists: `engine.wire`.
- Log-prob keys appear in `meta_info` only when `return_logprob` is true; the top-logprob keys only when
  `top_logprobs_num > 0`; `input/output_token_ids_logprobs` only when `token_ids_logprob` is given (SGLang
  `add_logprob_to_meta_info`).
- (Alloy only) `top_logprobs_num` must be in [0, vocab size], and an answer is bounded: positions × (1 +
  top_logprobs_num + len(token_ids_logprob)), summed over the sequences (positions: the input positions scored plus
  max_new_tokens), over the server's `max_logprob_entries` (--max-logprob-entries) is HTTP 400 naming both.
"""
from __future__ import annotations

import gc
import math
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from infra.choices import MAX_LOGPROB_ENTRIES

# Sampling params we implement; and SGLang params we accept only at their neutral value (anything else → 400,
# so a client never gets silently different sampling than it asked for).
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "n",
                 "skip_special_tokens", "no_stop_trim", "sampling_seed", "stream_interval",
                 "spaces_between_special_tokens"}
NEUTRAL_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None,
                    "logit_bias": None, "custom_params": None}
# Top-level GenerateReqInput fields that change semantics if set; we do not support them.
UNSUPPORTED_TOP = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "session_params",
                   "custom_logit_processor")
MAX_N = 256
MAX_STOP_STRS = 32


class ProtocolError(Exception):
    """A request the server refuses; `status` is the HTTP code (4xx), `message` names the bad field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class SamplingSpec:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_strs: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class SeqSpec:
    """One sequence to run. `logprob_start` is already normalised (see module doc). `abort_keys` are the rids that
    abort it: its own, its prompt's, and the client's str rid of a batch (aborting it aborts the whole batch)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingSpec
    return_logprob: bool = False
    logprob_start: int = 0
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False
    abort_keys: frozenset[str] = frozenset()


@dataclass
class GenerateRequest:
    seqs: list[SeqSpec]
    is_single: bool
    stream: bool = False


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    max_total_tokens: int
    max_seqs: int = 4096
    max_logprob_entries: int = MAX_LOGPROB_ENTRIES  # (log-prob, id) entries one answer may carry: `_check_entries`


# -- typed field readers: bools are not ints, floats are not ints, NaN is not a number ------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v):
        raise ProtocolError(f"{name} must be an integer, got {type(v).__name__} {v!r:.60}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ProtocolError(f"{name} must be in {rng}, got {v}")
    return v


def _num(v: Any, name: str) -> float:
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise ProtocolError(f"{name} must be a finite number, got {v!r:.60}")
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{name} must be true or false, got {v!r:.60}")
    return v


def _token_list(v: Any, name: str, vocab: int, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise ProtocolError(f"{name} must be a list of token ids, got {type(v).__name__}")
    if not v and not allow_empty:
        raise ProtocolError(f"{name} is empty")
    for j, t in enumerate(v):
        if not _is_int(t):
            raise ProtocolError(f"{name}[{j}] must be an integer token id, got {t!r:.60}")
        if not 0 <= t < vocab:
            raise ProtocolError(f"{name}[{j}] = {t} is out of the vocabulary [0, {vocab})")
    return tuple(v)


def _per_item(v: Any, n: int, name: str) -> list:
    """A scalar applies to every batch item; a list must have one value per item."""
    if isinstance(v, list):
        if len(v) != n:
            raise ProtocolError(f"{name} has {len(v)} entries for a batch of {n}")
        return v
    return [v] * n


def parse_sampling(d: Any, name: str, vocab: int) -> tuple[SamplingSpec, int]:
    """`sampling_params` dict → (SamplingSpec, n). Unknown keys and unsupported non-neutral values are 400."""
    if d is None:
        return SamplingSpec(), 1
    if not isinstance(d, dict):
        raise ProtocolError(f"{name} must be an object, got {type(d).__name__}")
    for key, val in d.items():
        if key in NEUTRAL_SAMPLING:
            if val is not None and val != NEUTRAL_SAMPLING[key]:
                raise ProtocolError(f"{name}.{key}={val!r:.60} is not supported by the embedded engine "
                                    f"(only {NEUTRAL_SAMPLING[key]!r})")
        elif key not in SAMPLING_KEYS:
            raise ProtocolError(f"{name}.{key} is not a known sampling parameter")

    def get(key, default):
        v = d.get(key)
        return default if v is None else v

    max_new = _int(get("max_new_tokens", 128), f"{name}.max_new_tokens", lo=0)
    temperature = _num(get("temperature", 1.0), f"{name}.temperature")
    if temperature < 0:
        raise ProtocolError(f"{name}.temperature must be non-negative, got {temperature}")
    top_p = _num(get("top_p", 1.0), f"{name}.top_p")
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"{name}.top_p must be in (0, 1], got {top_p}")
    top_k = _int(get("top_k", -1), f"{name}.top_k")
    if top_k != -1 and top_k < 1:
        raise ProtocolError(f"{name}.top_k must be -1 (disable) or at least 1, got {top_k}")
    stop = get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRS or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(f"{name}.stop must be a non-empty string or a list of at most {MAX_STOP_STRS} of them")
    stop_ids = _token_list(get("stop_token_ids", []), f"{name}.stop_token_ids", vocab, allow_empty=True)
    n = _int(get("n", 1), f"{name}.n", lo=1, hi=MAX_N)
    seed = d.get("sampling_seed")
    if seed is not None:
        seed = _int(seed, f"{name}.sampling_seed", lo=0, hi=2**63 - 1)
    if d.get("stream_interval") is not None:
        _int(d["stream_interval"], f"{name}.stream_interval", lo=1)
    spec = SamplingSpec(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, stop_strs=tuple(stop),
        stop_token_ids=frozenset(stop_ids), ignore_eos=_bool(get("ignore_eos", False), f"{name}.ignore_eos"),
        skip_special_tokens=_bool(get("skip_special_tokens", True), f"{name}.skip_special_tokens"),
        no_stop_trim=_bool(get("no_stop_trim", False), f"{name}.no_stop_trim"), seed=seed,
    )
    _bool(get("spaces_between_special_tokens", True), f"{name}.spaces_between_special_tokens")
    return spec, n


def _prompts(body: dict, tokenizer, vocab: int) -> tuple[list[tuple[int, ...]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ProtocolError("exactly one of text or input_ids must be provided")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
        out = []
        for i, t in enumerate(texts):
            toks = tuple(tokenizer(t).input_ids)
            if not toks:
                raise ProtocolError(f"text{'' if single else f'[{i}]'} is empty (no tokens)")
            out.append(_token_list(list(toks), f"text[{i}] tokens", vocab))
        return out, single
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("input_ids must be a non-empty list of token ids or a non-empty list of such lists")
    if isinstance(ids[0], list):
        return [_token_list(x, f"input_ids[{i}]", vocab) for i, x in enumerate(ids)], False
    return [_token_list(ids, "input_ids", vocab)], True


def parse_generate(body: Any, tokenizer, limits: Limits) -> GenerateRequest:
    """Validate a `/generate` JSON body and expand it into sequences (in response order). Raises ProtocolError."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in UNSUPPORTED_TOP:
        if body.get(key) not in (None, [], ""):
            raise ProtocolError(f"{key} is not supported by the embedded engine")
    if body.get("return_hidden_states") not in (None, False):
        raise ProtocolError("return_hidden_states is not supported by the embedded engine")
    prompts, single = _prompts(body, tokenizer, limits.vocab_size)
    batch = len(prompts)

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != batch:
            raise ProtocolError(f"sampling_params has {len(sp)} entries for a batch of {batch}")
        parsed = [parse_sampling(d, f"sampling_params[{i}]", limits.vocab_size) for i, d in enumerate(sp)]
    else:
        parsed = [parse_sampling(sp, "sampling_params", limits.vocab_size)] * batch
    n = parsed[0][1]
    if any(p[1] != n for p in parsed):
        raise ProtocolError("sampling_params.n must be the same for every item of a batch")

    ret_lp = [_bool(v, "return_logprob") for v in _per_item(_default(body, "return_logprob", False), batch, "return_logprob")]
    starts = [_int(v, "logprob_start_len", lo=-1) for v in _per_item(_default(body, "logprob_start_len", -1), batch, "logprob_start_len")]
    tops = [_int(v, "top_logprobs_num", lo=0, hi=limits.vocab_size)
            for v in _per_item(_default(body, "top_logprobs_num", 0), batch, "top_logprobs_num")]
    tid = body.get("token_ids_logprob") or None
    if tid is not None and isinstance(tid, list) and tid and isinstance(tid[0], list):
        tids = [_token_list(x, f"token_ids_logprob[{i}]", limits.vocab_size) for i, x in enumerate(_per_item(tid, batch, "token_ids_logprob"))]
    else:
        tids = [None if tid is None else _token_list(tid, "token_ids_logprob", limits.vocab_size)] * batch
    text_in_lp = _bool(_default(body, "return_text_in_logprobs", False), "return_text_in_logprobs")
    stream = _bool(_default(body, "stream", False), "stream")
    rids = _rids(body.get("rid"), batch, single)
    if single and n > 1:
        single = False  # SGLang: parallel sampling of one prompt answers with a list

    seqs: list[SeqSpec] = []
    total, entries = 0, []
    for i, ids in enumerate(prompts):
        samp = parsed[i][0]
        _check_lengths(ids, samp.max_new_tokens, limits, "" if batch == 1 else f"[{i}]")
        start = starts[i]
        if ret_lp[i] and start >= len(ids):
            raise ProtocolError(f"logprob_start_len ({start}) must be smaller than the number of input tokens "
                                f"({len(ids)}) of item {i}")
        if start == -1 or not ret_lp[i]:
            start = len(ids) if samp.max_new_tokens == 0 else len(ids) - 1
        for j in range(n):
            rid = rids[i] if n == 1 else f"{rids[i]}_{j}"
            seqs.append(SeqSpec(rid=rid, input_ids=ids, sampling=samp, return_logprob=ret_lp[i], logprob_start=start,
                                top_logprobs_num=tops[i], token_ids_logprob=tids[i],
                                return_text_in_logprobs=text_in_lp,
                                abort_keys=frozenset({rid, rids[i]} | ({body["rid"]} if isinstance(body.get("rid"), str) else set()))))
            total += len(ids) + samp.max_new_tokens
            if ret_lp[i]:  # positions: the prompt positions scored (from `start`) + the tokens it may generate
                entries.append((len(ids) - start + samp.max_new_tokens, tops[i], len(tids[i] or ())))
    if len(seqs) > limits.max_seqs:
        raise ProtocolError(f"the request expands to {len(seqs)} sequences, over the limit of {limits.max_seqs}")
    if total > limits.max_total_tokens:
        raise ProtocolError(f"the request needs {total} tokens (prompts + max_new_tokens), over the server's "
                            f"max_total_tokens={limits.max_total_tokens}")
    _check_entries(entries, limits.max_logprob_entries)
    return GenerateRequest(seqs=seqs, is_single=single, stream=stream)


def _check_entries(entries: list[tuple[int, int, int]], limit: int) -> None:
    """The answer's size bound: positions × (1 + top_logprobs_num + len(token_ids_logprob)) (log-prob, id)
    entries, summed over the sequences (`entries`: one (positions, top, n_ids) each), at most `limit`."""
    n = sum(p * (1 + k + t) for p, k, t in entries)
    if n <= limit:
        return
    shapes = {(k, t) for _, k, t in entries}
    positions = sum(p for p, _, _ in entries)
    if len(shapes) == 1:
        (k, t), = shapes
        how = f"{positions} × (1 + {k} + {t}) = {n}"
    else:
        how = f"{n} (summed over {len(entries)} sequences, {positions} positions)"
    raise ProtocolError(f"the answer is too large: positions × (1 + top_logprobs_num + len(token_ids_logprob)) = "
                        f"{how} exceeds max_logprob_entries {limit} (positions: the input positions scored plus "
                        f"max_new_tokens; ask for fewer top log-probs or token ids, or split the batch)")


def _default(body: dict, key: str, default: Any) -> Any:
    v = body.get(key)
    return default if v is None else v


def _rids(rid: Any, batch: int, single: bool) -> list[str]:
    """One rid per prompt: the client's, `f"{rid}_{i}"` when a str names a batch, or a fresh uuid."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch)]
    if isinstance(rid, str) and rid:
        return [rid] if single else [f"{rid}_{i}" for i in range(batch)]
    if isinstance(rid, list) and len(rid) == batch and all(isinstance(r, str) and r for r in rid):
        if len(set(rid)) != len(rid):
            raise ProtocolError("rid contains duplicate request ids")
        return list(rid)
    raise ProtocolError(f"rid must be a non-empty string or a list of {batch} non-empty strings (one per prompt)")


def _check_lengths(ids: tuple[int, ...], max_new: int, limits: Limits, where: str) -> None:
    if len(ids) >= limits.context_len:
        raise ProtocolError(f"the input{where} ({len(ids)} tokens) is longer than the model's context length "
                            f"({limits.context_len} tokens)")
    if len(ids) + max_new >= limits.context_len:
        raise ProtocolError(f"requested token count{where} exceeds the model's maximum context length of "
                            f"{limits.context_len} tokens: {len(ids)} input tokens + max_new_tokens={max_new}")


# -- responses ------------------------------------------------------------------------------------------------------
@dataclass
class SeqResult:
    """What the engine produced for one sequence (filled by the scheduler thread, read once it is finished)."""

    output_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[tuple[list[float], list[int]]] = field(default_factory=list)
    out_ids_logprobs: list[list[float]] = field(default_factory=list)
    in_logprobs: list[float | None] = field(default_factory=list)
    in_top: list[tuple[list[float], list[int]] | None] = field(default_factory=list)
    in_ids_logprobs: list[list[float] | None] = field(default_factory=list)
    finish_reason: dict | None = None


GC_PAUSE_PAIRS = 1_000


@contextmanager
def gc_paused(active: bool = True):
    """Pause the cyclic GC while building or parsing a big log-prob answer (`active`). Such an answer is millions of
    small lists, and the collections their allocation triggers traverse the whole heap (torch, transformers) again
    and again: measured on a 1,024-token × top-20 answer, `build_output` + `orjson.dumps` take 1.9-2.2 µs per
    (log-prob, id) pair with the GC on and 0.29 with it paused; `orjson.loads` 1.3-1.8 vs 0.44. Nothing in them
    makes cycles, so nothing is left for the GC to find afterwards."""
    if not active or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def logprob_pairs(spec: SeqSpec, res: SeqResult) -> int:
    """How many (log-prob, id) pairs the answer for one sequence carries (what `gc_paused` is sized by)."""
    if not spec.return_logprob:
        return 0
    per = 1 + spec.top_logprobs_num + len(spec.token_ids_logprob or ())
    return (len(res.in_logprobs) + len(res.out_logprobs)) * per


class TokenText:
    """Per-token text for `return_text_in_logprobs` (cached: the same ids recur on every request), and the text of
    an empty completion (`empty`)."""

    def __init__(self, tokenizer):
        self.tok, self.cache = tokenizer, {}
        self._empty: dict[bool, str] = {}

    def empty(self, skip_special_tokens: bool) -> str:
        """`tokenizer.decode([], skip_special_tokens=...)` (every scoring answer's text), decoded once per flag."""
        text = self._empty.get(skip_special_tokens)
        if text is None:
            text = self._empty[skip_special_tokens] = self.tok.decode([], skip_special_tokens=skip_special_tokens)
        return text

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tok.decode([token_id])
        return s


def output_text(tokenizer, spec: SeqSpec, res: SeqResult, upto: int | None = None,
                token_text: TokenText | None = None) -> str:
    """Decoded completion. A matched stop token is not part of the text and a matched stop string cuts the text
    where it starts (SGLang detokenizer `trim_matched_stop`), unless `no_stop_trim`. `token_text`: decode through
    it for an empty completion (`TokenText.empty`: the same text, decoded once)."""
    ids = res.output_ids if upto is None else res.output_ids[:upto]
    fr = res.finish_reason if upto is None else None
    s = spec.sampling
    if fr and fr.get("type") == "stop" and not s.no_stop_trim and isinstance(fr.get("matched"), int) and ids:
        ids = ids[:-1]
    if not ids and token_text is not None and token_text.tok is tokenizer:
        text = token_text.empty(s.skip_special_tokens)
    else:
        text = tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens)
    if upto is not None:
        # a streamed prefix may end inside a multi-byte character (byte-level BPE): hold its bytes back (they decode
        # to U+FFFD) until the token that completes it arrives, as SGLang's detokenizer does
        text = text.rstrip("\ufffd")
    if fr and fr.get("type") == "stop" and not s.no_stop_trim and isinstance(fr.get("matched"), str):
        pos = text.find(fr["matched"])
        if pos >= 0:
            text = text[:pos]
    return text


def build_output(tokenizer, spec: SeqSpec, res: SeqResult, weight_version: str, e2e_latency: float | None,
                 token_text: TokenText, upto: int | None = None, logprobs: bool = True) -> dict:
    """The SGLang response object `{text, output_ids, meta_info}` for one sequence (`upto`: a streaming prefix;
    `logprobs=False`: without the log-prob lists even when the spec asks for them, as the binary body's items)."""
    n_out = len(res.output_ids) if upto is None else upto
    meta: dict[str, Any] = {
        "id": spec.rid, "finish_reason": res.finish_reason if upto is None else None,
        "prompt_tokens": len(spec.input_ids), "weight_version": weight_version, "total_retractions": 0,
    }
    if spec.return_logprob and logprobs:
        if spec.return_text_in_logprobs:
            def triples(lps, ids):
                return [[lp, t, token_text(t)] for lp, t in zip(lps, ids)]
        else:  # the common case, inlined: this runs once per (log-prob, id) pair of a scoring answer
            def triples(lps, ids):
                return [[lp, t, None] for lp, t in zip(lps, ids)]

        def tops(entry):
            return None if entry is None else triples(*entry)

        ids_in = list(spec.input_ids[spec.logprob_start:])
        meta["input_token_logprobs"] = triples(res.in_logprobs, ids_in)
        meta["output_token_logprobs"] = triples(res.out_logprobs[:n_out], res.output_ids[:n_out])
        if spec.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [tops(e) for e in res.in_top]
            meta["output_top_logprobs"] = [tops(e) for e in res.out_top[:n_out]]
        if spec.token_ids_logprob is not None:
            want = list(spec.token_ids_logprob)
            meta["input_token_ids_logprobs"] = [None if e is None else triples(e, want) for e in res.in_ids_logprobs]
            meta["output_token_ids_logprobs"] = [triples(e, want) for e in res.out_ids_logprobs[:n_out]]
    meta["completion_tokens"] = n_out
    meta["cached_tokens"] = 0
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    return {"text": output_text(tokenizer, spec, res, upto, token_text), "output_ids": list(res.output_ids[:n_out]),
            "meta_info": meta}
