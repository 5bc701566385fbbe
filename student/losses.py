"""On-Policy Distillation losses: pure functions on tensors, no config objects, no I/O.

The student samples its own response y; the domain's teacher scores it (per-token log-prob of y_t and its top-k
distribution at every position). Two losses, both token-level, each registered (``LOSSES``) as an ``OPDLoss`` that
declares what it needs (``needs_teacher_topk``) and looked up once by name (``get_loss(distill.loss)``):

- ``sampled_rkl``: reverse KL on the sampled token used as a detached advantage in a policy-gradient loss
  (Agarwal et al. 2024 "On-Policy Distillation of Language Models", arXiv:2306.13649; Thinking Machines
  "On-Policy Distillation" 2025; the slime OPD form);
- ``topk_kl``: KL between teacher and student over the teacher's top-k ids plus one tail bucket, forward, reverse,
  or TRL/GKD's generalized JSD.

Conventions: padded ``(B, T)`` tensors with ``mask (B, T)`` (1 = response token that counts); losses return
``(loss, metrics)`` with metrics as detached 0-d tensors (as torchtune's losses do: the trainer reads them back once
per optimizer step, training/step_metrics.py, not once per micro-batch); aggregation is token-mean (Σ over valid
tokens / their number, or / ``global_token_count`` so that data-parallel ranks sum to the one-rank loss), each token's
term optionally times a ``token_weight`` (``distill.loss_agg: seq_mean_token_mean``: ``rl_math.seq_mean_weights``). The token
mean, the truncated importance ratio and the shape checks are the ones the PPO losses use (``training/rl_math.py``):
``student`` does not import ``teachers``' internals (docs/architecture.md, "Layering").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from infra.config import OPD_LOSSES
from training.logprobs import gather_log_softmax
from training.rl_math import check_shapes, token_mean, truncated_ratio

DIRECTIONS = ("forward", "reverse", "jsd")
Metrics = dict[str, torch.Tensor]  # metric name → detached 0-d tensor
# Tail mass is clamped to ≥ TAIL_MIN so log(tail) stays finite (reverse KL against a teacher whose top-k already holds
# all the mass would otherwise be +inf); log-probs are clamped to ≥ LOG_FLOOR so -inf (masked vocab) stays finite.
TAIL_MIN = 1e-12
LOG_FLOOR = -1e4


_token_mean = token_mean  # training/rl_math.py (shared with the PPO losses)


def _mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A metric: the detached token mean, a 0-d tensor left on the device (read back once per optimizer step,
    training/step_metrics.py: `.item()` here would stall the host every micro-step)."""
    return _token_mean(x.detach(), valid, None)


