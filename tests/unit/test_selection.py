"""Best-checkpoint selection and early stopping of a specialist (teachers/selection.py): the rules by hand, the
held-out validation prompts, and the config checks."""
from __future__ import annotations

import pytest

from domains.base import is_eval_prompt, prompt_split
from domains.registry import load_domain
from infra.config import ConfigError, config_from_dict
from teachers.selection import Selection

pytestmark = pytest.mark.unit


def test_best_is_the_first_strictly_higher_score_and_patience_counts_validations_after_it():
    s = Selection()
    assert s.stop_reason(patience=1, stop_at=0.9) is None  # nothing validated yet
    assert s.record(0, 0.40) is True and (s.best_step, s.best_score) == (0, 0.40)
    assert s.record(50, 0.55) is True
    assert s.record(100, 0.55) is False  # a tie keeps the earlier (less trained) policy
    assert s.record(150, 0.50) is False
    assert (s.best_step, s.best_score, s.since_best()) == (50, 0.55, 2)
    assert s.stop_reason(patience=3, stop_at=None) is None
    assert "2 validations without a new best" in s.stop_reason(patience=2, stop_at=None)
    assert s.stop_reason(patience=0, stop_at=None) is None  # 0 = never stop on patience
    assert s.record(200, 0.56, min_delta=0.02) is False  # +0.01 is within min_delta: not a new best
    assert s.record(250, 0.58, min_delta=0.02) is True and s.since_best() == 0


def test_stop_at_looks_at_the_latest_score_only():
    s = Selection()
    s.record(0, 1.0)
    s.record(50, 0.9)
    assert s.stop_reason(patience=0, stop_at=1.0) is None  # the best reached it, but the latest did not
    s.record(100, 1.0)
    assert "stop_at 1.0" in s.stop_reason(patience=0, stop_at=1.0)


def test_state_round_trip():
    s = Selection()
    s.record(0, 0.3)
    s.record(10, 0.6)
    back = Selection.from_state(s.state_dict())
    assert back == s and Selection.from_state({}) == Selection() and Selection.from_state(None) == Selection()


def test_validation_prompts_are_the_val_split_never_trained_on_nor_eval():
    dom = load_domain("reverse", difficulty=3)
    pool = {ex.prompt for ex in dom.split("train", 3000, 0)}  # what PromptCursor / SFT / distill draw from
    val = dom.split("val", 50, 0)
    assert len(val) == 50 and len({ex.prompt for ex in val}) == 50
    assert all(prompt_split(ex.prompt) == "val" for ex in val)
    assert not pool & {ex.prompt for ex in val}
    assert not any(is_eval_prompt(ex.prompt) for ex in val)  # disjoint from the eval split by construction
    assert val == dom.split("val", 50, 0)  # deterministic


def test_config_needs_validations_for_patience_or_stop_at():
    with pytest.raises(ConfigError, match="specialists.val_every > 0"):
        config_from_dict({"domains": [{"name": "a"}], "specialists": {"val_every": 0, "patience": 2}})
    with pytest.raises(ConfigError, match="specialists.stop_at"):
        config_from_dict({"domains": [{"name": "a"}], "specialists": {"stop_at": 1.5}})
    cfg = config_from_dict({"domains": [{"name": "a"}], "specialists": {"val_every": 0, "select": "best"}})
    assert cfg.specialists.val_every == 0  # then the last policy is the specialist


def test_per_domain_overrides_merge_into_that_domains_settings_only():
    cfg = config_from_dict({"domains": [{"name": "a"}, {"name": "b"}], "specialists": {
        "steps": 300, "kl_coef": 0.05, "policy_train": {"lr": 1e-3, "micro_batch_size": 32},
        "per_domain": {"b": {"kl_coef": 0.0, "steps": 500, "policy_train": {"lr": 2e-3}}}}})
    a, b = cfg.specialists.for_domain("a"), cfg.specialists.for_domain("b")
    assert (a.kl_coef, a.steps, a.policy_train.lr) == (0.05, 300, 1e-3)
    assert (b.kl_coef, b.steps, b.policy_train.lr, b.policy_train.micro_batch_size) == (0.0, 500, 2e-3, 32)
    assert b.per_domain == {} and a is cfg.specialists


@pytest.mark.parametrize("per_domain, message", [
    ({"c": {"steps": 5}}, "specialists.per_domain names domains that are not configured: ['c']"),
    ({"a": {"stepz": 5}}, "specialists.per_domain.a: stepz: unknown key"),
    ({"a": {"steps": -1}}, "specialists.per_domain.a: steps: Input should be greater than or equal to 0"),
    ({"a": {"policy_train": {"lr": "fast"}}}, "specialists.per_domain.a: policy_train.lr:"),
    ({"a": {"max_parallel": 4}}, "specialists.per_domain.a: ['max_parallel'] apply to the whole stage"),
    ({"a": {"val_every": 0, "patience": 3}}, "specialists.per_domain.a: specialists.patience / specialists.stop_at need validations"),
])
def test_per_domain_errors_name_the_domain_and_field(per_domain, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"domains": [{"name": "a"}], "specialists": {"per_domain": per_domain}})
    assert message in str(err.value)


def test_launch_order_longest_expected_first():
    """Specialists start by configured steps, most first (per_domain overrides count), ties in config order."""
    from flows.specialists import launch_order
    from infra.config import SpecialistsConfig

    sc = SpecialistsConfig(steps=100, per_domain={"c": {"steps": 300}, "d": {"steps": 50}, "e": {"steps": 300}})
    assert launch_order(sc, ["a", "b", "c", "d", "e"]) == ["c", "e", "a", "b", "d"]
    assert launch_order(SpecialistsConfig(steps=10), ["x", "y"]) == ["x", "y"]
