"""Per-call accounting for sandboxed tool calls: a sandbox uid of its own per call (as root), and a cgroup per call
where cgroups are writable. Both exist so that concurrent sandboxes cannot starve or outlive each other.

- `CallUid` (root only): a uid from `UID_BASE` .. `UID_BASE + UID_RANGE` held by this call alone (an exclusive
  `flock` on a file named after it in a root-only directory, so concurrent processes never share one). RLIMIT_NPROC
  counts the processes of a uid, so with one uid per call `max_procs` is per call: one call's fork bomb cannot make
  another call's fork or start fail. It also makes "kill every process of this uid" (`kill(-1)` by a process of that
  uid) mean "kill everything this call started", which is how mode "none" ends a call. No passwd entry is needed.
- `CallCgroup`: a child cgroup per call in every hierarchy we may write: cgroup v2 (core files only: `cgroup.kill`
  kills the whole call at once; `memory.max` / `pids.max` when those controllers are enabled for our subtree) and
  cgroup v1 `pids` / `memory` hierarchies (`pids.max`, `memory.limit_in_bytes`). The program joins them before exec
  (`join()` writes "0" to each `cgroup.procs` fd opened by the parent), so everything it forks is counted and
  killed with it; its supervisor stays outside (it is a fork of the caller, whose RSS would make it the OOM
  killer's choice). Where no hierarchy is writable (non-root, a read-only /sys/fs/cgroup) it is a no-op and the
  rlimits are the only bound (`limits()` says which hold).
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import signal
import time
from functools import lru_cache

UID_BASE, UID_RANGE = 2_000_000_000, 1 << 20  # far above any real or subordinate (/etc/subuid) uid in common use
_LOCK_DIR = "/run/alloy-sandbox-uids"


class CallUid:
    """A sandbox uid owned by one call until `release()`. `uid` is None when not root (no drop possible)."""

    def __init__(self) -> None:
        self.uid: int | None = None
        self._fd: int | None = None
        if os.geteuid() != 0:
            return
        lock_dir = _lock_dir()
        start = random.randrange(UID_RANGE)
        for i in range(256):
            uid = UID_BASE + (start + i) % UID_RANGE
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.stat(os.path.join(lock_dir, str(uid)))  # still the file at that name? (release unlinks it)
                if (st.st_dev, st.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                    raise OSError(errno.EAGAIN, "lock file replaced")
            except OSError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise OSError(errno.EAGAIN, "sandbox: no free per-call uid")

    def alive(self) -> list[int]:
        """Pids of processes still running as this uid (a stat per /proc entry)."""
        out = []
        if self.uid is None:
            return out
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if os.stat(f"/proc/{p}").st_uid == self.uid:
                        out.append(int(p))
                except OSError:
                    pass
        return out

    def kill_all(self) -> bool:
        """SIGKILL every process of this uid: a forked helper drops to it and calls `kill(-1)` (which no fork can
        race). Only when `alive()` finds one, so a clean call costs one /proc scan. True when none is left."""
        if self.uid is None or self.uid < UID_BASE or not self.alive():
            return True
        pid = os.fork()
        if pid == 0:  # only system calls here: the parent may have threads
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(self.uid)
                for _ in range(3):
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except OSError:
                        break
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        deadline = time.monotonic() + 1.0
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.01)  # killed, not yet reaped by whoever their parent is now
        return not left

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(os.path.join(_lock_dir(), str(self.uid)))
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


@lru_cache(maxsize=1)
def _lock_dir() -> str:
    d = _LOCK_DIR if os.path.isdir("/run") and os.access("/run", os.W_OK) else "/tmp/alloy-sandbox-uids"
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid != 0 or st.st_mode & 0o077:
        raise OSError(errno.EPERM, f"sandbox: {d} must be a root-owned 0700 directory")
    return d


# -- cgroups ---------------------------------------------------------------------------------------------------------

def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """{"" (v2) or controller name (v1): our path in that hierarchy}."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                out[c] = path
    return out


