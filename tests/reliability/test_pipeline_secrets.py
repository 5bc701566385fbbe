"""One real pipeline run (Prefect flow, DeepSpeed, engine servers, MLflow on SQLite, file storage), shrunk to a few
steps per stage, with an API key set and a plugin domain whose verifier is buggy. Then:

- the key never appears in MLflow (params, tags, metrics, artifacts: the raw SQLite file and the artifact dir are
  grepped), in any log or file under the run root, in report.json, or in what the flow logged;
- the key does not show in `ps`: the argv of every process the run starts is sampled while it runs;
- the key is not stored as a Prefect flow-run parameter (visible in the Prefect UI): the run is started the supported
  way, `alloy run --set engine.api_key=<key>` (the CLI moves secret overrides into the environment, where config
  loading reads ALLOY_ENGINE_API_KEY), and a flow given a secret in `overrides` directly refuses it;
- the verifier that raises (or returns NaN) on some responses gives reward 0 and is counted by the specialist, and
  the run continues to its report.

The test double here is only the plugin domain (a user's code, loaded by `impl` like any plugin).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
SECRET = f"sk-SECRET-{uuid.uuid4().hex}"
SPEC_STEPS = 2
FAST = ["base.steps=5", "base.n_train_per_domain=100", "eval.n_eval=8", f"specialists.steps={SPEC_STEPS}",
        "specialists.batch_size=8", "specialists.checkpoint_every=1", "specialists.log_every=1", "distill.steps=2",
        "distill.batch_size=8", "distill.eval_every=0", "distill.log_every=1"]
PLUGIN = textwrap.dedent("""
    import math
    from domains.builtin.text import Reverse

    class FlakyReverse(Reverse):
        '''`reverse` with a buggy verifier: raises on odd-length responses, NaN on lengths 2 mod 4.'''
        def score(self, example, response):
            if len(response) % 2 == 1:
                raise RuntimeError("verifier bug: odd length")
            if len(response) % 4 == 2:
                return math.nan
            return super().score(example, response)
