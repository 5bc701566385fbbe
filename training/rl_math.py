"""RL primitives both trainers' losses share (the specialists' PPO in `teachers/ppo_math.py`, the OPD student's in
`student/losses.py`): pure functions on tensors, no config objects, no I/O.

Conventions: padded ``(B, T)`` tensors, a boolean ``valid`` / 0-1 ``mask`` marking the tokens that count; padded
positions may hold garbage (inf, nan) and are removed with ``torch.where``, never by multiplying by the mask, so they
reach neither a value nor a gradient.
"""
from __future__ import annotations

import math

import torch

from training.logprobs import MAX_LOG_RATIO


def check_shapes(fn: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ValueError naming the first tensor of ``others`` whose shape differs from ``ref``'s (None: skipped)."""
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}")


def token_mean(x: torch.Tensor, valid: torch.Tensor, global_token_count: float | torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level aggregation: Σ_{valid} x / N, N = the number of valid tokens (at least 1), or
    ``global_token_count`` (the whole batch's tokens over every micro-batch and rank, so that the parts sum to the
    one-pass loss). ``weight`` (B, T), if given, scales each token's term (Σ_{valid} weight·x / N; see
    ``seq_mean_weights``). x, valid (B, T) → a 0-d tensor; no host read."""
    if weight is not None:
        check_shapes("token_mean", "x", x, weight=weight)
        x = x * weight.to(x.dtype)
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    if global_token_count is None:
        return total / valid.sum().clamp_min(1)  # a 0-d int tensor: the same float division, no host read
    if float(global_token_count) <= 0:
        raise ValueError(f"global_token_count must be > 0, got {float(global_token_count)}")
    return total / global_token_count


def seq_mean_weights(token_counts: list[int] | tuple[int, ...]) -> list[float]:
    """Per-sequence token weights that turn a token mean into a mean over sequences of each sequence's token mean
    (verl's ``seq-mean-token-mean``): with L_b the tokens of sequence b, N = Σ_b L_b and S the sequences with L_b > 0,

        w_b = N / (S · L_b)       (0 for an empty sequence),   so   Σ_b w_b · Σ_t ℓ_bt / N = (1/S) Σ_b (Σ_t ℓ_bt / L_b).

    Σ_b w_b·L_b = N, so the weighted loss keeps the token mean's normaliser (``global_token_count``) and splits over
    micro-batches and ranks exactly as it does. A 3-token answer then weighs as much as a 16-token one."""
    if any(int(n) < 0 for n in token_counts):
        raise ValueError(f"seq_mean_weights: token counts must be >= 0, got {list(token_counts)}")
    n, s = sum(int(x) for x in token_counts), sum(1 for x in token_counts if int(x) > 0)
    return [n / (s * int(x)) if int(x) > 0 else 0.0 for x in token_counts]


def truncated_ratio(logp_num: torch.Tensor, logp_den: torch.Tensor, clip: float | None = None) -> torch.Tensor:
    """A per-token importance weight, detached and truncated:

        w_t = min(exp(logp_num_t − logp_den_t), clip)        (no truncation when clip is None)

    computed as exp(min(Δ, MAX_LOG_RATIO, log clip)) so it never overflows. PPO's truncated importance sampling
    (numerator: the trainer's π_old, denominator: the rollout engine's log-probs; Yao et al. 2025) and the OPD
    student's correction for samples from an older student (numerator: the current student, denominator: the
    behaviour policy) are both this. Shapes: (B, T) → (B, T)."""
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    log_w = (logp_num.detach() - logp_den.detach()).clamp(max=MAX_LOG_RATIO)
    if clip is not None:
        log_w = log_w.clamp(max=math.log(clip))
    return torch.exp(log_w)
