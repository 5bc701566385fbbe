"""Benchmark: OPD against mixed multi-task RL, offline distillation and sequential RL, at equal compute.

    python bench/merge_baselines.py --out bench/results/merge_baselines.json [--domains sort_digits,max_list:3,caesar]
        [--rl-steps 40] [--distill-steps 60] [--batch 64] [--base-steps 150] [--quick]
    python bench/merge_baselines.py --demo [--seeds 0,1,2] [--fresh]     # → bench/results/merge_baselines_demo.json
    python bench/merge_baselines.py --long [--seeds 0,1,2,3,4]           # → bench/results/merge_baselines_long.json

`--demo`: configs/demo.yaml's 12 domains (their difficulties), a base as the demo's was until 11-28 (1000 fixed SFT
steps on 2000 demonstrations per domain: the committed results' setting; the demo now stops its base at a validation
score, `base.stop_at_score`), S = 50, Sd = 144, offline_kd on the teachers' greedy outputs. With `--seeds` (or
`--demo`) each seed writes `<out>_seed<K>.json` (+ .md) as it finishes and a rerun reuses it (same settings, else it
refuses, naming them; `--fresh` reruns), so a crash or Ctrl-C loses at most the seed in progress. Then `<out>.json`
summarises the seeds (`merge_stats.py`: per arm the mean over domains with a Student-t 95% interval over seeds,
per-domain intervals, forgetting, OPD's paired difference to each arm), `<out>.md` is its table, `<out>.png` the arms
× domains chart, also logged with the summary to an MLflow run (experiment `alloy-bench`).

`--long` (issue 56): configs/long.yaml's six domains, three of them long-answer (answers of 40+ tokens:
domains/builtin/long.py, each domain sampling and evaluated within its own token budget), S = 200 (the long ones learn
slowly), Sd = 300, the base and offline_kd as `--demo`'s, seeds 0-4. The specialists' PPO gets the long domains'
step credit (`specialists.step_credit`, on by default), and so does mixed RL (each row's credit from its own domain).

One tiny base (a fresh `tiny` model, plain-torch SFT on the domains' demonstrations, stopped early so RL has room)
is every arm's start. The arms (each worker is a fresh process; PPO is `teachers.specialist_main.run_specialist`,
the real critic PPO with its engine server; OPD is `student.distill_main.run_distillation` with teacher servers):
  specialists    : PPO from the base on each domain alone, `--rl-steps` steps of `--batch` prompts (the teachers)
  opd            : the specialists, then OPD of the base from them: `--distill-steps` steps of `--batch` prompts
  offline        : the specialists, then offline distillation: each teacher samples (temperature 1) completions for
                   its domain's train prompts, as many in all as OPD's student samples; the base is SFT-ed on them,
                   UNVERIFIED (every sample kept, as OPD keeps every sample), `--distill-steps` steps of `--batch`
  mixed_rl       : one PPO policy from the base on all domains' prompts mixed (`teachers.mixed_domain.MixedDomain`:
                   evenly interleaved prompts, each row's reward from its own domain's verifier)
  sequential_rl  : PPO from the base on domain 1, then from that policy on domain 2, ... (a fresh critic per stage;
                   the KL reference is the stage's start)

Equal compute = the same number of SAMPLED COMPLETIONS (one response, ≤ max_new_tokens tokens, to one prompt) that
an arm's training consumes. OPD's budget counts the RL of the specialists it depends on: C = D·S·B + Sd·B (D
domains, S = --rl-steps, Sd = --distill-steps, B = --batch). mixed_rl gets C/B PPO steps, sequential_rl C/(D·B) per
stage; offline gets the specialists (D·S·B) plus Sd·B teacher samples and Sd SFT updates (OPD's student updates).
What stays unequal and is recorded per arm: PPO makes `ppo_epochs` policy optimizer steps (plus critic steps) per
batch where a distillation step is one; OPD also pays teacher scoring forwards; sampled tokens differ with response
lengths; wall and CPU seconds (this process tree, resource.getrusage) depend on the machine's load.

Scores: greedy mean verifier reward on `--eval-n` held-out eval prompts per domain (`domains.evaluate
.evaluate_model`, via `trl_compare.accuracy`). Forgetting of domain i = score_i at the arm's OWN POINT for i − its
final score_i; the own point is the model right after RL on domain i: sequential_rl — after stage i; opd, offline —
specialist i (the model the merge starts from for i); mixed_rl has no per-domain stage, so its own point is the best
of its evaluations (every C/(D·B) steps and the end): "drop vs best-ever". Means are over all D domains (for
sequential_rl the last domain forgets 0 by definition; the mean over the first D−1 is reported too). Also reported:
drop vs the base, max(0, base_i − final_i). Target (issue 7): OPD's mean score > mixed_rl's and > offline's, and
OPD's mean forgetting < sequential_rl's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, exit_on_sigterm, make_cfg, start_meta, verdict, write_outputs  # noqa: E402
from merge_stats import ARMS as SUMMARY_ARMS  # noqa: E402  (the summary's arm names: offline is offline_kd)
from trl_compare import accuracy  # noqa: E402

FINAL_ARMS = ("opd", "offline", "mixed_rl", "sequential_rl")


def preset_of(args) -> str | None:
    """"demo" / "long" (`--demo`, `--long`: a config's domains and that preset's settings), or None."""
    return "demo" if args.demo else "long" if getattr(args, "long", False) else None


def parse_domains(text: str) -> list[dict]:
    """"sort_digits,max_list:3" → [{"name": "sort_digits", "difficulty": 1}, {"name": "max_list", "difficulty": 3}]."""
    return [{"name": s.split(":")[0], "difficulty": int(s.split(":")[1]) if ":" in s else 1} for s in text.split(",")]


def load(specs: list[dict]) -> dict:
    from domains.registry import load_domain

    return {s["name"]: load_domain(s["name"], difficulty=s["difficulty"]) for s in specs}


def build_base(root: Path, specs: list[dict], steps: int, seed: int, n_train: int = 1000) -> Path:
    """A fresh tiny model SFT-ed (plain torch, `distill_fixtures.sft_plain`) on `n_train` demonstrations per domain."""
    from distill_fixtures import sft_plain
    from infra.models import init_model_dir

    pairs = [(e.prompt, e.answer) for dom in load(specs).values() for e in dom.split("train", n_train, seed)]
    return sft_plain(init_model_dir("tiny", root / "init", seed=seed), root / "base", pairs, steps, seed=seed)


def scores(model_dir_or_model, spec: dict) -> dict:
    """{domain: greedy eval score} with the same evaluator for every arm."""
    from infra.models import load_model, load_tokenizer

    model = load_model(model_dir_or_model) if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model
    return accuracy(model, load_tokenizer(spec["base"]), load(spec["domains"]), spec["eval_n"], spec["max_new_tokens"])


# -- the workers (each in a fresh process) --------------------------------------------------------------------------
def rl_cfg(spec: dict, root: Path, steps: int, n_prompts: int):
    from infra.config import config_from_dict

    r, B = spec["rl"], spec["batch"]
    train = {"lr": r["lr"], "micro_batch_size": B}
    return config_from_dict({
        "run": {"name": "merge-bench", "root": str(root), "seed": spec["seed"]}, "model": {"preset": "tiny"},
        "domains": spec["domains"], "eval": {"n_eval": spec["eval_n"], "max_new_tokens": spec["max_new_tokens"]},
        "specialists": {"steps": steps, "batch_size": B, "over_sampling": 1.0, "ppo_epochs": r["ppo_epochs"],
                        "lam": r["lam"], "kl_coef": r["kl_coef"], "critic_warmup_steps": r["warmup"],
                        "n_prompts": n_prompts, "eval_n": 10,  # the budget: each domain's own, else the eval's
                        "checkpoint_every": max(steps, 1), "log_every": max(steps, 1),
                        "policy_train": train, "critic_train": train}})


def run_rl(spec: dict, domain, init: str, work: Path, steps: int, n_prompts: int, on_step=None) -> dict:
    """`steps` PPO steps on `domain` from `init`; returns the final HF dir and the sample bookkeeping."""
    from infra.tracking import NoopTracker
    from teachers.specialist_main import run_specialist

    out = run_specialist(rl_cfg(spec, work, steps, n_prompts), domain, init, f"file://{work}/ckpt", work / "w",
                         NoopTracker(), on_step=on_step)
    h = out["history"]
    return {"dir": out["specialist_dir"], "steps": out["steps"], "samples": int(sum(x["samples"] for x in h)),
            "sampled_tokens": int(sum(x["response_tokens"] for x in h)),
            "policy_optimizer_steps": spec["rl"]["ppo_epochs"] * sum("policy_loss" in x for x in h),
            "reward_first": h[0]["reward"], "reward_last": h[-1]["reward"]}


def worker_specialist(spec: dict, name: str, work: Path) -> dict:
    rl = run_rl(spec, load(spec["domains"])[name], spec["base"], work, spec["rl"]["steps"], spec["rl"]["n_prompts"])
    return {"rl_samples": rl["samples"], "teacher_samples": 0, "distill_samples": 0, "rl": rl,
            "sampled_tokens": rl["sampled_tokens"], "policy_optimizer_steps": rl["policy_optimizer_steps"],
            "dir": rl["dir"], "final": scores(rl["dir"], spec)}


def worker_opd(spec: dict, work: Path) -> dict:
    from infra.tracking import NoopTracker
    from student.distill_main import run_distillation
    from domains.registry import load_domains
    from tasks.teachers import start_teachers

    d = spec["distill"]
    levers = {k: d[k] for k in ("reward_coef", "domain_weighting") if d.get(k) is not None}  # merge_levers.py
    cfg = make_cfg(work, spec["domains"], seed=spec["seed"], steps=d["steps"], batch_size=spec["batch"],
                   max_new_tokens=spec["max_new_tokens"], n_prompts_per_domain=spec["rl"]["n_prompts"],
                   train={"lr": d["lr"]}, **levers)
    names = [s["name"] for s in spec["domains"]]
    fleet = start_teachers(names, spec["teachers"], spec["base"], log_dir=work / "logs", engine_cfg=cfg.engine,
                           teachers_cfg=cfg.teachers)
    try:
        s = run_distillation(cfg, load_domains(cfg), spec["base"], fleet.endpoints(), f"file://{work}/student",
                             work / "distill", NoopTracker())
    finally:
        fleet.stop()
    return {"rl_samples": 0, "teacher_samples": 0, "distill_samples": s["trained_samples"],
            "sampled_tokens": s["sampled_tokens"], "policy_optimizer_steps": s["updates"],
            "distill": {k: s[k] for k in ("steps", "updates", "trained_samples", "sampled_tokens", "wall_s")},
            "final": scores(s["student_dir"], spec)}


def worker_offline(spec: dict, work: Path) -> dict:
    """Each teacher samples its share of Sd·B completions (temperature 1) on its domain's train prompts; the base is
    SFT-ed on all of them (unverified), Sd steps of B."""
    import torch

    from distill_fixtures import sft_plain
    from infra.chat import token_budget
    from infra.generation import generate_batch
    from infra.models import load_model, load_tokenizer

    d, doms = spec["distill"], load(spec["domains"])
    tok = load_tokenizer(spec["base"])
    n_total = d["steps"] * spec["batch"]
    pairs, reward, tokens = [], {}, 0
    for i, (name, dom) in enumerate(doms.items()):
        n = n_total // len(doms) + (i < n_total % len(doms))
        pool = dom.split("train", spec["rl"]["n_prompts"], spec["seed"])
        exs = [pool[j % len(pool)] for j in range(n)]
        torch.manual_seed(spec["seed"] + i)
        greedy = spec.get("offline_sampling", "sample") == "greedy"
        budget = token_budget(dom, tok, spec["max_new_tokens"])  # a long-answer domain's own, as OPD samples with
        outs = generate_batch(load_model(spec["teachers"][name]).eval(), tok, [e.prompt for e in exs],
                              budget, batch_size=128, greedy=greedy, temperature=1.0)
        pairs += [(e.prompt, o) for e, o in zip(exs, outs)]
        reward[name] = statistics.fmean(dom.verify(e, o) for e, o in zip(exs, outs))
        tokens += sum(len(tok(o, add_special_tokens=False).input_ids) for o in outs)
    out = sft_plain(Path(spec["base"]), work / "student", pairs, d["steps"], lr=d["lr"], batch=spec["batch"],
                    seed=spec["seed"])
    return {"rl_samples": 0, "teacher_samples": len(pairs), "distill_samples": 0, "sampled_tokens": tokens,
            "policy_optimizer_steps": d["steps"], "teacher_sample_reward": reward, "final": scores(out, spec)}


def worker_mixed(spec: dict, work: Path) -> dict:
    from infra.models import load_tokenizer
    from teachers.mixed_domain import MixedDomain

    doms, tok = load(spec["domains"]), load_tokenizer(spec["base"])
    every, evals = spec["mixed_steps"] // len(doms), []

    def on_step(trainer, metrics) -> None:  # the policy during training, evaluated in place
        if trainer.state.step % every == 0 and trainer.state.step < spec["mixed_steps"]:
            m = trainer.policy.module
            was = m.training
            evals.append({"step": trainer.state.step, "scores": accuracy(m.eval(), tok, doms, spec["eval_n"],
                                                                           spec["max_new_tokens"])})
            m.train(was)

    rl = run_rl(spec, MixedDomain(list(doms.values())), spec["base"], work, spec["mixed_steps"],
                spec["rl"]["n_prompts"] * len(doms), on_step=on_step)
    final = scores(rl["dir"], spec)
    evals.append({"step": rl["steps"], "scores": final})
    return {"rl_samples": rl["samples"], "teacher_samples": 0, "distill_samples": 0, "rl": rl,
            "sampled_tokens": rl["sampled_tokens"], "policy_optimizer_steps": rl["policy_optimizer_steps"],
            "evals": evals, "final": final}


def worker_sequential(spec: dict, work: Path) -> dict:
    doms, init, stages = load(spec["domains"]), spec["base"], []
    for i, (name, dom) in enumerate(doms.items()):
        rl = run_rl(spec, dom, init, work / f"stage{i}", spec["stage_steps"], spec["rl"]["n_prompts"])
        stages.append({"domain": name, "rl": rl, "scores": scores(rl["dir"], spec)})
        init = rl["dir"]
    return {"rl_samples": sum(s["rl"]["samples"] for s in stages), "teacher_samples": 0, "distill_samples": 0,
            "sampled_tokens": sum(s["rl"]["sampled_tokens"] for s in stages),
            "policy_optimizer_steps": sum(s["rl"]["policy_optimizer_steps"] for s in stages),
            "stages": stages, "final": stages[-1]["scores"]}


def worker(arm: str, spec: dict, result: Path) -> None:
    import torch

    exit_on_sigterm()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    work = Path(spec["root"]) / arm.replace(":", "-")
    if arm.startswith("specialist:"):
        res = worker_specialist(spec, arm.split(":", 1)[1], work)
    else:
        res = {"opd": worker_opd, "offline": worker_offline, "mixed_rl": worker_mixed,
               "sequential_rl": worker_sequential}[arm](spec, work)
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    res.update(arm=arm, wall_s=time.perf_counter() - t0,
               cpu_s=me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime)  # + the engine servers it waited for
    result.write_text(json.dumps(res, default=float))


# -- the parent -----------------------------------------------------------------------------------------------------
def run_worker(arm: str, spec_path: Path, out_dir: Path) -> dict:
    """Run one arm in a fresh process; add the load average around it."""
    res_path, log_path = out_dir / f"{arm.replace(':', '-')}.json", out_dir / f"{arm.replace(':', '-')}.log"
    load0 = list(os.getloadavg())
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, __file__, "--worker", arm, "--spec", str(spec_path), "--result",
                             str(res_path)], stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO)).returncode
    if rc != 0:
        raise RuntimeError(f"worker {arm} failed (exit {rc}); log tail:\n" + log_path.read_text()[-3000:])
    res = json.loads(res_path.read_text())
    res.update(loadavg_before=load0, loadavg_after=list(os.getloadavg()))
    print(f"{arm}: {res['wall_s']:.0f}s, final {res['final']}", file=sys.stderr, flush=True)
    return res


def mean(xs) -> float:
    return statistics.fmean(list(xs))


def specialists_summary(names: list[str], spec_runs: dict) -> dict:
    """{domain: specialist run} → each specialist's score on its own domain, all scores, the compute they used."""
    return {"own": {d: spec_runs[d]["final"][d] for d in names}, "scores": {d: spec_runs[d]["final"] for d in names},
            **{k: sum(r[k] for r in spec_runs.values()) for k in
               ("rl_samples", "sampled_tokens", "policy_optimizer_steps", "wall_s", "cpu_s")}}


