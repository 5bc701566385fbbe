"""Tool execution sandbox: run one whitelisted command in a confined subprocess and capture its output.

Layers, outermost first (each one alone stops a different escape):

1. Parsing: `shlex.split`, never a shell (`shell=False` always), so `;`, `|`, `$(...)`, globs and redirects are
   plain characters. The program must be in `allowed` and in `PROGRAMS`.
2. Path confinement for file programs (`ls`, `cat`, `grep`): every argument that names a file must stay inside the
   work dir after resolving symlinks; `..` components are refused outright, absolute paths only if they resolve
   inside. Which arguments name files is decided by `sandbox.flags`: each program has an allow-list of flags,
   each known to take no value, a value or a path, so `--file=PATH`, `-fPATH`, `-f PATH` and a response file
   `@PATH` are checked like operands, and any other flag is refused.
3. Process confinement, in a `preexec_fn` of the forked child (before exec; `sandbox.supervisor`):
   - new network namespace (`unshare(CLONE_NEWNET)` via ctypes: Python 3.11 has no `os.unshare`): only a
     loopback interface that is down, so no connection anywhere, 127.0.0.1 included;
   - new PID namespace: the program runs as PID 1 of its own namespace under a tiny waiting parent, so when it
     ends or is killed, the kernel kills and reaps everything it forked (no orphans, no zombies left to a PID 1
     that does not reap). The waiting parent (the supervisor) is a child subreaper in every mode, so in mode
     "none" too every descendant, detached or daemonized, is reparented to it, and it kills and reaps them all
     before it exits (as root with `kill(-1)` from the call's own uid);
   - new IPC namespace: System V shared memory, queues and semaphores (and POSIX queues) the call makes are its
     own and die with it; new mount namespace for the program only, with every mount private and a fresh /proc
     that lists the call's own processes (`sandbox.supervisor._private_proc`; required in mode "root", where the
     kernel allows in mode "userns");
   - accounting per call (`sandbox.accounting`): as root a uid of its own (so RLIMIT_NPROC is per call and one
     call's fork bomb cannot starve another), and a cgroup of its own wherever a hierarchy is writable (pids.max,
     the whole call's memory, cgroup.kill);
   - rlimits: CPU seconds, address space (`memory_mb`), process count, open files, file size (caps the output
     files), no core dumps;
   - as root, in every mode: drop to the call's uid, gid nobody, no supplementary groups (no capabilities, so the
     namespaces cannot be undone, and RLIMIT_NPROC is enforced, which it is not for root); in modes "userns" and
     "none" before anything else, so the user namespace belongs to that uid; `PR_SET_NO_NEW_PRIVS` (setuid
     binaries gain nothing). As non-root the namespaces come from an unprivileged user namespace, when the kernel
     allows it;
   - parent-death signal, a fresh session (so a wall-clock timeout kills the whole process group);
   - a scrubbed environment: `PATH`, `HOME` = work dir, `LANG=C`; no proxies, tokens or keys are inherited;
   - Landlock (`sandbox.confine`, any uid, no privilege needed): the program can open, list and execute only beneath
     the system dirs (`SYSTEM_READ_PATHS`: /usr, /bin, /lib*, /etc/ld.so.cache; not the rest of /etc, not /root,
     /home, /tmp, /proc, the repository or a venv) and the interpreter's own files (`python_read_paths`: its
     executable, stdlib dir and libpython, found by asking the interpreter once), read+write without execute only
     beneath its own work dir (never another episode's), and /dev/null, /dev/zero, /dev/urandom. It also refuses
     TCP bind/connect and signals or abstract unix sockets beyond the sandbox. Metadata (`stat`) is not covered,
     and `ls -l` shows numeric owners (no /etc/passwd);
   - seccomp (last, just before exec): EPERM for `socket()` of every family (AF_UNIX included), and for
     everything that addresses another socket from the AF_UNIX pair a call may make (connect, bind, sendmsg,
     `sendto` with an address), so no unix socket with a path is reachable (a network namespace and Landlock do
     not cover those); System V and POSIX IPC, inotify/fanotify, ptrace,
     process_vm_readv/writev, mount, unshare/setns/namespace clones, keyctl, bpf, perf_event_open, kexec, module
     loading, reboot, swapon, io_uring and a few more (`sandbox.confine.DENIED_SYSCALLS`); other ABIs (i386, x32)
     are killed.
   Both are prepared in the parent (the ruleset fd per call, the BPF program once) and only applied in the child.
   Without Landlock (kernel < 5.13 or disabled) or libseccomp, `run_tool` raises `SandboxUnavailable` (fail
   closed) unless the environment sets `ALLOY_SANDBOX_ALLOW_UNCONFINED=1`, which runs without the missing layer
   and logs a warning once per process, but still refuses arbitrary code (`python`) unless
   `ALLOY_SANDBOX_ALLOW_UNCONFINED_CODE=1` is set too; results carry `fs_isolated`, `syscall_filtered`,
   `isolation` (the mode) and `limits` (the per-call limits that held).
4. Output: stdout/stderr go to temp files capped by RLIMIT_FSIZE (a flood is killed by SIGXFSZ) and are read
   back up to `max_output_bytes`.

When the namespaces cannot be created (no root, no user namespaces), `isolation_support()` says so and every result
carries `net_isolated=False`; the seccomp filter still closes the network (no AF_INET/AF_INET6/netlink socket can
be created), and Landlock, the uid drop (as root), the limits and the supervisor still hold (a wall-clock timeout
kills the program, and every descendant, detached or not, is killed and reaped before the call returns). Only if the
seccomp filter is missing too (opted out) is the fallback rule-level blocking: programs that could open sockets
(`network_capable`, e.g. `python`) are refused, as are arguments that look like URLs or host:port addresses.

`calc` evaluates arithmetic with an AST whitelist (`sandbox.calc.safe_calc`) in a sandboxed interpreter, so even a
pathological expression is bounded by the same limits. `python` (arbitrary code) is in `PROGRAMS` for coding
domains and for the escape tests, never in `DEFAULT_ALLOWED`; its arguments are not path-checked (layer 2), so
layers 3-4 hold it: Landlock keeps it to its work dir (/etc/passwd, the repository and other episodes' folders are
refused), seccomp and the namespaces keep it off the network, the limits bound its forks, memory and time.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sandbox import confine, flags
from sandbox.accounting import CallCgroup, CallUid, cgroup_layout
from sandbox.calc import _CALC_MAIN
from sandbox.flags import FlagSpec
from sandbox.supervisor import _preexec, _wait_polling

log = logging.getLogger(__name__)

MODES = ("root", "userns", "none")
DEFAULT_ALLOWED = frozenset({"calc", "ls", "cat", "echo"})
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_URL_RE = re.compile(r"[a-z][a-z0-9+.-]*://|(?:^|[@/])[\w.-]+:\d{1,5}(?:/|$)", re.I)
UNCONFINED_ENV = "ALLOY_SANDBOX_ALLOW_UNCONFINED"  # "1": run without Landlock/seccomp where they are missing
UNCONFINED_CODE_ENV = "ALLOY_SANDBOX_ALLOW_UNCONFINED_CODE"  # "1" as well: ... even arbitrary code (`python`)
SYSTEM_READ_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")


class SandboxUnavailable(RuntimeError):
    """Landlock or seccomp is missing and the environment did not opt out (`UNCONFINED_ENV`): fail closed."""


@dataclass
class ToolResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the command was not run; −N when killed by signal N
    timed_out: bool = False
    blocked_reason: str | None = None  # why the command was refused before running
    net_isolated: bool = False  # ran inside a fresh network namespace
    truncated: bool = False  # output hit the cap
    elapsed_s: float = 0.0
    fs_isolated: bool = False  # ran under the Landlock ruleset (sees only its work dir and the system dirs)
    syscall_filtered: bool = False  # ran under the seccomp filter
    sandbox_error: str | None = None  # the sandbox failed to start or end the call (not the command's fault)
    isolation: str = ""  # the mode it ran in: "root" | "userns" | "none" ("" when not run)
    limits: tuple[str, ...] = ()  # per-call limits that held beyond the rlimits: "uid", "cgroup-pids", ...

    @property
    def ok(self) -> bool:
        return (self.exit_code == 0 and not self.timed_out and self.blocked_reason is None
                and self.sandbox_error is None)


@dataclass(frozen=True)
class Program:
    argv0: tuple[str, ...]  # the command line prefix; the user's arguments are appended
    flags: FlagSpec | None = None  # a file program: its allowed flags; its file arguments are confined to the work dir
    network_capable: bool = False  # could open sockets: refused when there is no network namespace
    needs_python: bool = False
    runs_code: bool = False  # runs arbitrary code: refused without Landlock+seccomp unless UNCONFINED_CODE_ENV


def _world_executable(path: str) -> bool:
    """Whether an unprivileged user (nobody) can execute `path`: o+x on the file and on every parent directory."""
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


@lru_cache(maxsize=1)
def sandbox_python() -> str | None:
    """An interpreter the sandbox user may execute (as root, /root/... interpreters are out of reach of nobody)."""
    cands = [getattr(sys, "_base_executable", ""), sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    for c in cands:
        if c and os.path.exists(c) and (os.geteuid() != 0 or _world_executable(c)):
            return c
    return None


_PY_PROBE = ("import os, sys, sysconfig\n"
             "print(os.path.realpath(sys.executable))\n"
             "for p in sys.path: print(p)\n"
             "so = sysconfig.get_config_var('INSTSONAME') if sysconfig.get_config_var('Py_ENABLE_SHARED') else None\n"
             "if so: print(os.path.join(sysconfig.get_config_var('LIBDIR'), so))\n")


@lru_cache(maxsize=4)
def python_read_paths(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The files the sandbox interpreter strictly needs beyond `SYSTEM_READ_PATHS`: its executable, its stdlib and
    lib-dynload (`sys.path` under `-I -S`) and its libpython when shared. Asked of the interpreter itself, once;
    paths already beneath a system dir are dropped (for /usr/bin/python3: all). A stdlib dir is granted entry by
    entry without its site-packages / dist-packages (a venv's or pyenv's installed packages stay unreadable), plus
    the right to list it. Returns (read+execute paths, list-only dirs)."""
    out = subprocess.run([python, "-I", "-S", "-c", _PY_PROBE], capture_output=True, text=True, timeout=30,
                         env={"PATH": _SAFE_PATH, "LANG": "C"}, cwd="/", check=True).stdout
    roots = [os.path.realpath(p) for p in SYSTEM_READ_PATHS if os.path.exists(p)]
    paths: list[str] = []
    list_only: list[str] = []
    for line in out.splitlines():
        p = os.path.realpath(line) if line else ""
        if not p or not os.path.exists(p) or any(p == r or p.startswith(r + "/") for r in roots):
            continue
        if os.path.isdir(p) and os.path.isfile(os.path.join(p, "os.py")):  # the stdlib dir: list it, read its entries
            list_only.append(p)
            paths += [os.path.join(p, e) for e in sorted(os.listdir(p)) if e not in ("site-packages", "dist-packages")]
        elif not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    return tuple(dict.fromkeys(paths)), tuple(list_only)


