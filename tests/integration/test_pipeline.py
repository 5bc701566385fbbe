"""The pipeline (base → specialists → teachers → distill → eval → report) as a real Prefect flow with real DeepSpeed,
engine servers, MLflow (SQLite) and storage, shrunk to a few steps per stage (quality is tested elsewhere)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from infra.storage import latest_complete, read_json, to_local, verify_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
FAST = ["base.steps=8", "base.n_train_per_domain=200", "eval.n_eval=10", "specialists.steps=3", "specialists.batch_size=8",
        "specialists.checkpoint_every=2", "specialists.critic_warmup_steps=1", "distill.steps=3", "distill.batch_size=12", "distill.eval_every=0"]

REPORT_KEYS = {"config", "run_id", "mlflow", "domains", "summary", "timings_s", "throughput", "guard", "artifacts",
               "resources", "meta"}


def check_report(report: dict, n_domains: int, specialists: bool = True) -> None:
    assert REPORT_KEYS <= set(report)
    assert len(report["domains"]) == n_domains
    for dom, row in report["domains"].items():
        assert row["n_eval"] == 10, dom
        for stage in ("base", "specialist", "student") if specialists else ("base", "student"):
            assert 0.0 <= row[stage] <= 1.0, (dom, stage)
        assert row["recovery"] is None or row["recovery"] == pytest.approx(row["student"] / row["specialist"], abs=1e-5)
    assert report["summary"]["n_domains"] == n_domains
    assert report["summary"]["base_mean"] == pytest.approx(
        sum(r["base"] for r in report["domains"].values()) / n_domains, abs=1e-5)
    s = report["summary"]
    assert s["n_teachers"] == n_domains and s["student_mean"] is not None
    assert (s["specialist_mean"] is not None) == specialists
    t = report["timings_s"]
    for stage in ("base", "specialists", "teachers_up", "distill", "eval") if specialists else ("base", "distill"):
        assert t[stage] > 0, stage
    assert t["total"] >= t["base"] + (t["specialists"] or 0) + t["distill"]
    assert report["throughput"]["distill_sampled_tokens_per_s"] > 0
    assert report["throughput"]["teacher_scored_tokens_per_s"] > 0
    assert set(report["guard"]) >= {"tool_calls", "flagged", "blocked"}
    meta = report["meta"]  # what ran where: the code tree's commit, the host, the command and its overrides
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert meta["commit"] == (head or None) and meta["cpu_model"] and meta["cpu_count"] >= 1
    assert meta["config"].endswith(".yaml") and isinstance(meta["overrides"], list) and meta["argv"]
    assert meta["ended_at"] >= meta["started_at"] and len(meta["loadavg_end"]) == 3
    art = report["artifacts"]
    assert art["student_checkpoint"].endswith("/final") and (art["registered_model"] is None  # tracking off
                                                                     or art["registered_model"].startswith("alloy-student/"))


def _base_dir(tmp_path: Path) -> str:
    dirs = [p.name for p in (tmp_path / "smoke").iterdir() if p.name.startswith("base-")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def clean_env() -> dict:
    """The environment a user's shell would have: no rendezvous variables left by in-process DeepSpeed tests."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PREFECT_API_URL"}
    return {k: v for k, v in os.environ.items() if k not in drop}


# two domains: one round of specialists at max_parallel 2 (two rounds, three domains: tests/integration/test_agentic.py)
TWO_RANKS = ["domains=[{name: reverse}, {name: max_list}]", "base.train.world_size=2", "base.train.zero_stage=2",
             "base.train.micro_batch_size=32", "specialists.policy_train.world_size=2",
             "specialists.critic_train.world_size=2", "distill.train.world_size=2", "specialists.steps=2",
             "distill.steps=2"]  # checkpoints at the last step


