"""The run context: everything a stage needs about the current pipeline run, built once at the flow boundary."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.config import AlloyConfig, ConfigError

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
    started: float = field(default_factory=time.monotonic)


def load_domains(cfg: AlloyConfig) -> dict:
    """Instantiate every configured domain; a bad plugin fails with the config path that names it."""
    from domains.registry import load_domain

    out = {}
    for i, d in enumerate(cfg.domains):
        try:
            out[d.name] = load_domain(d.name, impl=d.impl, difficulty=d.difficulty, params=dict(d.params))
        except Exception as exc:  # DomainLoadError or anything a plugin raises
            where = f"domains.{i}" + (".impl" if d.impl else ".name")
            raise ConfigError(f"{where}: cannot load domain {d.name!r}"
                              + (f" from plugin {d.impl!r}" if d.impl else "") + f": {exc}") from exc
    return out


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
