"""Benchmark: OPD's levers on the specialists `merge_baselines.py --demo` kept, against that run's other arms.

    python bench/merge_levers.py --tag more_distill --distill-steps 432 [--reward-coef 0.5]
        [--domain-weighting rkl] [--distill-lr 2e-3] [--seeds 0,1,2] [--quick]

For each seed, OPD reruns from the same base and the same specialists (`--models`, default
runs/merge_baselines_demo/seed<K>, written by `merge_baselines.py --demo`) with one lever changed: more distill steps
(`--distill-steps`), reward mixing (`--reward-coef`: the verifier reward's advantage added to the distillation loss),
per-domain weighting (`--domain-weighting rkl`: more prompts for the teachers the student is furthest from) or the
learning rate. Each seed writes `<out>_seed<K>.json` (reused on a rerun with the same settings); `<out>.json` has the
lever's OPD mean over domains with a 95% interval over seeds and, seed by seed, its paired difference to the main
run's arms (`<main>_seed<K>.json`). Sampled completions per arm are recorded: a lever with more distill steps spends
more than the main run's equal budget (`extra_samples_vs_budget`), which the table says.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_baselines import FINAL_ARMS as MAIN_ARMS, aggregate_opd_only, run_worker  # noqa: E402
from merge_stats import ci95  # noqa: E402
from harness import REPO, add_check, exit_on_sigterm, start_meta, verdict, write_outputs  # noqa: E402


def run_seed(args, seed: int, models: Path, main_path: Path, out: Path) -> dict:
    meta = start_meta()
    main = json.loads(main_path.read_text())
    spec = json.loads((models / "spec.json").read_text())
    names = [d["name"] for d in spec["domains"]]
    kept = json.loads((models / "runs.json").read_text())
    spec["distill"] = {"steps": args.distill_steps or spec["distill"]["steps"],
                       "lr": args.distill_lr or spec["distill"]["lr"],
                       "reward_coef": args.reward_coef, "domain_weighting": args.domain_weighting}
    if args.quick:
        spec["eval_n"] = min(spec["eval_n"], 10)
    with tempfile.TemporaryDirectory(prefix="bench-lever-") as tmp:
        spec.update(base=str(models / "base"), root=tmp, teachers={n: str(models / "teachers" / n) for n in names})
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        run = run_worker("opd", spec_path, Path(tmp))
    opd = aggregate_opd_only(names, kept["base_scores"], kept["specialists"], run)
    budget = main["config"]["equal_compute"]["budget_C"]
    result = {"bench": "merge_levers", "tag": args.tag, "seed": seed, "meta": meta, "plan": plan_of(args),
              "models": str(models), "distill": spec["distill"], "opd": opd, "main_file": str(main_path),
              "main": {a: main["aggregate"][a]["mean_score"] for a in MAIN_ARMS},
              "extra_samples_vs_budget": opd["compute"]["total_samples"] - budget, "run": run}
    write_outputs(out, result, f"lever {args.tag}, seed {seed}: OPD mean {opd['mean_score']:.3f} (main run: "
                  + ", ".join(f"{a} {result['main'][a]:.3f}" for a in MAIN_ARMS) + ")")
    return result


def plan_of(args) -> dict:
    return {k: v for k, v in vars(args).items() if k in ("tag", "distill_steps", "distill_lr", "reward_coef",
                                                         "domain_weighting", "quick")}


def summary(results: list[dict]) -> dict:
    """The lever's OPD over seeds, and seed by seed its paired difference to each arm of the main run."""
    out = {"opd": ci95([r["opd"]["mean_score"] for r in results]),
           "forgetting": ci95([r["opd"]["forgetting_mean"] for r in results]),
           "main_opd": ci95([r["main"]["opd"] for r in results])}
    for arm in MAIN_ARMS:
        out[f"lever_minus_{arm}"] = ci95([r["opd"]["mean_score"] - r["main"][arm] for r in results])
    return out


def table(tag: str, s: dict, results: list[dict]) -> str:
    def iv(c: dict) -> str:
        return f"{c['mean']:.3f} [{c['ci95_low']:.3f}, {c['ci95_high']:.3f}]"

    extra = sorted({r["extra_samples_vs_budget"] for r in results})
    return "\n".join([
        f"Lever `{tag}` ({len(results)} seeds; sampled completions beyond the main run's equal budget: {extra}).", "",
        "| | mean score [95% CI] |", "|---|---|", f"| OPD with the lever | {iv(s['opd'])} |",
        f"| OPD of the main run | {iv(s['main_opd'])} |",
        *[f"| lever − {arm} (paired) | {iv(s[f'lever_minus_{arm}'])} |" for arm in MAIN_ARMS],
        f"| OPD forgetting with the lever | {iv(s['forgetting'])} |"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", required=True, help="the lever's name (file names, tables)")
    p.add_argument("--main", default=str(REPO / "bench/results/merge_baselines_demo.json"),
                   help="the main run's summary path; its per-seed files <stem>_seed<K>.json are compared")
    p.add_argument("--models", default=str(REPO / "runs/merge_baselines_demo"), help="folder with seed<K>/ kept models")
    p.add_argument("--out", default=None, help="default bench/results/merge_levers_<tag>.json")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--distill-steps", type=int, default=None)
    p.add_argument("--distill-lr", type=float, default=None)
    p.add_argument("--reward-coef", type=float, default=None)
    p.add_argument("--domain-weighting", choices=("uniform", "rkl"), default=None)
    p.add_argument("--quick", action="store_true", help="eval on 10 prompts per domain (a smoke run)")
    p.add_argument("--fresh", action="store_true")
    add_check(p, None)
    args = p.parse_args(argv)
    meta = start_meta()
    import torch

    torch.set_num_threads(1)
    exit_on_sigterm()
    out = Path(args.out or REPO / f"bench/results/merge_levers_{args.tag}.json")
    main_path, results = Path(args.main), []
    for seed in [int(x) for x in args.seeds.split(",")]:
        path = out.with_name(f"{out.stem}_seed{seed}.json")
        if path.exists() and not args.fresh and json.loads(path.read_text()).get("plan") == plan_of(args):
            results.append(json.loads(path.read_text()))
            print(f"seed {seed}: reusing {path}", file=sys.stderr)
            continue
        models = Path(args.models) / f"seed{seed}"
        main_seed = main_path.with_name(f"{main_path.stem}_seed{seed}.json")
        for need in (models / "runs.json", main_seed):
            if not need.exists():
                raise SystemExit(f"{need}: missing; run `python bench/merge_baselines.py --demo --seeds {seed}` "
                                 "first (it keeps the models and writes the per-seed file)")
        results.append(run_seed(args, seed, models, main_seed, path))
    s = summary(results)
    write_outputs(out, {"bench": "merge_levers", "tag": args.tag, "command": " ".join(
        ["python bench/merge_levers.py"] + argv), "meta": meta, "n_seeds": len(results), "summary": s,
        "seed_files": [r.get("seed") for r in results]}, table(args.tag, s, results))
    return verdict("merge_levers", None, args.check, has_target=False)


if __name__ == "__main__":
    sys.exit(main())
