"""`alloy run --dry-run` (alloy/plan.py) as a user runs it, against real storage (local and moto S3) and a real engine
server; and checkpoint reuse across a change of scheduling settings through the stages' own code (tasks/*.py), on
checkpoints committed with infra/storage.py under the prefixes the stages use (no training needed)."""
import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_proc import EngineProc
from infra.config import load_config
from engine.launcher import free_port
from infra.storage import get_fs, join, save_checkpoint, write_json
from tasks.prefixes import base_prefix, specialist_prefix_of, student_prefix_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
ALLOY = str(Path(sys.executable).parent / "alloy")  # the console script of this venv (.venv/bin/alloy)
DOMAINS = ["reverse", "max_list", "case_swap"]
MARKER = "alloy-test-marker.txt"
# settings that change how a run is scheduled, logged or served, not what it trains
SCHEDULING = ["specialists.max_parallel=4", "specialists.retries=0", "distill.log_every=3", "engine.threads=2",
              "eval.batch_size=7", "specialists.per_domain.reverse.log_every=1", "tracking.enabled=false"]


def dry_run_argv(sets: tuple[str, ...]) -> list[str]:
    return ["run", SMOKE, "--dry-run", *[a for s in sets for a in ("--set", s)]]


def dry_run_process(*sets: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`alloy run SMOKE --dry-run --set …` as a user types it: the console script, in its own process."""
    return subprocess.run([ALLOY, *dry_run_argv(sets)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def dry_run(*sets: str) -> subprocess.CompletedProcess:
    """The same command line through the CLI's own parser and command in this process (a process's start-up, ~5 s
    of imports, is paid once by the test above, not by every case); stdout and stderr captured as the process's."""
    from alloy.cli import build_parser

    argv = dry_run_argv(sets)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        args = build_parser().parse_args(argv)
        rc = args.fn(args)
    return subprocess.CompletedProcess(["alloy", *argv], rc, out.getvalue(), err.getvalue())


@pytest.fixture
def completed_run(tmp_path, tiny_model_dir):
    """Storage as a finished smoke run leaves it: a base, three specialists and a student (each a real tiny HF
    checkpoint with a marker file), result.json files with per-step times and a report.json."""
    src = tmp_path / "ckpt-src"
    shutil.copytree(tiny_model_dir, src)
    (src / MARKER).write_text("committed by the fixture")
    cfg = load_config(SMOKE, [f"run.root={tmp_path}"])
    url = cfg.storage_url
    save_checkpoint(src, join(base_prefix(cfg, url), "final"), step=150, meta={"stage": "base"})
    write_json(join(base_prefix(cfg, url), "result.json"), {"steps": 150, "wall_s": 75.0, "world_size": 1})
    history = [{"step": i, "rollout_s": 0.5, "train_s": 0.25} for i in range(1, 121)]
    for d in DOMAINS:
        prefix = specialist_prefix_of(cfg, url, d)
        save_checkpoint(src, join(prefix, "final"), step=120)
        write_json(join(prefix, "result.json"), {"score": 0.5, "steps": 120, "history": history, "guard": {}})
    prefix = student_prefix_of(cfg, url)
    save_checkpoint(src, join(prefix, "final"), step=60)
    write_json(join(prefix, "result.json"), {"steps": 60, "wall_s": 90.0, "n_teachers": 3, "throughput": {
        "sampled_tokens_per_s": 10.0, "teacher_scored_tokens_per_s": 10.0}})
    write_json(join(url, "report.json"), {"timings_s": {"eval": 30.0, "teachers_up": 6.0},
                                          "domains": {d: {"n_eval": 50} for d in DOMAINS}})
    return tmp_path


