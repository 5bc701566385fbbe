"""Hand-offs between flow runs on different workers (flows/handoff.py), the worker-side pull step
(alloy/deploy_steps.py) and the `model.path` check a storage-fed worker skips. The whole path with real servers
and two repository copies is tests/e2e/test_scaleout.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from alloy.deploy_steps import set_working_directory_from_env
from flows.handoff import dispatch_overrides, fetch_checkpoint
from infra.config import ConfigError, config_from_dict
from infra.storage import save_checkpoint

pytestmark = pytest.mark.unit


def test_dispatch_overrides_drop_the_local_root_and_pin_the_storage():
    ctx = SimpleNamespace(overrides=["base.steps=5", "run.root=/mine/runs", "run.storage=file:///x", "eval.n_eval=3"],
                          storage_url="s3://bucket/alloy")
    assert dispatch_overrides(ctx) == ["base.steps=5", "eval.n_eval=3", 'run.storage="s3://bucket/alloy"']
    cfg = config_from_dict({"domains": [{"name": "reverse"}], "run": {"storage": "s3://bucket/alloy"}})
    assert cfg.storage_url == "s3://bucket/alloy"


def test_fetch_checkpoint_local_dir_url_and_missing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert fetch_checkpoint(str(model), tmp_path / "unused", "t") == str(model)  # a local dir is used as is
    with pytest.raises(FileNotFoundError, match="not a directory on this worker"):
        fetch_checkpoint(str(tmp_path / "nope"), tmp_path / "x", "t")
    url = save_checkpoint(str(model), (tmp_path / "store" / "base" / "step-00000001").as_uri(), step=1)
    local = fetch_checkpoint(url, tmp_path / "pulled", "t")
    assert (tmp_path / "pulled" / "config.json").read_text() == "{}" and local == str(tmp_path / "pulled")
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint .* run\.storage to storage every worker"):
        fetch_checkpoint((tmp_path / "elsewhere").as_uri(), tmp_path / "y", "specialist reverse: base checkpoint")


def test_pull_step_resolves_on_the_worker(tmp_path, monkeypatch):
    from alloy import deploy_steps

    monkeypatch.chdir(os.getcwd())  # restored after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    elsewhere, repo = tmp_path / "elsewhere", tmp_path / "repo"
    elsewhere.mkdir(), (repo / "flows").mkdir(parents=True)
    monkeypatch.delenv("ALLOY_HOME", raising=False)
    # a worker started outside any copy of the repository: today's error, naming the variable and where it looked
    monkeypatch.setattr(deploy_steps, "worker_directories", lambda: [("$PWD", elsewhere)])
    with pytest.raises(RuntimeError, match=r"\$ALLOY_HOME is not set on this worker and the worker was not started "
                                           r"in a copy of the Alloy repository \(no flows/ in \[.*elsewhere'\]\)"):
        set_working_directory_from_env()
    # started in the repository (a stock `prefect worker start` there): that folder, the first that holds flows/
    monkeypatch.setattr(deploy_steps, "worker_directories",
                        lambda: [("the worker's working directory", elsewhere), ("$PWD", repo)])
    assert set_working_directory_from_env() == {"directory": str(repo.resolve())}
    assert os.getcwd() == str(repo.resolve()) and sys.path[0] == str(repo.resolve())
    # $ALLOY_HOME wins, and must name a copy of the repository
    monkeypatch.setenv("ALLOY_HOME", str(elsewhere))
    with pytest.raises(RuntimeError, match="not a copy of the Alloy repository.*no flows/"):
        set_working_directory_from_env()
    (elsewhere / "flows").mkdir()
    assert set_working_directory_from_env() == {"directory": str(elsewhere.resolve())}


def test_worker_directories_name_the_parents_folder(monkeypatch, tmp_path):
    """On Linux the first candidate is the parent process's working directory (for a flow run: its worker's)."""
    from alloy import deploy_steps

    monkeypatch.setenv("PWD", str(tmp_path))
    found = dict(deploy_steps.worker_directories())
    assert found["$PWD"] == tmp_path
    if Path("/proc/self/cwd").exists():
        assert found["the worker's working directory"] == Path(os.readlink(f"/proc/{os.getppid()}/cwd"))


def test_a_worker_that_never_reads_model_path_skips_its_check():
    data = {"domains": [{"name": "reverse"}], "model": {"path": "/models/only-on-the-base-worker"}}
    with pytest.raises(ConfigError, match="model.path"):
        config_from_dict(dict(data))
    assert config_from_dict(dict(data), check_model_path=False).model.path == "/models/only-on-the-base-worker"
    with pytest.raises(ConfigError, match="must not be empty"):  # still a config error everywhere
        config_from_dict({"domains": [{"name": "reverse"}], "model": {"path": " "}}, check_model_path=False)
