"""Scored student samples → padded training tensors, and the OPD loss of one micro-batch (composing student.losses).

Alignment (next-token convention): row b holds `prompt + response` right-padded to T; position t predicts token t+1,
so the model's outputs are taken at positions 0 … T−2 and every per-token tensor is (B, T−1). The response token
`output_ids[j]` sits at input position `P + j` (P = len(prompt)) and is predicted at position `P + j − 1`; that is
where its teacher log-prob, rollout log-prob and teacher top-k go, and where `mask` is 1 — unless the token is tool
output inserted by a tool domain's env (the sample's `loss_mask` is 0 there): then `mask` is 0 and the position counts
in no loss and no metric (the teacher still scored it as context; the tokens after it are predicted from it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from training.logprobs import gather_log_softmax
from student.losses import OPDInputs, OPDLoss, check_teacher_topk, get_loss
from student.sampler import StudentSample


@dataclass
class OPDBatch:
    input_ids: torch.Tensor  # (B, T) long, right-padded
    attention_mask: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T-1) float: 1 where position t predicts a response token the student wrote
    teacher_logp: torch.Tensor  # (B, T-1) teacher log π_T(y_t), 0 off the mask
    rollout_logp: torch.Tensor  # (B, T-1) behaviour (sampling) log π_old(y_t), 0 off the mask
    topk_ids: torch.Tensor | None  # (B, T-1, K) long, or None when not scored with top-k
    topk_logp: torch.Tensor | None  # (B, T-1, K)
    reward_adv: torch.Tensor  # (B,) task-reward advantage (0 when rewards are off)
    lag: torch.Tensor  # (B,) policy versions between sampling and this update
    sample_ids: list[str]
    token_weight: torch.Tensor | None = None  # (B, T-1) each token's weight in the loss (`row_weight`), or None: 1

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def to(self, device: torch.device) -> "OPDBatch":
        """This batch with every tensor on `device` (the student's logits' device: its GPU in a GPU run)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def reward_advantage(rewards: Sequence[float], groups: Sequence[str]) -> list[float]:
    """A_i = r_i − mean{r_j : group_j = group_i}: the per-domain batch mean is the baseline (domains differ in how
    hard they are, so one global baseline would push easy domains up and hard ones down regardless of the sample)."""
    sums: dict[str, list[float]] = {}
    for r, g in zip(rewards, groups):
        sums.setdefault(g, []).append(float(r))
    means = {g: sum(v) / len(v) for g, v in sums.items()}
    return [float(r) - means[g] for r, g in zip(rewards, groups)]


def collate(samples: Sequence[StudentSample], pad_id: int, version: int, with_topk: bool,
            reward_adv: Sequence[float] | None = None, row_weight: Sequence[float] | None = None) -> OPDBatch:
    """Pad scored samples into an `OPDBatch` (see the module docstring for the alignment). `reward_adv`: the
    samples' task-reward advantages when the baseline is taken over more than these samples (a rank's shard of a
    global batch); default `reward_advantage` over these samples. `row_weight`: one weight per sample for each of its
    tokens in the loss (`training.rl_math.seq_mean_weights` of the global batch), None: every token 1."""
    if not samples:
        raise ValueError("collate: no samples")
    if row_weight is not None and len(row_weight) != len(samples):
        raise ValueError(f"collate: {len(row_weight)} row weights for {len(samples)} samples")
    B, T = len(samples), max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    K = int(samples[0].teacher_topk_ids.shape[1]) if with_topk else 0
    ids = np.full((B, T), pad_id, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T - 1), dtype=np.float32)
    t_lp = np.zeros((B, T - 1), dtype=np.float32)
    r_lp = np.zeros((B, T - 1), dtype=np.float32)
    k_ids = np.tile(np.arange(K, dtype=np.int64), (B, T - 1, 1)) if with_topk else None
    k_lp = np.zeros((B, T - 1, K), dtype=np.float32) if with_topk else None
    for b, s in enumerate(samples):
        P, L = len(s.prompt_ids), len(s.output_ids)
        where = f"collate: sample {b} ({s.sample_id})"
        if s.teacher_logprobs is None or len(s.teacher_logprobs) != L or len(s.rollout_logprobs) != L:
            raise ValueError(f"{where}: needs {L} teacher and rollout log-probs (scored?)")
        ids[b, :P + L] = s.prompt_ids + s.output_ids
        attn[b, :P + L] = 1
        if L == 0:
            continue
        m = np.ones(L, dtype=np.float32)
        if s.loss_mask is not None:  # tool output (0) is context, not a target
            if len(s.loss_mask) != L:
                raise ValueError(f"{where}: loss_mask has {len(s.loss_mask)} entries for {L} response tokens")
            m = np.asarray(s.loss_mask, dtype=np.float32)
        mask[b, P - 1:P - 1 + L] = m
        t_lp[b, P - 1:P - 1 + L] = np.asarray(s.teacher_logprobs, dtype=np.float32) * m  # 0 off the mask
        r_lp[b, P - 1:P - 1 + L] = np.asarray(s.rollout_logprobs, dtype=np.float32) * m
        if with_topk:
            if tuple(s.teacher_topk_ids.shape) != (L, K):
                raise ValueError(f"{where}: teacher top-k has shape {tuple(s.teacher_topk_ids.shape)}, want ({L}, {K})")
            k_ids[b, P - 1:P - 1 + L] = s.teacher_topk_ids
            k_lp[b, P - 1:P - 1 + L] = s.teacher_topk_logprobs
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    adv = reward_advantage(rewards, [s.domain for s in samples]) if reward_adv is None else list(reward_adv)
    return OPDBatch(
        torch.from_numpy(ids), torch.from_numpy(attn), torch.from_numpy(mask), torch.from_numpy(t_lp),
        torch.from_numpy(r_lp), torch.from_numpy(k_ids) if with_topk else None,
        torch.from_numpy(k_lp) if with_topk else None, torch.tensor(adv, dtype=torch.float32),
        torch.tensor([version - s.version for s in samples], dtype=torch.float32), [s.sample_id for s in samples],
        None if row_weight is None else
        torch.from_numpy(mask) * torch.tensor(list(row_weight), dtype=torch.float32)[:, None])


