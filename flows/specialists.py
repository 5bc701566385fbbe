"""The specialists stage as Prefect flows.

`specialists(ctx, base_dir)` trains one specialist per configured domain from the base checkpoint:
- `specialists.mode: local` (default): `train_specialist` tasks on a thread pool of `max_parallel` workers, each a
  trainer process; a failed one is retried (`specialists.retries`) and resumes from its newest complete checkpoint;
- `specialists.mode: deployment`: one `run_deployment` of `alloy-specialist/default` per domain (a work pool, e.g.
  Kubernetes with one GPU node per run), each bounded by the global concurrency limit `gpu`; a failed or crashed
  flow run is run again (`specialists.retries`), on any worker, and resumes from storage. No disk is shared:
  the flow run gets the base checkpoint's storage URL and commits its `final/` and `result.json` to storage, which
  this flow reads back (flows/handoff.py).
A `specialists.guard.judge_path` is served for the stage (tasks/judge.py): one server shared by every local
specialist; in deployment mode, one per specialist flow run, on its worker. So are a model-rewarded domain's reward
model or judge (tasks/reward_servers.py): local specialists use the pipeline's servers (their URLs in `ctx`); in
deployment mode the flow run gets no URL of the pipeline's machine but the reward models' storage URLs, pulls what
its domain needs and serves it on its worker (a judge's `reward.model` path must exist there).

`specialist(...)` is that deployment's entry point: one domain, plain JSON parameters.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.handoff import (DEPLOYMENT_POLL_S, dispatch_overrides, fetch_checkpoint, warn_unshared_storage,
                           where_am_i)
from infra.choices import StageMode
from infra.config import refuse_secret_overrides
from infra.procs import stop_requested
from infra.storage import local_path
from tasks.context import RunContext, open_context, stage_timer
from tasks.judge import serve_judge
from tasks.reward_servers import needed_reward_models, reward_checkpoints, serve_rewards
from tasks.specialist import specialist_prefix, train_specialist

log = logging.getLogger("alloy")


def _unless_stopped(task, task_run, state) -> bool:
    """Retry a failed specialist, except after a stop request (Ctrl-C of `alloy run`): it would only be refused."""
    return not stop_requested()


def launch_order(sc, domains) -> list[str]:
    """Domains in the order their specialists start: the longest expected first (most configured steps, with
    `specialists.per_domain` overrides), ties in config order. With `max_parallel` lanes, a long run started last
    would leave the other lanes idle at the end of the stage (list scheduling: longest first bounds the makespan)."""
    names = list(domains)
    return sorted(names, key=lambda d: (-sc.for_domain(d).steps, names.index(d)))


def _local(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    sc = ctx.cfg.specialists
    task = train_specialist.with_options(retries=sc.retries, retry_delay_seconds=2, retry_condition_fn=_unless_stopped)
    futures = {d: task.submit(ctx, d, base_dir) for d in launch_order(sc, ctx.domains)}
    return {d: futures[d].result() for d in ctx.domains}


def _deployments(ctx: RunContext, base_url: str, reward_urls: dict[str, str]) -> dict[str, dict]:
    """Each domain as a flow run of `specialists.deployment`, handed the base checkpoint's and the reward models'
    storage URLs; results come back through storage (the flow run's worker may share no disk with this one)."""
    from prefect.deployments import run_deployment

    from infra.storage import join, read_json

    warn_unshared_storage(ctx, "specialists.mode")
    overrides = dispatch_overrides(ctx)  # no reward server URL of this machine: each flow run serves its own
    rewards = {"reward_models": reward_urls} if reward_urls else {}

    def one(domain: str) -> dict:
        attempts = 1 + ctx.cfg.specialists.retries
        for attempt in range(1, attempts + 1):
            fr = run_deployment(ctx.cfg.specialists.deployment, timeout=None, as_subflow=True,
                                poll_interval=DEPLOYMENT_POLL_S,
                                parameters={"config": ctx.config_path, "domain": domain, "base_url": base_url,
                                            "overrides": overrides, "parent_run_id": ctx.parent_run_id, **rewards})
            if fr.state and fr.state.is_completed():
                break
            ended = f"specialist {domain}: deployment run {fr.id} ended {fr.state and fr.state.name}"
            retry = fr.state and (fr.state.is_failed() or fr.state.is_crashed()) and not stop_requested()
            if attempt == attempts or not retry:
                raise RuntimeError(ended)
            # a new flow run, on whichever worker the pool gives it: it resumes from the newest step-* in storage
            log.warning("%s; retry %d of %d (resumes from its newest checkpoint in storage)", ended, attempt,
                        attempts - 1)
        prefix = specialist_prefix(ctx, domain)
        summary = read_json(join(prefix, "result.json"))
        local = fetch_checkpoint(join(prefix, "final"), local_path(ctx.work_dir, "specialists", domain, "final-local"),
                                 f"specialist {domain}")
        return {**summary, "specialist_dir": local, "checkpoint": join(prefix, "final"), "domain": domain,
                "flow_run_id": str(fr.id)}

    with ThreadPoolExecutor(max_workers=len(ctx.domains)) as pool:  # the `gpu` limit bounds what really runs
        return dict(zip(ctx.domains, pool.map(one, ctx.domains)))


@flow(name="alloy-specialists", validate_parameters=False)
def specialists(ctx: RunContext, base_dir: str, base_url: str | None = None,
                reward_models: dict[str, dict] | None = None) -> dict[str, dict]:
    """{domain: specialist summary} for every configured domain (see tasks/specialist.py for the summary).
    `base_dir`: the base checkpoint here (local mode); `base_url`: its storage URL (deployment mode);
    `reward_models`: the reward-model stage's summaries (deployment mode hands on their `checkpoint` URLs)."""
    with stage_timer(ctx, "specialists"):
        if ctx.cfg.specialists.mode == StageMode.DEPLOYMENT:
            if not base_url:
                raise ValueError("specialists.mode=deployment needs the base checkpoint's storage URL (base_url)")
            out = _deployments(ctx, base_url, {n: s["checkpoint"] for n, s in (reward_models or {}).items()})
        else:
            with serve_judge(ctx) as run_ctx:  # specialists.guard.judge_path: one judge server for the stage
                out = _local(run_ctx, base_dir)
    for d, s in out.items():
        log.info("specialist %s: score %.3f (%d steps, the step-%s policy selected%s)", d, s["score"], s["steps"],
                 s.get("selected_step", s["steps"]), f"; stopped early: {s['stopped']}" if s.get("stopped") else "")
    return out


def run_specialists(ctx: RunContext, base_dir: str, base_url: str | None = None,
                    reward_models: dict[str, dict] | None = None) -> dict[str, dict]:
    """`specialists` with a task runner of `specialists.max_parallel` workers (a config value, so set per call)."""
    runner = ThreadPoolTaskRunner(max_workers=ctx.cfg.specialists.max_parallel)
    return specialists.with_options(task_runner=runner)(ctx, base_dir, base_url, reward_models)


def fetch_reward_models(ctx: RunContext, domain: str, urls: dict[str, str] | None) -> dict[str, dict]:
    """{name: {"checkpoint", "local_dir"}} of the reward models `domain` scores with, each pulled from its storage
    URL in `urls` ({name: URL}, the flow run's `reward_models`) into this worker's work dir; checks that what
    `serve_rewards` will serve for it is here (a judge's `reward.model` path on this worker)."""
    out = {}
    for name in needed_reward_models(ctx.cfg, [domain]):
        if name not in (urls or {}):
            raise ValueError(f"specialist {domain}: reward model {name!r} (reward_models.{name}) was not handed to "
                             f"this flow run: parameter `reward_models` holds {sorted(urls or {})}")
        local = fetch_checkpoint(urls[name], local_path(ctx.work_dir, "specialists", domain, f"rm-{name}"),
                                 f"specialist {domain}: reward model {name}")
        out[name] = {"checkpoint": urls[name], "local_dir": local}
    reward_checkpoints(ctx.cfg, out, [domain])  # a ConfigError naming the field, before the base is pulled
    return out


@flow(name="alloy-specialist", log_prints=True)
def specialist(config: str, domain: str, base_url: str, overrides: list[str] | None = None,
               parent_run_id: str | None = None, reward_models: dict[str, str] | None = None) -> dict:
    """One domain's specialist (the `alloy-specialist/default` deployment) from the base checkpoint at `base_url`
    (a storage URL, pulled into this worker's work dir; a local directory also works on the machine that has it).
    A model-rewarded domain's reward model (from `reward_models`, {name: its `final/` storage URL}) or judge is
    served here, on this worker, while it trains, as the guard's judge is.
    Its `final/` and `result.json` are committed to storage; a rerun resumes from the newest `step-*` there, on
    any worker. Holds one slot of the global concurrency limit `gpu` while it trains (`alloy up --gpu-slots N`
    creates it). Secrets are refused in `overrides`: the worker's environment carries them (ALLOY_ENGINE_API_KEY)."""
    from prefect.concurrency.sync import concurrency

    refuse_secret_overrides(overrides, "flow alloy-specialist, parameter `overrides`")
    ctx = open_context(config, overrides or [], parent_run_id=parent_run_id, check_model_path=False)
    print(where_am_i(f"alloy-specialist {domain}", ctx))
    status = "FAILED"
    try:
        if domain not in ctx.domains:
            raise ValueError(f"domain {domain!r} is not configured in {config}; configured: {sorted(ctx.domains)}")
        # its own copies: several specialist flow runs on one worker (same run.root) must not share one directory
        rms = fetch_reward_models(ctx, domain, reward_models)
        base_dir = fetch_checkpoint(base_url, local_path(ctx.work_dir, "specialists", domain, "base"),
                                    f"specialist {domain}: base checkpoint")
        with (concurrency("gpu", occupy=1, strict=False), serve_judge(ctx, [domain]) as jctx,  # its judge and
              serve_rewards(jctx, rms, [domain]) as run_ctx):                                 # reward servers
            out = train_specialist(run_ctx, domain, base_dir)
        status = "FINISHED"
        return out
    finally:
        if parent_run_id is None:  # our own parent run; someone else's stays open for them
            ctx.tracker.end(status)
