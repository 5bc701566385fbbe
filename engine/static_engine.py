"""The engine's static decode path (`Engine` mixin): prefill into and decode over one preallocated KV pool
(`engine.static_batch`), fixed-shape steps replayed as CUDA graphs on a GPU (`engine.cuda_graphs`), the whole
batch's sampling and read-back in one device→host copy (`engine.static_step`). `Engine._set_model` picks it
(decode_path "static", or "auto" on CUDA) for the models `FusedDecoder` computes; the segment path
(`engine.running`) stays the CPU's default. The scheduler's loop, admission, aborts and weight updates are shared:
a `StaticBatch` has the running batch's interface."""
from __future__ import annotations

import logging
import time

import torch

from engine.batching import running_rows_for_memory
from engine.cuda_graphs import StepGraphs
from engine.static_batch import KVPool, StaticBatch
from engine.static_step import StepRead, sample_and_read, step_params

log = logging.getLogger("alloy.engine")


class StaticDecode:
    """Mixin of `engine.scheduler.Engine` (its state: `_fused`, `_batch`, `_graphs`, counters)."""

    def _build_static(self) -> None:
        """A KV pool shaped for the current model, the static batch over it, and its graph runner."""
        if isinstance(self._batch, StaticBatch):
            self._batch.pool.free()
        first = self._fused.layers[0]
        pool = KVPool(len(self._fused.layers), first["split"][1] // first["head_dim"], first["head_dim"],
                      self.dtype, self.device)
        self._batch = StaticBatch(pool)
        self._graphs = StepGraphs(self._fused, pool, self.cuda_graph)

    def _size_running_requests(self) -> None:
        """On a GPU with the static pool: at most as many running rows as a pool of full-context rows fits in
        what is left of this server's memory share after the model (90% of it: logits and activations need the
        rest), as SGLang sizes its KV cache from `mem_fraction_static`."""
        if not self._static or self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        share = (self.mem_fraction_static or 0.9) * total
        left = 0.9 * (share - torch.cuda.memory_reserved(self.device))
        columns = 1 << max(6, (self.context_len - 1).bit_length())
        rows = running_rows_for_memory(self.max_running_requests, left, self._batch.pool.bytes_per_token, columns)
        if rows < self.max_running_requests:
            log.info("max_running_requests %d → %d: a KV pool of %d-token rows fits %.2f GB", self.max_running_requests,
                     rows, columns, left / 1e9)
            self.max_running_requests = rows

    def _prefill_static(self, group: list, keep: int) -> None:
        """The packed prefill writing each prompt's keys/values into its own row of the static pool (after the
        running rows); the first tokens are sampled; rows that finished at once leave again (`_drop_rows`)."""
        batch = self._batch
        n = len(batch)
        slots = batch.slots_for([len(s.spec.input_ids) for s in group],
                                [s.spec.sampling.max_new_tokens for s in group])
        t0 = time.perf_counter()
        logits, _ = self._fused.prefill([s.spec.input_ids for s in group], keep, None, static=(batch.pool, slots))
        self.prefill_seconds += time.perf_counter() - t0
        self.prefill_forwards += 1
        real = sum(len(s.spec.input_ids) for s in group)
        self.prefill_tokens += real
        self.prefill_padded_tokens += real
        self._fill_input_logprobs(group, logits)
        alive, first = self._sample_and_check(group, logits[:, -1])
        pos = torch.tensor([len(s.spec.input_ids) for s in group], dtype=torch.long).to(self.device)
        batch.add(group, first, pos)
        self._reserved += sum(len(s.spec.input_ids) + s.spec.sampling.max_new_tokens for s in group)
        dead = {n + i for i, a in enumerate(alive) if not a}
        if dead:
            self._drop_rows(dead)

    def _decode_static(self) -> None:
        """One step of the static batch: a fixed-shape forward (a CUDA graph replay on a GPU), then sampling,
        log-probs, top-k and stop tokens of every row on the device, read back in one copy (`static_step`)."""
        batch = self._batch
        n = len(batch)
        rows, columns = batch.shape()
        logits = self._graphs.run(rows, columns)[:n]
        if batch.changed:
            self._sampling = step_params(batch.seqs, self.device, self.vocab_size, self.eos_ids)
            batch.changed = False
        params = self._sampling
        ids, read = sample_and_read(logits, params, self._gen, self.original_logprob)
        batch.advance(ids)
        self.steps += 1
        self.decode_segments += 1
        self.decode_rows += n
        dead = self._record_static(batch.seqs, read)
        if dead:
            self._drop_rows(dead)

    def _record_static(self, seqs: list, read: StepRead) -> set[int]:
        """Append one step's `StepRead` to each row's result and finish the rows that stop (SGLang's order, as in
        `_sample_and_check`); returns the finished rows."""
        dead, record = set(), self._record_token
        for i, s in enumerate(seqs):
            spec, k = s.spec, s.spec.top_logprobs_num
            if spec.return_logprob:
                vals, tix = read.top[i] if k > 0 else ((), ())
                top = (vals[:k], tix[:k]) if k > 0 else None
                alive = record(s, read.ids[i], read.stop_hit[i], read.logprob[i], top,
                               None if spec.token_ids_logprob is None
                               else read.token_ids_logprobs[i][: len(spec.token_ids_logprob)])
            else:
                alive = record(s, read.ids[i], read.stop_hit[i])
            if not alive:
                dead.add(i)
        return dead

    def graph_info(self) -> dict:
        """The static path's CUDA graph counters for /get_server_info (empty on the segment path)."""
        g = self._graphs
        if g is None:
            return {}
        return {"cuda_graph": g.enabled, "cuda_graphs_captured": g.captured, "cuda_graph_replays": g.replays,
                "cuda_graph_capture_seconds": round(g.capture_seconds, 6), "cuda_graph_error": g.error}
