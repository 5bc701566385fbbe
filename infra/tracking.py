"""Experiment tracking: a small object over MLflow's client API, and a no-op twin for rank > 0 and unit tests.

One pipeline = one parent run; each stage (base, specialist/<domain>, student) is a nested child run, tagged
`mlflow.parentRunId` (which the MLflow UI nests) and `alloy.child=<name>` (so a retried stage finds and continues
its run instead of creating a duplicate). The merged model goes to the Model Registry with an alias.

Every call names its run id explicitly through `MlflowClient`: MLflow's fluent API keeps the active run on a
thread-local stack, so concurrent children logging from threads (or a handle passed between threads) would
attach metrics to the wrong run or to none.

Tracking URI: `MLFLOW_TRACKING_URI` from the environment wins, then the `uri` argument, then
`sqlite:///<abs runs_root>/mlflow.db`. For a SQLite store the artifacts go next to the database
(`<db dir>/mlartifacts/`), not into the current directory. The URI is logged with any password masked.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from infra.secrets import REDACTED, is_secret, mask_secrets  # noqa: F401  (REDACTED, is_secret: re-exported)

log = logging.getLogger("alloy.tracking")

CHILD_TAG = "alloy.child"
PARENT_TAG = "mlflow.parentRunId"
# The MLflow UI (3.x) opens an experiment without a kind on its GenAI views ("Evaluation runs"); this kind is its
# "Model training" view. Set when Alloy creates or first uses an experiment; a kind a user set is left alone.
KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # a run's Description in the MLflow UI (markdown)
_STATUSES = ("FINISHED", "FAILED", "KILLED")
_MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow's limit on params/tags per log_batch call (metrics: 1000)
STARTED_PARENTS: list[tuple[str, str]] = []  # (tracking URI, run id) of every parent run this process started


# --------------------------------------------------------------------------------------------- pure helpers


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def flatten_config(d: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists → {dotted.key: str(value)}; list items by index ("domains.0.name"); empty containers kept.

    flatten_config({"a": {"b": 1, "c": [True, None]}, "d": {}})
        == {"a.b": "1", "a.c.0": "true", "a.c.1": "null", "d": "{}"}
    """
    out: dict[str, str] = {}
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list, tuple)) and len(v):
            out.update(flatten_config(v, key))
        elif isinstance(v, (dict, list, tuple)):
            out[key] = "{}" if isinstance(v, dict) else "[]"
        else:
            out[key] = _fmt(v)
    return out


def mask_url(text: str) -> str:
    """Credentials in text masked: `infra.secrets.mask_secrets` (URL user info, query tokens, auth headers)."""
    return mask_secrets(text)


def redact(flat: dict[str, Any]) -> dict[str, Any]:
    """Values of keys naming a secret (`infra.secrets.is_secret`) become "***"; credentials inside other values
    (URL user info, query tokens, auth headers) are masked (`mask_secrets`).

    redact({"engine.api_key": "sk-1", "eval.max_new_tokens": "16", "db": "pg://u:pw@h/x"})
        == {"engine.api_key": "***", "eval.max_new_tokens": "16", "db": "pg://u:***@h/x"}
    """
    return {k: REDACTED if is_secret(k, v) else (mask_secrets(v) if isinstance(v, str) else v) for k, v in flat.items()}


