"""Run a trainer as a child process (its own torch.distributed group, engine server, event loop) and follow it.

A trainer reports its steps as data (training/progress_events.py: `report` appends JSON lines to the file named by
`ALLOY_PROGRESS_FILE`, which `run_worker` sets to `progress_path(log_path)`); `run_worker` reads them, drives a
progress bar and an optional callback (Prefect progress artifact), and raises with the log tail when the process
fails. Its log lines stay for people: nothing parses them.

The child gets none of our rendezvous variables (a fresh torch process group), leads its own session (one `killpg`
reaches whatever it spawned; a terminal's Ctrl-C does not reach it directly), and dies with us: `PR_SET_PDEATHSIG`
(infra/procs.py; `run_worker` forks from the thread that waits on the child, so the signal follows that wait), and
a cancelled task or a stop request (the first Ctrl-C of `alloy run`, alloy/interrupt.py) SIGTERMs its group,
SIGKILL after `STOP_GRACE_S`, and raises `infra.procs.Stopped`.

Config overrides reach the child as `--set key=value` argv, except secrets: argv is world-readable (`ps`), so
`worker_command` moves those into the child's environment (infra.config `secret_overrides_env`), where its
`load_config` reads them back: the child ends up with the same effective config.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from infra import procs, zygote
from infra.config import secret_overrides_env, split_secret_overrides
from infra.progress import progress
from training.progress_events import PROGRESS_ENV, read_events

log = logging.getLogger("alloy")

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_S = 15.0  # a trainer's clean stop (servers down, MLflow run KILLED) fits well within it


class WorkerCommand(list):
    """A child's argv (a plain list: what logs and `ps` show) plus `env`, the variables it must also get: the
    config overrides that name secrets. Never printed (repr is the argv's)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        super().__init__(argv)
        self.env = dict(env or {})

    def __add__(self, other: list) -> "WorkerCommand":
        return WorkerCommand(list(self) + list(other), {**self.env, **getattr(other, "env", {})})


def overrides_args(overrides: list[str]) -> list[str]:
    """`--set` argv of the overrides that name no secret (the others: `worker_command`)."""
    return sum((["--set", s] for s in split_secret_overrides(overrides)[0]), [])


def worker_command(argv: list[str], overrides: list[str]) -> WorkerCommand:
    """`argv` plus the config overrides: `--set` arguments for the plain ones, environment for the secret ones."""
    return WorkerCommand(list(argv) + overrides_args(overrides),
                         secret_overrides_env(split_secret_overrides(overrides)[1], os.environ))


def torchrun_command(module: str, nproc: int, args: list[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node N -m module args…` (single node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
            *args]


def on_ranks(cmd: list[str], world_size: int) -> list[str]:
    """A worker's command (`[python, -m, module, flags…]`; a `WorkerCommand` keeps its env) as is for one rank, else
    under torchrun with `world_size` ranks: the launch path of every multi-rank trainer (base, specialists, student)."""
    if world_size == 1:
        return cmd
    if list(cmd[1:2]) != ["-m"]:
        raise ValueError(f"on_ranks: expected [python, -m, module, ...], got {list(cmd)[:3]}")
    return WorkerCommand(torchrun_command(cmd[2], world_size, list(cmd[3:])), getattr(cmd, "env", {}))


def worker_env(cmd: list[str]) -> dict[str, str]:
    """Our environment without the rendezvous variables (the child makes its own process group), plus `cmd.env`."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    return {**env, **getattr(cmd, "env", {})}


def progress_path(log_path: Path) -> Path:
    """Where `run_worker`'s child reports its steps: beside its log `<name>.log`, `<name>.progress.jsonl`."""
    return log_path.with_name(f"{log_path.stem}.progress.jsonl")


def run_worker(cmd: list[str], log_path: Path, steps: int, label: str,
               on_step: Callable[[int], None] | None = None) -> None:
    """Run `cmd` (a `WorkerCommand` brings its env) with stdout+stderr appended to `log_path`; follow the steps it
    reports (`progress_path(log_path)`): the bar, and `on_step(step)` whenever the newest step changes."""
    events_path = progress_path(log_path)
    env = {**worker_env(cmd), PROGRESS_ENV: str(events_path)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: process log %s", label, log_path)
    last = -1
    procs.raise_if_stopped(f"{label} not started")
    with open(log_path, "ab") as fh, progress(label, max(steps, 1)) as bar:
        offset = events_path.stat().st_size if events_path.exists() else 0  # a retry appends: only its own events
        proc = zygote.start(cmd, env=env, stdout=fh)
        # a stop request SIGTERMs the trainer at once, even while this thread is busy (a slow progress update)
        token = procs.on_stop(lambda: procs.signal_group(proc.pid, signal.SIGTERM))
        try:
            while proc.poll() is None:
                if procs.stop_requested():
                    log.warning("%s: stopping (pid %d)", label, proc.pid)
                    code = procs.stop_group(proc, STOP_GRACE_S)
                    raise procs.Stopped(f"{label} stopped on request (exit code {code}); log {log_path}")
                time.sleep(0.5)
                events, offset = read_events(events_path, offset)
                if events and events[-1].step != last:
                    last = events[-1].step
                    bar(last)
                    if on_step is not None and not procs.stop_requested():  # a stop does not wait on Prefect's API
                        on_step(last)
        finally:
            procs.cancel_on_stop(token)
            if proc.poll() is None:  # cancelled or interrupted: take the whole process group down
                procs.stop_group(proc, STOP_GRACE_S)
    if proc.returncode != 0 and procs.stop_requested():
        raise procs.Stopped(f"{label} stopped on request (exit code {proc.returncode}); log {log_path}")
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"{label} failed with exit code {proc.returncode}; last log lines ({log_path}):\n"
                           + "\n".join(tail))
