"""The trainer-process skeleton (training/worker.py): one description per worker gives both its command line and its
parser; SIGTERM becomes WorkerStopped in the main thread, once; results are written atomically."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from infra import procs
from training.worker import Worker, WorkerStopped, arg, stop_on_signals, write_json_atomic
from student.distill_main import WORKER as STUDENT
from training.base_main import WORKER as BASE
from training.reward_main import WORKER as REWARD_MODEL
from teachers.specialist_main import WORKER as SPECIALIST

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("worker", [BASE, SPECIALIST, STUDENT, REWARD_MODEL], ids=lambda w: w.module)
def test_the_command_a_task_builds_is_what_the_worker_parses(worker):
    own = {a.dest: f"v-{a.dest}" for a in worker.args}
    argv = worker.argv(config="c.yaml", set=["a=1", "b=2"], mlflow_run_id=None, result="r.json", **own)
    assert argv[:3] == [sys.executable, "-m", worker.module] and "--mlflow-run-id" not in argv
    ns = worker.parser().parse_args(argv[3:])
    assert ns.config == "c.yaml" and ns.set == ["a=1", "b=2"] and ns.result == "r.json" and ns.mlflow_run_id is None
    assert all(getattr(ns, k) == v for k, v in own.items())


def test_unknown_flag_names_the_worker():
    with pytest.raises(TypeError, match="teachers.specialist_main: no flag for 'student_init'"):
        SPECIALIST.flags(student_init="x")
    w = Worker("m", "d", args=(arg("--n", type=int, required=True),))
    assert w.flags(n=3, work_dir=None) == ["--n", "3"]
    with pytest.raises(SystemExit):
        w.parser().parse_args(["--config", "c"])  # --n is required


def test_the_base_worker_runs_on_the_threads_its_config_gives(tmp_path, monkeypatch):
    """`base.threads` (null: torch's default) reaches torch in the process, before the run starts."""
    import torch

    monkeypatch.chdir(tmp_path)
    smoke = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "smoke.yaml")
    before, seen = torch.get_num_threads(), []
    try:
        for value in ("2", "null"):
            torch.set_num_threads(1)
            argv = ["--config", smoke, "--set", f"base.threads={value}", "--set", "tracking.enabled=false",
                    "--init", "unused", "--out", "unused"]
            assert BASE.main(lambda run: seen.append((run.cfg.base.threads, torch.get_num_threads())), argv) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [(2, 2), (None, 1)]  # null leaves the count as the process had it


def test_result_is_written_atomically(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json_atomic(path, {"a": 1, "x": 0.5})
    assert json.loads(path.read_text()) == {"a": 1, "x": 0.5}
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left


def test_sigterm_raises_once_in_the_main_thread_and_requests_a_stop():
    procs.reset_stop()
    calls = []
    token = procs.on_stop(lambda: calls.append("stopped"))
    prev = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(WorkerStopped) as info, stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between bytecodes of the main thread
                    pass
                calls.append("not reached")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal while `finally` runs is only logged
                for _ in range(1000):
                    pass
                calls.append("finally ran")
        assert info.value.signum == signal.SIGTERM and str(info.value) == "stopped by SIGTERM"
        time.sleep(0.2)  # the stop request runs in a thread of its own
        assert sorted(calls) == ["finally ran", "stopped"] and procs.stop_requested()
        assert signal.getsignal(signal.SIGTERM) is prev  # restored
    finally:
        procs.cancel_on_stop(token)
        procs.reset_stop()


def test_a_signal_while_an_event_loop_runs_cancels_it_through_the_loop():
    """A trainer's loop runs under `procs.run_async` (training/session.py): SIGTERM cancels its task from the loop
    (never raised into the loop's own code, where it can leave a future unresolved that a task awaits forever), the
    coroutine's `finally` awaits in full (a second signal there is only logged), and WorkerStopped comes out after."""
    import asyncio

    procs.reset_stop()
    calls = []

    async def trainer_loop():
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        try:
            while True:  # rollouts in threads, as the engine client's
                await loop.run_in_executor(None, time.sleep, 0.01)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # closing the server client: an await that must complete
            calls.append("closed")

    try:
        with pytest.raises(WorkerStopped) as info, stop_on_signals():
            procs.run_async(trainer_loop())
        assert info.value.signum == signal.SIGTERM and calls == ["closed"]
        assert not procs.cancel_main_loop(KeyboardInterrupt())  # nothing runs now: the caller raises for itself
    finally:
        procs.reset_stop()


def test_a_loop_that_swallows_the_cancellation_still_stops():
    import asyncio

    procs.reset_stop()

    async def stubborn():
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "kept going"

    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerStopped) as info, stop_on_signals():
            procs.run_async(stubborn())
        assert info.value.signum == signal.SIGINT and time.monotonic() - t0 < 5
        assert procs.run_async(asyncio.sleep(0, result=7)) == 7  # the next call is a plain asyncio.run again
    finally:
        procs.reset_stop()
