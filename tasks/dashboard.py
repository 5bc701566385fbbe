"""The MLflow side of a finished run: chart artifacts on the parent run (the per-domain score bars also as an MLflow
image, which the run's "Model metrics" tab shows), results on the registered student version, and a link from the
parent run to that version (tags and the run's description).

Called by `publish_report` once the report exists. Everything here reads what the stages already logged (child runs'
metric histories), so a retried publish redraws the same charts (an artifact of the same path is overwritten).
"""
from __future__ import annotations

import logging
import os

from infra import charts
from infra.tracking import NOTE_TAG

log = logging.getLogger("alloy")

SCORES_PNG = "charts/scores_by_domain.png"
SCORES_IMAGE_KEY = "scores_by_domain"  # the same chart as an MLflow image (the run's "Model metrics" tab)
SPECIALIST_PNG = "charts/specialist_reward.png"
STUDENT_PNG = "charts/student_{name}.png"
# student metric → (file name part, title, y label)
STUDENT_CURVES = {"train/reward": ("reward", "Student: verifier reward of its own samples", "mean reward"),
                  "train/reverse_kl": ("reverse_kl", "Student: reverse KL to the routed teacher", "KL (nats/token)"),
                  "train/loss": ("loss", "Student: OPD loss", "loss")}


def mlflow_ui_url() -> str | None:
    """The MLflow UI address (set by `alloy up` for its worker; users can export it for their own UI)."""
    return os.environ.get("ALLOY_MLFLOW_UI_URL") or None


def _log(tracker, fig, path: str, logged: list[str]) -> None:
    try:
        tracker.log_figure(fig, path)
        logged.append(path)
    finally:
        charts.close(fig)


def log_charts(tracker, report: dict) -> list[str]:
    """Draw and log the per-domain score bars and the learning curves; returns the artifact paths logged."""
    if getattr(tracker, "run_id", None) is None:
        return []
    logged: list[str] = []
    fig = charts.scores_figure(report["domains"], title=f"Per-domain eval score ({report['config']})")
    try:
        tracker.log_image(fig, SCORES_IMAGE_KEY)
    except Exception as exc:  # noqa: BLE001 - the artifact below still carries the chart
        log.warning("MLflow: the score chart as an image failed (%s: %s); it is still a run artifact",
                    type(exc).__name__, exc)
    _log(tracker, fig, SCORES_PNG, logged)
    kids = tracker.children()
    spec = {name.split("/", 1)[1]: tracker.metric_history(rid, "reward")
            for name, rid in kids.items() if name.startswith("specialist/")}
    spec = {d: pts for d, pts in spec.items() if pts}
    if spec:
        _log(tracker, charts.curves_figure(spec, "Specialists: training reward", "mean reward"), SPECIALIST_PNG,
             logged)
    if "student" in kids:
        for key, (name, title, ylabel) in STUDENT_CURVES.items():
            pts = tracker.metric_history(kids["student"], key)
            if pts:
                _log(tracker, charts.curves_figure({key: pts}, title, ylabel), STUDENT_PNG.format(name=name), logged)
        evals = {k.split("/", 1)[1]: tracker.metric_history(kids["student"], k)
                 for k in (f"eval/{d}" for d in report["domains"])}
        evals = {d: pts for d, pts in evals.items() if pts}
        if evals:
            _log(tracker, charts.curves_figure(evals, "Student: eval score during distillation", "score"),
                 STUDENT_PNG.format(name="eval"), logged)
    log.info("MLflow charts: %s", ", ".join(logged))
    return logged


def student_link(name: str, version: str) -> dict[str, str]:
    """Tags of the parent run that point at the registered student version, and its description (markdown, a link
    that the MLflow UI opens on the version's page)."""
    uri = f"models:/{name}/{version}"
    return {"alloy.registered_model.name": name, "alloy.registered_model.version": str(version),
            "alloy.registered_model.uri": uri,
            NOTE_TAG: f"Registered student: [{name} version {version}](#/models/{name}/versions/{version}) "
                      f"(`{uri}`, alias `candidate`)"}


def annotate_registered_student(tracker, report: dict) -> None:
    """Put the run's results on the registered student version (tags: means, recovery; a description line), and
    link the parent run to that version (`student_link`)."""
    ref = (report.get("artifacts") or {}).get("registered_model")
    if not ref or "/" not in ref:
        return
    name, version = ref.rsplit("/", 1)
    if getattr(tracker, "run_id", None) is not None:
        tracker.set_tags(student_link(name, version))
    s = report["summary"]
    tags = {f"alloy.{k}": s[k] for k in ("base_mean", "specialist_mean", "student_mean", "mean_recovery",
                                          "min_recovery", "n_teachers") if s.get(k) is not None}
    tags.update({f"alloy.recovery.{d}": r["recovery"] for d, r in report["domains"].items()
                 if r.get("recovery") is not None})
    desc = (f"OPD student of {s['n_domains']} domains from config {report['config']}: student mean "
            f"{s.get('student_mean')}, specialist mean {s.get('specialist_mean')}, base mean {s.get('base_mean')}, "
            f"mean recovery {s.get('mean_recovery')}, min recovery {s.get('min_recovery')} "
            f"(pipeline run {report.get('run_id')})")
    tracker.update_model_version(name, version, tags=tags, description=desc)
