"""A real browser on the real UIs: headless Chromium (Debian's `chromium` + `chromium-driver`, through selenium)
opens the Prefect UI page of the smoke deployment's flow run and the MLflow page of its parent run, and checks
that the run's name, state and metrics are rendered (both UIs are single-page apps: we wait for the JS-rendered
text, not the HTML); the MLflow experiment opens on its training view ("Model training": the experiment kind Alloy
sets) with the parent run, whose description links the registered student; and a user's first click path in the
Prefect UI, the smoke deployment's "Run" → "Quick run", starts a flow run that completes; and on an agentic run with
a tool domain (`tool_run`), a specialist's rollouts table and one tool episode's trace (its turns, the tool call, the
guard's verdict). Screenshots go to a temporary folder, so a test run leaves the tree clean; `make screenshots`
sets ALLOY_SCREENSHOTS_DIR=docs/img to refresh the README's images (a relative path is from the repository)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from e2e_helpers import ROOT, api_get, api_send

pytestmark = pytest.mark.e2e

CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver")
TIMEOUT_S = 60
RECLICK_S = 20  # the Quick run dialog's Run is clicked again if the dialog is still open this long after
QUICK_RUN_S = 480  # a run of the smoke run's fast settings: ~2 min on 2 loaded cores when it trains
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: $ALLOY_SCREENSHOTS_DIR (relative to the repository) if set, else a temp folder."""
    target = os.environ.get("ALLOY_SCREENSHOTS_DIR")
    img = ROOT / target if target else tmp_path_factory.mktemp("screenshots")
    img.mkdir(parents=True, exist_ok=True)
    return img


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists() or not CHROMEDRIVER:
        pytest.skip("chromium and chromium-driver are not installed (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the dev extra) is not installed")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(TIMEOUT_S)
    yield driver
    driver.quit()


def wait_for_text(driver, *texts: str) -> str:
    """Wait until the rendered page text contains every one of `texts`; returns that text."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    body = ""

    def rendered(d) -> bool:
        nonlocal body
        body = d.find_element("tag name", "body").text
        return all(t in body for t in texts)

    try:
        WebDriverWait(driver, TIMEOUT_S, poll_frequency=0.5).until(rendered)
    except TimeoutException:
        missing = [t for t in texts if t not in body]
        raise AssertionError(f"{driver.current_url}: never showed {missing}; page text:\n{body[:2000]}") from None
    return body


def click_text(driver, text: str, tag: str = "*", within: str = "") -> None:
    """Click the displayed element `tag` whose whole text is `text` (with tag "*": the innermost such element),
    inside the element of the XPath `within` if given, once the page has rendered one."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    xpath = f"{within}//{tag}[normalize-space(.)='{text}'" + ("]" if tag != "*" else
                                                                f" and not(.//*[normalize-space(.)='{text}'])]")

    def shown(d):
        return next((e for e in d.find_elements("xpath", xpath) if e.is_displayed() and e.is_enabled()), False)

    try:
        WebDriverWait(driver, TIMEOUT_S, poll_frequency=0.5).until(shown).click()
    except TimeoutException:
        body = driver.find_element("tag name", "body").text
        raise AssertionError(f"{driver.current_url}: no {tag} {text!r} to click; page text:\n{body[:2000]}") from None


