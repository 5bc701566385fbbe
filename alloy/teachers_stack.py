"""`alloy teachers up | down | status`: teacher engine servers outside the pipeline, detached.

One embedded engine server (SGLang protocol, `engine.server`, the same argv the pipeline's `Supervisor`
builds, and the same health wait: `engine.launcher.wait_healthy`) per domain, on consecutive ports from `--port-start`, state in `<home>/teachers.json`, logs in
`<home>/logs/teacher-<domain>.log`. A pipeline then uses them instead of launching its own:
`--set teachers.external.<domain>=http://127.0.0.1:<port>` (printed by `up`).

`--checkpoints` accepts
  - a report.json of an earlier run (its `artifacts.specialists`),
  - a JSON file or an inline JSON object `{"domain": "path/to/checkpoint", ...}`,
  - a run directory holding `specialist-<domain>-<hash>/final/` checkpoints (what the pipeline commits), or a
    directory whose sub-directories are HF checkpoints named after their domain.
A checkpoint path may be a `file://` URL or a committed prefix; its `final/` is used when present.
Unlike the `Supervisor`, nothing here restarts a dead server: this process exits once the servers are up.

With `--config CONFIG` the servers launch as that run would launch its teachers: its `engine` section (backend,
options, bind address, API key from the environment) and, on a node with GPUs (`--gpus N`, else
`resources.gpus_per_node`, else the CUDA devices visible), the GPUs and memory fractions of the distill stage's
placement plan (`alloy plan CONFIG`; infra/placement.py), one planned teacher per domain. Without it: embedded CPU
servers on loopback, as before.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from alloy.detached import (HOST, REPO_ROOT, StackError, http_get, is_alive, log_tail, pick_port, read_state, spawn,
                            stack_env, stop_entries, write_state)
from infra.names import local_path

STATE_FILE = "teachers.json"


class CheckpointsError(StackError):
    """A bad `--checkpoints` value (bad input: exit code 2)."""
_SPECIALIST_DIR = re.compile(r"^specialist-(?P<domain>.+)-[0-9a-f]{6,}$")


def _is_checkpoint(p: Path) -> bool:
    return (p / "config.json").is_file()


def _resolve_path(domain: str, raw: str) -> str:
    p = Path(raw[len("file://"):] if raw.startswith("file://") else raw).expanduser()
    for cand in (p, p / "final"):
        if _is_checkpoint(cand):
            return str(cand.resolve())
    raise CheckpointsError(f"checkpoint of domain {domain!r}: {raw} is not an HF checkpoint directory (no config.json "
                     f"in it or in its final/)")


def resolve_checkpoints(spec: str) -> dict[str, str]:
    """`--checkpoints` (see the module docstring) → {domain: absolute local checkpoint dir}."""
    path = Path(spec).expanduser()
    if spec.lstrip().startswith("{"):
        try:
            mapping = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise CheckpointsError(f"--checkpoints: inline JSON does not parse: {exc}") from exc
    elif path.is_file():
        try:
            mapping = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointsError(f"--checkpoints: {path} is not valid JSON: {exc}") from exc
        if isinstance(mapping, dict) and "artifacts" in mapping:  # a report.json
            mapping = (mapping.get("artifacts") or {}).get("specialists") or {}
            if not mapping:
                raise CheckpointsError(f"--checkpoints: report {path} lists no specialists (artifacts.specialists)")
    elif path.is_dir():
        if _is_checkpoint(path) or _is_checkpoint(path / "final"):
            raise CheckpointsError(f"--checkpoints: {path} is one checkpoint; name its domain: "
                             f"--checkpoints '{{\"<domain>\": \"{path}\"}}'")
        mapping = {}
        for child in sorted(path.iterdir(), key=lambda c: c.stat().st_mtime):  # newest run of a domain wins
            m = _SPECIALIST_DIR.match(child.name)
            if m and _is_checkpoint(child / "final"):
                mapping[m.group("domain")] = str(child / "final")
            elif child.is_dir() and _is_checkpoint(child):
                mapping[child.name] = str(child)
        if not mapping:
            raise CheckpointsError(f"--checkpoints: no checkpoints in {path} (expected specialist-<domain>-<hash>/final/ "
                             f"or <domain>/config.json)")
    else:
        raise CheckpointsError(f"--checkpoints: {spec} is neither a directory, a JSON file nor inline JSON")
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise CheckpointsError('--checkpoints: expected an object {"domain": "checkpoint path", ...}')
    return {d: _resolve_path(d, p) for d, p in mapping.items()}


def teacher_specs(checkpoints: dict[str, str], cfg=None, gpus: int | None = None) -> dict:
    """{domain: `ServerSpec`} of the teacher servers: embedded CPU servers on loopback without a config; with one,
    launched as its run would launch them (see the module docstring). A checkpoint whose domain has no planned
    teacher is refused, naming it."""
    from engine.launcher import ServerSpec

    if cfg is None:
        return {d: ServerSpec(name=f"teacher-{d}", model_path=c, host=HOST) for d, c in checkpoints.items()}
    from alloy.placement_cmd import node_gpus
    from infra.placement import PlacementError, make_plan, placements_of, visible_devices

    n = node_gpus(cfg, gpus)
    placements = {}
    if n > 0:
        try:
            plan = make_plan(cfg, n)
        except PlacementError as exc:
            raise CheckpointsError(f"--config: the placement plan {exc} (see `alloy plan CONFIG --gpus {n}`)") from None
        visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), n)
        placements = placements_of(plan, visible, "teacher")
        missing = sorted(set(checkpoints) - set(placements))
        if missing:
            raise CheckpointsError(f"--checkpoints: no planned teacher for domain(s) {missing} in the config's "
                                   f"placement plan (planned: {sorted(placements)}); the config's domains must "
                                   "include every checkpoint's")
    return {d: ServerSpec.for_engine(f"teacher-{d}", ckpt, cfg.engine, placements.get(d))
            for d, ckpt in checkpoints.items()}


def teachers_up(home: Path, checkpoints: dict[str, str], port_start: int = 30000, threads: int = 1,
                timeout_s: float = 180.0, specs: dict | None = None) -> dict:
    """Serve each checkpoint on its own port (port_start, +1, …; 0 = free ports) and wait for `/health`; `specs`:
    {domain: ServerSpec} (`teacher_specs`; default: embedded CPU servers). Returns the state; already serving the
    same domains → that state with "already_up"."""
    from engine.launcher import build_command, server_env, url_for, wait_healthy

    specs = specs or teacher_specs(checkpoints)

    home = Path(home).resolve()
    state_path = home / STATE_FILE
    old = read_state(state_path)
    if old and any(is_alive(t) for t in old["teachers"].values()):
        if set(old["teachers"]) == set(checkpoints) and all(is_alive(t) for t in old["teachers"].values()):
            return {**old, "already_up": True}
        raise StackError(f"teachers already running from {state_path} ({', '.join(sorted(old['teachers']))}); "
                         f"run `alloy teachers down --home {home}` first")
    state = {"home": str(home), "teachers": {}}
    env = stack_env(home, "", "", None)
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    try:
        for i, (domain, ckpt) in enumerate(sorted(checkpoints.items())):
            port = pick_port(0 if port_start == 0 else port_start + i, f"teacher {domain}, --port-start")
            spec = specs[domain]
            cmd = build_command(spec, port)
            entry = spawn(f"teacher-{domain}", cmd, local_path(home, "logs", f"teacher-{domain}.log"),
                          server_env(spec, env, threads), REPO_ROOT)
            entry.update(port=port, url=url_for(spec.host, port), model_path=ckpt, backend=str(spec.backend),
                         gpus=spec.env.get("CUDA_VISIBLE_DEVICES"))
            state["teachers"][domain] = entry
            write_state(state_path, state)
        teachers = state["teachers"]
        down = wait_healthy({d: t["url"] for d, t in teachers.items()}, timeout_s,
                            {d: specs[d].api_key for d in teachers},
                            failed=lambda d: None if is_alive(teachers[d]) else "exited")
        exited = sorted(d for d, why in down.items() if why == "exited")
        if exited:
            raise StackError("\n".join(f"teacher {d} exited before it was healthy; last lines of {teachers[d]['log']}:"
                                       f"\n{log_tail(teachers[d]['log'])}" for d in exited))
        if down:
            raise StackError(f"teachers not healthy after {timeout_s:.0f}s: {', '.join(sorted(down))}")
    except BaseException:
        stop_entries(list(state["teachers"].values()), grace_s=5.0)
        state_path.unlink(missing_ok=True)
        raise
    return state


def teachers_down(home: Path) -> list[str]:
    state_path = Path(home).resolve() / STATE_FILE
    state = read_state(state_path)
    if not state:
        return []
    running = sorted(d for d, t in state["teachers"].items() if is_alive(t))
    stop_entries(list(state["teachers"].values()), grace_s=5.0)
    state_path.unlink(missing_ok=True)
    return running


def teachers_status(home: Path) -> dict[str, dict] | None:
    """{domain: {"up", "healthy", "url", "pid", "model_path"}}, or None when no teachers were started."""
    state = read_state(Path(home).resolve() / STATE_FILE)
    if not state:
        return None
    return {d: {"up": is_alive(t), "healthy": http_get(t["url"] + "/health", timeout=2.0)[0] == 200,
                "url": t["url"], "pid": t["pid"], "model_path": t["model_path"]} for d, t in state["teachers"].items()}


def _print_external(teachers: dict[str, dict]) -> None:
    print("point a run at them (config):\nteachers:\n  external:")
    for d, t in sorted(teachers.items()):
        print(f"    {d}: {t['url']}")
    print("or on the command line:\n  " + " ".join(f"--set teachers.external.{d}={t['url']}"
                                                 for d, t in sorted(teachers.items())))


def cmd_teachers(args) -> int:
    home = Path(args.home)
    try:
        if args.teachers_command == "up":
            checkpoints = resolve_checkpoints(args.checkpoints)
            cfg = None
            if args.config:
                from infra.config import ConfigError, load_config

                try:
                    cfg = load_config(args.config, args.overrides)
                except (ConfigError, FileNotFoundError) as exc:
                    raise CheckpointsError(f"--config: {exc}") from None
            state = teachers_up(home, checkpoints, args.port_start, args.threads, args.timeout,
                                teacher_specs(checkpoints, cfg, args.gpus))
            print(f"teachers {'already up' if state.get('already_up') else 'up'}:")
            for d, t in sorted(state["teachers"].items()):
                where = f"  [GPU {t['gpus']}]" if t.get("gpus") else ""
                print(f"  {d:<16}{t['url']:<28}{t['model_path']}{where}")
            _print_external(state["teachers"])
            return 0
        if args.teachers_command == "down":
            stopped = teachers_down(home)
            print(f"stopped: {', '.join(stopped)}" if stopped else "no teachers running")
            return 0
        st = teachers_status(home)
        if st is None:
            print(f"no teachers (no {STATE_FILE} in {home.resolve()})")
            return 1
        print(f"{'domain':<16}{'state':<9}{'pid':<9}{'url':<28}checkpoint")
        for d, r in sorted(st.items()):
            label = "healthy" if r["healthy"] else ("up" if r["up"] else "down")
            print(f"{d:<16}{label:<9}{r['pid']:<9}{r['url']:<28}{r['model_path']}")
        return 0 if all(r["healthy"] for r in st.values()) else 1
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CheckpointsError) else 1


def add_parser(sub, default_home: Path) -> None:
    t = sub.add_parser("teachers", help="serve teacher engine servers outside the pipeline (up | down | status)",
                       description="Teacher servers a pipeline can use through teachers.external.")
    tsub = t.add_subparsers(dest="teachers_command", required=True, metavar="{up,down,status}")
    home_help = "where teachers.json and the logs live (default $ALLOY_STACK_HOME, else <repo>/runs/stack)"
    tu = tsub.add_parser("up", help="serve one engine server per domain checkpoint, detached",
                         description="Exit 0 when every teacher answers /health, 1 when one does not (log tail printed) "
                                     "or a port is busy, 2 for a bad --checkpoints value.")
    tu.add_argument("--checkpoints", required=True, metavar="DIR_OR_JSON",
                    help="a report.json, a JSON file or inline JSON {domain: checkpoint}, or a run directory")
    tu.add_argument("--port-start", type=int, default=30000, help="first port; one per domain, in domain order "
                                                                   "(0: any free ports)")
    tu.add_argument("--threads", type=int, default=1, help="torch threads per CPU server")
    tu.add_argument("--config", default=None, metavar="CONFIG", help="launch as this run would launch its teachers: "
                    "its engine section and, with GPUs, the distill stage's placement plan")
    tu.add_argument("--gpus", type=int, default=None, metavar="N", help="with --config: GPUs to plan for (default "
                    "resources.gpus_per_node, else the CUDA devices visible)")
    tu.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=c",
                    help="with --config: config overrides, as for `alloy run`")
    tu.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for /health")
    tu.add_argument("--home", default=str(default_home), help=home_help)
    td = tsub.add_parser("down", help="stop the teacher servers", description="Exit 0.")
    td.add_argument("--home", default=str(default_home), help=home_help)
    ts = tsub.add_parser("status", help="each teacher's health, URL and checkpoint",
                         description="Exit 0 when every teacher is healthy, 1 otherwise.")
    ts.add_argument("--home", default=str(default_home), help=home_help)
    t.set_defaults(fn=cmd_teachers)
