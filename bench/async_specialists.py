"""Benchmark: the specialists stage on the demo's domains, synchronous vs asynchronous, and against a reference tree.

    python bench/async_specialists.py --out bench/results/async_specialists.json [--config configs/demo.yaml]
        [--reference-tree DIR] [--domains a,b,...] [--base DIR] [--set KEY=VALUE ...] [--repeats 1] [--quick]
        [--target 1.4] [--check]

What runs. The stage as `alloy run` runs it, without Prefect: one base checkpoint (`--base`, or the config's base SFT
run here once: `python -m training.base_main`), then for each mode every domain's specialist as its own trainer
process (`python -m teachers.specialist_main`, the pipeline's worker, which starts its own rollout server),
`specialists.max_parallel` at once, the longest (most steps) first, as the pipeline orders them, started as the
pipeline starts them (`infra.zygote.start`: forked from a process zygote on a CPU host; one zygote per mode, stopped
and reaped at the mode's end so its CPU counts). Every mode trains the same domains from the same base.

Modes: `sync` and `async` are this tree with `specialists.async_rollouts` false / true (nothing else differs).
`reference` (with `--reference-tree`) is another checkout, e.g. `git worktree add /tmp/ref 234cfcc`, the tree at
the filing of issue 35, whose stage was then synchronous: its own `specialist_main` and its own copy of `--config`
(the same path inside that tree), started fresh (`python -m`, its tree first on `PYTHONPATH`), with the `--set`s
minus the async flag. Modes alternate per repeat (reference, sync, async; then reversed).

Measures, per mode: the stage's wall time (first start to last exit), each specialist's score on its domain's eval
split (`domains.evaluate`, this tree's code, on every mode's `final/`, so trees are scored alike), how many reach base
+ 0.15, the per-step `step_s` against `rollout_s + train_s + push_s` (the overlap), and the CPU seconds of the
trainers and their servers (`RUSAGE_CHILDREN`: every trainer is waited for, the zygote reaped).

Target (issue 35): this tree's stage, in the config's own mode (`specialists.async_rollouts` of `--config`), at
least `--target` (1.4)× faster than the reference's at equal quality: mean specialist score ≥ the reference's − 0.02
and at least as many specialists at base + 0.15. `async_vs_sync` is reported beside it (not a target: on a machine
whose cores the lanes already fill, the overlap has nothing to gain; docs/tuning.md). Without `--reference-tree`
the target is not judged (`--check` exits 2). `--quick` (tests): two domains, 8 steps, a 40-step base; its numbers
mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repository on sys.path, quiet env defaults)
from harness import REPO, add_check, own_cpu_s, start_meta, verdict, write_outputs
from infra.procs import pythonpath_first

TARGET_SPEEDUP, QUALITY_SLACK, LIFT = 1.4, 0.02, 0.15
QUICK = ["base.steps=40", "specialists.steps=8", "specialists.batch_size=16", "specialists.val_every=4",
         "specialists.checkpoint_every=4", "specialists.per_domain={}", "eval.n_eval=20"]
ASYNC_KEY = "specialists.async_rollouts"


def _run(cmd: list[str], log: Path, tree: Path | None = None):
    """`cmd` as the pipeline starts a trainer (`infra.zygote.start`), or, for a reference `tree`, fresh from it."""
    from infra import zygote

    with open(log, "wb") as fh:  # the child keeps its own descriptor
        if tree is None:
            return zygote.start(cmd, env=dict(os.environ), stdout=fh, cwd=str(REPO))
        env = dict(os.environ, PYTHONPATH=pythonpath_first(tree), ALLOY_ZYGOTE="0")
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tree, env=env, start_new_session=True)


def build_base(config: str, sets: list[str], root: Path, seed: int, preset: str) -> Path:
    from infra.models import init_model_dir

    init = init_model_dir(preset, root / "base-init", seed=seed)
    out = root / "base"
    cmd = [sys.executable, "-m", "training.base_main", "--config", config, "--init", str(init), "--out", str(out),
           "--result", str(root / "base-result.json"), *[x for s in sets for x in ("--set", s)]]
    if _run(cmd, root / "base.log").wait() != 0:
        raise SystemExit(f"base SFT failed: see {root / 'base.log'}")
    return Path(json.loads((root / "base-result.json").read_text())["checkpoint"])  # the committed `final/`


def run_stage(config: str, sets: list[str], base: Path, domains: list[tuple[str, int]], parallel: int,
              root: Path, tree: Path | None = None) -> dict:
    """Every domain's specialist, `parallel` at once, longest first; returns wall, per-domain summaries, CPU.
    `tree`: run another checkout's specialists (fresh processes from it) instead of this one's."""
    from infra import zygote

    root.mkdir(parents=True, exist_ok=True)
    queue = sorted(domains, key=lambda d: -d[1])
    running: list[tuple[object, str]] = []
    cpu0, t0, results = own_cpu_s(), time.perf_counter(), {}
    try:
        while queue or running:
            while queue and len(running) < parallel:
                name, _ = queue.pop(0)
                cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", config, "--domain", name,
                       "--init", str(base), "--out", f"file://{root}/ckpt/{name}", "--work-dir", str(root / name),
                       "--result", str(root / f"{name}.json"), *[x for s in sets for x in ("--set", s)]]
                running.append((_run(cmd, root / f"{name}.log", tree), name))
            time.sleep(0.2)
            for proc, name in [r for r in running if r[0].poll() is not None]:
                running.remove((proc, name))
                if proc.returncode != 0:
                    raise SystemExit(f"specialist {name} failed ({proc.returncode}): see {root / f'{name}.log'}")
                results[name] = json.loads((root / f"{name}.json").read_text())
                results[name]["final_dir"] = str(root / "ckpt" / name / "final")
    finally:
        for proc, _ in running:
            proc.kill()
            proc.wait()
        wall = time.perf_counter() - t0
        zygote.stop()  # reaped: its CPU and its children's count in ours from here
    return {"wall_s": wall, "cpu_s": own_cpu_s() - cpu0, "specialists": results}


def score_finals(stage: dict, doms: dict, n_eval: int, seed: int, max_new_tokens: int) -> dict[str, float]:
    """Each specialist's `final/` on its domain's eval split, by this tree's evaluation (every mode scored alike)."""
    from domains.evaluate import evaluate

    return {d: float(evaluate(s["final_dir"], {d: doms[d]}, n_eval, seed, "specialist",
                              max_new_tokens=max_new_tokens).score.iloc[0]) for d, s in stage["specialists"].items()}


