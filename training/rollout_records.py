"""Rollout records: what a trainer sampled, scored and trained on, and what its evaluations generated, as Parquet
files a user can read, filter and diff.

Both RL trainers (teachers/specialist.py, student/trainer.py) hand each step's trained samples to a `Recorder` as
`RolloutRow`s. What is written is `specialists.record` / `distill.record` (`infra.config_shared.RecordConfig`):

- `full: true`: every step, every row (ids, log-probs and all): the debug record, off by default;
- otherwise every `every` steps (and the last), `sample` rows chosen by a hash of their ids (the same rows whatever
  the order they finished in), with the same columns: always on, small.

One file per recorded step, `<out_url>/rollouts/step-<step:06d>.parquet` beside the trainer's checkpoints (local or
S3: infra/storage.py); a resumed run rewrites the steps it repeats, so a step's file is the step that trained. The
recorded text columns of the sample also go to the MLflow run as a table (`rollouts/<domain>.json`, one artifact the
UI shows as a table; with `full` too, only the sample's steps and rows go there). The table's rows are buffered and
appended at each checkpoint and at the end (`Recorder.flush`): MLflow rewrites the whole file on every append (a
download, a concatenation and an upload, ~30 ms of CPU), which per sampled step cost the demo's trainers ~70 s of
wall in their step loops (docs/tuning.md#overhead); the table then shows the committed steps, so a resumed run's
repeated steps appear once.

Evaluations are recorded too, always (unless `sample` is 0), with no extra generation: each evaluation keeps the
first `sample` episodes of every domain it generated anyway (`domains.evaluate.score_domains(keep=k)`: the same
prompts at every evaluation, so two of them can be diffed) and the trainer writes them (`Recorder.record_eval`,
rows from `eval_rows`) with `split` "eval" (the eval split: the student's periodic evals, a specialist's final
score) or "val" (a specialist's validations), one file per evaluation, `<out_url>/rollouts/<split>-step-<step:06d>
.parquet`, `step` the trainer step it ran at; with a bound MLflow run also a table, `rollouts/<split>_<domain>.json`
(appended per evaluation; no traces: those stay the training sample's); the trainer's summary counts them apart
(`rollout_records.evals`: files, bytes, seconds). An eval row is greedy and scored as the
evaluation scores it: `reward` the clean reward (a hack attempt scores 0), `staleness` 0, `weight_version` the
weights evaluated (a specialist's final eval: the selected step's), no log-probs (`behaviour_logprobs` null), and a
tool episode's `calls` carry the guard's rule filter's verdict (evaluation runs no guard: a call the rules flag has
`guard_allowed` false, its rules, and still `executed`; `blocked_calls` counts those: the episode's hack attempts).

Columns (`SCHEMA`, version `SCHEMA_VERSION` in the file's metadata; a list column is one value per response token):

    stage               "specialist" | "student"
    split               "train" (a trained sample) | "eval" | "val" (an evaluation's; module docstring). Added in
                        `alloy.rollouts/2`: a version-1 file has none and reads as "train"
    domain              the sample's domain
    step                the trainer step whose update trained the sample (1-based, as the step of the MLflow metrics)
    sample_id           the sample's id (a compacted episode's sub-traces: `<episode>~k`)
    episode_id          the episode it belongs to (= sample_id unless compacted)
    weight_version      the weights version that generated it (the oldest of its tokens for a resumed partial)
    staleness           updates between the weights that generated it and the weights it updated (0: on-policy)
    prompt, response    decoded text (special tokens kept; tool output lines included)
    prompt_ids          token ids of the prompt
    output_ids          token ids of the response (tool output included)
    behaviour_logprobs  log π_behaviour of each response token, as the engine reported it (0 for tool output; null
                        on an eval row)
    teacher_logprobs    the teacher's log-prob of each response token (the student's rows; null for a specialist)
    loss_mask           1 = a token the policy wrote (trained), 0 = tool output; null = all trained
    reward              the reward the update used (0 for an episode with a guard-blocked call)
    finish_reason       "stop" | "length" | ...
    blocked_calls       tool calls the guard blocked in the episode
    tool_calls          tool calls in the response (`domains.tools.count_tool_calls`; 0 for a plain domain)
    token_versions      the weights version of each response token (a resumed partial's are older: APRIL)
    step_credit         the part of the reward the update placed on each response token (teachers/step_credit.py;
                        the rest on the last token); null = the whole reward on the last token. Added in
                        `alloy.rollouts/3` (older files read as null)
    teacher_topk_ids,   the teacher's top-k ids and log-probs at each response token (the student's rows with a
    teacher_topk_logprobs  top-k loss; null otherwise)
    calls               the episode's tool calls as the env recorded them: command, output, executed, guard_allowed,
                        rules (the guard's rules hit), exit_code (a compacted episode's sub-traces each carry all)

Each recorded tool episode of the sample also goes to the run as an MLflow trace (`episode_trace`): a span per
turn, a child span per tool call with its command, output, guard verdict and rules (a blocked call's span is an
ERROR). The file's metadata holds the step itself (`step_meta`): the weights version the update started from and its metrics
(losses), what a replay of the step compares against; an evaluation's file holds its step, the version evaluated and
the domains' scores. `read_rollouts(prefix)` reads the training rows back as one DataFrame, `split=` an evaluation's
or (None) every split (`alloy rollouts` prints, filters and diffs them).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

log = logging.getLogger("alloy")

SCHEMA_VERSION = "alloy.rollouts/3"  # /2: the `split` column (a /1 file reads as split "train"); /3: `step_credit`
FOLDER = "rollouts"
TRAIN, SPLITS = "train", ("train", "val", "eval")
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
    split: str = TRAIN
    step_credit: list[float] | None = None


def schema():
    """The Parquet schema of a record file (pyarrow; its metadata names `SCHEMA_VERSION`)."""
    import pyarrow as pa

    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
    return pa.schema([
        ("stage", pa.string()), ("split", pa.string()), ("domain", pa.string()), ("step", pa.int64()),
        ("sample_id", pa.string()), ("episode_id", pa.string()), ("weight_version", pa.int64()),
        ("staleness", pa.int64()),
        ("prompt", pa.string()), ("response", pa.string()), ("prompt_ids", ints), ("output_ids", ints),
        ("behaviour_logprobs", floats), ("teacher_logprobs", floats), ("loss_mask", pa.list_(pa.int8())),
        ("reward", pa.float64()), ("finish_reason", pa.string()), ("blocked_calls", pa.int32()),
        ("tool_calls", pa.int32()),
        ("calls", pa.list_(pa.struct([("command", pa.string()), ("output", pa.string()), ("executed", pa.bool_()),
                                      ("guard_allowed", pa.bool_()), ("rules", pa.list_(pa.string())),
                                      ("exit_code", pa.int32())]))),
        ("token_versions", ints), ("teacher_topk_ids", pa.list_(ints)), ("teacher_topk_logprobs", pa.list_(floats)),
        ("step_credit", pa.list_(pa.float64())),
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


def file_name(step: int, split: str = TRAIN) -> str:
    """A record file's name: `step-NNNNNN.parquet` (training), `<split>-step-NNNNNN.parquet` (an evaluation)."""
    if split not in SPLITS:
        raise ValueError(f"rollout records: split {split!r} is none of {SPLITS}")
    return f"step-{step:06d}.parquet" if split == TRAIN else f"{split}-step-{step:06d}.parquet"


