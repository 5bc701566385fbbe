"""The GPU placement (infra/placement.py, docs/placement.md) applied to the processes a stage launches.

When a plan applies (`resources.gpus_per_node` set, or CUDA devices present), `trainer_lane(cmd, cfg, stage)`
holds one free lane of `stage` (a trainer of the plan: specialists have `max_parallel` lanes, base and distill one)
and adds to the trainer's command the environment `infra.placement.trainer_env` gives it: CUDA_VISIBLE_DEVICES of
its GPUs, its own rollout server's placement, which `PolicyServer.for_engine` applies inside the trainer, and with
`resources.share_gpus` its memory fraction (ALLOY_GPU_MEM_FRACTION, which its ranks cap their allocator at).
`server_placements(cfg, kind)` is the same for the teacher servers, the guard's judge and the reward servers. Without
GPUs both change nothing.

A lane is held as an exclusive `flock` on a file under the temp dir, keyed by the node's visible devices: the
specialist tasks of one flow run (threads) and specialist flow runs of one worker node (processes, deployment mode)
never get the same lane; a crashed holder's lock goes with its process.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

from infra import procs
from infra.placement import Plan, make_plan, placements_of, trainer_env, visible_devices
from tasks.worker_process import WorkerCommand

log = logging.getLogger("alloy")

LANE_DIR_ENV = "ALLOY_LANE_DIR"  # where the lane lock files go (default: the temp dir)


def node_gpus(cfg) -> int:
    """GPUs of this node: `resources.gpus_per_node`, else the CUDA devices this process sees (0 without CUDA)."""
    if cfg.resources.gpus_per_node is not None:
        return cfg.resources.gpus_per_node
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_plan(cfg) -> tuple[Plan, list[str]] | None:
    """(plan, node device ids of plan GPUs 0..N-1), or None when this node has no GPUs. Raises PlacementError."""
    gpus = node_gpus(cfg)
    if gpus <= 0:
        return None
    return make_plan(cfg, gpus), visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)


def _lock_dir(visible: list[str]) -> Path:
    key = hashlib.sha256(",".join(visible).encode()).hexdigest()[:8]
    d = Path(os.environ.get(LANE_DIR_ENV) or tempfile.gettempdir()) / f"alloy-gpu-lanes-{os.getuid()}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _hold_lane(stage: str, n: int, visible: list[str], poll_s: float = 0.5) -> Iterator[int]:
    """Wait for a free lane 0..n-1 of `stage` on this node, hold it while in the block; yields its index."""
    d = _lock_dir(visible)
    while True:
        for i in range(n):
            fh = open(d / f"{stage}-{i}.lock", "w")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            try:
                yield i
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
            return
        procs.raise_if_stopped(f"{stage}: waiting for a GPU lane")
        time.sleep(poll_s)


@contextlib.contextmanager
def trainer_lane(cmd: list[str], cfg, stage: str) -> Iterator[list[str]]:
    """`cmd` with the placement of a free lane of `stage` ("base" | "specialists" | "distill") in its environment,
    the lane held while in the block; `cmd` unchanged when no plan applies."""
    placed = node_plan(cfg)
    trainers = placed[0].trainers(stage) if placed else []
    if not trainers:
        yield cmd
        return
    plan, visible = placed
    with _hold_lane(stage, len(trainers), visible) as i:
        env = trainer_env(plan, trainers[i], visible)
        log.info("%s: lane %s on GPU(s) %s (CUDA_VISIBLE_DEVICES=%s%s)", stage, trainers[i].name,
                 list(trainers[i].gpus), env["CUDA_VISIBLE_DEVICES"],
                 f", memory fraction {trainers[i].mem_fraction:.2f}" if plan.shared else "")
        yield WorkerCommand(list(cmd), {**getattr(cmd, "env", {}), **env})


def server_placements(cfg, kind: str) -> dict[str, dict]:
    """{name: placement} of the launched servers of `kind` ("teacher", "judge", "reward": named as
    `tasks.reward_servers.reward_checkpoints` names them; for `launcher.launch_settings`);
    {} without GPUs."""
    placed = node_plan(cfg)
    if placed is None:
        return {}
    return placements_of(*placed, kind)
