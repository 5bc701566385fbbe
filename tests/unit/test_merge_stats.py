"""bench/merge_stats.py: the 95% intervals over seeds and the multi-seed summary, with hand-derived numbers."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from merge_stats import ci95, summarize, summary_table, t975, target  # noqa: E402

pytestmark = pytest.mark.unit


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(10) == 2.228
    assert t975(22) == 2.086  # between table entries: the lower df's (wider) value
    assert t975(31) == 1.96
    with pytest.raises(ValueError, match="2 seeds"):
        t975(0)


def test_ci95_by_hand():
    # [1, 2, 3]: mean 2, sd 1, half = 4.303 / sqrt(3) = 2.484338
    c = ci95([1, 2, 3])
    assert c["mean"] == 2 and c["sd"] == 1 and c["n"] == 3
    assert c["ci95_low"] == pytest.approx(2 - 4.303 / math.sqrt(3)) == pytest.approx(-0.484338, abs=1e-6)
    assert c["ci95_high"] == pytest.approx(4.484338, abs=1e-6)
    # two seeds 0.2, 0.4: mean 0.3, sd 0.141421, half = 12.706 · 0.141421 / 1.414214 = 1.2706
    c = ci95([0.2, 0.4])
    assert (c["ci95_low"], c["ci95_high"]) == (pytest.approx(-0.9706), pytest.approx(1.5706))
    assert ci95([0.5]) == {"mean": 0.5, "ci95_low": 0.5, "ci95_high": 0.5, "sd": 0.0, "n": 1}
    with pytest.raises(ValueError):
        ci95([])


def agg(base, own, opd, offline, mixed, seq, forget=(0.0, 0.0, 0.0, 0.0)):
    """A one-domain per-seed aggregate ("d") as merge_baselines.aggregate writes it."""
    def arm(x, f):
        return {"scores": {"d": x}, "mean_score": x, "forgetting_mean": f, "gain_vs_base_mean": x - base}
    return {"base": {"scores": {"d": base}, "mean_score": base}, "specialists": {"own": {"d": own}},
            "opd": arm(opd, forget[0]), "offline": arm(offline, forget[1]), "mixed_rl": arm(mixed, forget[2]),
            "sequential_rl": {**arm(seq, forget[3]), "forgetting_mean_first_d_minus_1": forget[3] * 2}}


def test_summary_paired_differences_and_target():
    aggs = [agg(0.1, 0.5, 0.4, 0.2, 0.3, 0.1, (0.1, 0.3, 0.0, 0.4)),
            agg(0.2, 0.6, 0.5, 0.2, 0.3, 0.1, (0.1, 0.4, 0.0, 0.4)),
            agg(0.0, 0.4, 0.3, 0.2, 0.3, 0.1, (0.1, 0.5, 0.0, 0.4))]
    s = summarize(aggs, ["d"])
    assert s["opd"]["mean"] == pytest.approx(0.4) and s["opd"]["per_seed"] == [0.4, 0.5, 0.3]
    # opd sd 0.1 → half 4.303·0.1/√3 = 0.248434
    assert s["opd"]["ci95_low"] == pytest.approx(0.4 - 0.248434, abs=1e-6)
    assert s["mixed_rl"]["ci95_low"] == s["mixed_rl"]["ci95_high"] == pytest.approx(0.3)  # no spread
    # paired OPD − mixed: 0.1, 0.2, 0.0 → mean 0.1, same interval width as opd's own
    d = s["mixed_rl"]["opd_minus_arm"]
    assert d["mean"] == pytest.approx(0.1) and d["ci95_low"] == pytest.approx(0.1 - 0.248434, abs=1e-6)
    assert "opd_minus_arm" not in s["opd"]
    assert s["offline_kd"]["forgetting"]["mean"] == pytest.approx(0.4)
    assert s["sequential_rl"]["forgetting_first_d_minus_1"]["mean"] == pytest.approx(0.8)
    assert s["specialists"]["mean_score"]["mean"] == pytest.approx(0.5)
    assert s["base"]["per_domain"]["d"]["mean"] == pytest.approx(0.1)
    t = target(s)
    # opd's low 0.1516 < mixed's 0.3: the intervals overlap, though every paired difference is ≥ 0
    assert t["opd_interval_above_mixed_rl"]["met"] is False
    assert t["opd_minus_mixed_rl_paired_ci_above_0"]["met"] is False  # 0.1 − 0.248 < 0
    assert t["opd_interval_above_offline_kd"]["met"] is False  # 0.1516 < 0.2 (offline has no spread)
    assert t["opd_forgets_less_than_sequential_rl"]["met"] is True  # 0.1 < 0.4
    assert t["met"] is False
    md = summary_table(s, ["d"], 3)
    assert "3 seeds" in md and "| **opd** | 0.400 [0.152, 0.648] |" in md


def test_target_met_when_intervals_separate():
    aggs = [agg(0.1, 0.6, 0.50, 0.2, 0.3, 0.1), agg(0.1, 0.6, 0.52, 0.21, 0.31, 0.1),
            agg(0.1, 0.6, 0.51, 0.22, 0.29, 0.1, (0.0, 0.0, 0.0, 0.3))]
    t = target(summarize(aggs, ["d"]))
    assert t["opd_interval_above_mixed_rl"]["met"] and t["opd_interval_above_offline_kd"]["met"]
    assert t["opd_forgets_less_than_sequential_rl"]["met"] and t["met"] is True


def test_one_seed_judges_no_interval_and_the_long_bar():
    """One seed has no interval: every interval check (and the verdict) is null, not a point read as an interval.
    Issue 56's bar (`paired_bar` 0.02) judges the paired lower bounds instead."""
    t = target(summarize([agg(0.1, 0.6, 0.50, 0.2, 0.3, 0.1)], ["d"]), paired_bar=0.02)
    assert t["opd_interval_above_mixed_rl"]["met"] is None and t["opd_minus_offline_kd_paired_ci_above_0"]["met"] is None
    assert t["opd_minus_mixed_rl_paired_low_at_least_0.02"]["met"] is None and t["met"] is None
    # three seeds: OPD − mixed 0.20, 0.21, 0.22 → sd 0.01, low 0.21 − 4.303·0.01/√3 = 0.185157 ≥ 0.02
    aggs = [agg(0.1, 0.6, 0.50, 0.2, 0.3, 0.1), agg(0.1, 0.6, 0.52, 0.21, 0.31, 0.1),
            agg(0.1, 0.6, 0.51, 0.22, 0.29, 0.1)]
    t = target(summarize(aggs, ["d"]), paired_bar=0.02)
    assert t["headline"] == ["opd_minus_mixed_rl_paired_low_at_least_0.02", "opd_minus_offline_kd_paired_low_at_least_0.02"]
    assert t["opd_minus_mixed_rl_paired_low_at_least_0.02"]["ci95_low"] == pytest.approx(0.185157, abs=1e-6)
    assert t["met"] is True
    t = target(summarize(aggs, ["d"]), paired_bar=0.3)  # a bar above every lower bound
    assert t["met"] is False
