"""Critic-based PPO math for the specialists: pure functions on tensors, no config objects, no I/O.

Conventions (every function):
- batch tensors are padded ``(B, T)``; ``mask (B, T)`` (bool or float) is 1 on response tokens that count,
  0 on padding and on tokens the trainer must ignore (prompt, tool output, stale partial-rollout tokens);
- losses return ``(loss, metrics)``: ``loss`` a scalar tensor (with grad), ``metrics`` a dict of python floats;
- padded positions may hold garbage (even inf/nan): they are removed with ``torch.where``, never by multiplying
  by the mask, so they can neither change a value nor poison a gradient.

References: PPO (Schulman et al. 2017, arXiv:1707.06347), GAE (Schulman et al. 2016, arXiv:1506.02438), dual-clip PPO
(Ye et al. 2020, arXiv:1912.09729), KL estimators (Schulman, "Approximating KL Divergence", 2020), truncated
importance sampling for the rollout/trainer mismatch (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL").
"""
from __future__ import annotations

from typing import Callable

import torch

from training.logprobs import MAX_LOG_RATIO
from training.rl_math import check_shapes, truncated_ratio

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_KINDS = ("k1", "k2", "k3")


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask != 0


def _zero_pad(mask: torch.Tensor, *xs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Replace padded entries by 0 with ``torch.where`` (whose backward gives padded entries an exact 0 gradient), so
    garbage in padding (inf/nan) can reach neither the loss nor, through 0·nan, a gradient."""
    valid = _valid(mask)
    return [None if x is None else torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in xs]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask over ``dim`` (all dims if None). Shapes: x, mask broadcastable, e.g. (B, T)."""
    w = mask.to(x.dtype)
    prod = torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device)) * w
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask / Σ mask over ``dim`` (all dims if None); 0 where the mask is empty (not nan)."""
    denom = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / denom.clamp_min(torch.finfo(x.dtype).tiny)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of x (scalar). Unbiased (Bessel n/(n−1)) by default, as verl does."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.to(x.dtype).sum()
    if unbiased:  # n / (n − 1) only where n > 1, without reading n on the host (no device sync)
        var = torch.where(n > 1, var * n / torch.where(n > 1, n - 1, torch.ones_like(n)), var)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  sum_all: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) over valid entries (mean/var over the whole batch). Padded positions → 0.

    Shapes: x, mask (B, T) → (B, T). With ``shift_mean=False`` the mean is added back (scale only).
    ``sum_all``: sums a scalar over the data-parallel ranks (each holding a shard of the batch); mean and var are
    then those of the whole global batch (two passes, as ``masked_var``), so W shards whiten as one batch would.
    """
    if sum_all is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        n = sum_all(mask.to(x.dtype).sum())
        mean = sum_all(masked_sum(x, mask)) / n.clamp_min(torch.finfo(x.dtype).tiny)
        var = sum_all(masked_sum((x - mean) ** 2, mask)) / n.clamp_min(torch.finfo(x.dtype).tiny)
        if n > 1:
            var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_valid(mask), out, torch.zeros((), dtype=x.dtype, device=x.device))


