"""OPD losses (student/losses.py) against hand-derived numbers and direct full-vocabulary torch computations."""
import math
from math import log

import pytest
import torch

from student.losses import LOSSES, OPDInputs, get_loss, importance_ratio, sampled_rkl_loss, topk_kl_loss

pytestmark = pytest.mark.unit

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=0, atol=atol)


# ---------------------------------------------------------------- sampled_rkl

def test_sampled_rkl_hand_numbers():
    # token 1: π_s = 0.5, π_T = 0.25 → rkl = log 2,  A = −log 2, ℓ = −A = log 2
    # token 2: π_s = 0.1, π_T = 0.4  → rkl = −log 4, A = log 4,  ℓ = −log 4
    # token 3: padding (garbage). loss = (log 2 − log 4)/2 = −(log 2)/2; mean |A| = (log 2 + log 4)/2 = 1.5·log 2
    s = t([[log(0.5), log(0.1), 3.0]]).requires_grad_()
    teacher, mask = t([[log(0.25), log(0.4), -1e9]]), t([[1, 1, 0]])
    loss, m = sampled_rkl_loss(s, teacher, mask)
    close(loss, -log(2) / 2)
    close(m["reverse_kl"], -log(2) / 2)
    close(m["adv_abs_mean"], 1.5 * log(2))
    close(m["is_weight_mean"], 1.0)
    (grad,) = torch.autograd.grad(loss, s)
    close(grad, [[log(2) / 2, -log(4) / 2, 0.0]])  # ∂ℓ/∂logp = −A/N (ratio = 1 on-policy)


def test_sampled_rkl_reward_mixing_old_logp_and_is_weight():
    s, teacher, mask = t([[log(0.5), log(0.1)]]), t([[log(0.25), log(0.4)]]), t([[1, 1]])
    # + 0.5·reward_adv (reward_adv = 1 per sequence): A = [−log 2 + 0.5, log 4 + 0.5] → loss = (−log 2 − 1)/2
    loss, _ = sampled_rkl_loss(s, teacher, mask, reward_adv=t([1.0]), reward_coef=0.5)
    close(loss, (-log(2) - 1.0) / 2)
    loss_bt, _ = sampled_rkl_loss(s, teacher, mask, reward_adv=t([[1.0, 1.0]]), reward_coef=0.5)
    close(loss_bt, loss)
    # old_logp replaces the student log-prob in the advantage: old = [log 0.25, log 0.4] → A = 0 → loss 0.
    loss_old, m_old = sampled_rkl_loss(s, teacher, mask, old_logp=teacher.clone())
    close(loss_old, 0.0)
    close(m_old["reverse_kl"], 0.0)
    # behaviour (rollout) log-probs [log 0.25, log 0.1] → w = [2, 1]; ℓ = [2·log 2, −log 4] → loss 0.
    rollout = t([[log(0.25), log(0.1)]])
    loss_w, m_w = sampled_rkl_loss(s, teacher, mask, rollout_logp=rollout)
    close(loss_w, 0.0)
    close(m_w["is_weight_mean"], 1.5)
    # truncated at 1.5: ℓ = [1.5·log 2, −2·log 2] → loss = −0.25·log 2
    loss_c, m_c = sampled_rkl_loss(s, teacher, mask, rollout_logp=rollout, is_clip=1.5)
    close(loss_c, -0.25 * log(2))
    close(m_c["is_weight_mean"], 1.25)
    with pytest.raises(ValueError, match="reward_adv is None"):
        sampled_rkl_loss(s, teacher, mask, reward_coef=1.0)


def test_sampled_rkl_gradient_wrt_logits_matches_analytic():
    # loss = (1/N) Σ_t −w_t·A_t·log π(y_t | z_t) in gradient, so ∂loss/∂z_t = −(w_t·A_t/N)·(onehot(y_t) − softmax(z_t)).
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 11
    z = torch.randn(B, T, V, generator=g, dtype=D).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=D), -1).gather(-1, y[..., None])[..., 0]
    mask = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    rollout = torch.randn(B, T, generator=g, dtype=D) * 0.1 - 2.0
    n = mask.sum()
    for rl in (None, rollout):
        logp = torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0]
        loss, _ = sampled_rkl_loss(logp, teacher, mask, rollout_logp=rl, is_clip=5.0)
        (grad,) = torch.autograd.grad(loss, z)
        with torch.no_grad():
            lp = torch.log_softmax(z, -1)
            adv = -(lp.gather(-1, y[..., None])[..., 0] - teacher)
            w = torch.ones(B, T, dtype=D) if rl is None else importance_ratio(
                lp.gather(-1, y[..., None])[..., 0], rl, mask, clip=5.0)
            onehot = torch.nn.functional.one_hot(y, V).to(D)
            analytic = -(w * adv * mask / n)[..., None] * (onehot - lp.exp())
        torch.testing.assert_close(grad, analytic, rtol=0, atol=1e-14)
        assert bool((grad[1, 2:] == 0).all())


