"""SGLang weight sync without the disk (engine/sglang_sync.py), on CPU without sglang:

- the request bodies carry SGLang's own field names, read from sgl-project/sglang
  `python/sglang/srt/managers/io_struct.py` at commit 001067fffe33427bee0ed2f007fb7551a1d76b44 (written out below);
- the strategy chooser;
- the distributed path's order (group join beside `/init_weights_update_group`, broadcasts beside
  `/update_weights_from_distributed`, in the order of `names`, buckets, the disk fallback after a failure) over
  torch.distributed with gloo between this process (the trainer, rank 0) and a child process standing in for one
  SGLang server TP rank (rank 1). Only the torch.distributed part is real: the child answers the JSON bodies over a
  pipe, doing what SGLang's model runner does with them (a `torch.empty(shape, getattr(torch, dtype))` per name, a
  broadcast from src 0 each, in order). The HTTP side needs a real SGLang server on a GPU; it is not tested here.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch

from engine.sglang_sync import (SGLangDistributedSync, SGLangTensorSync, WeightSyncError, check_response,
                                      choose_sync, destroy_group_body, distributed_update_body, dtype_name,
                                      init_group_body, is_local_url, make_sync, plan_buckets, server_tp_size,
                                      tensor_update_body)

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

# sglang io_struct.py @ 001067ff: every field of each request (BaseReq's rid / http_worker_ipc left out), and the
# ones without a default (a body must carry them).
SGLANG_FIELDS = {
    "UpdateWeightsFromTensorReqInput": (
        {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
         "disable_draft_model", "torch_empty_cache"},
        {"serialized_named_tensors"}),
    "InitWeightsUpdateGroupReqInput": (
        {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
        {"master_address", "master_port", "rank_offset", "world_size"}),
    "UpdateWeightsFromDistributedReqInput": (
        {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
         "load_format", "torch_empty_cache"},
        {"names", "dtypes", "shapes"}),
    "DestroyWeightsUpdateGroupReqInput": ({"group_name"}, set()),
}


def test_request_bodies_use_sglang_field_names():
    bodies = {
        "UpdateWeightsFromTensorReqInput": tensor_update_body("QUJD", 2, version="7", flush_cache=True),
        "InitWeightsUpdateGroupReqInput": init_group_body("10.0.0.1", 29555, 3, "g"),
        "UpdateWeightsFromDistributedReqInput": distributed_update_body([("w", "bfloat16", [2, 3])], "g",
                                                                        version="7", flush_cache=False),
        "DestroyWeightsUpdateGroupReqInput": destroy_group_body("g"),
    }
    for cls, body in bodies.items():
        fields, required = SGLANG_FIELDS[cls]
        assert set(body) <= fields, (cls, set(body) - fields)
        assert required <= set(body), (cls, required - set(body))
        orjson.dumps(body)  # JSON as sent
    tensor = bodies["UpdateWeightsFromTensorReqInput"]
    assert tensor["serialized_named_tensors"] == ["QUJD", "QUJD"]  # one entry per TP rank, each reads [tp_rank]
    assert tensor["weight_version"] == "7" and tensor["flush_cache"] is True
    init = bodies["InitWeightsUpdateGroupReqInput"]
    assert (init["rank_offset"], init["world_size"], init["backend"], init["master_port"]) == (1, 3, "nccl", 29555)
    dist_body = bodies["UpdateWeightsFromDistributedReqInput"]
    assert (dist_body["names"], dist_body["dtypes"], dist_body["shapes"]) == (["w"], ["bfloat16"], [[2, 3]])


def test_dtype_names_resolve_as_sglang_does():
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        assert getattr(torch, dtype_name(dt)) is dt


def test_check_response():
    assert check_response("/x", 200, {"success": True, "message": "ok"}) == "ok"
    partial = {"success": False, "message": "Failed to update parameter online: boom. Please discard the whole "
                                            "weights."}
    with pytest.raises(WeightSyncError, match=r"/x failed \(HTTP 400\): Failed to update parameter online"):
        check_response("/x", 400, partial)
    with pytest.raises(WeightSyncError, match="HTTP 200"):
        check_response("/x", 200, {"success": False, "message": "no"})
    with pytest.raises(WeightSyncError, match="Internal Server Error"):
        check_response("/x", 500, "Internal Server Error")


def test_plan_buckets():
    assert plan_buckets([], 10) == []
    assert plan_buckets([4, 4, 4], None) == [[0, 1, 2]]
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([20, 4, 4, 30], 8) == [[0], [1, 2], [3]]  # a tensor over the bound goes alone


def cfg(mode=None, backend="sglang"):
    """(engine.backend, engine.sglang_weight_sync) as choose_sync takes them; None = the field's default."""
    return backend, "auto" if mode is None else mode


