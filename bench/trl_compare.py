"""Benchmark: Alloy OPD against TRL 1.16's GKDTrainer (several domains) and DistillationTrainer (one domain), at an
operating point fixed in this file before measuring (issue 21), plus a sweep over model size and response length.

    python bench/trl_compare.py --out bench/results/trl_compare.json          # the headline point, 3 seeds
    python bench/trl_compare.py --sweep --out bench/results/trl_compare_sweep.json   # presets x response lengths
    python bench/trl_compare.py --quick --out /tmp/t.json                     # smoke run (the integration test)

The headline point (the defaults): the `small` preset for the student and every teacher, 3 domains
(reverse, sort_digits, max_list), 64 prompts per step, exactly 32 new tokens per response on every side (`--force`,
the default: EOS does not stop a response — Alloy's engine gets `ignore_eos`, TRL's generation config no EOS id, and
its completion mask keeps every token — so both sides do the same work per step whatever the policy does), the
exact full-vocabulary reverse KL on both sides (Alloy: `topk_kl` with top_k = V, the vocabulary size: the tail
bucket is empty and the loss is KL(π_s‖π_T) over all V tokens, student/losses.py; TRL: beta = 1), the same number
of optimizer steps (`--steps`), seeds 0, 1, 2, TRL at the better of 1 and 2 torch threads (`--trl-threads`: each TRL
system first runs `--trl-calib-steps` steps at each count, seed 0, no evaluation; the count with more completion
tokens/s runs every seed; the trials are in `thread_trials`).

Same for every system: the student (a weak mixed-domain base) and teachers (the base SFT-ed further on one domain
each, plain torch, `build_models`), the prompts (the trainer's own seeded `PromptStream`, batch k = the k-th
`take(batch)`; the TRL trainers read them in order, no shuffling), seed, learning rate (AdamW, constant, no warm-up,
no decay, grad clip 1.0), steps, max_new_tokens, sampling temperature 1.0, fully on-policy reverse KL (beta = 1):
  - alloy        : `run_distillation`, one embedded teacher server per domain, `topk_kl` reverse with top_k = V,
                   max_staleness `--max-staleness` (1, its default: sampling of batch k+1 overlaps the update of k);
  - gkd          : `trl.experimental.gkd.GKDTrainer`, lmbda = 1, beta = 1, temperature = 1.0, with a teacher wrapper
                   that routes every row to its domain's teacher (a sub-batch forward per domain);
  - alloy_1dom   : alloy on the first domain only, one teacher (DistillationTrainer takes one teacher model);
  - trl_distill  : `trl.DistillationTrainer` on the first domain, its teacher, beta = 1, temperature = 1.0;
  - alloy_s0, alloy_1dom_s0: alloy and alloy_1dom at max_staleness 0 (fully on-policy, as TRL; `headline.staleness0`);
  - alloy_top16 (only when asked for): alloy with the pipeline's default loss, teacher top-16 + tail bucket.
Each (system, seed) runs in a fresh subprocess; the parent samples its memory every 0.2 s with psutil, the whole
process tree (Alloy's student and teacher servers are child processes): peak RSS sum and peak PSS sum.

Reported per run: completion tokens/s (sampled response tokens over the training loop's wall time; also over the
whole worker including start-up: imports, server launches, model loads), s/step, CPU seconds per completion token
over steps 2..N (every process of the system: `getrusage` of the worker + the servers' own `process_cpu_seconds`),
the phases (Alloy's own `timing_s`; TRL's by `trl_systems.phase_timers`: generate / teacher forward / the rest),
peak RSS/PSS, per-domain greedy
accuracy on the held-out eval split after training (`domains.evaluate.evaluate_model`, budget max_new_tokens), and
held-out reverse KL to the routed teacher (student samples with EOS stopping; exact per-token KL over the full
vocabulary, averaged over response tokens). Aggregates are mean ± sd over seeds. `headline`: Alloy / GKD and
alloy_1dom / DistillationTrainer in completion tokens/s, mean accuracies, and the targets (≥ 1.5x both; accuracy
no worse than the peer's minus 0.02) with met flags. The same measures of the untrained base (`init`) and of the
teachers are reported. Each Alloy process uses one torch thread (its default), several processes in parallel.

`--sweep`: the systems alloy, gkd, alloy_1dom, trl_distill (seed 0, `--sweep-steps` steps, barely trained models,
no accuracy: forced lengths make the work independent of the weights) at every preset of `--sweep-presets` and every
length of `--sweep-lengths`; TRL again at its better thread count per point. Rows go to the JSON's `sweep`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (REPO, add_check, exit_on_sigterm, make_cfg, own_cpu_s, server_cpu_s, start_meta,  # noqa: E402
                     verdict, write_outputs)
from trl_systems import cpu_window, prompt_ids, run_gkd, run_trl_distill  # noqa: E402

SYSTEMS = ("alloy", "gkd", "alloy_1dom", "trl_distill", "alloy_s0", "alloy_1dom_s0", "alloy_top16")
DEFAULT_SYSTEMS = SYSTEMS[:6]
# alloy_s0 / alloy_1dom_s0: Alloy fully on-policy (max_staleness 0: no sampling under the update, as TRL runs);
# alloy_top16: the pipeline's default loss (teacher top-16 + tail bucket) beside the exact one, for context
ALLOY_OVERRIDES = {"alloy": {}, "alloy_1dom": {}, "alloy_s0": {"max_staleness": 0},
                   "alloy_1dom_s0": {"max_staleness": 0}, "alloy_top16": {"top_k": 16}}
ONE_DOMAIN = ("alloy_1dom", "trl_distill", "alloy_1dom_s0")
TRL = ("gkd", "trl_distill")
SPEEDUP_MIN, ACCURACY_TOLERANCE = 1.5, 0.02  # issue 21's targets at the headline point


def build_models(root: Path, preset: str, domains: list[str], base_steps: int, teacher_steps: int,
                 seed: int = 0) -> tuple[Path, dict[str, Path]]:
    """A weak mixed-domain base of `preset` and {domain: teacher dir}, each teacher = base + SFT on its domain only
    (`tests/distill_fixtures.build_base_and_teachers` with a preset)."""
    import shutil

    from distill_fixtures import sft_plain
    from domains.registry import load_domain
    from infra.models import init_model_dir

    pairs = {d: [(e.prompt, e.answer) for e in load_domain(d).split("train", 400, seed)] for d in domains}
    init = init_model_dir(preset, root / "init", seed=seed)
    base = sft_plain(init, root / "base", [p for d in domains for p in pairs[d]], base_steps, seed=seed)
    teachers = {d: sft_plain(base, root / f"teacher-{d}", pairs[d], teacher_steps, seed=seed + 1) for d in domains}
    shutil.rmtree(init, ignore_errors=True)
    return base, teachers


def force_alloy_length() -> None:
    """Make Alloy's student sampling decode exactly max_new_tokens per response: `ignore_eos` on the student's
    /generate (EOS can still be sampled; it no longer ends the response), the rest of `sample_batch` unchanged."""
    import student.trainer as trainer_mod

    original = getattr(trainer_mod, "sample_batch", None)
    if original is None:
        raise RuntimeError("trl_compare --force: student.trainer.sample_batch is gone; update force_alloy_length")

    class Forced:
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        async def generate(self, input_ids, **kw):
            return await self.client.generate(input_ids, **{**kw, "ignore_eos": True, "stop_token_ids": None})

    async def sample_forced(client, items, **kw):
        return await original(Forced(client), items, **kw)

    trainer_mod.sample_batch = sample_forced


# -- measures shared by every system (run in the worker on the trained student) ------------------------------------
def heldout_rkl(student, teachers: dict, domains: dict, tok, n: int, max_new_tokens: int, seed: int = 1234) -> dict:
    """{domain: mean over response tokens of KL(π_s ‖ π_T)} on `n` eval prompts per domain (see module doc)."""
    import torch

    pad, eos = tok.pad_token_id, tok.eos_token_id
    student.eval()
    out = {}
    for d, dom in domains.items():
        rows = [prompt_ids(tok, ex.prompt) for ex in dom.split("eval", n, 0)]
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        am = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, T - len(r):], am[i, T - len(r):] = torch.tensor(r), 1
        torch.manual_seed(seed)
        with torch.no_grad():
            gen = student.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0,
                                   top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        seqs, spans = [], []
        for r, g in zip(rows, gen[:, T:].tolist()):
            resp = g[: g.index(eos) + 1] if eos in g else g
            seqs.append(r + resp)
            spans.append((len(r), len(resp)))
        # right-padded, so positions are 0..n-1 exactly as the engine and trainer see them
        L = max(map(len, seqs))
        x = torch.full((len(seqs), L), pad, dtype=torch.long)
        xm = torch.zeros_like(x)
        for i, s in enumerate(seqs):
            x[i, :len(s)], xm[i, :len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            ls = torch.log_softmax(student(input_ids=x, attention_mask=xm).logits.float(), -1)
            lt = torch.log_softmax(teachers[d](input_ids=x, attention_mask=xm).logits.float(), -1)
        kl = (ls.exp() * (ls - lt)).sum(-1)  # (B, L): KL at the position predicting token t+1
        vals = [kl[i, P - 1:P - 1 + R] for i, (P, R) in enumerate(spans) if R > 0]
        out[d] = float(torch.cat(vals).mean()) if vals else float("nan")
    return out


def accuracy(model, tok, domains: dict, n: int, max_new_tokens: int) -> dict:
    from domains.evaluate import evaluate_model

    model.eval()
    df = evaluate_model(model, tok, domains, n, 0, "bench", max_new_tokens=max_new_tokens, batch_size=128)
    return {r.domain: float(r.score) for r in df.itertuples()}


# -- the systems ----------------------------------------------------------------------------------------------------
def run_alloy(spec: dict, names: list[str], seed: int, work: Path, overrides: dict | None = None):
    from infra.models import load_model, load_tokenizer
    from infra.tracking import NoopTracker
    from student.distill_main import run_distillation
    from domains.registry import load_domains
    from tasks.teachers import start_teachers

    overrides = {"top_k": spec["top_k"], "max_staleness": spec["max_staleness"], **(overrides or {})}
    if overrides["top_k"] == "vocab":  # K = V: the tail bucket is empty, the loss is the full-vocabulary KL
        overrides["top_k"] = len(load_tokenizer(spec["base"]))
    if spec["force"]:
        force_alloy_length()
    cfg = make_cfg(work, [{"name": d} for d in names], seed=seed, steps=spec["steps"], batch_size=spec["batch"],
                   max_new_tokens=spec["max_new_tokens"], temperature=1.0, loss="topk_kl", direction="reverse",
                   n_prompts_per_domain=spec["n_prompts_per_domain"],
                   train={"lr": spec["lr"], **({"dtype": "bf16"} if spec.get("cuda") else {})}, **overrides)
    fleet = start_teachers(names, {d: spec["teachers"][d] for d in names}, spec["base"], log_dir=work / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    marks: dict[int, tuple[float, int]] = {}

    def on_step(trainer, metrics) -> None:
        # CPU of the loop after its first step (as for TRL: `cpu_marks`): this process (the trainer, every thread)
        # + what the student's rollout server and each teacher server report for themselves
        if trainer.state.step in (1, spec["steps"]):
            urls = list(fleet.endpoints().values()) + [trainer.policy.url]
            marks[trainer.state.step] = (own_cpu_s() + server_cpu_s(urls), trainer.state.sampled_tokens)

    try:
        s = run_distillation(cfg, load_domains(cfg), spec["base"], fleet.endpoints(), f"file://{work}/student",
                             work / "distill", NoopTracker(), on_step=on_step)
    finally:
        fleet.stop()
    cpu, tokens = cpu_window(marks, 1, spec["steps"], "alloy")
    return load_model(s["student_dir"]), {"train_wall_s": s["wall_s"], "steps": s["steps"], "top_k": cfg.distill.top_k,
                                          "completion_tokens": s["sampled_tokens"], "timing_s": s["timing_s"],
                                          "train_cpu_s": cpu, "cpu_tokens": tokens,
                                          "max_staleness": cfg.distill.max_staleness}


def measure(model, spec: dict, names: list[str]) -> dict:
    """Per-domain held-out accuracy and reverse KL to the routed teacher: the same code for every system."""
    import torch

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)  # the measures are not timed: every core, for every system
    model = model.float().eval()
    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    teachers = {d: load_model(spec["teachers"][d]).eval() for d in names}
    return {"accuracy": accuracy(model, tok, domains, spec["eval_n"], spec["max_new_tokens"]),
            "heldout_rkl": heldout_rkl(model, teachers, domains, tok, spec["kl_n"], spec["max_new_tokens"])}


# A parent that trained in-process (a world of one) has these in its environment, pointing at its own TCP store:
# a worker that inherited them would rendezvous there (TRL's trainers init torch.distributed: EADDRINUSE).
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "ALLOY_SELF_RENDEZVOUS")


def worker_env() -> dict[str, str]:
    """This process's environment without rendezvous variables: each worker is its own world."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}


