"""Benchmark: per-domain specialist settings chosen over several bases, not one. Each arm (a named set of
`--set` overrides on a config) trains each domain's specialist from each base, with early stops off, to a step cap;
the validation curves it records then replay any early-stopping rule (a step cap and a patience) without rerunning.

    python bench/specialist_sweep.py --config configs/demo.yaml --base 0=DIR0 --base 1=DIR1 --base 2=DIR2
        --domains copy,case_swap --arm demo= --arm kl0=specialists.kl_coef=0.0 [--steps 900] [--jobs 2]
        [--rule 600:4 --rule 800:4] [--out bench/results/specialist_sweep.json]

`--base NAME=DIR`: an HF checkpoint, e.g. a demo seed's base stage (`<run.root>/demo/base-<key>/final`).
`--arm NAME=KEY=VALUE[,KEY=VALUE...]`: the overrides of that arm (empty: the config as it is), applied to the stage
and to `per_domain.<domain>` (a config's per-domain settings would win over the stage's). Each run is
`python -m teachers.specialist_main` (the real PPO with its engine server), validated every `val_every` steps on
the val split (greedy, 200 prompts), `patience=0` and `stop_at` off so the curve runs to `--steps`.
Reported per run: the curve, and for each `--rule CAP:PATIENCE` the best validation that rule would have kept and
the steps it would have spent (the demo's rule: stop after PATIENCE validations without a new best, or at the
config's `stop_at`); and per domain, arm and rule, each base's gain (the kept best over the step-0 validation),
their smallest and mean, and the steps spent (`summary`, the table). Scores do not depend on load; wall times do
(meta has the load). No target: a measurement to choose settings by (`docs/tuning.md` names the choice and the
command); `--summarize JSON` rebuilds the summary and table of a written file with other `--rule`s, running nothing.
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
from harness import add_check, exit_on_sigterm, start_meta, verdict, write_json, write_outputs  # noqa: E402

from teachers.selection import Selection  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse_arm(text: str) -> tuple[str, list[str]]:
    """`NAME=K=V,K=V` → (NAME, ["K=V", ...]); `NAME=` → (NAME, [])."""
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--arm {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...] (or NAME= for the config as it is)")
    sets = [s for s in rest.split(",") if s]
    for s in sets:
        if "=" not in s or not s.startswith("specialists."):
            raise SystemExit(f"--arm {name}: {s!r} is not a specialists.KEY=VALUE override")
    return name, sets


def replay(curve: list[dict], cap: int, patience: int, stop_at: float | None) -> dict:
    """The best validation the trainer's early-stopping rule (`teachers.selection.Selection`) keeps on `curve`
    (steps ascending, step 0 first): validations up to `cap`, stopping at `stop_at` or after `patience` (> 0)
    validations without a new best. `steps`: the step training would have stopped at."""
    sel, last = Selection(), 0
    for point in curve:
        if point["step"] > cap:
            break
        last = point["step"]
        sel.record(point["step"], point["score"])
        if sel.stop_reason(patience, stop_at):
            break
    return {"best": sel.best_score, "best_step": sel.best_step, "steps": last}


def summarize(runs: list[dict], rules: list[str], stop_at: float | None) -> tuple[dict, str]:
    """Per domain, arm and rule (`CAP:PATIENCE`): each base's gain under that rule, the smallest, the mean and the
    steps spent over the bases; and the same as a markdown table (a row per domain and arm, a column per rule)."""
    summary: dict = {}
    for r in runs:
        for rule in rules:
            cap, patience = (int(x) for x in rule.split(":"))
            kept = replay(r["validation"], cap, patience, stop_at)
            cell = summary.setdefault(r["domain"], {}).setdefault(r["arm"], {}).setdefault(
                rule, {"gains": {}, "steps": 0})
            cell["gains"][r["base_name"]] = round(kept["best"] - r["validation"][0]["score"], 4)
            cell["steps"] += kept["steps"]
    lines = ["| domain | arm | " + " | ".join(f"{rule}: gains (min) · steps" for rule in rules) + " |",
             "|---|---|" + "---|" * len(rules)]
    for domain, arms in summary.items():
        for arm, cells in arms.items():
            for cell in cells.values():
                g = list(cell["gains"].values())
                cell["min"], cell["mean"] = min(g), round(sum(g) / len(g), 4)
            lines.append(f"| {domain} | {arm} | " + " | ".join(
                " / ".join(f"{x:+.2f}" for x in c["gains"].values()) + f" (**{c['min']:+.2f}**) · {c['steps']}"
                for c in cells.values()) + " |")
    return summary, "\n".join(lines)


def run_one(config: str, name: str, base: str, domain: str, arm: str, sets: list[str], steps: int, work: Path) -> dict:
    out = work / f"{arm}-{domain}-{name}"
    overrides = [f"specialists.steps={steps}", "specialists.patience=0", "specialists.stop_at=1.0", *sets]
    per_domain = [f"specialists.per_domain.{domain}.{s.removeprefix('specialists.')}" for s in overrides]
    cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", config, "--domain", domain, "--init", base,
           "--out", f"file://{out}/ckpt", "--work-dir", str(out / "work"), "--result", str(out / "result.json"),
           "--set", f"run.root={out}/root"]
    for s in overrides + per_domain:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(f"{out}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    r = json.loads((out / "result.json").read_text())
    return {"domain": domain, "arm": arm, "base_name": name, "base": base, "sets": sets, "eval_score": r["score"],
            "validation": [{"step": v["step"], "score": v["score"]} for v in r["validation"]],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--base", action="append", default=[], help="NAME=DIR: an HF checkpoint to start from")
    p.add_argument("--domains", default="")
    p.add_argument("--arm", action="append", default=[], help="NAME=KEY=VALUE[,KEY=VALUE...]")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--rule", action="append", default=[], help="CAP:PATIENCE, an early-stopping rule to replay")
    p.add_argument("--stop-at", type=float, default=0.95, help="the rule's stop_at (the demo's 0.95)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench/results/specialist_sweep.json"))
    p.add_argument("--summarize", metavar="JSON", help="rebuild a written file's summary with these --rules; no runs")
    add_check(p, None)
    args = p.parse_args(argv)
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        rules = args.rule or result["config"]["rules"]
        result["config"]["rules"] = rules
        result["summary"], table = summarize(result["runs"], rules, result["config"]["stop_at"])
        write_outputs(Path(args.summarize), result, table)
        return verdict("specialist_sweep", None, args.check, has_target=False)
    if not (args.base and args.domains and args.arm):
        p.error("--base, --domains and --arm are required (or --summarize JSON)")
    exit_on_sigterm()
    meta = start_meta()
    bases = dict(b.split("=", 1) for b in args.base)
    arms = dict(parse_arm(a) for a in args.arm)
    rules = [tuple(int(x) for x in r.split(":")) for r in args.rule] or [(args.steps, 0)]
    domains = args.domains.split(",")
    result = {"bench": "specialist_sweep", "meta": meta,
              "config": {"config": args.config, "bases": bases, "domains": domains, "arms": arms,
                         "steps": args.steps, "rules": [f"{c}:{pt}" for c, pt in rules], "stop_at": args.stop_at},
              "runs": []}
    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run_one, args.config, name, path, d, arm, sets, args.steps, Path(tmp))
                for d in domains for arm, sets in arms.items() for name, path in bases.items()]
        for job in jobs:
            r = job.result()
            r["rules"] = {f"{c}:{pt}": replay(r["validation"], c, pt, args.stop_at) for c, pt in rules}
            r["val_start"] = r["validation"][0]["score"]
            runs.append(r)
            print(f"{r['arm']:>10} {r['domain']:>12} base {r['base_name']}: start {r['val_start']:.3f}  " + "  ".join(
                f"{k} {v['best']:.3f}@{v['best_step']} ({v['steps']} st)" for k, v in r["rules"].items()), flush=True)
            # after every run, so an interrupted sweep keeps what finished (a copy of meta: its end is the sweep's)
            write_json(Path(args.out), {**result, "meta": dict(meta)})
    result["summary"], table = summarize(runs, result["config"]["rules"], args.stop_at)
    write_outputs(Path(args.out), result, table)
    return verdict("specialist_sweep", None, args.check, has_target=False)


if __name__ == "__main__":
    sys.exit(main())
