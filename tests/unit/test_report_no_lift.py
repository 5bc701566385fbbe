"""report.json says why a specialist did not learn (issue 56: "tool_long learns, or the report says why not"): each
domain's `training` from its specialist's result, and `no_lift` when the specialist ended within NO_LIFT of its base."""
import json

import pandas as pd
import pytest

from infra.report import NO_LIFT, build_report, render_table, report_problems, specialist_training, why_no_lift

pytestmark = pytest.mark.unit


def result(rewards, best_step, best_val, selected_step, stopped=None):
    return {"steps": len(rewards), "history": [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)],
            "best_step": best_step, "best_val": best_val, "selected_step": selected_step, "stopped": stopped}


def scores(rows):
    return pd.DataFrame([{"domain": d, "stage": st, "score": v, "n_eval": 100}
                         for d, per in rows.items() for st, v in zip(("base", "specialist", "student"), per)])


def test_training_summarises_the_steps_rewards_and_the_kept_step():
    t = specialist_training(result([0.0, 0.25, 0.0, 0.5], best_step=3, best_val=0.4, selected_step=3))
    assert t == {"steps": 4, "rewarded_steps": 2, "reward_first": 0.0, "reward_last": 0.5, "best_step": 3,
                 "best_val": 0.4, "selected_step": 3, "stopped": None}
    assert specialist_training(None) is None and specialist_training({}) is None


def test_a_specialist_that_never_earned_a_reward_is_named_so():
    t = specialist_training(result([0.0] * 8, best_step=0, best_val=0.0, selected_step=0))
    why = why_no_lift({"base": 0.0, "specialist": 0.0}, t)
    assert why.startswith("specialist 0.000 against the base's 0.000: none of its 8 training steps earned any reward")


def test_a_kept_starting_policy_and_an_unconfirmed_gain_are_told_apart():
    kept = specialist_training(result([0.1, 0.2], best_step=0, best_val=0.52, selected_step=0,
                                      stopped="4 validations without a new best (best 0.520 at step 0)"))
    why = why_no_lift({"base": 0.52, "specialist": 0.52}, kept)
    assert "never rose above step 0's (0.520) in 2 steps, so the starting policy was kept; stopped: 4 validations" in why
    later = specialist_training(result([0.1, 0.2, 0.3], best_step=2, best_val=0.6, selected_step=2))
    assert "kept step 2 (validation 0.600 at its best step 2); the eval split did not confirm" in why_no_lift(
        {"base": 0.5, "specialist": 0.51}, later)


def test_a_lift_of_no_lift_or_more_says_nothing():
    t = specialist_training(result([0.0, 0.0], best_step=0, best_val=0.0, selected_step=0))
    assert why_no_lift({"base": 0.30, "specialist": 0.30 + NO_LIFT}, t) is None
    assert why_no_lift({"base": None, "specialist": 0.1}, t) is None
    assert "no training record" in why_no_lift({"base": 0.3, "specialist": 0.3}, None)


def test_the_report_carries_both_per_domain_and_prints_the_reasons():
    specs = {"tool_long": result([0.0] * 8, 0, 0.0, 0), "tool_add": result([0.2, 0.6], 2, 0.9, 2)}
    rep = build_report(config="c", run_id="r", mlflow={}, domains=["tool_add", "tool_long"], specialists=specs,
                       scores=scores({"tool_add": (0.0, 0.97, 0.93), "tool_long": (0.0, 0.0, 0.0)}))
    rep = json.loads(json.dumps(rep))
    assert report_problems(rep) == []
    assert rep["domains"]["tool_add"]["no_lift"] is None and rep["domains"]["tool_add"]["training"]["rewarded_steps"] == 2
    assert rep["domains"]["tool_long"]["training"]["rewarded_steps"] == 0
    text = render_table(rep)
    assert "no lift:\n  tool_long: specialist 0.000 against the base's 0.000: none of its 8 training steps" in text
    # no specialists stage (or a report built without results): both null, nothing printed
    plain = build_report(config="c", run_id="r", mlflow={}, domains=["tool_long"],
                         scores=scores({"tool_long": (0.0, 0.0, 0.0)}))
    assert plain["domains"]["tool_long"]["training"] is None and plain["domains"]["tool_long"]["no_lift"] is None
    assert "no lift" not in render_table(plain)
