"""What ran, and where: the code's commit, the host's CPU, the load, the command line. One source for the benches'
`meta` (bench/harness.py) and the pipeline's `report.json` `meta` (tasks/report.py), so every published figure names
the tree and the machine it came from (docs/results.md cites them)."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the code tree this process imported Alloy from


def git_state(repo: Path = REPO) -> dict:
    """{"commit": HEAD's sha, "dirty": tracked files differ from it}; None for both outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if head else None
    return {"commit": head.strip() if head else None, "dirty": bool(status.strip()) if status is not None else None}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows: the host class every timing must name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if re.match(r"model name\s*:", line):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    """The installed torch's version, read from its metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_meta(**extra) -> dict:
    """A run's meta at its start: commit (+ dirty) of the code tree, CPU model and count, load average, python,
    torch, platform, this process's command line (`sys.argv`), the UTC start time; `extra` keys are added as given."""
    return {**git_state(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()), "python": platform.python_version(), "torch": torch_version(),
            "platform": platform.platform(), "argv": list(sys.argv), "started_at": now_utc(), **extra}


def finish_meta(meta: dict) -> dict:
    """A copy of `meta` with the load average and the UTC time at its end."""
    return {**meta, "loadavg_end": list(os.getloadavg()), "ended_at": now_utc()}