def worker(system: str, seed: int, threads: int, spec: dict, result_path: Path) -> None:
    import torch

    exit_on_sigterm()
    t0 = time.perf_counter()
    names = spec["domains"][:1] if system in ONE_DOMAIN else list(spec["domains"])
    # TRL is one process: `threads` (1 or 2) torch threads. Alloy's trainer and servers use one each (their default).
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"trlcmp-{system}-") as tmp:
        if system in ALLOY_OVERRIDES:
            model, stats = run_alloy(spec, names, seed, Path(tmp), ALLOY_OVERRIDES[system])
        else:
            model, stats = {"gkd": run_gkd, "trl_distill": run_trl_distill}[system](spec, names, seed, Path(tmp))
        wall = time.perf_counter() - t0
        want = stats["steps"] * spec["batch"] * spec["max_new_tokens"]
        if spec["force"] and stats["completion_tokens"] != want:
            raise RuntimeError(f"{system}: --force but {stats['completion_tokens']} completion tokens, expected "
                               f"steps x batch x max_new_tokens = {want}")
        res = {"system": system, "seed": seed, "threads": threads, "domains": names, "worker_train_wall_s": wall,
               **stats, "s_per_step": stats["train_wall_s"] / max(stats["steps"], 1),
               "completion_tokens_per_s": stats["completion_tokens"] / stats["train_wall_s"],
               "completion_tokens_per_s_incl_startup": stats["completion_tokens"] / wall,
               "cpu_s_per_completion_token": stats["train_cpu_s"] / max(stats["cpu_tokens"], 1),
               **({} if spec.get("skip_eval") else measure(model, spec, names))}
    result_path.write_text(json.dumps(res, default=float))


