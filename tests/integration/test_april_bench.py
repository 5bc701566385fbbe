"""`bench/april.py --quick` end to end: a real engine server on loopback, the real `rollout_step` in three arms
(sync = over_sampling 1, april = 2× with no drops, april_s2 = 2× with max_staleness 2), and the JSON it writes.

A smoke run's wall-clock numbers are noise on a shared 2-core box, so the checks are on the bookkeeping, which is
exact: B finished samples per step at least, the synchronous arm never aborts or resumes, every token it decoded
is in a finished sample, APRIL submits ⌈2B⌉ requests per step and resumes partials, staleness within the bound,
rates recomputed from the raw counts — and the structural effect APRIL exists for: it keeps more rows in each
decode forward, so it needs fewer engine forwards per finished sample than waiting for the whole batch.
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
B, STEPS, TAIL_HI = 8, 6, 128  # what --quick sets


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("april") / "april.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "april.py"), "--quick", "--out", str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"april --quick: {time.perf_counter() - t0:.1f} s")
    return json.loads(out.read_text()) | {"_md": out.with_suffix(".md").read_text()}


def test_shape(result):
    r = result
    assert r["bench"] == "april" and r["quick"] is True and r["command"] == f"python bench/april.py --quick --out " \
        + r["config"]["out"]
    assert r["meta"]["cpu_count"] >= 1 and len(r["loadavg"]["before"]) == 3
    assert r["config"]["batches"] == [B] and r["config"]["steps"] == STEPS
    assert set(r["summary"]) == {str(B)} and list(r["summary"][str(B)]) == ["sync", "april", "april_s2"]
    t = r["target"]
    assert t["goal"] == 1.5 and set(t["value_by_batch"]) == {str(B)}
    assert t["met"] == (t["value_by_batch"][str(B)] >= 1.5) and t["april_over_sampling"] == 2.0
    assert t["value_by_arm"] == {"april": t["value_by_batch"]}
    assert t["value_by_batch"][str(B)] == pytest.approx(r["summary"][str(B)]["april"]["ratio_to_sync"], abs=1e-3)
    assert r["table_md"].startswith("| B | arm |") and r["table_md"].count("\n") == 4  # header, rule, 3 arms
    assert r["_md"].strip() == r["table_md"]
    wl = r["workload"]["natural_length_first_2000"]
    assert 8 <= wl["min"] and wl["max"] <= TAIL_HI and 0.05 < r["workload"]["tail_fraction_first_2000"] < 0.15


def test_runs_bookkeeping(result):
    runs = {x["arm"]: x for x in result["runs"]}
    assert len(result["runs"]) == 3
    for arm, x in runs.items():
        assert x["measured_steps"] == STEPS and len(x["steps"]) == STEPS + result["config"]["warmup"]
        # a step returns once B samples finished: an abort never reaches the next step's requests (the engine
        # applies it only to requests submitted before it), so there is no short step
        assert x["short_steps"] == 0 and all(s["finished"] >= B for s in x["steps"])
        assert x["finished_capped"] == B * STEPS
        assert x["samples_per_s"] == pytest.approx(x["finished"] / x["wall_s"], rel=1e-4)
        assert x["wall_s"] == pytest.approx(sum(s["wall_s"] for s in x["steps"][-STEPS:]), abs=1e-5)
        assert x["finished_length"]["n"] == x["finished"] and x["finished_length"]["max"] <= TAIL_HI
        assert sum(x["staleness"]["versions_behind"].values()) == x["finished"]
        assert x["engine"]["decode_steps"] > 0 and x["engine"]["rows_per_decode_step"] >= 1
    sync = runs["sync"]
    # the synchronous rollout: B requests, all awaited, nothing aborted, resumed, buffered or stale
    assert all(s["requests"] == B and s["resumed"] == 0 and s["partials"] == 0 and s["buffer"] == 0
               for s in sync["steps"])
    assert sync["finished"] == B * STEPS and sync["short_steps"] == 0 and sync["staleness"]["max"] == 0
    assert all(s["engine_tokens"] == s["finished_tokens"] for s in sync["steps"])  # no decoded token is left over
    april = runs["april"]
    assert all(s["requests"] == math.ceil(2.0 * B) for s in april["steps"])
    assert april["resumed"] > 0 and april["dropped_stale"] == 0 and april["staleness"]["max"] <= 64
    assert april["staleness"]["resumed_samples"] > 0 and 0 < april["staleness"]["offpolicy_token_frac"] < 1
    # resumed partials first: a step resumes min(buffer before it, 2B) partials
    for prev, cur in zip(april["steps"], april["steps"][1:]):
        assert cur["resumed"] == min(prev["buffer"] - cur["dropped_stale"], 2 * B)
    s2 = runs["april_s2"]
    assert s2["max_staleness"] == 2 and s2["staleness"]["max"] <= 2


def test_april_needs_fewer_engine_forwards_per_sample(result):
    """Waiting for the slowest of B leaves the tail decoding alone; APRIL keeps the batch full. Per finished
    sample, it needs fewer decode forwards (a property of the schedule, not of the machine's load)."""
    runs = {x["arm"]: x for x in result["runs"]}
    per_sample = {a: runs[a]["engine"]["decode_steps"] / runs[a]["finished"] for a in ("sync", "april")}
    assert per_sample["april"] < per_sample["sync"], per_sample
    assert runs["april"]["engine"]["rows_per_decode_step"] > runs["sync"]["engine"]["rows_per_decode_step"]
