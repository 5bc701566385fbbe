"""The model rewards' servers: each reward model and chat judge a model-rewarded domain needs, served while the
specialists train and the stages are evaluated (domains/model_reward.py).

    with serve_rewards(ctx, reward_models) as ctx:     # ctx.cfg and ctx.overrides now hold the servers' URLs
        ... evaluate the base, train the specialists, distill, evaluate the student ...

A domain's `reward.reward_model` (a `reward_models` entry trained by tasks/reward_models.py: its local `final/`) or
a judge's `reward.model` (a chat checkpoint directory) is served once, shared by every domain that names it, by one
engine server (`engine.backend`, bound to `engine.host`, `engine.api_key`) under a `Supervisor` that restarts it on
the same port if it dies, as tasks/judge.py serves the anti-hack judge; on its GPU of the plan when one applies
(`server_placements(cfg, "reward")`: `rm-<name>`, `judge-<dir name>`). A domain with an external `reward.url` needs
nothing. The URLs reach the specialist workers as config overrides (`domains.<i>.reward.served_url`, an ops field:
no checkpoint prefix moves with the port) and the flow process's evaluation through the context's config. The
servers stop when the block ends, however it ends.

`specialists.mode: deployment`: a specialist flow run may share no disk or loopback with the pipeline, so it is
handed no `served_url` (flows/handoff.py leaves them out) but the reward models' storage URLs; it pulls what its
domain needs and serves it on its own worker (`serve_rewards(ctx, reward_models, [domain])`), as it serves its
own guard judge. A judge's `reward.model` is a path: it must exist on that worker too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Iterator, Mapping

from engine.launcher import ServerSpec, Supervisor
from infra.config import ConfigError
from infra.placement import reward_server_name
from tasks.context import RunContext
from tasks.gpu_lanes import server_placements

log = logging.getLogger("alloy")


def served_domains(cfg, domains: list[str] | None = None) -> dict[int, object]:
    """{domain index: its `reward` section} of every domain among `domains` (None: all) whose reward model or judge
    is to be served here: `kind: model` with a `reward_model`, or `kind: judge` with a `model`; none with a URL."""
    return {i: d.reward for i, d in enumerate(cfg.domains)
            if d.reward is not None and not (d.reward.served_url or d.reward.url)
            and (domains is None or d.name in domains)}


def needed_reward_models(cfg, domains: list[str] | None = None) -> list[str]:
    """The `reward_models` names the served domains among `domains` (None: all) score with, in config order."""
    names = [rc.reward_model for rc in served_domains(cfg, domains).values() if rc.kind == "model"]
    return list(dict.fromkeys(names))


def reward_checkpoints(cfg, reward_models: Mapping[str, dict],
                       domains: list[str] | None = None) -> dict[int, tuple[str, Path]]:
    """{domain index: (server name, checkpoint dir)} of every domain among `domains` (None: all) whose reward the
    pipeline serves: `reward_model` (its trained `local_dir` in `reward_models`, the stage's summaries) or a judge's
    `model` (a directory on this machine: on a specialist flow run's worker in deployment mode)."""
    out: dict[int, tuple[str, Path]] = {}
    for i, rc in served_domains(cfg, domains).items():
        if rc.kind == "model":
            summary = reward_models.get(rc.reward_model)
            if summary is None:
                raise ConfigError(f"domains.{i}.reward.reward_model: reward model {rc.reward_model!r} was not trained "
                                  "in this run")
            out[i] = (reward_server_name(rc), Path(summary["local_dir"]))
        else:
            path = Path(rc.model).expanduser().resolve()  # one directory, however it is written: one server
            if not (path / "config.json").is_file():
                raise ConfigError(f"domains.{i}.reward.model: {rc.model} is not a model checkpoint directory (no "
                                  f"config.json, from {Path.cwd()}); the judge is served from this machine's disk, "
                                  "so with specialists.mode=deployment every specialist worker needs it at this path")
            out[i] = (reward_server_name(rc), path)
    return out


def with_served(cfg, urls: Mapping[int, str]):
    """`cfg` with `domains.<i>.reward.served_url` set for each (index, url)."""
    domains = list(cfg.domains)
    for i, url in urls.items():
        d = domains[i]
        domains[i] = d.model_copy(update={"reward": d.reward.model_copy(update={"served_url": url})})
    return cfg.model_copy(update={"domains": domains})


def reward_specs(cfg, by_path: Mapping[str, str]) -> list[ServerSpec]:
    """The server of each checkpoint of `by_path` ({checkpoint dir: server name}) as `cfg.engine` launches it, on its
    GPU of the plan when one applies (`infra.placement`'s `reward` procs, named as `reward_checkpoints` names them)."""
    placements = server_placements(cfg, "reward")
    return [ServerSpec.for_engine(name, path, cfg.engine, placements.get(name)) for path, name in by_path.items()]


@contextlib.contextmanager
def serve_rewards(ctx: RunContext, reward_models: Mapping[str, dict],
                  domains: list[str] | None = None) -> Iterator[RunContext]:
    """Serve every reward model and judge checkpoint the domains among `domains` (None: all) need while the block
    runs; yield a context whose config and worker overrides hold their URLs (`ctx` itself when nothing is to be
    served)."""
    wanted = reward_checkpoints(ctx.cfg, reward_models, domains)
    if not wanted:
        yield ctx
        return
    ec = ctx.cfg.engine
    sup = Supervisor.for_engine(ctx.work_dir / "logs" / "rewards", ec, ctx.cfg.teachers)  # the teachers' budget
    try:
        by_path = {str(path): name for name, path in wanted.values()}  # one server per checkpoint
        urls = sup.start(reward_specs(ctx.cfg, by_path))
        served = {i: urls[by_path[str(path)]] for i, (_, path) in wanted.items()}
        for i, url in served.items():
            log.info("rewards: domain %s's %s served at %s", ctx.cfg.domains[i].name, wanted[i][1], url)
        overrides = [f"domains.{i}.reward.served_url={url}" for i, url in served.items()]
        yield dataclasses.replace(ctx, cfg=with_served(ctx.cfg, served), overrides=[*ctx.overrides, *overrides])
    finally:
        sup.stop()
