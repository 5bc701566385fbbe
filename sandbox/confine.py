"""Kernel confinement for sandboxed tool calls: a Landlock filesystem ruleset and a seccomp syscall filter, both via
ctypes (no bubblewrap, no Python binding for libseccomp: the C library `libseccomp.so.2` is enough).

Both are prepared in the parent, where errors can be reported and memory allocated safely, and only *applied* in the
forked child just before exec (`apply`), with two system calls that allocate nothing:

- `landlock_ruleset(read_paths, rw_paths)`: a ruleset fd that allows read+execute beneath `read_paths` (system dirs,
  the interpreter), read+write (no execute) beneath `rw_paths` (the work dir), a few device files, and nothing else:
  no other file can be opened, listed, written or executed, whatever the uid and mode bits say. Paths are resolved
  once when the rule is added, so a symlink planted later leads nowhere new. With ABI ≥ 4 it also refuses TCP
  bind/connect, with ABI ≥ 6 signals to processes outside the sandbox and abstract unix sockets outside it.
  Landlock needs no privilege; `landlock_restrict_self` needs no_new_privs, which the child sets first.
- `seccomp_program()`: a classic BPF filter built once with libseccomp (`seccomp_export_bpf`), default allow, with a
  deny list answered EPERM (so a tool sees an ordinary error, never a kill):
  - sockets: `socket()` of any family, AF_UNIX included, and `socketpair()` but AF_UNIX. A pair of its own is all
    a call has, so everything that would address another socket is denied too (`ADDRESSING_SYSCALLS`: connect,
    bind, listen, accept, sendmsg/sendmmsg, whose address sits in memory a filter cannot read) and `sendto` with a
    destination address (argument 4 non-NULL; `send()` passes NULL): a pair's datagram end could otherwise be
    pointed at any path-bound or abstract unix socket on the host, which neither a network namespace (paths) nor
    Landlock ≤ 7 (paths) covers;
  - System V and POSIX IPC (`IPC_SYSCALLS`: shm*, msg*, sem*, mq_*): objects that outlive the call and are shared
    across calls and uids in the host's IPC namespace (the namespaces give each call its own as well);
  - file watches (`WATCH_SYSCALLS`: inotify, fanotify): the names other episodes create in a directory the call
    can name (/tmp);
  - ptrace and process_vm_readv/writev, mount and the new mount API, unshare/setns and clone with namespace
    flags, keyctl/add_key/request_key (keys outlive the call in the uid's keyring), bpf, perf_event_open, kexec,
    module loading, reboot, swapon/off, io_uring (which bypasses seccomp), userfaultfd, open_by_handle_at,
    chroot/pivot_root, clock/time setting.
  clone3 answers ENOSYS (its flags live in memory a filter cannot read), which makes glibc fall back to clone.
  Syscalls of another ABI (i386, x32) kill. The threat model and the tests that check each entry:
  docs/security.md.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from functools import lru_cache

_libc = ctypes.CDLL(None, use_errno=True)

# -- Landlock (include/uapi/linux/landlock.h) ---------------------------------------------------------------------
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
(EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK,
 MAKE_FIFO, MAKE_BLOCK, MAKE_SYM, REFER, TRUNCATE, IOCTL_DEV) = (1 << i for i in range(16))
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a rule on a file may carry
READ_EXEC = EXECUTE | READ_FILE | READ_DIR
READ_WRITE = (WRITE_FILE | READ_FILE | READ_DIR | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SYM
              | MAKE_FIFO | MAKE_SOCK | REFER | TRUNCATE)  # no EXECUTE: nothing written there can be exec'd
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
DEVICE_FILES = {"/dev/null": READ_FILE | WRITE_FILE | TRUNCATE, "/dev/zero": READ_FILE, "/dev/urandom": READ_FILE}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled (ENOSYS / EOPNOTSUPP)."""
    v = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                      ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(v), 0)


def _handled_fs(abi: int) -> int:
    fs = (REFER - 1)  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        fs |= REFER
    if abi >= 3:
        fs |= TRUNCATE
    if abi >= 5:
        fs |= IOCTL_DEV
    return fs


