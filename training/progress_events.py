"""Progress as data: a trainer process reports each step as one JSON line; the process that started it reads them.

Log lines are for people; a parent that followed a child by a regex over its log broke whenever a message was
reworded. Here the format is defined once, as `ProgressEvent`: one JSON object a line,

    {"step": 12, "total": 60, "t": 1712345678.9, "metrics": {"loss": 0.41, "reward": 0.5}}

(`t`: unix time of the report; `metrics`: numbers only, a non-finite one as null). The parent names the file in the
child's environment (`PROGRESS_ENV`, set by `tasks.worker_process.run_worker`), so no trainer's flags change:

- the trainer calls `report(step, total, **metrics)`: rank 0 (`RANK`, as torchrun sets it; none: rank 0) appends one
  line and closes the file (flushed), a no-op when the variable is unset; a failed write is logged once and never
  raised (progress must not stop a training run);
- the parent calls `read_events(path, offset)`: the events of the complete lines after `offset` and the offset after
  the last of them; a torn last line (a write in progress) is left for the next read, a garbled complete line is
  skipped.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("alloy.progress")

PROGRESS_ENV = "ALLOY_PROGRESS_FILE"
_warned: set[str] = set()  # files whose write failure was logged already (once per file, not per step)


@dataclass(frozen=True)
class ProgressEvent:
    """One reported step: `step` of `total`, at unix time `t`, with `metrics` ({name: number, or None})."""

    step: int
    total: int
    t: float
    metrics: dict[str, float | None] = field(default_factory=dict)

    def to_line(self) -> str:
        return json.dumps({"step": self.step, "total": self.total, "t": self.t, "metrics": self.metrics},
                          allow_nan=False) + "\n"

    @classmethod
    def from_line(cls, line: bytes | str) -> "ProgressEvent":
        d = json.loads(line)
        return cls(int(d["step"]), int(d["total"]), float(d["t"]), dict(d.get("metrics") or {}))


def numbers_only(metrics: dict) -> dict[str, float | None]:
    """The numeric metrics as floats (non-finite ones as None, JSON has no NaN); anything else is left out."""
    out: dict[str, float | None] = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
            continue
        try:
            v = float(v)  # also a numpy or one-element torch scalar
        except (TypeError, ValueError, RuntimeError):
            continue
        out[str(k)] = v if math.isfinite(v) else None
    return out


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def report(step: int, total: int, **metrics) -> None:
    """Append the event of `step`/`total` to the file `PROGRESS_ENV` names (rank 0; see the module docstring)."""
    path = os.environ.get(PROGRESS_ENV)
    if not path or not _is_rank0():
        return
    try:
        line = ProgressEvent(int(step), int(total), time.time(), numbers_only(metrics)).to_line()
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
    except Exception as e:  # noqa: BLE001 - progress must never stop a trainer
        if path not in _warned:
            _warned.add(path)
            log.warning("progress events: cannot write %s (%s); training goes on without them", path, e)


def read_events(path: str | os.PathLike, offset: int = 0) -> tuple[list[ProgressEvent], int]:
    """The events of the complete lines of `path` from byte `offset`, and the offset after the last complete line
    (a missing file: none, `offset`)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # 0: no complete line yet
    events = []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            events.append(ProgressEvent.from_line(line))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("progress events: skipping a garbled line in %s: %r (%s)", Path(path).name, line[:200], e)
    return events, offset + end
