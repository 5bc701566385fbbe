"""`alloy run CONFIG --dry-run`: check what can be checked without training, then print the plan.

Checks (a failure names the field, path or key, and the command exits 2): the config; the model (a local
checkpoint's config and tokenizer load; a Hub id must be in the local Hugging Face cache, as runs are offline; a
preset builds its char tokenizer); the domain plugins; the storage URL (a probe written, read, listed and deleted
under it with the credentials of the environment); the ports the config fixes; every external teacher's /health;
the run's checkpoint bytes against the storage's free space (`check_checkpoint_bytes`, also run by `alloy plan`).
No Prefect server, MLflow store, engine server or trainer is started.

`preflight` is the part of these checks that needs no network but the storage's, run by `alloy config`, by
`alloy run` before any stage starts and by the dry run: the domains (plugin imports; a dataset's split sizes
against every field that asks for rows, e.g. `specialists.val_n`), the guard judge's checkpoint
(`specialists.guard.judge_path`, when the stage would serve it), the syntax of every URL the run will call
(`teachers.external.<domain>`, `specialists.guard.judge_url`) and the storage.

The plan: the stages in order, for each what a run would reuse (a complete checkpoint under the stage's prefix,
tasks/prefixes.py) and what it would train, with a time estimate from what earlier runs recorded under the storage
URL (and the other runs under `run.root` when the storage is the default one): per-step times in the base's, the
specialists' and the student's result.json, eval and teacher start-up from report.json timings.
"""
from __future__ import annotations

import json
import os
import posixpath
import socket
import sys
import threading
import time
import urllib.error
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from alloy.detached import http_request
from infra.choices import StageMode
from infra.config import AlloyConfig, ConfigError, load_config
from infra.storage import RetryPolicy, get_fs, is_local, join, latest_complete, verify_checkpoint
from tasks.prefixes import base_prefix, specialist_prefix_of, student_prefix_of

EXIT_OK, EXIT_USAGE = 0, 2
QUICK = RetryPolicy(attempts=2, base_s=0.1, max_s=0.5)  # a dry run reports a problem, it does not wait it out
STORAGE_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
S3_OPTIONS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}}


@dataclass
class Check:
    name: str  # the field (or key) checked, e.g. "model.path", "teachers.external.reverse"
    ok: bool
    detail: str


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() in a daemon thread (one that hangs cannot keep the process alive); TimeoutError after timeout_s."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="alloy-dry-run")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ------------------------------------------------------------------------------------------ checks


