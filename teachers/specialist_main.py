"""One specialist as a process: its own torch.distributed group, engine server, event loop.

    python -m teachers.specialist_main --config PATH [--set a.b=c ...] --domain NAME --init DIR --out URL
        [--work-dir DIR] [--result PATH] [--mlflow-run-id ID]

`--init` is the HF dir the policy (and the critic's backbone) start from: the base checkpoint. `--out` is the
storage prefix of this specialist: resumable `step-*` checkpoints and `final/` (the HF model served as the
domain's teacher). A rerun with the same `--out` resumes from the newest complete `step-*` (APRIL buffer, ledger,
cursor and both optimizers included). The result JSON has the per-step history, guard and APRIL totals, the
specialist's own eval score and the `final/` URL. The specialist (`final/`) is the policy of the best validation (`specialists.select: best`,
teachers/selection.py) or the last one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch

from infra.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed, shutdown_distributed
from infra.engine.launcher import Supervisor
from infra.models import load_model, load_tokenizer
from infra.policy_server import PolicyServer
from infra.storage import join, save_checkpoint
from teachers.critic import ValueModel
from teachers.guard import Guard, LLMJudge
from teachers.specialist import SpecialistTrainer

log = logging.getLogger("alloy.specialist")
JUDGE_KEY_ENV = "ALLOY_JUDGE_API_KEY"


def settings(t, steps: int, seed: int) -> TrainSettings:
    return TrainSettings(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                         dtype=t.dtype, micro_batch_size=t.micro_batch_size, grad_accum=1,
                         warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule, total_steps=max(steps, 1), seed=seed)


def make_guard(gc) -> Guard | None:
    """The anti-hack guard from `specialists.guard`, or None when `enabled` is false (tool calls run unchecked)."""
    if not gc.enabled:
        log.warning("anti-hack guard disabled (specialists.guard.enabled=false): tool calls run unchecked")
        return None
    judge = None
    if gc.judge_url:
        judge = LLMJudge(gc.judge_url, api_key=gc.judge_api_key or os.environ.get(JUDGE_KEY_ENV) or None,
                         model=gc.judge_model, kind=gc.judge_kind)
    return Guard(judge, allowed_hosts=set(gc.allowed_hosts))


def response_budget(cfg, domain) -> int:
    """Configured budget, else a tool episode's length (tool domains), else the eval budget."""
    sc = cfg.specialists.for_domain(domain.name)
    if sc.max_new_tokens:
        return sc.max_new_tokens
    return int(getattr(domain, "episode_chars", 0)) or cfg.eval.max_new_tokens


def run_specialist(cfg, domain, init_dir: str, out_url: str, work_dir, tracker, on_step=None) -> dict:
    """Train `domain`'s specialist from `init_dir`; returns the summary incl. `checkpoint` (final/ URL),
    `specialist_dir` (local HF copy) and `score` (greedy eval on the held-out split, clean env for tools)."""
    from domains.evaluate import evaluate_model

    sc, work = cfg.specialists.for_domain(domain.name), Path(work_dir)  # with specialists.per_domain merged in
    work.mkdir(parents=True, exist_ok=True)
    seed = cfg.run.seed
    tok = load_tokenizer(init_dir)
    init_distributed()
    policy = DeepSpeedBackend(load_model(init_dir), settings(sc.policy_train, sc.steps, seed))
    critic = DeepSpeedBackend(ValueModel.from_pretrained(init_dir), settings(sc.critic_train, sc.steps, seed))
    ref = load_model(init_dir).eval() if sc.kl_coef else None
    guard = make_guard(sc.guard) if hasattr(domain, "env") else None
    trainer = SpecialistTrainer(sc, domain, tok, policy, critic, None, out_url=out_url, work_dir=work,
                                tracker=tracker, seed=seed, max_new_tokens=response_budget(cfg, domain), guard=guard,
                                ref_model=ref, on_step=on_step)
    serve_dir = trainer.resume() or init_dir
    with Supervisor(work / "logs", threads_per_server=cfg.engine.threads) as sup:
        trainer.server = PolicyServer.for_engine(cfg.engine, sup, f"policy-{domain.name}", serve_dir, work / "server",
                                                 version=trainer.state.step,
                                                 seed=seed * 1009 + zlib.crc32(domain.name.encode()) % 100_003)

        async def go() -> dict:
            try:
                return await trainer.run()
            finally:
                await trainer.server.aclose()
                if guard is not None:
                    await guard.aclose()

        summary = asyncio.run(go())
    final = work / "final"
    shutil.rmtree(final, ignore_errors=True)
    best = summary["best_step"]
    use_best = sc.select == "best" and best is not None and best != trainer.state.step
    policy.eval_mode()
    if use_best:  # the best-validating policy is the specialist (teachers/selection.py)
        shutil.copytree(trainer.best_dir, final)
        model = load_model(final).to(next(policy.module.parameters()).device)
        log.info("specialist %s: the step-%d policy is the specialist (validation %.3f; last step %d: %.3f)",
                 domain.name, best, summary["best_val"], trainer.state.step, summary["validation"][-1]["score"])
    else:
        policy.save_hf(final, tokenizer=tok)
        model = policy.module
    summary["selected_step"] = best if use_best else trainer.state.step
    df = evaluate_model(model, tok, {domain.name: domain}, sc.eval_n or cfg.eval.n_eval, seed, "specialist",
                        max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size)
    summary["score"] = float(df.score.iloc[0])
    tracker.log_metrics({"eval/score": summary["score"], "eval/selected_step": summary["selected_step"]},
                        step=trainer.state.step)
    summary["checkpoint"] = save_checkpoint(str(final), join(out_url, "final"), trainer.state.step,
                                            meta={"stage": "specialist", "domain": domain.name,
                                                  "score": summary["score"], "step": summary["selected_step"]})
    summary["specialist_dir"] = str(final)
    policy.close()
    critic.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    from infra.config import load_config
    from infra.tracking import NoopTracker, Tracker
    from tasks.context import load_domains

    p = argparse.ArgumentParser(description="Alloy specialist: critic-based PPO with APRIL on one domain")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--domain", required=True)
    p.add_argument("--init", required=True, help="HF dir the policy starts from (the base checkpoint)")
    p.add_argument("--out", required=True, help="storage URL prefix of this specialist's checkpoints")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--result", default=None)
    p.add_argument("--mlflow-run-id", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(args.config, args.set)
    domains = load_domains(cfg)
    if args.domain not in domains:
        raise SystemExit(f"--domain {args.domain!r} is not configured; configured: {sorted(domains)}")
    torch.set_num_threads(cfg.specialists.for_domain(args.domain).threads)
    tracker = NoopTracker()
    if args.mlflow_run_id and cfg.tracking.enabled:
        tracker = Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment,
                          uri=cfg.tracking.uri).resume(args.mlflow_run_id)
    try:
        summary = run_specialist(cfg, domains[args.domain], args.init, args.out, args.work_dir, tracker)
    finally:
        shutdown_distributed()
    if args.result:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps(summary, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
