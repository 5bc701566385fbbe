"""SGLang's weight-update endpoints on the embedded server (engine/sglang_updates.py), driven by the SGLang client of
engine/sglang_sync.py against a real server process on loopback, on CPU:

- distributed: `SGLangDistributedSync` over gloo (this process is the trainer, rank 0; the server joins as rank 1)
  pushes another model's weights; greedy ids and scored log-probs then equal an HF forward of that model, with the
  push's weight_version; a wrong shape is received, refused (success false) and the weights stay;
- tensor: `SGLangTensorSync` with CPU tensors (named shared-memory files, our ForkingPickler serializer) pushes
  weights back; a wrong name is refused whole;
- a malicious payload (a pickle calling os.system) is refused with a 400 naming the global, nothing executed; the
  endpoints sit behind the API key.
CUDA IPC and NCCL are the same code paths with CUDA tensors (bench/weight_sync_check.py on a GPU machine).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from engine_proc import ENGINE_DEVICE, REFERENCE_NUMERICS, TINY_LP_TOL, EngineProc, forward_logprobs, http, json_body

pytestmark = pytest.mark.integration

KEY = "sync-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"input_ids": [1, 30, 31, 40], "return_logprob": True, "logprob_start_len": 0,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}


def call(base, path, body=None, *, raw=None, headers=AUTH, method="POST"):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    status, payload = http(base, path, data, method=method, headers=headers)
    return status, json_body(payload)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the server inherits it: gloo on loopback
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("sync-server") / "server.log", api_key=KEY).start()
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def weights_of(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every state-dict entry, a tied tensor once (as DeepSpeedBackend.named_weights)."""
    out, seen = [], set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out.append((name, t.detach().clone()))
    return out


def greedy(server):
    status, out = call(server.url, "/generate", GREEDY)
    assert status == 200, out
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]], \
        out["meta_info"]["weight_version"]


def check_serves(server, model, version):
    """The server's greedy ids and prompt log-probs are `model`'s (an HF forward), under `version`."""
    ids, lps, got_version = greedy(server)
    assert got_version == version
    if not REFERENCE_NUMERICS:
        return ids, lps
    prompt = GREEDY["input_ids"]
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(forward_logprobs(model, seq)[-1].argmax()))
    assert ids == seq[len(prompt):]
    ref = forward_logprobs(model, prompt)
    want = [float(ref[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(lps, want)) < TINY_LP_TOL
    return ids, lps


class Fallback:
    def __init__(self):
        self.calls = []

    async def __call__(self, version, flush_cache):
        self.calls.append(version)


def test_distributed_then_tensor_push(server, model, tmp_path):
    from engine.sglang_sync import SGLangDistributedSync, SGLangTensorSync
    from infra.models import init_model_dir, load_model

    before = check_serves(server, model, "w0")
    other = load_model(init_model_dir("tiny", tmp_path / "seed7", seed=7))

    async def distributed():
        fb = Fallback()
        sync = SGLangDistributedSync(server.url, fb, backend="auto", api_key=KEY, timeout_s=60)
        try:
            assert await sync.push(weights_of(other), "v1") == "distributed"
            assert sync.backend == "gloo"  # auto: the trainer's tensors are on the host
            after = check_serves(server, other, "v1")
            assert after[1] != before[1]  # the log-probs moved (the tiny models' greedy ids may agree)
            # a wrong shape: received whole (the broadcast completes), refused, the weights stay; then the fallback
            bad = [("model.norm.weight", torch.zeros(3))]
            assert await sync.push(bad, "v2") == "disk" and fb.calls == ["v2"]
            assert "has shape [3]" in sync.disabled
            assert check_serves(server, other, "v1") == after
        finally:
            await sync.aclose()
        assert sync.group is None

    asyncio.run(asyncio.wait_for(distributed(), 120))
    # the group is gone on the server too
    status, out = call(server.url, "/update_weights_from_distributed",
                       {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]})
    assert status == 400 and out["success"] is False and "init_weights_update_group first" in out["message"]

    async def tensor():
        fb = Fallback()
        sync = SGLangTensorSync(server.url, fb, cpu_tensors=True, api_key=KEY, timeout_s=60)
        assert await sync.push(weights_of(model), "v3") == "tensor"
        check_serves(server, model, "v3")
        # a wrong name: the whole set is refused, nothing copied
        noisy = [(n, t + 1.0) for n, t in weights_of(model)] + [("model.nope.weight", torch.zeros(2))]
        assert await sync.push(noisy, "v4") == "disk" and fb.calls == ["v4"]
        assert "is not a weight of the model" in sync.disabled
        check_serves(server, model, "v3")

    asyncio.run(asyncio.wait_for(tensor(), 120))


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_payload_is_refused_and_nothing_runs(server, tmp_path):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", Evil(marker))])).decode()
    body = {"serialized_named_tensors": [payload], "weight_version": "evil"}
    status, out = call(server.url, "/update_weights_from_tensor", body)
    assert status == 400 and out["success"] is False, out
    assert "refused global posix.system" in out["message"]
    assert not marker.exists()
    # not base64, not a list of pairs, behind the API key
    status, out = call(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]})
    assert status == 400 and "not base64" in out["message"]
    status, out = call(server.url, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [base64.b64encode(pickle.dumps({"a": 1})).decode()]})
    assert status == 400 and "list of (name, tensor) pairs" in out["message"]
    for path in ("/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/destroy_weights_update_group"):
        assert call(server.url, path, body, headers={})[0] == 401, path
    status, out = call(server.url, "/init_weights_update_group",
                       {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2,
                        "backend": "gloo"})
    assert status == 400 and "rank_offset 2 does not fit world_size 2" in out["message"]
    if ENGINE_DEVICE == "cpu":  # on CUDA a nccl group is allowed (and would wait for a trainer at port 1)
        status, out = call(server.url, "/init_weights_update_group",
                           {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                            "backend": "nccl"})
        assert status == 400 and "backend nccl needs the server on CUDA" in out["message"]
    assert call(server.url, "/get_model_info", method="GET")[1]["weight_version"] != "evil"