@pytest.mark.parametrize("mode,same,cuda,want", [
    (None, True, True, "tensor"), ("auto", True, True, "tensor"), ("auto", False, True, "distributed"),
    ("auto", True, False, "disk"), ("auto", False, False, "disk"), ("disk", True, True, "disk"),
    ("tensor", True, True, "tensor"), ("distributed", True, True, "distributed"),
    ("distributed", False, True, "distributed"),
])
def test_choose_sync(mode, same, cuda, want):
    assert choose_sync(*cfg(mode), same_machine=same, has_cuda=cuda) == want


@pytest.mark.parametrize("mode,same,cuda,want", [
    ("auto", True, False, "memory"), ("auto", False, False, "memory"), ("auto", True, True, "tensor"),
    ("auto", False, True, "memory"), ("memory", True, True, "memory"), ("disk", True, True, "disk"),
    ("tensor", True, False, "tensor"), ("distributed", False, False, "distributed"),
])
def test_choose_embedded_sync(mode, same, cuda, want):
    from engine.sglang_sync import choose_embedded_sync

    assert choose_embedded_sync(mode, same_machine=same, has_cuda=cuda) == want


def test_choose_embedded_sync_refuses():
    from engine.sglang_sync import choose_embedded_sync

    with pytest.raises(ValueError, match="engine.weight_sync: tensor .* needs the server on the trainer's machine"):
        choose_embedded_sync("tensor", same_machine=False, has_cuda=True)
    with pytest.raises(ValueError, match="engine.weight_sync must be one of"):
        choose_embedded_sync("ipc", True, True)


@pytest.mark.parametrize("requested,tensor_gpu,server_gpus,want", [
    ("auto", None, (), "gloo"),                       # host tensors: gloo broadcasts them
    ("auto", None, ("GPU-a",), "gloo"),
    ("auto", "GPU-a", ("GPU-a",), "gloo"),            # the server on the trainer's GPU: NCCL refuses that
    ("auto", "GPU-a", ("GPU-b",), "nccl"),            # another GPU
    ("auto", "GPU-a", (), "nccl"),                    # a server that reports no GPU (real SGLang)
    ("nccl", "GPU-a", ("GPU-a",), "nccl"), ("gloo", "GPU-a", ("GPU-b",), "gloo"),  # an explicit choice stays
])
def test_group_backend(requested, tensor_gpu, server_gpus, want):
    from engine.sglang_sync import group_backend

    assert group_backend(requested, tensor_gpu, server_gpus) == want


def test_choose_sync_refuses_what_cannot_work():
    assert choose_sync(*cfg("tensor", backend="embedded"), True, True) == "disk"  # the embedded path is elsewhere
    with pytest.raises(ValueError, match="engine.sglang_weight_sync: tensor needs the trainer on the server's"):
        choose_sync(*cfg("tensor"), same_machine=False, has_cuda=True)
    with pytest.raises(ValueError, match="engine.sglang_weight_sync: tensor"):
        choose_sync(*cfg("tensor"), same_machine=True, has_cuda=False)
    with pytest.raises(ValueError, match="engine.sglang_weight_sync: distributed .* needs CUDA"):
        choose_sync(*cfg("distributed"), same_machine=True, has_cuda=False)
    with pytest.raises(ValueError, match=r"engine.sglang_weight_sync must be one of .*'nccl'"):
        choose_sync(*cfg("nccl"), True, True)


def test_helpers():
    assert is_local_url("http://127.0.0.1:30000") and is_local_url("http://localhost:1")
    assert not is_local_url("http://10.1.2.3:30000")
    assert server_tp_size(None) == 1 and server_tp_size({"tp_size": 4}) == 4
    with pytest.raises(ValueError, match="strategy must be"):
        make_sync("ipc", "http://x", lambda v, f: None)


class DiskCalls:
    def __init__(self):
        self.calls: list[tuple[str, bool]] = []

    async def __call__(self, version: str, flush_cache: bool) -> None:
        self.calls.append((version, flush_cache))


def test_tensor_sync_falls_back_to_disk_and_says_why(caplog):
    disk = DiskCalls()
    sync = SGLangTensorSync("http://127.0.0.1:9", disk)
    with caplog.at_level(logging.WARNING, logger="alloy.sglang_sync"):
        how = asyncio.run(sync.push([("w", torch.ones(2))], version="3", flush_cache=True))
    assert how == "disk" and disk.calls == [("3", True)]
    assert "not on a CUDA device" in sync.disabled
    assert "SGLang tensor weight sync of version 3 failed" in caplog.text
    assert asyncio.run(sync.push([("w", torch.ones(2))], version="4")) == "disk"  # stays off
    assert disk.calls[-1] == ("4", True)


def test_tensor_sync_serializes_without_sglang():
    from engine.tensor_payload import Serializer, deserialize, named_tensors

    try:
        import sglang  # noqa: F401
    except ImportError:  # our own serializer, same format: a ForkingPickler dump, base64
        assert SGLangTensorSync("http://x", DiskCalls()).serializer() is Serializer
    else:
        pytest.skip("sglang is installed here")
    w = torch.arange(6.0).reshape(2, 3)
    got = named_tensors(deserialize(Serializer.serialize([("w", w)], output_str=True)))
    assert list(got) == ["w"] and torch.equal(got["w"], w)


