"""Shared fixtures. Tests are split by cost with markers: unit, integration, e2e (see pyproject.toml)."""
from __future__ import annotations

import os

from alloy.cli import env_defaults  # noqa: E402  (the CLI's quiet defaults, before torch is imported)

env_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub (`alloy` itself leaves this to the user)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)  # tests use their own SQLite stores

import pytest
import torch

# One torch thread in the test process, as Alloy's own trainer and server processes run (distill.threads = 1, engine
# threads = 1): the models trained in-process here (the session's judge, the fixtures' plain-torch SFT) are tiny,
# and a second OpenMP thread on 2 shared cores mostly spin-waits. Until this, the first half of the session ran on
# torch's default (one thread per core) and test_guard_experiment's set_num_threads(1) switched the rest to one.
torch.set_num_threads(1)

from s3_fixtures import moto_server, s3_bucket, s3_env  # noqa: F401,E402  (pytest fixtures)


# `make test` runs the suite on pytest-xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder`), with the work
# units chosen here: each test file is one unit, so a module's fixtures are built once, on one worker, and its tests
# keep their order; the files on the e2e session's `alloy up` stack are one unit, browser first: test_prefect_deploy's
# last test stops that stack. (xdist's own `loadgroup` marks do not group under pytest 9: it renames `item._nodeid`,
# which pytest 9 no longer reads, and silently falls back to one test per unit.)
E2E_STACK_FILES = ("test_browser.py", "test_prefect_deploy.py")


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # any other --dist: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "e2e-stack" if path.rsplit("/", 1)[-1] in E2E_STACK_FILES else path

    return FileUnits(config, log)


@pytest.fixture(scope="session")
def judge_dir(tmp_path_factory):
    """The small anti-hack judge (teachers/judge_model.py), trained once per `make test` (~45 s on 2 cores; it raises
    unless it classifies a held-out set well). Under pytest-xdist the first worker that asks trains it in the run's
    shared temp dir while a second one waits on the lock: two judges trained at once on the 2 cores took 240-370 s.
    ALLOY_TEST_JUDGE_DIR names one trained before (same code) to reuse."""
    import os
    from pathlib import Path

    from filelock import FileLock

    from teachers.judge_model import train_judge

    if os.environ.get("ALLOY_TEST_JUDGE_DIR"):
        return Path(os.environ["ALLOY_TEST_JUDGE_DIR"])
    xdist = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    shared = tmp_path_factory.getbasetemp().parent if xdist else tmp_path_factory.mktemp("judge")
    out = shared / "judge"
    with FileLock(str(shared / "judge.lock")):
        done = shared / "judge.ok"  # written after train_judge returns: it raises on a judge that classifies badly
        if done.is_file():  # trained by another worker of this run
            return out
        # serially on every core, as `python -m teachers.judge_model` trains it (torch's default): nothing else runs
        # while a fixture builds, and 2 threads took 44 s here against 71 s on one; under xdist the other worker is
        # running tests, so one thread
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if xdist else os.cpu_count() or 1)
        try:
            print("JUDGE-TRAINING", train_judge(out))
        finally:
            torch.set_num_threads(threads)
        done.touch()
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A fresh tiny Llama + char tokenizer in HF format, built once per session (seed 0)."""
    from infra.models import init_model_dir

    return init_model_dir("tiny", tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def qwen2_bpe_dir(tmp_path_factory):
    """A fresh tiny Qwen2 + byte-level BPE tokenizer (512 tokens, ChatML chat template) trained on
    `bpe_fixtures.CORPUS`, built once per session (seed 0)."""
    from bpe_fixtures import make_qwen2_bpe_dir

    return make_qwen2_bpe_dir(tmp_path_factory.mktemp("qwen2-bpe") / "model")


@pytest.fixture(scope="session")
def model(tiny_model_dir):
    """The `tiny_model_dir` model loaded in-process (eval mode): the reference for engine outputs."""
    from infra.models import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test harness (a temporary API + SQLite) for the whole session: it takes ~15 s to start."""
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def reverse_base(tmp_path_factory):
    """A tiny base SFT-ed 60 steps on `reverse` (distill_fixtures.build_base, plain torch), built once per session for
    the rollout tests: its answers vary in length, so a token-count cut leaves partials."""
    from distill_fixtures import build_base

    return build_base(tmp_path_factory.mktemp("reverse-base"), ["reverse"], steps=60)


WEAK_OPD_DOMAINS = ["reverse", "sort_digits", "max_list"]


@pytest.fixture(scope="session")
def weak_opd_models(tmp_path_factory):
    """(base, {domain: teacher}) for WEAK_OPD_DOMAINS, barely trained (20 + 20 plain-torch SFT steps,
    distill_fixtures.build_base_and_teachers), built once per session for the tests whose teachers' quality does not
    matter (test_teacher_kill, test_external_teachers). Read-only: a test that needs a changed checkpoint copies it."""
    from distill_fixtures import build_base_and_teachers

    return build_base_and_teachers(tmp_path_factory.mktemp("weak-opd-models"), WEAK_OPD_DOMAINS, base_steps=20,
                                   teacher_steps=20)
