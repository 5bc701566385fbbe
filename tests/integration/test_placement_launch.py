"""GPU placement reaches the real processes (CPU: embedded servers, no CUDA needed): with `resources.gpus_per_node`
set, teacher servers launched by `start_teachers`, trainer processes launched by `run_worker` in a held lane, and the
rollout server each trainer starts through `PolicyServer.for_engine` get the CUDA_VISIBLE_DEVICES of their plan
entry (read back from the live processes with psutil)."""
from __future__ import annotations

import json
import sys
import textwrap
import threading

import psutil
import pytest

from infra.config import config_from_dict
from infra.placement import make_plan
from tasks.gpu_lanes import server_placements, trainer_lane
from tasks.teachers import start_teachers
from tasks.worker_process import WorkerCommand, progress_path, run_worker
from training.progress_events import read_events

pytestmark = pytest.mark.integration

DOMAINS = ["reverse", "max_list"]

# What a trainer does with its placement: start its rollout server the way training/session.py does, then record its
# own CUDA_VISIBLE_DEVICES and the live server's (environment and argv) before stopping it.
PROBE = textwrap.dedent("""
    import json, os, sys
    import psutil
    from infra.config import EngineConfig
    from engine.launcher import Supervisor
    from training.policy_server import PolicyServer
    work, model = sys.argv[1], sys.argv[2]
    with Supervisor(work + "/logs") as sup:
        PolicyServer.for_engine(EngineConfig(), sup, "policy", model, work + "/server")
        proc = psutil.Process(sup.status()[0]["pid"])
        out = {"trainer": os.environ.get("CUDA_VISIBLE_DEVICES"), "server": proc.environ().get("CUDA_VISIBLE_DEVICES"),
               "server_cmd": proc.cmdline(), "fraction": os.environ.get("ALLOY_GPU_MEM_FRACTION")}
    from training.progress_events import report
    report(1, 1)
    open(work + "/probe.json", "w").write(json.dumps(out))
""")


def test_launched_processes_get_their_planned_gpus(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node's GPUs 4-7 are the plan's 0-3
    monkeypatch.setenv("ALLOY_LANE_DIR", str(tmp_path / "lanes"))
    cfg = config_from_dict({"domains": [{"name": d} for d in DOMAINS], "resources": {"gpus_per_node": 4},
                            "specialists": {"max_parallel": 2}})
    # the plan (tests/unit/test_placement.py derives such plans by hand): specialist trainers on GPUs 0 and 1, their
    # rollout servers on 2 and 3; teachers reverse → 2, max_list → 3 (beside the student on 0 and its rollout on 1)
    plan = make_plan(cfg, 4)
    assert [(p.name, p.kind, p.gpus) for p in plan.processes if p.stage in ("specialists", "teachers")] == [
        ("lane-0", "trainer", (0,)), ("lane-0", "rollout", (2,)), ("lane-1", "trainer", (1,)),
        ("lane-1", "rollout", (3,)), ("reverse", "teacher", (2,)), ("max_list", "teacher", (3,))]

    # two trainers at once, each in its own lane (held as in tasks/specialist.py), each starting its rollout server
    works = [tmp_path / f"t{i}" for i in range(2)]
    cmds = [WorkerCommand([sys.executable, "-c", PROBE, str(w), str(tiny_model_dir)]) for w in works]
    errors: list[BaseException] = []

    def run(cmd, work):
        try:
            run_worker(cmd, work / "trainer.log", 1, work.name)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with trainer_lane(cmds[0], cfg, "specialists") as a, trainer_lane(cmds[1], cfg, "specialists") as b:
        threads = [threading.Thread(target=run, args=(c, w)) for c, w in zip((a, b), works)]
        for t in threads:
            t.start()
        # teachers meanwhile, launched as the distill stage launches them
        fleet = start_teachers(DOMAINS, {d: str(tiny_model_dir) for d in DOMAINS}, str(tiny_model_dir),
                               log_dir=tmp_path / "teachers", engine_cfg=cfg.engine, teachers_cfg=cfg.teachers,
                               placements=server_placements(cfg, "teacher"))
        try:
            teacher_env = {s["name"]: psutil.Process(s["pid"]).environ().get("CUDA_VISIBLE_DEVICES")
                           for s in fleet.status()}
        finally:
            fleet.stop()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert teacher_env == {"teacher-reverse": "6", "teacher-max_list": "7"}
    probes = [json.loads((w / "probe.json").read_text()) for w in works]
    assert [(p["trainer"], p["server"]) for p in probes] == [("4", "6"), ("5", "7")]
    assert all("--base-gpu-id" not in p["server_cmd"] for p in probes)  # the embedded server takes no SGLang flags
    assert [p["fraction"] for p in probes] == [None, None]  # GPUs not shared: no allocator cap
    # each trainer's progress reached its own events file (the lane's command kept run_worker's variable)
    assert [[e.step for e in read_events(progress_path(w / "trainer.log"))[0]] for w in works] == [[1], [1]]


def test_shared_gpu_lanes_on_one_gpu_get_their_fractions(tiny_model_dir, tmp_path, monkeypatch):
    """resources.share_gpus on one GPU: two specialist lanes held at once, both on the node's GPU 3; each trainer
    (run in its lane) and its rollout server see that GPU, and the trainer gets its planned ALLOY_GPU_MEM_FRACTION
    (what init_distributed caps its allocator at)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("ALLOY_LANE_DIR", str(tmp_path / "lanes"))
    cfg = config_from_dict({"domains": [{"name": d} for d in DOMAINS],
                            "resources": {"gpus_per_node": 1, "share_gpus": True}, "specialists": {"max_parallel": 2}})
    plan = make_plan(cfg, 1)
    trainers = plan.trainers("specialists")
    assert len(trainers) == 2 and all(p.gpus == (0,) for p in plan.processes)
    works = [tmp_path / f"t{i}" for i in range(2)]
    cmds = [WorkerCommand([sys.executable, "-c", PROBE, str(w), str(tiny_model_dir)]) for w in works]
    with trainer_lane(cmds[0], cfg, "specialists") as a, trainer_lane(cmds[1], cfg, "specialists") as b:
        for c, w in zip((a, b), works):
            run_worker(c, w / "trainer.log", 1, w.name)
    probes = [json.loads((w / "probe.json").read_text()) for w in works]
    assert [(p["trainer"], p["server"]) for p in probes] == [("3", "3"), ("3", "3")]
    assert [p["fraction"] for p in probes] == [f"{t.mem_fraction:.2f}" for t in trainers]
