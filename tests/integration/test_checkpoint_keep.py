"""Checkpoints sized for GPUs (training/checkpoints.py, training/session.py): how many a trainer keeps, older ones
without their DeepSpeed states (a trainer on a GPU), a resume that would fall back to such a one refused, step-*
deleted once final/ is committed; and final/ in the training dtype (bf16), read back by every reader of final/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from infra.storage import MANIFEST, checkpoint_name, join, list_checkpoints, to_local, verify_checkpoint
from training.checkpoints import (STATE_FILE, commit_checkpoint, drop_parts, drop_resume_checkpoints,
                                  restore_latest)

pytestmark = pytest.mark.integration

PARTS = ("state",)


def write_parts(step: int):
    """A trainer's parts in miniature: hf/ weights and a DeepSpeed-like state/ folder (optimizer file 6 bytes)."""
    def write(local: Path) -> None:
        (local / "hf").mkdir()
        (local / "hf" / "model.safetensors").write_text(f"weights {step}")
        (local / "state" / "state").mkdir(parents=True)
        (local / "state" / "state" / "optim_states.pt").write_text("adam-m")
    return write


def commit(tmp_path: Path, out: str, step: int, **kw) -> str:
    return commit_checkpoint(tmp_path / "work", out, step, 1, {"step": step}, write_parts(step), {"k": "v"}, **kw)


def names(out: str) -> list[str]:
    return [c.name for c in list_checkpoints(out) if c.complete]


def test_on_a_gpu_older_checkpoints_keep_only_their_weights(tmp_path):
    out = f"file://{tmp_path}/store"
    for step in (1, 2, 3):
        commit(tmp_path, out, step, keep_last=2, state_parts=PARTS, slim=True)
    assert names(out) == ["step-00000002", "step-00000003"]
    older, newest = (Path(to_local(join(out, n))) for n in names(out))
    assert (newest / "state" / "state" / "optim_states.pt").is_file()  # the newest always has it
    assert not (older / "state").exists() and (older / "hf" / "model.safetensors").is_file()
    m = json.loads((older / MANIFEST).read_text())
    assert sorted(m["files"]) == ["hf/model.safetensors", STATE_FILE] and m["meta"] == {"k": "v", "dropped": ["state"]}
    assert verify_checkpoint(join(out, "step-00000002"), deep=True) == (True, "ok")  # still a complete checkpoint
    assert drop_parts(join(out, "step-00000002"), m, PARTS) == 0  # already slim: nothing to do
    local, state, url = restore_latest(tmp_path / "work", out, 1, who="student", setting="distill.train.world_size",
                                       state_parts=PARTS, keep_setting="distill.keep_checkpoints")
    assert url.endswith("step-00000003") and state == {"step": 3} and (local / "state").is_dir()


def test_on_the_cpu_older_checkpoints_stay_whole(tmp_path):
    out = f"file://{tmp_path}/store"
    for step in (1, 2, 3):
        commit(tmp_path, out, step, keep_last=2, state_parts=PARTS, slim=False)
    assert names(out) == ["step-00000002", "step-00000003"]
    assert Path(to_local(join(out, "step-00000002")), "state", "state", "optim_states.pt").is_file()
    commit(tmp_path, out, 4, keep_last=1, state_parts=PARTS)
    assert names(out) == ["step-00000004"]


def corrupt_newest(out: str, step: int) -> None:
    """Bit rot in the newest checkpoint: same size, other bytes (a resume skips it and falls back)."""
    f = Path(to_local(join(out, checkpoint_name(step))), "hf", "model.safetensors")
    f.write_bytes(bytes(reversed(f.read_bytes())))


def test_a_resume_that_falls_back_to_a_slim_checkpoint_is_refused_naming_it(tmp_path):
    out = f"file://{tmp_path}/store"
    for step in (1, 2):
        commit(tmp_path, out, step, keep_last=2, state_parts=PARTS, slim=True)
    corrupt_newest(out, 2)
    with pytest.raises(ValueError) as exc:
        restore_latest(tmp_path / "work", out, 1, who="student", setting="distill.train.world_size",
                       state_parts=PARTS, keep_setting="distill.keep_checkpoints")
    msg = str(exc.value)
    assert f"cannot resume from {join(out, 'step-00000001')}" in msg and "state dropped" in msg
    assert "distill.keep_checkpoints" in msg and f"remove {out} to train student from its start" in msg
    # the same checkpoints kept whole (the CPU rule) fall back to the older one, as they always did
    whole = f"file://{tmp_path}/whole"
    for step in (1, 2):
        commit(tmp_path, whole, step, keep_last=2, state_parts=PARTS, slim=False)
    corrupt_newest(whole, 2)
    _, state, url = restore_latest(tmp_path / "work", whole, 1, who="student", setting="distill.train.world_size",
                                   state_parts=PARTS, keep_setting="distill.keep_checkpoints")
    assert url.endswith("step-00000001") and state == {"step": 1}


def test_once_final_is_committed_a_slim_trainer_deletes_its_step_checkpoints(tmp_path):
    from training.session import commit_final

    out = f"file://{tmp_path}/store"
    for step in (1, 2):
        commit(tmp_path, out, step, keep_last=2, state_parts=PARTS, slim=False)
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_text("final weights")
    commit_final(final, out, 2, {"stage": "student"})  # the CPU: step-* stay
    assert names(out) == ["step-00000001", "step-00000002"]
    url = commit_final(final, out, 2, {"stage": "student"}, drop_resume=True)  # a GPU
    assert names(out) == [] and verify_checkpoint(url) == (True, "ok")
    assert sorted(p.name for p in Path(to_local(out)).iterdir()) == ["final"]
    assert drop_resume_checkpoints(out) == []


def test_final_in_bf16_loads_in_every_reader(tmp_path, tiny_model_dir):
    """A bf16 trainer's save_hf (what final/ is) writes bf16 tensors, half the bytes of fp32; the readers of final/
    (infra.models.load_model, the engine's native loader, the critic's backbone) load it in their own dtype, with
    exactly the bf16 values."""
    from engine.native_model import load_native
    from infra.checkpoint_budget import weights_bytes
    from infra.models import load_model
    from infra.presets import preset_params
    from teachers.critic import ValueModel
    from training.deepspeed_backend import DeepSpeedBackend
    from training.ds_config import TrainSettings

    backend = DeepSpeedBackend(load_model(tiny_model_dir), TrainSettings(dtype="bf16", micro_batch_size=2))
    try:
        final = tmp_path / "final"
        backend.save_hf(final)
        expect = {k: v.detach().float().clone() for k, v in backend.module.state_dict().items()}
    finally:
        backend.close()
    weights = final / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")  # safetensors: 8-byte length + JSON header
    assert weights.stat().st_size - header == weights_bytes(preset_params("tiny"), "bf16")  # 105,024 × 2 bytes
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"

    hf = load_model(final)  # float32, as a trainer starts from it
    assert next(hf.parameters()).dtype == torch.float32
    got = hf.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expect.items() if k in got)
    native = load_native(final, dtype=torch.float32)  # the engine's loader casts tensor by tensor
    assert native is not None
    emb = native.state_dict()["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32 and torch.equal(emb, expect["model.embed_tokens.weight"])
    critic = ValueModel.from_pretrained(final)
    assert torch.equal(critic.backbone.state_dict()["embed_tokens.weight"], expect["model.embed_tokens.weight"])
