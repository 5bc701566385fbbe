"""The Alloy pipeline on one GPU machine, end to end, as a benchmark that can fail.

    python bench/gpu_pipeline.py --out bench/results/gpu_pipeline_<card>.json [--config configs/gpu-1.yaml]
        [--quick] [--set key=value ...] [--root DIR] [--expect-device cuda|cpu]

Runs the pipeline's own flow function (`flows.pipeline.pipeline`: base SFT → specialists, several at once → teacher
servers → OPD student → evaluation → report) in this process, with MLflow tracking off. The lent GPU machine has
CUDA + PyTorch but no Prefect, MLflow or SGLang (and no network): `prefect` is replaced by pass-through stand-ins
(`prefect_stand_in`: `@flow`/`@task` call the function; `.submit` runs it on the flow's thread pool of
`specialists.max_parallel` workers, with the task's retries; artifacts and concurrency limits do nothing, `quote` passes its value through), and
`mlflow`/`sglang` are made absent (an import fails as on a machine without them). What runs is the real thing
otherwise: the trainer processes (DeepSpeed), the embedded engine servers (rollouts, teachers), the placement plan
that shares the GPU between them by memory fractions, storage, evaluation, the report. Prefect's orchestration
itself (task runs, artifacts, the `gpu` concurrency limit) is what this does not exercise; tests/e2e does.

`--quick` shortens the config by overrides (`QUICK`) to fit a few minutes of device time; `--set` adds more.

Written to `--out` (JSON): the commit, command, machine (CPU, cores, torch, CUDA, GPU name and memory), the config
and overrides; per stage (`base`, `specialists`, `teachers`, `distill`, `eval`): wall seconds, the device each
trainer process trained on (from its summary) and each engine server ran on (its log's "engine ready" line), `ok`;
`throughput`: rollout tokens/s (specialists' sampled tokens over rollout time, the student's sampled tokens/s),
teacher scoring tokens/s, training tokens/s per trainer (positions forwarded in updates over update time);
`mfu`: each trainer's 6·N·tokens/s over the card's dense bf16 peak (`training.mfu`, the one definition: `PEAK_TFLOPS`;
N = the model's parameters; attention FLOPs left out, so a lower bound; PPO's policy only), comparable across runs;
`mfu_trainers`: the MFU each trainer reported in its own summary (6·N plus attention, PPO's policy and critic);
`gpu_memory`: the peak of every process seen by
`nvidia-smi --query-compute-apps` (sampled every `SAMPLE_S`) and each trainer's own `torch.cuda.max_memory_*`;
`weight_push`: seconds the specialists' pushes sat on the critical path (`push_s` per step: the next rollout waits)
and the student's (`timing_s.push_s`), and the deferred load time the servers spent off it (`push_load_s`);
`stage_windows`: each stage's start and end (epoch seconds: `tasks.context.stage_timer` wrapped);
`ok` per part and a top-level `ok`. Exit 1 when anything failed, when a trainer or server is not on
`--expect-device` (default: cuda when torch sees a GPU), or when the report is missing a stage.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, safetensors_params, start_meta, write_json  # noqa: E402  (puts the repository on sys.path)
from training.mfu import PEAK_TFLOPS, ModelShape, card_peak, flops_per_token  # noqa: E402,F401
from training.mfu import mfu as _mfu  # noqa: E402

ABSENT = ("mlflow", "sglang")
SAMPLE_S = 1.0  # nvidia-smi sampling period
QUICK = ["base.steps=100", "base.train.warmup_steps=10", "base.n_train_per_domain=500", "specialists.steps=4",
         "specialists.batch_size=64", "specialists.max_parallel=6", "specialists.val_every=2",
         "specialists.checkpoint_every=100", "specialists.critic_warmup_steps=1", "specialists.eval_n=32",
         "distill.steps=8", "distill.batch_size=96", "distill.train.warmup_steps=2", "distill.eval_every=4",
         "distill.eval_n=16", "distill.checkpoint_every=100", "eval.n_eval=64"]


# ------------------------------------------------------------------------------------------ Prefect stand-in


class _Runner:
    """`prefect.task_runners.ThreadPoolTaskRunner`: its `max_workers` bounds the threads `.submit` runs on."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers or 4


_POOLS: list[ThreadPoolExecutor] = []  # the running flows' pools, innermost last