def resolve_tracking_uri(runs_root: str | os.PathLike = "runs", uri: str | None = None) -> str:
    """MLFLOW_TRACKING_URI from the environment, else uri, else sqlite:///<absolute runs_root>/mlflow.db."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if uri:
        return uri
    return "sqlite:///" + str(Path(runs_root).resolve() / "mlflow.db")


def _default_artifact_location(tracking_uri: str) -> str | None:
    """For a SQLite store, <db dir>/mlartifacts (MLflow would otherwise use ./mlruns in the current directory)."""
    if tracking_uri.startswith("sqlite:///"):
        db = tracking_uri[len("sqlite:///"):]
        if db and db != ":memory:":
            return Path(db).resolve().parent.joinpath("mlartifacts").as_uri()
    return None


# --------------------------------------------------------------------------------------------- MLflow tracker


class Tracker:
    """MLflow tracking bound to one experiment and (after start_parent/resume/child) one run.

    Handles returned by `child()` and `resume()` are Trackers bound to that run and share this one's client;
    they are safe to use from different threads at the same time.
    """

    def __init__(self, runs_root: str | os.PathLike = "runs", experiment: str = "alloy", uri: str | None = None, *,
                 artifact_location: str | None = None):
        from mlflow import MlflowClient

        self.tracking_uri = resolve_tracking_uri(runs_root, uri)
        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self.registry_uri = os.environ.get("MLFLOW_REGISTRY_URI") or self.tracking_uri
        self.experiment_name = experiment
        self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        self.experiment_id = self._ensure_experiment(experiment, artifact_location
                                                     or _default_artifact_location(self.tracking_uri))
        self.run_id: str | None = None
        log.info("MLflow tracking at %s, experiment %r", mask_secrets(self.tracking_uri), experiment)

    def __repr__(self) -> str:
        return (f"Tracker(uri={mask_secrets(self.tracking_uri)!r}, experiment={self.experiment_name!r}, "
                f"run_id={self.run_id!r})")

    def _ensure_experiment(self, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        exp = self._client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self._client.create_experiment(name, artifact_location=artifact_location,
                                                      tags={KIND_TAG: TRAINING_KIND})
            except MlflowException:  # another process created it between our get and create
                exp = self._client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise RuntimeError(f"MLflow experiment {name!r} is deleted; restore it (`mlflow experiments restore "
                               f"--experiment-id {exp.experiment_id}`) or set tracking.experiment to another name")
        if not (exp.tags or {}).get(KIND_TAG):  # made before Alloy set kinds, or by someone else: first use
            self._client.set_experiment_tag(exp.experiment_id, KIND_TAG, TRAINING_KIND)
        return exp.experiment_id

    def _bind(self, run_id: str, experiment_id: str | None = None) -> "Tracker":
        h = copy.copy(self)  # shares the client: one connection pool per process
        h.run_id = run_id
        h.experiment_id = experiment_id or self.experiment_id
        return h

    def _rid(self, what: str) -> str:
        if self.run_id is None:
            raise RuntimeError(f"Tracker.{what}: no run bound; call start_parent() or resume() first")
        return self.run_id

    # ----------------------------------------------------------------------------------------- runs

    def start_parent(self, run_name: str, tags: dict | None = None) -> str:
        """Create the pipeline's parent run, bind this tracker to it, return its run id."""
        run = self._client.create_run(self.experiment_id, run_name=run_name,
                                      tags={k: str(v) for k, v in (tags or {}).items()})
        self.run_id = run.info.run_id
        STARTED_PARENTS.append((self.tracking_uri, self.run_id))  # what a Ctrl-C of `alloy run` marks KILLED
        log.info("MLflow parent run %s (%s)", run_name, self.run_id)
        return self.run_id

    def resume(self, run_id: str) -> "Tracker":
        """A handle bound to an existing run, marked RUNNING again if it had ended (a retried stage continues it)."""
        run = self._client.get_run(run_id)
        if run.info.lifecycle_stage == "deleted":
            raise RuntimeError(f"MLflow run {run_id} is deleted and cannot be resumed")
        if run.info.status != "RUNNING":
            self._client.update_run(run_id, status="RUNNING")
        return self._bind(run_id, run.info.experiment_id)

    def find_child(self, parent_run_id: str, name: str) -> str | None:
        """Run id of the oldest live child of parent_run_id tagged alloy.child=name, or None."""
        from mlflow.entities import ViewType

        exp_id = self._client.get_run(parent_run_id).info.experiment_id
        token = None
        while True:
            page = self._client.search_runs([exp_id], filter_string=f"tags.{PARENT_TAG} = '{parent_run_id}'",
                                            run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                            order_by=["attributes.start_time ASC"], page_token=token)
            for r in page:
                if r.data.tags.get(CHILD_TAG) == name:
                    return r.info.run_id
            token = page.token
            if not token:
                return None

    @contextlib.contextmanager
    def child(self, name: str, tags: dict | None = None, resume: bool = True) -> Iterator["Tracker"]:
        """A nested run under this tracker's run; ends FINISHED, or FAILED if the block raises.

        With resume=True an existing child of the same name is continued (Prefect retried the stage), so names must
        be unique per parent ("specialist/math"). Concurrent children from threads each get their own handle.
        """
        parent = self._rid("child")
        existing = self.find_child(parent, name) if resume else None
        if existing:
            h = self.resume(existing)
            if tags:
                h.set_tags(tags)
            log.info("MLflow: continuing child run %s (%s)", name, existing)
        else:
            all_tags = {**{k: str(v) for k, v in (tags or {}).items()}, PARENT_TAG: parent, CHILD_TAG: name}
            h = self._bind(self._client.create_run(self.experiment_id, run_name=name, tags=all_tags).info.run_id)
        try:
            yield h
        except BaseException:
            from infra.procs import stop_requested

            h.end("KILLED" if stop_requested() else "FAILED")  # stopped by a Ctrl-C of `alloy run`: KILLED
            raise
        h.end("FINISHED")

    def end(self, status: str = "FINISHED") -> None:
        if status not in _STATUSES:
            raise ValueError(f"Tracker.end: status must be one of {_STATUSES}, got {status!r}")
        self._client.set_terminated(self._rid("end"), status=status)

    # ----------------------------------------------------------------------------------------- logging

    def log_params(self, params: dict[str, Any]) -> None:
        """Log flat params (values stringified, cut to MLflow's 6000 chars). A param cannot change once logged."""
        from mlflow.entities import Param

        rid = self._rid("log_params")
        items = [Param(str(k), _fmt(v)[:_MAX_PARAM_LEN]) for k, v in params.items()]
        for i in range(0, len(items), _BATCH):
            self._client.log_batch(rid, params=items[i:i + _BATCH])

    def log_config(self, config: dict) -> None:
        """Log a nested config once as dotted params, secrets redacted."""
        self.log_params(redact(flatten_config(config)))

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        from mlflow.entities import Metric

        rid = self._rid("log_metrics")
        ts = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            if v is None:
                continue
            try:
                items.append(Metric(str(k), float(v), ts, int(step or 0)))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"Tracker.log_metrics: metric {k!r} is not a number: {v!r}") from exc
        for i in range(0, len(items), 1000):
            self._client.log_batch(rid, metrics=items[i:i + 1000])

    def start_system_metrics(self) -> Any | None:
        """Start MLflow's system-metrics monitor on this run (a thread sampling CPU, memory, disk, network and, with
        `nvidia-ml-py` installed, each GPU's utilisation and memory: `system/...` metrics beside the curves);
        returns it (call `.finish()` at the end) or None where it cannot start. Without `pynvml` only a warning
        says the GPU metrics are missing. Sampling every 10 s unless MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL says."""
        import importlib.util

        rid = self._rid("start_system_metrics")
        if importlib.util.find_spec("pynvml") is None:
            log.warning("MLflow system metrics without GPU metrics: `pynvml` is missing (pip install nvidia-ml-py)")
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(rid, resume_logging=True, tracking_uri=self.tracking_uri)
            monitor.start()
        except Exception as exc:  # noqa: BLE001 - monitoring is an extra: the run goes on without it
            log.warning("MLflow system metrics not started: %s: %s", type(exc).__name__, exc)
            return None
        return monitor

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        rid = self._rid("set_tags")
        items = [RunTag(str(k), str(v)) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH):
            self._client.log_batch(rid, tags=items[i:i + _BATCH])

    def log_table(self, df, artifact_file: str) -> None:
        """A pandas DataFrame as a JSON table artifact (MLflow appends if the file already exists in the run)."""
        self._client.log_table(self._rid("log_table"), data=df, artifact_file=artifact_file)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        self._client.log_dict(self._rid("log_dict"), d, artifact_file)

    def log_trace(self, root: dict) -> str:
        """An MLflow trace linked to this run, from a tree of spans: each node a dict with `name` and optionally
        `span_type` (MLflow's: AGENT, LLM, TOOL, ...), `inputs`, `outputs`, `attributes`, `status` ("OK" | "ERROR")
        and `children` (nodes). Returns the trace id. (The rollout records' tool episodes: one span per turn, a
        child span per tool call.)"""
        import mlflow

        client, rid = self._client, self._rid("log_trace")
        isolated_trace_ids()
        if mlflow.get_tracking_uri() != self.tracking_uri:  # the trace exporter writes to the process's tracking URI
            mlflow.set_tracking_uri(self.tracking_uri)
        top = client.start_trace(root["name"], span_type=root.get("span_type", "UNKNOWN"), inputs=root.get("inputs"),
                                 attributes=root.get("attributes"), experiment_id=self.experiment_id, run_id=rid)

        def add(parent, nodes) -> None:
            for node in nodes:
                span = client.start_span(node["name"], trace_id=top.trace_id, parent_id=parent.span_id,
                                         span_type=node.get("span_type", "UNKNOWN"), inputs=node.get("inputs"),
                                         attributes=node.get("attributes"))
                add(span, node.get("children", ()))
                client.end_span(top.trace_id, span.span_id, outputs=node.get("outputs"),
                                status=node.get("status", "OK"))

        add(top, root.get("children", ()))
        client.end_trace(top.trace_id, outputs=root.get("outputs"), status=root.get("status", "OK"))
        mlflow.flush_trace_async_logging()  # written before this returns (a trainer may exit right after)
        return top.trace_id

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self._rid("log_text"), text, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        """A matplotlib (or plotly) figure as an image artifact."""
        self._client.log_figure(self._rid("log_figure"), figure, artifact_file)

    def log_image(self, figure, key: str) -> None:
        """A matplotlib figure as an MLflow image of `key` (shown in the run's "Model metrics" charts, unlike a
        plain artifact, which only the Artifacts tab lists); logged again, the key gets a new step."""
        import io

        import numpy as np
        from PIL import Image

        buf = io.BytesIO()
        figure.savefig(buf, format="png", dpi=100)
        buf.seek(0)
        with Image.open(buf) as img:
            arr = np.asarray(img.convert("RGB"))
        self._client.log_image(self._rid("log_image"), arr, key=key, step=0)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file, or a directory's contents, under artifact_path."""
        rid = self._rid("log_artifact")
        if Path(path).is_dir():
            self._client.log_artifacts(rid, str(path), artifact_path)
        else:
            self._client.log_artifact(rid, str(path), artifact_path)

    def register_model(self, model_dir: str | os.PathLike, name: str, alias: str | None = None,
                       description: str | None = None, tags: dict | None = None, flavor: str = "files") -> str:
        """Log model_dir as run artifacts `models/<name>`, register a new version of `name` from them, set alias.

        flavor "files": the directory's files as they are. flavor "transformers": an MLflow transformers model
        (infra/mlflow_model.py: `mlflow.transformers.load_model("models:/<name>@<alias>")` gives a text-generation
        pipeline, the checkpoint under `model/`); where that cannot be built (not a loadable causal LM) it warns
        and logs the files. The version's tag `alloy.mlflow_flavor` says which (only when "transformers" was asked).
        Returns the version (as a string); `models:/<name>@<alias>` then resolves to these files.
        """
        import tempfile

        from mlflow.exceptions import MlflowException

        rid = self._rid("register_model")
        if flavor not in ("files", "transformers"):
            raise ValueError(f"register_model: flavor must be 'files' or 'transformers', got {flavor!r}")
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"register_model: model_dir {str(model_dir)!r} is not a directory")
        art_path = f"models/{name}"
        tags = {k: str(v) for k, v in (tags or {}).items()}
        with tempfile.TemporaryDirectory(prefix="alloy-mlflow-model-") as tmp:
            logged_dir = str(model_dir)
            if flavor == "transformers":
                logged_dir, tags["alloy.mlflow_flavor"] = self._transformers_dir(model_dir, Path(tmp), description)
            self._client.log_artifacts(rid, logged_dir, art_path)
        source = self._client.get_run(rid).info.artifact_uri.rstrip("/") + "/" + art_path
        try:
            self._client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self._client.create_model_version(name, source, run_id=rid, description=description, tags=tags or None)
        version = str(mv.version)
        if alias:
            self._client.set_registered_model_alias(name, alias, version)
        log.info("registered model %s version %s%s", name, version, f" as @{alias}" if alias else "")
        return version

    @staticmethod
    def _transformers_dir(model_dir, tmp: Path, description: str | None) -> tuple[str, str]:
        """(folder to log, flavor logged): the MLflow transformers model built in tmp, or model_dir as it is."""
        from infra.mlflow_model import save_transformers_model

        try:
            return str(save_transformers_model(model_dir, tmp / "model", description)), "transformers"
        except Exception as exc:  # noqa: BLE001 - any reason the flavor cannot apply: register the files instead
            log.warning("register_model: %s is registered as plain files, not as an MLflow transformers model "
                        "(mlflow.transformers.load_model will not load it): %s: %s",
                        model_dir, type(exc).__name__, exc)
            return str(model_dir), "files"

    def update_model_version(self, name: str, version: str, tags: dict | None = None,
                             description: str | None = None) -> None:
        """Add tags to (and optionally rewrite the description of) a registered model version."""
        for k, v in (tags or {}).items():
            self._client.set_model_version_tag(name, str(version), k, str(v))
        if description is not None:
            self._client.update_model_version(name, str(version), description=description)

    # ----------------------------------------------------------------------------------------- reading back

    def children(self, parent_run_id: str | None = None) -> dict[str, str]:
        """{child name: run id} of the live children of a run (default: this tracker's run); oldest wins a name."""
        from mlflow.entities import ViewType

        parent = parent_run_id or self._rid("children")
        out: dict[str, str] = {}
        token = None
        while True:
            page = self._client.search_runs([self.experiment_id], filter_string=f"tags.{PARENT_TAG} = '{parent}'",
                                            run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                            order_by=["attributes.start_time ASC"], page_token=token)
            for r in page:
                out.setdefault(r.data.tags.get(CHILD_TAG, r.info.run_name), r.info.run_id)
            token = page.token
            if not token:
                return out

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """[(step, value)] of one metric of a run, in step order; a step logged twice (a resumed run) keeps the last."""
        last: dict[int, tuple[int, float]] = {}
        for m in self._client.get_metric_history(run_id, key):
            if m.step not in last or m.timestamp >= last[m.step][0]:
                last[m.step] = (m.timestamp, float(m.value))
        return [(s, v) for s, (_, v) in sorted(last.items())]


