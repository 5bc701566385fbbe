"""Which files /update_weights_from_buffer (engine/server.py) may read: regular files inside the server's
weight-buffer directories, nothing else.

The JSON form of the endpoint names a file on the server's machine. Before this rule any path was opened: a FIFO
hung a worker thread on `open`, and the error of a file that was not a weight buffer echoed its first bytes. Now
the path, with every symlink resolved (`os.path.realpath`), must lie inside one of the directories the server was
started with (`--weight-buffer-dir`, repeatable; a trainer's `PolicyServer` passes its own: a private directory
in /dev/shm and `work_dir/weights`; default `DEFAULT_BUFFER_DIRS`), and be a regular file (`lstat`,
`stat.S_ISREG`); `weight_buffer.read_buffer` opens it non-blocking and checks the open file again (a file swapped
for a FIFO in between cannot hang it). A refused path is HTTP 400 naming the rule; no message carries a byte of
the file (`weight_buffer` names a bad magic without echoing it). A symlink inside the directories to a file inside
them is fine; one that leaves them is refused.

A weight buffer sent as the request body (`application/octet-stream`) is not a path and is not affected.
"""
from __future__ import annotations

import os
import stat
from typing import Iterable

from engine.protocol import ProtocolError

# Where the trainers write their weight buffers (training/policy_server.py: a private `alloy-NAME-*` directory
# in /dev/shm, which passes its directories explicitly); the default of a server started by hand.
DEFAULT_BUFFER_DIRS: tuple[str, ...] = ("/dev/shm",)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


def buffer_dirs(dirs: Iterable[str] | None) -> tuple[str, ...]:
    """The allowed directories, symlinks resolved (`DEFAULT_BUFFER_DIRS` for None or none)."""
    dirs = [d for d in (dirs or ()) if d] or list(DEFAULT_BUFFER_DIRS)
    return tuple(dict.fromkeys(os.path.realpath(os.path.expanduser(str(d))) for d in dirs))


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # e.g. relative vs absolute
        return False


def _rule(dirs: tuple[str, ...]) -> str:
    return (f"path must name a regular file inside the server's weight-buffer directories ({', '.join(dirs)}; "
            "--weight-buffer-dir), symlinks resolved")


def check_buffer_path(path: str, dirs: tuple[str, ...]) -> str:
    """The resolved path of `path` if it may be read as a weight buffer; raises `ProtocolError` (400) naming the
    rule otherwise. A file that does not exist passes (the read reports FileNotFoundError, as before)."""
    if "\0" in path:
        raise ProtocolError(f"{_rule(dirs)}; got a path with a NUL byte")
    real = os.path.realpath(os.path.abspath(path))
    if not any(_inside(real, d) for d in dirs):
        raise ProtocolError(f"{_rule(dirs)}; {path!r} resolves to {real!r}, outside them")
    try:
        mode = os.lstat(real).st_mode
    except FileNotFoundError:
        return real
    except OSError as e:
        raise ProtocolError(f"{_rule(dirs)}; {path!r} cannot be examined ({type(e).__name__})") from None
    if not stat.S_ISREG(mode):
        kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
        raise ProtocolError(f"{_rule(dirs)}; {path!r} is {kind}")
    return real
