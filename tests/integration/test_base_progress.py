"""The base SFT on two ranks, started the way `train_base` starts it (tasks/base.py `run_multi_rank`: torchrun under
`run_worker`): the task follows the steps the trainer reports as data, each step once (rank 0 alone reports), with
its metrics; the log keeps its lines for people."""
from __future__ import annotations

import json

import pytest

from infra.config import config_from_dict
from tasks.base import run_multi_rank
from tasks.base_worker import WORKER as BASE_WORKER
from tasks.worker_process import progress_path, torchrun_command
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
    result, log_path = tmp_path / "result.json", tmp_path / "logs" / "base.log"
    args = BASE_WORKER.flags(config=cfg_path, init=tiny_model_dir, out=tmp_path / "out", result=result)
    run_multi_rank(torchrun_command(BASE_WORKER.module, 2, args), log_path, STEPS)
    assert json.loads(result.read_text())["world_size"] == 2
    reported = read_events(progress_path(log_path))[0]
    assert [(e.step, e.total) for e in reported] == [(s, STEPS) for s in range(1, STEPS + 1)]
    assert all({"loss", "token_acc"} <= set(e.metrics) for e in reported)
    assert "base SFT" in log_path.read_text()
