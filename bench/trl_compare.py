"""Benchmark: Alloy OPD against TRL 1.16's GKDTrainer (several domains) and DistillationTrainer (one domain).

    python bench/trl_compare.py --out bench/results/trl_compare.json [--domains reverse,sort_digits,max_list]
        [--seeds 0,1,2] [--steps 120] [--batch 48] [--max-new-tokens 8] [--lr 3e-3] [--quick]

Same for every system: the tiny student (a weak mixed-domain base) and teachers (the base SFT-ed further on one
domain each, `tests/distill_fixtures.build_base_and_teachers`), the prompts (the trainer's own seeded
`PromptStream`, batch k = the k-th `take(batch)`; the TRL trainers read them in order, no shuffling), seed,
learning rate (AdamW, constant, no warm-up, no decay, grad clip 1.0), steps, max_new_tokens, sampling temperature
1.0, fully on-policy divergence of the student from the teacher with beta = 1 (reverse KL):
  - alloy        : `run_distillation`, one embedded teacher server per domain, loss topk_kl (teacher top-16 + tail
                   bucket), direction reverse, trainer defaults otherwise (max_staleness 1: sampling of batch k+1
                   overlaps the update of batch k);
  - gkd          : `trl.experimental.gkd.GKDTrainer`, lmbda = 1, beta = 1, temperature = 1.0, with a teacher wrapper
                   that routes every row to its domain's teacher (a sub-batch forward per domain);
  - alloy_1dom   : alloy on the first domain only, one teacher;
  - alloy_1dom_exact (only when asked for): alloy_1dom with TRL's exact objective, teacher top-k = the whole
                   vocabulary and max_staleness 0 (fully on-policy);
  - trl_distill  : `trl.DistillationTrainer` on the first domain, its teacher, beta = 1, temperature = 1.0.
Each (system, seed) runs in a fresh subprocess; the parent samples its memory every 0.2 s with psutil, the whole
process tree (Alloy's student and teacher servers are child processes): peak RSS sum and peak PSS sum (PSS splits
shared pages between processes, so it does not count the torch libraries once per process).

Reported per run: completion tokens/s (sampled response tokens, EOS included, over the training loop's wall time;
also over the whole worker including start-up), s/step, peak RSS/PSS, per-domain greedy accuracy on the held-out
eval split after training (`domains.evaluate.evaluate_model`), and held-out reverse KL to the routed teacher: for
`--kl-n` eval prompts per domain the student samples a response (temperature 1, fixed seed), and the exact
per-token KL(π_s ‖ π_T) = Σ_v π_s(v) (log π_s(v) − log π_T(v)) is averaged over the response tokens. The same
measures of the untrained base are reported as `init`. TRL runs with torch threads = CPU count (one process);
each Alloy process uses one thread (its default), several processes in parallel. The machine is shared with other
agents: the JSON records os.getloadavg() around every run.
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
from teacher_scaling import REPO, exit_on_sigterm, machine_info, make_cfg, write_outputs  # noqa: E402

SYSTEMS = ("alloy", "gkd", "alloy_1dom", "trl_distill", "alloy_1dom_exact")
# alloy_1dom_exact: Alloy with TRL's exact objective (teacher top-k = the whole vocabulary, fully on-policy), to
# separate what the loss's top-k truncation and the one-step staleness cost from what the system costs
ALLOY_OVERRIDES = {"alloy": {}, "alloy_1dom": {}, "alloy_1dom_exact": {"top_k": "vocab", "max_staleness": 0}}
ONE_DOMAIN = ("alloy_1dom", "trl_distill", "alloy_1dom_exact")


# -- measures shared by every system (run in the worker on the trained student) ------------------------------------
def prompt_ids(tok, prompt: str) -> list[int]:
    return [tok.bos_token_id] + tok(prompt, add_special_tokens=False).input_ids


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


def prompt_rows(domains: dict, tok, spec: dict, seed: int) -> list:
    """The exact prompt sequence Alloy's trainer draws: `steps` takes of `batch` from its seeded PromptStream."""
    from student.sampler import PromptStream

    stream = PromptStream(domains, tok, spec["n_prompts_per_domain"], seed)
    return [it for _ in range(spec["steps"]) for it in stream.take(spec["batch"])]


def trl_args(cls, spec: dict, seed: int, out_dir: Path, **extra):
    return cls(output_dir=str(out_dir), per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
               max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
               weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=seed, report_to="none",
               save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True, use_cpu=True, bf16=False,
               dataloader_num_workers=0, **extra)