def explained_variance(y_pred: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var[y − y_pred] / Var[y] over valid entries (scalar). 1 = perfect critic, ≤ 0 = no better than a constant.

    Returns nan when Var[y] = 0 (undefined), rather than a misleading number.
    """
    var_y = masked_var(y, mask)
    ev = 1.0 - masked_var(y - y_pred, mask) / var_y
    return torch.where(var_y == 0, torch.full_like(ev, float("nan")), ev)  # no `if`: no device sync


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = −Σ_v p_v log p_v of softmax(logits), per position. Shapes: (B, T, V) → (B, T).

    Uses H = logsumexp(z) − Σ_v softmax(z)_v · z_v, which never forms log 0 (logits must be finite).
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (arXiv:1506.02438, eq. 16), vectorised over B, looping over T backwards.

        δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γ·λ·A_{t+1},   R_t = A_t + V_t

    where "t+1" is the next *valid* token: a masked position neither contributes (its reward and value are ignored)
    nor receives (its advantage and return are 0); the recursion passes through it unchanged, so interior holes
    (e.g. tool-output tokens) behave as if they were cut out. After the last valid token V = 0 and A = 0 (the
    trajectory is terminal). No whitening here: call ``masked_whiten`` on the result if wanted.

    Shapes: rewards, values, mask (B, T) → advantages (B, T), returns (B, T); no gradient flows.
    """
    check_shapes("compute_gae", "rewards", rewards, values=values, mask=mask)
    with torch.no_grad():
        rewards, values = rewards.detach(), values.detach()
        valid = _valid(mask)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            v = valid[:, t]
            advantages[:, t] = torch.where(v, adv_t, zero)
            next_value = torch.where(v, values[:, t], next_value)
            next_adv = torch.where(v, adv_t, next_adv)
        returns = torch.where(valid, advantages + values, zero)
    return advantages, returns


def compute_gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                     lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-Python reference for ``compute_gae``: per sequence, cut out the valid tokens, run the textbook
    recursion on that list, scatter the result back. Slow; exists so a test can check the vectorised version.
    """
    rows_r, rows_v, rows_m = rewards.tolist(), values.tolist(), mask.tolist()
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rows_r, rows_v, rows_m):
        idx = [t for t in range(len(m)) if m[t] != 0]
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[t]
            adv[t], ret[t] = next_adv, next_adv + v[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    as_t = lambda rows: torch.tensor(rows, dtype=values.dtype, device=values.device)  # noqa: E731
    return as_t(adv_rows), as_t(ret_rows)


def token_rewards(terminal_reward: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0, step_credit: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token reward: r_t = −kl_coef·kl_t on every valid token, plus the task reward R on the last valid token;
    with `step_credit` c (the parts of R a domain places on the tokens that earned them, `Domain.credit`), c_t on
    every valid token t and R − Σ_valid c on the last one:

        r_t = −kl_coef·kl_t + c_t + [t = last]·(R − Σ_s c_s)

    so Σ_t r_t is the same with or without step credit (with γ = 1 the return of the whole trajectory is R either
    way); only when its parts arrive moves, which lowers the variance of the early tokens' advantages. Credit on an
    invalid (masked) position goes to the last token with the rest.

    Shapes: terminal_reward (B,) the whole task reward R, mask (B, T), kl (B, T) per-token KL(π‖π_ref) estimate (see
    ``kl_estimator``), step_credit (B, T) or None → rewards (B, T), 0 on padding. A row with no valid token is an
    error (its reward would silently vanish).
    """
    if terminal_reward.shape != mask.shape[:1]:
        raise ValueError(f"token_rewards: terminal_reward has shape {tuple(terminal_reward.shape)}, "
                         f"expected ({mask.shape[0]},) to match mask {tuple(mask.shape)}")
    if kl is None and kl_coef != 0.0:
        raise ValueError(f"token_rewards: kl_coef={kl_coef} but kl is None")
    check_shapes("token_rewards", "mask", mask, kl=kl, step_credit=step_credit)
    valid = _valid(mask)
    empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"token_rewards: rows {empty} have no valid token in mask")
    dtype = terminal_reward.dtype if terminal_reward.is_floating_point() else torch.get_default_dtype()
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        rewards = torch.where(valid, -kl_coef * kl.detach().to(dtype), rewards)
    terminal = terminal_reward.detach().to(dtype)
    if step_credit is not None:
        placed = torch.where(valid, step_credit.detach().to(dtype), torch.zeros((), dtype=dtype))
        rewards = rewards + placed
        terminal = terminal - placed.sum(dim=1)
    T = mask.shape[1]
    last = T - 1 - valid.flip(dims=[1]).to(torch.int64).argmax(dim=1)  # (B,) index of the last valid token
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += terminal
    return rewards


