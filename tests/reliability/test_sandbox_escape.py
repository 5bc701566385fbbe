"""The sandbox red-team suite (issue 52): a policy's code or tool call tries to leave state behind for a later episode
or to reach the host, through the kernel channels a uid, Landlock and a network namespace do not close by
themselves. Every case is judged from the HOST side (what is left in /proc/sysvipc, /dev/shm, /tmp, the process
table, what a host socket received, what a host watcher saw), and runs in every sandbox mode this machine produces:
as root ("root": namespaces made as root; "userns"; "none": no namespace) and, as root, from a caller that first
drops to nobody (modes "userns" and "none"), through a small helper process (`NOBODY_SERVER`).

Each channel and the layer that closes it is described in docs/security.md, which names these tests.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandbox import confine
from sandbox.runner import available_modes, run_tool, sandbox_python
from proc_scan import alive_with
from sandbox.supervisor import NOBODY

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PY = ["python"]
ROOT = os.geteuid() == 0
VARIANTS = ([("caller", m) for m in available_modes()]
            + ([("nobody", "userns"), ("nobody", "none")] if ROOT else []))
_libc = ctypes.CDLL(None, use_errno=True)

# A caller dropped to nobody: run_tool requests as JSON lines on stdin, results on stdout (first line: its modes).
NOBODY_SERVER = r'''import dataclasses, json, os, sys
sys.path.insert(0, sys.argv[1])
from sandbox import runner  # imported as root (the venv may be root's), probed after the drop
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
print(json.dumps(runner.available_modes()), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    kw = dict(req["kw"], allowed=set(req["kw"].get("allowed", runner.DEFAULT_ALLOWED)))
    try:
        out = dataclasses.asdict(runner.run_tool(req["command"], req["workdir"], **kw))
    except Exception as e:
        out = {"error": repr(e)}
    print(json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def nobody_server():
    """One helper per module, dropped to nobody; None when the tests do not run as root."""
    if not ROOT:
        yield None
        return
    p = subprocess.Popen([sys.executable, "-c", NOBODY_SERVER, str(REPO)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd="/", bufsize=1)
    modes = json.loads(p.stdout.readline())
    lock = threading.Lock()

    def call(command: str, workdir, **kw) -> dict:
        with lock:
            p.stdin.write(json.dumps({"command": command, "workdir": str(workdir), "kw": kw}) + "\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline())
        assert "error" not in out, out
        return out

    call.modes = modes
    yield call
    p.stdin.close()
    p.wait(timeout=30)


@pytest.fixture(params=VARIANTS, ids=[f"{u}-{m}" for u, m in VARIANTS])
def sbx(request, nobody_server):
    """`sbx(command, workdir, **run_tool kwargs) -> result dict` in one (caller, mode) variant; `.user`, `.mode`."""
    user, mode = request.param
    if user == "nobody":
        if mode not in nobody_server.modes:
            pytest.skip(f"mode {mode!r} cannot be produced as nobody here ({nobody_server.modes})")

        def call(command, workdir, **kw):
            return nobody_server(command, workdir, isolation=mode, **kw)
    else:
        def call(command, workdir, **kw):
            kw.setdefault("allowed", {"python"})
            return dataclasses.asdict(run_tool(command, workdir, isolation=mode, **kw))
    call.user, call.mode = user, mode
    return call


def _py(code: str, *args) -> str:
    return shlex.join(["python", "-c", code, *map(str, args)])


def _run_py(sbx, code: str, workdir, *args, **kw) -> dict:
    """Run `code` (which prints one JSON object) as the `python` tool; returns that object. The call must have run
    confined (Landlock and seccomp) and ended by itself."""
    r = sbx(_py(code, *args), workdir, allowed=PY, **kw)
    assert r["blocked_reason"] is None and r["sandbox_error"] is None, r
    assert r["fs_isolated"] and r["syscall_filtered"] and r["isolation"] == sbx.mode, r
    assert r["exit_code"] == 0, r
    return json.loads(r["stdout"])


def _host_dir(prefix: str) -> Path:
    """A host directory every sandbox uid can name and enter (0755), as /tmp itself is."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def workdir():
    d = _host_dir("alloy-redteam-")
    (d / "notes.txt").write_text("hello notes\n")
    os.chmod(d / "notes.txt", 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# Shared by the probes: `attempt(name, fn)` records "allowed" or "refused: <why>"; `sc` raises on a −1 return.
PRELUDE = r'''import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
res = {}
def sc(rc):
    if rc == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return rc
def ok(rc):
    sc(rc)
def attempt(name, fn):
    try:
        out = fn()
        res[name] = "allowed" if out is None else out
    except OSError as e:
        res[name] = f"refused: {e.strerror or e}"
'''


# -- System V and POSIX IPC ---------------------------------------------------------------------------------------

IPC_MAKE = PRELUDE + r'''key, mq = int(sys.argv[1]), sys.argv[2]
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
def shm():
    sid = sc(libc.shmget(key, 1 << 20, 0o1000 | 0o666))  # IPC_CREAT
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    ctypes.memmove(addr, b"the answer is 42", 16)
attempt("shmget", shm)
attempt("msgget", lambda: ok(libc.msgget(key + 1, 0o1000 | 0o666)))
attempt("semget", lambda: ok(libc.semget(key + 2, 1, 0o1000 | 0o666)))
attempt("mq_open", lambda: ok(libc.mq_open(mq.encode(), os.O_CREAT | os.O_RDWR, 0o666, None)))
print(json.dumps(res))
'''
IPC_FIND = PRELUDE + r'''key, mq = int(sys.argv[1]), sys.argv[2]
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
attempt("shmget", lambda: ok(libc.shmget(key, 0, 0)))
attempt("msgget", lambda: ok(libc.msgget(key + 1, 0)))
attempt("semget", lambda: ok(libc.semget(key + 2, 0, 0)))
attempt("mq_open", lambda: ok(libc.mq_open(mq.encode(), os.O_RDONLY)))
print(json.dumps(res))
'''


def _sysv_keys() -> dict[str, dict[int, int]]:
    """The host's System V objects, as the host sees them: {"shm"|"msg"|"sem": {key: id}} (`ipcs`)."""
    out = {}
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        out[kind] = {int(r[0]): int(r[1]) for r in rows if r}
    return out


def _remove_sysv(key: int, mq: str) -> None:
    """Host-side cleanup of what a call left (only today's sandbox leaves any)."""
    keys = _sysv_keys()
    for kind, k in (("shm", key), ("msg", key + 1), ("sem", key + 2)):
        if k in keys[kind]:
            {"shm": lambda i: _libc.shmctl(i, 0, None), "msg": lambda i: _libc.msgctl(i, 0, None),
             "sem": lambda i: _libc.semctl(i, 0, 0)}[kind](keys[kind][k])  # IPC_RMID
    _libc.mq_unlink(mq.encode())


def _host_mq_exists(mq: str) -> bool:
    fd = _libc.mq_open(mq.encode(), os.O_RDONLY)
    if fd >= 0:
        os.close(fd)
    return fd >= 0


def test_sysv_and_posix_ipc_do_not_outlive_the_call(sbx, workdir):
    """A call creates a shared memory segment (and writes into it), a message queue, a semaphore set and a POSIX
    message queue; afterwards the host's /proc/sysvipc holds none of them, no POSIX queue of that name exists, and a
    second call cannot find any of them (the channel of one episode publishing answers for a later one)."""
    key, mq = random.randrange(0x41000000, 0x41ffffff, 4), f"/alloy-redteam-{os.getpid()}-{random.getrandbits(32)}"
    before = _sysv_keys()
    try:
        made = _run_py(sbx, IPC_MAKE, workdir, key, mq)
        after = _sysv_keys()
        left = {kind: sorted(set(after[kind]) - set(before[kind]) & {key, key + 1, key + 2}) for kind in after}
        assert left == {"shm": [], "msg": [], "sem": []}, (made, left)
        assert not _host_mq_exists(mq), made
        found = _run_py(sbx, IPC_FIND, workdir, key, mq)
        assert all(v.startswith("refused") for v in found.values()), found
    finally:
        _remove_sysv(key, mq)


@pytest.mark.parametrize("mode", [m for m in ("root", "userns") if m in available_modes()])
def test_ipc_namespace_alone_drops_the_objects(workdir, mode):
    """Defence in depth: with the namespaces but WITHOUT the seccomp filter (the supervisor's `_preexec` driven
    directly), the SysV objects a call creates live in its own IPC namespace and die with it: the host never sees
    them."""
    from sandbox.supervisor import _preexec

    key, mq = random.randrange(0x42000000, 0x42ffffff, 4), f"/alloy-redteam-ns-{os.getpid()}"
    try:
        p = subprocess.run([sandbox_python(), "-I", "-S", "-c", IPC_MAKE, str(key), mq], cwd=workdir,
                           env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30,
                           preexec_fn=_preexec(mode, 10.0, 256, 16, 1 << 20))
        made = json.loads(p.stdout)
        assert made["shmget"] == "allowed" and made["msgget"] == "allowed", made  # it ran, unfiltered
        left = _sysv_keys()
        assert key not in left["shm"] and key + 1 not in left["msg"] and key + 2 not in left["sem"], made
        assert not _host_mq_exists(mq)
    finally:
        _remove_sysv(key, mq)


# -- unix sockets on the host ---------------------------------------------------------------------------------------

UNIX_SEND = PRELUDE + r'''import socket
path, abstract = sys.argv[1], "\0" + sys.argv[2]
def pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]
def pair_connect(addr):
    s = pair()
    s.connect(addr)
    s.send(b"pair+connect")
attempt("socketpair+sendto(path)", lambda: pair().sendto(b"pair+sendto", path) and None)
attempt("socketpair+sendmsg(path)", lambda: pair().sendmsg([b"pair+sendmsg"], [], 0, path) and None)
attempt("socketpair+connect(path)", lambda: pair_connect(path))
attempt("socket+sendto(path)", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"sock", path) and None)
attempt("socketpair+sendto(abstract)", lambda: pair().sendto(b"pair+abstract", abstract) and None)
attempt("socketpair+connect(abstract)", lambda: pair_connect(abstract))
attempt("socketpair+bind(abstract)", lambda: pair().bind(abstract + "-listen"))
def own_pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.send(b"own")
    return "allowed" if b.recv(10) == b"own" else "lost"
attempt("socketpair+send (own pair)", own_pair)
print(json.dumps(res))
'''


def test_host_unix_datagram_sockets_are_unreachable(sbx, workdir):
    """A path-bound AF_UNIX datagram socket (0666, in a directory the call can name) and an abstract one on the host:
    socketpair+sendto/sendmsg/connect, socket+sendto, to the path and to the abstract name; the host receives
    nothing. (The control: the same sends from outside the sandbox arrive.)"""
    d = _host_dir("alloy-redteam-sock-")
    path, abstract = d / "host.dgram", f"alloy-redteam-{os.getpid()}-{random.getrandbits(32)}"
    by_path, by_name = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), socket.socket(socket.AF_UNIX,
                                                                                       socket.SOCK_DGRAM)
    try:
        by_path.bind(str(path))
        os.chmod(path, 0o666)
        by_name.bind("\0" + abstract)
        by_path.setblocking(False)
        by_name.setblocking(False)
        socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b"control", str(path))
        assert by_path.recv(100) == b"control"  # positive control: reachable from outside the sandbox
        res = _run_py(sbx, UNIX_SEND, workdir, path, abstract)
        assert res["socketpair+send (own pair)"] == "allowed", res  # a pair of its own still works (asyncio needs it)
        got = []
        for s in (by_path, by_name):
            while True:
                try:
                    got.append(s.recv(100))
                except BlockingIOError:
                    break
        assert got == [], (got, res)
        assert all(v.startswith("refused") for k, v in res.items() if "own pair" not in k), res
    finally:
        by_path.close()
        by_name.close()
        shutil.rmtree(d, ignore_errors=True)


