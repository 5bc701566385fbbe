"""The tool sandbox against real escape attempts: protected files, `..` traversal, symlinks out of the work dir, a
connection to a real listener on 127.0.0.1, an infinite loop, a fork bomb, a memory hog, an output flood, shell
syntax, the scrubbed environment and the dropped uid; and, through the `python` tool, reading /etc/passwd, the
repository and another episode's folder, writing /tmp, and denied syscalls (AF_INET sockets, ptrace,
process_vm_readv, unshare, keyctl, io_uring) — each also run unsandboxed as a positive control. The escape batch
runs both as the calling user (root here) and from a child process that first drops to nobody (65534)."""
import json
import os
import subprocess
import sys
import shlex
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandbox.accounting import UID_BASE, UID_RANGE
from sandbox.calc import safe_calc
from sandbox.runner import PROGRAMS, check_command, isolation_support, run_tool
from proc_scan import alive_with
from sandbox.supervisor import NOBODY

pytestmark = pytest.mark.integration

ISOLATED = isolation_support() != "none"
needs_ns = pytest.mark.skipif(not ISOLATED, reason="no network/PID namespace on this machine (rule-level fallback)")
PY = {"python"}


@pytest.fixture
def workdir():
    """A work dir the sandbox user can enter (pytest's tmp_path is 0700 under root's tree)."""
    d = Path(tempfile.mkdtemp(prefix="alloy-sbx-test-"))
    os.chmod(d, 0o755)
    (d / "notes.txt").write_text("hello notes\n")
    (d / "sub").mkdir()
    (d / "sub" / "inner.txt").write_text("inner\n")
    os.chmod(d / "sub", 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def py(code: str) -> str:
    return shlex.join(["python", "-c", code])


def test_whitelisted_commands_work(workdir):
    assert run_tool("calc 123+456", workdir).stdout == "579\n"
    assert run_tool("calc (12+34)*2-7//2", workdir).stdout == "89\n"  # 92 − 3
    assert run_tool("ls", workdir).stdout == "notes.txt\nsub\n"
    assert run_tool("cat notes.txt", workdir).stdout == "hello notes\n"
    assert run_tool(f"cat {workdir}/sub/inner.txt", workdir).stdout == "inner\n"  # absolute, but inside
    assert run_tool("echo hi; cat /etc/passwd", workdir).stdout == "hi; cat /etc/passwd\n"  # no shell: inert text
    r = run_tool("cat notes.txt", workdir)
    assert r.ok and r.net_isolated == ISOLATED and r.elapsed_s < 2


def test_refused_commands_never_run(workdir):
    for cmd, why in [("rm -rf notes.txt", "not allowed"), ("python -c 1", "not allowed"), ("", "empty command"),
                     ("cat 'unclosed", "cannot parse")]:
        r = run_tool(cmd, workdir)
        assert r.exit_code is None and why in r.blocked_reason, cmd
    assert (workdir / "notes.txt").exists()


def test_calc_is_arithmetic_only(workdir):
    for expr, why in [("__import__('os').system('id')", "Call not allowed"), ("2**10000", "exponent out of range"),
                      ("1/0", "division by zero"), ("open('/etc/passwd').read()", "not allowed")]:
        r = run_tool(f"calc {shlex.quote(expr)}", workdir)
        assert r.exit_code == 1 and why in r.stderr and r.stdout == "", expr
    assert safe_calc("7/2") == "3.5" and safe_calc("-3+10") == "7" and safe_calc("2**10") == "1024"


def test_protected_files_and_traversal_are_refused(workdir):
    for cmd in ["cat /etc/passwd", "cat ../notes.txt", "ls ..", "cat sub/../../etc/passwd", "ls /",
                "cat /proc/1/environ", f"cat {workdir}/../../etc/passwd"]:
        r = run_tool(cmd, workdir)
        assert r.exit_code is None and r.stdout == "" and r.blocked_reason, cmd
    assert "outside the work dir" in run_tool("cat /etc/passwd", workdir).blocked_reason
    assert "'..'" in run_tool("cat sub/../notes.txt", workdir).blocked_reason  # refused even when it stays inside


def test_symlink_escapes_are_refused(workdir):
    (workdir / "pw").symlink_to("/etc/passwd")
    (workdir / "etcdir").symlink_to("/etc")
    (workdir / "ok").symlink_to(workdir / "notes.txt")
    for cmd in ["cat pw", "cat etcdir/passwd", "ls etcdir", f"cat {workdir}/pw"]:
        r = run_tool(cmd, workdir)
        assert r.exit_code is None and "outside the work dir" in r.blocked_reason, cmd
    assert run_tool("cat ok", workdir).stdout == "hello notes\n"  # a link that stays inside is fine


def test_rule_level_fallback_without_a_network_namespace(workdir):
    """What run_tool refuses when `isolation_support()` is "none" (checked directly: this machine may have netns)."""
    for cmd in ["python -c 1", "cat http://10.0.0.1/x", "ls host.example:8080/"]:
        _, prog, why = check_command(cmd, workdir, {"python", "cat", "ls"}, net_isolated=False)
        assert prog is None and why, cmd
    _, prog, why = check_command("python -c 1", workdir, {"python"}, net_isolated=True)
    assert prog is not None and why is None


@needs_ns
def test_no_network_even_to_loopback(workdir):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    accepted = []

    def accept_loop():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept_loop, daemon=True).start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    def n_accepted(want: int) -> int:
        deadline = time.monotonic() + 1.0
        while len(accepted) < want and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(accepted)

    try:
        exec(code, {})  # positive control: the listener is reachable from outside the sandbox
        assert n_accepted(1) == 1
        r = run_tool(py(code), workdir, allowed=PY)
        # seccomp refuses the AF_INET socket itself; without it, the empty network namespace has no route
        why = "Operation not permitted" if r.syscall_filtered else "Network is unreachable"
        assert r.exit_code == 1 and "connected" not in r.stdout and why in r.stderr
        assert n_accepted(2) == 1  # nothing arrived from inside
    finally:
        srv.close()