def parse_name(name: str) -> tuple[str, int] | None:
    """(split, step) of a record file's name (`file_name`), or None for another file."""
    name = name.rsplit("/", 1)[-1]
    head, sep, rest = name.partition("step-")
    split = head[:-1] if head.endswith("-") else head
    if not sep or not rest.endswith(".parquet") or (head and split not in SPLITS[1:]):
        return None
    try:
        return split or TRAIN, int(rest.removesuffix(".parquet"))
    except ValueError:
        return None


def step_url(out_url: str, step: int, split: str = TRAIN) -> str:
    from infra.storage import join

    return join(out_url, FOLDER, file_name(step, split))


def eval_rows(stage: str, step: int, version: int, scores: Mapping[str, Any], decode: Callable[[Sequence[int]], str],
              *, split: str = "eval") -> list[RolloutRow]:
    """An evaluation's sample as rows: `scores` {domain: `domains.evaluate.DomainScores`} whose `samples` the
    evaluation kept (`keep=k`); `step` the trainer step it ran at, `version` the weights version it evaluated;
    `decode` ids → text (the tokenizer's, special tokens kept, as the training rows). Module docstring: what an eval
    row's columns hold."""
    from domains.tools import count_tool_calls

    rows = []
    for domain, sc in scores.items():
        for smp in getattr(sc, "samples", None) or []:
            response = decode(smp.output_ids)
            sid = f"{split}-{domain}-{smp.index}"
            rows.append(RolloutRow(
                stage=stage, split=split, domain=domain, step=step, sample_id=sid, episode_id=sid,
                weight_version=version, staleness=0, prompt=decode(smp.prompt_ids), response=response,
                prompt_ids=list(smp.prompt_ids), output_ids=list(smp.output_ids), behaviour_logprobs=None,
                reward=float(smp.reward), finish_reason=smp.finish_reason,
                loss_mask=list(smp.loss_mask) if smp.loss_mask else None,
                blocked_calls=sum(not c.get("guard_allowed", True) for c in smp.calls),
                tool_calls=count_tool_calls(response) if smp.tool else 0, calls=list(smp.calls) or None))
    return rows


