"""The OPD student samples full tool episodes through a real embedded engine server (issue 23, item 2).

A tiny model SFT-ed briefly on `tool_add` demonstrations (`!calc a+b⏎>sum⏎sum`) and on `addition` answers is served
by `python -m engine.server`; `student.sampler.sample_batch` samples a mixed batch. What must show: a tool
episode that made a call holds the guarded env's tool output (the specialists' env: shortcut planted, a rule guard;
tests/integration/test_student_guard.py has the blocked hack) as tokens in its sequence with loss mask 0 (the model's
tokens 1, rollout log-prob 0 on the env's), plain samples have no mask; the teacher (here the same server) scores the
whole sequence; `collate` puts the mask where the OPD losses read it. With a compaction window the episodes are
sampled from compacted contexts and split into sub-trace samples (`~k`, a `>notes: …` context) the teacher scores.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distill_fixtures import sft_plain
from domains.compaction import Compaction
from domains.evaluate import episode_budget
from domains.guard import Guard
from domains.registry import load_domain
from domains.tools import ToolEnv, parse_tool_call
from engine_proc import EngineProc
from infra.chat import PromptRenderer
from engine.client import EngineClient
from infra.models import init_model_dir, load_tokenizer
from student.batch import collate
from student.sampler import PromptStream, sample_batch, split_subtraces
from student.scoring import TeacherScorer

pytestmark = pytest.mark.integration
WINDOW = Compaction(max_context_tokens=32, keep_last=0)  # a tool_add episode (~13 + 25 tokens) outgrows it


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny model that has seen the tool trajectory format (plus plain addition answers)."""
    root = tmp_path_factory.mktemp("student-tools")
    tools, add = load_domain("tool_add"), load_domain("addition")
    pairs = [(e.prompt, tools.tool_demonstration(e)[len(e.prompt):]) for e in tools.split("train", 300, 0)]
    pairs += [(e.prompt, e.answer) for e in add.split("train", 50, 0)]
    # 40 small steps: about half the sampled episodes (temperature 1) start with a well-formed call, enough here
    return sft_plain(init_model_dir("tiny", root / "init", seed=0), root / "sft", pairs, steps=40, batch=32)


@pytest.fixture()
def server(tool_model, tmp_path):
    proc = EngineProc(tool_model, tmp_path / "engine.log").start().wait_healthy()
    yield proc
    proc.kill()


def env_line_for(command: str, example) -> str:
    """What a fresh student env answers to `command` (the line the episode must hold as tool output)."""
    async def run():
        with ToolEnv(example, guard=Guard()) as env:
            return await env.execute(command)
    return asyncio.run(run())


def first_tool_output(tok, s) -> str | None:
    """Check the first tool output of episode `s` (None if it made no call): it follows a tool-call line the model
    wrote (mask 1), it is the student env's own answer to that call, as tokens with mask 0 and rollout log-prob 0."""
    L = len(s.output_ids)
    assert len(s.loss_mask) == len(s.rollout_logprobs) == L
    mask = np.asarray(s.loss_mask)
    if mask.all():
        return None
    first_env = int(np.argmin(mask))
    n_env = int(np.argmax(mask[first_env:])) if mask[first_env:].any() else L - first_env
    model_part = tok.decode(s.output_ids[:first_env])
    command = parse_tool_call(model_part)
    assert command is not None, f"{s.sample_id}: tool output follows {model_part!r}, not a tool call line"
    env_text = tok.decode(s.output_ids[first_env:first_env + n_env])
    assert env_text.startswith(">") and env_text == env_line_for(command, s.example)[:n_env], (s.sample_id, env_text)
    assert all(lp == 0.0 for lp in s.rollout_logprobs[first_env:first_env + n_env])
    assert mask[:first_env].all() and s.model_tokens == L - int((mask == 0).sum())
    return env_text


