"""The `reward_models` config section (infra/config_stages.py RewardModelConfig): bad values fail at load with their
dotted path; its checkpoint prefix (tasks/prefixes.py) moves with what changes the model and only with that; a config
without reward models keys every stage as before; the trainer's pair order (training/reward_main.py) is pure."""
import json

import pytest

from infra.config import ConfigError, config_from_dict
from tasks.prefixes import base_prefix, reward_model_prefix_of, specialist_prefix_of, student_prefix_of
from training.reward_main import step_pairs

pytestmark = pytest.mark.unit


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "a!", "rejected": "a."}) + "\n"
                            for i in range(20)))
    return str(path)


def cfg(path, **rm):
    return config_from_dict({"domains": [{"name": "reverse"}], "reward_models": {"polite": {"data": path, **rm}}})


@pytest.mark.parametrize("rm,message", [
    ({"data": "/no/such.jsonl"}, "reward_models.polite.data: no such file: /no/such.jsonl"),
    ({"steps": 0}, "reward_models.polite.steps: Input should be greater than or equal to 1"),
    ({"val_fraction": 1.0}, "reward_models.polite.val_fraction: Input should be less than 1"),
    ({"max_length": 4}, "reward_models.polite.max_length"),
    ({"train": {"lr": -1}}, "reward_models.polite.train.lr"),
    ({"chosen": "prompt"}, "reward_models.polite: prompt, chosen, rejected and margin_column must name different"),
    ({"init": " "}, "reward_models.polite.init: must be `base` or a local HF checkpoint directory"),
    ({"typo": 1}, "reward_models.polite.typo: unknown key"),
    ({"train": {"lr_schedule": "cosine", "warmup_steps": 300}}, "reward_models.polite.train.warmup_steps=300 must be "
                                                                "below reward_models.polite.steps=200"),
])
def test_bad_values_fail_at_load_naming_the_field(data, rm, message):
    with pytest.raises(ConfigError) as err:
        cfg(data, **rm)
    assert message in str(err.value)


def test_a_reward_model_name_is_one_path_segment(data):
    with pytest.raises(ConfigError, match=r"reward_models: '\.\./x'"):
        config_from_dict({"domains": [{"name": "reverse"}], "reward_models": {"../x": {"data": data}}})


def test_the_prefix_moves_with_what_changes_the_model_and_only_with_that(data, tmp_path):
    base = cfg(data)
    p = reward_model_prefix_of(base, "s3://b", "polite")
    assert p.startswith("s3://b/rm-polite-")
    for ops in ({"log_every": 3}, {"val_every": 7}, {"checkpoint_every": 9}, {"keep_checkpoints": 4},
                {"threads": 2}, {"max_file_mb": 9.0}, {"max_row_kb": 9.0}, {"train": {"gradient_checkpointing": True}}):
        assert reward_model_prefix_of(cfg(data, **ops), "s3://b", "polite") == p, ops
    for change in ({"steps": 201}, {"seed": 3}, {"val_fraction": 0.2}, {"max_length": 100}, {"system": "hi"},
                   {"margin_column": "m"}, {"train": {"lr": 0.01}}, {"init": str(tmp_path)}):
        assert reward_model_prefix_of(cfg(data, **change), "s3://b", "polite") != p, change
    assert cfg(data, seed=0).reward_models["polite"].seed == 0
    assert reward_model_prefix_of(cfg(data, seed=0), "s3://b", "polite") == p  # null seed: run.seed, 0 here


def test_reward_models_move_no_other_stage(data):
    plain = config_from_dict({"domains": [{"name": "reverse"}]})
    with_rm = cfg(data)
    assert plain.fingerprint() == with_rm.model_copy(update={"reward_models": {}}).fingerprint()
    for prefix in (base_prefix, student_prefix_of):
        assert prefix(plain, "s3://b") == prefix(with_rm, "s3://b")
    assert specialist_prefix_of(plain, "s3://b", "reverse") == specialist_prefix_of(with_rm, "s3://b", "reverse")


def test_the_pair_order_is_a_pure_function_of_the_step():
    n, size = 10, 4
    stream = [i for step in range(1, 6) for i in step_pairs(step, n, size, seed=0)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))  # each epoch once
    assert step_pairs(4, n, size, 0) == stream[12:16]  # a resumed run at step 4 draws what the whole run drew
    assert step_pairs(1, n, size, 1) != step_pairs(1, n, size, 0)