class Recorder:
    """Writes a trainer's rollout records under `out_url` as `cfg` (a RecordConfig) says; `tracker`: the trainer's
    MLflow tracker (the sample's table), or None. `last_step`: the run's final step (always recorded)."""

    def __init__(self, cfg, out_url: str, tracker=None, *, last_step: int | None = None):
        self.cfg, self.out_url, self.tracker, self.last_step = cfg, out_url, tracker, last_step
        self.written: list[str] = []  # URLs of the files this process wrote (training steps and evaluations)
        self.files, self.bytes = 0, 0  # the training steps' files
        self.seconds = 0.0  # wall time spent recording (building rows, Parquet, storage, MLflow), in the step loop
        self.evals = {"files": 0, "bytes": 0, "seconds": 0.0}  # the evaluations' samples (`record_eval`), apart
        self._tables: dict[str, list[dict]] = {}  # MLflow table rows not yet logged, by artifact file (`flush`)
        self._tables_lock = threading.Lock()  # a checkpoint may flush in a worker thread (the student's)
        if self.cfg.full or self.cfg.sample:  # (a sample also records every evaluation's)
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

    def record_eval(self, step: int, rows: list[RolloutRow], *, meta: dict | None = None) -> str | None:
        """Write an evaluation's sample (`rows`, from `eval_rows`: the evaluation kept `cfg.sample` episodes per
        domain) as `<out_url>/rollouts/<split>-step-NNNNNN.parquet` (the rows' split) with `meta` (the evaluation:
        version, scores), and with a bound MLflow run its table, `rollouts/<split>_<domain>.json`. Always, unless
        `sample` is 0; returns the file's URL, or None (nothing to record, or a failed write: logged, the caller
        goes on)."""
        if not self.cfg.sample or not rows:
            return None
        split = rows[0].split
        t0 = time.perf_counter()
        try:
            url, size = self._write(step_url(self.out_url, step, split), rows,
                                    {"step": step, "split": split, **(meta or {})}, f"{split} step {step}")
            if url is None:
                return None
            self.evals["files"] += 1
            self.evals["bytes"] += size
            if getattr(self.tracker, "run_id", None) is not None:
                self._buffer_table(rows, split)
            return url
        finally:
            self.evals["seconds"] += time.perf_counter() - t0

    def summary(self) -> dict:
        """What the trainer's summary reports: the training steps' files and bytes written and seconds spent, and
        the same of the evaluations' samples (`evals`)."""
        return {"files": self.files, "bytes": self.bytes, "seconds": round(self.seconds, 4),
                "evals": {**self.evals, "seconds": round(self.evals["seconds"], 4)}}

    def _record(self, step: int, samples: list, row_of, sample_id, meta: dict | None) -> str | None:
        kept = samples if self.cfg.full else pick_sample(samples, self.cfg.sample, step, sample_id)
        if not kept:
            return None
        url = step_url(self.out_url, step)
        try:
            rows = [row_of(s) for s in kept]
        except Exception as e:  # noqa: BLE001 (decoding: the step trains on regardless)
            log.warning("rollout records: step %d not written to %s: %s", step, url, e)
            return None
        url, size = self._write(url, rows, {"step": step, **(meta or {})}, f"step {step}")
        if url is None:
            return None
        self.files += 1
        self.bytes += size
        if getattr(self.tracker, "run_id", None) is not None and self.sampled(step):  # an MLflow run to show it in
            shown = pick_sample(rows, self.cfg.sample, step, lambda r: r.sample_id) if self.cfg.full else rows
            self._buffer_table(shown)
            for r in shown:
                if r.tool_calls or r.calls:
                    self._log_trace(r)
        return url

    def _write(self, url: str, rows: list[RolloutRow], meta: dict, what: str) -> tuple[str | None, int]:
        """(url, bytes) of the file written, (None, 0) when it was not (logged)."""
        from infra.storage import write_bytes

        try:
            data = to_parquet(rows, meta)
            write_bytes(url, data, durable=False)  # renamed into place whole; not fsynced (a record, not a checkpoint)
        except Exception as e:  # noqa: BLE001 (storage or encoding: the step trains on regardless)
            log.warning("rollout records: %s not written to %s: %s", what, url, e)
            return None, 0
        self.written.append(url)
        return url, len(data)

    def _log_trace(self, row: RolloutRow) -> None:
        try:
            self.tracker.log_trace(episode_trace(row))
        except Exception as e:  # noqa: BLE001 (a tracking hiccup must not stop training)
            log.warning("rollout records: MLflow trace of %s not logged: %s", row.sample_id, e)

    def _buffer_table(self, rows: list[RolloutRow], split: str = TRAIN) -> None:
        """Buffer `rows` for their domains' MLflow tables (`flush` logs them)."""
        with self._tables_lock:
            for r in rows:
                name = f"{FOLDER}/{r.domain}.json" if split == TRAIN else f"{FOLDER}/{split}_{r.domain}.json"
                self._tables.setdefault(name, []).append({c: getattr(r, c) for c in TABLE_COLUMNS})

    def flush(self) -> None:
        """Append the buffered rows to their MLflow tables, one `log_table` per table (`rollouts/<domain>.json`,
        `rollouts/<split>_<domain>.json`; the tables by name, each one's rows in the order they were recorded). The trainers call it after each
        checkpoint and at the end; without a bound MLflow run nothing is buffered. A failed table is logged and
        dropped (its rows are in the Parquet files): a record never stops training."""
        with self._tables_lock:
            tables, self._tables = self._tables, {}
        if not tables:
            return
        import pandas as pd

        t0 = time.perf_counter()
        try:
            for name in sorted(tables):
                try:
                    self.tracker.log_table(pd.DataFrame(tables[name], columns=TABLE_COLUMNS), name)
                except Exception as e:  # noqa: BLE001 (a tracking hiccup must not stop training)
                    log.warning("rollout records: MLflow table %s not logged: %s", name, e)
        finally:
            self.seconds += time.perf_counter() - t0


