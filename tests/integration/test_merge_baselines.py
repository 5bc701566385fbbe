"""`bench/merge_baselines.py --quick` end to end (real specialist PPO, real OPD with teacher servers, real offline
SFT, mixed and sequential RL): the numbers of a smoke run mean nothing, the bookkeeping does — every arm consumed
the same number of sampled completions, per-domain scores are in [0, 1], forgetting and the target flags follow
from the recorded scores.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ARMS = ("opd", "offline", "mixed_rl", "sequential_rl")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("merge") / "merge.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/merge_baselines.py"), "--quick", "--out", str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out.with_suffix(".md").read_text().strip() == json.loads(out.read_text())["table_md"].strip()
    return json.loads(out.read_text())


def test_shape_and_equal_compute(result):
    assert result["bench"] == "merge_baselines" and result["quick"] is True and "--quick" in result["command"]
    assert result["machine"]["cpus"] >= 1 and result["total_s"] > 0
    eq = result["config"]["equal_compute"]
    D, S, Sd, B = eq["D"], eq["S"], eq["Sd"], eq["B"]
    assert eq["budget_C"] == D * S * B + Sd * B and eq["mixed_rl_steps"] * B == eq["budget_C"]
    agg = result["aggregate"]
    for arm in ARMS:  # measured, not planned: each arm's recorded samples add up to the same budget
        c = agg[arm]["compute"]
        assert c["total_samples"] == c["rl_samples"] + c["teacher_samples"] + c["distill_samples"] == eq["budget_C"]
        assert 0 < c["sampled_tokens"] <= c["total_samples"] * result["config"]["max_new_tokens"]
    runs = {r["arm"]: r for r in result["runs"]}
    spec_rl = sum(r["rl_samples"] for a, r in runs.items() if a.startswith("specialist:"))
    assert spec_rl == D * S * B
    assert agg["opd"]["compute"]["rl_samples"] == agg["offline"]["compute"]["rl_samples"] == spec_rl
    assert runs["opd"]["distill"]["updates"] == runs["offline"]["policy_optimizer_steps"] == Sd  # same updates
    assert [s["rl"]["samples"] for s in runs["sequential_rl"]["stages"]] == [eq["budget_C"] // D] * D


def test_scores_forgetting_and_target_recomputed(result):
    agg, names = result["aggregate"], [d["name"] for d in result["config"]["domains"]]
    runs = {r["arm"]: r for r in result["runs"]}
    own_spec = {d: runs[f"specialist:{d}"]["final"][d] for d in names}
    for arm in ARMS:
        a = agg[arm]
        assert set(a["scores"]) == set(names) and all(0.0 <= v <= 1.0 for v in a["scores"].values())
        assert a["scores"] == runs[arm]["final"]
        assert a["mean_score"] == pytest.approx(statistics.fmean(a["scores"].values()), abs=1e-12)
        own = {"opd": own_spec, "offline": own_spec,
               "sequential_rl": {s["domain"]: s["scores"][s["domain"]] for s in runs["sequential_rl"]["stages"]},
               "mixed_rl": {d: max(e["scores"][d] for e in runs["mixed_rl"]["evals"]) for d in names}}[arm]
        assert a["own_point"] == own
        for d in names:
            assert a["forgetting"][d] == pytest.approx(own[d] - a["scores"][d], abs=1e-12)
            assert a["drop_vs_base"][d] == pytest.approx(max(0.0, agg["base"]["scores"][d] - a["scores"][d]))
        assert a["forgetting_mean"] == pytest.approx(statistics.fmean(a["forgetting"].values()), abs=1e-12)
    seq = agg["sequential_rl"]
    assert seq["forgetting"][names[-1]] == 0.0  # the last stage's own point is the end
    assert runs["sequential_rl"]["final"] == runs["sequential_rl"]["stages"][-1]["scores"]
    assert runs["mixed_rl"]["evals"][-1]["scores"] == runs["mixed_rl"]["final"]
    t = result["target"]
    for key, other, better in (("opd_beats_mixed_rl_mean_score", "mixed_rl", "mean_score"),
                               ("opd_beats_offline_mean_score", "offline", "mean_score")):
        assert t[key]["diff"] == pytest.approx(agg["opd"][better] - agg[other][better], abs=1e-12)
        assert t[key]["met"] is (t[key]["diff"] > 0)
    f = t["opd_forgets_less_than_sequential_rl"]
    assert f["diff"] == pytest.approx(seq["forgetting_mean"] - agg["opd"]["forgetting_mean"], abs=1e-12)
    assert f["met"] is (f["diff"] > 0)
    assert t["met"] is all(t[k]["met"] for k in t if k != "met")
