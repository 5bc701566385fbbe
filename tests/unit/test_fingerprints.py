"""Checkpoint prefixes move with what changes a stage's result, and only with that: the settings marked `ops_field`
in the config (scheduling, logging, serving, credentials) are left out of every fingerprint (tasks/prefixes.py)."""
import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.config import AlloyConfig, load_config
from tasks.prefixes import base_prefix, specialist_prefix_of, student_prefix_of

pytestmark = pytest.mark.unit

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
STORAGE = "s3://bucket/alloy/smoke"

# every ops field of the config, with a value other than smoke.yaml's
OPS_CHANGES = {
    "run.root": "/elsewhere", "run.storage": "s3://other/prefix", "run.resume": False,
    "base.log_every": 3, "base.threads": 1, "eval.batch_size": 7, "eval.device": "cpu", "eval.dtype": "bf16",
    "tracking.enabled": False, "tracking.uri": "http://mlflow.example:5000", "tracking.experiment": "other",
    "engine.host": "0.0.0.0", "engine.api_key": "k3y", "engine.threads": 3, "engine.sglang_weight_sync": "disk",
    "engine.weight_sync": "disk", "engine.read_timeout_s": 60.0, "engine.max_body_mb": 64.0, "engine.device": "cpu",
    "engine.dtype": "bfloat16", "engine.max_logprob_entries": 8_388_608,
    "teachers.health_timeout_s": 5.0, "teachers.max_restarts": 0, "teachers.check_tokenizers": False,
    "distill.score_batch_size": 4, "distill.teacher_timeout_s": 5.0, "distill.teacher_retries": 0,
    "distill.score_attempts": 1, "distill.checkpoint_every": 7, "distill.log_every": 3, "distill.threads": 2,
    "distill.mode": "deployment", "distill.deployment": "other/distill", "distill.keep_checkpoints": 3, "distill.record": {"full": True},
    "specialists.keep_checkpoints": 1, "specialists.record": {"every": 2, "sample": 8}, "specialists.checkpoint_every": 7, "specialists.log_every": 3, "specialists.max_parallel": 4,
    "specialists.mode": "deployment", "specialists.deployment": "other/flow", "specialists.retries": 0,
    "specialists.threads": 2, "specialists.guard.judge_api_key": "k3y", "specialists.guard.judge_timeout_s": 3.0,
    "resources.gpus_per_node": 8, "resources.gpu_memory_gb": 40.0, "resources.model_gb": 3.0,
    "resources.kv_cache_gb": 2.0, "resources.trainer_overhead_gb": 1.0, "resources.colocate_rollout": True,
    "resources.share_gpus": True,
    # memory and speed of a trainer, the same update up to float rounding
    **{f"{t}.{f}": v for t in ("base.train", "specialists.policy_train", "specialists.critic_train", "distill.train")
       for f, v in (("gradient_checkpointing", True), ("micro_batch_tokens", 4096))},
}

STAGES = ("base", "specialist", "student")
ALL, SPEC_ON = set(STAGES), {"specialist", "student"}
# settings that change what is trained, and the stages whose checkpoints they move
TRAINING_CHANGES = [
    ("run.seed=1", ALL), ("run.name=other", ALL), ("model.preset=nano", ALL), ("model.chat_template=none", ALL), ("domains.0.difficulty=2", ALL),
    ("base.steps=5", ALL), ("base.train.lr=0.01", ALL), ("base.tool_trajectories=true", ALL),
    ("base.stop_at_score=0.5", ALL),
    ("specialists.steps=7", SPEC_ON), ("specialists.per_domain.max_list.kl_coef=0.0", SPEC_ON),
    ("specialists.per_domain.reverse.kl_coef=0.0", {"student"}),  # another domain's specialist
    ("specialists.guard.judge_url=http://judge:1", SPEC_ON), ("specialists.enabled=false", SPEC_ON),
    ("specialists.guard.judge_path=/judges/j1", SPEC_ON), ("specialists.guard.judge_on_error=allow", SPEC_ON),
    ("eval.max_new_tokens=9", SPEC_ON),  # the specialists' rollout budget when specialists.max_new_tokens is unset
    ("eval.n_eval=9", SPEC_ON),  # the specialist's own score, kept in its result.json
    ("engine.backend=sglang", SPEC_ON), ("engine.max_running_requests=8", SPEC_ON),  # which APRIL samples finish
    ("distill.steps=5", {"student"}), ("distill.train.lr=0.01", {"student"}), ("distill.eval_every=5", {"student"}),
    ("distill.loss_agg=seq_mean_token_mean", {"student"}),
    ("teachers.external.reverse=http://teacher:1", {"student"}),
]


def prefixes(overrides: list[str], domain: str = "max_list") -> dict[str, str]:
    cfg = load_config(SMOKE, overrides)
    return {"base": base_prefix(cfg, STORAGE), "specialist": specialist_prefix_of(cfg, STORAGE, domain),
            "student": student_prefix_of(cfg, STORAGE)}