# --------------------------------------------------------------------------------------------- no-op


class NoopTracker:
    """Same surface as Tracker, does nothing: used off rank 0, with tracking disabled, and in pure unit tests."""
    tracking_uri = None
    registry_uri = None
    experiment_name = None
    experiment_id = None
    run_id = None

    def start_parent(self, run_name: str, tags: dict | None = None) -> None:
        return None

    def resume(self, run_id: str) -> "NoopTracker":
        return self

    def find_child(self, parent_run_id: str, name: str) -> None:
        return None

    @contextlib.contextmanager
    def child(self, name: str, tags: dict | None = None, resume: bool = True) -> Iterator["NoopTracker"]:
        yield self

    def end(self, status: str = "FINISHED") -> None:
        return None

    def log_params(self, params: dict) -> None:
        return None

    def log_config(self, config: dict) -> None:
        return None

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        return None

    def start_system_metrics(self) -> None:
        return None

    def set_tags(self, tags: dict) -> None:
        return None

    def log_table(self, df, artifact_file: str) -> None:
        return None

    def log_dict(self, d: dict, artifact_file: str) -> None:
        return None

    def log_trace(self, root: dict) -> None:
        return None

    def log_text(self, text: str, artifact_file: str) -> None:
        return None

    def log_figure(self, figure, artifact_file: str) -> None:
        return None

    def log_image(self, figure, key: str) -> None:
        return None

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        return None

    def register_model(self, model_dir, name: str, alias: str | None = None, description: str | None = None,
                       tags: dict | None = None, flavor: str = "files") -> None:
        return None

    def update_model_version(self, name: str, version: str, tags: dict | None = None,
                             description: str | None = None) -> None:
        return None

    def children(self, parent_run_id: str | None = None) -> dict[str, str]:
        return {}

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return []