def check_model(cfg: AlloyConfig) -> Check:
    if cfg.model.path is None:
        from infra.models import PRESETS
        from infra.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        p = PRESETS[cfg.model.preset]
        return Check("model.preset", True, f"{cfg.model.preset}: a fresh model ({p.layers} layers, hidden {p.hidden}) "
                                           f"with the char tokenizer (vocab {len(tok)})")
    path = cfg.model.path
    try:
        from transformers import AutoConfig, AutoTokenizer

        mc = AutoConfig.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001  (any load failure is the user's to fix)
        where = ("" if Path(path).expanduser().is_dir() else
                 f" (not a local directory; as a Hub id it needs the network, or the local Hugging Face cache with "
                 f"HF_HUB_OFFLINE=1: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '') or 'unset'})")
        return Check("model.path", False, f"{path}: cannot load its config and tokenizer{where}: {_short(exc)}")
    return Check("model.path", True, f"{path}: {mc.model_type}, tokenizer vocab {len(tok)}")


def check_domains(cfg: AlloyConfig) -> tuple[Check, dict]:
    """Every domain loads (a plugin imports and builds; a dataset is read and is large enough for the split sizes
    the config asks for); a failure is named by the field the ConfigError names (e.g. `domains.0.dataset.path`)."""
    from domains.registry import load_domains

    try:
        domains = load_domains(cfg)
    except ConfigError as exc:
        field, sep, rest = str(exc).partition(": ")
        named = sep and field.startswith("domains.") and " " not in field
        return (Check(field, False, rest) if named else Check("domains", False, str(exc))), {}
    return Check("domains", True, ", ".join(domains) + " loaded"), domains


def serves_judge(cfg: AlloyConfig, domains: dict) -> bool:
    """Whether the specialists stage will serve `specialists.guard.judge_path` (tasks/judge.wants_judge_server):
    specialists train, the guard is on, a checkpoint and no URL, and some domain has tools."""
    gc = cfg.specialists.guard
    return bool(cfg.specialists.enabled and gc.enabled and gc.judge_path and not gc.judge_url
                and any(hasattr(d, "env") for d in domains.values()))


def check_judge(cfg: AlloyConfig, domains: dict) -> list[Check]:
    """The judge checkpoint the specialists stage will serve: a model directory whose context leaves room for a
    prompt (checked here, not after the base stage's SFT)."""
    if not serves_judge(cfg, domains):
        return []
    name, raw = "specialists.guard.judge_path", cfg.specialists.guard.judge_path
    path = Path(raw).expanduser()
    if not (path / "config.json").is_file():
        where = "does not exist" if not path.exists() else "is not a model checkpoint directory (no config.json)"
        return [Check(name, False, f"{raw} {where} (from {Path.cwd()}); build the judge with `python -m "
                                   f"teachers.judge_model {raw}`, or set specialists.guard.judge_url to a served "
                                   "judge, or leave judge_path out for a rule-only guard")]
    if cfg.specialists.guard.judge_prompt_chars is None:
        from tasks.judge import judge_prompt_chars

        try:
            judge_prompt_chars(path, cfg.specialists.guard.judge_max_tokens)
        except ValueError as exc:
            return [Check(name, False, str(exc).removeprefix(f"{name}: "))]
    return [Check(name, True, f"{raw}: a judge checkpoint (served for the specialists stage)")]


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) URL a client can call (scheme, host, port, spaces), or None."""
    from urllib.parse import urlsplit

    if url != url.strip() or any(c.isspace() for c in url):
        return "contains whitespace"
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number in 0..65535 raises here
    except ValueError as exc:
        return f"not a URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"scheme must be http or https, got {parts.scheme!r}"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    return None


def check_urls(cfg: AlloyConfig) -> list[Check]:
    """The syntax of every URL a stage will call: the external teachers and the guard's judge."""
    urls = {f"teachers.external.{d}": u for d, u in cfg.teachers.external.items()}
    if cfg.specialists.enabled and cfg.specialists.guard.enabled and cfg.specialists.guard.judge_url:
        urls["specialists.guard.judge_url"] = cfg.specialists.guard.judge_url
    return [Check(name, False, f"{u!r}: {why}") for name, u in urls.items() if (why := url_problem(u))]


def preflight(cfg: AlloyConfig) -> tuple[list[Check], dict]:
    """(the checks every command runs before a stage could start, the loaded domains): domains and their split
    sizes, the judge checkpoint, URL syntax, the storage. No server is started and no model is loaded."""
    dom_check, domains = check_domains(cfg)
    return [dom_check, *check_judge(cfg, domains), *check_urls(cfg), check_storage(cfg)], domains


def report_failures(checks: list[Check], err=None) -> int:
    """Print each failed check as `error: <field>: <detail>`; EXIT_USAGE if any failed, else EXIT_OK."""
    failed = [c for c in checks if not c.ok]
    for c in failed:
        print(f"error: {c.name}: {c.detail}", file=err or sys.stderr)
    return EXIT_USAGE if failed else EXIT_OK