def ops_paths(cls: type[BaseModel], where: str = "") -> set[str]:
    out = set()
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("fingerprint") is False:
            out.add(where + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= ops_paths(ann, f"{where}{name}.")
    return out


def test_the_list_covers_every_ops_field():
    assert ops_paths(AlloyConfig) == set(OPS_CHANGES)


@pytest.mark.parametrize("key", sorted(OPS_CHANGES))
def test_an_ops_setting_moves_no_prefix(key):
    before = prefixes([])
    assert prefixes([f"{key}={json.dumps(OPS_CHANGES[key])}"]) == before
    cfg = load_config(SMOKE, [f"{key}={json.dumps(OPS_CHANGES[key])}"])
    assert cfg.fingerprint() == load_config(SMOKE).fingerprint()


# the ops fields of a dataset domain's `dataset` section (inside the domains list, which ops_paths does not walk)
DATASET_OPS = {"max_file_mb": 64.0, "max_row_kb": 16.0}


def test_dataset_limits_move_no_prefix(tmp_path):
    from infra.config import DatasetConfig, config_from_dict

    assert ops_paths(DatasetConfig) == set(DATASET_OPS)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(50)))

    def dataset_prefixes(**ds):
        cfg = config_from_dict({"domains": [{"name": "ds", "dataset": {"path": str(data), **ds}}]})
        return base_prefix(cfg, STORAGE), specialist_prefix_of(cfg, STORAGE, "ds"), student_prefix_of(cfg, STORAGE)

    assert dataset_prefixes(**DATASET_OPS) == dataset_prefixes()


def test_all_ops_settings_at_once_and_per_domain_ones_move_no_prefix():
    before = prefixes([])
    sets = [f"{k}={json.dumps(v)}" for k, v in OPS_CHANGES.items()]
    assert prefixes(sets) == before
    # an override that holds only ops settings is no override at all
    assert prefixes(["specialists.per_domain.reverse={log_every: 1, checkpoint_every: 3, threads: 2}"]) == before


@pytest.mark.parametrize("override,moved", TRAINING_CHANGES, ids=[o for o, _ in TRAINING_CHANGES])
def test_a_training_setting_moves_exactly_the_stages_it_changes(override, moved):
    before, after = prefixes([]), prefixes([override])
    assert {s for s in STAGES if before[s] != after[s]} == moved


def test_a_specialist_prefix_follows_its_own_merged_settings():
    assert prefixes(["specialists.per_domain.max_list.steps=120"])["specialist"] == prefixes([])["specialist"]
    assert prefixes(["specialists.per_domain.reverse.steps=7"], "reverse")["specialist"] == \
        prefixes(["specialists.steps=7"], "reverse")["specialist"]


def test_base_tool_trajectories_off_keys_the_base_as_before_the_setting_existed():
    def base_settings(overrides):
        return load_config(SMOKE, overrides).model_dump(context={"fingerprint": True})["base"]

    assert "tool_trajectories" not in base_settings([])  # the default is left out: smoke's base prefix unmoved
    assert base_settings(["base.tool_trajectories=true"])["tool_trajectories"] is True
    assert "tool_trajectories" in load_config(SMOKE).model_dump()["base"]  # an ordinary dump keeps it


def test_distill_token_mean_keys_the_student_as_before_loss_agg_existed():
    def distill_settings(overrides):
        return load_config(SMOKE, overrides).model_dump(context={"fingerprint": True})["distill"]

    assert "loss_agg" not in distill_settings([])  # the default is left out: every student prefix unmoved
    assert distill_settings(["distill.loss_agg=seq_mean_token_mean"])["loss_agg"] == "seq_mean_token_mean"
    assert load_config(SMOKE).model_dump()["distill"]["loss_agg"] == "token_mean"  # an ordinary dump keeps it


def test_base_validation_settings_move_the_base_only_when_it_stops_by_its_score():
    """`base.val_every` / `val_n` decide nothing while `stop_at_score` is null: a base keys its checkpoints as
    before the settings existed; with a target they decide where the base stops, so they move every stage."""
    assert prefixes(["base.val_every=7", "base.val_n=9"]) == prefixes([])
    on = ["base.stop_at_score=0.5"]
    assert prefixes(on + ["base.val_every=7"])["base"] != prefixes(on)["base"]
    assert prefixes(on + ["base.val_n=9"])["base"] != prefixes(on)["base"]


def test_setting_a_train_section_in_part_to_its_defaults_moves_no_prefix():
    """A --set of one field of `specialists.policy_train` / `critic_train` / `distill.train` keeps the section's
    other stage defaults (micro_batch_size 64 / 128, not TrainConfig's 32): setting a field to the value it already
    has is no change at all. (Before the fix it reset micro_batch_size, so such a config keyed other checkpoints.)"""
    before = prefixes([])
    for section in ("specialists.policy_train", "specialists.critic_train", "distill.train"):
        lr = load_config(SMOKE).model_dump()[section.split(".")[0]][section.split(".")[1]]["lr"]
        assert prefixes([f"{section}.lr={lr}"]) == before, section


def test_a_judge_checkpoint_keys_the_specialists_by_its_files_not_its_path(tmp_path):
    """A run root copied or moved with its judge inside reuses its specialists; a judge with other weights moves
    them (and the student), never the base."""
    judge = tmp_path / "runs" / "judge"
    judge.mkdir(parents=True)
    (judge / "config.json").write_text('{"model_type": "llama"}')
    (judge / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    moved = tmp_path / "elsewhere" / "judge"
    moved.parent.mkdir()
    import shutil

    shutil.copytree(judge, moved)
    here, there = prefixes([f"specialists.guard.judge_path={judge}"]), prefixes([f"specialists.guard.judge_path={moved}"])
    assert here == there
    assert here["specialist"] != prefixes([])["specialist"]  # a served judge still counts
    (moved / "model.safetensors").write_bytes(bytes(range(256)) * 39 + bytes(256))
    other = prefixes([f"specialists.guard.judge_path={moved}"])
    assert {s for s in STAGES if other[s] != here[s]} == SPEC_ON