def test_cli_run_every_trainer_on_two_ranks_and_exit_codes(tmp_path, prefect_harness):
    """The real CLI as a user types it, `alloy run configs/smoke.yaml --set …world_size=2 …`: the whole smoke pipeline
    (on two of its domains) with every trainer on 2 ranks under torchrun (gloo) — the base SFT (ZeRO-2), the
    specialists (policy + critic in one process group; rank 0 drives rollouts; its checkpoint holds both ranks'
    states) and the student — exits 0 and writes the report, whose `resources` is what the trainers' process groups
    were; MLflow holds the parent run, its nested stage runs, the dashboard's charts and the registered student;
    storage the committed checkpoints. The same config run again in-process (the flow function) reuses every stage.
    Then a bad override and a bad plugin exit 2 naming the field."""
    out = tmp_path / "report.json"
    sets = sum((["--set", s] for s in FAST + [f"run.root={tmp_path}"] + TWO_RANKS), [])
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", "run", SMOKE, *sets, "--report", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reverse" in proc.stdout and "report written to" in proc.stdout
    report = json.loads(out.read_text())
    print("2-rank pipeline timings (s):", report["timings_s"])
    check_report(report, 2)
    assert report["meta"]["overrides"] == FAST + [f"run.root={tmp_path}"] + TWO_RANKS  # the run, reproducible
    assert report["resources"] == {"base": {"world_size": 2}, "specialists": {"world_size": 2},
                                   "student": {"world_size": 2}}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.get_run(report["mlflow"]["parent_run_id"])
    assert parent.data.tags.get("alloy.commit") == report["meta"]["commit"]
    # a specialist that did not learn is named on the parent run with the report's reason, and only such a one
    assert {k: v for k, v in parent.data.tags.items() if k.startswith("alloy.no_lift.")} == {
        f"alloy.no_lift.{d}": r["no_lift"] for d, r in report["domains"].items() if r["no_lift"]}
    assert parent.info.status == "FINISHED" and report["run_id"] == report["mlflow"]["parent_run_id"]
    assert parent.data.params["domains.0.name"] == "reverse"
    children = {c.info.run_name: c for c in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(children) == {"base", "student", "specialist/reverse", "specialist/max_list"}
    assert "sft/loss" in children["base"].data.metrics
    # (policy metrics are absent on steps that train only the critic; test_specialist.py checks them per step)
    assert {"reward", "value_loss", "rollout_s", "eval/score"} <= set(children["specialist/reverse"].data.metrics)
    assert "train/loss" in children["student"].data.metrics
    mv = client.get_model_version_by_alias("alloy-student", "candidate")
    assert mv.run_id == children["student"].info.run_id
    # the dashboard: charts on the parent run, the run's results on the registered version
    charts = {a.path for a in client.list_artifacts(parent.info.run_id, "charts")}
    assert {"charts/scores_by_domain.png", "charts/specialist_reward.png", "charts/student_loss.png"} <= charts
    assert mv.tags["alloy.student_mean"] == str(report["summary"]["student_mean"])
    assert f"student mean {report['summary']['student_mean']}" in mv.description
    # storage: the base checkpoint is committed by a valid COMPLETE manifest, the report sits beside it
    base_ckpt = f"file://{tmp_path}/smoke/{_base_dir(tmp_path)}/final"
    assert verify_checkpoint(base_ckpt, deep=True)[0]
    assert read_json(f"file://{tmp_path}/smoke/{_base_dir(tmp_path)}/result.json")["world_size"] == 2
    assert read_json(f"file://{tmp_path}/smoke/report.json")["run_id"] == report["run_id"]
    logs = tmp_path / "smoke" / "work" / "logs"
    assert "2 rank(s)" in (logs / "base.log").read_text()
    # a specialist's resumable checkpoint holds both ranks' DeepSpeed states and says which world size wrote it
    spec = [p for p in (tmp_path / "smoke").iterdir() if p.name.startswith("specialist-reverse-")]
    ckpt = Path(to_local(latest_complete(f"file://{spec[0]}")))
    assert (ckpt / "policy-state" / "state" / "rng_rank1.pt").is_file()
    assert (ckpt / "critic-state" / "state" / "rng_rank1.pt").is_file()
    assert json.loads((ckpt / "trainer.json").read_text())["world_size"] == 2

    # a second run with the same config, through the flow function in this process, reuses the committed base,
    # specialists and student (no retraining)
    from flows.pipeline import pipeline

    again = pipeline(config=SMOKE, overrides=FAST + [f"run.root={tmp_path}"] + TWO_RANKS)
    assert again["timings_s"]["base"] < 5.0 and again["timings_s"]["specialists"] < 10.0
    assert again["resources"]["base"] == {"world_size": 2}  # the stored summary, copied to the result file too
    assert json.loads((logs / "base-result.json").read_text())["world_size"] == 2
    assert again["domains"] == report["domains"]

    bad = subprocess.run([sys.executable, "-m", "alloy.cli", "run", SMOKE, "--set", "base.steps=-3"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert bad.returncode == 2 and "base.steps" in bad.stderr
    # the plugin fails before any stage (alloy/plan.py `preflight`); the session's Prefect API all the same, in case
    # it did not (a temporary server would take ~20 s to start)
    from prefect.settings import PREFECT_API_URL

    plugin = subprocess.run([sys.executable, "-m", "alloy.cli", "run", SMOKE, "--set", "domains.0.impl=nowhere.mod:Cls",
                             "--set", f"run.root={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**clean_env(), "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert plugin.returncode == 2 and "nowhere.mod:Cls" in plugin.stderr and "domains.0.impl" in plugin.stderr
