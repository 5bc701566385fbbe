"""GPU check: what a machine with CUDA GPUs (and no Prefect, MLflow or SGLang) can tell about Alloy's trainers.

    python bench/gpu_check.py --out /path/gpu_check.json [--part-timeout S] [--steps N] [--layers L]

Runs on bare CUDA + PyTorch + deepspeed + pydantic + transformers (+ aiohttp/orjson for the embedded engine).
Each part runs in its own subprocess with a timeout (`--part-timeout`, else the part's default), and in each one
`prefect`, `mlflow` and `sglang` are made absent (None in sys.modules: an import raises ModuleNotFoundError and
`importlib.util.find_spec` finds nothing, as on a machine without them): the JSON records which of them anything tried to import (DeepSpeed's autotuner probes
mlflow and does without) and that none was loaded. Parts:

- `probe`: torch, CUDA, devices (name, memory), deepspeed.
- `deepspeed_zero0` .. `deepspeed_zero3` (CUDA): `training.deepspeed_backend.DeepSpeedBackend` in bf16 at that ZeRO
  stage, one rank, on a random-init Llama (hidden 1024, `--layers` 8, 16 heads, vocab 32000: ~170M parameters),
  `--steps` steps on one fixed batch of 8 × 512 random tokens (memorising it: the loss must fall), token-mean
  cross-entropy normalised as the trainers do (`backend.loss_normalizer`). Checks: every loss finite, the last
  below the first. Reports tokens/s over the steps after the first two (warm-up), peak GPU memory.
- `deepspeed_zero3_buckets` (CUDA): the ZeRO-3 part with each step's batch forwarded in 4 calls of 2 rows before
  one backward (as the student forwards a micro-batch in length buckets); its per-step losses must stay within 0.05
  of the one-forward ZeRO-3 part's (`max_loss_diff_to_one_forward`).
- `torch_bf16` (CUDA): the same model, batch and steps as a plain torch loop (fp32 weights, bf16 autocast, AdamW):
  the reference the DeepSpeed tokens/s are divided by (`ratio_to_torch`; a DeepSpeed part under 0.2 fails).
- `deepspeed_zero2_2ranks` (≥ 2 GPUs): the ZeRO-2 part under torchrun on 2 ranks (each its half of a 16-row batch).
- `placement` (CUDA): `infra.placement.make_plan` for configs/gpu-example.yaml on the GPUs seen (their memory as
  `resources.gpu_memory_gb`): the plan and `plan_problems` (must be none), or the planner's refusal (a clear
  `PlacementError` is a pass: it is what the planner must do when the node is too small). Then, for every GPU,
  a process started with the CUDA_VISIBLE_DEVICES `trainer_env` gives a trainer there must see exactly one
  device whose UUID is that GPU's.
- `specialist_step`, `distill_step` (CPU, beside the GPU parts: CUDA_VISIBLE_DEVICES empty, DS_ACCELERATOR=cpu;
  both run at the same time as the GPU parts, which run one after another):
  2 PPO steps of `teachers.specialist_main.run_specialist` and 2 OPD steps of `student.distill_main.
  run_distillation` on a fresh `tiny` model, each with its own embedded engine server (the student's teacher is
  another embedded server), no tracking; the specialist without critic warm-up.
  Checks: 2 steps done, every loss reported finite (a value loss each step; a policy loss where the step had one:
  from a random-init model every reward can be 0, so no advantage and no policy update), an OPD loss each step.
- `shared_gpu` (CUDA): `configs/gpu-1.yaml` planned on one GPU (`resources.share_gpus`), and a specialist lane's
  trainer env around a process training the `medium` preset (bf16) through `DeepSpeedBackend`: its allocator is
  capped at the lane's fraction (`ALLOY_GPU_MEM_FRACTION`, applied by `init_distributed`): peak memory under the
  cap, an allocation past it refused.
- `loss_memory` (CUDA): `bench/loss_memory.py --device cuda` at 1 × 1024, 4 × 1024 and 16 × 2048 tokens: extra GPU
  memory (torch.cuda.max_memory_allocated) of the OPD losses and the specialists' log-probs + entropy on bf16
  logits with V = 151,936, before and after chunking; fails if a chunked run takes more than 1.5× the logits.

Without CUDA the GPU parts are `skipped` and `"cuda": false`. Any failed part (an exception, a failed check, a
timeout, a blocked module loaded) makes `"ok": false` and the exit code 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, start_meta, write_json  # noqa: E402  (puts the repository on sys.path)

BLOCKED = ("prefect", "mlflow", "sglang")
MAX_BUCKET_LOSS_DIFF = 0.05  # bf16: ZeRO-3 with 4 forwards per step vs 1 forward, per-step loss, same batch
MIN_RATIO_TO_TORCH = 0.2  # a DeepSpeed part slower than 1/5 of plain torch on the same work fails
_ATTEMPTS: set[str] = set()


def _audit(event: str, args: tuple) -> None:
    if event == "import" and str(args[0]).split(".")[0] in BLOCKED:
        _ATTEMPTS.add(str(args[0]).split(".")[0])


def block_imports() -> None:
    """Make the BLOCKED packages absent, as on a machine without them: `import x` raises ModuleNotFoundError and
    `importlib.util.find_spec("x")` is None (a None entry in sys.modules); an audit hook records who tried."""
    for name in BLOCKED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    if not getattr(block_imports, "hooked", False):
        sys.addaudithook(_audit)
        block_imports.hooked = True


def loaded_blocked() -> list[str]:
    return sorted({m.split(".")[0] for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in BLOCKED})


# ------------------------------------------------------------------------------------------ parts (in a child)


def part_probe(args) -> dict:
    import training  # noqa: F401  (sets DS_ACCELERATOR: cpu unless CUDA is visible)
    import torch

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "device_count": 0, "devices": []}
    if out["cuda"]:
        out["device_count"] = torch.cuda.device_count()
        out["cuda_version"] = torch.version.cuda
        for i in range(out["device_count"]):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 2),
                                   "uuid": str(getattr(p, "uuid", ""))})
    import deepspeed

    out["deepspeed"] = deepspeed.__version__
    return out


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _batch(rows: int, seq: int, device, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 32000, (rows, seq), generator=g).to(device)


def _token_ce_sum(logits, ids):
    import torch

    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1), reduction="sum")


def _train_summary(losses: list[float], times: list[float], tokens_per_step: int) -> dict:
    timed = times[2:] if len(times) > 2 else times
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    return {"losses": [round(x, 4) for x in losses], "loss_finite_and_decreasing": ok,
            "tokens_per_s": round(tokens_per_step * len(timed) / sum(timed), 1), "step_s": [round(t, 4) for t in times],
            "check": None if ok else f"losses not finite or not decreasing: {losses}"}


def part_deepspeed(args, stage: int, chunks: int = 1) -> dict:
    import infra  # noqa: F401
    import torch

    from training.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL starts: one GPU per rank
    rank, world = init_distributed()
    torch.manual_seed(0)
    model = _llama(args.layers)
    params = sum(p.numel() for p in model.parameters())
    rows, seq = 8, 512
    backend = DeepSpeedBackend(model, TrainSettings(lr=1e-4, zero_stage=stage, dtype="bf16", micro_batch_size=rows,
                                                    total_steps=args.steps, seed=0))
    ids = _batch(rows * world, seq, backend.device)[rank * rows:(rank + 1) * rows]  # this rank's rows
    global_tokens = rows * world * (seq - 1)
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # `chunks` > 1: the rows forwarded in that many calls before one backward, as the student forwards a
        # micro-batch in length buckets (student/trainer.py); the summed loss equals the one-forward loss
        local = sum(_token_ce_sum(backend(input_ids=part).logits, part) for part in ids.chunk(chunks))
        backend.step(local / backend.loss_normalizer(global_tokens))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(backend.all_reduce_sum(local.item()) / global_tokens)
    res = {"zero_stage": stage, "world_size": world, "forwards_per_step": chunks, "params": params, "batch": f"{rows * world} x {seq}",
           "device": str(backend.device), "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
           **_train_summary(losses, times, rows * world * seq)}
    if backend.device.type != "cuda" and not res["check"]:  # it trained, but on the CPU of a GPU machine
        res["check"] = f"the DeepSpeed engine is on {backend.device}, not on the GPU (DS_ACCELERATOR?)"
    backend.close()
    return res if rank == 0 else {}


def part_torch_bf16(args) -> dict:
    import torch

    torch.manual_seed(0)
    model = _llama(args.layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows, seq = 8, 512
    ids = _batch(rows, seq, "cuda")
    losses, times = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _token_ce_sum(model(input_ids=ids).logits, ids) / (rows * (seq - 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"batch": f"{rows} x {seq}", **_train_summary(losses, times, rows * seq)}


def part_placement(args) -> dict:
    import torch

    from infra.config import load_config
    from infra.placement import PlacementError, Proc, make_plan, plan_problems, trainer_env, visible_devices

    n = torch.cuda.device_count()
    mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / 1e9
    cfg = load_config(REPO / "configs" / "gpu-example.yaml", [f"resources.gpu_memory_gb={mem:.1f}"],
                      check_model_path=False)
    out: dict = {"gpus": n, "gpu_memory_gb": round(mem, 1), "config": "configs/gpu-example.yaml"}
    try:
        plan = make_plan(cfg, n)
        out.update(fits=True, processes=plan.to_json()["processes"], problems=plan_problems(plan))
    except PlacementError as exc:
        plan = None
        out.update(fits=False, refusal=str(exc))
    visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), n)
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    seen = {}
    for g in range(min(n, 8)):  # what a trainer placed on GPU g sees
        env = {**os.environ, **trainer_env(plan or _empty_plan(n), Proc("check", f"gpu-{g}", "trainer", (g,), 0.95),
                                           visible)}
        probe = ("import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)")
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        seen[g] = r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr[-500:]}"
    out["trainer_env_sees"] = seen
    bad = [g for g, s in seen.items() if s != f"1 {uuids[g]}"]
    problems = out.get("problems") or []
    out["check"] = ("; ".join(problems) if problems else
                    f"CUDA_VISIBLE_DEVICES of GPUs {bad} did not show exactly that GPU" if bad else None)
    return out


def _empty_plan(n: int):
    from infra.placement import Plan

    return Plan(n, 0, 0, "")


def _cpu_cfg(work: Path, **sections):
    from infra.config import config_from_dict

    return config_from_dict({"run": {"name": "gpu-check", "root": str(work / "runs")}, "domains": [{"name": "reverse"}],
                             "eval": {"n_eval": 8, "max_new_tokens": 8}, **sections})


def part_specialist_step(args) -> dict:
    from domains.registry import load_domains
    from infra.models import init_model_dir
    from infra.tracking import NoopTracker
    from teachers.specialist_main import run_specialist

    work = Path(tempfile.mkdtemp(prefix="gpu-check-spec-"))  # removed by run_part_here
    base = init_model_dir("tiny", work / "base", seed=0)
    cfg = _cpu_cfg(work, specialists={"steps": 2, "batch_size": 8, "val_every": 0, "eval_n": 8, "log_every": 1,
                                      "checkpoint_every": 2, "n_prompts": 32, "critic_warmup_steps": 0})
    t0 = time.perf_counter()
    out = run_specialist(cfg, load_domains(cfg)["reverse"], str(base), f"file://{work}/out", work / "work",
                         NoopTracker())
    losses = [(h.get("policy_loss"), h.get("value_loss")) for h in out["history"]]
    # a step may report no policy loss: from a random-init model every reward can be 0 (no advantage, no policy
    # update; a CI run saw that on both steps), so the check asks for finite numbers and a critic update each step
    reported = [x for pair in losses for x in pair if x is not None]
    ok = (out["steps"] == 2 and len(losses) == 2 and all(math.isfinite(x) for x in reported)
          and all(v is not None for _, v in losses))
    return {"steps": out["steps"], "policy_value_loss": losses, "run_s": round(time.perf_counter() - t0, 2),
            "score": out.get("score"), "check": None if ok else f"steps {out['steps']}, (policy, value) losses {losses}"}


def part_distill_step(args) -> dict:
    from domains.registry import load_domains
    from engine.launcher import ServerSpec, Supervisor
    from infra.models import init_model_dir
    from infra.tracking import NoopTracker
    from student.distill_main import run_distillation

    work = Path(tempfile.mkdtemp(prefix="gpu-check-distill-"))  # removed by run_part_here
    base = init_model_dir("tiny", work / "base", seed=0)
    cfg = _cpu_cfg(work, distill={"steps": 2, "batch_size": 8, "eval_every": 0, "eval_n": 8, "log_every": 1,
                                  "checkpoint_every": 2, "n_prompts_per_domain": 32})
    seen: list[dict] = []
    t0 = time.perf_counter()
    with Supervisor(work / "logs") as sup:
        teachers = sup.start([ServerSpec("teacher-reverse", str(base))])
        out = run_distillation(cfg, load_domains(cfg), str(base), {"reverse": teachers["teacher-reverse"]},
                               f"file://{work}/out", work / "work", NoopTracker(),
                               on_step=lambda tr, m: seen.append(dict(m)))
    losses = [m.get("train/loss") for m in seen]
    ok = out["steps"] == 2 and len(losses) == 2 and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    return {"steps": out["steps"], "loss": losses, "run_s": round(time.perf_counter() - t0, 2),
            "check": None if ok else f"steps {out['steps']}, losses {losses}"}


# name → (function, needs CUDA, minimum GPUs, default timeout s)
PARTS = {
    "probe": (part_probe, False, 0, 180),
    **{f"deepspeed_zero{z}": ((lambda a, z=z: part_deepspeed(a, z)), True, 1, 600) for z in range(4)},
    "deepspeed_zero3_buckets": ((lambda a: part_deepspeed(a, 3, chunks=4)), True, 1, 600),
    "torch_bf16": (part_torch_bf16, True, 1, 600),
    "deepspeed_zero2_2ranks": ((lambda a: part_deepspeed(a, 2)), True, 2, 600),
    "placement": (part_placement, True, 1, 600),
    "specialist_step": (part_specialist_step, False, 0, 600),
    "distill_step": (part_distill_step, False, 0, 600),
}
CPU_PARTS = ("specialist_step", "distill_step")


def part_loss_memory(args) -> dict:
    """bench/loss_memory.py on the GPU: extra memory of the OPD losses and the specialists' log-probs, old (full
    float32 copies) vs chunked, bf16 logits at V = 151,936; a chunked run above 1.5× the logits fails the part."""
    sys.path.insert(0, str(REPO / "bench"))
    import loss_memory

    out = Path(tempfile.gettempdir()) / "loss_memory.json"
    code = loss_memory.main(["--device", "cuda", "--shapes", "1x1024,4x1024,16x2048", "--out", str(out)])
    report = json.loads(out.read_text())
    res = {k: report[k] for k in ("V", "method", "max_new_over_logits", "target_met")}
    res["runs"] = [{k: r.get(k) for k in ("variant", "impl", "B", "T", "extra_over_logits", "extra_bytes", "seconds",
                                          "skipped", "error")} for r in report["runs"]]
    if code != 0 or not report["target_met"]:
        res["check"] = f"loss_memory: exit {code}, max chunked extra {report['max_new_over_logits']}× (target ≤ 1.5×)"
    return res


PARTS["loss_memory"] = (part_loss_memory, True, 1, 600)

_SHARED_TRAINER = """
import json, sys, time
import infra  # noqa: F401  (DS_ACCELERATOR)
import torch
from infra.models import build_model
from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
rows, seq, steps = 32, 128, 3
model = build_model("medium", 100, 0, 1, 2)
backend = DeepSpeedBackend(model, TrainSettings(lr=1e-4, zero_stage=0, dtype="bf16", micro_batch_size=rows,
                                                total_steps=steps, seed=0))  # init_distributed applies the cap
