"""Fast starts of `python -m module` children on a CPU host: a zygote process forks them with their imports done.

Every trainer and engine server is a fresh `python -m ...` process, and on a CPU host most of its start is imports:
an engine server spends ~2.3 of its ~2.5 CPU-seconds of start importing torch and its own modules, a trainer ~5 s
importing transformers' model classes, DeepSpeed and MLflow. The demo starts 12 specialists, 24 servers and two
more trainers on 2 cores. A zygote (as Android's and Chromium's) pays each import once: `spawn(cmd, ...)` asks it
to import `module` (the first time), fork, and run the module as `__main__` in the child, as `python -m` would.

What a child gets is what `subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fd, stderr=STDOUT, stdin=DEVNULL,
start_new_session=True)` plus `PR_SET_PDEATHSIG` gives (tasks/worker_process.py, engine/launcher.py):
- its argv as its process title (`ps`, psutil; `set_title`), its own session (pgid == pid: one `killpg` reaches
  it all), the environment and working directory asked for, stdout and stderr on the given descriptor, stdin on
  /dev/null;
- torch's thread count from `OMP_NUM_THREADS`, fresh numpy and `random` seeds, atexit handlers run at exit;
- death with the process that asked for it: the request's connection stays open while the child lives; when it
  closes (that process exited, or was SIGKILLed) the zygote SIGKILLs the child's group; the zygote dies with the
  process that started it (a lifeline pipe), and its children with it (`PR_SET_PDEATHSIG`).
The handle (`Forked`) answers `pid`, `poll()`, `wait(timeout)` and `returncode` as `Popen` does.

`spawn` returns None, and the caller starts the child with `Popen` as before, whenever a forked child could differ
from a fresh one: turned off (`ALLOY_ZYGOTE=0`); a GPU host (the zygote's imports must not touch CUDA before a
fork, and GPU runs are the ones the GPU pipeline check exercises); a command other than `sys.executable -m
module`; an environment that differs from the zygote's in a variable a library reads when imported (`IMPORT_TIME`
prefixes: HF_, TORCH, CUDA, PYTHON..., LD_, HOME, TMPDIR...); an import that starts a Python thread (forking it is
unsafe: the zygote then refuses every request). A module the zygote cannot import (on the child's PYTHONPATH
only, or broken) is imported by the child itself, which reports a failure in its own log as a fresh one would.
Variables our own modules read are read at run time, not at import.
A forked child finds the zygote through `ALLOY_ZYGOTE` (its socket path, in the child's environment), so a trainer's
engine server is forked by the same zygote (in `ps`, a sibling of its trainer under the zygote); a process started
otherwise starts its own zygote on its first `spawn`.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from infra.procs import pdeathsig_preexec, signal_group

log = logging.getLogger("alloy")

ENV = "ALLOY_ZYGOTE"
# Environment variables read by a library when it is imported (huggingface_hub's constants, torch's and CUDA's
# settings, the dynamic loader, Python's own, paths cached at import): a child that wants another value than the
# zygote had starts fresh. Prefix match, case-sensitive.
# (torch.distributed's RANK, MASTER_*, GLOO_*, NCCL_* are read when a process group is made: at run time.)
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "ROCM", "HIP_", "DS_",
               "DEEPSPEED", "OPENBLAS", "OMP_", "MKL_", "KMP_", "GOMP", "LD_", "PYTHON", "HOME", "XDG_", "TMPDIR",
               "TEMP", "TMP", "LANG", "LC_", "TZ", "MPL", "MLFLOW_ENABLE", "SSL_", "REQUESTS_CA")
# applied in the child as a fresh interpreter would (torch's threads, buffering, bytecode, sys.path: `_fresh`)
APPLIED = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH"}
THREADS = {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}  # applied only as a positive count
START_TIMEOUT_S = 30.0
TITLE_ROOM = 4096  # characters of blank argv the zygote starts with: room for its children's titles (`ps`)
REQUEST_TIMEOUT_S = 300.0  # the first request for a module waits for its import (seconds; minutes on a busy box)

_lock = threading.Lock()
_started: dict[str, subprocess.Popen] = {}  # socket path -> the zygote this process started
_refused: set[str] = set()  # zygote sockets that refused a request for a reason that will not change
_live: set["Forked"] = set()  # handles of running children: their connections must stay open


def _stop_started() -> None:
    """At exit: close each lifeline, so the zygotes we started exit, and reap them (their CPU time, and that of the
    children they reaped, then counts in ours: `time`, `getrusage(RUSAGE_CHILDREN)`). Registered when this module is
    imported, before any supervisor's own atexit stop, so it runs after them (atexit is last in, first out)."""
    for proc in _started.values():
        try:
            os.close(proc._alloy_lifeline)
        except OSError:
            pass
    for path, proc in _started.items():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        d = os.path.dirname(path)
        try:
            keep = os.path.getsize(os.path.join(d, "zygote.log")) > 0
        except OSError:
            keep = False
        if keep:  # what it printed (an import's warning, a bad request) stays readable
            log.info("process zygote's log: %s", os.path.join(d, "zygote.log"))
            with contextlib.suppress(OSError):
                os.unlink(path)
        else:
            shutil.rmtree(d, ignore_errors=True)