def check_storage(cfg: AlloyConfig) -> Check:
    """Write, read, list and delete a probe under the storage URL (a local URL that does not exist yet: its nearest
    existing parent must be a writable directory; nothing is created)."""
    url = cfg.storage_url
    name = "run.storage" if cfg.run.storage else "run.root"

    def probe() -> str:
        fs, path = get_fs(url, storage_options=None if is_local(url) else S3_OPTIONS)
        if is_local(url):
            anc = Path(path)
            while not anc.exists() and anc != anc.parent:
                anc = anc.parent
            if not anc.is_dir():
                raise NotADirectoryError(f"{anc} is not a directory")
            if not os.access(anc, os.W_OK | os.X_OK):
                raise PermissionError(f"{anc} is not writable")
            if anc != Path(path):
                return f"writable (created at the first run, under {anc})"
        key = posixpath.join(path, f".alloy-dry-run-{uuid.uuid4().hex[:8]}")
        fs.pipe_file(key, b"ok")
        try:
            if fs.cat_file(key) != b"ok":
                raise OSError(f"probe {key} read back different bytes")
            fs.invalidate_cache(path)
            fs.ls(path)
        finally:
            fs.rm_file(key)
        return "writable (a probe written, read, listed and deleted)"

    try:
        return Check(name, True, f"{url}: {_with_timeout(probe, STORAGE_TIMEOUT_S)}")
    except Exception as exc:  # noqa: BLE001
        return Check(name, False, f"{url}: not usable with the credentials of this environment: {_short(exc)}")


def check_ports(cfg: AlloyConfig) -> list[Check]:
    """Ports the config fixes (SGLang options such as `port`); every other server takes a free port."""
    fixed = {f"engine.sglang_args.{k}": v for k, v in cfg.engine.sglang_args.items()
             if k.endswith("port") and isinstance(v, int) and not isinstance(v, bool) and v > 0}
    if not fixed:
        return [Check("ports", True, "none fixed by the config (launched servers take free ports)")]
    out = []
    for key, port in fixed.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.engine.host, port))
                out.append(Check(key, True, f"port {port} is free on {cfg.engine.host}"))
            except OSError as exc:
                out.append(Check(key, False, f"port {port} on {cfg.engine.host} is not free: {_short(exc)}"))
    return out


def check_teachers(cfg: AlloyConfig) -> list[Check]:
    """GET <url>/health of every external teacher (with the engine API key, if any)."""
    if not cfg.teachers.external:
        return [Check("teachers.external", True, "none (every teacher is launched by the run)")]
    out = []
    for domain, url in cfg.teachers.external.items():
        if url_problem(url):  # reported by check_urls
            continue
        name, health = f"teachers.external.{domain}", url.rstrip("/") + "/health"
        try:
            status = http_request(health, timeout=HEALTH_TIMEOUT_S, api_key=cfg.engine.api_key)[0]
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (OSError, ValueError) as exc:  # the message names the URL: "<health>: no answer within 5 s (...)"
            out.append(Check(name, False, str(exc)))
            continue
        out.append(Check(name, status == 200, f"{health}: HTTP {status}" + ("" if status == 200 else " (not healthy)")))
    return out


# ------------------------------------------------------------------------------------------ checkpoint bytes


def stored_bytes(cfg: AlloyConfig, domains: list[str]) -> int:
    """Bytes already under this config's stage prefixes (a rerun reuses or replaces them); 0 where unreadable."""
    url = cfg.storage_url
    prefixes = [base_prefix(cfg, url), student_prefix_of(cfg, url),
                *(specialist_prefix_of(cfg, url, d) for d in domains)]
    total = 0
    for prefix in prefixes:
        try:
            fs, path = get_fs(prefix, storage_options=None if is_local(prefix) else S3_OPTIONS)
            total += int(fs.du(path)) if fs.exists(path) else 0
        except Exception:  # noqa: BLE001  (a courtesy: what is stored only loosens the check)
            continue
    return total