ids = torch.randint(4, 100, (rows, seq), generator=torch.Generator().manual_seed(0)).to(backend.device)
torch.cuda.reset_peak_memory_stats()
losses = []
for _ in range(steps):
    logits = backend(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 100), ids[:, 1:].reshape(-1),
                                             reduction="sum")
    backend.step(loss / backend.loss_normalizer(rows * (seq - 1)))
    losses.append(loss.item() / (rows * (seq - 1)))
torch.cuda.synchronize()
out = {"device": str(backend.device), "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
       "losses": [round(x, 4) for x in losses], "total_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)}
try:  # one allocation past the cap must be refused by this process's allocator
    torch.empty(int(float(sys.argv[1]) * 1e9), dtype=torch.uint8, device="cuda")
    out["over_cap_refused"] = False
except torch.OutOfMemoryError:
    out["over_cap_refused"] = True
print(json.dumps(out))
"""


def part_shared_gpu(args) -> dict:
    """configs/gpu-1.yaml on one GPU (its memory as resources.gpu_memory_gb): the shared plan, then a specialist
    lane's trainer env (`trainer_env`: CUDA_VISIBLE_DEVICES and ALLOY_GPU_MEM_FRACTION) around a process that
    trains the `medium` preset (bf16, ZeRO-0, 32 × 128 tokens, 3 steps) through DeepSpeedBackend: its peak allocated
    memory must stay under the cap, and one allocation of (cap − peak + 1 GB) must raise OutOfMemoryError there."""
    import torch

    from infra.config import load_config
    from infra.placement import make_plan, plan_problems, trainer_env, visible_devices

    mem = torch.cuda.get_device_properties(0).total_memory / 1e9
    cfg = load_config(REPO / "configs" / "gpu-1.yaml", [f"resources.gpu_memory_gb={mem:.1f}"])
    plan = make_plan(cfg, 1)
    lane = plan.trainers("specialists")[0]
    env = {**os.environ, **trainer_env(plan, lane, visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), 1))}
    env.pop("RANK", None)
    cap_gb = lane.mem_fraction * mem
    over_gb = max(cap_gb, 1.0)  # larger than what is left under the cap, whatever the peak: the cap must refuse it
    r = subprocess.run([sys.executable, "-c", _SHARED_TRAINER, f"{over_gb:.2f}"], env=env, capture_output=True,
                       text=True, timeout=540, cwd=str(REPO))
    out: dict = {"gpu_memory_gb": round(mem, 1), "problems": plan_problems(plan),
                 "processes": plan.to_json()["processes"], "lane_fraction": lane.mem_fraction,
                 "cap_gb": round(cap_gb, 2), "env_fraction": env.get("ALLOY_GPU_MEM_FRACTION")}
    if r.returncode != 0:
        out["check"] = f"the capped trainer failed: {r.stderr[-1500:]}"
        return out
    out["trainer"] = json.loads(r.stdout.strip().splitlines()[-1])
    t = out["trainer"]
    bad = ([f"plan: {out['problems']}"] if out["problems"] else []) + \
        ([f"peak {t['peak_allocated_gb']} GB over the cap {cap_gb:.2f} GB"] if t["peak_allocated_gb"] > cap_gb else []) + \
        (["an allocation past the cap was not refused"] if not t["over_cap_refused"] else []) + \
        ([f"trainer on {t['device']}"] if not t["device"].startswith("cuda") else [])
    out["check"] = "; ".join(bad) or None
    return out


PARTS["shared_gpu"] = (part_shared_gpu, True, 1, 600)


def run_part_here(name: str, args) -> int:
    """Child: run one part with the blocker on, write {"result": ..., "blocked_attempts", "blocked_loaded"}."""
    block_imports()
    sys.path.insert(0, str(REPO))
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    tempfile.tempdir = tmp  # the part's scratch files, removed below
    out: dict = {}
    try:
        out["result"] = PARTS[name][0](args)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        code = 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(blocked_attempts=sorted(_ATTEMPTS), blocked_loaded=loaded_blocked())
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.part_out).write_text(json.dumps(out))
    return code


# ------------------------------------------------------------------------------------------ orchestration


def run_part(name: str, args, probe: dict) -> dict:
    fn, needs_cuda, min_gpus, timeout = PARTS[name]
    if needs_cuda and (not probe.get("cuda") or probe.get("device_count", 0) < min_gpus):
        why = "no CUDA device" if not probe.get("cuda") else f"needs {min_gpus} GPUs, {probe['device_count']} seen"
        return {"status": "skipped", "reason": why}
    timeout = args.part_timeout or timeout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if name in CPU_PARTS:  # beside the GPUs: the trainers and their engine servers stay on the CPU
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        part_out = fh.name
    own = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--part-out", part_out,
           "--steps", str(args.steps), "--layers", str(args.layers)]
    cmd = own if name != "deepspeed_zero2_2ranks" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *own[1:]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        return {"status": "failed", "error": f"timed out after {timeout} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    seconds = round(time.perf_counter() - t0, 2)
    try:
        data = json.loads(Path(part_out).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        data = {}
    finally:
        Path(part_out).unlink(missing_ok=True)
    res = {"seconds": seconds, "blocked_attempts": data.get("blocked_attempts", []),
           "blocked_loaded": data.get("blocked_loaded", []), **(data.get("result") or {})}
    error = data.get("error") or (None if proc.returncode == 0 else f"exit code {proc.returncode}")
    if error is None and res.get("check"):
        error = res["check"]
    if error is None and res["blocked_loaded"]:
        error = f"loaded {res['blocked_loaded']}, which a bare CUDA machine does not have"
    if error:
        res.update(status="failed", error=error, stderr_tail=proc.stderr[-2000:])
    else:
        res["status"] = "ok"
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_check.json"))
    p.add_argument("--part-timeout", type=float, default=None, help="seconds per part (default: each part's own)")
    p.add_argument("--steps", type=int, default=10, help="training steps of the GPU parts")
    p.add_argument("--layers", type=int, default=8, help="layers of the GPU parts' random Llama")
    p.add_argument("--only", default=None, help="comma-separated part names (default: all)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    add_check(p, "any part fails (exception, failed check, timeout, a blocked package loaded)", always=True)
    args = p.parse_args(argv)
    if args.part:
        return run_part_here(args.part, args)
    meta = start_meta()
    block_imports()  # this process imports none of them either
    names = [n for n in PARTS if n != "probe"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    parts = {"probe": run_part("probe", args, {})}
    probe = parts["probe"] if parts["probe"]["status"] == "ok" else {}

    def run_group(group: list[str]) -> None:  # one after another (GPU timings must not overlap)
        for name in group:
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            parts[name] = run_part(name, args, probe)
            print(f"gpu_check: {name}: {parts[name]['status']} {parts[name].get('error', '')}".rstrip(),
                  file=sys.stderr, flush=True)

    # the CPU parts run beside the GPU parts and beside each other (their own processes and engine servers)
    groups = [[n for n in names if n not in CPU_PARTS]] + [[n] for n in names if n in CPU_PARTS]
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(run_group, groups))
    parts = {n: parts[n] for n in ["probe", *names]}
    base = parts.get("torch_bf16", {}).get("tokens_per_s")
    for z in range(4):
        d = parts.get(f"deepspeed_zero{z}", {})
        if base and d.get("tokens_per_s"):
            d["ratio_to_torch"] = round(d["tokens_per_s"] / base, 3)
            if d["ratio_to_torch"] < MIN_RATIO_TO_TORCH and d["status"] == "ok":  # the same model, batch and steps
                d.update(status="failed", error=f"DeepSpeed at {d['ratio_to_torch']} of the plain torch loop's "
                                                f"tokens/s (< {MIN_RATIO_TO_TORCH}): not on the GPU, or a slow path")
    one, four = parts.get("deepspeed_zero3", {}), parts.get("deepspeed_zero3_buckets", {})
    if one.get("losses") and four.get("losses") and four["status"] == "ok":  # same model, batch, seed, steps
        diff = max(abs(a - b) for a, b in zip(one["losses"], four["losses"]))
        four["max_loss_diff_to_one_forward"] = round(diff, 4)
        if diff > MAX_BUCKET_LOSS_DIFF:
            four.update(status="failed", error=f"4 forwards before one backward under ZeRO-3 trained differently from "
                                               f"one forward: losses differ by {diff:.4f} > {MAX_BUCKET_LOSS_DIFF}")
    failed = [n for n, r in parts.items() if r["status"] == "failed"]
    attempted = sorted({m for r in parts.values() for m in r.get("blocked_attempts", [])})
    loaded = sorted({m for r in parts.values() for m in r.get("blocked_loaded", [])} | set(loaded_blocked()))
    report = {
        "bench": "gpu_check", "meta": meta,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "ok": not failed, "failed": failed,
        "cuda": bool(probe.get("cuda")), "device_count": probe.get("device_count", 0),
        "devices": probe.get("devices", []),
        "machine": {"torch": probe.get("torch"), "deepspeed": probe.get("deepspeed")},
        "imports": {"blocked": list(BLOCKED), "attempted": attempted, "loaded": loaded,
                    "prefect": "prefect" in loaded, "mlflow": "mlflow" in loaded},
        "parts": parts,
    }
    out = Path(args.out)
    write_json(out, report)
    print(f"gpu_check: {'ok' if not failed else 'FAILED: ' + ', '.join(failed)}; wrote {out}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