# -- the systems ----------------------------------------------------------------------------------------------------
def run_alloy(spec: dict, names: list[str], seed: int, work: Path, overrides: dict | None = None):
    from infra.models import load_model, load_tokenizer
    from infra.tracking import NoopTracker
    from student.distill_main import run_distillation
    from domains.registry import load_domains
    from tasks.teachers import start_teachers

    overrides = dict(overrides or {})
    if overrides.get("top_k") == "vocab":  # K = V: the tail bucket is empty, the loss is the full-vocabulary KL
        overrides["top_k"] = len(load_tokenizer(spec["base"]))
    cfg = make_cfg(work, [{"name": d} for d in names], seed=seed, steps=spec["steps"], batch_size=spec["batch"],
                   max_new_tokens=spec["max_new_tokens"], temperature=1.0, loss="topk_kl", direction="reverse",
                   n_prompts_per_domain=spec["n_prompts_per_domain"], train={"lr": spec["lr"]}, **overrides)
    fleet = start_teachers(names, {d: spec["teachers"][d] for d in names}, spec["base"], log_dir=work / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    try:
        s = run_distillation(cfg, load_domains(cfg), spec["base"], fleet.endpoints(), f"file://{work}/student",
                             work / "distill", NoopTracker())
    finally:
        fleet.stop()
    return load_model(s["student_dir"]), {"train_wall_s": s["wall_s"], "steps": s["steps"],
                                          "completion_tokens": s["sampled_tokens"], "timing_s": s["timing_s"]}


def run_gkd(spec: dict, names: list[str], seed: int, work: Path):
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers.modeling_outputs import CausalLMOutput
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    rows = [{"prompt_ids": it.prompt_ids, "domain_idx": names.index(it.domain)}
            for it in prompt_rows(domains, tok, spec, seed)]

    class RoutedTeacher(torch.nn.Module):
        """One teacher per domain; row b goes to teachers[route[b]] (set by the trainer before each forward)."""

        def __init__(self, teachers):
            super().__init__()
            self.teachers = torch.nn.ModuleList(teachers)
            self.config = teachers[0].config
            self.route = None

        def forward(self, input_ids, attention_mask):
            logits = None
            for k, t in enumerate(self.teachers):
                rows_k = (self.route == k).nonzero().squeeze(-1)
                if rows_k.numel() == 0:
                    continue
                lk = t(input_ids=input_ids[rows_k], attention_mask=attention_mask[rows_k]).logits
                if logits is None:
                    logits = lk.new_zeros(input_ids.shape + (lk.shape[-1],))
                logits[rows_k] = lk
            return CausalLMOutput(logits=logits)

    def collate(batch):
        pid = [b["prompt_ids"] for b in batch]
        T = max(map(len, pid))
        ids = torch.full((len(pid), T), tok.pad_token_id, dtype=torch.long)
        am = torch.zeros_like(ids)
        for i, r in enumerate(pid):  # left-padded prompts for generate
            ids[i, T - len(r):], am[i, T - len(r):] = torch.tensor(r), 1
        # no "labels": GKD makes them after generation; with labels of prompts only, num_items_in_batch would be 0
        return {"prompts": ids, "prompt_attention_mask": am, "input_ids": ids.clone(), "attention_mask": am.clone(),
                "domain_idx": torch.tensor([b["domain_idx"] for b in batch])}

    class RoutedGKD(GKDTrainer):
        completion_tokens = 0

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.accelerator.unwrap_model(self.teacher_model).route = inputs["domain_idx"]
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.completion_tokens += int((inputs["labels"] != -100).sum())  # generated tokens up to EOS
            return loss

    student = load_model(spec["base"])
    teacher = RoutedTeacher([load_model(spec["teachers"][d]) for d in names])
    args = trl_args(GKDConfig, spec, seed, work / "gkd", lmbda=1.0, beta=1.0, temperature=1.0,
                    max_new_tokens=spec["max_new_tokens"], disable_dropout=True)
    trainer = RoutedGKD(model=student, teacher_model=teacher, args=args, data_collator=collate,
                        train_dataset=Dataset.from_list(rows), processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    return trainer.model, {"train_wall_s": wall, "steps": trainer.state.global_step,
                           "completion_tokens": trainer.completion_tokens}


def run_trl_distill(spec: dict, names: list[str], seed: int, work: Path):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    rows = [{"prompt": it.example.prompt} for it in prompt_rows(domains, tok, spec, seed)]
    # the tokenizer adds BOS itself: tok(text=p) == [bos] + chars == Alloy's prompt ids
    assert tok(text=[rows[0]["prompt"]])["input_ids"][0] == prompt_ids(tok, rows[0]["prompt"])

    class CountingDistill(DistillationTrainer):
        completion_tokens = 0

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.completion_tokens += int(out["completion_mask"].sum())
            return out

    args = trl_args(DistillationConfig, spec, seed, work / "dt", beta=1.0, temperature=1.0, top_k=0, top_p=1.0,
                    max_completion_length=spec["max_new_tokens"], shuffle_dataset=False,
                    gradient_checkpointing=False, disable_dropout=True)
    trainer = CountingDistill(model=load_model(spec["base"]), teacher_model=load_model(spec["teachers"][names[0]]),
                              args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    return trainer.model, {"train_wall_s": wall, "steps": trainer.state.global_step,
                           "completion_tokens": trainer.completion_tokens}


def measure(model, spec: dict, names: list[str]) -> dict:
    """Per-domain held-out accuracy and reverse KL to the routed teacher: the same code for every system."""
    import torch

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    torch.set_num_threads(spec["trl_threads"])
    model = model.float().eval()
    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    teachers = {d: load_model(spec["teachers"][d]).eval() for d in names}
    return {"accuracy": accuracy(model, tok, domains, spec["eval_n"], spec["max_new_tokens"]),
            "heldout_rkl": heldout_rkl(model, teachers, domains, tok, spec["kl_n"], spec["max_new_tokens"])}


def worker(system: str, seed: int, spec: dict, result_path: Path) -> None:
    import torch

    exit_on_sigterm()
    t0 = time.perf_counter()
    names = spec["domains"][:1] if system in ONE_DOMAIN else list(spec["domains"])
    # TRL is one process: it gets every core. Alloy's trainer and servers use one thread each (their default).
    torch.set_num_threads(1 if system.startswith("alloy") else spec["trl_threads"])
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"trlcmp-{system}-") as tmp:
        if system in ALLOY_OVERRIDES:
            model, stats = run_alloy(spec, names, seed, Path(tmp), ALLOY_OVERRIDES[system])
        else:
            model, stats = {"gkd": run_gkd, "trl_distill": run_trl_distill}[system](spec, names, seed, Path(tmp))
        wall = time.perf_counter() - t0
        res = {"system": system, "seed": seed, "domains": names, "worker_train_wall_s": wall, **stats,
               "s_per_step": stats["train_wall_s"] / max(stats["steps"], 1),
               "completion_tokens_per_s": stats["completion_tokens"] / stats["train_wall_s"],
               "completion_tokens_per_s_incl_startup": stats["completion_tokens"] / wall,
               **measure(model, spec, names)}
    result_path.write_text(json.dumps(res, default=float))


# -- the parent -----------------------------------------------------------------------------------------------------
def run_worker(system: str, seed: int, spec_path: Path, out_dir: Path) -> dict:
    """Run one (system, seed) in a fresh process; add the peak memory of its process tree and the load average."""
    import psutil

    res_path = out_dir / f"{system}-{seed}.json"
    log_path = out_dir / f"{system}-{seed}.log"
    load0 = list(os.getloadavg())
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", system, "--seed", str(seed), "--spec",
                                 str(spec_path), "--result", str(res_path)], stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(REPO))
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
            time.sleep(0.2)
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
    out = {}
    for system in SYSTEMS:
        rs = [r for r in runs if r["system"] == system]
        if not rs:
            continue
        doms = rs[0]["domains"]
        out[system] = {k: mean_std([r[k] for r in rs]) for k in
                       ("completion_tokens_per_s", "completion_tokens_per_s_incl_startup", "s_per_step",
                        "peak_rss_mb", "peak_pss_mb")}
        out[system]["accuracy"] = {d: mean_std([r["accuracy"][d] for r in rs]) for d in doms}
        out[system]["accuracy_mean"] = mean_std([statistics.fmean(r["accuracy"].values()) for r in rs])
        out[system]["heldout_rkl"] = {d: mean_std([r["heldout_rkl"][d] for r in rs]) for d in doms}
        out[system]["heldout_rkl_mean"] = mean_std([statistics.fmean(r["heldout_rkl"].values()) for r in rs])
    return out


