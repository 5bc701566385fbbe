"""Exactly-once under failures: a teacher server SIGKILLed mid-distillation (the supervisor restarts it on the same
port, the client retries), and a trainer crash followed by a resume from the last checkpoint. Either way every
sample id the prompt stream issued is trained exactly once or dropped with a reason — checked on the ledger that
the final checkpoint committed.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from domains.registry import load_domains
from infra.config import config_from_dict
from infra.storage import join, read_json
from infra.tracking import NoopTracker
from student.sampler import PromptStream

pytestmark = pytest.mark.integration

DOMAINS = ["reverse", "sort_digits", "max_list"]
BATCH = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory, weak_opd_models):
    """Weak teachers are enough here (quality does not matter): the session's (tests/conftest.py), 3 launched under a
    Supervisor."""
    from tasks.teachers import start_teachers

    root = tmp_path_factory.mktemp("kill")
    base, teachers = weak_opd_models
    cfg = make_cfg(steps=1)
    fleet = start_teachers(DOMAINS, {d: str(p) for d, p in teachers.items()}, str(base), log_dir=root / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    yield base, fleet
    fleet.stop()


def make_cfg(**distill):
    return config_from_dict({
        "domains": [{"name": d} for d in DOMAINS],
        "distill": {"batch_size": BATCH, "max_new_tokens": 6, "eval_every": 0, "log_every": 1, "checkpoint_every": 5,
                    "n_prompts_per_domain": 200, "teacher_retries": 10, **distill}})


def issued_ids(cfg, base, steps: int) -> set[str]:
    """The ids a fresh prompt stream hands out in `steps` uniform takes of BATCH (deterministic)."""
    from infra.models import load_tokenizer

    stream = PromptStream(load_domains(cfg), load_tokenizer(base), cfg.distill.n_prompts_per_domain, cfg.run.seed)
    return {item.sample_id for _ in range(steps) for item in stream.take(BATCH)}


def committed_state(out_url: str, step: int) -> dict:
    return read_json(join(out_url, f"step-{step:08d}", "trainer.json"))


def test_teacher_sigkilled_mid_run_completes_nothing_lost_or_double_counted(setup, tmp_path):
    from student.distill_main import run_distillation

    base, fleet = setup
    cfg = make_cfg(steps=16)
    killed: dict = {}

    def on_step(trainer, metrics):
        if trainer.state.step == 6:  # the producer is already sampling/scoring the next batches
            st = next(s for s in fleet.status() if s["name"] == "teacher-reverse")
            killed.update(pid=st["pid"], at=time.monotonic())
            os.kill(st["pid"], signal.SIGKILL)

    out_url = f"file://{tmp_path}/out"
    out = run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), out_url, tmp_path / "w", NoopTracker(),
                           on_step=on_step)

    rev = next(s for s in fleet.status() if s["name"] == "teacher-reverse")
    assert killed and rev["restarts"] == 1 and rev["alive"] and rev["pid"] != killed["pid"]
    assert out["teachers"]["reverse"]["retries"] > 0  # the client rode out the restart
    assert out["steps"] == 16 and out["updates"] == 16
    # nothing lost: every issued id trained; nothing double-counted: the ledger equals the issued set exactly
    assert out["dropped"] == {} and out["duplicates_skipped"] == 0
    state = committed_state(out_url, 16)
    assert state["cursor"] == 16 * BATCH
    ledger = state["ledger"]["ledger"]
    assert len(ledger) == len(set(ledger)) == 16 * BATCH and set(ledger) == issued_ids(cfg, base, 16)
    assert out["teachers"]["reverse"]["sequences"] == 16 * BATCH // 3  # scored once each, never twice


def test_crash_then_resume_trains_each_sample_exactly_once(setup, tmp_path):
    from student.distill_main import run_distillation

    base, fleet = setup
    cfg = make_cfg(steps=12)
    out_url = f"file://{tmp_path}/out"

    class Crash(RuntimeError):
        pass

    def crash_at_8(trainer, metrics):
        if trainer.state.step == 8:  # last commit was step 5; steps 6-8 are rolled back with the weights
            raise Crash("simulated trainer crash")

    with pytest.raises(Crash):
        run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), out_url, tmp_path / "w", NoopTracker(),
                         on_step=crash_at_8)
    assert committed_state(out_url, 5)["cursor"] == 5 * BATCH

    resumed_steps: list[int] = []
    out = run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), out_url, tmp_path / "w", NoopTracker(),
                           on_step=lambda tr, m: resumed_steps.append(tr.state.step))
    assert resumed_steps == list(range(6, 13))  # continued after the committed step 5, not from scratch
    assert out["updates"] == 12 and out["steps"] == 12
    state = committed_state(out_url, 12)
    ledger = state["ledger"]["ledger"]
    # ids of the rolled-back steps 6-8 were issued again (same cursor → same ids) and trained once in all
    assert len(ledger) == len(set(ledger)) == 12 * BATCH == state["cursor"]
    assert set(ledger) == issued_ids(cfg, base, 12) and state["dropped"] == {}