def check_checkpoint_bytes(cfg: AlloyConfig, gpus: int, domains: list[str]) -> tuple[Check, list[str]]:
    """The run's checkpoint bytes (infra/checkpoint_budget.py: weights, DeepSpeed states × checkpoints kept, final/
    exports) on `gpus` GPUs (0: the CPU) against its storage's free space (plus what the run already stores under
    its own prefixes): (a Check named `checkpoints` that fails, naming the fields that size them and both numbers,
    when they do not fit; the estimate's lines)."""
    from infra.checkpoint_budget import budget_fields, budget_problem, fmt_bytes, free_bytes, run_bytes, run_trainers
    from infra.placement import PlacementError, model_size
    from infra.storage import to_local

    try:
        params, _, _ = model_size(cfg.model.path, cfg.resources.model_gb, cfg.model.preset)
    except PlacementError as exc:
        return Check("checkpoints", True, f"not estimated: {exc}"), []
    trainers, at_once = run_trainers(cfg, params, gpus > 0, domains)
    stays, extra = run_bytes(trainers, at_once)
    need, url = stays + extra, cfg.storage_url
    try:
        free, where = free_bytes(url, to_local(url) if is_local(url) else None)
    except ValueError as exc:
        return Check("checkpoints", False, str(exc)), []
    stored = stored_bytes(cfg, domains) if free is not None else 0
    room = where if free is None else f"{fmt_bytes(free)} {where}" + (
        f", {fmt_bytes(stored)} already stored by this run" if stored else "")
    lines = [f"checkpoints (estimate: {params / 1e6:.1f}M params, trained on {'a GPU' if gpus > 0 else 'the CPU'}):",
             *_budget_rows(trainers, extra, need, room)]
    problem = budget_problem(need, free, stored, budget_fields(cfg))
    if problem:
        return Check("checkpoints", False, f"{url}: {problem}"), lines
    return Check("checkpoints", True, f"~{fmt_bytes(need)} on {url} ({room})"), lines


def _budget_rows(trainers: list, extra: int, need: int, room: str) -> list[str]:
    """The estimate's table: one row per trainer (`infra.checkpoint_budget.TrainerBytes`), the extra while trainers
    train, the total."""
    from infra.checkpoint_budget import fmt_bytes

    w = max(len(t.name) for t in trainers) + 2
    rows = []
    for t in trainers:
        older = f" + {t.keep - 1} older × {fmt_bytes(t.older)}" if t.keep > 1 else ""
        gone = " (deleted once final/ is in)" if t.transient else ""
        resume = f"step-* {fmt_bytes(t.newest)}{older}{gone}, " if t.newest else ""
        rows.append(f"  {t.name:<{w}}{resume}final {fmt_bytes(t.final)}")
    if extra:
        rows.append(f"  {'while training':<{w}}+{fmt_bytes(extra)} (the trainers at once; a new checkpoint lands "
                    "before the oldest is pruned)")
    return rows + [f"  {'total':<{w}}~{fmt_bytes(need)} ({room})"]


# ------------------------------------------------------------------------------------------ estimates


@dataclass
class Estimates:
    """Seconds per unit of work, from what earlier runs recorded (None: nothing recorded)."""
    base_step: float | None = None
    specialist_step: dict[str, float] | None = None  # domain → s/step; "*" = mean over every domain
    student_step: float | None = None
    eval_example: float | None = None
    teachers_up: float | None = None


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return sum(xs) / len(xs) if xs else None


def _per_step(results: list[Any]) -> float | None:
    """Mean seconds a step of the trainers' summaries (`<prefix>/result.json`: `wall_s` over `steps`)."""
    return _mean([r["wall_s"] / r["steps"] for _, r in results
                  if isinstance(r, dict) and r.get("steps") and isinstance(r.get("wall_s"), (int, float))])