@lru_cache(maxsize=1)
def _kernel_confinement() -> tuple[str | None, str | None]:
    """Why Landlock, and why seccomp, cannot be used here (None: usable). Probed once per process."""
    landlock = None if confine.landlock_abi() >= 1 else "Landlock is not available in this kernel (needs ≥ 5.13)"
    try:
        confine.seccomp_program()
        seccomp = None
    except OSError as e:
        seccomp = f"no seccomp filter: {e}"
    return landlock, seccomp


def confinement_support() -> tuple[bool, bool]:
    """(Landlock used, seccomp used) for the next `run_tool`. Raises `SandboxUnavailable` when one is missing and
    `ALLOY_SANDBOX_ALLOW_UNCONFINED=1` is not set."""
    landlock, seccomp = _kernel_confinement()
    missing = [why for why in (landlock, seccomp) if why]
    if missing and os.environ.get(UNCONFINED_ENV) != "1":
        raise SandboxUnavailable("sandbox: " + "; ".join(missing) + f". Refusing to run tool calls without it; set "
                                 f"{UNCONFINED_ENV}=1 to run them with the remaining layers only")
    if missing:
        _warn_unconfined("; ".join(missing))
    return landlock is None, seccomp is None


@lru_cache(maxsize=1)
def _warn_unconfined(why: str) -> None:
    """Logged once per process: the opt-out is in effect."""
    log.warning("sandbox: %s=1: tool calls run WITHOUT %s (%s); arbitrary code (`python`, the code verifier) is still "
                "refused unless %s=1 too", UNCONFINED_ENV,
                " and ".join(n for n, w in zip(("Landlock", "seccomp"), _kernel_confinement()) if w), why,
                UNCONFINED_CODE_ENV)


