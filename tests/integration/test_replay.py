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


def cfg_dict(root) -> dict:
    return {"run": {"name": "replay", "root": str(root)}, "domains": [{"name": "reverse"}],
            "eval": {"n_eval": 8, "max_new_tokens": 10},
            "specialists": {"steps": 3, "batch_size": 16, "checkpoint_every": 1, "keep_checkpoints": 3,
                            "val_every": 0, "critic_warmup_steps": 1, "deterministic_rollouts": True,
                            "record": {"full": True}}}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 3-step specialist with the full record and a checkpoint after every step: (root, base, its summary)."""
    from teachers.specialist_main import run_specialist

    root = tmp_path_factory.mktemp("replay")
    base = build_base(root / "base", ["reverse"], steps=40)
    cfg = config_from_dict(cfg_dict(root))
    out = run_specialist(cfg, load_domains(cfg)["reverse"], str(base), f"file://{root}/spec", root / "w",
                         NoopTracker())
    assert out["steps"] == 3
    return root, base, out


def test_a_replayed_ppo_step_reproduces_its_recorded_losses(recorded, tmp_path):
    from teachers.replay import LOSSES, replay_step
    from teachers.specialist_main import build_specialist

    root, base, _ = recorded
    cfg = config_from_dict(cfg_dict(root))
    dom = load_domains(cfg)["reverse"]

    # the checkpoint the third step started from, alone under a prefix of its own: what a resume restores
    (tmp_path / "at2").mkdir()
    shutil.copytree(root / "spec" / checkpoint_name(2), tmp_path / "at2" / checkpoint_name(2))
    trainer = build_specialist(cfg, dom, str(base), f"file://{tmp_path}/at2", tmp_path / "w2", NoopTracker(),
                               guarded=False)
    trainer.resume()
    got = replay_step(trainer, f"file://{root}/spec", 3)
    assert got["version"] == 2 and set(LOSSES) <= set(got["recorded"])
    for k in LOSSES:
        assert got["replayed"][k] == got["recorded"][k], (k, got)  # bit for bit, not approximately

    with pytest.raises(ValueError, match="step 2 updated weights version 1, but the trainer holds version 2"):
        replay_step(trainer, f"file://{root}/spec", 2)
    for b in trainer.backends:
        b.close()


def test_the_final_evaluation_leaves_its_sample_beside_the_trained_rows(recorded, capsys):
    """The specialist's score (`select_and_commit`) records its first `record.sample` eval episodes (split "eval", at
    the last step, the selected policy's version): `read_rollouts(split="eval")` and `alloy rollouts list --split
    eval` read them; the trained rows (what replays and train_only read) are as before."""
    from alloy.cli import main
    from infra.chat import PromptRenderer
    from infra.models import load_tokenizer
    from training.rollout_records import read_rollouts, step_meta

    root, base, out = recorded
    cfg = config_from_dict(cfg_dict(root))
    dom = load_domains(cfg)["reverse"]
    ev = read_rollouts(f"file://{root}/spec", split="eval")
    assert list(ev.sample_id) == [f"eval-reverse-{i}" for i in range(4)] and (ev.step == 3).all()
    assert (ev.split == "eval").all() and (ev.weight_version == out["selected_step"]).all()
    render = PromptRenderer(load_tokenizer(base), cfg.model.chat_template)
    assert [list(p) for p in ev.prompt_ids] == [render.example_ids(dom, ex)
                                                for ex in dom.split("eval", 8, cfg.run.seed)[:4]]
    assert ev.reward.between(0, 1).all() and all(len(o) > 0 for o in ev.output_ids)
    assert step_meta(f"file://{root}/spec", 3, "eval")["scores"]["reverse"]["score"] == pytest.approx(out["score"])
    assert out["rollout_records"]["evals"]["files"] == 1 and out["rollout_records"]["files"] == 3
    train = read_rollouts(f"file://{root}/spec")
    assert sorted(set(train.step)) == [1, 2, 3] and (train.split == "train").all()
    assert main(["rollouts", "list", str(root / "spec"), "--split", "eval"]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[:6] for ln in out_lines[1:]] == \
        [["specialist", "eval", "reverse", "3", "4", f"{ev.reward.mean():.3f}"]]


def test_train_only_trains_from_the_records_with_no_engine_server(recorded, tmp_path):
    """`specialists.debug.train_only`: the specialist process trains on the recorded run's rollouts, one update per
    recorded step, and no engine server process serves its weights at any time (every process on the machine is
    watched for one with this run's paths); the same rewards per step as the recording; it commits final/."""
    import json
    import subprocess
    import sys
    import time

    import psutil

    root, base, out = recorded
    cfg_path = tmp_path / "cfg.json"  # JSON is YAML
    cfg_path.write_text(json.dumps(cfg_dict(root)))
    cmd = [sys.executable, "-m", "teachers.specialist_main", "--config", str(cfg_path), "--domain", "reverse",
           "--init", str(base), "--out", f"file://{tmp_path}/t", "--work-dir", str(tmp_path / "w"),
           "--result", str(tmp_path / "result.json"), "--set", f"specialists.debug.train_only=file://{root}/spec"]
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "log", "wb"), stderr=subprocess.STDOUT)
    servers = set()
    while proc.poll() is None:
        for p in psutil.process_iter(["pid", "cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if "engine.server" in line and (str(base) in line or str(tmp_path) in line):
                servers.add(p.info["pid"])
        time.sleep(0.05)
    assert proc.returncode == 0, (tmp_path / "log").read_text()[-3000:]
    assert not servers and not (tmp_path / "w" / "logs").exists()
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["steps"] == 3 and res["trained_from"] == f"file://{root}/spec"
    assert [h["reward"] for h in res["history"]] == pytest.approx([h["reward"] for h in out["history"]])
    assert "train_only" in (tmp_path / "log").read_text() and res["checkpoint"].endswith("final")
    from training.rollout_records import read_rollouts  # its final eval's sample (no trained rows recorded there)

    assert len(read_rollouts(f"file://{tmp_path}/t", split="eval")) == 4


def test_rollout_only_samples_and_records_without_training(tmp_path):
    """`specialists.debug.rollout_only`: every step samples and records (the full record here), and the committed
    policy is the base, weight for weight."""
    from safetensors.torch import load_file

    from teachers.specialist_main import run_specialist
    from training.rollout_records import read_rollouts

    base = build_base(tmp_path / "base", ["reverse"], steps=10)
    cfg = config_from_dict({**cfg_dict(tmp_path), "specialists": {**cfg_dict(tmp_path)["specialists"],
                                                                   "debug": {"rollout_only": True}}})
    out = run_specialist(cfg, load_domains(cfg)["reverse"], str(base), f"file://{tmp_path}/ro", tmp_path / "w",
                         NoopTracker())
    assert out["steps"] == 3 and all("policy_loss" not in h and "value_loss" not in h for h in out["history"])
    recs = read_rollouts(f"file://{tmp_path}/ro")
    assert sorted(set(recs.step)) == [1, 2, 3] and (recs.staleness == 0).all()
    before, after = load_file(base / "model.safetensors"), load_file(tmp_path / "ro" / "final" / "model.safetensors")
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
