"""Fail fast: what a stage will need (the guard judge's checkpoint, a dataset's split sizes, URL syntax, plugin
imports, the storage) is checked by `alloy config`, `alloy run --dry-run` and `alloy run` before any stage starts;
each failure names the field and the command exits 2 (alloy/plan.py `preflight`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
AGENTIC = str(ROOT / "configs" / "agentic.yaml")
FAST_FAIL_S = 10.0


def alloy_in(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI as a user runs it from `cwd` (nothing Prefect/MLflow-related from other tests); (process, seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)
    return proc, time.monotonic() - t0


def assert_refused_before_any_stage(proc: subprocess.CompletedProcess, secs: float, cwd: Path, field: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"error: {field}: " in proc.stderr, proc.stderr
    assert secs < FAST_FAIL_S, f"took {secs:.1f} s"
    # no flow run, no MLflow store, no checkpoint: nothing was started or written under the working directory
    assert "alloy-pipeline" not in proc.stdout + proc.stderr
    assert list(cwd.iterdir()) == [p for p in cwd.iterdir() if p.name in ("data.jsonl", "small.yaml")]


def small_dataset_config(tmp_path: Path, rows: int = 400) -> Path:
    """A dataset domain of `rows` rows (a 5% val split of ~20 rows) under a config whose specialists validate on
    `val_n` 200 val prompts (the default)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus one?", "answer": str(i + 1)}) + "\n"
                            for i in range(rows)))
    cfg = tmp_path / "small.yaml"
    cfg.write_text(f"run: {{name: small}}\nmodel: {{preset: tiny}}\n"
                   f"domains:\n  - {{name: plus, dataset: {{path: {data}}}, verifier: numeric}}\n"
                   f"base: {{n_train_per_domain: 100}}\neval: {{n_eval: 10}}\n"
                   f"specialists: {{n_prompts: 100, eval_n: 10}}\ndistill: {{n_prompts_per_domain: 100, eval_every: 0}}\n")
    return cfg


def test_run_of_agentic_without_its_judge_exits_2_before_any_stage(tmp_path):
    """configs/agentic.yaml names `runs/agentic/judge`, which a fresh checkout does not have: refused at once, not
    after the base stage's SFT."""
    proc, secs = alloy_in(tmp_path, "run", AGENTIC)
    assert_refused_before_any_stage(proc, secs, tmp_path, "specialists.guard.judge_path")
    assert "runs/agentic/judge does not exist" in proc.stderr and "teachers.judge_model" in proc.stderr


def test_run_with_a_dataset_too_small_for_val_n_exits_2_before_any_stage(tmp_path):
    cfg = small_dataset_config(tmp_path)
    proc, secs = alloy_in(tmp_path, "run", str(cfg))
    assert_refused_before_any_stage(proc, secs, tmp_path, "domains.0.dataset.path")
    assert "the val split has" in proc.stderr and "specialists.val_n = 200" in proc.stderr, proc.stderr


def test_config_and_dry_run_refuse_the_same(tmp_path, monkeypatch, capsys):
    """In process (no start-up cost): `alloy config` and `alloy run --dry-run` name the same fields."""
    from alloy.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = str(small_dataset_config(tmp_path))
    for argv in (["config", cfg], ["run", cfg, "--dry-run"]):
        assert main(argv) == 2
        assert "error: domains.0.dataset.path: " in capsys.readouterr().err
    for argv in (["config", AGENTIC], ["run", AGENTIC, "--dry-run"]):
        assert main(argv) == 2
        assert "error: specialists.guard.judge_path: " in capsys.readouterr().err
    # fewer val prompts asked: the same dataset passes
    assert main(["config", cfg, "--set", "specialists.val_n=5"]) == 0, capsys.readouterr().err


def test_judge_checkpoint_checks(tmp_path, monkeypatch):
    from alloy.plan import check_judge
    from domains.registry import load_domains
    from infra.config import load_config

    monkeypatch.chdir(tmp_path)
    judge = tmp_path / "judge"
    judge.mkdir()
    cfg = load_config(AGENTIC, [f"specialists.guard.judge_path={judge}"])
    domains = load_domains(cfg)
    (c,) = check_judge(cfg, domains)
    assert not c.ok and "no config.json" in c.detail
    # what the pipeline flow checks at its start (a deployment run has no `alloy run` before it)
    from tasks.judge import judge_checkpoint

    with pytest.raises(ValueError, match=r"^specialists\.guard\.judge_path: .*\(no config\.json"):
        judge_checkpoint(cfg.specialists.guard)
    (judge / "config.json").write_text(json.dumps({"max_position_embeddings": 40}))
    (c,) = check_judge(cfg, domains)  # 40 positions leave no room for a prompt and 16 new tokens
    assert not c.ok and c.name == "specialists.guard.judge_path" and "leaves no room" in c.detail, c
    (judge / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert check_judge(cfg, domains)[0].ok and judge_checkpoint(cfg.specialists.guard) == judge
    # not served: a judge URL wins, the guard is off, specialists are off, or no domain has tools
    for sets in (["specialists.guard.judge_url=http://judge:8000"], ["specialists.guard.enabled=false"],
                 ["specialists.enabled=false"]):
        off = load_config(AGENTIC, ["specialists.guard.judge_path=/no/such/judge", *sets])
        assert check_judge(off, domains) == []
    plain = load_config(AGENTIC, ["specialists.guard.judge_path=/no/such/judge", "domains=[{name: reverse}]",
                                  "specialists.per_domain={}"])  # its per-domain settings name the tool domains
    assert check_judge(plain, load_domains(plain)) == []


@pytest.mark.parametrize("url, why", [("http://", "no host"), ("http://host:99999", "not a URL"),
                                      ("http://host:port", "not a URL"), ("http://ho st:8000", "whitespace"),
                                      ("https://host:0", "port 0")])
def test_teacher_and_judge_url_syntax_names_the_field(url, why):
    from alloy.plan import check_urls, url_problem
    from infra.config import config_from_dict

    assert url_problem("http://10.0.0.5:30000") is None and url_problem("https://teacher.example/v1") is None
    cfg = config_from_dict({"domains": [{"name": "reverse"}], "teachers": {"external": {"reverse": url}},
                            "specialists": {"guard": {"judge_url": url}}})
    checks = check_urls(cfg)
    assert [c.name for c in checks] == ["teachers.external.reverse", "specialists.guard.judge_url"]
    assert all(not c.ok and why in c.detail for c in checks), checks