""")


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # a record whose args do not format is no leak
            pass


def watch_argv(stop: threading.Event, seen: dict) -> None:
    """Sample the argv of every descendant process (what `ps` shows to any user) until `stop`."""
    me = psutil.Process()
    while not stop.wait(0.1):
        for p in me.children(recursive=True):
            try:
                argv = p.cmdline()  # every argv a pid shows: between fork and exec it still shows its parent's
                seen.setdefault((p.pid, tuple(argv)), argv)
            except psutil.Error:
                pass


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_harness):
    """The pipeline, once, started as `alloy run CONFIG --set … --set engine.api_key=<key> --report …` (the CLI's
    own parser and command, in this process); returns its report, the argv seen, and what the flow process logged."""
    import flows.pipeline  # noqa: F401  (imports Prefect, which sets up its logging: before our handler is added)
    from alloy.cli import EXIT_OK, build_parser
    from engine.client import API_KEY_ENV

    root = tmp_path_factory.mktemp("secrets")
    plugdir = root / "plugins"
    plugdir.mkdir()
    (plugdir / "alloy_rel_flaky_plugin.py").write_text(PLUGIN)
    old_pp = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(plugdir)] + ([old_pp] if old_pp else []))  # worker processes
    sys.path.insert(0, str(plugdir))  # this process (config load)
    handler = Collect()
    loggers = [logging.getLogger(), logging.getLogger("prefect"), logging.getLogger("alloy")]
    for lg in loggers:
        lg.addHandler(handler)
    stop, argv = threading.Event(), {}
    watcher = threading.Thread(target=watch_argv, args=(stop, argv), daemon=True)
    watcher.start()
    overrides = FAST + [f"run.root={root}", "domains=[{name: flaky, impl: 'alloy_rel_flaky_plugin:FlakyReverse'}]",
                        f"engine.api_key={SECRET}"]
    cli = ["run", SMOKE, *sum((["--set", o] for o in overrides), []), "--report", str(root / "out" / "report.json")]
    old_key = os.environ.get(API_KEY_ENV)
    t0 = time.monotonic()
    try:
        args = build_parser().parse_args(cli)
        assert args.fn(args) == EXIT_OK
        report = json.loads((root / "out" / "report.json").read_text())
    finally:
        if old_key is None:  # `alloy run` put the key in this process's environment
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = old_key
        stop.set()
        watcher.join()
        for lg in loggers:
            lg.removeHandler(handler)
        sys.path.remove(str(plugdir))
        if old_pp is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pp
    print(f"\npipeline took {time.monotonic() - t0:.1f} s")
    return {"root": root, "report": report, "argv": argv, "log": handler.lines}


def files_containing(root: Path, needle: bytes) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes())


def test_secret_not_in_mlflow(run):
    from mlflow import MlflowClient

    root = run["root"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    parent = client.get_run(run["report"]["mlflow"]["parent_run_id"])
    assert parent.data.params["engine.api_key"] == "***"  # logged, redacted
    runs = client.search_runs([parent.info.experiment_id])
    assert {r.info.run_name for r in runs} >= {"base", "specialist/flaky", "student"}
    for r in runs:
        blob = json.dumps({"params": r.data.params, "tags": r.data.tags, "metrics": r.data.metrics})
        assert SECRET not in blob, r.info.run_name
    assert (root / "mlflow.db").stat().st_size > 0 and (root / "mlartifacts").is_dir()
    hits = files_containing(root, SECRET.encode())
    assert [f for f in hits if f.startswith(("mlflow.db", "mlartifacts"))] == []  # raw bytes of the store too


def test_secret_not_in_logs_files_or_report(run):
    root = run["root"]
    report = (root / "out" / "report.json").read_text()
    assert json.loads(report)["run_id"] == run["report"]["run_id"] and SECRET not in report
    logs = sorted(p.relative_to(root) for p in root.rglob("*.log"))
    assert len(logs) >= 4  # base, specialist, teacher and student servers, distill
    assert files_containing(root, SECRET.encode()) == []  # every file under the run root: logs, db, checkpoints
    assert run["log"] and not [line for line in run["log"] if SECRET in line]  # what the flow process logged


def test_the_argv_watch_saw_every_worker(run):
    """Precondition of the next test: the sampler saw the trainer processes and the engine servers."""
    seen = " ".join(" ".join(a) for a in run["argv"].values())
    for module in ("training.base_main", "teachers.specialist_main", "student.distill_main", "engine.server"):
        assert module in seen, module


def test_secret_not_in_any_process_argv(run):
    leaks = {pid: " ".join(a)[:160] for pid, a in run["argv"].items() if any(SECRET in x for x in a)}
    assert leaks == {}


@pytest.fixture(scope="module")
def flow_run_parameters(run):
    """The parameters of every flow run in the Prefect API the pipeline ran against (the session's test harness)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from infra.http import run_sync

    async def params():
        async with get_client() as client:
            runs = await client.read_flow_runs(limit=200, sort=FlowRunSort.EXPECTED_START_TIME_DESC)
            return [fr.parameters for fr in runs]

    return run_sync(params())


def test_the_pipeline_flow_run_is_in_prefect(flow_run_parameters):
    assert any(p.get("config") == SMOKE for p in flow_run_parameters)


def test_secret_not_in_prefect_flow_run_parameters(flow_run_parameters):
    assert [p for p in flow_run_parameters if SECRET in json.dumps(p, default=str)] == []


@pytest.mark.parametrize("flow_name", ["pipeline", "specialist", "distill"])
def test_a_secret_override_passed_to_a_flow_is_refused(prefect_harness, flow_name):
    """A secret in a deployable flow's `overrides` is refused before any work, naming the variable to use instead.
    (Prefect has recorded the parameter by then: the refusal makes the mistake loud, it cannot hide the key. A key
    of its own is used here, so the pipeline's key stays out of the flow-run parameters checked above.)"""
    from flows.distill import distill
    from flows.pipeline import pipeline
    from flows.specialists import specialist
    from infra.config import ConfigError

    key = f"sk-REFUSED-{uuid.uuid4().hex}"
    overrides = ["base.steps=1", f"engine.api_key={key}", "specialists.guard.judge_api_key=j"]
    call = {"pipeline": lambda: pipeline(config=SMOKE, overrides=overrides),
            "specialist": lambda: specialist(config=SMOKE, domain="add", base_url="/nonexistent", overrides=overrides),
            "distill": lambda: distill(config=SMOKE, student_init="/nonexistent", teachers={}, overrides=overrides)}
    with pytest.raises(ConfigError) as err:
        call[flow_name]()
    msg = str(err.value)
    assert f"flow alloy-{flow_name}, parameter `overrides`: secret override(s) " in msg, msg
    assert "engine.api_key: set ALLOY_ENGINE_API_KEY" in msg and \
        "specialists.guard.judge_api_key: set ALLOY_JUDGE_API_KEY" in msg, msg
    assert key not in msg and "base.steps" not in msg


def test_raising_verifier_gives_zero_counted_and_the_run_continues(run):
    from infra.storage import join, read_json

    report = run["report"]
    assert set(report["domains"]) == {"flaky"}
    row = report["domains"]["flaky"]
    assert all(0.0 <= row[s] <= 1.0 for s in ("base", "specialist", "student"))
    prefix = report["artifacts"]["specialists"]["flaky"].rsplit("/", 1)[0]
    result = read_json(join(prefix, "result.json"))
    assert result["steps"] == SPEC_STEPS and result["verifier_errors"] > 0
    rewards = [h["reward"] for h in result["history"]]
    assert len(rewards) == SPEC_STEPS and all(0.0 <= r <= 1.0 for r in rewards)
