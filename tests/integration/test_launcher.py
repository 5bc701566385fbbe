"""Supervisor and teacher registry with real embedded servers: start many, restart a SIGKILLed one with its latest
weights, stop without leftovers, report a failed start's log, no orphans when the parent is SIGKILLed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from engine.client import EngineClient
from engine.launcher import (
    ServerSpec, Supervisor, SupervisorError, build_command, free_port, launch_settings, sglang_option_args, url_for,
    wait_healthy,
)
from teachers.registry import TeacherRegistry, TokenizerMismatch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]



def _cmdline(p: psutil.Process) -> str:
    """A process's command line, or "" once it has exited (a zombie some other test's child left: not ours)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""

def gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie awaiting a non-reaping init counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- pure command building ------------------------------------------------------------------------------------------

def test_build_command_embedded_and_sglang():
    spec = ServerSpec("math", "/ckpt/math", api_key="k", weight_version="3")
    assert build_command(spec, 31000) == [
        sys.executable, "-m", "engine.server", "--model", "/ckpt/math", "--port", "31000", "--host",
        "127.0.0.1", "--weight-version", "3"]  # the key goes in the child's environment, not in argv (`ps`)
    gpu = ServerSpec("code", "/ckpt/code", backend="sglang", host="0.0.0.0", extra_args=["--enable-metrics"],
                     options={"tp_size": 2, "mem_fraction_static": 0.8, "skip_tokenizer_init": True,
                              "trust_remote_code": False, "tokenizer_path": "/tok"})
    assert build_command(gpu, 30000) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/ckpt/code", "--port", "30000", "--host",
        "0.0.0.0", "--tp-size", "2", "--mem-fraction-static", "0.8", "--skip-tokenizer-init",
        "--tokenizer-path", "/tok", "--enable-metrics"]
    with pytest.raises(ValueError, match="unknown SGLang option 'tp'"):
        sglang_option_args({"tp": 2})
    with pytest.raises(ValueError, match="backend must be"):
        build_command(ServerSpec("x", "/m", backend="vllm"), 1)
    # a recorded weight buffer: applied by the embedded server at start; SGLang takes none
    assert build_command(ServerSpec("p", "/m", weights_buffer="/dev/shm/p-a.wbuf"), 1)[-2:] == [
        "--weights-buffer", "/dev/shm/p-a.wbuf"]
    with pytest.raises(ValueError, match="takes no weight buffer"):
        build_command(ServerSpec("p", "/m", backend="sglang", weights_buffer="/x.wbuf"), 1)