def test_importance_ratio_exactly_one_on_policy():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 6, generator=g, dtype=D) - 3
    mask = torch.ones(4, 6, dtype=D)
    mask[0, 4:] = 0
    w = importance_ratio(logp, logp.clone(), mask)
    assert bool((w[mask == 1] == 1.0).all()) and bool((w[mask == 0] == 0.0).all())
    w32 = importance_ratio(logp.float(), logp.float(), mask)
    assert bool((w32[mask == 1] == 1.0).all())
    close(importance_ratio(t([[log(0.5), log(0.1)]]), t([[log(0.1), log(0.5)]]), t([[1, 1]])), [[5.0, 0.2]])
    close(importance_ratio(t([[log(0.5), log(0.1)]]), t([[log(0.1), log(0.5)]]), t([[1, 1]]), clip=2.0), [[2.0, 0.2]])


# ---------------------------------------------------------------- topk_kl

# Teacher full distribution over a 3-token vocab: p_T = [0.3, 0.5, 0.2]; its top-2 ids are [1, 0] (order as a server
# returns them: by probability) with log-probs [log 0.5, log 0.3]; tail bucket 0.2.
# Student: p_S = [0.25, 0.25, 0.5]; on ids [1, 0] → [0.25, 0.25]; tail 0.5.
# Buckets: T = (0.5, 0.3, 0.2), S = (0.25, 0.25, 0.5).
FWD = 0.5 * log(0.5 / 0.25) + 0.3 * log(0.3 / 0.25) + 0.2 * log(0.2 / 0.5)           # KL(T‖S) ≈ 0.2180119
REV = 0.25 * log(0.25 / 0.5) + 0.25 * log(0.25 / 0.3) + 0.5 * log(0.5 / 0.2)        # KL(S‖T) ≈ 0.2392782
# JSD, β = 0.5: M = ½T + ½S = (0.375, 0.275, 0.35)
KL_TM = 0.5 * log(0.5 / 0.375) + 0.3 * log(0.3 / 0.275) + 0.2 * log(0.2 / 0.35)     # ≈ 0.0580213
KL_SM = 0.25 * log(0.25 / 0.375) + 0.25 * log(0.25 / 0.275) + 0.5 * log(0.5 / 0.35)  # ≈ 0.0531436
JSD_HALF = 0.5 * KL_TM + 0.5 * KL_SM                                                  # ≈ 0.0555825
# JSD, β = 0.25 (pins which side β weighs): M = 0.25·T + 0.75·S = (0.3125, 0.2625, 0.425)
JSD_QUARTER = (0.25 * (0.5 * log(0.5 / 0.3125) + 0.3 * log(0.3 / 0.2625) + 0.2 * log(0.2 / 0.425))
               + 0.75 * (0.25 * log(0.25 / 0.3125) + 0.25 * log(0.25 / 0.2625) + 0.5 * log(0.5 / 0.425)))


def hand_case(vocab4=False):
    """One valid position and one padded position with garbage. vocab4 splits the tail token 2 into two tokens."""
    if vocab4:   # p_T = [0.3, 0.5, 0.1, 0.1], p_S = [0.25, 0.25, 0.4, 0.1]: same buckets, different full KL
        s = [log(0.25), log(0.25), log(0.4), log(0.1)]
    else:
        s = [log(0.25), log(0.25), log(0.5)]
    logits = t([[s, [7.0] * len(s)]]).requires_grad_()
    ids = torch.tensor([[[1, 0], [0, 0]]])               # padded position: repeated ids, must be ignored
    tlogp = t([[[log(0.5), log(0.3)], [float("nan"), 5.0]]])
    return logits, ids, tlogp, t([[1, 0]])


