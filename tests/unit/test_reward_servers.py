"""Reward servers in `specialists.mode: deployment` (tasks/reward_servers.py, flows/specialists.py,
flows/handoff.py), without servers: a specialist flow run is handed no reward-server URL of the pipeline's machine,
only the reward models' storage URLs; it pulls what its own domain needs (the domain filter) and a judge checkpoint
missing on its worker is an error naming the field. And each reward server's spec carries its GPU of the plan. The
served path, real servers and a real flow run, is tests/integration/test_model_reward_deploy.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.config import ConfigError, config_from_dict
from infra.storage import save_checkpoint
from preference_fixtures import tiny_reward_files

pytestmark = pytest.mark.unit


@pytest.fixture()
def cfg(tmp_path):
    """Two model-rewarded domains (reward models `pol` and `kind`), one judged by a checkpoint path, one verifier."""
    rows, pairs = tiny_reward_files(tmp_path, "p{i}=")
    ds = {"path": str(rows)}
    return config_from_dict({
        "domains": [{"name": "polite", "dataset": ds, "reward": {"kind": "model", "reward_model": "pol"}},
                    {"name": "kindly", "dataset": ds, "reward": {"kind": "model", "reward_model": "kind"}},
                    {"name": "judged", "dataset": ds, "reward": {"kind": "judge", "model": str(tmp_path / "judge"),
                                                                  "rubric": "kind?"}},
                    {"name": "reverse"}],
        "reward_models": {"pol": {"data": str(pairs)}, "kind": {"data": str(pairs)}}})


def test_deployment_flow_runs_get_no_reward_server_url_of_this_machine():
    from flows.handoff import dispatch_overrides

    # what serve_rewards adds to the pipeline's context (tasks/reward_servers.py) and a user's own overrides
    ctx = SimpleNamespace(storage_url="s3://b/a", overrides=[
        "base.steps=5", "domains.0.reward.served_url=http://127.0.0.1:4321", "run.root=/mine",
        "domains.12.reward.served_url = http://127.0.0.1:9", "domains.0.reward.length_penalty=0.5"])
    assert dispatch_overrides(ctx) == ["base.steps=5", "domains.0.reward.length_penalty=0.5", 'run.storage="s3://b/a"']


def test_the_domain_filter(cfg, tmp_path):
    from tasks.reward_servers import needed_reward_models, reward_checkpoints

    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text("{}")
    rms = {"pol": {"local_dir": "/w/pol"}, "kind": {"local_dir": "/w/kind"}}
    assert needed_reward_models(cfg) == ["pol", "kind"]
    assert needed_reward_models(cfg, ["kindly"]) == ["kind"] and needed_reward_models(cfg, ["judged"]) == []
    assert set(reward_checkpoints(cfg, rms)) == {0, 1, 2}
    assert reward_checkpoints(cfg, {"kind": rms["kind"]}, ["kindly"]) == {1: ("rm-kind", Path("/w/kind"))}
    ((name, path),) = reward_checkpoints(cfg, {}, ["judged"]).values()
    assert path == judge and name.startswith("judge-judge-") and len(name) == len("judge-judge-") + 8
    assert reward_checkpoints(cfg, {}, ["reverse"]) == {}  # a verifier domain: nothing to serve
    with pytest.raises(ConfigError, match=r"domains\.0\.reward\.reward_model: reward model 'pol' was not trained"):
        reward_checkpoints(cfg, {"kind": rms["kind"]}, ["polite", "kindly"])


def ctx_of(cfg, tmp_path):
    from tasks.context import RunContext

    return RunContext(cfg=cfg, config_path="c.yaml", overrides=[], work_dir=tmp_path / "work", storage_url="",
                      tracker=None, parent_run_id=None, domains={})


def test_a_specialist_flow_run_pulls_only_its_domains_reward_model(cfg, tmp_path):
    from flows.specialists import fetch_reward_models

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    url = save_checkpoint(str(rm), (tmp_path / "store" / "rm-kind-x" / "final").as_uri(), step=1)
    ctx = ctx_of(cfg, tmp_path)
    got = fetch_reward_models(ctx, "kindly", {"kind": url, "pol": (tmp_path / "absent").as_uri()})
    local = tmp_path / "work" / "specialists" / "kindly" / "rm-kind"
    assert got == {"kind": {"checkpoint": url, "local_dir": str(local)}}
    assert (local / "config.json").read_text() == (rm / "config.json").read_text()
    assert fetch_reward_models(ctx, "reverse", None) == {}  # a verifier domain needs none
    with pytest.raises(ValueError, match=r"specialist polite: reward model 'pol' \(reward_models\.pol\) was not "
                                         r"handed to this flow run: parameter `reward_models` holds \['kind'\]"):
        fetch_reward_models(ctx, "polite", {"kind": url})


def test_a_judge_checkpoint_missing_on_the_worker_names_the_field(cfg, tmp_path):
    from flows.specialists import fetch_reward_models

    with pytest.raises(ConfigError, match=r"domains\.2\.reward\.model: .*judge is not a model checkpoint directory"
                                          r".*specialists\.mode=deployment every specialist worker needs it"):
        fetch_reward_models(ctx_of(cfg, tmp_path), "judged", {})


def test_each_reward_server_gets_its_planned_gpu(cfg, tmp_path):
    """The names `reward_checkpoints` gives the servers are the plan's `reward` procs (infra/placement.py), so each
    spec gets its placement: its own GPU; without GPUs (gpus_per_node 0) no placement, no env."""
    from tasks.gpu_lanes import server_placements
    from tasks.reward_servers import reward_checkpoints, reward_specs

    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 256}))
    rms = {"pol": {"local_dir": "/w/pol"}, "kind": {"local_dir": "/w/kind"}}
    planned = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"gpus_per_node": 8})})
    by_path = {str(path): name for name, path in reward_checkpoints(planned, rms).values()}
    placements = server_placements(planned, "reward")
    assert set(placements) == set(by_path.values())
    assert sorted(placements)[:2] == ["judge-judge-" + sorted(placements)[0][-8:], "rm-kind"] and "rm-pol" in placements
    specs = reward_specs(planned, by_path)
    assert [(s.name, s.model_path) for s in specs] == [(n, p) for p, n in by_path.items()]
    for spec in specs:
        gpus = placements[spec.name]["gpus"]
        assert spec.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(g) for g in gpus), spec
    bare = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"gpus_per_node": 0})})
    assert all(s.env == {} for s in reward_specs(bare, by_path))
