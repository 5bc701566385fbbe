"""Teacher servers for distillation: one engine server per specialist checkpoint, or `teachers.external` URLs.

`start_teachers` launches (through a `Supervisor`, which restarts a dead server on the same port with the same
weights) one server per `{domain: checkpoint_dir}` as the `engine` section says (`ServerSpec.for_engine`), adds the
external `{domain: url}` teachers, waits until every teacher answers (`engine.launcher.wait_healthy`), and checks
that every teacher's tokenizer matches the student's: OPD compares log-probs token id by token id, so a teacher with
another vocabulary would train the student on nonsense. Any failure stops whatever was launched and raises with a
message naming the domain(s). The servers live until `TeacherFleet.stop()`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from engine.client import EngineUnavailable
from engine.launcher import ServerSpec, Supervisor, wait_healthy
from tasks.context import RunContext, stage_timer
from tasks.gpu_lanes import server_placements
from teachers.registry import TeacherRegistry

log = logging.getLogger("alloy")


@dataclass
class TeacherFleet:
    """The running teachers: {domain: url} plus the supervisor of the launched ones (None if all are external)."""

    registry: TeacherRegistry
    supervisor: Supervisor | None
    launched: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    tokenizers: dict[str, str] = field(default_factory=dict)  # domain → "match" | "unverified: …"

    def endpoints(self) -> dict[str, str]:
        return self.registry.endpoints()

    def status(self) -> list[dict]:
        return self.supervisor.status() if self.supervisor else []

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


def teacher_sources(domains: list[str], checkpoints: Mapping[str, str],
                    external: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split into ({domain: checkpoint} to launch, {domain: url} external); an external URL wins over a checkpoint.
    Raises naming every domain that has neither."""
    missing = [d for d in domains if d not in checkpoints and d not in external]
    if missing:
        raise ValueError(f"no teacher for domain(s) {missing}: give a specialist checkpoint or a teachers.external URL")
    ext = {d: external[d] for d in domains if d in external}
    launch = {d: str(checkpoints[d]) for d in domains if d in checkpoints and d not in ext}
    return launch, ext


def start_teachers(domains: list[str], checkpoints: Mapping[str, str], student_dir: str, *, log_dir: str | Path,
                   engine_cfg, teachers_cfg, placements: Mapping[str, dict] | None = None) -> TeacherFleet:
    """Launch / register every domain's teacher, wait for health, check tokenizers against `student_dir`.
    `engine_cfg` / `teachers_cfg` are `infra.config.EngineConfig` / `TeachersConfig`; launched servers bind to
    `engine_cfg.host`. `placements`: {domain: its planned GPUs} (tasks/gpu_lanes.py `server_placements`)."""
    launch, external = teacher_sources(domains, checkpoints, teachers_cfg.external)
    for d in sorted(set(external) & set(checkpoints)):
        log.info("teachers: %s uses the external teacher %s, not its specialist checkpoint", d, external[d])
    sup = Supervisor.for_engine(log_dir, engine_cfg, teachers_cfg) if launch else None
    try:
        urls = dict(external)
        if sup is not None:
            specs = [ServerSpec.for_engine(f"teacher-{d}", p, engine_cfg, (placements or {}).get(d))
                     for d, p in launch.items()]
            started = sup.start(specs)
            urls.update({d: started[f"teacher-{d}"] for d in launch})
        registry = TeacherRegistry(urls, api_key=engine_cfg.api_key, client_kwargs={"timeout": 30.0, "max_retries": 3})
        down = wait_healthy(external, teachers_cfg.health_timeout_s, engine_cfg.api_key)  # the launched ones are up
        if down:
            raise EngineUnavailable("teachers not healthy: "
                                    + ", ".join(f"{d} ({registry.endpoint(d)})" for d in sorted(down)))
        checked = registry.check_tokenizers(student_dir) if teachers_cfg.check_tokenizers else {}
    except BaseException:
        if sup is not None:
            sup.stop()
        raise
    unverified = {d: r for d, r in checked.items() if r != "match"}
    if unverified:
        log.warning("teachers: tokenizer not verifiable for %s", unverified)
    log.info("teachers: %d up (%d launched, %d external)", len(domains), len(launch), len(external))
    return TeacherFleet(registry, sup, sorted(launch), sorted(external), checked)


@task(name="serve-teachers", cache_policy=NO_CACHE)
def serve_teachers(ctx: RunContext, checkpoints: dict[str, str], student_dir: str) -> TeacherFleet:
    """One teacher per configured domain (specialist checkpoint or `teachers.external`), tokenizers checked."""
    with stage_timer(ctx, "teachers_up"):
        fleet = start_teachers(list(ctx.domains), checkpoints, student_dir, log_dir=ctx.work_dir / "logs" / "teachers",
                               engine_cfg=ctx.cfg.engine, teachers_cfg=ctx.cfg.teachers,
                               placements=server_placements(ctx.cfg, "teacher"))
    ctx.tracker.set_tags({"alloy.teachers.n": len(fleet.endpoints()), "alloy.teachers.launched": ",".join(fleet.launched),
                          "alloy.teachers.external": ",".join(fleet.external)})
    return fleet
