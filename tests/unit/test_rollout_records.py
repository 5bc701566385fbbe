"""Rollout records (training/rollout_records.py): which steps and rows are written, the Parquet schema, reading them
back from local storage and from a real S3-compatible server (moto's), and a failed write that does not stop
training."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.config import RecordConfig
from training.rollout_records import (SCHEMA_VERSION, Recorder, RolloutRow, episode_trace, pick_sample,
                                      read_rollouts, schema, step_meta, step_url)

pytestmark = pytest.mark.unit


class Tracker:
    """Collects what `log_table` and `log_trace` are given (the Recorder's only calls on a tracker)."""

    run_id = "run-1"  # bound to a run (a NoopTracker's is None: nothing is logged)

    def __init__(self):
        self.tables: list[tuple[str, list[dict]]] = []
        self.traces: list[dict] = []

    def log_trace(self, root: dict) -> None:
        self.traces.append(root)

    def log_table(self, df, artifact_file: str) -> None:
        self.tables.append((artifact_file, df.to_dict("records")))


def row(step: int, i: int, domain: str = "reverse") -> RolloutRow:
    return RolloutRow(stage="specialist", domain=domain, step=step, sample_id=f"s{i}", episode_id=f"s{i}",
                      weight_version=step - 1, staleness=0, prompt=f"rev:{i}=", response=str(i)[::-1],
                      prompt_ids=[1, 2, 3], output_ids=[4, 5], behaviour_logprobs=[-0.5, -0.25], reward=i / 10,
                      finish_reason="stop", loss_mask=None if i % 2 else [1, 0])


def test_steps_recorded_every_n_and_the_last_unless_full():
    rec = Recorder(RecordConfig(every=10, sample=4), "file:///nowhere", last_step=25)
    assert [s for s in range(1, 26) if rec.wants(s)] == [10, 20, 25]
    assert not any(Recorder(RecordConfig(every=0), "x", last_step=5).wants(s) for s in range(1, 6))
    assert not Recorder(RecordConfig(every=10, sample=0), "x").wants(10)
    assert all(Recorder(RecordConfig(every=0, sample=0, full=True), "x").wants(s) for s in range(1, 6))


def test_the_sample_is_the_same_rows_whatever_order_they_finished_in():
    ids = [f"s{i}" for i in range(20)]
    a = pick_sample(ids, 4, 10, str)
    assert a == pick_sample(list(reversed(ids)), 4, 10, str) and len(a) == 4 and a == sorted(a)
    assert pick_sample(ids, 4, 20, str) != a  # another step samples other rows
    assert pick_sample(ids, 50, 10, str) == sorted(ids) and pick_sample(ids, 0, 10, str) == []


def test_written_and_read_back_with_the_schema_and_the_table(tmp_path):
    tracker = Tracker()
    rec = Recorder(RecordConfig(every=2, sample=3), f"file://{tmp_path}/spec", tracker, last_step=5)
    for step in range(1, 6):
        url = rec.record(step, range(8), lambda i, step=step: row(step, i), sample_id=lambda i: f"s{i}")
        assert (url is not None) == (step in (2, 4, 5))
    assert rec.written == [step_url(f"file://{tmp_path}/spec", s) for s in (2, 4, 5)]
    df = read_rollouts(f"file://{tmp_path}/spec")
    assert list(df.columns) == schema().names and len(df) == 9
    assert sorted(set(df.step)) == [2, 4, 5] and (df.staleness == 0).all()
    first = df[df.step == 2].iloc[0]
    assert list(first.prompt_ids) == [1, 2, 3] and list(first.behaviour_logprobs) == [-0.5, -0.25]
    assert first.teacher_logprobs is None and first.response == first.sample_id[1:][::-1]
    assert len(read_rollouts(f"file://{tmp_path}/spec/rollouts", steps=[4])) == 3
    import pyarrow.parquet as pq

    assert pq.read_schema(tmp_path / "spec" / "rollouts" / "step-000002.parquet").metadata[b"schema"] == \
        SCHEMA_VERSION.encode()
    # the MLflow table: one artifact per domain, the sample's text columns, appended at each flush (a checkpoint,
    # the end) with the steps recorded since: none before it, one call per table, in step order
    assert tracker.tables == []
    rec.flush()
    assert [name for name, _ in tracker.tables] == ["rollouts/reverse.json"]
    assert [r["step"] for r in tracker.tables[0][1]] == [2, 2, 2, 4, 4, 4, 5, 5, 5]
    assert set(tracker.tables[0][1][0]) == {"step", "domain", "sample_id", "staleness", "reward", "finish_reason",
                                            "blocked_calls", "tool_calls", "prompt", "response"}
    rec.flush()  # nothing new: no call
    rec.record(6, range(8), lambda i: row(6, i), sample_id=lambda i: f"s{i}")  # the last step is recorded anyway
    rec.flush()
    assert [len(rows) for _, rows in tracker.tables] == [9, 3] and rec.seconds > 0


def test_full_records_every_row_of_every_step(tmp_path):
    rec = Recorder(RecordConfig(every=1, sample=2, full=True), str(tmp_path / "s"), Tracker())
    for step in (1, 2):
        rec.record(step, range(6), lambda i, step=step: row(step, i, "reverse" if i < 3 else "copy"),
                   sample_id=lambda i: f"s{i}")
    df = read_rollouts(str(tmp_path / "s"))
    assert len(df) == 12 and sorted(set(df.domain)) == ["copy", "reverse"]
    rec.flush()
    # the MLflow table keeps to the sample: 2 rows a step, in their domains' tables
    assert {name for name, _ in rec.tracker.tables} <= {"rollouts/copy.json", "rollouts/reverse.json"}
    assert sum(len(rows) for _, rows in rec.tracker.tables) == 4


def test_no_records_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no rollout records under .*{tmp_path.name}/x/rollouts"):
        read_rollouts(str(tmp_path / "x"))


def test_a_failed_write_is_logged_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rec = Recorder(RecordConfig(every=1, sample=2), str(blocker / "spec"))
    with caplog.at_level(logging.WARNING, logger="alloy"):
        assert rec.record(1, range(3), lambda i: row(1, i), sample_id=lambda i: f"s{i}") is None
    assert "rollout records: step 1 not written" in caplog.text and rec.written == []


def test_records_on_s3(s3_bucket):
    rec = Recorder(RecordConfig(every=1, sample=2), f"{s3_bucket}/run/student")
    rec.record(1, range(5), lambda i: row(1, i), sample_id=lambda i: f"s{i}")
    df = read_rollouts(f"{s3_bucket}/run/student")
    assert len(df) == 2 and rec.bytes > 0


def call(command: str, output: str, allowed: bool = True, rules=()) -> dict:
    return {"command": command, "output": output, "executed": allowed, "guard_allowed": allowed,
            "rules": list(rules), "exit_code": 0 if allowed else None}


def tool_row(step: int = 3) -> RolloutRow:
    """A tool_add episode that tried the shortcut (blocked), then used calc and answered."""
    response = "!cat .answers\n>error\n!calc 1+2\n>3\n3"
    return RolloutRow(stage="specialist", domain="tool_add", step=step, sample_id="t0", episode_id="t0",
                      weight_version=step - 1, staleness=0, prompt="tla:1+2=", response=response, prompt_ids=[1],
                      output_ids=[2] * len(response), behaviour_logprobs=[-0.1] * len(response), reward=0.0,
                      finish_reason="stop", loss_mask=[1] * len(response), blocked_calls=1, tool_calls=2,
                      calls=[call("cat .answers", "error", False, ["hidden_file", "copy_answer"]), call("calc 1+2", "3")])


def test_a_tool_episode_is_a_trace_of_turns_and_tool_calls_with_guard_verdicts(tmp_path):
    tree = episode_trace(tool_row())
    assert tree["name"] == "specialist tool_add step 3" and tree["span_type"] == "AGENT"
    assert tree["inputs"] == {"prompt": "tla:1+2="} and tree["attributes"]["blocked_calls"] == 1
    assert [t["outputs"]["text"] for t in tree["children"]] == ["!cat .answers\n", "!calc 1+2\n", "3"]
    blocked, calc = (t["children"][0] for t in tree["children"][:2])
    assert blocked == {"name": "cat", "span_type": "TOOL", "inputs": {"command": "cat .answers"},
                       "outputs": {"output": "error"}, "status": "ERROR",
                       "attributes": {"guard.allowed": False, "guard.rules": ["hidden_file", "copy_answer"],
                                      "executed": False, "exit_code": None}}
    assert calc["status"] == "OK" and calc["outputs"] == {"output": "3"} and calc["attributes"]["exit_code"] == 0
    assert tree["children"][2]["children"] == []  # the answer: no tool
    # recorded: the calls column round-trips, and the sampled tool episode goes to the run as a trace
    tracker = Tracker()
    rec = Recorder(RecordConfig(every=1, sample=4), str(tmp_path / "s"), tracker)
    rec.record(3, [tool_row()], lambda r: r)
    df = read_rollouts(str(tmp_path / "s"))
    assert [c["command"] for c in df.calls[0]] == ["cat .answers", "calc 1+2"] and list(df.calls[0][0]["rules"]) == \
        ["hidden_file", "copy_answer"]
    assert [t["name"] for t in tracker.traces] == ["specialist tool_add step 3"]


def test_the_trace_lands_in_a_real_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    from infra.tracking import Tracker as MlflowTracker

    tracker = MlflowTracker(runs_root=tmp_path, experiment="records")
    run = tracker.start_parent("spec")
    trace_id = tracker.log_trace(episode_trace(tool_row()))
    (trace,) = MlflowClient(tracker.tracking_uri).search_traces(locations=[tracker.experiment_id], run_id=run)
    assert trace.info.trace_id == trace_id
    spans = {s.name: s for s in trace.data.spans}
    assert sorted(spans) == ["calc", "cat", "specialist tool_add step 3", "turn 1", "turn 2", "turn 3"]
    assert spans["cat"].status.status_code == "ERROR" and spans["cat"].attributes["guard.allowed"] is False
    assert spans["cat"].parent_id == spans["turn 1"].span_id and spans["calc"].inputs == {"command": "calc 1+2"}


SEEDED_TRACES = """
import json, random, sys
from infra.tracking import Tracker
root, tree = sys.argv[1], json.loads(sys.argv[2])
out = []
for name in ("first", "rerun"):
    tracker = Tracker(runs_root=root, experiment="records")
    run = tracker.start_parent(name)
    random.seed(0)  # the trainer's seeding
    trace_id = tracker.log_trace(tree)
    out.append({"run": run, "trace_id": trace_id, "untouched": random.random() == random.Random(0).random(),
                "experiment_id": tracker.experiment_id, "uri": tracker.tracking_uri})
print(json.dumps(out))
"""


def test_seeded_runs_keep_their_own_traces(tmp_path):
    """Every trainer seeds Python's `random` (run.seed), from which OpenTelemetry's default generator draws trace
    ids: two runs of one seed (a rerun of a config) logged the same ids, and the second run's traces replaced the
    first's in the store (the first run's Traces tab was empty; seen on the e2e stack too). The ids
    come from MLflow's private generator (MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR, set by `log_trace` when
    the environment does not say): each run keeps its own traces, and the trainer's `random` stream is untouched.
    In a fresh interpreter, as a trainer is: in a test worker, threads left by earlier tests may draw from the
    shared `random` between the seeding and the check (seen once under pytest-xdist)."""
    from mlflow import MlflowClient

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR"}
    proc = subprocess.run([sys.executable, "-c", SEEDED_TRACES, str(tmp_path), json.dumps(episode_trace(tool_row()))],
                          capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, rerun = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["untouched"] and rerun["untouched"]  # logging a trace drew nothing from the seeded `random`
    assert first["trace_id"] != rerun["trace_id"]
    client = MlflowClient(first["uri"])
    for r in (first, rerun):
        (trace,) = client.search_traces(locations=[r["experiment_id"]], run_id=r["run"])
        assert trace.info.trace_id == r["trace_id"] and len(trace.data.spans) == 6


def test_full_records_go_to_mlflow_only_on_the_sample_steps(tmp_path):
    from infra.tracking import NoopTracker

    tracker = Tracker()
    rec = Recorder(RecordConfig(every=5, sample=1, full=True), str(tmp_path / "s"), tracker, last_step=7)
    for step in range(1, 8):
        rec.record(step, range(3), lambda i, step=step: row(step, i), sample_id=lambda i: f"s{i}")
    rec.flush()
    assert len(rec.written) == 7 and [[r["step"] for r in rows] for _, rows in tracker.tables] == [[5, 7]]
    quiet = Recorder(RecordConfig(every=1, sample=2), str(tmp_path / "q"), NoopTracker())
    assert quiet.record(1, range(3), lambda i: row(1, i), sample_id=lambda i: f"s{i}") is not None  # no run: no table


def test_a_step_record_holds_what_a_replay_needs(tmp_path):
    """Token versions, the teacher's top-k, and the step itself (version, losses) in the file's metadata."""
    r = row(4, 1)
    r.token_versions, r.teacher_topk_ids, r.teacher_topk_logprobs = [3, 2], [[4, 9], [5, 1]], [[-0.5, -1.5], [-0.25, -2.0]]
    rec = Recorder(RecordConfig(every=1, sample=4), f"file://{tmp_path}/st")
    rec.record(4, [r], lambda x: x, meta={"version": 3, "metrics": {"loss": 0.125, "kl": 2.5}})
    got = read_rollouts(f"file://{tmp_path}/st").iloc[0]
    assert list(got.token_versions) == [3, 2] and [list(x) for x in got.teacher_topk_ids] == [[4, 9], [5, 1]]
    assert [list(x) for x in got.teacher_topk_logprobs] == [[-0.5, -1.5], [-0.25, -2.0]]
    assert step_meta(f"file://{tmp_path}/st", 4) == {"step": 4, "version": 3, "metrics": {"loss": 0.125, "kl": 2.5}}


def scores_with_samples():
    """An evaluation's kept episodes (`domains.evaluate.score_domains(keep=2)`): a plain domain's and a tool
    domain's, one of whose calls the guard's rules flag (a hack attempt: reward 0 clean)."""
    from domains.evaluate import DomainScores, EvalSample, eval_calls
    from domains.tools import CallRecord

    plain = DomainScores([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [False] * 3, samples=[
        EvalSample(0, [ord(c) for c in "rev:ab="], [ord(c) for c in "ba"], "stop", 1.0, 1.0),
        EvalSample(1, [ord(c) for c in "rev:cd="], [ord(c) for c in "cd"], "length", 0.0, 0.0)])
    response = "!cat .answers\n>3\n3"
    calls = eval_calls([CallRecord("cat .answers", "3", executed=True)])
    tool = DomainScores([0.0], [1.0], [True], tool=True, samples=[
        EvalSample(0, [ord(c) for c in "tla:1+2="], [ord(c) for c in response], "stop", 0.0, 1.0, tool=True,
                   loss_mask=[1] * 14 + [0] * 3 + [1], calls=calls)])
    return {"reverse": plain, "tool_add": tool}


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def test_an_evaluations_sample_is_recorded_as_its_own_split(tmp_path):
    """`Recorder.record_eval`: the rows `eval_rows` builds from what the evaluation kept, written as
    `eval-step-NNNNNN.parquet` beside the training steps, read back by split; the MLflow table `eval_<domain>`, no
    trace; with `record.sample` 0, nothing."""
    from training.rollout_records import eval_rows, file_name, parse_name

    rows = eval_rows("student", 10, 10, scores_with_samples(), decode)
    assert [r.sample_id for r in rows] == ["eval-reverse-0", "eval-reverse-1", "eval-tool_add-0"]
    assert all(r.split == "eval" and r.staleness == 0 and r.weight_version == 10 for r in rows)
    assert [r.prompt for r in rows] == ["rev:ab=", "rev:cd=", "tla:1+2="] and rows[0].response == "ba"
    hack = rows[2]  # evaluation runs no guard: the flagged call ran, with the rules' verdict
    assert hack.reward == 0.0 and hack.blocked_calls == 1 and hack.tool_calls == 1
    assert hack.calls[0]["executed"] and not hack.calls[0]["guard_allowed"] and "hidden_file" in hack.calls[0]["rules"]
    tracker = Tracker()
    rec = Recorder(RecordConfig(every=10, sample=2), f"file://{tmp_path}/st", tracker, last_step=20)
    rec.record(10, range(4), lambda i: row(10, i), sample_id=lambda i: f"s{i}")
    url = rec.record_eval(10, rows, meta={"version": 10, "scores": {"reverse": {"score": 0.5}}})
    assert url == step_url(f"file://{tmp_path}/st", 10, "eval") and url.endswith("rollouts/eval-step-000010.parquet")
    assert (file_name(10), parse_name(url), parse_name("val-step-000003.parquet")) == \
        ("step-000010.parquet", ("eval", 10), ("val", 3))
    assert parse_name("other-step-000001.parquet") is None and parse_name("notes.txt") is None
    train = read_rollouts(f"file://{tmp_path}/st")  # the trained rows only (what replays read)
    assert len(train) == 2 and (train.split == "train").all() and list(train.columns) == schema().names
    ev = read_rollouts(f"file://{tmp_path}/st", split="eval")
    assert list(ev.sample_id) == ["eval-reverse-0", "eval-reverse-1", "eval-tool_add-0"] and (ev.step == 10).all()
    assert ev.behaviour_logprobs.isna().all() and list(ev.loss_mask[2])[-4:] == [0, 0, 0, 1]
    assert [c["command"] for c in ev.calls[2]] == ["cat .answers"] and ev.calls[0] is None
    both = read_rollouts(f"file://{tmp_path}/st", split=None)
    assert sorted(both.split) == ["eval"] * 3 + ["train"] * 2
    assert step_meta(f"file://{tmp_path}/st", 10, "eval") == {"step": 10, "split": "eval", "version": 10,
                                                              "scores": {"reverse": {"score": 0.5}}}
    with pytest.raises(FileNotFoundError, match="no val rollout records under"):
        read_rollouts(f"file://{tmp_path}/st", split="val")
    rec.flush()
    assert [n for n, _ in tracker.tables] == ["rollouts/eval_reverse.json", "rollouts/eval_tool_add.json",
                                              "rollouts/reverse.json"]
    assert tracker.traces == []  # (an eval sample logs no trace)
    off = Recorder(RecordConfig(every=10, sample=0), f"file://{tmp_path}/off", Tracker())
    assert off.record_eval(10, rows) is None and off.written == []


def test_a_version_1_file_without_the_split_column_reads_as_train(tmp_path):
    """Files written before `alloy.rollouts/2` have no `split` column: their rows read as "train", alone and beside
    version-2 files."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from training.rollout_records import to_parquet

    old = pa.schema([f for f in schema() if f.name not in ("split", "step_credit")],
                    metadata={"schema": "alloy.rollouts/1"})
    new = pq.read_table(io.BytesIO(to_parquet([row(3, 1), row(3, 2)])))
    folder = tmp_path / "s" / "rollouts"
    folder.mkdir(parents=True)
    pq.write_table(new.drop(["split", "step_credit"]).cast(old), folder / "step-000003.parquet")
    df = read_rollouts(str(tmp_path / "s"))
    assert list(df.columns) == schema().names and list(df.split) == ["train", "train"]
    assert df.step_credit.isna().all()  # /3's column: null (the whole reward at the end) in an older file
    assert list(df.sample_id) == ["s1", "s2"] and list(df.prompt_ids[0]) == [1, 2, 3]
    Recorder(RecordConfig(every=1, sample=4), str(tmp_path / "s")).record(4, [row(4, 5)], lambda r: r)
    assert list(read_rollouts(str(tmp_path / "s")).step) == [3, 3, 4]
    assert pq.read_schema(folder / "step-000004.parquet").metadata[b"schema"] == b"alloy.rollouts/3"