# -- inotify ----------------------------------------------------------------------------------------------------------

INOTIFY = PRELUDE + r'''import select, struct, time
watched = sys.argv[1]
seen = []
def watch():
    fd = sc(libc.inotify_init1(0))
    sc(libc.inotify_add_watch(fd, watched.encode(), 0x100 | 0x200))  # IN_CREATE | IN_DELETE
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            buf = os.read(fd, 4096)
            while buf:
                _, _, _, n = struct.unpack_from("iIII", buf)
                seen.append(buf[16:16 + n].rstrip(b"\0").decode())
                buf = buf[16 + n:]
attempt("inotify", watch)
attempt("fanotify", lambda: ok(libc.fanotify_init(0, 0)))
res["seen"] = seen
print(json.dumps(res))
'''


def test_inotify_sees_nothing_of_the_host(sbx, workdir):
    """While a call watches a host directory (as /tmp, where other episodes' folders appear), the host creates files
    in it; the call learns no name (its inotify_init fails)."""
    d = _host_dir("alloy-redteam-watched-")
    done = threading.Event()

    def other_episodes():
        i = 0
        while not done.is_set():
            (d / f"episode-{i}").write_text("x")
            i += 1
            time.sleep(0.05)

    t = threading.Thread(target=other_episodes)
    t.start()
    try:
        res = _run_py(sbx, INOTIFY, workdir, d, timeout_s=5.0)
    finally:
        done.set()
        t.join()
        shutil.rmtree(d, ignore_errors=True)
    assert res["seen"] == [] and res["inotify"].startswith("refused"), res
    assert res["fanotify"].startswith("refused"), res


