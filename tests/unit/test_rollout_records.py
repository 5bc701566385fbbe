"""Rollout records (training/rollout_records.py): which steps and rows are written, the Parquet schema, reading them
back from local storage and from a real S3-compatible server (moto's), and a failed write that does not stop
training."""
from __future__ import annotations

import logging

import pytest

from infra.config import RecordConfig
from training.rollout_records import (SCHEMA_VERSION, Recorder, RolloutRow, pick_sample, read_rollouts, schema,
                                      step_url)

pytestmark = pytest.mark.unit


class Tracker:
    """Collects what `log_table` is given (the Recorder's only call on a tracker)."""

    def __init__(self):
        self.tables: list[tuple[str, list[dict]]] = []

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
    # the MLflow table: one artifact per domain, the sample's text columns, appended per recorded step
    assert [name for name, _ in tracker.tables] == ["rollouts/reverse.json"] * 3
    assert set(tracker.tables[0][1][0]) == {"step", "domain", "sample_id", "staleness", "reward", "finish_reason",
                                            "blocked_calls", "tool_calls", "prompt", "response"}


def test_full_records_every_row_of_every_step(tmp_path):
    rec = Recorder(RecordConfig(every=0, sample=2, full=True), str(tmp_path / "s"), Tracker())
    for step in (1, 2):
        rec.record(step, range(6), lambda i, step=step: row(step, i, "reverse" if i < 3 else "copy"),
                   sample_id=lambda i: f"s{i}")
    df = read_rollouts(str(tmp_path / "s"))
    assert len(df) == 12 and sorted(set(df.domain)) == ["copy", "reverse"]
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