def _check_bt(fn: str, mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    check_shapes(fn, "mask", mask, **tensors)


def importance_ratio(logp_current: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
                     clip: float | None = None) -> torch.Tensor:
    """Per-token importance weight for tokens sampled by an older student (the behaviour policy), detached:

        w_t = exp(log π_current(y_t) − log π_behaviour(y_t)),   truncated at ``clip`` if given: min(w_t, clip)

    Exactly 1 on-policy (exp(0)). Computed as exp(min(Δ, log clip)) so it cannot overflow.
    Shapes: logp_current, logp_behaviour, mask (B, T) → w (B, T), 0 on padded positions.
    """
    _check_bt("importance_ratio", mask, logp_current=logp_current, logp_behaviour=logp_behaviour)
    if clip is not None and clip <= 0:
        raise ValueError(f"importance_ratio: clip must be > 0 or None, got {clip}")
    w = truncated_ratio(logp_current, logp_behaviour, clip)
    return torch.where(mask != 0, w, torch.zeros((), dtype=w.dtype, device=w.device))


def sampled_rkl_loss(logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor,
                     old_logp: torch.Tensor | None = None, rollout_logp: torch.Tensor | None = None,
                     reward_adv: torch.Tensor | None = None, reward_coef: float = 0.0, is_clip: float | None = None,
                     global_token_count: float | torch.Tensor | None = None,
                     token_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Sampled-token reverse KL as a policy-gradient loss (slime / Thinking Machines OPD form):

        rkl_t = log π_s(y_t) − log π_T(y_t)          (π_s from old_logp if given, else the detached logp_student)
        A_t   = −rkl_t + reward_coef · reward_adv     (detached)
        ρ_t   = exp(logp_t − sg(logp_t))              (= 1 in value; ∇ρ_t = ∇ log π_s(y_t))
        w_t   = min(exp(sg(logp_t) − rollout_logp_t), is_clip)   (1 if rollout_logp is None; see importance_ratio)
        ℓ_t   = −A_t · ρ_t · w_t,     loss = token-mean of ℓ over the mask (each ℓ_t times ``token_weight`` if given)

    so ∇loss = −(1/N) Σ_t w_t·A_t·∇ log π_s(y_t): minimising it descends the reverse KL E_{y~π_s}[log π_s − log π_T]
    (the score-function gradient, per token without future-token credit, as in the references).
    Shapes: logp_student (B, T) with grad; logp_teacher, mask, old_logp, rollout_logp (B, T); reward_adv (B,) or (B, T).
    Metrics: ``loss``, ``reverse_kl`` (mean rkl_t on sampled tokens; can be < 0 per sample), ``adv_abs_mean``,
    ``is_weight_mean``.
    """
    _check_bt("sampled_rkl_loss", mask, logp_student=logp_student, logp_teacher=logp_teacher, old_logp=old_logp,
              rollout_logp=rollout_logp)
    if reward_coef != 0.0 and reward_adv is None:
        raise ValueError(f"sampled_rkl_loss: reward_coef={reward_coef} but reward_adv is None")
    valid = mask != 0
    # Padding may hold garbage: zero it with torch.where so neither the loss nor a gradient (via 0·nan) sees it.
    zero = torch.zeros((), dtype=logp_student.dtype, device=logp_student.device)
    logp_student, logp_teacher, old_logp, rollout_logp = [
        None if x is None else torch.where(valid, x, zero) for x in (logp_student, logp_teacher, old_logp, rollout_logp)]
    logp_det = logp_student.detach()
    student_ref = logp_det if old_logp is None else old_logp.detach()
    rkl = student_ref - logp_teacher.detach()
    adv = -rkl
    if reward_adv is not None and reward_coef != 0.0:
        r = reward_adv.detach().to(adv.dtype)
        if r.dim() == 1:
            if r.shape[0] != mask.shape[0]:
                raise ValueError(f"sampled_rkl_loss: reward_adv has shape {tuple(r.shape)}, expected "
                                 f"({mask.shape[0]},) or {tuple(mask.shape)}")
            r = r[:, None]
        else:
            _check_bt("sampled_rkl_loss", mask, reward_adv=r)
        adv = adv + reward_coef * torch.where(valid, r, zero)
    ratio = torch.exp(logp_student - logp_det)
    if rollout_logp is None:
        w = torch.ones_like(logp_det)
    else:
        w = importance_ratio(logp_det, rollout_logp, mask, is_clip)
    loss = _token_mean(-adv * ratio * w, valid, global_token_count, token_weight)
    metrics = {
        "loss": loss.detach(),
        "reverse_kl": _mean(rkl, valid),
        "adv_abs_mean": _mean(adv.abs(), valid),
        "is_weight_mean": _mean(w, valid),
    }
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends (Mächler 2012): log(−expm1(x)) near 0, log1p(−exp(x)) below.

    Each branch is evaluated on inputs safe for it: `torch.where` back-propagates 0 · (the unused branch's
    derivative), and log1p(−exp(x)) has an infinite derivative for x within float32 rounding of 0 (where
    exp(x) == 1), which would make that 0 · inf = nan."""
    cut = -math.log(2.0)
    near_zero = x > cut
    hi = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, cut))))
    lo = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, cut), x)))
    return torch.where(near_zero, hi, lo)