# -- tool flags that name files ------------------------------------------------------------------------------------

def _outside_file() -> str:
    """A file outside the work dir that Landlock does allow (the system dirs): only the path check stops a flag
    that names it."""
    for p in ("/usr/lib/os-release", "/usr/share/common-licenses/GPL-3", os.path.realpath(sys.executable)):
        if os.path.isfile(p):
            return p
    pytest.skip("no readable file under the system dirs")


@pytest.mark.parametrize("command", [
    "grep --file={f} notes.txt", "grep -f{f} notes.txt", "grep -if{f} notes.txt", "grep -f {f} notes.txt",
    "grep --exclude-from={f} -r hello", "grep --exclude-from {f} -r hello", "grep -e hello --file={f} notes.txt",
    "grep hello @{f}", "cat @{f}", "cat --opt={f}", "ls --hide={f} --unknown={f}",
    "grep -R hello", "grep --dereference-recursive hello", "grep -d recurse hello {f}", "ls -l{f}",
    "grep --exclude-dir {f} -r x /", "cat -- {f}", "ls --color=auto {f}",
])
def test_tool_flags_naming_files_are_path_checked(workdir, command):
    """Every argument that names a file goes through the work-dir check: `--opt=path`, `-fpath`, `-f path`, a
    response file `@path`, after `--`; an unknown flag is refused (each program has an allow-list of flags); so
    is recursion that follows symlinks (`grep -R`). The program never runs."""
    cmd = command.format(f=_outside_file())
    r = run_tool(cmd, workdir, allowed={"grep", "cat", "ls"})
    assert r.exit_code is None and r.stdout == "" and r.blocked_reason, (cmd, r)