@pytest.mark.parametrize("vocab4", [False, True])
@pytest.mark.parametrize("direction,beta,expected", [("forward", 0.5, FWD), ("reverse", 0.5, REV),
                                                     ("jsd", 0.5, JSD_HALF), ("jsd", 0.25, JSD_QUARTER)])
def test_topk_kl_hand_numbers(vocab4, direction, beta, expected):
    logits, ids, tlogp, mask = hand_case(vocab4)
    loss, m = topk_kl_loss(logits, ids, tlogp, mask, direction=direction, beta=beta)
    close(loss, expected)
    close(m["teacher_tail_mass"], 0.2)
    close(m["student_tail_mass"], 0.5)
    (grad,) = torch.autograd.grad(loss, logits)
    assert bool(torch.isfinite(grad).all()) and bool((grad[0, 1] == 0).all())


def test_topk_kl_tail_bucket_is_not_full_kl():
    # With V = 4 the tail merges tokens 2 and 3, so the bucket KL is below the full forward KL (data processing).
    # full − bucket = [0.1·log(0.1/0.4) + 0.1·log(0.1/0.1)] − 0.2·log(0.2/0.5) = 0.1·log 0.25 − 0.2·log 0.4 ≈ 0.0446
    logits, ids, tlogp, mask = hand_case(vocab4=True)
    loss, _ = topk_kl_loss(logits, ids, tlogp, mask, direction="forward")
    pt, ps = [0.3, 0.5, 0.1, 0.1], [0.25, 0.25, 0.4, 0.1]
    full = sum(a * log(a / b) for a, b in zip(pt, ps))
    close(full - loss, 0.1 * log(0.25) - 0.2 * log(0.4))


DIRS = ("forward", "reverse", "jsd")


def random_full(seed, B=2, T=3, V=7):
    g = torch.Generator().manual_seed(seed)
    s_logits = (torch.randn(B, T, V, generator=g, dtype=D) * 2).requires_grad_()
    t_logp = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=D) * 2, -1)
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V)  # K = V, shuffled order
    return s_logits, ids, t_logp.gather(-1, ids), t_logp, torch.ones(B, T, dtype=D)


def full_divergence(s_logits, t_logp, direction, beta=0.5):
    s_logp = torch.log_softmax(s_logits, -1)
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
    if direction == "forward":
        return kl(t_logp, s_logp).mean()
    if direction == "reverse":
        return kl(s_logp, t_logp).mean()
    m_log = torch.log(beta * t_logp.exp() + (1 - beta) * s_logp.exp())
    return (beta * kl(t_logp, m_log) + (1 - beta) * kl(s_logp, m_log)).mean()


@pytest.mark.parametrize("direction,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.1)])
def test_topk_kl_with_k_equal_v_is_full_kl(direction, beta):
    s_logits, ids, t_top, t_logp, mask = random_full(4)
    loss, m = topk_kl_loss(s_logits, ids, t_top, mask, direction=direction, beta=beta)
    ref = full_divergence(s_logits, t_logp, direction, beta)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-10)
    (g_ours,) = torch.autograd.grad(loss, s_logits)
    (g_ref,) = torch.autograd.grad(ref, s_logits)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-10)
    assert m["teacher_tail_mass"] < 1e-11 and m["student_tail_mass"] < 1e-11
    # student log-probs instead of logits give the same loss (log_softmax is idempotent)
    loss_lp, _ = topk_kl_loss(torch.log_softmax(s_logits, -1), ids, t_top, mask, direction=direction, beta=beta)
    torch.testing.assert_close(loss_lp, loss, rtol=0, atol=1e-12)


@pytest.mark.parametrize("direction", DIRS)
def test_topk_kl_with_k_equal_v_has_finite_float32_gradients(direction):
    """In float32 the summed top-V mass rounds to within ~1e-8 of 1, where log1p(-exp(x)) has an infinite
    derivative; the unused branch of log1mexp must not leak 0 * inf = nan into the gradient (it did: a full-
    vocabulary student went nan after one step)."""
    for seed in range(20):
        s64, ids, t_top, t_logp, mask = random_full(seed, B=4, T=8, V=100)
        s32 = s64.detach().float().requires_grad_()
        loss, _ = topk_kl_loss(s32, ids, t_top.float(), mask.float(), direction=direction)
        (g,) = torch.autograd.grad(loss, s32)
        assert torch.isfinite(g).all(), f"seed {seed}: non-finite gradient"
        ref = full_divergence(s64, t_logp, direction)
        (g_ref,) = torch.autograd.grad(ref, s64)
        torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=1e-5)


