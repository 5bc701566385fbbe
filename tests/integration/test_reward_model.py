"""The reward-model stage end to end on a tiny model (char tokenizer) and a synthetic preference set with an easy rule
(chosen responses end with "!", rejected ones do not): the trainer process (training/reward_main.py) through the
stage launcher reaches ≥ 0.9 held-out pair accuracy and commits a `final/` that
`AutoModelForSequenceClassification.from_pretrained` loads, scoring exactly what `reward_input_ids` renders; a rerun
with an ops-only change reuses it by fingerprint; a run stopped by SIGTERM resumes from its newest checkpoint and
ends where the uninterrupted run did; `alloy rm train` from flags (run again: reused, no MLflow run
opened); preference files from S3.

`ALLOY_TEST_RM_SEED` picks the seed of the data and the model's head (default 0)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from domains.preferences import load_preferences, reward_input_ids
from infra.config import load_config
from infra.storage import list_checkpoints, verify_checkpoint, write_bytes
from infra.tracking import NoopTracker
from tasks.context import RunContext
from tasks.prefixes import reward_model_prefix_of
from training.progress_events import PROGRESS_ENV, read_events
from training.reward_main import RM_FILE, WORKER

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("ALLOY_TEST_RM_SEED", "0"))
STEPS = 40
WORDS = "apple river stone cloud music paper light storm garden silver window tiger ocean pencil forest".split()


def pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def body() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))

    return [{"prompt": f"say something about {rng.choice(WORDS)} {i}", "chosen": body() + "!",
             "rejected": body() + rng.choice([".", "?", ""])} for i in range(n)]


def write_config(tmp_path: Path, init: str, **rm) -> Path:
    data = tmp_path / "prefs.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in pairs(300, SEED)))
    cfg = {"run": {"name": "rm", "root": str(tmp_path / "runs"), "seed": SEED}, "tracking": {"enabled": False},
           "domains": [{"name": "reverse"}],
           "reward_models": {"bang": {"data": str(data), "val_fraction": 0.2, "steps": STEPS, "max_length": 64,
                                      "init": init, "val_every": 20, "checkpoint_every": 10, "log_every": 10,
                                      "threads": 1, "train": {"lr": 0.003, "micro_batch_size": 8}, **rm}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def context(config: Path, overrides: list[str] = ()) -> RunContext:
    cfg = load_config(config, list(overrides))
    work = Path(cfg.run.root) / cfg.run.name / "work"
    work.mkdir(parents=True, exist_ok=True)
    return RunContext(cfg=cfg, config_path=str(config), overrides=list(overrides), work_dir=work,
                      storage_url=cfg.storage_url, tracker=NoopTracker(), parent_run_id=None, domains={})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """The stage's reward model, trained once (init: base, the tiny model standing in for the base)."""
    from tasks.reward_models import train_reward_model

    tmp = tmp_path_factory.mktemp("rm")
    ctx = context(write_config(tmp, "base"))
    t0 = time.perf_counter()
    summary = train_reward_model(ctx, "bang", tiny_model_dir)
    print(f"RM-SEED {SEED}: held-out pair accuracy {summary['val_accuracy']:.3f} on {summary['val_pairs']} pairs, "
          f"margin {summary['val_margin']:.3f}, history {[(v['step'], round(v['val_accuracy'], 3)) for v in summary['validation']]}, "
          f"{time.perf_counter() - t0:.1f} s")
    return tmp, ctx, summary


def test_the_reward_model_learns_the_rule_and_loads_as_a_classifier(trained):
    from transformers import AutoModelForSequenceClassification

    from infra.tokenizer import load_tokenizer

    tmp, ctx, summary = trained
    assert summary["val_accuracy"] >= 0.9 and summary["val_pairs"] >= 30 and summary["steps"] == STEPS
    assert [v["step"] for v in summary["validation"]] == [20, 40]
    final = summary["checkpoint"]
    assert final == reward_model_prefix_of(ctx.cfg, ctx.storage_url, "bang") + "/final" and verify_checkpoint(final)[0]
    local = Path(summary["local_dir"])
    card = json.loads((local / RM_FILE).read_text())
    assert card["render"]["function"] == "domains.preferences.reward_input_ids" and card["max_length"] == 64
    assert card["val_accuracy"] == summary["val_accuracy"] and card["pad_token_id"] == 0

    model = AutoModelForSequenceClassification.from_pretrained(str(local)).eval()
    tok = load_tokenizer(local)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    # fresh pairs the model never saw: the rule holds; a batch scores as each sequence alone (pad ignored)
    fresh = [(f"say something about {w} 9999", f"{w} river!", f"{w} river.") for w in WORDS]
    seqs = [reward_input_ids(tok, p, r, max_length=64) for p, c, rj in fresh for r in (c, rj)]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (T - len(s)) for s in seqs])
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, 0]
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-4)
    assert (batch[0::2] > batch[1::2]).float().mean() >= 0.9