@pytest.mark.parametrize("command, stdout", [
    ("grep -h hello= notes.txt", ""), ("grep -n hello notes.txt", "1:hello notes\n"),
    ("grep -in -e HELLO notes.txt", "1:hello notes\n"), ("grep -c hello notes.txt", "1\n"),
    ("grep --count hello notes.txt", "1\n"), ("grep -rh hello", "hello notes\n"), ("grep -A1 -B 1 hello notes.txt",
                                                                                  "hello notes\n"),
    ("grep --max-count=1 hello notes.txt", "hello notes\n"), ("grep -e hello -- notes.txt", "hello notes\n"),
    ("ls", "notes.txt\n"), ("ls -a", ".\n..\nnotes.txt\n"), ("ls -1 --all", ".\n..\nnotes.txt\n"),
    ("cat -n notes.txt", "     1\thello notes\n"), ("cat notes.txt", "hello notes\n"),
    ("ls --hide=notes.txt", ""), ("ls -I notes.txt", ""),
])
def test_tool_flags_the_domains_use_still_work(workdir, command, stdout):
    """The allow-lists keep what the tool domains and a model reasonably type."""
    r = run_tool(command, workdir, allowed={"grep", "cat", "ls"})
    assert r.blocked_reason is None and r.stdout == stdout and r.exit_code in (0, 1), (command, r)


