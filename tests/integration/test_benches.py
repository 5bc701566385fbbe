"""The three OPD benches and the APRIL bench's demo workload run end to end in their `--quick` mode (real teacher
servers, real TRL trainers, in-process engines) and write the JSON the README tables are made from. The numbers of
a smoke run mean nothing; the shape and the bookkeeping do: step counts, token counts (exactly batch ×
max_new_tokens where lengths are forced, else bounded by it), ratios computed from the reported parts, the
pre-registered targets and their met flags, memory of Alloy's process tree including its server children, and
every JSON's `meta`.

`--check` (issue 35) is exercised on the same runs, each with the exit code it must give: overhead with a planted
miss (`--target 0`: no ratio is ≤ 0) exits 1 and still writes its JSON; teacher_scaling's quick run has no N = 12,
so it cannot judge its target (2); scoring_transport has no target (0: it ran); a small loss_memory run with a
reachable target (`--target 100`) exits 0; async_specialists with a planted miss (`--target 100`: its stage 100×
faster than the reference's, here this very tree run fresh) exits 1. record_cost runs a specialist three times (record
off, default, full) for 6 steps each, without `--check` (its ratio on a loaded CI machine judges nothing).

They run at once (separate processes): on 2 cores their start-ups (imports, server launches) overlap.
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
           "april_demo": "april", "scoring_transport": "scoring_transport",
           "loss_memory": "loss_memory", "async_specialists": "async_specialists",
           "record_cost": "record_cost"}  # name → bench/<script>.py
EXTRA = {"april_demo": ["--workload", "demo"], "overhead": ["--check", "--target", "0"],
         "teacher_scaling": ["--check"], "scoring_transport": ["--check"],
         "loss_memory": ["--variants", "topk_kl", "--vocab", "4096", "--check", "--target", "100"],
         "async_specialists": ["--reference-tree", str(REPO), "--check", "--target", "100"],
         "record_cost": ["--steps", "6"]}
# --check's exit code where it is not 0 (see the module docstring)
RC = {"overhead": 1, "teacher_scaling": 2, "async_specialists": 1}


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
        assert rc == RC.get(b, 0), f"bench {b} exited {rc}:\n" + (out / f"{b}.log").read_text()[-4000:]
    print(f"four quick benches: {time.perf_counter() - t0:.1f} s")
    return {b: json.loads((out / f"{b}.json").read_text()) for b in BENCHES} | {"dir": out}


def meta_shape(m: dict, script: str) -> None:
    """`meta` as harness.start_meta/end_meta record it (the fields themselves: tests/unit/test_bench_harness.py)."""
    assert len(m["commit"]) == 40 and isinstance(m["dirty"], bool) and m["cpu_count"] >= 1 and m["cores"]
    assert len(m["loadavg_start"]) == len(m["loadavg_end"]) == 3 and m["cpu_model"] and m["python"] and m["torch"]
    assert m["argv"][0].endswith(f"bench/{script}.py") and "--quick" in m["argv"]
    assert m["threads"]["torch_threads"] >= 1 and "OMP_NUM_THREADS" in m["threads"]["env"]


def common_shape(r: dict, name: str) -> None:
    assert r["bench"] == name and r["quick"] is True
    assert r["command"].startswith(f"python bench/{name}.py") and "--quick" in r["command"]
    meta_shape(r["meta"], name)
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
        # CPU per measured step: the trainer's own getrusage + each server's own (student's and the N teachers')
        by = run["cpu_s_per_step_by_process"]
        assert set(by) == {"trainer", "servers", "servers_engine_thread"} and all(v > 0 for v in by.values())
        assert run["cpu_s_per_step"] == pytest.approx(by["trainer"] + by["servers"])
        assert by["servers_engine_thread"] < by["servers"]  # a part of the servers' processes
        assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
    assert len(mixes) == 1
    for row in r["results"]:  # one round in quick mode: min = median = max
        for key, sp in row["spread_over_rounds"].items():
            assert sp["n"] == cfg["rounds"] == 1 and sp["min"] == sp["median"] == sp["max"], key
    assert cfg["cores"] == r["meta"]["cores"]
    # no N = 12 in quick mode: the pre-registered ratio is absent, not faked
    assert r["ratio_12_over_1"] is None and r["target"] == {"ratio_12_over_1_max": 1.25, "ratio_12_over_1": None,
                                                            "met": None}
    assert (results["dir"] / "teacher_scaling.md").read_text().startswith("| teachers |")


def test_overhead_shape(results):
    r = results["overhead"]
    common_shape(r, "overhead")
    pipe, inproc, cfg = r["pipeline"], r["inprocess"], r["config"]
    B, L = cfg["batch"], cfg["max_new_tokens"]
    assert cfg["repeats"] == 1 and cfg["cores"] == r["meta"]["cores"]
    for half in (pipe, inproc):
        assert half["steps"] == cfg["steps"] and len(half["step_s"]) == (cfg["steps"] - cfg["warmup"]) * cfg["repeats"]
        assert len(half["cpu_s_per_step"]) == len(half["repeats"]) == cfg["repeats"]
        assert all(x > 0 for x in half["step_s"] + half["cpu_s_per_step"])
        assert half["cpu_s_per_step_median"] == statistics.median(half["cpu_s_per_step"])
        sp = half["spread_over_repeats"]["cpu_s_per_step"]
        assert sp["min"] <= sp["median"] <= sp["max"] and sp["n"] == cfg["repeats"]
        assert B <= half["sampled_tokens_per_step_median"] <= B * L
    # CPU per step from each process's own accounting: the trainer's getrusage and every server's report
    by = pipe["cpu_s_per_step_by_process"]  # the servers' engine threads: a part of the servers' CPU
    assert set(by) == {"trainer", "servers", "servers_engine_thread"} and all(v > 0 for v in by.values())
    assert by["servers_engine_thread"] < by["servers"]
    assert pipe["cpu_s_per_step"][0] == pytest.approx(by["trainer"] + by["servers"])
    assert set(inproc["parts_s_per_step_median"]) == {"sample_s", "score_s", "train_s", "push_s"}
    assert all(v > 0 for v in inproc["parts_s_per_step_median"].values())
    assert inproc["config"]["teacher_engines"] == len(cfg["domains"])
    assert r["ratio_wall"] == pytest.approx(pipe["step_s_median"] / inproc["step_s_median"], rel=1e-12)
    assert r["ratio_cpu"] == pytest.approx(pipe["cpu_s_per_step_median"] / inproc["cpu_s_per_step_median"], rel=1e-12)
    assert set(pipe["timing_s_per_step"]) >= {"sample_s", "score_s", "train_s", "push_s"}
    # the planted miss (--target 0): every flag false, the JSON written all the same (and the exit code was 1)
    assert r["target"] == {"ratio_wall_max": 0.0, "ratio_cpu_max": 0.0, "met_wall": False, "met_cpu": False,
                           "met": False}
    assert [(x["half"], x["repeat"]) for x in r["loadavg"]] == [("pipeline", 0), ("inprocess", 0)]


def test_trl_compare_shape(results):
    r = results["trl_compare"]
    common_shape(r, "trl_compare")
    cfg = r["config"]
    doms = cfg["domains"]
    assert len(doms) == 2 and cfg["seeds"] == [0] and cfg["force"] is True and cfg["top_k"] == "vocab"
    by = {x["system"]: x for x in r["runs"]}
    assert set(by) == {"alloy", "gkd", "alloy_1dom", "trl_distill", "alloy_s0", "alloy_1dom_s0"}
    V = by["alloy"]["top_k"]
    assert V == by["alloy_1dom"]["top_k"] and V > 16  # top-k = the vocabulary: the exact reverse KL
    for s, run in by.items():
        want = doms[:1] if s in ("alloy_1dom", "trl_distill", "alloy_1dom_s0") else doms
        assert run["domains"] == want and set(run["accuracy"]) == set(run["heldout_rkl"]) == set(want)
        assert all(0.0 <= v <= 1.0 for v in run["accuracy"].values())
        assert all(math.isfinite(v) and v >= -1e-6 for v in run["heldout_rkl"].values())  # a KL is ≥ 0
        # same number of optimizer steps everywhere; forced lengths: every response is exactly max_new_tokens
        assert run["steps"] == cfg["steps"], (s, run["steps"])
        assert run["completion_tokens"] == cfg["steps"] * cfg["batch"] * cfg["max_new_tokens"], s
        assert run["completion_tokens_per_s"] == pytest.approx(run["completion_tokens"] / run["train_wall_s"])
        assert run["s_per_step"] == pytest.approx(run["train_wall_s"] / cfg["steps"])
        assert 0 < run["peak_pss_mb"] <= run["peak_rss_mb"]
        # CPU of the loop's steps 2..N, every process of the system (Alloy: trainer, rollout server, teachers)
        assert run["train_cpu_s"] > 0 and run["cpu_tokens"] == (cfg["steps"] - 1) * cfg["batch"] * cfg["max_new_tokens"]
        assert run["cpu_s_per_completion_token"] == pytest.approx(run["train_cpu_s"] / run["cpu_tokens"])
        if s in ("gkd", "trl_distill"):  # TRL's phases, as Alloy reports its own: they add up to the loop's wall
            t = run["timing_s"]
            assert t["sample_s"] > 0 and t["score_s"] > 0 and t["train_s"] > 0, t
            assert t["sample_s"] + t["score_s"] + t["train_s"] == pytest.approx(run["train_wall_s"])
        else:
            assert run["max_staleness"] == (0 if s.endswith("_s0") else 1)
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
    assert h["accuracy_base"] == pytest.approx(statistics.fmean(r["init"]["accuracy"].values()))
    s0 = h["staleness0"]  # the same comparison with Alloy fully on-policy
    assert s0["speedup_vs_gkd"] == pytest.approx(
        by["alloy_s0"]["completion_tokens_per_s"] / by["gkd"]["completion_tokens_per_s"])
    assert s0["speedup_vs_distillation"] == pytest.approx(
        by["alloy_1dom_s0"]["completion_tokens_per_s"] / by["trl_distill"]["completion_tokens_per_s"])
    assert s0["accuracy_alloy"] == pytest.approx(statistics.fmean(by["alloy_s0"]["accuracy"].values()))
    assert s0["accuracy_gkd"] == h["accuracy_gkd"] and s0["accuracy_base"] == h["accuracy_base"]
    assert s0["met"]["all"] == all(v for k, v in s0["met"].items() if k != "all")
    assert h["point"]["forced_length"] is True and h["point"]["alloy_top_k"] == V
    assert set(r["init"]["accuracy"]) == set(r["teacher_accuracy"]) == set(doms)
    # one thread count offered (quick): no calibration runs; the full run offers 1 and 2
    assert r["thread_trials"] == [] and cfg["trl_threads"] == [2] and h["trl_threads"] == {"gkd": 2, "trl_distill": 2}


def test_loss_memory_check(results):
    """A reachable target (`--target 100`) with `--check`: met, exit 0 (the fixture checked the code)."""
    r = results["loss_memory"]
    assert r["bench"] == "loss_memory" and r["target"] == 100 and r["target_met"] is True
    assert r["max_new_over_logits"] <= 100 and {x["impl"] for x in r["runs"]} == {"old", "new"}
    assert len(r["meta"]["commit"]) == 40 and len(r["meta"]["loadavg_end"]) == 3


def test_async_specialists_shape(results):
    """Three stages from one base (the reference tree's, this tree's synchronous and asynchronous), each specialist
    scored on its `final/` by the same evaluation; the ratios are those of the reported walls; the planted miss
    (`--target 100`) is judged, not skipped."""
    r = results["async_specialists"]
    common_shape(r, "async_specialists")
    assert set(r["runs"]) == {"reference", "sync", "async"} and r["stage_mode"] == "sync"
    assert r["reference"]["tree"] == str(REPO) and r["reference"]["commit"] == r["meta"]["commit"]
    for mode, runs in r["runs"].items():
        (run,) = runs
        assert set(run["scores"]) == set(r["domains"]) == set(run["own_scores"]) and len(r["domains"]) == 2
        for d, score in run["scores"].items():  # this tree's eval of `final/` is the specialist's own eval
            assert 0 <= score <= 1 and score == pytest.approx(run["own_scores"][d], abs=1e-9)
        assert run["steps"] == 8 * 2 and run["wall_s"] > 0 and run["cpu_s"] > 0
        assert run["lifted"] == sum(run["scores"][d] >= r["base_scores"][d] + 0.15 for d in r["domains"])
    walls = {m: v[0]["wall_s"] for m, v in r["runs"].items()}
    assert r["speedup_vs_reference"] == pytest.approx(walls["reference"] / walls["sync"], rel=1e-2)
    assert r["async_vs_sync"] == pytest.approx(walls["sync"] / walls["async"], rel=1e-2)
    assert r["met"] is False and r["target"]["speedup"] == 100
    assert r["runs"]["async"][0]["lag_mean"] > 0 and r["runs"]["sync"][0]["lag_mean"] == 0


def test_april_demo_workload(results):
    r = results["april_demo"]
    assert r["bench"] == "april" and r["quick"] is True and "summary" not in r  # the demo workload alone
    meta_shape(r["meta"], "april")
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


def test_record_cost_shape(results):
    """Three runs of one specialist (record off, the default sample, the full record): the files each wrote, and the
    cost computed from the recorder's own seconds over the same run's step seconds."""
    r = results["record_cost"]
    runs = r["runs"]
    assert [runs[m]["steps"] for m in ("off", "default", "full")] == [6, 6, 6]
    assert [runs[m]["records"]["files"] for m in ("off", "default", "full")] == [0, 1, 6]  # default: the last step
    assert runs["off"]["records"]["evals"]["files"] == 0 < runs["default"]["records"]["evals"]["files"]
    assert runs["off"]["records"]["bytes"] == 0 < runs["default"]["records"]["bytes"] < runs["full"]["records"]["bytes"]
    for m in ("default", "full"):
        assert runs[m]["cost"] == pytest.approx(runs[m]["records"]["seconds"] / runs[m]["step_s_sum"], rel=1e-3)
    assert r["target"]["full_max"] == 0.05 and r["target"]["default_max"] == 0.01
    assert r["target"]["met"] == (r["target"]["met_full"] and r["target"]["met_default"])
    meta_shape(r["meta"], "record_cost")
    assert r["config"]["steps"] == 6
