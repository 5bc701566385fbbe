"""`alloy up | down | status`: the local stack a user schedules and watches runs with, all on 127.0.0.1.

`up` starts, as detached processes with their logs under `<home>/logs/`:
  1. a Prefect server (`prefect server start`, SQLite at `<home>/prefect/prefect.db`; PREFECT_HOME points into the
     home dir, so the user's `~/.prefect` is never read or written),
  2. the MLflow server on the pipeline's tracking store (`sqlite:///<runs root>/mlflow.db`, the URI
     `infra.tracking.resolve_tracking_uri` gives a run whose `run.root` is `runs` in the repo),
then creates the process work pool `alloy-local`, registers `prefect.yaml`'s deployments (`prefect deploy --all`, with
ALLOY_HOME = the repo, which the deployments' pull step changes into) and starts a worker on the pool. The worker
(and so every flow run) gets MLFLOW_TRACKING_URI, so what the worker logs is what the MLflow UI shows.

State (pids, process start times, ports, URLs) is written to `<home>/stack.json` as each piece starts, so `down`
can clean up even after an interrupted `up`. A pid counts as ours only while its start time matches the recorded
one: a recycled pid is never signalled. `down` stops each component's process group and every descendant (flow-run
processes of the worker may lead their own sessions), SIGTERM first, SIGKILL after a grace period.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = "alloy-local"
WORKER_NAME = "alloy-local-worker"
HOST = "127.0.0.1"
STATE_FILE = "stack.json"
COMPONENTS = ("prefect-server", "mlflow", "prefect-worker")


class StackError(RuntimeError):
    """Something a user can act on (a busy port, a component that did not come up); the message says what."""


# ------------------------------------------------------------------------------------------ processes and state


def default_home() -> Path:
    return Path(os.environ.get("ALLOY_STACK_HOME") or REPO_ROOT / "runs" / "stack").resolve()


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether binding host:port fails (SO_REUSEADDR as servers set it, so TIME_WAIT sockets do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def pick_port(port: int, component: str, host: str = HOST) -> int:
    """`port`, or a free one when it is 0; a busy port raises naming the component and the flag to change."""
    if port == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    if port_in_use(port, host):
        raise StackError(f"port {port} ({component}) is already in use on {host}; stop what uses it or pass another "
                         f"port (0 picks a free one)")
    return port


def log_tail(path: str | Path, n_lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return "(no log)"


def spawn(name: str, cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> dict:
    """Start `cmd` detached (its own session, so it outlives this process and `down` can signal its group);
    returns the state entry {name, pid, create_time, log, cmd}."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n=== alloy {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(cwd), start_new_session=True, close_fds=True)
    return {"name": name, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
            "log": str(log_path), "cmd": cmd}


def _process(entry: dict | None) -> psutil.Process | None:
    """The live process an entry recorded, or None (gone, a zombie, or a recycled pid)."""
    if not entry or not entry.get("pid"):
        return None
    try:
        p = psutil.Process(entry["pid"])
        if abs(p.create_time() - entry["create_time"]) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


def is_alive(entry: dict | None) -> bool:
    return _process(entry) is not None


def _reap(pid: int) -> None:
    try:  # only succeeds for our own children (e.g. `up` called in-process); avoids zombies
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_entries(entries: list[dict], grace_s: float = 10.0) -> list[int]:
    """SIGTERM each live entry's process group and all its descendants, SIGKILL what is left after `grace_s`.
    Returns the pids that were signalled."""
    procs: dict[int, psutil.Process] = {}
    groups: set[int] = set()
    for e in entries:
        p = _process(e)
        if p is None:
            continue
        for q in [p] + p.children(recursive=True):  # collected first: a dying parent orphans its children
            procs[q.pid] = q
        groups.add(p.pid)  # spawn() made it a session (and group) leader

    def send(sig: int) -> None:
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for q in procs.values():
            try:
                q.send_signal(sig)  # psutil checks the pid still belongs to the same process
            except psutil.Error:
                pass

    def gone(q: psutil.Process) -> bool:
        _reap(q.pid)
        try:
            return not q.is_running() or q.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(gone(q) for q in procs.values()):
        time.sleep(0.2)
    if not all(gone(q) for q in procs.values()):
        send(signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(gone(q) for q in procs.values()):
            time.sleep(0.1)
    return sorted(procs)


def read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise StackError(f"state file {path} is not valid JSON ({exc}); delete it after checking nothing runs") from exc


def write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)  # atomic: a concurrent `status` never reads half a file