atexit.register(_stop_started)


def stop() -> None:
    """Stop the zygotes this process started and reap them now, as at exit (a bench counts each stage's CPU:
    `getrusage(RUSAGE_CHILDREN)` then includes the zygote and the children it forked). Children still running die
    with it; the next `start` starts a new zygote."""
    with _lock:
        _stop_started()
        _started.clear()
        _refused.clear()


def pids() -> set[int]:
    """The pids of the zygotes this process started (infrastructure: `alloy run`'s Ctrl-C does not wait for them to
    exit, alloy/interrupt.py; they outlive their children until this process exits or `stop()`)."""
    with _lock:
        return {proc.pid for proc in _started.values()}


def gpu_host() -> bool:
    """An NVIDIA or AMD device node exists: children may use CUDA/ROCm, so they start fresh."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def enabled(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ENV, "1") != "0" and sys.platform.startswith("linux") and not gpu_host()


def env_mismatch(want: dict[str, str], have: dict[str, str], added: set[str] = frozenset()) -> list[str]:
    """The import-time variables on which a child's environment `want` differs from the zygote's `have` (`added`:
    variables the zygote's own imports set, as a fresh child's imports would: missing from `want` is not a
    difference). PYTHONPATH is a difference only when an entry is missing from the zygote's sys.path."""
    out = []
    for key in sorted(set(want) | set(have)):
        if not key.startswith(IMPORT_TIME) or want.get(key) == have.get(key):
            continue
        if key in THREADS and want.get(key, "").isdigit() and int(want[key]) > 0:
            continue  # a thread count the child sets (torch.set_num_threads); unset, it would get the zygote's
        if key in APPLIED and key not in THREADS:
            continue
        if key in added and key not in want:
            continue
        out.append(key)
    return out


# ------------------------------------------------------------------------------------------------- the client


class Forked:
    """A child forked by the zygote: `pid`, `args`, `returncode`, `poll()`, `wait(timeout)` as `subprocess.Popen`."""

    def __init__(self, sock: socket.socket, pid: int, args: list[str], buf: bytes = b""):
        self._sock, self.pid, self.args, self._buf = sock, pid, list(args), buf
        self.returncode: int | None = None
        self._read_lock = threading.Lock()
        _live.add(self)

    def _take(self, block_s: float | None) -> None:
        """Read the zygote's exit message, waiting at most `block_s` seconds (None: forever)."""
        with self._read_lock:
            if self.returncode is not None:
                return
            deadline = None if block_s is None else time.monotonic() + block_s
            while b"\n" not in self._buf:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._sock.settimeout(left)
                try:
                    chunk = self._sock.recv(4096)
                except (TimeoutError, BlockingIOError, socket.timeout):
                    return
                except OSError:
                    chunk = b""
                if not chunk:  # the zygote is gone: its children died with it (PR_SET_PDEATHSIG)
                    self._done(-signal.SIGKILL)
                    return
                self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            self._done(int(json.loads(line)["exit"]))

    def _done(self, code: int) -> None:
        self.returncode = code
        self._sock.close()
        _live.discard(self)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"Forked(pid={self.pid}, returncode={self.returncode}, args={self.args[:4]}...)"


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    body = json.dumps(msg).encode()
    head = struct.pack("!I", len(body))
    socket.send_fds(sock, [head], list(fds)) if fds else sock.sendall(head)  # the descriptors ride on the header
    sock.sendall(body)


