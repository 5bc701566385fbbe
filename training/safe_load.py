"""Loading torch checkpoint files without running code: everything a resume reads back from storage goes through here.

A `.pt` file is a pickle, and unpickling with `torch.load(weights_only=False)` calls whatever the file names
(`os.system`, ...): a tampered storage bucket would run code on the trainer. `safe_torch_load` always uses
`weights_only=True` (tensors, dicts, lists, tuples, numbers, strings, None), plus only the classes given in
`allow`; anything else is refused with `UnsafeCheckpointError` naming the file, before any of it is built.

DeepSpeed's own `engine.load_checkpoint` unpickles with `weights_only=False`; `DeepSpeedBackend` routes it through
`safe_torch_load` with `DEEPSPEED_ALLOWED` (`training.deepspeed_backend`). Those are the only non-tensor classes its
checkpoints hold (found with `torch.serialization.get_unsafe_globals_in_checkpoint` over ZeRO 0-3 in fp32, bf16 and
fp16): plain state holders rebuilt by `__new__` + attribute assignment (the attributes themselves again restricted
to the safe set), and an Enum looked up by value. None of them runs code while it is built.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Iterable

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds (or claims to hold) Python objects outside the safe set; it was not loaded."""


def deepspeed_allowed() -> list:
    """The non-tensor classes DeepSpeed 0.19 writes into its ZeRO optimizer checkpoints (see the module doc)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str | Path, map_location: Any = None, allow: Iterable = ()) -> Any:
    """`torch.load(path, weights_only=True)` with the extra classes in `allow`; refuses anything else."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln or "global" in ln.lower()),
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds Python objects outside the safe set, and unpickling them could run "
            f"code ({detail[:300]}). Checkpoints are only loaded with torch.load(weights_only=True); if this file "
            "was written by an older Alloy, resume from a checkpoint written by this version (or start afresh)."
        ) from None