def test_an_ops_change_reuses_the_checkpoint_and_a_training_change_moves_it(trained, monkeypatch):
    import tasks.reward_models as stage

    tmp, ctx, summary = trained
    monkeypatch.setattr(stage, "run_trainer", lambda *a, **k: pytest.fail("trained again instead of reusing"))
    ops = context(Path(ctx.config_path), ["reward_models.bang.log_every=3", "reward_models.bang.checkpoint_every=7",
                                          "reward_models.bang.threads=2"])
    again = stage.train_reward_model(ops, "bang", "/nonexistent-base")  # reused: the base is never read
    assert again["checkpoint"] == summary["checkpoint"] and again["val_accuracy"] == summary["val_accuracy"]
    assert again["reused"] is True and summary["reused"] is False
    # `alloy rm train` passes the base as a function that fetches it: a reused model never calls it
    lazy = stage.train_reward_model(ops, "bang", lambda: pytest.fail("fetched the base to reuse a reward model"))
    assert lazy["reused"] is True and lazy["checkpoint"] == summary["checkpoint"]
    prefix = reward_model_prefix_of(ctx.cfg, ctx.storage_url, "bang")
    for change in ("reward_models.bang.steps=41", "reward_models.bang.train.lr=0.002", "reward_models.bang.seed=7",
                   "reward_models.bang.val_fraction=0.3", "run.seed=5", "model.chat_template=none"):
        assert reward_model_prefix_of(load_config(ctx.config_path, [change]), ctx.storage_url, "bang") != prefix, change
    assert reward_model_prefix_of(load_config(ctx.config_path, ["base.steps=7"]), ctx.storage_url, "bang") != prefix
    data = Path(ctx.cfg.reward_models["bang"].data)
    data.write_text(data.read_text() + json.dumps({"prompt": "new", "chosen": "a!", "rejected": "a."}) + "\n")
    assert reward_model_prefix_of(load_config(ctx.config_path), ctx.storage_url, "bang") != prefix  # its content


def test_a_stopped_run_resumes_from_its_newest_checkpoint(trained, tiny_model_dir, tmp_path):
    """SIGTERM after step 12: the worker exits 128 + 15 leaving step-10 (no final/); the same command resumes from
    the newest checkpoint and ends where the stage's uninterrupted run (same settings) did."""
    _, ctx, summary = trained
    out = f"file://{tmp_path}/out"
    progress = tmp_path / "progress.jsonl"
    cmd = WORKER.argv(config=ctx.config_path, name="bang", init=tiny_model_dir, out=out,
                      result=tmp_path / "result.json", work_dir=tmp_path / "work")
    env = {**os.environ, PROGRESS_ENV: str(progress)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "log1", "wb"))
    deadline, offset, last = time.monotonic() + 120, 0, 0
    while last < 12 and proc.poll() is None and time.monotonic() < deadline:
        events, offset = read_events(progress, offset) if progress.exists() else ([], 0)
        last = max([last] + [e.step for e in events])
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, (tmp_path / "log1").read_text()[-3000:]
    done = [c.step for c in list_checkpoints(out) if c.complete]
    assert done and max(done) < STEPS and not verify_checkpoint(f"{out}/final")[0]

    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = json.loads((tmp_path / "result.json").read_text())
    assert resumed["resumed_from"] == f"{out}/step-{max(done):08d}"
    assert resumed["val_accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert resumed["val_margin"] == pytest.approx(summary["val_margin"], rel=1e-4)


def test_alloy_rm_train_from_flags(tiny_model_dir, tmp_path):
    data = tmp_path / "p.csv"
    import pandas as pd

    pd.DataFrame(pairs(120, SEED)).to_csv(data, index=False)
    argv = [sys.executable, "-m", "alloy.cli", "rm", "train", "--data", str(data), "--model", str(tiny_model_dir),
            "--out", str(tmp_path / "out"), "--steps", "3", "--max-length", "48", "--work-dir", str(tmp_path / "work"),
            "--name", "quick", "--set", "tracking.enabled=true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # the run root's own sqlite store
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint: file://{tmp_path}/out/final" in res.stdout and "reward model quick:" in res.stdout
    assert "reused" not in res.stdout
    assert (tmp_path / "work" / "rm-quick" / "rm-config.yaml").is_file()

    def runs() -> list[tuple[str, str]]:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
        exp = client.get_experiment_by_name(load_config(tmp_path / "work" / "rm-quick" / "rm-config.yaml",
                                                        ["tracking.enabled=true"]).tracking.experiment)
        return sorted((r.info.run_name, r.info.status) for r in client.search_runs([exp.experiment_id]))

    trained_runs = [("reward_model/quick", "FINISHED"), ("rm-quick", "FINISHED")]
    assert runs() == trained_runs  # trained: the parent and its child
    # again: the checkpoint is reused, says so, and opens no (empty) MLflow run
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                           env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reward model quick: reused" in again.stdout and f"checkpoint: file://{tmp_path}/out/final" in again.stdout
    assert runs() == trained_runs
    bad = subprocess.run([sys.executable, "-m", "alloy.cli", "rm", "train", "--data", str(data)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert bad.returncode == 2 and "--model, --out" in bad.stderr


def test_preference_files_read_from_s3(s3_bucket, tmp_path):
    rows = pairs(20, SEED)
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_bytes(f"{s3_bucket}/prefs/p.jsonl", body)
    (tmp_path / "p.jsonl").write_bytes(body)
    assert load_preferences(f"{s3_bucket}/prefs/p.jsonl") == load_preferences(str(tmp_path / "p.jsonl"))
