"""The specialists stage as Prefect flows.

`specialists(ctx, base_dir)` trains one specialist per configured domain from the base checkpoint:
- `specialists.mode: local` (default): `train_specialist` tasks on a thread pool of `max_parallel` workers, each a
  trainer process; a failed one is retried (`specialists.retries`) and resumes from its newest complete checkpoint;
- `specialists.mode: deployment`: one `run_deployment` of `alloy-specialist/default` per domain (a work pool, e.g.
  Kubernetes with one GPU node per run), each bounded by the global concurrency limit `gpu`.

`specialist(...)` is that deployment's entry point: one domain, plain JSON parameters.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from infra.config import refuse_secret_overrides
from infra.procs import stop_requested
from tasks.context import RunContext, open_context, stage_timer
from tasks.specialist import specialist_prefix, train_specialist

log = logging.getLogger("alloy")


def _unless_stopped(task, task_run, state) -> bool:
    """Retry a failed specialist, except after a stop request (Ctrl-C of `alloy run`): it would only be refused."""
    return not stop_requested()


def _local(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    sc = ctx.cfg.specialists
    task = train_specialist.with_options(retries=sc.retries, retry_delay_seconds=2, retry_condition_fn=_unless_stopped)
    futures = {d: task.submit(ctx, d, base_dir) for d in ctx.domains}
    return {d: f.result() for d, f in futures.items()}


def _deployments(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    """Each domain as a flow run of `specialists.deployment`; results come back through storage."""
    from prefect.deployments import run_deployment

    from infra.storage import join, load_checkpoint, read_json

    def one(domain: str) -> dict:
        fr = run_deployment(ctx.cfg.specialists.deployment, timeout=None, as_subflow=True,
                            parameters={"config": ctx.config_path, "domain": domain, "base_dir": base_dir,
                                        "overrides": list(ctx.overrides), "parent_run_id": ctx.parent_run_id})
        if not fr.state or not fr.state.is_completed():
            raise RuntimeError(f"specialist {domain}: deployment run {fr.id} ended {fr.state and fr.state.name}")
        prefix = specialist_prefix(ctx, domain)
        summary = read_json(join(prefix, "result.json"))
        local = ctx.work_dir / "specialists" / domain / "final-local"
        load_checkpoint(join(prefix, "final"), local)
        return {**summary, "specialist_dir": str(local), "checkpoint": join(prefix, "final"), "domain": domain}

    with ThreadPoolExecutor(max_workers=len(ctx.domains)) as pool:  # the `gpu` limit bounds what really runs
        return dict(zip(ctx.domains, pool.map(one, ctx.domains)))


@flow(name="alloy-specialists", validate_parameters=False)
def specialists(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    """{domain: specialist summary} for every configured domain (see tasks/specialist.py for the summary)."""
    with stage_timer(ctx, "specialists"):
        out = _deployments(ctx, base_dir) if ctx.cfg.specialists.mode == "deployment" else _local(ctx, base_dir)
    for d, s in out.items():
        log.info("specialist %s: score %.3f (%d steps, the step-%s policy selected%s)", d, s["score"], s["steps"],
                 s.get("selected_step", s["steps"]), f"; stopped early: {s['stopped']}" if s.get("stopped") else "")
    return out


def run_specialists(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    """`specialists` with a task runner of `specialists.max_parallel` workers (a config value, so set per call)."""
    runner = ThreadPoolTaskRunner(max_workers=ctx.cfg.specialists.max_parallel)
    return specialists.with_options(task_runner=runner)(ctx, base_dir)


@flow(name="alloy-specialist", log_prints=True)
def specialist(config: str, domain: str, base_dir: str, overrides: list[str] | None = None,
               parent_run_id: str | None = None) -> dict:
    """One domain's specialist (the `alloy-specialist/default` deployment). Holds one slot of the global
    concurrency limit `gpu` while it trains (create it with `prefect gcl create gpu --limit N`). Secrets are
    refused in `overrides`: the worker's environment carries them (ALLOY_ENGINE_API_KEY, ...)."""
    from prefect.concurrency.sync import concurrency

    refuse_secret_overrides(overrides, "flow alloy-specialist, parameter `overrides`")
    ctx = open_context(config, overrides or [], parent_run_id=parent_run_id)
    if domain not in ctx.domains:
        raise ValueError(f"domain {domain!r} is not configured in {config}; configured: {sorted(ctx.domains)}")
    with concurrency("gpu", occupy=1, strict=False):
        return train_specialist(ctx, domain, base_dir)
