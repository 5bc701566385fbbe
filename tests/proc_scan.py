"""Host-side process listing for sandbox tests: what is still alive after a call, judged from outside it."""
from __future__ import annotations

import os


def alive_with(token: str) -> list[int]:
    """Pids of the processes whose command line holds `token` (a sandboxed program and everything it forked)."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    out.append(int(p))
        except OSError:
            pass
    return out
