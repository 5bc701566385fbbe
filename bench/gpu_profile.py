"""Where the time goes on the device: torch.profiler over the embedded engine's decode steps and the trainers' steps.

    python bench/gpu_profile.py --out $OUT/gpu_profile_<card>.json [--device cuda|cpu] [--preset medium]
        [--steps 200] [--rows 1,64] [--train-rows 64 --train-seq 512] [--parts decode,sft,ppo]

Parts, each under `torch.profiler.profile` (CPU activities, plus CUDA on a GPU; every thread: the engine decodes on
its own thread, `_ExperimentalConfig(profile_all_threads=True)`), each after an unprofiled warm-up:

- `decode_<R>` for R in `--rows`: an in-process `engine.scheduler.Engine` (dtype auto: bf16 on CUDA) decodes R
  requests of `--steps` new tokens each (ignore_eos, temperature 1), all submitted at once: about `--steps` decode
  steps at R rows (and one prefill);
- `sft`: one SFT step of `training.sft.train_sft` on `--train-rows` sequences of `--train-seq` tokens
  (DeepSpeedBackend, bf16 on CUDA);
- `ppo`: one PPO update (`teachers.ppo_step.ppo_update`, policy + critic) on the same shape.

Per part the JSON has: `wall_s`; `top_cuda` / `top_cpu`: the ops with the most self CUDA / CPU time (name, count,
ms); `host_syncs`: counts of cudaStreamSynchronize, cudaDeviceSynchronize, aten::_local_scalar_dense, aten::item,
aten::nonzero and `Memcpy DtoH` events and per step, and a total that counts each sync once (on CUDA the
runtime's stream/device synchronizations, on the CPU `_local_scalar_dense` + `nonzero`), per decode step (the engine's own step counter);
`launches`: cudaLaunchKernel / cuLaunchKernel / cudaLaunchKernelExC (and cudaGraphLaunch apart) counts and per step
(on the CPU: the count of `aten::` ops, nested ones included, labelled as that proxy); `gpu_idle_fraction`:
1 − (union of the device-side kernel and copy intervals) / wall (null on the CPU); and for decode parts the engine's
counters over the run (decode ms / step, engine-thread CPU ms / step, rows per step, prefill seconds). Each part runs
in try/except: a failed part records its error and the others still run; exit 1 if any part failed.
`--device cpu` runs every part on a tiny model in under a minute (tests/integration/test_gpu_perf.py).
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_check, start_meta, write_json  # noqa: E402  (puts the repository on sys.path)

import gpu_parts as gp  # noqa: E402

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::item",
              "aten::nonzero")
DTOH = "Memcpy DtoH"
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCH = "cudaGraphLaunch"


def profiler(cuda: bool):
    """torch.profiler over every thread (the engine's too); `all_threads` False where this torch lacks the option."""
    import torch
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        cfg = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
        return torch.profiler.profile(activities=acts, experimental_config=cfg), True
    except (ImportError, TypeError):
        return torch.profiler.profile(activities=acts), False


def _dev_self(k) -> float:
    return float(getattr(k, "self_device_time_total", None) or getattr(k, "self_cuda_time_total", 0) or 0)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(prof, wall_s: float, steps: int | None, cuda: bool, top: int = 15) -> dict:
    """The profile as the module docstring's summary (all times in ms)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    names = collections.Counter(e.name for e in events)
    per = (lambda n: round(n / steps, 2)) if steps else (lambda n: None)
    syncs = {k: names.get(k, 0) for k in SYNC_NAMES}
    syncs[DTOH] = sum(c for n, c in names.items() if n.startswith(DTOH))
    out = {"wall_s": round(wall_s, 4), "steps": steps, "events": len(events)}
    # the names nest (aten::item → aten::_local_scalar_dense → a DtoH copy + cudaStreamSynchronize): the total counts
    # each sync once, at the runtime call on CUDA, at the op that would sync on a GPU on the CPU
    total = (syncs["cudaStreamSynchronize"] + syncs["cudaDeviceSynchronize"]) if cuda else \
        (syncs["aten::_local_scalar_dense"] + syncs["aten::nonzero"])
    out["host_syncs"] = {"counts": syncs, "counts_per_step": {k: per(v) for k, v in syncs.items()},
                         "total": total, "per_step": per(total),
                         "total_is": "cudaStreamSynchronize + cudaDeviceSynchronize" if cuda else
                         "aten::_local_scalar_dense + aten::nonzero (the ops that sync on a GPU)"}
    if cuda:
        launches = sum(names.get(k, 0) for k in LAUNCH_NAMES)
        out["launches"] = {"what": "kernel launches (" + " + ".join(LAUNCH_NAMES) + ")", "total": launches,
                           "per_step": per(launches), "graph_launches": names.get(GRAPH_LAUNCH, 0),
                           "graph_launches_per_step": per(names.get(GRAPH_LAUNCH, 0))}
        dev = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        busy_us = _union_us(dev) if dev else sum(_dev_self(k) for k in prof.key_averages())
        out["gpu_busy_ms"] = round(busy_us / 1000, 3)
        out["gpu_idle_fraction"] = round(max(0.0, 1 - busy_us / 1e6 / wall_s), 4) if wall_s > 0 else None
    else:
        aten = sum(c for n, c in names.items() if n.startswith("aten::"))
        out["launches"] = {"what": "proxy on the CPU: aten:: ops (nested ones included), no kernel launches",
                           "total": aten, "per_step": per(aten)}
        out["gpu_idle_fraction"] = None
    avgs = list(prof.key_averages())

    def row(k) -> dict:
        return {"name": k.key, "count": k.count, "self_cpu_ms": round(k.self_cpu_time_total / 1000, 3),
                "self_cuda_ms": round(_dev_self(k) / 1000, 3)}

    out["top_cpu"] = [row(k) for k in sorted(avgs, key=lambda k: -k.self_cpu_time_total)[:top]]
    out["top_cuda"] = [row(k) for k in sorted(avgs, key=lambda k: -_dev_self(k))[:top] if _dev_self(k) > 0] if cuda else []
    return out


def profile_decode(eng, rows: int, steps: int, cuda: bool, top: int) -> dict:
    warm = gp.prompts(rows, 16, seed=100 + rows)
    # the warm-up decodes as far as the profiled run: the static path captures its CUDA graphs per (rows, columns)
    # there, not inside the profile
    gp.run_engine(eng, warm, [steps] * rows, rows, ignore_eos=True, tag=f"warm{rows}")
    prs = gp.prompts(rows, 16, seed=rows)
    prof, all_threads = profiler(cuda)
    before = gp.counters(eng)
    with prof:
        t0 = time.perf_counter()
        res = gp.run_engine(eng, prs, [steps] * rows, rows, ignore_eos=True, tag=f"prof{rows}")
        gp.sync(eng.device)
        wall = time.perf_counter() - t0
    engine = gp.counter_delta(before, gp.counters(eng))
    return {"rows": rows, "new_tokens": steps, "profile_all_threads": all_threads, "tokens_per_s": res["tokens_per_s"],
            "engine_counters": engine, "graphs": gp.graph_info(eng),
            **summarize(prof, wall, engine["delta"].get("steps"), cuda, top)}


def profile_train(kind: str, model_dir: Path, device, rows: int, seq: int, cuda: bool, top: int) -> dict:
    if kind == "sft":
        backend, tok, pairs = gp.sft_setup(model_dir, device, rows, seq)
        run = lambda: gp.sft_steps(backend, tok, pairs, 1)  # noqa: E731
        closers = (backend,)
    else:
        policy, critic, batch = gp.ppo_setup(model_dir, device, rows, seq)
        run = lambda: gp.ppo_steps(policy, critic, batch, 1)  # noqa: E731
        closers = (policy, critic)
    try:
        run()  # warm-up: allocator, optimizer state, kernels' first launch
        prof, all_threads = profiler(cuda)
        with prof:
            t0 = time.perf_counter()
            marks = run()
            wall = time.perf_counter() - t0
        return {"rows": rows, "seq_len": seq, "tokens": rows * seq, "step_s": round(marks[-1]["wall_s"], 4),
                "profile_all_threads": all_threads, **summarize(prof, wall, 1, cuda, top)}
    finally:
        gp.close(*closers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when torch sees a GPU")
    p.add_argument("--preset", default=None, help="model preset (infra/presets.py); default medium on cuda, tiny on cpu")
    p.add_argument("--steps", type=int, default=None, help="decode steps profiled per row count (default 200; cpu 24)")
    p.add_argument("--rows", default="1,64", help="row counts of the decode parts")
    p.add_argument("--train-rows", type=int, default=None, help="rows of the SFT / PPO batch (default 64; cpu 4)")
    p.add_argument("--train-seq", type=int, default=None, help="tokens per row (default 512 = medium's context; cpu 64)")
    p.add_argument("--parts", default="decode,sft,ppo")
    p.add_argument("--top", type=int, default=15)
    add_check(p, None)
    args = p.parse_args(argv)
    meta = start_meta()

    import torch

    import training  # noqa: F401  (DeepSpeed's accelerator: cuda when torch sees a GPU)

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = dev_name == "cpu"
    preset = args.preset or ("tiny" if cpu else "medium")
    steps = args.steps or (24 if cpu else 200)
    train_rows, train_seq = args.train_rows or (4 if cpu else 64), args.train_seq or (64 if cpu else 512)
    parts = args.parts.split(",")
    out: dict = {"bench": "gpu_profile", "meta": meta, "parts": {}}
    t_start = time.perf_counter()
    try:
        device, dtype, card = gp.resolve(dev_name)
    except Exception as e:  # noqa: BLE001 - recorded: the JSON says why nothing ran
        out.update(error=f"{type(e).__name__}: {e}", ok=False)
        write_json(Path(args.out), out)
        return 1
    cuda = device.type == "cuda"
    out.update(device=str(device), dtype=str(dtype).replace("torch.", ""), card=card, preset=preset,
               config={"steps": steps, "rows": args.rows, "train_rows": train_rows, "train_seq": train_seq,
                       "parts": parts})

    def part(name: str, fn) -> None:
        gp.run_part("gpu_profile", name, fn, out["parts"])

    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as tmp:
        model_dir = gp.make_model(preset, Path(tmp))
        out["model"] = gp.model_shape(model_dir)
        if "decode" in parts:
            row_counts = [int(r) for r in args.rows.split(",")]
            eng = None
            try:
                eng = gp.start_engine(model_dir, device, max(row_counts))
                meta["engine_options"] = gp.engine_options(eng)
                for r in row_counts:
                    part(f"decode_{r}", lambda r=r: profile_decode(eng, r, steps, cuda, args.top))
            except Exception as e:  # noqa: BLE001 - the engine did not start: every decode part failed
                for r in row_counts:
                    out["parts"].setdefault(f"decode_{r}", {"error": f"engine: {type(e).__name__}: {e}"})
            finally:
                if eng is not None:
                    eng.stop()
                gp.close()
        for kind in ("sft", "ppo"):
            if kind in parts:
                part(kind, lambda kind=kind: profile_train(kind, model_dir, device, train_rows, train_seq, cuda,
                                                           args.top))
    out["total_s"] = round(time.perf_counter() - t_start, 2)
    out["ok"] = bool(out["parts"]) and not any("error" in v for v in out["parts"].values())
    write_json(Path(args.out), out)
    print(f"gpu_profile: ok={out['ok']} ({out['total_s']} s) → {args.out}", flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