def _address() -> str | None:
    """This process's zygote socket: the one that forked us (ALLOY_ZYGOTE), else the one we started (on first use)."""
    path = os.environ.get(ENV)
    if path and path != "0" and os.path.exists(path):
        return path
    with _lock:
        for path, proc in _started.items():
            if proc.poll() is None:
                return path
        d = tempfile.mkdtemp(prefix="alloy-zygote-")
        path = os.path.join(d, "sock")
        lifeline_r, lifeline_w = os.pipe()  # the zygote exits when our end closes: when this process is gone
        try:
            with open(os.path.join(d, "zygote.log"), "ab") as err:  # the zygote's own warnings (its imports')
                proc = subprocess.Popen([sys.executable, "-m", "infra.zygote", path, " " * TITLE_ROOM],
                                        stdin=lifeline_r, stdout=subprocess.PIPE, stderr=err,
                                        env=dict(os.environ, **{ENV: path}), start_new_session=True, close_fds=True)
        finally:
            os.close(lifeline_r)
        ready = proc.stdout.readline() if _readable(proc.stdout, START_TIMEOUT_S) else b""
        if ready.strip() != b"ready":
            proc.kill()
            os.close(lifeline_w)
            log.warning("process zygote did not start (%s); children start fresh", ready.decode(errors="replace"))
            return None
        proc._alloy_lifeline = lifeline_w  # held for our lifetime
        _started[path] = proc
        return path


def _readable(f, timeout_s: float) -> bool:
    sel = selectors.DefaultSelector()
    sel.register(f, selectors.EVENT_READ)
    try:
        return bool(sel.select(timeout_s))
    finally:
        sel.close()


def spawn(cmd: list[str], *, env: dict[str, str], stdout: int, cwd: str | None = None) -> Forked | None:
    """`cmd` (`[sys.executable, "-m", module, *args]`) forked from the zygote, its stdout and stderr on the descriptor
    `stdout`; None when it must start fresh (module docstring): the caller then uses `subprocess.Popen`."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or not enabled(env) or not enabled():
        return None
    path = _address()
    if path is None or path in _refused:
        return None
    env = {**env, ENV: path}  # its own children are forked by the same zygote
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(REQUEST_TIMEOUT_S)
        sock.connect(path)
        _send(sock, {"module": cmd[2], "args": cmd[3:], "argv": cmd, "env": env,
                     "cwd": os.path.abspath(cwd or os.getcwd())}, [stdout])
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                raise OSError("the zygote closed the connection")
            buf += chunk
    except OSError as e:
        sock.close()
        log.warning("process zygote at %s unreachable (%s): %s starts fresh", path, e, cmd[2])
        return None
    line, rest = buf.split(b"\n", 1)
    reply = json.loads(line)
    if "pid" not in reply:
        sock.close()
        if reply.get("permanent"):
            _refused.add(path)
        log.info("%s starts fresh: %s", cmd[2], reply.get("error"))
        return None
    return Forked(sock, int(reply["pid"]), cmd, rest)


def start(cmd: list[str], *, env: dict[str, str], stdout, cwd: str | None = None):
    """Start `cmd` with stdout and stderr appended to the open file `stdout`, stdin on /dev/null, in its own session,
    dying with this process: forked from the zygote where `spawn` can, else `subprocess.Popen` with
    `PR_SET_PDEATHSIG` (follows the calling thread: call from a thread that outlives the child). Returns the
    `Forked` or the `Popen`."""
    return spawn(cmd, env=env, stdout=stdout.fileno(), cwd=cwd) or subprocess.Popen(
        cmd, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
        start_new_session=True, preexec_fn=pdeathsig_preexec())


# ------------------------------------------------------------------------------------------------- the zygote


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 4)
    if not data:
        raise EOFError
    while len(data) < 4:
        chunk = conn.recv(4 - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    (n,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return json.loads(body), list(fds)


def _shadowing(pythonpath: str) -> list[str]:
    """Entries of `pythonpath` missing from sys.path that hold a top-level module or package the zygote imported
    from somewhere else: a fresh child would have imported that copy instead. An entry that holds the very files
    loaded (the checkout an editable install points at) shadows nothing."""
    out = []
    for entry in (p for p in pythonpath.split(os.pathsep) if p and p not in sys.path):
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for n in names:
            module = sys.modules.get(_module_name(entry, n) or "")
            if module is not None and os.path.realpath(os.path.join(entry, n)) not in _origins(module):
                out.append(entry)
                break
    return out


def _module_name(entry: str, name: str) -> str | None:
    """The top-level module the directory entry `name` of a sys.path entry would provide: a package directory, a
    `.py` file or an extension module; None for anything else (`prefect.yaml` provides no module `prefect`)."""
    if os.path.isdir(os.path.join(entry, name)):
        return name if name.isidentifier() else None
    stem, dot, ext = name.partition(".")
    module = ext == "py" or ext.rsplit(".", 1)[-1] in ("so", "pyd")
    return stem if dot and module and stem.isidentifier() else None


def _origins(module) -> set[str]:
    """Where `module` was loaded from: its file, or its package's directories (real paths)."""
    if hasattr(module, "__path__"):
        return {os.path.realpath(p) for p in module.__path__}
    file = getattr(module, "__file__", None)
    return {os.path.realpath(file)} if file else set()


