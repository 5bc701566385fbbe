"""Critic-based PPO end to end on CPU, no server: a nano policy + nano critic, each in a DeepSpeedBackend (ZeRO 0),
learn a toy task (reward 1 iff the first sampled char is 'a'), sampled in-process with a manual loop whose log-probs
are the rollout log-probs. Plus the batch alignment by hand, the critic's save/load, and critic warm-up.
"""
from __future__ import annotations

import math

import pytest
import torch

from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
from infra.models import build_model, load_model
from infra.tokenizer import char_vocab
from teachers.april import Sample
from teachers.critic import ValueModel
from teachers.ppo_step import build_batch, ppo_update, token_logprobs

pytestmark = pytest.mark.integration

VOCAB = char_vocab()
PAD, BOS, EOS = VOCAB["<pad>"], VOCAB["<bos>"], VOCAB["<eos>"]
PROMPT = [BOS] + [VOCAB[c] for c in "Q:"]
TARGET = VOCAB["a"]


def backends(lr: float, batch: int, seed: int = 0) -> tuple[DeepSpeedBackend, DeepSpeedBackend]:
    policy = DeepSpeedBackend(build_model("nano", len(VOCAB), PAD, BOS, EOS, seed=seed),
                              TrainSettings(lr=lr, micro_batch_size=batch, seed=seed))
    critic = DeepSpeedBackend(ValueModel.from_preset("nano", len(VOCAB), PAD, BOS, EOS, seed=seed),
                              TrainSettings(lr=lr, micro_batch_size=batch, seed=seed))
    return policy, critic