def test_policy_server_pushes_by_tensor_and_distributed(tiny_model_dir, tmp_path):
    """`engine.weight_sync: tensor | distributed` for the embedded server: a trainer's PolicyServer pushes a
    DeepSpeedBackend's weights through the SGLang client (CPU: shm files / gloo); both servers then serve them."""
    from engine.launcher import Supervisor
    from infra.models import init_model_dir, load_model, load_tokenizer
    from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
    from training.policy_server import PolicyServer

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    other_dir = init_model_dir("tiny", tmp_path / "seed7", seed=7)
    backend = DeepSpeedBackend(load_model(other_dir), TrainSettings())
    tok = load_tokenizer(tiny_model_dir)
    with Supervisor(tmp_path / "logs") as sup:
        servers = [PolicyServer(sup, name, str(tiny_model_dir), tmp_path / name, weight_sync=name)
                   for name in ("tensor", "distributed")]
        assert [s.sync for s in servers] == ["tensor", "distributed"] and not any(s.memory for s in servers)

        async def greedy(server):
            (out,) = await server.client.generate([GREEDY["input_ids"]], max_new_tokens=6, temperature=0.0)
            return out.output_ids

        async def push(server):
            try:
                how = await server.push(backend, tok, 1)
                info = await server.client.model_info()
                out = await greedy(server)
                # deferred (the student's double buffering): push returns after a copy; an optimizer step before
                # the load runs (here every weight zeroed in place) must not reach the server
                assert await server.push(backend, tok, 2, wait=False) == server.sync and server.loaded_version == 1
                live = {k: t.detach().clone() for k, t in backend.module.state_dict().items()}
                with torch.no_grad():
                    for p in backend.module.parameters():
                        p.zero_()
                await server.wait_version(2)
                after = (await server.client.model_info())["weight_version"], await greedy(server)
                backend.module.load_state_dict(live)
                return how, server.loaded_version, info["weight_version"], out, after, server.last_path
            finally:
                await server.aclose()

        got = [asyncio.run(push(s)) for s in servers]
    backend.close()
    assert [g[:3] for g in got] == [("tensor", 2, "1"), ("distributed", 2, "1")]
    assert got[0][3] == got[1][3]
    assert [g[4] for g in got] == [("2", got[0][3])] * 2 and [g[5] for g in got] == ["tensor", "distributed"]
