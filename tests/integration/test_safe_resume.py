"""Resume never unpickles code: a checkpoint in the storage bucket (moto S3) whose `.pt` file was replaced by a
pickle that runs `os.system` when loaded is refused at `load_state` with an error naming the file, and the payload's
marker file is never created. The same checkpoint untampered resumes. The planted files are the ones DeepSpeed reads
itself (model states, the ZeRO optimizer shard) and our RNG state, each re-hashed into the manifest as a tampering
bucket owner would; an RNG file in the old format (numpy arrays) is refused the same way, naming the file."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from training.deepspeed_backend import CHECKPOINT_TAG, DeepSpeedBackend, TrainSettings
from training.safe_load import UnsafeCheckpointError
from infra.storage import MANIFEST, checkpoint_name, get_fs, join, load_latest, read_json, save_checkpoint, write_json

pytestmark = pytest.mark.integration

_spec = importlib.util.spec_from_file_location("ds_rank_worker", Path(__file__).with_name("ds_rank_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SETTINGS = TrainSettings(lr=1e-2, micro_batch_size=4, zero_stage=2)  # ZeRO-2: an optimizer shard file as well
STATE = f"state/{CHECKPOINT_TAG}"
PLANTED = {"rng": f"{STATE}/rng_rank0.pt", "model_states": f"{STATE}/mp_rank_00_model_states.pt",
           "optim_states": f"{STATE}/zero_pp_rank_0_mp_rank_00_optim_states.pt"}


class Payload:
    """Unpickling this runs a shell command (what a tampered checkpoint would do): it touches `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def plant(ckpt_url: str, rel: str, data: bytes) -> None:
    """Overwrite `rel` in the committed checkpoint and fix its manifest entry, so the sha256 checks pass."""
    fs, path = get_fs(ckpt_url)
    fs.pipe(f"{path}/{rel}", data)
    manifest = read_json(join(ckpt_url, MANIFEST))
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_json(join(ckpt_url, MANIFEST), manifest)


@pytest.fixture
def bucket_checkpoint(tmp_path, s3_bucket):
    """A resumable DeepSpeed state after one training step, committed to the bucket; yields (prefix, ckpt url)."""
    backend = DeepSpeedBackend(worker.build_model(), SETTINGS)
    try:
        ids, attn, scored = worker.collate(worker.global_batch(1))
        loss = worker.summed_token_nll(backend(input_ids=ids, attention_mask=attn).logits, ids, scored)
        backend.step(loss / backend.loss_normalizer(float(scored.sum())))
        backend.save_state(tmp_path / "save" / "state")
    finally:
        backend.close()
    prefix = join(s3_bucket, "run")
    url = save_checkpoint(tmp_path / "save", join(prefix, checkpoint_name(1)), step=1)
    yield prefix, url


def resume(prefix: str, local: Path) -> DeepSpeedBackend:
    """What the trainers' resume does: the newest verified checkpoint from the bucket, then `load_state`."""
    assert load_latest(prefix, local) is not None
    backend = DeepSpeedBackend(worker.build_model(), SETTINGS)
    try:
        backend.load_state(local / "state")
    except BaseException:
        backend.close()
        raise
    return backend


def test_untampered_checkpoint_resumes(bucket_checkpoint, tmp_path):
    prefix, _ = bucket_checkpoint
    backend = resume(prefix, tmp_path / "resume")
    assert backend.global_step == 1
    backend.close()


@pytest.mark.parametrize("which", sorted(PLANTED))
def test_planted_pickle_is_refused_and_never_runs(bucket_checkpoint, tmp_path, which):
    prefix, url = bucket_checkpoint
    marker = tmp_path / "PWNED"
    payload = torch_bytes({"state": Payload(marker), "torch": torch.zeros(3)})
    # the payload is live: unpickled the unsafe way, it does run its command
    control = tmp_path / "control.pt"
    control.write_bytes(torch_bytes({"state": Payload(tmp_path / "control-ran")}))
    torch.load(control, weights_only=False)
    assert (tmp_path / "control-ran").exists()

    plant(url, PLANTED[which], payload)
    with pytest.raises(UnsafeCheckpointError, match=rf"refusing to load .*{Path(PLANTED[which]).name}.*system"):
        resume(prefix, tmp_path / "resume")
    assert not marker.exists(), "the planted payload ran during resume"


def test_old_format_rng_state_is_refused_naming_the_file(bucket_checkpoint, tmp_path):
    prefix, url = bucket_checkpoint
    legacy = {"python": __import__("random").getstate(), "torch": torch.get_rng_state(),
              "numpy": np.random.get_state()}  # what save_state wrote before: numpy arrays are not weights_only
    plant(url, PLANTED["rng"], torch_bytes(legacy))
    with pytest.raises(UnsafeCheckpointError, match=r"rng_rank0\.pt.*older Alloy"):
        resume(prefix, tmp_path / "resume")
