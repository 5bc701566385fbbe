"""Load: 12 teacher servers (real embedded engine servers under one Supervisor, API key on) scored concurrently for a
bounded time, the way the OPD student scores: `EngineClient.score` batches with top-k, one client per teacher.

Passes when no call fails and every answer is well-formed (`student.scoring.check_scores`); prints and writes the
latency percentiles (p50/p95/p99 per call and over all teachers) and the scored tokens/s to
`$ALLOY_LOAD_OUT` (default: the test's tmp dir). Opt-in (it starts 12 servers: ~5 GB RSS, > 60 s on 2 cores):

    ALLOY_TEST_MANY=1 [ALLOY_LOAD_SECONDS=30] [ALLOY_LOAD_CONCURRENCY=2] \
        .venv/bin/python -m pytest tests/reliability/test_teacher_load.py -s
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.environ.get("ALLOY_TEST_MANY") != "1", reason="opt-in: set ALLOY_TEST_MANY=1")]

N_TEACHERS = 12
BATCH, PROMPT, RESPONSE, TOP_K = 8, 10, 12, 8


async def hammer(client, seconds: float, concurrency: int, seed: int) -> dict:
    """`concurrency` workers score random batches against one teacher until the deadline."""
    from student.scoring import check_scores

    rng = random.Random(seed)
    lat, errors, tokens = [], [], 0
    deadline = time.monotonic() + seconds

    async def worker():
        nonlocal tokens
        while time.monotonic() < deadline:
            seqs = [[1] + [rng.randrange(4, 100) for _ in range(PROMPT + RESPONSE - 1)] for _ in range(BATCH)]
            t0 = time.perf_counter()
            try:
                res = await client.score(seqs, [PROMPT] * BATCH, top_k=TOP_K)
            except Exception as e:  # counted, the test fails on any
                errors.append(f"{type(e).__name__}: {e}")
                continue
            lat.append(time.perf_counter() - t0)
            bad = [p for p in (check_scores(r, RESPONSE, 100) for r in res) if p]
            if bad:
                errors.append(f"malformed answer: {bad[0]}")
            tokens += BATCH * RESPONSE

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"latencies": lat, "errors": errors, "tokens": tokens}


def test_twelve_teachers_under_concurrent_scoring_load(tiny_model_dir, tmp_path):
    from engine.client import run_sync
    from engine.launcher import ServerSpec, Supervisor
    from teachers.registry import TeacherRegistry

    seconds = float(os.environ.get("ALLOY_LOAD_SECONDS", "30"))
    concurrency = int(os.environ.get("ALLOY_LOAD_CONCURRENCY", "2"))
    key = "sk-load-test-key"
    t0 = time.monotonic()
    with Supervisor(tmp_path / "logs", health_timeout=600, install_signal_handlers=False) as sup:
        names = [f"d{i:02d}" for i in range(N_TEACHERS)]
        urls = sup.start([ServerSpec(f"teacher-{d}", tiny_model_dir, api_key=key) for d in names])
        reg = TeacherRegistry({d: urls[f"teacher-{d}"] for d in names}, api_key=key,
                              client_kwargs={"timeout": 120.0, "max_retries": 0})
        up_s = time.monotonic() - t0
        domains = reg.domains()
        assert len(domains) == N_TEACHERS

        async def run_all():
            return await asyncio.gather(*(hammer(reg.client(d), seconds, concurrency, i)
                                          for i, d in enumerate(domains)))

        t1 = time.monotonic()
        results = run_sync(run_all())
        wall = time.monotonic() - t1
        restarts = [s["restarts"] for s in sup.status()]
    per = {d: r for d, r in zip(domains, results)}
    all_lat = np.array([x for r in results for x in r["latencies"]])
    report = {
        "n_teachers": N_TEACHERS, "startup_s": round(up_s, 1), "load_s": round(wall, 1),
        "concurrency_per_teacher": concurrency, "batch": BATCH, "prompt_tokens": PROMPT, "response_tokens": RESPONSE,
        "top_k": TOP_K, "calls": int(all_lat.size), "errors": sum(len(r["errors"]) for r in results),
        "latency_s": {q: round(float(np.percentile(all_lat, int(q[1:]))), 3) for q in ("p50", "p95", "p99")},
        "scored_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
        "per_teacher_p95_s": {d: round(float(np.percentile(r["latencies"], 95)), 3) for d, r in per.items()},
        "cpu_count": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 1),
    }
    out = Path(os.environ.get("ALLOY_LOAD_OUT") or tmp_path / "teacher_load.json")
    out.write_text(json.dumps(report, indent=2))
    print("\nTEACHER-LOAD", json.dumps(report))
    assert restarts == [0] * N_TEACHERS
    assert all(r["errors"] == [] for r in results), {d: r["errors"][:3] for d, r in per.items() if r["errors"]}
    assert all(len(r["latencies"]) >= concurrency for r in results)  # every teacher served every worker
