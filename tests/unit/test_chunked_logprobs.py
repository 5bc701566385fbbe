"""The chunked full-vocabulary log-probs (training/logprobs.py) against the textbook full-tensor implementation they
replace: the OPD losses (every registered one, through student.batch.opd_loss), `topk_kl_loss`, and the specialists'
sampled-token log-probs + entropy (teachers/ppo_step.py) — values and gradients, bf16 and fp32 logits, padding with
garbage, chunk boundaries in the middle of sequences. The reference functions below are the implementations as they
were before chunking (full float32 copies of the logits)."""
from __future__ import annotations

import math

import pytest
import torch

import training.logprobs as lp_mod
from training.logprobs import gather_log_softmax
from student.batch import OPDBatch, opd_loss
from student.losses import LOG_FLOOR, LOSSES, OPDInputs, _kl, _token_mean, _with_tail, sampled_rkl_loss, topk_kl_loss
from teachers.ppo_math import entropy_from_logits

pytestmark = pytest.mark.unit

DTYPES = (torch.float32, torch.bfloat16)


# ---- the pre-chunking implementations ---------------------------------------------------------------------------
def ref_topk_kl(student_logits, ids, t_logp, mask, direction="forward", beta=0.5, global_token_count=None):
    """topk_kl_loss before chunking: where + float cast + log_softmax over the whole (B, T, V)."""
    B, T, V = student_logits.shape
    K = ids.shape[-1]
    valid = mask != 0
    valid_k = valid[..., None].expand(B, T, K)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    ids = torch.where(valid_k, ids.long(), torch.arange(K).expand(B, T, K))
    t_top = torch.where(valid_k, t_logp.detach().to(dtype), torch.full((), -math.log(K), dtype=dtype))
    z = torch.where(valid[..., None], student_logits.to(dtype), torch.zeros((), dtype=dtype))
    s_log = _with_tail(torch.log_softmax(z, dim=-1).gather(-1, ids).clamp_min(LOG_FLOOR))
    t_log = _with_tail(t_top.clamp_min(LOG_FLOOR))
    if direction == "forward" or (direction == "jsd" and beta == 0.0):
        per_tok = _kl(t_log, s_log)
    elif direction == "reverse" or (direction == "jsd" and beta == 1.0):
        per_tok = _kl(s_log, t_log)
    else:
        m_log = torch.logsumexp(torch.stack([t_log + math.log(beta), s_log + math.log1p(-beta)]), dim=0)
        per_tok = beta * _kl(t_log, m_log) + (1.0 - beta) * _kl(s_log, m_log)
    return _token_mean(per_tok, valid, global_token_count)


def ref_opd_loss(logits, batch, name, direction, beta, reward_coef, is_clip, gtc):
    """student.batch.opd_loss + the registered objectives before chunking (loss value only)."""
    logits = logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    adv = batch.reward_adv if reward_coef else None
    if name == "sampled_rkl":
        return sampled_rkl_loss(logp, batch.teacher_logp, batch.mask, rollout_logp=batch.rollout_logp, reward_adv=adv,
                                reward_coef=reward_coef, is_clip=is_clip, global_token_count=gtc)[0]
    total = ref_topk_kl(logits, batch.topk_ids, batch.topk_logp, batch.mask, direction, beta, gtc)
    if reward_coef:
        total = total + sampled_rkl_loss(logp, logp.detach(), batch.mask, rollout_logp=batch.rollout_logp,
                                         reward_adv=adv, reward_coef=reward_coef, is_clip=is_clip,
                                         global_token_count=gtc)[0]
    return total


def ref_logp_entropy(logits, input_ids, temperature):
    """teachers/ppo_step._logp_and_entropy before chunking."""
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([logp, torch.zeros_like(logp[:, :1])], dim=1), entropy_from_logits(logits)


# ---- helpers ------------------------------------------------------------------------------------------------------
def assert_grad_close(got, want, dtype):
    """fp32: float-rounding close. bf16: both sides compute in float32 and round the gradient to bf16 once, so they
    may differ by one bf16 step where the float32 values straddle a rounding boundary."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-7)


def demo_batch(B=3, T=11, V=37, K=5, seed=0):
    """Rows of different lengths (right padding), garbage top-k / log-probs in the padding."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T - 1)
    for b, (p, n) in enumerate([(2, 8), (3, 4), (1, 6)][:B]):
        mask[b, p - 1:p - 1 + n] = 1.0
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * (T - 1))]).view(B, T - 1, K)
    topk_ids[mask == 0] = V + 7  # out of range: must never be read at a padded position
    topk_logp = torch.log_softmax(torch.randn(B, T - 1, V, generator=g), -1).gather(-1, topk_ids.clamp(max=V - 1))
    topk_logp[mask == 0] = float("nan")
    teacher_logp = torch.where(mask != 0, -torch.rand(B, T - 1, generator=g) * 3, torch.full((), float("nan")))
    rollout_logp = torch.where(mask != 0, -torch.rand(B, T - 1, generator=g) * 3, torch.zeros(()))
    batch = OPDBatch(input_ids, torch.ones_like(input_ids), mask, teacher_logp, rollout_logp, topk_ids, topk_logp,
                     torch.randn(B, generator=g), torch.zeros(B), [f"s{b}" for b in range(B)])
    logits = torch.randn(B, T, V, generator=g) * 3
    return batch, logits


