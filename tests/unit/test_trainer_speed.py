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