def _which(name: str) -> str:
    return shutil.which(name, path=_SAFE_PATH) or f"/bin/{name}"


PROGRAMS: dict[str, Program] = {
    "calc": Program(("{python}", "-I", "-S", "-c", _CALC_MAIN), needs_python=True),
    "ls": Program((_which("ls"),), flags=flags.LS),
    "cat": Program((_which("cat"),), flags=flags.CAT),
    "grep": Program((_which("grep"),), flags=flags.GREP),  # the pattern is an operand: path-checked too
    "echo": Program((_which("echo"),)),
    "python": Program(("{python}", "-I", "-S"), network_capable=True, needs_python=True, runs_code=True),
    "true": Program((_which("true"),)),
}


# -- isolation modes --------------------------------------------------------------------------------------------

def _probe(mode: str) -> bool:
    uid = CallUid()
    try:
        p = subprocess.Popen([_which("true")], cwd="/", env={"PATH": _SAFE_PATH}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=_preexec(mode, 2.0, 64, 16, 1024, uid=uid.uid))
        return p.wait(timeout=10) == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        uid.release()


@lru_cache(maxsize=1)
def available_modes() -> tuple[str, ...]:
    """The isolation modes this machine can produce, strongest first: "root" (netns + pidns made as root, then the
    drop to the call's uid), "userns" (an unprivileged user namespace + netns + pidns, owned by the call's uid when
    we are root), "none" (no namespace; always available). Probed once per process by running `true` in each."""
    modes = ["root", "userns"] if os.geteuid() == 0 else ["userns"]
    return tuple(m for m in modes if _probe(m)) + ("none",)


