"""Compaction on a real engine server: `tool_long` episodes (6 files, ~70 tokens) rolled out by the specialists'
`Roller` with `specialists.max_context_tokens` = 80 and APRIL (2x over-sampling, cut partials resumed the next step)
come back as several sub-traces each, whose contexts are exactly what the engine sampled from (the trainer's
log-probs on the rows equal the rollout's), and one PPO update (`ppo_shard`, the trainer's batch path) runs on them.
The summaries are the policy's own (`compaction_summary: policy`, the default): after the env's `>compact⏎` the
model writes `#7;3;…⏎`, trained in its sub-trace; a malformed one falls back to the rules' `>notes:` line (counted).
"""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from distill_fixtures import sft_plain
from domains.base import Example
from domains.compaction import compacted_demonstration, compaction_counts, plan, tokenizer_summarizer
from domains.tools import COMPACT_REQUEST, trajectory_segments
from domains.registry import load_domain
from engine_proc import EngineProc
from infra.config import SpecialistsConfig
from training.deepspeed_backend import DeepSpeedBackend, TrainSettings
from engine.client import EngineClient
from infra.models import init_model_dir, load_model, load_tokenizer
from teachers.april import AprilBuffer
from teachers.compaction import expand
from teachers.critic import ValueModel
from teachers.ppo_step import build_batch, token_logprobs
from teachers.rollout import PromptCursor, Roller, rollout_step
from teachers.specialist import compaction_of, ppo_shard

pytestmark = pytest.mark.integration

MAX_CONTEXT = 80
EXTRA_BUDGET = 40  # the episode's budget also holds its requests and summaries


def tool_policy(root, dom, cfg):
    """A tiny model SFT-ed (40 steps) on compacted tool_long demonstrations (`compacted_demonstration`: the
    request untrained, the summary `#digits⏎` trained) and on their sub-traces (context → the rest of the
    episode), so it writes summaries and makes `!cat` calls also after one (or after a fallback `>notes:` line)."""
    init = init_model_dir("tiny", root / "init", seed=0)
    tok, summarize = load_tokenizer(init), tokenizer_summarizer(load_tokenizer(init))
    pairs = []
    for ex in dom.split("train", 200, seed=0):
        prompt = tok(ex.prompt).input_ids  # BOS + prompt (the char tokenizer: one char, one id)
        segs = compacted_demonstration(prompt, dom.intended_calls(ex), ex.answer, lambda n: dom.summary_of(ex, n),
                                       cfg, summarize)
        pairs.append((ex.prompt, segs))
        resp = "".join(t for t, _ in segs)
        mask = [int(trained) for t, trained in segs for _ in t]
        for sub in plan(prompt, tok(resp, add_special_tokens=False).input_ids, mask, cfg, summarize)[1:]:
            pairs.append((tok.decode(list(sub.context), skip_special_tokens=True),
                          trajectory_segments(resp[sub.start:])))
    return sft_plain(init, root / "policy", pairs, steps=40, batch=32)


async def two_steps(url: str, dom, tok, cfg):
    client = EngineClient(url)
    buffer, cursor = AprilBuffer(max_staleness=4), PromptCursor(dom, tok, 50, 0)
    out = []
    try:
        for version in range(2):
            roller = Roller(client, dom, tok, temperature=1.0, seed=7, compaction=cfg)
            samples, counters = await rollout_step(roller, buffer, cursor, batch_size=4, over_sampling=2.0,
                                                   max_new_tokens=dom.episode_chars + EXTRA_BUDGET,
                                                   version=version,
                                                   deterministic=True)
            out.append((samples, counters, roller))
    finally:
        await client.aclose()
    return out


