"""Benchmark: a trainer's weight push to its own embedded rollout server, disk vs memory (`engine.weight_sync`).

    python bench/weight_push.py --out bench/results/weight_push.json [--presets tiny,small] [--pushes 10] [--check]

Per preset: one DeepSpeedBackend (stage 0, fp32, world of one) over a fresh model and two PolicyServers on the same
model under one Supervisor, one `weight_sync: disk`, one `memory`. Each round perturbs the trainer's weights (as an
optimizer step would) and pushes them to both, in alternating order, timing:
  - disk: `push(wait=True)`: `save_hf` (safetensors + tokenizer) → `update_weights_from_disk` (`from_pretrained`
    in the server) → supervisor record: the whole push is on the trainer's critical path today;
  - memory: `push(wait=False)` returns after the snapshot (`named_weights` → weight buffer in /dev/shm): the
    critical path once the load overlaps the next step; `wait_loaded()` then times the server's in-place load;
    snapshot + load is the push when nothing overlaps it (`push(wait=True)`).
After every round both servers must report the pushed version and score a probe sequence identically (a push that
is fast but wrong fails the bench). Medians over `--pushes` rounds (after one warm-up round); every sample kept.
Target: memory snapshot + load ≤ 0.5 × disk at every preset (`target.met`: disk / memory ≥ `--target`, default 2);
`--check` exits 1 when it is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_check, start_meta, verdict, write_json  # noqa: E402


async def rounds(backend, tok, servers: dict, n: int, probe: list[int]) -> dict[str, list[float]]:
    import torch

    times: dict[str, list[float]] = {"disk_ms": [], "memory_snapshot_ms": [], "memory_load_ms": [], "memory_ms": []}
    gen = torch.Generator().manual_seed(0)
    for i in range(n + 1):  # round 0 warms up
        with torch.no_grad():
            for p in backend.module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        order = ("disk", "memory") if i % 2 else ("memory", "disk")
        for sync in order:
            s = servers[sync]
            t0 = time.perf_counter()
            await s.push(backend, tok, i + 1, wait=sync == "disk")
            t1 = time.perf_counter()
            await s.wait_loaded()
            t2 = time.perf_counter()
            if i == 0:
                continue
            if sync == "disk":
                times["disk_ms"].append((t2 - t0) * 1e3)
            else:
                times["memory_snapshot_ms"].append((t1 - t0) * 1e3)
                times["memory_load_ms"].append((t2 - t1) * 1e3)
                times["memory_ms"].append((t2 - t0) * 1e3)
        scored = [await servers[k].client.score(probe, 1) for k in ("disk", "memory")]
        versions = [(await servers[k].client.model_info())["weight_version"] for k in ("disk", "memory")]
        if versions != [str(i + 1)] * 2 or (scored[0].token_logprobs != scored[1].token_logprobs).any():
            raise AssertionError(f"round {i}: disk and memory pushes disagree: versions {versions}, log-probs "
                                 f"{scored[0].token_logprobs[:4]} vs {scored[1].token_logprobs[:4]}")
    return times


def bench_preset(preset: str, pushes: int, tmp: Path) -> dict:
    from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
    from engine.launcher import Supervisor
    from infra.models import init_model_dir, load_model, load_tokenizer
    from training.policy_server import PolicyServer

    model_dir = init_model_dir(preset, tmp / preset / "model", seed=0)
    tok = load_tokenizer(model_dir)
    backend = DeepSpeedBackend(load_model(model_dir), TrainSettings())
    nbytes = sum(t.numel() * t.element_size() for t in backend.named_weights().values())
    try:
        with Supervisor(tmp / preset / "logs", install_signal_handlers=False) as sup:
            servers = {sync: PolicyServer(sup, f"{preset}-{sync}", str(model_dir), tmp / preset / sync,
                                          weight_sync=sync, seed=0) for sync in ("disk", "memory")}

            async def go():
                try:
                    return await rounds(backend, tok, servers, pushes, [1] + list(range(20, 60)))
                finally:
                    for s in servers.values():
                        await s.aclose()

            times = asyncio.run(go())
    finally:
        backend.close()
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"weight_bytes": nbytes, "params": sum(p.numel() for p in backend.module.parameters()), **med,
            "speedup_total": round(med["disk_ms"] / med["memory_ms"], 2),
            "speedup_critical_path": round(med["disk_ms"] / med["memory_snapshot_ms"], 2),
            "samples_ms": {k: [round(x, 2) for x in v] for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--target", type=float, default=2.0, help="the least disk / memory push time at every preset")
    add_check(p, "disk / memory push < --target at some preset")
    args = p.parse_args(argv)
    meta = start_meta()
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result: dict = {"bench": "weight_push", "command": "python bench/weight_push.py " + " ".join(argv or sys.argv[1:]),
                    "meta": meta, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            r = result["presets"][preset] = bench_preset(preset, args.pushes, Path(tmp))
            print(f"{preset}: disk {r['disk_ms']:.1f} ms, memory {r['memory_ms']:.1f} ms (snapshot "
                  f"{r['memory_snapshot_ms']:.1f} + load {r['memory_load_ms']:.1f}), {r['weight_bytes']} bytes")
    worst = min(r["disk_ms"] / r["memory_ms"] for r in result["presets"].values())
    result["target"] = {"metric": "min over presets of disk push / memory push (snapshot + load)",
                        "value": round(worst, 2), "goal": args.target, "met": worst >= args.target}
    result["total_s"] = round(time.perf_counter() - t0, 1)
    write_json(Path(args.out), result)
    print(f"wrote {args.out}")
    return verdict("weight_push", result["target"]["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