def test_environment_is_scrubbed_and_uid_dropped(workdir, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-sandbox")
    r = run_tool(py("import os; print(sorted(os.environ)); print(os.getuid(), os.getpid())"), workdir, allowed=PY)
    if not ISOLATED and not r.syscall_filtered:  # no namespace and no seccomp: python is refused (rule level)
        assert "network namespace" in r.blocked_reason
        return
    if not ISOLATED:
        pytest.skip("no PID namespace or uid drop to check (Landlock + seccomp: see the escape batch below)")
    env_line, ids = r.stdout.splitlines()
    assert env_line == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'PYTHONDONTWRITEBYTECODE']"
    uid, pid = map(int, ids.split())
    assert pid == 1  # its own PID namespace
    if os.geteuid() == 0:
        assert UID_BASE <= uid < UID_BASE + UID_RANGE  # a uid of its own for this call
        r = run_tool(py("open('x', 'w')"), workdir, allowed=PY)  # the work dir is not writable for nobody
        assert r.exit_code == 1 and "Permission denied" in r.stderr and not (workdir / "x").exists()


@needs_ns
def test_infinite_loop_hits_the_time_limit(workdir):
    r = run_tool(py("while True: pass"), workdir, allowed=PY, timeout_s=1.0)
    assert r.timed_out and r.exit_code < 0 and 0.9 < r.elapsed_s < 3.0


