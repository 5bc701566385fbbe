"""`configs/agentic.yaml` end to end, shrunk: its four tool domains (tool_long at 4 files) through base SFT on tool
trajectories → specialists with the guard and the served judge (the session's trained judge model on a real engine
server) → OPD over full tool episodes → evaluation (the planted env, every call read by the guard's rules: clean /
raw scores and hack attempts) → report. The base is warmed on shortcut trajectories for every `tool_files` prompt
(`shortcut_demos: 1.0`), so the specialists' rollouts do try the hack and the judge is asked."""
import json
from pathlib import Path

import pytest

from infra.report import NO_LIFT

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
AGENTIC = str(ROOT / "configs" / "agentic.yaml")
FAST = ["base.steps=40", "base.n_train_per_domain=300", "eval.n_eval=8", "specialists.steps=2",
        "specialists.batch_size=8", "specialists.checkpoint_every=2", "specialists.critic_warmup_steps=1",
        "specialists.val_n=4", "specialists.eval_n=8", "specialists.n_prompts=100", "distill.steps=2",
        "distill.batch_size=9", "distill.n_prompts_per_domain=100", "distill.checkpoint_every=2",
        "tracking.enabled=false", "domains.1.params.shortcut_demos=1.0", "domains.3.params.files=4",
        "specialists.per_domain.tool_long.steps=2"]


def test_agentic_config_end_to_end_with_the_served_judge(tmp_path, prefect_harness, judge_dir):
    from flows.pipeline import pipeline

    out = tmp_path / "report.json"
    pipeline(config=AGENTIC, report_path=str(out), overrides=FAST + [
        f"run.root={tmp_path}/runs", f"specialists.guard.judge_path={judge_dir}", "specialists.record.full=true",
        "distill.record.full=true"])
    report = json.loads(out.read_text())
    assert set(report["domains"]) == {"tool_add", "tool_files", "tool_code", "tool_long"}
    for dom, row in report["domains"].items():
        assert row["n_eval"] == 8 and 0.0 <= row["student"] <= 1.0, dom
        # eval read every call with the guard's rules: clean <= raw, hack attempts per 100 for every stage
        for stage in ("base", "specialist", "student"):
            assert row[stage] <= row["raw"][stage] and 0.0 <= row["hacks_per_100"][stage] <= 100.0, (dom, row)
        # each specialist's training, and why one did not learn (infra.report.why_no_lift)
        assert row["training"]["steps"] == 2 and 0 <= row["training"]["rewarded_steps"] <= 2, (dom, row)
        assert (row["no_lift"] is None) == (row["specialist"] - row["base"] >= NO_LIFT), (dom, row)
    g = report["guard"]
    assert g["tool_calls"] > 0 and g["flagged"] > 0, g
    assert g["judged"] > 0 and g["judge_errors"] == 0, g  # the judge model answered every flagged call
    assert g["judge_blocked"] <= g["judged"] and g["blocked"] >= g["judge_blocked"], g
    assert report["summary"]["student_mean"] is not None
    # the Prefect UI's progress artifact of each specialist (updated at most every 5 s) ends at 100 %
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    keys = [f"specialist-{d.replace('_', '-')}" for d in report["domains"]]
    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    newest = {a.key: a for a in sorted(arts, key=lambda a: a.created)}
    assert {k: (a.type, a.data) for k, a in newest.items()} == {k: ("progress", 100.0) for k in keys}

    # the full rollout record of every trainer: each tool episode's calls with the guard's verdicts (the blocked
    # ones are the episode's blocked_calls), read back with `alloy rollouts` as a user would
    from alloy.rollouts_cmd import load

    recs, prefixes = load(str(tmp_path / "runs"), "train")
    assert {p.rsplit("/", 1)[1].split("-")[0] for p in prefixes} == {"specialist", "student"}
    assert set(recs.domain) == {"tool_add", "tool_files", "tool_code", "tool_long"} and set(recs.step) == {1, 2}
    for _, r in recs.iterrows():
        calls = list(r.calls) if r.calls is not None else []
        assert len(calls) >= r.tool_calls, (r.sample_id, r.tool_calls, calls)
        if "~" not in r.sample_id and r.stage == "specialist":  # a whole episode: its calls are its own
            assert r.blocked_calls == sum(not c["guard_allowed"] for c in calls), (r.sample_id, calls)
    assert any(len(c["rules"]) for cs in recs.calls if cs is not None for c in cs)  # the rules flagged some calls
    evs, _ = load(str(tmp_path / "runs"), "eval")  # each evaluation's first episodes, the rules' verdicts on calls
    assert set(evs[evs.stage == "specialist"].domain) == set(report["domains"])
    for _, r in evs.iterrows():
        calls = list(r.calls) if r.calls is not None else []
        assert r.blocked_calls == sum(not c["guard_allowed"] for c in calls) and (r.reward == 0 or not r.blocked_calls)