def test_long_tool_episodes_compact_into_subtraces_and_train(tmp_path):
    torch.manual_seed(0)
    dom = load_domain("tool_long")
    sc = SpecialistsConfig(max_context_tokens=MAX_CONTEXT, compact_keep_last=1, compact_summary_tokens=12,
                           ppo_epochs=1)
    cfg = compaction_of(sc)
    assert cfg.summary == "policy"  # the default
    assert compaction_of(SpecialistsConfig()) is None  # off by default
    model_dir = tool_policy(tmp_path, dom, cfg)
    tok = load_tokenizer(model_dir)
    srv = EngineProc(model_dir, tmp_path / "engine.log").start().wait_healthy()
    try:
        steps = asyncio.run(two_steps(srv.url, dom, tok, cfg))
    finally:
        srv.kill()
    samples = [s for got, _, _ in steps for s in got]
    roller = steps[-1][2]
    counters = [c for _, c, _ in steps]
    assert sum(c["partials"] for c in counters) > 0 and counters[1]["resumed"] > 0, counters  # APRIL cut, resumed
    rewards = [dom.verify(Example(**s.example), roller.text(s.output_ids)) for s in samples]
    rows, row_rewards = expand(samples, rewards, cfg, roller.summarize)
    per_episode = {s.sample_id: sum(r.rollout_id == s.sample_id for r in rows) for s in samples}
    made = [s.made_by for x in samples for s in plan(x.prompt_ids, x.output_ids, x.loss_mask, cfg, roller.summarize)]
    counted = {k: sum(compaction_counts(plan(x.prompt_ids, x.output_ids, x.loss_mask, cfg, roller.summarize))[k]
                      for x in samples) for k in ("events", "fallbacks")}
    print("SUBTRACES", per_episode, "rewards", rewards, "COMPACTIONS", counted, "by", made)
    assert made.count("policy") >= 1, made  # the policy wrote a summary that became the next context
    assert max(per_episode.values()) >= 3 and sum(n > 1 for n in per_episode.values()) >= 2
    # a partial cut at version 0 and finished at version 1 was compacted too, and resumed from the same context
    assert any(per_episode[s.sample_id] > 1 and set(s.token_versions) == {0, 1} for s in samples)
    by_id = {s.sample_id: s for s in samples}
    for r in rows:  # a model token was sampled with at most MAX_CONTEXT tokens in view
        last_model = max(i for i, m in enumerate(r.loss_mask) if m)
        assert len(r.prompt_ids) + last_model + 1 <= MAX_CONTEXT, r.sample_id
        episode = by_id[r.rollout_id]
        if r.sample_id == r.rollout_id:  # sub-trace 0 keeps the episode's id (domains.compaction.subtrace_id)
            assert r.prompt_ids == episode.prompt_ids  # the first sub-trace starts from the episode's prompt
        else:  # a compacted context: the prompt, then the kept turn + request + the policy's summary, or the notes
            assert r.prompt_ids[:len(episode.prompt_ids)] == episode.prompt_ids
            rest = tok.decode(r.prompt_ids[len(episode.prompt_ids):])
            policy = COMPACT_REQUEST + "#" in rest and rest.endswith("\n") and rest.split("\n")[-2].startswith("#")
            assert policy or rest.startswith(">notes: "), rest
    summary_rows = [r for r in rows if tok.decode(r.output_ids).split(COMPACT_REQUEST)[-1].startswith("#")
                    and COMPACT_REQUEST in tok.decode(r.output_ids)]
    assert summary_rows and all(r.loss_mask[-1] == 1 for r in summary_rows)  # a summary trains at its row's end
    # every model token of every episode is trained exactly once, in one row
    assert sum(sum(r.loss_mask) for r in rows) == sum(sum(s.loss_mask) for s in samples)
    reward_of = dict(zip(by_id, rewards))
    assert row_rewards == [reward_of[r.rollout_id] for r in rows]

    policy = DeepSpeedBackend(load_model(model_dir), TrainSettings(lr=1e-3, micro_batch_size=64, seed=0))
    critic = DeepSpeedBackend(ValueModel.from_pretrained(model_dir), TrainSettings(lr=1e-3, micro_batch_size=64,
                                                                                   seed=0))
    try:
        # the rows' contexts are what the engine sampled from: the trainer's log-probs match the rollout's
        batch = build_batch(rows, tok.pad_token_id, row_rewards)
        with torch.no_grad():
            lp = token_logprobs(policy.module, batch, 1.0)
        diff = ((lp - batch.rollout_logprobs) * batch.mask).abs().max().item()
        assert diff < 1e-3, diff
        m = ppo_shard(sc, tok.pad_token_id, policy, critic, None, rows, row_rewards, version=1, critic_only=False)
        assert m["num_tokens"] == batch.num_tokens and all(math.isfinite(m[k]) for k in ("pg_loss", "vf_loss"))
        assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    finally:
        policy.close()
        critic.close()