def table(agg: dict, init: dict) -> str:
    def ms(x, f="{:.1f}"):
        return (f + " ± " + f).format(x["mean"], x["std"])

    lines = ["| system | domains | completion tok/s | tok/s incl. start-up | s/step | peak RSS MB (tree) | "
             "peak PSS MB | accuracy (mean) | held-out reverse KL (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for s, a in agg.items():
        lines.append(f"| {s} | {len(a['accuracy'])} | {ms(a['completion_tokens_per_s'])} | "
                     f"{ms(a['completion_tokens_per_s_incl_startup'])} | {ms(a['s_per_step'], '{:.3f}')} | "
                     f"{ms(a['peak_rss_mb'], '{:.0f}')} | {ms(a['peak_pss_mb'], '{:.0f}')} | "
                     f"{ms(a['accuracy_mean'], '{:.3f}')} | {ms(a['heldout_rkl_mean'], '{:.3f}')} |")
    lines.append(f"| init (base, untrained) | {len(init['accuracy'])} | | | | | | "
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "bench/results/trl_compare.json"))
    p.add_argument("--domains", default="reverse,sort_digits,max_list")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]), help=f"any of {','.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--kl-n", type=int, default=50)
    p.add_argument("--base-steps", type=int, default=60)
    p.add_argument("--teacher-steps", type=int, default=200)
    p.add_argument("--quick", action="store_true",
                   help="first 2 domains, 1 seed, 4 steps, batch 6, barely trained models (a smoke run)")
    p.add_argument("--jobs", type=int, default=1, help="workers at once (1 for timing; --quick runs all at once)")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, json.loads(Path(args.spec).read_text()), Path(args.result))
        return 0
    if args.quick:
        args.seeds, args.steps, args.batch, args.max_new_tokens, args.eval_n, args.kl_n = "0", 4, 6, 4, 6, 4
        args.domains = ",".join(args.domains.split(",")[:2])
        args.jobs = len(args.systems.split(","))  # a smoke run: its timings mean nothing, so overlap the start-ups
        args.base_steps, args.teacher_steps = 2, 2
    from distill_fixtures import build_base_and_teachers

    t0 = time.perf_counter()
    names = args.domains.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = args.systems.split(",")
    machine = machine_info()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        root = Path(tmp)
        base, teachers = build_base_and_teachers(root / "models", names, args.base_steps, args.teacher_steps)
        spec = {"base": str(base), "teachers": {d: str(p) for d, p in teachers.items()}, "domains": names,
                "steps": args.steps, "batch": args.batch, "max_new_tokens": args.max_new_tokens, "lr": args.lr,
                "n_prompts_per_domain": 200, "eval_n": args.eval_n, "kl_n": args.kl_n,
                "trl_threads": os.cpu_count() or 1}
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        from infra.models import load_model

        init = {"system": "init", **measure(load_model(base), spec, names)}
        jobs = [(system, seed) for seed in seeds for system in systems]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each worker is measured as its own process tree
            for r in pool.map(lambda job: run_worker(job[0], job[1], spec_path, root), jobs):
                runs.append(r)
                system, seed = r["system"], r["seed"]
                print(f"{system} seed {seed}: {r['completion_tokens_per_s']:.0f} tok/s, {r['s_per_step']:.3f} s/step, "
                      f"acc {r['accuracy']}, rkl {r['heldout_rkl']}", file=sys.stderr, flush=True)
    agg = aggregate(runs)
    ratios = {}
    if "alloy" in agg and "gkd" in agg:
        ratios["alloy_vs_gkd_tokens_per_s"] = (agg["alloy"]["completion_tokens_per_s"]["mean"]
                                               / agg["gkd"]["completion_tokens_per_s"]["mean"])
    if "alloy_1dom_exact" in agg and "trl_distill" in agg:
        ratios["alloy_1dom_exact_vs_trl_distill_tokens_per_s"] = (
            agg["alloy_1dom_exact"]["completion_tokens_per_s"]["mean"]
            / agg["trl_distill"]["completion_tokens_per_s"]["mean"])
    if "alloy_1dom" in agg and "trl_distill" in agg:
        ratios["alloy_1dom_vs_trl_distill_tokens_per_s"] = (agg["alloy_1dom"]["completion_tokens_per_s"]["mean"]
                                                            / agg["trl_distill"]["completion_tokens_per_s"]["mean"])
    result = {"bench": "trl_compare", "command": " ".join(["python bench/trl_compare.py"] + (argv or sys.argv[1:])),
              "quick": args.quick, "machine": machine, "loadavg_end": list(os.getloadavg()),
              "shared_machine_note": "2 cores shared with other agents' jobs; per-run load averages in runs[]",
              "config": {k: v for k, v in spec.items() if k not in ("base", "teachers")} | {
                  "seeds": seeds, "systems": systems, "jobs": args.jobs},
              "init": init, "runs": runs, "aggregate": agg, "ratios": ratios,
              "target": {"tokens_per_s_ratio_min": 1.5}, "total_s": time.perf_counter() - t0}
    write_outputs(Path(args.out), result, table(agg, init))
    return 0


if __name__ == "__main__":
    sys.exit(main())