def arm_summary(r: dict, own: dict, uses: dict | None, base: dict, names: list[str]) -> dict:
    """One arm's final scores, forgetting (own point − final), drop vs base and compute (+ `uses`: the specialists
    an arm depends on)."""
    final = r["final"]
    forgetting = {d: own[d] - final[d] for d in names}
    compute = {k: r[k] + (uses[k] if uses and k in uses else 0) for k in
               ("rl_samples", "teacher_samples", "distill_samples", "sampled_tokens", "policy_optimizer_steps",
                "wall_s", "cpu_s")}
    compute["total_samples"] = compute["rl_samples"] + compute["teacher_samples"] + compute["distill_samples"]
    return {"scores": final, "mean_score": mean(final.values()), "own_point": own, "forgetting": forgetting,
            "forgetting_mean": mean(forgetting.values()),
            "drop_vs_base": {d: max(0.0, base[d] - final[d]) for d in names},
            "drop_vs_base_mean": mean(max(0.0, base[d] - final[d]) for d in names),
            "gain_vs_base_mean": mean(final[d] - base[d] for d in names), "compute": compute}


def aggregate(names: list[str], base: dict, runs: list[dict]) -> dict:
    """Per arm: final per-domain scores, forgetting (own point − final, see the module doc), drop vs base and the
    compute it used (the specialists' RL counted in opd and offline)."""
    spec_runs = {r["arm"].split(":", 1)[1]: r for r in runs if r["arm"].startswith("specialist:")}
    by_arm = {r["arm"]: r for r in runs}
    specialists = specialists_summary(names, spec_runs)
    out = {"base": {"scores": base, "mean_score": mean(base.values())}, "specialists": specialists}
    for arm in FINAL_ARMS:
        r = by_arm[arm]
        if arm in ("opd", "offline"):
            own, uses = specialists["own"], specialists
        elif arm == "sequential_rl":
            own, uses = {s["domain"]: s["scores"][s["domain"]] for s in r["stages"]}, None
        else:
            own, uses = {d: max(e["scores"][d] for e in r["evals"]) for d in names}, None
        out[arm] = arm_summary(r, own, uses, base, names)
    out["sequential_rl"]["forgetting_mean_first_d_minus_1"] = mean(
        out["sequential_rl"]["forgetting"][d] for d in names[:-1]) if len(names) > 1 else 0.0
    return out


