"""Base stage: SFT of a fresh tiny model (or a given HF checkpoint) on mixed-domain demonstrations.

Produces the base checkpoint every later stage starts from. The checkpoint is committed to storage with a
COMPLETE manifest; a rerun with the same config reuses it instead of training again. One rank trains in-process;
several ranks run `tasks.base_worker` under torchrun.
"""
from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.models import init_model_dir
from infra.storage import join, latest_complete, load_checkpoint, save_checkpoint
from tasks.base_worker import WORKER as BASE_WORKER, run_base_sft
from tasks.context import RunContext, stage_timer
from tasks.prefixes import base_prefix
from tasks.worker_process import run_worker, worker_command

log = logging.getLogger("alloy")


def torchrun_command(module: str, nproc: int, args: list[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node N -m module args…` (single node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args]


def run_multi_rank(cmd: list[str], log_path: Path, steps: int) -> None:
    """torchrun `cmd` as a worker process (tasks/worker_process.py: own session, stops with us), following the base
    SFT's progress lines."""
    run_worker(cmd, log_path, steps, cmd[6], rb"base SFT: (\d+)/\d+")


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
            shutil.rmtree(local, ignore_errors=True)
            load_checkpoint(found, str(local))
            return str(local)

        init_dir = (Path(cfg.model.path).expanduser() if cfg.model.path
                    else init_model_dir(cfg.model.preset, ctx.work_dir / "base-init", seed=cfg.run.seed))
        shutil.rmtree(local, ignore_errors=True)
        t0 = time.monotonic()
        with ctx.tracker.child("base", tags={"stage": "base"}) as run:
            if cfg.base.train.world_size == 1:
                run_base_sft(cfg, ctx.domains, str(init_dir), str(local), run)
            else:
                args = BASE_WORKER.flags(config=ctx.config_path, init=init_dir, out=local,
                                         mlflow_run_id=getattr(run, "run_id", None))
                cmd = torchrun_command(BASE_WORKER.module, cfg.base.train.world_size, args)
                run_multi_rank(worker_command(cmd, ctx.overrides), ctx.work_dir / "logs" / "base.log", cfg.base.steps)
        url = save_checkpoint(str(local), join(prefix, f"step-{cfg.base.steps:08d}"), step=cfg.base.steps,
                              meta={"stage": "base", "config_fingerprint": cfg.fingerprint(),
                                    "train_s": round(time.monotonic() - t0, 3)})  # `alloy run --dry-run` estimates
        log.info("base: committed %s", url)
        return str(local)
