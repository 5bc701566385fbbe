"""engine/device.py: resolving --device/--dtype and the mem_fraction_static budget check (CUDA calls faked)."""
from __future__ import annotations

import pytest
import torch

from engine import device as D

pytestmark = pytest.mark.unit


def test_resolve_device_and_dtype(monkeypatch):
    assert D.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.resolve_device("auto") == torch.device("cpu") and D.resolve_device(" AUTO ") == torch.device("cpu")
    with pytest.raises(D.DeviceError, match="no CUDA GPU"):
        D.resolve_device("cuda:1")
    for bad in ("gpu", "cuda:", "cuda:-1", "", "mps"):
        with pytest.raises(D.DeviceError, match="auto \\| cpu \\| cuda \\| cuda:N"):
            D.resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # always with an index: torch.cuda.set_device / set_per_process_memory_fraction refuse a bare "cuda" (the first
    # GPU run of the engine failed on exactly that)
    assert D.resolve_device("auto") == torch.device("cuda", 0) and D.resolve_device("cuda") == torch.device("cuda", 0)
    assert D.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(D.DeviceError, match="sees 2 CUDA GPU"):
        D.resolve_device("cuda:2")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert D.resolve_dtype("auto", cuda) == torch.bfloat16 and D.resolve_dtype("auto", cpu) == torch.float32
    assert D.resolve_dtype("float16", cpu) == torch.float16 and D.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(D.DeviceError, match="dtype must be one of auto"):
        D.resolve_dtype("float64", cpu)


def test_mem_fraction_checks_and_budget_message(monkeypatch):
    assert D.check_mem_fraction(None) is None and D.check_mem_fraction(1) == 1.0
    for bad in (0, -0.1, 1.01, "0.5"):
        with pytest.raises(D.DeviceError, match="mem_fraction_static must be a fraction"):
            D.check_mem_fraction(bad)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert D.memory_budget_error(cpu, 0.1) is None and D.memory_info(cpu) == {}
    assert D.memory_budget_error(cuda, None) is None

    class Props:
        total_memory = 80e9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9e9)
    assert D.memory_budget_error(cuda, 0.2) is None  # 9 GB of 16 allowed
    msg = D.memory_budget_error(cuda, 0.1)  # 9 GB of 8 allowed
    assert "mem_fraction_static 0.1" in msg and "allows 8.00 GB" in msg and "need 9.00 GB" in msg
    assert "mem_fraction_static 0.1" in D.oom_message(cuda, 0.1, RuntimeError("CUDA out of memory. Tried ..."))