def _processes_of(uid: int) -> list[str]:
    """Processes (zombies included) of `uid`: as root each call runs as a uid of its own, so this sees only that
    call's processes even while other sandboxes run on the machine."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid_line = next(ln for ln in open(f"/proc/{p}/status") if ln.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) == uid:
            pids.append(p)
    return pids


@needs_ns
@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC per uid needs the drop to a sandbox uid")
def test_fork_bomb_is_contained_and_fully_reaped(workdir):
    bomb = ("import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    r = run_tool(py(bomb), workdir, allowed=PY, timeout_s=1.0, max_procs=16)
    assert r.timed_out and r.elapsed_s < 4.0
    uid = int(r.stdout)  # the call's own uid (65534 seen from inside a user namespace: then only the count)
    assert uid == NOBODY or (UID_BASE <= uid < UID_BASE + UID_RANGE and _processes_of(uid) == [])  # nothing left


@needs_ns
@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC per uid needs the drop to a sandbox uid")
def test_process_limit_and_children_die_with_the_program(workdir):
    code = ("import os, time\nok = fail = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        fail += 1\n        continue\n    if pid == 0:\n        time.sleep(30)\n"
            "        os._exit(0)\n    ok += 1\nprint(ok, fail, os.getuid())")
    r = run_tool(py(code), workdir, allowed=PY, max_procs=8)
    ok, fail, uid = map(int, r.stdout.split())
    assert r.exit_code == 0 and ok < 8 and ok + fail == 40 and not r.timed_out
    assert uid == NOBODY or _processes_of(uid) == []  # the sleeping children died with their namespace's PID 1


@needs_ns
def test_memory_hog_hits_the_memory_limit(workdir):
    hog = "b = []\nwhile True:\n    b.append(bytearray(16 << 20))"
    r = run_tool(py(hog), workdir, allowed=PY, memory_mb=128, timeout_s=5.0)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and not r.timed_out and r.elapsed_s < 3.0


@needs_ns
def test_output_flood_is_capped(workdir):
    r = run_tool(py("print('x' * 10**7)"), workdir, allowed=PY, max_output_bytes=1000)
    assert r.truncated and r.stdout == "x" * 1000 and r.exit_code != 0  # the write past the cap failed (EFBIG)


# -- Landlock + seccomp, as the calling user and as nobody -------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# Each attempt prints "allowed" or "refused: <why>"; run unsandboxed first (positive control), then in the sandbox.
PROBE = r'''import ctypes, json, os, socket, sys, time
other, repo_file, tmp_target = sys.argv[1:4]
libc = ctypes.CDLL(None, use_errno=True)
def sc(rc, what):
    if rc == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
def ptrace_child():
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        sc(libc.ptrace(16, pid, 0, 0), "ptrace")  # PTRACE_ATTACH to our own child
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
def vm_read():
    dst, src = ctypes.create_string_buffer(8), ctypes.create_string_buffer(b"secret!")
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    sc(libc.process_vm_readv(os.getpid(), ctypes.byref(Iov(ctypes.addressof(dst), 8)), 1,
                             ctypes.byref(Iov(ctypes.addressof(src), 8)), 1, 0), "process_vm_readv")
def io_uring():
    fd = libc.syscall(425, 4, ctypes.create_string_buffer(120))
    sc(fd, "io_uring_setup")
    os.close(fd)
attempts = {
    "read /etc/passwd": lambda: open("/etc/passwd").read(),
    "read the repository": lambda: open(repo_file).read(),
    "list another episode": lambda: os.listdir(other),
    "read another episode": lambda: open(os.path.join(other, "secret.txt")).read(),
    "list /": lambda: os.listdir("/"),
    "write /tmp": lambda: open(tmp_target, "w").close(),
    "socket AF_INET": lambda: socket.socket(socket.AF_INET).close(),
    "socket AF_INET6": lambda: socket.socket(socket.AF_INET6).close(),
    "socket AF_NETLINK": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close(),
    "ptrace attach": ptrace_child,
    "process_vm_readv": vm_read,
    "unshare user ns": lambda: sc(libc.unshare(0x10000000), "unshare"),
    "keyctl": lambda: sc(libc.syscall(250, 0, -4, 1), "keyctl"),
    "io_uring_setup": io_uring,
}
res = {}
for name, fn in attempts.items():
    try:
        fn()
        res[name] = "allowed"
    except OSError as e:
        res[name] = f"refused: {e.strerror or e}"
print(json.dumps(res))
'''
# allowed without a sandbox to both root and nobody on any Linux with user namespaces; Landlock answers EACCES
LANDLOCKED = {"read /etc/passwd", "read the repository", "list another episode", "read another episode", "list /",
              "write /tmp"}
CONTROLLED = LANDLOCKED | {"socket AF_INET", "ptrace attach", "process_vm_readv"}
# Runs a batch of run_tool calls as the caller or, with "drop", after dropping to nobody (everything imported first,
# as root; the sandbox's probes and the seccomp filter are built after the drop), plus the unsandboxed control.
RUNNER = r'''import dataclasses, json, os, subprocess, sys
spec = json.load(sys.stdin)
sys.path.insert(0, spec["repo"])
from sandbox import runner as sandbox
if spec["drop"]:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
out = {"uid": os.getuid(), "mode": sandbox.isolation_support(), "results": {}}
for name, cmd, allowed, kw in spec["cases"]:
    out["results"][name] = dataclasses.asdict(sandbox.run_tool(cmd, spec["workdir"], allowed=set(allowed), **kw))
ctl = subprocess.run([sandbox.sandbox_python(), "-I", "-S", "-c", spec["probe"], *spec["control_args"]],
                     cwd=spec["workdir"], capture_output=True, text=True, timeout=30)
out["control"] = json.loads(ctl.stdout)
print(json.dumps(out))
'''


def _escape_cases(workdir: Path, other: Path, port: int, tmp_target: str):
    """(name, command, allowed, run_tool kwargs, check(result dict, isolation mode))."""
    loop = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    probe = shlex.join(["python", "-c", PROBE, str(other), str(Path(__file__).resolve()), tmp_target])
    ran = lambda r: r["blocked_reason"] is None and r["fs_isolated"] and r["syscall_filtered"]  # noqa: E731
    refused = lambda r: r["exit_code"] is None and r["stdout"] == "" and r["blocked_reason"]  # noqa: E731
    cases = [
        ("calc", "calc 6*7", DEFAULT, {}, lambda r, m: ran(r) and r["stdout"] == "42\n"),
        ("ls", "ls", DEFAULT, {}, lambda r, m: ran(r) and r["stdout"] == "notes.txt\npw\nsub\n"),
        ("cat", "cat sub/inner.txt", DEFAULT, {}, lambda r, m: ran(r) and r["stdout"] == "inner\n"),
        ("echo", "echo hi there", DEFAULT, {}, lambda r, m: ran(r) and r["stdout"] == "hi there\n"),
        ("python prints", py("import os; print(open('notes.txt').read().strip(), sorted(os.listdir('sub')));"
                             "open(os.devnull, 'w').write('x')"), PY, {},
         lambda r, m: ran(r) and r["stdout"] == "hello notes ['inner.txt']\n"),
        ("python env", py("import os; print(sorted(os.environ), os.getpid())"), PY, {},
         lambda r, m: ran(r) and r["stdout"].startswith("['HOME', 'LANG', 'LC_ALL', 'PATH', 'PYTHONDONTWRITEBYTECODE']")
         and (m == "none" or r["stdout"].endswith(" 1\n"))),
        ("cat /etc/passwd", "cat /etc/passwd", DEFAULT, {}, lambda r, m: refused(r)),
        ("ls ..", "ls ..", DEFAULT, {}, lambda r, m: refused(r)),
        ("symlink out", "cat pw", DEFAULT, {}, lambda r, m: refused(r)),
        ("loopback", py(loop), PY, {}, lambda r, m: ran(r) and r["exit_code"] == 1 and "connected" not in r["stdout"]
         and "Operation not permitted" in r["stderr"]),
        ("infinite loop", py("while True: pass"), PY, {"timeout_s": 1.0}, lambda r, m: r["timed_out"]),
        ("memory hog", py("b = []\nwhile True:\n    b.append(bytearray(16 << 20))"), PY,
         {"memory_mb": 128, "timeout_s": 5.0}, lambda r, m: r["exit_code"] == 1 and "MemoryError" in r["stderr"]),
        ("output flood", py("print('x' * 10**7)"), PY, {"max_output_bytes": 1000},
         lambda r, m: r["truncated"] and r["stdout"] == "x" * 1000),
        ("probe", probe, PY, {}, lambda r, m: ran(r) and r["exit_code"] == 0),
    ]
    if "grep" in PROGRAMS:
        cases.append(("grep", "grep hello notes.txt", DEFAULT | {"grep"}, {},
                      lambda r, m: ran(r) and r["stdout"] == "hello notes\n"))
    return cases


DEFAULT = frozenset({"calc", "ls", "cat", "echo"})


@pytest.mark.parametrize("user", ["caller", "nobody"])
def test_landlock_and_seccomp_hold_as_caller_and_as_nobody(workdir, user):
    """The escape batch in a child process, as the calling user or dropped to nobody first: tools work, every
    escape is refused, and the probe's attempts, allowed unsandboxed (control), are refused in the sandbox."""
    if user == "nobody" and os.geteuid() != 0:
        pytest.skip("dropping to nobody needs root (the caller already is unprivileged)")
    other = Path(tempfile.mkdtemp(prefix="alloy-sbx-other-"))  # another episode's folder, readable by nobody
    os.chmod(other, 0o755)
    (other / "secret.txt").write_text("the other episode's answer\n")
    os.chmod(other / "secret.txt", 0o644)
    (workdir / "pw").symlink_to("/etc/passwd")
    tmp_in, tmp_ctl = (f"{tempfile.gettempdir()}/alloy-sbx-escape-{os.getpid()}-{user}-{k}" for k in ("in", "ctl"))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    cases = _escape_cases(workdir, other, srv.getsockname()[1], tmp_in)
    spec = {"repo": str(REPO), "drop": user == "nobody", "workdir": str(workdir), "probe": PROBE,
            "cases": [[name, cmd, sorted(allowed), kw] for name, cmd, allowed, kw, _ in cases],
            "control_args": [str(other), str(Path(__file__).resolve()), tmp_ctl]}
    try:
        p = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(spec), capture_output=True, text=True,
                           timeout=120, cwd="/", env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing arrived from inside
    finally:
        srv.close()
        shutil.rmtree(other, ignore_errors=True)
    assert out["uid"] == (NOBODY if user == "nobody" else os.geteuid())
    for name, _, _, _, check in cases:
        assert check(out["results"][name], out["mode"]), (name, out["results"][name])
    inside = json.loads(out["results"]["probe"]["stdout"])
    control = out["control"]
    assert all(control[k] == "allowed" for k in CONTROLLED), control  # without the sandbox these all work
    assert set(inside) == set(control)
    for name, outcome in inside.items():  # Landlock: EACCES; seccomp: EPERM (the deny list answers EPERM)
        assert outcome == f"refused: {'Permission denied' if name in LANDLOCKED else 'Operation not permitted'}", \
            (name, outcome)
    assert os.path.exists(tmp_ctl) and not os.path.exists(tmp_in)
    os.unlink(tmp_ctl)