def opd_loss(logits: torch.Tensor, batch: OPDBatch, *, loss: OPDLoss | str, direction: str, beta: float,
             reward_coef: float, is_clip: float | None,
             global_token_count: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The OPD loss `loss` (an `OPDLoss` from `student.losses.get_loss`, or its name) of one micro-batch.
    logits (B, T, V) from the student's forward over `input_ids`; the objectives are in student/losses.py.

    Both normalise by `global_token_count` (N/(W·G), see DeepSpeedBackend.loss_normalizer). Metrics (detached 0-d
    tensors) add `logp_abs_diff` = token-mean |log π_now − log π_rollout| (train/inference mismatch plus staleness).
    """
    spec = get_loss(loss) if isinstance(loss, str) else loss
    # Every full-vocabulary quantity is one chunked gather over the whole (B, T, V) logits (no float32 copy, no
    # slice, so backward allocates one logits-sized gradient; training/logprobs.py): column 0 the sampled token, then
    # the teacher's top-k ids. The last position predicts nothing: it gets a target 0 and stays off the mask.
    B, T, V = logits.shape
    # collated on the host: what needs a host read (the top-k check, the valid positions' indices) is done there,
    # before the copy, so nothing here waits for the device (no sync per micro-batch); the losses run on the device
    host = batch
    batch = batch.to(logits.device)
    mask = batch.mask
    off = torch.zeros((B, 1), dtype=torch.long, device=host.input_ids.device)
    ids = torch.cat([host.input_ids[:, 1:], off], dim=1).unsqueeze(-1)  # (B, T, 1): position t predicts token t+1
    with_topk = spec.needs_teacher_topk and batch.topk_ids is not None and batch.topk_logp is not None
    if with_topk:
        topk = check_teacher_topk("opd_loss", host.topk_ids, host.topk_logp, host.mask, V, direction, beta)
        ids = torch.cat([ids, torch.cat([topk, off[..., None].expand(B, 1, topk.shape[-1])], dim=1)], dim=-1)
    valid = torch.cat([host.mask != 0, off.bool()], dim=1)  # on the host: its indices need no device sync
    gathered = gather_log_softmax(logits, ids.to(logits.device), valid)[:, :-1]  # (B, T-1, 1 [+ K])
    logp = gathered[..., 0]  # (B, T-1); −log V off the mask, where no loss reads it
    # train/inference log-prob gap |log π_now − log π_rollout| per token: ~1e-6 on-policy, grows with staleness
    gap = {"logp_abs_diff": ((logp.detach() - batch.rollout_logp).abs() * mask).sum() / mask.sum().clamp_min(1)}
    inputs = OPDInputs(logits=logits[:, :-1], logp=logp, teacher_logp=batch.teacher_logp,
                       rollout_logp=batch.rollout_logp, mask=mask, reward_adv=batch.reward_adv if reward_coef else None,
                       topk_ids=batch.topk_ids, topk_logp=batch.topk_logp,
                       student_topk_logp=gathered[..., 1:] if with_topk else None, token_weight=batch.token_weight)
    total, metrics = spec(inputs, direction=direction, beta=beta, reward_coef=reward_coef, is_clip=is_clip,
                          global_token_count=global_token_count)
    return total, {**metrics, **gap}
