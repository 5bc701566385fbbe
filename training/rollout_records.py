"""Rollout records: what a trainer sampled, scored and trained on, as Parquet files a user can read, filter and diff.

Both RL trainers (teachers/specialist.py, student/trainer.py) hand each step's trained samples to a `Recorder` as
`RolloutRow`s. What is written is `specialists.record` / `distill.record` (`infra.config_shared.RecordConfig`):

- `full: true`: every step, every row (ids, log-probs and all): the debug record, off by default;
- otherwise every `every` steps (and the last), `sample` rows chosen by a hash of their ids (the same rows whatever
  the order they finished in), with the same columns: always on, small.

One file per recorded step, `<out_url>/rollouts/step-<step:06d>.parquet` beside the trainer's checkpoints (local or
S3: infra/storage.py); a resumed run rewrites the steps it repeats, so a step's file is the step that trained. The
recorded text columns of the sample also go to the MLflow run as a table (`rollouts/<domain>.json`, one artifact the
UI shows as a table, rows appended per sampled step; with `full` too, only the sample's steps and rows go there).

Columns (`SCHEMA`, version `SCHEMA_VERSION` in the file's metadata; a list column is one value per response token):

    stage               "specialist" | "student"
    domain              the sample's domain
    step                the trainer step whose update trained the sample (1-based, as the step of the MLflow metrics)
    sample_id           the sample's id (a compacted episode's sub-traces: `<episode>~k`)
    episode_id          the episode it belongs to (= sample_id unless compacted)
    weight_version      the weights version that generated it (the oldest of its tokens for a resumed partial)
    staleness           updates between the weights that generated it and the weights it updated (0: on-policy)
    prompt, response    decoded text (special tokens kept; tool output lines included)
    prompt_ids          token ids of the prompt
    output_ids          token ids of the response (tool output included)
    behaviour_logprobs  log π_behaviour of each response token, as the engine reported it (0 for tool output)
    teacher_logprobs    the teacher's log-prob of each response token (the student's rows; null for a specialist)
    loss_mask           1 = a token the policy wrote (trained), 0 = tool output; null = all trained
    reward              the reward the update used (0 for an episode with a guard-blocked call)
    finish_reason       "stop" | "length" | ...
    blocked_calls       tool calls the guard blocked in the episode
    tool_calls          tool calls in the response (`domains.tools.count_tool_calls`; 0 for a plain domain)
    token_versions      the weights version of each response token (a resumed partial's are older: APRIL)
    teacher_topk_ids,   the teacher's top-k ids and log-probs at each response token (the student's rows with a
    teacher_topk_logprobs  top-k loss; null otherwise)
    calls               the episode's tool calls as the env recorded them: command, output, executed, guard_allowed,
                        rules (the guard's rules hit), exit_code (a compacted episode's sub-traces each carry all)

Each recorded tool episode of the sample also goes to the run as an MLflow trace (`episode_trace`): a span per
turn, a child span per tool call with its command, output, guard verdict and rules (a blocked call's span is an
ERROR). The file's metadata holds the step itself (`step_meta`): the weights version the update started from and its metrics
(losses), what a replay of the step compares against. `read_rollouts(prefix)` reads the rows back as one DataFrame (`alloy rollouts` prints, filters and diffs them).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

log = logging.getLogger("alloy")

SCHEMA_VERSION = "alloy.rollouts/1"
FOLDER = "rollouts"
TABLE_COLUMNS = ["step", "domain", "sample_id", "staleness", "reward", "finish_reason", "blocked_calls", "tool_calls",
                 "prompt", "response"]


@dataclass
class RolloutRow:
    """One trained sample, as recorded (the columns of the module docstring)."""

    stage: str
    domain: str
    step: int
    sample_id: str
    episode_id: str
    weight_version: int
    prompt: str
    response: str
    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    finish_reason: str
    staleness: int
    teacher_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    blocked_calls: int = 0
    tool_calls: int = 0
    calls: list[dict] | None = None
    token_versions: list[int] | None = None
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None


def schema():
    """The Parquet schema of a record file (pyarrow; its metadata names `SCHEMA_VERSION`)."""
    import pyarrow as pa

    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
    return pa.schema([
        ("stage", pa.string()), ("domain", pa.string()), ("step", pa.int64()), ("sample_id", pa.string()),
        ("episode_id", pa.string()), ("weight_version", pa.int64()), ("staleness", pa.int64()),
        ("prompt", pa.string()), ("response", pa.string()), ("prompt_ids", ints), ("output_ids", ints),
        ("behaviour_logprobs", floats), ("teacher_logprobs", floats), ("loss_mask", pa.list_(pa.int8())),
        ("reward", pa.float64()), ("finish_reason", pa.string()), ("blocked_calls", pa.int32()),
        ("tool_calls", pa.int32()),
        ("calls", pa.list_(pa.struct([("command", pa.string()), ("output", pa.string()), ("executed", pa.bool_()),
                                      ("guard_allowed", pa.bool_()), ("rules", pa.list_(pa.string())),
                                      ("exit_code", pa.int32())]))),
        ("token_versions", ints), ("teacher_topk_ids", pa.list_(ints)), ("teacher_topk_logprobs", pa.list_(floats)),
    ], metadata={"schema": SCHEMA_VERSION})


def to_parquet(rows: list[RolloutRow], meta: dict | None = None) -> bytes:
    """`rows` as the bytes of one Parquet file with `schema()`; `meta` (JSON-able) in its metadata as `step`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sch = schema()
    if meta is not None:
        sch = sch.with_metadata({**sch.metadata, b"step": json.dumps(meta, default=float).encode()})
    cols = {name: [getattr(r, name) for r in rows] for name in sch.names}
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pydict(cols, schema=sch), buf, compression="zstd")
    return buf.getvalue()


