"""The model rewards' servers: each reward model and chat judge a model-rewarded domain needs, served while the
specialists train and the stages are evaluated (domains/model_reward.py).

    with serve_rewards(ctx, reward_models) as ctx:     # ctx.cfg and ctx.overrides now hold the servers' URLs
        ... evaluate the base, train the specialists, distill, evaluate the student ...

A domain's `reward.reward_model` (a `reward_models` entry trained by tasks/reward_models.py: its local `final/`) or
a judge's `reward.model` (a chat checkpoint directory) is served once, shared by every domain that names it, by one
engine server (`engine.backend`, bound to `engine.host`, `engine.api_key`) under a `Supervisor` that restarts it on
the same port if it dies, as tasks/judge.py serves the anti-hack judge. A domain with an external `reward.url` needs
nothing. The URLs reach the specialist workers as config overrides (`domains.<i>.reward.served_url`, an ops field:
no checkpoint prefix moves with the port) and the flow process's evaluation through the context's config. The
servers stop when the block ends, however it ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Iterator, Mapping

from engine.launcher import ServerSpec, Supervisor
from infra.config import ConfigError
from tasks.context import RunContext

log = logging.getLogger("alloy")


def reward_checkpoints(cfg, reward_models: Mapping[str, dict]) -> dict[int, tuple[str, Path]]:
    """{domain index: (server name, checkpoint dir)} of every domain whose reward the pipeline serves:
    `reward_model` (its trained `local_dir` in `reward_models`, the stage's summaries) or a judge's `model`."""
    out: dict[int, tuple[str, Path]] = {}
    for i, d in enumerate(cfg.domains):
        rc = d.reward
        if rc is None or rc.served_url or rc.url:
            continue
        if rc.kind == "model":
            summary = reward_models.get(rc.reward_model)
            if summary is None:
                raise ConfigError(f"domains.{i}.reward.reward_model: reward model {rc.reward_model!r} was not trained "
                                  "in this run")
            out[i] = (f"rm-{rc.reward_model}", Path(summary["local_dir"]))
        else:
            path = Path(rc.model).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(f"domains.{i}.reward.model: {rc.model} is not a model checkpoint directory (no "
                                  f"config.json, from {Path.cwd()})")
            out[i] = (f"judge-{path.name}"[:60], path)
    return out


def with_served(cfg, urls: Mapping[int, str]):
    """`cfg` with `domains.<i>.reward.served_url` set for each (index, url)."""
    domains = list(cfg.domains)
    for i, url in urls.items():
        d = domains[i]
        domains[i] = d.model_copy(update={"reward": d.reward.model_copy(update={"served_url": url})})
    return cfg.model_copy(update={"domains": domains})


@contextlib.contextmanager
def serve_rewards(ctx: RunContext, reward_models: Mapping[str, dict]) -> Iterator[RunContext]:
    """Serve every reward model and judge checkpoint the domains need while the block runs; yield a context whose
    config and worker overrides hold their URLs (`ctx` itself when nothing is to be served)."""
    wanted = reward_checkpoints(ctx.cfg, reward_models)
    if not wanted:
        yield ctx
        return
    ec = ctx.cfg.engine
    sup = Supervisor.for_engine(ctx.work_dir / "logs" / "rewards", ec, ctx.cfg.teachers)  # the teachers' budget
    try:
        by_path = {str(path): name for name, path in wanted.values()}  # one server per checkpoint
        urls = sup.start([ServerSpec.for_engine(name, path, ec) for path, name in by_path.items()])
        served = {i: urls[by_path[str(path)]] for i, (_, path) in wanted.items()}
        for i, url in served.items():
            log.info("rewards: domain %s's %s served at %s", ctx.cfg.domains[i].name, wanted[i][1], url)
        overrides = [f"domains.{i}.reward.served_url={url}" for i, url in served.items()]
        yield dataclasses.replace(ctx, cfg=with_served(ctx.cfg, served), overrides=[*ctx.overrides, *overrides])
    finally:
        sup.stop()
