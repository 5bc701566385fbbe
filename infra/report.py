"""`report.json`: the pipeline's contract with checks and dashboards (docs/architecture.md, "The report contract").

`build_report` turns the per-domain score table (one row per domain and stage) plus run facts into the report
dict; stages that have not run yet are `null`. `render_table` prints a report for humans (`alloy report PATH`).
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

STAGES = ("base", "specialist", "student")
RESOURCE_STAGES = ("base", "specialists", "student")
TIMING_KEYS = ("base", "specialists", "teachers_up", "distill", "eval", "total")


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return round(sum(xs) / len(xs), 6) if xs else None


def _num(x: Any) -> float | None:
    """A score cell as report JSON: a rounded float, or None for a missing cell / NaN."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else round(x, 6)


def domain_table(scores: pd.DataFrame, domains: list[str]) -> dict[str, dict[str, Any]]:
    """{domain: {base, specialist, student, recovery, n_eval, raw, hacks_per_100, reward, reward_unparseable}} from
    long-format scores (domain, stage, score, n_eval[, raw_score, hacks_per_100, reward_score, reward_unparseable]).
    The stage columns are the clean scores; `raw` and `hacks_per_100` ({stage: value}) are a tool domain's raw
    scores and hack attempts per 100 eval episodes (`domains/evaluate.py`), null for a plain domain; `reward` and
    `reward_unparseable` ({stage: value}) a model-rewarded domain's mean model reward (σ of the reward model's raw
    score, or the judge's score) and its unparsed judge answers, null for a verifier domain: beside a ground-truth
    score in the stage columns, "reward up, truth flat" is a hacked reward."""
    out: dict[str, dict[str, Any]] = {}
    for dom in domains:
        row: dict[str, Any] = {s: None for s in STAGES}
        raw: dict[str, Any] = {s: None for s in STAGES}
        hacks: dict[str, Any] = {s: None for s in STAGES}
        reward: dict[str, Any] = {s: None for s in STAGES}
        unparsed: dict[str, Any] = {s: None for s in STAGES}
        sub = scores[scores["domain"] == dom] if len(scores) else scores
        n_eval = None
        for _, r in sub.iterrows():
            if r["stage"] in STAGES:
                row[r["stage"]] = round(float(r["score"]), 6)
                raw[r["stage"]] = _num(r.get("raw_score"))
                hacks[r["stage"]] = _num(r.get("hacks_per_100"))
                reward[r["stage"]] = _num(r.get("reward_score"))
                unparsed[r["stage"]] = _num(r.get("reward_unparseable"))
                n_eval = int(r["n_eval"])
        spec, stud = row["specialist"], row["student"]
        # recovery = student / specialist; undefined when the specialist scores 0
        row["recovery"] = round(stud / spec, 6) if (spec and stud is not None) else None
        row["n_eval"] = n_eval
        tool = any(v is not None for v in hacks.values())
        row["raw"] = raw if tool else None
        row["hacks_per_100"] = hacks if tool else None
        rewarded = any(v is not None for v in reward.values())
        row["reward"] = reward if rewarded else None
        row["reward_unparseable"] = unparsed if rewarded else None
        out[dom] = row
    return out


NO_LIFT = 0.02  # a specialist within this of its base (clean score) did not learn: the report says why (`no_lift`)


def specialist_training(result: dict | None) -> dict | None:
    """What a specialist's result (teachers/specialist.py: `history`, `best_step`, `best_val`, `selected_step`,
    `stopped`) says about its training, for the report: {steps, rewarded_steps (steps whose rollouts' mean reward was
    above 0), reward_first, reward_last (mean reward of the first and last step), best_step, best_val,
    selected_step, stopped}; None without a result (an external teacher)."""
    if not result:
        return None
    rewards = [float(h["reward"]) for h in result.get("history") or [] if h.get("reward") is not None]
    return {"steps": result.get("steps"), "rewarded_steps": sum(1 for r in rewards if r > 0),
            "reward_first": _num(rewards[0]) if rewards else None, "reward_last": _num(rewards[-1]) if rewards else None,
            "best_step": result.get("best_step"), "best_val": _num(result.get("best_val")),
            "selected_step": result.get("selected_step"), "stopped": result.get("stopped")}


