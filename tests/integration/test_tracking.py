"""Tracking against a real MLflow SQLite store in tmp (one store per module: creating one costs seconds).

The pure helpers (flatten_config, redact, resolve_tracking_uri) are also marked `unit`: they need no MLflow.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pandas as pd
import pytest

from infra.tracking import (CHILD_TAG, NoopTracker, Tracker, flatten_config, make_tracker, mask_url, redact,
                            resolve_tracking_uri)

pytestmark = pytest.mark.integration

SECRETS = ["sk-live-SECRET-123", "S3CR3T-aws", "hunter2", "hf_TOKEN_abc", "pg-pass-xyz", "ghp_listed_token"]
CONFIG = {
    "run": {"name": "demo", "seed": 0, "resume": True, "storage": None},
    "engine": {"api_key": SECRETS[0], "threads": 1, "sglang_args": {}},
    "storage": {"AWS_SECRET_ACCESS_KEY": SECRETS[1], "region": "us-east-1"},
    "auth": {"Password": SECRETS[2], "hf_token": SECRETS[3], "tokens": [SECRETS[5], 12345]},
    "tracking": {"uri": f"postgresql://alloy:{SECRETS[4]}@db:5432/mlflow"},
    "domains": [{"name": "math", "difficulty": 2}, {"name": "code", "impl": None}],
    "eval": {"max_new_tokens": 16, "n_eval": 100},
    "model": {"tokenizer_path": "/models/tok"},
}


# --------------------------------------------------------------------------------------------- pure helpers


@pytest.mark.unit
def test_flatten_config_hand_derived():
    assert flatten_config({"a": {"b": 1, "c": [True, None]}, "d": {}, "e": [], "f": 0.5, "g": "x"}) == {
        "a.b": "1", "a.c.0": "true", "a.c.1": "null", "d": "{}", "e": "[]", "f": "0.5", "g": "x"}
    flat = flatten_config(CONFIG)
    assert flat["domains.0.name"] == "math" and flat["domains.1.impl"] == "null"
    assert flat["run.resume"] == "true" and flat["engine.sglang_args"] == "{}"
    assert len(flat) == 21 and flat["auth.tokens.1"] == "12345"


@pytest.mark.unit
def test_redact_hand_derived():
    flat = {"engine.api_key": "a", "x.SECRET": "b", "db.Password": "c", "hf_token": "d", "apikey": "e",
            "auth.tokens.0": "f", "tokenizer_key": "g", "eval.max_new_tokens": "16", "tokens_per_s": 12.5,
            "max_tokens": "1e3", "model.tokenizer_path": "/t", "keep_last": "3", "n": 1,
            "uri": "https://user:pw@host/x", "plain": "https://host/x", "specialists.max_new_tokens": "null",
            "hf_token_unset": None}
    assert redact(flat) == {"engine.api_key": "***", "x.SECRET": "***", "db.Password": "***", "hf_token": "***",
                            "apikey": "***", "auth.tokens.0": "***", "tokenizer_key": "***",
                            "eval.max_new_tokens": "16", "tokens_per_s": 12.5, "max_tokens": "1e3",
                            "model.tokenizer_path": "/t", "keep_last": "3", "n": 1,
                            "uri": "https://user:***@host/x", "plain": "https://host/x",
                            "specialists.max_new_tokens": "null", "hf_token_unset": None}
    assert mask_url("see postgresql://u:p@h:1/db and s3://b/k") == "see postgresql://u:***@h:1/db and s3://b/k"
    red = redact(flatten_config(CONFIG))
    assert not [v for v in red.values() if any(s in v for s in SECRETS)]


@pytest.mark.unit
def test_resolve_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("runs") == f"sqlite:///{tmp_path}/runs/mlflow.db"  # absolute: sqlite:////tmp/…
    assert resolve_tracking_uri("runs", "http://mlflow:5000") == "http://mlflow:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert resolve_tracking_uri("runs", "http://mlflow:5000") == "http://from-env:5000"


# --------------------------------------------------------------------------------------------- MLflow store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module: (runs_root, tracking_uri)."""
    root = tmp_path_factory.mktemp("mlflow-runs")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
            mp.delenv(var, raising=False)
        t = Tracker(runs_root=root, experiment="alloy-test")
        yield root, t.tracking_uri


