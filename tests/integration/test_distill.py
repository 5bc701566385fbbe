"""OPD smoke on real servers: three teacher servers (a weak base SFT-ed further on one domain each), the `distill`
flow (teachers up → student process → register), MLflow metrics, and the on-policy importance ratio.

What must show: the student's reverse KL to every teacher goes down, and its eval score on every domain goes up.
"""
from __future__ import annotations

import json
import math

import pytest

from distill_fixtures import build_base_and_teachers
from domains.registry import load_domains
from infra.config import config_from_dict
from infra.storage import read_json, verify_checkpoint
from infra.tracking import NoopTracker, Tracker
from tasks.context import RunContext
from tasks.worker_process import progress_path
from training.progress_events import read_events

pytestmark = pytest.mark.integration

DOMAINS = ["reverse", "sort_digits", "max_list"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_base_and_teachers(tmp_path_factory.mktemp("opd-models"), DOMAINS)


def make_cfg(root, **distill):
    return config_from_dict({
        "run": {"name": "opd", "root": str(root)}, "model": {"preset": "tiny"},
        "domains": [{"name": d} for d in DOMAINS], "eval": {"n_eval": 40, "max_new_tokens": 8},
        "distill": {"steps": 120, "batch_size": 48, "max_new_tokens": 8, "eval_every": 60, "eval_n": 40,
                    "log_every": 20, "checkpoint_every": 60, "train": {"lr": 3e-3, "micro_batch_size": 48},
                    **distill}})


def make_ctx(cfg, tmp_path, tracker, parent) -> RunContext:
    cfg_path = tmp_path / "cfg.json"  # JSON is YAML: the student process loads the very same config
    cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    work = tmp_path / "work"
    work.mkdir()
    return RunContext(cfg=cfg, config_path=str(cfg_path), overrides=[], work_dir=work, storage_url=cfg.storage_url,
                      tracker=tracker, parent_run_id=parent, domains=load_domains(cfg))


def test_distill_flow_three_teachers_kl_down_scores_up(models, tmp_path, prefect_harness):
    from flows.distill import distill_stage

    base, teachers = models
    # deterministic: seeded sampling, batch k always from the step-(k − 1) weights: the same run under any load
    cfg = make_cfg(tmp_path / "runs", deterministic=True)
    tracker = Tracker(runs_root=tmp_path / "runs", experiment="opd-test")
    parent = tracker.start_parent("opd-test")
    ctx = make_ctx(cfg, tmp_path, tracker, parent)

    out = distill_stage(ctx, str(base), {d: str(p) for d, p in teachers.items()})

    assert out["n_teachers"] == 3 and out["steps"] == 120 and out["registered_model"] == "alloy-student/1"
    assert set(ctx.timings) >= {"teachers_up", "distill"}
    # exactly-once bookkeeping: every issued id is trained or dropped (with a reason), none twice
    assert out["trained_samples"] + len(out["dropped"]) == out["cursor"] == 120 * 48
    assert out["duplicates_skipped"] == 0
    assert out["throughput"]["distill_sampled_tokens_per_s"] > 0 and out["throughput"]["teacher_scored_tokens_per_s"] > 0
    assert verify_checkpoint(out["student_checkpoint"])[0]
    assert read_json(out["student_checkpoint"].rsplit("/", 1)[0] + "/result.json")["steps"] == 120
    # the task followed the student process by the steps it reported as data (tasks/worker_process.py), every one
    reported = read_events(progress_path(ctx.work_dir / "logs" / "distill.log"))[0]
    assert [e.step for e in reported] == list(range(1, 121)) and {e.total for e in reported} == {120}
    assert "train/reward" in reported[-1].metrics

    # per-domain eval score up (step 0 → 120), on every domain
    first, last = out["evals"][0], out["evals"][-1]
    print("DISTILL-NUMBERS", {"evals": out["evals"], "dropped": len(out["dropped"])})
    assert (first["step"], last["step"]) == (0, 120)
    for d in DOMAINS:  # deterministic run: +0.052 (reverse), +0.48 (sort_digits), +0.175 (max_list)
        assert last["scores"][d] > first["scores"][d] + 0.03, (d, first, last)

    # MLflow: one nested `student` run with the per-teacher series; reverse KL down for every teacher
    from mlflow import MlflowClient

    client = MlflowClient(tracker.tracking_uri)
    child = tracker.find_child(parent, "student")
    assert child == out["student_run_id"]
    for d in DOMAINS:
        rkl = [m.value for m in sorted(client.get_metric_history(child, f"teacher/{d}/rkl"), key=lambda m: m.step)]
        print("DISTILL-RKL", d, rkl)
        assert len(rkl) == 6 and rkl[-1] < rkl[0] - 0.2, (d, rkl)
        for name in ("tokens", "latency_p50_s", "latency_p95_s", "errors", "retries"):
            assert client.get_metric_history(child, f"teacher/{d}/{name}"), name
        assert len(client.get_metric_history(child, f"eval/{d}")) == 3  # steps 0, 60, 120
    assert client.get_metric_history(child, "summary/teacher_scored_tokens_per_s")[0].value > 0
    mv = client.get_model_version_by_alias("alloy-student", "candidate")
    assert str(mv.version) == "1" and mv.run_id == child and mv.tags["alloy.loss"] == "topk_kl"
    assert mv.tags["alloy.mlflow_flavor"] == "transformers"  # mlflow.transformers.load_model-able (test_tracking.py)
    # rollout records (the default: a sample of 4 every 10 steps) with the teachers' log-prob of every token
    from training.rollout_records import read_rollouts

    recs = read_rollouts(out["student_checkpoint"].rsplit("/", 1)[0])
    assert sorted(set(recs.step)) == list(range(10, 121, 10)) and set(recs.domain) <= set(DOMAINS)
    assert (recs.stage == "student").all() and recs.staleness.between(0, 1).all()
    assert all(len(o) == len(t) == len(b) for o, t, b in zip(recs.output_ids, recs.teacher_logprobs,
                                                             recs.behaviour_logprobs))
    assert {a.path for a in client.list_artifacts(child, "rollouts")} <= \
        {f"rollouts/{p}{d}.json" for d in DOMAINS for p in ("", "eval_")}
    evs = read_rollouts(out["student_checkpoint"].rsplit("/", 1)[0], split="eval")  # each eval's first 4 per domain
    assert sorted(set(evs.step)) == [0, 60, 120] and (evs.groupby(["step", "domain"]).size() == 4).all()
    assert evs.groupby("step").prompt.apply(tuple).nunique() == 1  # the same prompts at every eval
    top = recs.iloc[0]  # topk_kl: the teacher's top-16 at every response token
    assert len(top.teacher_topk_ids) == len(top.output_ids) and all(len(k) == 16 for k in top.teacher_topk_ids)


def test_sampled_rkl_on_policy_importance_ratio_is_one(models, tmp_path):
    """Synchronous (max_staleness 0) sampled_rkl: the trainer's log-probs of the engine's samples equal the
    engine's rollout log-probs, so the importance ratio is 1 up to float noise; with staleness 1 it is not."""
    from student.distill_main import run_distillation
    from tasks.teachers import start_teachers

    base, teachers = models
    cfg = make_cfg(tmp_path / "runs", steps=4, loss="sampled_rkl", max_staleness=0, eval_every=0, log_every=1,
                   is_clip=None)
    fleet = start_teachers(DOMAINS, {d: str(p) for d, p in teachers.items()}, str(base), log_dir=tmp_path / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    seen: list[dict] = []
    try:
        out = run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), f"file://{tmp_path}/s0",
                               tmp_path / "w0", NoopTracker(), on_step=lambda tr, m: seen.append(dict(m)))
        assert out["steps"] == 4 and [m["train/lag_max"] for m in seen] == [0.0] * 4
        for m in seen:
            assert m["train/logp_abs_diff"] < 1e-4  # engine and trainer agree on every sampled token's log-prob
            assert m["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert math.isfinite(m["train/loss"]) and m["train/reverse_kl"] > 0
        cfg1 = make_cfg(tmp_path / "runs", steps=4, loss="sampled_rkl", max_staleness=1, eval_every=0, log_every=1)
        seen.clear()
        run_distillation(cfg1, load_domains(cfg1), str(base), fleet.endpoints(), f"file://{tmp_path}/s1",
                         tmp_path / "w1", NoopTracker(), on_step=lambda tr, m: seen.append(dict(m)))
        lags = [m["train/lag_max"] for m in seen]
        assert lags[0] == 0.0 and max(lags) == 1.0  # batch 1 was sampled before update 0 landed
        stale = [m for m in seen[1:] if m["train/lag_mean"] > 0]
        assert stale and all(m["train/logp_abs_diff"] > 1e-3 for m in stale)  # the ratio has work to do
    finally:
        fleet.stop()


def distill_served(cfg, models, tmp_path, name: str) -> dict:
    """`run_distillation` of `cfg` from the base with the three teachers served for it, into `tmp_path/name`."""
    from student.distill_main import run_distillation
    from tasks.teachers import start_teachers

    base, teachers = models
    fleet = start_teachers(DOMAINS, {d: str(p) for d, p in teachers.items()}, str(base), log_dir=tmp_path / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    try:
        return run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), f"file://{tmp_path}/{name}",
                                tmp_path / f"w-{name}", NoopTracker())
    finally:
        fleet.stop()