def _with_tail(topk_logp: torch.Tensor) -> torch.Tensor:
    """Append the tail bucket: (…, K) log-probs → (…, K + 1), last = log(max(1 − Σ_k p_k, TAIL_MIN))."""
    lse = torch.logsumexp(topk_logp, dim=-1, keepdim=True).clamp(max=math.log1p(-TAIL_MIN))
    return torch.cat([topk_logp, _log1mexp(lse)], dim=-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(P‖Q) = Σ_i p_i (log p_i − log q_i) over the last dim."""
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def topk_kl_loss(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor, teacher_topk_logp: torch.Tensor,
                 mask: torch.Tensor, direction: str = "forward", beta: float = 0.5,
                 global_token_count: float | torch.Tensor | None = None,
                 chunk_tokens: int | None = None, token_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Token-level KL between the teacher's top-k distribution and the student's, each with one tail bucket.

    Buckets at each position: the K teacher ids, plus a tail holding the rest of the mass,
        T = (p_T(i_1), …, p_T(i_K), max(1 − Σ_k p_T(i_k), TAIL_MIN))
        S = (p_S(i_1), …, p_S(i_K), max(1 − Σ_k p_S(i_k), TAIL_MIN))
    With K = V the tail is empty (TAIL_MIN) and the divergence equals the full-vocabulary one (up to ~1e-12).
    Then per token (``direction``):
        forward: KL(T‖S)            reverse: KL(S‖T)
        jsd:     exactly TRL's GKD ``generalized_jsd_loss`` (arXiv:2306.13649 eq. 1):
                 M = β·T + (1 − β)·S,   JSD_β = β·KL(T‖M) + (1 − β)·KL(S‖M),
                 and, as TRL special-cases them, β = 0 → KL(T‖S) (forward) and β = 1 → KL(S‖T) (reverse).
                 Note JSD_β itself → 0 at both ends; the continuous limits are JSD_β/β → KL(T‖S) as β → 0 and
                 JSD_β/(1 − β) → KL(S‖T) as β → 1, so the special cases are a (documented) jump, as in TRL.
    loss = token-mean over the mask (each token's term times ``token_weight`` (B, T) if given: ``seq_mean_weights``
    per row makes it a mean over sequences). All in log space (logsumexp, log1mexp), in float32 or wider. The student's
    log-softmax over V is taken ``chunk_tokens`` positions at a time (``training.logprobs.gather_log_softmax``), so no
    float32 copy of the whole logits is kept; only the (B, T, K + 1) buckets are.

    Shapes: student_logits (B, T, V) logits or full log-probs (log_softmax is applied; it is the identity on log-probs);
    teacher_topk_ids (B, T, K) integer ids, distinct per position; teacher_topk_logp (B, T, K) teacher log-probs of
    those ids (under the teacher's full softmax); mask (B, T). Gradient flows to student_logits only.
    Metrics: ``loss``, ``teacher_tail_mass``, ``student_tail_mass``.
    """
    if student_logits.dim() != 3:
        raise ValueError(f"topk_kl_loss: student_logits must be (B, T, V), got shape {tuple(student_logits.shape)}")
    B, T, _ = student_logits.shape
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"topk_kl_loss: mask has shape {tuple(mask.shape)}, expected ({B}, {T})")
    ids = check_teacher_topk("topk_kl_loss", teacher_topk_ids, teacher_topk_logp, mask, student_logits.shape[-1],
                             direction, beta)
    s_top = gather_log_softmax(student_logits, ids, mask != 0, chunk_tokens=chunk_tokens)
    return topk_kl_from_student_logp(s_top, teacher_topk_logp, mask, direction, beta, global_token_count, token_weight)