@pytest.fixture
def tracker(store, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    return Tracker(runs_root=store[0], experiment="alloy-test")


def children(t: Tracker, parent: str):
    return t._client.search_runs([t.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")


def test_store_location(store, tracker):
    root, uri = store
    assert uri == f"sqlite:///{root}/mlflow.db" and (root / "mlflow.db").is_file()
    pid = tracker.start_parent("loc")
    assert tracker._client.get_run(pid).info.artifact_uri.startswith((root / "mlartifacts").as_uri())
    tracker.end()


def test_parent_and_two_children_logging_from_threads(tracker):
    import mlflow

    pid = tracker.start_parent("pipeline", tags={"alloy.config": "configs/smoke.yaml"})
    errors = []

    def stage(name: str, scale: float):
        try:
            with tracker.child(name, tags={"stage": "specialist"}) as run:
                run.log_params({"domain": name.split("/")[1], "lr": 1e-3})
                for step in range(10):
                    run.log_metrics({"loss": scale * step, "acc": None}, step=step)
        except Exception as exc:  # surfaced below: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(f"specialist/{d}", s)) for d, s in (("math", 1.0), ("code", 2.0))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    tracker.log_metrics({"summary/mean": 0.5})
    tracker.end("FINISHED")

    runs = {r.data.tags[CHILD_TAG]: r for r in children(tracker, pid)}
    assert sorted(runs) == ["specialist/code", "specialist/math"]
    for name, scale in (("specialist/math", 1.0), ("specialist/code", 2.0)):
        r = runs[name]
        assert r.info.status == "FINISHED" and r.info.run_name == name and r.data.tags["stage"] == "specialist"
        assert r.data.params == {"domain": name.split("/")[1], "lr": "0.001"}
        hist = tracker._client.get_metric_history(r.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in hist) == [(s, scale * s) for s in range(10)]
        assert "acc" not in r.data.metrics
    parent = tracker._client.get_run(pid)
    assert parent.info.status == "FINISHED" and parent.data.metrics == {"summary/mean": 0.5}
    assert parent.data.tags["alloy.config"] == "configs/smoke.yaml"
    assert mlflow.active_run() is None  # nothing leaked into the fluent, thread-local run stack


def test_failed_child_then_retry_continues_the_same_run(tracker):
    pid = tracker.start_parent("retry")
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.child("student", tags={"attempt": 1}) as run:
            run.log_metrics({"loss": 3.0}, step=0)
            first = run.run_id
            raise RuntimeError("boom")
    assert tracker._client.get_run(first).info.status == "FAILED"
    assert tracker.find_child(pid, "student") == first and tracker.find_child(pid, "nope") is None

    with tracker.child("student", tags={"attempt": 2}) as run:  # the Prefect retry of the stage
        assert run.run_id == first
        assert tracker._client.get_run(first).info.status == "RUNNING"
        run.log_metrics({"loss": 2.0}, step=1)
    h = tracker.resume(first)  # e.g. from another process that only knows the run id
    h.log_metrics({"loss": 1.0}, step=2)
    h.end()
    r = tracker._client.get_run(first)
    assert r.info.status == "FINISHED" and r.data.tags["attempt"] == "2"
    hist = sorted(tracker._client.get_metric_history(first, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in hist] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert len(children(tracker, pid)) == 1  # no duplicate run
    with tracker.child("student", resume=False) as fresh:
        assert fresh.run_id != first
    tracker.end()


def test_log_config_redacts_every_secret(tracker):
    pid = tracker.start_parent("config")
    tracker.log_config(CONFIG)
    params = tracker._client.get_run(pid).data.params
    assert len(params) == 21
    assert params["engine.api_key"] == "***" and params["storage.AWS_SECRET_ACCESS_KEY"] == "***"
    assert params["auth.Password"] == "***" and params["auth.hf_token"] == "***" and params["auth.tokens.0"] == "***"
    assert params["tracking.uri"] == "postgresql://alloy:***@db:5432/mlflow"
    assert params["eval.max_new_tokens"] == "16" and params["domains.1.name"] == "code"
    leaked = [(k, v) for k, v in params.items() if any(s in v or s in k for s in SECRETS)]
    assert leaked == []
    tracker.end()


def test_artifacts_table_dict_figure(tracker, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pid = tracker.start_parent("artifacts")
    df = pd.DataFrame({"domain": ["math", "code"], "stage": ["base", "base"], "score": [0.25, 0.5], "n_eval": [4, 8]})
    tracker.log_table(df, "scores.json")
    tracker.log_dict({"a": 1}, "report.json")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    tracker.log_figure(fig, "plots/curve.png")
    plt.close(fig)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    tracker.log_artifact(tmp_path / "d", "dir")
    tracker.log_artifact(tmp_path / "d" / "x.txt")

    local = tracker._client.download_artifacts(pid, "scores.json", str(tmp_path / "dl"))
    back = pd.read_json(local, orient="split")
    pd.testing.assert_frame_equal(back, df)
    names = {a.path for a in tracker._client.list_artifacts(pid)}
    assert names == {"scores.json", "report.json", "plots", "dir", "x.txt"}
    assert [a.path for a in tracker._client.list_artifacts(pid, "plots")] == ["plots/curve.png"]
    tracker.end()


def test_register_model_alias_resolves(tracker, tmp_path, monkeypatch):
    import mlflow

    model = tmp_path / "student"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x00\x01weights")
    pid = tracker.start_parent("register")
    v1 = tracker.register_model(model, "alloy-test-student", alias="candidate", description="OPD student",
                                tags={"domains": "math,code"})
    (model / "model.safetensors").write_bytes(b"v2 weights")
    with tracker.child("student-v2") as run:
        v2 = run.register_model(model, "alloy-test-student", alias="candidate")
    assert (v1, v2) == ("1", "2")

    mv = tracker._client.get_model_version_by_alias("alloy-test-student", "candidate")
    assert mv.version in (2, "2") and mv.run_id != pid
    v1_info = tracker._client.get_model_version("alloy-test-student", "1")
    assert v1_info.description == "OPD student" and v1_info.tags == {"domains": "math,code"} and v1_info.run_id == pid
    # models:/ URIs resolve through the registry; point MLflow's globals at the test store for this lookup only
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracker.tracking_uri)
    got = mlflow.artifacts.download_artifacts("models:/alloy-test-student@candidate", dst_path=str(tmp_path / "dl"))
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == b"v2 weights", got
    tracker.end()


def test_register_transformers_flavor_loads_a_pipeline(tracker, tiny_model_dir, tmp_path, monkeypatch):
    """The student as the pipeline registers it (tasks/distill.py): mlflow.transformers.load_model on the alias gives
    a text-generation pipeline that generates; a folder that is no checkpoint falls back to plain files, tagged so."""
    import mlflow.transformers

    pid = tracker.start_parent("register-transformers")
    with tracker.child("student") as run:
        v = run.register_model(tiny_model_dir, "alloy-test-hf-student", alias="candidate", flavor="transformers",
                               description="OPD student", tags={"alloy.loss": "topk_kl"})
    mv = tracker._client.get_model_version_by_alias("alloy-test-hf-student", "candidate")
    assert str(mv.version) == v and mv.run_id != pid and mv.description == "OPD student"
    assert mv.tags == {"alloy.loss": "topk_kl", "alloy.mlflow_flavor": "transformers"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracker.tracking_uri)
    pipe = mlflow.transformers.load_model("models:/alloy-test-hf-student@candidate")
    assert pipe.task == "text-generation"
    out = pipe("abc", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = pipe.tokenizer(out, add_special_tokens=False)["input_ids"]
    assert isinstance(out, str) and 1 <= len(ids) <= 4, out  # 4 new tokens (fewer if EOS), the char tokenizer's

    junk = tmp_path / "not-a-checkpoint"
    junk.mkdir()
    (junk / "notes.txt").write_text("no config.json here")
    v2 = tracker.register_model(junk, "alloy-test-hf-student", alias="candidate", flavor="transformers")
    assert tracker._client.get_model_version("alloy-test-hf-student", v2).tags == {"alloy.mlflow_flavor": "files"}
    got = mlflow.artifacts.download_artifacts("models:/alloy-test-hf-student@candidate", dst_path=str(tmp_path / "dl"))
    assert sorted(p.name for p in Path(got).iterdir()) == ["notes.txt"]
    with pytest.raises(ValueError, match="flavor must be 'files' or 'transformers', got 'onnx'"):
        tracker.register_model(junk, "alloy-test-hf-student", flavor="onnx")
    tracker.end()


def test_unbound_tracker_says_what_to_do(tracker):
    with pytest.raises(RuntimeError, match=r"log_metrics: no run bound; call start_parent\(\) or resume\(\) first"):
        tracker.log_metrics({"x": 1.0})
    tracker.start_parent("bad-metric")
    with pytest.raises(TypeError, match="metric 'x' is not a number: 'abc'"):
        tracker.log_metrics({"x": "abc"})
    with pytest.raises(ValueError, match="status must be one of"):
        tracker.end("DONE")
    tracker.end()


def test_noop_tracker_does_nothing(tmp_path, monkeypatch, store):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for t in (NoopTracker(), make_tracker(1, runs_root=tmp_path / "r"), make_tracker(0, enabled=False)):
        assert isinstance(t, NoopTracker)
        assert t.start_parent("x", tags={"a": 1}) is None and t.tracking_uri is None
        with t.child("c", tags={"b": 2}) as c:
            assert c.log_metrics({"m": 1.0}, step=1) is None
            c.log_params({"p": 1})
            c.log_config({"api_key": "s"})
            c.log_table(pd.DataFrame({"a": [1]}), "t.json")
            c.log_dict({}, "d.json")
            c.log_figure(None, "f.png")
            c.log_artifact(tmp_path)
            c.set_tags({"t": 1})
        assert t.register_model(tmp_path, "m", alias="candidate") is None
        assert t.resume("abc") is t and t.find_child("p", "c") is None
        t.end("FAILED")
    assert list(tmp_path.iterdir()) == []  # no store, no artifacts, no runs dir
    assert mlflow.active_run() is None
    real = make_tracker(0, runs_root=store[0], experiment="alloy-test")
    assert isinstance(real, Tracker) and real.tracking_uri == store[1]


@pytest.mark.unit
def test_system_metrics_on_a_gpu_only_unless_mlflow_says(monkeypatch):
    from infra.tracking import system_metrics_wanted

    assert system_metrics_wanted(True, env={}) and not system_metrics_wanted(False, env={})  # CI: off
    assert system_metrics_wanted(False, env={"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true"})
    assert not system_metrics_wanted(True, env={"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"})
    assert NoopTracker().start_system_metrics() is None


def test_system_metrics_are_logged_to_the_run_and_stop(tracker, monkeypatch, caplog):
    import importlib.util
    import time

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    run_id = tracker.start_parent("system-metrics")
    with caplog.at_level("WARNING", logger="alloy.tracking"):
        monitor = tracker.start_system_metrics()
    assert monitor is not None
    if importlib.util.find_spec("pynvml") is None:  # no GPU metrics: said once, the rest is logged
        assert "pynvml" in caplog.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            k.startswith("system/") for k in tracker._client.get_run(run_id).data.metrics):
        time.sleep(0.2)
    monitor.finish()
    keys = set(tracker._client.get_run(run_id).data.metrics)
    assert "system/cpu_utilization_percentage" in keys, keys
    tracker.end()
