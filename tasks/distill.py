"""Distillation stage: run the OPD student in its own process, then register it in the MLflow Model Registry.

The student trains in `python -m student.distill_main` (its own torch.distributed group, engine server and event
loop), logging to the nested MLflow run `student`. Its checkpoints go under `<storage>/student-<fingerprint>/`; a
rerun of the same config reuses a complete `final/` (and a crashed run resumes from its newest `step-*`).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from student.distill_main import WORKER as STUDENT_WORKER
from tasks.context import RunContext, stage_timer
from tasks.prefixes import student_prefix_of
from tasks.stage import reuse_or_train, run_trainer
from tasks.worker_process import on_ranks, worker_command

log = logging.getLogger("alloy")

REGISTERED_NAME = "alloy-student"


def student_prefix(ctx: RunContext) -> str:
    """Storage prefix of this config's student (tasks/prefixes.py)."""
    return student_prefix_of(ctx.cfg, ctx.storage_url)


def distill_command(ctx: RunContext, student_init: str, endpoints: dict[str, str], out_url: str, result: Path,
                    run_id: str | None) -> list[str]:
    """The trainer's argv (a `WorkerCommand`): secret overrides ride in its environment, never in argv."""
    cmd = STUDENT_WORKER.argv(config=ctx.config_path, student_init=student_init, teachers=json.dumps(endpoints),
                              out=out_url, work_dir=ctx.work_dir / "distill", result=result, mlflow_run_id=run_id)
    return on_ranks(worker_command(cmd, ctx.overrides), ctx.cfg.distill.train.world_size)


@task(name="distill-student", cache_policy=NO_CACHE)
def train_student(ctx: RunContext, student_init: str, endpoints: dict[str, str]) -> dict:
    """OPD from `endpoints` ({domain: teacher url}) into a student initialised from `student_init` (HF dir).

    Returns the distillation summary with `student_dir` (local HF dir), `student_checkpoint` (committed URL),
    `throughput` ({distill_sampled_tokens_per_s, teacher_scored_tokens_per_s}) and `student_run_id`.
    """
    cfg, prefix = ctx.cfg, student_prefix(ctx)
    local = ctx.work_dir / "student"
    result_path = ctx.work_dir / "distill" / "result.json"
    with stage_timer(ctx, "distill"), ctx.tracker.child("student", tags={"stage": "student"}) as run:
        def train() -> None:
            cmd = distill_command(ctx, student_init, endpoints, prefix, result_path, getattr(run, "run_id", None))
            run_trainer(cmd, ctx, "distill", ctx.work_dir / "logs" / "distill.log", cfg.distill.steps, "distill")

        summary, final = reuse_or_train(ctx, prefix, "distill: student", result_path, local, train)
        tp = summary["throughput"]
        summary.update(student_dir=str(local), student_checkpoint=final, student_run_id=getattr(run, "run_id", None),
                       throughput={"distill_sampled_tokens_per_s": tp["sampled_tokens_per_s"],
                                   "teacher_scored_tokens_per_s": tp["teacher_scored_tokens_per_s"]})
        run.log_metrics({**{f"summary/{k}": v for k, v in summary["throughput"].items()},
                         # the guard's counters over the student's tool episodes (as the specialists' summary/guard_*)
                         **{f"summary/guard_{k}": float(v) for k, v in summary.get("guard", {}).items()}})
    return summary


@task(name="register-student", cache_policy=NO_CACHE)
def register_student(ctx: RunContext, student: dict) -> str | None:
    """Register the student as a new version of `alloy-student` with alias `candidate`; returns "alloy-student/<v>"
    (None when tracking is off). Registered from the `student` run, so the version links to its metrics, as an MLflow
    transformers model: `mlflow.transformers.load_model("models:/alloy-student@candidate")` is a pipeline."""
    with ctx.tracker.child("student", tags={"stage": "student"}) as run:
        version = run.register_model(
            student["student_dir"], REGISTERED_NAME, alias="candidate", flavor="transformers",
            description=f"OPD student of {len(ctx.domains)} domains ({ctx.cfg.distill.loss}, "
                        f"{student['steps']} steps) from config {ctx.config_path}",
            tags={"alloy.config": ctx.config_path, "alloy.fingerprint": ctx.cfg.fingerprint(),
                  "alloy.checkpoint": student["student_checkpoint"], "alloy.domains": ",".join(ctx.domains),
                  "alloy.loss": ctx.cfg.distill.loss})
    return f"{REGISTERED_NAME}/{version}" if version is not None else None