def _writable_dir(path: str) -> bool:
    probe = os.path.join(path, f"alloy-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


@lru_cache(maxsize=1)
def cgroup_layout() -> dict[str, str]:
    """Where per-call cgroups can be created: {"v2": dir, "pids": dir, "memory": dir} for each writable one (v2 also
    "v2_pids"/"v2_memory" when those controllers are enabled for our subtree). Probed once per process."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        return {}
    layout: dict[str, str] = {}
    for mnt, fstype, opts in mounts:
        if "ro" in opts:
            continue
        if fstype == "cgroup2" and "" in own and "v2" not in layout:
            base = os.path.normpath(mnt + own[""])
            if os.path.exists(os.path.join(base, "cgroup.procs")) and _writable_dir(base):  # the root has no .kill
                layout["v2"] = base
                try:  # allowed only when our cgroup has no processes of its own, or is the root
                    with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                        f.write("+pids +memory")
                except OSError:
                    pass
                try:
                    ctl = open(os.path.join(base, "cgroup.subtree_control")).read().split()
                except OSError:
                    ctl = []
                for c in ("pids", "memory"):
                    if c in ctl:
                        layout[f"v2_{c}"] = base
        elif fstype == "cgroup":
            for c in ("pids", "memory"):
                if c in opts and c in own and c not in layout:
                    base = os.path.normpath(mnt + own[c])
                    if _writable_dir(base):
                        layout[c] = base
    for base in set(layout.values()):
        _remove_stale(base)
    return layout


def _remove_stale(base: str) -> None:
    """Remove the empty per-call cgroups a dead process left behind (it crashed between mkdir and rmdir)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("alloy-sbx-")]
    except OSError:
        return
    for name in names:
        try:
            os.kill(int(name.split("-")[2]), 0)
            continue  # its process is alive: in use
        except ProcessLookupError:
            pass
        except (OSError, ValueError, IndexError):
            continue
        try:
            os.rmdir(os.path.join(base, name))
        except OSError:
            pass


class CallCgroup:
    """The cgroups of one call (see the module docstring). Use `procs_fds()` in the parent (kept open across the
    fork), `join(fds)` in the child, `kill()` and `close()` in the parent once the call's supervisor has exited."""

    _n = 0

    def __init__(self, memory_mb: int, max_procs: int) -> None:
        CallCgroup._n += 1
        name = f"alloy-sbx-{os.getpid()}-{CallCgroup._n}"
        self.dirs: dict[str, str] = {}  # kind ("v2", "pids", "memory") -> dir
        self.limited: set[str] = set()  # "pids", "memory": enforced per call
        layout = cgroup_layout()
        mem = str(memory_mb * 1024 * 1024)
        for kind in ("v2", "pids", "memory"):
            if kind not in layout:
                continue
            d = os.path.join(layout[kind], name)
            try:
                os.mkdir(d)
            except OSError:
                continue
            self.dirs[kind] = d
            writes = []
            if kind == "v2":
                if "v2_pids" in layout:
                    writes.append(("pids.max", str(max_procs + 1), "pids"))
                if "v2_memory" in layout:
                    writes += [("memory.max", mem, "memory"), ("memory.swap.max", "0", None)]
            elif kind == "pids":
                writes.append(("pids.max", str(max_procs + 1), "pids"))  # + the program itself
            else:
                writes.append(("memory.limit_in_bytes", mem, "memory"))
            for fname, value, what in writes:
                try:
                    with open(os.path.join(d, fname), "w") as f:
                        f.write(value)
                    if what:
                        self.limited.add(what)
                except OSError:
                    pass

    def procs_fds(self) -> list[int]:
        fds = []
        for d in self.dirs.values():
            try:
                fds.append(os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
            except OSError:
                pass
        return fds

    @staticmethod
    def join(fds: list[int]) -> None:
        """In the forked child: move itself into each cgroup. Raises OSError (the call then fails to start)."""
        for fd in fds:
            os.write(fd, b"0")

    def _pids(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs.values():
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids.update(int(x) for x in f.read().split())
            except OSError:
                pass
        return pids

    def kill(self, wait_s: float = 2.0) -> bool:
        """SIGKILL everything left in the call's cgroups (cgroup.kill on v2, else pid by pid until empty); True when
        they are empty."""
        if "v2" in self.dirs:
            try:
                with open(os.path.join(self.dirs["v2"], "cgroup.kill"), "w") as f:
                    f.write("1")
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while True:
            pids = self._pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def close(self) -> None:
        for d in self.dirs.values():
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    time.sleep(0.01)  # killed processes still being reaped
        self.dirs = {}
