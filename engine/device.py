"""Where the embedded engine runs: the `--device` / `--dtype` / `--mem-fraction-static` values of
`python -m engine.server`, checked and resolved by `infra.devices` (auto: CUDA in bfloat16 when torch sees a GPU,
else CPU in float32), and the CUDA memory budget of a server that shares its GPU with others (SGLang's
`mem_fraction_static`)."""
from __future__ import annotations

import contextlib

import torch

from infra.devices import ALIASES as DTYPE_ALIASES  # noqa: F401
from infra.devices import (DTYPE_CHOICES, DTYPES, DeviceError, check_device_name, dtype_name,  # noqa: F401
                           resolve_device, resolve_dtype)

GB = 1e9


UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -11}


def logprob_tolerance(dtype: str, num_layers: int, max_abs_logit: float) -> float:
    """How far a model's log-probs computed in `dtype` may be from a float32 reference: each decoder layer adds two
    residual updates rounded to `dtype` (relative error ≤ u, the unit roundoff: 2⁻⁹ for bfloat16, 2⁻¹¹ for
    float16), the final norm and the LM head one more each, so |Δlogit| ≲ (2L + 2)·u·max(1, max|logit|); and
    log_softmax is 2-Lipschitz in the max norm (|Δ log p| ≤ 2·max|Δlogit|). float32 (other kernels, other
    summation orders): at least 1e-4. Used by the tests and bench/engine_cuda_check.py."""
    u = UNIT_ROUNDOFF[dtype]
    return max(1e-4, 2 * (2 * num_layers + 2) * u * max(1.0, max_abs_logit))


def check_mem_fraction(fraction: float | None) -> float | None:
    """None, or a fraction in (0, 1]; anything else raises DeviceError."""
    if fraction is None:
        return None
    if not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) <= 1.0:
        raise DeviceError(f"mem_fraction_static must be a fraction in (0, 1], got {fraction!r}")
    return float(fraction)


def enter_device(device: torch.device, threads: int | None, fraction: float | None) -> None:
    """Before a server loads its model: this process's torch threads (`threads`, None: torch's default), the current
    CUDA device and its allocator cap (`limit_memory`)."""
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    limit_memory(device, fraction)


@contextlib.contextmanager
def oom_as_error(device: torch.device, fraction: float | None):
    """A CUDA out-of-memory while loading becomes a RuntimeError that says what to change (`oom_message`)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(oom_message(device, fraction, e)) from None


def limit_memory(device: torch.device, fraction: float | None) -> None:
    """Cap this process's CUDA caching allocator at `fraction` of `device`'s memory (no-op on CPU / None)."""
    if fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def memory_budget_error(device: torch.device, fraction: float | None) -> str | None:
    """After load and warm-up: a message if the memory this process reserved on `device` exceeds its
    `mem_fraction_static` share of the GPU (the server must not start), else None."""
    if fraction is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    reserved = torch.cuda.memory_reserved(device)
    if reserved <= fraction * total:
        return None
    return (f"mem_fraction_static {fraction:g} of {device} ({total / GB:.2f} GB) allows {fraction * total / GB:.2f} GB, "
            f"but the model and warm-up need {reserved / GB:.2f} GB reserved: raise mem_fraction_static (the "
            "placement plan's share of this GPU) or serve a smaller model")


def oom_message(device: torch.device, fraction: float | None, err: BaseException) -> str:
    """A CUDA out-of-memory error while loading, rewritten to name the memory fraction (when one was set)."""
    if fraction is None or device.type != "cuda":
        return f"{type(err).__name__}: {err}"
    total = torch.cuda.get_device_properties(device).total_memory
    return (f"out of CUDA memory under mem_fraction_static {fraction:g} of {device}: allowed "
            f"{fraction * total / GB:.2f} GB, reserved {torch.cuda.memory_reserved(device) / GB:.2f} GB when the "
            f"allocation failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")


def memory_info(device: torch.device) -> dict:
    """Peak/current CUDA memory of this process on `device` for /get_server_info ({} on CPU)."""
    if device.type != "cuda":
        return {}
    return {"cuda_max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_memory_reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "cuda_max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "cuda_total_memory_bytes": int(torch.cuda.get_device_properties(device).total_memory),
            "cuda_device_uuid": str(torch.cuda.get_device_properties(device).uuid)}  # weight sync: same GPU?
