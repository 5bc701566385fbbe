"""PPO math (teachers/ppo_math.py) against hand-derived numbers, float64, tolerances 1e-12 unless stated."""
import math

import pytest
import torch

from teachers.ppo_math import (agg_loss, compute_gae, compute_gae_loop, entropy_from_logits, explained_variance,
                               kl_estimator, mask_offpolicy, masked_mean, masked_whiten, policy_loss, tis_weights,
                               token_rewards, value_loss)

pytestmark = pytest.mark.unit

D = torch.float64
TOL = dict(rtol=0, atol=1e-12)


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=0, atol=atol)


# ---------------------------------------------------------------- GAE

def test_gae_three_tokens_gamma_1():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], γ = 1, λ = 0.95, V after the last token = 0.
    # t=2: δ = 1 + 0   − 0.7 = 0.3   A2 = 0.3
    # t=1: δ = 0 + 0.7 − 0.6 = 0.1   A1 = 0.1 + 0.95·0.3   = 0.385
    # t=0: δ = 0 + 0.6 − 0.5 = 0.1   A0 = 0.1 + 0.95·0.385 = 0.46575
    # R = A + V = [0.96575, 0.985, 1.0]
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1.0, 1.0, 1.0]]), gamma=1.0, lam=0.95)
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_three_tokens_gamma_0_9():
    # Same data, γ = 0.9, γλ = 0.855.
    # t=2: δ = 1 − 0.7 = 0.3                     A2 = 0.3
    # t=1: δ = 0.9·0.7 − 0.6 = 0.03              A1 = 0.03 + 0.855·0.3    = 0.2865
    # t=0: δ = 0.9·0.6 − 0.5 = 0.04              A0 = 0.04 + 0.855·0.2865 = 0.2849575
    # R = [0.7849575, 0.8865, 1.0]
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1.0, 1.0, 1.0]]), gamma=0.9, lam=0.95)
    close(adv, [[0.2849575, 0.2865, 0.3]])
    close(ret, [[0.7849575, 0.8865, 1.0]])


