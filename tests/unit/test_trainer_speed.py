"""What makes a trainer fill a GPU, checked on the CPU: the fused-AdamW choice (pure), SDPA attention for every
trained model, metrics read back in one transfer per optimizer step."""
from __future__ import annotations

import pytest

from training.ds_config import adamw_kwargs

pytestmark = pytest.mark.unit


def test_fused_adamw_on_cuda_only():
    assert adamw_kwargs("cuda") == {"fused": True}
    assert adamw_kwargs("cpu") == {} and adamw_kwargs("meta") == {}  # the CPU path as it was
    # the optimizer offloaded to the host by ds_config_overrides: its states live where the fused kernel does not run
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert adamw_kwargs("cuda", offloaded) == {}
    assert adamw_kwargs("cuda", {"zero_optimization": {"offload_optimizer": {"device": "none"}}}) == {"fused": True}
    assert adamw_kwargs("cuda", {"zero_optimization": {"stage": 3}}) == {"fused": True}


def test_host_floats_reads_tensors_back_as_the_same_floats():
    import torch

    from training.step_metrics import host_floats

    a = {"loss": torch.tensor(0.1, dtype=torch.float32), "n": 3, "bf": torch.tensor(1.0078125, dtype=torch.bfloat16)}
    b = {"kl": torch.tensor([2.5], dtype=torch.float64), "lr": 1e-3}
    got = host_floats(a, b)
    assert got == [{"loss": torch.tensor(0.1).item(), "n": 3.0, "bf": 1.0078125}, {"kl": 2.5, "lr": 1e-3}]
    assert [list(d) for d in got] == [["loss", "n", "bf"], ["kl", "lr"]]  # keys keep their order
    assert all(type(v) is float for d in got for v in d.values()) and host_floats() == []


def test_base_sft_step_perf_from_train_sft_metrics():
    from types import SimpleNamespace

    from training.base_main import perf_metrics

    m = {"forward_tokens": 100.0, "train_flops": 4e12, "step_s": 2.0}
    cpu = SimpleNamespace(world_size=2, peak_tflops=None)
    assert perf_metrics(m, cpu) == {"perf/train_tokens_per_s": 100.0}  # 2 ranks · 100 / 2 s; no MFU on the CPU
    gpu = SimpleNamespace(world_size=2, peak_tflops=1.0)  # 4e12 FLOPs in 2 s on a 1 TFLOP/s card: twice its peak
    assert perf_metrics(m, gpu) == {"perf/train_tokens_per_s": 100.0, "perf/mfu": 2.0}
    assert perf_metrics({}, gpu) == {}


def test_trained_models_attend_with_sdpa(tmp_path):
    """The policy, the critic's backbone and the student load with torch's scaled_dot_product_attention (flash /
    memory-efficient kernels on a GPU, in bf16): transformers' default wherever the architecture supports it, which
    every `infra.models` architecture does. A default that changed would show here."""
    from infra.models import ARCHS, init_model_dir, load_model
    from teachers.critic import ValueModel

    for arch in ARCHS:
        d = init_model_dir("tiny", tmp_path / arch, arch=arch,
                           **({} if arch == "llama" else {"tokenizer": "bpe", "train_text": [__file__]}))
        assert load_model(d).config._attn_implementation == "sdpa", arch
        assert ValueModel.from_pretrained(d).backbone.config._attn_implementation == "sdpa", arch