def read_rollouts(prefix: str, steps: Iterable[int] | None = None, split: str | None = TRAIN) -> Any:
    """The record files of `split` under `prefix` (a trainer's `out_url`, or its `rollouts/` folder) as one pandas
    DataFrame with `schema()`'s columns, in step order (only `steps` when given): the training rows by default,
    "eval" / "val" an evaluation's, None every split (the `split` column says which; a version-1 file's rows read as
    "train"). A FileNotFoundError names the folder when it holds none."""
    import pandas as pd
    import pyarrow.parquet as pq

    from infra.storage import get_fs, join, read_bytes

    if split is not None and split not in SPLITS:
        raise ValueError(f"rollout records: split {split!r} is none of {SPLITS}")
    folder = prefix.rstrip("/")
    if not folder.endswith(FOLDER):
        folder = join(folder, FOLDER)
    fs, path = get_fs(folder)
    try:
        listed = fs.ls(path, detail=False)
    except FileNotFoundError:
        listed = []
    files = sorted(((parsed[1], SPLITS.index(parsed[0]), p.rsplit("/", 1)[-1]) for p in listed
                    if (parsed := parse_name(p)) is not None and split in (None, parsed[0])))
    if not files:
        which = "" if split in (None, TRAIN) else f"{split} "
        raise FileNotFoundError(f"no {which}rollout records under {folder} (a trainer writes them as "
                                f"{FOLDER}/step-NNNNNN.parquet beside its checkpoints, an evaluation's sample as "
                                f"{FOLDER}/eval-step-NNNNNN.parquet or val-step-NNNNNN.parquet)")
    want = None if steps is None else {int(s) for s in steps}
    frames = []
    for step, k, name in files:
        if want is not None and step not in want:
            continue
        df = pq.read_table(io.BytesIO(read_bytes(join(folder, name)))).to_pandas()
        if "split" not in df.columns:  # alloy.rollouts/1: training rows only
            df["split"] = SPLITS[k]
        frames.append(df)
    names = schema().names
    if not frames:
        return pd.DataFrame(columns=names)
    df = pd.concat(frames, ignore_index=True)
    return df.reindex(columns=[*names, *(c for c in df.columns if c not in names)])  # a column it lacks: null


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


def step_meta(prefix: str, step: int, split: str = TRAIN) -> dict:
    """The metadata of step `step`'s record under `prefix` (a trainer's `out_url`): {"step", "version", "metrics"};
    an evaluation's (`split`): {"step", "split", "version", "scores"}."""
    import pyarrow.parquet as pq

    from infra.storage import read_bytes

    url = step_url(prefix.rstrip("/").removesuffix(f"/{FOLDER}"), step, split)
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