T = TypeVar("T")


def pick_sample(items: list[T], k: int, step: int, sample_id: Callable[[T], str]) -> list[T]:
    """`k` of `items` chosen by a hash of (step, its sample id): the same ones whatever order they finished in; in
    sample-id order."""
    def key(x: T) -> bytes:
        return hashlib.sha256(f"{step}|{sample_id(x)}".encode()).digest()

    return sorted(sorted(items, key=key)[:max(k, 0)], key=sample_id)


def step_url(out_url: str, step: int) -> str:
    from infra.storage import join

    return join(out_url, FOLDER, f"step-{step:06d}.parquet")


class Recorder:
    """Writes a trainer's rollout records under `out_url` as `cfg` (a RecordConfig) says; `tracker`: the trainer's
    MLflow tracker (the sample's table), or None. `last_step`: the run's final step (always recorded)."""

    def __init__(self, cfg, out_url: str, tracker=None, *, last_step: int | None = None):
        self.cfg, self.out_url, self.tracker, self.last_step = cfg, out_url, tracker, last_step
        self.written: list[str] = []  # URLs of the files this process wrote
        self.bytes = 0
        self.seconds = 0.0  # wall time spent recording (building rows, Parquet, storage, MLflow), in the step loop
        if self.cfg.full or (self.cfg.every and self.cfg.sample):
            to_parquet([])  # pyarrow imported and its Parquet writer set up now, not in the first recorded step

    def wants(self, step: int) -> bool:
        """Whether step `step` is recorded: every step with `full`, else the sample's steps (`sampled`)."""
        return bool(self.cfg.full) or self.sampled(step)

    def sampled(self, step: int) -> bool:
        """Whether step `step` is one of the sample's: every `every` steps and the last. Only those go to MLflow
        (the table and the traces), also with `full`."""
        if not self.cfg.every or not self.cfg.sample:
            return False
        return step % self.cfg.every == 0 or step == self.last_step

    def record(self, step: int, samples: Iterable[T], row_of: Callable[[T], RolloutRow],
               sample_id: Callable[[T], str] = lambda s: s.sample_id, meta: dict | None = None) -> str | None:
        """Write step `step`'s samples (all with `full`, else the sample, chosen before `row_of` turns them into
        rows: only recorded samples are decoded) and `meta` (the step: version, metrics); returns the file's URL,
        or None when the step is not recorded. A failed write is logged and skipped: a record never stops training."""
        if not self.wants(step):
            return None
        t0 = time.perf_counter()
        try:
            return self._record(step, list(samples), row_of, sample_id, meta)
        finally:
            self.seconds += time.perf_counter() - t0

    def summary(self) -> dict:
        """What the trainer's summary reports: files and bytes written, seconds spent."""
        return {"files": len(self.written), "bytes": self.bytes, "seconds": round(self.seconds, 4)}

    def _record(self, step: int, samples: list, row_of, sample_id, meta: dict | None) -> str | None:
        kept = samples if self.cfg.full else pick_sample(samples, self.cfg.sample, step, sample_id)
        if not kept:
            return None
        from infra.storage import write_bytes

        url = step_url(self.out_url, step)
        try:
            rows = [row_of(s) for s in kept]
            data = to_parquet(rows, {"step": step, **(meta or {})})
            write_bytes(url, data, durable=False)  # renamed into place whole; not fsynced (a record, not a checkpoint)
        except Exception as e:  # noqa: BLE001 (storage or encoding: the step trains on regardless)
            log.warning("rollout records: step %d not written to %s: %s", step, url, e)
            return None
        self.written.append(url)
        self.bytes += len(data)
        if getattr(self.tracker, "run_id", None) is not None and self.sampled(step):  # an MLflow run to show it in
            shown = pick_sample(rows, self.cfg.sample, step, lambda r: r.sample_id) if self.cfg.full else rows
            self._log_table(shown)
            for r in shown:
                if r.tool_calls or r.calls:
                    self._log_trace(r)
        return url

    def _log_trace(self, row: RolloutRow) -> None:
        try:
            self.tracker.log_trace(episode_trace(row))
        except Exception as e:  # noqa: BLE001 (a tracking hiccup must not stop training)
            log.warning("rollout records: MLflow trace of %s not logged: %s", row.sample_id, e)

    def _log_table(self, rows: list[RolloutRow]) -> None:
        import pandas as pd

        df = pd.DataFrame([{c: getattr(r, c) for c in TABLE_COLUMNS} for r in rows])
        for domain, part in df.groupby("domain", sort=True):
            try:
                self.tracker.log_table(part.reset_index(drop=True), f"{FOLDER}/{domain}.json")
            except Exception as e:  # noqa: BLE001 (a tracking hiccup must not stop training)
                log.warning("rollout records: MLflow table of %s not logged: %s", domain, e)


