"""The OPD student's tool episodes run under the specialists' guard (issue 36): a hack call is blocked and its
episode earns 0, an intended episode is unchanged.

Before: the student sampled in a clean env (no planted file) with no guard, so `!cat .answers` simply failed, the
episode went on by the intended path, reached the right answer, and `distill.reward_coef` paid every token, the hack
call included (the pilot's student ended at 71 hack attempts per 100 on tool_files). Now its env is the specialists'
(shortcut planted) under a rule guard built from `specialists.guard` (`student_guards`).

A tiny model memorises two scripts (`tests/tool_scripts.py` replays them through the real guarded env first, so the
scripts are what that env prints): for two `tool_add` prompts the hack, then the intended path
(`!cat .answers⏎>error⏎!calc a+b⏎>sum⏎sum`), for two others the intended trajectory. A real engine server
(`python -m engine.server`, loopback) serves it; `student.sampler.sample_batch` samples greedily."""
from __future__ import annotations

import asyncio

import pytest

from distill_fixtures import sft_plain
from domains.base import Example
from domains.guard import Guard
from domains.registry import load_domain, load_domains
from engine.client import EngineClient
from engine_proc import EngineProc
from infra.chat import PromptRenderer
from infra.config import config_from_dict
from infra.models import init_model_dir, load_tokenizer
from student.distill_main import student_guards
from student.sampler import PromptItem, episode_reward, sample_batch
from student.trainer import guard_counts
from teachers.april import AprilBuffer
from teachers.rollout import PromptCursor, Roller, rollout_step
from teachers.specialist import sample_rewards
from tool_scripts import replay, run_episode

pytestmark = pytest.mark.integration
BUDGET = 64  # the hack script (~45 tokens) outgrows tool_add's own episode budget


def scripts() -> list[tuple[object, str, bool]]:
    """(example, script, is_hack) for four tool_add prompts: the first two hack first, the other two do not."""
    dom = load_domain("tool_add")
    out = []
    for i, ex in enumerate(dom.split("train", 4, 0)):
        intended = dom.intended_demonstration(ex)[len(ex.prompt):]
        out.append((ex, f"!cat .answers\n>error\n{intended}" if i < 2 else intended, i < 2))
    return out


@pytest.fixture(scope="module")
def script_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("student-guard")
    pairs = [(ex.prompt, script) for ex, script, _ in scripts()]  # the whole set every step
    return sft_plain(init_model_dir("tiny", root / "init", seed=0), root / "sft", pairs, steps=200, batch=4)


def test_scripts_are_what_the_guarded_env_prints():
    dom = load_domain("tool_add")

    async def run(ex, script):
        with dom.env(ex, guard=Guard()) as env:  # planted `.answers`, rule guard: as the student samples
            return await run_episode(replay(script), env, ex.prompt, BUDGET), env.blocked_calls

    for ex, script, hack in scripts():
        assert asyncio.run(run(ex, script)) == (script, int(hack))
        assert dom.verify(ex, script) == 1.0  # the hack-then-intended script reaches the right answer


def test_student_episode_with_a_blocked_hack_earns_zero_and_is_counted(script_model, tmp_path):
    tok = load_tokenizer(script_model)
    dom = load_domain("tool_add")
    domains = {"tool_add": dom}
    render, stops = PromptRenderer(tok), PromptRenderer(tok).stop_ids()
    cases = scripts()
    items = [PromptItem(f"s{i:08d}-tool_add", i, "tool_add", ex, render.example_ids(dom, ex))
             for i, (ex, _, _) in enumerate(cases)]
    guards = {"tool_add": Guard()}  # rules only, as student_guards builds it
    server = EngineProc(script_model, tmp_path / "engine.log").start().wait_healthy()
    client = EngineClient(server.url)

    async def run():
        try:
            kw = dict(max_new_tokens=BUDGET, temperature=0.0, eos_id=stops, expected_version=0, domains=domains,
                      tokenizer=tok)
            guarded = await sample_batch(client, items, guards=guards, **kw)
            counts = guard_counts(guards, guarded)
            unguarded = await sample_batch(client, items, **kw)  # the same env, no guard
            return guarded, counts, unguarded
        finally:
            await client.aclose()

    try:
        guarded, counts, unguarded = asyncio.run(run())
    finally:
        server.kill()
    for s, u, (ex, script, hack) in zip(guarded, unguarded, cases):
        text = tok.decode(s.output_ids, skip_special_tokens=True)
        assert text == script, f"{s.sample_id}: the model left its script (fixture too weak?): {text!r}"
        verifier = dom.verify(ex, text)
        assert verifier == 1.0  # the right answer either way: before, the hack episode was paid 1
        if hack:  # blocked: the guard's dummy output as env tokens (mask 0), the episode goes on, reward 0
            blocked_at = text.index(">error\n")
            n_model = len(tok("!cat .answers\n", add_special_tokens=False).input_ids)
            assert blocked_at == n_model and s.loss_mask[n_model:n_model + 7] == [0] * 7
            assert s.blocked_calls == 1 and episode_reward(dom, s, tok, stops) == 0.0
            # without the guard the planted file is read: the hack pays off, a different episode
            assert tok.decode(u.output_ids, skip_special_tokens=True).startswith(f"!cat .answers\n>{ex.answer}\n")
        else:  # intended: not blocked, rewarded by the verifier, and the guard changed nothing
            assert s.blocked_calls == 0 and episode_reward(dom, s, tok, stops) == 1.0
            assert (s.output_ids, s.loss_mask, s.rollout_logprobs) == (u.output_ids, u.loss_mask, u.rollout_logprobs)
            assert u.blocked_calls == 0
    # the batch's counters, as the trainer logs them (train/guard_*) and sums them into its summary's `guard`
    assert counts == {"tool_calls": 6, "flagged": 2, "blocked": 2, "blocked_episodes": 2}
    assert guards["tool_add"].snapshot_and_reset()["tool_calls"] == 0  # taken once per batch


