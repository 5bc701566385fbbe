"""One critic-based PPO update on a batch of finished samples (docs/architecture.md, "Critic-based PPO").
No HTTP, no config objects: the rollout side hands over `teachers.april.Sample`s and one terminal reward per sample.

Alignment (every per-token tensor here is (B, T), T = longest prompt+output of the batch, rows right-padded):

    input_ids[b]   = prompt_ids + output_ids + [pad] * k            (length P_b + O_b, then padding)
    position t     = the state "prefix input_ids[b, :t+1]"; its logits predict input_ids[b, t+1]
    mask[b, t]     = 1  iff  input_ids[b, t+1] is a trained response token, i.e. P_b − 1 ≤ t ≤ P_b + O_b − 2 and
                     the sample's loss_mask (1 per output token; empty = all ones) is 1 for output token t + 1 − P_b
    logp[b, t]     = log π(input_ids[b, t+1] | input_ids[b, :t+1])     (0 where t = T − 1)
    values[b, t]   = V(input_ids[b, :t+1])                             (value of the state that chooses token t+1)
    rollout_logprobs[b, t] = output_logprobs[t + 1 − P_b] on response positions, 0 elsewhere

So the last column is never valid, and the terminal reward sits on the position that predicts the last output token.

The update (`ppo_update`) is the textbook recipe:
    old_logp, old_values  = forward(policy), forward(critic)                 no grad, before any update
    r_t  = −kl_coef·KL_t (+ R on the last response token; with step credit c:  ppo_math.token_rewards (KL: k1 vs ref)
           c_t on each token, R − Σc on the last)
    A, G = GAE(r, old_values; γ, λ);  A ← whiten(A)                           ppo_math.compute_gae / masked_whiten
    per epoch: policy  ℓ = clipped surrogate · TIS(old_logp vs rollout) − entropy_coef·H   → policy.step
               critic  ℓ = ½·max((clip(v) − G)², (v − G)²)                                 → critic.step
Each epoch is one optimizer step on the whole local batch (in token-budget micro-batches when a backend's
settings have `micro_batch_tokens`: one forward and backward each, π_old / V_old then forwarded without grad).
Losses are summed over tokens and divided by `backend.loss_normalizer(N)`, N = valid tokens over all ranks, so
every token weighs the same on any world size and in any micro-batches.
Advantages are whitened with the statistics of the whole global batch (all ranks' shards), so W ranks on their
shards apply the update one rank applies to the global batch (`reduce_metrics` then gives the global metrics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from training.batching import MAX_BUCKETS, length_buckets, step_micro_batches
from training.logprobs import gather_log_softmax
from training.step_metrics import host_floats
from teachers import ppo_math
from teachers.april import Sample


@dataclass
class PPOBatch:
    """A padded batch (see the module docstring for the alignment). Shapes: (B, T) unless noted."""

    input_ids: torch.Tensor          # long
    attention_mask: torch.Tensor     # long, 1 on prompt+output tokens
    mask: torch.Tensor               # float, 1 where position t predicts a trained response token
    rollout_logprobs: torch.Tensor   # float, the engine's log-prob of the predicted token; 0 off-mask
    rewards: torch.Tensor | None     # (B,) float terminal task rewards, or None (pass them to ppo_update)
    sample_ids: list[str]
    step_credit: torch.Tensor | None = None  # float, the part of the reward placed on each token (`Sample.step_credit`)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())


def build_batch(samples: Sequence[Sample], pad_id: int, rewards: Sequence[float] | None = None) -> PPOBatch:
    """Right-pad prompt+output of each sample into a `PPOBatch` (alignment in the module docstring)."""
    if not samples:
        raise ValueError("build_batch: no samples")
    if rewards is not None and len(rewards) != len(samples):
        raise ValueError(f"build_batch: {len(rewards)} rewards for {len(samples)} samples")
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"build_batch: sample {i} ({s.sample_id}) has no prompt_ids (need at least BOS)")
        if not s.output_ids:
            raise ValueError(f"build_batch: sample {i} ({s.sample_id}) has no output_ids")
        if len(s.output_logprobs) != len(s.output_ids):
            raise ValueError(f"build_batch: sample {i} ({s.sample_id}) has {len(s.output_logprobs)} output_logprobs "
                             f"for {len(s.output_ids)} output_ids")
        if s.loss_mask and len(s.loss_mask) != len(s.output_ids):
            raise ValueError(f"build_batch: sample {i} ({s.sample_id}) has {len(s.loss_mask)} loss_mask entries "
                             f"for {len(s.output_ids)} output_ids")
        if s.step_credit and len(s.step_credit) != len(s.output_ids):
            raise ValueError(f"build_batch: sample {i} ({s.sample_id}) has {len(s.step_credit)} step_credit entries "
                             f"for {len(s.output_ids)} output_ids")
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    rollout = torch.zeros((B, T), dtype=torch.float32)
    credit = torch.zeros((B, T), dtype=torch.float32) if any(s.step_credit for s in samples) else None
    for b, s in enumerate(samples):
        P, O = len(s.prompt_ids), len(s.output_ids)
        input_ids[b, :P + O] = torch.tensor(list(s.prompt_ids) + list(s.output_ids), dtype=torch.long)
        attention_mask[b, :P + O] = 1
        # output token j sits at P + j and is predicted from position P + j − 1
        loss_mask = s.loss_mask if s.loss_mask else [1] * O
        mask[b, P - 1:P + O - 1] = torch.tensor(loss_mask, dtype=torch.float32)
        rollout[b, P - 1:P + O - 1] = torch.tensor(s.output_logprobs, dtype=torch.float32)
        if credit is not None and s.step_credit:
            credit[b, P - 1:P + O - 1] = torch.tensor(s.step_credit, dtype=torch.float32)
    rollout = torch.where(mask != 0, rollout, torch.zeros(()))
    reward_t = None if rewards is None else torch.tensor([float(r) for r in rewards], dtype=torch.float32)
    return PPOBatch(input_ids, attention_mask, mask, rollout, reward_t, [s.sample_id for s in samples], credit)


def _logits(model, batch: PPOBatch) -> torch.Tensor:
    out = model(input_ids=batch.input_ids.to(_device(model)), attention_mask=batch.attention_mask.to(_device(model)))
    return out.logits if hasattr(out, "logits") else out  # any float dtype: gather_log_softmax works in float32+


def _device(model) -> torch.device:
    if hasattr(model, "device") and isinstance(model.device, torch.device):
        return model.device
    return next(model.parameters()).device



def _rows(batch: PPOBatch, g: Sequence[int]) -> tuple[PPOBatch, torch.Tensor, int]:
    """(the rows `g` of `batch` cut to their longest row L, the row index tensor, L): a micro-batch or a bucket."""
    lengths = batch.attention_mask.sum(dim=1)
    rows = torch.tensor(list(g), dtype=torch.long)
    L = int(lengths[rows].max())
    return (PPOBatch(batch.input_ids[rows, :L], batch.attention_mask[rows, :L], batch.mask[rows, :L],
                     batch.rollout_logprobs[rows, :L], None, [batch.sample_ids[i] for i in g]), rows, L)


def _bucketed(batch: PPOBatch, fn, groups: list[list[int]] | None = None) -> tuple:
    """`fn(sub_batch)` → a tuple of (b, L) tensors (or None) on each length bucket of `batch`'s rows (cut to that
    bucket's longest row L), put back together as (B, T) tensors in row order, 0 past each bucket's L (padding only:
    every row ends within its bucket). One bucket: `fn(batch)`. Causal models see the same prefixes either way, so
    the values on real positions differ only by float rounding. `groups`: these row groups instead of
    `length_buckets` (token-budget micro-batches, forwarded without grad)."""
    if groups is None:
        groups = length_buckets(batch.attention_mask.sum(dim=1).tolist(), MAX_BUCKETS)
    if len(groups) <= 1:
        return fn(batch)
    B, T = batch.input_ids.shape
    parts = [fn(_rows(batch, g)[0]) for g in groups]
    order = torch.tensor([i for g in groups for i in g])
    inverse = torch.empty(B, dtype=torch.long)
    inverse[order] = torch.arange(B)

    def merge(k: int) -> torch.Tensor | None:
        if parts[0][k] is None:
            return None
        cat = torch.cat([torch.nn.functional.pad(p[k], (0, T - p[k].shape[1])) for p in parts])
        return cat[inverse.to(cat.device)]
    return tuple(merge(k) for k in range(len(parts[0])))


def _logp_and_entropy(model, batch: PPOBatch, with_entropy: bool, temperature: float = 1.0,
                      groups: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log-probs of input_ids[:, t+1] from logits[:, t] / temperature (last column 0), and optionally the
    entropy (B, T). The temperature is the sampling one: the engine reports log-probs of the tempered policy.
    Forwarded in length buckets, or in `groups` (`_bucketed`): 0 past the end of a row's bucket."""
    return _bucketed(batch, lambda sub: _logp_and_entropy_one(model, sub, with_entropy, temperature), groups)


