"""Model FLOPs utilisation (MFU) of a trainer: the model's training FLOPs per second over the card's peak (pure, no
torch: the benches import it too, bench/gpu_pipeline.py).

Training FLOPs of one token at context length T (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, Appendix B; the same
accounting as Chinchilla's and nanoGPT's `estimate_mfu`):

    F(T) = 6·N + 12·L·d·T

N the model's parameters (each tensor once: a tied embedding counts once, for its matmul as the LM head), L its
layers, d its hidden size (= heads × head dim). 6·N: a multiply-add (2 FLOPs) per parameter in the forward pass and
twice that in the backward pass; 12·L·d·T: the attention scores Q·Kᵀ and their product with V, 2·2·d·T FLOPs a layer
forward, ×3 with the backward. T is the row's own length (PaLM counts the full T, not the causal half); a batch of
rows of lengths T_i trains Σ_i T_i·F(T_i) FLOPs, padding not counted (it is work the trainer need not have done).
Passes without gradient (PPO's reference or old log-probs, the student's teacher scores) are not training FLOPs and
are left out, as MFU does by definition.

    MFU = FLOPs / seconds / (peak TFLOP/s × 10¹²)

against the card's dense bf16 tensor-core peak (`PEAK_TFLOPS`), whatever dtype the trainer runs in; None where the
peak is unknown (the CPU, a card not in the table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# dense bf16 tensor-core peak per card, TFLOP/s (vendor data sheets, SXM parts); an unknown card has no MFU
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "B200": 2250.0}

# HF config attribute names of the layer count and the hidden size, in the order tried (llama/qwen2, gpt2, others)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")


def card_peak(device_name: str | None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of the card named `device_name` (`torch.cuda.get_device_name()`, e.g.
    "NVIDIA H200"), or None for an unknown card or no name (the CPU)."""
    return next((v for k, v in PEAK_TFLOPS.items() if device_name and k in device_name), None)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs count needs of a model: parameters N, layers L, hidden size d."""

    params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, config: Any, params: int) -> "ModelShape":
        """From an HF config (`model.config`) and the model's parameter count; layers and hidden 0 (no attention
        term) when the config names neither."""
        def first(names: Sequence[str]) -> int:
            return next((int(getattr(config, n)) for n in names if isinstance(getattr(config, n, None), int)), 0)
        return cls(int(params), first(LAYER_FIELDS), first(HIDDEN_FIELDS))


def flops_per_token(shape: ModelShape, context: int) -> float:
    """F(T) = 6·N + 12·L·d·T: training FLOPs (forward + backward) of one token at context length T."""
    return 6.0 * shape.params + 12.0 * shape.layers * shape.hidden * context


def train_flops(shape: ModelShape, lengths: Sequence[int]) -> float:
    """Σ_i T_i·F(T_i): training FLOPs of one forward + backward pass over rows of lengths T_i (no padding)."""
    return float(sum(t * flops_per_token(shape, t) for t in lengths))


def mfu(flops: float | None, seconds: float | None, peak_tflops: float | None) -> float | None:
    """FLOPs / seconds / peak: the fraction of the card's peak the work used; None without a peak, time or work."""
    if not (flops and seconds and peak_tflops) or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def step_perf(shapes: Sequence[ModelShape], lengths: Sequence[int], seconds: float, peak_tflops: float | None,
              world_size: int = 1, passes: int = 1) -> dict[str, float | None]:
    """One optimizer step's (or one stage's) speed: `tokens_per_s`, the global batch's positions Σ T_i over
    `seconds`, and `mfu` per card: the models `shapes`, each trained `passes` times (forward + backward) on the rows
    `lengths` in `seconds`, their FLOPs split evenly over `world_size` ranks (one card each); `flops`, one card's
    share (to add up over steps)."""
    tokens = float(sum(lengths))
    flops = passes * sum(train_flops(s, lengths) for s in shapes) / world_size
    return {"tokens_per_s": tokens / seconds if seconds and seconds > 0 else None,
            "mfu": mfu(flops, seconds, peak_tflops), "flops": flops}
