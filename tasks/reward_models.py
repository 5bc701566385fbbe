"""Reward-model stage: each configured `reward_models.<name>` trained on its preference pairs, after the base stage and
before the specialists (flows/pipeline.py), one at a time on the base's GPU lane.

Each is a trainer process (`python -m training.reward_main`, under torchrun when its `train.world_size > 1`) launched
by the one stage launcher (tasks/stage.py): it commits `<prefix>/final` (the HF sequence-classification model, its
tokenizer and `reward_model.json`), its summary stored beside it; the prefix is `rm-<name>-<hash>`
(`tasks.prefixes.reward_model_prefix_of`), so a rerun with the same settings and data reuses it without training,
and `alloy rm train CONFIG --name NAME` trains exactly the checkpoint the pipeline would reuse.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import ConfigError
from tasks.context import RunContext, stage_timer
from tasks.prefixes import reward_model_prefix_of
from tasks.stage import reuse_or_train, run_trainer
from tasks.worker_process import WorkerCommand, on_ranks, worker_command
from training.reward_main import WORKER as RM_WORKER


def reward_model_init(ctx: RunContext, name: str, base_dir: str | Path | Callable[[], Path] | None) -> Path:
    """Where `reward_models.<name>` starts: the base checkpoint (`init: base`; `base_dir` may be a function that
    fetches it, called only here, i.e. only to train) or its own checkpoint directory; ConfigError naming the setting
    when that is not there."""
    init = ctx.cfg.reward_models[name].init
    if init == "base":
        if callable(base_dir):
            base_dir = base_dir()
        if base_dir is None:
            raise ConfigError(f"reward_models.{name}.init: `base` needs the base stage's checkpoint; train the base "
                              "first (alloy run) or set a checkpoint directory")
        return Path(base_dir)
    path = Path(init).expanduser()
    if not path.is_dir():
        raise ConfigError(f"reward_models.{name}.init: no such directory on this machine: {init}")
    return path


def reward_model_command(ctx: RunContext, name: str, init_dir: Path, out_url: str, result: Path,
                         run_id: str | None) -> WorkerCommand:
    """The trainer's argv (on the reward model's `train.world_size` ranks); secret overrides ride in its env."""
    cmd = RM_WORKER.argv(config=ctx.config_path, name=name, init=init_dir, out=out_url, result=result,
                         work_dir=ctx.work_dir / f"rm-{name}-work", mlflow_run_id=run_id)
    return on_ranks(worker_command(cmd, ctx.overrides), ctx.cfg.reward_models[name].train.world_size)


def train_reward_model(ctx: RunContext, name: str, base_dir: str | Path | Callable[[], Path] | None = None,
                       out_url: str | None = None) -> dict:
    """Reuse or train `reward_models.<name>` (its own prefix, or `out_url`); returns its summary with `checkpoint`
    (the committed `final/` URL), `local_dir` (a local copy of it) and `reused` (True when a complete `final/` was
    reused: nothing trained and, as for every reused stage, no MLflow run opened)."""
    prefix = out_url or reward_model_prefix_of(ctx.cfg, ctx.storage_url, name)
    result = ctx.work_dir / "logs" / f"rm-{name}-result.json"
    local = ctx.work_dir / "reward_models" / name

    trained = False

    def train() -> None:
        nonlocal trained
        trained = True
        init_dir = reward_model_init(ctx, name, base_dir)
        with ctx.tracker.child(f"reward_model/{name}", tags={"stage": "reward_model", "reward_model": name}) as run:
            cmd = reward_model_command(ctx, name, init_dir, prefix, result, getattr(run, "run_id", None))
            run_trainer(cmd, ctx, "base", ctx.work_dir / "logs" / f"rm-{name}.log", ctx.cfg.reward_models[name].steps,
                        f"reward model {name}")

    summary, final = reuse_or_train(ctx, prefix, f"reward model {name}", result, local, train)
    return {**summary, "checkpoint": final, "local_dir": str(local), "reused": not trained}


@task(name="train-reward-models", cache_policy=NO_CACHE)
def train_reward_models(ctx: RunContext, base_dir: str) -> dict[str, dict]:
    """{name: summary} of every configured reward model, each reused or trained in config order ({} without any)."""
    out = {}
    with stage_timer(ctx, "reward_models"):
        for name in ctx.cfg.reward_models:
            out[name] = train_reward_model(ctx, name, base_dir)
    return out