def test_gae_padding_neither_contributes_nor_receives():
    # Row 0: 2 valid tokens then padding full of garbage. Row 1: an interior hole (e.g. tool output).
    # Both reduce to r = [0, 1], V = [0.5, 0.7], γ = 1, λ = 0.95:
    #   A1 = 1 − 0.7 = 0.3;  A0 = (0.7 − 0.5) + 0.95·0.3 = 0.485;  R = [0.985, 1.0]
    rewards = t([[0.0, 1.0, 99.0, float("nan")], [0.0, 5.0, 1.0, 0.0]])
    values = t([[0.5, 0.7, 9.0, float("inf")], [0.5, -3.0, 0.7, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    close(adv, [[0.485, 0.3, 0.0, 0.0], [0.485, 0.0, 0.3, 0.0]])
    close(ret, [[0.985, 1.0, 0.0, 0.0], [0.985, 0.0, 1.0, 0.0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_loop_equals_vectorised(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, T = 16, 23
    rewards, values = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    mask[3, 2:5] = 0  # an interior hole too
    a_vec, r_vec = compute_gae(rewards, values, mask, gamma, lam)
    a_loop, r_loop = compute_gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(a_vec, a_loop, **TOL)
    torch.testing.assert_close(r_vec, r_loop, **TOL)
    assert float(mask.sum()) < B * T and bool((a_vec[mask == 0] == 0).all())


def test_gae_has_no_grad():
    v = t([[0.5, 0.6]]).requires_grad_()
    adv, ret = compute_gae(t([[0.0, 1.0]]), v, t([[1.0, 1.0]]))
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- rewards and KL

def test_token_rewards_terminal_on_last_valid_minus_kl():
    # row 0: 3 valid tokens, row 1: 2 valid tokens. kl = 0.1 everywhere, kl_coef = 0.5 → −0.05 per valid token.
    mask = t([[1, 1, 1], [1, 1, 0]])
    r = token_rewards(t([1.0, 0.5]), mask, kl=torch.full((2, 3), 0.1, dtype=D), kl_coef=0.5)
    close(r, [[-0.05, -0.05, 0.95], [-0.05, 0.45, 0.0]])
    close(token_rewards(t([1.0, 0.5]), mask), [[0, 0, 1.0], [0, 0.5, 0]])


def test_token_rewards_step_credit_moves_the_reward_not_its_sum():
    # row 0: R = 0.5 with credit 0.1, 0.2 on tokens 0, 1 → 0.1, 0.2, and 0.5 − 0.3 = 0.2 on the last.
    # row 1: R = 0.4, credit 0.3 on token 2, which is masked → it joins the terminal: 0, 0.4 on the last valid.
    mask = t([[1, 1, 1], [1, 1, 0]])
    credit = t([[0.1, 0.2, 0.0], [0.0, 0.0, 0.3]])
    r = token_rewards(t([0.5, 0.4]), mask, step_credit=credit)
    close(r, [[0.1, 0.2, 0.2], [0.0, 0.4, 0.0]])
    close(r.sum(dim=1), [0.5, 0.4])
    # with the KL term: −0.05 per valid token on top
    r = token_rewards(t([0.5, 0.4]), mask, kl=torch.full((2, 3), 0.1, dtype=D), kl_coef=0.5, step_credit=credit)
    close(r, [[0.05, 0.15, 0.15], [-0.05, 0.35, 0.0]])
    with pytest.raises(ValueError, match="step_credit has shape"):
        token_rewards(t([0.5, 0.4]), mask, step_credit=t([[0.1, 0.2]]))


def test_token_rewards_errors():
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        token_rewards(t([1.0, 1.0]), t([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="kl is None"):
        token_rewards(t([1.0]), t([[1, 1]]), kl_coef=0.1)
    with pytest.raises(ValueError, match="terminal_reward"):
        token_rewards(t([1.0, 2.0, 3.0]), t([[1, 1]]))


def test_kl_estimators_hand_values():
    # logp = log 0.5, ref = log 0.25 → logp − ref = log 2, x = ref − logp = −log 2.
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    close(kl_estimator(logp, ref, "k1"), [math.log(2)])                 # 0.693147…
    close(kl_estimator(logp, ref, "k2"), [0.5 * math.log(2) ** 2])      # 0.240227…
    close(kl_estimator(logp, ref, "k3"), [0.5 + math.log(2) - 1.0])     # e^{−log 2} + log 2 − 1 = 0.193147…
    close(kl_estimator(ref, ref, "k3"), [0.0])
    with pytest.raises(ValueError, match="k1"):
        kl_estimator(logp, ref, "k4")


def test_k3_and_k2_never_negative():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(1000, generator=g, dtype=D) * 5, torch.randn(1000, generator=g, dtype=D) * 5
    assert bool((kl_estimator(logp, ref, "k3") >= 0).all()) and bool((kl_estimator(logp, ref, "k2") >= 0).all())
    assert bool((kl_estimator(logp, ref, "k1") < 0).any())  # k1 alone can be negative per sample


# ---------------------------------------------------------------- aggregation

LOSS_2x3 = t([[4.0, 100.0, 100.0], [1.0, 2.0, 3.0]])   # sub-trace of length 1 (padding holds garbage) and of length 3
MASK_2x3 = t([[1, 0, 0], [1, 1, 1]])


def test_agg_token_mean_weighs_by_tokens():
    close(agg_loss(LOSS_2x3, MASK_2x3, "token_mean"), (4 + 1 + 2 + 3) / 4)            # 2.5
    close(agg_loss(LOSS_2x3, MASK_2x3, "seq_mean_token_mean"), (4 + (1 + 2 + 3) / 3) / 2)  # 3.0
    close(agg_loss(LOSS_2x3, MASK_2x3, "seq_mean_token_sum"), (4 + 6) / 2)             # 5.0
    with pytest.raises(ValueError, match="token_mean"):
        agg_loss(LOSS_2x3, MASK_2x3, "sum")


def test_agg_global_token_count_ranks_sum_to_one_rank():
    # rank 0 holds row 0 (1 token), rank 1 holds row 1 (3 tokens); global count 4: 4/4 + 6/4 = 2.5.
    r0 = agg_loss(LOSS_2x3[:1], MASK_2x3[:1], global_token_count=4)
    r1 = agg_loss(LOSS_2x3[1:], MASK_2x3[1:], global_token_count=4)
    close(r0, 1.0)
    close(r1, 1.5)
    close(r0 + r1, agg_loss(LOSS_2x3, MASK_2x3))
    with pytest.raises(ValueError, match="global_token_count"):
        agg_loss(LOSS_2x3, MASK_2x3, "seq_mean_token_sum", global_token_count=4)


def test_policy_loss_two_ranks_gradients_sum_to_one_rank():
    g = torch.Generator().manual_seed(2)
    logp = (torch.randn(4, 5, generator=g, dtype=D) * 0.3).requires_grad_()
    old, adv = torch.zeros(4, 5, dtype=D), torch.randn(4, 5, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    full, _ = policy_loss(logp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, logp)
    n = int(mask.sum())
    l0, _ = policy_loss(logp[:2], old[:2], adv[:2], mask[:2], global_token_count=n)
    l1, _ = policy_loss(logp[2:], old[2:], adv[2:], mask[2:], global_token_count=n)
    (g_split,) = torch.autograd.grad(l0 + l1, logp)
    close(l0 + l1, full)
    torch.testing.assert_close(g_split, g_full, **TOL)


# ---------------------------------------------------------------- policy loss

def ratios_logp(ratios):
    return t([[math.log(r) for r in ratios]])


def test_policy_loss_clip_cases_by_hand():
    # ε = 0.2, old_logp = 0 so ratio ρ = exp(logp). ℓ = max(−Aρ, −A·clip(ρ, 0.8, 1.2)):
    #   A=+1: ρ=1.1 → −1.1 (inside)   ρ=1.5 → max(−1.5, −1.2) = −1.2 (clipped)   ρ=0.5 → max(−0.5, −0.8) = −0.5
    #   A=−1: ρ=1.1 →  1.1 (inside)   ρ=1.5 → max( 1.5,  1.2) =  1.5            ρ=0.5 → max( 0.5,  0.8) =  0.8 (clipped)
    # token mean = (−1.1 − 1.2 − 0.5 + 1.1 + 1.5 + 0.8) / 6 = 0.1; clipped term active on 2 of 6 tokens.
    logp = ratios_logp([1.1, 1.5, 0.5, 1.1, 1.5, 0.5]).requires_grad_()
    adv = t([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv), eps_clip=0.2)
    close(loss, 0.1)
    close(m["clip_frac"], 2 / 6)
    close(m["approx_kl"], -sum(math.log(r) for r in [1.1, 1.5, 0.5, 1.1, 1.5, 0.5]) / 6)
    assert m["dual_clip_frac"] == 0.0
    # ∂ℓ/∂logp = −A·ρ where the unclipped term is active, 0 where the clip is active; then /6.
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-1.1 / 6, 0.0, -0.5 / 6, 1.1 / 6, 1.5 / 6, 0.0]])


def test_policy_loss_asymmetric_upper_clip():
    # ε_low = 0.2, ε_high = 0.28: A=+1 ρ=1.25 → −1.25 (inside now), ρ=1.5 → −1.28; A=−1 ρ=0.5 → 0.8 (lower unchanged).
    logp = ratios_logp([1.25, 1.5, 0.5])
    adv = t([[1.0, 1.0, -1.0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv), eps_clip=0.2, eps_clip_high=0.28)
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    close(m["clip_frac"], 2 / 3)
    sym, _ = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv), eps_clip=0.2)
    close(sym, (-1.2 - 1.2 + 0.8) / 3)


def test_policy_loss_dual_clip():
    # c = 3. A=−1 ρ=5: max(5, 1.2) = 5 → min(5, 3) = 3 (dual clip active). A=−1 ρ=2: 2 < 3, unchanged.
    # A=+1 ρ=5: −1.2 (dual clip never applies to A > 0). A=−2 ρ=5: max(10, 2.4) = 10 → min(10, 6) = 6.
    logp = ratios_logp([5.0, 2.0, 5.0, 5.0]).requires_grad_()
    adv = t([[-1.0, -1.0, 1.0, -2.0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv), eps_clip=0.2, eps_clip_c=3.0)
    close(loss, (3.0 + 2.0 - 1.2 + 6.0) / 4)
    close(m["dual_clip_frac"], 2 / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, 2.0 / 4, 0.0, 0.0]])  # the capped tokens carry no gradient
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="eps_clip_c"):
            policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv), eps_clip_c=bad)


def test_policy_loss_tis_weights_and_mask():
    # A=+1 ρ=1.1 → −1.1, w=0.5 → −0.55;  A=−1 ρ=0.5 → 0.8, w=2 → 1.6;  mean = 1.05 / 2 = 0.525.
    # A third, padded token holds garbage and must not matter.
    logp = ratios_logp([1.1, 0.5, 7.0])
    adv, w = t([[1.0, -1.0, 1e6]]), t([[0.5, 2.0, 1e6]])
    mask = t([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, mask, eps_clip=0.2, tis_weights=w)
    close(loss, 0.525)
    close(m["clip_frac"], 0.5)


def test_tis_weights_truncate_and_detach():
    train_old = t([[math.log(0.5), math.log(0.25), math.log(0.3)]]).requires_grad_()
    rollout = t([[math.log(0.25), math.log(0.5), math.log(0.3)]])
    close(tis_weights(train_old, rollout, clip=2.0), [[2.0, 0.5, 1.0]])
    close(tis_weights(train_old, rollout, clip=1.5), [[1.5, 0.5, 1.0]])
    assert not tis_weights(train_old, rollout).requires_grad


def test_mask_offpolicy():
    mask = t([[1, 1, 1, 1, 0]])
    version = torch.tensor([[5, 4, 3, 2, 9]])       # the padded slot's version is never checked
    close(mask_offpolicy(mask, version, current_version=5, max_lag=2), [[1, 1, 1, 0, 0]])
    close(mask_offpolicy(mask, version, current_version=5, max_lag=0), [[1, 0, 0, 0, 0]])
    bmask = mask_offpolicy(mask.bool(), version, 5, 1)
    assert bmask.dtype == torch.bool and bmask.tolist() == [[True, True, False, False, False]]
    with pytest.raises(ValueError, match="current_version=3"):
        mask_offpolicy(mask, version, current_version=3, max_lag=2)


# ---------------------------------------------------------------- value loss and helpers

def test_value_loss_clipped_vs_unclipped_by_hand():
    # c = 0.2, v_old = 0.5, R = 1:
    #   v=0.6: clip → 0.6, both (0.4)² = 0.16                     → ½·0.16 = 0.08
    #   v=1.0: clip → 0.7, (0.7−1)² = 0.09 > (1−1)² = 0           → ½·0.09 = 0.045   (clipped branch active)
    #   v=0.0: clip → 0.3, (0.3−1)² = 0.49 < (0−1)² = 1           → ½·1    = 0.5     (unclipped branch wins)
    # token mean = 0.625 / 3
    values = t([[0.6, 1.0, 0.0]]).requires_grad_()
    loss, m = value_loss(values, torch.full((1, 3), 0.5, dtype=D), torch.ones(1, 3, dtype=D), torch.ones(1, 3, dtype=D),
                         value_clip=0.2)
    close(loss, 0.625 / 3)
    close(m["vf_clip_frac"], 1 / 3)
    (grad,) = torch.autograd.grad(loss, values)
    close(grad, [[(0.6 - 1.0) / 3, 0.0, (0.0 - 1.0) / 3]])  # ½·2(v−R)/3 where unclipped, 0 where clipped
    unclipped, _ = value_loss(values, torch.full((1, 3), 0.5, dtype=D), torch.ones(1, 3, dtype=D),
                              torch.ones(1, 3, dtype=D), value_clip=None)
    close(unclipped, 0.5 * (0.16 + 0.0 + 1.0) / 3)


def test_explained_variance_by_hand():
    # y = [1, 2, 3], ŷ = [1, 2, 4]: residual [0, 0, −1]; Var(res)/Var(y) = (2/9)/(2/3) = 1/3 → EV = 2/3.
    # A padded 4th slot is ignored.
    mask = t([1, 1, 1, 0])
    close(explained_variance(t([1.0, 2.0, 4.0, 50.0]), t([1.0, 2.0, 3.0, -50.0]), mask), 2 / 3)
    assert math.isnan(explained_variance(t([1.0, 2.0]), t([1.0, 1.0]), t([1, 1])).item())


def test_masked_mean_and_whiten():
    x, mask = t([[1.0, 2.0, 3.0, 1e9]]), t([[1, 1, 1, 0]])
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty mask → 0, not nan
    w = masked_whiten(x, mask)
    # mean 2, unbiased var 1 → (x − 2)/sqrt(1 + 1e−8)
    close(w, [[-1 / math.sqrt(1 + 1e-8), 0.0, 1 / math.sqrt(1 + 1e-8), 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[-1 / math.sqrt(1 + 1e-8) + 2, 2.0, 1 / math.sqrt(1 + 1e-8) + 2,
                                                      0.0]])


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(2, 3, 5, dtype=D)), torch.full((2, 3), math.log(5), dtype=D))
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 7, generator=g, dtype=D) * 3
    p = torch.softmax(z, -1)
    close(entropy_from_logits(z), -(p * p.log()).sum(-1))


def test_nan_padding_reaches_neither_loss_nor_gradient():
    # Every input holds nan in the padded slot, including logp/values (which carry grad back to the model).
    nan = float("nan")
    mask = t([[1.0, 1.0, 0.0]])
    logp = ratios_logp([1.1, 0.5, 1.0])
    logp[0, 2] = nan
    logp.requires_grad_()
    loss, m = policy_loss(logp, t([[0.0, 0.0, nan]]), t([[1.0, -1.0, nan]]), mask, tis_weights=t([[0.5, 2.0, nan]]))
    close(loss, 0.525)   # the numbers of test_policy_loss_tis_weights_and_mask
    assert all(math.isfinite(v) for v in m.values())
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-1.1 * 0.5 / 2, 0.0, 0.0]])
    values = t([[0.6, 1.0, nan]]).requires_grad_()
    vloss, vm = value_loss(values, t([[0.5, 0.5, nan]]), t([[1.0, 1.0, nan]]), mask)
    close(vloss, (0.08 + 0.045) / 2)
    (vgrad,) = torch.autograd.grad(vloss, values)
    close(vgrad, [[(0.6 - 1.0) / 2, 0.0, 0.0]])
