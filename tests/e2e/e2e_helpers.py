"""Helpers of the e2e tests: the CLI as a user runs it, a user's environment, the Prefect/MLflow REST APIs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alloy.detached import http_json

ROOT = Path(__file__).resolve().parents[2]
ALLOY = [sys.executable, "-m", "alloy.cli"]
# Shrinks configs/smoke.yaml to two domains (one round of specialists at max_parallel 2) and two steps per stage
# (a checkpoint at the last one): the point here is the deployment path, not model quality.
DOMAINS = ("reverse", "max_list")
FAST = ["domains=[" + ", ".join("{name: %s}" % d for d in DOMAINS) + "]", "base.steps=10",
        "base.n_train_per_domain=200", "eval.n_eval=10", "specialists.steps=2", "specialists.batch_size=8",
        "specialists.checkpoint_every=2", "distill.steps=2", "distill.batch_size=12", "distill.eval_every=0"]
# the e2e stack's worker asks for scheduled flow runs every 2 s (Prefect's default: 10 s): less idle waiting
FAST_POLL = {"PREFECT_WORKER_QUERY_SECONDS": "2"}


def user_env() -> dict[str, str]:
    """The environment of a user's shell: nothing Prefect/MLflow/rendezvous-related left over by other tests."""
    drop = ("PREFECT_", "MLFLOW_TRACKING_URI", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def run_cli(*args: str, timeout: float = 300.0, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ALLOY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env or user_env())


def api_get(url: str):
    """A REST API's JSON answer; a 503 (Prefect's "retry me" while SQLite is busy) is retried as Prefect's client does."""
    return http_json(url)


def api_send(url: str, body: dict, method: str = "POST"):
    """A JSON request to a REST API; its JSON answer (None for an empty one, e.g. Prefect's 204 of a PATCH)."""
    return http_json(url, body, method, timeout=10.0)
