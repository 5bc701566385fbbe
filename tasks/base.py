"""Base stage: SFT of a fresh tiny model (or a given HF checkpoint) on mixed-domain demonstrations.

Produces the base checkpoint every later stage starts from. The checkpoint is committed to storage with a
COMPLETE manifest; a rerun with the same config reuses it instead of training again. One rank trains in-process;
several ranks run `tasks.base_worker` under torchrun.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.models import init_model_dir
from infra.config import ConfigError
from infra.storage import (MANIFEST, checkpoint_name, join, latest_complete, load_checkpoint, read_json,
                           save_checkpoint, verify_checkpoint)
from tasks.base_worker import WORKER as BASE_WORKER, run_base_sft
from training.deepspeed_backend import release_gpu_memory
from tasks.context import RunContext, stage_timer
from tasks.gpu_lanes import trainer_lane
from tasks.prefixes import base_prefix
from tasks.worker_process import run_worker, torchrun_command, worker_command

log = logging.getLogger("alloy")


def run_multi_rank(cmd: list[str], log_path: Path, steps: int) -> None:
    """torchrun `cmd` as a worker process (tasks/worker_process.py: own session, stops with us), following the steps
    the base SFT reports."""
    run_worker(cmd, log_path, steps, cmd[6])


def base_checkpoint_url(ctx: RunContext) -> str:
    """Storage URL of the committed base checkpoint `train_base` returned a local copy of: what a flow run on
    another worker is handed (deployment modes) instead of this run's local path."""
    url = join(base_prefix(ctx.cfg, ctx.storage_url), checkpoint_name(ctx.cfg.base.steps))
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


@task(name="train-base", cache_policy=NO_CACHE)
def train_base(ctx: RunContext) -> str:
    """Return the local directory of the base checkpoint (HF format)."""
    cfg = ctx.cfg
    prefix = base_prefix(cfg, ctx.storage_url)
    local = ctx.work_dir / "base"
    with stage_timer(ctx, "base"):
        found = latest_complete(prefix) if cfg.run.resume else None
        if found:
            log.info("base: reusing complete checkpoint %s", found)
            ctx.resources["base"] = {"world_size": read_json(join(found, MANIFEST))["meta"].get("world_size")}
            shutil.rmtree(local, ignore_errors=True)
            load_checkpoint(found, str(local))
            return str(local)

        init_dir = _init_dir(ctx)
        shutil.rmtree(local, ignore_errors=True)
        t0 = time.monotonic()
        with ctx.tracker.child("base", tags={"stage": "base"}) as run:
            result = ctx.work_dir / "logs" / "base-result.json"  # the trainer's summary, either way
            result.unlink(missing_ok=True)
            if cfg.base.train.world_size == 1:
                summary = run_base_sft(cfg, ctx.domains, str(init_dir), str(local), run)
                release_gpu_memory()  # trained in this process: its GPU memory goes back before the next stage
                result.parent.mkdir(parents=True, exist_ok=True)
                result.write_text(json.dumps(summary))
                world = summary["world_size"]
            else:
                args = BASE_WORKER.flags(config=ctx.config_path, init=init_dir, out=local, result=result,
                                         mlflow_run_id=getattr(run, "run_id", None))
                cmd = torchrun_command(BASE_WORKER.module, cfg.base.train.world_size, args)
                with trainer_lane(worker_command(cmd, ctx.overrides), cfg, "base") as cmd:  # tasks/gpu_lanes.py
                    run_multi_rank(cmd, ctx.work_dir / "logs" / "base.log", cfg.base.steps)
                world = json.loads(result.read_text())["world_size"]
        ctx.resources["base"] = {"world_size": world}  # the process group it trained in (report.json `resources`)
        url = save_checkpoint(str(local), join(prefix, f"step-{cfg.base.steps:08d}"), step=cfg.base.steps,
                              meta={"stage": "base", "config_fingerprint": cfg.fingerprint(), "world_size": world,
                                    "train_s": round(time.monotonic() - t0, 3)})  # `alloy run --dry-run` estimates
        log.info("base: committed %s", url)
        return str(local)