def kl_estimator(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from log-probs of tokens sampled from π (Schulman 2020). With x = ref − logp:

        k1 = −x = logp − ref            (unbiased, high variance, can be < 0)
        k2 = ½·x²                       (biased, low variance, ≥ 0)
        k3 = exp(x) − x − 1             (unbiased, low variance, ≥ 0)

    Shapes: logp, ref_logp (B, T) → (B, T). For k3, x is clamped to ±20 so exp cannot overflow.
    """
    check_shapes("kl_estimator", "logp", logp, ref_logp=ref_logp)
    x = ref_logp - logp
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x ** 2
    if kind == "k3":
        x = x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(x) - x - 1.0
    raise ValueError(f"kl_estimator: kind={kind!r}; valid kinds are {list(KL_KINDS)}")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
             global_token_count: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    - ``token_mean``: Σ_{b,t} mask·ℓ / N, N = Σ mask (or ``global_token_count``). Every token weighs the same, so a
      long sub-trace counts more than a short one (docs/architecture.md, "Critic-based PPO"). With data
      parallelism, pass the number of valid tokens over all ranks as ``global_token_count``: each rank's loss is
      then its share and the ranks' losses (and gradients) sum to the single-rank loss. (The DP all-reduce
      averages gradients, so multiply by world size.)
    - ``seq_mean_token_sum``: mean over rows of Σ_t mask·ℓ (rows without tokens count as 0).
    - ``seq_mean_token_mean``: mean over non-empty rows of (Σ_t mask·ℓ / Σ_t mask).
    """
    check_shapes("agg_loss", "loss_mat", loss_mat, mask=mask)
    if global_token_count is not None and mode != "token_mean":
        raise ValueError(f"agg_loss: global_token_count only applies to mode='token_mean', got mode={mode!r}")
    if mode == "token_mean":
        if global_token_count is None:
            return masked_mean(loss_mat, mask)
        if float(global_token_count) <= 0:
            raise ValueError(f"agg_loss: global_token_count must be > 0, got {float(global_token_count)}")
        return masked_sum(loss_mat, mask) / global_token_count
    if mode == "seq_mean_token_sum":
        return masked_sum(loss_mat, mask, dim=1).mean()
    if mode == "seq_mean_token_mean":
        nonempty = _valid(mask).any(dim=1)
        return masked_mean(loss_mat, mask, dim=1)[nonempty].mean()
    raise ValueError(f"agg_loss: mode={mode!r}; valid modes are {list(AGG_MODES)}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_clip: float = 0.2, eps_clip_high: float | None = None, eps_clip_c: float | None = None,
                tis_weights: torch.Tensor | None = None, agg: str = "token_mean",
                global_token_count: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv:1707.06347 eq. 7), as a loss to minimise, per token:

        ρ_t = exp(logp_t − old_logp_t)
        ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε, 1 + ε_high))            ε_high = eps_clip_high or eps_clip
        dual clip (arXiv:1912.09729), only where A_t < 0:  ℓ_t ← min(ℓ_t, −A_t·c),   c = eps_clip_c > 1
        TIS (rollout/trainer mismatch): ℓ_t ← w_t·ℓ_t,  w = tis_weights (detached; see ``tis_weights``)

    then ``agg_loss(ℓ, mask, agg)``. Shapes: logp (B, T) with grad; old_logp, advantages, mask, tis_weights (B, T).
    Metrics (detached 0-d tensors, read back once per step: training/step_metrics.py): ``pg_loss``, ``clip_frac``
    (tokens where the clipped term is the active one), ``approx_kl`` (k1 mean of KL(π_old‖π) = mean(old_logp − logp)
    on tokens sampled from π_old), ``dual_clip_frac``, ``ratio_mean``.
    """
    check_shapes("policy_loss", "logp", logp, old_logp=old_logp, advantages=advantages, mask=mask,
                  tis_weights=tis_weights)
    if eps_clip <= 0:
        raise ValueError(f"policy_loss: eps_clip must be > 0, got {eps_clip}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_high <= 0:
        raise ValueError(f"policy_loss: eps_clip_high must be > 0, got {eps_clip_high}")
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"policy_loss: eps_clip_c must be > 1 (dual-clip bound on the ratio), got {eps_clip_c}")
    logp, old_logp, advantages, tis_weights = _zero_pad(mask, logp, old_logp.detach(), advantages.detach(),
                                                        None if tis_weights is None else tis_weights.detach())
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss_mat = torch.maximum(surr, surr_clipped)
    dual_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        dual_active = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_active, cap, loss_mat)
    if tis_weights is not None:
        loss_mat = loss_mat * tis_weights
    loss = agg_loss(loss_mat, mask, agg, global_token_count)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac": masked_mean((surr_clipped > surr).to(logp.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "dual_clip_frac": masked_mean(dual_active.to(logp.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               value_clip: float | None = 0.2, agg: str = "token_mean",
               global_token_count: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss (PPO2 / verl form), INCLUDING the factor ½:

        v_clip_t = clip(v_t, v_old_t − c, v_old_t + c)
        ℓ_t = ½ · max((v_clip_t − R_t)², (v_t − R_t)²)            (c = value_clip; None → ½·(v_t − R_t)²)

    then ``agg_loss(ℓ, mask, agg)``. Shapes: values (B, T) with grad; old_values, returns, mask (B, T).
    Metrics (detached 0-d tensors): ``vf_loss``, ``vf_clip_frac`` (tokens where the clipped branch is the larger
    one), ``explained_variance`` (of returns by values; nan if the returns are constant), ``value_mean``.
    """
    check_shapes("value_loss", "values", values, old_values=old_values, returns=returns, mask=mask)
    values, old_values, returns = _zero_pad(mask, values, old_values.detach(), returns.detach())
    unclipped = (values - returns) ** 2
    if value_clip is None:
        clipped = unclipped
    else:
        if value_clip <= 0:
            raise ValueError(f"value_loss: value_clip must be > 0 or None, got {value_clip}")
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (v_clip - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(clipped, unclipped), mask, agg, global_token_count)
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clip_frac": masked_mean((clipped > unclipped).to(values.dtype), mask),
            "explained_variance": explained_variance(values, returns, mask),
            "value_mean": masked_mean(values, mask),
        }
    return loss, metrics


