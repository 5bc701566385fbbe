"""`alloy up | down | status`: the local stack a user schedules and watches runs with, all on 127.0.0.1.

`up` starts, as detached processes with their logs under `<home>/logs/`:
  1. a Prefect server (`prefect server start`, SQLite at `<home>/prefect/prefect.db`; PREFECT_HOME points into the
     home dir, so the user's `~/.prefect` is never read or written),
  2. the MLflow server on the pipeline's tracking store (`sqlite:///<runs root>/mlflow.db`, the URI
     `infra.tracking.resolve_tracking_uri` gives a run whose `run.root` is `runs` in the repo),
then creates the process work pool `alloy-local`, the global concurrency limit `gpu` (`--gpu-slots N`: how many
specialist flow runs of `specialists.mode: deployment` train at once; an existing limit is set to N), registers
`prefect.yaml`'s deployments (`prefect deploy --all`) and starts a stock worker on the pool in the repository (the
deployments' pull step uses the worker's folder when ALLOY_HOME is unset; alloy/deploy_steps.py). The worker
(and so every flow run) gets MLFLOW_TRACKING_URI, so what the worker logs is what the MLflow UI shows.

State (pids, process start times, ports, URLs) is written to `<home>/stack.json` as each piece starts, so `down`
can clean up even after an interrupted `up`. A pid counts as ours only while its start time matches the recorded
one: a recycled pid is never signalled. `down` stops each component's process group and every descendant (flow-run
processes of the worker may lead their own sessions), SIGTERM first, SIGKILL after a grace period.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

from alloy.detached import (HOST, REPO_ROOT, StackError, http_get, http_json, is_alive, pick_port, read_state, spawn,
                            stack_env, stop_entries, wait_until, write_state)

POOL = "alloy-local"
WORKER_NAME = "alloy-local-worker"
STATE_FILE = "stack.json"
COMPONENTS = ("prefect-server", "mlflow", "prefect-worker")
GPU_LIMIT = "gpu"  # the global concurrency limit each alloy-specialist flow run holds one slot of
DEFAULT_GPU_SLOTS = 2  # = specialists.max_parallel's default: as many at once as local mode trains


def default_home() -> Path:
    return Path(os.environ.get("ALLOY_STACK_HOME") or REPO_ROOT / "runs" / "stack").resolve()


# ------------------------------------------------------------------------------------------ the stack


def _bin(name: str) -> list[str]:
    """The console script next to this interpreter (the venv's), else `python -m name`."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", name]


def _prefect_health(url: str) -> bool:
    status, body = http_get(url + "/api/health")
    return status == 200 and body.strip() == b"true"


def _worker_online(api_url: str) -> bool:
    workers = http_json(f"{api_url}/work_pools/{POOL}/workers/filter", {})
    return any(w.get("name") == WORKER_NAME and w.get("status") == "ONLINE" for w in workers or [])


def ensure_gpu_limit(api_url: str, slots: int) -> str:
    """Create the global concurrency limit `gpu` with `slots` slots, or set an existing one to `slots`
    (idempotent); returns "created", "updated" or "unchanged"."""
    url = f"{api_url}/v2/concurrency_limits/"
    try:
        current = http_json(url + GPU_LIMIT, timeout=10)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        http_json(url, {"name": GPU_LIMIT, "limit": slots, "active": True}, timeout=10)
        return "created"
    if current.get("limit") == slots and current.get("active", True):
        return "unchanged"
    http_json(url + GPU_LIMIT, {"limit": slots, "active": True}, "PATCH", timeout=10)
    return "updated"


def prefect_server_command(port: int, host: str = HOST) -> list[str]:
    """The Prefect server's argv (also what tests/e2e/test_scaleout.py starts): a stock `prefect server start`.
    It takes `prefect deploy` only with the FastAPI that pyproject.toml pins (< 0.151; see the pin's comment)."""
    return _bin("prefect") + ["server", "start", "--host", host, "--port", str(port), "--analytics-off",
                              "--no-prompt"]


def _run_step(what: str, cmd: list[str], env: dict, log_path: Path, timeout_s: float = 300.0) -> str:
    """Run a short Prefect CLI command to completion; raise with its output if it fails."""
    proc = subprocess.run(cmd, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    with open(log_path, "a") as f:
        f.write(f"\n=== {' '.join(cmd)} (exit {proc.returncode})\n{out}")
    if proc.returncode != 0 and not (what == "work pool" and "already exists" in out):
        raise StackError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out


def up(home: Path, prefect_port: int = 4200, mlflow_port: int = 5000, runs_root: Path | None = None,
       tracking_uri: str | None = None, timeout_s: float = 240.0, echo=print,
       gpu_slots: int = DEFAULT_GPU_SLOTS) -> dict:
    """Start the stack (see the module docstring) and return its state; already up → the existing state.
    Raises StackError; on failure everything started so far is stopped again."""
    from infra.tracking import resolve_tracking_uri

    home = Path(home).resolve()
    state_path = home / STATE_FILE
    old = read_state(state_path)
    if old:
        alive = {n: is_alive(e) for n, e in old.get("components", {}).items()}
        if alive and all(alive.values()):
            old["already_up"] = True
            return old
        if any(alive.values()):
            down_now = sorted(n for n, a in alive.items() if not a)
            raise StackError(f"the stack in {home} is partly up ({', '.join(down_now)} down); run `alloy down "
                             f"--home {home}` first")
    if not tracking_uri:  # an explicit --runs-root wins over MLFLOW_TRACKING_URI; otherwise the pipeline's rule
        tracking_uri = ("sqlite:///" + str(Path(runs_root).resolve() / "mlflow.db") if runs_root
                        else resolve_tracking_uri(REPO_ROOT / "runs"))
    local_mlflow = tracking_uri.startswith("sqlite:///")
    pport = pick_port(prefect_port, "prefect server, --prefect-port")
    mport = pick_port(mlflow_port, "mlflow, --mlflow-port") if local_mlflow else None
    if mport == pport:
        raise StackError(f"--prefect-port and --mlflow-port are both {pport}")
    api_url, ui_url = f"http://{HOST}:{pport}/api", f"http://{HOST}:{pport}"
    mlflow_url = f"http://{HOST}:{mport}" if local_mlflow else tracking_uri
    env = stack_env(home, api_url, tracking_uri, mlflow_url)
    logs = home / "logs"
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    state = {"home": str(home), "repo": str(REPO_ROOT), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "pool": POOL, "tracking_uri": tracking_uri, "components": {},
             "urls": {"prefect_ui": ui_url, "prefect_api": api_url, "mlflow_ui": mlflow_url}}
    comps = state["components"]
    try:
        comps["prefect-server"] = spawn("prefect-server", prefect_server_command(pport), logs / "prefect-server.log",
                                        env, home)
        comps["prefect-server"].update(port=pport, url=ui_url)
        write_state(state_path, state)
        if local_mlflow:
            db = Path(tracking_uri[len("sqlite:///"):])
            db.parent.mkdir(parents=True, exist_ok=True)
            comps["mlflow"] = spawn("mlflow", _bin("mlflow") + [
                "server", "--host", HOST, "--port", str(mport), "--backend-store-uri", tracking_uri,
                "--default-artifact-root", (db.parent / "mlartifacts").as_uri(), "--no-serve-artifacts",
                "--workers", "1"], logs / "mlflow.log", env, home)
            comps["mlflow"].update(port=mport, url=mlflow_url)
            write_state(state_path, state)
        echo(f"starting the Prefect server on {ui_url} and MLflow on {mlflow_url} …")
        wait_until(lambda: _prefect_health(ui_url), comps["prefect-server"], "prefect server", timeout_s)
        _run_step("work pool", _bin("prefect") + ["work-pool", "create", POOL, "--type", "process"], env,
                  logs / "deploy.log")
        try:
            action = ensure_gpu_limit(api_url, gpu_slots)
        except (OSError, ValueError) as exc:  # HTTPError, connection refused, bad JSON
            raise StackError(f"creating the global concurrency limit {GPU_LIMIT} failed: {exc}") from None
        state["gpu_limit"] = {"name": GPU_LIMIT, "slots": gpu_slots, "action": action}
        echo(f"work pool {POOL} and concurrency limit {GPU_LIMIT} ({gpu_slots} slots) ready; deploying prefect.yaml …")
        _run_step("prefect deploy", _bin("prefect") + ["deploy", "--all", "--no-prompt"], env, logs / "deploy.log")
        # a stock worker started in the repository, as Prefect's docs teach: no ALLOY_HOME (unless the user's
        # environment sets one), no PYTHONPATH of ours; the pull step finds the repository as the worker's folder
        worker_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if os.environ.get("PYTHONPATH"):
            worker_env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        comps["prefect-worker"] = spawn("prefect-worker", _bin("prefect") + [
            "worker", "start", "--pool", POOL, "--type", "process", "--name", WORKER_NAME], logs / "worker.log",
            {**worker_env, "PWD": str(REPO_ROOT)}, REPO_ROOT)
        comps["prefect-worker"].update(port=None, url=f"{ui_url}/work-pools/work-pool/{POOL}")
        write_state(state_path, state)
        wait_until(lambda: _worker_online(api_url), comps["prefect-worker"], "prefect worker", timeout_s)
        if local_mlflow:
            wait_until(lambda: http_get(mlflow_url + "/health")[0] == 200, comps["mlflow"], "mlflow server", timeout_s)
    except BaseException:
        stop_entries(list(comps.values()))
        state_path.unlink(missing_ok=True)
        raise
    return state


def down(home: Path) -> list[str]:
    """Stop every live component of the stack in `home` (worker first, so it stops taking runs); returns the
    names that were running. The state file is removed."""
    state_path = Path(home).resolve() / STATE_FILE
    state = read_state(state_path)
    if not state:
        return []
    comps = state.get("components", {})
    order = [n for n in ("prefect-worker", "mlflow", "prefect-server") if n in comps]
    running = [n for n in order if is_alive(comps[n])]
    stop_entries([comps[n] for n in order[:1]])  # the worker and its flow runs, before the API they report to
    stop_entries([comps[n] for n in order[1:]])
    state_path.unlink(missing_ok=True)
    return running


def latest_flow_runs(api_url: str, limit: int = 5) -> list[dict]:
    """The newest flow runs as {name, flow, deployment, state, start, id} (plain REST: no Prefect import)."""
    runs = http_json(f"{api_url}/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": limit})
    names: dict[str, str] = {}

    def name_of(kind: str, ident: str | None) -> str:
        if not ident:
            return "-"
        if ident not in names:
            status, body = http_get(f"{api_url}/{kind}/{ident}")
            names[ident] = json.loads(body).get("name", "?") if status == 200 else "?"
        return names[ident]

    return [{"name": r["name"], "flow": name_of("flows", r.get("flow_id")),
             "deployment": name_of("deployments", r.get("deployment_id")), "state": r.get("state_name") or "-",
             "start": (r.get("start_time") or r.get("expected_start_time") or "-")[:19], "id": r["id"]}
            for r in runs]


def status(home: Path) -> dict:
    """{"state": state file or None, "components": {name: {"up" (process alive), "answers" (alive and answering
    its health check; the worker: ONLINE in the API), "pid", "url"}}, "flow_runs": [...] | None, "all_up": bool}."""
    state = read_state(Path(home).resolve() / STATE_FILE)
    comps = (state or {}).get("components", {})
    rows = {n: {"up": is_alive(comps.get(n)), "pid": (comps.get(n) or {}).get("pid"),
                "url": (comps.get(n) or {}).get("url", "-")} for n in COMPONENTS}
    if state and "mlflow" not in comps:  # a remote tracking server: not ours to run
        rows["mlflow"] = {"up": True, "pid": None, "url": state["urls"]["mlflow_ui"]}
    # a live process is not enough: it must answer (a hung server shows as "no answer")
    if rows["prefect-server"]["up"]:
        rows["prefect-server"]["answers"] = _prefect_health(state["urls"]["prefect_ui"])
    if rows["mlflow"]["up"]:
        rows["mlflow"]["answers"] = http_get(state["urls"]["mlflow_ui"] + "/health")[0] == 200
    if rows["prefect-worker"]["up"] and rows["prefect-server"].get("answers"):
        try:
            rows["prefect-worker"]["answers"] = _worker_online(state["urls"]["prefect_api"])
        except (OSError, ValueError):
            rows["prefect-worker"]["answers"] = False
    for r in rows.values():
        r["answers"] = r["up"] and r.get("answers", False)
    runs = None
    if state and rows["prefect-server"]["answers"]:
        try:
            runs = latest_flow_runs(state["urls"]["prefect_api"])
        except (OSError, ValueError):
            runs = None
    return {"state": state, "components": rows, "flow_runs": runs, "all_up": all(r["answers"] for r in rows.values())}


# ------------------------------------------------------------------------------------------ CLI


def _print_urls(state: dict) -> None:
    u = state["urls"]
    print(f"Prefect UI   {u['prefect_ui']}\nPrefect API  {u['prefect_api']}\nMLflow UI    {u['mlflow_ui']}")
    print(f"work pool    {state['pool']} (worker {WORKER_NAME}); logs in {state['home']}/logs")
    if state.get("gpu_limit"):
        print(f"gpu limit    {state['gpu_limit']['name']}: {state['gpu_limit']['slots']} slots")
    print(f"use it:      export PREFECT_API_URL={u['prefect_api']}\n"
          f"             prefect deployment run 'alloy-pipeline/smoke' --watch")


def cmd_up(args) -> int:
    for flag, port in (("--prefect-port", args.prefect_port), ("--mlflow-port", args.mlflow_port)):
        if not 0 <= port <= 65535:
            print(f"error: {flag} must be in 0..65535 (0 = any free port), got {port}", file=sys.stderr)
            return 2
    if args.gpu_slots < 1:
        print(f"error: --gpu-slots must be at least 1, got {args.gpu_slots}", file=sys.stderr)
        return 2
    try:
        state = up(Path(args.home), args.prefect_port, args.mlflow_port,
                   runs_root=Path(args.runs_root) if args.runs_root else None, tracking_uri=args.mlflow_uri,
                   gpu_slots=args.gpu_slots)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("already up" if state.get("already_up") else "the Alloy stack is up")
    _print_urls(state)
    return 0


def cmd_down(args) -> int:
    try:
        stopped = down(Path(args.home))
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing running (home {Path(args.home).resolve()})")
    return 0


def cmd_status(args) -> int:
    try:
        st = status(Path(args.home))
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if st["state"] is None:
        print(f"not running (no {STATE_FILE} in {Path(args.home).resolve()}); start it with `alloy up`")
        return 1
    print(f"{'component':<16}{'state':<11}{'pid':<9}url")
    for name, r in st["components"].items():
        label = "up" if r["answers"] else ("no answer" if r["up"] else "down")
        print(f"{name:<16}{label:<11}{str(r['pid'] or '-'):<9}{r['url']}")
    if st["flow_runs"] is not None:
        print("\nlatest flow runs:" if st["flow_runs"] else "\nno flow runs yet")
        for r in st["flow_runs"]:
            where = f"{r['flow']}/{r['deployment']}" if r["deployment"] != "-" else f"{r['flow']} (subflow)"
            print(f"  {r['start']}  {r['state']:<10} {where}  {r['name']}  "
                  f"{st['state']['urls']['prefect_ui']}/runs/flow-run/{r['id']}")
    return 0 if st["all_up"] else 1


def add_parsers(sub) -> None:
    """Register `up`, `down`, `status` and `teachers` on the `alloy` subparsers."""
    home_help = "state, logs and Prefect's SQLite live here (default $ALLOY_STACK_HOME, else <repo>/runs/stack)"
    u = sub.add_parser("up", help="start Prefect server + worker + MLflow UI on 127.0.0.1 and deploy prefect.yaml",
                       description="Start the local stack: Prefect server (SQLite), work pool alloy-local, the "
                                   "deployments of prefect.yaml, a worker, and the MLflow UI. Exit 0 when up (or "
                                   "already up), 1 when a component fails (port busy, did not start).")
    u.add_argument("--home", default=str(default_home()), help=home_help)
    u.add_argument("--prefect-port", type=int, default=4200, help="Prefect server/UI port (0: any free port)")
    u.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port (0: any free port)")
    u.add_argument("--runs-root", default=None, help="the runs root whose mlflow.db the UI serves (default <repo>/runs)")
    u.add_argument("--mlflow-uri", default=None, help="tracking URI instead (sqlite:///… is served; http… is used "
                                                      "as is); default $MLFLOW_TRACKING_URI, else the runs root's")
    u.add_argument("--gpu-slots", type=int, default=DEFAULT_GPU_SLOTS,
                   help="slots of the global concurrency limit `gpu` (specialist flow runs training at once in "
                        f"specialists.mode=deployment; default {DEFAULT_GPU_SLOTS}, as specialists.max_parallel); "
                        "an existing limit is set to this")
    u.set_defaults(fn=cmd_up)
    d = sub.add_parser("down", help="stop everything `alloy up` started (no orphans)",
                       description="Stop the worker (and its flow runs), MLflow and the Prefect server. Exit 0.")
    d.add_argument("--home", default=str(default_home()), help=home_help)
    d.set_defaults(fn=cmd_down)
    s = sub.add_parser("status", help="each component up/down with its URL, and the latest flow runs",
                       description="Exit 0 when every component is up, 1 otherwise.")
    s.add_argument("--home", default=str(default_home()), help=home_help)
    s.set_defaults(fn=cmd_status)
    from alloy.teachers_stack import add_parser as add_teachers

    add_teachers(sub, default_home())