# ---- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_gather_log_softmax_equals_full_tensor_version(dtype, chunk):
    g = torch.Generator().manual_seed(1)
    B, T, V, K = 3, 9, 23, 4
    logits = (torch.randn(B, T, V + 1, generator=g) * 4).to(dtype)[..., :V]  # not contiguous
    valid = torch.rand(B, T, generator=g) > 0.3
    ids = torch.randint(0, V, (B, T, K), generator=g)
    garbage = logits.detach().clone()
    garbage[~valid] = float("nan")  # padding holds garbage: it must reach neither value nor gradient
    for x in (logits, garbage):
        x = x.detach().requires_grad_()
        got = gather_log_softmax(x, ids, valid, chunk_tokens=chunk)
        w = torch.randn(B, T, K, generator=torch.Generator().manual_seed(2))
        (g_got,) = torch.autograd.grad((got * w)[valid].sum(), x)
        z = torch.where(valid[..., None], x.float(), torch.zeros(()))
        want = torch.log_softmax(z, -1).gather(-1, ids)
        (g_want,) = torch.autograd.grad((want * w)[valid].sum(), x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-6, atol=1e-6)
        assert bool(torch.isfinite(got).all()) and bool((g_got[~valid] == 0).all())
        assert_grad_close(g_got[valid], g_want[valid], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_specialist_logp_and_entropy_equal_full_tensor_version(dtype, temperature):
    """What teachers/ppo_step._logp_and_entropy computes (sampled-token log-prob + entropy, tempered), chunked."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 13, 29
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype).requires_grad_()
    input_ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], 1).unsqueeze(-1)
    lp, ent = gather_log_softmax(logits, targets, temperature=temperature, with_entropy=True, chunk_tokens=5)
    logp = torch.cat([lp[:, :-1, 0], torch.zeros_like(lp[:, :1, 0])], dim=1)
    ref_logp, ref_ent = ref_logp_entropy(logits, input_ids, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    a, c = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)  # a PPO-like loss: logp and entropy terms
    (g_got,) = torch.autograd.grad((logp * a).sum() + (ent * c).sum(), logits)
    (g_want,) = torch.autograd.grad((ref_logp * a).sum() + (ref_ent * c).sum(), logits)
    assert_grad_close(g_got, g_want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.3)])
def test_topk_kl_loss_equals_full_tensor_version(dtype, direction, beta):
    batch, logits = demo_batch()
    x = logits.to(dtype)[:, :-1].detach().requires_grad_()
    ids = batch.topk_ids.clamp(max=x.shape[-1] - 1)
    for chunk in (3, None):  # 3 tokens: boundaries inside every row
        got, _ = topk_kl_loss(x, ids, batch.topk_logp, batch.mask, direction, beta, global_token_count=7.0,
                              chunk_tokens=chunk)
        want = ref_topk_kl(x, ids, batch.topk_logp, batch.mask, direction, beta, global_token_count=7.0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert_grad_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("reward_coef", [0.0, 0.5])
def test_every_registered_loss_through_opd_loss_equals_full_tensor_version(monkeypatch, dtype, name, reward_coef):
    monkeypatch.setattr(lp_mod, "CHUNK_ELEMENTS", 37 * 4)  # 4 positions per chunk: boundaries mid-sequence
    batch, logits = demo_batch()
    x = logits.to(dtype).requires_grad_()
    kw = dict(direction="jsd", beta=0.4, reward_coef=reward_coef, is_clip=2.0)
    got, m = opd_loss(x, batch, loss=name, global_token_count=9.0, **kw)
    want = ref_opd_loss(x, batch, name, kw["direction"], kw["beta"], reward_coef, kw["is_clip"], 9.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert all(math.isfinite(v) for v in m.values())
    (g_got,) = torch.autograd.grad(got, x)
    (g_want,) = torch.autograd.grad(want, x)
    assert_grad_close(g_got, g_want, dtype)
    assert bool((g_got[:, -1] == 0).all())  # the last position predicts nothing


def test_objective_with_and_without_pregathered_student_topk_agree():
    """OPDInputs.student_topk_logp (opd_loss's one-pass gather) gives the loss `topk_kl_loss` gives from logits."""
    batch, logits = demo_batch()
    x = logits[:, :-1]
    ids = batch.topk_ids.clamp(max=x.shape[-1] - 1)
    logp = torch.log_softmax(x, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    base = dict(logits=x, logp=logp, teacher_logp=batch.teacher_logp, rollout_logp=batch.rollout_logp,
                mask=batch.mask, topk_ids=ids, topk_logp=batch.topk_logp)
    pre = gather_log_softmax(x, torch.where(batch.mask[..., None] != 0, ids, 0), batch.mask != 0)
    kw = dict(direction="reverse", beta=0.5, reward_coef=0.0, is_clip=None, global_token_count=None)
    a, _ = LOSSES["topk_kl"](OPDInputs(**base), **kw)
    b, _ = LOSSES["topk_kl"](OPDInputs(**base, student_topk_logp=pre), **kw)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert float(a) > 0


def test_gather_log_softmax_input_errors():
    x = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"ids has shape \(2, 4, 1\)"):
        gather_log_softmax(x, torch.zeros(2, 4, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="valid has shape"):
        gather_log_softmax(x, torch.zeros(2, 3, 1, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        gather_log_softmax(x, torch.zeros(2, 3, 1, dtype=torch.long), temperature=0.0)
