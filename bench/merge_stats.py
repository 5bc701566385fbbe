"""Pure statistics of `merge_baselines.py --seeds`: 95% intervals over seeds and the multi-seed summary.

No I/O, no torch: every function takes and returns plain numbers and dicts (unit-tested with hand-derived values in
tests/unit/test_merge_stats.py).
"""
from __future__ import annotations

import math
import statistics

ARMS = ("opd", "offline_kd", "mixed_rl", "sequential_rl")
PER_SEED_ARM = {"opd": "opd", "offline_kd": "offline", "mixed_rl": "mixed_rl", "sequential_rl": "sequential_rl"}

# Student-t 0.975 quantiles by degrees of freedom (two-sided 95%); beyond 30 the normal 1.96 is within 2%.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (the table's next lower df between entries:
    a wider, conservative interval)."""
    if df < 1:
        raise ValueError(f"t975: need at least 1 degree of freedom (2 seeds), got {df}")
    if df > 30:
        return 1.96
    return T975[max(k for k in T975 if k <= df)]


def ci95(xs: list[float]) -> dict:
    """Mean and the t-interval mean ± t(n−1)·sd/√n over `xs` (one value per seed). With one value the interval is
    that value (n = 1 says so: no spread is known)."""
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("ci95: no values")
    m = statistics.fmean(xs)
    if len(xs) == 1:
        return {"mean": m, "ci95_low": m, "ci95_high": m, "sd": 0.0, "n": 1}
    sd = statistics.stdev(xs)
    half = t975(len(xs) - 1) * sd / math.sqrt(len(xs))
    return {"mean": m, "ci95_low": m - half, "ci95_high": m + half, "sd": sd, "n": len(xs)}


def summarize(aggs: list[dict], names: list[str]) -> dict:
    """The multi-seed summary from each seed's `aggregate` (merge_baselines.aggregate): per arm the mean over domains
    with its 95% interval over seeds, the same per domain, forgetting, and OPD's paired difference to each arm
    (OPD − arm, seed by seed: the seeds share base and specialists, so the pairing removes their noise)."""
    out = {"base": {"mean_score": ci95([a["base"]["mean_score"] for a in aggs]),
                    "per_domain": {d: ci95([a["base"]["scores"][d] for a in aggs]) for d in names}},
           "specialists": {"mean_score": ci95([statistics.fmean(a["specialists"]["own"].values()) for a in aggs]),
                           "per_domain": {d: ci95([a["specialists"]["own"][d] for a in aggs]) for d in names}}}
    for arm in ARMS:
        per_seed = [a[PER_SEED_ARM[arm]] for a in aggs]
        score = ci95([r["mean_score"] for r in per_seed])
        out[arm] = {**{k: score[k] for k in ("mean", "ci95_low", "ci95_high", "sd", "n")},
                    "per_seed": [r["mean_score"] for r in per_seed],
                    "per_domain": {d: ci95([r["scores"][d] for r in per_seed]) for d in names},
                    "forgetting": ci95([r["forgetting_mean"] for r in per_seed]),
                    "gain_vs_base": ci95([r["gain_vs_base_mean"] for r in per_seed])}
        if arm != "opd":
            diffs = [o["mean_score"] - r["mean_score"] for o, r in zip((a["opd"] for a in aggs), per_seed)]
            out[arm]["opd_minus_arm"] = ci95(diffs)
    seq = [a["sequential_rl"] for a in aggs]
    out["sequential_rl"]["forgetting_first_d_minus_1"] = ci95(
        [r.get("forgetting_mean_first_d_minus_1", r["forgetting_mean"]) for r in seq])
    return out


def target(summary: dict, paired_bar: float | None = None) -> dict:
    """The issue's bar: OPD's interval above mixed RL's and above offline distillation's (no overlap), and OPD's
    mean forgetting below sequential RL's; the paired-difference intervals (above 0 or not) beside them. With
    `paired_bar` (issue 56's long-answer set: 0.02) the headline is instead the paired intervals' lower bounds at
    least that high for both arms. One seed gives no interval: every interval check is then `met: null`."""
    opd = summary["opd"]
    one = opd["n"] < 2

    def judged(ok: bool) -> bool | None:
        return None if one else ok

    t = {}
    for arm in ("mixed_rl", "offline_kd"):
        other = summary[arm]
        t[f"opd_interval_above_{arm}"] = {"opd_ci95_low": opd["ci95_low"], "other_ci95_high": other["ci95_high"],
                                          "met": judged(opd["ci95_low"] > other["ci95_high"])}
        d = other["opd_minus_arm"]
        t[f"opd_minus_{arm}_paired_ci_above_0"] = {**d, "met": judged(d["ci95_low"] > 0)}
        if paired_bar is not None:
            t[f"opd_minus_{arm}_paired_low_at_least_{paired_bar:g}"] = {
                **d, "bar": paired_bar, "met": judged(d["ci95_low"] >= paired_bar)}
    f_opd, f_seq = opd["forgetting"]["mean"], summary["sequential_rl"]["forgetting"]["mean"]
    t["opd_forgets_less_than_sequential_rl"] = {"opd": f_opd, "other": f_seq, "met": f_opd < f_seq}
    if paired_bar is None:
        headline = ("opd_interval_above_mixed_rl", "opd_interval_above_offline_kd", "opd_forgets_less_than_sequential_rl")
    else:
        headline = tuple(f"opd_minus_{arm}_paired_low_at_least_{paired_bar:g}" for arm in ("mixed_rl", "offline_kd"))
    verdicts = [t[k]["met"] for k in headline]
    met = None if any(v is None for v in verdicts) else all(verdicts)
    return {**t, "headline": list(headline), "met": met}


def summary_table(summary: dict, names: list[str], n_seeds: int) -> str:
    """Markdown: one row per arm (mean [95% CI] over domains, forgetting), then the per-domain means."""
    f3 = "{:.3f}".format

    def iv(c: dict) -> str:
        return f"{f3(c['mean'])} [{f3(c['ci95_low'])}, {f3(c['ci95_high'])}]"

    lines = [f"Mean over {len(names)} domains, 95% t-interval over {n_seeds} seeds.", "",
             "| arm | mean score [95% CI] | forgetting [95% CI] | OPD − arm, paired [95% CI] |", "|---|---|---|---|",
             f"| base | {iv(summary['base']['mean_score'])} | | |",
             f"| specialists (own domain each) | {iv(summary['specialists']['mean_score'])} | | |"]
    for arm in ARMS:
        a = summary[arm]
        paired = iv(a["opd_minus_arm"]) if "opd_minus_arm" in a else ""
        lines.append(f"| {'**opd**' if arm == 'opd' else arm} | {iv(a)} | {iv(a['forgetting'])} | {paired} |")
    lines += ["", "| arm | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = [("base", summary["base"]["per_domain"]), ("specialists", summary["specialists"]["per_domain"])]
    rows += [(arm, summary[arm]["per_domain"]) for arm in ARMS]
    for label, per in rows:
        lines.append(f"| {label} | " + " | ".join(f"{f3(per[d]['mean'])} ± {f3(per[d]['mean'] - per[d]['ci95_low'])}"
                                               for d in names) + " |")
    return "\n".join(lines)
