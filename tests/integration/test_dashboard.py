"""The MLflow dashboard of a finished run, against a real SQLite MLflow store: chart PNGs on the parent run drawn from
the children's metric histories, and the run's results on the registered student version. The chart geometry and the
Prefect summary text are checked as pure functions (unit)."""
from __future__ import annotations

import math

import pytest

from infra import charts
from infra.tracking import KIND_TAG, NOTE_TAG, TRAINING_KIND, Tracker
from tasks.dashboard import SCORES_IMAGE_KEY, SCORES_PNG, SPECIALIST_PNG, annotate_registered_student, log_charts
from tasks.report import summary_markdown

pytestmark = pytest.mark.integration

DOMAINS = {"sort": {"base": 0.2, "specialist": 0.8, "student": 0.6, "recovery": 0.75, "n_eval": 10},
           "copy": {"base": 0.5, "specialist": None, "student": 0.4, "recovery": None, "n_eval": 10}}
SUMMARY = {"n_domains": 2, "n_teachers": 2, "base_mean": 0.35, "specialist_mean": 0.8, "student_mean": 0.5,
           "mean_recovery": 0.75, "min_recovery": 0.75}


def report(registered: str | None = None) -> dict:
    return {"config": "configs/x.yaml", "run_id": "pid", "domains": DOMAINS, "summary": SUMMARY,
            "mlflow": {"tracking_uri": "sqlite:///x.db", "experiment": "e", "parent_run_id": "pid"},
            "timings_s": {}, "artifacts": {"registered_model": registered}}


@pytest.mark.unit
def test_score_bars_hand_derived():
    bars = charts.score_bars(DOMAINS)
    assert list(bars) == ["base", "specialist", "student"]
    assert bars["base"] == [0.2, 0.5] and bars["student"] == [0.6, 0.4]
    assert bars["specialist"][0] == 0.8 and math.isnan(bars["specialist"][1])
    # no specialist anywhere (specialists disabled): that stage has no bars at all
    assert list(charts.score_bars({"a": {"base": 0.1, "specialist": None, "student": 0.3}})) == ["base", "student"]