def dialog_open(driver, within: str) -> bool:
    """Whether the element of the XPath `within` still shows an enabled "Run" button."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        buttons = driver.find_elements("xpath", f"{within}//button[normalize-space(.)='Run']")
        return any(b.is_displayed() and b.is_enabled() for b in buttons)
    except StaleElementReferenceException:  # re-rendered while looked at: ask again on the next poll
        return False


def patient(call, tries: int = 5):
    """call(), again after a second on an HTTP 5xx or a refused connection. A 503 (SQLite busy while a flow run keeps
    the 2 shared cores busy) is already retried with backoff inside api_get/api_send; this covers the rest."""
    import urllib.error

    for i in range(tries):
        try:
            return call()
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or i == tries - 1:
                raise
        except urllib.error.URLError:
            if i == tries - 1:
                raise
        time.sleep(1)


def test_prefect_ui_shows_the_flow_run(browser, stack, smoke_run, shots):
    fr = smoke_run["flow_run"]
    browser.get(f"{stack['urls']['prefect_ui']}/runs/flow-run/{fr['id']}")
    # the header (name, state, flow, deployment, pool), then the logs, which the page fetches after it renders
    wait_for_text(browser, fr["name"], "Completed", "alloy-pipeline", "smoke", "alloy-local",
                  "Finished in state Completed()")
    assert fr["name"] in browser.title
    assert browser.save_screenshot(str(shots / "prefect-flow-run.png"))
    # the Artifacts tab lists the pipeline's Prefect artifacts (table of scores, markdown summary)
    tab = "//*[normalize-space(.)='Artifacts' and not(*[normalize-space(.)='Artifacts'])]"  # innermost: the tab
    next(e for e in browser.find_elements("xpath", tab) if e.is_displayed()).click()
    wait_for_text(browser, "alloy-scores", "alloy-summary")


def test_mlflow_ui_shows_the_run_and_its_metrics(browser, stack, smoke_run, shots):
    report = json.loads(Path(smoke_run["report_path"]).read_text())
    run_id = report["mlflow"]["parent_run_id"]
    run = api_get(f"{stack['urls']['mlflow_ui']}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
    name, exp = run["info"]["run_name"], run["info"]["experiment_id"]
    browser.get(f"{stack['urls']['mlflow_ui']}/#/experiments/{exp}/runs/{run_id}")
    summary = {f"summary/{k}": v for k, v in report["summary"].items() if isinstance(v, (int, float))}
    # "specialist/reverse": a nested child run, linked from the parent's page (fetched after the run itself, so
    # it is waited for like the rest: in one CI run the check came before the child runs had rendered)
    body = wait_for_text(browser, name, "Finished", "specialist/reverse", *summary)
    lines = body.splitlines()
    for key, value in summary.items():  # the metrics table renders "key" then its value on the next line
        shown = lines[lines.index(key) + 1]
        assert float(shown) == pytest.approx(value, rel=1e-6, abs=1e-9), (key, shown)
    # a screenshot that shows the metrics: close the assistant side panel if this MLflow has one, scroll to them
    for close in browser.find_elements("css selector", "button[aria-label='Close']"):
        try:
            close.click()
        except Exception:  # noqa: BLE001 - a hidden/obsolete button; the screenshot is still useful
            pass
    metrics = browser.find_element("xpath", "//*[starts-with(normalize-space(text()), 'Metrics (')]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", metrics)
    assert browser.save_screenshot(str(shots / "mlflow-run.png"))


def test_mlflow_experiment_opens_on_training_view_with_run_and_student_link(browser, stack, smoke_run, shots):
    """The experiment has the "Model training" kind, and the links Alloy gives (the Prefect summary's, with the
    UI's `workflowType`: MLflow 3.17's UI picks its view by a global switch, GenAI by default, not by the kind)
    open the training view: the experiment's runs with the parent run, whose description links the registered
    student version."""
    from infra.charts import TRAINING_VIEW, mlflow_run_url

    mlflow = stack["urls"]["mlflow_ui"]
    report = json.loads(Path(smoke_run["report_path"]).read_text())
    run_id = report["mlflow"]["parent_run_id"]
    run = api_get(f"{mlflow}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
    name, exp_id = run["info"]["run_name"], run["info"]["experiment_id"]
    exp = api_get(f"{mlflow}/api/2.0/mlflow/experiments/get?experiment_id={exp_id}")["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"
    model, version = report["artifacts"]["registered_model"].rsplit("/", 1)
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["alloy.registered_model.uri"] == f"models:/{model}/{version}"

    browser.get(f"{mlflow}/#/experiments/{exp_id}{TRAINING_VIEW}")
    body = wait_for_text(browser, exp["name"], "Runs", "Models", name)
    assert "Evaluation runs" not in body, body[:2000]  # a tab of the GenAI view
    assert browser.save_screenshot(str(shots / "mlflow-experiment.png"))
    browser.get(mlflow_run_url(mlflow, exp_id, run_id))
    wait_for_text(browser, name, f"Registered student: {model} version {version}")
    link = browser.find_element("xpath", f"//a[normalize-space(.)='{model} version {version}']")
    href = link.get_attribute("href")
    assert href.endswith(f"#/models/{model}/versions/{version}"), href
    browser.get(href)  # the link opens a new tab; the same page here
    wait_for_text(browser, model, f"Version {version}", "candidate")


def test_prefect_ui_quick_run_of_the_smoke_deployment_completes(browser, stack, smoke_run, shots):
    """The smoke deployment's page → "Run" → "Quick run" (→ the dialog's "Run"): a flow run of the deployment's
    default parameters, which completes. For the test those defaults are the smoke run's fast settings on a runs
    root of its own under the stack's (set through the API, restored after): the smoke run's storage and report stay
    as the deploy tests check them, and nothing is written in the tree. That root starts with a copy of the smoke
    run's storage, so the run reuses its committed base, specialists and student (`run.resume`; `run.root` moves no
    checkpoint prefix) instead of training them again: what is checked here is the click path and a flow run that
    completes with its report, not training (the smoke run did that). Its flow runs (the pipeline's and its
    sub-flows') are deleted after, so `alloy status`'s latest runs still show the smoke run."""
    api, ui = stack["urls"]["prefect_api"], stack["urls"]["prefect_ui"]
    dep_id = smoke_run["flow_run"]["deployment_id"]
    dep = api_get(f"{api}/deployments/{dep_id}")
    root = Path(stack["runs_root"]) / "quick-run"
    report = root / "report.json"
    shutil.copytree(Path(stack["runs_root"]) / "smoke", root / "smoke")  # the smoke run's checkpoints: reused
    overrides = [o for o in smoke_run["params"]["overrides"] if not o.startswith("run.root=")] + [f"run.root={root}"]
    api_send(f"{api}/deployments/{dep_id}", {"parameters": {
        **dep["parameters"], "overrides": overrides, "report_path": str(report)}}, "PATCH")
    try:
        def runs() -> list[dict]:
            return patient(lambda: api_send(f"{api}/flow_runs/filter", {"deployments": {"id": {"any_": [dep_id]}}}))

        every_before = {r["id"] for r in patient(lambda: api_send(f"{api}/flow_runs/filter", {}))}
        before = {r["id"] for r in runs()}
        browser.get(f"{ui}/deployments/deployment/{dep_id}")
        wait_for_text(browser, "smoke", "alloy-local")
        click_text(browser, "Run", tag="button")
        click_text(browser, "Quick run")
        # Prefect 3.8's UI then shows the "Run Deployment" dialog, filled with the deployment's parameters (the
        # flow has a required one, `config`): its own "Run" button submits them
        wait_for_text(browser, "Run Deployment", "Validate parameters")
        dialog = "//*[normalize-space(text())='Run Deployment']/ancestor::*[.//button[normalize-space(.)='Run']][1]"
        click_text(browser, "Run", tag="button", within=dialog)
        # the dialog closes once it has submitted the run; one still open RECLICK_S after the click did not take
        # the click (in one loaded run no flow run appeared within a minute): its Run is clicked once more
        clicked, reclicked = time.monotonic(), False
        deadline = clicked + 2 * TIMEOUT_S
        while not (new := [r for r in runs() if r["id"] not in before]):
            if not reclicked and time.monotonic() > clicked + RECLICK_S and dialog_open(browser, dialog):
                click_text(browser, "Run", tag="button", within=dialog)
                reclicked = True
            assert time.monotonic() < deadline, ("no flow run appeared after Quick run; page text:\n"
                                                 + browser.find_element("tag name", "body").text[:2000])
            time.sleep(1)
        (fr,) = new
        deadline = time.monotonic() + QUICK_RUN_S
        while (fr := patient(lambda: api_get(f"{api}/flow_runs/{fr['id']}")))["state_type"] not in FINAL:
            assert time.monotonic() < deadline, f"flow run {fr['name']} still {fr['state_name']}"
            time.sleep(2)
        assert fr["state_type"] == "COMPLETED", fr["state"]
        assert fr["parameters"]["report_path"] == str(report) and report.is_file()
        browser.get(f"{ui}/runs/flow-run/{fr['id']}")
        wait_for_text(browser, fr["name"], "Completed", "smoke")
        assert browser.save_screenshot(str(shots / "prefect-quick-run.png"))
    finally:
        try:
            patient(lambda: api_send(f"{api}/deployments/{dep_id}", {"parameters": dep["parameters"]}, "PATCH"))
        finally:  # the flow runs go even when the restore failed: `alloy status`'s test looks for the smoke run
            if "every_before" in locals():
                for r in patient(lambda: api_send(f"{api}/flow_runs/filter", {})):
                    if r["id"] not in every_before:
                        patient(lambda: api_send(f"{api}/flow_runs/{r['id']}", {}, "DELETE"))


def xpath_literal(text: str) -> str:
    """`text` as an XPath 1.0 string literal (which has no escapes: a text with both quotes is a concat())."""
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    return "concat(" + ", \"'\", ".join(f"'{part}'" for part in text.split("'")) + ")"


def close_assistant(driver) -> None:
    """Close MLflow 3's assistant side panel (it covers a third of the page) if it is open."""
    for button in driver.find_elements("css selector", "button[data-component-id='mlflow.assistant.chat_panel.close']"):
        if button.is_displayed():
            button.click()


def test_mlflow_ui_shows_the_rollouts_table_and_a_tool_episode_trace(browser, stack, tool_run, shots):
    """Issue 53's "rollouts you can read" in the UI, on a finished agentic run (`tool_run`: the base and `tool_add`
    specialist stages on the stack's MLflow): the specialist run's artifact `rollouts/tool_add.json` opens as a table
    (its columns and the rows the REST API gives), and one sampled tool episode's trace, listed on the run's Traces
    tab (linked to the run), shows its spans (the episode, a span per turn, the tool call under its turn) and the
    tool call's command, output and guard verdict (allowed or not, the rules it hit)."""
    from mlflow import MlflowClient

    from training.rollout_records import TABLE_COLUMNS

    mlflow, exp, run_id, domain = (stack["urls"]["mlflow_ui"], tool_run["experiment_id"], tool_run["run_id"],
                                   tool_run["domain"])
    artifact = f"rollouts/{domain}.json"
    table = api_get(f"{mlflow}/get-artifact?path={artifact}&run_uuid={run_id}")  # what the UI reads too
    assert table["columns"] == TABLE_COLUMNS and len(table["data"]) == 4, table  # the default sample: 4 rows
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert {r["step"] for r in rows} == {1} and any(r["tool_calls"] for r in rows), rows
    size = browser.get_window_size()
    browser.set_window_size(1920, 1000)  # the table's ten columns side by side
    try:
        browser.get(f"{mlflow}/#/experiments/{exp}/runs/{run_id}/artifacts/{artifact}?workflowType=machine_learning")
        # the cells: one line each (a response's newlines render as spaces)
        wait_for_text(browser, f"specialist/{domain}", artifact, "View as table", *TABLE_COLUMNS,
                      *(r["prompt"] for r in rows), *(" ".join(r["response"].split()) for r in rows))
        close_assistant(browser)
        sidebar = "button[data-component-id='mlflow_header.toggle_sidebar_button']"
        browser.find_element("css selector", sidebar).click()  # the table gets the width of the experiment sidebar
        # a click on a response cell previews it whole, its lines as the episode wrote them (tool call, tool output)
        shown = next(r for r in rows if r["tool_calls"])
        cell = f"//span[normalize-space(.)={xpath_literal(' '.join(shown['response'].split()))}]"
        next(e for e in browser.find_elements("xpath", cell) if e.is_displayed()).click()
        wait_for_text(browser, "Preview", shown["response"].strip())
        # the table, narrower beside the preview, scrolled to its last columns (prompt, response) for the screenshot
        browser.execute_script("""let e = arguments[0];
            while (e && !(e.scrollWidth > e.clientWidth && /auto|scroll/.test(getComputedStyle(e).overflowX)))
                e = e.parentElement;
            if (e) e.scrollLeft = e.scrollWidth;""", browser.find_element("xpath", cell))
        time.sleep(0.5)  # scrolled and painted
        assert browser.save_screenshot(str(shots / "mlflow-rollouts-table.png"))
        browser.find_element("css selector", sidebar).click()  # as it was (the UI keeps it collapsed otherwise)

        # the traces of the run (search by run: each is linked to it), one whose tool call the guard blocked if any
        traces = MlflowClient(mlflow).search_traces(locations=[exp], run_id=run_id)
        assert len(traces) == sum(1 for r in rows if r["tool_calls"]), (len(traces), rows)

        def tool_spans(trace):
            return [s for s in trace.data.spans if s.span_type == "TOOL"]

        trace = min((t for t in traces if tool_spans(t)), key=lambda t: all(
            s.attributes.get("guard.allowed") for s in tool_spans(t)))
        spans = {s.span_id: s for s in trace.data.spans}
        tool = tool_spans(trace)[0]
        turn, root = spans[tool.parent_id], spans[spans[tool.parent_id].parent_id]
        assert root.name == f"specialist {domain} step 1" and turn.name.startswith("turn ") and root.parent_id is None
        allowed = tool.attributes["guard.allowed"]
        assert tool.status.status_code == ("OK" if allowed else "ERROR")
        rules = list(tool.attributes.get("guard.rules") or [])
        trace_id = trace.info.trace_id
        browser.get(f"{mlflow}/#/experiments/{exp}/runs/{run_id}/traces?workflowType=machine_learning")
        wait_for_text(browser, f"specialist/{domain}", *(t.info.trace_id for t in traces))
        browser.get(f"{mlflow}/#/experiments/{exp}/runs/{run_id}/traces?workflowType=machine_learning"
                    f"&selectedEvaluationId={trace_id}")
        wait_for_text(browser, root.name, turn.name, tool.name, "Inputs / Outputs", "Attributes")
        close_assistant(browser)
        click_text(browser, tool.name)  # the tool call's span in the span tree: its command and output
        wait_for_text(browser, "command", tool.inputs["command"], "output", *filter(None, [tool.outputs["output"]]))
        click_text(browser, "Attributes")  # the guard's verdict
        wait_for_text(browser, "guard.allowed", str(allowed).lower(), "guard.rules", *rules, "executed")
        assert browser.save_screenshot(str(shots / "mlflow-rollout-trace.png"))
    finally:
        browser.set_window_size(size["width"], size["height"])
