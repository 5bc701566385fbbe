"""The wiring of model rewards without servers: which checkpoints the pipeline serves and how their URLs reach the
config (tasks/reward_servers.py), the prefixes a reward model keys (tasks/prefixes.py), the specialist's selection
reward (teachers/specialist.py), and the report's reward columns (infra/report.py)."""
import pandas as pd
import pytest

from infra.config import ConfigError, config_from_dict
from preference_fixtures import tiny_reward_files

pytestmark = pytest.mark.unit


@pytest.fixture()
def data(tmp_path):
    return tiny_reward_files(tmp_path, "pol:{i}=")


def cfg_of(data, reward: dict, **rm):
    rows, pairs = data
    return config_from_dict({"domains": [{"name": "polite", "dataset": {"path": str(rows)}, "reward": reward},
                                         {"name": "reverse"}],
                             "reward_models": {"pol": {"data": str(pairs), **rm}}})


def test_served_checkpoints_and_their_urls(data, tmp_path):
    from tasks.reward_servers import reward_checkpoints, with_served

    cfg = cfg_of(data, {"kind": "model", "reward_model": "pol"})
    assert reward_checkpoints(cfg, {"pol": {"local_dir": str(tmp_path)}}) == {0: ("rm-pol", tmp_path)}
    with pytest.raises(ConfigError, match=r"domains\.0\.reward\.reward_model: reward model 'pol' was not trained"):
        reward_checkpoints(cfg, {})
    served = with_served(cfg, {0: "http://127.0.0.1:5"})
    assert served.domains[0].reward.served_url == "http://127.0.0.1:5" and cfg.domains[0].reward.served_url is None
    assert reward_checkpoints(served, {}) == {}  # served already: nothing more to start
    assert served.fingerprint() == cfg.fingerprint()  # an ops field: no prefix moves with the port
    judge = cfg_of(data, {"kind": "judge", "model": str(tmp_path / "nope"), "rubric": "polite?"})
    with pytest.raises(ConfigError, match=r"domains\.0\.reward\.model: .* is not a model checkpoint directory"):
        reward_checkpoints(judge, {})
    external = cfg_of(data, {"kind": "model", "url": "http://rm:30000"})
    assert reward_checkpoints(external, {}) == {}


def test_a_reward_model_keys_its_specialist_and_the_student(data):
    from tasks.prefixes import specialist_prefix_of, student_prefix_of

    a = cfg_of(data, {"kind": "model", "reward_model": "pol"})
    b = cfg_of(data, {"kind": "model", "reward_model": "pol"}, steps=7)  # another reward model
    assert specialist_prefix_of(a, "s", "polite") != specialist_prefix_of(b, "s", "polite")
    assert specialist_prefix_of(a, "s", "reverse") == specialist_prefix_of(b, "s", "reverse")
    assert student_prefix_of(a, "s") != student_prefix_of(b, "s")


def test_selection_reads_the_model_reward_never_the_truth():
    from domains.evaluate import DomainScores
    from teachers.specialist import selection_rewards

    truth_only = DomainScores([1.0, 0.0], [1.0, 0.0], [False, False])
    assert selection_rewards(truth_only) == [1.0, 0.0]
    rewarded = DomainScores([1.0, 0.0], [1.0, 0.0], [False, False], reward=[0.2, None], unparseable=1)
    assert selection_rewards(rewarded) == [0.2, 0.2]
    row = rewarded.row()
    assert row["reward_score"] == 0.2 and row["reward_unparseable"] == 1.0 and row["score"] == 0.5


def test_the_report_has_reward_columns_for_rewarded_domains_only():
    from infra.report import build_report, render_table, report_problems

    rows = [("polite", "base", 0.2, 0.3), ("polite", "specialist", 0.9, 0.95), ("polite", "student", 0.85, 0.9),
            ("reverse", "base", 0.5, None), ("reverse", "specialist", 0.7, None), ("reverse", "student", 0.7, None)]
    df = pd.DataFrame([{"domain": d, "stage": st, "score": s, "n_eval": 10, "raw_score": s,
                        "hacks_per_100": float("nan"), "reward_score": r,
                        "reward_unparseable": 0.0 if r is not None else None} for d, st, s, r in rows])
    rep = build_report(config="c", run_id="r", mlflow={}, scores=df, domains=["polite", "reverse"])
    assert rep["domains"]["polite"]["reward"] == {"base": 0.3, "specialist": 0.95, "student": 0.9}
    assert rep["domains"]["polite"]["recovery"] == pytest.approx(0.85 / 0.9, abs=1e-6)  # on the truth
    assert rep["domains"]["reverse"]["reward"] is None and report_problems(rep) == []
    table = render_table(rep)
    assert "model-rewarded domains" in table and "0.300" in table.split("model-rewarded")[1]
