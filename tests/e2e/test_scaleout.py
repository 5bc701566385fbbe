"""Scale-out with no shared disk (docs/scale-out.md), with real parts: a Prefect server, two process work pools
`pool-a` and `pool-b` with one worker each, each worker started from its OWN copy of the repository in its own
temporary folder (ALLOY_HOME, PYTHONPATH and cwd point there: no path of one copy is used by the other), a moto S3
server as `run.storage`, and an MLflow tracking server over HTTP (`mlflow server`, artifacts served by it).

`alloy-pipeline/scaleout` runs on pool-a with `specialists.mode=deployment` and `distill.mode=deployment`: every
`alloy-specialist` and the `alloy-distill` flow run go to pool-b, handed storage URLs only. One specialist's trainer
is SIGKILLed on worker B once a step checkpoint of it is in S3 (and its local work dir is deleted): that flow run
fails, the pipeline runs the deployment again (`specialists.retries`), and the new flow run resumes from the S3
checkpoint and completes. The run completes with a full report and one MLflow parent run with the specialists and
the student nested under it. (One test, one pipeline run: the whole file is one setup and one run, ~4 min here.)

Ports, PREFECT_HOME, S3 bucket and MLflow store are this module's own; everything is stopped at the end.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from e2e_helpers import DOMAINS, FAST, ROOT, api_get, user_env

pytestmark = pytest.mark.e2e

PREFECT = str(Path(sys.executable).parent / "prefect")
MLFLOW = str(Path(sys.executable).parent / "mlflow")
RUN_OVERRIDES = FAST + ["specialists.mode=deployment", "distill.mode=deployment"]
# the specialist whose trainer is killed: more steps and a checkpoint after each, so there is a window to kill in
KILLED = "reverse"
KILLED_STEPS, KILLED_EVERY = f"specialists.per_domain.{KILLED}.steps=6", f"specialists.per_domain.{KILLED}.checkpoint_every=1"


def _post(url: str, body: dict, method: str = "POST"):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=15) as r:
        return json.loads(r.read() or b"null")


def _wait(check, what: str, timeout_s: float, entries=()):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = check()
            if out:
                return out
        except (OSError, ValueError):
            pass
        for e in entries:
            assert psutil.pid_exists(e["pid"]), f"{e['name']} exited; log:\n{Path(e['log']).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.5)


def copy_repo(dest: Path) -> Path:
    """The working tree as it is (tracked and untracked, not ignored: uncommitted changes included), not a clone."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def start_prefect_server(home: Path, port: int, env: dict) -> dict:
    """The server as `alloy up` starts it (alloy/stack.py's command, so a change there is followed here)."""
    from alloy.detached import spawn
    from alloy.stack import prefect_server_command

    return spawn("prefect-server", prefect_server_command(port), home / "logs" / "prefect-server.log", env, home)


