"""The run context: everything a stage needs about the current pipeline run, built once at the flow boundary."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from domains.registry import load_domains
from infra.config import AlloyConfig

log = logging.getLogger("alloy")


@dataclass
class RunContext:
    cfg: AlloyConfig
    config_path: str
    overrides: list  # the --set overrides the config was loaded with (passed on to worker processes)
    work_dir: Path  # local scratch for this run: logs, local copies of checkpoints
    storage_url: str  # fsspec URL where checkpoints and the report are committed
    tracker: object  # infra.tracking.Tracker or NoopTracker
    parent_run_id: str | None
    domains: dict  # name → domains.base.Domain
    timings: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)  # stage → {"world_size": W} as the trainer ran (report.json)
    started: float = field(default_factory=time.monotonic)
    meta: dict = field(default_factory=dict)  # infra.hostinfo.run_meta at the start: report.json's `meta`


class stage_timer:
    """`with stage_timer(ctx, "base"): ...` records the stage's wall time in ctx.timings."""

    def __init__(self, ctx: RunContext, name: str):
        self.ctx, self.name = ctx, name

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.ctx.timings[self.name] = self.ctx.timings.get(self.name, 0.0) + time.monotonic() - self.t0
        return False


def open_context(config_path: str, overrides: list[str], parent_run_id: str | None = None,
                 check_model_path: bool = True) -> RunContext:
    """Load the config and domains, make the run's scratch dir, and open tracking: a new MLflow parent run, or
    (`parent_run_id`, e.g. a deployment run working for a pipeline run elsewhere) that existing run.
    `check_model_path=False` for a flow that starts from a base checkpoint in storage (it never reads model.path)."""
    import uuid

    from infra.config import load_config
    from infra.hostinfo import run_meta
    from infra.tracking import NoopTracker, Tracker

    cfg = load_config(config_path, overrides, check_model_path=check_model_path)
    meta = run_meta(config=config_path, overrides=list(overrides), fingerprint=cfg.fingerprint())
    domains = load_domains(cfg)
    work_dir = Path(cfg.run.root).resolve() / cfg.run.name / "work"  # local scratch; storage holds what is committed
    work_dir.mkdir(parents=True, exist_ok=True)
    if cfg.tracking.enabled:
        tracker = Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri)
        if parent_run_id:
            tracker = tracker.resume(parent_run_id)
            parent = parent_run_id
        else:
            parent = tracker.start_parent(f"{cfg.run.name}-{uuid.uuid4().hex[:6]}",
                                          tags={"alloy.config": config_path, "alloy.fingerprint": cfg.fingerprint(),
                                                **({"alloy.commit": meta["commit"]} if meta["commit"] else {})})
            tracker.log_config(cfg.model_dump(mode="json"))
    else:
        tracker, parent = NoopTracker(), None
    return RunContext(cfg=cfg, config_path=config_path, overrides=list(overrides), work_dir=work_dir,
                      storage_url=cfg.storage_url, tracker=tracker, parent_run_id=parent or uuid.uuid4().hex,
                      domains=domains, meta=meta)
