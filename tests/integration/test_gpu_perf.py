"""The prepared GPU session of issue 51 on this CPU machine, on tiny models: bench/gpu_profile.py writes every part's
profile summary; bench/gpu_perf.py writes every part (engine, HF, trainers, pipeline; TRL in its own test), judges
its targets (on the CPU every goal is scaled to 0: the figures must exist) and exits 0 with --check; a planted miss
exits 1 and stays in the JSON as missed; bench/gpu_session.sh runs the engine check and both in one go with no
wheels to install."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def run(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"bench/{script}", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_gpu_profile_on_cpu_summarises_every_part(tmp_path):
    out = tmp_path / "profile.json"
    proc = run("gpu_profile.py", "--device", "cpu", "--steps", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["device"] == "cpu" and r["preset"] == "tiny" and r["meta"]["commit"]
    assert set(r["parts"]) == {"decode_1", "decode_64", "sft", "ppo"}
    for name, p in r["parts"].items():
        assert "error" not in p, (name, p)
        assert p["top_cpu"] and p["top_cuda"] == [] and p["gpu_idle_fraction"] is None
        assert p["launches"]["what"].startswith("proxy on the CPU") and p["launches"]["per_step"] > 0
        assert p["host_syncs"]["per_step"] is not None
    d = r["parts"]["decode_64"]
    assert d["profile_all_threads"], "the engine decodes on its own thread: the profile must see it"
    # 12 tokens: 1 prefill + 11 steps; rows per step: 64, or more where the engine pads to a captured batch size
    assert d["steps"] == 11 and d["engine_counters"]["rows_per_step"] >= 64
    assert d["engine_counters"]["decode_ms_per_step"] > 0 and d["engine_counters"]["engine_cpu_ms_per_step"] > 0
    assert any(t["name"] == "aten::mm" for t in d["top_cpu"])


def test_gpu_perf_on_cpu_writes_every_part_and_meets_its_scaled_targets(tmp_path):
    out = tmp_path / "perf.json"
    proc = run("gpu_perf.py", "--device", "cpu", "--parts", "engine,hf,train,pipeline", "--levels", "1,8",
               "--hf-levels", "1,8", "--check", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    parts = r["parts"]
    assert r["meta"]["commit"] and r["device"] == "cpu" and r["card"] is None
    for name in ("engine", "hf", "train", "pipeline"):
        assert "error" not in parts[name] and "skipped" not in parts[name], (name, parts[name])
    assert parts["trl"] == {"skipped": "not in --parts"}
    tiny = parts["engine"]["presets"]["tiny"]
    for c in ("1", "8"):
        for load in ("equal", "mix"):
            run_ = tiny["levels"][c][load]
            assert run_["tokens_per_s"] > 0 and run_["decode_ms_per_step"] > 0 and run_["engine_cpu_ms_per_step"] > 0
    assert tiny["levels"]["8"]["equal"]["output_tokens"] == 8 * 16  # equal lengths: exactly --new-tokens each
    assert tiny["levels"]["8"]["mix"]["requests"] == 16  # 2 rounds of 8
    assert parts["hf"]["compiled"] is False and parts["hf"]["cache_implementation"] == "static"
    assert set(parts["comparison"]) == {"1", "8"} and parts["comparison"]["8"]["mix"] > 0
    for kind, models in (("sft", 1), ("ppo", 2)):
        t = parts["train"][kind]
        assert t["tokens_per_s"] > 0 and t["models_trained"] == models and t["mfu"] is None  # no peak on a CPU
    assert parts["train"]["tokens_per_step"] == 4 * 64 and parts["train"]["flops_per_token"] > 0
    pipe = parts["pipeline"]
    assert pipe["ok"] and not pipe["timed_out"] and pipe["gpu_busy_fraction"] is None
    assert {"base", "specialists", "distill", "eval"} <= set(pipe["stage_wall_s"])
    targets = r["targets"]
    assert set(targets) == {"engine_single_stream_tok_s", "engine_256_tok_s", "engine_vs_hf_64_mix",
                            "engine_vs_hf_64_equal", "sft_mfu", "alloy_vs_gkd_staleness1", "alloy_vs_gkd_staleness0"}
    assert all(t["goal"] == 0 for t in targets.values())
    assert targets["engine_vs_hf_64_mix"]["value"] == parts["comparison"]["8"]["mix"]
    assert targets["alloy_vs_gkd_staleness1"]["met"] is None  # TRL did not run: not judged
    assert r["met"] is True


def test_gpu_perf_trl_part_on_cpu(tmp_path):
    out = tmp_path / "trl.json"
    proc = run("gpu_perf.py", "--device", "cpu", "--parts", "trl", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trl = json.loads(out.read_text())["parts"]["trl"]
    assert "error" not in trl, trl
    for system in ("alloy", "alloy_s0", "gkd"):
        assert trl["runs"][system]["completion_tokens_per_s"] > 0, trl["runs"][system]
    assert trl["runs"]["alloy"]["max_staleness"] == 1 and trl["runs"]["alloy_s0"]["max_staleness"] == 0
    assert trl["alloy_vs_gkd_staleness1"] > 0 and trl["alloy_vs_gkd_staleness0"] > 0


def test_a_planted_miss_fails_check_and_stays_in_the_json(tmp_path):
    out = tmp_path / "miss.json"
    proc = run("gpu_perf.py", "--device", "cpu", "--parts", "engine", "--levels", "1", "--plant-miss", "--check",
               "--out", str(out))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    t = r["targets"]["engine_single_stream_tok_s"]
    assert t["met"] is False and t["value"] > 0 and t["goal"] == 1e12 and r["met"] is False
    assert "MISSED" in proc.stderr


def test_busy_share_per_stage_window():
    import gpu_perf

    windows = [{"stage": "base", "start": 10.0, "end": 12.0}, {"stage": "eval", "start": 12.0, "end": 13.0},
               {"stage": "eval", "start": 20.0, "end": 21.0}, {"stage": "distill", "start": 30.0, "end": None}]
    samples = [(10.5, 100.0), (11.5, 50.0), (12.5, 0.0), (20.5, 20.0)]
    assert gpu_perf.busy_by_stage(windows, samples) == {"base": 0.75, "eval": 0.0, "eval#2": 0.2}


def test_gpu_session_script_runs_both_benches_in_one_go(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (shim / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), WHEELS=str(tmp_path / "no"),
               CHECK_S="120", PROFILE_S="120", PERF_BUDGET_S="60",
               PERF_ARGS="--device cpu --parts engine --levels 1,4 --hf-levels 4 --new-tokens 8")
    proc = subprocess.run(["bash", "bench/gpu_session.sh"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["engine_cuda_check.log", "engine_cuda_check_cpu.json", "gpu_perf.log", "gpu_perf_cpu.json",
                     "gpu_profile.log", "gpu_profile_cpu.json", "nvidia_smi.txt"]
    assert json.loads((tmp_path / "out" / "engine_cuda_check_cpu.json").read_text())["ok"]
    assert json.loads((tmp_path / "out" / "gpu_profile_cpu.json").read_text())["ok"]
    assert json.loads((tmp_path / "out" / "gpu_perf_cpu.json").read_text())["met"] is True
