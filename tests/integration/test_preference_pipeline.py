"""`configs/preference.yaml` end to end, shrunk to a few steps per stage (~1 min on 2 cores): the data from
scripts/make_preference_pairs.py, the reward model trained after the base, served for the specialists and every
evaluation (tasks/reward_servers.py), the `polite` specialist trained on its reward, and the report holding both the
ground truth (the stage columns) and the reward model's score (`reward`) for every stage. What is checked is the
wiring; learning is what docs/results.md's runs of the full config measure."""
import json

import pytest

from preference_fixtures import CONFIG, make_pairs

pytestmark = pytest.mark.integration

FAST = ["base.steps=20", "base.n_train_per_domain=500", "specialists.n_prompts=500",
        "distill.n_prompts_per_domain=500", "reward_models.polite.steps=10", "reward_models.polite.val_every=5",
        "specialists.steps=3", "specialists.val_every=3", "specialists.val_n=16", "specialists.eval_n=16",
        "specialists.checkpoint_every=3", "specialists.batch_size=16", "distill.steps=2", "distill.eval_every=0",
        "distill.batch_size=16", "distill.checkpoint_every=2", "eval.n_eval=16", "tracking.enabled=false"]


def test_preference_example_reports_truth_and_reward(tmp_path, prefect_harness):
    from flows.pipeline import pipeline

    data = tmp_path / "data"
    make_pairs(data)
    again = tmp_path / "again"
    make_pairs(again)  # deterministic from the seed
    for name in ("polite.jsonl", "pairs.jsonl", "pairs_long.jsonl"):
        assert (data / name).read_bytes() == (again / name).read_bytes(), name
    out = tmp_path / "report.json"
    pipeline(config=CONFIG, report_path=str(out), overrides=FAST + [
        f"run.root={tmp_path}/runs", f"domains.0.dataset.path={data / 'polite.jsonl'}",
        f"reward_models.polite.data={data / 'pairs.jsonl'}"])
    report = json.loads(out.read_text())
    polite = report["domains"]["polite"]
    for stage in ("base", "specialist", "student"):
        assert polite[stage] in [k / 16 for k in range(17)], stage  # the regex truth: 0/1 per example
        assert 0.0 < polite["reward"][stage] < 1.0, stage  # the reward model's mean σ(score)
        assert polite["reward_unparseable"][stage] == 0.0
    for dom in ("reverse", "case_swap"):  # verifier domains: no model reward
        assert report["domains"][dom]["reward"] is None
    rm = report["artifacts"]["reward_models"]["polite"]
    assert rm["checkpoint"].endswith("/final") and 0.0 <= rm["val_accuracy"] <= 1.0
