"""Benchmark: OPD distillation step time with N = 1, 2, 4, 6, 12 teacher servers, the same 12-domain mix at every N.

    python bench/teacher_scaling.py --out bench/results/teacher_scaling.json [--teachers 1,2,4,6,12] [--mix 12]
        [--batch 96] [--steps 30] [--warmup 3] [--rounds 2] [--max-new-tokens 16] [--quick]

Every run distills the same `--mix` domains (the first 12 plain built-ins: addition … caesar; tool_add is a tool
domain, left out; past 13, a built-in class under a new name at difficulty 2, e.g. `reverse_d2`) with the same
prompts, so the sequences, the scoring work and the student's update are the same at every N; only the number of
teacher servers they route to changes: N teachers = N embedded engine servers, domain i → server i mod N (N = 1:
all 12 domains on one server; N = 4: 3 domains each; N = 12: one per domain). The servers are launched once by
`tasks.teachers.start_teachers` (max N of them) and all hold a copy of the same tiny teacher checkpoint (the base
SFT-ed a few steps further); a run with N teachers uses N of them while the others idle (an idle server blocks on
an event; the CPU seconds the idle servers use during each run are recorded to show it). Scoring calls go per
domain (`score_batch_size` sequences at most), so the number of calls per step is the same at every N; what
changes is how many processes they fan out to.

One `student.distill_main.run_distillation` per N and round, same config (batch `--batch` prompts split evenly over
the mix, same seed, lr, max_new_tokens; trainer defaults otherwise: max_staleness 1, topk_kl top-16, score batch 32,
one torch thread per process). Target (issue 21): `ratio_12_over_1` = median step with 12 servers / with 1 ≤ 1.25.
Step time = interval between consecutive committed steps (the trainer's `on_step` hook), the first `--warmup` steps
of each run dropped; per N we report the median over all rounds and the ratio to N = 1. Rounds run the N values in
alternating order (1→12, then 12→1) because the load of the shared machine drifts. Sampled tokens per step and a
per-token ratio are reported too (the student drifts while training, so lengths may differ between runs).
`train_s_per_step` (the student update, which does not depend on N) shows external contention.

This machine has 2 cores shared with other agents: the N servers, the student's server and the trainer all share
them. `os.getloadavg()` is recorded before and after every run.

The module also holds the small harness the other benches reuse (machine info, model building, configs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from alloy.cli import env_defaults  # noqa: E402  (offline/quiet env before torch is imported)

env_defaults()

PLAIN_BUILTINS = ["addition", "subtraction", "multiplication", "max_list", "digit_sum", "binary", "reverse", "copy",
                  "sort_digits", "case_swap", "caesar", "count_char", "brackets"]
# past the 13 plain built-ins: the same class under another config name, at difficulty 2
ALIASES = [("reverse_d2", "domains.builtin.text:Reverse"), ("sort_digits_d2", "domains.builtin.text:SortDigits"),
           ("addition_d2", "domains.builtin.arithmetic:Addition"), ("copy_d2", "domains.builtin.text:Copy")]


# -- harness shared by the benches ----------------------------------------------------------------------------------
def machine_info() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}


def domain_specs(n: int) -> list[dict]:
    """n distinct domain configs (`{"name", "impl"?, "difficulty"?}`): plain built-ins first, then aliases."""
    specs = [{"name": d} for d in PLAIN_BUILTINS] + [{"name": a, "impl": impl, "difficulty": 2} for a, impl in ALIASES]
    if n > len(specs):
        raise ValueError(f"domain_specs: at most {len(specs)} distinct domains, asked for {n}")
    return specs[:n]


def build_student_and_teacher(root: Path, domains: list[str], base_steps: int, teacher_steps: int,
                              seed: int = 0) -> tuple[Path, Path]:
    """A tiny base (the student's start) and one teacher = base + `teacher_steps` more SFT steps (plain torch)."""
    from distill_fixtures import build_base, sft_plain
    from domains.registry import load_domain

    base = build_base(root, domains, base_steps, seed=seed)
    pairs = [(e.prompt, e.answer) for d in domains for e in load_domain(d).split("train", 200, seed + 1)]
    teacher = sft_plain(base, root / "teacher", pairs, teacher_steps, seed=seed + 1)
    return base, teacher


def make_cfg(root: Path, specs: list[dict], seed: int = 0, **distill):
    """An AlloyConfig for a distillation run over `specs`; `distill` overrides the `distill:` section."""
    from infra.config import config_from_dict

    train = {"lr": 1e-3, "micro_batch_size": distill.get("batch_size", 96), **distill.pop("train", {})}
    return config_from_dict({
        "run": {"name": "bench", "root": str(root), "seed": seed}, "model": {"preset": "tiny"},
        "domains": specs, "eval": {"n_eval": 20, "max_new_tokens": distill.get("max_new_tokens", 16)},
        "distill": {"eval_every": 0, "checkpoint_every": 100000, "log_every": 100000, "n_prompts_per_domain": 200,
                    "train": train, **distill}})


def tree_cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) used so far, split into `trainer` (this process: the training loop, its HTTP
    client, the weight snapshots) and `servers` (its live children: the engine servers)."""
    import psutil

    out = {"trainer": 0.0, "servers": 0.0}
    me = psutil.Process()
    for role, proc in [("trainer", me)] + [("servers", c) for c in me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            out[role] += t.user + t.system
        except psutil.Error:
            pass
    return out


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and its live children (the engine servers)."""
    return sum(tree_cpu_by_role().values())