def test_missing_kernel_layers_fail_closed_unless_opted_out(workdir, monkeypatch):
    """Without Landlock (or libseccomp) run_tool refuses to run anything, with an error naming the opt-out; the
    opt-out runs the call with the remaining layers and says so in the result."""
    from sandbox import runner as sandbox

    monkeypatch.setattr(sandbox, "_kernel_confinement", lambda: ("Landlock is not available in this kernel", None))
    monkeypatch.delenv(sandbox.UNCONFINED_ENV, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match="ALLOY_SANDBOX_ALLOW_UNCONFINED=1"):
        run_tool("echo hi", workdir)
    monkeypatch.setenv(sandbox.UNCONFINED_ENV, "1")
    r = run_tool("echo hi", workdir)
    assert r.ok and r.stdout == "hi\n" and not r.fs_isolated and r.syscall_filtered


# -- the escape suite in every mode this machine can produce ---------------------------------------------------------

from sandbox import accounting  # noqa: E402
from sandbox.runner import available_modes  # noqa: E402

ESCAPES = r'''import json, os, socket, sys
sock_path, secret, outside = sys.argv[1:4]
def unix():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    s.connect(sock_path)
    s.sendall(b"hello from the sandbox")
res = {}
for name, fn in {"connect the 0666 unix socket": unix,
                 "read root's 0600 file": lambda: open(secret).read(),
                 "read /etc/shadow": lambda: open("/etc/shadow").read(),
                 "write outside the work dir": lambda: open(outside, "w").write("x"),
                 "write the work dir": lambda: open("escape.txt", "w").write("x")}.items():
    try:
        fn()
        res[name] = "allowed"
    except OSError as e:
        res[name] = f"refused: {e.strerror or e}"
print(json.dumps(res))
'''
DETACH = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n"
          "        os._exit(0)\n    os._exit(0)\nprint('detached')")
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
# 4 children of 80 MiB each, held at once: each reports its allocation and holds it until every live one has (or 2 s
# pass without a report: one was killed), so on a busy machine they do not run one after another under the limit
MEMORY = """import os, select
r, w = os.pipe()
hold_r, hold_w = os.pipe()
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(r); os.close(hold_w)
        b = b'x' * (80 << 20)
        os.write(w, b'1')
        os.read(hold_r, 1)
        os._exit(0)
    kids.append(pid)
os.close(w); os.close(hold_r)
got = 0
while got < 4 and select.select([r], [], [], 2.0)[0]:
    d = os.read(r, 4)
    if not d:
        break
    got += len(d)
os.close(hold_w)
print(sum(os.waitpid(p, 0)[1] == 0 for p in kids))
"""


