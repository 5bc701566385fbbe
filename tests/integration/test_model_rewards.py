"""Model rewards against real servers on loopback (domains/model_reward.py):

- `ModelRewarder` on a reward model served by the embedded engine (a `LlamaForSequenceClassification` made here from
  the tiny Llama): its raw scores are HF's forward on `reward_input_ids` (1e-5), its training rewards the batch
  normalisation and length penalty of domains/reward_math.py on them, its evaluation scores σ(raw);
  `rewarders_of` builds it from a config's `reward:` section and a missing server is an error naming the setting;
- evaluation (`score_domains`) of a model-rewarded dataset domain: the score is its ground truth (`reward.truth`),
  the model's reward beside it;
- `JudgeRewarder` on the embedded engine serving the `qwen2_bpe_dir` chat model (format and errors, not quality):
  the rubric goes as the system message, the answers come back as text, a batch without a score is a RewardError
  that counts them; a judge URL that is a reward-model server is the server's 400;
- `serve_rewards` serving a judge's `reward.model` checkpoint for a block, its URL in the context's config and
  worker overrides, the server stopped after.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine_proc import EngineProc, make_reward_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    return make_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def rm_server(rm_dir, tmp_path_factory):
    proc = EngineProc(rm_dir, tmp_path_factory.mktemp("rm-log") / "server.log").start()
    yield proc.wait_healthy()
    proc.kill()


@pytest.fixture(scope="module")
def chat_server(qwen2_bpe_dir, tmp_path_factory):
    proc = EngineProc(qwen2_bpe_dir, tmp_path_factory.mktemp("judge-log") / "server.log").start()
    yield proc.wait_healthy()
    proc.kill()


@pytest.fixture(scope="module")
def polite(tmp_path_factory):
    """A small dataset domain config (rows `pol:<word>=`, answers with the sign-off for half), and its file."""
    d = tmp_path_factory.mktemp("polite")
    words = [f"{a}{b}{c}" for a in "abcdefgh" for b in "aeiou" for c in "xyz"]
    (d / "polite.jsonl").write_text("".join(json.dumps({"prompt": f"pol:{w}=", "answer": w + "!" * (i % 2)}) + "\n"
                                            for i, w in enumerate(words)))
    return d / "polite.jsonl"


def config(path, reward: dict):
    from infra.config import config_from_dict

    return config_from_dict({"model": {"preset": "tiny"},
                             "domains": [{"name": "polite", "dataset": {"path": str(path)}, "reward": reward}]},
                            check_model_path=False)


def load_domains(cfg) -> dict:
    """The config's one dataset domain (no split-size check: the file is small)."""
    from domains.registry import load_dataset_domain

    return {"polite": load_dataset_domain(cfg.domains[0], 0)}


def test_model_rewarder_scores_what_hf_scores(rm_server, rm_dir, polite):
    from transformers import AutoModelForSequenceClassification

    from domains.model_reward import ModelRewarder, RewardError, rewarders_of
    from domains.preferences import reward_input_ids
    from domains.reward_math import batch_normalized, length_penalized, sigmoid
    from infra.tokenizer import load_tokenizer

    tok = load_tokenizer(rm_dir)
    cfg = config(polite, {"kind": "model", "url": rm_server.url, "truth": "regex:[a-z]+!", "max_length": 24,
                          "length_penalty": 0.5})
    domain = load_domains(cfg)["polite"]
    rw = rewarders_of(cfg, {"polite": domain}, tok)["polite"]
    assert isinstance(rw, ModelRewarder) and rw.max_length == 24 and rw.normalize == "batch"
    exs = domain.split("train", 4, 0)
    responses = [ex.answer for ex in exs[:2]] + ["zzzzzzzzzzzzzzzzzzzzzzzzzzzz", "!"]
    lengths = [3, 4, 20, 1]
    batch = asyncio.run(rw.score(exs, responses, lengths, 20))
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    with torch.no_grad():
        want = [float(hf(input_ids=torch.tensor([reward_input_ids(tok, ex.prompt, r, "", "auto", 24)])).logits[0, 0])
                for ex, r in zip(exs, responses)]
    assert batch.raw == pytest.approx(want, abs=1e-5)
    assert batch.scores == pytest.approx([sigmoid(r) for r in want], abs=1e-6)
    assert batch.rewards == pytest.approx(length_penalized(batch_normalized(want), lengths, 20, 0.5), abs=1e-6)
    # no server handed over for a reward model the pipeline serves: the error names the setting
    served = config(polite, {"kind": "model", "url": rm_server.url}).model_copy()
    served.domains[0].reward = served.domains[0].reward.model_copy(update={"url": None, "reward_model": "x"})
    with pytest.raises(RewardError, match=r"domains\.0\.reward: the reward model 'x' is served by the pipeline"):
        rewarders_of(served, {"polite": domain}, tok)