# -- /proc and stat --------------------------------------------------------------------------------------------------

PROC = PRELUDE + r'''host_pid = int(sys.argv[1])
attempt("stat /proc/<host pid>", lambda: f"uid {os.stat(f'/proc/{host_pid}').st_uid}")
attempt("list /proc", lambda: f"{sum(p.isdigit() for p in os.listdir('/proc'))} pids")
attempt("read /proc/<host pid>/status", lambda: open(f"/proc/{host_pid}/status").read()[:20])
attempt("pids seen by stat", lambda: str(sum(os.path.exists(f"/proc/{p}") for p in range(1, 4 * 32768))))
print(json.dumps(res))
'''


def test_proc_shows_no_host_process(sbx, workdir):
    """/proc: with a PID namespace the call gets a /proc of its own (mounted in a mount namespace of its own), so
    not even `stat` finds a host pid, and it sees only its own processes. Without namespaces (mode "none") /proc
    cannot be listed or read (Landlock), but `stat` still tells which pids exist and their uids: documented as
    out of scope in docs/security.md."""
    res = _run_py(sbx, PROC, workdir, os.getpid(), timeout_s=10.0)
    assert res["list /proc"].startswith("refused") and res["read /proc/<host pid>/status"].startswith("refused"), res
    if sbx.mode == "none":
        assert res["stat /proc/<host pid>"].startswith("uid"), res  # the documented gap
    else:
        assert res["stat /proc/<host pid>"] == "refused: No such file or directory", res
        assert int(res["pids seen by stat"]) <= 4, res  # its own: the program (and nothing of the host)


STAT = PRELUDE + r'''attempt("stat /etc/passwd", lambda: f"size {os.stat('/etc/passwd').st_size}")
attempt("open /etc/passwd", lambda: open("/etc/passwd").read()[:10])
attempt("list /etc", lambda: str(len(os.listdir("/etc"))))
print(json.dumps(res))
'''


def test_stat_outside_the_work_dir_is_out_of_scope(sbx, workdir):
    """Landlock does not cover metadata: `stat` of a path outside the work dir answers (its size, owner, times),
    while opening or listing it is refused. Documented as out of scope (docs/security.md); this test pins it."""
    res = _run_py(sbx, STAT, workdir)
    assert res["stat /etc/passwd"].startswith("size"), res
    assert res["open /etc/passwd"] == "refused: Permission denied" and res["list /etc"].startswith("refused"), res


# -- files, processes, signals, keys -------------------------------------------------------------------------------

LEAVE = PRELUDE + r'''import time
shm_name, tmp_name, token = sys.argv[1:4]
attempt("/dev/shm file", lambda: open(shm_name, "w").write("answer"))
attempt("/tmp file", lambda: open(tmp_name, "w").write("answer"))
def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", token])
        os._exit(0)
    time.sleep(0.1)
attempt("daemon", daemon)
attempt("memfd", lambda: str(os.memfd_create("answer")))
print(json.dumps(res))
'''


