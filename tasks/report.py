"""Publish the run's results: report.json (local path and storage), MLflow table and summary, Prefect artifacts."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.charts import mlflow_run_url
from infra.hostinfo import finish_meta
from infra.report import build_report, render_table
from infra.storage import join, write_json
from infra.secrets import mask_secrets
from tasks.context import RunContext
from tasks.dashboard import annotate_registered_student, log_charts, mlflow_ui_url

log = logging.getLogger("alloy")


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(ctx: RunContext, scores: pd.DataFrame, report_path: str | None = None, n_teachers: int = 0,
                   throughput: dict | None = None, guard: dict | None = None, artifacts: dict | None = None,
                   resources: dict | None = None, specialists: dict[str, dict] | None = None) -> dict:
    ctx.timings["total"] = time.monotonic() - ctx.started
    tracker = ctx.tracker
    report = build_report(
        config=ctx.config_path, run_id=ctx.parent_run_id or "", scores=scores, domains=list(ctx.domains),
        mlflow={"tracking_uri": mask_secrets(getattr(tracker, "tracking_uri", None) or ""), "experiment": ctx.cfg.tracking.experiment,
                "parent_run_id": ctx.parent_run_id},
        n_teachers=n_teachers, timings_s=ctx.timings, throughput=throughput, guard=guard, artifacts=artifacts,
        resources=resources, meta=finish_meta(ctx.meta), specialists=specialists,
    )
    write_json(join(ctx.storage_url, "report.json"), report)
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=2))
    tracker.log_table(scores, "scores.json")
    tracker.log_metrics({f"summary/{k}": float(v) for k, v in report["summary"].items() if isinstance(v, (int, float))})
    tracker.log_dict(report, "report.json")
    stuck = {f"alloy.no_lift.{d}": r["no_lift"] for d, r in report["domains"].items() if r.get("no_lift")}
    if stuck:  # a specialist that did not learn, and why: on the parent run, where the dashboard shows it
        tracker.set_tags(stuck)
    charts = log_charts(tracker, report)
    annotate_registered_student(tracker, report)
    url = mlflow_run_url(mlflow_ui_url(), getattr(tracker, "experiment_id", None), ctx.parent_run_id)
    rows = [{"domain": d, **{k: v for k, v in r.items() if not isinstance(v, dict) and k != "no_lift"},
             **{f"{k} ({st})": v for k in ("raw", "hacks_per_100", "reward") for st, v in (r.get(k) or {}).items()}}
            for d, r in report["domains"].items()]
    create_table_artifact(key="alloy-scores", table=rows, description="Per-domain eval scores (base / specialist / student)")
    create_markdown_artifact(key="alloy-summary", markdown=summary_markdown(report, url, charts),
                             description="Alloy run summary")
    s = report["summary"]
    log.info("report: %d domains, base mean %s, specialist mean %s, student mean %s", s["n_domains"], s["base_mean"],
             s["specialist_mean"], s["student_mean"])
    return report


def summary_markdown(report: dict, mlflow_url: str | None, charts: list[str]) -> str:
    """The Prefect summary artifact: the report table, then where to read more in MLflow."""
    mf = report.get("mlflow") or {}
    lines = ["```", render_table(report), "```", ""]
    if mlflow_url:
        lines.append(f"**MLflow run:** [{mf.get('parent_run_id')}]({mlflow_url})")
    elif mf.get("parent_run_id"):
        lines.append(f"**MLflow run:** `{mf.get('parent_run_id')}` in experiment `{mf.get('experiment')}` "
                     f"(`{mf.get('tracking_uri')}`; set ALLOY_MLFLOW_UI_URL to get a link here)")
    if charts:
        lines.append("Charts in the run's artifacts: " + ", ".join(f"`{c}`" for c in charts))
    reg = (report.get("artifacts") or {}).get("registered_model")
    if reg:
        lines.append(f"Registered model: `{reg}` (alias `candidate`)")
    return "\n".join(lines)
