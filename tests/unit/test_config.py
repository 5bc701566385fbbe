"""Config loading: defaults, overrides, and errors that name the dotted path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.config import ConfigError, apply_overrides, config_from_dict, load_config

pytestmark = pytest.mark.unit

MINIMAL = {"domains": [{"name": "addition"}, {"name": "reverse"}]}


def write(tmp_path, data) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_defaults_fill_in(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.domain_names() == ["addition", "reverse"]
    assert cfg.base.train.zero_stage == 0 and cfg.engine.host == "127.0.0.1"
    assert cfg.storage_url.startswith("file://") and cfg.storage_url.endswith("/runs/alloy")


def test_overrides_nested_and_list_index(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["base.steps=7", "domains.1.difficulty=3", "base.train.lr=0.01",
                                                "run.storage=s3://bucket/x"])
    assert cfg.base.steps == 7 and cfg.domains[1].difficulty == 3 and cfg.base.train.lr == 0.01
    assert cfg.storage_url == "s3://bucket/x"


@pytest.mark.parametrize("override, path", [
    ("base.stpes=3", "base.stpes: unknown key"),
    ("base.steps=many", "base.steps: Input should be a valid integer"),
    ("base.train.zero_stage=5", "base.train.zero_stage"),
    ("domains.0.difficulty=0", "domains.0.difficulty"),
    ("eval.n_eval=-1", "eval.n_eval"),
    ("run.name=a/b", "run.name"),
    ("domains.0.impl=nocolon", "domains.0.impl"),
])
def test_errors_name_the_dotted_path(tmp_path, override, path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL), [override])
    assert path in str(err.value)


def test_several_errors_reported_at_once():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"domains": [{"name": "a", "difficulty": "x"}], "bogus": 1, "eval": {"n_eval": 0}})
    msg = str(err.value)
    assert "3 error(s)" in msg and "domains.0.difficulty" in msg and "bogus: unknown key" in msg and "eval.n_eval" in msg


def test_multi_rank_trainers(tmp_path):
    """Specialists and the student may run on several ranks; policy and critic share one process group, and rank 0
    generates with the weights it holds (no ZeRO-3 with world_size > 1)."""
    cfg = load_config(write(tmp_path, MINIMAL), ["specialists.policy_train.world_size=2",
                                                "specialists.critic_train.world_size=2", "distill.train.world_size=2"])
    assert cfg.specialists.critic_train.world_size == cfg.distill.train.world_size == 2
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL), ["specialists.policy_train.world_size=2"])
    assert "specialists.policy_train.world_size (2) and specialists.critic_train.world_size (1)" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a per-domain override is checked merged
        load_config(write(tmp_path, {**MINIMAL, "specialists": {"per_domain": {
            "reverse": {"critic_train": {"world_size": 4}}}}}))
    assert "specialists.per_domain.reverse" in str(err.value) and "critic_train.world_size (4)" in str(err.value)
    with pytest.raises(ConfigError, match=r"distill\.train\.zero_stage: 3 shards the weights over the 2 ranks"):
        load_config(write(tmp_path, MINIMAL), ["distill.train.world_size=2", "distill.train.zero_stage=3"])
    # a base stopped by its score: every rank scores its own whole weights
    with pytest.raises(ConfigError, match=r"base\.train\.zero_stage: 3 shards the weights over the 2 ranks"):
        load_config(write(tmp_path, MINIMAL), ["base.train.world_size=2", "base.train.zero_stage=3",
                                               "base.stop_at_score=0.4"])
    load_config(write(tmp_path, MINIMAL), ["base.train.world_size=2", "base.train.zero_stage=3"])  # no target: fine


def test_duplicate_domains_and_unknown_external_teacher():
    with pytest.raises(ConfigError, match="repeated: \\['a'\\]"):
        config_from_dict({"domains": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match="not configured: \\['b'\\]"):
        config_from_dict({"domains": [{"name": "a"}], "teachers": {"external": {"b": "http://127.0.0.1:1"}}})
    with pytest.raises(ConfigError, match="teachers.external"):
        config_from_dict({"domains": [{"name": "a"}], "teachers": {"external": {"a": "ftp://x"}}})


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["nokey"])
    with pytest.raises(ConfigError, match="not a valid list index"):
        apply_overrides({"domains": [{"name": "a"}]}, ["domains.5.name=b"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("domains: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_fingerprint_stable_and_sensitive():
    a = config_from_dict(MINIMAL)
    b = config_from_dict(MINIMAL)
    assert a.fingerprint() == b.fingerprint()
    b.base.steps = 1
    assert a.fingerprint() != b.fingerprint() and a.fingerprint("model") == b.fingerprint("model")


def test_cli_exit_code_2_with_dotted_path(tmp_path):
    path = write(tmp_path, MINIMAL)
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", "config", path, "--set", "base.train.dtype=fp8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "base.train.dtype" in proc.stderr


def test_cli_config_loads_domain_plugins(tmp_path):
    """`alloy config` builds every domain: a plugin that does not import fails there, named by its dotted path."""
    root = Path(__file__).resolve().parents[2]
    cfg = {**MINIMAL, "domains": [{"name": "reverse"}, {"name": "pal", "impl": "palindrome_domain:Palindrome"}]}
    path = write(tmp_path, cfg)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", "config", path], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(root))
    assert proc.returncode == 2, proc.stderr
    assert "domains.1.impl: cannot load domain 'pal'" in proc.stderr and "palindrome_domain" in proc.stderr
    env["PYTHONPATH"] = str(root / "examples" / "plugins")
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", "config", path], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(root))
    assert proc.returncode == 0, proc.stderr
    assert "impl: palindrome_domain:Palindrome" in proc.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(name, tmp_path):
    path = Path(__file__).resolve().parents[2] / "configs" / name
    # a local model.path (gpu-example.yaml: /models/…) exists on the machine the config is for: stand in a directory
    raw = yaml.safe_load(path.read_text())
    local_model = (raw.get("model") or {}).get("path")
    overrides = [f"model.path={tmp_path}"] if local_model else []
    # dataset files (dataset-example.yaml: made by scripts/make_datasets.py): the same script writes them here
    datasets = {i: d["dataset"]["path"] for i, d in enumerate(raw.get("domains") or []) if d.get("dataset")}
    if datasets:
        import importlib.util

        spec = importlib.util.spec_from_file_location("make_datasets", path.parents[1] / "scripts" / "make_datasets.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.write_datasets(tmp_path / "data", rows=50)
        # preference.yaml's rows and pairs: scripts/make_preference_pairs.py
        spec = importlib.util.spec_from_file_location("make_pairs", path.parents[1] / "scripts" / "make_preference_pairs.py")
        pairs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pairs)
        pairs.main([str(tmp_path / "data"), "--rows", "50", "--pairs", "20"])
        overrides += [f"domains.{i}.dataset.path={tmp_path / 'data' / Path(p).name}" for i, p in datasets.items()]
        overrides += [f"reward_models.{n}.data={tmp_path / 'data' / Path(rm['data']).name}"
                      for n, rm in (raw.get("reward_models") or {}).items()]
    cfg = load_config(path, overrides)
    for d in cfg.domain_names():
        cfg.specialists.for_domain(d)  # per-domain overrides merge into valid settings


def test_a_cosine_warmup_as_long_as_its_stage_is_refused_when_the_config_loads():
    """The first GPU run of configs/gpu-1.yaml died in base SFT on `base.steps=100` with a 100-step warm-up; the
    config now says so when it loads, naming the section."""
    root = Path(__file__).resolve().parents[2]
    gpu1 = str(root / "configs" / "gpu-1.yaml")
    with pytest.raises(ConfigError, match=r"base\.train\.warmup_steps=100 must be below base\.steps=100"):
        load_config(gpu1, ["base.steps=100"])
    with pytest.raises(ConfigError, match=r"distill\.train\.warmup_steps=50 must be below distill\.steps=8"):
        load_config(gpu1, ["distill.steps=8"])
    with pytest.raises(ConfigError, match=r"specialists\.per_domain\.copy\.critic_train\.warmup_steps=5"):
        load_config(gpu1, ["specialists.per_domain={copy: {steps: 5, critic_train: {lr_schedule: cosine, "
                           "warmup_steps: 5}}}"])
    assert load_config(gpu1, ["base.steps=101", "distill.steps=51"]).base.steps == 101
    load_config(gpu1, ["base.steps=100", "base.train.lr_schedule=constant"])  # no decay, no constraint


def test_lr_decay_steps_sets_the_cosine_horizon_and_bad_values_are_refused_naming_the_field():
    """`train.lr_decay_steps`: the cosine decays over that many steps instead of the stage's (the trainer's
    TrainSettings.total_steps), so a shorter stage stops on the way down; below the stage's steps (a tail at lr 0) or
    on a constant schedule it is refused when the config loads, naming the section."""
    from training.ds_config import lr_multiplier
    from training.session import train_settings

    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    cfg = load_config(demo, [])  # the demo: 1,200 steps of a 1,500-step cosine
    s = train_settings(cfg.distill.train, cfg.distill.steps, 0)
    assert s.total_steps == 1500 and s.lr_schedule == "cosine"
    # step 1,199 (the 1,200th update) of a 1,500-step cosine: ½(1 + cos(π·1199/1500)) = 0.0961...
    assert lr_multiplier(1199, s.warmup_steps, s.lr_schedule, s.total_steps) == pytest.approx(0.09611, abs=1e-5)
    plain = load_config(demo, ["distill.steps=1200", "distill.train.lr_decay_steps=null"])
    assert train_settings(plain.distill.train, plain.distill.steps, 0).total_steps == 1200  # null: the stage's
    # unset, it is not in the fingerprint (run roots from before the field keep their keys); set, it moves the stage
    from infra.config import AlloyConfig, result_settings
    assert "lr_decay_steps" not in result_settings(AlloyConfig, plain.model_dump())["distill"]["train"]
    assert cfg.fingerprint("distill") != plain.fingerprint("distill")
    assert cfg.fingerprint("base", "specialists") == plain.fingerprint("base", "specialists")
    with pytest.raises(ConfigError, match=r"distill\.train\.lr_decay_steps=1000 is below distill\.steps=1200"):
        load_config(demo, ["distill.steps=1200", "distill.train.lr_decay_steps=1000"])
    with pytest.raises(ConfigError, match=r"base\.train\.lr_decay_steps=2000 applies to lr_schedule cosine only"):
        load_config(demo, ["base.train.lr_decay_steps=2000"])
    with pytest.raises(ConfigError, match=r"lr_decay_steps"):
        load_config(demo, ["distill.train.lr_decay_steps=0"])


def test_teacher_scoring_calls_over_the_engine_answer_cap_are_refused_when_the_config_loads():
    """engine.max_logprob_entries caps an embedded server's answer (engine/protocol.py); the student's scoring calls
    (score_batch_size × (max_new_tokens + 1) × (1 + top_k) entries) must fit it, and do at the defaults."""
    smoke = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
    cfg = load_config(smoke, ["distill.max_new_tokens=512"])  # 32 × 513 × 17 = 279,072: far under 2^22
    assert cfg.distill.score_batch_size * 513 * (1 + cfg.distill.top_k) * 15 < cfg.engine.max_logprob_entries
    with pytest.raises(ConfigError, match=r"= 4218912 log-prob entries, over engine\.max_logprob_entries=4194304"):
        load_config(smoke, ["distill.max_new_tokens=512", "distill.top_k=256"])  # 32 × 513 × 257
    assert load_config(smoke, ["distill.top_k=256", "engine.backend=sglang"]).distill.top_k == 256  # not ours
    assert load_config(smoke, ["distill.max_new_tokens=512", "distill.top_k=256",
                               "engine.max_logprob_entries=8388608"]).engine.max_logprob_entries == 2**23


@pytest.mark.parametrize("section, full", [("specialists.policy_train", 64), ("specialists.critic_train", 64),
                                           ("distill.train", 128), ("base.train", 32)])
def test_a_section_set_in_part_keeps_the_other_defaults_of_its_full_default(tmp_path, section, full):
    """A --set of one field of a train section (or a YAML that sets it in part) leaves its other fields at the
    defaults the stage gives the whole section (specialists: micro_batch_size 64, distill: 128), not at
    TrainConfig's own (32)."""
    stage, name = section.split(".")

    def got(cfg):
        return getattr(getattr(cfg, stage), name)

    assert got(config_from_dict(MINIMAL)).micro_batch_size == full
    by_set = got(load_config(write(tmp_path, MINIMAL), [f"{section}.lr=0.01"]))
    assert (by_set.lr, by_set.micro_batch_size) == (0.01, full)
    by_yaml = got(config_from_dict({**MINIMAL, stage: {name: {"dtype": "bf16"}}}))
    assert (by_yaml.dtype, by_yaml.micro_batch_size) == ("bf16", full)
    given = got(config_from_dict({**MINIMAL, stage: {name: {"micro_batch_size": 5}}}))
    assert given.micro_batch_size == 5  # a value given wins


def test_trainer_memory_settings_reach_the_trainers(tmp_path):
    """`gradient_checkpointing` and `micro_batch_tokens` of every train section reach its `TrainSettings`; a token
    budget with grad_accum > 1 is refused (the budget decides a step's micro-batches), naming the section."""
    from training.session import train_settings

    cfg = load_config(write(tmp_path, MINIMAL), ["distill.train.gradient_checkpointing=true",
                                                "distill.train.micro_batch_tokens=8192"])
    s = train_settings(cfg.distill.train, 10, 0)
    assert (s.gradient_checkpointing, s.micro_batch_tokens, s.micro_batch_size) == (True, 8192, 128)
    plain = train_settings(cfg.base.train, 10, 0)
    assert (plain.gradient_checkpointing, plain.micro_batch_tokens) == (False, None)
    with pytest.raises(ConfigError, match=r"base\.train: grad_accum=2: with micro_batch_tokens"):
        load_config(write(tmp_path, MINIMAL), ["base.train.micro_batch_tokens=512", "base.train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"distill\.train\.micro_batch_tokens"):
        load_config(write(tmp_path, MINIMAL), ["distill.train.micro_batch_tokens=0"])
