"""Weight sync from a trainer to its rollout server without the disk, in SGLang's formats: to a real SGLang server
(`engine.backend: sglang`, GPU) and to the embedded one, which implements the same endpoints
(engine/sglang_updates.py), so this client is exercised on every run that picks it, CPU tests included.

Three strategies, picked by `choose_sync` (pure) from `engine.sglang_weight_sync` (auto | tensor | distributed |
disk), where the server runs and whether the trainer has CUDA:

- **tensor** (`SGLangTensorSync`): trainer and server on one machine. The trainer's CUDA tensors travel as CUDA IPC
  handles: SGLang's own `MultiprocessingSerializer` (a `ForkingPickler` dump; `output_str=True` = base64, as JSON
  needs) in `POST /update_weights_from_tensor`, one entry of `serialized_named_tensors` per server TP rank (each rank
  reads entry `[tp_rank]`). No copy of the weights is made; the trainer keeps them alive until the server answers.
  The serializer is SGLang's (`sglang.srt.utils`) when sglang is importable, else ours (engine/tensor_payload.py:
  the same format, the device as a GPU UUID as SGLang's patch writes it). With `cpu_tensors` (the embedded server,
  which reads them) CPU tensors travel too, as named shared-memory files (always our serializer then).
- **distributed** (`SGLangDistributedSync`): trainer and server share a NCCL group (gloo for a trainer without
  CUDA and the embedded server: CPU tensors). `backend="auto"` picks at the first push (`group_backend`): gloo for
  host tensors or a server on the trainer's own GPU (NCCL refuses two ranks on one device: "Duplicate GPU
  detected"; the embedded server reports its GPU's UUID in /get_server_info), NCCL otherwise. Once, `POST
  /init_weights_update_group` (master address/port, `rank_offset` 1, `world_size` = 1 trainer + the server's TP
  ranks, backend nccl, group name) while the trainer joins the same group as rank 0; then per push `POST
  /update_weights_from_distributed` with names / dtypes / shapes while rank 0 broadcasts every tensor, in the same
  order, concurrently with the request (the server allocates `torch.empty(shape, getattr(torch, dtype))` per name,
  broadcasts from src 0 and only answers once it has loaded them).
- **disk** (`DiskSync`): today's path (training/policy_server.py): save HF weights, `POST /update_weights_from_disk`.

The HTTP calls go through `engine.client.EngineClient` (one attempt each: a weight update must not run twice).
Every fast push checks SGLang's answer (`{"success": bool, "message": str}`, HTTP 200 or 400). On any failure it
logs a warning saying so and calls the `fallback` it was given (the caller's disk push of the full weights), so a
server that SGLang reports as partially updated ("Please discard the whole weights") is overwritten entirely from
disk, never left half-updated. A failed strategy stays off for the rest of the run (its IPC or NCCL state is not
trusted again); later pushes go straight to disk.

Atomicity: SGLang applies one update request under its model-update writer lock (in-flight generations finish
first, new ones wait), so one request per push keeps sampling on whole weight versions. `bucket_bytes` splits a push
into several requests (bounded receive buffers on the server for the distributed path); then only the last request
carries `weight_version` and `flush_cache`, and a generation running between two requests can see a mix, so split
only where the caller does not sample during the push.

Read (not copied) from sgl-project/sglang: `python/sglang/srt/managers/io_struct.py` at 001067fffe33 (request
fields, below), `python/sglang/srt/entrypoints/http_server.py` at 0025436eab05 (endpoints and response shapes),
`python/sglang/srt/model_executor/model_runner.py` at 01cc04e2b5b0 (server side: rank = rank_offset + tp_rank,
`init_custom_process_group` over `tcp://addr:port` with a `PrefixStore(group_name)`; per-name async broadcasts from
src 0, then `load_weights`), `sglang.srt.utils` `MultiprocessingSerializer`, `test/srt/test_update_weights_from_
distributed.py` at 00b08c497f07; and how THUDM/slime (`update_weight_from_distributed.py`) and verl pair the remote
`init_weights_update_group` call with rank 0 joining the group, then broadcast beside the update call.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from typing import Any, Awaitable, Callable, Iterable, Sequence
from urllib.parse import urlparse

from engine.client import EngineClient, EngineError, EngineRequestError, EngineUnavailable
from infra.choices import Backend, SglangWeightSync, WeightSync, values

log = logging.getLogger("alloy.sglang_sync")

SYNC_FIELD = "engine.sglang_weight_sync"
EMBEDDED_FIELD = "engine.weight_sync"
DEFAULT_GROUP = "alloy_weight_update"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})

DiskPush = Callable[[str, bool], Awaitable[Any]]  # fallback(version, flush_cache): the caller's full disk push


class WeightSyncError(RuntimeError):
    """A fast weight push failed (SGLang refused it, the transport broke, or the strategy cannot run here)."""


# ---------------------------------------------------------------------------------------------------------------
# Choosing a strategy (pure)
# ---------------------------------------------------------------------------------------------------------------

def choose_sync(backend: str, mode: str, same_machine: bool, has_cuda: bool) -> SglangWeightSync:
    """TENSOR | DISTRIBUTED | DISK for a trainer pushing to its SGLang rollout server.

    `backend`, `mode`: `engine.backend` and `engine.sglang_weight_sync` (infra.choices).
    auto: no CUDA → disk; same machine → tensor (CUDA IPC); otherwise → distributed (NCCL). An explicit choice that
    cannot work here raises, naming the field. Not SGLang (`engine.backend: embedded`) → "disk": the embedded
    server's choice is `engine.weight_sync` (`choose_embedded_sync`).
    """
    if mode not in values(SglangWeightSync):
        raise ValueError(f"{SYNC_FIELD} must be one of {list(values(SglangWeightSync))}, got {mode!r}")
    mode = SglangWeightSync(mode)
    if backend != Backend.SGLANG or mode == SglangWeightSync.DISK:
        return SglangWeightSync.DISK
    if mode == SglangWeightSync.TENSOR:
        if not (same_machine and has_cuda):
            raise ValueError(f"{SYNC_FIELD}: tensor needs the trainer on the server's machine with CUDA "
                             f"(same_machine={same_machine}, cuda={has_cuda}); use distributed or disk")
        return SglangWeightSync.TENSOR
    if mode == SglangWeightSync.DISTRIBUTED:
        if not has_cuda:
            raise ValueError(f"{SYNC_FIELD}: distributed broadcasts over NCCL and needs CUDA in the trainer; "
                             "use disk")
        return SglangWeightSync.DISTRIBUTED
    if not has_cuda:
        return SglangWeightSync.DISK
    return SglangWeightSync.TENSOR if same_machine else SglangWeightSync.DISTRIBUTED


def choose_embedded_sync(mode: str, same_machine: bool, has_cuda: bool) -> WeightSync:
    """`engine.weight_sync` for an embedded rollout server → MEMORY | TENSOR | DISTRIBUTED | DISK (`mode` resolved).

    auto: TENSOR (CUDA IPC, /update_weights_from_tensor) when the trainer has CUDA and the server is on its machine,
    else MEMORY (the weight buffer: today's CPU default). An explicit tensor needs the same machine (CUDA IPC handles
    or shm files are local); distributed works anywhere (NCCL with CUDA, gloo without)."""
    if mode not in values(WeightSync):
        raise ValueError(f"{EMBEDDED_FIELD} must be one of {list(values(WeightSync))}, got {mode!r}")
    mode = WeightSync(mode)
    if mode == WeightSync.AUTO:
        return WeightSync.TENSOR if (has_cuda and same_machine) else WeightSync.MEMORY
    if mode == WeightSync.TENSOR and not same_machine:
        raise ValueError(f"{EMBEDDED_FIELD}: tensor sends CUDA IPC / shared-memory handles and needs the server on "
                         "the trainer's machine; use distributed")
    return mode


def is_local_url(url: str) -> bool:
    """True when `url`'s host is this machine by name (loopback, 0.0.0.0, this host's name)."""
    host = (urlparse(url).hostname or "").lower()
    return host in LOCAL_HOSTS or host == socket.gethostname().lower()


def server_tp_size(options: dict | None) -> int:
    """TP ranks of an SGLang server launched with `options` (ServerSpec.options: `tp_size`, 1 when unset)."""
    tp = int((options or {}).get("tp_size") or 1)
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    return tp


# ---------------------------------------------------------------------------------------------------------------
# Request bodies, in SGLang's formats (pure)
# ---------------------------------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """torch.bfloat16 → "bfloat16": SGLang resolves it with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def tensor_update_body(serialized: str, tp_size: int, *, version: str | None, flush_cache: bool) -> dict:
    """`UpdateWeightsFromTensorReqInput`: the same base64 payload for each TP rank (SGLang's own Engine serializes
    one per rank too; each rank deserializes entry [tp_rank])."""
    return {"serialized_named_tensors": [serialized] * tp_size, "load_format": None, "flush_cache": flush_cache,
            "abort_all_requests": False, "weight_version": version}