def read_estimates(cfg: AlloyConfig) -> Estimates:
    fs, path = get_fs(cfg.storage_url, storage_options=None if is_local(cfg.storage_url) else S3_OPTIONS)
    roots = [path]
    if cfg.run.storage is None:  # the default storage: every run under run.root is an earlier run of this machine
        roots = [posixpath.join(posixpath.dirname(path.rstrip("/")), "*")]

    def files(pattern: str) -> list[Any]:
        out = []
        for root in roots:
            for f in sorted(fs.glob(posixpath.join(root, pattern))):
                try:
                    out.append((f, json.loads(fs.cat_file(f))))
                except (OSError, ValueError):
                    continue
        return out

    est = Estimates()
    est.base_step = _per_step(files("base-*/result.json"))
    per: dict[str, list[float]] = {}
    for f, r in files("specialist-*/result.json"):
        domain = posixpath.basename(posixpath.dirname(f)).removeprefix("specialist-").rsplit("-", 1)[0]
        for h in (r.get("history") or []) if isinstance(r, dict) else []:
            if isinstance(h, dict) and isinstance(h.get("rollout_s"), (int, float)):
                per.setdefault(domain, []).append(h["rollout_s"] + float(h.get("train_s") or 0.0))
    if per:
        est.specialist_step = {d: _mean(v) for d, v in per.items() if _mean(v)}
        est.specialist_step["*"] = _mean([x for v in per.values() for x in v])
    est.student_step = _per_step(files("student-*/result.json"))
    evals, ups = [], []
    for _, rep in files("report.json"):
        t, doms = (rep.get("timings_s") or {}, rep.get("domains") or {}) if isinstance(rep, dict) else ({}, {})
        n = sum(int(d.get("n_eval") or 0) for d in doms.values() if isinstance(d, dict))
        if isinstance(t.get("eval"), (int, float)) and n:
            evals.append(t["eval"] / (2 * n))  # the base and the student are evaluated on the same examples
        ups.append(t.get("teachers_up"))
    est.eval_example, est.teachers_up = _mean(evals), _mean(ups)
    return est


def _estimates(cfg: AlloyConfig) -> Estimates:
    try:
        return read_estimates(cfg)
    except Exception as exc:  # noqa: BLE001  (estimates are a courtesy: never fail a dry run over them)
        print(f"note: no estimates: cannot read earlier runs under {cfg.storage_url}: {_short(exc)}", file=sys.stderr)
        return Estimates()


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "no estimate (no earlier run)"
    s = int(round(s))
    if s >= 3600:
        return f"~{s // 3600}h {s % 3600 // 60:02d}m"
    return f"~{s // 60}m {s % 60:02d}s" if s >= 60 else f"~{s}s"


# ------------------------------------------------------------------------------------------ the plan


def _resume_step(prefix: str) -> int | None:
    found = latest_complete(prefix, retry=QUICK)
    return int(found.rsplit("-", 1)[-1]) if found and found.rsplit("-", 1)[-1].isdigit() else None


