"""A trainer's own rollout server: one engine server serving the current policy, weights pushed after each step.

Used by both RL trainers (specialist PPO, OPD student). A push has two halves:
  1. the snapshot: the trainer's weights written where the server can read them, done before the caller's next
     optimizer step may touch them;
  2. the load: the live server takes them as `weight_version = version`, and the supervisor records them so
     that a restarted server comes back with the latest weights and the same version.
`engine.weight_sync` picks the path for the embedded server (`auto`, the default: `tensor` when the trainer has
CUDA, else `memory`). `tensor` / `distributed` (and any SGLang server with `engine.sglang_weight_sync`): SGLang's
own update endpoints through engine/sglang_sync.py (CUDA IPC or shm-file handles of the trainer's tensors; a
broadcast over NCCL, or gloo for host tensors or a server on the trainer's own GPU; a deferred push sends a copy
made on their device); a failed one falls back to a weight buffer (embedded) or disk (SGLang) for the rest of the
run. `memory`: the snapshot is a weight buffer
(engine/weight_buffer.py: `DeepSpeedBackend.named_weights` as raw tensors) in /dev/shm when it has room,
else under the work dir, two files alternating by version (A/B: the server may still read one while the next is
written); the load is `update_weights_from_buffer`, an in-place copy into the server's model. `disk` (and any
SGLang server): an HF dir (`save_hf`) loaded with `update_weights_from_disk`. With `push(..., wait=False)` the
load runs as a task while the caller goes on (sampling the next batch on the previous weights).
The embedded server reads weight buffers only inside the directories it is launched with (`--weight-buffer-dir`,
engine/buffer_paths.py): this server's private /dev/shm directory (made before the launch) and `work_dir/weights`.

The server owns the tracking of its loads: `loaded_version` (the newest version loaded), `wait_version(v)` (until
version v or a newer one is loaded, however many pushes away it is: the student's sampler gates on it, see
"Double buffering" in docs/architecture.md), `load_error` (the first failed load's, which every later
`wait_version` raises) and `load_s` (the time the deferred loads took, start to finish).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from engine.backends import server_backend
from engine.client import EngineClient
from engine.launcher import ServerSpec, Supervisor, launch_settings
from engine.weight_buffer import write_buffer
from infra.choices import Backend, SglangWeightSync, WeightSync, values
from infra.placement import rollout_placement

log = logging.getLogger("alloy.policy_server")


class PolicyServer:
    """Serve `model_dir` under `name`, bound to `host` (the trainer passes `cfg.engine.host`);
    `push(backend, tokenizer, version)` publishes new weights (see the module docstring).

    `weight_sync="disk"` (or an SGLang server) keeps the last `keep` weight directories under `work_dir/weights/`
    (the server may still be reading the previous one while it swaps); "memory" keeps two buffer files, removed
    by `aclose`. `loaded_version`: the version the server has loaded (the last finished load); `wait_version`,
    `load_error`, `load_s`: see the module docstring.
    """

    def __init__(self, supervisor: Supervisor, name: str, model_dir: str, work_dir: str | Path, *,
                 backend: str = Backend.EMBEDDED, api_key: str | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, options: dict | None = None, keep: int = 2, version: int = 0,
                 seed: int | None = None, env: dict[str, str] | None = None, weight_sync: str = WeightSync.AUTO,
                 sglang_weight_sync: str = SglangWeightSync.AUTO):
        if weight_sync not in values(WeightSync):
            raise ValueError(f"PolicyServer: weight_sync must be one of {list(values(WeightSync))}, got {weight_sync!r}")
        self.supervisor, self.name, self.backend = supervisor, name, backend
        self.memory = False  # set by `_fast_sync` (the weight-buffer path of the embedded server)
        extra, options = list(extra_args or []), dict(options or {})
        if seed is not None:  # the sampling stream follows the run's seed (and differs after a resume at `version`)
            stream = (seed * 1_000_003 + version) % 2 ** 31
            options[server_backend(backend).seed_option] = stream
        self.weights_dir = Path(work_dir) / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.keep, self.version, self.loaded_version = keep, version, version
        # the server reads weight buffers only inside the directories it is told (engine/buffer_paths.py): ours
        self._shm_dir: Path | None = None  # a private directory in /dev/shm, made now, chosen at the first push
        self._buffers: set[Path] = set()
        atexit.register(self._remove_buffers)  # from here on: the directory goes even if the server never starts
        dir_flag = server_backend(backend).buffer_dir_flag
        if dir_flag is not None:
            self._shm_dir = self._make_shm_dir(name)
            for d in ([self._shm_dir] if self._shm_dir else []) + [self.weights_dir]:
                extra += [dir_flag, str(d)]
        spec = ServerSpec(name=name, model_path=str(model_dir), backend=backend, host=host, api_key=api_key,
                          extra_args=extra, options=options, weight_version=str(version), env=dict(env or {}))
        self.url = supervisor.start([spec])[name]
        # retries ride out a supervisor restart of this server (tens of seconds on a loaded machine): ~30 s budget
        self.client = EngineClient(self.url, api_key=api_key, max_retries=10, backoff_base=0.25, backoff_max=4.0)
        self._pushed: list[Path] = []
        self._loading: asyncio.Task | None = None
        self.load_error: BaseException | None = None  # the first failed load's error (its version never came)
        self.load_s = 0.0  # time the deferred loads took, start to finish
        self._load_done: asyncio.Event | None = None  # set (and dropped) when a load finishes: wakes `wait_version`
        self._buffer_dir: Path | None = None  # chosen at the first memory push (by then the size is known)
        self.sync = WeightSync.DISK  # the strategy in use (`_fast_sync`): memory | tensor | distributed | disk
        self._sglang = self._fast_sync(backend, weight_sync, sglang_weight_sync, options, api_key)
        self._pushing: tuple | None = None  # (train_backend, tokenizer, weights) of the load in progress (fallback)
        self._held: dict | None = None  # the copy a deferred tensor / distributed push sends (`_snapshot_tensors`)
        self.last_path = self.sync  # the path that loaded the last tensor / distributed push (or "disk")

    def _fast_sync(self, backend: str, embedded_mode: str, sglang_mode: str, options: dict, api_key: str | None):
        """SGLang's tensor / distributed weight update (engine/sglang_sync.py) for either engine, or None (the
        embedded server's weight buffer, or disk). Sets `self.sync` and `self.memory`."""
        import torch

        from engine.sglang_sync import choose_embedded_sync, choose_sync, is_local_url, make_sync, server_tp_size

        cuda, local = torch.cuda.is_available(), is_local_url(self.url)
        if backend == Backend.SGLANG:
            strategy, field, mode = choose_sync(backend, sglang_mode, local, cuda), "sglang_weight_sync", sglang_mode
            fallback = self._disk_fallback
        else:
            strategy, field, mode = choose_embedded_sync(embedded_mode, local, cuda), "weight_sync", embedded_mode
            if server_backend(backend).weights_buffer_flag is None and strategy == WeightSync.MEMORY:
                strategy = WeightSync.DISK
            fallback = self._memory_fallback
        self.sync = strategy
        self.memory = strategy == WeightSync.MEMORY
        if strategy in (WeightSync.MEMORY, WeightSync.DISK):
            return None
        log.info("%s: weight sync %s (engine.%s=%s)", self.name, strategy, field, mode)
        return make_sync(strategy, self.url, fallback, tp_size=server_tp_size(options), api_key=api_key,
                         cpu_tensors=backend != Backend.SGLANG, backend="auto" if cuda else "gloo",
                         client=self.client)  # the server's one client: its weight updates go through it too

    @classmethod
    def for_engine(cls, engine_cfg, supervisor: Supervisor, name: str, model_dir: str, work_dir: str | Path,
                   **kw) -> "PolicyServer":
        """A rollout server launched as `engine_cfg` (infra.config.EngineConfig) says: backend (embedded or real
        SGLang), its options, bind address, API key; on the GPUs the trainer process was given for it
        (infra/placement.py `trainer_env`: PLACEMENT_ENV), if any."""
        settings = launch_settings(engine_cfg, rollout_placement(os.environ))
        return cls(supervisor, name, model_dir, work_dir, **settings, api_key=engine_cfg.api_key,
                   host=engine_cfg.host, weight_sync=engine_cfg.weight_sync,
                   sglang_weight_sync=engine_cfg.sglang_weight_sync, **kw)

    async def push(self, train_backend, tokenizer, version: int, wait: bool = True) -> str:
        """Publish the trainer's weights (rank 0; `save_hf`/`named_weights` are collectives the other ranks join)
        as `weight_version=version`: first awaits the previous load (re-raising its error), then snapshots the
        weights (in a thread) and starts the server's load. `wait=True`: returns once the server has them;
        `wait=False`: returns after the snapshot (the caller may step its optimizer) and the load runs as a task
        (`wait_loaded`). Returns the buffer file or weight dir, or (tensor / distributed sync) the path that loaded
        the weights ("tensor", "distributed", "disk"; the strategy tried when the load is deferred).

        Tensor / distributed sync send the trainer's tensors themselves (IPC handles, a broadcast): with `wait=True`
        the live weights (nothing steps them while the load runs); with `wait=False` a copy on their own device,
        `held`, allocated once and reused (the previous load has finished before the next copy starts), so the
        optimizer may step while the server reads: one more copy of the weights in the training dtype."""
        await self.wait_loaded()
        if self._sglang is not None:
            weights = await asyncio.to_thread(self._snapshot_tensors, train_backend, not wait)
            load, path = self._load_tensors(train_backend, tokenizer, weights, version), self.sync
        elif self.memory:
            path = await asyncio.to_thread(self._snapshot_buffer, train_backend, version)
            load = self._load_buffer(path, version)
        else:
            path = self.weights_dir / f"v{version:06d}"
            await asyncio.to_thread(self._snapshot_dir, train_backend, tokenizer, path)
            load = self._load_dir(path, version)
        self.version = version
        self._loading = asyncio.ensure_future(self._tracked(load))
        if wait:
            await self.wait_loaded()
            if self._sglang is not None:
                return self.last_path
        return str(path)

    async def wait_loaded(self) -> None:
        """Await the load of the last push, if one is in flight; re-raises its error. Several waiters may wait on
        one load (the next push and a trainer's end of run): the task is forgotten only once it has finished, so the
        next push never starts its load before the previous one is done (versions load in order)."""
        task = self._loading
        if task is None:
            return
        try:
            await asyncio.shield(task)
        finally:
            if self._loading is task and task.done():
                self._loading = None

    async def wait_version(self, version: int) -> None:
        """Until the server has loaded `version` or a newer one, whichever push brings it (it may not even have
        started: a sampler waits here for weights still being trained); raises `load_error` once a load has failed
        (a run must not wait on weights that will not come)."""
        while self.load_error is None and self.loaded_version < version:
            if self._load_done is None:
                self._load_done = asyncio.Event()
            await self._load_done.wait()
        if self.load_error is not None:
            raise self.load_error

    async def _tracked(self, load) -> None:
        """Run one deferred load: its time into `load_s`, its error into `load_error`; wakes `wait_version`."""
        t = time.perf_counter()
        try:
            await load
        except Exception as e:
            self.load_error = self.load_error or e
            raise
        finally:
            self.load_s += time.perf_counter() - t
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        event, self._load_done = self._load_done, None
        if event is not None:
            event.set()

    # -- the two halves ---------------------------------------------------------------------------------------------
    @staticmethod
    def _snapshot_dir(train_backend, tokenizer, path: Path) -> None:
        if path.exists():
            shutil.rmtree(path)
        train_backend.save_hf(str(path), tokenizer=tokenizer)

    def _snapshot_tensors(self, train_backend, copy: bool) -> dict:
        """The weights for a tensor / distributed push: the live tensors on their device, or (`copy`) a copy of
        them in `self._held` (reused across pushes while names, shapes, dtypes and devices stay the same)."""
        weights = _named_weights(train_backend, on_device=True)
        if not copy:
            return weights
        held = self._held
        if held is None or list(held) != list(weights) or any(
                (h.shape, h.dtype, h.device) != (w.shape, w.dtype, w.device) for h, w in zip(held.values(),
                                                                                            weights.values())):
            held = self._held = {k: _empty_like(w) for k, w in weights.items()}
        for k, w in weights.items():
            held[k].copy_(w)
        return held

    async def _load_tensors(self, train_backend, tokenizer, weights: dict, version: int) -> None:
        self._pushing = (train_backend, tokenizer, weights)  # what a fallback loads instead
        try:
            self.last_path = await self._sglang.push(list(weights.items()), str(version), flush_cache=True)
        finally:
            self._pushing = None
        self.loaded_version = version

    def _snapshot_buffer(self, train_backend, version: int, weights: dict | None = None) -> Path:
        weights = _named_weights(train_backend) if weights is None else weights
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        path = self._pick_buffer_dir(nbytes) / f"{self.name}-{'ab'[version % 2]}.wbuf"
        self._buffers.add(path)
        write_buffer(path, weights, str(version))
        return path

    @staticmethod
    def _make_shm_dir(name: str) -> Path | None:
        """A private directory in /dev/shm (None when it is not a writable directory): one of the server's
        --weight-buffer-dir, made before the server starts; whether buffers go there is decided at the first push."""
        shm = Path("/dev/shm")
        try:
            if shm.is_dir() and os.access(shm, os.W_OK):
                return Path(tempfile.mkdtemp(prefix=f"alloy-{name}-", dir=shm))
        except OSError:
            pass
        return None

    def _pick_buffer_dir(self, nbytes: int) -> Path:
        """The private /dev/shm directory when it has room for three buffers (A, B and the one being written),
        else `work_dir/weights`."""
        if self._buffer_dir is None:
            room = 0
            try:
                if self._shm_dir is not None:
                    room = shutil.disk_usage(self._shm_dir).free
            except OSError:
                pass
            if self._shm_dir is not None and room >= 3 * nbytes + 64 * 2**20:
                self._buffer_dir = self._shm_dir
            else:
                log.info("%s: /dev/shm has no room for weight buffers (%d bytes free, %d needed); using %s", self.name,
                         room, 3 * nbytes, self.weights_dir)
                self._buffer_dir = self.weights_dir
        return self._buffer_dir

    async def _load_buffer(self, path: Path, version: int) -> None:
        await self.client.update_weights_from_buffer(path=str(path), version=str(version), flush_cache=True)
        self.supervisor.set_weights(self.name, None, str(version), buffer=str(path))
        self.loaded_version = version

    async def _load_dir(self, path: Path, version: int) -> None:
        await self.client.update_weights(str(path), version=str(version), flush_cache=True)
        self.supervisor.set_weights(self.name, str(path), str(version))
        self.loaded_version = version
        self._pushed.append(path)
        while len(self._pushed) > self.keep:
            shutil.rmtree(self._pushed.pop(0), ignore_errors=True)

    async def _memory_fallback(self, version: str, flush_cache: bool) -> None:
        """The embedded server's fast path failed: the full weights of the push in progress as a weight buffer
        (a restarted server comes back with these too)."""
        train_backend, _tokenizer, weights = self._pushing
        path = await asyncio.to_thread(self._snapshot_buffer, train_backend, int(version), weights)
        await self._load_buffer(path, int(version))

    async def _disk_fallback(self, version: str, flush_cache: bool) -> None:
        """SGLang's fast path failed: the full weights of the push in progress through disk (a restarted server
        also comes back with these; after a fast push it comes back with the last disk weights and their older
        version, which the trainers' staleness checks handle, until the next push). The files come from the live
        backend (`save_hf`): after a deferred push they may hold a step newer than `version` says."""
        train_backend, tokenizer, _weights = self._pushing
        path = self.weights_dir / f"v{int(version):06d}"
        await asyncio.to_thread(self._snapshot_dir, train_backend, tokenizer, path)
        await self._load_dir(path, int(version))

    def _remove_buffers(self) -> None:
        for p in self._buffers:
            p.unlink(missing_ok=True)
        self._buffers.clear()
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)

    async def aclose(self) -> None:
        """Finish an in-flight load (its error is logged, not raised), close the client, remove the buffers."""
        try:
            await self.wait_loaded()
        except Exception as e:  # noqa: BLE001 - closing anyway
            log.warning("%s: the last weight load failed: %s", self.name, e)
        if self._sglang is not None:
            await self._sglang.aclose()
        await self.client.aclose()
        self._remove_buffers()
        atexit.unregister(self._remove_buffers)


def _named_weights(train_backend, on_device: bool = False) -> dict:
    weights = train_backend.named_weights(on_device)
    if weights is None:
        raise RuntimeError("PolicyServer.push: named_weights() returned nothing (only rank 0 pushes weights)")
    return weights


def _empty_like(t):
    import torch

    return torch.empty_like(t, memory_format=torch.contiguous_format)