def read_rollouts(prefix: str, steps: Iterable[int] | None = None) -> Any:
    """Every record file under `prefix` (a trainer's `out_url`, or its `rollouts/` folder) as one pandas DataFrame,
    in step order (only `steps` when given). A FileNotFoundError names the folder when there is none."""
    import pandas as pd
    import pyarrow.parquet as pq

    from infra.storage import get_fs, join, read_bytes

    folder = prefix.rstrip("/")
    if not folder.endswith(FOLDER):
        folder = join(folder, FOLDER)
    fs, path = get_fs(folder)
    try:
        names = sorted(p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].startswith("step-")
                       and p.endswith(".parquet"))
    except FileNotFoundError:
        names = []
    if not names:
        raise FileNotFoundError(f"no rollout records under {folder} (a trainer writes them as "
                                f"{FOLDER}/step-NNNNNN.parquet beside its checkpoints)")
    want = None if steps is None else {int(s) for s in steps}
    frames = []
    for name in names:
        step = int(name.rsplit("step-", 1)[1].split(".")[0])
        if want is not None and step not in want:
            continue
        frames.append(pq.read_table(io.BytesIO(read_bytes(join(folder, name.rsplit("/", 1)[-1])))).to_pandas())
    if not frames:
        return pd.DataFrame(columns=schema().names)
    return pd.concat(frames, ignore_index=True)