def test_launch_settings_follow_the_engine_config():
    from infra.config import EngineConfig

    assert launch_settings(EngineConfig()) == {"backend": "embedded", "options": {}, "extra_args": []}
    cpu = launch_settings(EngineConfig(max_running_requests=16, sglang_args={"tp_size": 2}))  # sglang_args: SGLang's
    assert cpu == {"backend": "embedded", "options": {"max_running_requests": 16}, "extra_args": []}
    # one name from config to server flag (the embedded server's and SGLang's alike) to scheduler parameter
    assert build_command(ServerSpec("policy-x", "/m", **cpu), 30000)[-2:] == ["--max-running-requests", "16"]
    gpu = launch_settings(EngineConfig(backend="sglang", max_running_requests=8, sglang_args={"tp_size": 2}))
    assert gpu == {"backend": "sglang", "options": {"tp_size": 2, "max_running_requests": 8}, "extra_args": []}
    cmd = build_command(ServerSpec("policy-x", "/m", **gpu), 30000)  # rollout servers launch real SGLang too
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-4:] == ["--tp-size", "2", "--max-running-requests", "8"]
    # the embedded server's read timeout and body limit are config fields (a flag only where not the default)
    limits = launch_settings(EngineConfig(read_timeout_s=5, max_body_mb=64, sglang_args={"tp_size": 2}))
    assert limits["options"] == {"read_timeout_s": 5.0, "max_body_mb": 64.0}
    assert build_command(ServerSpec("t", "/m", **limits), 30000)[-4:] == ["--read-timeout-s", "5.0", "--max-body-mb",
                                                                        "64.0"]
    assert launch_settings(EngineConfig(backend="sglang", read_timeout_s=5))["options"] == {}  # SGLang: no such flag
    # the answer cap (--max-logprob-entries): a flag only where not the default
    cap = launch_settings(EngineConfig(max_logprob_entries=2**23))
    assert cap["options"] == {"max_logprob_entries": 2**23}
    assert build_command(ServerSpec("t", "/m", **cap), 30000)[-2:] == ["--max-logprob-entries", str(2**23)]
    assert launch_settings(EngineConfig(backend="sglang", max_logprob_entries=5))["options"] == {}
    # the embedded server's device and dtype: flags only where not "auto"; SGLang takes its own (sglang_args)
    dev = launch_settings(EngineConfig(device="cuda:1", dtype="float16"))
    assert dev["options"] == {"device": "cuda:1", "dtype": "float16"}
    assert build_command(ServerSpec("t", "/m", **dev), 30000)[-4:] == ["--device", "cuda:1", "--dtype", "float16"]
    assert launch_settings(EngineConfig(device="cpu"))["options"] == {"device": "cpu"}
    assert launch_settings(EngineConfig(backend="sglang", device="cuda", dtype="bfloat16"))["options"] == {}
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"dtype": "float64"}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_engine_backend_names_come_from_the_backend_registry():
    """`engine.backend` accepts exactly the kinds in engine.backends; each kind checks its own options."""
    from infra.config import ConfigError, config_from_dict
    from engine.backends import BACKENDS

    domains = [{"name": "addition"}]
    for name in BACKENDS:
        assert config_from_dict({"domains": domains, "engine": {"backend": name}}).engine.backend == name
    with pytest.raises(ConfigError) as err:
        config_from_dict({"domains": domains, "engine": {"backend": "vllm"}})
    assert "engine.backend" in str(err.value) and all(f"'{name}'" in str(err.value) for name in BACKENDS)
    with pytest.raises(ValueError, match="server 'x': unknown embedded server option 'tp_size'"):
        build_command(ServerSpec("x", "/m", options={"tp_size": 2}), 1)


def test_max_running_requests_reaches_the_scheduler_under_one_name(tiny_model_dir, tmp_path):
    """engine.max_running_requests → `--max-running-requests` → the scheduler's `max_running_requests`, read back
    from a real server's /get_server_info; without it the server runs with MAX_RUNNING_REQUESTS."""
    from infra.config import EngineConfig
    from infra.choices import MAX_RUNNING_REQUESTS
    from engine.client import run_sync
    from training.policy_server import PolicyServer

    async def info(client) -> dict:
        try:
            return await client.request("GET", "/get_server_info")
        finally:
            await client.aclose()

    with Supervisor(tmp_path / "logs", install_signal_handlers=False) as sup:
        capped = PolicyServer.for_engine(EngineConfig(max_running_requests=5), sup, "capped", str(tiny_model_dir),
                                         tmp_path / "capped", seed=3)
        plain = sup.start([ServerSpec("plain", str(tiny_model_dir))])["plain"]
        cmdline = psutil.Process(next(s["pid"] for s in sup.status() if s["name"] == "capped")).cmdline()
        assert cmdline[cmdline.index("--max-running-requests") + 1] == "5" and "--seed" in cmdline
        assert run_sync(info(capped.client))["max_running_requests"] == 5
        assert run_sync(info(EngineClient(plain)))["max_running_requests"] == MAX_RUNNING_REQUESTS


def test_clients_dial_loopback_for_a_wildcard_bind():
    """A server bound to every interface (`engine.host: 0.0.0.0` or `::`) is dialled on the loopback address of the
    same family; any other bind address is dialled as is."""
    assert url_for("0.0.0.0", 31000) == "http://127.0.0.1:31000"
    assert url_for("::", 31000) == url_for("[::]", 31000) == "http://[::1]:31000"
    assert url_for("127.0.0.2", 31000) == "http://127.0.0.2:31000"
    assert url_for("::1", 31000) == "http://[::1]:31000"
    assert url_for("10.1.2.3", 31000) == "http://10.1.2.3:31000"


# -- three servers under one supervisor, registered as teachers ---------------------------------------------------

