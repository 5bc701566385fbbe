"""The Alloy pipeline as a Prefect flow: base → reward models (if configured) → specialists (parallel) → teacher servers →
distill → eval → report."""
from __future__ import annotations

import logging

import pandas as pd
from prefect import flow
from prefect.utilities.annotations import quote

from domains.evaluate import COLUMNS
from flows.distill import run_distill
from flows.handoff import where_am_i
from flows.specialists import run_specialists
from infra.choices import StageMode
from infra.config import refuse_secret_overrides
from infra.procs import stop_requested
from infra.report import GUARD_KEYS, resources_of
from tasks.base import base_checkpoint_url, train_base
from tasks.context import RunContext, open_context
from tasks.evaluate import evaluate_stage
from tasks.judge import judge_checkpoint, wants_judge_server
from tasks.report import publish_report
from tasks.reward_servers import serve_rewards
from tasks.reward_models import train_reward_models

log = logging.getLogger("alloy")


def specialist_scores(ctx: RunContext, specs: dict[str, dict]) -> pd.DataFrame:
    """Each specialist's own-domain score (evaluated by its trainer on the same eval split) as report rows."""
    sc = ctx.cfg.specialists
    return pd.DataFrame([{"domain": d, "stage": "specialist", "score": s["score"],
                          "n_eval": sc.for_domain(d).eval_n or ctx.cfg.eval.n_eval, "checkpoint": s["checkpoint"],
                          "raw_score": s.get("raw_score", s["score"]), "hacks_per_100": s.get("hacks_per_100"),
                          "reward_score": s.get("reward_score"), "reward_unparseable": s.get("reward_unparseable")}
                         for d, s in specs.items()], columns=COLUMNS)


def guard_totals(specs: dict[str, dict]) -> dict[str, int]:
    """report.json's `guard`: each counter of `GUARD_KEYS` summed over the specialists' results, and the verifiers'
    zeros by reason (`reward_<reason>`, e.g. reward_exit, reward_not_plain: `teachers.specialist.reward_outcome_counts`)
    where a specialist counted any."""
    out = dict.fromkeys(GUARD_KEYS, 0)
    for s in specs.values():
        guard = s.get("guard", {})
        for k in GUARD_KEYS:
            out[k] += int(guard.get(k, 0))
        for k, v in guard.items():
            if k.startswith("reward_"):
                out[k] = out.get(k, 0) + int(v)
    return out


@flow(name="alloy-pipeline", log_prints=True)
def pipeline(config: str, overrides: list[str] | None = None, report_path: str | None = None) -> dict:
    """Run the whole pipeline for CONFIG (a YAML path) with `a.b=c` overrides; returns the report dict.
    Secrets are refused in `overrides` (a flow parameter, stored by Prefect): they come from the environment."""
    refuse_secret_overrides(overrides, "flow alloy-pipeline, parameter `overrides`")
    ctx = open_context(config, overrides or [])  # loads the domains: plugins, a dataset's split sizes
    print(where_am_i("alloy-pipeline", ctx))
    status = "FAILED"
    try:
        if ctx.cfg.specialists.enabled and wants_judge_server(ctx):  # before the base stage, not after its SFT
            judge_checkpoint(ctx.cfg.specialists.guard)
        base_dir = train_base(ctx)
        reward_models = train_reward_models(ctx, base_dir) if ctx.cfg.reward_models else {}
        # another worker's flow run (deployment modes) is handed storage URLs, never this run's local paths
        remote = StageMode.DEPLOYMENT in (ctx.cfg.specialists.mode, ctx.cfg.distill.mode)
        base_url = base_checkpoint_url(ctx) if remote else None
        with serve_rewards(ctx, reward_models) as rctx:  # model-rewarded domains: their reward models and judges
            frames = [evaluate_stage(rctx, base_dir, stage="base")]
            specs: dict[str, dict] = {}
            if ctx.cfg.specialists.enabled:
                specs = run_specialists(rctx, base_dir, base_url, reward_models)  # deployment: served per flow run
                frames.append(specialist_scores(ctx, specs))
            teachers = {d: specs[d]["specialist_dir"] if d in specs else base_dir for d in ctx.domains}
            teacher_urls = ({d: specs[d]["checkpoint"] if d in specs else base_url for d in ctx.domains} if remote
                            else None)
            student = run_distill(ctx, base_dir, teachers, base_url, teacher_urls)
            frames.append(evaluate_stage(rctx, student["student_dir"], stage="student"))
        report = publish_report(
            ctx, pd.concat(frames, ignore_index=True), report_path=report_path, n_teachers=student["n_teachers"],
            throughput=student["throughput"], guard=guard_totals(specs),
            artifacts={"student_checkpoint": student["student_checkpoint"],
                       "registered_model": student["registered_model"],
                       "specialists": {d: s["checkpoint"] for d, s in specs.items()},
                       **({"reward_models": {n: {"checkpoint": s["checkpoint"], "val_accuracy": s["val_accuracy"]}
                                             for n, s in reward_models.items()}} if reward_models else {})},
            resources=resources_of(ctx.resources.get("base"), list(specs.values()), student),
            specialists=quote(specs))  # quote: Prefect would visit every step of every specialist's history
        status = "FINISHED"
        return report
    finally:
        ctx.tracker.end("KILLED" if status == "FAILED" and stop_requested() else status)  # a Ctrl-C: KILLED
