"""`sandbox.pool`: tool calls forked from the lean helper process give what `run_tool` in the caller gives (output,
refusals, limits, errors), and the helper's life is tied to its caller's: it restarts after a death, is per process
and per opt-out setting, and ends when the caller ends, even by SIGKILL."""
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandbox import pool
from sandbox.runner import UNCONFINED_CODE_ENV, isolation_support, run_tool

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
needs_ns = pytest.mark.skipif(isolation_support() == "none", reason="the sandbox refuses python without namespaces")


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="alloy-pool-test-"))
    os.chmod(d, 0o755)
    (d / "notes.txt").write_text("hello notes\n")
    os.chmod(d / "notes.txt", 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_pool():
    pool.shutdown()
    yield
    pool.shutdown()


def helper_pid() -> int:
    return pool._current().proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def same(a, b) -> dict:
    """The fields of two ToolResults that differ, timing aside."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return {k: (da[k], db[k]) for k in da if k != "elapsed_s" and da[k] != db[k]}


@pytest.mark.parametrize("command, kw", [
    ("cat notes.txt", {}), ("ls", {}), ("calc (12+34)*2", {}), ("echo hi; cat /etc/passwd", {}),
    ("cat /etc/passwd", {}), ("cat ../notes.txt", {}), ("rm notes.txt", {}), ("cat notes.txt", {"allowed": {"ls"}}),
    ("cat missing.txt", {}), ("echo " + "x" * 500, {"max_output_bytes": 100}),
])
def test_pooled_calls_match_run_tool(workdir, command, kw):
    direct, pooled = run_tool(command, workdir, **kw), pool.run_tool_pooled(command, workdir, **kw)
    assert same(direct, pooled) == {}
    assert isinstance(pooled.limits, tuple)


@needs_ns
def test_limits_hold_through_the_helper(workdir):
    r = pool.run_tool_pooled(shlex.join(["python", "-c", "while True: pass"]), workdir, allowed={"python"},
                             timeout_s=1.0)
    assert r.timed_out and not r.ok
    r = pool.run_tool_pooled(shlex.join(["python", "-c", "open('x', 'w')"]), workdir, allowed={"python"})
    assert not r.ok and not (workdir / "x").exists()  # the work dir is read-only to the call
    r = pool.run_tool_pooled(shlex.join(["python", "-c", "open('x', 'w').write('1')"]), workdir,
                             allowed={"python"}, writable_workdir=True)
    assert r.ok and (workdir / "x").read_text() == "1"


def test_errors_come_back_as_themselves(workdir):
    with pytest.raises(ValueError, match="isolation 'bogus' is not available"):
        pool.run_tool_pooled("ls", workdir, isolation="bogus")
    assert pool.run_tool_pooled("cat notes.txt", workdir).stdout == "hello notes\n"  # the helper survives it


@needs_ns
def test_a_dead_helper_fails_its_calls_and_the_next_call_starts_a_new_one(workdir):
    first = helper_pid()
    box: dict = {}

    def slow():
        try:
            box["r"] = pool.run_tool_pooled(shlex.join(["python", "-c", "import time; time.sleep(5)"]), workdir,
                                            allowed={"python"}, timeout_s=10)
        except Exception as e:
            box["e"] = e

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(1.0)  # the call is in flight
    os.kill(first, signal.SIGKILL)
    t.join(timeout=20)
    assert not t.is_alive()
    assert isinstance(box.get("e"), RuntimeError) and "exited with code -9" in str(box["e"])
    assert pool.run_tool_pooled("cat notes.txt", workdir).stdout == "hello notes\n"
    assert helper_pid() != first


def test_a_changed_opt_out_starts_a_fresh_helper(workdir, monkeypatch):
    monkeypatch.delenv(UNCONFINED_CODE_ENV, raising=False)
    first = helper_pid()
    monkeypatch.setenv(UNCONFINED_CODE_ENV, "1")
    assert pool.run_tool_pooled("ls", workdir).stdout == "notes.txt\n"
    second = helper_pid()
    assert second != first
    deadline = time.monotonic() + 10
    while alive(first) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(first)  # the old helper was ended, not leaked


def test_the_helper_ends_with_its_caller_even_when_killed(workdir):
    code = ("import os, sys, time; from sandbox import pool; "
            f"r = pool.run_tool_pooled('cat notes.txt', {str(workdir)!r}); "
            "print(pool._current().proc.pid, r.stdout.strip(), flush=True); time.sleep(60)")
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid, out = caller.stdout.readline().strip().split(" ", 1)
    assert out == "hello notes"
    assert alive(int(pid))
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(int(pid))


def test_a_forked_child_uses_a_helper_of_its_own(workdir):
    parent_helper = helper_pid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            res = pool.run_tool_pooled("cat notes.txt", workdir)
            os.write(w, f"{pool._current().proc.pid} {res.stdout.strip()}".encode())
            pool.shutdown()
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        pid, text = f.read().split(" ", 1)
    os.waitpid(child, 0)
    assert text == "hello notes" and int(pid) != parent_helper


def test_the_bench_fails_a_missed_target(tmp_path):
    """bench/sandbox_calls.py --check: a planted miss (pooled 1000x direct) exits 1 and still writes its numbers."""
    out = tmp_path / "sbx.json"
    r = subprocess.run([sys.executable, "bench/sandbox_calls.py", "--out", str(out), "--ballast-mb", "0,64",
                        "--calls", "12", "--repeats", "1", "--concurrency", "2", "--target", "1000", "--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [row["ballast_mb"] for row in res["rows"]] == [0, 64] and res["target"]["met"] is False
    for row in res["rows"]:
        assert row["direct_calls_per_s"]["median"] > 0 and row["pooled_calls_per_s"]["median"] > 0
        assert row["speedup"] == pytest.approx(row["pooled_calls_per_s"]["median"]
                                               / row["direct_calls_per_s"]["median"])
    assert res["meta"]["commit"] and res["meta"]["argv"][-1] == "--check"