def test_log1mexp_gradient_is_finite_near_zero():
    from student.losses import TAIL_MIN, _log1mexp

    x = torch.tensor([-1e-12, -1e-9, -3e-8, -0.5, -0.7, -5.0], requires_grad=True)
    y = _log1mexp(x.clamp(max=math.log1p(-TAIL_MIN)))
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(g).all()
    # d/dx log(1 - e^x) = -e^x / (1 - e^x), away from the float32 cliff
    close(g[3:], [-math.exp(v) / (1 - math.exp(v)) for v in (-0.5, -0.7, -5.0)], atol=1e-5)


def test_topk_jsd_beta_limits_follow_trl_convention():
    s_logits, ids, t_top, t_logp, mask = random_full(5)
    fwd, _ = topk_kl_loss(s_logits, ids, t_top, mask, direction="forward")
    rev, _ = topk_kl_loss(s_logits, ids, t_top, mask, direction="reverse")
    # TRL special cases: β = 0 is KL(T‖S), β = 1 is KL(S‖T).
    close(topk_kl_loss(s_logits, ids, t_top, mask, direction="jsd", beta=0.0)[0], fwd)
    close(topk_kl_loss(s_logits, ids, t_top, mask, direction="jsd", beta=1.0)[0], rev)
    # Continuous limits: JSD_β/β → KL(T‖S) as β → 0, JSD_β/(1 − β) → KL(S‖T) as β → 1 (error O(β)).
    eps = 1e-6
    lo, _ = topk_kl_loss(s_logits, ids, t_top, mask, direction="jsd", beta=eps)
    hi, _ = topk_kl_loss(s_logits, ids, t_top, mask, direction="jsd", beta=1 - eps)
    torch.testing.assert_close(lo / eps, fwd, rtol=1e-4, atol=0)
    torch.testing.assert_close(hi / eps, rev, rtol=1e-4, atol=0)
    assert fwd.item() > 0.1 and rev.item() > 0.1
    with pytest.raises(ValueError, match="beta"):
        topk_kl_loss(s_logits, ids, t_top, mask, direction="jsd", beta=1.5)


