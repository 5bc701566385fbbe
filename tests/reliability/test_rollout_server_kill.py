"""A trainer's own rollout server SIGKILLed mid-run: the supervisor restarts it on the same port with the latest
pushed weights, the trainer's client rides the restart out, and the run finishes without losing or double-training
a sample (no resume from a checkpoint needed).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.storage import latest_complete, load_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def _engine_servers(pid: int) -> list[psutil.Process]:
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "engine.server" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_rollout_server_sigkilled_mid_run_is_restarted_and_the_run_completes(tmp_path, reverse_base):
    base = reverse_base  # the session's tiny reverse base (tests/conftest.py)
    cfg = {"run": {"name": "rkill", "root": str(tmp_path)}, "domains": [{"name": "reverse"}],
           "eval": {"n_eval": 20, "max_new_tokens": 10},
           "specialists": {"steps": STEPS, "batch_size": 16, "log_every": 1, "checkpoint_every": 5,
                           "over_sampling": 2.0, "max_staleness": 50}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = f"file://{tmp_path}/spec"
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", str(tmp_path / "cfg.json"),
           "--domain", "reverse", "--init", str(base), "--out", out, "--work-dir", str(work),
           "--result", str(tmp_path / "r.json")]
    log = tmp_path / "run.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            deadline = time.time() + 400
            while not re.search(rb"specialist reverse step 3/", log.read_bytes()):
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            (server,) = _engine_servers(proc.pid)
            server.send_signal(signal.SIGKILL)  # the policy's engine server, between rollouts or mid-batch
            killed_pid = server.pid
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert re.search(r"policy-reverse died \(exit -9\); restart 1 on port \d+", text), text[-3000:]
    # with the weights of the last push: a weight buffer (engine.weight_sync: memory) over the initial model
    assert re.search(r"restart 1 on port \d+ with \S+ \+ weight buffer \S+-[ab]\.wbuf \(version [1-9]", text)
    assert "resumed" not in text  # ridden out in-process, not by a resume from a checkpoint
    assert killed_pid not in {p.pid for p in psutil.process_iter()}  # and nothing left running
    state_dir = tmp_path / "final-state"
    load_checkpoint(latest_complete(out), state_dir)
    state = json.loads((state_dir / "trainer.json").read_text())
    assert state["step"] == STEPS
    ledger = state["april"]["ledger"]
    buffered = {p["sample_id"] for p in state["april"]["partials"]}
    assert len(ledger) == len(set(ledger)) and not buffered & set(ledger)  # nothing trained twice
    assert {f"reverse-{i:08d}" for i in range(state["cursor"])} == set(ledger) | buffered  # nothing lost
    assert json.loads((tmp_path / "r.json").read_text())["steps"] == STEPS