def test_a_replayed_opd_step_reproduces_its_recorded_loss(models, tmp_path):
    """A 3-step student (top-k KL over three teacher servers, deterministic sampling) with the full rollout record and
    a checkpoint after every step; a fresh trainer resumes the step-2 checkpoint alone and replays step 3's record
    (its own and the teachers' log-probs and top-16, no teacher asked): the same loss as the run, bit for bit."""
    import shutil

    from infra.storage import checkpoint_name
    from student.distill_main import build_student
    from student.replay import replay_step

    base = models[0]
    cfg = make_cfg(tmp_path / "runs", steps=3, eval_every=0, checkpoint_every=1, keep_checkpoints=3,
                   deterministic=True, record={"full": True})
    out = distill_served(cfg, models, tmp_path, "s")
    assert out["steps"] == 3
    (tmp_path / "at2").mkdir()
    shutil.copytree(tmp_path / "s" / checkpoint_name(2), tmp_path / "at2" / checkpoint_name(2))
    trainer = build_student(cfg, load_domains(cfg), str(base), f"file://{tmp_path}/at2", tmp_path / "w2",
                            NoopTracker())
    trainer.resume()
    got = replay_step(trainer, f"file://{tmp_path}/s", 3)
    losses = sorted(k for k in got["recorded"] if not k.startswith("perf/"))
    assert got["version"] == 2 and "train/loss" in losses, got
    assert {k: got["replayed"][k] for k in losses} == {k: got["recorded"][k] for k in losses}  # bit for bit
    trainer.raw_backend.close()


def test_rollout_only_samples_scores_and_records_without_training(models, tmp_path):
    """`distill.debug.rollout_only`: every step samples, the teachers score and the full record keeps it; the committed
    student is its init, weight for weight."""
    from safetensors.torch import load_file

    from training.rollout_records import read_rollouts

    base = models[0]
    cfg = make_cfg(tmp_path / "runs", steps=2, eval_every=0, debug={"rollout_only": True}, record={"full": True})
    out = distill_served(cfg, models, tmp_path, "ro")
    assert out["steps"] == 2
    recs = read_rollouts(f"file://{tmp_path}/ro")
    assert sorted(set(recs.step)) == [1, 2] and len(recs) == 2 * 48
    assert all(len(t) == len(o) for t, o in zip(recs.teacher_logprobs, recs.output_ids))
    before, after = load_file(base / "model.safetensors"), load_file(tmp_path / "ro" / "final" / "model.safetensors")
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