# -- the parent -----------------------------------------------------------------------------------------------------
def run_worker(system: str, seed: int, threads: int, spec_path: Path, out_dir: Path, poll_s: float) -> dict:
    """Run one (system, seed) in a fresh process; add the peak memory of its process tree (sampled every `poll_s`
    seconds) and the load average."""
    import psutil

    tag = f"{spec_path.stem}-{system}-{seed}-t{threads}"
    res_path, log_path = out_dir / f"{tag}.json", out_dir / f"{tag}.log"
    load0 = list(os.getloadavg())
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", system, "--seed", str(seed), "--threads",
                                 str(threads), "--spec", str(spec_path), "--result", str(res_path)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(REPO), env=worker_env())
        root = psutil.Process(proc.pid)
        peak_rss = peak_pss = 0
        while proc.poll() is None:
            rss = pss = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    m = p.memory_full_info()
                    rss, pss = rss + m.rss, pss + m.pss
                except psutil.Error:
                    pass
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(poll_s)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {system} seed {seed} failed (exit {proc.returncode}); log tail:\n"
                           + log_path.read_text()[-3000:])
    res = json.loads(res_path.read_text())
    res.update(peak_rss_mb=peak_rss / 2 ** 20, peak_pss_mb=peak_pss / 2 ** 20, loadavg_before=load0,
               loadavg_after=list(os.getloadavg()))
    return res


