"""Launch and supervise many engine servers (embedded or SGLang): free ports, logs, health, restarts, clean stop.

A `Supervisor` owns a set of server processes. Each runs in its own session (process group) so that stopping it
kills everything it spawned (SGLang forks scheduler/detokenizer processes). Children also get
`PR_SET_PDEATHSIG(SIGKILL)` on Linux, so a SIGKILLed parent leaves no orphans. Because Linux delivers that signal
when the *thread* that forked the child exits, every `Popen` runs on one long-lived spawner thread owned by the
supervisor: starting a supervisor from a short-lived worker thread (a Prefect task thread) must not kill the
servers when that thread ends.

A monitor thread polls the processes; a dead server is restarted on the same port (so clients just retry) with
its latest weights (`set_weights`: an HF dir, or for the embedded server a weight buffer applied over the
initial model: engine/weight_buffer.py), at most `max_restarts` times per `restart_window_s`.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from infra import zygote
from infra.procs import cancel_on_stop, log_tail, on_stop, pythonpath_first
from infra.choices import MAX_LOGPROB_ENTRIES, READ_TIMEOUT_S, Backend
from engine.backends import BACKENDS, server_backend
from engine.client import API_KEY_ENV, EngineClient, run_sync

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: engine/launcher.py

@dataclass
class ServerSpec:
    """One server to run. `port=None` → a free port is picked. `backend` names a `BACKENDS` entry; `options` are
    keys of that backend's options (engine.backends); `extra_args` are passed verbatim after
    them. `env` is added to the child's environment. `weights_buffer`: a weight buffer the server applies right
    after loading `model_path` (its version wins over `weight_version`; embedded backend only)."""

    name: str
    model_path: str
    backend: str = Backend.EMBEDDED  # a name in engine.backends.BACKENDS
    host: str = "127.0.0.1"
    port: int | None = None
    api_key: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    weight_version: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    weights_buffer: str | None = None

    @classmethod
    def for_engine(cls, name: str, model_path: str | Path, engine_cfg, placement: dict | None = None) -> "ServerSpec":
        """Server `name` of `model_path` launched as `engine_cfg` (an `infra.config.EngineConfig`) says: bound to its
        `host`, with its `api_key`, backend and options (`launch_settings`, on the GPUs of `placement` when given)."""
        return cls(name=name, model_path=str(model_path), host=engine_cfg.host, api_key=engine_cfg.api_key,
                   **launch_settings(engine_cfg, placement))


def launch_settings(engine_cfg, placement: dict | None = None) -> dict[str, Any]:
    """`ServerSpec` fields (backend, options, extra_args) for a server launched under `engine_cfg` (an
    `infra.config.EngineConfig`): SGLang gets `sglang_args` as options, both get `max_running_requests`, the
    embedded server its `device` / `dtype` when they are not "auto". With a `placement` (a planned server of
    infra/placement.py plus the node's `visible` devices) also `env`, and SGLang gets the plan's --base-gpu-id /
    --tp-size / --mem-fraction-static (over those of `sglang_args`); the embedded server its
    --mem-fraction-static (its share of the GPU it sees as its only one)."""
    backend = server_backend(engine_cfg.backend)
    options = dict(engine_cfg.sglang_args) if backend.takes_sglang_args else {}
    if engine_cfg.max_running_requests:
        options.setdefault("max_running_requests", engine_cfg.max_running_requests)
    if not backend.takes_sglang_args:  # the embedded server's limits, where they differ from its defaults
        if engine_cfg.read_timeout_s != READ_TIMEOUT_S:
            options["read_timeout_s"] = engine_cfg.read_timeout_s
        if engine_cfg.max_body_mb is not None:
            options["max_body_mb"] = engine_cfg.max_body_mb
        if getattr(engine_cfg, "max_logprob_entries", MAX_LOGPROB_ENTRIES) != MAX_LOGPROB_ENTRIES:
            options["max_logprob_entries"] = engine_cfg.max_logprob_entries
        for key in ("device", "dtype"):
            value = getattr(engine_cfg, key, "auto")
            if value != "auto":
                options[key] = value
    if placement is None:
        return {"backend": backend.name, "options": options, "extra_args": []}
    from infra.placement import server_launch

    placed = server_launch(placement, placement["visible"], backend.takes_sglang_args)
    return {"backend": backend.name, "options": {**options, **placed["options"]}, "extra_args": [],
            "env": placed["env"]}


def sglang_option_args(options: dict[str, Any]) -> list[str]:
    """{"tp_size": 2, "trust_remote_code": True} → ["--tp-size", "2", "--trust-remote-code"]; unknown keys raise."""
    return BACKENDS[Backend.SGLANG].option_args(options)


def server_env(spec: ServerSpec, base: Mapping[str, str], threads_per_server: int | None = None) -> dict[str, str]:
    """The environment a server of `spec` starts with: `base` plus the repository on PYTHONPATH, one torch thread
    count per CPU server, the spec's own variables (its GPUs: CUDA_VISIBLE_DEVICES) and, for our server, the API
    key (in the environment, not in argv: `ps` shows argv)."""
    env = dict(base)
    env["PYTHONPATH"] = pythonpath_first(REPO_ROOT, env)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    backend = server_backend(spec.backend)
    if backend.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        if threads_per_server:
            # Many CPU servers on 2 cores: one intra-op thread each (torch reads OMP_NUM_THREADS at start),
            # or they oversubscribe the cores and all crawl.
            n = str(threads_per_server)
            env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    env.update({k: str(v) for k, v in spec.env.items()})
    if spec.api_key and not backend.api_key_in_argv:  # the key travels in the environment, not in argv (`ps`)
        env[API_KEY_ENV] = spec.api_key
    return env


def build_command(spec: ServerSpec, port: int) -> list[str]:
    """The argv that starts `spec` on `port` (pure)."""
    try:
        backend = server_backend(spec.backend)
    except ValueError as e:
        raise ValueError(f"server {spec.name!r}: {e}") from None
    cmd = [sys.executable, "-m", backend.module, backend.model_flag, str(spec.model_path),
           "--port", str(port), "--host", spec.host]
    if spec.api_key and backend.api_key_in_argv:  # SGLang reads it from argv only; ours from the env (not in `ps`)
        cmd += ["--api-key", spec.api_key]
    if spec.weight_version is not None:
        cmd += ["--weight-version", str(spec.weight_version)]
    if spec.weights_buffer is not None:
        if backend.weights_buffer_flag is None:
            raise ValueError(f"server {spec.name!r}: the {backend.label} takes no weight buffer (weights_buffer)")
        cmd += [backend.weights_buffer_flag, str(spec.weights_buffer)]
    try:
        cmd += backend.option_args(spec.options)
    except ValueError as e:
        raise ValueError(f"server {spec.name!r}: {e}") from None
    return cmd + [str(a) for a in spec.extra_args]


def redact(cmd: list[str]) -> list[str]:
    """The argv with the value after --api-key masked (for logs)."""
    return ["***" if i > 0 and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]


def free_port(host: str = "127.0.0.1") -> int:
    """Bind to port 0, read the port the kernel chose, release it. Racy by nature: callers retry on a clash."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def connect_host(host: str) -> str:
    """The address a client on this machine dials for a server bound to `host`: the loopback address of the same
    family for a wildcard bind (0.0.0.0 → 127.0.0.1, :: → ::1), else `host` itself."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host.strip("[]") == "::":
        return "::1"
    return host


def url_for(host: str, port: int) -> str:
    """The URL a local client uses for a server bound to `host`:`port` (wildcard binds are dialled on loopback)."""
    h = connect_host(host).strip("[]")
    h = f"[{h}]" if ":" in h else h
    return f"http://{h}:{port}"


def wait_healthy(urls: Mapping[str, str], timeout: float, api_key: str | Mapping[str, str | None] | None = None, *,
                 failed: Callable[[str], str | None] | None = None, interval: float = 0.2) -> dict[str, str]:
    """Poll `GET <url>/health` of every server of `urls` ({name: url}) at once until it answers 200; `api_key`: one
    key for all, or {name: key}. Returns {name: why} of those that did not: the text `failed(name)` returned (asked
    before each poll, e.g. "the process exited"; it may point `urls[name]` at a new address), else "not healthy at
    <url> after <timeout>s". {} when every server came up."""
    keys = api_key if isinstance(api_key, Mapping) else dict.fromkeys(urls, api_key)

    async def wait_one(name: str, client: EngineClient) -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            why = failed(name) if failed is not None else None
            if why:
                return why
            client.base_url = urls[name].rstrip("/")
            if await client.health():
                return None
            if loop.time() > deadline:
                return f"not healthy at {client.base_url} after {timeout:.0f}s"
            await asyncio.sleep(interval)

    async def wait_all() -> list[str | None]:
        clients = [EngineClient(urls[n], api_key=keys.get(n), timeout=5.0) for n in urls]
        try:
            return await asyncio.gather(*(wait_one(n, c) for n, c in zip(urls, clients)))
        finally:
            for c in clients:
                await c.aclose()

    return {n: why for n, why in zip(list(urls), run_sync(wait_all())) if why}


@dataclass
class _Server:
    spec: ServerSpec
    port: int
    log_path: Path
    proc: subprocess.Popen | zygote.Forked | None = None
    restarts: int = 0
    restart_times: collections.deque = field(default_factory=collections.deque)
    failed: str | None = None

    @property
    def url(self) -> str:
        return url_for(self.spec.host, self.port)


class SupervisorError(RuntimeError):
    pass


class _Spawner:
    """A daemon thread that runs every `Popen` of one supervisor (see the module docstring: PDEATHSIG follows the
    forking thread). Daemon, unlike a ThreadPoolExecutor worker, so interpreter exit does not end it (and SIGKILL
    the servers) before the atexit `stop()` has terminated them gracefully."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        threading.Thread(target=self._run, name="alloy-spawner", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def run(self, fn):
        if self._closed:
            raise RuntimeError("spawner is shut down")
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def shutdown(self) -> None:
        self._closed = True
        self._jobs.put(None)


class Supervisor:
    """Start, watch, restart and stop engine servers. Use as a context manager.

    >>> with Supervisor("runs/x/logs") as sup:
    ...     urls = sup.start([ServerSpec("math", "ckpt/math")])
    """

    def __init__(self, log_dir: str | Path, *, max_restarts: int = 3, restart_window_s: float = 600.0,
                 health_timeout: float = 180.0, monitor_interval: float = 0.5, grace_s: float = 5.0,
                 threads_per_server: int | None = 1, install_signal_handlers: bool = True, port_retries: int = 3):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.health_timeout, self.monitor_interval, self.grace_s = health_timeout, monitor_interval, grace_s
        self.threads_per_server, self.port_retries = threads_per_server, port_retries
        self._servers: dict[str, _Server] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._spawner = _Spawner()
        self._monitor: threading.Thread | None = None
        self._prev_handlers: dict[int, Any] = {}
        atexit.register(self.stop)
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # an ignored signal stays ignored (e.g. `cmd &`)
                    self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        self._stop_token = 0
        self._stop_token = on_stop(self.stop)  # a stop request (Ctrl-C of `alloy run`) stops the servers too

    @classmethod
    def for_engine(cls, log_dir: str | Path, engine_cfg, limits=None) -> "Supervisor":
        """A supervisor of servers launched under `engine_cfg` (an `infra.config.EngineConfig`: its `threads` per CPU
        server), with the restart budget and health timeout of `limits` (a section with `max_restarts` and
        `health_timeout_s`: `infra.config.TeachersConfig`), or the defaults without one."""
        budget = {} if limits is None else {"max_restarts": limits.max_restarts,
                                             "health_timeout": limits.health_timeout_s}
        return cls(log_dir, threads_per_server=engine_cfg.threads, **budget)

    # -- public API ---------------------------------------------------------------------------------------------
    def start(self, specs: list[ServerSpec]) -> dict[str, str]:
        """Launch every spec, wait until all answer `/health`; returns {name: url}. On failure, raises with the log
        tail of each server that did not come up (the others keep running; `stop()` ends them)."""
        if self._stopping.is_set():
            raise SupervisorError("supervisor is stopped")
        names = [s.name for s in specs]
        dup = {n for n in names if names.count(n) > 1} | (set(names) & set(self._servers))
        if dup:
            raise ValueError(f"server names must be unique; duplicated: {sorted(dup)}")
        new, taken = [], {s.port for s in self._servers.values()}
        for spec in specs:
            # A private copy: set_weights() updates it, never the caller's object.
            spec = dataclasses.replace(spec, extra_args=list(spec.extra_args), env=dict(spec.env),
                                       options=dict(spec.options))
            port = spec.port
            while port is None or (spec.port is None and port in taken):
                port = free_port(spec.host)
            taken.add(port)
            srv = _Server(spec, port, self.log_dir / f"{spec.name}.log")
            with self._lock:
                self._servers[spec.name] = srv
            self._launch(srv)
            new.append(srv)
        errors = self._wait_healthy(new, allow_new_port=True)
        if errors:
            raise SupervisorError("engine servers failed to start:\n" + "\n\n".join(errors))
        self._ensure_monitor()
        return {s.spec.name: s.url for s in new}

    def set_weights(self, name: str, path: str | None, version: str | None, buffer: str | None = None) -> None:
        """Record the latest weights of `name`: a restart launches with `--model path --weight-version version`.
        With `buffer` (a weight buffer file; embedded servers), a restart loads `path` (None: the model it runs
        now) and then copies the buffer over it (`--weights-buffer`), taking the buffer's own version; without
        one, any buffer recorded before is forgotten. (Pushing the weights to the live server is the caller's
        `EngineClient.update_weights` / `update_weights_from_buffer`.)"""
        with self._lock:
            srv = self._get(name)
            if buffer is not None and server_backend(srv.spec.backend).weights_buffer_flag is None:
                raise ValueError(f"set_weights({name!r}): the {server_backend(srv.spec.backend).label} takes no "
                                 "weight buffer")
            if path is not None:
                srv.spec.model_path = str(path)
            srv.spec.weight_version = version
            srv.spec.weights_buffer = None if buffer is None else str(buffer)

    def url(self, name: str) -> str:
        return self._get(name).url

    def urls(self) -> dict[str, str]:
        with self._lock:
            return {n: s.url for n, s in self._servers.items()}

    def status(self) -> list[dict]:
        with self._lock:
            return [{
                "name": n, "url": s.url, "pid": s.proc.pid if s.proc else None,
                "alive": bool(s.proc and s.proc.poll() is None), "restarts": s.restarts, "log": str(s.log_path),
                "model_path": s.spec.model_path, "weight_version": s.spec.weight_version, "failed": s.failed,
                "weights_buffer": s.spec.weights_buffer,
            } for n, s in self._servers.items()]

    def stop(self) -> None:
        """Terminate every server's process group (SIGTERM, SIGKILL after `grace_s`). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5.0)
        with self._lock:
            procs = [s.proc for s in self._servers.values() if s.proc is not None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)  # also reaps stragglers the server itself spawned
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("process %d survived SIGKILL", p.pid)
        self._spawner.shutdown()
        for sig, handler in self._prev_handlers.items():
            try:
                signal.signal(sig, handler)
            except ValueError:  # not in the main thread any more
                pass
        atexit.unregister(self.stop)
        cancel_on_stop(self._stop_token)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------------------------------------------
    def _get(self, name: str) -> _Server:
        if name not in self._servers:
            raise KeyError(f"no server named {name!r}; known: {sorted(self._servers)}")
        return self._servers[name]

    def _child_env(self, spec: ServerSpec) -> dict[str, str]:
        return server_env(spec, os.environ, self.threads_per_server)

    def _launch(self, srv: _Server) -> None:
        cmd = build_command(srv.spec, srv.port)
        env = self._child_env(srv.spec)
        with open(srv.log_path, "ab") as logf:  # the child keeps its own copy of the fd
            logf.write(f"\n=== alloy launch {time.strftime('%H:%M:%S')}: {' '.join(redact(cmd))}\n".encode())
            logf.flush()
            srv.proc = self._spawner.run(lambda: zygote.start(cmd, env=env, stdout=logf, cwd=str(REPO_ROOT)))
        log.info("started %s (pid %d) on %s, log %s", srv.spec.name, srv.proc.pid, srv.url, srv.log_path)

    def _wait_healthy(self, servers: list[_Server], allow_new_port: bool) -> list[str]:
        """Wait for all `servers` concurrently (`wait_healthy`); returns one error text per server that did not come
        up, with its log tail. A server that lost its free port to another process before binding it (it exits with
        "address already in use") is relaunched on a new one, up to `port_retries` times, when `allow_new_port`."""
        by_name = {s.spec.name: s for s in servers}
        urls = {n: s.url for n, s in by_name.items()}
        port_tries = dict.fromkeys(by_name, 0)

        def failed(name: str) -> str | None:
            srv = by_name[name]
            if self._stopping.is_set():
                return "supervisor stopped"
            if srv.proc.poll() is None:
                return None
            tail = log_tail(srv.log_path).lower()
            clash = "address already in use" in tail or "errno 98" in tail
            if clash and allow_new_port and srv.spec.port is None and port_tries[name] < self.port_retries:
                port_tries[name] += 1  # someone took the port between free_port() and bind: pick another
                srv.port = free_port(srv.spec.host)
                urls[name] = srv.url
                self._launch(srv)
                return None
            return f"process exited with code {srv.proc.returncode} before becoming healthy"

        keys = {n: s.spec.api_key for n, s in by_name.items()}
        errors = wait_healthy(urls, self.health_timeout, keys, failed=failed)
        return [f"{n}: {why}; last lines of {by_name[n].log_path}:\n{log_tail(by_name[n].log_path)}"
                for n, why in errors.items()]

    def _ensure_monitor(self) -> None:
        if self._monitor is None or not self._monitor.is_alive():
            self._monitor = threading.Thread(target=self._monitor_loop, name="alloy-supervisor", daemon=True)
            self._monitor.start()

    def _monitor_loop(self) -> None:
        while not self._stopping.wait(self.monitor_interval):
            with self._lock:
                dead = [s for s in self._servers.values() if s.failed is None and s.proc and s.proc.poll() is not None]
            for srv in dead:
                try:
                    self._restart(srv)
                except Exception as e:  # keep watching the others
                    log.exception("restart of %s failed", srv.spec.name)
                    srv.failed = f"restart failed: {e}"

    def _restart(self, srv: _Server) -> None:
        now = time.monotonic()
        while srv.restart_times and now - srv.restart_times[0] > self.restart_window_s:
            srv.restart_times.popleft()
        code = srv.proc.returncode
        _signal_group(srv.proc, signal.SIGKILL)  # whatever it spawned dies with it
        if len(srv.restart_times) >= self.max_restarts:
            srv.failed = (f"died (exit {code}) after {self.max_restarts} restarts within {self.restart_window_s:.0f}s; "
                          f"not restarting. Log: {srv.log_path}")
            log.error("%s %s", srv.spec.name, srv.failed)
            return
        srv.restart_times.append(now)
        srv.restarts += 1
        log.warning("%s died (exit %s); restart %d on port %d with %s%s (version %s)", srv.spec.name, code,
                    srv.restarts, srv.port, srv.spec.model_path,
                    f" + weight buffer {srv.spec.weights_buffer}" if srv.spec.weights_buffer else "",
                    srv.spec.weight_version)
        if self._stopping.is_set():
            return
        try:
            self._launch(srv)
        except RuntimeError:  # the spawner was shut down by a concurrent stop()
            if self._stopping.is_set():
                return
            raise
        errors = self._wait_healthy([srv], allow_new_port=False)
        if errors:
            # Kill it so the next monitor pass sees it dead and tries again (within the max_restarts budget).
            log.error("restart of %s did not become healthy: %s", srv.spec.name, errors[0])
            _signal_group(srv.proc, signal.SIGKILL)
            srv.proc.wait()

    def _on_signal(self, signum, frame) -> None:
        self.stop()
        prev = self._prev_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the child's process group (it leads its own session, so pgid == pid)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