def why_no_lift(row: dict, training: dict | None) -> str | None:
    """Why a domain's specialist ended within `NO_LIFT` of its base (clean scores), read from its training; None
    when it lifted, or when a stage has no score."""
    base, spec = row.get("base"), row.get("specialist")
    if base is None or spec is None or spec - base >= NO_LIFT:
        return None
    head = f"specialist {spec:.3f} against the base's {base:.3f}: "
    if training is None:
        return head + "no training record (an external teacher, or a result from before this field)"
    steps = training.get("steps")
    if steps and training.get("rewarded_steps") == 0:
        return head + (f"none of its {steps} training steps earned any reward, so RL had no successful episode to "
                       "reinforce (more base SFT, an easier difficulty, or partial or step credit give it one)")
    if training.get("selected_step") == 0 or (training.get("selected_step") is None and training.get("best_step") == 0):
        best = training.get("best_val")
        return head + (f"its validation never rose above step 0's ({_fmt(best)}) in {steps} steps, so the starting "
                       "policy was kept" + (f"; stopped: {training['stopped']}" if training.get("stopped") else ""))
    return head + (f"it trained {steps} steps and kept step {training.get('selected_step')} (validation "
                   f"{_fmt(training.get('best_val'))} at its best step {training.get('best_step')}); the eval split "
                   "did not confirm the validation's gain")


# report.json `guard`: summed over the specialists (teachers/guard.py `Guard` counters)
GUARD_KEYS = ("tool_calls", "flagged", "blocked", "judged", "judge_blocked", "judge_errors")


def build_report(*, config: str, run_id: str, mlflow: dict, scores: pd.DataFrame, domains: list[str],
                 n_teachers: int = 0, timings_s: dict | None = None, throughput: dict | None = None,
                 guard: dict | None = None, artifacts: dict | None = None, resources: dict | None = None,
                 meta: dict | None = None, specialists: dict[str, dict] | None = None) -> dict:
    """`resources`: {stage: {"world_size": W}} as the trainers ran (see `resources_of`); missing stages are null.
    `meta`: what ran where (`infra.hostinfo.run_meta`: commit, CPU, load, command line, config and overrides).
    `specialists`: {domain: the specialist's result}, for each domain's `training` and `no_lift` (why a specialist
    did not learn); without it both are null."""
    table = domain_table(scores, domains)
    for dom, row in table.items():
        row["training"] = specialist_training((specialists or {}).get(dom))
        row["no_lift"] = why_no_lift(row, row["training"]) if specialists is not None else None
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
        "guard": {**dict.fromkeys(GUARD_KEYS, 0), **(guard or {})},
        "artifacts": {"student_checkpoint": None, "registered_model": None, **(artifacts or {})},
        "resources": {k: {"world_size": None, **(resources or {}).get(k, {})} for k in RESOURCE_STAGES},
        "meta": dict(meta or {}),
    }