def test_evaluation_reports_truth_and_reward(rm_server, tiny_model_dir, polite):
    from domains.evaluate import score_domains
    from domains.model_reward import rewarders_of
    from infra.models import load_model
    from infra.tokenizer import load_tokenizer

    cfg = config(polite, {"kind": "model", "url": rm_server.url, "truth": "regex:[a-z]+!"})
    domains = load_domains(cfg)
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    exs = domains["polite"].split("eval", 6, 0)
    out = score_domains(model, tok, domains, {"polite": exs}, 8, keep=2,
                        rewarders=rewarders_of(cfg, domains, tok))["polite"]
    assert len(out.reward) == 6 and all(0.0 < r < 1.0 for r in out.reward)
    assert out.clean == out.raw and all(c in (0.0, 1.0) for c in out.clean)  # the truth: a regex, 0 or 1
    row = out.row()
    assert row["reward_score"] == pytest.approx(sum(out.reward) / 6) and row["reward_unparseable"] == 0.0
    # without a truth, the score is the reward itself
    cfg2 = config(polite, {"kind": "model", "url": rm_server.url})
    d2 = load_domains(cfg2)
    out2 = score_domains(model, tok, d2, {"polite": exs}, 8, rewarders=rewarders_of(cfg2, d2, tok))["polite"]
    assert out2.clean == pytest.approx(out.reward, abs=1e-6)


def test_judge_format_and_errors(chat_server, rm_server, polite):
    from domains.model_reward import JudgeRewarder, RewardError, rewarders_of
    from engine.client import EngineRequestError

    cfg = config(polite, {"kind": "judge", "url": f"{chat_server.url}/v1", "rubric": "Is the answer polite?",
                          "scale": 5, "max_tokens": 8})
    domain = load_domains(cfg)["polite"]
    judge = rewarders_of(cfg, {"polite": domain}, None)["polite"]
    assert isinstance(judge, JudgeRewarder) and judge.scale == 5
    exs = domain.split("train", 3, 0)
    msgs = judge.messages(exs[0].prompt, "abc!")
    assert msgs[0] == {"role": "system", "content": "Is the answer polite?\nGrade the response. End your answer with "
                                                    "one line: Score: N/5 (N a whole number from 0 to 5)."}
    assert msgs[1]["role"] == "user" and f"Prompt:\n{exs[0].prompt}" in msgs[1]["content"] and \
        msgs[1]["content"].endswith("Response:\nabc!")
    answers = asyncio.run(judge.answers(exs, ["abc!", "abc", "x"]))
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    assert answers == asyncio.run(judge.answers(exs, ["abc!", "abc", "x"]))  # greedy: the same answers
    # an untrained tiny chat model writes no "Score: N/5": the batch fails, counting them, never a 0
    assert not any("score" in a.lower() for a in answers), answers
    with pytest.raises(RewardError, match=r"3 of 3 answers hold no score"):
        asyncio.run(judge.score(exs, ["abc!", "abc", "x"], [1, 1, 1], 8))
    # a reward-model server is no chat model: its 400 comes through
    wrong = JudgeRewarder(rm_server.url, "Is it polite?")
    with pytest.raises(EngineRequestError, match="400"):
        asyncio.run(wrong.score(exs[:1], ["abc!"], [1], 8))


def test_the_pipeline_serves_a_judge_checkpoint(qwen2_bpe_dir, polite, tmp_path):
    """`reward.model` (a chat checkpoint) served by tasks/reward_servers.py under a Supervisor for the block: the
    context's config and overrides carry its URL, the judge answers there, and the server is gone after."""
    from domains.model_reward import rewarders_of
    from engine.client import EngineClient
    from tasks.context import RunContext
    from tasks.reward_servers import serve_rewards

    cfg = config(polite, {"kind": "judge", "model": str(qwen2_bpe_dir), "rubric": "Is it polite?", "max_tokens": 4})
    ctx = RunContext(cfg=cfg, config_path="c.yaml", overrides=["x.y=1"], work_dir=tmp_path, storage_url="",
                     tracker=None, parent_run_id=None, domains=load_domains(cfg))
    with serve_rewards(ctx, {}) as rctx:
        url = rctx.cfg.domains[0].reward.served_url
        assert url and rctx.overrides == ["x.y=1", f"domains.0.reward.served_url={url}"]
        assert ctx.cfg.domains[0].reward.served_url is None  # the caller's config is left as it was
        judge = rewarders_of(rctx.cfg, rctx.domains, None)["polite"]
        exs = rctx.domains["polite"].split("train", 2, 0)
        assert len(asyncio.run(judge.answers(exs, ["abc!", "abc"]))) == 2

    async def healthy() -> bool:
        async with EngineClient(url, max_retries=0) as client:
            return await client.health()

    assert not asyncio.run(healthy())