def summarize(stage: dict, scores: dict[str, float], base_scores: dict[str, float]) -> dict:
    steps = [h for s in stage["specialists"].values() for h in s["history"]]
    parts = sum(h.get("rollout_s", 0) + h.get("train_s", 0) + h.get("push_s", 0) for h in steps)
    return {"wall_s": round(stage["wall_s"], 2), "cpu_s": round(stage["cpu_s"], 1),
            "mean_score": sum(scores.values()) / len(scores), "scores": scores,
            "own_scores": {d: s.get("score") for d, s in stage["specialists"].items()},
            "lifted": sum(scores[d] >= base_scores[d] + LIFT for d in scores),
            "steps": len(steps), "sum_step_s": round(sum(h.get("step_s", 0) for h in steps), 2),
            "sum_parts_s": round(parts, 2),
            "lag_mean": sum(h.get("lag_mean", 0) for h in steps) / max(1, len(steps))}


def _mean(runs: list[dict]) -> dict:
    return {k: sum(x[k] for x in runs) / len(runs) for k in ("wall_s", "cpu_s", "mean_score", "lifted")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--reference-tree", default=None, help="another checkout whose synchronous stage is the reference "
                                                          "(e.g. a `git worktree` of the commit a target names)")
    p.add_argument("--domains", default=None, help="comma-separated (default: every configured domain)")
    p.add_argument("--base", default=None, help="a base checkpoint (HF dir) to start from (default: train one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides, every mode")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", default=None, help="work dir (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="2 domains, 8 steps, 40 base steps: a smoke run")
    p.add_argument("--target", type=float, default=TARGET_SPEEDUP, help="reference / this tree's stage wall")
    add_check(p, f"this tree's stage < --target ({TARGET_SPEEDUP})× faster than the reference tree's, or its mean "
                 f"score below the reference's − {QUALITY_SLACK}, or fewer specialists at base + {LIFT}")
    args = p.parse_args(argv)
    meta, t_start = start_meta(), time.perf_counter()

    from domains.evaluate import evaluate
    from domains.registry import load_domains
    from infra.config import load_config

    sets = (QUICK if args.quick else []) + args.set
    cfg = load_config(args.config, sets)
    names = args.domains.split(",") if args.domains else cfg.domain_names()[:2] if args.quick else cfg.domain_names()
    tree = Path(args.reference_tree).resolve() if args.reference_tree else None
    if tree is not None and not (tree / "teachers" / "specialist_main.py").is_file():
        raise SystemExit(f"--reference-tree {tree}: no teachers/specialist_main.py there (a checkout of Alloy?)")
    config = Path(args.config).resolve()
    ref_config = tree / config.relative_to(REPO) if tree is not None and config.is_relative_to(REPO) else config
    if tree is not None and not ref_config.is_file():
        raise SystemExit(f"--reference-tree: {ref_config} does not exist (the reference runs its own --config)")
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-async-spec-"))
    base = Path(args.base) if args.base else build_base(str(config), sets, root, cfg.run.seed, cfg.model.preset)
    doms = load_domains(cfg)
    ev = dict(n_eval=cfg.eval.n_eval, seed=cfg.run.seed, max_new_tokens=cfg.eval.max_new_tokens)
    df = evaluate(str(base), {d: doms[d] for d in names}, ev["n_eval"], ev["seed"], "base",
                  max_new_tokens=ev["max_new_tokens"])
    base_scores = dict(zip(df.domain, map(float, df.score)))
    domains = [(d, cfg.specialists.for_domain(d).steps) for d in names]
    modes = (["reference"] if tree is not None else []) + ["sync", "async"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    plain = [x for x in sets if not x.startswith(ASYNC_KEY + "=")]
    for r in range(args.repeats):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            if mode == "reference":
                stage = run_stage(str(ref_config), plain, base, domains, cfg.specialists.max_parallel,
                                  root / f"r{r}-{mode}", tree)
            else:
                flag = [f"{ASYNC_KEY}={'true' if mode == 'async' else 'false'}"]
                stage = run_stage(str(config), plain + flag, base, domains, cfg.specialists.max_parallel,
                                  root / f"r{r}-{mode}")
            runs[mode].append(summarize(stage, score_finals(stage, doms, **ev), base_scores))
            print(f"repeat {r} {mode}: wall {runs[mode][-1]['wall_s']:.1f}s mean score "
                  f"{runs[mode][-1]['mean_score']:.3f}", flush=True)
    avg = {m: _mean(runs[m]) for m in modes}
    own = "async" if cfg.specialists.async_rollouts else "sync"  # what `alloy run` with this config runs
    result = {"bench": "async_specialists", "quick": args.quick, "total_s": time.perf_counter() - t_start,
              "command": " ".join(["python bench/async_specialists.py"] + (argv if argv is not None else sys.argv[1:])),
              "meta": meta, "config": str(config), "sets": sets, "domains": names, "base": str(base),
              "base_scores": base_scores, "runs": runs, "mean": avg, "stage_mode": own,
              "async_vs_sync": avg["sync"]["wall_s"] / avg["async"]["wall_s"],
              "target": {"speedup": args.target, "quality_slack": QUALITY_SLACK, "lift": LIFT}, "met": None}
    if tree is not None:
        ref, cur = avg["reference"], avg[own]
        result["reference"] = {"tree": str(tree), "commit": harness.git_state(tree).get("commit"),
                               "config": str(ref_config)}
        result["speedup_vs_reference"] = ref["wall_s"] / cur["wall_s"]
        result["quality_delta_vs_reference"] = cur["mean_score"] - ref["mean_score"]
        result["met"] = (result["speedup_vs_reference"] >= args.target
                         and cur["mean_score"] >= ref["mean_score"] - QUALITY_SLACK and cur["lifted"] >= ref["lifted"])
    table = ("| mode | stage wall (s) | CPU (s) | mean score | specialists ≥ base + 0.15 |\n|---|---|---|---|---|\n"
             + "\n".join(f"| {m} | {v['wall_s']:.1f} | {v['cpu_s']:.0f} | {v['mean_score']:.3f} | "
                         f"{v['lifted']:.1f} of {len(names)} |" for m, v in avg.items())
             + f"\n\nasync / sync speed-up {result['async_vs_sync']:.2f}×")
    if tree is not None:
        table += (f"; this tree's stage ({own}) / the reference ({(result['reference']['commit'] or str(tree))[:7]}) "
                  f"{result['speedup_vs_reference']:.2f}× (target ≥ {args.target}×), quality Δ "
                  f"{result['quality_delta_vs_reference']:+.3f}")
    write_outputs(Path(args.out), result, table)
    return verdict("async_specialists", result["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