def test_student_samples_tool_episodes_with_masked_tool_output(tool_model, server):
    tok = load_tokenizer(tool_model)
    domains = {"tool_add": load_domain("tool_add"), "addition": load_domain("addition")}
    stops = PromptRenderer(tok).stop_ids()
    budgets = {"tool_add": episode_budget(domains["tool_add"], 8), "addition": 8}
    items = PromptStream(domains, tok, n_per_domain=32, seed=0).take(24)
    client = EngineClient(server.url)

    async def run():
        try:
            kw = dict(max_new_tokens=budgets, eos_id=stops, expected_version=0, sampling_seed=7, domains=domains,
                      tokenizer=tok, guards={"tool_add": Guard()})
            samples = await sample_batch(client, items, temperature=1.0, **kw)
            cold = await sample_batch(client, items, temperature=0.3, **kw)  # well-formed calls: real calc outputs
            scorer = TeacherScorer({d: client for d in domains}, top_k=4, batch_size=24, vocab_size=len(tok))
            scored, dropped = await scorer.score(samples)
            # compaction (the specialists' max_context_tokens): turns generated from the compacted context, then
            # each sub-trace a sample of its own, scored by the teacher on its own context
            compacted = split_subtraces(await sample_batch(client, items, temperature=0.3, compaction=WINDOW, **kw),
                                        WINDOW, tok)
            subs_scored, subs_dropped = await scorer.score(compacted)
            return samples, cold, scored, dropped, compacted, subs_scored, subs_dropped
        finally:
            await client.aclose()

    samples, cold, scored, dropped, compacted, subs_scored, subs_dropped = asyncio.run(run())
    assert [s.sample_id for s in samples] == [it.sample_id for it in items] and not dropped and len(scored) == 24
    plain = [s for s in samples if s.domain == "addition"]
    episodes = [s for s in samples if s.domain == "tool_add"]
    assert len(plain) == len(episodes) == 12
    assert all(s.loss_mask is None and s.model_tokens == len(s.output_ids) for s in plain)
    assert all(len(s.output_ids) <= budgets["tool_add"] for s in episodes + cold)
    outputs = [first_tool_output(tok, s) for s in episodes]
    called = sum(o is not None for o in outputs)
    assert called >= 3, f"only {called} of 12 tool episodes made a call: the fixture model did not learn the format"
    cold_outputs = [first_tool_output(tok, s) for s in cold if s.domain == "tool_add"]
    ran = [o for o in cold_outputs if o is not None and o != ">error\n"]
    assert len(ran) >= 2 and all(o[1:].strip().isdigit() for o in ran), cold_outputs  # calc ran in the sandbox

    # the teacher scored the whole sequence; the student's tokens count, the tool output does not
    by_id = {s.sample_id: s for s in scored}
    for s in episodes:
        t = np.asarray(by_id[s.sample_id].teacher_logprobs)
        assert t.shape == (len(s.output_ids),) and np.isfinite(t).all()
        m = np.asarray(s.loss_mask, dtype=bool)
        # the teacher here is the student's own server: on the student's tokens it agrees with the rollout
        assert np.abs(t[m] - np.asarray(s.rollout_logprobs)[m]).max() < 0.05
    for rows in (scored, subs_scored):
        batch = collate(rows, tok.pad_token_id, version=0, with_topk=True)
        for b, s in enumerate(rows):
            P, L = len(s.prompt_ids), len(s.output_ids)
            want = np.ones(L) if s.loss_mask is None else np.asarray(s.loss_mask)
            assert batch.mask[b, P - 1:P - 1 + L].numpy().tolist() == want.tolist()
            assert float(batch.mask[b].sum()) == s.model_tokens

    # compacted episodes: sub-traces `<id>~k` on a `>notes: …` context, each model token within the window
    assert not subs_dropped and len(subs_scored) == len(compacted)
    later = [s for s in compacted if s.sample_id != s.episode]
    assert later, "no tool episode outgrew the 32-token window"
    for s in later:
        assert s.sample_id.startswith(s.episode + "~") and s.episode in {x.sample_id for x in compacted}
        assert tok.decode(s.prompt_ids, skip_special_tokens=True).startswith(s.example.prompt + ">notes: ")
    for s in compacted:
        if s.loss_mask is not None and any(s.loss_mask):
            last_model = max(j for j, m in enumerate(s.loss_mask) if m)
            assert len(s.prompt_ids) + last_model + 1 <= WINDOW.max_context_tokens, s.sample_id
