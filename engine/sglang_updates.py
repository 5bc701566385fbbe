"""SGLang's own weight-update endpoints on the embedded server, in SGLang's formats, so that one trainer-side client
(engine/sglang_sync.py) serves both engines and is exercised against a server we run:

- `POST /update_weights_from_tensor` (`UpdateWeightsFromTensorReqInput`): `serialized_named_tensors[0]` (this server
  is TP rank 0) is base64 of a `ForkingPickler` dump of [(name, tensor), ...]: CUDA IPC handles for CUDA tensors,
  named shared-memory files for CPU tensors. Read with the allow-listed unpickler of engine/tensor_payload.py (a
  refused global → 400 naming it; nothing of it ran) in a thread, then applied like a weight buffer.
- `POST /init_weights_update_group` (`InitWeightsUpdateGroupReqInput`): join a torch.distributed group as rank
  `rank_offset` (+ TP rank 0) of `world_size` over `tcp://master_address:master_port` with the store prefixed by
  `group_name`, as SGLang's model runner does (engine/sglang_sync.py `join_update_group`, the trainer's side uses the
  same function as rank 0). `backend`: nccl (the server must run on CUDA) or gloo (CPU tensors; what the CPU tests
  and a trainer without CUDA use). The join blocks until every rank has come, so it runs in a thread.
- `POST /update_weights_from_distributed` (`UpdateWeightsFromDistributedReqInput`): a tensor per (name, dtype,
  shape) is allocated (on the server's device for nccl, on the host for gloo) and received by broadcast from rank 0
  in order, in a thread; then all of them are applied at once.
- `POST /destroy_weights_update_group`.

Applying: `Engine.update_weights_from_tensors(partial=True)`, on the engine thread between steps (engine/
weight_updates.py): sequences submitted before finish on the old weights, later ones wait; every name, shape and
kind is checked before anything is copied, so a refused set leaves the old weights (all or nothing per request);
`weight_version` is set with them; `flush_cache` is accepted (the engine keeps no cache across requests). A subset of
the weights is fine (SGLang's client may split a push into buckets). Answers are SGLang's
`{"success": bool, "message": str}` with HTTP 200 or 400 (a malformed body too, so its client reads the message).
A distributed update whose metas are well-formed but wrong for the model (a shape) is still received whole (the
trainer is broadcasting it), then refused.

Memory: a distributed update holds one received copy of the tensors it carries until they are copied in (the client's
`bucket_bytes` bounds it); metas promising more than `MAX_RECEIVE_FACTOR` x the model's state bytes are refused before
any receive (the trainer's broadcast then fails on its timeout).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from aiohttp import web

from engine.protocol import ProtocolError
from engine.request_guards import json_body

log = logging.getLogger("alloy.engine.sglang_updates")

READY = web.AppKey("weight_update_engine_ready", object)  # request → the ready Engine (engine.server's check)
GROUPS = web.AppKey("weight_update_groups", dict)
GROUP_LOCK = web.AppKey("weight_update_group_lock", asyncio.Lock)
JOIN_TIMEOUT_S = 600.0  # the rendezvous and every collective of the group (torch.distributed's own timeout)
MAX_RECEIVE_FACTOR = 2
BACKENDS = ("nccl", "gloo")


def _answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _engine(request: web.Request):
    return request.app[READY](request)


async def _body(request: web.Request) -> dict:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _common(body: dict) -> tuple[str | None, bool]:
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ProtocolError("weight_version must be a string or null")
    for key in ("flush_cache", "abort_all_requests", "torch_empty_cache", "disable_draft_model"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ProtocolError(f"{key} must be true or false")
    if body.get("load_format") not in (None, "direct"):
        raise ProtocolError(f"load_format {body['load_format']!r} is not supported by the embedded server "
                            "(null or 'direct': a list of (name, tensor) pairs)")
    return version, bool(body.get("abort_all_requests", False))


def _sglang_errors(handler):
    """A malformed body answers SGLang's shape (success false, HTTP 400) instead of the server's error object."""
    async def wrapped(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except ProtocolError as e:
            if e.status != 400:
                raise
            log.info("%s refused: %s", request.path, e)
            return _answer(False, str(e))
    wrapped.__name__ = handler.__name__
    return wrapped


async def _apply(engine, tensors: dict, version: str | None, abort_all: bool, source: str, endpoint: str):
    fut = engine.update_weights_from_tensors(tensors, version, abort_all=abort_all, source=source, partial=True,
                                             endpoint=endpoint)
    return await asyncio.wrap_future(fut)


# -- /update_weights_from_tensor ------------------------------------------------------------------------------------
@_sglang_errors
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    from engine.tensor_payload import PayloadRefused, deserialize, named_tensors

    engine = _engine(request)
    body = await _body(request)
    version, abort_all = _common(body)
    payload = body.get("serialized_named_tensors")
    if not (isinstance(payload, list) and payload and all(isinstance(p, str) for p in payload)):
        raise ProtocolError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    t0 = time.perf_counter()
    try:  # in a thread: rebuilding opens IPC handles / shm files (and may initialise CUDA)
        tensors = await asyncio.to_thread(lambda: named_tensors(deserialize(payload[0])))
    except PayloadRefused as e:
        log.warning("update_weights_from_tensor refused: %s", e)
        return _answer(False, f"Failed to read serialized_named_tensors: {e}")
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA IPC handle this process cannot open
        log.warning("update_weights_from_tensor: rebuilding the tensors failed: %s: %s", type(e).__name__, e)
        return _answer(False, f"Failed to rebuild the tensors of serialized_named_tensors: {type(e).__name__}: {e}")
    read_s = time.perf_counter() - t0
    success, message = await _apply(engine, tensors, version, abort_all, "update_weights_from_tensor",
                                    "update_weights_from_tensor")
    del tensors
    log.info("update_weights_from_tensor: success=%s %s (payload read in %.3fs)", success, message, read_s)
    return _answer(success, message)


# -- the distributed group ------------------------------------------------------------------------------------------
def _int(body: dict, key: str, lo: int = 0) -> int:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ProtocolError(f"{key} must be an integer >= {lo}")
    return v


@_sglang_errors
async def init_weights_update_group(request: web.Request) -> web.Response:
    from engine.sglang_sync import DEFAULT_GROUP, join_update_group

    engine = _engine(request)
    body = await _body(request)
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise ProtocolError("master_address must be a non-empty string")
    port, offset, world = _int(body, "master_port", 1), _int(body, "rank_offset"), _int(body, "world_size", 2)
    group_name = body.get("group_name") or DEFAULT_GROUP
    backend = body.get("backend") or "nccl"
    if not isinstance(group_name, str):
        raise ProtocolError("group_name must be a string")
    if backend not in BACKENDS:
        raise ProtocolError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and engine.device.type != "cuda":
        raise ProtocolError(f"backend nccl needs the server on CUDA; it runs on {engine.device} (use gloo)")
    rank = offset + 0  # this server is TP rank 0 of 1
    if rank >= world:
        raise ProtocolError(f"rank_offset {offset} does not fit world_size {world}")
    async with request.app[GROUP_LOCK]:
        groups = request.app[GROUPS]
        if group_name in groups:
            return _answer(False, f"Failed to initialize custom process group: group {group_name!r} already exists "
                                  "(destroy it first)")
        t0 = time.perf_counter()

        def join():
            if backend == "nccl":
                import torch

                torch.cuda.set_device(engine.device)
            return join_update_group(address, port, world, group_name, rank=rank, backend=backend,
                                     timeout_s=JOIN_TIMEOUT_S)
        try:
            group = await asyncio.to_thread(join)
        except Exception as e:  # noqa: BLE001 - the rendezvous failed or timed out
            log.warning("init_weights_update_group %s: %s: %s", group_name, type(e).__name__, e)
            return _answer(False, f"Failed to initialize custom process group: {type(e).__name__}: {e}")
        groups[group_name] = (group, backend, threading.Lock())
    log.info("joined weight-update group %r (%s, rank %d of %d, %s:%d) in %.2fs", group_name, backend, rank, world,
             address, port, time.perf_counter() - t0)
    return _answer(True, "Succeeded to initialize custom process group.")


def _metas(body: dict, engine) -> list[tuple[str, Any, list[int]]]:
    import torch

    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ProtocolError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ProtocolError(f"names, dtypes and shapes must be non-empty and of one length "
                            f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    out, total = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"names: {name!r} is not a non-empty string")
        dtype = getattr(torch, dt, None) if isinstance(dt, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"dtypes: {dt!r} (for {name!r}) is not a torch dtype name")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise ProtocolError(f"shapes: {shape!r} (for {name!r}) is not a list of non-negative integers")
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=dtype).element_size()
        out.append((name, dtype, shape))
    from engine.weight_buffer import state_bytes

    limit = MAX_RECEIVE_FACTOR * state_bytes(engine.model, 4)
    if total > limit:
        raise ProtocolError(f"the tensors of this update ({total} bytes) exceed {MAX_RECEIVE_FACTOR}x the model's "
                            f"weights ({limit} bytes)")
    return out


def _receive(group, backend: str, metas, device) -> dict:
    import torch
    import torch.distributed as dist

    where = device if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    got, handles = {}, []
    for name, dtype, shape in metas:
        t = torch.empty(shape, dtype=dtype, device=where)
        handles.append(dist.broadcast(t, src=0, group=group, async_op=True))
        got[name] = t
    for h in handles:
        h.wait()
    if backend == "nccl":
        torch.cuda.synchronize(device)
    return got


@_sglang_errors
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    from engine.sglang_sync import DEFAULT_GROUP

    engine = _engine(request)
    body = await _body(request)
    version, abort_all = _common(body)
    group_name = body.get("group_name") or DEFAULT_GROUP
    entry = request.app[GROUPS].get(group_name)
    if entry is None:
        raise ProtocolError(f"no weight-update group {group_name!r}: POST /init_weights_update_group first")
    metas = _metas(body, engine)
    group, backend, lock = entry
    t0 = time.perf_counter()
    try:  # one receive at a time per group, off the event loop
        tensors = await asyncio.to_thread(lambda: _locked(lock, _receive, group, backend, metas, engine.device))
    except Exception as e:  # noqa: BLE001 - the broadcast broke (a peer gone, a timeout): the group is not trusted
        log.warning("update_weights_from_distributed: receive failed: %s: %s", type(e).__name__, e)
        return _answer(False, f"Failed to receive the weights over group {group_name!r}: {type(e).__name__}: {e}")
    recv_s = time.perf_counter() - t0
    success, message = await _apply(engine, tensors, version, abort_all, f"weight-update group {group_name}",
                                    "update_weights_from_distributed")
    del tensors
    log.info("update_weights_from_distributed (%d tensors, received in %.3fs): success=%s %s", len(metas), recv_s,
             success, message)
    return _answer(success, message)


def _locked(lock: threading.Lock, fn, *args):
    with lock:
        return fn(*args)


@_sglang_errors
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    from engine.sglang_sync import DEFAULT_GROUP, leave_update_group

    body = await json_body(request, allow_empty=True) or {}
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    group_name = body.get("group_name") or DEFAULT_GROUP
    async with request.app[GROUP_LOCK]:
        entry = request.app[GROUPS].pop(group_name, None)
    if entry is None:
        return _answer(False, f"Failed to destroy custom process group: no group {group_name!r}")
    await asyncio.to_thread(leave_update_group, entry[0])
    log.info("left weight-update group %r", group_name)
    return _answer(True, "Succeeded to destroy custom process group.")


def add_routes(app: web.Application, engine_ready) -> None:
    """The four endpoints (behind the app's auth middleware like every non-/health path); `engine_ready(request)`:
    the app's engine once loaded (else it raises the server's 503)."""
    app[READY] = engine_ready
    app[GROUPS] = {}
    app[GROUP_LOCK] = asyncio.Lock()
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