_alive_with = alive_with  # tests/proc_scan.py


def test_nothing_outlives_the_call(sbx, workdir):
    """A call tries to leave a file in /dev/shm and in /tmp, a daemon (setsid, double fork, exec) and a memfd; from
    the host afterwards: no such file, no such process."""
    token = f"alloy-redteam-daemon-{os.getpid()}-{random.getrandbits(32)}"
    shm_name, tmp_name = f"/dev/shm/{token}", f"{tempfile.gettempdir()}/{token}"
    try:
        res = _run_py(sbx, LEAVE, workdir, shm_name, tmp_name, token)
        assert res["/dev/shm file"].startswith("refused") and res["/tmp file"].startswith("refused"), res
        assert not os.path.exists(shm_name) and not os.path.exists(tmp_name)
        deadline = time.monotonic() + 1.0
        while _alive_with(token) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _alive_with(token) == [], res
    finally:
        for p in (shm_name, tmp_name):
            if os.path.exists(p):
                os.unlink(p)
        for pid in _alive_with(token):
            os.kill(pid, signal.SIGKILL)


REACH = PRELUDE + r'''import signal
host_pid = int(sys.argv[1])
attempt("kill -0 host pid", lambda: os.kill(host_pid, 0))
attempt("SIGUSR1 host pid", lambda: os.kill(host_pid, signal.SIGUSR1))
attempt("ptrace attach host pid", lambda: ok(libc.ptrace(16, host_pid, 0, 0)))
attempt("add_key to the user keyring", lambda: ok(libc.syscall(248, b"user", b"alloy-answer", b"42", 2, -4)))
attempt("userfaultfd", lambda: ok(libc.syscall(323, 0)))
attempt("io_uring_setup", lambda: ok(libc.syscall(425, 4, ctypes.create_string_buffer(120))))
attempt("prctl(PR_SET_MM)", lambda: ok(libc.prctl(35, 7, 0, 0, 0)))
print(json.dumps(res))
'''
SLEEPER = ("import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: open(sys.argv[1], 'w').write('hit'))\n"
           "print('ready', flush=True)\ntime.sleep(30)")


def test_host_processes_cannot_be_signalled_traced_or_keyed(sbx, workdir):
    """A host process of the caller's own uid (nobody in the unprivileged variants): the call cannot signal it, not
    even `kill -0` to learn it exists, ptrace it; it cannot add a key to a keyring (which
    would outlive it), nor use userfaultfd, io_uring or PR_SET_MM. Judged on the host: the process got no
    signal."""
    d = _host_dir("alloy-redteam-sleeper-")
    hit = d / "hit"
    os.chmod(d, 0o777)
    as_nobody = (lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY))) if sbx.user == "nobody" else None
    host = subprocess.Popen([sandbox_python(), "-I", "-S", "-c", SLEEPER, str(hit)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=as_nobody)
    try:
        assert host.stdout.readline() == "ready\n"
        res = _run_py(sbx, REACH, workdir, host.pid)
        time.sleep(0.1)
        assert not hit.exists() and host.poll() is None, res
        assert all(v.startswith("refused") for v in res.values()), res
    finally:
        host.kill()
        host.wait()
        shutil.rmtree(d, ignore_errors=True)


def test_seccomp_denies_the_kernel_channels_by_name():
    """The filter's deny list names every channel above (docs/security.md lists them)."""
    for name in ("shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
                 "semtimedop", "semctl", "mq_open", "inotify_init", "inotify_init1", "fanotify_init", "connect",
                 "bind", "sendmsg", "sendmmsg", "ptrace", "add_key", "keyctl", "userfaultfd", "io_uring_setup"):
        assert name in confine.DENIED_SYSCALLS, name
