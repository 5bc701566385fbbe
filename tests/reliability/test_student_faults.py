"""The OPD student trainer process (`python -m student.distill_main`) under faults, for real: its own DeepSpeed,
engine server and MLflow logging, scored by a real teacher engine server behind a garbage-answering front.

One scenario, checked claim by claim:
1. the student is SIGKILLed (whole process group) mid-run, after a few committed checkpoints;
2. the newest checkpoint's COMPLETE manifest is made wrong (a size that does not match its file);
3. the same command is run again (same `--out`, same `--mlflow-run-id`).
Meanwhile the teacher is an EXTERNAL server as far as Alloy knows: an aiohttp front on loopback that speaks the
SGLang `/generate` protocol by forwarding to a real engine server, but answers garbage (NaN, ±inf, null, wrong
lengths, wrong token ids, wrong top-k widths, positive log-probs, out-of-vocabulary or repeated top-k ids, a
missing result) for every sequence whose prompt hashes into a fixed bucket.

Proved: the rerun skips the bad checkpoint with a warning and resumes from the one before; one MLflow run holds
both attempts; every issued sample id is trained once or dropped once (never both, never twice); exactly the
garbage-scored samples are dropped as `teacher_bad_response`, the loss is finite at every step and the final
weights are finite (garbage never reached a gradient). And every listening socket (servers and the trainer's own
process group) is on loopback, and `engine.host` chooses the teachers' bind address (and their clients follow).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import psutil
import pytest

from infra.storage import MANIFEST, get_fs, join, latest_complete, read_json

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOMAINS = ["reverse", "copy"]
STEPS, BATCH, CKPT_EVERY = 8, 8, 2
ASKED_HOST = "127.0.0.2"  # a loopback address other than the default, so honouring it is safe to test
KINDS = ["nan", "inf", "null", "short", "wrong_id", "topk_width", "positive", "topk_oov", "topk_repeat", "missing",
         "prompt_tokens"]


def garbage_plan(issued: dict[str, list[int]]) -> dict[tuple, str]:
    """{prompt ids: corruption} for about 1 prompt in 3 (a hash bucket), kinds dealt round-robin in issue order so
    that every kind is served. Depends on the prompts alone, so the test knows which sample ids must be dropped
    without seeing the student's samples."""
    bad = [tuple(p) for p in issued.values() if zlib.crc32(bytes(p)) % 3 == 0]
    return {p: KINDS[i % len(KINDS)] for i, p in enumerate(bad)}


def corrupt(obj: dict, kind: str) -> None:
    """Spoil one `/generate` scoring result in place (the `missing` kind is handled by the caller)."""
    meta = obj["meta_info"]
    lps, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    if kind == "nan":
        lps[-1][0] = math.nan
    elif kind == "inf":
        lps[-1][0] = -math.inf
    elif kind == "null":
        lps[-1][0] = None
    elif kind == "short":
        del lps[:2]  # fewer entries than response tokens
    elif kind == "wrong_id":
        lps[-1][1] = (lps[-1][1] + 1) % 100
    elif kind == "topk_width":
        tops[-1] = tops[-1][:-1]
    elif kind == "positive":
        lps[-1][0] = 3.0
    elif kind == "topk_oov":
        tops[-1][0][1] = 5000
    elif kind == "topk_repeat":
        tops[-1][1][1] = tops[-1][0][1]
    elif kind == "prompt_tokens":
        meta["prompt_tokens"] += 1