@pytest.mark.parametrize("direction", ["forward", "reverse", "jsd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_kl_finite_when_teacher_tail_is_empty(direction, dtype):
    # Teacher top-2 holds all of its mass (p = [0.6, 0.4], tail 0), once exactly and once summing to slightly over 1
    # (rounding in a real server). The student puts mass on the tail; reverse KL is then large but finite.
    g = torch.Generator().manual_seed(6)
    s_logits = torch.randn(1, 2, 5, generator=g, dtype=dtype).requires_grad_()
    ids = torch.tensor([[[3, 1], [0, 4]]])
    tlogp = torch.tensor([[[log(0.6), log(0.4)], [log(0.6 + 1e-7), log(0.4)]]], dtype=dtype)
    loss, m = topk_kl_loss(s_logits, ids, tlogp, torch.ones(1, 2, dtype=dtype), direction=direction)
    (grad,) = torch.autograd.grad(loss, s_logits)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0
    # 1 − Σ p over the top-k is 0 up to rounding: a few float32 ulps of 1 (how many depends on the CPU's exp kernel)
    assert m["teacher_tail_mass"] <= (1e-11 if dtype == torch.float64 else 4 * torch.finfo(torch.float32).eps)
    # -inf student logits (a masked vocabulary entry that the teacher ranks in its top-k) stay finite too
    z = s_logits.detach().clone()
    z[0, 0, 3] = float("-inf")
    z.requires_grad_()
    loss2, _ = topk_kl_loss(z, ids, tlogp, torch.ones(1, 2, dtype=dtype), direction=direction)
    (grad2,) = torch.autograd.grad(loss2, z)
    assert math.isfinite(loss2.item()) and bool(torch.isfinite(grad2).all())


def test_topk_kl_gradcheck():
    g = torch.Generator().manual_seed(7)
    s_logits = torch.randn(2, 2, 6, generator=g, dtype=D).requires_grad_()
    t_full = torch.log_softmax(torch.randn(2, 2, 6, generator=g, dtype=D), -1)
    top = t_full.topk(3, dim=-1)
    mask = t([[1, 1], [1, 0]])
    for direction in DIRS:
        fn = lambda z: topk_kl_loss(z, top.indices, top.values, mask, direction=direction, beta=0.3)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (s_logits,), eps=1e-6, atol=1e-8)



def test_topk_kl_token_mean_and_global_count():
    # Two copies of the hand position plus one padded slot: the token mean equals the per-token value; splitting the
    # rows over two "ranks" with global_token_count = 2 sums to the same loss.
    logits, ids, tlogp, _ = hand_case()
    z = torch.cat([logits.detach(), logits.detach()])
    ids2, tl2 = torch.cat([ids, ids]), torch.cat([tlogp, tlogp])
    mask = t([[1, 0], [1, 0]])
    full, _ = topk_kl_loss(z, ids2, tl2, mask)
    close(full, FWD)
    halves = [topk_kl_loss(z[i:i + 1], ids2[i:i + 1], tl2[i:i + 1], mask[i:i + 1], global_token_count=2)[0]
              for i in (0, 1)]
    close(halves[0] + halves[1], FWD)


def test_token_weight_makes_each_loss_a_mean_over_samples_and_splits_like_the_token_mean():
    """`distill.loss_agg: seq_mean_token_mean`: with `seq_mean_weights` per row, sampled_rkl and topk_kl are the mean
    over rows of each row's own token mean, and split over micro-batches with the global count as before."""
    from training.rl_math import seq_mean_weights

    torch.manual_seed(0)
    B, T, V, K = 3, 4, 6, 3
    logits = torch.randn(B, T, V, dtype=D)
    mask = t([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])  # 4, 1 and 2 tokens: N = 7
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(B * T)]).reshape(B, T, K)
    tlogp = torch.log_softmax(torch.randn(B, T, V, dtype=D), -1).gather(-1, ids)
    logp = torch.log_softmax(logits, -1)[..., 0]
    teacher = torch.randn(B, T, dtype=D)
    w = torch.tensor(seq_mean_weights([4, 1, 2]), dtype=D)[:, None] * mask
    rows = range(B)
    for name, fn in (("topk_kl", lambda r, **kw: topk_kl_loss(logits[r], ids[r], tlogp[r], mask[r], **kw)[0]),
                     ("sampled_rkl", lambda r, **kw: sampled_rkl_loss(logp[r], teacher[r], mask[r], **kw)[0])):
        per_row = [fn(slice(b, b + 1)) for b in rows]  # each row alone: its own token mean
        weighted = fn(slice(0, B), token_weight=w)
        close(weighted, sum(per_row) / B, atol=1e-12)
        parts = [fn(slice(b, b + 1), token_weight=w[b:b + 1], global_token_count=7) for b in rows]
        close(sum(parts), weighted, atol=1e-12)
        assert not torch.allclose(weighted, fn(slice(0, B))), name  # the token mean weighs row 0's 4 tokens 4×


def test_topk_kl_input_errors():
    logits, ids, tlogp, mask = hand_case()
    with pytest.raises(ValueError, match="direction"):
        topk_kl_loss(logits, ids, tlogp, mask, direction="sideways")
    with pytest.raises(ValueError, match=r"repeated id at \(row, t\)=\(0, 0\)"):
        topk_kl_loss(logits, torch.tensor([[[1, 1], [0, 0]]]), tlogp, mask)
    with pytest.raises(ValueError, match="out of range"):
        topk_kl_loss(logits, torch.tensor([[[1, 3], [0, 0]]]), tlogp, mask)
    with pytest.raises(ValueError, match="teacher_topk_logp"):
        topk_kl_loss(logits, ids, tlogp[..., :1], mask)


@pytest.mark.parametrize("count_elements", [1 << 22, 0])  # ids counted per row, or (a large vocabulary) sorted
def test_repeated_teacher_ids_are_found_at_their_position_and_padding_is_ignored(monkeypatch, count_elements):
    import student.losses as losses

    monkeypatch.setattr(losses, "_COUNT_ELEMENTS", count_elements)
    V, K = 6, 3
    ids = torch.tensor([[[0, 1, 2], [3, 4, 5], [9, 9, 9]],    # row 0: the last position is padding, garbage ids
                        [[5, 4, 3], [2, 1, 0], [1, 2, 1]]])   # row 1: a repeat at t = 2
    lp = torch.full((2, 3, K), -2.0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match=r"repeated id at \(row, t\)=\(1, 2\)"):
        losses.check_teacher_topk("f", ids, lp, mask, V)
    ok = ids.clone()
    ok[1, 2] = torch.tensor([1, 2, 0])
    out = losses.check_teacher_topk("f", ok, lp, mask, V)
    assert out[0, 2].tolist() == [0, 1, 2] and out[1, 2].tolist() == [1, 2, 0]  # padding → 0 … K−1, the rest kept
    with pytest.raises(ValueError, match="out of range"):
        losses.check_teacher_topk("f", ok, lp, torch.ones(2, 3), V)  # the garbage row counts once it is valid