@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sup-logs")
    sup = Supervisor(logs, health_timeout=60, monitor_interval=0.2, grace_s=3, install_signal_handlers=False)
    box: dict = {}

    def launch():  # from a short-lived thread, as a Prefect task would: the servers must outlive it
        try:
            urls = sup.start([ServerSpec(f"teacher-{d}", tiny_model_dir) for d in ("add", "rev", "sort")])
            box["reg"] = TeacherRegistry({d: urls[f"teacher-{d}"] for d in ("add", "rev", "sort")})
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    try:
        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
        if "error" in box:
            raise box["error"]
        time.sleep(0.5)  # a PDEATHSIG tied to the exited thread would have killed them by now
        yield sup, box["reg"]
    finally:
        sup.stop()


def test_three_servers_healthy_and_registered(fleet, tiny_model_dir):
    sup, reg = fleet
    st = sup.status()
    assert [s["name"] for s in st] == ["teacher-add", "teacher-rev", "teacher-sort"]
    assert all(s["alive"] and s["restarts"] == 0 and Path(s["log"]).exists() for s in st)
    assert len({s["url"] for s in st}) == 3 and reg.domains() == ["add", "rev", "sort"]
    assert wait_healthy(reg.endpoints(), 5.0) == {}
    assert reg.check_tokenizers(tiny_model_dir) == {"add": "match", "rev": "match", "sort": "match"}
    with pytest.raises(KeyError, match=r"'mul'.*known domains: \['add', 'rev', 'sort'\]"):
        reg.endpoint("mul")
    assert reg.client("add") is reg.client("add")


def test_external_teachers_and_health_errors(fleet):
    _, reg = fleet
    dead_url = f"http://127.0.0.1:{free_port()}"
    ext = TeacherRegistry({"ext": reg.endpoint("add"), "gone": dead_url})
    assert wait_healthy(ext.endpoints(), 1.0) == {"gone": f"not healthy at {dead_url} after 1s"}
    c = ext.client("ext")
    assert c.run_sync(c.model_info())["is_generation"] is True and ext.domains() == ["ext", "gone"]


def test_tokenizer_mismatch_names_teachers(fleet, tmp_path):
    from infra.tokenizer import save_char_tokenizer

    _, reg = fleet
    tok = save_char_tokenizer(tmp_path)
    tok.add_tokens(["<tool>"])  # a student vocab with one more token
    tok.save_pretrained(str(tmp_path))
    with pytest.raises(TokenizerMismatch) as err:
        reg.check_tokenizers(tmp_path)
    msg = str(err.value)
    assert all(d in msg for d in ("add (", "rev (", "sort (")) and "vocab size 100 vs student 101" in msg


def test_sigkill_restarts_with_latest_weights(fleet, tmp_path):
    """The restart loads the recorded HF dir, then the recorded weight buffer over it, with the buffer's version."""
    from engine_proc import forward_logprobs
    from engine.weight_buffer import write_buffer
    from infra.models import init_model_dir, load_model

    sup, reg = fleet
    new_weights = init_model_dir("tiny", tmp_path / "rev-step7", seed=7)
    pushed = load_model(init_model_dir("tiny", tmp_path / "rev-step9", seed=9))
    write_buffer(tmp_path / "rev.wbuf", pushed.state_dict(), 9)
    sup.set_weights("teacher-rev", str(new_weights), "7", buffer=str(tmp_path / "rev.wbuf"))
    old_pid = next(s["pid"] for s in sup.status() if s["name"] == "teacher-rev")
    os.kill(old_pid, signal.SIGKILL)

    def rev():
        return next(s for s in sup.status() if s["name"] == "teacher-rev")

    wait_until(lambda: rev()["restarts"] == 1 and rev()["alive"], 10, "the monitor to restart teacher-rev")
    c = EngineClient(reg.endpoint("rev"), max_retries=60, backoff_base=0.1, backoff_max=0.5)

    ids = [1, 20, 21, 22, 23]

    async def after_restart():
        await c.wait_healthy(timeout=60)
        return (await c.model_info(), await c.generate([ids[:3]], max_new_tokens=3, ignore_eos=True),
                await c.score(ids, 1))

    info, gens, scored = c.run_sync(after_restart())
    assert rev()["pid"] != old_pid and gone(old_pid) and rev()["url"] == reg.endpoint("rev")
    assert "--weights-buffer" in psutil.Process(rev()["pid"]).cmdline()
    assert Path(info["model_path"]) == new_weights and info["weight_version"] == "9"
    assert gens[0].weight_version == "9" and len(gens[0].output_ids) == 3
    want = forward_logprobs(pushed, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.as_tensor(scored.token_logprobs), want, atol=1e-4)
    sup.set_weights("teacher-rev", str(new_weights), "7")  # a disk push forgets the buffer
    assert rev()["weights_buffer"] is None and rev()["weight_version"] == "7"