def landlock_ruleset(read_paths, rw_paths, list_paths=(), ro_paths=()) -> int:
    """A Landlock ruleset fd (O_CLOEXEC; the caller closes it) allowing read+execute beneath each of `read_paths`,
    read+write beneath each of `rw_paths`, listing (only) beneath `list_paths`, reading (no write, no execute)
    beneath `ro_paths`, plus DEVICE_FILES. Missing paths are skipped. Raises OSError."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not available in this kernel")
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0,
                        (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        rules = ([(p, READ_EXEC) for p in read_paths] + [(p, READ_WRITE) for p in rw_paths]
                 + [(p, READ_DIR) for p in list_paths] + [(p, READ_FILE | READ_DIR) for p in ro_paths])
        for path, access in rules + list(DEVICE_FILES.items()):
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                    access &= FILE_RIGHTS
                rule = _PathBeneath(access & handled, pfd)
                if _libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                 ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(pfd)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- seccomp via libseccomp ---------------------------------------------------------------------------------------
SCMP_ACT_ALLOW, SCMP_ACT_KILL_PROCESS = 0x7FFF0000, 0x80000000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
AF_UNIX = 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "fsopen",
    "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns", "keyctl",
    "add_key", "request_key", "bpf", "perf_event_open", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "acct", "syslog", "iopl", "ioperm",
    "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "lookup_dcookie", "uselib", "vhangup")
IPC_SYSCALLS = ("shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
                "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr")
WATCH_SYSCALLS = ("inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark")
ADDRESSING_SYSCALLS = ("connect", "bind", "listen", "accept", "accept4", "sendmsg", "sendmmsg")
DENIED_SYSCALLS += IPC_SYSCALLS + WATCH_SYSCALLS + ADDRESSING_SYSCALLS  # all answered EPERM, whatever the arguments


def scmp_act_errno(e: int) -> int:
    return 0x00050000 | (e & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


class SeccompProgram:
    """An exported BPF filter, kept alive in the parent; `load()` installs it in the calling (child) process."""

    def __init__(self, bpf: bytes):
        n = len(bpf) // ctypes.sizeof(_SockFilter)
        self.n_instructions = n
        self._filters = (_SockFilter * n).from_buffer_copy(bpf)
        self._prog = _SockFprog(n, ctypes.cast(self._filters, ctypes.POINTER(_SockFilter)))

    def load(self) -> None:
        if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sandbox: loading the seccomp filter failed")


@lru_cache(maxsize=1)
def seccomp_program() -> SeccompProgram:
    """Build the deny-list filter once (see the module docstring). Raises OSError when libseccomp is missing."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise OSError(errno.ENOENT, f"libseccomp not found ({name}): install libseccomp2") from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        def rule(action: int, syscall: str, *cmps: _ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(syscall.encode())
            if nr < 0:
                return  # unknown to this libseccomp (an old one): nothing to filter
            arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add failed for {syscall}")

        _check(lib.seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS), "seccomp_attr_set")
        eperm = scmp_act_errno(errno.EPERM)
        for sc in DENIED_SYSCALLS:
            rule(eperm, sc)
        rule(eperm, "socket")  # every family, AF_UNIX included: a path socket cannot be reached (no fd to connect)
        rule(eperm, "socketpair", _ArgCmp(0, SCMP_CMP_NE, AF_UNIX, 0))  # a connected pair reaches only itself
        rule(eperm, "sendto", _ArgCmp(4, SCMP_CMP_NE, 0, 0))  # ... unless told another address: only NULL passes
        for flag in NAMESPACE_FLAGS:
            rule(eperm, "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule(scmp_act_errno(errno.ENOSYS), "clone3")
        r, w = os.pipe()
        try:
            _check(lib.seccomp_export_bpf(ctx, w), "seccomp_export_bpf")
            os.close(w)
            w = -1
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
    finally:
        lib.seccomp_release(ctx)
    return SeccompProgram(b"".join(chunks))


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what} failed")


# -- in the child ------------------------------------------------------------------------------------------------

def apply(ruleset_fd: int | None, program: SeccompProgram | None) -> None:
    """In the forked child, after no_new_privs and the uid drop, just before exec: enter the Landlock domain, then
    install the seccomp filter (last, so nothing it denies is needed before exec). Raises OSError (the child then
    never execs: `Popen` reports the error)."""
    if ruleset_fd is not None:
        if _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "sandbox: landlock_restrict_self failed")
        os.close(ruleset_fd)
    if program is not None:
        program.load()