def episode_trace(row: RolloutRow) -> dict:
    """A recorded tool episode as a span tree (`infra.tracking.Tracker.log_trace`): the episode (prompt in,
    response out, reward, staleness), one LLM span per model turn (its text), and under a turn that ends in a tool
    call a TOOL span: the command in, the env's output line out, the guard's verdict and rules and the exit code as
    attributes (the call's record, matched in order by command), ERROR when the guard blocked it."""
    from domains.tools import CALL_PREFIX, RESULT_PREFIX, parse_tool_call, trajectory_segments

    records, k = list(row.calls or []), 0
    turns: list[dict] = []
    segments = trajectory_segments(row.response)
    for i, (text, by_model) in enumerate(segments):
        if not by_model:
            continue
        turn = {"name": f"turn {len(turns) + 1}", "span_type": "LLM", "outputs": {"text": text}, "children": []}
        last = text.rstrip("\n").rsplit("\n", 1)[-1]
        command = parse_tool_call(last + "\n") if text.endswith("\n") and last.startswith(CALL_PREFIX) else None
        if command is not None:
            out = segments[i + 1][0] if i + 1 < len(segments) and not segments[i + 1][1] else ""
            rec = next((r for r in records[k:] if r.get("command") == command), None)
            if rec is not None:
                k = records.index(rec, k) + 1
            allowed = True if rec is None else bool(rec.get("guard_allowed", True))
            attrs = {"guard.allowed": allowed}
            if rec is not None:
                attrs.update({"guard.rules": list(rec.get("rules") or []), "executed": bool(rec.get("executed")),
                              "exit_code": rec.get("exit_code")})
            turn["children"].append({"name": command.split(" ", 1)[0] or "tool", "span_type": "TOOL",
                                     "inputs": {"command": command},
                                     "outputs": {"output": out.removeprefix(RESULT_PREFIX).rstrip("\n")},
                                     "attributes": attrs, "status": "OK" if allowed else "ERROR"})
        turns.append(turn)
    return {"name": f"{row.stage} {row.domain} step {row.step}", "span_type": "AGENT",
            "inputs": {"prompt": row.prompt}, "outputs": {"response": row.response},
            "attributes": {"sample_id": row.sample_id, "episode_id": row.episode_id, "reward": row.reward,
                           "staleness": row.staleness, "weight_version": row.weight_version,
                           "blocked_calls": row.blocked_calls, "finish_reason": row.finish_reason},
            "children": turns}


def step_meta(prefix: str, step: int) -> dict:
    """The metadata of step `step`'s record under `prefix` (a trainer's `out_url`): {"step", "version", "metrics"}."""
    import pyarrow.parquet as pq

    from infra.storage import read_bytes

    url = step_url(prefix.rstrip("/").removesuffix(f"/{FOLDER}"), step)
    md = pq.read_schema(io.BytesIO(read_bytes(url))).metadata or {}
    return json.loads(md.get(b"step", b"{}"))


def recorded_step(prefix: str, step: int, at_version: int) -> tuple[Any, dict]:
    """(rows, metadata) of step `step`'s record under `prefix`, for a replay on weights `at_version` (the trainer's
    `state.step`): a ValueError when the record has no step metadata, the step started from other weights, or the
    record holds only a sample of the rows its update trained on (not `record.full`)."""
    meta = step_meta(prefix, step)
    if "version" not in meta or "metrics" not in meta:
        raise ValueError(f"replay: step {step}'s record under {prefix} has no step metadata (recorded before "
                         "records held it)")
    if at_version != meta["version"]:
        raise ValueError(f"replay: step {step} updated weights version {meta['version']}, but the trainer holds "
                         f"version {at_version}: resume it from the checkpoint of step {meta['version']}")
    df = read_rollouts(prefix, steps=[step])
    if meta.get("rows") is not None and len(df) != meta["rows"]:
        raise ValueError(f"replay: step {step}'s record holds {len(df)} of the {meta['rows']} rows its update "
                         "trained on (a sample: record.full was off): it cannot be replayed")
    return df, meta
