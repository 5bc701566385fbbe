"""Progress as data (training/progress_events.py): the trainer's `report` writes one JSON line a step (rank 0, only
when the parent named a file, never raising), `read_events` reads complete lines from an offset (a torn last line
waits for its end), and `run_worker` follows a real child's reports (tasks/worker_process.py)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.worker_process import progress_path, run_worker
from training.progress_events import PROGRESS_ENV, ProgressEvent, read_events, report

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def events(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(PROGRESS_ENV, str(path))
    monkeypatch.delenv("RANK", raising=False)
    return path


def test_report_writes_one_json_line_a_step_with_numeric_metrics(events):
    report(1, 10, loss=0.5, n=3, name="text", flag=True, bad=float("nan"))
    report(2, 10)
    lines = events.read_text().splitlines()
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["total"] == 10 and first["t"] > 1e9
    assert first["metrics"] == {"loss": 0.5, "n": 3.0, "bad": None}  # numbers only; NaN is not JSON
    assert [e.step for e in read_events(events)[0]] == [1, 2]


def test_report_is_a_no_op_without_the_variable_or_off_rank_0(events, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    report(1, 10)
    monkeypatch.delenv(PROGRESS_ENV)
    monkeypatch.setenv("RANK", "0")
    report(2, 10)
    assert not events.exists()


def test_a_failed_write_never_reaches_the_trainer(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path / "no-such-dir" / "p.jsonl"))
    monkeypatch.delenv("RANK", raising=False)
    report(1, 2)
    report(2, 2)
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1  # once, not per step


def test_read_events_from_an_offset_leaves_a_torn_line_for_later(events):
    assert read_events(events) == ([], 0)  # no file yet
    events.write_text(ProgressEvent(1, 3, 1.0).to_line() + ProgressEvent(2, 3, 2.0, {"x": 1.0}).to_line())
    got, offset = read_events(events)
    assert [(e.step, e.metrics) for e in got] == [(1, {}), (2, {"x": 1.0})] and offset == events.stat().st_size
    line3 = ProgressEvent(3, 3, 3.0).to_line()
    with open(events, "a") as fh:
        fh.write(line3[:7])  # a write in progress
    assert read_events(events, offset) == ([], offset)
    with open(events, "a") as fh:
        fh.write(line3[7:] + "not json\n")  # the rest, then a garbled line: skipped
    got, end = read_events(events, offset)
    assert [e.step for e in got] == [3] and end == events.stat().st_size


CHILD = textwrap.dedent("""
    import time
    from training.progress_events import report
    print("a human line: step 99/99", flush=True)  # logs are not parsed
    for step in (1, 2, 3):
        report(step, 3, loss=1.0 / step)
        time.sleep(0.7)
""")


def test_run_worker_follows_the_steps_its_child_reports(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    log_path = tmp_path / "logs" / "child.log"
    seen: list[int] = []
    run_worker([sys.executable, "-c", CHILD], log_path, 3, "child", seen.append)
    assert seen == sorted(set(seen)) and seen[-1] == 3, seen
    assert "step 99/99" in log_path.read_text()
    assert [e.step for e in read_events(progress_path(log_path))[0]] == [1, 2, 3]
    again: list[int] = []  # a retry appends to the same files and follows only its own reports
    run_worker([sys.executable, "-c", CHILD.replace("(1, 2, 3)", "(2, 3)")], log_path, 3, "child", again.append)
    assert again and again[0] == 2 and again[-1] == 3, again


def test_throttled_updates_run_at_most_once_per_interval():
    """`infra.progress.throttled` (a specialist's Prefect progress artifact): the first call runs, then one per
    `every_s` of the clock; the newest value goes through when one runs."""
    from infra.progress import throttled

    now, seen = [0.0], []
    update = throttled(seen.append, 5.0, clock=lambda: now[0])
    for t, step in ((0.0, 1), (1.0, 2), (4.9, 3), (5.0, 4), (9.0, 5), (11.0, 6), (11.1, 7)):
        now[0] = t
        assert update(step) == (step in (1, 4, 6))
    assert seen == [1, 4, 6]
