"""Benchmark: the specialists stage synchronous vs asynchronous (`specialists.async_rollouts`), on the demo's domains.

    python bench/async_specialists.py --out bench/results/async_specialists.json [--config configs/demo.yaml]
        [--domains a,b,...] [--base DIR] [--set KEY=VALUE ...] [--repeats 1] [--quick] [--check]

What runs. The stage as `alloy run` runs it, without Prefect: one base checkpoint (`--base`, or the config's base SFT
run here once: `python -m tasks.base_worker`), then for each mode every domain's specialist as its own trainer
process (`python -m teachers.specialist_main`, the pipeline's worker, which starts its own rollout server),
`specialists.max_parallel` at once, the longest (most steps) first, as the pipeline orders them. Both modes train
the same domains from the same base with the same config; the only difference is `specialists.async_rollouts`
(false / true). Modes alternate per repeat (sync first in the first repeat).

Measures, per mode: the stage's wall time (first start to last exit), each specialist's eval score (its own
held-out eval split, as the pipeline reports it), how many reach base + 0.15, the per-step `step_s` against
`rollout_s + train_s + push_s` (the overlap), and the CPU seconds of the trainer processes and their servers
(`RUSAGE_CHILDREN`: the trainers are waited for, and each waits for its server).

Target (issue 35): the async stage ≥ 1.4× faster than the synchronous one at equal quality: mean specialist
score ≥ sync's − 0.02 and at least as many specialists at base + 0.15. `--check` exits 1 when missed.
`--quick` (tests): two domains, 8 steps, a 40-step base; it measures nothing worth reporting.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repository on sys.path, quiet env defaults)
from harness import REPO, add_check, own_cpu_s, start_meta, verdict, write_outputs

TARGET_SPEEDUP, QUALITY_SLACK, LIFT = 1.4, 0.02, 0.15
QUICK = ["base.steps=40", "specialists.steps=8", "specialists.batch_size=16", "specialists.val_every=4",
         "specialists.checkpoint_every=4", "specialists.per_domain={}", "eval.n_eval=20"]


def _run(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def build_base(config: str, sets: list[str], root: Path, seed: int, preset: str) -> Path:
    from infra.models import init_model_dir

    init = init_model_dir(preset, root / "base-init", seed=seed)
    out = root / "base"
    cmd = [sys.executable, "-m", "tasks.base_worker", "--config", config, "--init", str(init), "--out", str(out),
           "--result", str(root / "base-result.json"), *[x for s in sets for x in ("--set", s)]]
    if _run(cmd, root / "base.log").wait() != 0:
        raise SystemExit(f"base SFT failed: see {root / 'base.log'}")
    return Path(json.loads((root / "base-result.json").read_text())["checkpoint"])  # the committed `final/`


def run_stage(config: str, sets: list[str], base: Path, domains: list[tuple[str, int]], parallel: int,
              root: Path) -> dict:
    """Every domain's specialist, `parallel` at once, longest first; returns wall, per-domain summaries, CPU."""
    root.mkdir(parents=True, exist_ok=True)
    queue = sorted(domains, key=lambda d: -d[1])
    running: list[tuple[subprocess.Popen, str]] = []
    cpu0, t0, results = own_cpu_s(), time.perf_counter(), {}
    while queue or running:
        while queue and len(running) < parallel:
            name, _ = queue.pop(0)
            cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", config, "--domain", name,
                   "--init", str(base), "--out", f"file://{root}/ckpt/{name}", "--work-dir", str(root / name),
                   "--result", str(root / f"{name}.json"), *[x for s in sets for x in ("--set", s)]]
            running.append((_run(cmd, root / f"{name}.log"), name))
        time.sleep(0.2)
        for proc, name in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, name))
            if proc.returncode != 0:
                for p, _ in running:
                    p.kill()
                raise SystemExit(f"specialist {name} failed ({proc.returncode}): see {root / f'{name}.log'}")
            results[name] = json.loads((root / f"{name}.json").read_text())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": own_cpu_s() - cpu0, "specialists": results}