def _logp_and_entropy_one(model, batch: PPOBatch, with_entropy: bool,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = _logits(model, batch)                                       # (B, T, V)
    ids = batch.input_ids.to(logits.device)
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1).unsqueeze(-1)  # (B, T, 1); last: unused
    # token chunks, no float32 copy of the logits (training/logprobs.py); the entropy comes from the same pass
    out = gather_log_softmax(logits, targets, temperature=temperature, with_entropy=with_entropy)
    lp, entropy = out if with_entropy else (out, None)
    logp = torch.cat([lp[:, :-1, 0], torch.zeros_like(lp[:, :1, 0])], dim=1)  # (B, T): last position predicts nothing
    return logp, entropy


def token_logprobs(backend_or_model, batch: PPOBatch, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log π(input_ids[:, t+1] | prefix) for a `DeepSpeedBackend` or a plain HF causal LM. Grad flows if
    enabled; read it with `batch.mask` (off-mask entries are log-probs of prompt tokens, or of padding tokens up to
    the longest row of the row's length bucket, 0 after it; last column 0)."""
    return _logp_and_entropy(backend_or_model, batch, with_entropy=False, temperature=temperature)[0]


DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


def is_deterministic(backend_or_model) -> bool:
    """Whether a train-mode forward equals the eval-mode one: no `nn.Dropout` with p > 0 and no dropout rate > 0 in
    the HF config (attention dropout is functional in HF models, so the config is the only place it shows)."""
    model = getattr(backend_or_model, "module", backend_or_model)
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return False
    cfg = getattr(model, "config", None)
    return not any(isinstance(getattr(cfg, f, None), (int, float)) and getattr(cfg, f) > 0 for f in DROPOUT_FIELDS)


def _values(critic, batch: PPOBatch, groups: list[list[int]] | None = None) -> torch.Tensor:
    """(B, T) values, forwarded in length buckets or `groups` (`_bucketed`: 0 past the end of a row's bucket)."""
    dev = _device(critic)
    return _bucketed(batch, lambda sub: (critic(input_ids=sub.input_ids.to(dev),
                                                attention_mask=sub.attention_mask.to(dev)).float(),), groups)[0]


def _budget_epoch(backend, batch: PPOBatch, groups: list[list[int]], loss_fn, summed: tuple[str, ...]) -> dict:
    """One optimizer step of `backend` over `batch` in token-budget micro-batches (`step_micro_batches`): per group,
    `loss_fn(sub_batch, rows, L)` → (loss normalised by the step's global token count, metrics), then
    `backend.accumulate`; the gradients add up to those of one pass over all rows. An empty group (rank padding)
    is a zero-loss pass over row 0. Metrics (device tensors, no read-back): the `summed` keys (losses, already
    shares of the global mean) summed over the groups, the others token-weighted means over this rank's tokens."""
    parts: list[tuple[dict, float]] = []  # (metrics, tokens) of each non-empty group
    for k, g in enumerate(groups):
        sub, rows, L = _rows(batch, g or [0])
        loss, m = loss_fn(sub, rows, L)
        backend.accumulate(loss if g else loss * 0.0, last=k == len(groups) - 1)
        if g:
            parts.append((m, float(sub.mask.sum())))
    n_all = sum(n for _, n in parts)
    if n_all == 0:  # no trained token on this rank (a fully masked shard): the means of its one pass, as before
        return parts[0][0]
    return {key: sum(m[key] if key in summed else m[key] * (n / n_all) for m, n in parts if n)
            for key in parts[0][0]}


def ppo_update(policy, critic, batch: PPOBatch, rewards: torch.Tensor | Sequence[float] | None = None, *,
               ppo_epochs: int = 1, eps_clip: float = 0.2, eps_clip_high: float | None = None,
               eps_clip_c: float | None = None, value_clip: float | None = 0.2, gamma: float = 1.0, lam: float = 0.95,
               entropy_coef: float = 0.0, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
               tis_clip: float = 2.0, use_tis: bool = True, critic_only: bool = False,
               temperature: float = 1.0) -> dict[str, float]:
    """One PPO update of `policy` and `critic` (both `training.deepspeed_backend.DeepSpeedBackend`) on `batch`.

    rewards: (B,) terminal task rewards (None → `batch.rewards`). ref_logprobs: (B, T) reference-policy log-probs in
    the batch alignment, required when kl_coef ≠ 0. critic_only: critic warm-up, the policy is neither stepped nor
    given gradients (the policy metrics pg_loss, clip_frac*, ratio_mean_first, approx_kl, entropy are then
    absent). Metrics (floats; per-epoch losses averaged over epochs, `*_first` from epoch 1): reward_mean,
    pg_loss, vf_loss, clip_frac, clip_frac_first, ratio_mean_first, approx_kl, entropy, explained_variance
    (old values vs returns, before the update; nan if the returns are constant), tis_weight_mean, num_tokens.
    """
    if ppo_epochs < 1:
        raise ValueError(f"ppo_update: ppo_epochs must be >= 1, got {ppo_epochs}")
    for name, backend in (("policy", policy), ("critic", critic)):
        if backend.settings.grad_accum != 1:
            raise ValueError(f"ppo_update: {name} TrainSettings.grad_accum={backend.settings.grad_accum}; each PPO "
                             f"epoch is one optimizer step on the whole batch, so grad_accum must be 1")
    rewards = batch.rewards if rewards is None else torch.as_tensor(rewards, dtype=torch.float32)
    if rewards is None:
        raise ValueError("ppo_update: no rewards (pass rewards= or build_batch(..., rewards=...))")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"ppo_update: kl_coef={kl_coef} needs ref_logprobs")
    mask = batch.mask
    global_tokens = policy.all_reduce_sum(float(mask.sum()))
    if global_tokens <= 0:
        raise ValueError("ppo_update: the batch has no trained token on any rank (all masks are 0)")
    norm_pi, norm_v = policy.loss_normalizer(global_tokens), critic.loss_normalizer(global_tokens)

    # token-budget micro-batches (`micro_batch_tokens`) of each model, or None: one pass in length buckets
    lengths = batch.attention_mask.sum(dim=1).tolist()
    pi_groups = None if critic_only else step_micro_batches(policy, lengths)
    v_groups = step_micro_batches(critic, lengths)

    # ---- rollout-time quantities, frozen for all epochs ----------------------------------------------------------
    # Without dropout a train-mode forward equals the eval-mode one, so epoch 1's forwards (with grad) double as the
    # frozen π_old / V_old forwards: two forwards fewer per update (the update is the same to the last bit). Not
    # with token-budget micro-batches: each one's graph is freed by its own backward, after π_old is needed.
    reuse_pi = not critic_only and is_deterministic(policy) and pi_groups is None
    reuse_v = is_deterministic(critic) and v_groups is None
    first_pi = first_v = None
    policy.train_mode() if reuse_pi else policy.eval_mode()
    critic.train_mode() if reuse_v else critic.eval_mode()
    if reuse_pi:
        first_pi = _logp_and_entropy(policy, batch, with_entropy=True, temperature=temperature)
    if reuse_v:
        first_v = _values(critic, batch)
    with torch.no_grad():  # without grad, in the micro-batches when there is a budget (the logits' memory)
        old_logp = (first_pi[0].detach() if reuse_pi else _logp_and_entropy(
            policy, batch, False, temperature, pi_groups and [g for g in pi_groups if g])[0]).cpu()
        old_values = (first_v.detach() if reuse_v else _values(
            critic, batch, v_groups and [g for g in v_groups if g])).cpu()
        kl = None if ref_logprobs is None else ppo_math.kl_estimator(old_logp, ref_logprobs.float().cpu(), "k1")
        # a fully masked batch: a rank without rows of the global batch (teachers/specialist.ppo_shard); it adds 0
        r = (ppo_math.token_rewards(rewards, mask, kl, kl_coef, batch.step_credit) if mask.any()
             else torch.zeros_like(mask))
        advantages, returns = ppo_math.compute_gae(r, old_values, mask, gamma, lam)
        advantages = ppo_math.masked_whiten(advantages, mask, sum_all=_sum_over_ranks(policy))
        # TIS: the rollout engine sampled the tokens; re-weight them towards the trainer's π_old
        tis = ppo_math.tis_weights(old_logp, batch.rollout_logprobs, tis_clip) if use_tis else None
        explained_var = ppo_math.explained_variance(old_values, returns, mask).item()

    metrics: dict[str, float] = {
        "reward_mean": float(rewards.float().mean()), "num_tokens": float(mask.sum()),
        "explained_variance": explained_var,
        "tis_weight_mean": ppo_math.masked_mean(tis, mask).item() if tis is not None else 1.0,
    }
    # the losses of one token-budget micro-batch (`_budget_epoch`): `sub` = rows `rows` of the batch, cut to L
    def pi_loss(sub: PPOBatch, rows: torch.Tensor, L: int) -> tuple[torch.Tensor, dict]:
        lp, ent_t = _logp_and_entropy_one(policy, sub, True, temperature)  # (b, L) each

        def cut(t: torch.Tensor) -> torch.Tensor:  # the micro-batch's part of a (B, T) tensor: (b, L)
            return t[rows, :L].to(lp.device)
        pg_g, pg_m = ppo_math.policy_loss(lp, cut(old_logp), cut(advantages), cut(mask), eps_clip, eps_clip_high,
                                          eps_clip_c, None if tis is None else cut(tis), global_token_count=norm_pi)
        ent_g = ppo_math.agg_loss(ent_t, cut(mask), global_token_count=norm_pi)
        return pg_g - entropy_coef * ent_g, {**{k: pg_m[k] for k in ("pg_loss", "clip_frac", "approx_kl",
                                                                     "ratio_mean")},
                                             "entropy": ppo_math.masked_mean(ent_t.detach(), cut(mask))}

    def v_loss(sub: PPOBatch, rows: torch.Tensor, L: int) -> tuple[torch.Tensor, dict]:
        v = _values(critic, sub, [list(range(len(sub.sample_ids)))])  # (b, L): one group, one forward of `sub`
        return ppo_math.value_loss(v, *(t[rows, :L].to(v.device) for t in (old_values, returns, mask)), value_clip,
                                   global_token_count=norm_v)

    per_epoch: list[dict] = []  # each epoch's metrics as device tensors: read back once, after the last step
    policy.train_mode()
    critic.train_mode()
    for epoch in range(ppo_epochs):
        em: dict = {}
        if pi_groups is not None:
            em = _budget_epoch(policy, batch, pi_groups, pi_loss, summed=("pg_loss",))
        elif not critic_only:
            if epoch == 0 and first_pi is not None:
                logp, entropy = first_pi
            else:
                logp, entropy = _logp_and_entropy(policy, batch, with_entropy=True, temperature=temperature)
            dev = logp.device
            pg, pg_m = ppo_math.policy_loss(logp, old_logp.to(dev), advantages.to(dev), mask.to(dev), eps_clip,
                                            eps_clip_high, eps_clip_c, None if tis is None else tis.to(dev),
                                            global_token_count=norm_pi)
            ent = ppo_math.agg_loss(entropy, mask.to(dev), global_token_count=norm_pi)
            policy.step(pg - entropy_coef * ent)
            em = {k: pg_m[k] for k in ("pg_loss", "clip_frac", "approx_kl", "ratio_mean")}
            em["entropy"] = ppo_math.masked_mean(entropy.detach(), mask.to(dev))
        if v_groups is not None:
            vf_m = _budget_epoch(critic, batch, v_groups, v_loss, summed=("vf_loss",))
        else:
            values = first_v if epoch == 0 and first_v is not None else _values(critic, batch)
            dev = values.device
            vf, vf_m = ppo_math.value_loss(values, old_values.to(dev), returns.to(dev), mask.to(dev), value_clip,
                                           global_token_count=norm_v)
            critic.step(vf)
        per_epoch.append({**em, "vf_loss": vf_m["vf_loss"]})
    sums: dict[str, float] = {}
    for epoch, em in enumerate(host_floats(*per_epoch)):  # the same floats, summed in the same order as before
        if not critic_only:
            for k in ("pg_loss", "clip_frac", "approx_kl", "entropy"):
                sums[k] = sums.get(k, 0.0) + em[k]
            if epoch == 0:
                metrics["clip_frac_first"], metrics["ratio_mean_first"] = em["clip_frac"], em["ratio_mean"]
        sums["vf_loss"] = sums.get("vf_loss", 0.0) + em["vf_loss"]
    metrics.update({k: v / ppo_epochs for k, v in sums.items()})
    return metrics


def _sum_over_ranks(backend):
    """A scalar-tensor sum over the data-parallel ranks of `backend`, or None in a world of one."""
    if backend.world_size == 1:
        return None
    return lambda t: torch.tensor(backend.all_reduce_sum(float(t)), dtype=t.dtype)


def reduce_metrics(metrics: dict[str, float], backend, rows: int) -> dict[str, float]:
    """`ppo_update`'s metrics of this rank's shard → those of the global batch (a collective: every rank calls it
    with the same keys). Losses are shares of the global token mean (their rank mean is the global value);
    `reward_mean` is weighted by `rows` (this shard's real samples), the other metrics by this shard's tokens."""
    if backend.world_size == 1:
        return metrics
    n = metrics.get("num_tokens", 0.0)
    rows_all = backend.all_reduce_sum(rows)
    tokens_all = backend.all_reduce_sum(n)
    out = {}
    for k in sorted(metrics):
        v = metrics[k]
        if k == "num_tokens":
            out[k] = tokens_all
        elif k in ("pg_loss", "vf_loss"):
            out[k] = backend.all_reduce_mean(v)
        elif k == "reward_mean":
            out[k] = backend.all_reduce_sum(v * rows) / max(rows_all, 1)
        else:
            out[k] = backend.all_reduce_sum(v * n if n else 0.0) / max(tokens_all, 1.0)
    return out