def sample(model: torch.nn.Module, n: int, length: int, step: int,
           gen: torch.Generator) -> tuple[list[Sample], list[float]]:
    """n responses of `length` chars from the prompt (temperature 1); rollout log-probs = the sampled tokens' log π."""
    model.eval()
    ids = torch.tensor([PROMPT] * n)
    logps = []
    with torch.no_grad():
        for _ in range(length):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(-1, tok))
            ids = torch.cat([ids, tok], dim=1)
    out, logps = ids[:, len(PROMPT):].tolist(), torch.cat(logps, dim=1).tolist()
    samples = [Sample(sample_id=f"{step}-{i}", rollout_id=f"{step}-{i}", prompt_ids=PROMPT, output_ids=out[i],
                      output_logprobs=logps[i], token_versions=[step] * length, domain="toy", example={},
                      finish_reason="length") for i in range(n)]
    return samples, [1.0 if o[0] == TARGET else 0.0 for o in out]


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_build_batch_alignment_by_hand(tiny_model_dir):
    a = Sample("a", "ra", [1, 10, 11], [20, 21], [-0.5, -0.7], [0, 0], "toy", {}, "stop")
    b = Sample("b", "rb", [1], [30, 31, 32], [-1.0, -2.0, -3.0], [0, 0, 0], "toy", {}, "length", loss_mask=[1, 0, 1])
    batch = build_batch([a, b], pad_id=PAD, rewards=[1.0, 0.0])
    # position t predicts token t+1: a's outputs sit at 3, 4 → predicted from 2, 3; b's at 1, 2, 3 → from 0, 1, 2
    assert batch.input_ids.tolist() == [[1, 10, 11, 20, 21], [1, 30, 31, 32, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1, 0], [1, 0, 1, 0, 0]]  # b's middle token has loss_mask 0
    assert batch.rollout_logprobs.tolist() == [[0, 0, -0.5, pytest.approx(-0.7), 0], [-1.0, 0, -3.0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.num_tokens == 4 and batch.sample_ids == ["a", "b"]

    # token_logprobs reads the same alignment: logp[b, t] = log_softmax(logits[b, t])[input_ids[b, t+1]]
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        logp = token_logprobs(model, batch)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert logp.shape == (2, 5) and logp[:, -1].tolist() == [0.0, 0.0]
    for row, t in [(0, 2), (0, 3), (1, 0), (1, 2)]:
        want = torch.log_softmax(logits[row, t], -1)[batch.input_ids[row, t + 1]]
        assert logp[row, t].item() == pytest.approx(want.item(), abs=1e-6)

    bad = Sample("c", "rc", [1], [30, 31], [-1.0], [0, 0], "toy", {}, "stop")
    with pytest.raises(ValueError, match=r"sample 0 \(c\) has 1 output_logprobs for 2 output_ids"):
        build_batch([bad], pad_id=PAD)


def test_value_model_roundtrip_and_backbone_from_pretrained(tmp_path, tiny_model_dir):
    critic = ValueModel.from_pretrained(tiny_model_dir)
    policy = load_model(tiny_model_dir)
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    ids = torch.tensor([[1, 40, 41, 42], [1, 50, 51, PAD]])
    am = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert torch.equal(critic(ids, am), torch.zeros(2, 4))  # zero-initialised head
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
        critic.value_head.bias.fill_(0.25)
    before = critic(ids, am)
    assert before.shape == (2, 4) and before.abs().min() > 0
    loaded = ValueModel.load(critic.save(tmp_path / "critic"))
    assert torch.equal(loaded(ids, am), before)
    with pytest.raises(FileNotFoundError, match="value_model.safetensors missing"):
        ValueModel.load(tmp_path)


def test_critic_only_leaves_policy_unchanged():
    policy, critic = backends(lr=3e-3, batch=8)
    samples, _ = sample(policy.module, 8, 3, 0, torch.Generator().manual_seed(0))
    batch = build_batch(samples, PAD, rewards=[1.0, 0.0] * 4)
    # pretend the rollout engine was 0.5 nats more confident than the trainer: TIS weight exp(−0.5) on every token
    batch.rollout_logprobs = torch.where(batch.mask != 0, batch.rollout_logprobs + 0.5, batch.rollout_logprobs)
    pi0, v0 = params(policy.module), params(critic.module)
    m = ppo_update(policy, critic, batch, critic_only=True, ppo_epochs=1)
    assert all(torch.equal(pi0[k], v) for k, v in params(policy.module).items())
    assert all(p.grad is None or not p.grad.any() for p in policy.module.parameters())
    assert any(not torch.equal(v0[k], v) for k, v in params(critic.module).items())
    # zero head, V = 0, γ = 1, λ = 0.95: δ = r, so the returns are the λ-returns [λ²R, λR, R] of each row, and
    # vf_loss = ½ · Σ G² / 24 tokens = ½ · 4 rows · (0.9025² + 0.95² + 1) / 24
    assert m["vf_loss"] == pytest.approx(0.5 * 4 * (0.9025 ** 2 + 0.95 ** 2 + 1) / 24, rel=1e-6)
    assert m["reward_mean"] == 0.5 and m["num_tokens"] == 24.0 and "pg_loss" not in m
    assert m["tis_weight_mean"] == pytest.approx(math.exp(-0.5), abs=1e-5)
    policy.close()
    critic.close()


def test_ppo_learns_toy_task_and_first_epoch_ratio_is_one():
    policy, critic = backends(lr=3e-3, batch=64)
    gen = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(30):
        samples, r = sample(policy.module, 64, 3, step, gen)
        m = ppo_update(policy, critic, build_batch(samples, PAD, r), ppo_epochs=2)
        rewards.append(m["reward_mean"])
        # on-policy data: π_old recomputed by the trainer equals the sampler's π, so epoch 1 has ratio 1, no clipping
        assert m["clip_frac_first"] == 0.0
        assert m["ratio_mean_first"] == pytest.approx(1.0, abs=1e-6)
        assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert all(math.isfinite(m[k]) for k in ("pg_loss", "vf_loss", "entropy", "approx_kl"))
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print("reward per update:", [round(r, 3) for r in rewards])
    assert start < 0.1, rewards
    assert end > 0.5, rewards
    policy.close()
    critic.close()


def test_kl_penalty_enters_the_token_rewards():
    policy, critic = backends(lr=3e-3, batch=4)
    samples, _ = sample(policy.module, 4, 3, 0, torch.Generator().manual_seed(0))
    batch = build_batch(samples, PAD, rewards=[0.0] * 4)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        ppo_update(policy, critic, batch, kl_coef=0.1)
    with torch.no_grad():
        ref = token_logprobs(policy, batch) + 1.0  # k1 = logp − ref = −1 per token → r_t = −0.1·(−1) = +0.1
    m = ppo_update(policy, critic, batch, kl_coef=0.1, ref_logprobs=ref, critic_only=True)
    # V = 0, γ = 1, λ = 0.95: G = [0.1 + 0.95·0.195, 0.1 + 0.95·0.1, 0.1] per row; vf_loss = ½·mean(G²)
    g = [0.1 + 0.95 * 0.195, 0.195, 0.1]
    assert m["vf_loss"] == pytest.approx(0.5 * sum(x * x for x in g) / 3, rel=1e-5)
    policy.close()
    critic.close()


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_reusing_the_first_epoch_forwards_as_pi_old_changes_nothing(monkeypatch, ppo_epochs):
    """Without dropout, epoch 1's forwards double as the π_old / V_old forwards: the same update, to the last bit,
    as separate eval-mode forwards."""
    import teachers.ppo_step as ps

    gen = torch.Generator().manual_seed(1)
    pol, _ = backends(lr=3e-3, batch=16)
    samples, r = sample(pol.module, 16, 4, 0, gen)
    pol.close()
    results = []
    for reuse in (True, False):
        monkeypatch.setattr(ps, "is_deterministic", lambda b, reuse=reuse: reuse)
        policy, critic = backends(lr=3e-3, batch=16)
        batch = build_batch(samples, PAD, r)
        with torch.no_grad():
            ref = token_logprobs(policy, batch) - 0.3
        m = ppo_update(policy, critic, batch, ppo_epochs=ppo_epochs, kl_coef=0.1, ref_logprobs=ref)
        results.append((m, params(policy.module), params(critic.module)))
        policy.close()
        critic.close()
    (m1, pi1, v1), (m2, pi2, v2) = results
    assert all(torch.equal(pi1[k], pi2[k]) for k in pi1) and all(torch.equal(v1[k], v2[k]) for k in v1)
    assert m1 == m2


def test_dropout_is_detected_in_modules_and_in_the_hf_config():
    from teachers.ppo_step import is_deterministic

    model = build_model("nano", len(VOCAB), PAD, BOS, EOS, seed=0)
    assert is_deterministic(model)
    model.config.attention_dropout = 0.1  # HF Llama applies it functionally: only the config shows it
    assert not is_deterministic(model)
    assert not is_deterministic(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert is_deterministic(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))



def grads_at_each_step(backend) -> list[dict[str, torch.Tensor]]:
    """Records the module's gradients just before each optimizer step of `backend` (its engine's step)."""
    seen, step = [], backend.engine.step

    def recording(*a, **kw):
        seen.append({n: p.grad.detach().clone() for n, p in backend.module.named_parameters() if p.grad is not None})
        return step(*a, **kw)
    backend.engine.step = recording
    return seen


@pytest.mark.parametrize("critic_only", [False, True])
def test_token_budget_micro_batches_give_the_one_pass_update(critic_only):
    """`micro_batch_tokens`: each epoch's rows go in micro-batches of ≤ 24 padded positions (one backward each,
    `DeepSpeedBackend.accumulate`), π_old / V_old without grad in the same groups. The losses are token sums over
    the global count, so each step's gradients equal the one-pass ones (length buckets, first-epoch reuse) to float
    rounding (observed ~5e-8 on gradients of ~0.3), and so do pg_loss, vf_loss and the token-weighted metrics. The
    weights after two Adam steps agree to 1e-5 (Adam divides near-zero gradients by their own size)."""
    gen = torch.Generator().manual_seed(3)
    pol, _ = backends(lr=3e-3, batch=8)
    samples, _ = sample(pol.module, 8, 6, 0, gen)
    pol.close()
    for i, s in enumerate(samples):  # outputs of 1..6 tokens: rows of 4..9, several micro-batches of ≤ 24
        k = 1 + i % 6
        s.output_ids, s.output_logprobs, s.token_versions = s.output_ids[:k], s.output_logprobs[:k], [0] * k
    r = [float(i % 3 == 0) for i in range(8)]
    results = []
    for budget in (None, 24):
        settings = TrainSettings(lr=3e-3, micro_batch_size=8, seed=0, micro_batch_tokens=budget)
        policy = DeepSpeedBackend(build_model("nano", len(VOCAB), PAD, BOS, EOS, seed=0), settings)
        critic = DeepSpeedBackend(ValueModel.from_preset("nano", len(VOCAB), PAD, BOS, EOS, seed=0), settings)
        g_pi, g_v = grads_at_each_step(policy), grads_at_each_step(critic)
        batch = build_batch(samples, PAD, r)
        with torch.no_grad():
            ref = token_logprobs(policy, batch) - 0.3
        m = ppo_update(policy, critic, batch, ppo_epochs=2, kl_coef=0.1, ref_logprobs=ref, critic_only=critic_only)
        results.append((m, g_pi, g_v, params(policy.module), params(critic.module)))
        policy.close()
        critic.close()
    (m1, gp1, gv1, pi1, v1), (m2, gp2, gv2, pi2, v2) = results
    assert len(gp1) == len(gp2) == (0 if critic_only else 2) and len(gv1) == len(gv2) == 2
    for a, b in zip(gp1 + gv1, gp2 + gv2):
        assert set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max(a[k].abs().max().item() for a in gv1 for k in a) > 1e-2  # a real gradient, not zeros
    assert max((pi1[k] - pi2[k]).abs().max().item() for k in pi1) < 1e-5
    assert max((v1[k] - v2[k]).abs().max().item() for k in v1) < 1e-5
    assert set(m1) == set(m2)
    for k in m1:
        assert m1[k] == pytest.approx(m2[k], abs=1e-6, nan_ok=True), k