def aggregate_opd_only(names: list[str], base: dict, specialist_runs: list[dict], opd_run: dict) -> dict:
    """The OPD arm's summary from kept specialists (merge_levers.py)."""
    s = specialists_summary(names, {r["arm"].split(":", 1)[1]: r for r in specialist_runs})
    return arm_summary(opd_run, s["own"], s, base, names)


def target(agg: dict) -> dict:
    opd = agg["opd"]
    t = {"opd_beats_mixed_rl_mean_score": {"opd": opd["mean_score"], "other": agg["mixed_rl"]["mean_score"],
                                           "diff": opd["mean_score"] - agg["mixed_rl"]["mean_score"]},
         "opd_beats_offline_mean_score": {"opd": opd["mean_score"], "other": agg["offline"]["mean_score"],
                                          "diff": opd["mean_score"] - agg["offline"]["mean_score"]},
         "opd_forgets_less_than_sequential_rl": {"opd": opd["forgetting_mean"],
                                                 "other": agg["sequential_rl"]["forgetting_mean"],
                                                 "diff": agg["sequential_rl"]["forgetting_mean"]
                                                 - opd["forgetting_mean"]}}
    for v in t.values():
        v["met"] = v["diff"] > 0
    return {**t, "met": all(v["met"] for v in t.values())}


