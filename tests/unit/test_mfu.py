"""training/mfu.py: the PaLM FLOPs count (6N + 12·L·d·T per token) and MFU, on hand-derived numbers."""
from types import SimpleNamespace

import pytest

from training.mfu import ModelShape, card_peak, flops_per_token, mfu, step_perf, train_flops

pytestmark = pytest.mark.unit


def test_flops_per_token_hand_numbers():
    # N = 1000, L = 2, d = 8, T = 10: 6·1000 + 12·2·8·10 = 6000 + 1920
    assert flops_per_token(ModelShape(1000, 2, 8), 10) == 7920.0
    # the `medium` preset (151M, 12 layers, hidden 1024) at T = 512: 6·151e6 + 12·12·1024·512 = 906e6 + 75.497472e6
    assert flops_per_token(ModelShape(151_000_000, 12, 1024), 512) == 906_000_000 + 75_497_472


def test_train_flops_counts_each_row_at_its_own_length():
    shape = ModelShape(1000, 2, 8)
    # rows of 10 and 4 tokens: 10·(6000 + 192·10) + 4·(6000 + 192·4) = 79200 + 27072 (no padding to 10 counted)
    assert train_flops(shape, [10, 4]) == 79200 + 27072
    assert train_flops(shape, []) == 0.0


def test_mfu_hand_numbers_and_none_without_a_peak():
    # 989.4e12 FLOPs in 2 s on a 989.4 TFLOP/s card: half of the peak
    assert mfu(989.4e12, 2.0, 989.4) == pytest.approx(0.5, rel=1e-12)
    assert mfu(1e12, 1.0, None) is None  # the CPU: no peak
    assert mfu(1e12, 0.0, 989.4) is None and mfu(0.0, 1.0, 989.4) is None


def test_step_perf_splits_the_flops_over_ranks_and_counts_passes():
    shape = ModelShape(1000, 2, 8)
    flops = train_flops(shape, [10, 4])  # 106272
    one = step_perf([shape], [10, 4], 2.0, 1e-9)  # a peak of 1000 FLOP/s keeps the numbers readable
    assert one["tokens_per_s"] == 7.0 and one["mfu"] == pytest.approx(flops / 2.0 / 1000.0, rel=1e-12)
    # policy and critic, 2 epochs each, on 2 ranks: 2·2·flops / 2 ranks per card
    two = step_perf([shape, shape], [10, 4], 2.0, 1e-9, world_size=2, passes=2)
    assert two["tokens_per_s"] == 7.0 and two["mfu"] == pytest.approx(2 * flops / 2.0 / 1000.0, rel=1e-12)
    assert one["flops"] == flops and two["flops"] == 2 * flops  # one card's share: 2 models · 2 passes / 2 ranks
    assert step_perf([shape], [10], 1.0, None)["mfu"] is None


def test_card_peak_from_the_device_name():
    assert card_peak("NVIDIA H200") == 989.4 and card_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert card_peak(None) is None and card_peak("NVIDIA GeForce GTX 1080") is None


def test_model_shape_reads_llama_and_gpt2_style_configs():
    assert ModelShape.of(SimpleNamespace(num_hidden_layers=12, hidden_size=1024), 151) == ModelShape(151, 12, 1024)
    assert ModelShape.of(SimpleNamespace(n_layer=2, n_embd=64), 9) == ModelShape(9, 2, 64)
    assert ModelShape.of(SimpleNamespace(), 5) == ModelShape(5, 0, 0)  # no attention term: 6N only
