"""The three OPD benches run end to end in their `--quick` mode (real teacher servers, real TRL trainers) and write
the JSON the README tables are made from. The numbers of a smoke run mean nothing; the shape and the bookkeeping do:
step counts, token counts bounded by batch × max_new_tokens, ratios computed from the reported parts, memory of
Alloy's process tree including its server children.

The three run at once (separate processes): on 2 cores their start-ups (imports, server launches) overlap.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCHES = ("teacher_scaling", "overhead", "trl_compare")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("benches")
    procs = {}
    for b in BENCHES:
        log = open(out / f"{b}.log", "w")
        procs[b] = (subprocess.Popen([sys.executable, str(REPO / "bench" / f"{b}.py"), "--quick", "--out",
                                      str(out / f"{b}.json")], cwd=str(REPO), stdout=log,
                                     stderr=subprocess.STDOUT), log)
    t0 = time.perf_counter()
    for b, (proc, log) in procs.items():
        rc = proc.wait(timeout=900)
        log.close()
        assert rc == 0, f"bench {b} failed:\n" + (out / f"{b}.log").read_text()[-4000:]
    print(f"three quick benches: {time.perf_counter() - t0:.1f} s")
    return {b: json.loads((out / f"{b}.json").read_text()) for b in BENCHES} | {"dir": out}


def common_shape(r: dict, name: str) -> None:
    assert r["bench"] == name and r["quick"] is True
    assert r["command"].startswith(f"python bench/{name}.py") and "--quick" in r["command"]
    assert r["machine"]["cpus"] >= 1 and len(r["machine"]["loadavg"]) == 3
    assert r["table_md"].startswith("|") and r["table_md"].count("\n") >= 2
    assert r["total_s"] > 0


def test_teacher_scaling_shape(results):
    r = results["teacher_scaling"]
    common_shape(r, "teacher_scaling")
    cfg = r["config"]
    assert cfg["teachers"] == [1, 2] and cfg["servers_launched"] == 2
    rows = {x["n_teachers"]: x for x in r["results"]}
    assert set(rows) == {1, 2}
    assert rows[1]["ratio_to_1"] == 1.0 and rows[1]["ratio_per_token_to_1"] == 1.0
    assert rows[2]["ratio_to_1"] == pytest.approx(rows[2]["step_s_median"] / rows[1]["step_s_median"], rel=1e-12)
    for run in r["runs"]:
        n = run["n_teachers"]
        assert len(run["domains"]) == n == len(set(run["domains"]))
        assert run["steps"] == cfg["steps"] and len(run["step_s"]) == cfg["steps"] - cfg["warmup"]
        assert all(s > 0 for s in run["step_s"]) and run["dropped"] == 0
        # every step samples one response per prompt: between 1 and max_new_tokens tokens each
        assert all(cfg["batch"] <= t <= cfg["batch"] * cfg["max_new_tokens"] for t in run["sampled_tokens"])
        assert run["idle_servers"] == cfg["servers_launched"] - n and run["idle_servers_cpu_s"] >= 0
        assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
    assert r["target"]["ratio_12_vs_1_max"] == 1.25 and r["target"]["met"] is None  # no N = 12 in quick mode
    assert (results["dir"] / "teacher_scaling.md").read_text().startswith("| teachers |")


def test_overhead_shape(results):
    r = results["overhead"]
    common_shape(r, "overhead")
    parts, pipe = r["parts"], r["pipeline"]
    for k in ("sample_s", "teacher_forward_s", "student_update_s"):
        assert parts[k] > 0 and len(parts["runs"][k.rsplit("_", 1)[0]]) == r["config"]["repeats"]
    assert parts["sum_s"] == pytest.approx(parts["sample_s"] + parts["teacher_forward_s"] + parts["student_update_s"],
                                           rel=1e-12)
    assert r["overhead_ratio"] == pytest.approx(pipe["step_s_median"] / parts["sum_s"], rel=1e-12)
    B, L = r["config"]["batch"], r["config"]["max_new_tokens"]
    assert B <= parts["sampled_tokens"] <= B * L and B <= pipe["sampled_tokens_per_step_median"] <= B * L
    assert pipe["steps"] == r["config"]["steps"] and len(pipe["step_s"]) == r["config"]["steps"] - r["config"]["warmup"]
    assert set(pipe["timing_s_per_step"]) >= {"sample_s", "score_s", "train_s", "push_s"}
    assert r["target"] == {"overhead_ratio_max": 1.3, "met": r["overhead_ratio"] <= 1.3}
    assert set(r["loadavg"]) == {"before_pipeline", "after_pipeline", "after_parts"}


def test_trl_compare_shape(results):
    r = results["trl_compare"]
    common_shape(r, "trl_compare")
    cfg = r["config"]
    doms = cfg["domains"]
    assert len(doms) == 2 and cfg["seeds"] == [0]
    by = {x["system"]: x for x in r["runs"]}
    assert set(by) == {"alloy", "gkd", "alloy_1dom", "trl_distill"}
    for s, run in by.items():
        want = doms[:1] if s in ("alloy_1dom", "trl_distill") else doms
        assert run["domains"] == want and set(run["accuracy"]) == set(run["heldout_rkl"]) == set(want)
        assert all(0.0 <= v <= 1.0 for v in run["accuracy"].values())
        assert all(math.isfinite(v) and v >= -1e-6 for v in run["heldout_rkl"].values())  # a KL is ≥ 0
        # same number of optimizer steps everywhere; each sample has 1..max_new_tokens completion tokens
        assert run["steps"] == cfg["steps"], (s, run["steps"])
        samples = cfg["steps"] * cfg["batch"]
        assert samples <= run["completion_tokens"] <= samples * cfg["max_new_tokens"]
        assert run["completion_tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["train_wall_s"])
        assert run["s_per_step"] == pytest.approx(run["train_wall_s"] / cfg["steps"])
        assert 0 < run["peak_pss_mb"] <= run["peak_rss_mb"]
    # Alloy's tree holds its student server and one teacher server per domain: its memory must count them
    assert by["alloy"]["peak_rss_mb"] > by["gkd"]["peak_rss_mb"]
    agg = r["aggregate"]
    assert agg["gkd"]["completion_tokens_per_s"]["mean"] == pytest.approx(by["gkd"]["completion_tokens_per_s"])
    assert r["ratios"]["alloy_vs_gkd_tokens_per_s"] == pytest.approx(
        by["alloy"]["completion_tokens_per_s"] / by["gkd"]["completion_tokens_per_s"])
    assert set(r["init"]["accuracy"]) == set(doms)
