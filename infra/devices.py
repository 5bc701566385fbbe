"""Where a model runs and in which dtype, one resolver for every stage (the engine's `--device` / `--dtype`, the
evaluation's `eval.device` / `eval.dtype`, the judge, the trainers' frozen copies): `auto` is CUDA in bfloat16 when
torch sees a GPU, else the CPU in float32. Names are checked here, with messages that say what is allowed."""
from __future__ import annotations

import re

import torch

DEVICES = "auto | cpu | cuda | cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the trainers' `TrainConfig.dtype` names
DTYPE_CHOICES = ("auto", *DTYPES)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class DeviceError(ValueError):
    """A device, dtype or memory fraction that cannot be used here; the message says why."""


def check_device_name(device: str) -> str:
    """`device` if it is one of auto, cpu, cuda, cuda:N (syntax only; no CUDA needed), else DeviceError."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device.strip().lower()):
        raise DeviceError(f"device must be one of {DEVICES}, got {device!r}")
    return device.strip().lower()


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The torch device for `device` (auto or None = cuda when `torch.cuda.is_available()`, else cpu), a CUDA device
    always with its index (`torch.cuda.set_device` and the allocator cap refuse a bare "cuda"). Asking for CUDA on
    a machine without it (or for a GPU index it does not have) raises DeviceError naming what torch sees."""
    if isinstance(device, torch.device):
        device = str(device)
    name = check_device_name("auto" if device is None else device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} asked for, but torch sees no CUDA GPU on this machine "
                              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu or auto")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"device {name!r} asked for, but torch sees {n} CUDA GPU(s) (cuda:0 … cuda:{n - 1}; "
                              "CUDA_VISIBLE_DEVICES renumbers them from 0)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The torch dtype for `dtype` (auto or None = bfloat16 on CUDA, float32 on CPU; fp32/bf16/fp16 as aliases)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise DeviceError(f"dtype must be one of {' | '.join(DTYPE_CHOICES)} (or {', '.join(ALIASES)}), got {dtype!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