def test_stop_leaves_no_process(fleet):
    sup, _ = fleet
    pids = [s["pid"] for s in sup.status()]
    sup.stop()
    assert all(gone(p) for p in pids)
    assert not any(s["alive"] for s in sup.status())
    mine = [p for p in psutil.Process().children(recursive=True) if "engine.server" in _cmdline(p)]
    assert mine == []


def test_failed_start_reports_log_tail(tmp_path):
    # A server that exits is reported at once; one that stays up but never turns healthy (the embedded server
    # currently keeps answering 503 after a failed model load) is reported after health_timeout. Either way the
    # error carries the log tail, which names the bad path.
    with Supervisor(tmp_path / "logs", health_timeout=15, install_signal_handlers=False) as sup:
        with pytest.raises(SupervisorError) as err:
            sup.start([ServerSpec("broken", str(tmp_path / "no-such-model"))])
        pid = sup.status()[0]["pid"]
    msg = str(err.value)
    assert ("broken: process exited with code" in msg or "broken: not healthy" in msg), msg
    assert "last lines of" in msg and "no-such-model" in msg
    assert gone(pid)


PARENT = textwrap.dedent("""
    import json, sys, time
    from engine.launcher import ServerSpec, Supervisor
    sup = Supervisor(sys.argv[2], health_timeout=60)
    sup.start([ServerSpec("a", sys.argv[1]), ServerSpec("b", sys.argv[1])])
    print(json.dumps([s["pid"] for s in sup.status()]), flush=True)
    time.sleep(600)
""")


def test_parent_sigkill_leaves_no_orphans(tiny_model_dir, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir), str(tmp_path / "logs")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = parent.stdout.readline()
        assert line, f"parent script failed: {parent.stderr.read()}"
        pids = json.loads(line)
        assert len(pids) == 2 and not any(gone(p) for p in pids)
    finally:
        parent.kill()  # SIGKILL: no atexit, no handlers; only PR_SET_PDEATHSIG can take the children down
        parent.wait()
    wait_until(lambda: all(gone(p) for p in pids), 10, f"children {pids} to die with their parent")


@pytest.mark.skipif(os.environ.get("ALLOY_TEST_MANY") != "1", reason="opt-in: set ALLOY_TEST_MANY=1")
def test_twelve_servers_rss(tiny_model_dir, tmp_path):
    n = 12
    t0 = time.monotonic()
    with Supervisor(tmp_path / "logs", health_timeout=300, install_signal_handlers=False) as sup:
        urls = sup.start([ServerSpec(f"s{i}", str(tiny_model_dir)) for i in range(n)])
        up_s = time.monotonic() - t0
        mem = {s["name"]: psutil.Process(s["pid"]).memory_full_info() for s in sup.status()}
        rss = {k: m.rss / 2**20 for k, m in mem.items()}
        pss = {k: m.pss / 2**20 for k, m in mem.items()}  # shared libraries split between the servers
        c = EngineClient(urls["s11"])
        assert len(c.run_sync(c.generate([[1, 20]], max_new_tokens=4, ignore_eos=True))[0].output_ids) == 4
    report = {"n_servers": n, "startup_s": round(up_s, 1), "rss_mib_each": {k: round(v, 1) for k, v in rss.items()},
              "rss_mib_total": round(sum(rss.values()), 1), "pss_mib_total": round(sum(pss.values()), 1)}
    print("\nMANY-SERVERS", json.dumps(report))
    assert len(rss) == n and all(v > 0 for v in rss.values())