def summarize(stage: dict, base_scores: dict[str, float]) -> dict:
    specs = stage["specialists"]
    scores = {d: s["score"] for d, s in specs.items()}
    steps = [h for s in specs.values() for h in s["history"]]
    parts = sum(h.get("rollout_s", 0) + h.get("train_s", 0) + h.get("push_s", 0) for h in steps)
    return {"wall_s": round(stage["wall_s"], 2), "cpu_s": round(stage["cpu_s"], 1),
            "mean_score": sum(scores.values()) / len(scores), "scores": scores,
            "lifted": sum(scores[d] >= base_scores[d] + LIFT for d in scores),
            "steps": len(steps), "sum_step_s": round(sum(h.get("step_s", 0) for h in steps), 2),
            "sum_parts_s": round(parts, 2),
            "lag_mean": sum(h.get("lag_mean", 0) for h in steps) / max(1, len(steps))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--domains", default=None, help="comma-separated (default: every configured domain)")
    p.add_argument("--base", default=None, help="a base checkpoint (HF dir) to start from (default: train one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides, both modes")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", default=None, help="work dir (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="2 domains, 8 steps, 40 base steps: a smoke run")
    add_check(p, f"async wall ≥ {TARGET_SPEEDUP}× faster at mean score ≥ sync − {QUALITY_SLACK} and as many "
                 f"specialists at base + {LIFT}")
    args = p.parse_args(argv)
    meta = start_meta()

    from domains.evaluate import evaluate
    from domains.registry import load_domains
    from infra.config import load_config

    sets = (QUICK if args.quick else []) + args.set
    cfg = load_config(args.config, sets)
    names = args.domains.split(",") if args.domains else cfg.domain_names()[:2] if args.quick else cfg.domain_names()
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-async-spec-"))
    base = Path(args.base) if args.base else build_base(args.config, sets, root, cfg.run.seed, cfg.model.preset)
    doms = load_domains(cfg)
    df = evaluate(str(base), {d: doms[d] for d in names}, cfg.eval.n_eval, cfg.run.seed, "base",
                  max_new_tokens=cfg.eval.max_new_tokens)
    base_scores = dict(zip(df.domain, df.score))
    domains = [(d, cfg.specialists.for_domain(d).steps) for d in names]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for r in range(args.repeats):
        for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            flag = [f"specialists.async_rollouts={'true' if mode == 'async' else 'false'}"]
            stage = run_stage(args.config, sets + flag, base, domains, cfg.specialists.max_parallel,
                              root / f"r{r}-{mode}")
            runs[mode].append(summarize(stage, base_scores))
            print(f"repeat {r} {mode}: wall {runs[mode][-1]['wall_s']:.1f}s mean score "
                  f"{runs[mode][-1]['mean_score']:.3f}", flush=True)
    s, a = ({k: sum(x[k] for x in runs[m]) / len(runs[m]) for k in ("wall_s", "mean_score", "lifted")}
            for m in ("sync", "async"))
    speedup = s["wall_s"] / a["wall_s"]
    met = speedup >= TARGET_SPEEDUP and a["mean_score"] >= s["mean_score"] - QUALITY_SLACK \
        and a["lifted"] >= s["lifted"]
    result = {"meta": meta, "config": args.config, "sets": sets, "domains": names, "base": str(base),
              "base_scores": base_scores, "runs": runs, "speedup": speedup, "quality_delta":
              a["mean_score"] - s["mean_score"], "target": {"speedup": TARGET_SPEEDUP, "quality_slack": QUALITY_SLACK},
              "met": met if not args.quick else None}
    table = ("| mode | stage wall (s) | mean score | specialists ≥ base + 0.15 |\n|---|---|---|---|\n"
             + "\n".join(f"| {m} | {v['wall_s']:.1f} | {v['mean_score']:.3f} | {v['lifted']:.1f} of {len(names)} |"
                         for m, v in (("sync", s), ("async", a)))
             + f"\n\nasync / sync speed-up {speedup:.2f}× (target ≥ {TARGET_SPEEDUP}×), quality Δ "
               f"{a['mean_score'] - s['mean_score']:+.3f}")
    write_outputs(Path(args.out), result, table)
    return verdict("async_specialists", result["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
