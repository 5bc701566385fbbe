"""bench/harness.py: the `meta` every bench JSON records, `--check`'s exit codes, the CPU accounting helpers, and
that every bench takes `--check` and records `meta` (read from the source; nothing is run)."""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402

LIBRARIES = {"harness", "merge_stats", "trl_systems", "gpu_parts"}  # modules of bench/ that are not benches


def test_meta_fields():
    m = harness.start_meta()
    assert re.fullmatch(r"[0-9a-f]{40}", m["commit"]) and isinstance(m["dirty"], bool)
    assert m["cpu_count"] == os.cpu_count() and m["cores"] == sorted(os.sched_getaffinity(0)) and m["cpu_model"]
    assert len(m["loadavg_start"]) == 3 and m["python"].count(".") == 2 and m["torch"]
    assert m["argv"] == sys.argv and set(m["threads_start"]["env"]) == set(harness.THREAD_ENV)
    import torch

    harness.end_meta(m)
    assert len(m["loadavg_end"]) == 3 and m["threads"]["torch_threads"] == torch.get_num_threads()
    assert m["threads"]["torch_interop_threads"] >= 1 and m["ended_at"] >= m["started_at"]
    first = m["loadavg_end"]
    assert harness.end_meta(m)["loadavg_end"] is first  # ended once: a second writer keeps the first end


def test_git_state_outside_a_checkout(tmp_path):
    assert harness.git_state(tmp_path) == {"commit": None, "dirty": None}


def test_dirty_flag_follows_tracked_changes(tmp_path):
    import subprocess

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    clean = harness.git_state(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", clean["commit"]) and clean["dirty"] is False
    (tmp_path / "f").write_text("b")
    assert harness.git_state(tmp_path) == {"commit": clean["commit"], "dirty": True}


def test_verdict_exit_codes(capsys):
    assert harness.verdict("b", False, check=False) == 0  # without --check a miss is only reported
    assert harness.verdict("b", True, check=True) == 0
    assert harness.verdict("b", False, check=True) == 1
    assert harness.verdict("b", None, check=True) == 2  # the run does not measure the target's point
    assert harness.verdict("b", None, check=True, has_target=False) == 0  # no target: it ran
    assert "MISSED" in capsys.readouterr().err


def test_add_check_flag():
    for kw in ({"what": "x > 1"}, {"what": None}, {"what": "a check fails", "always": True}):
        p = argparse.ArgumentParser()
        harness.add_check(p, **kw)
        assert p.parse_args(["--check"]).check is True and p.parse_args([]).check is False
        assert "--check" in p.format_help()  # a help text argparse can format (no stray %)


def test_spread_and_own_cpu():
    assert harness.spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    a = harness.own_cpu_s()
    sum(i * i for i in range(300_000))
    assert harness.own_cpu_s() > a
    assert harness.pin_cores(None) == sorted(os.sched_getaffinity(0))


def test_step_clock_needs_a_measured_step():
    with pytest.raises(ValueError):
        harness.StepClock(warmup=0, steps=3, teachers=[])
    with pytest.raises(ValueError):
        harness.StepClock(warmup=3, steps=3, teachers=[])


def test_every_bench_takes_check_and_records_meta():
    """Each script of bench/ with a `main` builds `--check` with harness.add_check, calls harness.start_meta, and
    returns an exit code from `main` (`sys.exit(main())`)."""
    benches = sorted(p for p in BENCH.glob("*.py") if p.stem not in LIBRARIES)
    assert len(benches) >= 15
    for path in benches:
        src = path.read_text()
        tree = ast.parse(src)
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert {"add_check", "start_meta"} <= called, f"{path.name}: no add_check / start_meta"
        assert "sys.exit(main())" in src, f"{path.name}: main's exit code is not the process's"


def test_cpu_window_spans_steps_2_to_n_and_names_a_run_that_ended_early():
    import trl_systems

    marks = {1: (10.0, 64), 60: (70.5, 4000)}
    assert trl_systems.cpu_window(marks, 1, 60, "alloy") == (60.5, 3936)
    with pytest.raises(RuntimeError, match=r"GKDTrainer: no CPU window over steps 2\.\.60: marks taken after steps \[1\]"):
        trl_systems.cpu_window({1: (10.0, 64)}, 1, 60, "GKDTrainer")
    with pytest.raises(RuntimeError, match="fewer than 2 steps"):
        trl_systems.cpu_window({1: (10.0, 64)}, 1, 1, "alloy")
