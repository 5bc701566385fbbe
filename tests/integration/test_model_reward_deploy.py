"""A specialist flow run of `specialists.mode: deployment` with a model-rewarded domain serves its own reward model
(flows/specialists.py `specialist`, tasks/reward_servers.py): the pipeline's overrides as dispatched to it
(flows/handoff.py `dispatch_overrides`) leave out the pipeline machine's `served_url` (here a dead loopback port),
and the flow run is handed the reward model's storage URL instead (parameter `reward_models`); it pulls the
checkpoint into its own work dir, serves it under its own Supervisor and trains `polite` on its rewards. Real
Prefect (the session's test harness), a real engine server and a real trainer; configs/preference.yaml shrunk to two
PPO steps (~1 min on 2 cores). The deployment's dispatch across workers is tests/e2e/test_scaleout.py's."""
from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_proc import make_reward_model
from preference_fixtures import CONFIG, make_pairs

pytestmark = pytest.mark.integration

FAST = ["specialists.steps=2", "specialists.val_every=2", "specialists.val_n=8", "specialists.eval_n=8",
        "specialists.checkpoint_every=2", "specialists.batch_size=8", "specialists.n_prompts=200",
        "eval.n_eval=8", "base.n_train_per_domain=500", "distill.n_prompts_per_domain=500",
        "tracking.enabled=false", "run.name=rm-deploy"]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_deployment_specialist_serves_its_own_reward_model(tmp_path, tiny_model_dir, prefect_harness):
    from flows.handoff import dispatch_overrides
    from flows.specialists import specialist
    from infra.storage import save_checkpoint

    data = tmp_path / "data"
    make_pairs(data)
    store = tmp_path / "store"
    base_url = save_checkpoint(str(tiny_model_dir), (store / "base" / "final").as_uri(), step=1)
    rm_url = save_checkpoint(str(make_reward_model(tiny_model_dir, tmp_path / "rm")),
                             (store / "rm-polite" / "final").as_uri(), step=1)
    # the pipeline's context inside serve_rewards: its own server's URL, unreachable from another worker
    parents_url = f"http://127.0.0.1:{dead_port()}"
    parent = SimpleNamespace(storage_url=store.as_uri(), overrides=[
        *FAST, f"run.root={tmp_path}/pipeline-runs", f"domains.0.dataset.path={data / 'polite.jsonl'}",
        f"reward_models.polite.data={data / 'pairs.jsonl'}",
        f"domains.0.reward.served_url={parents_url}"])
    overrides = dispatch_overrides(parent)
    assert not any("served_url" in o for o in overrides)

    worker_root = tmp_path / "worker"  # the flow run's own scratch dir (its run.root)
    out = specialist(config=CONFIG, domain="polite", base_url=base_url,
                     overrides=[*overrides, f"run.root={worker_root}"], reward_models={"polite": rm_url})

    work = worker_root / "rm-deploy" / "work"
    pulled = work / "specialists" / "polite" / "rm-polite"
    assert (pulled / "config.json").is_file()  # pulled from storage into the flow run's work dir
    log = (work / "logs" / "rewards" / "rm-polite.log").read_text()  # its own server, under its own Supervisor
    assert f"reward model ready: {pulled} (LlamaForSequenceClassification" in log
    assert "alloy engine server on http://127.0.0.1:" in log and parents_url not in log
    assert "server stopped" in log  # stopped when the flow run's training ended
    assert out["domain"] == "polite" and out["steps"] == 2
    assert 0.0 < out["reward_score"] < 1.0  # the evaluation's mean σ(score) from that server
    assert out["checkpoint"].startswith(store.as_uri()) and out["checkpoint"].endswith("/final")
