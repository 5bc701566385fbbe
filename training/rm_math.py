"""Reward-model math: the Bradley–Terry pairwise loss on scalar scores. Pure functions on tensors: no model, no
config, no I/O (the trainer is training/reward_main.py).

A reward model r(x, y) gives one scalar per (prompt, response). Under the Bradley–Terry model the probability that
a labeller prefers the chosen response y_c over the rejected y_r is σ(r(x, y_c) − r(x, y_r)); training maximises
its log-likelihood over the preference pairs (InstructGPT, Ouyang et al. 2022, eq. 1; TRL's `RewardTrainer`). With
a per-pair margin m (Llama 2's "margin" loss, TRL's `margin` column) the chosen score must beat the rejected one by
at least m before the loss flattens:

    loss = Σ_i −log σ(r_c,i − r_r,i − m_i) / N

N = the number of pairs (or `normalizer`: the global pair count over every rank divided by the world size, so that a
W-rank step averaged by DeepSpeed equals the 1-rank step on the same pairs, as `loss_normalizer` does for tokens).
−log σ(z) is computed as softplus(−z): finite for any z, with the exact gradient σ(z) − 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Bradley–Terry loss of one batch of pairs and its metrics.

    chosen, rejected: (B,) scores of the chosen and rejected responses (float; a trailing (B, 1) head output is
    accepted and squeezed); margin: (B,) or None (0). normalizer: the loss's denominator (None: B).

    Returns (loss, metrics): loss a 0-d tensor Σ_i softplus(−(r_c − r_r − m)) / N carrying the gradient; metrics,
    detached 0-d tensors (read back once per step, training/step_metrics.py):
      `loss`      the same value, detached;
      `accuracy`  the fraction of pairs with r_c > r_r (a tie counts as wrong), over this batch's B pairs;
      `margin`    the mean of r_c − r_r (the score gap itself, without the required margin m);
      `pairs`     B, as a float.
    """
    chosen, rejected = _flat(chosen, "chosen"), _flat(rejected, "rejected")
    if chosen.shape != rejected.shape:
        raise ValueError(f"bradley_terry_loss: chosen has shape {tuple(chosen.shape)} but rejected has "
                         f"{tuple(rejected.shape)}")
    if chosen.numel() == 0:
        raise ValueError("bradley_terry_loss: no pairs")
    gap = chosen - rejected
    z = gap
    if margin is not None:
        margin = _flat(margin, "margin").to(gap.dtype)
        if margin.shape != gap.shape:
            raise ValueError(f"bradley_terry_loss: margin has shape {tuple(margin.shape)} but chosen has "
                             f"{tuple(gap.shape)}")
        z = gap - margin
    n = float(gap.numel()) if normalizer is None else float(normalizer)
    if n <= 0:
        raise ValueError(f"bradley_terry_loss: normalizer must be > 0, got {n}")
    loss = F.softplus(-z).sum() / n
    with torch.no_grad():
        metrics = {"loss": loss.detach(), "accuracy": (gap > 0).to(gap.dtype).mean(), "margin": gap.mean(),
                   "pairs": torch.tensor(float(gap.numel()), dtype=gap.dtype, device=gap.device)}
    return loss, metrics


def _flat(x: torch.Tensor, name: str) -> torch.Tensor:
    """(B,) from (B,) or a head's (B, 1); anything else is a ValueError naming the argument."""
    if x.dim() == 2 and x.shape[1] == 1:
        return x[:, 0]
    if x.dim() != 1:
        raise ValueError(f"bradley_terry_loss: {name} must have shape (B,) or (B, 1), got {tuple(x.shape)}")
    return x
