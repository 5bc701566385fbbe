"""The model behind a reward-model server: an HF sequence-classification checkpoint scored in batched forwards.

`python -m engine.server --model DIR` serves this instead of the generation engine when DIR's config names a
`...ForSequenceClassification` architecture (`engine.classify.is_classifier_checkpoint`); its endpoints are
engine/classify.py's. What it computes, per input: the classification head's logits (`num_labels` floats; a reward
model has one) at the input's last token that is not the config's `pad_token_id` (`score_position`): exactly HF's
`AutoModelForSequenceClassification` forward on the input, so what training/reward_main.py trained is what is
served. SGLang reads the final token (LAST pooling); the two differ only for an input that ends with the pad id
(a tokenizer whose pad is its EOS, scoring a response closed by EOS): such a model scores alike on both engines only
if its pad id differs from the tokens its inputs end with.

Batching: the inputs of concurrent requests share forwards. `score` queues its request and one collector task (on
the server's event loop) runs rounds: a round takes the queued requests (in arrival order, up to `max_total_tokens`
tokens, at least one request), sorts all their inputs by length and cuts them into forwards of at most `max_batch`
rows and `max_prefill_tokens` padded tokens (`infra.batch_groups.token_budget_groups`; a single input longer than
that runs alone), and hands each request its own rows, in its order. Requests that arrive while a round's forwards
run are the next round; a collector that starts from idle first waits up to `batch_window_s` (a few ms) for more,
or until the queued inputs fill one forward's token budget. N specialists posting small batches at once so cost a
forward or two, not N. The pattern is engine/coalesce.py's (queued calls, each with its own future, answered from
one shared request), on the server side. Each forward is one right-padded batch through the backbone
(`model.base_model`, with the attention mask: padding changes no real token's hidden state) and the head
(`model.score`) on each row's last real position, so a request's scores do not depend on what it shared a forward
with (up to float rounding of differently shaped matmuls). Forwards run on one worker thread, so the cores are
never shared between two forwards; the event loop only waits.

Failures stay per request: when a shared round fails (a CUDA out-of-memory, raised as `engine.device.oom_as_error`
words it, or any other error), each of its requests is scored again alone, so only a request that fails by itself
gets the error. `abort(rid)` / `abort(abort_all=True)` fail the matching requests that are still queued (a 503
naming the abort message; a round already running finishes and answers); a request whose client went away is
dropped from the queue; `stop` fails what is still queued and refuses new requests.

The same surface as `engine.scheduler.Engine` where the server touches it (`start`, `stop`, `ready`,
`load_error`, `abort`, `model_path`, `device`, `dtype`, `mem_fraction_static`, `weight_version`), and
`is_generation = False` (what /get_model_info reports). Weight updates are not served for reward models.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import NamedTuple

import torch

from engine.device import (check_mem_fraction, dtype_name, enter_device, memory_budget_error, oom_as_error,
                           resolve_device, resolve_dtype)
from infra.batch_groups import token_budget_groups
from engine.protocol import ProtocolError
from infra.choices import MAX_PREFILL_TOKENS, MAX_TOTAL_TOKENS

log = logging.getLogger("alloy.engine")

MAX_BATCH = 64  # rows per forward (with `max_prefill_tokens` padded tokens, the bound on one forward's activations)
BATCH_WINDOW_S = 0.002  # how long an idle collector waits for more requests before its first forward


def score_position(ids, pad_id: int | None) -> int:
    """Where HF's sequence classifiers read the score: the last position whose id is not `pad_id` (0 when every id
    is the pad id, as HF's argmax gives); the last position when the config has no pad id."""
    if pad_id is None:
        return len(ids) - 1
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_id), 0)


class _Job(NamedTuple):
    """One queued request: its inputs, its rids (what `abort(rid)` matches), and where its scores go."""
    inputs: list[list[int]]
    rids: frozenset
    answer: asyncio.Future
    tokens: int  # Σ len(inputs): the queue's token count is kept, not summed per request


def _split(rows: list, sizes: list[int]) -> list[list]:
    out, at = [], 0
    for n in sizes:
        out.append(rows[at:at + n])
        at += n
    return out


