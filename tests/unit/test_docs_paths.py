"""The architecture page names files a newcomer can open: every repository path it names (`dir/file.py`, `.yaml`,
`.md`, `.sh`, `.json`) exists, and it names the file of each stage's trainer, loss and episode loop (issue 55)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|yaml|md|sh|json))\b")


def test_every_path_the_architecture_page_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = sorted(set(PATH.findall(text)))
    assert len(named) > 50  # the page names files, not only modules
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_the_architecture_page_names_every_trainer_loss_and_loop():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for path in ("teachers/specialist.py", "teachers/ppo_step.py", "teachers/ppo_math.py", "teachers/specialist_main.py",
                 "student/trainer.py", "student/losses.py", "student/distill_main.py", "training/sft.py",
                 "domains/episodes.py", "domains/evaluate.py", "engine/scheduler.py", "training/logprobs.py"):
        assert path in text, path
    assert "infra/logprobs" not in text  # the chunked log-softmax lives in training/


def test_the_teachers_package_says_what_lives_there():
    import teachers

    doc = teachers.__doc__ or ""
    assert "specialist" in doc and "teacher" in doc
    for module in ("specialist.py", "ppo_step.py", "ppo_math.py", "rollout.py", "critic.py"):
        assert module in doc, module
