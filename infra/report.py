"""`report.json`: the pipeline's contract with checks and dashboards (see DESIGN.md, "The report contract").

`build_report` turns the per-domain score table (one row per domain and stage) plus run facts into the report
dict; stages that have not run yet are `null`. `render_table` prints a report for humans (`alloy report PATH`).
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

STAGES = ("base", "specialist", "student")
TIMING_KEYS = ("base", "specialists", "teachers_up", "distill", "eval", "total")


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return round(sum(xs) / len(xs), 6) if xs else None


def domain_table(scores: pd.DataFrame, domains: list[str]) -> dict[str, dict[str, Any]]:
    """{domain: {base, specialist, student, recovery, n_eval}} from long-format scores (domain, stage, score, n_eval)."""
    out: dict[str, dict[str, Any]] = {}
    for dom in domains:
        row: dict[str, Any] = {s: None for s in STAGES}
        sub = scores[scores["domain"] == dom] if len(scores) else scores
        n_eval = None
        for _, r in sub.iterrows():
            if r["stage"] in STAGES:
                row[r["stage"]] = round(float(r["score"]), 6)
                n_eval = int(r["n_eval"])
        spec, stud = row["specialist"], row["student"]
        # recovery = student / specialist; undefined when the specialist scores 0
        row["recovery"] = round(stud / spec, 6) if (spec and stud is not None) else None
        row["n_eval"] = n_eval
        out[dom] = row
    return out


def build_report(*, config: str, run_id: str, mlflow: dict, scores: pd.DataFrame, domains: list[str],
                 n_teachers: int = 0, timings_s: dict | None = None, throughput: dict | None = None,
                 guard: dict | None = None, artifacts: dict | None = None) -> dict:
    table = domain_table(scores, domains)
    recoveries = [v["recovery"] for v in table.values() if v["recovery"] is not None]
    summary = {
        "n_domains": len(domains),
        "n_teachers": n_teachers,
        "base_mean": _mean([v["base"] for v in table.values()]),
        "specialist_mean": _mean([v["specialist"] for v in table.values()]),
        "student_mean": _mean([v["student"] for v in table.values()]),
        "mean_recovery": _mean(recoveries),
        "min_recovery": round(min(recoveries), 6) if recoveries else None,
    }
    timings = {k: None for k in TIMING_KEYS}
    timings.update({k: round(float(v), 3) for k, v in (timings_s or {}).items()})
    return {
        "config": config,
        "run_id": run_id,
        "mlflow": mlflow,
        "domains": table,
        "summary": summary,
        "timings_s": timings,
        "throughput": {"distill_sampled_tokens_per_s": None, "teacher_scored_tokens_per_s": None, **(throughput or {})},
        "guard": {"tool_calls": 0, "flagged": 0, "blocked": 0, **(guard or {})},
        "artifacts": {"student_checkpoint": None, "registered_model": None, **(artifacts or {})},
    }


def _fmt(x: Any) -> str:
    return "—" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def render_table(report: dict) -> str:
    """A plain-text table of a report: one line per domain, then the summary and timings."""
    header = f"{'domain':<16}{'base':>8}{'special.':>10}{'student':>9}{'recovery':>10}{'n_eval':>8}"
    lines = [f"report of run {report.get('run_id')}  (config {report.get('config')})", header, "-" * len(header)]
    for dom, r in report.get("domains", {}).items():
        lines.append(f"{dom:<16}{_fmt(r.get('base')):>8}{_fmt(r.get('specialist')):>10}{_fmt(r.get('student')):>9}"
                     f"{_fmt(r.get('recovery')):>10}{_fmt(r.get('n_eval')):>8}")
    s = report.get("summary", {})
    lines.append("-" * len(header))
    lines.append(f"{'mean':<16}{_fmt(s.get('base_mean')):>8}{_fmt(s.get('specialist_mean')):>10}"
                 f"{_fmt(s.get('student_mean')):>9}{_fmt(s.get('mean_recovery')):>10}")
    lines.append(f"domains {s.get('n_domains')}, teachers {s.get('n_teachers')}, min recovery {_fmt(s.get('min_recovery'))}")
    t = report.get("timings_s", {})
    lines.append("timings (s): " + ", ".join(f"{k} {_fmt(v)}" for k, v in t.items()))
    ml = report.get("mlflow", {})
    if ml:
        lines.append(f"mlflow: {ml.get('tracking_uri')}  experiment {ml.get('experiment')}  run {ml.get('parent_run_id')}")
    return "\n".join(lines)
