"""Specialist stage task: one domain's PPO specialist in its own process, resumable, with a progress artifact.

The specialist trains in `python -m teachers.specialist_main` (its `WORKER`), logging to the nested MLflow run
`specialist/<domain>`. Its checkpoints go under `<storage>/specialist-<domain>-<fingerprint>/`: a retried task (or a
rerun of the same config) resumes from the newest complete `step-*`, and a complete `final/` is reused as is.
"""
from __future__ import annotations

import logging

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from infra.progress import throttled
from infra.storage import local_path
from tasks.context import RunContext
from tasks.prefixes import specialist_prefix_of
from tasks.stage import reuse_or_train, run_trainer
from tasks.worker_process import WorkerCommand, on_ranks, worker_command
from teachers.specialist_main import WORKER as SPECIALIST_WORKER

log = logging.getLogger("alloy")
# A progress artifact is updated at most this often (and at 100 %): each update is a Prefect API call and an
# artifact row rewritten by the server; at every reported step (~2 a second per running specialist) they cost the
# demo ~15–20 CPU-seconds between the flow's process and the Prefect server (profiles, docs/tuning.md#overhead).
PROGRESS_EVERY_S = 5.0


def specialist_prefix(ctx: RunContext, domain: str) -> str:
    """Storage prefix of `domain`'s specialist (tasks/prefixes.py)."""
    return specialist_prefix_of(ctx.cfg, ctx.storage_url, domain)


def specialist_command(ctx: RunContext, domain: str, base_dir: str, out_url: str, result, run_id) -> WorkerCommand:
    """The trainer's argv; secret overrides ride in its environment (`worker_command`), never in argv."""
    cmd = SPECIALIST_WORKER.argv(config=ctx.config_path, domain=domain, init=base_dir, out=out_url,
                                 work_dir=local_path(ctx.work_dir, "specialists", domain), result=result, mlflow_run_id=run_id)
    ranks = ctx.cfg.specialists.for_domain(domain).policy_train.world_size  # = critic_train's (one process group)
    return on_ranks(worker_command(cmd, ctx.overrides), ranks)


def _progress_artifact(domain: str):
    """A Prefect progress artifact (0–100 %) for this specialist, or None outside a flow run."""
    try:
        return create_progress_artifact(progress=0.0, key=f"specialist-{domain.replace('_', '-')}",
                                        description=f"PPO specialist for {domain}")
    except Exception as exc:  # no flow run context (library use): progress goes to the log only
        log.debug("no progress artifact for %s: %s", domain, exc)
        return None


@task(name="train-specialist", cache_policy=NO_CACHE, task_run_name="specialist-{domain}")
def train_specialist(ctx: RunContext, domain: str, base_dir: str) -> dict:
    """Train (or resume, or reuse) `domain`'s specialist from `base_dir`. Returns its summary with `specialist_dir`
    (local HF dir), `checkpoint` (committed final/ URL), `score` (own-domain eval), `guard` and `april` totals."""
    cfg, prefix = ctx.cfg, specialist_prefix(ctx, domain)
    local = local_path(ctx.work_dir, "specialists", domain, "final-local")
    result = local_path(ctx.work_dir, "specialists", domain, "result.json")
    with ctx.tracker.child(f"specialist/{domain}", tags={"stage": "specialist", "domain": domain}) as run:
        def train() -> None:
            art = _progress_artifact(domain)
            steps = cfg.specialists.for_domain(domain).steps
            on_step = None if art is None else throttled(
                lambda step: update_progress_artifact(art, progress=100.0 * step / max(steps, 1)), PROGRESS_EVERY_S)

            cmd = specialist_command(ctx, domain, base_dir, prefix, result, getattr(run, "run_id", None))
            run_trainer(cmd, ctx, "specialists", local_path(ctx.work_dir, "logs", f"specialist-{domain}.log"), steps,
                        f"specialist {domain}", on_step)
            if art is not None:
                update_progress_artifact(art, progress=100.0)

        summary, final = reuse_or_train(ctx, prefix, f"specialist {domain}", result, local, train)
        summary.update(specialist_dir=str(local), checkpoint=final, domain=domain)
        run.log_metrics({"summary/score": summary["score"], **{f"summary/guard_{k}": float(v)
                                                                for k, v in summary.get("guard", {}).items()}})
    return summary
