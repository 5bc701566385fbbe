"""The deployment path a user takes: `alloy up` (a real `prefect server start` on SQLite, the `alloy-local` process
pool, `prefect deploy --all` from prefect.yaml, a worker, MLflow), then `prefect deployment run
'alloy-pipeline/smoke' --watch` → Completed with its report; `alloy status`, `up` twice, a busy port, `alloy down`.

The tests in this file run in order: the last one stops the session's stack."""
from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from e2e_helpers import DOMAINS, api_get, run_cli

pytestmark = pytest.mark.e2e


def api_post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_up_registers_pool_deployments_and_worker(stack):
    api = stack["urls"]["prefect_api"]
    assert api_get(api.rsplit("/api", 1)[0] + "/api/health") is True
    pool = api_get(f"{api}/work_pools/alloy-local")
    assert pool["type"] == "process"
    deps = {d["name"]: d for d in api_post(f"{api}/deployments/filter", {})}
    assert {"demo", "smoke"} <= set(deps)
    for name in ("demo", "smoke"):
        d = deps[name]
        assert d["work_pool_name"] == "alloy-local" and d["entrypoint"] == "flows/pipeline.py:pipeline"
        assert d["enforce_parameter_schema"] is True
        assert set(d["parameter_openapi_schema"]["properties"]) == {"config", "overrides", "report_path"}
    assert deps["smoke"]["parameters"]["config"] == "configs/smoke.yaml"
    workers = api_post(f"{api}/work_pools/alloy-local/workers/filter", {})
    assert [w["status"] for w in workers if w["name"] == "alloy-local-worker"] == ["ONLINE"]
    # Prefect's state stays in the stack's home, never in the user's ~/.prefect
    assert (Path(stack["home"]) / "prefect" / "prefect.db").is_file()
    assert "Prefect UI" in stack["up_stdout"] and stack["urls"]["mlflow_ui"] in stack["up_stdout"]


def test_smoke_deployment_run_completes_with_report(stack, smoke_run):
    proc, fr = smoke_run["proc"], smoke_run["flow_run"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Completed" in proc.stdout
    assert fr["state_type"] == "COMPLETED" and fr["state_name"] == "Completed"
    dep = api_get(f"{stack['urls']['prefect_api']}/deployments/{fr['deployment_id']}")
    assert dep["name"] == "smoke"
    assert fr["parameters"]["overrides"] == smoke_run["params"]["overrides"]  # the --params override reached the run
    report = json.loads(smoke_run["report_path"].read_text())
    assert report["config"] == "configs/smoke.yaml"
    assert set(report["domains"]) == set(DOMAINS)
    for dom, row in report["domains"].items():
        assert row["n_eval"] == 10, dom
        assert all(0.0 <= row[s] <= 1.0 for s in ("base", "specialist", "student")), dom
    # the copy beside the run's checkpoints, and the MLflow run in the store the stack's MLflow server serves
    assert json.loads((Path(stack["runs_root"]) / "smoke" / "report.json").read_text())["run_id"] == report["run_id"]
    assert report["mlflow"]["tracking_uri"] == stack["tracking_uri"]
    run = api_get(f"{stack['urls']['mlflow_ui']}/api/2.0/mlflow/runs/get?run_id={report['mlflow']['parent_run_id']}")
    assert run["run"]["info"]["status"] == "FINISHED"
    metrics = {m["key"]: m["value"] for m in run["run"]["data"]["metrics"]}
    assert metrics["summary/student_mean"] == pytest.approx(report["summary"]["student_mean"], abs=1e-9)


def test_status_shows_components_and_latest_flow_runs(stack, smoke_run):
    proc = run_cli("status", "--home", stack["home"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.strip()}
    for name in ("prefect-server", "mlflow", "prefect-worker"):
        assert lines[name][1] == "up", proc.stdout
        assert int(lines[name][2]) == stack["components"][name]["pid"]
    assert lines["prefect-server"][3] == stack["urls"]["prefect_ui"]
    assert "latest flow runs:" in proc.stdout
    run_line = next(ln for ln in proc.stdout.splitlines() if smoke_run["flow_run"]["name"] in ln)
    assert "Completed" in run_line and "alloy-pipeline/smoke" in run_line and smoke_run["flow_run"]["id"] in run_line


def test_up_twice_says_already_up(stack):
    proc = run_cli("up", "--home", stack["home"], "--prefect-port", "0", "--mlflow-port", "0", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("already up")
    again = json.loads((Path(stack["home"]) / "stack.json").read_text())
    assert {n: c["pid"] for n, c in again["components"].items()} == {n: c["pid"] for n, c in stack["components"].items()}


def test_busy_port_names_port_and_component(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("up", "--home", str(tmp_path / "h"), "--prefect-port", "0", "--mlflow-port", str(port), timeout=60)
    assert proc.returncode == 1
    assert f"port {port} (mlflow, --mlflow-port) is already in use" in proc.stderr
    assert not (tmp_path / "h" / "stack.json").exists()  # nothing was started
    bad = run_cli("up", "--home", str(tmp_path / "h"), "--prefect-port", "70000", timeout=60)
    assert bad.returncode == 2 and "--prefect-port" in bad.stderr


def test_down_stops_everything_without_orphans(stack):
    """Last in this file: stops the session's stack. Every component and every process below it is gone."""
    pids = set()
    for c in stack["components"].values():
        p = psutil.Process(c["pid"])
        pids |= {p.pid} | {q.pid for q in p.children(recursive=True)}
    assert len(pids) >= 3
    proc = run_cli("down", "--home", stack["home"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stopped: prefect-worker, mlflow, prefect-server"

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert [p for p in pids if alive(p)] == []
    for c in stack["components"].values():
        if c.get("port"):
            with socket.socket() as s:  # the port is free again
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", c["port"]))
    status = run_cli("status", "--home", stack["home"], timeout=60)
    assert status.returncode == 1 and "not running" in status.stdout
    again = run_cli("down", "--home", stack["home"], timeout=60)
    assert again.returncode == 0 and "nothing running" in again.stdout
