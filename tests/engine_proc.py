"""Test helpers for the embedded engine server as a real subprocess on loopback (shared by the engine test files)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from engine.launcher import free_port, log_tail

REPO = Path(__file__).resolve().parents[1]


def http(base: str, path: str, data: bytes | None = None, method: str = "POST", headers: dict | None = None,
         timeout: float = 60.0) -> tuple[int, bytes]:
    """One plain-urllib request → (status, raw body); HTTP errors are returned, not raised."""
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class EngineProc:
    """`python -m engine.server` on a fixed free port; can be SIGKILLed and started again on the same port."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, api_key: str | None = None):
        self.model_dir, self.log_path, self.extra, self.api_key = model_dir, log_path, list(extra), api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EngineProc":
        cmd = [sys.executable, "-m", "engine.server", "--model", str(self.model_dir), "--port", str(self.port),
               "--host", "127.0.0.1", "--weight-version", "w0", *self.extra]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> "EngineProc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if http(self.url, "/health", method="GET", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"server did not become healthy; log:\n{log_tail(self.log_path)}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V): row t = log_softmax(logits at position t) = log P(· | ids[:t+1]) from an unpadded forward."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def json_body(payload: bytes):
    try:
        return json.loads(payload) if payload else None
    except ValueError:
        return payload.decode(errors="replace")
