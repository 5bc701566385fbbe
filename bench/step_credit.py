"""Benchmark: does step credit help PPO learn long answers? The same specialist trained from the same base, with the
whole reward on the last token (`specialists.step_credit: false`) and with each step's, run's or field's credit on its
own tokens (true), side by side, per long-answer domain.

    python bench/step_credit.py --base DIR [--config configs/long.yaml] [--domains prefix_mod,rle_expand,record]
        [--steps 300] [--jobs 2] [--out bench/results/step_credit.json] [--check]

`--base`: an HF checkpoint to start from, e.g. the base stage of `alloy run configs/long.yaml`
(`<run.root>/long/base-<key>/final`). Each arm is `python -m teachers.specialist_main` with the config's specialist
settings (its `per_domain` included) and `--set specialists.steps=<steps> specialists.patience=0
specialists.step_credit=<arm>` (the steps and patience also under `per_domain.<domain>`, which would win): the real PPO with its engine server, validated every `val_every` steps on the val
split (greedy). Reported per domain and arm: the validation curve, its best and the gain over step 0 (the base), and
the final eval score of the selected policy. Target: step credit's best validation above terminal-only's on every
domain (`--check` exits 1 when it is not). Scores do not depend on load; wall times do (meta has the load).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_check, exit_on_sigterm, start_meta, verdict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ARMS = {"terminal": "false", "step_credit": "true"}


def run_arm(config: str, base: str, domain: str, arm: str, steps: int, work: Path) -> dict:
    """One specialist (`teachers.specialist_main`) from `base` on `domain` with step credit on or off."""
    out = work / f"{domain}-{arm}"
    cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", config, "--domain", domain, "--init", base,
           "--out", f"file://{out}/ckpt", "--work-dir", str(out / "work"), "--result", str(out / "result.json"),
           "--set", f"run.root={out}/root", "--set", f"specialists.steps={steps}", "--set", "specialists.patience=0",
           # a config's per-domain settings win over the stage's: set the steps there too (configs/long.yaml has them)
           "--set", f"specialists.per_domain.{domain}.steps={steps}",
           "--set", f"specialists.per_domain.{domain}.patience=0",
           "--set", f"specialists.step_credit={ARMS[arm]}"]
    t0 = time.perf_counter()
    with open(work / f"{domain}-{arm}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    r = json.loads((out / "result.json").read_text())
    curve = [{"step": v["step"], "score": v["score"]} for v in r["validation"]]
    return {"domain": domain, "arm": arm, "validation": curve, "val_start": curve[0]["score"],
            "val_best": r["best_val"], "best_step": r["best_step"], "gain": r["best_val"] - curve[0]["score"],
            "eval_score": r["score"], "credited_rows_last_step": r["history"][-1].get("step_credit_rows"),
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="HF checkpoint every arm starts from")
    p.add_argument("--config", default="configs/long.yaml")
    p.add_argument("--domains", default="prefix_mod,rle_expand,record")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench/results/step_credit.json"))
    add_check(p, "step credit's best validation is not above terminal-only's on every domain")
    args = p.parse_args(argv)
    exit_on_sigterm()
    meta = start_meta()
    domains = args.domains.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-step-credit-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run_arm, args.config, args.base, d, a, args.steps, Path(tmp)) for d in domains for a in ARMS]
        runs = [j.result() for j in jobs]
    by = {(r["domain"], r["arm"]): r for r in runs}
    per_domain = {d: {"terminal_best": by[d, "terminal"]["val_best"], "step_credit_best": by[d, "step_credit"]["val_best"],
                      "base": by[d, "terminal"]["val_start"],
                      "difference": by[d, "step_credit"]["val_best"] - by[d, "terminal"]["val_best"]} for d in domains}
    met = all(v["difference"] > 0 for v in per_domain.values())
    result = {"bench": "step_credit", "meta": meta, "config": {"config": args.config, "base": args.base,
              "domains": domains, "steps": args.steps, "jobs": args.jobs}, "runs": runs, "per_domain": per_domain,
              "target": {"what": "step credit's best validation above terminal-only's on every domain", "met": met},
              "met": met}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for d, v in per_domain.items():
        print(f"{d}: base {v['base']:.3f}  terminal best {v['terminal_best']:.3f}  step credit best "
              f"{v['step_credit_best']:.3f}  ({v['difference']:+.3f})")
    return verdict("step_credit", met, args.check)


if __name__ == "__main__":
    sys.exit(main())