# --- the distributed path over gloo: this process is the trainer (rank 0), a child is SGLang's TP rank 0 ---------

SERVER_RANK = r"""
import json, sys, torch, torch.distributed as dist
from engine.sglang_sync import join_update_group
group = None
for line in sys.stdin:
    ep, body = json.loads(line)
    if ep == "/init_weights_update_group":
        group = join_update_group(body["master_address"], body["master_port"], body["world_size"],
                                  body["group_name"], rank=body["rank_offset"] + 0, backend=body["backend"],
                                  timeout_s=30)
        out = {"success": True, "message": "Succeeded to initialize custom process group."}
    elif ep == "/update_weights_from_distributed":
        got, handles = {}, []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            w = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(w, src=0, group=group, async_op=True))
            got[name] = w
        for h in handles:
            h.wait()
        bad = [n for n in got if n.startswith("fail")]
        out = {"success": not bad, "got": {n: w.float().flatten().tolist() for n, w in got.items()},
               "message": "Failed to update parameter online: load_weights. The full weights of the ModelRunner are "
                          "partially updated. Please discard the whole weights." if bad else "Succeeded."}
    elif ep == "/destroy_weights_update_group":
        dist.destroy_process_group(group)
        out = {"success": True, "message": "Succeeded to destroy custom process group."}
    print(json.dumps(out), flush=True)
"""


class PipedSync(SGLangDistributedSync):
    """The trainer's SGLangDistributedSync with its one HTTP call answered by the child instead of SGLang."""

    def __init__(self, proc, fallback, **kw):
        super().__init__("http://stand-in", fallback, backend="gloo", timeout_s=30, **kw)
        self.proc, self.sent, self.got = proc, [], []

    def _call(self, endpoint, body):
        self.proc.stdin.write(orjson.dumps([endpoint, body]).decode() + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    async def post(self, endpoint, body):
        self.sent.append((endpoint, body))
        out = await asyncio.to_thread(self._call, endpoint, body)
        self.got.append(out.get("got"))
        return check_response(endpoint, 200 if out["success"] else 400, out)


def test_distributed_order_buckets_and_fallback_over_gloo(monkeypatch, caplog):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.Popen([sys.executable, "-c", SERVER_RANK], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    disk = DiskCalls()
    sync = PipedSync(proc, disk)
    g = torch.Generator().manual_seed(0)
    weights = [("model.embed_tokens.weight", torch.randn(5, 4, generator=g).to(torch.bfloat16)),
               ("model.norm.weight", torch.randn(4, generator=g)),
               ("lm_head.weight", torch.randn(4, 5, generator=g).to(torch.float16).t())]  # not contiguous
    try:
        async def run():
            how = [await sync.push(weights, version="1", flush_cache=True)]
            sync.bucket_bytes = 48  # 40 + 16 + 40 bytes → [embed], [norm], [lm_head]
            how.append(await sync.push(weights, version="2", flush_cache=True))
            with caplog.at_level(logging.WARNING, logger="alloy.sglang_sync"):
                how.append(await sync.push(weights + [("fail.weight", torch.zeros(2))], version="3",
                                           flush_cache=True))
            how.append(await sync.push(weights, version="4", flush_cache=False))
            return how

        how = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert how == ["distributed", "distributed", "disk", "disk"]
    endpoints = [e for e, _ in sync.sent]
    # one group; v1 in one request, v2 in 3 buckets, v3 in 3 (the last fails after two were applied); torn down
    assert endpoints == ["/init_weights_update_group"] + ["/update_weights_from_distributed"] * 7 + \
        ["/destroy_weights_update_group"]
    init = sync.sent[0][1]
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    names = [n for n, _ in weights]
    updates = [b for e, b in sync.sent if e == "/update_weights_from_distributed"]
    assert updates[0]["names"] == names and updates[0]["dtypes"] == ["bfloat16", "float32", "float16"]
    assert updates[0]["shapes"] == [[5, 4], [4], [5, 4]]
    assert (updates[0]["weight_version"], updates[0]["flush_cache"]) == ("1", True)
    assert [u["names"] for u in updates[1:4]] == [[n] for n in names]
    assert [(u["weight_version"], u["flush_cache"]) for u in updates[1:4]] == [(None, False), (None, False),
                                                                             ("2", True)]
    got_v1 = sync.got[1]
    got_v2 = {k: v for d in sync.got[2:5] for k, v in d.items()}
    for name, t in weights:  # every tensor arrived whole, under its name, both ways
        assert got_v1[name] == t.float().flatten().tolist() == got_v2[name]
    assert updates[6]["names"] == ["lm_head.weight", "fail.weight"] and updates[6]["weight_version"] == "3"
    assert disk.calls == [("3", True), ("4", False)]  # the half-applied push reloads everything from disk; then disk
    assert "partially updated" in sync.disabled
    assert "SGLang distributed weight sync of version 3 failed" in caplog.text
    assert proc.returncode == 0
