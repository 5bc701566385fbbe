"""`alloy teachers up --config`: the teacher servers launch as the run would launch them (engine section, and on a
node with GPUs the distill stage's placement plan); without a config, embedded CPU servers as before. Pure: the
specs and argv/environment are checked, no server starts (tests/e2e/test_teachers_cli.py runs real ones)."""
from __future__ import annotations

import pytest

from alloy.teachers_stack import CheckpointsError, teacher_specs
from engine.launcher import build_command, server_env
from infra.config import load_config
from infra.placement import make_plan

pytestmark = pytest.mark.unit


def test_without_a_config_embedded_cpu_servers_on_loopback():
    specs = teacher_specs({"reverse": "/ckpt/r"})
    s = specs["reverse"]
    assert (s.name, s.backend, s.host, s.env, s.options) == ("teacher-reverse", "embedded", "127.0.0.1", {}, {})
    env = server_env(s, {}, threads_per_server=1)
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


def test_with_a_config_and_gpus_each_teacher_gets_its_planned_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config("configs/smoke.yaml", ["engine.read_timeout_s=45"])
    ckpts = {d.name: f"/ckpt/{d.name}" for d in cfg.domains}
    specs = teacher_specs(ckpts, cfg, gpus=3)
    planned = {p.name: p.gpus for p in make_plan(cfg, 3).processes if p.kind == "teacher"}
    assert set(specs) == set(planned) == set(ckpts)
    for d, s in specs.items():
        assert s.env == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, planned[d]))}, (d, s.env)
        # the embedded server gets its planned share of its GPU, as SGLang would
        share = next(p.mem_fraction for p in make_plan(cfg, 3).processes if p.kind == "teacher" and p.name == d)
        assert s.options == {"read_timeout_s": 45.0, "mem_fraction_static": share} and s.model_path == ckpts[d]
        cmd = build_command(s, 31000)
        assert cmd[cmd.index("--read-timeout-s") + 1] == "45.0"
        assert cmd[cmd.index("--mem-fraction-static") + 1] == str(share)
        assert server_env(s, {})["CUDA_VISIBLE_DEVICES"] == s.env["CUDA_VISIBLE_DEVICES"]


def test_a_plan_that_does_not_fit_or_misses_a_domain_is_refused(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config("configs/smoke.yaml")
    ckpts = {d.name: f"/ckpt/{d.name}" for d in cfg.domains}
    with pytest.raises(CheckpointsError, match=r"(?s)--config: the placement plan does not fit on 1 GPU.*alloy plan"):
        teacher_specs(ckpts, cfg, gpus=1)
    with pytest.raises(CheckpointsError, match=r"no planned teacher for domain\(s\) \['other'\]"):
        teacher_specs({**ckpts, "other": "/ckpt/o"}, cfg, gpus=3)
    # no GPUs on this node: the config's engine section alone
    s = teacher_specs(ckpts, cfg, gpus=0)["reverse"]
    assert s.env == {} and s.options == {}  # the server's own default read timeout: no flag
