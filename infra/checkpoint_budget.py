"""How many bytes a run's checkpoints take on its storage, and whether they fit: `alloy run --dry-run` and `alloy
plan` refuse a config whose estimate exceeds the storage's free space. Pure arithmetic (no torch): the byte counts
take numbers, `free_bytes` takes its disk probe as an argument.

Per trained model of P parameters (b: bytes of its training dtype, 4 for fp32, 2 for bf16 / fp16):

    HF weights (hf/, best-hf/, final/)      P · b
    DeepSpeed state (…state/)               P · (b + o)    o = 12 for bf16 / fp16: fp32 master weights + Adam m, v
                                                           o =  8 for fp32: Adam m, v (the weights are the master)

(measured on the CPU with the tiny preset after one AdamW step: 14.3 B/param in bf16, 12.3 in fp32, the model
states and optimizer files of ZeRO 0-2 together, so ranks and ZeRO stages do not change the total).

What each trainer keeps under its storage prefix (training/checkpoints.py, `checkpoint_rule`):

    specialist, per domain   newest: policy hf/ + best-hf/ (validation on) + policy state + critic state
                             older:  hf/ + best-hf/ on a GPU (the states dropped), as the newest on the CPU
    student                  newest: hf/ + state;  older: hf/ on a GPU, as the newest on the CPU
    base                     no resumable checkpoint
    every trained stage      final/: the HF weights in the training dtype

    resume = newest + (keep − 1) · older             a trainer's step-* while it trains
    run = Σ_trainers final + Σ_{CPU trainers} resume    what stays (on a GPU step-* go once final/ is committed)
        + max over the stages of Σ_{trainers at once} (newest + resume on a GPU | newest on the CPU)
          (a new checkpoint is committed before the oldest is pruned, so for a moment a trainer holds one newest
          more; the specialists that train at once, or the student)
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # `TrainConfig.dtype` → bytes of one weight
FREE_BYTES_ENV = "ALLOY_STORAGE_FREE_BYTES"  # the storage's free bytes, instead of the disk's (see `free_bytes`)
GB = 1e9


def checkpoint_rule(keep: int | None, on_gpu: bool) -> tuple[int, bool]:
    """(checkpoints a trainer keeps, whether the older ones drop their DeepSpeed states) for the config value `keep`
    (`specialists.keep_checkpoints`, `distill.keep_checkpoints`; None: the default).

    On a GPU: 1 by default, and older ones (when more are asked for) keep only their HF weights: the fp32 master
    weights and Adam moments are 12 of a bf16 checkpoint's 14 bytes per parameter, GBs a round. On the CPU: 2, both
    whole, so a newest that fails verification falls back to a resumable one."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep_checkpoints must be >= 1 (the newest checkpoint is what a resume needs), got {keep}")
    return (keep if keep is not None else 1 if on_gpu else 2), on_gpu


def weights_bytes(params: float, dtype: str) -> int:
    """Bytes of one HF copy of `params` weights in `dtype` (fp32, bf16, fp16): P · b."""
    return int(params * _dtype_bytes(dtype))


