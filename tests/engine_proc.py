"""Test helpers for the embedded engine server as a real subprocess on loopback (shared by the engine test files)."""
from __future__ import annotations

import json
import os
import shutil
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

# The engine conformance tests run on CPU in float32 by default. On a GPU machine,
#   ALLOY_TEST_ENGINE_DEVICE=cuda [ALLOY_TEST_ENGINE_DTYPE=bfloat16|float32|float16|auto]
# starts every test server with --device/--dtype (and in-process engines with device=/dtype=), so the same tests
# check the engine on that device. Comparisons of exact float32 numbers against an in-process HF forward on CPU
# (greedy ids, log-probs at 1e-4) only hold on CPU float32: they are skipped otherwise (`REFERENCE_NUMERICS`);
# tests/integration/test_engine_device.py checks a bf16 server against HF at a derived tolerance.
ENGINE_DEVICE = os.environ.get("ALLOY_TEST_ENGINE_DEVICE", "").strip() or "cpu"
ENGINE_DTYPE = os.environ.get("ALLOY_TEST_ENGINE_DTYPE", "").strip() or "auto"
REFERENCE_NUMERICS = ENGINE_DEVICE == "cpu" and ENGINE_DTYPE in ("auto", "float32")
NOT_REFERENCE_REASON = (f"compares exact CPU float32 numbers against an in-process HF forward; the engine runs on "
                        f"{ENGINE_DEVICE}/{ENGINE_DTYPE} (ALLOY_TEST_ENGINE_DEVICE/DTYPE)")


from engine.device import logprob_tolerance  # noqa: E402 - (dtype, layers, max |logit|) → log-prob tolerance


# the tiny test model (tests/conftest.py: 2 layers, |logits| ≤ 1.4 on the test prompts, bounded by 2 here)
TINY_LP_TOL = 1e-4 if REFERENCE_NUMERICS else logprob_tolerance(
    "bfloat16" if ENGINE_DTYPE == "auto" and ENGINE_DEVICE != "cpu" else
    ("float32" if ENGINE_DTYPE == "auto" else ENGINE_DTYPE), 2, 2.0)


def engine_flags(extra: list[str] | tuple = ()) -> list[str]:
    """--device/--dtype of a test server (unless `extra` names them itself)."""
    out = []
    if "--device" not in extra:
        out += ["--device", ENGINE_DEVICE]
    if "--dtype" not in extra:
        out += ["--dtype", ENGINE_DTYPE]
    return out


def engine_kwargs() -> dict:
    """device=/dtype= of an in-process `engine.scheduler.Engine` in a test."""
    return {"device": ENGINE_DEVICE, "dtype": ENGINE_DTYPE}


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
               "--host", "127.0.0.1", "--weight-version", "w0", *engine_flags(self.extra), *self.extra]
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


def make_reward_model(base_dir, out_dir, num_labels: int = 1, seed: int = 0):
    """`base_dir` (a tiny causal LM) as a sequence-classification checkpoint with a random head of unit scale (so
    scores differ visibly), its tokenizer files beside it."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=num_labels)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for f in base_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out_dir / f.name)
    return out_dir
