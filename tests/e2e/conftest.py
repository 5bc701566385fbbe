"""The e2e session: one real local stack (`alloy up`: Prefect server + worker + MLflow on free loopback ports, state
in a temp dir) and one run of the `alloy-pipeline/smoke` deployment, shared by the deploy and browser tests.
Both are expensive (about 1 min and 2 min on 2 shared cores), so they are session-scoped, never per test.
`tool_run` (module-scoped, the browser tests') adds an agentic run with a tool domain to the stack's MLflow: the
smoke run has none, so it logs no tool-episode trace."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from e2e_helpers import FAST, FAST_POLL, ROOT, api_get, run_cli, user_env


@pytest.fixture(scope="session")
def stack():
    """`alloy up` on free ports with home and runs root in a temp dir; yields the state file's content plus
    "runs_root" and "env" (a client environment pointing at the stack). `alloy down` at the end.
    A private mkdtemp rather than tmp_path_factory: pytest prunes old basetemp dirs, and other pytest sessions on
    this machine must not delete a live server's database."""
    base = Path(tempfile.mkdtemp(prefix="alloy-e2e-stack-"))
    home, runs_root = base / "home", base / "runs"
    # FAST_POLL: the worker asks for scheduled runs every 2 s, not every 10 s
    proc = run_cli("up", "--home", str(home), "--prefect-port", "0", "--mlflow-port", "0", "--runs-root", str(runs_root),
                   timeout=420, env={**user_env(), **FAST_POLL})
    assert proc.returncode == 0, f"alloy up failed:\n{proc.stdout}\n{proc.stderr}"
    state = json.loads((home / "stack.json").read_text())
    env = user_env()
    env.update(PREFECT_API_URL=state["urls"]["prefect_api"], PREFECT_HOME=str(home / "prefect"))
    yield {**state, "runs_root": runs_root, "env": env, "up_stdout": proc.stdout}
    run_cli("down", "--home", str(home), timeout=120)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def smoke_run(stack):
    """`prefect deployment run 'alloy-pipeline/smoke' --watch` with the FAST overrides; returns the CLI's output,
    the flow run (from the API) and the report path."""
    report = Path(stack["runs_root"]) / "smoke-report.json"
    params = {"overrides": FAST + [f"run.root={stack['runs_root']}"], "report_path": str(report)}
    cmd = [str(Path(sys.executable).parent / "prefect"), "deployment", "run", "alloy-pipeline/smoke", "--watch",
           "--watch-interval", "1", "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=stack["env"])
    m = re.search(r"/runs/flow-run/([0-9a-f-]{36})", proc.stdout)
    assert m, f"no flow run URL in the output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    flow_run = api_get(f"{stack['urls']['prefect_api']}/flow_runs/{m.group(1)}")
    return {"proc": proc, "flow_run": flow_run, "report_path": report, "params": params}


# configs/agentic.yaml trimmed to one tool domain, a tiny base (enough SFT on tool trajectories that it writes tool
# calls: half of the demonstrations read the planted answer file, so the rule-only guard blocks calls) and one
# specialist step, whose rollouts are recorded (the last step always is: `specialists.record`'s default sample of 4).
TOOL_DOMAIN = "tool_add"
TOOL_RUN = ["run.name=agentic-rollouts", "domains=[{name: %s, params: {shortcut_demos: 0.5}}]" % TOOL_DOMAIN,
            "base.steps=40", "base.train.micro_batch_size=32", "base.n_train_per_domain=200", "eval.n_eval=4",
            "specialists.steps=1", "specialists.batch_size=8", "specialists.val_every=0", "specialists.eval_n=4",
            "specialists.critic_warmup_steps=0", "specialists.guard.judge_path=null", "specialists.per_domain={}"]


@pytest.fixture(scope="module")
def tool_run(stack):
    """A finished agentic run on the stack's MLflow (its own experiment, `alloy-agentic`): the pipeline's base and
    specialist stages (`tasks.base.train_base`, `tasks.specialist.train_specialist`: their trainer processes, as a
    flow run starts them, logging to the stack's tracking URI) for `tool_add`. The specialist's nested run then holds
    the rollouts table (`rollouts/tool_add.json`) and a trace per sampled tool episode. About 30-60 s on 2 cores.
    Returns {"experiment_id", "parent_run_id", "run_id" (the specialist's), "domain"}."""
    import tasks.specialist
    from tasks.base import train_base
    from tasks.context import open_context

    ctx = open_context(str(ROOT / "configs" / "agentic.yaml"), TOOL_RUN + [
        f"run.root={Path(stack['runs_root']) / 'agentic'}", f"tracking.uri={stack['tracking_uri']}"])
    with pytest.MonkeyPatch.context() as mp:
        # outside a flow run there is no progress artifact to update; Prefect would start a temporary server for it
        mp.setattr(tasks.specialist, "_progress_artifact", lambda domain: None)
        try:
            base_dir = train_base.fn(ctx)
            tasks.specialist.train_specialist.fn(ctx, TOOL_DOMAIN, base_dir)
        except BaseException:
            ctx.tracker.end("FAILED")
            raise
    ctx.tracker.end()
    return {"experiment_id": ctx.tracker.experiment_id, "parent_run_id": ctx.parent_run_id,
            "run_id": ctx.tracker.children()[f"specialist/{TOOL_DOMAIN}"], "domain": TOOL_DOMAIN}
