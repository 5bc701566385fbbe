"""Secrets in the config travel through the environment, never argv or flow parameters (infra/config.py "secrets",
tasks/worker_process.py `worker_command`): which overrides are secret, the variables that carry them, the precedence
--set > environment > file, and a real child process that ends up with the parent's effective config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.config import (SECRET_OVERRIDES_ENV, ConfigError, load_config, refuse_secret_overrides,
                          secret_env_overrides, secret_overrides_env, split_secret_overrides)
from tasks.worker_process import worker_command, worker_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SECRET_VARS = ("ALLOY_ENGINE_API_KEY", "ALLOY_JUDGE_API_KEY", SECRET_OVERRIDES_ENV)


@pytest.fixture(autouse=True)
def no_secret_env(monkeypatch):
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def config_path(tmp_path) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"domains": [{"name": "add"}], "engine": {"api_key": "from-file"}}))
    return str(path)


def test_split_finds_secret_keys_and_secrets_inside_mapping_values():
    items = ["engine.api_key=sk-1", "base.steps=3", "specialists.guard.judge_api_key=j", "engine={api_key: x}",
             "eval.max_new_tokens=5", "engine.sglang_args.tokenizer_path=/tok", "run.storage=s3://b/p"]
    plain, secret = split_secret_overrides(items)
    assert secret == ["engine.api_key=sk-1", "specialists.guard.judge_api_key=j", "engine={api_key: x}"]
    assert plain == ["base.steps=3", "eval.max_new_tokens=5", "engine.sglang_args.tokenizer_path=/tok",
                     "run.storage=s3://b/p"]


def test_known_secrets_get_their_own_variable_others_the_json_list():
    env = secret_overrides_env(["engine.api_key=sk-1", "specialists.guard.judge_api_key=j",
                                "engine.sglang_args.api_key=zz"])
    assert env == {"ALLOY_ENGINE_API_KEY": "sk-1", "ALLOY_JUDGE_API_KEY": "j",
                   SECRET_OVERRIDES_ENV: json.dumps(["engine.sglang_args.api_key=zz"])}
    # after an item in the list, everything goes to the list: the order of the overrides is kept
    assert secret_overrides_env(["engine.api_key=null", "engine.api_key=sk-2"]) == {
        SECRET_OVERRIDES_ENV: json.dumps(["engine.api_key=null", "engine.api_key=sk-2"])}
    # a list already in the environment is extended, not replaced
    assert secret_overrides_env(["engine.api_key=a"], {SECRET_OVERRIDES_ENV: '["x.key=1"]'}) == {
        SECRET_OVERRIDES_ENV: json.dumps(["x.key=1", "engine.api_key=a"])}


def test_a_key_with_yaml_special_characters_survives_the_trip():
    key = 'a"b\\c\u00e9/#x'
    env = secret_overrides_env([f"engine.api_key='{key}'"])
    assert env == {"ALLOY_ENGINE_API_KEY": key}
    assert secret_env_overrides(env) == [f"engine.api_key={json.dumps(key)}"]


def test_precedence_is_set_then_environment_then_file(config_path, monkeypatch):
    assert load_config(config_path).engine.api_key == "from-file"
    monkeypatch.setenv("ALLOY_ENGINE_API_KEY", "from-env")
    monkeypatch.setenv("ALLOY_JUDGE_API_KEY", "judge-env")
    cfg = load_config(config_path)
    assert (cfg.engine.api_key, cfg.specialists.guard.judge_api_key) == ("from-env", "judge-env")
    assert load_config(config_path, ["engine.api_key=from-set"]).engine.api_key == "from-set"
    monkeypatch.setenv("ALLOY_ENGINE_API_KEY", "")  # empty = unset
    assert load_config(config_path).engine.api_key == "from-file"


def test_the_json_list_is_applied_like_set_and_checked(config_path, monkeypatch):
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps(["engine.api_key=null"]))
    assert load_config(config_path).engine.api_key is None
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps(["engine.sglang_args.api_key=zz"]))
    assert load_config(config_path).engine.sglang_args == {"api_key": "zz"}
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, "not json")
    with pytest.raises(ConfigError, match=f"{SECRET_OVERRIDES_ENV} is not valid JSON"):
        load_config(config_path)
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, '{"engine.api_key": "x"}')
    with pytest.raises(ConfigError, match="must be a JSON list"):
        load_config(config_path)


def test_json_dumps_of_the_config_mask_the_secret_fields(config_path, monkeypatch):
    """What Prefect stores for a flow parameter holding the config (its JSON dump) has no key; the config itself
    keeps the real value."""
    monkeypatch.setenv("ALLOY_JUDGE_API_KEY", "j-1")
    cfg = load_config(config_path)
    dumped = cfg.model_dump(mode="json")
    assert dumped["engine"]["api_key"] == "***" and dumped["specialists"]["guard"]["judge_api_key"] == "***"
    assert "from-file" not in cfg.model_dump_json() and "j-1" not in cfg.model_dump_json()
    assert (cfg.engine.api_key, cfg.specialists.guard.judge_api_key) == ("from-file", "j-1")
    assert load_config(config_path, ["engine.api_key=null"]).model_dump(mode="json")["engine"]["api_key"] is None


def test_refusal_names_the_variable_and_not_the_value():
    refuse_secret_overrides(["base.steps=3"], "flow f")  # nothing secret: no error
    with pytest.raises(ConfigError) as err:
        refuse_secret_overrides(["base.steps=3", "engine.api_key=sk-XYZ", "engine.sglang_args.api_key=zz"], "flow f")
    msg = str(err.value)
    assert msg.startswith("flow f: secret override(s) ['engine.api_key', 'engine.sglang_args.api_key'] refused")
    assert "engine.api_key: set ALLOY_ENGINE_API_KEY" in msg and f"put it in {SECRET_OVERRIDES_ENV}" in msg
    assert "sk-XYZ" not in msg and "zz" not in msg


CHILD = ("import json, sys; from infra.config import load_config; a = sys.argv[2:]; "
         "print(json.dumps(load_config(sys.argv[1], [a[i + 1] for i in range(0, len(a), 2)]).model_dump()))")


def test_a_worker_child_gets_the_parents_config_without_the_secret_in_argv(config_path, monkeypatch):
    """The same effective config in a real child process: plain overrides as --set, secrets in its environment."""
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps(["engine.sglang_args.api_key=inherited"]))
    overrides = ["base.steps=7", "engine.api_key=sk-CHILD", "specialists.guard.judge_api_key=j-CHILD",
                 "engine.threads=2"]
    cmd = worker_command([sys.executable, "-c", CHILD, config_path], overrides)
    assert cmd[4:] == ["--set", "base.steps=7", "--set", "engine.threads=2"]
    assert not any("CHILD" in a for a in cmd) and "CHILD" not in repr(cmd)
    assert (cmd + ["--x"]).env == cmd.env  # appending argv keeps the environment
    out = subprocess.run(cmd, env=worker_env(cmd), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child == load_config(config_path, overrides).model_dump()  # python mode: secrets unmasked
    assert child["engine"]["api_key"] == "sk-CHILD" and child["engine"]["sglang_args"] == {"api_key": "inherited"}
    assert os.environ.get("ALLOY_ENGINE_API_KEY") is None  # the parent's own environment is untouched
