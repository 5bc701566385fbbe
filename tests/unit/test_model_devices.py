"""Every model on its device and dtype: what each stage asks `from_pretrained` for when the stage's device is a GPU
(faked on this CPU machine: torch is told it sees CUDA, and the loader records its arguments and stops), and that
the CPU defaults are unchanged. No stage may read a model as float32 onto the host when it runs on a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import infra.models as models
import teachers.critic as critic
from domains.registry import load_domain
from infra.models import init_model_dir

pytestmark = pytest.mark.unit


class _Asked(Exception):
    """Raised by the recording loader once it has seen what it was asked for."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch "sees" CUDA device 0; every HF load records (dtype, device_map) and stops."""
    asked: list[dict] = []

    def record(path, **kw):
        asked.append({"dtype": kw.get("dtype"), "device_map": kw.get("device_map")})
        raise _Asked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", record)
    monkeypatch.setattr(critic.AutoModel, "from_pretrained", record)
    return asked


def _on_gpu(call: dict, dtype: torch.dtype) -> None:
    assert call["device_map"] == {"": "cuda:0"}, f"read onto the host: {call}"
    assert call["dtype"] == dtype


def test_evaluation_loads_on_the_gpu_in_bf16(fake_gpu, tmp_path):
    from domains.evaluate import evaluate

    with pytest.raises(_Asked):
        evaluate(str(tmp_path), {}, 1, 0, "base")  # eval.device / eval.dtype: auto
    _on_gpu(fake_gpu[-1], torch.bfloat16)
    with pytest.raises(_Asked):
        evaluate(str(tmp_path), {}, 1, 0, "base", device="cuda:0", dtype="fp32")  # asked for: fp32, on the GPU
    _on_gpu(fake_gpu[-1], torch.float32)


def test_kl_reference_and_selected_policy_sit_beside_the_policy(fake_gpu, tmp_path):
    from training.session import frozen_copy

    policy = SimpleNamespace(settings=SimpleNamespace(dtype="bf16"), device=torch.device("cuda", 0))
    with pytest.raises(_Asked):
        frozen_copy(tmp_path, policy)
    _on_gpu(fake_gpu[-1], torch.bfloat16)


def test_trainers_read_weights_onto_their_gpu(fake_gpu, monkeypatch, tmp_path):
    """Policy, critic (and base/student) weights go straight to the rank's GPU in fp32 (DeepSpeed's master copy);
    ZeRO-3 reads on the host (each rank keeps a shard)."""
    import deepspeed.accelerator

    from training.deepspeed_backend import TrainSettings
    from training.session import train_device

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator",
                        lambda: SimpleNamespace(current_device_name=lambda: "cuda:0"))
    dev = train_device(TrainSettings(dtype="bf16"))
    assert dev == torch.device("cuda", 0)
    assert train_device(TrainSettings(dtype="bf16", zero_stage=3)) == torch.device("cpu")
    with pytest.raises(_Asked):
        models.load_model(tmp_path, device=dev)
    _on_gpu(fake_gpu[-1], torch.float32)
    with pytest.raises(_Asked):
        critic.ValueModel.from_pretrained(tmp_path, device=dev)
    _on_gpu(fake_gpu[-1], torch.float32)


def test_judge_predictions_on_the_gpu(fake_gpu, tmp_path):
    from teachers.judge_model import judge_predictions

    with pytest.raises(_Asked):
        judge_predictions(tmp_path, [])
    _on_gpu(fake_gpu[-1], torch.bfloat16)


def test_cpu_defaults_unchanged():
    from infra.devices import resolve_device, resolve_dtype

    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16  # the trainers' names
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        resolve_dtype("int4", torch.device("cpu"))


def test_bf16_evaluation_runs_on_the_cpu(tmp_path):
    """The dtype path end to end: a bf16 model generates and is scored on the CPU."""
    from domains.evaluate import evaluate

    d = init_model_dir("nano", tmp_path / "m")
    df = evaluate(str(d), {"reverse": load_domain("reverse")}, 4, 0, "base", max_new_tokens=4, device="cpu",
                  dtype="bf16")
    assert list(df.n_eval) == [4] and 0.0 <= float(df.score.iloc[0]) <= 1.0
    assert models.load_model(d, dtype=torch.bfloat16).dtype == torch.bfloat16
