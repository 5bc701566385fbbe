"""Detached processes for `alloy up | down | status` and `alloy teachers …` (alloy/stack.py, alloy/teachers_stack.py):
start a process in its own session, record it in a JSON state file, check it by pid *and* start time (a recycled
pid is never signalled), wait for it to answer, stop its process group and every descendant; plus the environment
every stack process gets, and the CLI's one HTTP helper (`http_request`, and `http_get` / `http_json` over it:
JSON, a timeout, an optional bearer key, errors that name the URL). Shared by both commands, so neither imports
the other's internals.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from infra.procs import log_tail, pythonpath_first

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class StackError(RuntimeError):
    """Something a user can act on (a busy port, a component that did not come up); the message says what."""


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether binding host:port fails (SO_REUSEADDR as servers set it, so TIME_WAIT sockets do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def pick_port(port: int, component: str, host: str = HOST) -> int:
    """`port`, or a free one when it is 0; a busy port raises naming the component and the flag to change."""
    if port == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    if port_in_use(port, host):
        raise StackError(f"port {port} ({component}) is already in use on {host}; stop what uses it or pass another "
                         f"port (0 picks a free one)")
    return port


def spawn(name: str, cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> dict:
    """Start `cmd` detached (its own session, so it outlives this process and `down` can signal its group);
    returns the state entry {name, pid, create_time, log, cmd}."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== alloy {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(cwd), start_new_session=True, close_fds=True)
    return {"name": name, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
            "log": str(log_path), "cmd": cmd}


def _process(entry: dict | None) -> psutil.Process | None:
    """The live process an entry recorded, or None (gone, a zombie, or a recycled pid)."""
    if not entry or not entry.get("pid"):
        return None
    try:
        p = psutil.Process(entry["pid"])
        if abs(p.create_time() - entry["create_time"]) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


def is_alive(entry: dict | None) -> bool:
    return _process(entry) is not None


def _reap(pid: int) -> None:
    try:  # only succeeds for our own children (e.g. `up` called in-process); avoids zombies
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_entries(entries: list[dict], grace_s: float = 10.0) -> list[int]:
    """SIGTERM each live entry's process group and all its descendants, SIGKILL what is left after `grace_s`.
    Returns the pids that were signalled."""
    procs: dict[int, psutil.Process] = {}
    groups: set[int] = set()
    for e in entries:
        p = _process(e)
        if p is None:
            continue
        for q in [p] + p.children(recursive=True):  # collected first: a dying parent orphans its children
            procs[q.pid] = q
        groups.add(p.pid)  # spawn() made it a session (and group) leader

    def send(sig: int) -> None:
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for q in procs.values():
            try:
                q.send_signal(sig)  # psutil checks the pid still belongs to the same process
            except psutil.Error:
                pass

    def gone(q: psutil.Process) -> bool:
        _reap(q.pid)
        try:
            return not q.is_running() or q.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(gone(q) for q in procs.values()):
        time.sleep(0.2)
    if not all(gone(q) for q in procs.values()):
        send(signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(gone(q) for q in procs.values()):
            time.sleep(0.1)
    return sorted(procs)


def read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise StackError(f"state file {path} is not valid JSON ({exc}); delete it after checking nothing runs") from exc


def write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)  # atomic: a concurrent `status` never reads half a file


def http_request(url: str, body: dict | None = None, method: str | None = None, *, timeout: float = 5.0,
                 api_key: str | None = None) -> tuple[int, bytes]:
    """One request with a JSON `body` (GET without one, else POST unless `method` says otherwise), `api_key` sent as
    a bearer token; returns (status, raw answer). An error status raises urllib's HTTPError (its `code`, `headers`,
    `read()`), no answer (refused, timed out) a ConnectionError; the message of either names the URL."""
    method = method or ("GET" if body is None else "POST")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        exc.msg = f"{exc.msg} ({method} {url})"
        raise
    except OSError as exc:
        raise ConnectionError(f"{url}: no answer within {timeout:g} s ({getattr(exc, 'reason', exc)})") from exc


def http_get(url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, an error status included; status 0 when nothing answers."""
    try:
        return http_request(url, timeout=timeout, api_key=api_key)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


# Prefect's server answers 503 for the errors it calls client-retryable (SQLite busy or locked while a flow run
# writes): its own client retries them with backoff, and so do we. Seconds before each retry; ~15 s in all.
RETRY_503_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def http_json(url: str, body: dict | None = None, method: str | None = None, timeout: float = 5.0,
              retry_s: tuple[float, ...] = RETRY_503_S, api_key: str | None = None):
    """`http_request`'s answer as JSON (None for an empty one, a 204). A 503 is retried after each of `retry_s`
    seconds (or the answer's Retry-After, when it says more, up to 30 s), then raised as the HTTPError it is; any
    other error is raised at once."""
    for wait_s in (*retry_s, None):
        try:
            raw = http_request(url, body, method, timeout=timeout, api_key=api_key)[1]
            return json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or wait_s is None:
                raise
            after = exc.headers.get("Retry-After", "") if exc.headers else ""
            time.sleep(max(wait_s, min(float(after), 30.0)) if after.replace(".", "", 1).isdigit() else wait_s)


def wait_until(check, entry: dict, what: str, timeout_s: float) -> None:
    """Poll `check()` until true; raise with the log tail if the process exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):  # connection refused, half-started server, bad JSON
            pass
        if not is_alive(entry):
            raise StackError(f"{what} exited before it was ready; last lines of {entry['log']}:\n{log_tail(entry['log'])}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout_s:.0f}s; last lines of {entry['log']}:\n"
                             f"{log_tail(entry['log'])}")
        time.sleep(0.5)


def stack_env(home: Path, api_url: str, tracking_uri: str, ui_url: str | None) -> dict[str, str]:
    """The environment of every stack process: Prefect state under home, the repo importable, runs tracked in
    the MLflow store the UI serves."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_PROFILE", "PREFECT_API_KEY")}
    pdir = home / "prefect"
    env.update(
        PREFECT_HOME=str(pdir), PREFECT_PROFILES_PATH=str(pdir / "profiles.toml"), PREFECT_API_URL=api_url,
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{pdir / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_TRACKING_URI=tracking_uri,
        PYTHONPATH=pythonpath_first(REPO_ROOT, env),
        PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")  # HF_HUB_OFFLINE: as the user's environment has it
    if ui_url:
        env["ALLOY_MLFLOW_UI_URL"] = ui_url  # lets a flow link its Prefect artifacts to the MLflow run page
    return env