def exit_on_sigterm() -> None:
    """SIGTERM → SystemExit, so `finally` blocks stop the engine servers this bench launched."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class StepClock:
    """`on_step` hook: wall time and process-tree CPU time between consecutive committed steps. The first interval
    starts at creation (it includes start-up) and is dropped with the warm-up. CPU seconds per step do not grow
    when other jobs steal the cores, so they show the cost of a step apart from contention."""

    def __init__(self):
        self.t = [time.perf_counter()]
        self.roles = [tree_cpu_by_role()]
        self.cpu = [sum(self.roles[0].values())]
        self.metrics: list[dict] = []

    def __call__(self, trainer, metrics: dict) -> None:
        self.t.append(time.perf_counter())
        self.roles.append(tree_cpu_by_role())
        self.cpu.append(sum(self.roles[-1].values()))
        self.metrics.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})

    def intervals(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.t, self.t[1:])][warmup:]

    def cpu_intervals(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.cpu, self.cpu[1:])][warmup:]

    def cpu_by_role_per_step(self, warmup: int) -> dict[str, float]:
        """Mean CPU seconds per step of each role after the warm-up (the profile of where a step's CPU goes)."""
        a, b = self.roles[min(warmup, len(self.roles) - 1)], self.roles[-1]
        n = max(len(self.roles) - 1 - warmup, 1)
        return {k: (b[k] - a[k]) / n for k in b}


def write_outputs(out: Path, result: dict, table_md: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result["table_md"] = table_md
    out.write_text(json.dumps(result, indent=2, default=float))
    out.with_suffix(".md").write_text(table_md + "\n")
    print(table_md)


# -- this bench -----------------------------------------------------------------------------------------------------
def server_cpu_s(urls: list[str]) -> float:
    """CPU seconds (user + system) used so far by the engine servers (children of this process) behind `urls`."""
    import psutil

    ports = {u.rsplit(":", 1)[1] for u in urls}
    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = c.cmdline()
            if "engine.server" in cmd and cmd[cmd.index("--port") + 1] in ports:
                t = c.cpu_times()
                total += t.user + t.system
        except (psutil.Error, ValueError, IndexError):
            pass
    return total


def run_one(n: int, urls: dict[str, str], base: Path, root: Path, args, rnd: int) -> dict:
    """One distillation run whose n domains route to n distinct teacher servers; returns the step-time record."""
    from infra.tracking import NoopTracker
    from student.distill_main import run_distillation
    from domains.registry import load_domains

    specs = domain_specs(args.mix)  # the same mix at every N
    names = [s["name"] for s in specs]
    servers = list(urls.values())[:n]
    teachers = {d: servers[i % n] for i, d in enumerate(names)}  # domain i → server i mod N
    assert len(set(teachers.values())) == n, f"expected {n} distinct teacher servers, got {teachers}"
    idle = [u for u in urls.values() if u not in servers]
    cfg = make_cfg(root / f"n{n}", specs, steps=args.steps, batch_size=args.batch,
                   max_new_tokens=args.max_new_tokens)
    load0, idle0 = list(os.getloadavg()), server_cpu_s(idle)
    clock = StepClock()
    summary = run_distillation(cfg, load_domains(cfg), str(base), teachers, f"file://{root}/n{n}/student",
                               root / f"n{n}" / "work", NoopTracker(), on_step=clock)
    steps = clock.intervals(args.warmup)
    tokens = [m.get("train/tokens", float("nan")) for m in clock.metrics][args.warmup:]
    lat = [v["latency_p50_s"] for v in summary["teachers"].values()]
    shutil.rmtree(root / f"n{n}", ignore_errors=True)
    cpu = clock.cpu_intervals(args.warmup)
    return {"n_teachers": n, "round": rnd, "domains": names, "routing": teachers, "step_s": steps,
            "step_s_median": statistics.median(steps), "cpu_s_per_step": cpu,
            "cpu_s_per_step_median": statistics.median(cpu), "sampled_tokens": tokens,
            "timing_s": summary["timing_s"], "wall_s": summary["wall_s"], "steps": summary["steps"],
            "train_s_per_step": summary["timing_s"]["train_s"] / max(summary["steps"], 1),
            "teacher_latency_p50_s_median": statistics.median(lat), "dropped": len(summary["dropped"]),
            "idle_servers": len(idle), "idle_servers_cpu_s": server_cpu_s(idle) - idle0,
            "loadavg_before": load0, "loadavg_after": list(os.getloadavg())}


def summarize(runs: list[dict], ns: list[int]) -> list[dict]:
    """Per N: the median over every measured step of every round, tokens per step, and the ratios to the smallest N."""
    rows = []
    for n in ns:
        rs = [r for r in runs if r["n_teachers"] == n]
        steps = [x for r in rs for x in r["step_s"]]
        tokens = [x for r in rs for x in r["sampled_tokens"]]
        med, tok = statistics.median(steps), statistics.median(tokens)
        cpu = statistics.median([x for r in rs for x in r["cpu_s_per_step"]])
        rows.append({"n_teachers": n, "step_s_median": med, "step_s_median_per_round": [r["step_s_median"] for r in rs],
                     "cpu_s_per_step_median": cpu,
                     "sampled_tokens_per_step_median": tok, "s_per_1k_tokens": 1000 * med / tok,
                     "train_s_per_step": statistics.median([r["train_s_per_step"] for r in rs]),
                     "teacher_latency_p50_s": statistics.median([r["teacher_latency_p50_s_median"] for r in rs]),
                     "idle_servers_cpu_s": sum(r["idle_servers_cpu_s"] for r in rs),
                     "loadavg_1min": [r["loadavg_after"][0] for r in rs]})
    one = rows[0]
    for r in rows:
        r["ratio_to_1"] = r["step_s_median"] / one["step_s_median"]
        r["ratio_per_token_to_1"] = r["s_per_1k_tokens"] / one["s_per_1k_tokens"]
        r["cpu_ratio_to_1"] = r["cpu_s_per_step_median"] / one["cpu_s_per_step_median"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| teachers | median step (s) | ratio to 1 | sampled tokens/step | ratio per token | "
             "median step per round (s) | CPU s/step (all processes) | CPU ratio to 1 | train part per step (s) | "
             "teacher p50 latency (s) | load avg (1 min) per round |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n_teachers']} | {r['step_s_median']:.3f} | {r['ratio_to_1']:.2f} | "
                     f"{r['sampled_tokens_per_step_median']:.0f} | {r['ratio_per_token_to_1']:.2f} | "
                     f"{', '.join(f'{x:.3f}' for x in r['step_s_median_per_round'])} | "
                     f"{r['cpu_s_per_step_median']:.3f} | "
                     f"{r['cpu_ratio_to_1']:.2f} | {r['train_s_per_step']:.3f} | "
                     f"{r['teacher_latency_p50_s']:.3f} | {', '.join(f'{x:.1f}' for x in r['loadavg_1min'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "bench/results/teacher_scaling.json"))
    p.add_argument("--teachers", default="1,2,4,6,12", help="teacher server counts N (each ≤ --mix)")
    p.add_argument("--mix", type=int, default=12, help="domains distilled at every N")
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds over every N, in alternating order")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--base-steps", type=int, default=40)
    p.add_argument("--teacher-steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="mix of 2, 1 and 2 teachers, batch 8, 3 steps, 1 round, "
                   "models built on the mix's domains only")
    args = p.parse_args(argv)
    if args.quick:
        args.teachers, args.batch, args.steps, args.warmup, args.max_new_tokens, args.rounds = "1,2", 8, 3, 1, 4, 1
        args.mix = 2
        args.base_steps, args.teacher_steps = 2, 2
    ns = sorted(int(x) for x in args.teachers.split(","))
    if max(ns) > args.mix:
        p.error(f"--teachers: N = {max(ns)} servers for a mix of {args.mix} domains leaves servers without a domain")
    if args.batch % args.mix:
        print(f"note: batch {args.batch} is not divisible by the mix of {args.mix}; domains get ±1 prompt",
              file=sys.stderr)
    import torch

    from domains.registry import load_domains
    from tasks.teachers import start_teachers

    torch.set_num_threads(1)  # the trainer process's default (distill.threads = 1); servers use 1 thread each
    exit_on_sigterm()
    t0 = time.perf_counter()
    machine = machine_info()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        root = Path(tmp)
        # the full run's models know every plain built-in; quick's barely trained ones only need the mix's domains
        model_domains = PLAIN_BUILTINS
        if args.quick:
            model_domains = [s["name"] for s in domain_specs(args.mix) if "impl" not in s]
        base, teacher = build_student_and_teacher(root / "models", model_domains, args.base_steps,
                                                  args.teacher_steps)
        # max(N) servers launched once (named after the first max(N) domains); a run with N teachers routes the mix
        # to N of them (the others idle: they block on an event, their CPU time during each run is recorded)
        specs = domain_specs(max(ns))
        names = [s["name"] for s in specs]
        cfg = make_cfg(root / "fleet", specs)
        load_domains(cfg)  # every alias must load before servers start
        t = time.perf_counter()
        fleet = start_teachers(names, {d: str(teacher) for d in names}, str(base), log_dir=root / "logs",
                               engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
        teachers_up_s = time.perf_counter() - t
        try:
            for rnd in range(args.rounds):
                for n in (ns if rnd % 2 == 0 else ns[::-1]):  # alternate the order: load drifts over time
                    runs.append(run_one(n, fleet.endpoints(), base, root, args, rnd))
                    print(f"round {rnd} N={n}: median step {runs[-1]['step_s_median']:.3f}s", file=sys.stderr,
                          flush=True)
        finally:
            fleet.stop()
    rows = summarize(runs, ns)
    r12 = next((r for r in rows if r["n_teachers"] == 12), None)
    ratio = r12["ratio_to_1"] if r12 and rows[0]["n_teachers"] == 1 else None
    command = " ".join(["python bench/teacher_scaling.py"] + (argv or sys.argv[1:]))
    result = {"bench": "teacher_scaling", "command": command,
              "quick": args.quick, "machine": machine, "loadavg_end": list(os.getloadavg()),
              "shared_machine_note": "2 cores shared with other agents' jobs; all servers and the trainer share them",
              "config": {"batch": args.batch, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                         "max_new_tokens": args.max_new_tokens, "teachers": ns, "mix": args.mix, "preset": "tiny",
                         "loss": "topk_kl", "max_staleness": 1, "threads_per_process": 1,
                         "servers_launched": len(names), "teachers_up_s": teachers_up_s},
              "ratio_12_over_1": ratio, "results": rows, "runs": runs,
              "target": {"ratio_12_over_1_max": 1.25, "ratio_12_over_1": ratio,
                         "met": (ratio <= 1.25) if ratio is not None else None},
              "total_s": time.perf_counter() - t0}
    write_outputs(Path(args.out), result, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