def build_plan(cfg: AlloyConfig, est: Estimates, domains: list[str]) -> tuple[list[str], float]:
    """(lines of the plan, estimated seconds of the stages that have an estimate)."""
    url, resume, total = cfg.storage_url, cfg.run.resume, 0.0
    lines: list[str] = []

    def row(label: str, what: str, secs: float | None, where: str = "", indent: int = 2, timed: bool = True) -> str:
        nonlocal total
        total += secs or 0.0
        when = _fmt_s(secs) if timed and not what.startswith("reuse") else ""
        text = f"{'':<{indent}}{label:<{20 - indent}}{what:<46}{when}".rstrip()
        return text + (f"\n{'':<20}→ {where}" if where and not what.startswith("reuse") else "")

    def trains(prefix: str, steps: int, per_step: float | None, resumable: bool = True) -> tuple[str, float | None]:
        """What happens under a prefix: reuse (a complete final/), resume (a `resumable` trainer's newest step) or
        train."""
        if not resume:
            return f"train {steps} steps (run.resume: false)", per_step and per_step * steps
        if verify_checkpoint(join(prefix, "final"), retry=QUICK)[0]:
            return f"reuse {join(prefix, 'final')}", 0.0
        at = _resume_step(prefix) if resumable else None
        if at:
            left = max(steps - at, 0)
            return f"resume at step {at}, train {left} more steps", per_step and per_step * left
        return f"train {steps} steps", per_step and per_step * steps

    n_eval = len(domains) * cfg.eval.n_eval
    eval_s = est.eval_example and est.eval_example * n_eval
    bp = base_prefix(cfg, url)
    lines.append(row("1. base", *trains(bp, cfg.base.steps, est.base_step, resumable=False), bp))
    lines.append(row("2. eval (base)", f"{len(domains)} domains × {cfg.eval.n_eval} examples", eval_s))
    sc = cfg.specialists
    if sc.enabled:
        width = min(sc.max_parallel, len(domains)) if sc.mode == StageMode.LOCAL else len(domains)
        sub, before = [], total
        for d in domains:
            per = est.specialist_step and (est.specialist_step.get(d) or est.specialist_step.get("*"))
            prefix = specialist_prefix_of(cfg, url, d)
            sub.append(row(d, *trains(prefix, sc.for_domain(d).steps, per), prefix, indent=5))
        # the domains train `width` at a time: the stage takes about the sum over the width
        stage = (total - before) / width if est.specialist_step else None
        total = before + (stage or 0.0)
        all_reused = all(" reuse " in line for line in sub)
        lines.append(row("3. specialists", f"{len(domains)} domains, {width} at a time ({sc.mode})", stage,
                         timed=not all_reused))
        lines += sub
    else:
        lines.append(row("3. specialists", "skipped (specialists.enabled: false): the base teaches", None, timed=False))
    ext = [d for d in domains if d in cfg.teachers.external]
    launched = [d for d in domains if d not in ext]
    lines.append(row("4. teachers", f"{len(launched)} launched, {len(ext)} external ({cfg.engine.backend})",
                     est.teachers_up if launched else 0.0, timed=bool(launched)))
    sp = student_prefix_of(cfg, url)
    lines.append(row("5. distill", *trains(sp, cfg.distill.steps, est.student_step), sp))
    lines.append(row("6. eval (student)", f"{len(domains)} domains × {cfg.eval.n_eval} examples", eval_s))
    lines.append(row("7. report", "report.json, MLflow, Prefect artifacts", None, join(url, "report.json"),
                     timed=False))
    return lines, total


def dry_run(config_path: str, overrides: list[str], out=None, err=None) -> int:
    """Run the checks and print the plan; 0 when every check passes, 2 otherwise (each failure on stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    t0 = time.monotonic()
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    print(f"dry run of {config_path}: run {cfg.run.name!r}, storage {cfg.storage_url} (nothing is trained)", file=out)
    pre, domains = preflight(cfg)
    from tasks.gpu_lanes import node_gpus

    budget, budget_lines = check_checkpoint_bytes(cfg, node_gpus(cfg), list(domains) or cfg.domain_names())
    checks = [Check("config", True, f"{config_path}: valid"), check_model(cfg), *pre, *check_ports(cfg),
              *check_teachers(cfg), budget]
    print("checks:", file=out)
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}", file=out)
    storage_ok = next(c for c in checks if c.name in ("run.storage", "run.root")).ok
    if storage_ok:
        try:
            lines, total = build_plan(cfg, _estimates(cfg), list(domains) or cfg.domain_names())
            print("plan (reuse = a complete checkpoint of the same training settings is in storage):", file=out)
            print("\n".join(lines + budget_lines), file=out)
            print(f"estimated time: {_fmt_s(total) if total else 'no estimate (no earlier run)'} (stages without "
                  f"an estimate not counted; dry run took {time.monotonic() - t0:.1f} s)", file=out)
        except Exception as exc:  # noqa: BLE001  (the storage answered the probe but not this)
            checks.append(Check("run.storage", False, f"{cfg.storage_url}: cannot list checkpoints: {_short(exc)}"))
    return report_failures(checks, err)
