"""bench/specialist_sweep.py: replaying an early-stopping rule on a recorded validation curve, by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from specialist_sweep import parse_arm, replay  # noqa: E402

pytestmark = pytest.mark.unit

CURVE = [{"step": s, "score": v} for s, v in
         [(0, 0.40), (50, 0.45), (100, 0.44), (150, 0.45), (200, 0.43), (250, 0.42), (300, 0.60), (350, 0.97)]]


def test_replay_patience_cap_and_stop_at():
    # patience 4: the best 0.45 at step 50; 100, 150 (a tie is no new best), 200, 250 → stop at 250, never seeing 0.60
    assert replay(CURVE, 900, 4, None) == {"best": 0.45, "best_step": 50, "steps": 250}
    # patience 5 reaches step 300 (0.60, a new best), then 350 (0.97 ≥ stop_at 0.95) stops it
    assert replay(CURVE, 900, 5, 0.95) == {"best": 0.97, "best_step": 350, "steps": 350}
    # no patience, cap 300: validations up to step 300 only
    assert replay(CURVE, 300, 0, None) == {"best": 0.60, "best_step": 300, "steps": 300}
    # stop_at reached at step 0
    assert replay(CURVE, 900, 0, 0.30) == {"best": 0.40, "best_step": 0, "steps": 0}


def test_parse_arm():
    assert parse_arm("demo=") == ("demo", [])
    assert parse_arm("kl0=specialists.kl_coef=0.0,specialists.steps=800") == (
        "kl0", ["specialists.kl_coef=0.0", "specialists.steps=800"])
    with pytest.raises(SystemExit, match="not a specialists"):
        parse_arm("x=kl_coef=0")
    with pytest.raises(SystemExit, match="NAME="):
        parse_arm("=specialists.kl_coef=0")


def test_summarize_gains_min_mean_and_steps_by_hand():
    from specialist_sweep import summarize
    runs = [{"domain": "copy", "arm": "kl0", "base_name": "0", "validation": CURVE},
            {"domain": "copy", "arm": "kl0", "base_name": "1",
             "validation": [{"step": 0, "score": 0.30}, {"step": 50, "score": 0.50}]}]
    summary, table = summarize(runs, ["900:4", "300:0"], 0.95)
    # base 0: 900:4 keeps 0.45 (gain +0.05, 250 steps); 300:0 keeps 0.60 (+0.20, 300 steps). base 1: +0.20, 50 steps
    assert summary["copy"]["kl0"]["900:4"] == {"gains": {"0": 0.05, "1": 0.2}, "steps": 300, "min": 0.05,
                                               "mean": 0.125}
    assert summary["copy"]["kl0"]["300:0"] == {"gains": {"0": 0.2, "1": 0.2}, "steps": 350, "min": 0.2, "mean": 0.2}
    assert table.splitlines()[2] == "| copy | kl0 | +0.05 / +0.20 (**+0.05**) · 300 | +0.20 / +0.20 (**+0.20**) · 350 |"