class RewardModel:
    """A sequence-classification model served on /classify. `score` may be awaited from any number of requests on
    one event loop: their inputs share forwards (the module's "Batching"), run one at a time on the worker thread."""

    is_generation = False

    def __init__(self, model_dir: str, *, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS, max_batch: int = MAX_BATCH, threads: int | None = None,
                 weight_version: str = "default", device: str = "cpu", dtype: str = "auto",
                 mem_fraction_static: float | None = None, batch_window_s: float = BATCH_WINDOW_S):
        self.model_path = self.tokenizer_path = str(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.mem_fraction_static = check_mem_fraction(mem_fraction_static)
        self.max_total_tokens, self.max_prefill_tokens, self.max_batch = max_total_tokens, max_prefill_tokens, max_batch
        self.threads, self.weight_version, self.batch_window_s = threads, weight_version, batch_window_s
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alloy-reward-model")
        # rounds: the collector's batches of requests (each one or more forwards); shared_rounds: those of >1 request;
        # retried_rounds: shared rounds that failed and were scored again request by request
        self.stats = {"requests": 0, "inputs": 0, "forwards": 0, "rounds": 0, "shared_rounds": 0,
                      "retried_rounds": 0, "tokens": 0, "padded_tokens": 0, "seconds": 0.0}
        self._queue: collections.deque[_Job] = collections.deque()  # touched on the event loop only
        self._queued = 0  # tokens in the queue
        self._filled = asyncio.Event()  # set when the queue holds a forward's token budget (ends the idle window)
        self._collector: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the tokenizer and model on the worker thread (`ready` is set after; `load_error` if it failed)."""
        self._pool.submit(self._load_guarded)

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, fail the queued ones and shut the worker down (any thread)."""
        self._stopped = True
        self._call_on_loop(self._fail_queued, None, "the reward model stopped")
        self._pool.shutdown(wait=True, cancel_futures=True)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "") -> None:
        """Fail the queued requests with `rid` among their rids (every queued one with `abort_all`) with a 503 naming
        `message`; a round already running finishes (its forwards are short). Any thread (the server calls this on
        shutdown and for /abort_request)."""
        if abort_all or rid:
            self._call_on_loop(self._fail_queued, None if abort_all else rid, message or "aborted")

    def _call_on_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
        else:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _fail_queued(self, rid: str | None, message: str) -> None:
        keep = []
        for job in self._queue:
            if rid is None or rid in job.rids:
                if not job.answer.done():
                    job.answer.set_exception(ProtocolError(f"request aborted: {message}", status=503))
            else:
                keep.append(job)
        self._queue = collections.deque(keep)
        self._queued = sum(j.tokens for j in keep)

    def _load_guarded(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported through /health (503), the log and the exit status
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("failed to load reward model from %s", self.model_path)
            return
        self.ready.set()
        log.info("reward model ready: %s (%s, %d label(s)) on %s in %s, vocab %d, context %d", self.model_path,
                 self.architecture, self.num_labels, self.device, dtype_name(self.dtype), self.vocab_size,
                 self.context_len)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from infra.models import placement_kwargs
        from infra.tokenizer import load_tokenizer

        enter_device(self.device, self.threads, self.mem_fraction_static)
        self.tokenizer = load_tokenizer(self.model_path)
        with oom_as_error(self.device, self.mem_fraction_static):
            model = AutoModelForSequenceClassification.from_pretrained(
                self.model_path, dtype=self.dtype, **placement_kwargs(self.device))
        model.eval()
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module) or model.base_model is model:
            raise ValueError(f"{type(model).__name__}: the embedded engine scores decoder reward models (a `score` "
                             "head on the backbone's last hidden state, as LlamaForSequenceClassification); this "
                             "model has none")
        self.model, self._head = model, head  # already on the device (placement_kwargs)
        cfg = model.config
        self.architecture = type(model).__name__
        self.num_labels = int(cfg.num_labels)
        self.id2label = {int(k): str(v) for k, v in (getattr(cfg, "id2label", None) or {}).items()}
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.pad_token_id = getattr(text_cfg, "pad_token_id", None)
        self.context_len = int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)
        with torch.inference_mode():
            self._forward([[0, 0]])  # warm-up: the first forward pays one-off allocation/dispatch costs
        budget = memory_budget_error(self.device, self.mem_fraction_static)
        if budget is not None:
            raise RuntimeError(budget)

    # -- scoring --------------------------------------------------------------------------------------------------
    async def score(self, inputs: list[tuple[int, ...]] | list[list[int]],
                    rids: list[str] | None = None) -> list[list[float]]:
        """The head's logits at the last token of each input (`num_labels` floats each), in input order. `rids`: the
        request's ids, which `abort(rid)` matches while it is queued."""
        if self._stopped:
            raise RuntimeError("the reward model stopped")
        if not inputs:
            return []
        loop = asyncio.get_running_loop()
        rows = [list(x) for x in inputs]
        job = _Job(rows, frozenset(rids or ()), loop.create_future(), sum(len(x) for x in rows))
        self._queue.append(job)
        self._queued += job.tokens
        if self._collector is None or self._collector.done() or self._loop is not loop:
            self._loop = loop
            self._filled = asyncio.Event()
            self._collector = loop.create_task(self._collect())
        if self._queued >= self.max_prefill_tokens:
            self._filled.set()
        return await job.answer

    async def _collect(self) -> None:
        """Run rounds while requests are queued (one collector per loop: `score` starts it when none runs)."""
        loop = asyncio.get_running_loop()
        if self.batch_window_s > 0 and not self._filled.is_set():  # from idle: let concurrent requests arrive
            try:
                await asyncio.wait_for(self._filled.wait(), self.batch_window_s)
            except asyncio.TimeoutError:
                pass
        while self._queue:
            jobs = self._take()
            if not jobs:
                continue
            try:
                results = await asyncio.wrap_future(self._pool.submit(self._score_round, [j.inputs for j in jobs]))
            except asyncio.CancelledError:
                if not self._stopped:
                    for j in jobs:
                        j.answer.cancel()
                    raise
                results = [RuntimeError("the reward model stopped")] * len(jobs)
            except Exception as e:  # noqa: BLE001 - the pool is shut down: every request of the round gets it
                results = [e] * len(jobs)
            for job, res in zip(jobs, results):
                if job.answer.done():  # its client went away (cancelled) while the round ran
                    continue
                if isinstance(res, BaseException):
                    job.answer.set_exception(res)
                else:
                    job.answer.set_result(res)
            await asyncio.sleep(0)  # let the answered requests' handlers run before the next round

    def _take(self) -> list[_Job]:
        """The next round: queued requests in arrival order, up to `max_total_tokens` tokens (at least one); those
        whose client went away are dropped."""
        jobs, tokens = [], 0
        while self._queue:
            job = self._queue[0]
            if job.answer.done():
                self._queued -= self._queue.popleft().tokens
                continue
            if jobs and tokens + job.tokens > self.max_total_tokens:
                break
            jobs.append(self._queue.popleft())
            self._queued -= job.tokens
            tokens += job.tokens
        if self._queued < self.max_prefill_tokens:
            self._filled.clear()
        return jobs

    def _score_round(self, batch: list[list[list[int]]]) -> list[list[list[float]] | BaseException]:
        """One round on the worker thread: every request's inputs in shared forwards → each request's rows, or the
        error it gets. A shared round that fails is scored again request by request (only a request that fails by
        itself gets an error; after a CUDA OOM the others may fit alone)."""
        t0 = time.perf_counter()
        self.stats["rounds"] += 1
        self.stats["requests"] += len(batch)
        self.stats["shared_rounds"] += len(batch) > 1
        try:
            try:
                return _split(self._score_inputs([x for inputs in batch for x in inputs]), [len(b) for b in batch])
            except Exception as e:  # noqa: BLE001 - answered to the request(s), as before batching across requests
                if len(batch) == 1:
                    return [e]
                log.warning("a shared round of %d requests failed (%s: %s); scoring them one by one", len(batch),
                            type(e).__name__, e)
                self.stats["retried_rounds"] += 1
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            out: list = []
            for inputs in batch:
                try:
                    out.append(self._score_inputs(inputs))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out
        finally:
            self.stats["seconds"] += time.perf_counter() - t0

    def score_sync(self, inputs) -> list[list[float]]:
        """One request's scores on the calling thread (no queue: for callers outside the server's event loop)."""
        res = self._score_round([[list(x) for x in inputs]])[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def _score_inputs(self, inputs: list[list[int]]) -> list[list[float]]:
        """`inputs` in `token_budget_groups` forwards → their rows in input order (a CUDA OOM as `oom_as_error`
        words it). Counted in `stats` once all went through."""
        lengths = [len(x) for x in inputs]
        out: list[list[float] | None] = [None] * len(inputs)
        forwards = padded = 0
        with torch.inference_mode(), oom_as_error(self.device, self.mem_fraction_static):
            for group in token_budget_groups(lengths, self.max_prefill_tokens, max_rows=self.max_batch):
                rows = self._forward([inputs[i] for i in group])
                for i, row in zip(group, rows):
                    out[i] = row
                forwards += 1
                padded += len(group) * max(lengths[i] for i in group)
        self.stats["forwards"] += forwards
        self.stats["padded_tokens"] += padded
        self.stats["inputs"] += len(inputs)
        self.stats["tokens"] += sum(lengths)
        return out  # type: ignore[return-value]

    def _forward(self, seqs: list[list[int]]) -> list[list[float]]:
        """One right-padded forward of `seqs` → (len(seqs), num_labels) logits at each one's `score_position`."""
        at = torch.tensor([score_position(s, getattr(self, "pad_token_id", None)) for s in seqs])
        n = torch.tensor([len(s) for s in seqs])
        L = int(n.max())
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = 1
        hidden = self.model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       use_cache=False)[0]  # (B, L, H)
        last = hidden[torch.arange(len(seqs), device=hidden.device), at.to(hidden.device)]  # (B, H)
        return self._head(last).float().cpu().tolist()

    def server_info(self) -> dict:
        """What /get_server_info reports for this model (its counters included)."""
        return {"architecture": getattr(self, "architecture", None), "num_labels": getattr(self, "num_labels", None),
                "max_total_tokens": self.max_total_tokens, "max_prefill_tokens": self.max_prefill_tokens,
                "max_batch": self.max_batch, "batch_window_s": self.batch_window_s, "context_length": getattr(self, "context_len", None),
                "vocab_size": getattr(self, "vocab_size", None),
                **{f"classify_{k}": (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()}}
