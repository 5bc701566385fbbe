"""The engine: one scheduler thread owns the model and runs continuous batching over all requests.

Loop (one iteration, `Engine._step`):
  1. take new sequences, aborts and weight-update jobs from thread-safe inboxes;
  2. **scoring** (max_new_tokens = 0): every waiting scoring sequence (up to a padded-token budget) in ONE
     forward, no KV cache; prompt log-probs read off the logits; done;
  3. **prefill**: waiting generation sequences (up to `max_running_requests` running and `max_total_tokens`
     reserved) in one forward (Llama/Qwen2: `FusedDecoder.prefill`, packed, so padding costs no projection or MLP work) that fills
     one fresh left-padded KV cache per width class of the prompts; their first token is sampled; survivors join
     the running batch (`running.RunningBatch`: segments of similar width, each with its own cache; new rows
     merge into the segment of their width, in one copy that also drops its finished rows, or start one);
  4. **decode**: ONE forward of one token for every running sequence (for Llama/Qwen2 the `FusedDecoder` step:
     the same arithmetic without transformers' per-module dispatch, which dominates a tiny model's step on CPU;
     attention per segment); sample; sequences that hit a stop condition become holes of their segment until it
     compacts (`select_rows`, trimming padding columns no row needs). A segment keeps its attention mask in a
     preallocated bool buffer handed to SDPA as a ready 4-D mask, so a step neither concatenates nor rebuilds it.
     Models without the fused step run the HF forward over one segment.

The HTTP side never touches the model: it submits `Seq`s and is called back (`Seq.on_done`, `Seq.on_token`) from
this thread, so /health and /abort_request stay responsive while a forward runs (torch releases the GIL in ops).

Weight updates (queued from any thread, held back until older sequences finish, applied on this thread) are
`engine.weight_updates.WeightUpdates`, a mixin of `Engine`.
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.batching import prefill_group, width_segments
from engine.cuda_graphs import cuda_graph_default
from engine.decode import FusedDecoder
from engine.device import (check_mem_fraction, dtype_name, enter_device, memory_budget_error, oom_as_error,
                           resolve_device, resolve_dtype)
from engine.kv_cache import BatchKVCache
from engine.native_model import engine_model, fused_decode
from engine.running import RunningBatch, Segment
from engine.protocol import ProtocolError, SeqResult, SeqSpec
from engine.sampling import prompt_logprobs, report_logprobs, sample_tokens, top_logprobs
from engine.static_engine import StaticDecode
from engine.weight_updates import UpdateJob, WeightUpdates
from infra.choices import MAX_PREFILL_TOKENS, MAX_RUNNING_REQUESTS, MAX_TOTAL_TOKENS

log = logging.getLogger("alloy.engine")


@dataclass(eq=False)
class Seq:
    """A sequence in flight: its spec, its growing result, and callbacks into the HTTP side (called from the
    engine thread; they must be thread-safe, e.g. `loop.call_soon_threadsafe`)."""

    spec: SeqSpec
    result: SeqResult = field(default_factory=SeqResult)
    on_done: Callable[["Seq"], None] | None = None
    on_token: Callable[["Seq", int], None] | None = None
    created: float = field(default_factory=time.time)
    finished_at: float | None = None
    serial: int = 0
    generator: torch.Generator | None = None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created


class Engine(WeightUpdates, StaticDecode):
    """Owns the model and the scheduler thread. Thread-safe API: `start`, `stop`, `submit`, `abort`,
    `update_weights` (with their ordering and application, from `WeightUpdates`: engine/weight_updates.py);
    the static decode path (a preallocated KV pool, fixed-shape steps, CUDA graphs) is `StaticDecode`'s;
    read-only properties once `ready` is set."""

    is_generation = True  # /get_model_info (a reward model's `engine.reward_model.RewardModel` says False)

    def __init__(self, model_dir: str, *, max_running_requests: int = MAX_RUNNING_REQUESTS,
                 max_total_tokens: int = MAX_TOTAL_TOKENS, max_prefill_tokens: int = MAX_PREFILL_TOKENS, threads: int | None = None, weight_version: str = "default",
                 seed: int = 0, max_segments: int = 4, weights_buffer: str | None = None, device: str = "cpu",
                 dtype: str = "auto", mem_fraction_static: float | None = None, decode_path: str | None = None,
                 cuda_graph: bool | None = None):
        self.model_path = self.tokenizer_path = str(model_dir)
        # where the model, its KV caches and sampling live (engine/device.py; raises DeviceError on a bad value).
        # In process the default stays cpu (float32); the server's --device defaults to auto.
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.mem_fraction_static = check_mem_fraction(mem_fraction_static)
        self.weights_buffer = weights_buffer  # applied right after loading model_dir (its version wins)
        # decode path (Llama/Qwen2): "static" (one preallocated KV pool, fixed-shape steps, CUDA graphs on a GPU:
        # engine/static_batch.py), "segments" (growing left-padded caches: running.py, the CPU's fastest), or
        # "auto": static on CUDA, segments on the CPU. Models the fused decoder does not cover use segments.
        decode_path = decode_path or os.environ.get("ALLOY_ENGINE_DECODE_PATH", "").strip() or "auto"
        if decode_path not in ("auto", "static", "segments"):
            raise ValueError(f"decode_path must be auto, static or segments, got {decode_path!r}")
        self.decode_path = decode_path
        self.cuda_graph = cuda_graph_default() if cuda_graph is None else bool(cuda_graph)
        self._graphs = None  # engine.cuda_graphs.StepGraphs on the static path
        self._static = False  # set by _set_model
        self.max_running_requests = max_running_requests
        self.max_total_tokens, self.max_prefill_tokens = max_total_tokens, max_prefill_tokens
        self.threads = threads
        self.weight_version = weight_version
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")
        self._seed = seed
        self._inbox: collections.deque[Seq] = collections.deque()
        # (rid, abort_all, message, cutoff): an abort hits only sequences submitted before it (serial < cutoff), as
        # in SGLang, whose scheduler reads requests and aborts in arrival order; a late abort never hits newer work
        self._aborts: collections.deque[tuple[str | None, bool, str, int]] = collections.deque()
        self._updates: collections.deque[UpdateJob] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # guards _active_rids and _serial (touched by both threads)
        self._active_rids: set[str] = set()
        self._serial = 0
        self._thread = threading.Thread(target=self._main, name="alloy-engine", daemon=True)
        # engine-thread state
        self._wait_score: collections.deque[Seq] = collections.deque()
        self._wait_gen: collections.deque[Seq] = collections.deque()
        self._batch = RunningBatch(max_segments)  # the decoding rows, in segments of similar width (running.py)
        self.max_segments = max_segments
        self._reserved = 0
        self.steps = 0  # decode steps run; with decode_rows / decode_seconds: batch occupancy and step time
        self.decode_rows = 0
        self.decode_seconds = 0.0
        self.prefill_forwards = self.prefill_tokens = self.prefill_padded_tokens = 0  # generation prefills
        self.prefill_seconds = 0.0
        self.bucketed_steps = 0  # decode steps whose attention was split by row width (batching.attention_buckets)
        self.decode_segments = 0  # Σ over decode steps of the running batch's segments (running.py)
        self.decode_holes = 0  # Σ over decode steps of finished rows still decoded along (RunningBatch.drop)
        self.engine_cpu_seconds = 0.0  # CPU time of the engine thread in _step (vs wall: GIL/CPU contention)
        self.decode_cpu_seconds = 0.0  # CPU time of the engine thread in decode steps (host time per step)
        self.idle_seconds = 0.0  # wall time the engine thread waited for work (nothing running or queued)

    # -- thread-safe API --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, seqs: list[Seq]) -> None:
        """Queue sequences. Raises ProtocolError (409-free: HTTP 400) if a rid is already in flight."""
        with self._lock:
            clash = [s.spec.rid for s in seqs if s.spec.rid in self._active_rids]
            if clash:
                raise ProtocolError(f"request id {clash[0]!r} is already in flight")
            for s in seqs:
                self._active_rids.add(s.spec.rid)
                s.serial = self._serial
                self._serial += 1
        self._inbox.extend(seqs)
        self._wake.set()

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted by AbortReq.") -> None:
        """Abort every in-flight sequence whose rid (or batch/prompt rid) is `rid`, or all of them. Sequences
        submitted after this call are not affected, even if the engine thread applies the abort later."""
        with self._lock:
            cutoff = self._serial
        self._aborts.append((rid, abort_all, message, cutoff))
        self._wake.set()

    def abort_seqs(self, seqs: list[Seq], message: str) -> None:
        for s in seqs:
            self._aborts.append((s.spec.rid, False, message, s.serial + 1))
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._load_initial()
        except Exception as e:  # noqa: BLE001 - reported through /health (503) and the log, never raised
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("failed to load model from %s", self.model_path)
            return
        self.ready.set()
        log.info("engine ready: model %s on %s in %s, vocab %d, context %d, max_running_requests %d, torch threads %d%s",
                 self.model_path, self.device, dtype_name(self.dtype), self.vocab_size, self.context_len,
                 self.max_running_requests, torch.get_num_threads(),
                 "" if self.device.type != "cuda" else
                 f", {torch.cuda.memory_reserved(self.device) / 1e9:.2f} GB reserved"
                 + ("" if self.mem_fraction_static is None else f" (mem_fraction_static {self.mem_fraction_static:g})"))
        with torch.inference_mode():
            while not self._stopping:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - one bad batch must not kill the server
                    log.exception("engine step failed; aborting the affected requests")
                    self._fail_all("internal engine error (see server log)")
            self._fail_all("server shutting down")

    def _load_initial(self) -> None:
        from infra.tokenizer import load_tokenizer

        enter_device(self.device, self.threads, self.mem_fraction_static)
        self.tokenizer = load_tokenizer(self.model_path)
        with oom_as_error(self.device, self.mem_fraction_static):
            self._load_on_device()
        budget = memory_budget_error(self.device, self.mem_fraction_static)
        if budget is not None:
            raise RuntimeError(budget)
        self._size_running_requests()
        gc.freeze()  # the model, torch and the libraries: never scanned by the cyclic GC again (a full collection
        # walked them all, triggered by the millions of small objects of a log-prob answer)

    def _load_on_device(self) -> None:
        self._set_model(engine_model(self.model_path, dtype=self.dtype, device=self.device))
        if self.weights_buffer:
            from engine.weight_buffer import copy_into, read_buffer

            version, tensors = read_buffer(self.weights_buffer)
            copy_into(self.model, tensors, f"weight buffer {self.weights_buffer}")
            self._refresh_fused()
            self.weight_version = version
            log.info("applied weight buffer %s (weight_version %s)", self.weights_buffer, version)
        self._gen = torch.Generator(device=self.device).manual_seed(self._seed)
        with torch.inference_mode():  # warm-up: the first forward pays one-off allocation/dispatch costs
            if self._fused is not None:
                self._fused.prefill([[0, 0]], 1, None)
            else:
                self.model(input_ids=torch.tensor([[0, 0]], device=self.device), use_cache=False)

    def _set_model(self, model) -> None:
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        # SDPA takes a ready boolean 4-D mask (True = attend); eager/other kernels get the 2-D mask
        self._sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
        # decode steps skip transformers' module dispatch for Llama/Qwen2 (same logits; ALLOY_ENGINE_FUSED_DECODE=0
        # turns it off); None → the plain HF forward
        self._fused = FusedDecoder.for_model(model) if fused_decode() else None
        self._static = self._fused is not None and (
            self.decode_path == "static" or (self.decode_path == "auto" and self.device.type == "cuda"))
        if self._static:  # a new model (the batch is empty here): a new pool shaped for it
            self._build_static()
        else:
            self._batch, self._graphs = RunningBatch(self.max_segments if self._fused is not None else 1), None
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        from engine.weight_buffer import state_bytes

        # the largest weight buffer this model takes (the body limit): float32 tensors even for a bf16 model
        self.state_bytes = state_bytes(model, float_bytes=4)
        self.context_len = int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)
        self.num_layers = int(cfg.num_hidden_layers)
        eos = set()
        for src in (getattr(model.generation_config, "eos_token_id", None), getattr(cfg, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            eos |= set(src) if isinstance(src, (list, tuple)) else ({src} if src is not None else set())
        self.eos_ids = frozenset(int(e) for e in eos)

    def _step(self) -> None:
        c0 = time.thread_time()
        try:
            self._step_inner()
        finally:
            self.engine_cpu_seconds += time.thread_time() - c0

    def _step_inner(self) -> None:
        self._wake.clear()
        while self._inbox:
            s = self._inbox.popleft()
            if s.spec.sampling.seed is not None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.spec.sampling.seed)
            (self._wait_score if s.spec.sampling.max_new_tokens == 0 else self._wait_gen).append(s)
        while self._aborts:
            self._apply_abort(*self._aborts.popleft())
        limit = self._admission_limit()
        worked = self._run_scoring(limit) | self._run_prefill(limit)
        if self._batch:
            self._decode_step()
            worked = True
        if not worked:
            t0 = time.perf_counter()
            self._wake.wait(1.0)  # every inbox sets _wake; the timeout is only a safety net
            self.idle_seconds += time.perf_counter() - t0

    # -- aborts and finishing ---------------------------------------------------------------------------------------
    def _apply_abort(self, rid: str | None, abort_all: bool, message: str, cutoff: float = float("inf")) -> None:
        """Finish (as "abort") the matching sequences with serial < cutoff, wherever they are."""
        if abort_all:
            hit = lambda s: s.serial < cutoff  # noqa: E731
        else:
            hit = lambda s: s.serial < cutoff and rid in s.spec.abort_keys  # noqa: E731
        fr = {"type": "abort", "message": message}
        for q in (self._wait_score, self._wait_gen):
            for s in [s for s in q if hit(s)]:
                q.remove(s)
                self._finish(s, fr)
        for s in list(self._inbox):
            if hit(s):  # not yet drained: drain happens first in each step, so this is rare
                self._inbox.remove(s)
                self._finish(s, fr)
        run, holes = self._batch.seqs, self._batch.holes
        rows = [i for i, s in enumerate(run) if i not in holes and hit(s)]
        if rows:
            for i in rows:
                self._finish(run[i], fr)
            self._drop_rows(set(rows))

    def _finish(self, s: Seq, finish_reason: dict) -> None:
        s.result.finish_reason = finish_reason
        s.finished_at = time.time()
        with self._lock:
            self._active_rids.discard(s.spec.rid)
        log.debug("request %s finished: %s, %d prompt + %d output tokens, %.3fs", s.spec.rid, finish_reason["type"],
                  len(s.spec.input_ids), len(s.result.output_ids), s.finished_at - s.created)
        if s.on_done is not None:
            s.on_done(s)

    def _fail_all(self, message: str) -> None:
        while self._inbox:
            self._wait_gen.append(self._inbox.popleft())
        self._apply_abort(None, True, message)
        self._batch.clear()
        self._reserved = 0
        while self._updates:
            self._updates.popleft().future.set_result((False, message))

    # -- forward passes ---------------------------------------------------------------------------------------------
    def _forward_prompts(self, seqs: list[Seq], keep: int, caches: list[tuple[list[int], BatchKVCache]] | None):
        """Forward of prompts. Returns (logits of the last `keep` positions of each prompt (G, keep, V), right-
        aligned; one left-padded mask (g_s, L_s) per `(indices, cache)` entry of `caches`, whose cache it fills).
        Llama/Qwen2: the fused, packed prefill (`FusedDecoder.prefill`); other models: the HF forward, which
        fills one cache (so `caches` is None or one entry with every prompt)."""
        if self._fused is not None:
            return self._fused.prefill([s.spec.input_ids for s in seqs], keep, caches)
        if caches and (len(caches) > 1 or list(caches[0][0]) != list(range(len(seqs)))):
            raise ValueError("the HF forward fills one cache holding every prompt in order")
        L = max(len(s.spec.input_ids) for s in seqs)
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            n = len(s.spec.input_ids)
            ids[i, L - n:] = torch.tensor(s.spec.input_ids)
            mask[i, L - n:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host, moved once
        pos = (mask.cumsum(dim=1) - 1).clamp_(min=0)
        cache = caches[0][1] if caches else None
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=cache is not None, logits_to_keep=keep)
        return out.logits, [mask] if caches else []

    def _fill_input_logprobs(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Prompt log-probs of tokens start … n-1 of every sequence of `seqs` that asks, from their kept logits
        (G, K, V) (row i: seqs[i]'s last K prompt columns), read back in one copy (`sampling.prompt_logprobs`).

        Entry 0 is [null, ids[start]]; entry j ≥ 1 is log P(ids[start+j] | ids[:start+j]) = raw log_softmax of the
        logits at prompt position start+j-1, i.e. kept row K - n + start + j - 1.
        """
        asks, who = [], []
        for i, s in enumerate(seqs):
            spec = s.spec
            if spec.return_logprob and spec.logprob_start < len(spec.input_ids):
                asks.append((i, spec.input_ids, spec.logprob_start, spec.top_logprobs_num, spec.token_ids_logprob))
                who.append(s)
        if not asks:
            return
        for s, (chosen, top, by_id) in zip(who, prompt_logprobs(logits, asks)):
            res = s.result
            res.in_logprobs = [None] + chosen
            if top is not None:
                res.in_top = [None] + top
            if by_id is not None:
                res.in_ids_logprobs = [None] + by_id

    def _run_scoring(self, limit: float) -> bool:
        """One padded forward (no cache) for waiting prefill-only sequences; finish them."""
        batch: list[Seq] = []
        while self._wait_score and self._wait_score[0].serial < limit:
            s = self._wait_score[0]
            L = max([len(s.spec.input_ids)] + [len(b.spec.input_ids) for b in batch])
            if batch and L * (len(batch) + 1) > self.max_prefill_tokens:
                break
            batch.append(self._wait_score.popleft())
        if not batch:
            return False
        need = [s for s in batch if s.spec.return_logprob and s.spec.logprob_start < len(s.spec.input_ids)]
        if need:
            keep = max(len(s.spec.input_ids) - s.spec.logprob_start for s in need)
            logits, _ = self._forward_prompts(need, keep, None)
            self._fill_input_logprobs(need, logits)
        for s in batch:
            self._finish(s, {"type": "length", "length": 0})
        return True

    def _run_prefill(self, limit: float) -> bool:
        """Prefill a group of waiting generation sequences, sample their first token, add them to the running
        batch: one new segment (its own KV cache) per width class of the group (`batching.width_segments`), each
        joining the running segment of its width or starting one (`RunningBatch.add`).

        Admission is FIFO (serial order, `max_running_requests` rows, `max_total_tokens` reserved). Llama/Qwen2 (the
        packed `FusedDecoder.prefill`, where padding costs nothing): all the admitted, shortest first, up to
        `max_prefill_tokens` real tokens. Other models (a left-padded HF forward): the shortest ones of similar
        length (`batching.prefill_group`), so a long resumed partial never pads a group of short prompts to its
        length; the rest wait for the next step."""
        cand: list[Seq] = []
        reserved = self._reserved
        live = self._batch.live
        while self._wait_gen and self._wait_gen[0].serial < limit and live + len(cand) < self.max_running_requests:
            s = self._wait_gen[0]
            need = len(s.spec.input_ids) + s.spec.sampling.max_new_tokens
            if (self._batch or cand) and reserved + need > self.max_total_tokens:
                break
            cand.append(self._wait_gen.popleft())
            reserved += need
        if not cand:
            return False
        lengths = [len(s.spec.input_ids) for s in cand]
        if self._fused is not None:  # packed prefill: no padding cost, so every candidate within the token budget
            pick, total = [], 0
            for i in sorted(range(len(cand)), key=lambda i: (lengths[i], i)):
                if pick and total + lengths[i] > self.max_prefill_tokens:
                    break
                pick.append(i)
                total += lengths[i]
        else:
            pick = prefill_group(lengths, self.max_prefill_tokens)
        chosen = set(pick)
        self._wait_gen.extendleft(reversed([s for i, s in enumerate(cand) if i not in chosen]))
        group = [cand[i] for i in pick]  # shortest first: left-padded, so leading padding descends down the rows
        keep = max([1] + [len(s.spec.input_ids) - s.spec.logprob_start for s in group if s.spec.return_logprob])
        if self._static:
            self._prefill_static(group, keep)
            return True
        if self._fused is not None:  # one cache per width class: short rows never carry a long row's columns
            plan = width_segments([len(s.spec.input_ids) for s in group])
        else:
            plan = [list(range(len(group)))]
        caches = [(idx, BatchKVCache(self.num_layers)) for idx in plan]
        t0 = time.perf_counter()
        logits, masks = self._forward_prompts(group, keep, caches)
        self.prefill_seconds += time.perf_counter() - t0
        self.prefill_forwards += 1
        self.prefill_tokens += sum(int(m.sum()) for m in masks)
        self.prefill_padded_tokens += sum(m.numel() for m in masks)
        self._fill_input_logprobs(group, logits)
        alive, _ = self._sample_and_check(group, logits[:, -1])
        for (idx, cache), mask in zip(caches, masks):
            if not any(alive[i] for i in idx):
                continue
            seqs = [group[i] for i in idx]
            pos = torch.tensor([len(s.spec.input_ids) for s in seqs], dtype=torch.long, device=self.device)
            last = torch.tensor([s.result.output_ids[-1] for s in seqs], dtype=torch.long, device=self.device)
            seg = Segment(seqs, cache, mask, pos, last, buckets=self._fused is not None)
            seg.holes = {r for r, i in enumerate(idx) if not alive[i]}
            if seg.holes:  # finished at their first token: they leave before the segment joins the batch
                seg.compact()
            self._reserved += sum(len(s.spec.input_ids) + s.spec.sampling.max_new_tokens for s in seg.seqs)
            self._batch.add(seg)
        return True

    def _params(self) -> tuple:
        """Per-row sampling tensors of the running batch; rebuilt only when its membership changed."""
        if self._batch.changed:
            self._sampling = self._sampling_params(self._batch.seqs)
            self._batch.changed = False
        return self._sampling

    def _sampling_params(self, seqs: list[Seq]) -> tuple:
        """(temperature, top_p, top_k) per row on the engine's device, and whether any row samples."""
        sp = [s.spec.sampling for s in seqs]
        dev = self.device
        return (torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev),
                torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=dev),
                torch.tensor([p.top_k for p in sp], dtype=torch.long, device=dev),
                any(p.temperature >= 1e-6 for p in sp))

    def _decode_step(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._decode_static() if self._static else self._decode_segments()
        finally:
            self.decode_seconds += time.perf_counter() - t0
            self.decode_cpu_seconds += time.thread_time() - c0

    def _decode_segments(self) -> None:
        batch = self._batch
        ids, pos = batch.inputs()
        B, holes = ids.shape[0], batch.holes
        if self._fused is not None:
            # step_mask may re-grow a segment's mask buffer (and re-derive its buckets): before reading buckets
            parts = [(a, b, s.cache, s.step_mask(self._sdpa), s.buckets) for a, b, s in batch.spans()]
            self.bucketed_steps += any(p[4] is not None for p in parts)
            logits = self._fused.step(ids, pos, parts)
        else:  # the HF forward: one segment (RunningBatch(max_segments=1))
            seg = batch.segs[0]
            logits = self.model(input_ids=ids[:, None], attention_mask=seg.step_mask(self._sdpa),
                                position_ids=pos[:, None], past_key_values=seg.cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
        # the step's counters move together, before `_sample_and_check` finishes rows: a finished request's
        # `on_done` may wake a reader of the counters (a bench) while this thread is still in the step
        self.steps += 1
        self.decode_rows += B
        self.decode_segments += len(batch.segs)
        self.decode_holes += len(holes)
        alive, new = self._sample_and_check(batch.seqs, logits, skip=holes, params=self._params())
        batch.advance(new)
        dead = {i for i, a in enumerate(alive) if not a} - holes
        if dead:
            self._drop_rows(dead)

    def _drop_rows(self, dead: set[int]) -> None:
        """Finished/aborted rows leave the batch lazily: they become holes of their segment (decoded along, their
        tokens ignored) until the segment compacts (`Segment.wants_compaction`) or absorbs new rows (a copy
        anyway). Compacting copies the segment: doing it per finished row cost more than decoding a few dead rows
        (bench/april.py, where rows finish at nearly every step)."""
        run = self._batch.seqs
        for i in dead:
            s = run[i]
            self._reserved -= len(s.spec.input_ids) + s.spec.sampling.max_new_tokens
        self._batch.drop(dead)
        if not self._batch:
            self._reserved = 0

    # -- sampling and stop conditions -------------------------------------------------------------------------------
    def _sample_and_check(self, seqs: list[Seq], logits: torch.Tensor, params=None,
                          skip: set[int] = frozenset()) -> tuple[list[bool], torch.Tensor]:
        """Sample one token per row of `logits` (B, V), record it (and its log-probs), check stop conditions.
        Finished sequences are finished here; returns (alive flags, sampled ids (B,)). Rows in `skip` (holes:
        already finished) record nothing and count as not alive."""
        if params is None:
            params = self._sampling_params(seqs)
        temp, top_p, top_k, any_sampled = params
        dev = self.device
        uniform = torch.zeros(len(seqs), device=dev)
        if any_sampled:  # all-greedy batches draw no random numbers
            uniform = torch.rand(len(seqs), generator=self._gen, device=dev)
            for i, s in enumerate(seqs):
                if s.generator is not None and s.spec.sampling.temperature >= 1e-6:
                    uniform[i] = torch.rand(1, generator=s.generator, device=dev)
        ids_t = sample_tokens(logits, temp, top_p, top_k, uniform)
        ids = ids_t.tolist()  # the step's one host sync for the tokens
        lp_rows = [i for i, s in enumerate(seqs) if s.spec.return_logprob]
        lp_row_of = {i: r for r, i in enumerate(lp_rows)}
        logp = None
        if lp_rows:
            idx = torch.tensor(lp_rows, dtype=torch.long, device=dev)
            logp = report_logprobs(logits[idx], temp[idx], self.original_logprob)
            chosen = logp.gather(1, ids_t[idx][:, None]).squeeze(1).tolist()
            tops = self._step_top_logprobs(seqs, lp_rows, logp)
        alive = []
        eos, record = self.eos_ids, self._record_token
        for i, s in enumerate(seqs):
            if i in skip:
                alive.append(False)
                continue
            tok, sp, spec = ids[i], s.spec.sampling, s.spec
            stop_token = not sp.ignore_eos and (tok in eos or tok in sp.stop_token_ids)
            if logp is not None and spec.return_logprob:
                r = lp_row_of[i]
                alive.append(record(s, tok, stop_token, chosen[r], tops[r] if spec.top_logprobs_num > 0 else None,
                                    None if spec.token_ids_logprob is None
                                    else logp[r, list(spec.token_ids_logprob)].tolist()))
            else:
                alive.append(record(s, tok, stop_token))
        return alive, ids_t

    def _record_token(self, s: Seq, tok: int, stop_token: bool, logprob: float | None = None,
                      top: tuple | None = None, ids_logprobs: list | None = None) -> bool:
        """Append one sampled token (and its log-probs, when the row asked for them) to `s`'s result and finish `s`
        if it stops; returns whether it goes on. Both decode paths record their steps here. `stop_token`: the token
        is one of the row's stop tokens (EOS unless ignore_eos); only then, at the length limit or with stop
        strings are the stop conditions checked in full (`_check_stop`, SGLang's order): most steps of most rows
        check nothing."""
        res, sp = s.result, s.spec.sampling
        out = res.output_ids
        out.append(tok)
        if logprob is not None:
            res.out_logprobs.append(logprob)
            if top is not None:
                res.out_top.append(top)
            if ids_logprobs is not None:
                res.out_ids_logprobs.append(ids_logprobs)
        fr = self._check_stop(s, tok) if stop_token or len(out) >= sp.max_new_tokens or sp.stop_strs else None
        if s.on_token is not None:
            s.on_token(s, len(out))
        if fr is not None:
            self._finish(s, fr)
        return fr is None

    @staticmethod
    def _step_top_logprobs(seqs: list[Seq], lp_rows: list[int], logp: torch.Tensor) -> dict[int, tuple]:
        """{row of `logp`: (values, ids)} of the top-k log-probs of every row that asks for them: one `topk` and one
        transfer to the host per distinct k in the step (not one per row)."""
        by_k: dict[int, list[int]] = {}
        for r, i in enumerate(lp_rows):
            k = seqs[i].spec.top_logprobs_num
            if k > 0:
                by_k.setdefault(k, []).append(r)
        out: dict[int, tuple] = {}
        for k, rows in by_k.items():
            sel = logp if len(rows) == logp.shape[0] else logp[torch.tensor(rows, device=logp.device)]
            vals, tix = top_logprobs(sel, k)
            out.update((r, (vals[j], tix[j])) for j, r in enumerate(rows))
        return out

    def _check_stop(self, s: Seq, tok: int) -> dict | None:
        """SGLang `Req.check_finished` order: length first, then stop/EOS token (unless ignore_eos), then strings."""
        sp, out = s.spec.sampling, s.result.output_ids
        if len(out) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if not sp.ignore_eos and (tok in sp.stop_token_ids or tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if sp.stop_strs:
            # only the tail can contain a new match: decode enough tokens to cover the longest stop string (its
            # UTF-8 length: a byte-level BPE may spend one token per byte of a non-ASCII character)
            tail_tokens = max(len(x.encode("utf-8")) for x in sp.stop_strs) + 8
            tail = self.tokenizer.decode(out[-tail_tokens:], skip_special_tokens=sp.skip_special_tokens)
            for stop in sp.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None
