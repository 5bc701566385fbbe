"""The three OPD benches and the APRIL bench's demo workload run end to end in their `--quick` mode (real teacher
servers, real TRL trainers, in-process engines) and write the JSON the README tables are made from. The numbers of
a smoke run mean nothing; the shape and the bookkeeping do: step counts, token counts (exactly batch ×
max_new_tokens where lengths are forced, else bounded by it), ratios computed from the reported parts, the
pre-registered targets and their met flags, memory of Alloy's process tree including its server children.

The four run at once (separate processes): on 2 cores their start-ups (imports, server launches) overlap.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCHES = {"teacher_scaling": "teacher_scaling", "overhead": "overhead", "trl_compare": "trl_compare",
           "april_demo": "april", "scoring_transport": "scoring_transport"}  # name → bench/<script>.py
EXTRA = {"april_demo": ["--workload", "demo"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("benches")
    procs = {}
    for b, script in BENCHES.items():
        log = open(out / f"{b}.log", "w")
        procs[b] = (subprocess.Popen([sys.executable, str(REPO / "bench" / f"{script}.py"), "--quick", "--out",
                                      str(out / f"{b}.json")] + EXTRA.get(b, []), cwd=str(REPO), stdout=log,
                                     stderr=subprocess.STDOUT), log)
    t0 = time.perf_counter()
    for b, (proc, log) in procs.items():
        rc = proc.wait(timeout=900)
        log.close()
        assert rc == 0, f"bench {b} failed:\n" + (out / f"{b}.log").read_text()[-4000:]
    print(f"four quick benches: {time.perf_counter() - t0:.1f} s")
    return {b: json.loads((out / f"{b}.json").read_text()) for b in BENCHES} | {"dir": out}


def common_shape(r: dict, name: str) -> None:
    assert r["bench"] == name and r["quick"] is True
    assert r["command"].startswith(f"python bench/{name}.py") and "--quick" in r["command"]
    assert r["machine"]["cpus"] >= 1 and len(r["machine"]["loadavg"]) == 3
    assert ("\n" + r["table_md"]).count("\n|") >= 3  # a markdown table (header, rule, rows), maybe after a summary
    assert r["total_s"] > 0


def test_teacher_scaling_shape(results):
    r = results["teacher_scaling"]
    common_shape(r, "teacher_scaling")
    cfg = r["config"]
    assert cfg["teachers"] == [1, 2] and cfg["servers_launched"] == 2 and cfg["mix"] == 2
    rows = {x["n_teachers"]: x for x in r["results"]}
    assert set(rows) == {1, 2}
    assert rows[1]["ratio_to_1"] == 1.0 and rows[1]["ratio_per_token_to_1"] == 1.0
    assert rows[2]["ratio_to_1"] == pytest.approx(rows[2]["step_s_median"] / rows[1]["step_s_median"], rel=1e-12)
    mixes = set()
    for run in r["runs"]:
        n = run["n_teachers"]
        # the same mix at every N, routed domain i → server i mod N: N distinct servers
        assert len(run["domains"]) == cfg["mix"] == len(set(run["domains"])) and list(run["routing"]) == run["domains"]
        assert len(set(run["routing"].values())) == n
        mixes.add(tuple(run["domains"]))
        assert run["steps"] == cfg["steps"] and len(run["step_s"]) == cfg["steps"] - cfg["warmup"]
        assert all(s > 0 for s in run["step_s"]) and run["dropped"] == 0
        # every step samples one response per prompt: between 1 and max_new_tokens tokens each
        assert all(cfg["batch"] <= t <= cfg["batch"] * cfg["max_new_tokens"] for t in run["sampled_tokens"])
        assert run["idle_servers"] == cfg["servers_launched"] - n and run["idle_servers_cpu_s"] >= 0
        assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
    assert len(mixes) == 1
    # no N = 12 in quick mode: the pre-registered ratio is absent, not faked
    assert r["ratio_12_over_1"] is None and r["target"] == {"ratio_12_over_1_max": 1.25, "ratio_12_over_1": None,
                                                            "met": None}
    assert (results["dir"] / "teacher_scaling.md").read_text().startswith("| teachers |")


def test_overhead_shape(results):
    r = results["overhead"]
    common_shape(r, "overhead")
    pipe, inproc, cfg = r["pipeline"], r["inprocess"], r["config"]
    B, L = cfg["batch"], cfg["max_new_tokens"]
    for half in (pipe, inproc):
        assert half["steps"] == cfg["steps"] and len(half["step_s"]) == len(half["cpu_s_per_step"]) \
            == cfg["steps"] - cfg["warmup"]
        assert all(x > 0 for x in half["step_s"] + half["cpu_s_per_step"])
        assert B <= half["sampled_tokens_per_step_median"] <= B * L
    assert set(inproc["parts_s_per_step_median"]) == {"sample_s", "score_s", "train_s", "push_s"}
    assert all(v > 0 for v in inproc["parts_s_per_step_median"].values())
    assert inproc["config"]["teacher_engines"] == len(cfg["domains"])
    assert r["ratio_wall"] == pytest.approx(pipe["step_s_median"] / inproc["step_s_median"], rel=1e-12)
    assert r["ratio_cpu"] == pytest.approx(pipe["cpu_s_per_step_median"] / inproc["cpu_s_per_step_median"], rel=1e-12)
    assert set(pipe["timing_s_per_step"]) >= {"sample_s", "score_s", "train_s", "push_s"}
    assert r["target"] == {"ratio_wall_max": 1.3, "ratio_cpu_max": 1.3, "met_wall": r["ratio_wall"] <= 1.3,
                           "met_cpu": r["ratio_cpu"] <= 1.3, "met": r["ratio_wall"] <= 1.3 and r["ratio_cpu"] <= 1.3}
    assert set(r["loadavg"]) == {"before_pipeline", "after_pipeline", "after_inprocess"}


def test_trl_compare_shape(results):
    r = results["trl_compare"]
    common_shape(r, "trl_compare")
    cfg = r["config"]
    doms = cfg["domains"]
    assert len(doms) == 2 and cfg["seeds"] == [0] and cfg["force"] is True and cfg["top_k"] == "vocab"
    by = {x["system"]: x for x in r["runs"]}
    assert set(by) == {"alloy", "gkd", "alloy_1dom", "trl_distill"}
    V = by["alloy"]["top_k"]
    assert V == by["alloy_1dom"]["top_k"] and V > 16  # top-k = the vocabulary: the exact reverse KL
    for s, run in by.items():
        want = doms[:1] if s in ("alloy_1dom", "trl_distill") else doms
        assert run["domains"] == want and set(run["accuracy"]) == set(run["heldout_rkl"]) == set(want)
        assert all(0.0 <= v <= 1.0 for v in run["accuracy"].values())
        assert all(math.isfinite(v) and v >= -1e-6 for v in run["heldout_rkl"].values())  # a KL is ≥ 0
        # same number of optimizer steps everywhere; forced lengths: every response is exactly max_new_tokens
        assert run["steps"] == cfg["steps"], (s, run["steps"])
        assert run["completion_tokens"] == cfg["steps"] * cfg["batch"] * cfg["max_new_tokens"], s
        assert run["completion_tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["train_wall_s"])
        assert run["s_per_step"] == pytest.approx(run["train_wall_s"] / cfg["steps"])
        assert 0 < run["peak_pss_mb"] <= run["peak_rss_mb"]
        assert run["threads"] == (2 if s in ("gkd", "trl_distill") else 1)
    # Alloy's tree holds its student server and one teacher server per domain: its memory must count them
    assert by["alloy"]["peak_rss_mb"] > by["gkd"]["peak_rss_mb"]
    agg, h = r["aggregate"], r["headline"]
    assert agg["gkd"]["completion_tokens_per_s"]["mean"] == pytest.approx(by["gkd"]["completion_tokens_per_s"])
    assert h["speedup_vs_gkd"] == pytest.approx(
        by["alloy"]["completion_tokens_per_s"] / by["gkd"]["completion_tokens_per_s"])
    assert h["speedup_vs_distillation"] == pytest.approx(
        by["alloy_1dom"]["completion_tokens_per_s"] / by["trl_distill"]["completion_tokens_per_s"])
    for key, system in (("accuracy_alloy", "alloy"), ("accuracy_gkd", "gkd"), ("accuracy_distillation", "trl_distill")):
        assert h[key] == pytest.approx(statistics.fmean(by[system]["accuracy"].values()))
    assert h["targets"]["speedup_min"] == 1.5 and h["targets"]["accuracy_tolerance"] == 0.02
    assert h["met"]["speedup_vs_gkd"] == (h["speedup_vs_gkd"] >= 1.5)
    assert h["met"]["accuracy_vs_gkd"] == (h["accuracy_alloy"] >= h["accuracy_gkd"] - 0.02)
    assert h["met"]["all"] == all(v for k, v in h["met"].items() if k != "all")
    assert h["point"]["forced_length"] is True and h["point"]["alloy_top_k"] == V
    assert set(r["init"]["accuracy"]) == set(r["teacher_accuracy"]) == set(doms)
    # one thread count offered (quick): no calibration runs; the full run offers 1 and 2
    assert r["thread_trials"] == [] and cfg["trl_threads"] == [2] and h["trl_threads"] == {"gkd": 2, "trl_distill": 2}


def test_april_demo_workload(results):
    r = results["april_demo"]
    assert r["bench"] == "april" and r["quick"] is True and "summary" not in r  # the demo workload alone
    d = r["demo"]
    B, S = d["batch"], r["config"]["demo_steps"]
    assert d["max_new_tokens"] == 16 and len(d["domains"]) == 2 and d["domains"][0]["name"] == "max_list"
    assert [a["arm"] for a in d["arms"]] == ["sync", "april"] and set(d["summary"]) == {"sync", "april"}
    assert {a["arm"]: a["requests_per_step"] for a in d["arms"]} == {"sync": B, "april": max(math.ceil(1.25 * B),
                                                                                          B + 4)}
    assert d["ratio_to_sync"]["sync"] == 1.0 and d["best_arm"] in d["summary"]
    assert len(d["runs"]) == 2 * len(d["domains"])  # every domain, every arm, one repeat
    for run in d["runs"]:
        assert run["measured_steps"] == S and run["finished_capped"] == B * S and run["short_steps"] == 0
        assert 1 <= run["finished_length"]["min"] and run["finished_length"]["max"] <= 16
    for arm, s in d["summary"].items():
        rs = [x for x in d["runs"] if x["arm"] == arm]
        assert s["samples_per_s"] == pytest.approx(sum(x["finished"] for x in rs) / sum(x["wall_s"] for x in rs),
                                                   rel=1e-3)
    assert r["table_md"].startswith("Demo workload")


def test_scoring_transport_shape(results):
    """The three transports hand the trainer identical arrays (the bench asserts it before timing) and each
    per-pair figure is its median seconds over its pair count."""
    r = results["scoring_transport"]
    common_shape(r, "scoring_transport")
    assert set(r["points"]) == {"tiny", "realistic"} and set(r["us_per_pair"]) == {"tiny", "realistic"}
    for name, p in r["points"].items():
        cfg = p["config"]
        assert cfg["pairs"] == cfg["samples"] * cfg["response_len"] * (cfg["top_k"] + 1)
        for v in ("json_items", "json_vectorised", "binary"):
            e = p["e2e"][v]
            assert len(e["runs"]) == r["repeats"] and all(x["wall_s"] > 0 for x in e["runs"])
            assert e["us_per_pair"] == pytest.approx(e["wall_s_median"] / cfg["pairs"] * 1e6)
            assert r["us_per_pair"][name][f"e2e_{v}"] == pytest.approx(e["us_per_pair"], abs=1e-4)
        pr = p["parse"]
        assert pr["pairs"] == pr["batch_sequences"] * cfg["response_len"] * (cfg["top_k"] + 1)
        assert pr["body_bytes"]["binary"] < pr["body_bytes"]["json"]