def _threads() -> int:
    """Python threads of this process. Native pools started by imports are not counted: OpenBLAS's (numpy, scipy)
    and jemalloc's (pyarrow) stop and restart around a fork (their pthread_atfork handlers), and torch's own pool
    is started by the first parallel op, which the zygote never runs."""
    return threading.active_count()


class _Zygote:
    def __init__(self, path: str):
        self.path, self.pid = path, os.getpid()
        self.env0 = dict(os.environ)
        self.broken: str | None = None
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(0, selectors.EVENT_READ, "lifeline")  # stdin: the pipe whose writer started us
        self.children: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
        self.owner: dict[socket.socket, int] = {}
        self.die_with_us = pdeathsig_preexec(self.pid)  # libc resolved now, not in each child

    def serve(self) -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            for key, _ in self.sel.select(0.05):
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self._request(conn)
                elif key.data == "lifeline":
                    if not os.read(0, 4096):
                        return
                else:  # a requester's connection closed (or spoke out of turn): its child dies with it
                    conn = key.fileobj
                    try:
                        alive = bool(conn.recv(4096, socket.MSG_DONTWAIT))  # nothing is sent after a request
                    except BlockingIOError:
                        alive = True
                    except OSError:
                        alive = False
                    if not alive:
                        pid = self.owner.pop(conn, None)
                        if pid is not None:
                            signal_group(pid, signal.SIGKILL)
                        self._drop(conn)
            self._reap()

    def _drop(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.owner.pop(conn, None)
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            self._drop(conn)

    def _reply(self, conn: socket.socket, msg: dict) -> None:
        try:
            conn.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            pass

    def _request(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        try:
            req, fds = _recv_request(conn)
        except (OSError, EOFError, ValueError) as e:
            print(f"zygote: bad request: {e!r}", file=sys.stderr, flush=True)
            conn.close()
            return
        try:
            error, permanent = self._refusal(req)
            if error:
                self._reply(conn, {"error": error, "permanent": permanent})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:  # the child: never returns
                self._child(req, fds[0] if fds else None, conn)
            self.children[pid] = conn
            self.owner[conn] = pid
            conn.setblocking(False)
            self.sel.register(conn, selectors.EVENT_READ, "conn")
            self._reply(conn, {"pid": pid})
        finally:
            for fd in fds:
                os.close(fd)

    def _refusal(self, req: dict) -> tuple[str | None, bool]:
        """Why `req` must start fresh (None: fork it), and whether every later request would be refused too. The
        module is imported first (kept for later requests even when this one is refused): the variables its import
        sets are then known."""
        if self.broken:
            return self.broken, True
        module = req["module"]
        if module not in sys.modules:
            try:
                importlib.import_module(module)
            except BaseException:  # noqa: BLE001 - not importable here (the child's PYTHONPATH has it), or
                pass  # broken: the child imports it itself, and reports a failure in its own log as a fresh one would
        n = _threads()
        if n != 1:
            self.broken = f"the zygote has {n} Python threads after importing {module}: forking it is unsafe"
            return self.broken, True
        diff = env_mismatch(req["env"], dict(os.environ), set(os.environ) - set(self.env0))
        shadow = _shadowing(req["env"].get("PYTHONPATH", ""))
        if diff or shadow:
            return (f"its environment differs from the zygote's in {diff}" if diff else
                    f"its PYTHONPATH entries {shadow} could shadow modules the zygote imported"), False
        return None, False

    def _child(self, req: dict, out_fd: int | None, conn: socket.socket) -> None:
        code = 1
        try:
            os.setsid()
            self.die_with_us()  # PR_SET_PDEATHSIG: SIGKILLed when the zygote dies
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.set_wakeup_fd(-1)
            self.sel.close()
            self.listener.close()
            for c in list(self.owner) + [conn]:
                c.close()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            if out_fd is not None:
                os.dup2(out_fd, 1)
                os.dup2(out_fd, 2)
                os.close(out_fd)
            env = req["env"]
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(env)
            _fresh_process_state(env, req["argv"], req["cwd"])
            sys.argv = [req["argv"][2], *req["args"]]  # runpy puts the module's file in argv[0]
            code = _run_main(req["module"])
        except BaseException:  # noqa: BLE001 - a failure before the module ran: report it where its log is
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def _fresh_process_state(env: dict[str, str], argv: list[str], cwd: str) -> None:
    """What a fresh interpreter would have that a fork inherits from the zygote."""
    sys.path[0] = cwd  # `python -m` puts the working directory first
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    for p in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if p not in sys.path:
            sys.path.insert(1, p)
    tempfile.tempdir = None
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=unbuffered or stream is sys.stderr)
        except (AttributeError, ValueError):
            pass
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    set_title(" ".join(argv))


def _run_main(module: str) -> int:
    """`python -m module` in this process: run it as __main__, then what interpreter exit runs; the exit code."""
    import runpy

    sys.modules.pop(module, None)  # as under `python -m`: the module runs as __main__ only (no runpy warning)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback to stderr, exit code 1
        import traceback

        traceback.print_exc()
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # non-daemon threads are joined before atexit, as at interpreter exit
        shutdown()
    atexit._run_exitfuncs()
    if code < 0:  # as the interpreter after an uncaught KeyboardInterrupt: die of the signal
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def set_title(title: str) -> None:
    """Show `title` as this process's command line (`ps`, /proc/PID/cmdline, psutil's `cmdline()` split on spaces):
    written over the argv strings the kernel reports (`arg_start`..`arg_end` in /proc/self/stat; the zygote starts
    with TITLE_ROOM blanks of argv to make room). The title ends in a NUL and the area in a blank: the kernel then
    reports the text up to that NUL (its rule for a rewritten argv), never the environment block, so
    /proc/PID/environ still shows the environment the process started with."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49: arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    if room < 2:
        return
    data = title.encode(errors="replace")[: room - 2] + b"\0"
    import ctypes

    ctypes.memmove(start, data + b" " * (room - len(data)), room)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m infra.zygote SOCKET_PATH [TITLE_ROOM] (started by infra.zygote.spawn)", file=sys.stderr)
        return 2
    path = argv[0]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # our own session; a stop reaches the children, not us
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a `kill`: exit through the `finally` below, its socket dir removed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    try:
        _Zygote(path).serve()
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