def table(names: list[str], agg: dict, runs: list[dict]) -> str:
    f3 = "{:.3f}".format
    lines = ["| arm | " + " | ".join(names) + " | mean score | forgetting (mean) | drop vs base (mean) | total samples | "
             "RL samples | distill / teacher samples | policy optimizer steps | sampled tokens | wall s | CPU s |",
             "|---|" + "---|" * (len(names) + 10)]
    b = agg["base"]
    lines.append("| base | " + " | ".join(f3(b["scores"][d]) for d in names) + f" | {f3(b['mean_score'])} |"
                 + " |" * 9)
    s = agg["specialists"]
    lines.append("| specialists (own domain each) | " + " | ".join(f3(s["own"][d]) for d in names)
                 + f" | {f3(mean(s['own'].values()))} | | | {s['rl_samples']} | {s['rl_samples']} | | "
                 f"{s['policy_optimizer_steps']} | {s['sampled_tokens']} | {s['wall_s']:.0f} | {s['cpu_s']:.0f} |")
    for arm in FINAL_ARMS:
        a, c = agg[arm], agg[arm]["compute"]
        lines.append(f"| {arm} | " + " | ".join(f3(a["scores"][d]) for d in names)
                     + f" | **{f3(a['mean_score'])}** | {f3(a['forgetting_mean'])} | {f3(a['drop_vs_base_mean'])} | "
                     f"{c['total_samples']} | {c['rl_samples']} | {c['distill_samples'] + c['teacher_samples']} | "
                     f"{c['policy_optimizer_steps']} | {c['sampled_tokens']} | {c['wall_s']:.0f} | {c['cpu_s']:.0f} |")
    lines += ["", "| arm | " + " | ".join(f"own point → final: {d}" for d in names) + " |",
              "|---|" + "---|" * len(names)]
    for arm in FINAL_ARMS:
        a = agg[arm]
        lines.append(f"| {arm} | " + " | ".join(f"{f3(a['own_point'][d])} → {f3(a['scores'][d])} "
                                                f"({a['forgetting'][d]:+.3f})" for d in names) + " |")
    seq = next(r for r in runs if r["arm"] == "sequential_rl")
    lines += ["", "| sequential_rl after stage | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i, st in enumerate(seq["stages"]):
        lines.append(f"| {i + 1} ({st['domain']}) | " + " | ".join(f3(st["scores"][d]) for d in names) + " |")
    return "\n".join(lines)


def run_seed(args, seed: int, out: Path, argv: list[str]) -> dict:
    """One seed: base, specialists, the four arms; writes `out` (+ .md) and returns the result."""
    specs = parse_domains(args.domains)
    names, D, B = [s["name"] for s in specs], len(specs), args.batch
    budget = D * args.rl_steps * B + args.distill_steps * B  # C: OPD's samples incl. its specialists' RL
    mixed_steps = budget // B
    t0 = time.perf_counter()
    meta = start_meta()
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        root = Path(tmp)
        base = build_base(root / "models", specs, args.base_steps, seed, args.n_train)
        spec = {"base": str(base), "root": str(root), "domains": specs, "seed": seed, "batch": B,
                "max_new_tokens": args.max_new_tokens, "eval_n": args.eval_n, "offline_sampling": args.offline_sampling,
                "rl": {"steps": args.rl_steps, "lr": args.rl_lr, "lam": args.lam, "kl_coef": args.kl_coef,
                       "warmup": args.critic_warmup, "ppo_epochs": args.ppo_epochs, "n_prompts": args.n_prompts},
                "distill": {"steps": args.distill_steps, "lr": args.distill_lr},
                "mixed_steps": mixed_steps, "stage_steps": mixed_steps // D}
        base_scores = scores(base, spec)
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            # the specialists first (opd and offline need them); mixed and sequential RL do not wait for them
            specialists = [pool.submit(run_worker, f"specialist:{d}", spec_path, root) for d in names]
            first = [pool.submit(run_worker, a, spec_path, root) for a in ("mixed_rl", "sequential_rl")]
            runs = [f.result() for f in specialists]
            spec["teachers"] = {r["arm"].split(":", 1)[1]: r["dir"] for r in runs}
            spec_path.write_text(json.dumps(spec))
            if args.keep:
                keep_models(Path(args.keep) / f"seed{seed}", spec, runs, base_scores)
            runs += list(pool.map(lambda a: run_worker(a, spec_path, root), ("opd", "offline")))
            runs += [f.result() for f in first]
    agg = aggregate(names, base_scores, runs)
    result = {"bench": "merge_baselines",
              "command": " ".join(["python bench/merge_baselines.py"] + argv),
              "quick": args.quick, "demo": args.demo, "preset": preset_of(args), "meta": meta,
              "shared_machine_note": "2 cores shared with other agents' jobs; per-run load averages in runs[]",
              "config": {k: v for k, v in spec.items() if k not in ("base", "root", "teachers")} | {
                  "jobs": args.jobs, "base_steps": args.base_steps, "n_train": args.n_train,
                  "offline_samples": f"{args.offline_sampling}, unverified (all kept)",
                  "equal_compute": {
                      "unit": "sampled completions (one response to one prompt) consumed by an arm's training",
                      "budget_C": budget, "formula": "C = D·S·B + Sd·B", "D": D, "S": args.rl_steps,
                      "Sd": args.distill_steps, "B": B, "mixed_rl_steps": mixed_steps,
                      "sequential_rl_steps_per_stage": mixed_steps // D}},
              "plan": plan_of(args), "runs": runs, "aggregate": agg, "target": target(agg),
              "total_s": time.perf_counter() - t0}
    write_outputs(out, result, table(names, agg, runs))
    return result


def keep_models(dest: Path, spec: dict, specialist_runs: list[dict], base_scores: dict) -> None:
    """Copy a seed's base and specialists (the teachers) to `dest` (base/, teachers/<domain>/, runs.json, spec.json)
    so that `merge_levers.py` can rerun OPD from the same specialists."""
    import shutil

    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(spec["base"], tmp / "base")
    for name, d in spec["teachers"].items():
        shutil.copytree(d, tmp / "teachers" / name)
    (tmp / "runs.json").write_text(json.dumps({"base_scores": base_scores, "specialists": specialist_runs},
                                              default=float))
    (tmp / "spec.json").write_text(json.dumps({k: v for k, v in spec.items() if k not in ("base", "root", "teachers")}))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def plan_of(args) -> dict:
    """The settings a per-seed file was made with (all but the seed and how it was run): reuse needs them equal."""
    skip = {"seeds", "seed", "out", "fresh", "jobs", "worker", "spec", "result", "mlflow_root", "no_mlflow", "keep",
            "check"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def seed_argv(argv: list[str], seed: int) -> list[str]:
    """`argv` with --seeds/--fresh replaced by `--seeds <seed>` (the command a per-seed file records)."""
    out, it = [], iter(argv)
    for a in it:
        if a == "--seeds":
            next(it, None)
        elif not a.startswith("--seeds=") and a != "--fresh":
            out.append(a)
    return out + ["--seeds", str(seed)]


def seed_path(out: Path, seed: int) -> Path:
    return out.with_name(f"{out.stem}_seed{seed}.json")


def same_setup(a: dict, b: dict) -> bool:
    """Two seeds' configs agree on everything but the seed (what a summary may pool)."""
    drop = ("seed", "jobs")
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def chart(summary: dict, names: list[str]):
    """Arms × domains: grouped bars of the mean score over seeds with 95% intervals (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("base", summary["base"]["per_domain"]), ("specialists", summary["specialists"]["per_domain"])]
    rows += [(arm, summary[arm]["per_domain"]) for arm in SUMMARY_ARMS]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4.5))
    width = 0.8 / len(rows)
    for i, (label, per) in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(names))]
        m = [per[d]["mean"] for d in names]
        err = [[per[d]["mean"] - per[d]["ci95_low"] for d in names], [per[d]["ci95_high"] - per[d]["mean"]
                                                                       for d in names]]
        ax.bar(xs, m, width, yerr=err, capsize=2, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("greedy eval score (mean over seeds, 95% CI)")
    ax.set_ylim(0, 1.05)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    return fig


def log_to_mlflow(result: dict, fig, runs_root: Path) -> str:
    """One MLflow run (experiment `alloy-bench`) with the summary as metrics, the chart, the table and the JSON."""
    from infra.tracking import Tracker

    tr = Tracker(runs_root=runs_root, experiment="alloy-bench")
    run_id = tr.start_parent(f"merge_baselines_{result['preset']}" if result.get("preset") else "merge_baselines",
                             tags={"bench": "merge_baselines", "n_seeds": result["n_seeds"]})
    tr.log_params({"n_seeds": result["n_seeds"], "n_domains": result["n_domains"], "seeds": result["seeds"],
                   **{f"equal_compute.{k}": v for k, v in result["config"]["equal_compute"].items()}})
    tr.log_metrics({f"{arm}.{k}": result["summary"][arm][k] for arm in SUMMARY_ARMS
                    for k in ("mean", "ci95_low", "ci95_high")})
    tr.log_figure(fig, "merge_baselines_chart.png")
    tr.log_text(result["table_md"], "merge_baselines.md")
    tr.log_dict({k: v for k, v in result.items() if k != "table_md"}, "merge_baselines.json")
    tr.end()
    return run_id


def summarize_seeds(args, out: Path, seeds: list[int], per_seed: list[dict], argv: list[str], meta: dict) -> dict:
    """The multi-seed file: n_seeds, n_domains, the summary with 95% intervals, the chart, the MLflow run."""
    from merge_stats import summarize, summary_table
    from merge_stats import target as summary_target

    names = [d["name"] for d in per_seed[0]["config"]["domains"]]
    for s, r in zip(seeds, per_seed):
        if not same_setup(r["config"], per_seed[0]["config"]):
            raise SystemExit(f"{seed_path(out, s)}: its config differs from seed {seeds[0]}'s (beyond the seed); "
                             "rerun it with --fresh or pool only like runs")
    summary = summarize([r["aggregate"] for r in per_seed], names)
    result = {"bench": "merge_baselines", "command": " ".join(["python bench/merge_baselines.py"] + argv),
              "quick": args.quick, "demo": args.demo, "preset": preset_of(args), "meta": meta, "n_seeds": len(seeds), "n_domains": len(names),
              "seeds": seeds, "domains": names, "seed_files": [seed_path(out, s).name for s in seeds],
              "config": {k: v for k, v in per_seed[0]["config"].items() if k != "seed"},
              "interval": "Student-t 95% over seeds: mean ± t(n−1)·sd/√n of the per-seed mean over domains",
              "arm_names": {"offline_kd": "per-seed files call it 'offline'"},
              # --long: issue 56's bar, the paired intervals' lower bounds >= +0.02 over both mixed RL and offline
              "summary": summary, "target": summary_target(summary, 0.02 if preset_of(args) == "long" else None),
              "per_seed_target": [r["target"] for r in per_seed],
              "total_s": sum(r["total_s"] for r in per_seed)}
    write_outputs(out, result, summary_table(summary, names, len(seeds)))  # first: an MLflow failure loses nothing
    fig = chart(summary, names)
    fig.savefig(out.with_suffix(".png"), dpi=110)
    if not args.no_mlflow:
        result["mlflow_run_id"] = log_to_mlflow(result, fig, Path(args.mlflow_root))
        out.write_text(json.dumps(result, indent=2, default=float))
        print(f"MLflow run {result['mlflow_run_id']} (experiment alloy-bench)", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result JSON (default bench/results/merge_baselines[_demo|_long].json)")
    p.add_argument("--domains", default="sort_digits,max_list:3,caesar", help="name[:difficulty],...")
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--demo", action="store_true",
                        help="configs/demo.yaml's 12 domains with the --demo defaults below (seeds 0,1,2)")
    preset.add_argument("--long", action="store_true",
                        help="configs/long.yaml's 6 domains (3 long-answer) with the --long defaults below (seeds 0-4)")
    p.add_argument("--seeds", default=None, help="comma-separated; several seeds write one file per seed "
                   "(<out>_seed<K>.json, reused when present: --fresh reruns) and a summary with 95%% intervals")
    p.add_argument("--fresh", action="store_true", help="rerun seeds whose per-seed file exists")
    p.add_argument("--rl-steps", type=int, default=None, help="PPO steps of each specialist (S; 40, --demo 50, "
                   "--long 300)")
    p.add_argument("--distill-steps", type=int, default=None, help="OPD / offline student updates (Sd; 60, --demo 144, "
                   "--long 300)")
    p.add_argument("--batch", type=int, default=64, help="prompts per step, every arm (B)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--distill-lr", type=float, default=2e-3)
    p.add_argument("--lam", type=float, default=None, help="GAE lambda (1: A = R − V, robust to a young critic; "
                   "--long 0.95, as configs/long.yaml)")
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--critic-warmup", type=int, default=None, help="critic-only first steps (3; --long 20)")
    p.add_argument("--ppo-epochs", type=int, default=None, help="optimizer steps per batch (4; --long 1)")
    p.add_argument("--n-prompts", type=int, default=2000, help="train prompts per domain")
    p.add_argument("--base-steps", type=int, default=None,
                   help="base SFT steps (150, --demo 1000: the demo's base until it stopped by score)")
    p.add_argument("--n-train", type=int, default=None, help="base SFT demonstrations per domain (1000, --demo 2000)")
    p.add_argument("--offline-sampling", choices=("greedy", "sample"), default=None,
                   help="how teachers write offline_kd's data (sample: temperature 1; --demo greedy)")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="the seed of a single-seed run (see --seeds)")
    p.add_argument("--jobs", type=int, default=2, help="workers at once")
    p.add_argument("--mlflow-root", default=str(REPO / "runs"),
                   help="runs root of the MLflow store the summary is logged to (MLFLOW_TRACKING_URI wins)")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--keep", default=None, help="keep each seed's base and specialists in KEEP/seed<K> (for "
                   "merge_levers.py; --demo: runs/merge_baselines_demo)")
    p.add_argument("--quick", action="store_true", help="2 domains, batch 8, 2 RL and 2 distill steps (a smoke run)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    add_check(p, "the written file's target.met is false (bench/README.md)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(Path(args.spec).read_text()), Path(args.result))
        return 0
    meta = start_meta()
    ppo = {"lam": 1.0, "ppo_epochs": 4, "critic_warmup": 3}
    demo = {"rl_steps": 50, "distill_steps": 144, "base_steps": 1000, "n_train": 2000, "offline_sampling": "greedy", **ppo}
    plain = {"rl_steps": 40, "distill_steps": 60, "base_steps": 150, "n_train": 1000, "offline_sampling": "sample", **ppo}
    # the long-answer specialists as configs/long.yaml trains them (4 epochs of lam 1 drove them below their base)
    presets = {"demo": demo, "long": {**demo, "rl_steps": 300, "distill_steps": 300, "lam": 0.95, "ppo_epochs": 1,
                                      "critic_warmup": 20}}
    preset = preset_of(args)
    for k, v in presets.get(preset, plain).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if preset:
        from april import demo_domains

        args.keep = args.keep or str(REPO / "runs" / f"merge_baselines_{preset}")
        args.domains = ",".join(f"{n}:{d}" for n, d in demo_domains(f"{preset}.yaml"))
    default_seeds = {"demo": [0, 1, 2], "long": [0, 1, 2, 3, 4]}.get(preset, [args.seed])
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else default_seeds
    if args.quick:
        args.domains = ",".join(args.domains.split(",")[:2])
        args.rl_steps, args.distill_steps, args.batch, args.max_new_tokens = 2, 2, 8, 8
        args.base_steps, args.n_train, args.eval_n, args.n_prompts, args.critic_warmup = 10, 100, 10, 50, 0
        args.jobs = 4
    out = Path(args.out or REPO / f"bench/results/merge_baselines{f'_{preset}' if preset else ''}.json")
    D = len(parse_domains(args.domains))
    if (D * args.rl_steps + args.distill_steps) % D:
        raise SystemExit(f"C/B = D·S + Sd = {D * args.rl_steps + args.distill_steps} must be divisible by D = {D} "
                         "(sequential RL's stages): pick --distill-steps as a multiple of the number of domains")
    import torch

    torch.set_num_threads(1)  # as every worker: two threads on two shared, busy cores mostly wait for each other
    exit_on_sigterm()
    if not args.seeds and not preset:  # one seed, one file (the 3-domain results of issue 7)
        return verdict("merge_baselines", run_seed(args, seeds[0], out, argv)["target"]["met"], args.check)
    per_seed, plan = [], plan_of(args)
    for s in seeds:
        path = seed_path(out, s)
        if path.exists() and not args.fresh:
            old = json.loads(path.read_text())
            if old.get("plan") != plan:
                diff = sorted(k for k in set(plan) | set(old.get("plan") or {})
                              if plan.get(k) != (old.get("plan") or {}).get(k))
                raise SystemExit(f"{path}: an earlier run with other settings ({', '.join(diff)}); pass --fresh to "
                                 "rerun it, or another --out")
            print(f"seed {s}: reusing {path}", file=sys.stderr)
            per_seed.append(old)
            continue
        print(f"seed {s}: running -> {path}", file=sys.stderr, flush=True)
        per_seed.append(run_seed(args, s, path, seed_argv(argv, s)))
    result = summarize_seeds(args, out, seeds, per_seed, argv, meta)
    return verdict("merge_baselines", result["target"]["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
