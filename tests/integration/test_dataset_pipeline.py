"""Real checkpoints and real data end to end: `configs/dataset-example.yaml` (a JSONL and a Parquet dataset of
multi-line Unicode prompts, the `numeric` and `choice` verifiers) on a Qwen2 checkpoint with a locally trained
byte-level BPE tokenizer and its ChatML template, through base → specialists → teachers → distill → eval → report;
with `run.storage` and both datasets on the moto S3 server. One pipeline run (a module fixture) serves both tests:
the report and the student's model and tokenizer, and the S3 artifacts (reading the datasets from local files is
tested in tests/unit/test_dataset_domain.py). Shrunk to a few steps per stage: what is checked is that every stage
runs on such a model and such data and the report is complete (learning is tested elsewhere)."""
import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from infra.storage import load_checkpoint, verify_checkpoint, write_bytes
from s3_fixtures import point_env_at

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "configs" / "dataset-example.yaml")
FAST = ["base.steps=12", "base.n_train_per_domain=200", "eval.n_eval=10", "specialists.steps=2",
        "specialists.batch_size=8", "specialists.checkpoint_every=2", "specialists.critic_warmup_steps=1",
        "specialists.val_n=8", "specialists.eval_n=10", "specialists.n_prompts=200", "distill.n_prompts_per_domain=200", "distill.steps=2", "distill.batch_size=8", "distill.eval_every=0",
        "tracking.enabled=false"]
ROWS = 1200  # per dataset: ~880 train, ~60 val, ~240 eval rows


def make_datasets(out: Path) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("make_datasets", ROOT / "scripts" / "make_datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_datasets(out, rows=ROWS)


def check_report(report: dict, model_dir: Path) -> None:
    assert set(report["domains"]) == {"wordmath", "quiz"}
    for dom, row in report["domains"].items():
        assert row["n_eval"] == 10, dom
        for stage in ("base", "specialist", "student"):
            assert 0.0 <= row[stage] <= 1.0, (dom, stage)
    s = report["summary"]
    assert s["n_domains"] == 2 and s["n_teachers"] == 2 and s["student_mean"] is not None
    assert report["throughput"]["teacher_scored_tokens_per_s"] > 0
    assert report["artifacts"]["student_checkpoint"].endswith("/final")


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, prefect_harness, qwen2_bpe_dir, moto_server):
    """The example pipeline once, on the Qwen2 + BPE checkpoint, both datasets read from S3, `run.storage` on S3
    (the S3 environment stays set for the module's tests, which read the student back)."""
    with pytest.MonkeyPatch.context() as mp:
        point_env_at(moto_server, mp)
        yield run_on_s3(tmp_path_factory.mktemp("dataset-pipeline"), qwen2_bpe_dir,
                        f"s3://{moto_server.create_bucket()}")


def run_on_s3(tmp_path: Path, qwen2_bpe_dir: Path, bucket: str) -> dict:
    from flows.pipeline import pipeline

    data = make_datasets(tmp_path / "data")
    urls = {}
    for name in ("wordmath", "quiz"):
        urls[name] = f"{bucket}/datasets/{data[name].name}"
        write_bytes(urls[name], data[name].read_bytes())
    storage = f"{bucket}/alloy"
    out = tmp_path / "report.json"
    pipeline(config=EXAMPLE, report_path=str(out), overrides=FAST + [
        f"run.root={tmp_path}/runs", f"run.storage={storage}", f"model.path={qwen2_bpe_dir}",
        f"domains.0.dataset.path={urls['wordmath']}", f"domains.1.dataset.path={urls['quiz']}"])
    return {"report": json.loads(out.read_text()), "storage": storage, "tmp": tmp_path}


def test_dataset_example_on_qwen2_bpe(s3_run, qwen2_bpe_dir):
    report = s3_run["report"]
    check_report(report, qwen2_bpe_dir)
    # the student is a Qwen2 with the same BPE tokenizer and chat template as the checkpoint it started from
    student = s3_run["tmp"] / "student"
    load_checkpoint(report["artifacts"]["student_checkpoint"], student)
    assert json.loads((student / "config.json").read_text())["model_type"] == "qwen2"
    tok, base_tok = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(str(qwen2_bpe_dir))
    text = "Zoë had 3 €.\nHow many?"
    assert tok(text).input_ids == base_tok(text).input_ids and tok.chat_template == base_tok.chat_template


def test_dataset_example_on_s3(s3_run, qwen2_bpe_dir):
    report = s3_run["report"]
    check_report(report, qwen2_bpe_dir)
    assert report["artifacts"]["student_checkpoint"].startswith(s3_run["storage"])
    assert verify_checkpoint(report["artifacts"]["student_checkpoint"])[0]