_alive_with = alive_with  # tests/proc_scan.py


def _gone(token: str, within: float = 1.0) -> bool:
    deadline = time.monotonic() + within
    while _alive_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive_with(token)


@pytest.mark.parametrize("cgroups", ["cgroups", "no-cgroups"])
@pytest.mark.parametrize("mode", ["root", "userns", "none"])
def test_escape_suite_in_every_mode(workdir, mode, cgroups, monkeypatch):
    """Every mode gives the same contract: a fork bomb is contained and does not make a concurrent call fail, a
    detached (setsid, double-forked) child dies with the call, a 0666 unix socket on the host cannot be reached,
    root's 0600 file, /etc/shadow and paths outside the work dir are refused; with and without per-call cgroups."""
    if mode not in available_modes():
        pytest.skip(f"mode {mode!r} cannot be produced here (available: {available_modes()})")
    if cgroups == "cgroups" and not accounting.cgroup_layout():
        pytest.skip("no writable cgroup hierarchy here")
    if cgroups == "no-cgroups":
        monkeypatch.setattr(accounting, "cgroup_layout", lambda: {})
    tmp = Path(tempfile.mkdtemp(prefix="alloy-sbx-escape-"))
    os.chmod(tmp, 0o755)
    secret, outside, sock_path = tmp / "secret", tmp / "outside.txt", tmp / "host.sock"
    secret.write_text("root only\n")
    os.chmod(secret, 0o600)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(sock_path))
    os.chmod(sock_path, 0o666)
    srv.listen(4)
    srv.settimeout(0.1)
    token = f"alloy-escape-{os.getpid()}-{mode}-{cgroups}"
    try:
        exec_ok = subprocess.run([sys.executable, "-c", ESCAPES, str(sock_path), str(secret), str(tmp / "ctl.txt")],
                                 capture_output=True, text=True, cwd=tmp, timeout=30)
        control = json.loads(exec_ok.stdout)  # positive control, unsandboxed: the socket is reachable
        assert control["connect the 0666 unix socket"] == "allowed", control
        srv.accept()[0].close()

        r = run_tool(shlex.join(["python", "-c", ESCAPES, str(sock_path), str(secret), str(outside)]), workdir,
                     allowed=PY, isolation=mode)
        assert r.ok and r.isolation == mode and r.fs_isolated and r.syscall_filtered, r
        inside = json.loads(r.stdout)
        assert all(v.startswith("refused") for v in inside.values()), inside
        assert inside["write the work dir"] == "refused: Permission denied"  # read-only unless writable_workdir
        if os.geteuid() == 0:
            assert "uid" in r.limits  # a uid of its own, gid nobody
        assert not outside.exists() and not (workdir / "escape.txt").exists()
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing arrived from inside

        # the work dir is read-only unless asked for; then what the call made there is given back to its owner
        owner = os.lstat(workdir).st_uid
        make = "import os\nos.mkdir('made')\nopen('made/f.txt', 'w').write('x')\nprint('made')"
        r = run_tool(shlex.join(["python", "-c", make]), workdir, allowed=PY, isolation=mode, writable_workdir=True)
        assert r.ok and r.stdout == "made\n", r
        assert os.lstat(workdir).st_uid == owner and (workdir / "made" / "f.txt").read_text() == "x"
        assert {os.lstat(p).st_uid for p in (workdir / "made", workdir / "made" / "f.txt")} == {owner}

        # a detached child (setsid, double fork) dies with the call
        r = run_tool(shlex.join(["python", "-c", DETACH, token + "-detach"]), workdir, allowed=PY, isolation=mode)
        assert r.ok and r.stdout == "detached\n", r
        assert _gone(token + "-detach"), _alive_with(token + "-detach")

        # a fork bomb is contained, fully killed, and does not make a concurrent call fail
        other: list = []
        t = threading.Thread(target=lambda: (time.sleep(0.4), other.append(
            run_tool("echo still here", workdir, isolation=mode))))
        t.start()
        r = run_tool(shlex.join(["python", "-c", BOMB, token + "-bomb"]), workdir, allowed=PY, isolation=mode,
                     timeout_s=1.0, max_procs=16)
        t.join()
        assert r.timed_out and r.elapsed_s < 4.0 and r.sandbox_error is None, r
        assert _gone(token + "-bomb"), _alive_with(token + "-bomb")
        if os.geteuid() == 0:  # a uid per call: the bomb's RLIMIT_NPROC is not the other call's
            assert other[0].ok and other[0].stdout == "still here\n", other[0]
        else:  # a shared uid may starve it: then it says so, never a silent failure
            assert other[0].ok or other[0].sandbox_error, other[0]

        # memory: a per-call cgroup bounds the whole call; without one only each process is bounded (measured).
        # The caller is made large, as a trainer is (and pytest is late in the suite): the cgroup's OOM killer must
        # still pick the program's processes, never the supervisor forked from the caller (the CI failure before).
        ballast = b"\x01" * (512 << 20)
        r = run_tool(shlex.join(["python", "-c", MEMORY]), workdir, allowed=PY, isolation=mode, memory_mb=160,
                     timeout_s=5.0)
        del ballast
        if "cgroup-memory" in r.limits:
            assert r.exit_code == 0 and int(r.stdout) < 4, r  # 4 × 80 MiB > 160 MiB: the cgroup killed some
        else:
            assert r.exit_code == 0 and int(r.stdout) == 4, r  # each under RLIMIT_AS: 320 MiB for the call
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_unconfined_opt_out_warns_once_and_refuses_code(workdir, monkeypatch, caplog):
    """ALLOY_SANDBOX_ALLOW_UNCONFINED=1 logs one warning per process, and does not cover arbitrary code: `python`
    raises SandboxUnavailable unless ALLOY_SANDBOX_ALLOW_UNCONFINED_CODE=1 is set as well."""
    from sandbox import runner as sandbox

    sandbox._warn_unconfined.cache_clear()
    monkeypatch.setattr(sandbox, "_kernel_confinement", lambda: ("Landlock is not available in this kernel", None))
    monkeypatch.setenv(sandbox.UNCONFINED_ENV, "1")
    monkeypatch.delenv(sandbox.UNCONFINED_CODE_ENV, raising=False)
    with caplog.at_level("WARNING", logger="sandbox.runner"):
        assert run_tool("echo hi", workdir).stdout == "hi\n"
        assert run_tool("calc 1+1", workdir).stdout == "2\n"  # fixed code (the AST whitelist), not the model's
        with pytest.raises(sandbox.SandboxUnavailable, match="ALLOY_SANDBOX_ALLOW_UNCONFINED_CODE=1"):
            run_tool(py("print(1)"), workdir, allowed=PY)
        monkeypatch.setenv(sandbox.UNCONFINED_CODE_ENV, "1")
        r = run_tool(py("print(1)"), workdir, allowed=PY)
        assert r.ok and r.stdout == "1\n" and not r.fs_isolated
    warnings = [rec for rec in caplog.records if sandbox.UNCONFINED_ENV in rec.getMessage()]
    assert len(warnings) == 1 and "WITHOUT Landlock" in warnings[0].getMessage(), warnings
    sandbox._warn_unconfined.cache_clear()