class _Wrapped:
    """A `@flow` / `@task` function: calling it calls the function (with the task's retries); `.submit` runs it on
    the innermost flow's pool; `.with_options` keeps the runner / retries it is given."""

    def __init__(self, fn, runner: _Runner | None = None, retries: int = 0, retry_if=None, is_flow: bool = False):
        self.fn, self.runner, self.retries, self.retry_if, self.is_flow = fn, runner, retries, retry_if, is_flow
        self.__name__, self.__doc__ = getattr(fn, "__name__", "fn"), fn.__doc__

    def with_options(self, task_runner=None, retries=None, retry_condition_fn=None, **_):
        return _Wrapped(self.fn, task_runner or self.runner, self.retries if retries is None else retries,
                        retry_condition_fn or self.retry_if, self.is_flow)

    def _call(self, *args, **kwargs):
        for attempt in range(self.retries + 1):
            try:
                return self.fn(*args, **kwargs)
            except Exception:
                if attempt == self.retries or (self.retry_if is not None and not self.retry_if(self, None, None)):
                    raise
                print(f"[stand-in] {self.__name__}: retry {attempt + 1} of {self.retries}", flush=True)

    def __call__(self, *args, **kwargs):
        if not self.is_flow:
            return self._call(*args, **kwargs)
        with ThreadPoolExecutor(max_workers=(self.runner or _Runner()).max_workers) as pool:
            _POOLS.append(pool)
            try:
                return self._call(*args, **kwargs)
            finally:
                _POOLS.remove(pool)

    def submit(self, *args, **kwargs) -> Future:
        if not _POOLS:
            raise RuntimeError(f"{self.__name__}.submit outside a flow")
        return _POOLS[-1].submit(self._call, *args, **kwargs)


def _decorator(is_flow: bool):
    def deco(fn=None, **options):
        def wrap(f):
            return _Wrapped(f, options.get("task_runner"), options.get("retries") or 0,
                            options.get("retry_condition_fn"), is_flow)
        return wrap(fn) if callable(fn) else wrap
    return deco


def prefect_stand_in() -> None:
    """Put pass-through `prefect` modules in sys.modules (see the module docstring), unless prefect is loaded."""
    if "prefect" in sys.modules:
        return
    mods = {n: types.ModuleType(n) for n in ("prefect", "prefect.task_runners", "prefect.artifacts",
                                              "prefect.cache_policies", "prefect.concurrency",
                                              "prefect.concurrency.sync", "prefect.deployments", "prefect.settings",
                                              "prefect.utilities", "prefect.utilities.annotations")}
    mods["prefect"].flow, mods["prefect"].task = _decorator(True), _decorator(False)
    mods["prefect.task_runners"].ThreadPoolTaskRunner = _Runner
    for name in ("create_progress_artifact", "update_progress_artifact", "create_markdown_artifact",
                 "create_table_artifact"):
        setattr(mods["prefect.artifacts"], name, lambda *a, **k: None)
    mods["prefect.cache_policies"].NO_CACHE = None
    mods["prefect.utilities.annotations"].quote = lambda value: value  # the stand-in's tasks get their arguments as is
    mods["prefect.concurrency.sync"].concurrency = lambda *a, **k: contextlib.nullcontext()

    def run_deployment(*a, **k):
        raise RuntimeError("deployment mode needs Prefect; this benchmark runs the stages locally")
    mods["prefect.deployments"].run_deployment = run_deployment
    for name, mod in mods.items():
        mod.__stand_in__ = True
        sys.modules[name] = mod
    for name in ABSENT:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  (an import raises ModuleNotFoundError)


def record_stage_windows() -> list[dict]:
    """Record each stage's wall-clock window (`tasks.context.stage_timer`: {"stage", "start", "end"} in epoch
    seconds), so a caller sampling the GPU beside this process (bench/gpu_perf.py) can tell how busy it was during
    each stage. Wraps the timer's enter/exit; the stage timings themselves are unchanged."""
    from tasks.context import stage_timer

    windows: list[dict] = []
    enter, exit_ = stage_timer.__enter__, stage_timer.__exit__

    def on_enter(self):
        self._window = {"stage": self.name, "start": time.time(), "end": None}
        windows.append(self._window)
        return enter(self)

    def on_exit(self, *exc):
        self._window["end"] = time.time()
        return exit_(self, *exc)

    stage_timer.__enter__, stage_timer.__exit__ = on_enter, on_exit
    return windows


# ------------------------------------------------------------------------------------------ GPU memory sampler


