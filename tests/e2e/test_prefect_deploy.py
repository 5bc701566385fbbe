"""The deployment path a user takes: `alloy up` (a real `prefect server start` on SQLite, the `alloy-local` process
pool, `prefect deploy --all` from prefect.yaml, a worker, MLflow), then `prefect deployment run
'alloy-pipeline/smoke' --watch` → Completed with its report; `alloy status`, `up` twice, a busy port, `alloy down`.
The server is a stock `prefect server start` (its argv is checked: no wrapper, no patch), so all of this is tested
against the server a team runs itself with this environment's pins. On the same server, the Kubernetes work pool
of deploy/kubernetes/ (template and GPU deployments; no cluster needed).

The tests in this file run in order: the last one stops the session's stack."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from e2e_helpers import DOMAINS, ROOT, api_get, run_cli

pytestmark = pytest.mark.e2e
PREFECT = str(Path(sys.executable).parent / "prefect")
K8S = ROOT / "deploy" / "kubernetes"


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
    assert api_get(f"{api}/v2/concurrency_limits/gpu")["limit"] == 2  # `alloy up`'s default --gpu-slots
    assert "gpu limit    gpu: 2 slots" in stack["up_stdout"]
    deps = {d["name"]: d for d in api_post(f"{api}/deployments/filter", {})}
    assert {"demo", "smoke"} <= set(deps)
    for name in ("demo", "smoke"):
        d = deps[name]
        assert d["work_pool_name"] == "alloy-local" and d["entrypoint"] == "flows/pipeline.py:pipeline"
        assert d["enforce_parameter_schema"] is True
        assert set(d["parameter_openapi_schema"]["properties"]) == {"config", "overrides", "report_path"}
    assert deps["smoke"]["parameters"]["config"] == "configs/smoke.yaml"
    # prefect.yaml's example schedule: on the demo deployment, created paused (shown on the Deployments page)
    (sched,) = api_get(f"{api}/deployments/{deps['demo']['id']}/schedules")
    assert sched["active"] is False and sched["schedule"]["cron"] == "0 2 * * *", sched
    assert sched["schedule"]["timezone"] == "UTC"
    assert api_get(f"{api}/deployments/{deps['smoke']['id']}/schedules") == []
    assert not deps["demo"]["paused"]  # the deployment itself runs on demand; only its schedule is off
    workers = api_post(f"{api}/work_pools/alloy-local/workers/filter", {})
    assert [w["status"] for w in workers if w["name"] == "alloy-local-worker"] == ["ONLINE"]
    # a stock worker started in the repository: no ALLOY_HOME, no PYTHONPATH of ours (the smoke run below proves
    # that the pull step finds the repository as the worker's folder)
    worker = psutil.Process(stack["components"]["prefect-worker"]["pid"])
    assert worker.cwd() == str(ROOT) and worker.cmdline()[1:5] == [PREFECT, "worker", "start", "--pool"]
    if "ALLOY_HOME" not in os.environ:
        assert "ALLOY_HOME" not in worker.environ()
    # a stock server: the venv's `prefect` console script, `server start`, nothing in between
    argv = psutil.Process(stack["components"]["prefect-server"]["pid"]).cmdline()
    port = str(stack["components"]["prefect-server"]["port"])
    assert argv[1:] == [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port, "--analytics-off",
                        "--no-prompt"], argv
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
    if "ALLOY_HOME" not in os.environ:  # the stock worker's flow run found the repository itself, and said so
        log = Path(stack["components"]["prefect-worker"]["log"]).read_text(errors="replace")
        assert f"alloy pull step: $ALLOY_HOME is not set; using the worker's working directory, {ROOT}" in log
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


def _prefect(stack, *args: str) -> tuple[int, str]:
    proc = subprocess.run([PREFECT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=stack["env"])
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())  # Rich wraps lines: compare unwrapped


def test_kubernetes_pool_template_and_gpu_deployments(stack):
    """deploy/kubernetes/ on the real server (no cluster). base-job-template.json is Prefect's default kubernetes
    template (what `prefect work-pool get-default-base-job-template --type kubernetes` prints; the server has it
    without prefect-kubernetes) plus the variables gpu_count (the container's `nvidia.com/gpu` limit, default 1),
    node_selector, tolerations and shm_size. `prefect work-pool create --type kubernetes --base-job-template`
    accepts it, and deploy/kubernetes/prefect.yaml deploys onto the pool. That file stays apart from the root
    prefect.yaml because `prefect deploy` refuses a missing pool (checked first: `alloy up` must deploy where no
    alloy-k8s pool exists). What a worker would submit is rendered with Prefect's own templating: a Job that asks
    for the deployment's GPUs."""
    from prefect.utilities.templating import apply_values

    from infra.config import load_config

    api = stack["urls"]["prefect_api"]
    ours = json.loads((K8S / "base-job-template.json").read_text())
    # what `prefect work-pool get-default-base-job-template --type kubernetes` prints, from the same endpoint
    workers = api_get(f"{api}/collections/views/aggregate-worker-metadata")
    default = workers["prefect-kubernetes"]["kubernetes"]["default_base_job_configuration"]
    added = {"gpu_count", "node_selector", "tolerations", "shm_size"}
    assert set(ours["variables"]["properties"]) - set(default["variables"]["properties"]) == added
    spec = ours["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"].pop("nvidia.com/gpu") == "{{ gpu_count }}"
    for key in ("nodeSelector", "tolerations", "volumes"):
        spec.pop(key)
    container.pop("volumeMounts")
    for name in added:
        ours["variables"]["properties"].pop(name)
    assert ours == default, "base-job-template.json drifted from Prefect's default kubernetes template"

    deploy = ("--no-prompt", "deploy", "--prefect-file", "deploy/kubernetes/prefect.yaml", "--all")
    rc, out = _prefect(stack, *deploy)
    assert rc != 0 and "references work pool 'alloy-k8s' which does not exist" in out, out
    rc, out = _prefect(stack, "work-pool", "create", "alloy-k8s", "--type", "kubernetes", "--base-job-template",
                       str(K8S / "base-job-template.json"))
    assert rc == 0, out
    pool = api_get(f"{api}/work_pools/alloy-k8s")
    assert pool["type"] == "kubernetes"
    props = pool["base_job_template"]["variables"]["properties"]
    assert props["gpu_count"]["type"] == "integer" and props["gpu_count"]["default"] == 1
    assert props["tolerations"]["default"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                "effect": "NoSchedule"}]
    rc, out = _prefect(stack, *deploy)
    assert rc == 0, out

    deps = api_post(f"{api}/deployments/filter", {"work_pools": {"name": {"any_": ["alloy-k8s"]}}})
    by_entry = {d["entrypoint"]: d for d in deps}
    assert set(by_entry) == {"flows/pipeline.py:pipeline", "flows/specialists.py:specialist",
                             "flows/distill.py:distill"} and {d["name"] for d in deps} == {"gpu"}
    pipeline = by_entry["flows/pipeline.py:pipeline"]
    assert {"specialists.mode=deployment", "specialists.deployment=alloy-specialist/gpu", "distill.mode=deployment",
            "distill.deployment=alloy-distill/gpu",
            "resources.gpus_per_node=null"} <= set(pipeline["parameters"]["overrides"])
    cfg = load_config(ROOT / pipeline["parameters"]["config"], pipeline["parameters"]["overrides"],
                      check_model_path=False)  # what the flow run loads first (the model is in the image)
    assert (cfg.specialists.deployment, cfg.distill.deployment) == ("alloy-specialist/gpu", "alloy-distill/gpu")
    assert cfg.resources.gpus_per_node is None
    assert pipeline["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/alloy"}}]
    defaults = {k: v["default"] for k, v in props.items() if "default" in v}
    for entry, gpus in (("flows/pipeline.py:pipeline", 8), ("flows/specialists.py:specialist", 2),
                        ("flows/distill.py:distill", 8)):
        job_vars = by_entry[entry]["job_variables"]
        assert job_vars["gpu_count"] == gpus, entry
        job = apply_values(pool["base_job_template"]["job_configuration"], {**defaults, **job_vars})
        pod = job["job_manifest"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        # unset cpu/memory variables leave no key at all: only the GPU limit
        assert c["resources"]["limits"] == {"nvidia.com/gpu": gpus} and not c["resources"]["requests"], entry
        assert c["image"] == job_vars["image"] and c["env"]["ALLOY_HOME"] == "/opt/alloy"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"] == props["tolerations"]["default"]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}]
        assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert job["namespace"] == "alloy" and pod["serviceAccountName"] == "alloy"


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