def check_teacher_topk(fn: str, teacher_topk_ids: torch.Tensor, teacher_topk_logp: torch.Tensor, mask: torch.Tensor,
                       vocab_size: int, direction: str = "forward", beta: float = 0.5) -> torch.Tensor:
    """Validate the teacher's top-k against ``mask`` (B, T) and the vocabulary size; returns the ids as long with
    padded positions replaced by 0 … K−1 (padding may hold garbage ids). Errors name ``fn`` and the field."""
    if mask.dim() != 2:
        raise ValueError(f"{fn}: mask must be (B, T), got shape {tuple(mask.shape)}")
    B, T = mask.shape
    V = int(vocab_size)
    if teacher_topk_ids.dim() != 3 or tuple(teacher_topk_ids.shape[:2]) != (B, T):
        raise ValueError(f"{fn}: teacher_topk_ids has shape {tuple(teacher_topk_ids.shape)}, expected ({B}, {T}, K)")
    if teacher_topk_logp.shape != teacher_topk_ids.shape:
        raise ValueError(f"{fn}: teacher_topk_logp has shape {tuple(teacher_topk_logp.shape)} but "
                         f"teacher_topk_ids has {tuple(teacher_topk_ids.shape)}")
    K = teacher_topk_ids.shape[-1]
    if not 1 <= K <= V:
        raise ValueError(f"{fn}: need 1 <= K <= V, got K={K}, V={V}")
    if direction not in DIRECTIONS:
        raise ValueError(f"{fn}: direction={direction!r}; valid directions are {list(DIRECTIONS)}")
    if direction == "jsd" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"{fn}: beta must be in [0, 1], got {beta}")
    valid = mask != 0
    valid_k = valid[..., None].expand(B, T, K)
    ids = teacher_topk_ids.long()
    rows = ids[valid]  # (N, K): only the valid positions are checked (padding may hold garbage)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= V):
        raise ValueError(f"{fn}: teacher_topk_ids out of range [0, {V}) at a valid position")
    dup = _repeats(rows, V)
    if bool(dup.any()):
        b, t = valid.nonzero()[int(dup.nonzero()[0, 0])].tolist()
        raise ValueError(f"{fn}: teacher_topk_ids has a repeated id at (row, t)=({b}, {t})")
    return torch.where(valid_k, ids, torch.arange(K, device=ids.device).expand(B, T, K))


_COUNT_ELEMENTS = 1 << 22  # (N, V) id counts up to 4M entries (16 MB of int32); a sort of the rows beyond