def test_registry():
    assert get_loss("sampled_rkl").fn is sampled_rkl_loss and get_loss("topk_kl").fn is topk_kl_loss
    assert set(LOSSES) == {"sampled_rkl", "topk_kl"}
    assert get_loss("topk_kl").needs_teacher_topk and not get_loss("sampled_rkl").needs_teacher_topk
    with pytest.raises(ValueError, match=r"\['sampled_rkl', 'topk_kl'\]"):
        get_loss("fkl")


def test_registry_is_the_one_source_of_distill_loss_names():
    """`distill.loss` accepts exactly the registered losses; an unknown name fails at config load, naming the field
    and every valid name; a loss the config does not list cannot be registered."""
    from infra.config import OPD_LOSSES, ConfigError, config_from_dict
    from student.losses import register_loss

    assert set(OPD_LOSSES) == set(LOSSES)
    domains = [{"name": "addition"}]
    for name in LOSSES:
        assert config_from_dict({"domains": domains, "distill": {"loss": name}}).distill.loss == name
    with pytest.raises(ConfigError) as err:
        config_from_dict({"domains": domains, "distill": {"loss": "fkl"}})
    msg = str(err.value)
    assert "distill.loss" in msg and all(f"'{name}'" in msg for name in LOSSES)
    with pytest.raises(ValueError, match="not in infra.config.OPD_LOSSES"):
        register_loss("fkl", fn=sampled_rkl_loss, needs_teacher_topk=False)(lambda x, **hp: None)
    with pytest.raises(ValueError, match="registered twice"):
        register_loss("topk_kl", fn=topk_kl_loss, needs_teacher_topk=True)(lambda x, **hp: None)
    assert set(LOSSES) == set(OPD_LOSSES)  # the refused registrations left the registry as it was


def test_loss_that_needs_teacher_topk_refuses_inputs_without_it():
    logits, _, _, mask = hand_case()
    x = OPDInputs(logits=logits, logp=t([[log(0.5), log(0.5)]]), teacher_logp=t([[log(0.5), log(0.5)]]),
                  rollout_logp=t([[log(0.5), log(0.5)]]), mask=mask)
    with pytest.raises(ValueError, match=r"topk_kl needs the teacher's top-k \(score with top_k > 0\)"):
        get_loss("topk_kl")(x, direction="forward", beta=0.5, reward_coef=0.0, is_clip=None, global_token_count=None)
    loss, m = get_loss("sampled_rkl")(x, direction="forward", beta=0.5, reward_coef=0.0, is_clip=None,
                                      global_token_count=None)
    assert float(loss) == 0.0 and m["reverse_kl"] == 0.0  # student = teacher on the sampled tokens


def test_nan_padding_reaches_neither_loss_nor_gradient():
    nan = float("nan")
    mask = t([[1, 1, 0]])
    s = t([[log(0.5), log(0.1), nan]]).requires_grad_()
    loss, m = sampled_rkl_loss(s, t([[log(0.25), log(0.4), nan]]), mask, old_logp=t([[log(0.5), log(0.1), nan]]),
                               rollout_logp=t([[log(0.5), log(0.1), nan]]), reward_adv=t([[0.0, 0.0, nan]]),
                               reward_coef=1.0)
    close(loss, -log(2) / 2)
    assert all(math.isfinite(v) for v in m.values())
    (grad,) = torch.autograd.grad(loss, s)
    close(grad, [[log(2) / 2, -log(4) / 2, 0.0]])
    logits, ids, tlogp, mask2 = hand_case()
    z = logits.detach().clone()
    z[0, 1] = nan
    z.requires_grad_()
    for direction, expected in (("forward", FWD), ("reverse", REV), ("jsd", JSD_HALF)):
        loss2, m2 = topk_kl_loss(z, ids, tlogp, mask2, direction=direction)
        close(loss2, expected)
        (g2,) = torch.autograd.grad(loss2, z)
        assert bool(torch.isfinite(g2).all()) and bool((g2[0, 1] == 0).all())