class GarbageTeacher:
    """An SGLang-protocol `/generate` front (aiohttp, 127.0.0.1, own thread and loop) over a real engine server.
    Scoring requests are forwarded; results of sequences whose prompt is in `plan` are spoiled."""

    def __init__(self, upstream: str, plan: dict[tuple, str]):
        from aiohttp import web

        self.upstream, self.plan, self.spoiled = upstream, plan, []  # spoiled: (kind, prompt_ids)
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/{path:.*}", self.passthrough)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _forward(self, method: str, path: str, payload=None):
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.request(method, self.upstream + path, json=payload) as r:
                return r.status, await r.json(content_type=None)

    async def passthrough(self, request):
        from aiohttp import web

        status, body = await self._forward("GET", request.path)
        return web.json_response(body, status=status)

    async def generate(self, request):
        from aiohttp import web

        payload = await request.json()
        status, body = await self._forward("POST", "/generate", payload)
        if status != 200 or payload.get("sampling_params", {}).get("max_new_tokens") != 0:
            return web.json_response(body, status=status)
        lsl = payload["logprob_start_len"]
        out = []
        for i, (ids, res) in enumerate(zip(payload["input_ids"], body)):
            start = (lsl[i] if isinstance(lsl, list) else lsl) + 1  # the client sends start - 1
            kind = self.plan.get(tuple(ids[:start]))
            if kind:
                self.spoiled.append((kind, ids[:start]))
                if kind == "missing":
                    continue  # the batch comes back one result short
                corrupt(res, kind)
            out.append(res)
        # json.dumps writes NaN / -Infinity literals, as a sloppy server would
        return web.Response(text=json.dumps(out), content_type="application/json")

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def listening(pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of pid and its descendants."""
    out = []
    root = psutil.Process(pid)
    for p in [root] + root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline()[1:4])
            out += [(cmd, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return out


def is_loopback(ip: str) -> bool:
    return ip in ("127.0.0.1", "::1") or ip.startswith("127.") or ip == "::ffff:127.0.0.1"


def issued(cfg_dict: dict, init: str) -> dict[str, list[int]]:
    """{sample_id: prompt_ids} the prompt stream issues in STEPS uniform takes of BATCH (deterministic)."""
    from infra.config import config_from_dict
    from infra.models import load_tokenizer
    from student.sampler import PromptStream
    from domains.registry import load_domains

    cfg = config_from_dict(cfg_dict)
    stream = PromptStream(load_domains(cfg), load_tokenizer(init), cfg.distill.n_prompts_per_domain, cfg.run.seed)
    return {it.sample_id: it.prompt_ids for _ in range(STEPS) for it in stream.take(BATCH)}


@pytest.fixture(scope="module")
def scenario(tiny_model_dir, tmp_path_factory):
    """Run 1 (SIGKILLed), bad manifest, run 2 (to the end). Returns everything the tests check."""
    from infra.config import EngineConfig, TeachersConfig
    from engine.launcher import free_port
    from infra.tracking import Tracker
    from tasks.teachers import start_teachers

    root = tmp_path_factory.mktemp("student-faults")
    # a plain server started with no --host (the CLI default), loading while the supervised teacher starts
    plain_port = free_port()
    plain = subprocess.Popen([sys.executable, "-m", "engine.server", "--model", str(tiny_model_dir), "--port",
                              str(plain_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    garbage = fleet = None
    sockets: dict[str, list] = {}
    try:
        # the pipeline's own path (tokenizer check included); `engine.host` asks for another loopback address
        fleet = start_teachers(["reverse"], {"reverse": str(tiny_model_dir)}, str(tiny_model_dir),
                               log_dir=root / "teacher-logs", engine_cfg=EngineConfig(host=ASKED_HOST),
                               teachers_cfg=TeachersConfig(health_timeout_s=300))
        teacher_url = fleet.endpoints()["reverse"]
        sockets["teacher"] = listening(fleet.status()[0]["pid"])
        cfg = {"run": {"name": "student-faults", "root": str(root)}, "domains": [{"name": d} for d in DOMAINS],
               "tracking": {"experiment": "reliability-student"},
               "distill": {"steps": STEPS, "batch_size": BATCH, "max_new_tokens": 4, "checkpoint_every": CKPT_EVERY,
                           "log_every": 1, "eval_every": 0, "loss": "topk_kl", "top_k": 4, "score_batch_size": 4,
                           "n_prompts_per_domain": 40, "teacher_retries": 2, "train": {"micro_batch_size": 8}}}
        (root / "cfg.json").write_text(json.dumps(cfg))
        ids = issued(cfg, str(tiny_model_dir))
        plan = garbage_plan(ids)
        garbage = GarbageTeacher(teacher_url, plan)
        tracker = Tracker(runs_root=root, experiment="reliability-student")
        parent = tracker.start_parent("student-faults")
        out = f"file://{root}/out"
        with tracker.child("student") as child:
            cmd = [sys.executable, "-m", "student.distill_main", "--config", str(root / "cfg.json"),
                   "--student-init", str(tiny_model_dir), "--teachers", json.dumps({d: garbage.url for d in DOMAINS}),
                   "--out", out, "--work-dir", str(root / "work"), "--result", str(root / "result.json"),
                   "--mlflow-run-id", child.run_id]
            with open(root / "run1.log", "wb") as fh:
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
                try:
                    deadline = time.monotonic() + 400
                    while (latest_complete(out) or "step-00000000")[-8:] < f"{2 * CKPT_EVERY:08d}":
                        assert proc.poll() is None and time.monotonic() < deadline, \
                            (root / "run1.log").read_text()[-3000:]
                        time.sleep(0.1)
                    sockets["student"] = listening(proc.pid)
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # trainer and, by PDEATHSIG, its engine server
                    except ProcessLookupError:  # it died on its own (the assert above says why)
                        pass
                    proc.wait()
            newest = latest_complete(out)
            killed_at = int(newest[-8:])
            # a wrong manifest on the newest checkpoint: a listed size that does not match the file
            fs, path = get_fs(newest)
            m = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
            m["files"]["trainer.json"]["size"] += 1
            fs.pipe_file(f"{path}/{MANIFEST}", json.dumps(m).encode())
            rerun = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
            (root / "run2.log").write_text(rerun.stdout + rerun.stderr)  # for a post-mortem
        tracker.end("FINISHED")
    finally:
        if garbage is not None:
            garbage.close()
        if fleet is not None:
            fleet.stop()
        try:
            sockets["plain"] = listening(plain.pid)
        finally:
            plain.kill()
            plain.wait()
    print(f"\nstudent scenario: killed with step-{killed_at:08d} newest, {len(plan)} of {len(ids)} prompts get "
          f"garbage, listening sockets {sockets}")
    return {"root": root, "cfg": cfg, "out": out, "killed_at": killed_at, "rerun": rerun, "parent": parent,
            "teacher_url": teacher_url,
            "child": child.run_id, "tracking_uri": tracker.tracking_uri, "sockets": sockets,
            "spoiled": list(garbage.spoiled), "run1_log": (root / "run1.log").read_text(),
            "issued": ids, "plan": plan}


def final_state(s) -> dict:
    return read_json(join(s["out"], f"step-{STEPS:08d}", "trainer.json"))


def test_sigkill_then_rerun_resumes_from_the_last_good_checkpoint(scenario):
    s = scenario
    assert s["rerun"].returncode == 0, s["rerun"].stderr[-4000:]
    assert CKPT_EVERY * 2 <= s["killed_at"] < STEPS and "student step" in s["run1_log"]
    err = s["rerun"].stderr
    bad = f"step-{s['killed_at']:08d}"
    # the wrong manifest is skipped with a warning naming it; the resume takes the checkpoint before it
    assert f"skipping checkpoint {s['out']}/{bad}: file 'trainer.json' has" in err, err[-3000:]
    assert f"at step {s['killed_at'] - CKPT_EVERY} (cursor {(s['killed_at'] - CKPT_EVERY) * BATCH}" in err
    steps_after = [int(x.split("/")[0]) for x in err.split("student step ")[1:]]
    assert steps_after == list(range(s["killed_at"] - CKPT_EVERY + 1, STEPS + 1))  # continued, not from scratch
    result = json.loads((s["root"] / "result.json").read_text())
    assert result["steps"] == STEPS and result["student_checkpoint"].endswith("/final")


def test_every_issued_sample_is_trained_or_dropped_exactly_once(scenario):
    state = final_state(scenario)
    ledger, dropped = state["ledger"]["ledger"], state["dropped"]
    assert state["step"] == STEPS and state["cursor"] == STEPS * BATCH
    assert len(ledger) == len(set(ledger))  # nothing trained twice
    assert not set(ledger) & set(dropped)  # nothing both trained and dropped
    assert set(ledger) | set(dropped) == set(scenario["issued"])  # nothing lost


def test_garbage_teacher_answers_are_dropped_counted_and_never_reach_the_gradient(scenario):
    from mlflow import MlflowClient

    from infra.models import load_model

    s = scenario
    state = final_state(s)
    expected = {sid for sid, prompt in s["issued"].items() if tuple(prompt) in s["plan"]}
    assert {k for k, _ in s["spoiled"]} == set(KINDS)  # every kind of garbage was served
    assert state["dropped"] == {sid: "teacher_bad_response" for sid in expected}
    assert 0 < len(expected) < len(s["issued"]) // 2
    result = json.loads((s["root"] / "result.json").read_text())
    teachers = result["teachers"]  # counters of the rerun (from its resume point on)
    resumed_cursor = (s["killed_at"] - CKPT_EVERY) * BATCH
    assert sum(t["dropped"] for t in teachers.values()) == sum(int(sid[1:9]) >= resumed_cursor for sid in expected)
    assert all(t["errors"] > 0 for t in teachers.values())
    # the loss of every logged step (both attempts) is finite, and so are the final weights
    client = MlflowClient(s["tracking_uri"])
    losses = client.get_metric_history(s["child"], "train/loss")
    assert {m.step for m in losses} == set(range(1, STEPS + 1))
    assert all(math.isfinite(m.value) for m in losses)
    final = load_model(result["student_dir"])
    assert all(bool(p.isfinite().all()) for p in final.parameters())


def test_one_mlflow_run_holds_both_attempts(scenario):
    from mlflow import MlflowClient

    s = scenario
    client = MlflowClient(s["tracking_uri"])
    runs = client.search_runs([client.get_run(s["parent"]).info.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["student", "student-faults"]  # no duplicate student run
    cursor = client.get_metric_history(s["child"], "train/cursor")
    # run 1 logged steps up to the kill, run 2 re-logged from its resume point: one run, every step present
    assert {m.step for m in cursor} == set(range(1, STEPS + 1))
    assert max(m.step for m in cursor if m.value == STEPS * BATCH) == STEPS
    assert len(cursor) > STEPS  # steps after the resume point were logged by both attempts, in the same run


def test_teacher_and_engine_servers_listen_on_loopback_only(scenario):
    socks = scenario["sockets"]
    rollout = [x for x in socks["student"] if "engine.server" in x[0]]
    servers = socks["teacher"] + socks["plain"] + rollout
    assert len(socks["teacher"]) >= 1 and len(socks["plain"]) >= 1 and rollout
    assert any("student.distill_main" in x[0] for x in socks["student"])  # the trainer itself was sampled too
    assert [x for x in servers if not is_loopback(x[1])] == []


def test_trainer_processes_listen_on_loopback_only(scenario):
    """A trainer's world of one rendezvouses in-process (no TCPStore on every interface) and its gloo sockets are
    on loopback (training/deepspeed_backend.py init_distributed); base, specialist and student trainers share it."""
    trainer = [x for x in scenario["sockets"]["student"] if "student.distill_main" in x[0]]
    assert trainer  # sampled while it trained (gloo's own peer listener, on loopback)
    assert [x for x in trainer if not is_loopback(x[1])] == []


def test_engine_host_setting_is_honoured(scenario):
    """`engine.host` is the bind address of launched teachers, and the registry's clients dial that address
    (the student then trained through them)."""
    assert {ip for _, ip, _ in scenario["sockets"]["teacher"]} == {ASKED_HOST}
    assert scenario["teacher_url"].startswith(f"http://{ASKED_HOST}:")
