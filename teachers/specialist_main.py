"""One specialist as a process: its own torch.distributed group, engine server, event loop.

    python -m teachers.specialist_main --config PATH [--set a.b=c ...] --domain NAME --init DIR --out URL
        [--work-dir DIR] [--result PATH] [--mlflow-run-id ID]

`--init` is the HF dir the policy (and the critic's backbone) start from: the base checkpoint. `--out` is the
storage prefix of this specialist: resumable `step-*` checkpoints and `final/` (the HF model served as the
domain's teacher). A rerun with the same `--out` resumes from the newest complete `step-*` (APRIL buffer, ledger,
cursor and both optimizers included; on the world size that wrote it). The result JSON has the per-step history,
guard and APRIL totals, the
specialist's own eval score and the `final/` URL. The specialist (`final/`) is the policy of the best validation (`specialists.select: best`,
teachers/selection.py) or the last one.
With `specialists.policy_train/critic_train.world_size` W > 1 the task starts this under torchrun: rank 0 runs the
recipe below (engine server, rollouts, APRIL, ledger, guard, validation, MLflow, commits) and announces each update,
weight save and state save/load; ranks 1..W-1 follow (training/ranks.py) and train their shards (ppo_shard).
The process around the recipe (flags, config, MLflow, torch.distributed, signals, the result file) is the
trainer skeleton's, training/worker.py; `WORKER` describes this entry point to the tasks that start it.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import zlib
from pathlib import Path

from domains.compaction import Compaction
from domains.episodes import episode_budget
from domains.model_reward import rewarders_of
from domains.registry import load_domains
from infra.chat import token_budget
from infra.checkpoint_budget import checkpoint_rule
from training.deepspeed_backend import DeepSpeedBackend
from training.ranks import Ranks
from training.session import (commit_final, end_stage, fresh_final, frozen_copy, run_stage, train_device,
                              train_settings, trainable)
from training.worker import Worker, WorkerRun, arg
from teachers.critic import ValueModel
from teachers.guard import Guard, LLMJudge
from teachers.specialist import SpecialistTrainer

log = logging.getLogger("alloy.specialist")
JUDGE_KEY_ENV = "ALLOY_JUDGE_API_KEY"


def settings(t, steps: int, seed: int):
    return train_settings(t, max(steps, 1), seed, grad_accum=1)  # one PPO minibatch = one optimizer step


def make_guard(gc) -> Guard | None:
    """The anti-hack guard from `specialists.guard`, or None when `enabled` is false (tool calls run unchecked)."""
    if not gc.enabled:
        log.warning("anti-hack guard disabled (specialists.guard.enabled=false): tool calls run unchecked")
        return None
    judge = None
    if gc.judge_url:  # a judge_path is served by the stage, which hands its URL here (tasks/judge.py)
        judge = LLMJudge(gc.judge_url, api_key=gc.judge_api_key or os.environ.get(JUDGE_KEY_ENV) or None,
                         model=gc.judge_model, kind=gc.judge_kind, timeout_s=gc.judge_timeout_s,
                         max_tokens=gc.judge_max_tokens, max_prompt_chars=gc.judge_prompt_chars or 4000)
    elif gc.judge_path:
        raise ValueError(f"specialists.guard.judge_path={gc.judge_path!r} is set but no judge server was handed to "
                         "this specialist (the specialists stage serves it and sets specialists.guard.judge_url)")
    return Guard(judge, allowed_hosts=set(gc.allowed_hosts), on_error=gc.judge_on_error)


def response_budget(cfg, domain, tokenizer) -> int:
    """Configured budget, else a tool episode's length (tool domains; with a policy-written compaction summary
    plus `summary_allowance`), else the domain's own budget in tokens
    (`token_budget(tokenizer)`: dataset domains), else the eval budget."""
    sc = cfg.specialists.for_domain(domain.name)
    if sc.max_new_tokens:
        return sc.max_new_tokens
    if getattr(domain, "episode_chars", 0):  # the policy's compaction requests and summaries count against it too
        return episode_budget(domain, 0, Compaction.of(sc))
    return token_budget(domain, tokenizer, cfg.eval.max_new_tokens)


def build_specialist(cfg, domain, init_dir: str, out_url: str, work_dir, tracker, on_step=None,
                     guarded: bool = True) -> SpecialistTrainer:
    """`domain`'s PPO trainer from `init_dir` (policy, critic, KL reference; nothing served yet), after joining
    torch.distributed: the trainer of `run_specialist`, and of a replay (teachers/replay.py). `guarded`: rank 0's
    rollouts of a tool domain run under the anti-hack guard (`specialists.guard`)."""
    sc, seed = cfg.specialists.for_domain(domain.name), cfg.run.seed  # with specialists.per_domain merged in
    tok, policy = trainable(init_dir, settings(sc.policy_train, sc.steps, seed))
    critic_settings = settings(sc.critic_train, sc.steps, seed)
    critic = DeepSpeedBackend(ValueModel.from_pretrained(init_dir, device=train_device(critic_settings)),
                              critic_settings)
    ref = frozen_copy(init_dir, policy) if sc.kl_coef else None  # on the policy's device, in its dtype
    ranks = Ranks()  # rank 0 runs the rollouts (under the guard); a rank > 0 only trains its shards of its batches
    guard = make_guard(sc.guard) if guarded and ranks.is_main and hasattr(domain, "env") else None
    # a model-rewarded domain's reward model or judge, served by the pipeline (its URL in the config's overrides)
    rewarder = rewarders_of(cfg, {domain.name: domain}, tok).get(domain.name) if guarded else None
    return SpecialistTrainer(sc, domain, tok, policy, critic, None, out_url=out_url, work_dir=work_dir,
                             tracker=tracker, seed=seed, max_new_tokens=response_budget(cfg, domain, tok),
                             guard=guard, ref_model=ref, on_step=on_step, ranks=ranks,
                             chat_template=cfg.model.chat_template, rewarder=rewarder)


def run_specialist(cfg, domain, init_dir: str, out_url: str, work_dir, tracker, on_step=None) -> dict:
    """Train `domain`'s specialist from `init_dir`; returns the summary incl. `checkpoint` (final/ URL),
    `specialist_dir` (local HF copy) and `score` (greedy eval on the held-out split, clean env for tools).
    The stage order is every RL trainer's (`training.session.run_stage`); `select_and_commit` is this stage's end."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    train_only = cfg.specialists.for_domain(domain.name).debug.train_only
    trainer = build_specialist(cfg, domain, init_dir, out_url, work, tracker, on_step, guarded=not train_only)
    if train_only:
        return train_only_stage(cfg, trainer, train_only, work)
    guard = trainer.guard
    return run_stage(trainer, trainer.ranks, engine_cfg=cfg.engine, work=work, init_dir=init_dir,
                     server_name=f"policy-{domain.name}", server_dir="server",
                     seed=cfg.run.seed * 1009 + zlib.crc32(domain.name.encode()) % 100_003,
                     backends=trainer.backends,
                     finish=lambda summary, final: select_and_commit(cfg, trainer, summary, final),
                     attach=lambda server: setattr(trainer, "server", server),
                     closers=[c for c in (guard, trainer.rewarder) if c is not None])  # their HTTP sessions


