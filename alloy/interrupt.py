"""Ctrl-C of `alloy run`: the first SIGINT/SIGTERM stops the run cleanly, a second one kills it at once.

`interruptible(fn, ...)` runs the pipeline in a worker thread (so neither Prefect nor a library can take the signal
handlers of the main thread, and the pipeline's context variables, e.g. Prefect settings, come along) while the main
thread waits for it and for signals.

First signal: `infra.procs.request_stop()`. Each trainer process being waited on (tasks/worker_process.py) gets
SIGTERM on its process group; its skeleton (training/worker.py) stops its engine servers, ends its MLflow run KILLED and
exits, and a checkpoint it was committing is complete or absent (infra/storage.py: COMPLETE manifest last, staging
renamed into place). The engine servers of this process (the teacher fleet) are stopped by their `Supervisor`'s stop
callback, an in-process training loop raises at its next step, failed stages are not retried. Once the pipeline
thread has unwound (at most `STOP_TIMEOUT_S`), anything still alive among our descendants is terminated, the MLflow
runs of this invocation are marked KILLED (the parent, and every child that did not finish), and `KeyboardInterrupt`
is raised for the CLI to print how to resume (`resume_command`) and exit 130.

Second signal: SIGKILL to every descendant and its process group, exit 130 at once. Trainers and engine servers
also carry PR_SET_PDEATHSIG (infra/procs.py), so even a SIGKILLed `alloy run` leaves none of them behind.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import psutil

from infra import procs, zygote

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
STOP_TIMEOUT_S = 25.0  # first signal → pipeline unwound; the rest of 30 s is the sweep
UNWIND_GRACE_S = 5.0  # once no child is left: the pipeline's last words (Prefect states) before we stop waiting
SWEEP_GRACE_S = 3.0
EXIT_FALLBACK_S = 3.0  # after the KeyboardInterrupt: the time a normal exit gets before it is forced
PREFECT_API_MARK = "prefect.server.api.server:create_app"  # Prefect's temporary API server (needed until exit)


def resume_command(config: str, overrides: list[str], report: str | None = None) -> str:
    """The `alloy run` line that continues this run: the same config and plain overrides (resume from storage is
    automatic, `run.resume`); secret overrides are not echoed."""
    from infra.config import split_secret_overrides

    plain, secret = split_secret_overrides(overrides)
    plain = [o for o in plain if not o.replace(" ", "").startswith("run.resume=")]
    parts = ["alloy", "run", config] + sum((["--set", o] for o in plain), []) + (["--report", report] if report else [])
    line = " ".join(shlex.quote(p) for p in parts)
    return line + (f"   (plus your {len(secret)} secret --set override(s), not shown)" if secret else "")


def interruptible(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` in a worker thread, with the signal handling above; raises KeyboardInterrupt after a
    clean stop. Call from the main thread."""
    procs.reset_stop()
    guard = _Guard()
    box: dict[str, Any] = {}
    done = threading.Event()
    ctx = contextvars.copy_context()

    def target() -> None:
        try:
            box["value"] = ctx.run(fn, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            box["error"] = exc
        finally:
            done.set()

    with guard.installed():
        threading.Thread(target=target, name="alloy-pipeline", daemon=True).start()
        while not done.wait(0.2) and guard.signum is None:
            pass
        if guard.signum is not None:
            guard.stop(done)
            raise KeyboardInterrupt(f"stopped by {signal.Signals(guard.signum).name}")
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Guard:
    def __init__(self):
        self.signum: int | None = None
        self.t_signal = 0.0
        self.seen: dict[int, psutil.Process] = {}  # descendants seen since the signal (kept: orphans lose their ppid)
        self.n_parents = len(_started_parents())
        self._prev: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev[sig] = signal.signal(sig, self._handler)
        try:
            yield
        finally:
            for sig, prev in self._prev.items():
                signal.signal(sig, prev)

    # -- signals (main thread) ------------------------------------------------------------------------------------
    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            self.kill_now()
        self.signum, self.t_signal = signum, time.monotonic()
        self.remember()
        print(f"\nalloy: {signal.Signals(signum).name}: stopping the run (trainers, engine servers); "
              "press Ctrl-C again to kill everything at once", file=sys.stderr, flush=True)
        threading.Thread(target=procs.request_stop, name="alloy-stop", daemon=True).start()

    def kill_now(self) -> None:
        """Second signal: SIGKILL every descendant (and its process group) and exit 130 now."""
        self.remember()
        mine = os.getpgid(0)
        for p in self.seen.values():
            try:
                pgid = os.getpgid(p.pid)
                if pgid != mine:
                    os.killpg(pgid, signal.SIGKILL)
                p.kill()
            except (psutil.Error, OSError):
                pass
        print("alloy: killed", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    # -- the clean stop (main thread) -----------------------------------------------------------------------------
    def remember(self) -> None:
        try:
            for p in psutil.Process().children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def alive(self, p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def stop(self, done: threading.Event) -> None:
        """Wait for the pipeline thread to unwind: until it has, or `UNWIND_GRACE_S` after the last child process
        (Prefect's API server and our process zygotes aside: they live until exit) is gone (a terminal's Ctrl-C also
        hits that server, which shares our process group; the flow's state updates then never get through), or
        `STOP_TIMEOUT_S` after the signal."""
        deadline, quiet_since = self.t_signal + STOP_TIMEOUT_S, None
        while not done.wait(0.5) and time.monotonic() < deadline:
            self.remember()
            infra_pids = zygote.pids()
            if any(self.alive(p) and not _is_prefect_api(p) and p.pid not in infra_pids for p in self.seen.values()):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > UNWIND_GRACE_S:
                break
        self.remember()
        if not done.is_set() and quiet_since is not None:
            print("alloy: every trainer and server has stopped; not waiting for the flow's last state updates "
                  "(Prefect's temporary API server stops with a terminal's Ctrl-C)", file=sys.stderr, flush=True)
        elif not done.is_set():
            print(f"alloy: the pipeline did not unwind in {STOP_TIMEOUT_S:.0f} s; terminating what is left",
                  file=sys.stderr, flush=True)
        # Prefect's own API server stays for its exit handlers while the flow has finished; anything else goes
        self.sweep(keep_prefect_api=done.is_set())
        self.mark_killed()
        # a thread that did not unwind, or an exit handler still talking to Prefect's API, must not hold the exit
        threading.Thread(target=self.exit_later, name="alloy-exit-fallback", daemon=True).start()

    def exit_later(self) -> None:
        time.sleep(EXIT_FALLBACK_S)
        self.remember()
        self.sweep(keep_prefect_api=False)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    def sweep(self, keep_prefect_api: bool) -> None:
        left = []
        for p in self.seen.values():
            try:
                if not self.alive(p) or keep_prefect_api and _is_prefect_api(p):
                    continue
                p.terminate()
                left.append(p)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=SWEEP_GRACE_S)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=2.0)

    def mark_killed(self) -> None:
        """The parent runs this invocation started, and their children that did not finish: KILLED."""
        for uri, run_id in _started_parents()[self.n_parents:]:
            try:
                from mlflow import MlflowClient

                client = MlflowClient(tracking_uri=uri)
                exp = client.get_run(run_id).info.experiment_id
                for child in client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'", max_results=1000):
                    if child.info.status != "FINISHED":
                        client.set_terminated(child.info.run_id, status="KILLED")
                client.set_terminated(run_id, status="KILLED")
            except Exception as exc:  # tracking must not keep the stop from finishing
                print(f"alloy: could not mark MLflow run {run_id} KILLED: {exc}", file=sys.stderr)


def _is_prefect_api(p: psutil.Process) -> bool:
    try:
        return PREFECT_API_MARK in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _started_parents() -> list[tuple[str, str]]:
    from infra.tracking import STARTED_PARENTS

    return list(STARTED_PARENTS)

