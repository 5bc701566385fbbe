"""Bad input is refused with exit code 2 naming what is wrong: a `model.path` that does not exist, a report.json of
the wrong shape; and the CLI names itself (`alloy --version`, `alloy <cmd> --help`)."""
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pandas as pd
import pytest

from infra.config import ConfigError, config_from_dict
from infra.report import build_report, report_problems, resources_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
ALLOY = str(Path(sys.executable).parent / "alloy")  # the console script of this venv (.venv/bin/alloy)


def alloy(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([ALLOY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def with_model_path(path: str):
    return config_from_dict({"domains": [{"name": "reverse"}], "model": {"path": path}})


@pytest.mark.parametrize("path", ["/nonexistent/model", "./no-such-dir", "~/no-such-alloy-model", "a/b/c", " "])
def test_a_local_model_path_that_does_not_exist_is_refused(path):
    with pytest.raises(ConfigError) as err:
        with_model_path(path)
    assert "model.path" in str(err.value)


def test_model_path_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "weights.bin").write_text("x")
    assert with_model_path(str(tmp_path / "models")).model.path == str(tmp_path / "models")  # a directory
    assert with_model_path("Qwen/Qwen2-0.5B").model.path == "Qwen/Qwen2-0.5B"  # may be a Hub id: --dry-run checks it
    with pytest.raises(ConfigError, match=r"model\.path.*no such directory: models/missing"):
        with_model_path("models/missing")  # `models` is a directory here: a local path
    with pytest.raises(ConfigError, match=r"model\.path.*weights\.bin is not a directory"):
        with_model_path("weights.bin")


def test_report_problems_name_the_key_path():
    good = build_report(config="c.yaml", run_id="r1", mlflow={}, domains=["reverse", "copy"],
                        scores=pd.DataFrame([{"domain": "reverse", "stage": "base", "score": 0.5, "n_eval": 10}]))
    assert report_problems(json.loads(json.dumps(good))) == []
    bad = json.loads(json.dumps(good))
    del bad["summary"]["mean_recovery"]
    bad["domains"]["copy"]["student"] = "0.5"
    bad["timings_s"] = [1.0]
    bad["guard"]["blocked"] = True
    assert report_problems(bad) == [
        "domains.copy.student: must be a number or null, got a string",
        "summary.mean_recovery: missing (must be a number or null)",
        "timings_s: must be an object, got a list",
        "guard.blocked: must be an integer, got a boolean"]
    assert report_problems([]) == ["<top level>: must be an object, got a list"]
    assert good["resources"] == {s: {"world_size": None} for s in ("base", "specialists", "student")}
    bad = json.loads(json.dumps(good))
    bad["resources"]["student"]["world_size"] = 2.0
    del bad["resources"]["base"]
    assert report_problems(bad) == ["resources.base: missing (must be an object)",
                                    "resources.student.world_size: must be an integer or null, got a float"]


def test_report_resources_come_from_the_trainers_results():
    res = resources_of({"world_size": 2}, [{"world_size": 2}, {"world_size": 1}, {}], {"world_size": 2})
    assert res == {"base": {"world_size": 2}, "specialists": {"world_size": 2}, "student": {"world_size": 2}}
    assert resources_of(None, [], None) == {s: {"world_size": None} for s in ("base", "specialists", "student")}
    report = build_report(config="c", run_id="r", mlflow={}, domains=[], scores=pd.DataFrame(), resources=res)
    assert report["resources"] == res and report_problems(report) == []


def test_cli_report_of_the_wrong_shape_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": "c", "run_id": "r", "domains": [], "summary": {"n_domains": 3}}))
    proc = alloy("report", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert "domains: must be an object, got a list" in proc.stderr
    assert "summary.mean_recovery: missing" in proc.stderr and proc.stdout == ""


def test_cli_version_and_serve_help_name_alloy():
    proc = alloy("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"alloy {version('alloy-opd')}"
    proc = alloy("serve", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: alloy serve ")
    assert "engine.server" not in proc.stdout


def test_every_subcommand_help_names_itself():
    import argparse

    from alloy.cli import build_parser

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> int:
        n = 0
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name == "serve":  # dispatched to the server's own parser (tested above)
                        continue
                    assert sub.format_usage().startswith(f"usage: {' '.join(words + [name])} "), name
                    n += 1 + walk(sub, words + [name])
        return n

    assert walk(build_parser(), ["alloy"]) >= 8


@pytest.mark.parametrize("cmd", ["config", "run"])
def test_cli_nonexistent_model_path_exits_2_naming_field_and_path(cmd):
    proc = alloy(cmd, SMOKE, "--set", "model.path=/nonexistent")
    assert proc.returncode == 2, proc.stderr
    assert "model.path" in proc.stderr and "/nonexistent" in proc.stderr


def test_alloy_config_refuses_a_missing_local_dataset_path(capsys):
    from alloy.cli import main

    example = str(Path(SMOKE).parent / "dataset-example.yaml")
    code = main(["config", example, "--set", "model.path=" + str(Path(SMOKE).parent),
                 "--set", "domains.1.dataset.path=/no/such/quiz.parquet"])
    err = capsys.readouterr().err
    assert code == 2 and "domains.1.dataset.path" in err and "/no/such/quiz.parquet" in err, err


@pytest.mark.parametrize("path", ["./no-such-model", "~/no-such-alloy-model", "~/", "/no/such/model", "a/b/c",
                                  "models/missing", "org/name/", "my model", "org/na..me"])
def test_alloy_config_refuses_a_missing_local_model_path(path, tmp_path, monkeypatch, capsys):
    """`alloy config` (in-process) exits 2 naming model.path and the path; `org/name` may be a Hub id and passes."""
    from alloy.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # `~/` names a directory that does not exist
    (tmp_path / "models").mkdir()  # so `models/missing` is a local path, not a Hub id
    assert main(["config", SMOKE, "--set", f"model.path={path}"]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and path in err, err


def test_alloy_config_accepts_a_hub_id_and_an_existing_directory(tmp_path, monkeypatch, capsys):
    from alloy.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    for path in ("Qwen/Qwen2-0.5B", "gpt2", str(tmp_path / "ckpt"), "ckpt"):
        assert main(["config", SMOKE, "--set", f"model.path={path}"]) == 0, capsys.readouterr().err
        assert f"path: {path}" in capsys.readouterr().out


def test_a_report_carries_what_ran_where_and_prints_it():
    """report.json's `meta` (infra.hostinfo.run_meta at the start, finish_meta at the end): the figure's commit,
    host class, load, command and overrides travel with it; `alloy report` prints them; a report without it (before
    2026-11-30) still reads."""
    from infra.hostinfo import finish_meta, run_meta
    from infra.report import render_table

    start = run_meta(config="c.yaml", overrides=["run.seed=1"])
    assert start["config"] == "c.yaml" and start["overrides"] == ["run.seed=1"] and len(start["loadavg_start"]) == 3
    assert start["cpu_model"] and start["cpu_count"] >= 1 and start["argv"] == sys.argv
    meta = finish_meta(start)
    assert "ended_at" not in start and meta["ended_at"] >= meta["started_at"] and len(meta["loadavg_end"]) == 3
    meta.update(commit="0123456789abcdef", dirty=True, cpu_model="AMD EPYC", cpu_count=2,
                loadavg_start=[3.21, 0, 0], loadavg_end=[0.5, 0, 0])
    rep = build_report(config="c.yaml", run_id="r", mlflow={}, domains=[], scores=pd.DataFrame(), meta=meta)
    assert rep["meta"] == meta and rep["meta"] is not meta and report_problems(json.loads(json.dumps(rep))) == []
    line = render_table(rep).splitlines()[-1]
    assert line.startswith("ran: commit 0123456789 (dirty) on AMD EPYC (2 CPUs), load 3.2 → 0.5, 20"), line
    old = build_report(config="c.yaml", run_id="r", mlflow={}, domains=[], scores=pd.DataFrame())
    assert old["meta"] == {} and "ran:" not in render_table(old)
