"""`alloy rollouts list | show | diff` over records written by the trainers' Recorder (training/rollout_records.py),
in a run folder with two trainers, and on a real S3-compatible server (moto's)."""
from __future__ import annotations

import json

import pytest

from alloy.cli import main
from infra.config import RecordConfig
from training.rollout_records import Recorder, RolloutRow

pytestmark = pytest.mark.unit


def row(stage: str, domain: str, step: int, i: int) -> RolloutRow:
    return RolloutRow(stage=stage, domain=domain, step=step, sample_id=f"{domain}-{i}", episode_id=f"{domain}-{i}",
                      weight_version=step - 1, staleness=i % 2, prompt=f"{domain}:{i}=", response=f"answer {i}\n42",
                      prompt_ids=[1, 2], output_ids=list(range(i + 1)), behaviour_logprobs=[-0.1] * (i + 1),
                      reward=i / 10, finish_reason="stop" if i % 3 else "length", blocked_calls=int(i == 4),
                      tool_calls=1)


def write_run(url: str) -> None:
    for prefix, stage, domain in (("specialist-reverse-0a1b2c", "specialist", "reverse"),
                                  ("student-3d4e5f", "student", "tool_add")):
        rec = Recorder(RecordConfig(every=0, full=True), f"{url}/{prefix}")
        for step in (10, 20):
            rec.record(step, range(6), lambda i, step=step: row(stage, domain, step, i),
                       sample_id=lambda i: f"{domain}-{i}")


def test_list_show_and_diff_a_run(tmp_path, capsys):
    write_run(f"file://{tmp_path}/run")
    assert main(["rollouts", "list", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["stage", "split", "domain", "steps", "recorded", "rows", "mean", "reward", "prefix"]
    assert [ln.split()[:7] for ln in out[1:]] == [["specialist", "train", "reverse", "10..20", "(2)", "12", "0.250"],
                                                 ["student", "train", "tool_add", "10..20", "(2)", "12", "0.250"]]

    assert main(["rollouts", "show", str(tmp_path / "run"), "--domain", "reverse", "--step", "20",
                 "--min-reward", "0.2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["sample_id"], r["reward"]) for r in rows] == \
        [(20, f"reverse-{i}", pytest.approx(i / 10)) for i in (2, 3, 4, 5)]
    assert rows[0]["response_tokens"] == 3 and rows[0]["response"] == "answer 2\n42"

    assert main(["rollouts", "show", str(tmp_path / "run"), "--blocked"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 5 and all(" 1 " in ln for ln in table[1:])  # 4 rows: step 10 and 20 of both trainers
    assert "answer 4⏎42" in table[1]  # newlines shown as ⏎ in a table row

    assert main(["rollouts", "show", str(tmp_path / "run"), "--stage", "student", "--limit", "1", "--long"]) == 0
    assert "response: answer 0\n42" in capsys.readouterr().out

    assert main(["rollouts", "diff", str(tmp_path / "run"), "--domain", "tool_add", "--steps", "10", "20",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["tool_add"]
    assert d["10"]["rows"] == 6 and d["10"]["finish"] == {"length": 2, "stop": 4} and d["10"]["blocked_calls"] == 1
    assert len(d["shared_prompts"]) == 6  # full records: every prompt is at both steps


def test_bad_input_exits_2_naming_what(tmp_path, capsys):
    write_run(f"file://{tmp_path}/run")
    assert main(["rollouts", "show", str(tmp_path / "run"), "--step", "15"]) == 2
    assert "--step 15: not recorded; recorded steps: [10, 20]" in capsys.readouterr().err
    assert main(["rollouts", "show", str(tmp_path / "run"), "--domain", "copy"]) == 2
    assert "--domain copy: no records of it; recorded domains: ['reverse', 'tool_add']" in capsys.readouterr().err
    assert main(["rollouts", "diff", str(tmp_path / "run"), "--steps", "10", "30"]) == 2
    assert "step 30 was not recorded" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["rollouts", "list", str(tmp_path / "empty")]) == 2
    assert "no rollout records under file://" in capsys.readouterr().err


def test_list_on_s3(s3_bucket, capsys):
    write_run(f"{s3_bucket}/run")
    assert main(["rollouts", "list", f"{s3_bucket}/run"]) == 0
    out = capsys.readouterr().out
    assert f"{s3_bucket}/run/specialist-reverse-0a1b2c" in out and f"{s3_bucket}/run/student-3d4e5f" in out


def eval_scores(step: int) -> dict:
    """What an evaluation at `step` kept of `tool_add` (`score_domains(keep=2)`): its first two prompts."""
    from domains.evaluate import DomainScores, EvalSample

    samples = [EvalSample(i, [ord(c) for c in f"q{i}"], [ord(c) for c in str(step + i)], "stop", 1.0 - i, 1.0 - i)
               for i in range(2)]
    return {"tool_add": DomainScores([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [False] * 3, samples=samples)}


def test_eval_samples_listed_shown_and_diffed_by_split(tmp_path, capsys):
    """An evaluation's sample (`Recorder.record_eval`: the same first prompts at every eval) beside the training
    records: `--split` keeps one kind of row, and `diff --split eval` puts the same prompts of two evals side by
    side; `diff` without it compares training steps."""
    from training.rollout_records import eval_rows

    url = f"file://{tmp_path}/run"
    write_run(url)
    rec = Recorder(RecordConfig(), f"{url}/student-3d4e5f")
    for step in (0, 20):
        rec.record_eval(step, eval_rows("student", step, step, eval_scores(step), lambda ids: "".join(map(chr, ids))))
    assert main(["rollouts", "list", str(tmp_path / "run"), "--split", "eval"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[:7] for ln in out[1:]] == [["student", "eval", "tool_add", "0..20", "(2)", "4", "0.500"]]
    assert main(["rollouts", "list", str(tmp_path / "run")]) == 0
    assert [ln.split()[:2] for ln in capsys.readouterr().out.splitlines()[1:]] == \
        [["specialist", "train"], ["student", "train"], ["student", "eval"]]

    assert main(["rollouts", "show", str(tmp_path / "run"), "--split", "eval", "--step", "20", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["split"], r["sample_id"], r["response"]) for r in rows] == \
        [("eval", "eval-tool_add-0", "20"), ("eval", "eval-tool_add-1", "21")]

    assert main(["rollouts", "diff", str(tmp_path / "run"), "--split", "eval", "--steps", "0", "20", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["tool_add"]
    assert d["0"]["rows"] == d["20"]["rows"] == 2
    assert d["shared_prompts"] == [{"prompt": "q0", "0": ["0"], "20": ["20"]},
                                   {"prompt": "q1", "0": ["1"], "20": ["21"]}]
    assert main(["rollouts", "diff", str(tmp_path / "run"), "--steps", "10", "20", "--json"]) == 0  # train's
    assert json.loads(capsys.readouterr().out)["tool_add"]["20"]["rows"] == 6
    assert main(["rollouts", "diff", str(tmp_path / "run"), "--steps", "0", "20"]) == 2
    assert "step 0 was not recorded (split train)" in capsys.readouterr().err
    assert main(["rollouts", "show", str(tmp_path / "run"), "--split", "val"]) == 2
    assert "--split val: no records of it" in capsys.readouterr().err