def train_only_stage(cfg, trainer: SpecialistTrainer, records: str, work: Path) -> dict:
    """`specialists.debug.train_only`: the stage with the loop replaced by training on the rollout records under
    `records` (teachers/replay.py `train_on_records`): no engine server is started, nothing is sampled. Then the
    stage's usual end (`select_and_commit`: the last policy, evaluated and committed). One rank only."""
    from teachers.replay import train_on_records

    if trainer.ranks.world_size > 1:
        raise ValueError("specialists.debug.train_only trains on one rank: set specialists.policy_train.world_size "
                         "and critic_train.world_size to 1")
    log.info("specialist %s: training from the rollout records under %s (debug.train_only)", trainer.domain.name,
             records)
    trainer.resume()
    summary = train_on_records(trainer, records)
    summary = select_and_commit(cfg, trainer, summary, fresh_final(work))
    return end_stage(summary, trainer.ranks, trainer.backends)


def select_and_commit(cfg, trainer: SpecialistTrainer, summary: dict, final: Path) -> dict:
    """Rank 0 after the loop: write the specialist to `final` (the best-validating policy, or the last: teachers/
    selection.py), score it greedily on the held-out split (a clean env for tools), log that, commit `final/`."""
    from domains.evaluate import evaluate_domains
    from training.rollout_records import eval_rows

    domain, tok, policy = trainer.domain, trainer.tok, trainer.policy  # on rank 0 of several: the led policy
    sc = cfg.specialists.for_domain(domain.name)
    best = summary["best_step"]
    use_best = sc.select == "best" and best is not None and best != trainer.state.step
    policy.eval_mode()
    if use_best:  # the best-validating policy is the specialist (teachers/selection.py)
        shutil.copytree(trainer.best_dir, final)
        model = frozen_copy(final, policy)
        log.info("specialist %s: the step-%d policy is the specialist (validation %.3f; last step %d: %.3f)",
                 domain.name, best, summary["best_val"], trainer.state.step, summary["validation"][-1]["score"])
    else:
        policy.save_hf(final, tokenizer=tok)
        model = policy.module
    summary["selected_step"] = best if use_best else trainer.state.step
    df, kept = evaluate_domains(model, tok, {domain.name: domain}, sc.eval_n or cfg.eval.n_eval, cfg.run.seed,
                                "specialist", max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                                chat_template=cfg.model.chat_template, compaction=Compaction.of(sc),
                                keep=sc.record.sample, rewarders=trainer.rewarders)
    row = df.iloc[0]
    # its first `record.sample` episodes: the eval sample of the rollout records (split "eval", at the last step;
    # weight_version: the step whose policy is the specialist)
    step = trainer.state.step
    trainer.recorder.record_eval(step, eval_rows("specialist", step, summary["selected_step"], kept, tok.decode),
                                 meta={"version": summary["selected_step"],
                                       "scores": {domain.name: {"score": float(row.score),
                                                                "raw_score": float(row.raw_score)}}})
    trainer.recorder.flush()  # this evaluation's rows to their MLflow table
    summary["rollout_records"] = trainer.recorder.summary()  # its `evals` with this evaluation's file
    summary["score"] = float(row.score)
    summary["raw_score"] = float(row.raw_score)
    # a tool domain's eval counts hack attempts (domains/evaluate.py); a plain domain has none (NaN → null)
    summary["hacks_per_100"] = None if math.isnan(row.hacks_per_100) else float(row.hacks_per_100)
    if trainer.rewarder is not None:  # a model-rewarded domain: its model's reward beside the (truth) score
        summary["reward_score"] = None if math.isnan(row.reward_score) else float(row.reward_score)
        summary["reward_unparseable"] = float(row.reward_unparseable)
    trainer.tracker.log_metrics({"eval/score": summary["score"], "eval/raw_score": summary["raw_score"],
                                 **({} if summary["hacks_per_100"] is None
                                    else {"eval/hacks_per_100": summary["hacks_per_100"]}),
                                 **({} if summary.get("reward_score") is None
                                    else {"eval/reward": summary["reward_score"]}),
                                 "eval/selected_step": summary["selected_step"]}, step=trainer.state.step)
    _, slim = checkpoint_rule(sc.keep_checkpoints, on_gpu=policy.device.type != "cpu")
    summary["checkpoint"] = commit_final(final, trainer.out_url, trainer.state.step,
                                         meta={"stage": "specialist", "domain": domain.name,
                                               "score": summary["score"], "step": summary["selected_step"]},
                                         drop_resume=slim)  # on a GPU its step-* go: a rerun reuses final/
    summary["specialist_dir"] = str(final)
    return summary


def _run(w: WorkerRun) -> dict:
    domains = load_domains(w.cfg)
    if w.args.domain not in domains:
        raise SystemExit(f"--domain {w.args.domain!r} is not configured; configured: {sorted(domains)}")
    return run_specialist(w.cfg, domains[w.args.domain], w.args.init, w.args.out, w.work_dir, w.tracker)


WORKER = Worker("teachers.specialist_main", "Alloy specialist: critic-based PPO with APRIL on one domain",
                args=(arg("--domain", required=True),
                      arg("--init", required=True, help="HF dir the policy starts from (the base checkpoint)"),
                      arg("--out", required=True, help="storage URL prefix of this specialist's checkpoints")),
                threads=lambda cfg, args: cfg.specialists.for_domain(args.domain).threads, work_subdir="specialist")


def main(argv: list[str] | None = None) -> int:
    return WORKER.main(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
