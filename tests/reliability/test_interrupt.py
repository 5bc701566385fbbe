"""Ctrl-C of a real `alloy run` (a subprocess, shrunk config): the first SIGINT (or SIGTERM) stops every process of the
run (trainer processes, their engine servers, the teacher servers, Prefect's temporary API server) within 30 s, exits
130 printing the command that resumes, marks the MLflow runs KILLED (the parent, and every child that did not finish),
and leaves each checkpoint under storage complete or absent (a hidden `.tmp-*` staging dir an interrupted commit may
leave is never listed or loaded: infra.storage.list_checkpoints skips hidden names). A second SIGINT kills everything
at once, no orphan either; nor does a SIGKILL of the process that waits on a trainer.

"Every process of the run" is found by an environment variable the test gives `alloy run`, which every process it
starts inherits; the scan covers all processes of this user, so a child re-parented to init is found too.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from infra.storage import list_checkpoints

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
TAG = "ALLOY_TEST_INTERRUPT_TAG"
SMALL = ["domains=[{name: reverse}]", "base.steps=4", "base.n_train_per_domain=50",
         "eval.n_eval=4", "specialists.steps=200", "specialists.batch_size=8", "specialists.checkpoint_every=1",
         "specialists.log_every=1", "specialists.retries=2", "distill.steps=200", "distill.batch_size=8",
         "distill.eval_every=0", "distill.log_every=1", "distill.checkpoint_every=1"]


def tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def start_run(root: Path, extra: list[str], api_url: str | None) -> tuple[subprocess.Popen, str, Path]:
    """`alloy run` as a user starts it: in a session of its own (a terminal's foreground process group) and, without
    `api_url`, with Prefect's temporary API server, which shares that group."""
    tag = uuid.uuid4().hex
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PREFECT_API_URL"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({TAG: tag, **({"PREFECT_API_URL": api_url} if api_url else {})})
    sets = sum((["--set", s] for s in SMALL + extra + [f"run.root={root}"]), [])
    out = root / f"alloy-{tag[:6]}.log"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "alloy.cli", "run", SMOKE, *sets], stdout=fh,
                                stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return proc, tag, out


def wait_for(proc: subprocess.Popen, out: Path, log: Path, trainer: str, step_line: bytes | None,
             timeout: float = 240) -> None:
    """Until the trainer `trainer` runs under `proc` with its engine server up and has logged `step_line` (in what
    `log` gained since the call)."""
    since = log.stat().st_size if log.exists() else 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()[-3000:]
        kids = {}
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                kids[p.pid] = " ".join(p.cmdline())
            except psutil.Error:
                pass
        trainers = [pid for pid, cmd in kids.items() if trainer in cmd]
        # its server: forked by the run's process zygote (infra/zygote.py), a sibling of the trainer, or its child
        served = any("engine.server" in cmd for cmd in kids.values())
        if trainers and served and (step_line is None or log.exists() and re.search(step_line, log.read_bytes()[since:])):
            return
        time.sleep(0.5)
    raise AssertionError(f"{trainer} did not get going in {timeout:.0f} s:\n{out.read_text()[-3000:]}")


def interrupt(proc: subprocess.Popen, tag: str, second_after: float | None = None, terminal: bool = True,
              sig: int = signal.SIGINT) -> float:
    """`sig` (and a second one `second_after` s later) to the process group, as a terminal's Ctrl-C does (or to the
    process alone); returns the seconds until no process of the run is left."""
    t0 = time.monotonic()
    send = (lambda: os.killpg(proc.pid, sig)) if terminal else (lambda: proc.send_signal(sig))
    send()
    if second_after is not None:
        time.sleep(second_after)
        send()
    proc.wait(timeout=60)
    while tagged(tag) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    left = [(p.pid, p.cmdline()) for p in tagged(tag)]
    assert not left, f"left running: {left}"
    return time.monotonic() - t0