def isolation_support() -> str:
    """The strongest mode `available_modes()` found: what `run_tool` uses unless told otherwise."""
    return available_modes()[0]


# -- argument checks --------------------------------------------------------------------------------------------

def _confine(arg: str, workdir: Path) -> str | None:
    """Why a path argument escapes the work dir, or None when it is inside (after resolving symlinks)."""
    if "\x00" in arg:
        return f"NUL byte in argument {arg!r}"
    if ".." in Path(arg).parts:
        return f"'..' in path {arg!r}"
    root = workdir.resolve()
    target = (root / arg).resolve()  # an absolute arg replaces root here; symlinks are followed
    if target != root and root not in target.parents:
        return f"path {arg!r} resolves outside the work dir"
    return None


def check_command(command: str, workdir: Path, allowed: set[str] | frozenset[str], net_isolated: bool) -> tuple[
        list[str], Program | None, str | None]:
    """Parse and vet a command. Returns (argv tokens, program, blocked_reason)."""
    try:
        tokens = shlex.split(command)
    except ValueError as e:
        return [], None, f"cannot parse command: {e}"
    if not tokens:
        return [], None, "empty command"
    name, args = tokens[0], tokens[1:]
    if name not in allowed or name not in PROGRAMS:
        usable = ", ".join(sorted(set(allowed) & PROGRAMS.keys()))
        return tokens, None, f"program {name!r} is not allowed (allowed: {usable})"
    prog = PROGRAMS[name]
    if not net_isolated:
        if prog.network_capable:
            return tokens, None, (f"program {name!r} can open sockets and no network namespace (nor seccomp "
                                  "filter) is available")
        if any(_URL_RE.search(a) for a in args):
            return tokens, None, ("network address in arguments and no network namespace (nor seccomp filter) is "
                                  "available")
    if prog.flags is not None:
        try:
            named = flags.file_operands(prog.flags, args)
        except flags.FlagRefused as e:
            return tokens, None, f"{name}: {e}"
        for a in named:
            why = _confine(a, workdir)
            if why:
                return tokens, None, why
    if prog.needs_python and sandbox_python() is None:
        return tokens, None, "no Python interpreter the sandbox user can execute"
    return tokens, prog, None