def _repeats(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N,) bool: row n of `rows` (N, K), ids in [0, V), holds some id twice. Counting ids per row is one
    scatter-add (~20x faster than sorting at V = K = 100); at a large vocabulary the (N, V) counts would not fit, so
    the rows are sorted instead (K is small there)."""
    N, K = rows.shape
    if N * vocab_size <= _COUNT_ELEMENTS:
        counts = torch.zeros((N, vocab_size), dtype=torch.int32, device=rows.device)
        counts.scatter_add_(1, rows, torch.ones_like(rows, dtype=torch.int32))
        return (counts > 1).any(dim=-1)
    srt = rows.sort(dim=-1).values
    return (srt[:, 1:] == srt[:, :-1]).any(dim=-1)


def topk_kl_from_student_logp(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, mask: torch.Tensor,
                              direction: str = "forward", beta: float = 0.5,
                              global_token_count: float | torch.Tensor | None = None,
                              token_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """``topk_kl_loss`` from the student's log-probs of the teacher's top-k ids (B, T, K) (with grad; float32 or
    wider), already gathered from its full log-softmax, and validated ids (``check_teacher_topk``)."""
    valid = mask != 0
    B, T, K = student_topk_logp.shape
    valid_k = valid[..., None].expand(B, T, K)
    dtype = student_topk_logp.dtype
    # Padded positions may hold garbage log-probs; replace them so no nan can reach a gradient.
    filler = torch.full((), -math.log(K), dtype=dtype, device=student_topk_logp.device)
    t_top = torch.where(valid_k, teacher_topk_logp.detach().to(dtype), filler)
    s_top = torch.where(valid_k, student_topk_logp, filler)
    s_log = _with_tail(s_top.clamp_min(LOG_FLOOR))                      # (B, T, K+1)
    t_log = _with_tail(t_top.clamp_min(LOG_FLOOR))                      # (B, T, K+1)

    if direction == "forward" or (direction == "jsd" and beta == 0.0):
        per_tok = _kl(t_log, s_log)
    elif direction == "reverse" or (direction == "jsd" and beta == 1.0):
        per_tok = _kl(s_log, t_log)
    else:
        m_log = torch.logsumexp(torch.stack([t_log + math.log(beta), s_log + math.log1p(-beta)]), dim=0)
        per_tok = beta * _kl(t_log, m_log) + (1.0 - beta) * _kl(s_log, m_log)

    loss = _token_mean(per_tok, valid, global_token_count, token_weight)
    metrics = {
        "loss": loss.detach(),
        "teacher_tail_mass": _mean(t_log[..., -1].exp(), valid),
        "student_tail_mass": _mean(s_log[..., -1].exp(), valid),
    }
    return loss, metrics


# -- the registry: each loss is looked up once by name, then asked what it needs ---------------------------------

@dataclass(frozen=True)
class OPDInputs:
    """One micro-batch's tensors, aligned on the positions that predict response tokens (student/batch.py).

    logits (B, T, V) student logits (grad); logp (B, T) student log π_s(y_t) (grad); teacher_logp, rollout_logp,
    mask (B, T); reward_adv (B,) or None (rewards off); topk_ids, topk_logp (B, T, K) the teacher's top-k, or None
    when it was not scored with top-k; student_topk_logp (B, T, K) the student's log-probs of topk_ids (grad), when
    the caller gathered them together with ``logp`` in one pass over the logits (student/batch.py: one logits-sized
    gradient instead of two) at ids it checked with ``check_teacher_topk``, else None (gathered from ``logits``);
    token_weight (B, T) each token's weight in the loss (``distill.loss_agg``), or None (every token 1)."""

    logits: torch.Tensor
    logp: torch.Tensor
    teacher_logp: torch.Tensor
    rollout_logp: torch.Tensor
    mask: torch.Tensor
    reward_adv: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    student_topk_logp: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None


Objective = Callable[..., tuple[torch.Tensor, Metrics]]