def deploy_file(repo: Path) -> Path:
    """prefect.yaml of this repository, its pull step and `default` deployments as they are, on pool-b, plus the
    pipeline on pool-a."""
    spec = yaml.safe_load((repo / "prefect.yaml").read_text())
    defaults = [d for d in spec["deployments"] if d["name"] == "default"]
    assert {d["entrypoint"] for d in defaults} == {"flows/specialists.py:specialist", "flows/distill.py:distill"}
    deps = [{**d, "work_pool": {"name": "pool-b"}} for d in defaults]
    deps.append({"name": "scaleout", "entrypoint": "flows/pipeline.py:pipeline", "enforce_parameter_schema": True,
                 "parameters": {"config": "configs/smoke.yaml", "overrides": [], "report_path": None},
                 "work_pool": {"name": "pool-a"}})
    out = repo / "scaleout-prefect.yaml"
    out.write_text(yaml.safe_dump({**spec, "deployments": deps}, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def cluster(moto_server):
    from alloy.detached import pick_port, stack_env, stop_entries
    from s3_fixtures import DUMMY_ENV

    base = Path(tempfile.mkdtemp(prefix="alloy-e2e-scaleout-"))
    entries: list[dict] = []
    try:
        copies = {w: copy_repo(base / f"copy-{w}") for w in ("a", "b")}
        pport, mport = pick_port(0, "prefect"), pick_port(0, "mlflow")
        api = f"http://127.0.0.1:{pport}/api"
        mlflow_url = f"http://127.0.0.1:{mport}"
        server_env = stack_env(base / "server", api, mlflow_url, None)
        entries.append(start_prefect_server(base / "server", pport, server_env))
        from alloy.detached import spawn

        (base / "mlflow").mkdir()
        entries.append(spawn("mlflow", [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(mport),
                                        "--backend-store-uri", f"sqlite:///{base / 'mlflow' / 'mlflow.db'}",
                                        "--serve-artifacts", "--artifacts-destination", str(base / "mlflow" / "art"),
                                        "--workers", "1"], base / "logs" / "mlflow.log", user_env(), base))
        bucket = moto_server.create_bucket()
        storage = f"s3://{bucket}/scaleout"

        def env_for(who: str, repo: Path | None) -> dict:
            env = user_env()
            for k in ("PYTHONPATH", "ALLOY_HOME", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
                env.pop(k, None)
            env.update(DUMMY_ENV, AWS_ENDPOINT_URL_S3=moto_server.endpoint_url, AWS_ENDPOINT_URL=moto_server.endpoint_url,
                       PREFECT_API_URL=api, PREFECT_HOME=str(base / f"prefect-home-{who}"),
                       PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_TRACKING_URI=mlflow_url,
                       PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1")
            if repo is not None:
                env.update(ALLOY_HOME=str(repo), PYTHONPATH=str(repo))
            return env

        _wait(lambda: api_get(f"http://127.0.0.1:{pport}/api/health") is True, "prefect server", 180, entries[:1])
        client = env_for("client", copies["a"])
        for pool in ("pool-a", "pool-b"):
            p = subprocess.run([PREFECT, "work-pool", "create", pool, "--type", "process"], env=client,
                               capture_output=True, text=True, timeout=180, cwd=copies["a"])
            assert p.returncode == 0, p.stdout + p.stderr
        from alloy.stack import ensure_gpu_limit

        # what `alloy up --gpu-slots 2` does, twice: idempotent
        assert [ensure_gpu_limit(api, 2), ensure_gpu_limit(api, 2), ensure_gpu_limit(api, 3)] == \
            ["created", "unchanged", "updated"]
        dep = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file",
                              str(deploy_file(copies["a"]))], env=client, capture_output=True, text=True,
                             timeout=300, cwd=copies["a"])
        assert dep.returncode == 0, dep.stdout[-3000:] + dep.stderr[-3000:]
        for w in ("a", "b"):
            # each worker asks for scheduled flow runs every 5 s (Prefect's default: 10 s; at 1 s, two workers kept
            # the server's SQLite busy enough for create_flow_run to get HTTP 503)
            entries.append(spawn(f"worker-{w}", [PREFECT, "worker", "start", "--pool", f"pool-{w}", "--type",
                                                 "process", "--name", f"worker-{w}"], base / "logs" / f"worker-{w}.log",
                                 {**env_for(w, copies[w]), "PREFECT_WORKER_QUERY_SECONDS": "5"}, copies[w]))
        for w in ("a", "b"):
            _wait(lambda: any(x["name"] == f"worker-{w}" and x["status"] == "ONLINE"
                              for x in _post(f"{api}/work_pools/pool-{w}/workers/filter", {})),
                  f"worker-{w}", 180, entries)
        _wait(lambda: urllib.request.urlopen(mlflow_url + "/health", timeout=5).status == 200, "mlflow", 120, entries)
        yield {"base": base, "copies": copies, "api": api, "mlflow": mlflow_url, "storage": storage,
               "bucket": bucket, "moto": moto_server, "client_env": client, "entries": entries}
    finally:
        stop_entries(list(reversed(entries)))
        shutil.rmtree(base, ignore_errors=True)


def deployment_id(api: str, flow: str, name: str) -> str:
    return api_get(f"{api}/deployments/name/{flow}/{name}")["id"]


def start_run(api: str, flow: str, name: str, params: dict) -> str:
    return _post(f"{api}/deployments/{deployment_id(api, flow, name)}/create_flow_run", {"parameters": params})["id"]


def wait_final(api: str, run_id: str, timeout_s: float) -> dict:
    return _wait(lambda: (lambda fr: fr if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
                          else None)(api_get(f"{api}/flow_runs/{run_id}")), f"flow run {run_id}", timeout_s)


def flow_run_logs(api: str, run_id: str) -> str:
    logs = _post(f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
    return "\n".join(x["message"] for x in logs)


def failed_runs_logs(api: str) -> str:
    """The logs of every failed flow run on the server (the assertion message of a failed run)."""
    runs = _post(f"{api}/flow_runs/filter", {"limit": 50})
    return "\n\n".join(f"--- {r['name']} ({r['state_type']}):\n{flow_run_logs(api, r['id'])[-3000:]}"
                         for r in runs if r["state_type"] in ("FAILED", "CRASHED"))


def s3_keys(cluster, prefix: str) -> list[str]:
    out = cluster["moto"].client().list_objects_v2(Bucket=cluster["bucket"], Prefix=prefix)
    return [o["Key"] for o in out.get("Contents", [])]


def trainer_after_a_checkpoint(cluster, prefix: str, copy: Path, domain: str):
    """The live trainer process of `domain` in `copy`, once a step checkpoint of `prefix` is complete in S3."""
    if not any(k.endswith("/COMPLETE") and "/step-" in k for k in s3_keys(cluster, prefix)):
        return None
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "teachers.specialist_main" in cmd and str(copy) in cmd and f"--domain {domain}" in cmd:
            return p
    return None


def test_pipeline_on_pool_a_specialists_and_distill_on_pool_b_with_a_killed_specialist(cluster):
    from infra.config import load_config
    from tasks.prefixes import base_prefix, specialist_prefix_of

    api, copies = cluster["api"], cluster["copies"]
    # the deployment records the pull step, not the deploying copy's folder: each worker resolves its own
    dep = api_get(f"{api}/deployments/name/alloy-specialist/default")
    assert dep["pull_steps"] == [{"alloy.deploy_steps.set_working_directory_from_env": {"variable": "ALLOY_HOME"}}]

    overrides = RUN_OVERRIDES + [f"run.storage={cluster['storage']}", KILLED_STEPS, KILLED_EVERY]
    prefix = specialist_prefix_of(load_config(ROOT / "configs" / "smoke.yaml", overrides), cluster["storage"],
                                  KILLED).split(f"s3://{cluster['bucket']}/", 1)[1]
    run_id = start_run(api, "alloy-pipeline", "scaleout", {"overrides": overrides, "report_path": "runs/report.json"})

    # the specialist's trainer on worker B dies mid-training (SIGKILL), once a step checkpoint is in S3; its work
    # dir goes too, so the retry has nothing but storage to resume from
    trainer = _wait(lambda: trainer_after_a_checkpoint(cluster, prefix, copies["b"], KILLED),
                    f"a step checkpoint of specialist {KILLED} in S3 while its trainer runs on worker B", 300)
    trainer.send_signal(signal.SIGKILL)
    killed_at = sorted(k for k in s3_keys(cluster, prefix) if k.endswith("/COMPLETE"))
    assert killed_at and not any("/final/" in k for k in killed_at), killed_at
    shutil.rmtree(copies["b"] / "runs" / "smoke" / "work" / "specialists" / KILLED, ignore_errors=True)

    fr = wait_final(api, run_id, 480)
    logs_a = flow_run_logs(api, run_id)
    assert fr["state_type"] == "COMPLETED", failed_runs_logs(api) + "\n--- pipeline:\n" + logs_a[-3000:]
    assert fr["work_pool_name"] == "pool-a"
    assert f"alloy-pipeline: code {copies['a']}" in logs_a

    runs = [r for r in _post(f"{api}/flow_runs/filter", {"limit": 50}) if r.get("deployment_id") and r["id"] != run_id]
    flows = {r["id"]: api_get(f"{api}/flows/{r['flow_id']}")["name"] for r in runs}
    assert {(r["work_pool_name"], flows[r["id"]]) for r in runs} == {("pool-b", "alloy-specialist"),
                                                                    ("pool-b", "alloy-distill")}
    states = sorted((r["parameters"].get("domain", "-"), r["state_type"]) for r in runs)
    assert states == sorted([("-", "COMPLETED"), (KILLED, "FAILED"), (KILLED, "COMPLETED")]
                            + [(d, "COMPLETED") for d in DOMAINS if d != KILLED])
    for r in runs:
        text = flow_run_logs(api, r["id"])
        assert f"code {copies['b']}" in text and str(copies["a"]) not in text, text[-2000:]
        values = json.dumps(r["parameters"])
        assert str(copies["a"]) not in values and "s3://" in values  # storage URLs only, no path of worker A
    # the retried flow run resumed from the checkpoint the killed one had committed, and finished
    log = (copies["b"] / "runs" / "smoke" / "work" / "logs" / f"specialist-{KILLED}.log").read_text()
    m = re.search(rf"specialist {KILLED}: resumed s3://\S+/step-(\d+) at step (\d+)", log)
    assert m, log[-3000:]
    assert int(m.group(1)) == int(m.group(2)) >= 1
    assert f"{prefix}/step-{int(m.group(1)):08d}/COMPLETE" in killed_at
    assert f"{prefix}/final/COMPLETE" in s3_keys(cluster, prefix)

    report = json.loads((copies["a"] / "runs" / "report.json").read_text())
    stored = json.loads(cluster["moto"].client().get_object(
        Bucket=cluster["bucket"], Key="scaleout/report.json")["Body"].read())
    assert stored["run_id"] == report["run_id"]
    assert set(report["domains"]) == set(DOMAINS)
    for dom, row in report["domains"].items():
        assert all(0.0 <= row[s] <= 1.0 for s in ("base", "specialist", "student")), (dom, row)
    assert report["artifacts"]["student_checkpoint"].startswith(cluster["storage"])
    # the base checkpoint the specialists were handed: committed in S3 by its manifest (written last)
    cfg = load_config(ROOT / "configs" / "smoke.yaml", overrides)
    base_keys = s3_keys(cluster, base_prefix(cfg, cluster["storage"]).split(f"s3://{cluster['bucket']}/", 1)[1])
    assert any(k.endswith("/COMPLETE") for k in base_keys) and any(k.endswith(".safetensors") for k in base_keys)
    assert all(u.startswith(cluster["storage"]) for u in report["artifacts"]["specialists"].values())
    # the trainers ran in B's copy, the pipeline's evaluations in A's: no work dir was shared
    assert all((copies["b"] / "runs" / "smoke" / "work" / "logs" / f"specialist-{d}.log").is_file() for d in DOMAINS)
    assert (copies["b"] / "runs" / "smoke" / "work" / "logs" / "distill.log").is_file()
    assert not (copies["a"] / "runs" / "smoke" / "work" / "logs" / "distill.log").exists()

    # one MLflow parent run, the specialists and the student nested under it, whichever worker logged them
    mlflow, parent = cluster["mlflow"], report["mlflow"]["parent_run_id"]
    assert report["mlflow"]["tracking_uri"] == mlflow
    exp = api_get(f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=alloy-smoke")["experiment"]
    found = _post(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                          "max_results": 100})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in found}
    assert [rid for rid, t in tags.items() if "mlflow.parentRunId" not in t] == [parent]
    children = [t.get("alloy.child") for t in tags.values() if t.get("mlflow.parentRunId") == parent]
    assert set(children) == {"base", "student"} | {f"specialist/{d}" for d in DOMAINS}
    assert all(children.count(f"specialist/{d}") == 1 for d in DOMAINS)  # the retry continued the killed one's run
    status = {r["info"]["run_id"]: r["info"]["status"] for r in found}
    assert set(status.values()) == {"FINISHED"}