def _scrubbed_env(workdir: Path) -> dict[str, str]:
    """A fresh environment: nothing inherited (no proxies, no credentials)."""
    return {"PATH": _SAFE_PATH, "HOME": str(workdir), "LANG": "C", "LC_ALL": "C", "PYTHONDONTWRITEBYTECODE": "1"}


def _read_capped(f, cap: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _kill_group(pgid: int) -> None:
    for _ in range(3):  # a second pass catches children forked while the first signal was in flight
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return


def _lend_workdir(workdir: Path, uid: int) -> tuple[int, int]:
    """As root: make the work dir (the dir itself, not its files) the call's, so it can create files there.
    Returns the owner to give everything back to."""
    st = os.lstat(workdir)
    os.chown(workdir, uid, -1)
    return st.st_uid, st.st_gid


def _return_workdir(workdir: Path, uid: int, owner: tuple[int, int]) -> None:
    """After the call (all its processes dead): everything beneath the work dir owned by the call's uid goes back
    to `owner` (symlinks not followed), so a later call given the same uid finds nothing of its own."""
    os.chown(workdir, *owner)
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            p = os.path.join(root, name)
            try:
                if os.lstat(p).st_uid == uid:
                    os.lchown(p, *owner)
            except OSError:
                pass


def run_tool(command: str, workdir: Path | str, timeout_s: float = 2.0, memory_mb: int = 256,
             allowed: set[str] | frozenset[str] = DEFAULT_ALLOWED, max_output_bytes: int = 4096,
             max_procs: int = 32, *, isolation: str | None = None, writable_workdir: bool = False) -> ToolResult:
    """Run `command` ("cat notes.txt", "calc 12+34") in the sandbox with cwd = `workdir` (see the module docstring).

    Never raises for a bad or hostile command: refusals come back as `blocked_reason`, limits as `timed_out`,
    a negative `exit_code` (killed by a signal) or `truncated`, and a sandbox that could not start the call (or
    not end all of it) as `sandbox_error` (never a silent failure: `ok` is False and the reason is set). As root
    the call runs as a uid of its own (`sandbox.accounting.CallUid`, gid nobody), so the work dir must be readable
    by others (mode 0o755, as `domains.tools.ToolEnv` creates it). The work dir is read-only to the call (Landlock,
    whoever the caller is) unless `writable_workdir`: then Landlock grants writes beneath it and, as root, the
    work dir is lent to the call's uid and everything the call created there is given back to the work dir's
    owner afterwards (`_lend_workdir`). `max_procs` is
    RLIMIT_NPROC of that uid (per call as root; per caller uid otherwise) and, where cgroups are writable, the
    call's `pids.max`; `memory_mb` is RLIMIT_AS per process and, with a memory cgroup, the whole call's limit.
    `isolation` forces a weaker mode than `isolation_support()` (one of `available_modes()`; for tests).
    Raises `SandboxUnavailable` (an environment problem, not a command's) when Landlock or seccomp is missing
    and not opted out of, or when the command runs arbitrary code and that was not opted out of as well.
    """
    t0 = time.monotonic()
    workdir = Path(workdir)
    use_landlock, use_seccomp = confinement_support()
    mode = isolation_support() if isolation is None else isolation
    if mode not in available_modes():
        raise ValueError(f"sandbox: isolation {mode!r} is not available here (available: {available_modes()})")
    net_isolated = mode != "none"
    if not workdir.is_dir():
        return ToolResult("", "", None, blocked_reason=f"work dir {workdir} does not exist", net_isolated=net_isolated)
    tokens, prog, why = check_command(command, workdir, allowed, net_isolated or use_seccomp)  # network closed
    if why:
        return ToolResult("", "", None, blocked_reason=why, net_isolated=net_isolated,
                          elapsed_s=time.monotonic() - t0)
    assert prog is not None
    if prog.runs_code and not (use_landlock and use_seccomp) and os.environ.get(UNCONFINED_CODE_ENV) != "1":
        raise SandboxUnavailable(f"sandbox: {tokens[0]!r} runs arbitrary code and the sandbox lacks "
                                 f"{'Landlock' if not use_landlock else 'seccomp'}; {UNCONFINED_ENV}=1 does not cover "
                                 f"code: set {UNCONFINED_CODE_ENV}=1 as well to run it anyway")
    argv = [sandbox_python() if a == "{python}" else a for a in prog.argv0] + tokens[1:]
    timed_out = False
    ruleset_fd = None
    sandbox_error = None
    common = dict(net_isolated=net_isolated, fs_isolated=use_landlock, syscall_filtered=use_seccomp, isolation=mode)
    try:
        uid = CallUid()
    except OSError as e:
        return ToolResult("", "", None, sandbox_error=f"sandbox: {e}", elapsed_s=time.monotonic() - t0, **common)
    lent = None
    cgroup = CallCgroup(memory_mb, max_procs)
    cg_fds = cgroup.procs_fds()
    limits = (("uid",) if uid.uid is not None else ()) + tuple(f"cgroup-{k}" for k in sorted(cgroup.limited)) + (
        ("cgroup-kill",) if "v2" in cgroup.dirs else ())
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                if use_landlock:
                    py_reads, py_lists = python_read_paths(argv[0]) if prog.needs_python else ((), ())
                    wd = [str(workdir.resolve())]
                    ruleset_fd = confine.landlock_ruleset(SYSTEM_READ_PATHS + py_reads, wd if writable_workdir else [],
                                                          py_lists, [] if writable_workdir else wd)
                if writable_workdir and uid.uid is not None:
                    lent = _lend_workdir(workdir, uid.uid)
                proc = subprocess.Popen(argv, cwd=str(workdir), env=_scrubbed_env(workdir), stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, close_fds=True, start_new_session=True,
                                        preexec_fn=_preexec(mode, timeout_s, memory_mb, max_procs, max_output_bytes,
                                                            ruleset_fd,
                                                            confine.seccomp_program() if use_seccomp else None,
                                                            uid.uid, cg_fds))
            except (OSError, subprocess.SubprocessError) as e:  # e.g. the process limit was hit at fork or exec
                return ToolResult("", "", None, sandbox_error=f"sandbox: could not start {tokens[0]!r}: {e}",
                                  elapsed_s=time.monotonic() - t0, limits=limits, **common)
            finally:
                if ruleset_fd is not None:
                    os.close(ruleset_fd)
                for fd in cg_fds:
                    os.close(fd)
            # The supervisor enforces timeout_s and kills every descendant before it exits; the deadline here is
            # the backstop. The group is signalled before the leader is reaped, so its id is still ours.
            _, exited = _wait_polling(proc.pid, t0 + timeout_s + 1.0, reap=False)
            if not exited:
                timed_out = True
                _kill_group(proc.pid)
            _kill_group(proc.pid)  # anything the program left running in its session
            code = proc.wait()
            # whatever escaped the supervisor (it can be killed by its own call in mode "none" where Landlock has no
            # signal scope): the call's cgroup, then every process of the call's uid
            if not cgroup.kill() or not uid.kill_all():
                sandbox_error = "sandbox: processes of the call survived it"
            stdout, trunc_out = _read_capped(out, max_output_bytes)
            stderr, trunc_err = _read_capped(err, max_output_bytes)
    finally:
        if lent is not None:
            _return_workdir(workdir, uid.uid, lent)
        cgroup.close()
        uid.release()
    # RLIMIT_CPU ends a CPU-bound program with SIGXCPU (soft) or SIGKILL (hard) before the wall clock does
    timed_out = timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL)
    truncated = trunc_out or trunc_err or code == -signal.SIGXFSZ
    return ToolResult(stdout, stderr, code, timed_out=timed_out, truncated=truncated, elapsed_s=time.monotonic() - t0,
                      sandbox_error=sandbox_error, limits=limits, **common)
