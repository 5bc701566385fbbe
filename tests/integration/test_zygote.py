"""The process zygote (infra/zygote.py): a forked child is what a fresh `python -m module` child would be, and it
dies with whoever asked for it. Real forks of a real zygote; the module they run is written here."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from infra import zygote

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not zygote.enabled(), reason="the zygote is off on this host (GPU, or ALLOY_ZYGOTE=0)")]

CHILD = textwrap.dedent('''
    import atexit, json, os, sys
    import torch
    atexit.register(lambda: print("atexit ran", flush=True))
    mode = sys.argv[1]
    if mode == "report":
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        y = (x @ x).sum().item()  # a parallel op in the child: the pool starts here, not in the zygote
        print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "pgid": os.getpgid(0),
                          "sid": os.getsid(0), "var": os.environ.get("ZYGOTE_TEST_VAR"), "name": __name__,
                          "stdin": sys.stdin.read(), "threads": torch.get_num_threads(), "finite": y == y}),
              flush=True)
        print("to stderr", file=sys.stderr, flush=True)
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise ValueError("planted failure")
    elif mode == "sleep":
        print("sleeping", flush=True)
        import time
        time.sleep(600)
''')


@pytest.fixture(scope="module")
def child_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("zygote-mod")
    (d / "zygote_child_mod.py").write_text(CHILD)
    return d


def _env(mod_dir, **extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mod_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def _spawn(mod_dir, tmp_path, *args, **extra):
    log = tmp_path / f"child-{args[0]}.log"
    with open(log, "ab") as fh:
        proc = zygote.spawn([sys.executable, "-m", "zygote_child_mod", *args], env=_env(mod_dir, **extra),
                            stdout=fh.fileno(), cwd=str(tmp_path))
    return proc, log


def test_a_forked_child_gets_its_argv_env_cwd_session_log_and_exit_code(child_module, tmp_path):
    import json

    proc, log = _spawn(child_module, tmp_path, "report", "a b", ZYGOTE_TEST_VAR="seen", OMP_NUM_THREADS="2")
    assert isinstance(proc, zygote.Forked), "the zygote refused a plain request"
    assert proc.wait(120) == 0, log.read_text()
    lines = log.read_text().splitlines()
    got = json.loads(next(line for line in lines if line.startswith("{")))
    assert got["argv"] == ["report", "a b"] and got["name"] == "__main__"
    assert got["cwd"] == str(tmp_path) and got["var"] == "seen" and got["stdin"] == ""
    assert got["pid"] == proc.pid == got["pgid"] == got["sid"]  # its own session, as start_new_session=True
    assert got["threads"] == 2 and got["finite"]
    assert "to stderr" in lines and lines[-1] == "atexit ran"  # stderr on the log; atexit handlers ran


def test_exit_codes_and_tracebacks_are_those_of_a_fresh_interpreter(child_module, tmp_path):
    proc, _ = _spawn(child_module, tmp_path, "exit", "7")
    assert proc.wait(120) == 7
    proc, log = _spawn(child_module, tmp_path, "raise")
    assert proc.wait(120) == 1
    text = log.read_text()
    assert "ValueError: planted failure" in text and "Traceback" in text and "atexit ran" in text


def test_a_signal_ends_the_child_with_the_signal_as_its_returncode(child_module, tmp_path):
    proc, log = _spawn(child_module, tmp_path, "sleep")
    deadline = time.monotonic() + 60
    while "sleeping" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    shown = psutil.Process(proc.pid)
    assert shown.cmdline() == [sys.executable, "-m", "zygote_child_mod", "sleep"]  # `ps` shows the command
    assert shown.environ().get("PATH") == os.environ.get("PATH")  # and /proc/PID/environ an environment
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM


def test_an_import_time_variable_or_a_switched_off_zygote_starts_fresh(child_module, tmp_path):
    proc, _ = _spawn(child_module, tmp_path, "exit", "0", HF_HUB_OFFLINE="1" if os.environ.get("HF_HUB_OFFLINE") != "1" else "0")
    assert proc is None  # huggingface_hub reads it when imported: the caller starts the child itself
    proc, _ = _spawn(child_module, tmp_path, "exit", "0", ALLOY_ZYGOTE="0")
    assert proc is None
    cmd = [sys.executable, "-c", "pass"]
    assert zygote.spawn(cmd, env=dict(os.environ), stdout=1) is None  # not `python -m module`


def test_env_mismatch_names_only_import_time_variables():
    have = {"HF_HOME": "/a", "TMPDIR": "/t", "ALLOY_X": "1", "TORCH_EXTENSIONS_DIR": "/e"}
    assert zygote.env_mismatch(dict(have, ALLOY_X="2", RANK="0"), have) == []
    assert zygote.env_mismatch(dict(have, HF_HOME="/b"), have) == ["HF_HOME"]
    assert zygote.env_mismatch({k: v for k, v in have.items() if k != "TMPDIR"}, have) == ["TMPDIR"]
    # set by the zygote's own imports (as a fresh child's would set it): absent from the request is no difference
    assert zygote.env_mismatch({"HF_HOME": "/a", "TMPDIR": "/t"}, have, added={"TORCH_EXTENSIONS_DIR"}) == []
    assert zygote.env_mismatch(dict(have, OMP_NUM_THREADS="1"), have) == []  # applied in the child
    # but without a count the child would keep the zygote's (OpenMP reads it when torch is loaded)
    assert zygote.env_mismatch(have, dict(have, OMP_NUM_THREADS="1")) == ["OMP_NUM_THREADS"]


def test_the_child_and_the_zygote_die_with_the_process_that_asked(child_module, tmp_path):
    """A SIGKILLed requester: its connection closes, the zygote kills the child; the zygote it started exits."""
    script = tmp_path / "requester.py"
    script.write_text(textwrap.dedent(f'''
        import os, sys, time
        sys.path.insert(0, {str(child_module)!r})
        from infra import zygote
        env = dict(os.environ, PYTHONPATH={str(child_module)!r})
        env.pop(zygote.ENV, None)
        os.environ.pop(zygote.ENV, None)
        with open({str(tmp_path / "req-child.log")!r}, "ab") as fh:
            p = zygote.spawn([sys.executable, "-m", "zygote_child_mod", "sleep"], env=env, stdout=fh.fileno())
        print(p.pid, next(iter(zygote._started)), flush=True)
        time.sleep(600)
    '''))
    env = {k: v for k, v in os.environ.items() if k != zygote.ENV}
    req = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child_pid, sock = req.stdout.readline().split()
        child_pid = int(child_pid)
        zygote_pid = psutil.Process(child_pid).ppid()
        assert psutil.pid_exists(child_pid) and os.path.exists(sock)
        req.kill()
        req.wait(10)
        deadline = time.monotonic() + 20
        while (_alive(child_pid) or _alive(zygote_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "the child outlived the process that asked for it"
        assert not _alive(zygote_pid), "the zygote outlived the process that started it"
        assert not os.path.exists(sock)
    finally:
        req.kill()


def test_a_terminated_zygote_removes_its_socket_directory(tmp_path):
    """`kill` (SIGTERM) or a hang-up on the zygote itself: it exits through its cleanup, its socket directory gone
    (before, each such end left an `alloy-zygote-*` directory in /tmp)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        sock = tmp_path / f"z{sig}" / "sock"
        sock.parent.mkdir()
        z = subprocess.Popen([sys.executable, "-m", "infra.zygote", str(sock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={k: v for k, v in os.environ.items() if k != zygote.ENV})
        try:
            assert z.stdout.readline() == b"ready\n" and sock.exists()
            z.send_signal(sig)
            assert z.wait(20) == 128 + sig
            assert not sock.parent.exists()
        finally:
            z.kill()
            z.wait()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_zygote_is_reaped_when_its_starter_exits_so_its_cpu_counts_in_the_starters(tmp_path):
    """`time alloy run` and getrusage count the work of forked children: the starter reaps its zygote at exit, or
    when it calls `zygote.stop()` (a bench, per stage); either way the zygote's socket directory is removed, and a
    start after `stop()` starts a new zygote."""
    script = tmp_path / "starter.py"
    script.write_text(textwrap.dedent(f'''
        import os, resource, sys
        from infra import zygote
        os.environ.pop(zygote.ENV, None)
        def kids():
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r.ru_utime + r.ru_stime
        def help_run():
            with open({str(tmp_path / "help.log")!r}, "ab") as fh:
                p = zygote.spawn([sys.executable, "-m", "engine.server", "--help"], env=dict(os.environ),
                                 stdout=fh.fileno())
            assert p is not None and p.wait(120) == 0
            return next(iter(zygote._started))
        first = help_run()
        before = kids()
        zygote.stop()
        assert kids() - before > 1.0, kids() - before  # the zygote imported torch and the engine
        assert not os.path.exists(os.path.dirname(first)) and not zygote._started
        second = help_run()
        assert second != first
        print(zygote._started[second].pid, os.path.dirname(second), flush=True)
    '''))
    env = {k: v for k, v in os.environ.items() if k != zygote.ENV}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    zygote_pid, sock_dir = int(out.split()[0]), out.split()[1]
    assert not psutil.pid_exists(zygote_pid) or not _alive(zygote_pid)
    assert not os.path.exists(sock_dir)
    # the starter alone imports next to nothing; each zygote imported torch and the engine (seconds of CPU)
    assert usage.ru_utime + usage.ru_stime > 2.0, usage


def test_the_process_start_bench_measures_both_arms_and_fails_a_planted_miss(tmp_path):
    """bench/process_start.py: fresh and forked server starts; `--check --target 0` cannot be met (a ratio < 0):
    exit 1, the JSON written all the same."""
    import json

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "process_start.json"
    r = subprocess.run([sys.executable, os.path.join(repo, "bench", "process_start.py"), "--quick", "--out", str(out),
                        "--check", "--target", "0"], cwd=repo, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert len(got["fresh"]["starts"]) == len(got["forked"]["starts"]) == 2 and got["target"]["met"] is False
    assert len(got["meta"]["commit"]) == 40 and got["meta"]["argv"][-1] == "0"
    fresh, forked = got["fresh"]["cpu_s"]["median"], got["forked"]["cpu_s"]["median"]
    assert 0 < forked < fresh  # a forked start skips the imports (measured: 0.37 against 2.3 CPU-s)
