"""Tool calls forked from a lean helper process instead of the caller (`run_tool_pooled`, same contract as
`sandbox.runner.run_tool`).

Why: `run_tool` starts each call with `fork` (its `preexec_fn` rules out `vfork`/`posix_spawn`), and a fork copies
the caller's page tables. From a bare interpreter a `cat` takes ~20 ms; from a process that holds torch and a model
(an eval, a PPO trainer, the student's sampler) the same call took 85–280 ms on the 2-core machine, most of it
spent copying the caller's page tables while the other episodes' calls queue behind it (`bench/sandbox_calls.py`).
So each process that runs tool calls starts one helper, `python -m sandbox.pool`, which imports
only `sandbox` and forks every call from its own small address space.

Protocol (private to this module): one JSON object per line. Request `{"id", "command", "workdir", "kw"}` on the
helper's stdin; reply `{"id", "result": {ToolResult fields}}` or `{"id", "error": [type, message]}` on the fd the
helper was given (its stdout, kept apart from anything printed). The helper runs up to `WORKERS` calls at once,
each exactly as `run_tool` would in the caller: the same checks, confinement, limits and results;
`SandboxUnavailable` and `ValueError` come back as themselves.

Life cycle: started on a process's first call, one per process (a forked child starts its own) and per setting of
the sandbox's opt-out variables (`UNCONFINED_ENV`, `UNCONFINED_CODE_ENV`: a change starts a fresh helper, so the
variables read at each call keep their meaning). The helper ignores SIGINT (Ctrl-C reaches the caller, whose calls
end within their timeouts) and exits when its stdin closes: at the caller's exit, or the caller's death, so it
never outlives it. If the helper dies, the calls in flight raise `RuntimeError` naming its exit code and last
stderr line, and the next call starts a new one.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path

from sandbox.runner import UNCONFINED_CODE_ENV, UNCONFINED_ENV, SandboxUnavailable, ToolResult, run_tool

WORKERS = 8  # calls the helper runs at once (each mostly waits on its child)
REPLY_SLACK_S = 30.0  # a reply later than the call's own timeout + this means the helper is stuck
_ERRORS = {"SandboxUnavailable": SandboxUnavailable, "ValueError": ValueError}
_TUPLES = {f.name for f in fields(ToolResult) if str(f.type).startswith("tuple")}


def _settings() -> tuple[str | None, str | None]:
    return os.environ.get(UNCONFINED_ENV), os.environ.get(UNCONFINED_CODE_ENV)


class ToolPool:
    """One helper process and the calls waiting on it. Thread-safe; `call` blocks until the reply."""

    def __init__(self) -> None:
        self.pid, self.settings = os.getpid(), _settings()
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "sandbox.pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=root,
                                     close_fds=True)
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.next_id = 0
        self.dead: str | None = None
        self.stderr_tail: deque[str] = deque(maxlen=5)
        threading.Thread(target=self._read, name="sandbox-pool-reader", daemon=True).start()
        threading.Thread(target=self._drain_stderr, name="sandbox-pool-stderr", daemon=True).start()

    def call(self, command: str, workdir, kw: dict) -> ToolResult:
        fut: Future = Future()
        with self.lock:
            if self.dead:
                raise RuntimeError(self.dead)
            self.next_id += 1
            rid = self.next_id
            self.pending[rid] = fut
            wire = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in kw.items()}
            line = json.dumps({"id": rid, "command": command, "workdir": str(workdir), "kw": wire}) + "\n"
            try:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
            except OSError as e:
                self.pending.pop(rid, None)
                raise RuntimeError(f"sandbox pool: the helper process is gone ({e})") from e
        timeout = float(kw.get("timeout_s", 2.0)) + REPLY_SLACK_S
        try:
            reply = fut.result(timeout=timeout)
        except TimeoutError:
            with self.lock:
                self.pending.pop(rid, None)
            raise RuntimeError(f"sandbox pool: no reply to {command!r} within {timeout:.0f}s") from None
        if "error" in reply:
            kind, msg = reply["error"]
            raise _ERRORS.get(kind, RuntimeError)(msg)
        res = reply["result"]
        return ToolResult(**{k: tuple(v) if k in _TUPLES else v for k, v in res.items()})

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                reply = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                fut = self.pending.pop(reply.get("id"), None)
            if fut is not None:
                fut.set_result(reply)
        code = self.proc.wait()
        why = (f"sandbox pool: the helper process exited with code {code}"
               + (f": {self.stderr_tail[-1]}" if self.stderr_tail else ""))
        with self.lock:
            self.dead, waiting, self.pending = why, list(self.pending.values()), {}
        for fut in waiting:
            fut.set_exception(RuntimeError(why))

    def _drain_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.stderr_tail.append(line)
                sys.stderr.write(f"[sandbox pool] {line}\n")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_pool: ToolPool | None = None
_pool_lock = threading.Lock()


def _current() -> ToolPool:
    global _pool
    with _pool_lock:
        p = _pool
        if p is None or p.dead or p.pid != os.getpid() or p.settings != _settings():
            if p is not None and p.pid == os.getpid():
                p.close()
            _pool = p = ToolPool()
        return p


def run_tool_pooled(command: str, workdir: Path | str, **kw) -> ToolResult:
    """`sandbox.runner.run_tool(command, workdir, **kw)`, forked from this process's helper (module docstring)."""
    return _current().call(command, workdir, kw)


def shutdown() -> None:
    """End this process's helper (registered at exit; tests call it to start from none)."""
    global _pool
    with _pool_lock:
        p, _pool = _pool, None
    if p is not None and p.pid == os.getpid():
        p.close()


atexit.register(shutdown)


def _serve() -> None:
    """The helper: requests on stdin, replies on the original stdout (fd 1 now points at stderr, so nothing a call
    prints can corrupt the replies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    lock = threading.Lock()

    def handle(req: dict) -> None:
        kw = dict(req["kw"])
        if "allowed" in kw:
            kw["allowed"] = set(kw["allowed"])
        try:
            msg = {"id": req["id"], "result": asdict(run_tool(req["command"], req["workdir"], **kw))}
        except Exception as e:  # returned to the caller, which raises it
            msg = {"id": req["id"], "error": [type(e).__name__, str(e)]}
        with lock:
            out.write(json.dumps(msg) + "\n")

    with ThreadPoolExecutor(WORKERS, thread_name_prefix="tool-call") as ex:
        for raw in sys.stdin.buffer:
            ex.submit(handle, json.loads(raw))


if __name__ == "__main__":
    _serve()