def http_get(url: str, timeout: float = 3.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def http_post_json(url: str, body: dict, timeout: float = 5.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_until(check, entry: dict, what: str, timeout_s: float) -> None:
    """Poll `check()` until true; raise with the log tail if the process exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):  # connection refused, half-started server, bad JSON
            pass
        if not is_alive(entry):
            raise StackError(f"{what} exited before it was ready; last lines of {entry['log']}:\n{log_tail(entry['log'])}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout_s:.0f}s; last lines of {entry['log']}:\n"
                             f"{log_tail(entry['log'])}")
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ the stack


def _bin(name: str) -> list[str]:
    """The console script next to this interpreter (the venv's), else `python -m name`."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", name]


def stack_env(home: Path, api_url: str, tracking_uri: str, ui_url: str | None) -> dict[str, str]:
    """The environment of every stack process: Prefect state under home, the repo importable, runs tracked in
    the MLflow store the UI serves."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_PROFILE", "PREFECT_API_KEY")}
    pdir = home / "prefect"
    env.update(
        PREFECT_HOME=str(pdir), PREFECT_PROFILES_PATH=str(pdir / "profiles.toml"), PREFECT_API_URL=api_url,
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{pdir / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false", ALLOY_HOME=str(REPO_ROOT), MLFLOW_TRACKING_URI=tracking_uri,
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if ui_url:
        env["ALLOY_MLFLOW_UI_URL"] = ui_url  # lets a flow link its Prefect artifacts to the MLflow run page
    return env


def _prefect_health(url: str) -> bool:
    status, body = http_get(url + "/api/health")
    return status == 200 and body.strip() == b"true"


def _worker_online(api_url: str) -> bool:
    workers = http_post_json(f"{api_url}/work_pools/{POOL}/workers/filter", {})
    return any(w.get("name") == WORKER_NAME and w.get("status") == "ONLINE" for w in workers or [])


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
       tracking_uri: str | None = None, timeout_s: float = 240.0, echo=print) -> dict:
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
        # `prefect server start` through alloy.prefect_compat: the same command plus a FastAPI null-body fix
        # without which `prefect deploy` fails against Prefect 3.8.8 + FastAPI 0.154 (see that module)
        comps["prefect-server"] = spawn("prefect-server", [sys.executable, "-m", "alloy.prefect_compat",
            "server", "start", "--host", HOST, "--port", str(pport), "--analytics-off", "--no-prompt"],
            logs / "prefect-server.log", env, home)
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
        echo(f"work pool {POOL} ready; deploying prefect.yaml …")
        _run_step("prefect deploy", _bin("prefect") + ["deploy", "--all", "--no-prompt"], env, logs / "deploy.log")
        comps["prefect-worker"] = spawn("prefect-worker", _bin("prefect") + [
            "worker", "start", "--pool", POOL, "--type", "process", "--name", WORKER_NAME], logs / "worker.log",
            env, home)
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
    runs = http_post_json(f"{api_url}/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": limit})
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
    print(f"use it:      export PREFECT_API_URL={u['prefect_api']}\n"
          f"             prefect deployment run 'alloy-pipeline/smoke' --watch")


def cmd_up(args) -> int:
    for flag, port in (("--prefect-port", args.prefect_port), ("--mlflow-port", args.mlflow_port)):
        if not 0 <= port <= 65535:
            print(f"error: {flag} must be in 0..65535 (0 = any free port), got {port}", file=sys.stderr)
            return 2
    try:
        state = up(Path(args.home), args.prefect_port, args.mlflow_port,
                   runs_root=Path(args.runs_root) if args.runs_root else None, tracking_uri=args.mlflow_uri)
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