class ResumePruner:
    """Deletes a specialist's or the student's resume checkpoints (`step-*` under its storage prefix) once its
    `final/` is committed (a rerun reuses `final/`, never `step-*`). The lent machine has 64 GB of disk and a 151M
    model's PPO checkpoint (policy + critic with their fp32 Adam states) is ~4.8 GB: twelve would not fit."""

    def __init__(self, root: Path):
        self.root, self.freed_bytes, self.pruned = root, 0, []
        self._stop = threading.Event()
        self._names: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self.sweep()

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self.sweep()

    def sweep(self) -> None:
        try:
            self._sweep()
        except Exception as e:  # noqa: BLE001 - disk housekeeping must never fail the run
            print(f"[resume pruner] {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _sweep(self) -> None:
        from infra.storage import MANIFEST

        for final in list(self.root.glob("*/specialist-*/final")) + list(self.root.glob("*/student-*/final")):
            if not (final / MANIFEST).is_file():
                continue
            for step in final.parent.glob("step-*"):
                size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
                shutil.rmtree(step, ignore_errors=True)
                self.freed_bytes += size
                self.pruned.append(str(step.relative_to(self.root)))


class GpuSampler:
    """Peak GPU memory of every process `nvidia-smi --query-compute-apps` lists, each named by its command line."""

    def __init__(self):
        self.peak_mib: dict[str, dict] = {}
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._names: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: str | None = None

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            except Exception as e:  # noqa: BLE001 - sampling is best effort; the trainers report their own peaks
                self.error = f"{type(e).__name__}: {e}"
                continue
            for line in out.stdout.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 2 or not parts[0].isdigit():
                    continue
                pid, mib = int(parts[0]), float(parts[1]) if parts[1].replace(".", "").isdigit() else 0.0
                # a pid keeps the name it was first seen with (an exiting process leaves /proc before nvidia-smi)
                name = self._names.get(pid) or process_name(pid)
                if name != "unknown":
                    self._names[pid] = name
                rec = self.peak_mib.setdefault(f"{name} (pid {pid})", {"role": name, "peak_mib": 0.0})
                rec["peak_mib"] = max(rec["peak_mib"], mib)


def process_name(pid: int) -> str:
    """What a process is, from its command line: `teacher/rollout server <model dir>`, `specialist <domain>`,
    `student`, `base`, or `flow (this process: evaluation)`."""
    if pid == os.getpid():
        return "flow (evaluation)"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "unknown"
    args = [a.decode(errors="replace") for a in argv if a]
    joined = " ".join(args)
    if "engine.server" in joined:
        model = args[args.index("--model") + 1] if "--model" in args else "?"
        return f"engine server {Path(model).parent.name}/{Path(model).name}"
    if "specialist_main" in joined:
        return f"specialist {args[args.index('--domain') + 1] if '--domain' in args else '?'}"
    if "distill_main" in joined:
        return "student"
    if "base_main" in joined:
        return "base"
    return Path(args[0]).name if args else "unknown"


# ------------------------------------------------------------------------------------------ reading the run


READY = re.compile(r"engine ready: model .* on (\S+) in (\w+),")  # engine/scheduler.py's line


def server_devices(root: Path) -> dict[str, dict]:
    """{server log: {"device", "dtype"}} from every embedded server log under `root` ("engine ready" line)."""
    out: dict[str, dict] = {}
    for log_path in sorted(root.rglob("*.log")):
        text = log_path.read_text(errors="replace")
        if "engine ready" not in text:
            continue
        for m in READY.finditer(text):  # the last start wins (a restarted server logs again)
            out[str(log_path.relative_to(root))] = {"device": m.group(1), "dtype": m.group(2)}
    return out


def trainer_results(root: Path) -> dict[str, dict]:
    """{"base" | "specialist <domain>" | "student": summary} of every trainer of the run under `root`: the base
    summary from the work dir's logs, the others as committed to storage (`<prefix>/result.json`)."""
    out: dict[str, dict] = {}
    for p in root.rglob("base-result.json"):
        out["base"] = json.loads(p.read_text())
    for p in root.glob("*/specialist-*/result.json"):
        domain = re.sub(r"^specialist-(.*)-[0-9a-f]+$", r"\1", p.parent.name)
        out[f"specialist {domain}"] = json.loads(p.read_text())
    for p in root.glob("*/student-*/result.json"):
        out["student"] = json.loads(p.read_text())
    return out


def model_params(root: Path) -> int | None:
    """Parameters of the run's model (the base checkpoint's safetensors, counted from their headers)."""
    for st in root.rglob("base/model.safetensors"):
        return safetensors_params(st)
    return None


def mfu(tokens: float, seconds: float, params: int | None, peak_tflops: float | None) -> float | None:
    """6·N·tokens/s over the peak (`training.mfu` without its attention term: a lower bound)."""
    if not (tokens and params):
        return None
    value = _mfu(tokens * flops_per_token(ModelShape(params, 0, 0), 0), seconds, peak_tflops)
    return None if value is None else round(value, 5)


def summarize(report: dict | None, root: Path, device: str, params: int | None, peak: float | None,
              sampler: GpuSampler) -> dict:
    trainers = trainer_results(root)
    servers = server_devices(root)
    timings = (report or {}).get("timings_s") or {}
    thr = (report or {}).get("throughput") or {}
    stages: dict[str, dict] = {}

    def on(dev: str | None) -> bool:
        return bool(dev) and dev.split(":")[0] == device

    base = trainers.get("base", {})
    stages["base"] = {"wall_s": timings.get("base"), "device": base.get("device"),
                      "ok": on(base.get("device")) and bool(timings.get("base"))}
    specs = {k: v for k, v in trainers.items() if k.startswith("specialist ")}
    n_domains = len((report or {}).get("domains") or {})
    spec_servers = {k: v for k, v in servers.items() if "specialist" in k}
    stages["specialists"] = {"wall_s": timings.get("specialists"), "n": len(specs),
                             "devices": sorted({str(v.get("device")) for v in specs.values()}),
                             "rollout_server_devices": sorted({str(v["device"]) for v in spec_servers.values()}),
                             "ok": bool(specs) and len(specs) == n_domains and all(on(v.get("device")) for v in specs.values())
                             and bool(spec_servers) and all(on(v["device"]) for v in spec_servers.values())}
    teacher_logs = {k: v for k, v in servers.items() if "teacher" in k}
    stages["teachers"] = {"n_servers": len(teacher_logs), "devices": sorted({str(v["device"]) for v in teacher_logs.values()}),
                          "dtypes": sorted({str(v["dtype"]) for v in teacher_logs.values()}),
                          "ok": len(teacher_logs) >= n_domains > 0 and all(on(v["device"]) for v in teacher_logs.values())}
    student = trainers.get("student", {})
    stages["distill"] = {"wall_s": timings.get("distill"), "device": student.get("device"),
                         "ok": on(student.get("device")) and bool(student.get("steps"))}
    stages["eval"] = {"wall_s": timings.get("eval"), "ok": bool(report) and all(
        (r.get("base") is not None and r.get("student") is not None) for r in (report.get("domains") or {}).values())}

    rollout_tok = sum(h.get("response_tokens", 0) for v in specs.values() for h in v.get("history", []))
    rollout_s = sum(h.get("rollout_s", 0) for v in specs.values() for h in v.get("history", []))
    spec_train_tok = sum(h.get("train_tokens", 0) for v in specs.values() for h in v.get("history", []))
    spec_train_s = sum(h.get("train_s", 0) for v in specs.values() for h in v.get("history", []))
    st_timing = student.get("timing_s") or {}
    throughput = {
        "specialist_rollout_tokens_per_s": round(rollout_tok / rollout_s, 1) if rollout_s else None,
        "student_sampled_tokens_per_s": (student.get("throughput") or {}).get("sampled_tokens_per_s"),
        "teacher_scored_tokens_per_s": (student.get("throughput") or {}).get("teacher_scored_tokens_per_s")
        or thr.get("teacher_scored_tokens_per_s"),
        "base_train_tokens_per_s": round(base["train_tokens"] / base["train_s"], 1) if base.get("train_s") else None,
        "specialist_train_tokens_per_s": round(spec_train_tok / spec_train_s, 1) if spec_train_s else None,
        "student_train_tokens_per_s": round(student.get("train_tokens", 0) / st_timing["train_s"], 1)
        if st_timing.get("train_s") else None,
    }
    mfus = {"base": mfu(base.get("train_tokens"), base.get("train_s"), params, peak),
            "specialists_policy": mfu(spec_train_tok, spec_train_s, params, peak),
            "student": mfu(student.get("train_tokens"), st_timing.get("train_s"), params, peak)}
    reported = {"base": base.get("mfu"), "student": student.get("mfu"),
                **{k: v.get("mfu") for k, v in specs.items()}}
    push = {"specialists_on_critical_path_s": round(sum(h.get("push_s", 0) for v in specs.values()
                                                        for h in v.get("history", [])), 3),
            "specialist_steps": sum(len(v.get("history", [])) for v in specs.values()),
            "student_on_critical_path_s": st_timing.get("push_s"),
            "student_load_off_critical_path_s": st_timing.get("push_load_s"), "student_steps": student.get("steps"),
            # the path each trainer's pushes took (tensor: CUDA IPC / shm handles; memory; distributed; disk)
            "paths": {k: v.get("weight_sync") for k, v in trainers.items() if v.get("weight_sync")}}
    trainer_mem = {k: v.get("gpu") for k, v in trainers.items() if v.get("gpu")}
    return {"stages": stages, "throughput": throughput, "mfu": mfus, "mfu_trainers": reported, "params": params, "weight_push": push,
            "gpu_memory": {"nvidia_smi_available": sampler.available, "nvidia_smi_error": sampler.error,
                           "per_process_peak_mib": sampler.peak_mib, "trainers_torch": trainer_mem},
            "servers": servers}


# ------------------------------------------------------------------------------------------ main


def machine(device: str) -> dict:
    """The GPU side of the machine (the rest is in `meta`)."""
    import torch

    out = {"cuda": torch.cuda.is_available()}
    if out["cuda"]:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 1e9, 1), cuda_version=torch.version.cuda,
                   gpu_count=torch.cuda.device_count())
    return out


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(REPO / "configs" / "gpu-1.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quick", action="store_true", help="shorten every stage (QUICK overrides) to fit a device lease")
    p.add_argument("--root", default=None, help="run root (default: a fresh temp dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--expect-device", choices=["cuda", "cpu"], default=None,
                   help="every trainer and server must be on it (default: cuda when torch sees a GPU, else cpu)")
    add_check(p, "a stage failed, the report lacks one, or a trainer or server is off --expect-device", always=True)
    args = p.parse_args(argv)
    meta = start_meta()

    prefect_stand_in()
    # `timeout` (a device lease) sends SIGTERM: stop the flow as a Ctrl-C would, and still write the JSON
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    import torch

    import training  # noqa: F401  (DeepSpeed's accelerator: cuda when torch sees a GPU)

    device = args.expect_device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = machine(device)
    root = Path(args.root or tempfile.mkdtemp(prefix="alloy-gpu-pipeline-"))
    overrides = (QUICK if args.quick else []) + ["tracking.enabled=false", f"run.root={root}", "run.resume=false"]
    if info.get("gpu_memory_gb"):
        overrides.append(f"resources.gpu_memory_gb={info['gpu_memory_gb']}")
    overrides += args.set
    out = {"bench": "gpu_pipeline", "meta": meta, "commit": meta["commit"],
           "command": " ".join([sys.executable] + sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": info, "config": args.config,
           "overrides": overrides, "expect_device": device,
           "stand_in": "prefect: pass-through stand-ins; mlflow, sglang: absent (see the module docstring)"}
    report, error = None, None
    t0 = time.perf_counter()
    windows = record_stage_windows()
    with GpuSampler() as sampler, ResumePruner(root) as pruner:
        try:
            from flows.pipeline import pipeline

            report = pipeline(config=args.config, overrides=overrides, report_path=str(root / "report.json"))
        except BaseException as e:  # noqa: BLE001 - recorded; the JSON is written either way
            error = "".join(traceback.format_exception(e))[-6000:]
            print(error, file=sys.stderr, flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["flow_process_torch_peak_bytes"] = torch.cuda.max_memory_allocated()
    params = model_params(root)
    out.update(summarize(report, root, device, params, card_peak(info.get("gpu")), sampler))
    out["stage_windows"] = windows  # epoch seconds; bench/gpu_perf.py reads the GPU's busy share per stage
    out["pruned_resume_checkpoints"] = {"n": len(pruner.pruned), "gb": round(pruner.freed_bytes / 1e9, 2)}
    out["report"] = {k: (report or {}).get(k) for k in ("summary", "timings_s", "throughput", "domains")}
    out["error"] = error
    out["ok"] = error is None and report is not None and all(s["ok"] for s in out["stages"].values())
    write_json(Path(args.out), out, default=str)
    print(json.dumps({"ok": out["ok"], "stages": out["stages"], "wall_s": out["wall_s"]}, indent=1, default=str))
    if not args.keep and args.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