def init_group_body(master_address: str, master_port: int, world_size: int, group_name: str, *,
                    rank_offset: int = 1, backend: str = "nccl") -> dict:
    """`InitWeightsUpdateGroupReqInput`: server TP rank r joins as rank `rank_offset + r`; the trainer is rank 0."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def distributed_update_body(metas: Sequence[tuple[str, str, list[int]]], group_name: str, *, version: str | None,
                            flush_cache: bool) -> dict:
    """`UpdateWeightsFromDistributedReqInput` for (name, dtype name, shape) in broadcast order."""
    return {"names": [m[0] for m in metas], "dtypes": [m[1] for m in metas], "shapes": [list(m[2]) for m in metas],
            "group_name": group_name, "flush_cache": flush_cache, "abort_all_requests": False,
            "weight_version": version, "load_format": None}


def destroy_group_body(group_name: str) -> dict:
    """`DestroyWeightsUpdateGroupReqInput`."""
    return {"group_name": group_name}


def group_backend(requested: str, tensor_gpu: str | None, server_gpus: Sequence[str] = ()) -> str:
    """The weight-update group's backend: `requested` unless it is "auto"; then gloo for host tensors
    (`tensor_gpu` None) or when the server runs on the trainer's own GPU (`tensor_gpu`, a GPU UUID, among
    `server_gpus`: NCCL refuses two ranks on one device), NCCL otherwise (a real SGLang server reports no UUID)."""
    if requested != "auto":
        return requested
    if tensor_gpu is None or tensor_gpu in server_gpus:
        return "gloo"
    return "nccl"


def check_response(endpoint: str, status: int, body: Any) -> str:
    """SGLang's answer `{"success": bool, "message": str}` (200 on success, 400 otherwise) → its message; anything
    else raises `WeightSyncError` naming the endpoint and what came back."""
    if isinstance(body, dict) and status == 200 and body.get("success") is True:
        return str(body.get("message", ""))
    msg = body.get("message") if isinstance(body, dict) else body
    raise WeightSyncError(f"SGLang {endpoint} failed (HTTP {status}): {str(msg)[:500]}")


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int | None) -> list[list[int]]:
    """Indices of tensors of `nbytes` sizes split into consecutive requests of at most `bucket_bytes` each (a
    tensor larger than that gets a request of its own); None or 0 → one request."""
    if not nbytes:
        return []
    if not bucket_bytes:
        return [list(range(len(nbytes)))]
    out: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(nbytes):
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


# ---------------------------------------------------------------------------------------------------------------
# The trainer's side of the NCCL group (torch.distributed; gloo in the tests)
# ---------------------------------------------------------------------------------------------------------------

def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_update_group(master_address: str, master_port: int, world_size: int, group_name: str, *, rank: int = 0,
                      backend: str = "nccl", timeout_s: float = 600.0):
    """Join the weight-update group as `rank` (the trainer: 0, hosting the TCP store at master_address:port), the
    way SGLang's server ranks join it: a `tcp://` rendezvous, the store prefixed with `group_name`, a process group
    of its own beside any default group the trainer already has (DeepSpeed's). Blocks until all `world_size` ranks
    have joined, so the caller sends `/init_weights_update_group` first or concurrently."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters  # renamed across torch versions
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_tensors(tensors: Sequence, group) -> None:
    """Broadcast `tensors` from rank 0 of `group`, in order (the order of the request's names), and wait."""
    import torch.distributed as dist

    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def leave_update_group(group) -> None:
    """Tear down the trainer's side of the group (abort first where torch can: a peer may be gone)."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None and dist.get_backend(group) == "nccl":
            abort(group)
        else:
            dist.destroy_process_group(group)
    except Exception as e:  # noqa: BLE001 — best effort on a group already broken
        log.warning("could not tear down weight-update group: %s", e)


# ---------------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------------

class _Sync:
    """What the strategies share: the server, the disk fallback, the HTTP calls, the fallback on failure.

    Every request goes through an `EngineClient` (engine/client.py: its session, API key header and per-call
    timeout): `client` when given (the caller's client of the same server), else one made for `base_url` and
    `api_key`, closed by `aclose`."""

    name = "?"

    def __init__(self, base_url: str, fallback: DiskPush, *, api_key: str | None = None, timeout_s: float = 600.0,
                 client: EngineClient | None = None):
        self.base_url, self.fallback = base_url.rstrip("/"), fallback
        self.timeout_s = float(timeout_s)
        self._own_client = client is None
        self.client = client or EngineClient(self.base_url, api_key=api_key, timeout=self.timeout_s, max_retries=0)
        self.disabled: str | None = None  # why the fast path is off (then every push goes to disk)

    async def post(self, endpoint: str, body: dict) -> str:
        """One POST, no retry (a weight update must not run twice), within `timeout_s`; SGLang's message, or
        `WeightSyncError` naming the endpoint (`check_response` for an answer, the transport's error otherwise)."""
        try:
            answer = await self.client.request("POST", endpoint, body, retries=0, timeout=self.timeout_s)
        except EngineRequestError as e:  # SGLang refused (400 with its message) or another error status
            return check_response(endpoint, e.status, e.message)
        except EngineUnavailable as e:  # unreachable, timed out, or 502/503/504
            raise WeightSyncError(f"SGLang {endpoint} at {self.base_url}: {e}") from e
        return check_response(endpoint, 200, answer)

    async def get_json(self, endpoint: str) -> dict:
        """One GET of a JSON object (e.g. /get_server_info), no retry, within min(timeout_s, 30 s); {} when it fails
        or is not an object."""
        try:
            body = await self.client.request("GET", endpoint, retries=0, timeout=min(self.timeout_s, 30.0))
        except EngineError:
            return {}
        return body if isinstance(body, dict) else {}

    async def push(self, named_tensors: Iterable, version: str, flush_cache: bool = True) -> str:
        """Load `named_tensors` ((name, torch.Tensor) pairs, HF names) into the server as `weight_version=version`;
        returns the path that did it ("tensor", "distributed" or "disk")."""
        if self.disabled is None:
            try:
                await self._push(named_tensors, str(version), flush_cache)
                return self.name
            except Exception as e:  # noqa: BLE001 — any failure of the fast path: say so, then disk
                self.disabled = f"{type(e).__name__}: {e}"
                log.warning("SGLang %s weight sync of version %s failed (%s); loading the full weights from disk "
                            "instead, and using disk for the rest of this run", self.name, version, self.disabled)
                await self._abandon()
        await self.fallback(str(version), flush_cache)
        return "disk"

    async def _push(self, named_tensors: Iterable, version: str, flush_cache: bool) -> None:
        raise NotImplementedError

    async def _abandon(self) -> None:
        """Release whatever the failed fast path holds."""

    async def aclose(self) -> None:
        """Release the fast path's state, and close this loop's session of the client made here."""
        await self._abandon()
        if self._own_client:
            await self.client.aclose()


class DiskSync(_Sync):
    """`update_weights_from_disk`: every push is the caller's `fallback` (save HF weights, then
    EngineClient.update_weights, as training/policy_server.py does). The tensors are not used."""

    name = SglangWeightSync.DISK
    options = ("timeout_s",)

    def __init__(self, fallback: DiskPush, base_url: str = "", **kw):
        super().__init__(base_url, fallback, **kw)
        self.disabled = "disk chosen"


class SGLangTensorSync(_Sync):
    """CUDA IPC handles of the trainer's tensors in one `POST /update_weights_from_tensor` per push (same machine).

    `tp_size`: the server's TP ranks (one payload entry each). `serializer`: an object with SGLang's
    `MultiprocessingSerializer.serialize(obj, output_str=True)`; None → sglang's when importable, else ours
    (engine/tensor_payload.py). `cpu_tensors`: CPU tensors may travel too (as shm files; the embedded server reads
    them, a real SGLang server does not), always with our serializer."""

    name = SglangWeightSync.TENSOR
    options = ("timeout_s", "serializer", "cpu_tensors")

    def __init__(self, base_url: str, fallback: DiskPush, *, tp_size: int = 1, serializer=None,
                 cpu_tensors: bool = False, **kw):
        super().__init__(base_url, fallback, **kw)
        self.tp_size, self._serializer, self.cpu_tensors = int(tp_size), serializer, bool(cpu_tensors)

    def serializer(self):
        if self._serializer is None:
            try:
                from sglang.srt.utils import MultiprocessingSerializer
            except ImportError:
                from engine.tensor_payload import Serializer as MultiprocessingSerializer
            self._serializer = MultiprocessingSerializer
        return self._serializer

    async def _push(self, named_tensors: Iterable, version: str, flush_cache: bool) -> None:
        named = [(name, t.detach()) for name, t in named_tensors]
        cpu = [name for name, t in named if not t.is_cuda]
        if cpu and not self.cpu_tensors:
            raise WeightSyncError(f"tensor sync sends CUDA IPC handles; {len(cpu)} tensors are not on a CUDA device "
                                  f"(first: {cpu[0]!r})")
        if cpu:
            from engine.tensor_payload import Serializer
            serializer = Serializer
        else:
            serializer = self.serializer()
        payload = await asyncio.to_thread(serializer.serialize, named, True)
        # `named` stays referenced until the server has answered (it has copied the weights by then)
        await self.post("/update_weights_from_tensor",
                        tensor_update_body(payload, self.tp_size, version=version, flush_cache=flush_cache))


class SGLangDistributedSync(_Sync):
    """Broadcast over a NCCL group of the trainer (rank 0) and the server's TP ranks (1 … tp_size).

    The group is made on the first push (`connect`) and kept; `aclose` destroys it on both sides. `master_address`
    must be reachable from the server (the trainer's address; loopback when both are on one machine);
    `master_port` None → a free port. `bucket_bytes`: see the module docstring (None: one request per push).
    `backend`: nccl, gloo, or auto (`group_backend`, decided at the first push)."""

    name = SglangWeightSync.DISTRIBUTED
    options = ("timeout_s", "master_address", "master_port", "group_name", "backend", "bucket_bytes")

    def __init__(self, base_url: str, fallback: DiskPush, *, tp_size: int = 1, master_address: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                 bucket_bytes: int | None = None, **kw):
        super().__init__(base_url, fallback, **kw)
        self.tp_size, self.master_address, self.master_port = int(tp_size), master_address, master_port
        self.group_name, self.backend, self.bucket_bytes = group_name, backend, bucket_bytes
        self.group = None

    @property
    def world_size(self) -> int:
        return 1 + self.tp_size

    async def connect(self) -> None:
        """`/init_weights_update_group` and the trainer joining as rank 0, concurrently (each waits for the other)."""
        if self.group is not None:
            return
        port = self.master_port or free_port()
        body = init_group_body(self.master_address, port, self.world_size, self.group_name, backend=self.backend)
        post = asyncio.ensure_future(self.post("/init_weights_update_group", body))
        join = asyncio.ensure_future(asyncio.to_thread(join_update_group, self.master_address, port, self.world_size,
                                                       self.group_name, backend=self.backend,
                                                       timeout_s=self.timeout_s))
        try:
            await self._both(post, join, "init_weights_update_group")
        except Exception as e:
            raise WeightSyncError(f"weight-update group {self.group_name!r} at {self.master_address}:{port}: "
                                  f"{e}") from e
        self.group = join.result()
        log.info("SGLang weight-update group %r up (%s:%d, world size %d)", self.group_name, self.master_address,
                 port, self.world_size)

    async def _resolve_backend(self, named: list) -> None:
        """`backend="auto"` → gloo or nccl (`group_backend`), once, before the group is made."""
        if self.backend != "auto":
            return
        import torch

        first = next((t for _, t in named if t.is_cuda), None)
        tensor_gpu = None if first is None else str(torch.cuda.get_device_properties(first.device).uuid)
        server_gpu = (await self.get_json("/get_server_info")).get("cuda_device_uuid") if first is not None else None
        self.backend = group_backend("auto", tensor_gpu, [server_gpu] if server_gpu else [])
        log.info("weight-update group backend %s (trainer's tensors on %s, server on %s)", self.backend,
                 tensor_gpu or "the host", server_gpu or "an unreported device")

    async def _push(self, named_tensors: Iterable, version: str, flush_cache: bool) -> None:
        named = [(name, t.detach()) for name, t in named_tensors]
        await self._resolve_backend(named)
        if self.backend == "nccl":
            bad = [name for name, t in named if not t.is_cuda]
            if bad:
                raise WeightSyncError(f"NCCL broadcasts CUDA tensors; {len(bad)} are not on a CUDA device "
                                      f"(first: {bad[0]!r})")
        if self.backend == "gloo":  # gloo broadcasts host tensors
            named = [(name, t.cpu()) for name, t in named]
        named = [(name, t if t.is_contiguous() else t.contiguous()) for name, t in named]
        await self.connect()
        buckets = plan_buckets([t.numel() * t.element_size() for _, t in named], self.bucket_bytes)
        for b, idx in enumerate(buckets):
            last = b == len(buckets) - 1
            part = [named[i] for i in idx]
            body = distributed_update_body([(n, dtype_name(t.dtype), list(t.shape)) for n, t in part],
                                           self.group_name, version=version if last else None,
                                           flush_cache=flush_cache and last)
            post = asyncio.ensure_future(self.post("/update_weights_from_distributed", body))
            bcast = asyncio.ensure_future(asyncio.to_thread(broadcast_tensors, [t for _, t in part], self.group))
            await self._both(post, bcast, "update_weights_from_distributed")

    async def _both(self, post: asyncio.Future, side: asyncio.Future, what: str) -> None:
        """Wait for the request and rank 0's side of it; the first error wins (a thread stuck in a collective is left
        to the group's timeout or abort; nothing waits for it)."""
        done, pending = await asyncio.wait({post, side}, timeout=self.timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        if pending:
            post.cancel()
            raise WeightSyncError(f"{what} did not finish in {self.timeout_s:.0f} s")

    async def _abandon(self) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            await asyncio.wait_for(self.post("/destroy_weights_update_group", destroy_group_body(self.group_name)),
                                   timeout=30)
        except Exception as e:  # noqa: BLE001 — the server may be the thing that broke
            log.warning("destroy_weights_update_group(%s): %s", self.group_name, e)
        await asyncio.to_thread(leave_update_group, group)


SYNCS: dict[SglangWeightSync, type[_Sync]] = {c.name: c for c in (DiskSync, SGLangTensorSync, SGLangDistributedSync)}


def make_sync(strategy: str, base_url: str, fallback: DiskPush, *, tp_size: int = 1, api_key: str | None = None,
              client: EngineClient | None = None, **kw) -> _Sync:
    """The strategy `choose_sync` picked, for the server at `base_url` (`kw`: the strategy's `options`, e.g.
    timeout_s; the others are left out). `client`: the caller's EngineClient of that server, to send the requests
    through (None: the strategy makes its own from `base_url` and `api_key`)."""
    cls = SYNCS.get(strategy)
    if cls is None:
        raise ValueError(f"weight sync strategy must be one of {sorted(SYNCS)}, got {strategy!r}")
    kw = {k: v for k, v in kw.items() if k in cls.options}
    if cls is DiskSync:
        return DiskSync(fallback, base_url, api_key=api_key, client=client, **kw)
    return cls(base_url, fallback, tp_size=tp_size, api_key=api_key, client=client, **kw)
