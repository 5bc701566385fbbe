"""Model rewards' pure arithmetic (domains/reward_math.py) against hand-derived numbers, and the `reward:` config's
errors by dotted path (infra/config_shared.py RewardConfig, infra/config.py)."""
import math

import pytest

from domains.reward_math import (JudgeScoreError, batch_normalized, fill_unparsed, length_penalized, normalized,
                                 parse_judge_score, sigmoid)
from infra.config import ConfigError, config_from_dict

pytestmark = pytest.mark.unit


def test_sigmoid_by_hand_and_without_overflow():
    assert sigmoid(0.0) == 0.5
    assert sigmoid(1.0) == pytest.approx(1 / (1 + math.e ** -1), abs=1e-15)  # 0.7310585786300049
    assert sigmoid(-1.0) == pytest.approx(1 - 0.7310585786300049, abs=1e-15)
    assert sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0  # no OverflowError from exp(1000)


def test_batch_normalization_by_hand():
    # raw 1, 3: mean 2, population std 1 → z = −1, +1 → σ(−1) = 0.2689414213699951, σ(1) = 0.7310585786300049
    a, b = batch_normalized([1.0, 3.0])
    assert a == pytest.approx(0.2689414213699951, abs=1e-15) and b == pytest.approx(0.7310585786300049, abs=1e-15)
    # shift and scale of the reward model do not matter: 10·r + 7 gives the same rewards
    assert batch_normalized([17.0, 37.0]) == pytest.approx([a, b], abs=1e-15)
    # raw 0, 0, 3: mean 1, std sqrt((1 + 1 + 4) / 3) = sqrt(2) → z = −1/√2, −1/√2, 2/√2
    z = [-1 / math.sqrt(2), -1 / math.sqrt(2), 2 / math.sqrt(2)]
    assert batch_normalized([0.0, 0.0, 3.0]) == pytest.approx([sigmoid(x) for x in z], abs=1e-15)
    assert batch_normalized([2.5, 2.5]) == [0.5, 0.5]  # no spread: no preference
    assert batch_normalized([]) == []


def test_normalized_modes():
    assert normalized([0.0, 2.0], "sigmoid") == pytest.approx([0.5, sigmoid(2.0)])
    assert normalized([0.0, 2.0], "batch") == batch_normalized([0.0, 2.0])
    with pytest.raises(ValueError, match="normalize"):
        normalized([1.0], "rank")


def test_length_penalty_by_hand():
    # budget 20, penalty 0.5: 0.9 − 0.5·10/20 = 0.65; 0.2 − 0.5·20/20 = −0.3 → clamped to 0
    assert length_penalized([0.9, 0.2], [10, 20], 20, 0.5) == pytest.approx([0.65, 0.0])
    assert length_penalized([0.9, 0.2], [10, 20], 20, 0.0) == [0.9, 0.2]  # off: unchanged
    # 12 tokens free: 10 pays nothing, 20 pays 0.5 · 8 / 20 = 0.2
    assert length_penalized([0.9, 0.5], [10, 20], 20, 0.5, free=12) == pytest.approx([0.9, 0.3])
    with pytest.raises(ValueError, match="2 rewards for 1 lengths"):
        length_penalized([0.9, 0.2], [10], 20, 0.5)


@pytest.mark.parametrize("text, scale, want", [
    ("Score: 7/10", 10, 0.7),
    ("The answer is polite.\nScore: 3", 4, 0.75),  # no denominator: out of `scale`
    ("**Score:** 8 out of 10", 10, 0.8),
    ("rating = 2.5/5", 10, 0.5),
    ("Score: 2/10 at first, but on reflection Score: 9/10", 10, 0.9),  # the last one decides
    ("<think>Score: 1/10? no</think> Score: 6/10", 10, 0.6),  # reasoning is skipped
    ("score: 0/10", 10, 0.0),
])
def test_parse_judge_score(text, scale, want):
    assert parse_judge_score(text, scale) == pytest.approx(want)


@pytest.mark.parametrize("text, why", [
    ("It is a fine answer.", "no 'Score: N/10'"),
    ("Score: 12/10", "outside"),
    ("Score: 3/0", "outside"),
    (None, "not text"),
])
def test_unparseable_judge_answers_raise(text, why):
    with pytest.raises(JudgeScoreError, match=why):
        parse_judge_score(text, 10)


def test_unparsed_samples_get_the_parsed_mean():
    assert fill_unparsed([0.2, None, 0.6]) == pytest.approx([0.2, 0.4, 0.6])
    with pytest.raises(ValueError, match="no sample"):
        fill_unparsed([None, None])


def _cfg(reward, **top):
    data = {"domains": [{"name": "pol", "dataset": {"path": "README.md"}, "reward": reward}], **top}
    return config_from_dict(data)


@pytest.mark.parametrize("reward, top, msg", [
    ({"kind": "model"}, {}, "domains.0.reward: kind model: set exactly one of reward_model"),
    ({"kind": "model", "url": "http://x", "reward_model": "r"}, {}, "set exactly one of reward_model"),
    ({"kind": "model", "url": "http://x", "rubric": "be nice"}, {}, "domains.0.reward: kind model: rubric belong"),
    ({"kind": "judge", "url": "http://x"}, {}, "domains.0.reward: kind judge: rubric is required"),
    ({"kind": "judge", "rubric": "r"}, {}, "kind judge: set exactly one of model"),
    ({"kind": "judge", "rubric": "r", "url": "u", "reward_model": "x"}, {}, "reward_model belongs to kind model"),
    ({"kind": "model", "reward_model": "nope"}, {}, "domains.0.reward.reward_model: no reward model 'nope'"),
    ({"kind": "model", "url": "http://x"}, {"distill": {"reward_coef": 0.5}}, "distill.reward_coef=0.5"),
    ({"kind": "model", "url": "http://x", "length_penalty": -1}, {}, "domains.0.reward.length_penalty"),
    ({"kind": "rm", "url": "http://x"}, {}, "domains.0.reward.kind"),
])
def test_reward_config_errors_name_the_dotted_path(reward, top, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(".", r"\.").replace("*", r"\*")):
        _cfg(reward, **top)


def test_reward_on_a_builtin_domain_is_refused_and_a_good_one_loads():
    with pytest.raises(ConfigError, match="domains.0: .*reward: applies to dataset domains only"):
        config_from_dict({"domains": [{"name": "reverse", "reward": {"kind": "model", "url": "http://x"}}]})
    cfg = _cfg({"kind": "judge", "url": "http://x/v1", "rubric": "Is it polite?", "truth": "regex:.*!"})
    assert cfg.domains[0].reward.kind == "judge" and cfg.domains[0].reward.scale == 10


def test_served_url_moves_no_fingerprint_and_the_reward_does():
    a = _cfg({"kind": "model", "url": "http://x"})
    b = _cfg({"kind": "model", "url": "http://x", "served_url": "http://127.0.0.1:1"})
    c = _cfg({"kind": "model", "url": "http://x", "length_penalty": 0.5})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