NOBODY_SUITE = r'''import json, os, shlex, sys, threading, time
spec = json.load(sys.stdin)
sys.path.insert(0, spec["repo"])
from sandbox import runner  # imported as root (the venv may be root's), probed after the drop
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
out = {"modes": runner.available_modes()}
for m in out["modes"]:
    res = {}
    r = runner.run_tool(shlex.join(["python", "-c", spec["escapes"], *spec["escape_args"]]), spec["workdir"],
                        allowed={"python"}, isolation=m)
    res["escapes"] = r.stdout
    r = runner.run_tool(shlex.join(["python", "-c", spec["detach"], spec["token"] + m + "-detach"]), spec["workdir"],
                        allowed={"python"}, isolation=m)
    res["detach"] = [r.ok, r.stdout]
    other = []
    t = threading.Thread(target=lambda: (time.sleep(0.4), other.append(runner.run_tool("echo hi", spec["workdir"],
                                                                                      isolation=m))))
    t.start()
    r = runner.run_tool(shlex.join(["python", "-c", spec["bomb"], spec["token"] + m + "-bomb"]), spec["workdir"],
                        allowed={"python"}, isolation=m, timeout_s=1.0, max_procs=16)
    t.join()
    res["bomb"] = [r.timed_out, r.sandbox_error]
    res["other"] = [other[0].ok, other[0].sandbox_error]
    write = shlex.join(["python", "-c", "open('w.txt', 'w').write('x'); print('wrote')"])
    res["own dir"] = [runner.run_tool(write, spec["own"], allowed={"python"}, isolation=m, writable_workdir=w).stdout
                      for w in (False, True)]
    out[m] = res
print(json.dumps(out))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="the caller is already unprivileged: the suite above is this case")
def test_escape_suite_as_an_unprivileged_caller(workdir):
    """The same escapes from a caller that is not root (dropped to nobody first): modes "userns" (if unprivileged
    user namespaces exist) and "none", where no uid drop and no cgroup is possible."""
    tmp = Path(tempfile.mkdtemp(prefix="alloy-sbx-escape-"))
    os.chmod(tmp, 0o755)
    secret, sock_path = tmp / "secret", tmp / "host.sock"
    secret.write_text("root only\n")
    os.chmod(secret, 0o600)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(sock_path))
    os.chmod(sock_path, 0o666)
    srv.listen(4)
    srv.settimeout(0.1)
    token = f"alloy-escape-nobody-{os.getpid()}-"
    own = tmp / "own"  # a work dir that belongs to the (unprivileged) caller: Landlock alone keeps it read-only
    own.mkdir()
    os.chown(own, NOBODY, NOBODY)
    spec = {"repo": str(REPO), "workdir": str(workdir), "own": str(own), "escapes": ESCAPES, "detach": DETACH, "bomb": BOMB,
            "token": token, "escape_args": [str(sock_path), str(secret), str(tmp / "outside.txt")]}
    try:
        p = subprocess.run([sys.executable, "-c", NOBODY_SUITE], input=json.dumps(spec), capture_output=True,
                           text=True, timeout=120, cwd="/")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert "root" not in out["modes"] and "none" in out["modes"]
    for m in out["modes"]:
        res = out[m]
        assert all(v.startswith("refused") for v in json.loads(res["escapes"]).values()), (m, res)
        assert res["detach"] == [True, "detached\n"] and res["bomb"] == [True, None], (m, res)
        assert res["other"][0] or res["other"][1], (m, res)  # ran, or said why: never a silent failure
        assert _gone(token + m), (m, _alive_with(token + m))
        assert res["own dir"] == ["", "wrote\n"], (m, res)  # read-only unless writable_workdir
    assert not (tmp / "outside.txt").exists()
