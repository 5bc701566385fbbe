"""Alloy at GPU speed (issue 51): the engine's decode, the trainers' MFU, TRL and the pipeline, on one card, in one go.

    python bench/gpu_perf.py [--out bench/results/gpu_perf_<card>.json] [--device cuda|cpu] [--budget-s 420]
        [--parts engine,hf,train,trl,pipeline] [--target NAME=VALUE ...] [--plant-miss] [--check]

Parts (each in try/except: a failed part records its error, the others run; a part that needs a package the machine
lacks records {"skipped": why}; a part that does not fit the time left records {"skipped": "time budget ..."}):

- `engine`: the embedded engine in process (`engine.scheduler.Engine`, dtype auto: bf16 on CUDA; `submit` with
  `Seq`s, closed loop: at most C requests in flight, a finished one's slot refilled at once, as C clients would) for
  each preset of `--presets` (cuda: small, medium) at C in `--levels` (1, 16, 64, 256), 16-token prompts, sampled at
  temperature 1 over the full vocabulary, on two loads: `equal` (C requests of exactly `--new-tokens`, ignore_eos)
  and `mix` (`--mix-rounds` × C requests, EOS honoured, each with its own length cap drawn as a rollout's:
  `gpu_parts.mix_lengths`, 1 in 8 rows to `--new-tokens`, the rest a domain answer's length + EOS from
  configs/gpu-1.yaml's domains). Reported: tokens/s (output tokens / wall) and the engine's own counters per decode
  step (decode ms, engine-thread CPU ms: the host time of a step, rows).
- `hf`: HF `generate` on the same card and `--hf-preset` (medium), configured as transformers' docs recommend for
  speed: `generation_config.cache_implementation = "static"`, `model.forward = torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True)` (on cuda; the CPU keeps the static cache, uncompiled), two warm-up calls
  per batch shape before timing (their time reported as `compile_s`), the same prompts and lengths as the engine,
  in batches of C (`--hf-levels`: 1, 64): a row stops at its length (a per-row StoppingCriteria) or EOS and pads on
  until its batch's longest ends, which is how generate batches; useful tokens only. `comparison`: engine / HF
  tokens/s per level and load.
- `train`: `--train-preset` (medium) SFT steps (`training.sft.train_sft`) and PPO updates (`teachers.ppo_step.
  ppo_update`, policy + critic, one epoch) on DeepSpeedBackend (bf16 on CUDA) at `--train-rows` × `--train-seq`
  tokens a step (64 × 512 = 32k), one warm-up step, then the median step time; MFU = FLOPs per token (6N + 12 ·
  layers · hidden · seq, `training.mfu.flops_per_token`, the trainers' own count) × tokens/s / the card's dense
  bf16 peak (`training.mfu.PEAK_TFLOPS`); PPO counts policy and critic (2 models).
- `trl`: Alloy's OPD student (`student.distill_main.run_distillation`, teacher servers, at max_staleness 1 and 0)
  against TRL's `GKDTrainer` (KV cache on) on the same card, as bench/trl_compare.py runs them (one subprocess per
  system, its `--worker`), at `--trl-preset` (medium), 3 domains, `--trl-batch` prompts × exactly
  `--trl-new-tokens` tokens (forced lengths: equal work on both sides), `--trl-steps` steps, fresh models (speed
  only: no evaluation). Completion tokens/s; skipped when `trl` or `datasets` cannot be imported.
- `pipeline`: `bench/gpu_pipeline.py --quick` in a subprocess given the time left: its per-stage wall, and on CUDA the
  share of each stage's window the GPU was busy (`nvidia-smi --query-gpu=utilization.gpu` sampled every 0.5 s:
  the percent of time a kernel ran; the stage windows from gpu_pipeline's `stage_windows`), the MFU it reports.

Targets (issue 51, judged on cuda; on the CPU every goal is multiplied by `--target-scale`, default 0 there, so
`--check` only checks that each measured part produced its figure): engine `medium` single stream ≥ 1,000 tok/s and
256 concurrent ≥ 50,000; engine / HF fast generate at 64 concurrent ≥ 1.5 on the mix and ≥ 1.0 on equal lengths;
SFT on `medium` ≥ 25 % MFU; Alloy / GKD ≥ 1.5 at max_staleness 1 and ≥ 1.0 at 0 (where TRL ran). `--target
NAME=VALUE` sets a goal; `--plant-miss` sets an impossible one (CI's test of `--check`). A target whose part was
skipped is `met: null` and not judged; one whose part failed is missed. `--check`: exit 1 when any judged target is
missed (the JSON keeps every value and goal), 2 when none could be judged.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, start_meta, verdict, write_json  # noqa: E402  (puts the repository on sys.path)

import gpu_parts as gp  # noqa: E402

# name: (goal on cuda, what); the value is read from the parts by `target_values`
TARGETS = {
    "engine_single_stream_tok_s": (1000.0, "engine, train preset (medium), 1 concurrent, equal lengths, tokens/s"),
    "engine_256_tok_s": (50000.0, "engine, medium, 256 concurrent, equal lengths, tokens/s"),
    "engine_vs_hf_64_mix": (1.5, "engine / HF fast generate tokens/s at 64 concurrent, rollout-like mix"),
    "engine_vs_hf_64_equal": (1.0, "engine / HF fast generate tokens/s at 64 concurrent, equal lengths"),
    "sft_mfu": (0.25, "SFT MFU on medium at ~32k tokens a step (6N + attention FLOPs / dense bf16 peak)"),
    "alloy_vs_gkd_staleness1": (1.5, "Alloy OPD / TRL GKDTrainer completion tokens/s, max_staleness 1"),
    "alloy_vs_gkd_staleness0": (1.0, "Alloy OPD / TRL GKDTrainer completion tokens/s, max_staleness 0"),
}
PARTS = ("engine", "hf", "train", "trl", "pipeline")
# the least time (s) a part needs to be started on cuda / on the cpu
MIN_S = {"engine": (60, 5), "hf": (45, 5), "train": (30, 5), "trl": (90, 10), "pipeline": (120, 20)}


def lst(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


# -- parts -----------------------------------------------------------------------------------------------------------
def part_engine(args, device, root: Path) -> dict:
    out: dict = {"loads": {"equal": f"C requests x exactly {args.new_tokens} tokens (ignore_eos)",
                           "mix": f"{args.mix_rounds} x C requests, EOS honoured, rollout-like length caps "
                                  f"(gpu_parts.mix_lengths, cap {args.new_tokens})"}, "presets": {}}
    for preset in args.presets.split(","):
        model_dir = gp.make_model(preset, root)
        eng = gp.start_engine(model_dir, device, max(lst(args.levels)))
        res: dict = {"model": gp.model_shape(model_dir), "engine_options": gp.engine_options(eng), "levels": {}}
        try:
            gp.run_engine(eng, gp.prompts(4, args.prompt_len, 999), [8] * 4, 4, ignore_eos=True, tag="warm")
            for c in lst(args.levels):
                prs_eq, prs_mix = workload(args, c)
                # warm-up: both loads once, untimed (the static path captures a CUDA graph per (rows, columns)
                # bucket the first time it runs: capture is not decode time; it is reported, per level)
                gp.run_engine(eng, prs_eq, [args.new_tokens] * c, c, ignore_eos=True, tag=f"warm-eq{c}")
                gp.run_engine(eng, prs_mix, mixl(args, c), c, ignore_eos=False, tag=f"warm-mix{c}")
                graphs_before = gp.graph_info(eng)
                res["levels"][str(c)] = {
                    "equal": gp.run_engine(eng, prs_eq, [args.new_tokens] * c, c, ignore_eos=True, tag=f"eq{c}"),
                    "mix": gp.run_engine(eng, prs_mix, mixl(args, c), c, ignore_eos=False, tag=f"mix{c}"),
                    "graphs_after_warmup": graphs_before, "graphs_after": gp.graph_info(eng)}
                print(f"engine {preset} c={c}: equal {res['levels'][str(c)]['equal']['tokens_per_s']} tok/s, "
                      f"mix {res['levels'][str(c)]['mix']['tokens_per_s']} tok/s", flush=True)
        finally:
            eng.stop()
            gp.close()
        out["presets"][preset] = res
    return out


def workload(args, c: int) -> tuple[list, list]:
    """The prompts of level c: equal (c) and mix (mix_rounds × c), the same for the engine and HF."""
    return (gp.prompts(c, args.prompt_len, seed=10_000 + c),
            gp.prompts(c * args.mix_rounds, args.prompt_len, seed=20_000 + c))


def mixl(args, c: int) -> list[int]:
    return gp.mix_lengths(c * args.mix_rounds, args.new_tokens, seed=c, batch=c)


def part_hf(args, device, dtype, root: Path) -> dict:
    model_dir = gp.make_model(args.hf_preset, root)
    compile_forward = args.hf_compile if args.hf_compile is not None else device.type == "cuda"
    out: dict = {"preset": args.hf_preset, "cache_implementation": "static", "levels": {}, "compile_errors": []}
    model = gp.hf_fast_model(model_dir, device, dtype, compile_forward)
    out["compiled"] = compile_forward
    for c in lst(args.hf_levels):
        prs_eq, prs_mix = workload(args, c)
        res: dict = {}
        try:
            t0 = time.perf_counter()
            for _ in range(2):  # compile, then the CUDA-graph recording (reduce-overhead); shapes as timed below
                gp.hf_generate(model, prs_eq[:c], [args.new_tokens] * c, c, honour_eos=False)
            res["compile_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - the compiled forward failed: recorded, then the plain static cache
            out["compile_errors"].append(f"c={c}: {type(e).__name__}: {str(e)[:500]}")
            model = gp.hf_fast_model(model_dir, device, dtype, False)
            out["compiled"] = False
        res["equal"] = gp.hf_generate(model, prs_eq, [args.new_tokens] * c, c, honour_eos=False)
        res["mix"] = gp.hf_generate(model, prs_mix, mixl(args, c), c, honour_eos=True)
        out["levels"][str(c)] = res
        print(f"hf {args.hf_preset} b={c}: equal {res['equal']['tokens_per_s']} tok/s, mix {res['mix']['tokens_per_s']}"
              f" tok/s (compile {res.get('compile_s')} s)", flush=True)
    del model
    gp.close()
    return out


def part_train(args, device, card) -> dict:
    import tempfile as tf

    out: dict = {"preset": args.train_preset, "rows": args.train_rows, "seq_len": args.train_seq,
                 "tokens_per_step": args.train_rows * args.train_seq, "peak_tflops": gp.peak_tflops(card)}
    with tf.TemporaryDirectory(prefix="gpu-perf-train-") as tmp:
        model_dir = gp.make_model(args.train_preset, Path(tmp))
        shape = gp.model_shape(model_dir)
        out["model"] = shape
        fpt = gp.flops_per_token(shape["params"], shape["layers"], shape["hidden"], args.train_seq)
        out["flops_per_token"] = fpt

        def summary(marks: list[dict], models: int) -> dict:
            timed = marks[1:] or marks
            step = statistics.median(m["wall_s"] for m in timed)
            tps = timed[0]["tokens"] / step
            peak = out["peak_tflops"]
            return {"step_s": round(step, 4), "steps_timed": len(timed), "warmup_step_s": round(marks[0]["wall_s"], 4),
                    "tokens_per_s": round(tps, 1), "models_trained": models,
                    "mfu": round(models * fpt * tps / (peak * 1e12), 5) if peak else None}

        backend, tok, pairs = gp.sft_setup(model_dir, device, args.train_rows, args.train_seq)
        try:
            out["sft"] = summary(gp.sft_steps(backend, tok, pairs, 1 + args.train_steps), 1)
        finally:
            gp.close(backend)
        print(f"train sft: {out['sft']}", flush=True)
        policy, critic, batch = gp.ppo_setup(model_dir, device, args.train_rows, args.train_seq)
        try:
            out["ppo"] = summary(gp.ppo_steps(policy, critic, batch, 1 + args.train_steps), 2)
        finally:
            gp.close(policy, critic)
        print(f"train ppo: {out['ppo']}", flush=True)
    return out


def part_trl(args, device, root: Path, deadline: float) -> dict:
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"{', '.join(missing)} not importable here: carry the TRL wheels (bench/README.md, "
                           f"gpu_perf.py: TRL trl + datasets + dill + multiprocess = 1.8 MB of cp312 wheels)"}
    import trl_compare as tc

    from infra.models import init_model_dir

    names = args.trl_domains.split(",")
    mdir = root / "trl-models"
    base = init_model_dir(args.trl_preset, mdir / "base", seed=0)
    teachers = {d: str(init_model_dir(args.trl_preset, mdir / f"teacher-{d}", seed=1 + i)) for i, d in enumerate(names)}
    spec = {"domains": names, "batch": args.trl_batch, "lr": 1e-5, "n_prompts_per_domain": 200, "force": True,
            "top_k": "vocab", "max_staleness": 1, "eval_n": 0, "kl_n": 0, "mem_poll_s": 1.0, "skip_eval": True,
            "base": str(base), "teachers": teachers, "steps": args.trl_steps, "max_new_tokens": args.trl_new_tokens,
            "cuda": device.type == "cuda"}
    spec_path = root / "trl-spec.json"
    spec_path.write_text(json.dumps(spec))
    runs, out = {}, {"point": {k: spec[k] for k in ("domains", "batch", "steps", "max_new_tokens", "force")},
                     "preset": args.trl_preset, "models": "fresh (speed only: forced lengths, no evaluation)"}
    for system in args.trl_systems.split(","):
        if time.monotonic() > deadline:
            runs[system] = {"skipped": "time budget"}
            continue
        try:
            r = tc.run_worker(system, 0, args.trl_threads, spec_path, root, 1.0)
            runs[system] = {k: r.get(k) for k in ("completion_tokens_per_s", "s_per_step", "train_wall_s",
                                                  "completion_tokens", "steps", "timing_s", "max_staleness",
                                                  "peak_rss_mb", "worker_train_wall_s")}
        except Exception as e:  # noqa: BLE001 - one system failed: recorded, the others run
            runs[system] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        print(f"trl {system}: {runs[system]}", flush=True)
    out["runs"] = runs

    def ratio(a: str, b: str):
        x, y = (runs.get(a) or {}).get("completion_tokens_per_s"), (runs.get(b) or {}).get("completion_tokens_per_s")
        return round(x / y, 3) if x and y else None

    out["alloy_vs_gkd_staleness1"], out["alloy_vs_gkd_staleness0"] = ratio("alloy", "gkd"), ratio("alloy_s0", "gkd")
    return out


class UtilSampler:
    """`nvidia-smi --query-gpu=utilization.gpu` every `period` s, stamped with epoch seconds (None without it)."""

    def __init__(self, period: float = 0.5):
        self.samples: list[tuple[float, float]] = []
        self.available = shutil.which("nvidia-smi") is not None
        self.period, self._stop = period, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self.available:
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._t.is_alive():
            self._t.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                r = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5)
                vals = [float(x) for x in r.stdout.split() if x.replace(".", "").isdigit()]
                if vals:
                    self.samples.append((time.time(), statistics.fmean(vals)))
            except Exception:  # noqa: BLE001 - sampling is best effort
                pass


def busy_by_stage(windows: list[dict], samples: list[tuple[float, float]]) -> dict:
    """{stage: mean GPU utilization (0..1) over the samples inside its window, or None without samples}."""
    out = {}
    for w in windows:
        if w.get("end") is None:
            continue
        xs = [u for t, u in samples if w["start"] <= t <= w["end"]]
        key = w["stage"] if w["stage"] not in out else f"{w['stage']}#{len(out)}"
        out[key] = round(statistics.fmean(xs) / 100, 4) if xs else None
    return out


def part_pipeline(args, device, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-perf-pipeline-") as tmp:
        js = Path(tmp) / "gpu_pipeline.json"
        cmd = [sys.executable, str(REPO / "bench" / "gpu_pipeline.py"), "--out", str(js), "--root", str(Path(tmp) / "run")]
        cmd += ["--quick"] if device.type == "cuda" else ["--config", "configs/smoke.yaml"]
        cmd += sum((["--set", s] for s in args.pipeline_set), [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        with UtilSampler() as sampler, open(Path(tmp) / "log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                rc, timed_out = proc.wait(timeout=max(1.0, timeout_s)), False
            except subprocess.TimeoutExpired:  # SIGTERM: gpu_pipeline stops the flow and still writes its JSON
                proc.terminate()
                try:
                    rc = proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                timed_out = True
        wall = time.perf_counter() - t0
        out = {"command": " ".join(cmd[1:]), "rc": rc, "timed_out": timed_out, "timeout_s": round(timeout_s, 1),
               "wall_s": round(wall, 1), "log_tail": (Path(tmp) / "log").read_text(errors="replace")[-2000:]}
        if not js.is_file():
            out["error"] = "gpu_pipeline.py wrote no JSON"
            return out
        r = json.loads(js.read_text())
        windows = r.get("stage_windows") or []
        stage_wall: dict[str, float] = {}
        for w in windows:  # a stage timed twice (eval of the base, then of the student) adds up, as timings_s does
            if w.get("end"):
                stage_wall[w["stage"]] = round(stage_wall.get(w["stage"], 0.0) + w["end"] - w["start"], 2)
        out.update(ok=r.get("ok"), flow_wall_s=r.get("wall_s"), stage_wall_s=stage_wall,
                   stages_ok={k: v.get("ok") for k, v in (r.get("stages") or {}).items()}, mfu=r.get("mfu"),
                   throughput=r.get("throughput"), error_tail=(r.get("error") or "")[-1500:] or None,
                   gpu_busy_fraction=busy_by_stage(windows, sampler.samples) if sampler.available else None,
                   gpu_busy_what="mean nvidia-smi utilization.gpu over each stage's window (null without nvidia-smi)",
                   gpu_util_samples=len(sampler.samples))
        if timed_out:
            out["note"] = "stopped at the time budget: the stages it reached are reported"
        return out


# -- targets -----------------------------------------------------------------------------------------------------------
def target_values(parts: dict, args) -> dict:
    """{target: (value or None, skipped?)}: skipped when the part it reads was skipped (not judged)."""
    def get(part: str, *path):
        p = parts.get(part) or {}
        if "skipped" in p:
            return None, True
        for k in path:
            p = (p or {}).get(k) if isinstance(p, dict) else None
        return p, False

    train_preset = args.train_preset
    comp = parts.get("comparison") or {}
    top_hf = str(max(lst(args.hf_levels)))
    vals = {
        "engine_single_stream_tok_s": get("engine", "presets", train_preset, "levels", "1", "equal", "tokens_per_s"),
        "engine_256_tok_s": get("engine", "presets", train_preset, "levels", str(max(lst(args.levels))), "equal",
                                "tokens_per_s"),
        "engine_vs_hf_64_mix": (comp.get(top_hf, {}).get("mix"), "skipped" in (parts.get("hf") or {})),
        "engine_vs_hf_64_equal": (comp.get(top_hf, {}).get("equal"), "skipped" in (parts.get("hf") or {})),
        "sft_mfu": get("train", "sft", "mfu"),
        "alloy_vs_gkd_staleness1": get("trl", "alloy_vs_gkd_staleness1"),
        "alloy_vs_gkd_staleness0": get("trl", "alloy_vs_gkd_staleness0"),
    }
    return vals


def judge(parts: dict, args, cuda: bool) -> dict:
    scale = args.target_scale if args.target_scale is not None else (1.0 if cuda else 0.0)
    goals = {k: g * scale for k, (g, _) in TARGETS.items()}
    for kv in args.target:
        k, _, v = kv.partition("=")
        if k not in TARGETS:
            raise SystemExit(f"--target {kv}: unknown target; one of {sorted(TARGETS)}")
        goals[k] = float(v)
    if args.plant_miss:
        goals["engine_single_stream_tok_s"] = 1e12
    out = {}
    for k, (value, skipped) in target_values(parts, args).items():
        if skipped:
            met = None
        elif k == "sft_mfu" and not cuda and value is None:
            # no peak to divide by on the CPU: a goal of 0 holds once the SFT steps ran, any other cannot be judged
            ran = ((parts.get("train") or {}).get("sft") or {}).get("tokens_per_s")
            met = (bool(ran) if goals[k] <= 0 else None)
        else:
            met = value is not None and value >= goals[k]
        out[k] = {"value": value, "goal": goals[k], "met": met, "what": TARGETS[k][1]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="default bench/results/gpu_perf_<card>.json")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when torch sees a GPU")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--budget-s", type=float, default=None, help="wall budget of the whole run (cuda 420 s, cpu 300 s)")
    p.add_argument("--presets", default=None, help="engine presets (cuda: small,medium; cpu: tiny)")
    p.add_argument("--levels", default=None, help="concurrency levels (cuda: 1,16,64,256; cpu: 1,4,16)")
    p.add_argument("--new-tokens", type=int, default=None, help="equal-length tokens and the mix's cap (cuda 128, cpu 16)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--mix-rounds", type=int, default=None, help="mix requests per slot (cuda 4, cpu 2)")
    p.add_argument("--hf-preset", default=None, help="HF peer preset (cuda medium, cpu tiny)")
    p.add_argument("--hf-levels", default=None, help="HF batch sizes (cuda 1,64; cpu 1,16); the last one is judged")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the HF forward (default: on cuda only)")
    p.add_argument("--train-preset", default=None, help="cuda medium, cpu tiny")
    p.add_argument("--train-rows", type=int, default=None, help="cuda 64, cpu 4")
    p.add_argument("--train-seq", type=int, default=None, help="cuda 512, cpu 64")
    p.add_argument("--train-steps", type=int, default=None, help="timed steps after one warm-up (cuda 3, cpu 1)")
    p.add_argument("--trl-preset", default=None, help="cuda medium, cpu nano")
    p.add_argument("--trl-domains", default=None, help="cuda reverse,sort_digits,max_list; cpu reverse")
    p.add_argument("--trl-systems", default="alloy,alloy_s0,gkd")
    p.add_argument("--trl-batch", type=int, default=None, help="cuda 64, cpu 4")
    p.add_argument("--trl-new-tokens", type=int, default=None, help="cuda 64, cpu 4")
    p.add_argument("--trl-steps", type=int, default=None, help="cuda 4, cpu 2")
    p.add_argument("--trl-threads", type=int, default=None, help="torch threads of each TRL/Alloy worker (cuda 4, cpu 1)")
    p.add_argument("--pipeline-set", action="append", default=[], metavar="KEY=VALUE",
                   help="overrides passed to gpu_pipeline.py (cpu: a 1-domain smoke run is the default)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=VALUE", help=f"goals: {', '.join(TARGETS)}")
    p.add_argument("--target-scale", type=float, default=None, help="every default goal × this (cuda 1, cpu 0)")
    p.add_argument("--plant-miss", action="store_true", help="an impossible single-stream goal (tests --check)")
    add_check(p, "any judged target of TARGETS (issue 51)")
    args = p.parse_args(argv)
    meta = start_meta()

    import torch

    import training  # noqa: F401  (DeepSpeed's accelerator: cuda when torch sees a GPU)

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = dev_name == "cpu"

    def dflt(name: str, on_cuda, on_cpu):
        if getattr(args, name) is None:
            setattr(args, name, on_cpu if cpu else on_cuda)

    for name, a, b in [("budget_s", 420.0, 300.0), ("presets", "small,medium", "tiny"), ("levels", "1,16,64,256", "1,4,16"),
                       ("new_tokens", 128, 16), ("mix_rounds", 4, 2), ("hf_preset", "medium", "tiny"),
                       ("hf_levels", "1,64", "1,16"), ("train_preset", "medium", "tiny"), ("train_rows", 64, 4),
                       ("train_seq", 512, 64), ("train_steps", 3, 1), ("trl_preset", "medium", "nano"),
                       ("trl_domains", "reverse,sort_digits,max_list", "reverse"), ("trl_batch", 64, 4),
                       ("trl_new_tokens", 64, 4), ("trl_steps", 4, 2), ("trl_threads", 4, 1)]:
        dflt(name, a, b)
    if cpu and not args.pipeline_set:
        args.pipeline_set = ["domains=[{name: reverse}]", "base.steps=2", "base.n_train_per_domain=50",
                             "eval.n_eval=4", "specialists.steps=1", "specialists.batch_size=4",
                             "specialists.critic_warmup_steps=0", "specialists.eval_n=4", "specialists.val_every=0",
                             "distill.steps=1", "distill.batch_size=4", "distill.eval_every=0"]
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out: dict = {"bench": "gpu_perf", "meta": meta, "config": vars(args), "parts": {}}
    try:
        device, dtype, card = gp.resolve(dev_name)
    except Exception as e:  # noqa: BLE001 - nothing can run: the JSON says why
        device, dtype, card = None, None, None
        out["error"] = f"{type(e).__name__}: {e}"
    out.update(device=str(device), dtype=str(dtype).replace("torch.", ""), card=card,
               gpu_memory_gb=round(torch.cuda.get_device_properties(device).total_memory / 1e9, 1)
               if device is not None and device.type == "cuda" else None)
    meta["engine_kwargs"] = sorted(gp.engine_kwargs_supported() - {"self"})
    parts = args.parts.split(",")
    root = Path(tempfile.mkdtemp(prefix="gpu-perf-"))

    def run(name: str, fn) -> None:
        left = deadline - time.monotonic()
        need = MIN_S[name][1 if cpu else 0]
        if name not in parts:
            out["parts"][name] = {"skipped": "not in --parts"}
            return
        if device is None:
            out["parts"][name] = {"error": out["error"]}
            return
        if left < need:
            out["parts"][name] = {"skipped": f"time budget: {left:.0f} s left < {need} s this part needs"}
            return
        gp.run_part("gpu_perf", name, fn, out["parts"])

    try:
        run("engine", lambda: part_engine(args, device, root))
        run("hf", lambda: part_hf(args, device, dtype, root))
        run("train", lambda: part_train(args, device, card))
        run("trl", lambda: part_trl(args, device, root, deadline - MIN_S["pipeline"][1 if cpu else 0]))
        run("pipeline", lambda: part_pipeline(args, device, deadline - time.monotonic()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    eng = out["parts"].get("engine", {}).get("presets", {}).get(args.hf_preset, {}).get("levels", {})
    hf = out["parts"].get("hf", {}).get("levels", {})
    out["parts"]["comparison"] = {c: {load: round(eng[c][load]["tokens_per_s"] / hf[c][load]["tokens_per_s"], 3)
                                      for load in ("equal", "mix")} for c in hf if c in eng}
    out["targets"] = judge(out["parts"], args, not cpu)
    judged = [t["met"] for t in out["targets"].values() if t["met"] is not None]
    out["met"] = all(judged) if judged else None
    out["total_s"] = round(time.monotonic() - t_start, 1)
    path = Path(args.out or REPO / "bench" / "results" / f"gpu_perf_{gp.card_tag(card)}.json")
    write_json(path, out)
    print(json.dumps({k: (v["value"], v["goal"], v["met"]) for k, v in out["targets"].items()}, default=str), flush=True)
    print(f"gpu_perf: met={out['met']} ({out['total_s']} s) → {path}", flush=True)
    return verdict("gpu_perf", out["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
