"""The Alloy pipeline as a Prefect flow: base → (specialists → teachers → distill, in later stages) → eval → report."""
from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pandas as pd
from prefect import flow

from infra.config import load_config
from infra.tracking import NoopTracker, Tracker
from tasks.base import train_base
from tasks.context import RunContext, load_domains
from tasks.evaluate import evaluate_stage
from tasks.report import publish_report

log = logging.getLogger("alloy")


def open_run(config_path: str, overrides: list[str]) -> RunContext:
    cfg = load_config(config_path, overrides)
    domains = load_domains(cfg)
    work_dir = Path(cfg.run.root).resolve() / cfg.run.name / "work"  # local scratch; storage holds what is committed
    work_dir.mkdir(parents=True, exist_ok=True)
    if cfg.tracking.enabled:
        tracker = Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri)
        parent = tracker.start_parent(f"{cfg.run.name}-{uuid.uuid4().hex[:6]}",
                                      tags={"alloy.config": config_path, "alloy.fingerprint": cfg.fingerprint()})
        tracker.log_config(cfg.model_dump(mode="json"))
    else:
        tracker, parent = NoopTracker(), None
    return RunContext(cfg=cfg, config_path=config_path, overrides=list(overrides), work_dir=work_dir, storage_url=cfg.storage_url,
                      tracker=tracker, parent_run_id=parent or uuid.uuid4().hex, domains=domains)


@flow(name="alloy-pipeline", log_prints=True)
def pipeline(config: str, overrides: list[str] | None = None, report_path: str | None = None) -> dict:
    """Run the whole pipeline for CONFIG (a YAML path) with `a.b=c` overrides; returns the report dict."""
    ctx = open_run(config, overrides or [])
    status = "FAILED"
    try:
        base_ckpt = train_base(ctx)
        scores = evaluate_stage(ctx, base_ckpt, stage="base")
        report = publish_report(ctx, pd.concat([scores], ignore_index=True), report_path=report_path)
        status = "FINISHED"
        return report
    finally:
        ctx.tracker.end(status)