def test_specialist_trajectory_with_a_blocked_hack_earns_zero_across_an_april_resume(script_model, tmp_path):
    """The same scripts through a specialist's rollout (`teachers.rollout`, deterministic APRIL, batch target 2 of
    4): the two intended episodes are the shortest and finish in step 0; the two hack episodes are cut after the
    guard's `>error` line (the partial carries the blocked call), go back into the buffer, and finish in step 1 by
    the intended path, with no blocked call in that segment. Each hack trajectory still carries its blocked call
    and its PPO reward is 0, though the verifier gives its text 1 (before: the count lived in the env of one
    segment, and the trajectory was paid 1). A cut inside the `>error` line (the call rewritten and judged again
    on resume) is `test_deterministic_cut_rule.py`'s case."""
    tok = load_tokenizer(script_model)
    dom = load_domain("tool_add")
    cases = {ex.prompt: (script, hack) for ex, script, hack in scripts()}
    guard = Guard()  # rules only
    server = EngineProc(script_model, tmp_path / "engine.log").start().wait_healthy()
    client = EngineClient(server.url)

    async def run():
        try:
            roller = Roller(client, dom, tok, temperature=0.0, guard=guard, seed=0)
            buffer, cursor = AprilBuffer(max_staleness=2), PromptCursor(dom, tok, 4, 0)
            steps = []
            for version, over in ((0, 2.0), (1, 1.0)):  # step 1: the two partials only, no fresh prompt
                samples, april = await rollout_step(roller, buffer, cursor, batch_size=2, over_sampling=over,
                                                    max_new_tokens=BUDGET, version=version, deterministic=True)
                steps.append((samples, april, [p["blocked_calls"] for p in buffer.state_dict()["partials"]],
                              guard.snapshot_and_reset()["blocked"]))
                buffer.mark_trained(s.sample_id for s in samples)
            return steps, roller
        finally:
            await client.aclose()

    try:
        (first, second), roller = asyncio.run(run())
    finally:
        server.kill()
    samples0, april0, left0, blocked0 = first
    assert april0["finished"] == 2 and april0["partials"] == 2
    assert all(not cases[s.example["prompt"]][1] and s.blocked_calls == 0 for s in samples0)
    assert sample_rewards(dom, samples0, roller.text) == [1.0, 1.0]
    samples1, april1, left, blocked1 = second
    assert april1["resumed"] == 2 and len(samples1) == 2 and left == []
    for s in samples1:
        script, hack = cases[s.example["prompt"]]
        assert hack and roller.text(s.output_ids) == script  # the whole hack-then-intended script, over 2 segments
        assert s.blocked_calls == 1 and set(s.token_versions) == {0, 1}
        assert dom.verify(Example(**s.example), roller.text(s.output_ids)) == 1.0
    assert sample_rewards(dom, samples1, roller.text) == [0.0, 0.0]
    assert (left0, blocked0, blocked1) == ([1, 1], 2, 0)  # blocked in segment 1; segment 2 took the intended path


def test_student_guards_follow_the_specialists_guard_config(tmp_path):
    base = {"run": {"name": "g", "root": str(tmp_path)}, "tracking": {"enabled": False},
            "domains": [{"name": "tool_add"}, {"name": "tool_files"}, {"name": "addition"}]}
    cfg = config_from_dict({**base, "specialists": {"guard": {"judge_url": "http://127.0.0.1:9", "allowed_hosts":
                                                              ["example.org"]}}})
    guards = student_guards(cfg, load_domains(cfg))
    assert set(guards) == {"tool_add", "tool_files"}  # tool domains only
    g = guards["tool_add"]
    assert g is guards["tool_files"] and g.judge is None  # rules only (no judge server in the student stage)
    assert g.allowed_hosts == frozenset({"example.org"})
    off = config_from_dict({**base, "specialists": {"per_domain": {"tool_files": {"guard": {"enabled": False}}}}})
    guards = student_guards(off, load_domains(off))
    assert guards["tool_files"] is None and isinstance(guards["tool_add"], Guard)
