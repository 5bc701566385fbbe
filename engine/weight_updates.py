"""Weight updates of the engine (`engine.scheduler.Engine`): how a new set of weights is queued, when it is
applied, and how.

`update_weights` (an HF dir: /update_weights_from_disk) and `update_weights_from_tensors` (a weight buffer's
tensors: /update_weights_from_buffer) queue an `UpdateJob` from any thread. The engine thread applies it in order
(`_admission_limit`, called each step): sequences submitted before the job finish on the old weights (or are aborted
with `abort_all`), later ones wait, and once nothing older is left the job is applied: a new model loaded and set
(`_load_weights`) or the tensors copied into the live one in place (`_copy_weights`, then the fused decoder's
copies refreshed). The job's future gets (success, message).

`WeightUpdates` is a mixin of `Engine`, split out of engine/scheduler.py to keep it readable: its methods use the
engine's state (`_lock`, `_serial`, `_updates`, `_wake`, the wait queues, the running batch, the model) and its
`_apply_abort` and `_set_model`. It imports no torch at module level (the engine does).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("alloy.engine")


@dataclass
class UpdateJob:
    model_path: str  # an HF dir to load; with `tensors`: where they came from (for messages)
    weight_version: str | None
    abort_all: bool
    future: concurrent.futures.Future
    cutoff: int = 0  # sequences submitted before the job (serial < cutoff) still run on the old weights
    aborted: bool = False
    tensors: dict | None = None  # {HF name: tensor}: copied into the live model in place (weight_buffer.copy_into)
    partial: bool = False  # `tensors` may be a subset of the weights (SGLang's update endpoints)
    endpoint: str = "update_weights_from_buffer"  # for the abort message


class WeightUpdates:
    """The weight-update half of `Engine` (module docstring): the thread-safe `update_weights*` calls and their
    application on the engine thread."""

    def update_weights(self, model_path: str, weight_version: str | None = None,
                       abort_all: bool = False) -> concurrent.futures.Future:
        """Load new weights from an HF dir. Sequences submitted earlier finish on the old weights (or are aborted
        if `abort_all`); later ones wait and run on the new weights. Future → (success, message)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            cutoff = self._serial
        self._updates.append(UpdateJob(model_path, weight_version, abort_all, fut, cutoff))
        self._wake.set()
        return fut

    def update_weights_from_tensors(self, tensors: dict, weight_version: str | None, abort_all: bool = False,
                                    source: str = "a weight buffer", *, partial: bool = False,
                                    endpoint: str = "update_weights_from_buffer") -> concurrent.futures.Future:
        """Copy `tensors` ({HF name: tensor}, e.g. `weight_buffer.read_buffer`, or the tensors of SGLang's
        update_weights_from_tensor / _from_distributed) into the live model in place, all or none of them, with the
        ordering of `update_weights`. `partial`: a subset of the weights is fine (else every parameter must be
        there). Future → (success, message)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            cutoff = self._serial
        self._updates.append(UpdateJob(source, weight_version, abort_all, fut, cutoff, tensors=tensors,
                                       partial=partial, endpoint=endpoint))
        self._wake.set()
        return fut

    # -- engine thread: applying a job ------------------------------------------------------------------------------
    def _admission_limit(self) -> float:
        """Serial number below which waiting sequences may start; a pending weight update pauses later arrivals
        and is applied once everything submitted before it has finished."""
        if not self._updates:
            return float("inf")
        job = self._updates[0]
        if job.abort_all and not job.aborted:
            job.aborted = True
            what = job.endpoint if job.tensors is not None else "update_weights_from_disk"
            self._apply_abort(None, True, f"Aborted by {what} (abort_all_requests).", job.cutoff)
        pending_old = any(s.serial < job.cutoff for s in self._wait_gen) or any(s.serial < job.cutoff for s in self._wait_score)
        if not self._batch and not pending_old:
            self._updates.popleft()
            job.future.set_result(self._load_weights(job))
            return self._admission_limit()
        return job.cutoff

    def _refresh_fused(self) -> None:
        if self._fused is not None:
            self._fused.refresh()

    def _copy_weights(self, job: UpdateJob) -> tuple[bool, str]:
        from engine.weight_buffer import copy_into

        t0 = time.perf_counter()
        try:
            n = copy_into(self.model, job.tensors, job.model_path, complete=not job.partial)
        except ValueError as e:  # names/shapes refused before anything was copied: the old weights stay
            return False, f"Failed to update weights: {e}"
        except Exception as e:  # noqa: BLE001 - reported as success=false (a copy that failed midway)
            log.exception("in-place weight copy from %s failed", job.model_path)
            return False, (f"Failed to update weights from {job.model_path} midway ({type(e).__name__}: {e}); "
                           "the model may hold a mix of old and new weights: push a full set again")
        job.tensors = None  # let go of the sources (CUDA IPC memory is the sender's until released)
        self._refresh_fused()
        if job.weight_version is not None:
            self.weight_version = job.weight_version
        msg = f"Succeeded to update model weights from {job.model_path} ({n} tensors, in place) in " \
              f"{time.perf_counter() - t0:.3f}s."
        log.info("%s weight_version=%s", msg, self.weight_version)
        return True, msg

    def _load_weights(self, job: UpdateJob) -> tuple[bool, str]:
        from engine.native_model import engine_model

        if job.tensors is not None:
            return self._copy_weights(job)
        t0 = time.perf_counter()
        try:  # on the host in the engine's dtype first: a bad dir never touches the device
            model = engine_model(job.model_path, dtype=self.dtype)
        except Exception as e:  # noqa: BLE001 - a bad path is the client's error, reported as success=false
            return False, f"Failed to load weights from {job.model_path}: {type(e).__name__}: {e}"
        vocab = int(model.get_input_embeddings().weight.shape[0])
        if vocab != self.vocab_size:
            return False, f"Failed to update weights: {job.model_path} has vocab {vocab}, the server's tokenizer {self.vocab_size}"
        if self.device.type != "cpu":
            try:
                model.to(self.device)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory next to the old model: keep serving the old one
                import torch

                model = None
                torch.cuda.empty_cache()
                return False, (f"Failed to move the weights of {job.model_path} to {self.device} "
                               f"({type(e).__name__}: {e}); the old weights stay")
        self._set_model(model)
        self.model_path = job.model_path
        if job.weight_version is not None:
            self.weight_version = job.weight_version
        msg = f"Succeeded to update model weights from {job.model_path} in {time.perf_counter() - t0:.2f}s."
        log.info("%s weight_version=%s", msg, self.weight_version)
        return True, msg
