"""A step's metrics read back to the host once: the losses return their metrics as detached 0-d tensors (as
torchtune's do), the trainers keep them on the device through the micro-steps of an optimizer step and turn them into
Python floats here, after the step, in one device→host copy per device.

Why: every `.item()` / `float(tensor)` on a CUDA tensor waits for the GPU to finish all the work queued before it;
inside a micro-step loop that stalls the host between the forward and the backward, so the GPU idles while the next
kernels are launched. Read back after the optimizer step, the host queues the whole step ahead of the GPU.
The floats are the same: each value is cast to float64 on the device (exact for float32 and bf16) before the copy,
and the trainers add them up as Python floats in the same order as before.
"""
from __future__ import annotations

from typing import Any

import torch


def host_floats(*metrics: dict[str, Any]) -> list[dict[str, float]]:
    """Each dict of `metrics` with its values as Python floats: 0-d (or one-element) tensors gathered per device and
    copied to the host in one transfer each; any other value through `float`. Same keys and order as given."""
    by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    out: list[dict[str, float]] = [{} for _ in metrics]
    for i, m in enumerate(metrics):
        for k, v in m.items():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((i, k, v.detach().reshape(()).to(torch.float64)))
                out[i][k] = 0.0  # a placeholder keeps the key's place
            else:
                out[i][k] = float(v)
    for items in by_device.values():
        for (i, k, _), value in zip(items, torch.stack([t for _, _, t in items]).tolist()):
            out[i][k] = value
    return out