def test_dry_run_plans_smoke_in_under_a_minute_and_creates_nothing(tmp_path):
    t0 = time.monotonic()
    proc = dry_run_process(f"run.root={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    out = proc.stdout
    for stage in ("1. base", "2. eval (base)", "3. specialists", "4. teachers", "5. distill", "6. eval (student)",
                  "7. report"):
        assert stage in out
    assert "train 150 steps" in out and "train 60 steps" in out and out.count("train 120 steps") == 3
    assert "no estimate (no earlier run)" in out and "reuse file:" not in out
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_dry_run_after_a_run_reuses_everything_despite_scheduling_changes(completed_run):
    proc = dry_run(f"run.root={completed_run}", *SCHEDULING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reused = [line for line in proc.stdout.splitlines() if " reuse file://" in line]
    assert len(reused) == 5, proc.stdout  # base, three specialists, student
    assert "train " not in proc.stdout

    # a training setting: every stage trains again (a specialist resumes its newest complete step), each estimated
    # from the step times recorded above (base 0.5 s, specialist 0.75 s, student 1.5 s per step)
    sets = [f"run.root={completed_run}", "base.steps=300", "tracking.enabled=false"]
    cfg = load_config(SMOKE, sets)
    save_checkpoint(completed_run / "ckpt-src", join(specialist_prefix_of(cfg, cfg.storage_url, "reverse"),
                                                     "step-00000040"), step=40)
    proc = dry_run(*sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {ln.split()[0] if ln.split()[0][0].isalpha() else ln.split()[1]: ln for ln in proc.stdout.splitlines()
             if "train " in ln}
    assert "train 300 steps" in lines["base"] and lines["base"].endswith("~2m 30s")
    assert "resume at step 40, train 80 more steps" in lines["reverse"] and lines["reverse"].endswith("~1m 00s")
    assert "train 120 steps" in lines["max_list"] and lines["max_list"].endswith("~1m 30s")
    assert "train 60 steps" in lines["distill"] and lines["distill"].endswith("~1m 30s")
    assert "reuse file:" not in proc.stdout and "no estimate" not in proc.stdout


def test_stages_reuse_their_checkpoints_after_a_scheduling_change(completed_run):
    """The stages' own code (not the plan) finds every checkpoint of the run under the changed settings."""
    from tasks.base import train_base
    from tasks.context import open_context
    from tasks.distill import train_student
    from tasks.specialist import train_specialist

    ctx = open_context(SMOKE, [f"run.root={completed_run}", *SCHEDULING])
    base_dir = train_base.fn(ctx)
    assert (Path(base_dir) / MARKER).is_file()
    for d in DOMAINS:
        summary = train_specialist.fn(ctx, d, base_dir)
        assert summary["checkpoint"] == join(specialist_prefix_of(ctx.cfg, ctx.storage_url, d), "final")
        assert (Path(summary["specialist_dir"]) / MARKER).is_file() and summary["score"] == 0.5
    student = train_student.fn(ctx, base_dir, {})
    assert student["student_checkpoint"] == join(student_prefix_of(ctx.cfg, ctx.storage_url), "final")
    assert (Path(student["student_dir"]) / MARKER).is_file()


def test_dry_run_checks_external_teachers(tmp_path, tiny_model_dir):
    server = EngineProc(tiny_model_dir, tmp_path / "teacher.log").start().wait_healthy()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        proc = dry_run(f"run.root={tmp_path}", f"teachers.external.reverse={server.url}",
                       f"teachers.external.max_list={dead}")
    finally:
        server.kill()
    assert proc.returncode == 2
    assert f"ok    teachers.external.reverse: {server.url}/health: HTTP 200" in proc.stdout
    assert f"error: teachers.external.max_list: {dead}/health: no answer" in proc.stderr
    assert "4. teachers" in proc.stdout and "1 launched, 2 external" in proc.stdout


def test_dry_run_refuses_storage_it_cannot_use(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for url in (f"file://{blocker}/runs", "nosuchproto://bucket/alloy"):
        proc = dry_run(f"run.root={tmp_path}", f"run.storage={url}")
        assert proc.returncode == 2, proc.stdout
        assert f"error: run.storage: {url}: not usable" in proc.stderr


def test_dry_run_probes_s3(tmp_path, s3_bucket):
    proc = dry_run(f"run.root={tmp_path}", f"run.storage={s3_bucket}/alloy/smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe written, read, listed and deleted" in proc.stdout
    fs, path = get_fs(s3_bucket)
    assert fs.find(path) == []  # the probe is gone
    missing = s3_bucket + "-missing"
    proc = dry_run(f"run.root={tmp_path}", f"run.storage={missing}/alloy")
    assert proc.returncode == 2 and f"error: run.storage: {missing}/alloy: not usable" in proc.stderr


def test_dry_run_loads_the_model_path(tmp_path, tiny_model_dir):
    proc = dry_run(f"run.root={tmp_path}", f"model.path={tiny_model_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ok    model.path: {tiny_model_dir}: llama" in proc.stdout
    proc = dry_run(f"run.root={tmp_path}", "model.path=nobody/no-such-model")  # a Hub id, not in the cache
    assert proc.returncode == 2
    assert "error: model.path: nobody/no-such-model: cannot load" in proc.stderr
    assert "Hugging Face cache" in proc.stderr


def test_dry_run_and_plan_refuse_checkpoints_bigger_than_the_storage(tmp_path, monkeypatch):
    """The run's checkpoint bytes (infra/checkpoint_budget.py) against a small storage: ALLOY_STORAGE_FREE_BYTES
    stands for a 1 MB disk. Smoke on the CPU (tiny preset, P = 105,024 parameters, fp32, 2 checkpoints kept):
    a specialist checkpoint is hf/ + best-hf/ + two DeepSpeed states = P·(4 + 4 + 12 + 12) = 32P, the student's
    P·(4 + 12) = 16P, a final/ 4P; what stays is the base's final 4P + 3 specialists × (2 · 32P + 4P) + the student's
    2 · 16P + 4P = 244P, plus 2 specialists at once committing one more (64P): 308P = 32,347,392 bytes."""
    monkeypatch.setenv("ALLOY_STORAGE_FREE_BYTES", "1000000")
    sets = (f"run.root={tmp_path}", "resources.gpus_per_node=0")
    proc = dry_run(*sets)
    assert proc.returncode == 2, proc.stdout[-3000:]
    err = proc.stderr
    assert "error: checkpoints: file://" in err
    assert "need about 32.3 MB (32347392 bytes), more than the storage has: 1 MB free (1000000 bytes)" in err
    for field in ("specialists.keep_checkpoints", "distill.keep_checkpoints", "domains (a specialist each)",
                  "specialists.max_parallel", "model.preset"):
        assert field in err, err
    assert "checkpoints (estimate: 0.1M params, trained on the CPU)" in proc.stdout
    assert "total                 ~32.3 MB (1 MB free by ALLOY_STORAGE_FREE_BYTES)" in proc.stdout

    # one checkpoint kept per trainer: 4P + 3 × (32P + 4P) + (16P + 4P) + 64P = 196P = 20,584,704 bytes
    monkeypatch.setenv("ALLOY_STORAGE_FREE_BYTES", "20584704")
    proc = dry_run(*sets, "specialists.keep_checkpoints=1", "distill.keep_checkpoints=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok    checkpoints: ~20.6 MB on file://" in proc.stdout

    # `alloy plan` (the placement) refuses the same way
    from alloy.cli import build_parser

    monkeypatch.setenv("ALLOY_STORAGE_FREE_BYTES", "1000000")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        args = build_parser().parse_args(["plan", SMOKE, "--gpus", "0", "--set", f"run.root={tmp_path}"])
        assert args.fn(args) == 2
    assert "(32347392 bytes), more than the storage has: 1 MB free (1000000 bytes)" in err.getvalue()
    assert list(tmp_path.iterdir()) == []  # neither wrote anything
