"""The child side of a sandbox call (`sandbox.runner.run_tool`): `_preexec` builds the function the forked child
runs before exec: the uid drop, the namespaces, the supervisor (`_supervise`: a child subreaper that enforces the
wall-clock timeout, kills and reaps every descendant, `_reap_descendants`, and exits with the program's status), and
in the program itself the call's cgroups, the OOM score (`_oom_first`), the rlimits (`_set_limits`), no_new_privs
and the kernel layers of `sandbox.confine`. `_wait_polling` waits for a child with a deadline (the supervisor and
`run_tool` both use it). The layers and the modes are described in `sandbox.runner`'s module docstring.
"""
from __future__ import annotations

import ctypes
import math
import os
import resource
import select
import signal
import time

from sandbox import confine
from sandbox.accounting import UID_BASE, CallCgroup

CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWIPC, CLONE_NEWNS = (0x40000000, 0x20000000, 0x10000000,
                                                                        0x08000000, 0x00020000)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 4, 38, 36
NOBODY = 65534  # the gid of every sandbox uid (the uid itself is per call: `sandbox.accounting.CallUid`)
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here, never in the forked child


def _set_limits(timeout_s: float, memory_mb: int, max_procs: int, max_output_bytes: int) -> None:
    cpu = max(1, math.ceil(timeout_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_output_bytes + 1, max_output_bytes + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _wait_polling(pid: int, deadline: float | None, reap: bool) -> tuple[int | None, bool]:
    """Wait for `pid` to exit until `deadline` (time.monotonic()): woken by a pidfd the moment it exits (Linux ≥
    5.3), else polling (1 ms growing to 20 ms, which rounds every call up to the next step).

    Returns (exit code, or −N when killed by signal N, or None if unknown; exited). With reap=False the exited
    child stays a zombie (WNOWAIT), so its pid, and the process group id it leads, cannot be recycled while we
    still signal that group.
    """
    delay = 0.001
    flags = os.WEXITED | os.WNOHANG | (0 if reap else os.WNOWAIT)
    try:
        pidfd = os.pidfd_open(pid)
        poller = select.poll()  # not select.select: a busy process may hold descriptors past FD_SETSIZE
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):  # already reaped (waitid says so below), or no pidfd support
        pidfd = None
    try:
        while True:
            try:
                info = os.waitid(os.P_PID, pid, flags)
            except ChildProcessError:
                return None, True
            except InterruptedError:
                continue
            if info is not None:
                if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    return -info.si_status, True
                return info.si_status, True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None, False
            if pidfd is not None:  # readable once the process has exited; the cap only bounds each wait
                poller.poll(1000 * (min(0.05, deadline - now) if deadline is not None else 0.05))
            else:
                time.sleep(delay)
                delay = min(0.02, delay * 2)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    st = f.read()
                if int(st[st.rindex(")") + 2:].split()[1]) == pid:
                    out.append(int(p))
            except (OSError, ValueError):
                pass
    return out


def _reap_descendants(kill_uid: int | None) -> None:
    """In the supervisor (a child subreaper: every orphan of the call is reparented to it): kill and reap every
    descendant left, until there is none. With `kill_uid` (mode "none" as root: the supervisor runs as the call's own
    uid) `kill(-1)` first kills every process of that uid at once, which no fork can race."""
    me = os.getpid()
    while True:
        if kill_uid is not None and kill_uid >= UID_BASE and os.getuid() == kill_uid:  # never as root or the caller
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        for child in _children(me):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _supervise(pid: int, timeout_s: float, kill_uid: int | None) -> None:
    """The supervisor's whole life (see `_preexec`); always ends in `os._exit`, never back in `Popen`'s exec path."""
    status = 1
    try:
        os.closerange(3, 65536)
        status, exited = _wait_polling(pid, time.monotonic() + timeout_s, reap=True)
        if not exited:
            os.kill(pid, signal.SIGKILL)
            status, _ = _wait_polling(pid, None, reap=True)
        _reap_descendants(kill_uid)
        if status is not None and status < 0:  # mirror a death by signal
            if -status not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
    finally:
        os._exit(status if status is not None and status >= 0 else 1)


def _oom_first() -> None:
    """In the program (before exec): make it and all it forks the OOM killer's first choice (oom_score_adj 1000;
    raising is always allowed). Without it the supervisor, a fork of the caller (a trainer with hundreds of MB
    mapped), has the largest RSS in the call's memory cgroup and is the one killed: the call then ends as a SIGKILL
    instead of the program failing its allocation. After a uid drop the process is not dumpable, which makes its
    /proc files root's; it is made dumpable for the write (execve resets the flag for the program anyway)."""
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
    except OSError:
        pass


def _private_proc(required: bool) -> None:
    """In the program, PID 1 of the call's PID namespace, before the uid drop: a mount namespace of its own (the
    supervisor stays in the caller's, so its /proc walk still sees the caller's pids) with every mount made private
    (nothing propagates back to the host) and a fresh /proc over the host's, which lists the call's PID namespace
    only: not even `stat` of /proc/<host pid> answers. Both namespaces die with the call's last process. Raises
    OSError when `required` (mode "root") and the kernel refuses; otherwise (a user namespace, where the kernel
    refuses proc over a partly hidden /proc) the call keeps the host's /proc, which Landlock still keeps it from
    listing or reading."""
    flags = ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if (_libc.unshare(CLONE_NEWNS) == 0
            and _libc.mount(b"none", b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None) == 0
            and _libc.mount(b"proc", b"/proc", b"proc", flags, None) == 0):
        return
    if required:
        raise OSError(ctypes.get_errno(), "sandbox: mounting a private /proc failed")


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(uid)


def _preexec(mode: str, timeout_s: float, memory_mb: int, max_procs: int, max_output_bytes: int,
             ruleset_fd: int | None = None, program: confine.SeccompProgram | None = None,
             uid: int | None = None, cgroup_fds: list[int] | None = None):
    """The function the forked child runs before exec. mode: "root" | "userns" | "none". `uid`: the call's sandbox
    uid (as root; None otherwise). Landlock (`ruleset_fd`) and seccomp (`program`) are applied last, after the uid
    drop and no_new_privs, when given.

    In order: as root in modes "userns" and "none", drop to `uid` now (the
    user namespace is then owned by the sandbox uid, and the supervisor runs as it); unshare the namespaces (not in
    "none": network, PID and IPC, so System V objects die with the call; the grandchild adds a mount namespace
    with a /proc of its own, `_private_proc`); become a child subreaper and fork once more: the grandchild (PID 1 of the new PID namespace, if any)
    continues to exec; the child stays as a tiny supervisor: it closes every inherited descriptor (so `Popen`
    learns exec success from the grandchild alone), kills the grandchild at the wall-clock timeout (which, with a
    PID namespace, makes the kernel kill and reap the whole namespace), then kills and reaps every descendant still
    alive (`_reap_descendants`: in mode "none", detached and daemonized ones are reparented to it), and exits with
    the grandchild's status, re-raising its signal. The grandchild joins the call's cgroups (`cgroup_fds`, opened
    by the caller) and raises its OOM score before it drops to `uid` (mode "root") and execs: the supervisor, a
    fork of a possibly large caller, stays outside the call's memory cgroup, so the cgroup's OOM killer can only
    pick the program's processes (measured: with the supervisor inside, a 1.5 GB caller's supervisor was the one
    killed and the call ended as a SIGKILL).
    """
    def run() -> None:
        if uid is not None and mode != "root":
            _drop(uid)
        if mode != "none":
            flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if mode == "userns" else 0)
            if _libc.unshare(flags) != 0:
                raise OSError(ctypes.get_errno(), "sandbox: unshare failed")
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        pid = os.fork()
        if pid > 0:
            _supervise(pid, timeout_s, uid if mode == "none" else None)  # never returns
        if mode != "none":
            _private_proc(required=mode == "root")
        CallCgroup.join(cgroup_fds or [])  # the program only: the supervisor is no candidate of the call's OOM
        _oom_first()
        _set_limits(timeout_s, memory_mb, max_procs, max_output_bytes)
        if uid is not None and mode == "root":
            _drop(uid)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        confine.apply(ruleset_fd, program)
    return run
