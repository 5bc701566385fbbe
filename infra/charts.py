"""PNG charts for the MLflow dashboard: per-domain scores (base / specialist / student) and learning curves.

Pure functions from plain data to matplotlib figures (Agg backend, no display); the caller logs them.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

STAGES = ("base", "specialist", "student")
COLORS = {"base": "#9e9e9e", "specialist": "#1f77b4", "student": "#ff7f0e"}


def score_bars(domains: dict[str, dict]) -> dict[str, list[float]]:
    """{stage: [score per domain, in the order of `domains`]}; a missing score is NaN (drawn as no bar).

    Stages with no score in any domain (e.g. specialists disabled) are left out."""
    out = {}
    for stage in STAGES:
        vals = [float(r[stage]) if r.get(stage) is not None else math.nan for r in domains.values()]
        if any(not math.isnan(v) for v in vals):
            out[stage] = vals
    return out


def scores_figure(domains: dict[str, dict], title: str = "Per-domain eval score") -> Figure:
    """Grouped bars: one group per domain, one bar per stage; recovery (student / specialist) under each name."""
    names = list(domains)
    bars = score_bars(domains)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2))
    width = 0.8 / max(1, len(bars))
    for i, (stage, vals) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, vals, width, label=stage, color=COLORS[stage])
    labels = []
    for n in names:
        rec = domains[n].get("recovery")
        labels.append(f"{n}\nrec {rec:.2f}" if rec is not None else n)
    ax.set_xticks(range(len(names)), labels, rotation=45 if len(names) > 6 else 0, ha="right" if len(names) > 6 else "center",
                  fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score (greedy, eval split)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def curves_figure(series: dict[str, list[tuple[int, float]]], title: str, ylabel: str) -> Figure:
    """One line per series (label → [(step, value)]), sorted by step; NaN points skipped."""
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for label, pts in series.items():
        pts = sorted((s, v) for s, v in pts if not math.isnan(v))
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=label, marker="." if len(pts) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if series:
        ax.legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def close(fig: Figure) -> None:
    plt.close(fig)


# The MLflow UI (3.x) shows every experiment in a global view, GenAI unless the user switched it (or the URL names
# one): links of Alloy's open the "Model training" view, where runs, their metrics and charts are.
TRAINING_VIEW = "?workflowType=machine_learning"


def mlflow_run_url(ui_url: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI page of a run (in the UI's training view), or None when the UI address or the run is unknown."""
    if not (ui_url and experiment_id and run_id):
        return None
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}"
