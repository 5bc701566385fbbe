"""The Bradley–Terry loss (training/rm_math.py) against hand-derived numbers, float64, tolerance 1e-12."""
import math

import pytest
import torch

from training.rm_math import bradley_terry_loss

pytestmark = pytest.mark.unit

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=0, atol=atol)


def test_two_pairs_by_hand():
    # gaps: 2 − 1 = 1, 0 − 1 = −1.  −log σ(1) = log(1 + e^−1) = 0.313261687518223
    #                               −log σ(−1) = log(1 + e^1)  = 1.313261687518223 (the two differ by exactly 1)
    loss, m = bradley_terry_loss(t([2.0, 0.0]), t([1.0, 1.0]))
    close(loss, (math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2)
    close(loss, 0.813261687518223)
    close(m["accuracy"], 0.5)  # one of two pairs ranked right
    close(m["margin"], 0.0)  # (1 + −1) / 2
    close(m["pairs"], 2.0)
    close(m["loss"], loss)
    assert not m["loss"].requires_grad


def test_equal_scores_cost_log_2_and_count_as_wrong():
    loss, m = bradley_terry_loss(t([0.3, -5.0, 7.0]), t([0.3, -5.0, 7.0]))
    close(loss, math.log(2.0))
    close(m["accuracy"], 0.0)


def test_margin_shifts_the_argument_not_the_metrics():
    # gap 3, margin 1: −log σ(2) = log(1 + e^−2) = 0.126928011042973; gap 0.5, margin 2: −log σ(−1.5) = log(1 + e^1.5)
    loss, m = bradley_terry_loss(t([3.0, 1.0]), t([0.0, 0.5]), margin=t([1.0, 2.0]))
    close(loss, (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.5))) / 2)
    close(math.log1p(math.exp(-2.0)), 0.126928011042973)
    close(m["accuracy"], 1.0)  # both gaps are positive: the margin is a training target, not the ranking
    close(m["margin"], 1.75)  # (3 + 0.5) / 2, the gap itself


def test_gradient_is_sigma_minus_one_over_n():
    # d/dr_c softplus(−(r_c − r_r)) / N = (σ(gap) − 1) / N; d/dr_r = (1 − σ(gap)) / N
    c, r = t([1.0, -2.0, 0.0]).requires_grad_(), t([0.0, 0.0, 0.0]).requires_grad_()
    loss, _ = bradley_terry_loss(c, r)
    loss.backward()
    sig = [1 / (1 + math.exp(-g)) for g in (1.0, -2.0, 0.0)]
    close(c.grad, [(s - 1) / 3 for s in sig])
    close(r.grad, [(1 - s) / 3 for s in sig])


def test_normalizer_splits_a_batch_into_parts_that_sum_to_the_whole():
    """Two ranks, each with its share of 4 pairs, normalizer = 4 / 2: DeepSpeed averages the two ranks' gradients,
    so the mean of the parts' losses is the 1-rank loss."""
    c, r = t([1.0, 2.0, -1.0, 0.5]), t([0.0, 3.0, 0.0, 0.5])
    whole, _ = bradley_terry_loss(c, r)
    a, _ = bradley_terry_loss(c[0::2], r[0::2], normalizer=2.0)
    b, _ = bradley_terry_loss(c[1::2], r[1::2], normalizer=2.0)
    close((a + b) / 2, whole)


def test_extreme_gaps_stay_finite():
    loss, _ = bradley_terry_loss(t([1000.0, -1000.0]), t([-1000.0, 1000.0]))
    close(loss, 2000.0 / 2, atol=1e-9)  # −log σ(2000) ≈ 0, −log σ(−2000) ≈ 2000
    loss32, _ = bradley_terry_loss(torch.tensor([90.0]), torch.tensor([-90.0]))
    assert torch.isfinite(loss32) and float(loss32) == 0.0


def test_head_shaped_scores_and_shape_errors():
    loss, m = bradley_terry_loss(t([[2.0], [0.0]]), t([[1.0], [1.0]]))
    close(loss, 0.813261687518223)
    with pytest.raises(ValueError, match=r"chosen has shape \(2,\) but rejected has \(3,\)"):
        bradley_terry_loss(t([1.0, 2.0]), t([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"margin has shape \(1,\)"):
        bradley_terry_loss(t([1.0, 2.0]), t([1.0, 2.0]), margin=t([1.0]))
    with pytest.raises(ValueError, match=r"chosen must have shape \(B,\) or \(B, 1\)"):
        bradley_terry_loss(t([[1.0, 2.0]]), t([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="no pairs"):
        bradley_terry_loss(t([]), t([]))
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        bradley_terry_loss(t([1.0]), t([0.0]), normalizer=0)
