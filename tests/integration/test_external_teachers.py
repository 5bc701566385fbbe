"""Teachers started outside the pipeline (plain `python -m engine.server` processes, as another team or a GPU
box would run them) given as `teachers.external` URLs; mixing them with launched ones; and the refusal of a teacher
whose tokenizer differs from the student's (char tokenizers, and two byte-level BPEs).
"""
from __future__ import annotations

import shutil

import psutil
import pytest

from engine_proc import EngineProc
from domains.registry import load_domains
from infra.config import ConfigError, config_from_dict
from infra.tracking import NoopTracker
from teachers.registry import TokenizerMismatch

pytestmark = pytest.mark.integration

DOMAINS = ["reverse", "sort_digits", "max_list"]


@pytest.fixture(scope="module")
def models(weak_opd_models):
    return weak_opd_models  # the session's weak base and teachers (tests/conftest.py); never written to


@pytest.fixture(scope="module")
def outside(models, tmp_path_factory):
    """Two teacher servers this test runs itself, outside any Alloy supervisor."""
    _, teachers = models
    logs = tmp_path_factory.mktemp("ext-logs")
    procs = {d: EngineProc(teachers[d], logs / f"{d}.log").start() for d in DOMAINS[:2]}
    for p in procs.values():
        p.wait_healthy()
    yield procs
    for p in procs.values():
        p.kill()


def make_cfg(external: dict, **distill):
    return config_from_dict({
        "domains": [{"name": d} for d in DOMAINS], "teachers": {"external": external},
        "distill": {"steps": 4, "batch_size": 24, "max_new_tokens": 6, "eval_every": 0, "log_every": 1, **distill}})


def test_external_urls_are_validated_at_config_load():
    with pytest.raises(ConfigError, match="teachers.external"):
        make_cfg({"reverse": "localhost:30000"})
    with pytest.raises(ConfigError, match="not configured"):
        make_cfg({"algebra": "http://127.0.0.1:1"})


def test_external_and_launched_teachers_mix_and_distill(models, outside, tmp_path):
    from student.distill_main import run_distillation
    from tasks.teachers import start_teachers

    base, teachers = models
    external = {d: p.url for d, p in outside.items()}
    cfg = make_cfg(external)
    # a checkpoint for every domain: the two external ones must win, only the third is launched
    fleet = start_teachers(DOMAINS, {d: str(p) for d, p in teachers.items()}, str(base), log_dir=tmp_path / "logs",
                           engine_cfg=cfg.engine, teachers_cfg=cfg.teachers)
    try:
        assert fleet.external == sorted(DOMAINS[:2]) and fleet.launched == [DOMAINS[2]]
        assert fleet.tokenizers == {d: "match" for d in DOMAINS}
        assert {d: fleet.endpoints()[d] for d in DOMAINS[:2]} == external
        assert [s["name"] for s in fleet.status()] == [f"teacher-{DOMAINS[2]}"]
        out = run_distillation(cfg, load_domains(cfg), str(base), fleet.endpoints(), f"file://{tmp_path}/out",
                               tmp_path / "w", NoopTracker())
    finally:
        fleet.stop()
    assert out["steps"] == 4 and out["dropped"] == {} and out["trained_samples"] == 4 * 24
    for d in DOMAINS:  # every teacher, external or launched, scored its domain's 8 samples per step
        t = out["teachers"][d]
        assert t["sequences"] == 4 * 8 and t["tokens"] > 0 and t["errors"] == 0 and t["retries"] == 0
    assert all(p.alive() for p in outside.values())  # the pipeline never stops servers it did not start


def test_only_external_teachers_need_no_supervisor(models, outside, tmp_path):
    from tasks.teachers import start_teachers

    base, _ = models
    ext = {d: p.url for d, p in outside.items()}
    cfg = config_from_dict({"domains": [{"name": d} for d in DOMAINS[:2]], "teachers": {"external": ext}})
    fleet = start_teachers(DOMAINS[:2], {}, str(base), log_dir=tmp_path / "logs", engine_cfg=cfg.engine,
                           teachers_cfg=cfg.teachers)
    assert fleet.supervisor is None and fleet.endpoints() == ext and fleet.launched == []
    with pytest.raises(ValueError, match=r"no teacher for domain\(s\) \['max_list'\]"):
        start_teachers(DOMAINS, {}, str(base), log_dir=tmp_path / "logs", engine_cfg=cfg.engine,
                       teachers_cfg=cfg.teachers)


def test_teacher_with_another_tokenizer_is_refused_and_nothing_is_left_running(models, tmp_path):
    from infra.models import load_tokenizer
    from tasks.teachers import start_teachers

    base, teachers = models
    odd = tmp_path / "teacher-odd"
    shutil.copytree(teachers["sort_digits"], odd)
    tok = load_tokenizer(odd)
    tok.add_tokens(["<tool>"])  # one more token: ids no longer line up with the student's vocabulary
    tok.save_pretrained(str(odd))
    cfg = make_cfg({})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ckpts = {"reverse": str(teachers["reverse"]), "sort_digits": str(odd), "max_list": str(teachers["max_list"])}
    with pytest.raises(TokenizerMismatch) as err:
        start_teachers(DOMAINS, ckpts, str(base), log_dir=tmp_path / "logs", engine_cfg=cfg.engine,
                       teachers_cfg=cfg.teachers)
    msg = str(err.value)
    assert f"sort_digits ({odd})" in msg and "vocab size 101 vs student 100" in msg
    assert "reverse (" not in msg and "max_list (" not in msg  # only the odd one is named
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []  # the servers launched for this attempt were stopped


def test_teacher_with_another_bpe_tokenizer_is_refused(qwen2_bpe_dir, tmp_path):
    """Two BPEs of the same size trained on different text: same vocab size, other tokens and merges."""
    from bpe_fixtures import CORPUS
    from infra.models import init_model_dir
    from teachers.registry import TeacherRegistry

    (tmp_path / "other-corpus.txt").write_text(CORPUS.lower(), encoding="utf-8")
    other = init_model_dir("nano", tmp_path / "other", arch="qwen2", tokenizer="bpe",
                           train_text=[tmp_path / "other-corpus.txt"], vocab_size=512)
    srv = EngineProc(other, tmp_path / "teacher.log").start().wait_healthy()
    try:
        reg = TeacherRegistry({"wordmath": srv.url})
        assert reg.check_tokenizers(other) == {"wordmath": "match"}
        with pytest.raises(TokenizerMismatch) as err:
            reg.check_tokenizers(qwen2_bpe_dir)
    finally:
        srv.kill()
    msg = str(err.value)
    assert f"wordmath ({other})" in msg and "vocab size 512 vs student 512" in msg
    assert "tokenizer.json differs in model (merges)" in msg
