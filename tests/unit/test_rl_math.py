"""The RL primitives both trainers' losses share (training/rl_math.py), on hand-derived numbers, and the PPO and
OPD losses computing their importance weights and shape checks through them (issue 55: one module, not two)."""
from __future__ import annotations

import inspect
from math import log

import pytest
import torch

from training.rl_math import check_shapes, seq_mean_weights, token_mean, truncated_ratio

pytestmark = pytest.mark.unit


def test_truncated_ratio_by_hand():
    num, den = torch.tensor([[log(0.5), log(0.1), 0.0]]), torch.tensor([[log(0.1), log(0.5), 0.0]])
    torch.testing.assert_close(truncated_ratio(num, den), torch.tensor([[5.0, 0.2, 1.0]]))
    torch.testing.assert_close(truncated_ratio(num, den, clip=2.0), torch.tensor([[2.0, 0.2, 1.0]]))
    huge = truncated_ratio(torch.tensor([500.0]), torch.tensor([0.0]))  # clamped at exp(20), never inf
    assert torch.isfinite(huge).all() and float(huge) == pytest.approx(float(torch.exp(torch.tensor(20.0))))
    assert not truncated_ratio(num.requires_grad_(), den).requires_grad
    with pytest.raises(ValueError, match="clip must be > 0"):
        truncated_ratio(num, den, clip=0.0)


def test_token_mean_by_hand_ignores_garbage_in_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 4.0]])
    valid = torch.tensor([[True, True, False], [True, False, True]])
    assert float(token_mean(x, valid)) == pytest.approx(10.0 / 4)
    assert float(token_mean(x, valid, global_token_count=8)) == pytest.approx(10.0 / 8)  # a micro-batch's share
    assert float(token_mean(x, torch.zeros_like(valid))) == 0.0
    with pytest.raises(ValueError, match="global_token_count must be > 0"):
        token_mean(x, valid, global_token_count=0)


def test_seq_mean_weights_by_hand():
    # lengths 4, 1, 3: N = 8 tokens, S = 3 sequences → w = 8/(3·L) = [2/3, 8/3, 8/9]; Σ w·L = 8/3 · 3 = N
    assert seq_mean_weights([4, 1, 3]) == pytest.approx([2 / 3, 8 / 3, 8 / 9])
    assert seq_mean_weights([0, 2]) == [0.0, 1.0]  # an empty row (all tool output) counts in neither N nor S
    assert seq_mean_weights([]) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        seq_mean_weights([2, -1])
    # the weighted token mean is then the mean over rows of each row's token mean: rows [1, 2, 3, 4] and [10]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, float("nan"), 0.0, 0.0]])
    valid = torch.tensor([[True] * 4, [True, False, False, False]])
    w = torch.tensor(seq_mean_weights([4, 1]))[:, None].expand(2, 4)  # 5/8, 5/2
    assert float(token_mean(x, valid, weight=w)) == pytest.approx((2.5 + 10.0) / 2)  # not (10 + 10)/5 = 4
    assert float(token_mean(x, valid)) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="token_mean: weight has shape"):
        token_mean(x, valid, weight=w[:, :2])


def test_check_shapes_names_the_tensor():
    ref = torch.zeros(2, 3)
    check_shapes("f", "mask", ref, a=torch.zeros(2, 3), b=None)
    with pytest.raises(ValueError, match=r"f: b has shape \(3, 2\) but mask has \(2, 3\)"):
        check_shapes("f", "mask", ref, a=torch.zeros(2, 3), b=torch.zeros(3, 2))


def test_both_losses_use_the_shared_primitives():
    from student import losses
    from teachers import ppo_math

    assert "truncated_ratio(" in inspect.getsource(ppo_math.tis_weights)
    assert "truncated_ratio(" in inspect.getsource(losses.importance_ratio)
    assert losses._token_mean is token_mean
    assert not hasattr(ppo_math, "_check_shapes")