def check_killed_runs(root: Path, started: float, child: str) -> None:
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("alloy-smoke")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.info.start_time >= started * 1000]
    assert len(parents) == 1, [(r.info.run_name, r.info.status) for r in parents]
    assert parents[0].info.status == "KILLED"
    children = {r.info.run_name: r.info.status for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert children.get(child) == "KILLED", children
    assert set(children.values()) <= {"FINISHED", "KILLED"}, children


def check_checkpoints(root: Path) -> None:
    """Every checkpoint directory under the run's storage is complete (a partial commit is hidden or absent), and
    every rollout record beside them (`<prefix>/rollouts/*.parquet`, not a checkpoint: each file is renamed into
    place whole, training/rollout_records.py) reads as Parquet."""
    import pyarrow.parquet as pq

    storage = root / "smoke"
    prefixes = [p for p in storage.iterdir() if p.is_dir() and re.match(r"(base|specialist|student)-", p.name)]
    assert prefixes
    for prefix in prefixes:
        for info in list_checkpoints(f"file://{prefix}", "*"):
            if info.name == "rollouts":
                for f in (prefix / "rollouts").iterdir():
                    assert f.suffix == ".parquet" and pq.read_metadata(f).num_rows > 0, f
                continue
            assert info.complete, (info.url, info.reason)


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """One run root for the two stage tests (same base config): the later one finds the MLflow store and the base
    checkpoint in place and reaches its stage sooner. Each test checks only the runs it started (`started`), and
    every checkpoint under the root."""
    return tmp_path_factory.mktemp("interrupt")


@pytest.fixture(scope="module")
def api_url(prefect_harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_ctrl_c_in_the_specialists_stage_stops_everything_then_twice_kills_at_once(run_root):
    """Ctrl-C as a terminal sends it: to the process group, which Prefect's temporary API server shares (it stops at
    once, so the flow's last state updates never arrive; the stop must not wait for them)."""
    root = run_root
    log = root / "smoke" / "work" / "logs" / "specialist-reverse.log"
    started = time.time()
    proc, tag, out = start_run(root, [], None)
    wait_for(proc, out, log, "teachers.specialist_main", rb"specialist reverse step [12]/")
    took = interrupt(proc, tag)
    text = out.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert took <= 30, took
    assert re.search(r"to resume from the last checkpoints: alloy run \S+smoke\.yaml --set", text), text[-2000:]
    assert "did not unwind" not in text, text[-3000:]  # a normal stop does not read like a fault
    check_killed_runs(root, started, "specialist/reverse")
    check_checkpoints(root)

    # the same run again (it resumes), Ctrl-C twice as soon as the trainer's engine server is up: killed at once
    proc, tag, out = start_run(root, [], None)
    wait_for(proc, out, log, "teachers.specialist_main", None)
    took = interrupt(proc, tag, second_after=0.5)
    assert proc.returncode == 130 and "alloy: killed" in out.read_text(), out.read_text()[-3000:]
    assert took <= 10, took


def test_sigterm_in_the_distill_stage_stops_everything_cleanly(run_root, api_url):
    """The distill stage (specialists off: the base model serves as the teacher); SIGTERM to `alloy run` alone, with
    a Prefect API server that stays up (the session's)."""
    root = run_root
    started = time.time()
    proc, tag, out = start_run(root, ["specialists.enabled=false"], api_url)
    wait_for(proc, out, root / "smoke" / "work" / "logs" / "distill.log", "student.distill_main",
             rb"student step [12]/")
    took = interrupt(proc, tag, terminal=False, sig=signal.SIGTERM)
    assert proc.returncode == 130, out.read_text()[-3000:]
    assert took <= 30, took
    check_killed_runs(root, started, "student")
    check_checkpoints(root)


PARENT = """
import sys, threading
from pathlib import Path
from tasks.worker_process import run_worker

def task():  # a trainer started from a worker thread, as a Prefect task does
    run_worker([sys.executable, "-c", "import time; print('child up', flush=True); time.sleep(120)"],
               Path(sys.argv[1]), 1, "child")

t = threading.Thread(target=task)
t.start()
t.join()
"""


def test_a_sigkilled_parent_leaves_no_trainer_process(tmp_path):
    """SIGKILL (no handler runs): PR_SET_PDEATHSIG takes the trainer down with the thread that waits on it."""
    tag, log = uuid.uuid4().hex, tmp_path / "child.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(log)], cwd=ROOT, env={**os.environ, TAG: tag})
    deadline = time.monotonic() + 60
    while not (log.exists() and b"child up" in log.read_bytes()):
        assert parent.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    assert len(tagged(tag)) == 2  # the parent and its trainer
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tagged(tag)
