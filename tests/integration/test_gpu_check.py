"""bench/gpu_check.py on a machine without CUDA: the GPU parts are skipped and say why, the CPU parts (a specialist
and a distill step with embedded engine servers) pass, the JSON has its shape, and nothing imported Prefect, MLflow
or SGLang (each part runs with them made absent, as on a bare CUDA machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(out), "--part-timeout", "240"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"] is True and report["failed"] == [], proc.stderr[-3000:]
    assert report["cuda"] is False and report["device_count"] == 0
    assert set(report["parts"]) == {"probe", "deepspeed_zero0", "deepspeed_zero1", "deepspeed_zero2",
                                    "deepspeed_zero3", "deepspeed_zero3_buckets", "torch_bf16",
                                    "deepspeed_zero2_2ranks", "placement", "specialist_step", "distill_step",
                                    "loss_memory", "shared_gpu"}
    for name, part in report["parts"].items():
        if name in ("probe", "specialist_step", "distill_step"):
            assert part["status"] == "ok" and part["blocked_loaded"] == [], (name, part)
        else:
            assert part == {"status": "skipped", "reason": "no CUDA device"}, (name, part)
    assert report["parts"]["specialist_step"]["steps"] == 2 and len(report["parts"]["distill_step"]["loss"]) == 2
    imports = report["imports"]
    assert imports["prefect"] is False and imports["mlflow"] is False and imports["loaded"] == []
    assert imports["blocked"] == ["prefect", "mlflow", "sglang"]
    assert "prefect" not in imports["attempted"]  # our code never asks for it (DeepSpeed probes mlflow, optionally)


def test_gpu_check_fails_loudly(tmp_path):
    """A part that breaks makes the bench fail: exit 1, "ok": false, the part named with its error."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(out), "--only", "specialist_step",
                           "--part-timeout", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=120)
    report = json.loads(out.read_text())
    assert proc.returncode == 1 and report["ok"] is False and report["failed"] == ["probe", "specialist_step"]
    assert report["parts"]["specialist_step"]["error"] == "timed out after 0.5 s"  # the timeout is every part's