def tis_weights(train_old_logp: torch.Tensor, rollout_logp: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling weights for the rollout-engine/trainer mismatch (per token, detached):

        w_t = min(exp(logp_train_old_t − logp_rollout_t), clip)

    The tokens were sampled by the rollout engine (whose numerics differ from the trainer's); w re-weights them
    towards the trainer's π_old. Computed as exp(min(Δ, log clip)) so it never overflows.
    Shapes: train_old_logp, rollout_logp (B, T) → w (B, T), no grad. Multiply into the per-token loss (``policy_loss``).
    """
    check_shapes("tis_weights", "train_old_logp", train_old_logp, rollout_logp=rollout_logp)
    if clip <= 0:
        raise ValueError(f"tis_weights: clip must be > 0, got {clip}")
    return truncated_ratio(train_old_logp, rollout_logp, clip)


def mask_offpolicy(mask: torch.Tensor, token_version: torch.Tensor, current_version: int, max_lag: int) -> torch.Tensor:
    """Drop tokens generated by a policy more than ``max_lag`` versions old (APRIL resumed partial rollouts).

        mask'_t = mask_t · [current_version − token_version_t ≤ max_lag]

    Shapes: mask (B, T) bool/float, token_version (B, T) int (policy version that sampled each token) → (B, T),
    same dtype as mask. A valid token newer than ``current_version`` is a bookkeeping bug and raises.
    """
    check_shapes("mask_offpolicy", "mask", mask, token_version=token_version)
    if max_lag < 0:
        raise ValueError(f"mask_offpolicy: max_lag must be >= 0, got {max_lag}")
    valid = _valid(mask)
    lag = current_version - token_version
    if bool((valid & (lag < 0)).any()):
        bad = (valid & (lag < 0)).nonzero()[0].tolist()
        raise ValueError(f"mask_offpolicy: token_version at (row, t)={tuple(bad)} is "
                         f"{int(token_version[bad[0], bad[1]])} > current_version={current_version}")
    keep = lag <= max_lag
    return torch.where(keep, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
