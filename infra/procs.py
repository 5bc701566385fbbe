"""Child processes that never outlive us, and the process-wide "stop" request.

- `pdeathsig_preexec(pid)`: a `preexec_fn` asking the kernel to SIGKILL the child when its parent dies, so even a
  SIGKILLed parent leaves no orphan. Linux delivers it when the *thread* that forked the child exits: fork from a
  thread that outlives the child (one that waits on it, or a long-lived spawner thread as in
  engine/launcher.py). Children are also started in their own session (`start_new_session=True`) so that one
  `killpg` reaches everything they spawned, and a terminal's Ctrl-C reaches only the process that owns them.
- `stop_group(proc, grace_s)`: SIGTERM the child's process group, SIGKILL after `grace_s`.
- `run_async(coro)` / `cancel_main_loop(exc)`: `asyncio.run` for sync code whose stop signal must not be raised
  into the middle of the event loop's own code (a KeyboardInterrupt there can leave a future unresolved that a task
  then awaits forever): a signal handler cancels the main thread's `run_async` task through the loop instead, its
  `finally` blocks and their awaits run, and `exc` is raised once it has unwound (as asyncio.Runner does for SIGINT).
- `request_stop()` / `stop_requested()` / `raise_if_stopped()`: the first Ctrl-C of `alloy run` (alloy/interrupt.py)
  asks everything in this process to stop: a trainer process being waited on is stopped (tasks/worker_process.py),
  an in-process training loop raises `Stopped` at its next step, and every registered stop callback runs (each live
  engine `Supervisor` registers its `stop`). `Stopped` is an ordinary exception: the stage fails and unwinds its
  `finally` blocks like any failure, and nothing new is started while the request stands.
"""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Awaitable, Callable, Mapping

log = logging.getLogger("alloy")

_stop = threading.Event()
_callbacks: dict[int, Callable[[], None]] = {}
_lock = threading.RLock()  # re-entrant: a signal handler may run while its own thread holds it
_tokens = itertools.count(1)
_main_loop: dict[str, Any] = {}  # while the main thread runs `run_async`: its loop, task and the exception to raise


class Stopped(RuntimeError):
    """Raised where work refuses to start or continue because a stop was requested (Ctrl-C of `alloy run`)."""


def pdeathsig_preexec(parent_pid: int | None = None):
    """preexec_fn: ask the kernel to SIGKILL the child when its parent (thread) dies; exit if it already died."""
    parent_pid = os.getpid() if parent_pid is None else parent_pid
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    prctl = libc.prctl if libc is not None else None  # resolved before fork: no dlsym in the child

    def preexec():
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # parent died between fork and prctl
            os._exit(1)

    return preexec


def pythonpath_first(entry: str | os.PathLike, env: Mapping[str, str] | None = None) -> str:
    """A PYTHONPATH with `entry` first, then `env`'s own PYTHONPATH (default: this process's environment) if set."""
    rest = (os.environ if env is None else env).get("PYTHONPATH")
    return os.pathsep.join([str(entry)] + ([rest] if rest else []))


def log_tail(path: str | os.PathLike, n_lines: int = 30) -> str:
    """The last `n_lines` of a child's log (from its last 16 KiB), or "(no log)"."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return "(no log)"


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group led by `pid` (a child started with start_new_session); gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM `proc`'s process group, SIGKILL it after `grace_s` (also reaps what the child itself spawned into its
    group); returns the exit code."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s of SIGTERM: SIGKILL", proc.pid, grace_s)
    signal_group(proc.pid, signal.SIGKILL)
    return proc.wait()


# ------------------------------------------------------------------------------------------ the stop request


def request_stop() -> None:
    """Ask everything in this process to stop (idempotent); runs the registered callbacks once, all at the same time
    (each supervisor waits for its own servers), and returns when they have."""
    if _stop.is_set():
        return
    _stop.set()
    with _lock:
        callbacks = list(_callbacks.values())
        _callbacks.clear()

    def call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # one failing callback must not keep the others from stopping
            log.exception("stop callback %r failed", fn)

    threads = [threading.Thread(target=call, args=(fn,), name="alloy-stop-callback", daemon=True) for fn in callbacks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def stop_requested() -> bool:
    return _stop.is_set()


def raise_if_stopped(what: str = "") -> None:
    if _stop.is_set():
        raise Stopped(f"stop requested{': ' + what if what else ''}")


def reset_stop() -> None:
    """Clear a finished stop request (a new run in the same process)."""
    _stop.clear()


def on_stop(fn: Callable[[], None]) -> int:
    """Register `fn` to run at `request_stop()` (at once if a stop is already requested); returns a token for
    `cancel_on_stop`."""
    if _stop.is_set():
        fn()
        return 0
    with _lock:
        token = next(_tokens)
        _callbacks[token] = fn
    return token


def cancel_on_stop(token: int) -> None:
    with _lock:
        _callbacks.pop(token, None)


# ------------------------------------------------------------------------------------------ event loops and signals


def run_async(coro: Awaitable):
    """`asyncio.run(coro)`; on the main thread, a signal handler's `cancel_main_loop(exc)` cancels the coroutine
    through the loop (at its next await; its `finally` blocks, awaits included, run) and `exc` is raised here once it
    has unwound, whether the coroutine then raised CancelledError or returned. Elsewhere (another thread, a nested
    call): plain `asyncio.run`."""
    if threading.current_thread() is not threading.main_thread() or _main_loop:
        return asyncio.run(coro)

    async def main():
        _main_loop.update(loop=asyncio.get_running_loop(), task=asyncio.current_task())
        return await coro

    try:
        out = asyncio.run(main())
    except asyncio.CancelledError:
        exc = _main_loop.get("exc")
        if exc is None:
            raise
        raise exc from None
    finally:
        exc = _main_loop.get("exc")
        _main_loop.clear()
    if exc is not None:  # the coroutine swallowed the cancellation: the stop still stands
        raise exc
    return out


def cancel_main_loop(exc: BaseException) -> bool:
    """From a signal handler (main thread): cancel the running `run_async` task, which then raises `exc`; False when
    none runs (the caller raises `exc` itself). A second call while the first unwinds changes nothing (True)."""
    loop, task = _main_loop.get("loop"), _main_loop.get("task")
    if loop is None or task is None or loop.is_closed():
        return False
    if "exc" not in _main_loop:
        _main_loop["exc"] = exc
        loop.call_soon_threadsafe(task.cancel)  # from the loop itself, never in the middle of its own code
    return True
