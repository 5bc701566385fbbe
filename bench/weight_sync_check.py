"""SGLang's weight-update endpoints on the embedded server, pushed by the SGLang client (engine/sglang_sync.py).

    python bench/weight_sync_check.py --out /path/weight_sync_check.json [--preset small] [--device auto]
        [--dtype auto] [--pushes 4]

Starts `python -m engine.server --device auto` (CUDA in bfloat16 when torch sees a GPU, else CPU in float32) on a
fresh `--preset` model A (seed 0); model B (seed 7) is written beside it. References: the server's scored
log-probs of a probe sequence after `/update_weights_from_disk` of B, and of A. Then, for each path, `--pushes`
pushes alternating B, A, B, … from this process (the trainer, holding both in the server's dtype on its device):

- `tensor`: `SGLangTensorSync` → /update_weights_from_tensor. On CUDA the trainer's tensors travel as CUDA IPC
  handles (the same GPU as the server); on CPU as shared-memory files.
- `distributed`: `SGLangDistributedSync` → /init_weights_update_group + /update_weights_from_distributed. NCCL
  when there are two GPUs (trainer on cuda:1, server on cuda:0: NCCL refuses two ranks on one GPU); on one GPU
  or on CPU, gloo (CUDA tensors staged through the host).
- `memory` (the baseline): /update_weights_from_buffer with a weight buffer in /dev/shm.

Each push is timed (wall time of the client's push: the server has copied the weights when it returns) and must
make the probe's log-probs equal the reference of the weights pushed (`max_abs_diff` ≤ 1e-5: the same weights in
the same dtype give the same numbers) and report the push's weight_version; a fallback (the fast path failing)
fails the check. Writes the JSON (`ok` per path, top-level `ok`) and exits 1 if any failed. On CPU with the tiny
preset it takes well under a minute; on a GPU with `small`, about one (most of it the server's start).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, start_meta, write_json  # noqa: E402  (puts the repository on sys.path)
from engine_cuda_check import call  # noqa: E402 - the same JSON-over-HTTP helper (bench/ is on sys.path)

PROBE = [1] + [5 + (7 * i) % 90 for i in range(31)]


def probe(url: str) -> tuple[list[float], str]:
    out = call(url, "/generate", {"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0,
                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]], out["meta_info"]["weight_version"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default=None, help="model preset (default: small with CUDA, tiny on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pushes", type=int, default=4)
    add_check(p, "any push is refused, falls back, or scores differently from a disk load", always=True)
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    meta = start_meta()

    import torch

    from engine.launcher import free_port
    from engine.sglang_sync import SGLangDistributedSync, SGLangTensorSync
    from engine.weight_buffer import write_buffer
    from infra.models import init_model_dir, load_model

    cuda = torch.cuda.is_available() and args.device != "cpu"
    preset = args.preset or ("small" if cuda else "tiny")
    result: dict = {"bench": "weight_sync_check", "meta": meta, "host": platform.node(), "cuda": cuda,
                    "preset": preset, "gpus": torch.cuda.device_count() if cuda else 0, "checks": {}}
    work = Path(tempfile.mkdtemp(prefix="weight-sync-check-"))
    dirs = {"A": init_model_dir(preset, work / "A", seed=0), "B": init_model_dir(preset, work / "B", seed=7)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "server.log"
    buf_dir = Path("/dev/shm" if Path("/dev/shm").is_dir() else work)  # the server reads buffers only there
    cmd = [sys.executable, "-m", "engine.server", "--model", str(dirs["A"]), "--port", str(port), "--device",
           args.device, "--dtype", args.dtype, "--weight-buffer-dir", str(buf_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                info = call(url, "/get_server_info", timeout=5)
                break
            except Exception:  # noqa: BLE001 - still starting
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("server did not start:\n" + log_path.read_text()[-3000:])
                time.sleep(0.5)
        result["server"] = {k: info.get(k) for k in ("device", "dtype", "model_path")}
        dtype = getattr(torch, info["dtype"])
        # references: the server's own numbers after a disk load of each model
        ref = {}
        for name in ("B", "A"):
            assert call(url, "/update_weights_from_disk", {"model_path": str(dirs[name]), "weight_version": "ref"})[
                "success"]
            ref[name] = probe(url)[0]

        def weights(name: str, device: str) -> list:
            model = load_model(dirs[name], dtype=dtype).to(device)
            out, seen = [], set()
            for n, t in model.state_dict().items():
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
                if key not in seen:
                    seen.add(key)
                    out.append((n, t.detach()))
            return out

        nccl = cuda and torch.cuda.device_count() >= 2
        plans = {"tensor": ("cuda:0" if cuda else "cpu", None),
                 "distributed": ("cuda:1" if nccl else ("cuda:0" if cuda else "cpu"), "nccl" if nccl else "gloo"),
                 "memory": ("cpu", None)}
        for path, (device, backend) in plans.items():
            check: dict = {"trainer_device": device, "backend": backend, "pushes": []}
            result["checks"][path] = check
            try:
                held = {name: weights(name, device) for name in ("A", "B")}
                falls = []

                async def fallback(version, flush_cache):
                    falls.append(version)

                if path == "tensor":
                    sync = SGLangTensorSync(url, fallback, cpu_tensors=not cuda, timeout_s=300)
                elif path == "distributed":
                    sync = SGLangDistributedSync(url, fallback, backend=backend, timeout_s=300)
                else:
                    sync = None

                async def run():
                    for i in range(args.pushes):
                        name = "AB"[(i + 1) % 2]  # B, A, B, …
                        version = f"{path}-{i}"
                        t0 = time.perf_counter()
                        if sync is None:
                            buf = buf_dir / f"wsc-{os.getpid()}.wbuf"
                            write_buffer(buf, dict(held[name]), version)
                            res = call(url, "/update_weights_from_buffer", {"path": str(buf)})
                            buf.unlink()
                            how = "memory" if res["success"] else "failed"
                        else:
                            how = await sync.push(held[name], version)
                        dt = time.perf_counter() - t0
                        lps, got_version = probe(url)
                        diff = max(abs(a - b) for a, b in zip(lps, ref[name]))
                        check["pushes"].append({"weights": name, "how": how, "seconds": round(dt, 4),
                                                "version_ok": got_version == version, "max_abs_diff": diff})
                    if sync is not None:
                        await sync.aclose()

                asyncio.run(run())
                secs = [x["seconds"] for x in check["pushes"]]
                check["median_s"] = statistics.median(secs[1:] or secs)  # the first push sets things up
                check["first_s"] = secs[0]
                check["fallbacks"] = falls
                check["ok"] = not falls and all(x["how"] == path and x["version_ok"] and x["max_abs_diff"] <= 1e-5
                                                for x in check["pushes"])
            except Exception as e:  # noqa: BLE001 - reported, the other paths still run
                check["ok"] = False
                check["error"] = f"{type(e).__name__}: {e}"
                check["traceback"] = traceback.format_exc()[-3000:]
        result["nbytes"] = sum(t.numel() * t.element_size() for _, t in weights("A", "cpu"))
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        result["server_log_tail"] = log_path.read_text()[-4000:] if log_path.exists() else ""
    result["ok"] = "error" not in result and bool(result["checks"]) and all(c.get("ok") for c in
                                                                          result["checks"].values())
    write_json(Path(args.out), result)
    print(json.dumps({k: ({p: {kk: c.get(kk) for kk in ("ok", "backend", "median_s", "first_s", "error")}
                           for p, c in v.items()} if k == "checks" else v)
                      for k, v in result.items() if k not in ("server_log_tail", "traceback")}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
