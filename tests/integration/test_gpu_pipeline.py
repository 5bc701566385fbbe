"""bench/gpu_pipeline.py on this CPU machine: the whole pipeline with every trainer, every engine server and the
evaluation in bf16 (the dtype paths a GPU run takes), Prefect replaced by the bench's pass-through stand-ins and
MLflow absent (as on the lent GPU machine), and the JSON it writes for a GPU run: every stage `ok` on the
expected device, the figures present, exit 0; and the same run judged against CUDA fails."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BF16 = ["base.train.dtype=bf16", "specialists.policy_train.dtype=bf16", "specialists.critic_train.dtype=bf16",
        "distill.train.dtype=bf16", "eval.dtype=bf16", "engine.dtype=bfloat16"]
SHORT = ["domains=[{name: reverse}, {name: max_list}]", "base.steps=8", "base.n_train_per_domain=200",
         "eval.n_eval=8", "specialists.steps=2", "specialists.batch_size=8", "specialists.checkpoint_every=2",
         "specialists.critic_warmup_steps=1", "specialists.eval_n=8", "distill.steps=2", "distill.batch_size=8",
         "distill.eval_every=0"]


def test_gpu_pipeline_bench_runs_the_flow_in_bf16_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_pipeline.json"
    sets = sum((["--set", s] for s in SHORT + BF16), [])
    proc = subprocess.run([sys.executable, "bench/gpu_pipeline.py", "--out", str(out), "--config",
                           "configs/smoke.yaml", "--root", str(tmp_path / "run"), "--keep", *sets],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["error"] is None and r["expect_device"] == "cpu" and r["commit"]
    assert set(r["stages"]) == {"base", "specialists", "teachers", "distill", "eval"}
    assert all(s["ok"] for s in r["stages"].values()), r["stages"]
    assert r["stages"]["specialists"]["n"] == 2 and r["stages"]["teachers"]["n_servers"] == 2
    assert r["stages"]["teachers"]["dtypes"] == ["bfloat16"]  # the engine servers ran in bf16
    servers = r["servers"]
    assert len(servers) == 5 and {v["dtype"] for v in servers.values()} == {"bfloat16"}, servers  # 2 + 2 + student
    for k in ("specialist_rollout_tokens_per_s", "teacher_scored_tokens_per_s", "base_train_tokens_per_s",
              "specialist_train_tokens_per_s", "student_train_tokens_per_s"):
        assert r["throughput"][k] and r["throughput"][k] > 0, k
    assert r["params"] > 0 and r["mfu"]["base"] is None  # no GPU peak to divide by on a CPU
    assert r["weight_push"]["specialist_steps"] == 4 and r["weight_push"]["student_steps"] == 2
    paths = r["weight_push"]["paths"]  # no CUDA: the embedded server's weight buffer (engine.weight_sync auto)
    assert set(paths) == {"specialist reverse", "specialist max_list", "student"}, paths
    assert all(p["strategy"] == "memory" for p in paths.values()), paths
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["domains"]) == {"reverse", "max_list"}
    # the base trainer's summary as the bench read it: trained in bf16 on the CPU
    base = json.loads(next((tmp_path / "run").rglob("base-result.json")).read_text())
    assert base["device"] == "cpu" and base["train_tokens"] > 0
    # each trainer's own speed figures (training/mfu.py): tokens/s always, no MFU without a GPU peak
    assert base["train_tokens_per_s"] > 0 and base["mfu"] is None
    assert set(r["mfu_trainers"]) == {"base", "student", "specialist reverse", "specialist max_list"}
    assert all(v is None for v in r["mfu_trainers"].values()), r["mfu_trainers"]
    # the same run judged against CUDA (what a GPU run must show) fails every stage that has a device
    spec = importlib.util.spec_from_file_location("gpu_pipeline", ROOT / "bench" / "gpu_pipeline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    judged = bench.summarize(report, tmp_path / "run", "cuda", r["params"], None, bench.GpuSampler())
    assert [k for k, v in judged["stages"].items() if not v["ok"]] == ["base", "specialists", "teachers", "distill"]