ISOLATED_IDS_ENV = "MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR"  # MLflow's own switch, honoured when set


def isolated_trace_ids() -> None:
    """Trace and span ids from MLflow's private random generator, not from Python's global `random` (OpenTelemetry's
    default): every trainer seeds that with `run.seed`, so a rerun of a config logged its traces under the first
    run's ids (the trainers of one run could share ids too), and a trace logged under an id the store already held
    replaced the earlier run's; drawing the ids also moved the trainer's `random` stream. MLflow reads its switch
    when it sets up its tracer provider, so the provider is reset once after the switch is set here, and at exit
    (MLflow's private generator, dropped only at interpreter shutdown, prints an ignored AttributeError); a switch in
    the environment (true or false) is left as it is."""
    if os.environ.get(ISOLATED_IDS_ENV) is not None:
        return
    import atexit

    import mlflow.tracing

    os.environ[ISOLATED_IDS_ENV] = "true"
    mlflow.tracing.reset()  # the next trace sets the provider up again, with the private generator
    atexit.register(mlflow.tracing.reset)


SYSTEM_METRICS_ENV = "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"  # MLflow's own switch, honoured here too


def system_metrics_wanted(on_gpu: bool, env: dict | None = None) -> bool:
    """Whether a trainer logs MLflow's system metrics: MLflow's own switch (MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING,
    true/false) when set, else on a GPU only (its utilisation and memory are what a GPU run needs beside its
    curves; a CPU run, CI included, logs what it always did)."""
    raw = (os.environ if env is None else env).get(SYSTEM_METRICS_ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return on_gpu


def make_tracker(rank: int, *, enabled: bool = True, runs_root: str | os.PathLike = "runs", experiment: str = "alloy",
                 uri: str | None = None) -> Tracker | NoopTracker:
    """A Tracker on rank 0 when tracking is enabled, a NoopTracker everywhere else."""
    if rank == 0 and enabled:
        return Tracker(runs_root=runs_root, experiment=experiment, uri=uri)
    return NoopTracker()