def mean_std(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def aggregate(runs: list[dict]) -> dict:
    """Per system: mean ± sd over seeds of the speed and memory measures and (when measured) accuracy and KL."""
    out = {}
    for system in SYSTEMS:
        rs = [r for r in runs if r["system"] == system]
        if not rs:
            continue
        doms = rs[0]["domains"]
        out[system] = {k: mean_std([r[k] for r in rs]) for k in
                       ("completion_tokens_per_s", "completion_tokens_per_s_incl_startup", "s_per_step",
                        "train_cpu_s", "cpu_s_per_completion_token", "peak_rss_mb", "peak_pss_mb")}
        out[system]["threads"] = rs[0]["threads"]
        if "accuracy" not in rs[0]:
            continue
        out[system]["accuracy"] = {d: mean_std([r["accuracy"][d] for r in rs]) for d in doms}
        out[system]["accuracy_mean"] = mean_std([statistics.fmean(r["accuracy"].values()) for r in rs])
        out[system]["heldout_rkl"] = {d: mean_std([r["heldout_rkl"][d] for r in rs]) for d in doms}
        out[system]["heldout_rkl_mean"] = mean_std([statistics.fmean(r["heldout_rkl"].values()) for r in rs])
    return out


def speedup(agg: dict, a: str, b: str, key: str = "completion_tokens_per_s") -> float | None:
    return agg[a][key]["mean"] / agg[b][key]["mean"] if a in agg and b in agg else None


def headline(agg: dict, init: dict | None = None) -> dict:
    """Issue 21's pre-registered comparison: Alloy / GKD (3 domains) and alloy_1dom / DistillationTrainer (1 domain,
    which takes one teacher) in completion tokens/s, and mean accuracies; met = ≥ 1.5x and accuracy ≥ peer − 0.02.
    `accuracy_base`: the untrained base's mean accuracy (`init`). `staleness0`: the same keys with Alloy fully
    on-policy (alloy_s0, alloy_1dom_s0), when those ran."""
    acc = {s: agg[s]["accuracy_mean"]["mean"] if "accuracy_mean" in agg.get(s, {}) else None for s in SYSTEMS}
    base = statistics.fmean(init["accuracy"].values()) if init and "accuracy" in init else None
    h = {"speedup_vs_gkd": speedup(agg, "alloy", "gkd"), "speedup_vs_distillation": speedup(agg, "alloy_1dom",
                                                                                           "trl_distill"),
         "speedup_incl_startup_vs_gkd": speedup(agg, "alloy", "gkd", "completion_tokens_per_s_incl_startup"),
         "speedup_incl_startup_vs_distillation": speedup(agg, "alloy_1dom", "trl_distill",
                                                         "completion_tokens_per_s_incl_startup"),
         "accuracy_alloy": acc["alloy"], "accuracy_gkd": acc["gkd"], "accuracy_alloy_1dom": acc["alloy_1dom"],
         "accuracy_distillation": acc["trl_distill"], "accuracy_base": base,
         "trl_threads": {s: agg[s]["threads"] for s in TRL if s in agg},
         "targets": {"speedup_min": SPEEDUP_MIN, "accuracy_tolerance": ACCURACY_TOLERANCE,
                     "pairs": "alloy vs gkd (3 domains), alloy_1dom vs trl_distill (1 domain)"}}

    def ok(x, y, f):
        return None if x is None or y is None else bool(f(x, y))

    def met_of(alloy: str, alloy_1dom: str, x: dict) -> dict:
        m = {"speedup_vs_gkd": ok(x["speedup_vs_gkd"], SPEEDUP_MIN, float.__ge__),
             "speedup_vs_distillation": ok(x["speedup_vs_distillation"], SPEEDUP_MIN, float.__ge__),
             "accuracy_vs_gkd": ok(acc[alloy], acc["gkd"], lambda a, b: a >= b - ACCURACY_TOLERANCE),
             "accuracy_vs_distillation": ok(acc[alloy_1dom], acc["trl_distill"],
                                            lambda a, b: a >= b - ACCURACY_TOLERANCE)}
        m["all"] = None if None in m.values() else all(m.values())
        return m

    h["met"] = met_of("alloy", "alloy_1dom", h)
    if "alloy_s0" in agg or "alloy_1dom_s0" in agg:
        s0 = {"speedup_vs_gkd": speedup(agg, "alloy_s0", "gkd"),
              "speedup_vs_distillation": speedup(agg, "alloy_1dom_s0", "trl_distill"),
              "accuracy_alloy": acc["alloy_s0"], "accuracy_gkd": acc["gkd"], "accuracy_alloy_1dom": acc["alloy_1dom_s0"],
              "accuracy_distillation": acc["trl_distill"], "accuracy_base": base}
        h["staleness0"] = s0 | {"met": met_of("alloy_s0", "alloy_1dom_s0", s0)}
    return h


def run_point(spec: dict, root: Path, name: str, systems: list[str], seeds: list[int], trl_threads: list[int],
              jobs: int, calib_steps: int) -> tuple[list[dict], list[dict]]:
    """Every (system, seed) of one operating point. With several counts in `trl_threads`, each TRL system first
    runs `calib_steps` steps (seed 0, no evaluation) at every count, and the count with the higher completion
    tokens/s runs every seed. Returns (runs, thread_trials)."""

    def go(tag: str, spec_: dict, jobs_: list[tuple[str, int, int]]) -> list[dict]:
        spec_path = root / f"{tag}.json"
        spec_path.write_text(json.dumps(spec_))
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # each worker is measured as its own process tree
            out = list(pool.map(lambda j: run_worker(j[0], j[1], j[2], spec_path, root,
                                                     spec_["mem_poll_s"]), jobs_))
        for r in out:
            print(f"{tag} {r['system']} seed {r['seed']} threads {r['threads']}: "
                  f"{r['completion_tokens_per_s']:.0f} tok/s, {r['s_per_step']:.3f} s/step, "
                  f"acc {r.get('accuracy')}", file=sys.stderr, flush=True)
        return out

    trl = [s for s in systems if s in TRL]
    trials, best = [], {s: trl_threads[0] for s in trl}
    if len(trl_threads) > 1 and trl:
        trials = go(f"{name}-threads", spec | {"steps": calib_steps, "skip_eval": True},
                    [(s, seeds[0], t) for s in trl for t in trl_threads])
        for s in trl:
            mine = [r for r in trials if r["system"] == s]
            best[s] = max(mine, key=lambda r: r["completion_tokens_per_s"])["threads"]
    runs = go(name, spec, [(s, seed, best.get(s, 1)) for seed in seeds for s in systems])
    return runs, [{k: r[k] for k in ("system", "seed", "threads", "steps", "completion_tokens_per_s", "s_per_step")}
                  for r in trials]


def table(agg: dict, init: dict) -> str:
    def ms(x, f="{:.1f}"):
        return (f + " ± " + f).format(x["mean"], x["std"])

    lines = ["| system | domains | torch threads | completion tok/s | tok/s incl. start-up | s/step | "
             "CPU ms / completion token | peak RSS MB (tree) | peak PSS MB | accuracy (mean) | "
             "held-out reverse KL (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, a in agg.items():
        cpu_ms = {k: v * 1000 if k != "n" else v for k, v in a["cpu_s_per_completion_token"].items()}
        lines.append(f"| {s} | {len(a['accuracy'])} | {a['threads']} | {ms(a['completion_tokens_per_s'])} | "
                     f"{ms(a['completion_tokens_per_s_incl_startup'])} | {ms(a['s_per_step'], '{:.3f}')} | "
                     f"{ms(cpu_ms, '{:.3f}')} | "
                     f"{ms(a['peak_rss_mb'], '{:.0f}')} | {ms(a['peak_pss_mb'], '{:.0f}')} | "
                     f"{ms(a['accuracy_mean'], '{:.3f}')} | {ms(a['heldout_rkl_mean'], '{:.3f}')} |")
    lines.append(f"| init (base, untrained) | {len(init['accuracy'])} | | | | | | | | "
                 f"{statistics.fmean(init['accuracy'].values()):.3f} | "
                 f"{statistics.fmean(init['heldout_rkl'].values()):.3f} |")
    lines += ["", "| system | " + " | ".join(f"acc {d}" for d in init["accuracy"]) + " | "
              + " | ".join(f"rKL {d}" for d in init["heldout_rkl"]) + " |",
              "|---|" + "---|" * (2 * len(init["accuracy"]))]
    for s, a in list(agg.items()) + [("init", None)]:
        if a is None:
            acc = [f"{init['accuracy'][d]:.3f}" for d in init["accuracy"]]
            kl = [f"{init['heldout_rkl'][d]:.3f}" for d in init["heldout_rkl"]]
        else:
            acc = [ms(a["accuracy"][d], "{:.3f}") if d in a["accuracy"] else "–" for d in init["accuracy"]]
            kl = [ms(a["heldout_rkl"][d], "{:.3f}") if d in a["heldout_rkl"] else "–" for d in init["heldout_rkl"]]
        lines.append(f"| {s} | " + " | ".join(acc + kl) + " |")
    return "\n".join(lines)


def headline_md(h: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    m = h["met"]
    return (f"Headline: Alloy / GKD **{f(h['speedup_vs_gkd'])}x** (met: {m['speedup_vs_gkd']}), alloy_1dom / "
            f"DistillationTrainer **{f(h['speedup_vs_distillation'])}x** (met: {m['speedup_vs_distillation']}); "
            f"incl. start-up {f(h['speedup_incl_startup_vs_gkd'])}x / {f(h['speedup_incl_startup_vs_distillation'])}x."
            f" Accuracy alloy {f(h['accuracy_alloy'], '{:.3f}')} vs gkd {f(h['accuracy_gkd'], '{:.3f}')} (met: "
            f"{m['accuracy_vs_gkd']}), alloy_1dom {f(h['accuracy_alloy_1dom'], '{:.3f}')} vs distillation "
            f"{f(h['accuracy_distillation'], '{:.3f}')} (met: {m['accuracy_vs_distillation']}), untrained base "
            f"{f(h['accuracy_base'], '{:.3f}')}. TRL threads: {h['trl_threads']}."
            + (f" Alloy at max_staleness 0: / GKD {f(h['staleness0']['speedup_vs_gkd'])}x, alloy_1dom_s0 / "
               f"DistillationTrainer {f(h['staleness0']['speedup_vs_distillation'])}x, accuracy "
               f"{f(h['staleness0']['accuracy_alloy'], '{:.3f}')} / {f(h['staleness0']['accuracy_alloy_1dom'], '{:.3f}')}"
               f" (met: {h['staleness0']['met']['all']})." if "staleness0" in h else "") + "\n\n")


def sweep_table(rows: list[dict]) -> str:
    lines = ["| preset | new tokens | alloy tok/s | gkd tok/s (threads) | alloy / gkd | alloy_1dom tok/s | "
             "trl_distill tok/s (threads) | alloy_1dom / distill | alloy / gkd incl. start-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["aggregate"]

        def tps(s):
            return f"{a[s]['completion_tokens_per_s']['mean']:.0f}" if s in a else "–"

        def th(s):
            return f" ({a[s]['threads']})" if s in a else ""

        def x(v):
            return "–" if v is None else f"{v:.2f}"
        lines.append(f"| {r['preset']} | {r['max_new_tokens']} | {tps('alloy')} | {tps('gkd')}{th('gkd')} | "
                     f"{x(r['speedup_vs_gkd'])} | {tps('alloy_1dom')} | {tps('trl_distill')}{th('trl_distill')} | "
                     f"{x(r['speedup_vs_distillation'])} | {x(r['speedup_incl_startup_vs_gkd'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help="default bench/results/trl_compare.json (--sweep: trl_compare_sweep.json)")
    p.add_argument("--preset", default="small", help="model preset of the student and every teacher (infra/models.py)")
    p.add_argument("--domains", default="reverse,sort_digits,max_list")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"any of {','.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps, the same for every system")
    p.add_argument("--batch", type=int, default=64, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--force", action=argparse.BooleanOptionalAction, default=True,
                   help="exactly max_new_tokens per response on every side (EOS does not stop); --no-force: EOS stops")
    p.add_argument("--top-k", default="vocab", help="Alloy's teacher top-k: 'vocab' (= V, the exact KL) or an int")
    p.add_argument("--max-staleness", type=int, default=1, help="Alloy's distill.max_staleness")
    p.add_argument("--trl-threads", default="1,2", help="torch thread counts tried for TRL (the faster one is kept)")
    p.add_argument("--trl-calib-steps", type=int, default=10, help="steps of each TRL thread-count trial")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--kl-n", type=int, default=50)
    p.add_argument("--base-steps", type=int, default=60)
    p.add_argument("--teacher-steps", type=int, default=200)
    p.add_argument("--sweep", action="store_true", help="the preset x length sweep instead of the headline point")
    p.add_argument("--sweep-presets", default="nano,tiny,small,base")
    p.add_argument("--sweep-lengths", default="8,32,128")
    p.add_argument("--sweep-steps", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="first 2 domains, 1 seed, 2 steps, batch 6, tiny preset, "
                   "2 TRL threads, barely trained models, memory sampled every 1 s, OpenMP threads wait passively "
                   "(a smoke run; with --sweep: nano, lengths 4 and 8)")
    p.add_argument("--jobs", type=int, default=1, help="workers at once (1 for timing; --quick runs all at once)")
    p.add_argument("--mem-poll-s", type=float, default=0.2,
                   help="interval of the parent's memory sampling of each worker's process tree (--quick: 1.0)")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    add_check(p, "headline `met.all`: Alloy / GKD and alloy_1dom / DistillationTrainer >= 1.5x in completion "
              "tokens/s, accuracy >= the peer's - 0.02; --sweep has no target")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, args.threads, json.loads(Path(args.spec).read_text()), Path(args.result))
        return 0
    meta = start_meta()
    if args.quick:
        args.seeds, args.steps, args.batch, args.max_new_tokens, args.eval_n, args.kl_n = "0", 2, 6, 4, 6, 4
        args.domains, args.preset, args.trl_threads = ",".join(args.domains.split(",")[:2]), "tiny", "2"
        args.jobs = len(args.systems.split(","))  # a smoke run: its timings mean nothing, so overlap the start-ups
        args.base_steps, args.teacher_steps = 2, 2
        args.sweep_presets, args.sweep_lengths, args.sweep_steps = "nano", "4,8", 3
        args.mem_poll_s = 1.0  # each psutil sample reads every tree process's smaps: ~2 ms of CPU per process
        # The 2-thread TRL workers (and every worker's evaluation) run beside ~8 other processes on 2 cores: OpenMP's
        # default spin-wait between parallel regions burns CPU the others need. Timings mean nothing here; set before
        # torch is imported, inherited by the workers and their servers.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = Path(args.out or REPO / f"bench/results/trl_compare{'_sweep' if args.sweep else ''}.json")
    t0 = time.perf_counter()
    names = args.domains.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = args.systems.split(",")
    trl_threads = [int(t) for t in args.trl_threads.split(",")]
    top_k = args.top_k if args.top_k == "vocab" else int(args.top_k)
    common = {"domains": names, "batch": args.batch, "lr": args.lr, "n_prompts_per_domain": 200, "force": args.force,
              "top_k": top_k, "max_staleness": args.max_staleness, "eval_n": args.eval_n, "kl_n": args.kl_n,
              "mem_poll_s": args.mem_poll_s}
    result = {"bench": "trl_compare", "command": " ".join(["python bench/trl_compare.py"] + (argv or sys.argv[1:])),
              "quick": args.quick, "meta": meta,
              "shared_machine_note": "2 cores, possibly shared with other jobs; per-run load averages in runs[]"}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        root = Path(tmp)
        if args.sweep:
            rows = []
            for preset in args.sweep_presets.split(","):
                # speed only: lengths are forced, so barely trained models do the same work per step as trained ones
                base, teachers = build_models(root / preset, preset, names, 2, 2)
                for L in (int(x) for x in args.sweep_lengths.split(",")):
                    spec = common | {"base": str(base), "teachers": {d: str(p) for d, p in teachers.items()},
                                     "steps": args.sweep_steps, "max_new_tokens": L, "skip_eval": True}
                    runs, trials = run_point(spec, root, f"{preset}-L{L}", ["alloy", "gkd", "alloy_1dom",
                                                                            "trl_distill"], [0], trl_threads, args.jobs,
                                             args.trl_calib_steps)
                    agg = aggregate(runs)
                    h = headline(agg)
                    rows.append({"preset": preset, "max_new_tokens": L, "aggregate": agg, "runs": runs,
                                 "thread_trials": trials} | {k: h[k] for k in (
                                     "speedup_vs_gkd", "speedup_vs_distillation", "speedup_incl_startup_vs_gkd",
                                     "speedup_incl_startup_vs_distillation")})
            result |= {"config": common | {"presets": args.sweep_presets.split(","), "steps": args.sweep_steps,
                                           "lengths": [r["max_new_tokens"] for r in rows], "trl_threads": trl_threads},
                       "sweep": rows, "total_s": time.perf_counter() - t0}
            write_outputs(out, result, sweep_table(rows))
            return verdict("trl_compare", None, args.check, has_target=False)
        base, teachers = build_models(root / "models", args.preset, names, args.base_steps, args.teacher_steps)
        spec = common | {"base": str(base), "teachers": {d: str(p) for d, p in teachers.items()}, "steps": args.steps,
                         "max_new_tokens": args.max_new_tokens}
        from infra.models import load_model

        init = {"system": "init", **measure(load_model(base), spec, names)}
        teacher_acc = {d: accuracy(load_model(teachers[d]), *_tok_doms(spec, [d]), spec["eval_n"],
                                   spec["max_new_tokens"])[d] for d in names}
        runs, trials = run_point(spec, root, "headline", systems, seeds, trl_threads, args.jobs, args.trl_calib_steps)
    agg = aggregate(runs)
    h = headline(agg, init)
    h["point"] = {"preset": args.preset, "domains": names, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                  "forced_length": args.force, "alloy_top_k": runs[0].get("top_k"), "steps": args.steps,
                  "seeds": seeds, "max_staleness": args.max_staleness}
    result |= {"config": common | {"preset": args.preset, "steps": args.steps, "max_new_tokens": args.max_new_tokens,
                                   "seeds": seeds, "systems": systems, "jobs": args.jobs, "trl_threads": trl_threads,
                                   "trl_calib_steps": args.trl_calib_steps,
                                   "base_steps": args.base_steps, "teacher_steps": args.teacher_steps},
               "headline": h, "init": init, "teacher_accuracy": teacher_acc, "runs": runs, "thread_trials": trials,
               "aggregate": agg, "total_s": time.perf_counter() - t0}
    write_outputs(out, result, headline_md(h) + table(agg, init))
    return verdict("trl_compare", h["met"]["all"], args.check)


def _tok_doms(spec: dict, names: list[str]) -> tuple:
    from domains.registry import load_domain
    from infra.models import load_tokenizer

    return load_tokenizer(spec["base"]), {d: load_domain(d) for d in names}


if __name__ == "__main__":
    sys.exit(main())
