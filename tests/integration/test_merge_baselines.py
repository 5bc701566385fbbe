"""`bench/merge_baselines.py --quick` end to end, one seed (real specialist PPO, real OPD with teacher servers, real
offline SFT, mixed and sequential RL): the numbers of a smoke run mean nothing, the bookkeeping does — every arm
consumed the same number of sampled completions, per-domain scores are in [0, 1], forgetting and the target flags
follow from the recorded scores.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ARMS = ("opd", "offline", "mixed_rl", "sequential_rl")


BENCH = [sys.executable, str(REPO / "bench/merge_baselines.py")]


def derived_seed(seed0: dict, seed: int) -> dict:
    """Seed 0's per-seed file as another seed's: every score in its aggregate halved. Scaling by a positive constant
    keeps the file consistent (means, forgetting, gains and max(0, ·) drops scale with it), so the summary over
    both has a real spread to put an interval on. A second trained seed would run the same code as seed 0 for ~40 s
    more and test nothing the summary's arithmetic does not."""
    def half(x):
        if isinstance(x, bool) or not isinstance(x, (int, float, dict, list)):
            return x
        return {k: half(v) for k, v in x.items()} if isinstance(x, dict) else (
            [half(v) for v in x] if isinstance(x, list) else x / 2)

    agg = {arm: {k: (v if k == "compute" else half(v)) for k, v in a.items()} for arm, a in seed0["aggregate"].items()}
    return {**seed0, "aggregate": agg, "config": {**seed0["config"], "seed": seed},
            "command": seed0["command"].replace("--seeds 0", f"--seeds {seed}")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Seed 0 of --quick trained for real (its base and specialists kept for the lever test); seed 1's file derived
    from it (derived_seed); then an invocation over both seeds in a third folder: it must reuse the two per-seed
    files (no training) and write the summary, the chart and the MLflow run."""
    tmp = tmp_path_factory.mktemp("merge")
    proc = subprocess.run(BENCH + ["--quick", "--seeds", "0", "--no-mlflow", "--out", str(tmp / "s0" / "m.json"),
                                   "--keep", str(tmp / "keep")], cwd=str(REPO), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (tmp / "all").mkdir()
    seed0 = json.loads((tmp / "s0" / "m_seed0.json").read_text())
    shutil.copy(tmp / "s0" / "m_seed0.json", tmp / "all" / "m_seed0.json")
    (tmp / "all" / "m_seed1.json").write_text(json.dumps(derived_seed(seed0, 1)))
    proc = subprocess.run(BENCH + ["--quick", "--seeds", "0,1", "--out", str(tmp / "all" / "m.json"),
                                   "--mlflow-root", str(tmp / "mlruns")],
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "seed 0: reusing" in proc.stderr and "seed 1: reusing" in proc.stderr and "running" not in proc.stderr
    return tmp


@pytest.fixture(scope="module")
def result(runs):
    out = runs / "s0" / "m_seed0.json"
    assert out.with_suffix(".md").read_text().strip() == json.loads(out.read_text())["table_md"].strip()
    return json.loads(out.read_text())


def test_shape_and_equal_compute(result):
    assert result["bench"] == "merge_baselines" and result["quick"] is True and "--quick" in result["command"]
    assert result["command"].endswith("--seeds 0") and result["config"]["seed"] == 0
    assert result["meta"]["cpu_count"] >= 1 and result["total_s"] > 0
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


def test_multi_seed_summary_intervals_chart_and_mlflow(runs):
    """The summary file's contract: n_seeds, n_domains, one summary object per arm with mean and its 95% interval
    recomputed from the two per-seed files, forgetting, the chart beside it and in the MLflow run."""
    from mlflow import MlflowClient

    sys.path.insert(0, str(REPO / "bench"))
    from merge_stats import t975

    res = json.loads((runs / "all" / "m.json").read_text())
    seeds = [json.loads((runs / "all" / f"m_seed{s}.json").read_text()) for s in (0, 1)]
    assert res["n_seeds"] == 2 and res["seeds"] == [0, 1] and res["n_domains"] == 2
    per_seed_name = {"opd": "opd", "offline_kd": "offline", "mixed_rl": "mixed_rl", "sequential_rl": "sequential_rl"}
    for arm in ("opd", "offline_kd", "mixed_rl", "sequential_rl"):
        a = res["summary"][arm]
        xs = [s["aggregate"][per_seed_name[arm]]["mean_score"] for s in seeds]
        half = t975(1) * statistics.stdev(xs) / 2 ** 0.5
        assert a["mean"] == pytest.approx(statistics.fmean(xs)) and a["per_seed"] == pytest.approx(xs)
        assert a["ci95_low"] == pytest.approx(a["mean"] - half) and a["ci95_high"] == pytest.approx(a["mean"] + half)
        assert a["forgetting"]["mean"] == pytest.approx(
            statistics.fmean(s["aggregate"][per_seed_name[arm]]["forgetting_mean"] for s in seeds))
    t = res["target"]
    assert t["met"] is (t["opd_interval_above_mixed_rl"]["met"] and t["opd_interval_above_offline_kd"]["met"]
                        and t["opd_forgets_less_than_sequential_rl"]["met"])
    assert (runs / "all" / "m.md").read_text().strip() == res["table_md"].strip()
    png = (runs / "all" / "m.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}")
    run = client.get_run(res["mlflow_run_id"])
    assert run.data.metrics["opd.mean"] == pytest.approx(res["summary"]["opd"]["mean"])
    assert run.data.params["n_seeds"] == "2"
    assert {"merge_baselines_chart.png", "merge_baselines.md", "merge_baselines.json"} <= {
        f.path for f in client.list_artifacts(res["mlflow_run_id"])}
    # a changed setting is refused for a reused seed (naming it) rather than pooled
    proc = subprocess.run(BENCH + ["--quick", "--seeds", "0,1", "--no-mlflow", "--out", str(runs / "all" / "m.json"),
                                   "--kl-coef", "0.07"], cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "kl_coef" in proc.stderr and "--fresh" in proc.stderr


def test_lever_reruns_opd_from_the_kept_specialists(runs):
    """merge_levers.py on the models seed 0 kept: OPD again with twice the distill steps; its extra samples beyond the
    equal budget and its paired differences to the main run's arms follow from the files."""
    kept = runs / "keep" / "seed0"
    assert (kept / "base" / "config.json").exists() and json.loads((kept / "runs.json").read_text())["specialists"]
    out = runs / "lever" / "l.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/merge_levers.py"), "--tag", "t", "--quick", "--seeds", "0",
                           "--distill-steps", "4", "--main", str(runs / "s0" / "m.json"), "--models", str(runs / "keep"),
                           "--out", str(out)], cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    main = json.loads((runs / "s0" / "m_seed0.json").read_text())
    seed = json.loads(out.with_name("l_seed0.json").read_text())
    B = main["config"]["equal_compute"]["B"]
    assert seed["run"]["distill"]["updates"] == 4 and seed["extra_samples_vs_budget"] == (4 - 2) * B
    assert seed["opd"]["compute"]["rl_samples"] == main["aggregate"]["opd"]["compute"]["rl_samples"]  # same teachers
    s = json.loads(out.read_text())["summary"]
    for arm in ("opd", "offline", "mixed_rl", "sequential_rl"):
        assert s[f"lever_minus_{arm}"]["mean"] == pytest.approx(
            seed["opd"]["mean_score"] - main["aggregate"][arm]["mean_score"])
    missing = subprocess.run([sys.executable, str(REPO / "bench/merge_levers.py"), "--tag", "t", "--seeds", "1",
                              "--main", str(runs / "s0" / "m.json"), "--models", str(runs / "keep"), "--out", str(out)],
                             cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "seed1" in missing.stderr and "--demo --seeds 1" in missing.stderr