def test_api_key_reaches_the_server_through_its_environment_not_its_argv(tiny_model_dir, tmp_path):
    """A launched server enforces the key (401 without it), and the key is not in its command line (`ps`)."""
    from engine.client import EngineRequestError, run_sync

    key = "sk-alloy-test-7f3a91"
    with Supervisor(tmp_path, health_timeout=60, install_signal_handlers=False) as sup:
        url = sup.start([ServerSpec("keyed", tiny_model_dir, api_key=key)])["keyed"]
        (st,) = sup.status()
        cmdline = " ".join(psutil.Process(st["pid"]).cmdline())
        assert "engine.server" in cmdline and key not in cmdline
        assert key not in Path(st["log"]).read_text()

        async def calls():
            anon, good = EngineClient(url, api_key="wrong", max_retries=0), EngineClient(url, api_key=key)
            try:
                with pytest.raises(EngineRequestError) as err:
                    await anon.generate([[1, 5, 6]], max_new_tokens=2, temperature=0.0)
                assert err.value.status == 401
                (g,) = await good.generate([[1, 5, 6]], max_new_tokens=2, temperature=0.0)
                assert len(g.output_ids) == 2
            finally:
                await anon.aclose()
                await good.aclose()

        run_sync(calls())


def test_policy_server_sampling_follows_the_run_seed(tiny_model_dir, tmp_path):
    """A trainer's rollout server draws its sampling noise from the run's seed: the same seed samples the same
    tokens, another seed others (before, every run sampled with the server's default seed 0, so "3 seeds" of a
    bench shared one noise stream)."""
    import asyncio

    from training.policy_server import PolicyServer

    prompts = [[1, 5 + i, 9, 12] for i in range(16)]
    with Supervisor(tmp_path / "logs") as sup:
        servers = {name: PolicyServer(sup, name, str(tiny_model_dir), tmp_path / name, seed=seed, weight_sync=sync)
                   for name, seed, sync in (("a", 1, "memory"), ("b", 1, "disk"), ("c", 2, "memory"))}

        async def sample(server):
            try:
                outs = await server.client.generate(prompts, max_new_tokens=6, temperature=1.0)
                return [o.output_ids for o in outs]
            finally:
                await server.aclose()

        got = {name: asyncio.run(sample(s)) for name, s in servers.items()}
        assert got["a"] == got["b"]
        assert got["a"] != got["c"]
        # the same new weights pushed in memory (a weight buffer, the load left running) and from disk: the two
        # servers (same seed, same history) then sample the same tokens again
        buffer = push_both_ways(servers["a"], servers["b"], sup, tiny_model_dir, tmp_path)
        again = {name: asyncio.run(sample(servers[name])) for name in ("a", "b")}
        assert again["a"] == again["b"] and again["a"] != got["a"]
        # buffers removed on close (with their private /dev/shm directory, when there was room there)
        assert not buffer.exists() and (buffer.parent == servers["a"].weights_dir or not buffer.parent.exists())


def push_both_ways(mem, disk, sup, tiny_model_dir, tmp_path):
    import asyncio

    from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
    from infra.models import init_model_dir, load_model, load_tokenizer

    backend = DeepSpeedBackend(load_model(init_model_dir("tiny", tmp_path / "seed7", seed=7)), TrainSettings())
    tok = load_tokenizer(tiny_model_dir)

    async def push():
        try:
            assert mem.memory and not disk.memory
            path = Path(await mem.push(backend, tok, 1, wait=False))
            assert path.is_file() and path.suffix == ".wbuf" and mem.version == 1
            await mem.wait_loaded()
            assert mem.loaded_version == 1 and (await mem.client.model_info())["weight_version"] == "1"
            await disk.push(backend, tok, 1)
            assert disk.loaded_version == 1 and (Path(disk.weights_dir) / "v000001" / "config.json").is_file()
        finally:
            await mem.client.aclose()
            await disk.client.aclose()
        return path

    path = asyncio.run(push())
    backend.close()
    st = {s["name"]: s for s in sup.status()}
    assert st["a"]["weights_buffer"] == str(path) and st["a"]["weight_version"] == "1"
    assert st["b"]["weights_buffer"] is None and st["b"]["model_path"].endswith("v000001")
    return path
