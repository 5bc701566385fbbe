"""What a trainer's optimizer step is made of, as plain data and pure functions (this module imports no torch):
`TrainSettings` (optimizer, precision, parallelism), the DeepSpeed config built from them (`build_ds_config`),
the lr schedule (`lr_multiplier`), the loss divisor (`loss_normalizer`) and a rank's rows of a global batch
(`shard_for_rank`). `training.deepspeed_backend.DeepSpeedBackend` builds its engine from these.

Loss normalisation (token-level aggregation across ranks). The update we want is the gradient of the global
token mean  L = Σ_{all ranks, all micro-batches} ℓ_t / N,  N = the token count of the whole optimizer step.
DeepSpeed *averages* gradients over the W data-parallel ranks and divides each micro-batch loss by the G
gradient-accumulation steps, so the gradient it applies is  (1 / (W·G)) Σ_{r,g} ∇ loss_{r,g}.  Hence each rank
passes  loss_{r,g} = Σ_{t ∈ (r,g)} ℓ_t · W·G / N  =  Σ ℓ_t / loss_normalizer(N),  loss_normalizer(N) = N / (W·G).
With this, 1 rank and W ranks on the same global batch apply the same update (tests/integration proves it for
W = 2 under ZeRO-2 and ZeRO-3, and against plain torch), and `DeepSpeedBackend.all_reduce_mean(loss)` is the global
token-mean loss. Normalising by the *local* token count instead weighs a short rank's tokens more than a long rank's.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

T = TypeVar("T")

_DTYPES = ("fp32", "bf16", "fp16")
_SCHEDULES = ("constant", "cosine")


@dataclass
class TrainSettings:
    """Optimizer, precision and parallelism settings of one trainer (every field is plain data).

    lr, weight_decay, betas, eps: AdamW (decay applies to ≥2-D weights only, not to norms or biases).
    grad_clip: max global L2 norm of the gradient; 0 disables clipping.
    zero_stage: 0 (plain data parallel), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters).
    dtype: "fp32", "bf16" (fp32 master weights in the optimizer) or "fp16" (dynamic loss scaling).
    micro_batch_size: rows per rank per forward; grad_accum: micro-batches per optimizer step.
    warmup_steps: linear warm-up from lr/warmup_steps to lr; lr_schedule: "constant" or "cosine" (to 0 at
    total_steps, which cosine requires). Steps count optimizer updates, not micro-batches.
    gradient_checkpointing: activation checkpointing (HF `gradient_checkpointing_enable`, non-reentrant): the
    layers' activations are recomputed in the backward instead of kept, for models whose activations do not fit
    (the same loss and gradients, about a third more compute).
    micro_batch_tokens: None (a trainer splits a step its fixed way), or the most padded positions (rows × longest
    row) of one micro-batch: the trainers cut each step's rows with `training.batching.token_budget_groups` and
    backward each group through `DeepSpeedBackend.accumulate` (a step of any number of micro-batches; needs
    grad_accum 1).
    seed: seeds python/numpy/torch RNGs on every rank (same value on all ranks, so a global batch sampled with
    these RNGs is identical everywhere). ds_config_overrides: deep-merged last into the generated DeepSpeed
    config (offload, bucket sizes, ... at scale).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    zero_stage: int = 0
    dtype: str = "fp32"
    micro_batch_size: int = 16
    grad_accum: int = 1
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None
    gradient_checkpointing: bool = False
    micro_batch_tokens: int | None = None
    seed: int = 0
    ds_config_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"TrainSettings.{name}={getattr(self, name)!r}: {why}")

        if not self.lr > 0:
            raise bad("lr", "must be > 0")
        if self.weight_decay < 0:
            raise bad("weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad("betas", "must be two numbers in [0, 1)")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.eps > 0:
            raise bad("eps", "must be > 0")
        if self.grad_clip < 0:
            raise bad("grad_clip", "must be >= 0 (0 disables clipping)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise bad("zero_stage", "must be 0, 1, 2 or 3")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {list(_DTYPES)}")
        if self.micro_batch_size < 1:
            raise bad("micro_batch_size", "must be >= 1")
        if self.grad_accum < 1:
            raise bad("grad_accum", "must be >= 1")
        if self.warmup_steps < 0:
            raise bad("warmup_steps", "must be >= 0")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise bad("micro_batch_tokens", "must be >= 1 (or None)")
        if self.micro_batch_tokens is not None and self.grad_accum != 1:
            raise bad("grad_accum", "must be 1 with micro_batch_tokens (the token budget decides the micro-batches)")
        if self.lr_schedule not in _SCHEDULES:
            raise bad("lr_schedule", f"must be one of {list(_SCHEDULES)}")
        if self.lr_schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise bad("total_steps", f"cosine needs total_steps > warmup_steps ({self.warmup_steps})")


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_ds_config(settings: TrainSettings, world_size: int) -> dict:
    """The DeepSpeed config dict for `settings` on `world_size` data-parallel ranks (pure).

    train_batch_size = micro_batch_size × grad_accum × world_size (DeepSpeed checks this identity).
    The optimizer and scheduler are not in the dict: the backend passes torch objects (`training.deepspeed_backend`).
    """
    if world_size < 1:
        raise ValueError(f"build_ds_config: world_size={world_size} must be >= 1")
    s = settings
    cfg: dict[str, Any] = {
        "train_batch_size": s.micro_batch_size * s.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "gradient_clipping": float(s.grad_clip),
        "zero_optimization": {"stage": s.zero_stage},
        "bf16": {"enabled": s.dtype == "bf16"},
        # loss_scale 0 = dynamic loss scaling, the only sane fp16 default
        "fp16": {"enabled": s.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # we hand DeepSpeed a torch AdamW; ZeRO refuses "untested" optimizers without this flag
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
    }
    if s.zero_stage == 3:
        # lets engine.save_16bit_model work too; save_hf gathers through the consolidated state dict either way
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return _deep_merge(cfg, s.ds_config_overrides)


def adamw_kwargs(device_type: str, ds_config: dict | None = None) -> dict:
    """Extra `torch.optim.AdamW` keywords for parameters on `device_type` (pure): `{"fused": True}` on CUDA, where
    torch's fused AdamW updates every parameter in a few kernels instead of a loop of small ones per tensor (the
    for-each default launches ~10 kernels per parameter tensor); `{}` elsewhere (the CPU path stays as it was), and
    when `ds_config` offloads the optimizer (`zero_optimization.offload_optimizer.device` cpu/nvme): its states and
    master weights then live on the host, where the fused kernel does not run."""
    offload = ((ds_config or {}).get("zero_optimization") or {}).get("offload_optimizer") or {}
    if device_type != "cuda" or offload.get("device", "none") not in ("none", None):
        return {}
    return {"fused": True}


def lr_multiplier(step: int, warmup_steps: int, schedule: str, total_steps: int | None) -> float:
    """lr(step) / lr for the update with 0-based index `step` (pure).

    warm-up (step < W): (step + 1) / W, so the first update already moves;
    constant: 1;  cosine: ½ (1 + cos(π p)),  p = clamp((step − W) / (total_steps − W), 0, 1).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(f"lr_multiplier: cosine needs total_steps > warmup_steps, got {total_steps}")
        p = min(max((step - warmup_steps) / (total_steps - warmup_steps), 0.0), 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"lr_multiplier: unknown schedule {schedule!r}; choose one of {list(_SCHEDULES)}")


def loss_normalizer(global_tokens: float, world_size: int, grad_accum: int = 1) -> float:
    """The divisor for a rank's summed token loss: N / (W·G) (see module docstring for the derivation)."""
    if global_tokens <= 0:
        raise ValueError(f"loss_normalizer: global_tokens={global_tokens} must be > 0")
    return float(global_tokens) / (world_size * grad_accum)


def shard_for_rank(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """This rank's rows of a global batch: items[rank::world_size] (deterministic, equal sizes).

    Strided like torch's DistributedSampler, so every rank sees a similar mix of a sorted batch.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_for_rank: rank={rank} not in [0, world_size={world_size})")
    if len(items) % world_size:
        raise ValueError(f"shard_for_rank: global batch of {len(items)} rows does not split evenly over "
                         f"{world_size} ranks; make it a multiple of the world size")
    return list(items[rank::world_size])