@dataclass(frozen=True)
class OPDLoss:
    """A registered OPD loss: its name, what it needs from the teacher, the primitive loss it is built on (``fn``)
    and its micro-batch objective, called as ``loss(inputs, direction=, beta=, reward_coef=, is_clip=,
    global_token_count=)`` → ``(loss, metrics)`` (pure: tensors and floats in)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, Metrics]]
    objective: Objective
    needs_teacher_topk: bool  # the teacher must score with top-k (OPDInputs.topk_ids / topk_logp)

    def __call__(self, x: OPDInputs, *, direction: str, beta: float, reward_coef: float, is_clip: float | None,
                 global_token_count: float | torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
        if self.needs_teacher_topk and (x.topk_ids is None or x.topk_logp is None):
            raise ValueError(f"{self.name} needs the teacher's top-k (score with top_k > 0)")
        return self.objective(x, direction=direction, beta=beta, reward_coef=reward_coef, is_clip=is_clip,
                              global_token_count=global_token_count)


LOSSES: dict[str, OPDLoss] = {}


def register_loss(name: str, *, fn: Callable[..., tuple[torch.Tensor, Metrics]],
                  needs_teacher_topk: bool) -> Callable[[Objective], Objective]:
    """Decorator: register an objective under ``name``, one of ``infra.config.OPD_LOSSES`` (the names
    ``distill.loss`` accepts)."""
    def register(objective: Objective) -> Objective:
        if name not in OPD_LOSSES:
            raise ValueError(f"OPD loss {name!r} is not in infra.config.OPD_LOSSES {list(OPD_LOSSES)}; add it there "
                             "so that distill.loss accepts it")
        if name in LOSSES:
            raise ValueError(f"OPD loss {name!r} registered twice")
        LOSSES[name] = OPDLoss(name, fn, objective, needs_teacher_topk)
        return objective
    return register


@register_loss("sampled_rkl", fn=sampled_rkl_loss, needs_teacher_topk=False)
def sampled_rkl_objective(x: OPDInputs, *, direction: str, beta: float, reward_coef: float, is_clip: float | None,
                          global_token_count: float | torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
    """ℓ_t = −w_t·A_t·ρ_t with A_t = −(log π_s − log π_T)(y_t) + reward_coef·A^reward, w_t the truncated importance
    ratio π_now/π_rollout (exact correction for samples from an older student). ``direction``, ``beta``: unused."""
    return sampled_rkl_loss(x.logp, x.teacher_logp, x.mask, rollout_logp=x.rollout_logp, reward_adv=x.reward_adv,
                            reward_coef=reward_coef, is_clip=is_clip, global_token_count=global_token_count,
                            token_weight=x.token_weight)


@register_loss("topk_kl", fn=topk_kl_loss, needs_teacher_topk=True)
def topk_kl_objective(x: OPDInputs, *, direction: str, beta: float, reward_coef: float, is_clip: float | None,
                      global_token_count: float | torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
    """The teacher-top-k + tail-bucket divergence (direction, beta) at every response position, plus, if
    reward_coef > 0, the importance-weighted policy-gradient term of the task reward alone (``sampled_rkl_loss``
    with π_T := π_s, so its KL advantage is exactly 0). Metrics add the sampled-token ``reverse_kl`` and
    ``is_weight_mean`` (and ``reward_pg_loss``)."""
    if x.student_topk_logp is None:
        total, metrics = topk_kl_loss(x.logits, x.topk_ids, x.topk_logp, x.mask, direction=direction, beta=beta,
                                      global_token_count=global_token_count, token_weight=x.token_weight)
    else:  # gathered by `student.batch.opd_loss` with ids it checked (`check_teacher_topk`): not checked twice
        _check_bt("topk_kl", x.mask, student_topk_logp=x.student_topk_logp[..., 0])
        total, metrics = topk_kl_from_student_logp(x.student_topk_logp, x.topk_logp, x.mask, direction, beta,
                                                   global_token_count, x.token_weight)
    _, rkl_m = sampled_rkl_loss(x.logp.detach(), x.teacher_logp, x.mask, rollout_logp=x.rollout_logp,
                                is_clip=is_clip)
    metrics.update(reverse_kl=rkl_m["reverse_kl"], is_weight_mean=rkl_m["is_weight_mean"])
    if reward_coef:
        pg, pg_m = sampled_rkl_loss(x.logp, x.logp.detach(), x.mask, rollout_logp=x.rollout_logp,
                                    reward_adv=x.reward_adv, reward_coef=reward_coef, is_clip=is_clip,
                                    global_token_count=global_token_count, token_weight=x.token_weight)
        total = total + pg
        metrics.update(reward_pg_loss=pg_m["loss"], loss=total.detach())
    return total, metrics


if set(LOSSES) != set(OPD_LOSSES):  # a name distill.loss accepts but nothing implements: fail at import, not mid-run
    raise ImportError(f"student.losses: infra.config.OPD_LOSSES names {sorted(set(OPD_LOSSES) - set(LOSSES))} "
                      "without a registered loss")


def get_loss(name: str) -> OPDLoss:
    """The OPD loss registered under ``name`` (see ``LOSSES``)."""
    if name not in LOSSES:
        raise ValueError(f"unknown OPD loss {name!r}; valid names are {sorted(LOSSES)}")
    return LOSSES[name]
