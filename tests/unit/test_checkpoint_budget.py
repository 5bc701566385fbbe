"""The checkpoint byte arithmetic of `alloy run --dry-run` / `alloy plan` (infra/checkpoint_budget.py), on hand-derived
numbers: a model of P = 1000 parameters, so every byte count can be checked in one's head."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.checkpoint_budget import (FREE_BYTES_ENV, TrainerBytes, base_bytes, budget_fields, budget_problem,
                                     checkpoint_rule, fmt_bytes, free_bytes, run_bytes, run_trainers,
                                     specialist_bytes, state_bytes, student_bytes, weights_bytes)
from infra.config import load_config
from infra.presets import preset_params

pytestmark = pytest.mark.unit

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
P = 1000


def test_the_default_keeps_one_on_a_gpu_two_on_the_cpu():
    assert checkpoint_rule(None, on_gpu=True) == (1, True)  # older ones (if asked for) drop their DeepSpeed states
    assert checkpoint_rule(None, on_gpu=False) == (2, False)  # today's two, both whole: the fallback resume
    assert checkpoint_rule(3, on_gpu=True) == (3, True)
    assert checkpoint_rule(1, on_gpu=False) == (1, False)
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        checkpoint_rule(0, on_gpu=False)


def test_weights_and_deepspeed_state_per_parameter():
    assert weights_bytes(P, "bf16") == 2000 and weights_bytes(P, "fp16") == 2000 and weights_bytes(P, "fp32") == 4000
    assert state_bytes(P, "bf16") == 1000 * (2 + 4 + 4 + 4)  # bf16 weights + fp32 master, Adam m, Adam v
    assert state_bytes(P, "fp32") == 1000 * (4 + 4 + 4)  # the fp32 weights are the master: m, v only
    with pytest.raises(ValueError, match="unknown training dtype 'int8'"):
        weights_bytes(P, "int8")


def test_a_specialist_on_a_gpu():
    # newest: hf/ 2000 + best-hf/ 2000 + policy state 14000 + critic state 14000 = 32000; an older one: 4000
    t = specialist_bytes("specialist a", P, "bf16", "bf16", keep=1, slim=True, best=True)
    assert (t.newest, t.older, t.final, t.transient) == (32000, 4000, 2000, True)
    assert t.resume == 32000 and t.stays == 2000  # step-* go once final/ is committed
    assert t.in_flight == 32000 + 32000  # its step-* while it trains + the new one of a commit
    three = specialist_bytes("specialist a", P, "bf16", "bf16", keep=3, slim=True, best=True)
    assert three.resume == 32000 + 2 * 4000 and three.in_flight == 32000 + 40000
    no_val = specialist_bytes("specialist a", P, "bf16", "bf16", keep=1, slim=True, best=False)
    assert no_val.newest == 2000 + 14000 + 14000


def test_a_specialist_on_the_cpu_keeps_whole_checkpoints():
    # fp32: hf/ 4000 + best-hf/ 4000 + two states of 12000 = 32000, kept twice, beside final/ 4000
    t = specialist_bytes("specialist a", P, "fp32", "fp32", keep=2, slim=False, best=True)
    assert (t.newest, t.older, t.final, t.transient) == (32000, 32000, 4000, False)
    assert t.resume == 64000 and t.stays == 68000 and t.in_flight == 32000


def test_student_and_base():
    s = student_bytes(P, "bf16", keep=1, slim=True)
    assert (s.newest, s.older, s.final, s.stays, s.in_flight) == (16000, 2000, 2000, 2000, 32000)
    b = base_bytes(P, "fp32")
    assert (b.newest, b.stays, b.in_flight) == (0, 4000, 0)  # final/ only


def test_a_run_on_a_gpu_and_on_the_cpu():
    gpu = [base_bytes(P, "bf16"), *(specialist_bytes(f"specialist {d}", P, "bf16", "bf16", keep=1, slim=True,
                                                     best=True) for d in "abc"),
           student_bytes(P, "bf16", keep=1, slim=True)]
    # stays: finals 2000 × 5; while training: 2 specialists at once × 64000 (> the student's 32000)
    assert run_bytes(gpu, at_once=2) == (10000, 128000)
    cpu = [base_bytes(P, "fp32"), *(specialist_bytes(f"specialist {d}", P, "fp32", "fp32", keep=2, slim=False,
                                                     best=True) for d in "abc"),
           student_bytes(P, "fp32", keep=2, slim=False)]
    # stays: base 4000 + 3 × 68000 + student (2 × 16000 + 4000); while training: 2 × 32000
    assert run_bytes(cpu, at_once=2) == (4000 + 204000 + 36000, 64000)
    assert run_bytes(cpu, at_once=0)[1] == 16000  # no specialists: the student's commit


def test_the_medium_preset_matches_the_measured_h200_checkpoint():
    """bench/gpu_pipeline.py measured ~4.8 GB per specialist checkpoint of the 151M `medium` preset in bf16."""
    t = specialist_bytes("specialist a", preset_params("medium"), "bf16", "bf16", keep=1, slim=True, best=True)
    assert 4.7e9 < t.newest < 4.9e9


def test_run_trainers_reads_the_config():
    cfg = load_config(str(SMOKE), ["specialists.keep_checkpoints=3", "specialists.per_domain.max_list.val_every=0",
                                   "specialists.policy_train.dtype=bf16"], check_model_path=False)
    trainers, at_once = run_trainers(cfg, P, True, ["reverse", "max_list", "case_swap"])
    by = {t.name: t for t in trainers}
    assert list(by) == ["base", "specialist reverse", "specialist max_list", "specialist case_swap", "student"]
    assert at_once == 2  # specialists.max_parallel
    # policy bf16, critic fp32: hf 2000 (+ best 2000) + 14000 + 12000
    assert by["specialist reverse"].newest == 30000 and by["specialist max_list"].newest == 28000
    assert by["specialist reverse"].keep == 3 and by["student"].keep == 1 and by["student"].newest == 16000
    cpu, _ = run_trainers(cfg, P, False, ["reverse"])
    assert [t.keep for t in cpu] == [1, 3, 2]
    off = load_config(str(SMOKE), ["specialists.enabled=false"], check_model_path=False)
    assert [t.name for t in run_trainers(off, P, True, ["reverse"])[0]] == ["base", "student"]
    assert "specialists.keep_checkpoints" in budget_fields(cfg) and "model.preset" in budget_fields(cfg)


def test_free_bytes_of_a_local_storage_before_its_first_run(tmp_path):
    asked = []

    def disk_usage(path):
        asked.append(path)
        return SimpleNamespace(free=123)

    missing = tmp_path / "runs" / "smoke"  # not created yet: its nearest existing parent is asked
    assert free_bytes("file://x", str(missing), env={}, disk_usage=disk_usage) == (123, f"free on {tmp_path}")
    assert asked == [str(tmp_path)]
    assert free_bytes("s3://b/p", None, env={}, disk_usage=disk_usage)[0] is None  # remote: not checked


def test_the_environment_sets_a_tighter_budget():
    env = {FREE_BYTES_ENV: "5e6"}
    assert free_bytes("s3://b/p", None, env=env) == (5_000_000, f"free by {FREE_BYTES_ENV}")
    with pytest.raises(ValueError, match=f"{FREE_BYTES_ENV}='lots': must be a number of bytes"):
        free_bytes("file://x", "/", env={FREE_BYTES_ENV: "lots"})


def test_budget_problem_names_the_fields_and_both_numbers():
    assert budget_problem(90, 50, 40, ["a.b"]) is None  # what the run already stores counts as room
    assert budget_problem(10**12, None, 0, ["a.b"]) is None  # remote storage: not checked
    msg = budget_problem(2_500_000_000, 1_000_000_000, 0, ["specialists.keep_checkpoints", "model.preset"])
    assert "about 2.5 GB (2500000000 bytes)" in msg and "1 GB free (1000000000 bytes)" in msg
    assert "specialists.keep_checkpoints, model.preset" in msg


def test_fmt_bytes():
    assert [fmt_bytes(n) for n in (1.5e12, 2.5e9, 240e6, 12_000, 7)] == ["1.5 TB", "2.5 GB", "240 MB", "12 kB", "7 B"]


def test_trainer_bytes_is_plain_data():
    t = TrainerBytes("student", 10, 1, 3, 5)
    assert (t.resume, t.stays, t.in_flight) == (12, 17, 10)
