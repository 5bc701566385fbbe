"""Run a trainer as a child process (its own torch.distributed group, engine server, event loop) and follow it.

Trainers log lines like "<what> step 12/60: ..." ; `run_worker` tails the log, drives a progress bar and an
optional callback (Prefect progress artifact), and raises with the log tail when the process fails. The child gets
none of our rendezvous variables (a fresh process group) and dies with us (PDEATHSIG via the launcher's helper
is not needed: we wait on it, and a cancelled task kills it in `finally`).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from infra.progress import progress

log = logging.getLogger("alloy")

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def overrides_args(overrides: list[str]) -> list[str]:
    return sum((["--set", s] for s in overrides), [])


def run_worker(cmd: list[str], log_path: Path, steps: int, label: str, step_pattern: bytes,
               on_step: Callable[[int], None] | None = None) -> None:
    """Run `cmd` with stdout+stderr appended to `log_path`; follow `step_pattern` (one group: the step number)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(step_pattern)
    log.info("%s: process log %s", label, log_path)
    last = -1
    with open(log_path, "ab") as fh, progress(label, max(steps, 1)) as bar:
        start = fh.tell()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                with open(log_path, "rb") as r:
                    r.seek(start)
                    hits = pattern.findall(r.read())
                if hits and int(hits[-1]) != last:
                    last = int(hits[-1])
                    bar(last)
                    if on_step is not None:
                        on_step(last)
        finally:
            if proc.poll() is None:  # cancelled or interrupted: take the whole process group down
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"{label} failed with exit code {proc.returncode}; last log lines ({log_path}):\n"
                           + "\n".join(tail))
