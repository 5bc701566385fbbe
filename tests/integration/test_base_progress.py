"""The base SFT on two ranks, started the way `train_base` starts it (tasks/base.py `base_command` through the stage
launcher's `run_trainer`: torchrun under `run_worker`): the task follows the steps the trainer reports as data, each
step once (rank 0 alone reports), with its metrics; rank 0 commits `final/` and writes the result file; the log keeps
its lines for people."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from infra.config import config_from_dict
from infra.storage import join, verify_checkpoint
from tasks.base import base_command
from tasks.stage import run_trainer
from tasks.worker_process import progress_path
from training.progress_events import read_events

pytestmark = pytest.mark.integration

STEPS = 4


def test_two_rank_base_sft_reports_every_step_once(tiny_model_dir, tmp_path):
    cfg = config_from_dict({"run": {"name": "base-progress", "root": str(tmp_path / "runs")},
                            "domains": [{"name": "reverse"}], "tracking": {"enabled": False},
                            "base": {"steps": STEPS, "n_train_per_domain": 64, "log_every": 1,
                                     "train": {"world_size": 2, "micro_batch_size": 4}}})
    cfg_path = tmp_path / "cfg.json"  # JSON is YAML: the worker loads the very same config
    cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    ctx = SimpleNamespace(cfg=cfg, config_path=str(cfg_path), overrides=[], work_dir=tmp_path / "work")
    out = f"file://{tmp_path}/storage/base"
    result, log_path = tmp_path / "result.json", tmp_path / "logs" / "base.log"
    cmd = base_command(ctx, tiny_model_dir, out, result, None)
    assert "torch.distributed.run" in cmd and "--nproc_per_node=2" in cmd
    run_trainer(cmd, ctx, "base", log_path, STEPS, "base SFT")
    summary = json.loads(result.read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS and summary["wall_s"] > 0
    assert summary["checkpoint"] == join(out, "final") and verify_checkpoint(join(out, "final"), deep=True)[0]
    reported = read_events(progress_path(log_path))[0]
    assert [(e.step, e.total) for e in reported] == [(s, STEPS) for s in range(1, STEPS + 1)]
    assert all({"loss", "token_acc"} <= set(e.metrics) for e in reported)
    assert "2 rank(s)" in log_path.read_text() and f"base SFT step {STEPS}/{STEPS}" in log_path.read_text()


def test_two_rank_base_sft_stops_at_its_validation_score(tiny_model_dir, tmp_path):
    """`base.stop_at_score`: both ranks score their own copy of the weights every `val_every` steps and stop at the
    same step, the first whose validation mean reaches the target; the summary says where and why, and the progress
    events end there. brackets answers yes or no: the untrained model scores 0 at step 2, and once it has learnt the
    format it scores ~0.5-0.7 (step 4 here)."""
    cap = 400
    cfg = config_from_dict({"run": {"name": "base-stop", "root": str(tmp_path / "runs")},
                            "domains": [{"name": "brackets"}], "tracking": {"enabled": False},
                            "base": {"steps": cap, "n_train_per_domain": 256, "log_every": 10,
                                     "stop_at_score": 0.3, "val_every": 2, "val_n": 40,
                                     "train": {"world_size": 2, "micro_batch_size": 8, "lr": 3e-3}}})
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    ctx = SimpleNamespace(cfg=cfg, config_path=str(cfg_path), overrides=[], work_dir=tmp_path / "work")
    out = f"file://{tmp_path}/storage/base"
    result, log_path = tmp_path / "result.json", tmp_path / "logs" / "base.log"
    run_trainer(base_command(ctx, tiny_model_dir, out, result, None), ctx, "base", log_path, cap, "base SFT")
    summary = json.loads(result.read_text())
    steps, history = summary["steps"], summary["validation"]
    assert 0 < steps < cap and steps % 2 == 0, summary
    assert [h["step"] for h in history] == list(range(2, steps + 1, 2))
    assert len(history) >= 2 and history[-1]["mean"] >= 0.3 > max(h["mean"] for h in history[:-1])  # the first one
    assert set(history[-1]["domains"]) == {"brackets"}
    assert summary["stopped"] == f"validation mean {history[-1]['mean']:.3f} >= stop_at_score 0.3 at step {steps}"
    assert verify_checkpoint(join(out, "final"), deep=True)[0]
    reported = read_events(progress_path(log_path))[0]
    assert [e.step for e in reported] == list(range(1, steps + 1))  # rank 0 alone, up to where both stopped
    assert f"base SFT: stopped at step {steps} of {cap}" in log_path.read_text()