def resources_of(base: dict | None, specialists: list[dict], student: dict | None) -> dict:
    """The report's `resources` from what the trainers recorded: the base stage's {"world_size": W}, and the
    `world_size` in each specialist's and the student's result (torch.distributed's world size in the trainer; a
    result from before this field: null). Specialists trained with different world sizes report the largest."""
    spec = [s.get("world_size") for s in specialists if s.get("world_size") is not None]
    return {"base": {"world_size": (base or {}).get("world_size")},
            "specialists": {"world_size": max(spec) if spec else None},
            "student": {"world_size": (student or {}).get("world_size")}}


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
    tools = {d: r for d, r in report.get("domains", {}).items() if r.get("hacks_per_100")}
    if tools:  # a tool domain's scores above are clean (hack attempts score 0): its raw score and attempts here
        lines.append("tool domains, raw score / hack attempts per 100 episodes (base, specialist, student):")
        for dom, r in tools.items():
            cells = [f"{_fmt((r.get('raw') or {}).get(st))} / {_fmt(r['hacks_per_100'].get(st))}" for st in STAGES]
            lines.append(f"  {dom:<14}" + "   ".join(cells))
    rewarded = {d: r for d, r in report.get("domains", {}).items() if r.get("reward")}
    if rewarded:  # a model-rewarded domain's scores above are its ground truth (if any): the model's reward here
        lines.append("model-rewarded domains, model reward (base, specialist, student; the score above is the "
                     "ground truth when the domain has one):")
        for dom, r in rewarded.items():
            lines.append(f"  {dom:<14}" + "   ".join(f"{_fmt(r['reward'].get(st)):>8}" for st in STAGES))
    stuck = {d: r["no_lift"] for d, r in report.get("domains", {}).items() if r.get("no_lift")}
    if stuck:  # a specialist that did not learn: why, from its training (`why_no_lift`)
        lines.append("no lift:")
        lines += [f"  {dom}: {why}" for dom, why in stuck.items()]
    lines.append(f"{'mean':<16}{_fmt(s.get('base_mean')):>8}{_fmt(s.get('specialist_mean')):>10}"
                 f"{_fmt(s.get('student_mean')):>9}{_fmt(s.get('mean_recovery')):>10}")
    lines.append(f"domains {s.get('n_domains')}, teachers {s.get('n_teachers')}, min recovery {_fmt(s.get('min_recovery'))}")
    t = report.get("timings_s", {})
    lines.append("timings (s): " + ", ".join(f"{k} {_fmt(v)}" for k, v in t.items()))
    ml = report.get("mlflow", {})
    if ml:
        lines.append(f"mlflow: {ml.get('tracking_uri')}  experiment {ml.get('experiment')}  run {ml.get('parent_run_id')}")
    meta = report.get("meta") or {}
    if meta:  # reports before 2026-11-30 have none
        commit = (meta.get("commit") or "?")[:10] + (" (dirty)" if meta.get("dirty") else "")
        load = " → ".join(f"{m[0]:.1f}" for m in (meta.get("loadavg_start"), meta.get("loadavg_end")) if m)
        lines.append(f"ran: commit {commit} on {meta.get('cpu_model')} ({meta.get('cpu_count')} CPUs), load {load}, "
                     f"{meta.get('started_at')} → {meta.get('ended_at')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the contract, checked

_NUM, _INT, _STR, _MAP = "a number", "an integer", "a string", "an object"
_OPT = " or null"
# key path → what its value must be (`*` is any key of the mapping above); what `build_report` writes
REPORT_SHAPE: dict[str, str] = {
    "config": _STR, "run_id": _STR + _OPT, "mlflow": _MAP, "domains": _MAP,
    **{f"domains.*.{k}": _NUM + _OPT for k in (*STAGES, "recovery")}, "domains.*.n_eval": _INT + _OPT,
    "domains.*.raw": _MAP + _OPT, "domains.*.hacks_per_100": _MAP + _OPT,
    "summary": _MAP, "summary.n_domains": _INT, "summary.n_teachers": _INT,
    **{f"summary.{k}": _NUM + _OPT for k in ("base_mean", "specialist_mean", "student_mean", "mean_recovery",
                                              "min_recovery")},
    "timings_s": _MAP, **{f"timings_s.{k}": _NUM + _OPT for k in TIMING_KEYS},
    "throughput": _MAP, **{f"throughput.{k}": _NUM + _OPT for k in ("distill_sampled_tokens_per_s",
                                                                      "teacher_scored_tokens_per_s")},
    "guard": _MAP, **{f"guard.{k}": _INT for k in GUARD_KEYS},
    "artifacts": _MAP, "artifacts.student_checkpoint": _STR + _OPT, "artifacts.registered_model": _STR + _OPT,
    "resources": _MAP, **{f"resources.{k}": _MAP for k in RESOURCE_STAGES},
    **{f"resources.{k}.world_size": _INT + _OPT for k in RESOURCE_STAGES},
}


def _is(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith(_OPT)
    if isinstance(value, bool):
        return False
    base = kind.removesuffix(_OPT)
    return {_NUM: isinstance(value, (int, float)), _INT: isinstance(value, int), _STR: isinstance(value, str),
            _MAP: isinstance(value, dict)}[base]


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def report_problems(report: Any) -> list[str]:
    """Why `report` (parsed JSON) is not a report.json of the contract above, one "key.path: problem" per line;
    empty when it is one. Keys beyond the contract are allowed."""
    if not isinstance(report, dict):
        return [f"<top level>: must be an object, got {_type_name(report)}"]
    problems: list[str] = []
    for path, kind in REPORT_SHAPE.items():
        parent, _, key = path.rpartition(".")
        nodes = [("", report)] if not parent else _nodes(report, parent)
        for where, node in nodes:
            full = f"{where}.{key}" if where else key
            if not isinstance(node, dict):
                continue  # the parent's own problem is reported
            if key not in node:
                problems.append(f"{full}: missing (must be {kind})")
            elif not _is(node[key], kind):
                problems.append(f"{full}: must be {kind}, got {_type_name(node[key])}")
    return problems


def _nodes(report: dict, path: str) -> list[tuple[str, Any]]:
    """(concrete key path, value) of every node `path` (dotted, `*` for any key) names in `report`."""
    out = [("", report)]
    for part in path.split("."):
        nxt = []
        for where, node in out:
            if not isinstance(node, dict):
                continue
            keys = list(node) if part == "*" else [part] if part in node else []
            nxt += [(f"{where}.{k}" if where else str(k), node[k]) for k in keys]
        out = nxt
    return out
