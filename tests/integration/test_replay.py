"""A recorded PPO step replayed on the weights it started from reproduces its losses bit for bit on the CPU
(teachers/replay.py over the full rollout record, training/rollout_records.py).

A real specialist (DeepSpeed policy and critic, its own engine server, APRIL with deterministic rollouts) trains 3
steps with `specialists.record.full` and a checkpoint after every step; a fresh trainer resumes the step-2
checkpoint alone and replays step 3's record: the same policy and value losses as the run logged. A step recorded
on a trainer at another version is refused."""
from __future__ import annotations

import shutil

import pytest

from distill_fixtures import build_base
from domains.registry import load_domains
from infra.config import config_from_dict
from infra.storage import checkpoint_name
from infra.tracking import NoopTracker

pytestmark = pytest.mark.integration


def test_a_replayed_ppo_step_reproduces_its_recorded_losses(tmp_path):
    from teachers.replay import LOSSES, replay_step
    from teachers.specialist_main import build_specialist, run_specialist

    base = build_base(tmp_path / "base", ["reverse"], steps=40)
    cfg = config_from_dict({
        "run": {"name": "replay", "root": str(tmp_path)}, "domains": [{"name": "reverse"}],
        "eval": {"n_eval": 8, "max_new_tokens": 10},
        "specialists": {"steps": 3, "batch_size": 16, "checkpoint_every": 1, "keep_checkpoints": 3, "val_every": 0,
                        "critic_warmup_steps": 1, "deterministic_rollouts": True, "record": {"full": True}}})
    dom = load_domains(cfg)["reverse"]
    out = run_specialist(cfg, dom, str(base), f"file://{tmp_path}/spec", tmp_path / "w", NoopTracker())
    assert out["steps"] == 3

    # the checkpoint the third step started from, alone under a prefix of its own: what a resume restores
    (tmp_path / "at2").mkdir()
    shutil.copytree(tmp_path / "spec" / checkpoint_name(2), tmp_path / "at2" / checkpoint_name(2))
    trainer = build_specialist(cfg, dom, str(base), f"file://{tmp_path}/at2", tmp_path / "w2", NoopTracker(),
                               guarded=False)
    trainer.resume()
    got = replay_step(trainer, f"file://{tmp_path}/spec", 3)
    assert got["version"] == 2 and set(LOSSES) <= set(got["recorded"])
    for k in LOSSES:
        assert got["replayed"][k] == got["recorded"][k], (k, got)  # bit for bit, not approximately

    with pytest.raises(ValueError, match="step 2 updated weights version 1, but the trainer holds version 2"):
        replay_step(trainer, f"file://{tmp_path}/spec", 2)
    for b in trainer.backends:
        b.close()
