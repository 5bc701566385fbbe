"""Base stage: SFT of a fresh tiny model (or a given HF checkpoint) on mixed-domain demonstrations.

Produces the base checkpoint every later stage starts from. The base SFT is a trainer process like the others
(`python -m training.base_main`, under torchrun when `base.train.world_size > 1`), launched by the one stage launcher
(tasks/stage.py): it commits `<prefix>/final` (COMPLETE manifest last) and writes its summary to
`logs/base-result.json`, stored beside the checkpoint as `<prefix>/result.json`; a rerun with the same config
(`run.resume`) reuses both instead of training again.
"""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import ConfigError
from infra.models import init_model_dir
from infra.storage import join, verify_checkpoint
from training.base_main import WORKER as BASE_WORKER
from tasks.context import RunContext, stage_timer
from tasks.prefixes import base_prefix
from tasks.stage import reuse_or_train, run_trainer
from tasks.worker_process import WorkerCommand, on_ranks, worker_command


def base_checkpoint_url(ctx: RunContext) -> str:
    """Storage URL of the committed base checkpoint (`<prefix>/final`) `train_base` returned a local copy of: what
    a flow run on another worker is handed (deployment modes) instead of this run's local path."""
    url = join(base_prefix(ctx.cfg, ctx.storage_url), "final")
    ok, why = verify_checkpoint(url)
    if not ok:
        raise FileNotFoundError(f"base: no complete checkpoint at {url} ({why}); the base stage commits it first")
    return url


def _init_dir(ctx: RunContext) -> Path:
    """Where the base SFT starts: `model.path` (checked here, where it is read: flow runs that start from the
    base checkpoint in storage load the config without that check), else a fresh preset model."""
    cfg = ctx.cfg
    if not cfg.model.path:
        return init_model_dir(cfg.model.preset, ctx.work_dir / "base-init", seed=cfg.run.seed)
    path = Path(cfg.model.path).expanduser()
    if not path.is_dir() and (cfg.model.path.startswith(("/", ".", "~")) or cfg.model.path.count("/") > 1):
        raise ConfigError(f"model.path: no such directory on this machine: {cfg.model.path}")
    return path


def base_command(ctx: RunContext, init_dir: Path, out_url: str, result: Path, run_id: str | None) -> WorkerCommand:
    """The trainer's argv (on `base.train.world_size` ranks); secret overrides ride in its environment."""
    cmd = BASE_WORKER.argv(config=ctx.config_path, init=init_dir, out=out_url, work_dir=ctx.work_dir / "base-work",
                           result=result, mlflow_run_id=run_id)
    return on_ranks(worker_command(cmd, ctx.overrides), ctx.cfg.base.train.world_size)


@task(name="train-base", cache_policy=NO_CACHE)
def train_base(ctx: RunContext) -> str:
    """Return the local directory of the base checkpoint (HF format)."""
    cfg, prefix = ctx.cfg, base_prefix(ctx.cfg, ctx.storage_url)
    result = ctx.work_dir / "logs" / "base-result.json"  # the trainer's summary (reused or not: tasks/stage.py)
    with stage_timer(ctx, "base"):
        def train() -> None:
            init_dir = _init_dir(ctx)
            with ctx.tracker.child("base", tags={"stage": "base"}) as run:
                cmd = base_command(ctx, init_dir, prefix, result, getattr(run, "run_id", None))
                run_trainer(cmd, ctx, "base", ctx.work_dir / "logs" / "base.log", cfg.base.steps, "base SFT")

        summary, _ = reuse_or_train(ctx, prefix, "base", result, ctx.work_dir / "base", train)
    ctx.resources["base"] = {"world_size": summary.get("world_size")}  # the process group it trained in (report.json)
    return str(ctx.work_dir / "base")
