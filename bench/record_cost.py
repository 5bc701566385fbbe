"""What the rollout records cost a specialist's step: the full record (every row of every step) and the default
sample (4 rows every 10 steps), on the demo's specialists.

Question (issue 53): does recording slow training? Targets: the full record ≤ 5% of step time, the default ≤ 1%.

Method: one demo specialist (`configs/demo.yaml`, its settings; `--domain`, default reverse) from a fresh `tiny`
model (seed 0: no base SFT, which would not change what a record holds per row), trained `--steps` steps in its
own process (`python -m teachers.specialist_main`) once per mode: `off` (`specialists.record.every=0` and
`sample=0`: no evaluation samples either), `default`
(the config's record settings), `full` (`specialists.record.full=true`). The recorder times itself
(`rollout_records.seconds` in the trainer's summary: building the rows, decoding, Parquet, the storage write,
MLflow off here): it runs in the step loop, between the update and the next step, so that time is added to the
steps. cost = record seconds / the summed `step_s` of the run's steps (the same run: load cannot skew it). The
evaluations' samples (since 4a877d5: the validations' and the final evaluation's first rows, `records.evals`) are
written outside the steps, at evaluations, and are reported apart (files, bytes, seconds), not in the cost.
The step-time medians of the three runs are reported beside it (separate runs: the machine's load moves them).

`--check`: full ≤ 5% and default ≤ 1%.

    python bench/record_cost.py --out bench/results/record_cost.json --check
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (sys.path, quiet env)
from harness import REPO, add_check, start_meta, verdict, write_outputs

TARGETS = {"full": 0.05, "default": 0.01}
MODES = {"off": ["specialists.record.every=0", "specialists.record.sample=0"], "default": [],
         "full": ["specialists.record.full=true"]}


def run_mode(mode: str, args, init: Path, root: Path) -> dict:
    sets = [f"specialists.steps={args.steps}", "tracking.enabled=false", f"specialists.threads={args.threads}",
            *MODES[mode]]
    out = root / mode
    cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", args.config, "--domain", args.domain,
           "--init", str(init), "--out", f"file://{out}/ckpt", "--work-dir", str(out / "work"),
           "--result", str(out / "result.json"), *[x for s in sets for x in ("--set", s)]]
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    with open(out / "log", "wb") as fh:
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"record_cost: the {mode} specialist failed ({rc}): see {out / 'log'}")
    res = json.loads((out / "result.json").read_text())
    steps = [h["step_s"] for h in res["history"]]
    rec = res["rollout_records"]
    return {"mode": mode, "wall_s": time.perf_counter() - t0, "steps": len(steps), "step_s_sum": sum(steps),
            "step_s_median": statistics.median(steps), "records": rec,
            "cost": rec["seconds"] / sum(steps) if steps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "record_cost.json")
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--domain", default="reverse")
    ap.add_argument("--steps", type=int, default=None, help="specialist steps per mode (default 60; --quick: 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the specialist (the demo's: 1)")
    ap.add_argument("--quick", action="store_true", help="20 steps (the CI test)")
    add_check(ap, "full > 5% or default > 1% of step time")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 20 if args.quick else 60
    meta = start_meta()
    from infra.models import init_model_dir

    with tempfile.TemporaryDirectory(prefix="record-cost-") as tmp:
        root = Path(tmp)
        init = init_model_dir("tiny", root / "init", seed=0)
        runs = {m: run_mode(m, args, init, root) for m in ("off", "default", "full")}
    met = {m: runs[m]["cost"] is not None and runs[m]["cost"] <= t for m, t in TARGETS.items()}
    rows = ["| mode | steps | step s (median) | record files | record bytes | record s | cost (record s / step s) | target |",
            "|---|---|---|---|---|---|---|---|"]
    for m, r in runs.items():
        target = f"≤ {TARGETS[m]:.0%} ({'met' if met[m] else 'MISSED'})" if m in TARGETS else ""
        rows.append(f"| {m} | {r['steps']} | {r['step_s_median']:.3f} | {r['records']['files']} | "
                    f"{r['records']['bytes']:,} | {r['records']['seconds']:.3f} | {r['cost']:.2%} | {target} |")
    result = {"bench": "record_cost", "meta": meta, "config": {"config": args.config, "domain": args.domain,
                                                               "steps": args.steps, "threads": args.threads},
              "runs": runs, "target": {**{f"{m}_max": t for m, t in TARGETS.items()}, **{f"met_{m}": v for m, v in
                                                                                       met.items()},
                                        "met": all(met.values())}}
    write_outputs(args.out, result, "\n".join(rows))
    return verdict("record_cost", all(met.values()), args.check)


if __name__ == "__main__":
    sys.exit(main())
