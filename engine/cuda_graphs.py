"""The static decode step (`FusedDecoder.step_static`) captured as CUDA graphs, one per (rows, columns) shape.

Why: a small model's eager decode step on a GPU is a few hundred kernel launches of microseconds each, and the host
issuing them is the bottleneck (the card idles between kernels). A captured graph replays the whole step with one
launch. The static step reads its inputs in place from the KV pool's `last`/`pos` buffers and its shapes depend only
on (rows, columns), so one graph per shape pair replays every step of that shape; `batching.batch_bucket` and
`column_bucket` keep the pairs few. Graphs are captured lazily, the first time a shape runs, into one shared memory
pool (SGLang and gpt-fast do the same); they read the pool's buffers, so they are dropped when the pool grows.

Capture follows torch's recipe (torch.cuda.graphs): warm-up runs on a side stream first. A warm-up writes the keys
and values of the step's inputs into the pool, which the replay right after writes again, identically. Any failure
to capture (an op that syncs, an old driver) is logged once and the engine goes on eagerly; `ALLOY_ENGINE_CUDA_GRAPH=0`
or the server's `--disable-cuda-graph` turns graphs off.
"""
from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger("alloy.engine")


def cuda_graph_default() -> bool:
    """Graphs on unless ALLOY_ENGINE_CUDA_GRAPH is 0/false/no (they only ever apply to a CUDA device)."""
    return os.environ.get("ALLOY_ENGINE_CUDA_GRAPH", "1").lower() not in ("0", "false", "no")


class StepGraphs:
    """Runs the static decode step of `decoder` over `pool` for (rows, columns): replayed from a captured graph on
    CUDA when `enabled`, else eagerly. `captured` counts graphs, `capture_seconds` their capture time."""

    def __init__(self, decoder, pool, enabled: bool):
        self.decoder, self.pool = decoder, pool
        self.enabled = bool(enabled) and pool.device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.generation = pool.generation
        self.mempool = None
        self.captured = 0
        self.replays = 0
        self.capture_seconds = 0.0
        self.error: str | None = None

    def eager(self, rows: int, columns: int) -> torch.Tensor:
        p = self.pool
        return self.decoder.step_static(p.last[:rows], p.pos[:rows], p, columns)

    def reset(self) -> None:
        """Forget every graph (the model's weights were replaced by new tensors, or the pool moved)."""
        self.graphs.clear()
        self.generation = self.pool.generation

    def run(self, rows: int, columns: int) -> torch.Tensor:
        """Logits (rows, V) of one step; valid until the next call."""
        if not self.enabled:
            return self.eager(rows, columns)
        if self.pool.generation != self.generation:
            self.reset()
        entry = self.graphs.get((rows, columns))
        if entry is None:
            try:
                entry = self._capture(rows, columns)
            except Exception as e:  # noqa: BLE001 - fall back to eager steps, once and loudly
                self.enabled, self.error = False, f"{type(e).__name__}: {e}"
                self.graphs.clear()
                log.warning("CUDA graph capture failed for %d rows × %d columns; decoding eagerly from now on: %s",
                            rows, columns, self.error)
                torch.cuda.synchronize(self.pool.device)
                return self.eager(rows, columns)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, rows: int, columns: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        dev = self.pool.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager(rows, columns)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's HTTP thread may touch CUDA (memory stats) while this thread captures
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = self.eager(rows, columns)
        self.graphs[(rows, columns)] = (graph, out)
        self.captured += 1
        self.capture_seconds += time.perf_counter() - t0
        log.debug("captured a CUDA graph of the decode step: %d rows × %d columns (%.3fs)", rows, columns,
                  time.perf_counter() - t0)
        return graph, out