@pytest.mark.unit
def test_scores_figure_draws_one_bar_per_domain_and_stage():
    fig = charts.scores_figure(DOMAINS)
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches if not math.isnan(p.get_height()))
    assert heights == [0.2, 0.4, 0.5, 0.6, 0.8]  # 3 stages x 2 domains, minus copy's missing specialist
    assert [t.get_text() for t in ax.get_xticklabels()] == ["sort\nrec 0.75", "copy"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base", "specialist", "student"]
    charts.close(fig)


@pytest.mark.unit
def test_curves_sorted_by_step_and_nan_skipped():
    fig = charts.curves_figure({"a": [(3, 0.5), (1, 0.1), (2, float("nan"))], "b": []}, "t", "y")
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == [0.1, 0.5]
    charts.close(fig)


@pytest.mark.unit
def test_mlflow_link_in_prefect_summary():
    url = charts.mlflow_run_url("http://127.0.0.1:5000/", "7", "abc")
    assert url == "http://127.0.0.1:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    assert charts.mlflow_run_url(None, "7", "abc") is None and charts.mlflow_run_url("http://x", "7", None) is None
    md = summary_markdown(report("alloy-student/3"), url, [SCORES_PNG])
    assert f"**MLflow run:** [pid]({url})" in md and "`charts/scores_by_domain.png`" in md
    assert "Registered model: `alloy-student/3`" in md and "sort" in md
    # no UI address known: the run id and where the store is, and how to get a link
    assert "set ALLOY_MLFLOW_UI_URL" in summary_markdown(report(), None, [])


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(var, raising=False)
    return Tracker(runs_root=tmp_path / "runs", experiment="alloy-dash")


def test_charts_and_registered_version_from_what_the_stages_logged(tracker, tmp_path):
    pid = tracker.start_parent("dash")
    for dom, rewards in (("sort", [0.1, 0.3, 0.6]), ("copy", [0.5, 0.5, 0.6])):
        with tracker.child(f"specialist/{dom}") as run:
            for step, r in enumerate(rewards, start=1):
                run.log_metrics({"reward": r}, step=step * 5)
    with tracker.child("student") as run:
        for step in (1, 2, 3):
            run.log_metrics({"train/reward": 0.1 * step, "train/loss": 1.0 / step, "train/reverse_kl": 2.0 / step},
                            step=step)
        run.log_metrics({"eval/sort": 0.4}, step=2)
        model = tmp_path / "m"
        model.mkdir()
        (model / "config.json").write_text("{}")
        version = run.register_model(model, "alloy-dash-student", alias="candidate", description="first")
    # a resumed student re-logs step 3 with a new value: the curve keeps the later one, once
    with tracker.child("student") as run:
        run.log_metrics({"train/loss": 0.25}, step=3)
    kids = tracker.children()
    assert set(kids) == {"specialist/sort", "specialist/copy", "student"}
    assert tracker.metric_history(kids["student"], "train/loss") == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert tracker.metric_history(kids["specialist/sort"], "reward") == [(5, 0.1), (10, 0.3), (15, 0.6)]

    logged = log_charts(tracker, report())
    assert logged == [SCORES_PNG, SPECIALIST_PNG, "charts/student_reward.png", "charts/student_reverse_kl.png",
                      "charts/student_loss.png", "charts/student_eval.png"]
    listed = {a.path for a in tracker._client.list_artifacts(pid, "charts")}
    assert listed == set(logged)
    png = tracker._client.download_artifacts(pid, SCORES_PNG, str(tmp_path / "dl"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert log_charts(tracker, report()) == logged  # a retried publish overwrites, same paths
    # the score bars are also an MLflow image of a key, which the run's "Model metrics" tab shows
    images = [a.path for a in tracker._client.list_artifacts(pid, "images")]
    assert images and all(p.startswith(f"images/{SCORES_IMAGE_KEY}") for p in images), images

    annotate_registered_student(tracker, report(f"alloy-dash-student/{version}"))
    mv = tracker._client.get_model_version("alloy-dash-student", version)
    assert mv.tags["alloy.mean_recovery"] == "0.75" and mv.tags["alloy.recovery.sort"] == "0.75"
    assert mv.tags["alloy.student_mean"] == "0.5" and "alloy.recovery.copy" not in mv.tags
    assert "student mean 0.5" in mv.description and "mean recovery 0.75" in mv.description
    # the parent run links to the registered student: tags, and a description the MLflow UI renders as a link
    tags = tracker._client.get_run(pid).data.tags
    assert tags["alloy.registered_model.name"] == "alloy-dash-student"
    assert tags["alloy.registered_model.version"] == version
    assert tags["alloy.registered_model.uri"] == f"models:/alloy-dash-student/{version}"
    assert f"(#/models/alloy-dash-student/versions/{version})" in tags[NOTE_TAG]
    tracker.end()


def test_experiment_opens_on_the_training_view_and_a_users_kind_is_kept(tracker, tmp_path):
    """A new experiment gets the kind of MLflow's "Model training" view; an old one without a kind gets it at its
    first use by Alloy; a kind a user set stays."""
    client = tracker._client
    assert client.get_experiment(tracker.experiment_id).tags[KIND_TAG] == TRAINING_KIND
    old = client.create_experiment("made-before-kinds")
    assert KIND_TAG not in client.get_experiment(old).tags
    Tracker(runs_root=tmp_path / "runs", experiment="made-before-kinds")
    assert client.get_experiment(old).tags[KIND_TAG] == TRAINING_KIND
    mine = client.create_experiment("genai-by-choice", tags={KIND_TAG: "genai_development"})
    Tracker(runs_root=tmp_path / "runs", experiment="genai-by-choice")
    assert client.get_experiment(mine).tags[KIND_TAG] == "genai_development"