def state_bytes(params: float, dtype: str) -> int:
    """Bytes of one DeepSpeed state of a model trained in `dtype`: P · (b + o), o = 12 (bf16, fp16) or 8 (fp32)."""
    b = _dtype_bytes(dtype)
    return int(params * (b + (8 if b == 4 else 12)))


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown training dtype {dtype!r}; choose one of {list(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TrainerBytes:
    """One trainer's checkpoints: `newest` (the resumable one), `older` (each older kept one), `keep`, `final`;
    `transient`: its step-* are deleted once final/ is committed (a slim trainer, on a GPU)."""
    name: str
    newest: int
    older: int
    keep: int
    final: int
    transient: bool = False

    @property
    def resume(self) -> int:
        """Bytes of its resumable step-* while it trains: newest + (keep − 1) · older."""
        return self.newest + (self.keep - 1) * self.older

    @property
    def stays(self) -> int:
        """Bytes under its prefix once it is done: final, plus its step-* unless they are transient."""
        return self.final + (0 if self.transient else self.resume)

    @property
    def in_flight(self) -> int:
        """What it adds while it trains, beyond `stays`: one newest more during a commit, plus its step-* when
        they are transient."""
        return self.newest + (self.resume if self.transient else 0)


def specialist_bytes(name: str, params: float, policy_dtype: str, critic_dtype: str, *, keep: int, slim: bool,
                     best: bool) -> TrainerBytes:
    """A PPO specialist: newest = hf/ (+ best-hf/ when it validates) + policy state + critic state (the critic: the
    policy's backbone with a value head, taken as P parameters); older = the HF weights alone when `slim`."""
    hf = weights_bytes(params, policy_dtype) * (2 if best else 1)
    newest = hf + state_bytes(params, policy_dtype) + state_bytes(params, critic_dtype)
    return TrainerBytes(name, newest, hf if slim else newest, keep, weights_bytes(params, policy_dtype), slim)


def student_bytes(params: float, dtype: str, *, keep: int, slim: bool) -> TrainerBytes:
    """The OPD student: newest = hf/ + state; older = hf/ alone when `slim`."""
    hf = weights_bytes(params, dtype)
    newest = hf + state_bytes(params, dtype)
    return TrainerBytes("student", newest, hf if slim else newest, keep, hf, slim)


def base_bytes(params: float, dtype: str) -> TrainerBytes:
    """The base SFT: final/ only (it keeps no resumable checkpoint)."""
    return TrainerBytes("base", 0, 0, 1, weights_bytes(params, dtype))


def run_bytes(trainers: list[TrainerBytes], at_once: int) -> tuple[int, int]:
    """(bytes that stay once the run is done, the most added while trainers train): Σ stays, and the larger of
    the `at_once` largest specialists' `in_flight` together and the student's (they train in different stages)."""
    stays = sum(t.stays for t in trainers)
    specialists = sorted((t.in_flight for t in trainers if t.name.startswith("specialist")), reverse=True)
    student = max((t.in_flight for t in trainers if t.name == "student"), default=0)
    return stays, max(sum(specialists[:max(at_once, 0)]), student)


def free_bytes(url: str, local_path: str | None, *, env: Mapping[str, str] | None = None,
               disk_usage: Callable[[str], object] = shutil.disk_usage) -> tuple[int | None, str]:
    """(free bytes of the run's storage, where the number comes from); (None, why) when there is none to check.

    `ALLOY_STORAGE_FREE_BYTES` wins when set, for any storage: it exists for tests (a small storage without a small
    disk) and for users who want a tighter budget than the disk's free space. Otherwise a local storage (`local_path`
    set) reports the free space of its directory or, before the first run creates it, of its nearest existing
    parent (`disk_usage(path).free`); a remote one (s3://…) is not checked."""
    env = os.environ if env is None else env
    raw = env.get(FREE_BYTES_ENV, "").strip()
    if raw:
        try:
            value = int(float(raw))
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{FREE_BYTES_ENV}={raw!r}: must be a number of bytes >= 0")
        return value, f"free by {FREE_BYTES_ENV}"
    if local_path is None:
        return None, "free space not checked: a remote storage"
    p = Path(local_path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(disk_usage(str(p)).free), f"free on {p}"


def budget_problem(need: int, free: int | None, stored: int, fields: list[str]) -> str | None:
    """Why `need` bytes do not fit (`free` bytes free plus `stored`, what this run already has under its own
    prefixes and would reuse or replace), naming the `fields` that size them; None when they fit or `free` is None."""
    if free is None or need <= free + stored:
        return None
    have = f"{fmt_bytes(free)} free" + (f" + {fmt_bytes(stored)} this run already stores" if stored else "")
    return (f"the run's checkpoints need about {fmt_bytes(need)} ({need} bytes), more than the storage has: {have} "
            f"({free + stored} bytes). Lower them with: {', '.join(fields)}; or point run.storage at a larger store")


def fmt_bytes(n: float) -> str:
    """`n` bytes for people: 1.5 GB, 240 MB, 12 kB, 7 B (powers of 1000)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------ a config's trainers


def run_trainers(cfg, params: float, on_gpu: bool, domains: list[str]) -> tuple[list[TrainerBytes], int]:
    """(the trainers of config `cfg` (an `infra.config.AlloyConfig`, read by attribute) with their checkpoint bytes,
    how many specialists train at once) for a model of `params` parameters trained on a GPU or the CPU: the base,
    a specialist per domain (`specialists.per_domain` merged in) unless `specialists.enabled` is false, the
    student."""
    out = [base_bytes(params, cfg.base.train.dtype)]
    sc = cfg.specialists
    if sc.enabled:
        for d in domains:
            own = sc.for_domain(d)
            keep, slim = checkpoint_rule(own.keep_checkpoints, on_gpu)
            out.append(specialist_bytes(f"specialist {d}", params, own.policy_train.dtype, own.critic_train.dtype,
                                        keep=keep, slim=slim, best=own.val_every > 0))
    keep, slim = checkpoint_rule(cfg.distill.keep_checkpoints, on_gpu)
    out.append(student_bytes(params, cfg.distill.train.dtype, keep=keep, slim=slim))
    at_once = len(domains) if sc.mode == "deployment" else min(sc.max_parallel, len(domains))
    return out, at_once if sc.enabled else 0


def budget_fields(cfg) -> list[str]:
    """The config fields that size a run's checkpoints, as a refusal names them."""
    model = "model.path (a smaller model)" if cfg.model.path else "model.preset"
    if not cfg.specialists.enabled:
        return ["distill.keep_checkpoints", model, "distill.train.dtype"]
    return ["specialists.keep_checkpoints", "distill.keep_checkpoints", "domains (a specialist each)",
            "specialists.max_parallel", model, "specialists.policy_train.dtype / critic_train.dtype",
            "distill.train.dtype"]
