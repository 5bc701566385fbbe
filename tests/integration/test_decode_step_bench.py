"""bench/decode_step.py runs both decode paths on a tiny model and judges its target: the static step issues no op
that syncs a GPU and the same kernel ops at 16 rows as at 1; the segment step's one sync (does any row sample?) is
reported, not judged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_decode_step_bench_runs_both_paths_and_checks(tmp_path):
    out = tmp_path / "decode_step.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "decode_step.py"), "--preset", "tiny", "--rows", "1,16",
                        "--new-tokens", "8", "--out", str(out), "--check"], cwd=str(REPO), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"segments/1", "segments/16", "static/1", "static/16"}
    for key, run in res["runs"].items():
        assert run["steps"] >= 7 and run["ms_per_step"] > 0 and run["cpu_ms_per_step"] > 0, key
    assert res["runs"]["static/16"]["sync_ops_per_step"] == 0
    assert res["runs"]["static/16"]["kernel_ops_per_step"] == res["runs"]["static/1"]["kernel_ops_per_step"]
    assert res["runs"]["segments/16"]["sync_ops"] == {"is_nonzero": 1}
    assert res["target"]["met"] is True and res["meta"]["cpu_model"]
    assert out.with_suffix(".md").read_text().startswith("| path |")


def test_decode_step_check_exits_1_on_a_miss(tmp_path):
    """Judged on the segment path (its step reads back whether any row samples), the target is missed: exit 1,
    and the JSON says so."""
    out = tmp_path / "miss.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "decode_step.py"), "--preset", "tiny", "--rows", "1,4",
                        "--new-tokens", "4", "--paths", "segments", "--judge-path", "segments", "--out", str(out),
                        "--check"], cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert json.loads(out.read_text())["target"]["met"] is False
