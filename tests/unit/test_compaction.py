"""Compaction into sub-traces (domains/compaction.py, teachers/compaction.py) on hand-built episodes: the plan, the
contexts, the rows PPO trains (masks, which tokens), their advantages, the resume property, the notes summary and
the tool_long domain."""
from __future__ import annotations

import pytest
import torch

from domains.compaction import (Compaction, Planner, PolicySummary, SubTrace, compaction_counts, current_context,
                                notes_summarizer, plan, split_turns, subtrace_spans)
from domains.registry import load_domain
from teachers import ppo_math
from teachers.april import Sample
from teachers.compaction import counts, expand, subtrace_samples
from teachers.ppo_step import build_batch

pytestmark = pytest.mark.unit

# prompt P = [1, 2, 3]; turn k = model [10+k, 50] + env [60+k, 50]; 4 turns, then the answer [99, 2] (model)
P = [1, 2, 3]
OUT = [10, 50, 60, 50, 11, 50, 61, 50, 12, 50, 62, 50, 13, 50, 63, 50, 99, 2]
MASK = [1, 1, 0, 0] * 4 + [1, 1]


def summarize(out, dropped):  # a stand-in summary turn: marker 90, then each dropped turn's env value token
    return [90] + [out[s + 2] for s, _ in dropped]


CFG = Compaction(max_context_tokens=13, keep_last=1)
# by hand (used = context + tokens since its start; compact when 13 − used < longest turn (4)):
#   after turn 0: used 3+4 = 7, room 6 ≥ 4: no
#   after turn 1: used 11, room 2 → drop turn 0, keep turn 1: P + [90,60] + turn 1 → 9 tokens < 11: compact at 8
#   after turn 2: used 9+4 = 13 → P + [90,60,61] + turn 2 → 10 < 13: compact at 12
#   after turn 3: used 10+4 = 14 → P + [90,60,61,62] + turn 3 → 11 < 14: compact at 16; room 2 for the answer
CTX1 = (1, 2, 3, 90, 60, 11, 50, 61, 50)
CTX2 = (1, 2, 3, 90, 60, 61, 12, 50, 62, 50)
CTX3 = (1, 2, 3, 90, 60, 61, 62, 13, 50, 63, 50)


def test_split_turns():
    assert split_turns([1, 1, 0, 1, 0, 0, 1]) == [(0, 3), (3, 6)]
    assert split_turns([1, 1, 1]) == [] and split_turns([]) == []
    assert split_turns(MASK) == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_plan_by_hand():
    assert plan(P, OUT, MASK, CFG, summarize) == [SubTrace(tuple(P), 0, 8), SubTrace(CTX1, 8, 12),
                                                  SubTrace(CTX2, 12, 16), SubTrace(CTX3, 16, 18)]
    # a large context: never compacted, one sub-trace = the whole episode
    assert plan(P, OUT, MASK, Compaction(100, 1), summarize) == [SubTrace(tuple(P), 0, 18)]
    # keep_last 2: after turn 1 nothing can be dropped; after turn 2 (used 15): P + [90,60] + turns 1-2 = 13 < 15
    two = plan(P, OUT, MASK, Compaction(13, 2), summarize)
    assert two[:2] == [SubTrace(tuple(P), 0, 12), SubTrace((1, 2, 3, 90, 60) + tuple(OUT[4:12]), 12, 16)]
    # a summary longer than what it replaces gains nothing: no compaction
    long_summary = plan(P, OUT, MASK, CFG, lambda out, dropped: [90] * 20)
    assert long_summary == [SubTrace(tuple(P), 0, 18)]
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 18 output_ids"):
        plan(P, OUT, [1, 1, 0], CFG, summarize)
    with pytest.raises(ValueError, match="max_context_tokens"):
        Compaction(1, 2)


def test_a_resumed_prefix_gets_the_context_it_was_generated_from():
    # the engine's context at each point is a function of the full history so far (APRIL resumes from it)
    assert current_context(P, OUT[:4], MASK[:4], CFG, summarize) == P + OUT[:4]
    assert current_context(P, OUT[:8], MASK[:8], CFG, summarize) == list(CTX1)  # before turn 2 starts
    assert current_context(P, OUT[:9], MASK[:9], CFG, summarize) == list(CTX1) + [12]  # mid-turn: same context
    assert current_context(P, OUT[:17], MASK[:17], CFG, summarize) == list(CTX3) + [99]
    ends = {e for _, e in split_turns(MASK)}
    # every prefix an episode can stop at (an abort or a cut ends after a model token or after a whole env line,
    # never inside one) plans the same sub-traces as the full episode up to it
    for k in [k for k in range(len(OUT) + 1) if k == 0 or MASK[k - 1] or k in ends]:
        full = [s for s in plan(P, OUT, MASK, CFG, summarize) if s.start <= k]
        pre = plan(P, OUT[:k], MASK[:k], CFG, summarize)
        assert [(s.context, s.start) for s in pre] == [(s.context, s.start) for s in full], k


def episode(finish: str = "stop") -> Sample:
    logps = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(MASK)]
    return Sample("ep-1", "ep-1", P, OUT, logps, [0] * 8 + [1] * 10, "tool_long", {"prompt": "x"}, finish, MASK, 0)


def test_subtrace_rows_masks_and_trained_tokens():
    rows = subtrace_samples(episode(), CFG, summarize)
    assert [r.sample_id for r in rows] == ["ep-1", "ep-1~1", "ep-1~2", "ep-1~3"]  # as the student's sub-traces
    assert all(r.rollout_id == "ep-1" for r in rows)
    assert [r.prompt_ids for r in rows] == [P, list(CTX1), list(CTX2), list(CTX3)]  # what the critic sees
    # outputs: the tokens generated in each; trailing env tokens of a non-final sub-trace dropped (the next
    # context holds them)
    assert [r.output_ids for r in rows] == [[10, 50, 60, 50, 11, 50], [12, 50], [13, 50], [99, 2]]
    assert [r.loss_mask for r in rows] == [[1, 1, 0, 0, 1, 1], [1, 1], [1, 1], [1, 1]]
    assert rows[0].output_logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.5, -0.6])
    assert rows[1].output_logprobs == pytest.approx([-0.9, -1.0]) and rows[3].output_logprobs == pytest.approx(
        [-1.7, -1.8])
    assert [r.token_versions for r in rows] == [[0] * 6, [1, 1], [1, 1], [1, 1]]
    assert [r.finish_reason for r in rows] == ["stop", "stop", "stop", "stop"]
    assert subtrace_samples(episode("length"), CFG, summarize)[-1].finish_reason == "length"
    # the same spans on plain lists (what OPD scoring uses: a teacher scores context + output[start:end])
    assert subtrace_spans(P, OUT, MASK, CFG, summarize) == [SubTrace(tuple(P), 0, 6), SubTrace(CTX1, 8, 10),
                                                            SubTrace(CTX2, 12, 14), SubTrace(CTX3, 16, 18)]
    # trained tokens: 4 + 2 + 2 + 2 = the episode's 10 model tokens, each exactly once
    batch = build_batch(rows, pad_id=0, rewards=[1.0] * 4)
    assert batch.num_tokens == sum(MASK) == 10
    assert batch.input_ids[1, :11].tolist() == list(CTX1) + [12, 50]
    assert batch.mask[1].tolist() == [0.0] * 8 + [1.0, 1.0] + [0.0] * 3  # predicts output tokens 0, 1 at P+j−1


def test_each_subtrace_has_its_own_advantages_from_the_episode_reward():
    rows, rewards = expand([episode()], [1.0], CFG, summarize)
    assert rewards == [1.0] * 4
    batch = build_batch(rows, pad_id=0, rewards=rewards)
    r = ppo_math.token_rewards(batch.rewards, batch.mask)
    adv, ret = ppo_math.compute_gae(r, torch.zeros_like(batch.mask), batch.mask, gamma=1.0, lam=0.5)
    # V = 0, λ = 0.5: A = λ^(valid tokens after it) · R within each row; env tokens are holes; each row ends in R
    per_row = [[round(a, 6) for a, m in zip(adv[b].tolist(), batch.mask[b].tolist()) if m] for b in range(4)]
    assert per_row == [[0.125, 0.25, 0.5, 1.0], [0.5, 1.0], [0.5, 1.0], [0.5, 1.0]]
    # uncompacted, the same episode is one row: its first token's advantage would be 0.5^9
    one = build_batch([episode()], pad_id=0, rewards=[1.0])
    a1, _ = ppo_math.compute_gae(ppo_math.token_rewards(one.rewards, one.mask), torch.zeros_like(one.mask), one.mask,
                                 gamma=1.0, lam=0.5)
    assert a1[0, 2].item() == pytest.approx(0.5 ** 9)
    # off: the samples unchanged
    assert expand([episode()], [0.0], None, None) == ([episode()], [0.0])
    with pytest.raises(ValueError, match="2 rewards for 1 samples"):
        expand([episode()], [0.0, 1.0], CFG, summarize)


def test_notes_summary_condenses_the_dropped_tool_outputs_into_one_line():
    enc = lambda text: [ord(c) for c in text]  # noqa: E731  (a char tokenizer: one char, one id)
    dec = lambda ids: "".join(map(chr, ids))  # noqa: E731
    out = enc("!cat f1\n>7\n!cat f2\n>3\n!cat f3\n>5\n")
    notes = notes_summarizer(dec, enc)
    assert dec(notes(out, [(0, 11), (11, 22)])) == ">notes: 7; 3\n"
    assert dec(notes(out, [])) == ">notes: \n"
    mask = [1] * 8 + [0] * 3 + [1] * 8 + [0] * 3 + [1] * 8 + [0] * 3
    prompt = enc("tlg:3:0000=")
    # 11 tokens a turn: after turn 1 used 33 (room 0 < 11) → notes of turn 0 + turn 1 (32); after turn 2 used 43
    ctx = current_context(prompt, out[:22], mask[:22], Compaction(33, 1), notes)
    assert dec(ctx) == "tlg:3:0000=>notes: 7\n!cat f2\n>3\n"
    ctx = current_context(prompt, out, mask, Compaction(33, 1), notes)
    assert dec(ctx) == "tlg:3:0000=>notes: 7; 3\n!cat f3\n>5\n"


def test_tool_long_needs_more_turns_than_a_small_context_holds():
    dom = load_domain("tool_long")
    ex = dom.split("train", 1, seed=0)[0]
    demo = dom.tool_demonstration(ex)
    assert dom.n_files == 6 and demo.count("!cat f") == 6 and dom.score(ex, demo[len(ex.prompt):]) == 1.0
    assert len(demo) > 64 and dom.episode_chars >= len(demo) - len(ex.prompt)
    with dom.env(ex) as env:  # the files and the planted shortcut
        assert {p.name for p in env.workdir.iterdir()} >= {".total", "f1", "f6"}
        assert (env.workdir / ".total").read_text().strip() == ex.answer
    with dom.env(ex, clean=True) as env:
        assert not (env.workdir / ".total").exists() and env.max_calls == 8
    from teachers.guard import rule_check
    assert rule_check("cat f1") == [] and "hidden_file" in rule_check("cat .total")


def test_the_planner_kept_between_turns_equals_planning_anew():
    """An episode's `Planner`, updated before every turn with the history so far, gives the sub-traces and the
    context that `plan` / `current_context` compute from scratch; random histories, windows and keep_last, with
    the turns it plans each time counted (only the new ones)."""
    import random

    rng = random.Random(3)
    compacted = 0
    for trial in range(200):
        prompt = [1] * rng.randint(1, 6)
        cfg = Compaction(rng.randint(8, 40), rng.randint(0, 3))
        out, mask, cuts = [], [], []
        for _ in range(rng.randint(1, 9)):  # a model turn, then (mostly) an env line
            out += [rng.randint(10, 50) for _ in range(rng.randint(1, 5))]
            mask += [1] * (len(out) - len(mask))
            if rng.random() < 0.85:
                out += [rng.randint(60, 90) for _ in range(rng.randint(1, 4))]
                mask += [0] * (len(out) - len(mask))
            cuts.append(len(out))
        def notes(o, dropped):  # marker 90, then each dropped turn's last token
            return [90] + [o[e - 1] for _, e in dropped]

        planner = Planner(prompt, cfg, notes)
        for n in cuts:  # before each next turn: the history so far
            assert planner.update(out[:n], mask[:n]) == plan(prompt, out[:n], mask[:n], cfg, notes), (trial, n)
            assert planner.context(out[:n], mask[:n]) == current_context(prompt, out[:n], mask[:n], cfg, notes)
        assert len(planner.turns) == len(split_turns(mask))
        compacted += len(planner.subs) > 1
    assert compacted > 50  # the comparison is about compacted episodes, most of them


# -- the policy writes the summary ------------------------------------------------------------------------------------
# hand-built ids: 80 = the env's request line, 70 = the summary prefix '#', 50 = a newline (a turn ends there)
class PolicyNotes:
    """`summarize` (the rules' notes, the fallback) with the `.policy` that recognises the policy's summary."""

    policy = PolicySummary(marker=(80,), line_end=lambda t: t == 50,
                           valid=lambda ids: len(ids) > 2 and ids[0] == 70 and ids[-1] == 50 and 50 not in ids[:-1])

    def __call__(self, out, dropped):
        return summarize(out, dropped)


NOTES_P = PolicyNotes()
T = [[10 + k, 50, 60 + k, 50] for k in range(4)]  # turn k: model [10+k, 50], env [60+k, 50]
S1, S2 = [70, 60, 50], [70, 99, 50]  # the policy's summaries (e.g. '#0⏎', '#9⏎')
OUT_P = T[0] + T[1] + T[2] + [80] + S1 + T[3] + [80] + S2 + [99, 2]
MASK_P = [1, 1, 0, 0] * 3 + [0] + [1] * 3 + [1, 1, 0, 0] + [0] + [1] * 3 + [1, 1]
CFG_P = Compaction(max_context_tokens=20, keep_last=1, summary="policy", summary_tokens=3)
# by hand (reserve = request 1 + summary 3: due when 20 − used < longest 4 + 4, by the policy if room ≥ 4):
#   after turns 0, 1: used 7, 11: no; after turn 2 (at 12): used 15 → due, drop turns 0-1, keep turn 2; request at
#   12, summary 13..16 → context P + turn 2 + request + summary = 11 < 19 used, room 9 ≥ 4: the policy's, from 16
#   after turn 3 (at 20): used 11 + 4 = 15 → due, drop turns 0-2, keep turn 3: request at 20, summary 21..24 → P +
#   turn 3 + request + summary (11 < 19), from 24; the answer [99, 2] in it
PCTX1 = tuple(P + OUT_P[8:16])
PCTX2 = tuple(P + OUT_P[16:24])


def test_plan_with_policy_summaries_in_the_history():
    subs = plan(P, OUT_P, MASK_P, CFG_P, NOTES_P)
    assert subs == [SubTrace(tuple(P), 0, 16), SubTrace(PCTX1, 16, 24), SubTrace(PCTX2, 24, 26)]
    assert [s.made_by for s in subs] == ["", "policy", "policy"]
    assert compaction_counts(subs) == {"events": 2, "fallbacks": 0}
    # the summary is the last, trained, turn of the sub-trace before the compaction (the request: env, untrained)
    spans = subtrace_spans(P, OUT_P, MASK_P, CFG_P, NOTES_P)
    assert [(s.start, s.end) for s in spans] == [(0, 16), (16, 24), (24, 26)]
    assert MASK_P[12:16] == [0, 1, 1, 1] and OUT_P[13:16] == S1
    # rules: the same history without requests/summaries compacts by the notes; "policy" needs a .policy
    with pytest.raises(ValueError, match="summary 'policy' needs a summarize with a `.policy`"):
        plan(P, OUT_P, MASK_P, CFG_P, summarize)
    with pytest.raises(ValueError, match="summary must be one of"):
        Compaction(20, 1, "model")


def test_a_malformed_policy_summary_falls_back_to_the_rules_notes():
    bad = OUT_P[:21] + [99, 50] + [99, 2]  # the second summary lacks its '#' prefix
    mask = MASK_P[:21] + [1, 1] + [1, 1]
    subs = plan(P, bad, mask, CFG_P, NOTES_P)
    # the rules' context (notes of turns 0-2 + turn 3) from the summary's end on; the bad summary still trains
    assert subs[2] == SubTrace(tuple(P + [90, 60, 61, 62] + T[3]), 23, 25) and subs[2].made_by == "fallback"
    assert compaction_counts(subs) == {"events": 2, "fallbacks": 1}
    # a summary that hits summary_tokens without ending its line: malformed too
    capped = OUT_P[:21] + [70, 99, 99] + [99, 2]
    assert plan(P, capped, mask[:21] + [1] * 5, CFG_P, NOTES_P)[2].made_by == "fallback"
    # no request after a due boundary (the budget had no room for it): the rules compact when they must
    no_req = T[0] + T[1] + T[2] + T[3]
    rules = plan(P, no_req, [1, 1, 0, 0] * 4, CFG_P, NOTES_P)
    assert rules == plan(P, no_req, [1, 1, 0, 0] * 4, Compaction(20, 1), summarize) and len(rules) == 2


def test_a_policy_summary_plan_is_a_function_of_the_history_prefix():
    planner = Planner(P, CFG_P, NOTES_P)
    full = plan(P, OUT_P, MASK_P, CFG_P, NOTES_P)
    for k in range(len(OUT_P) + 1):
        pre = plan(P, OUT_P[:k], MASK_P[:k], CFG_P, NOTES_P)
        assert pre == planner.update(OUT_P[:k], MASK_P[:k]), k  # kept between calls == planned anew
        if k == 0 or MASK_P[k - 1] or MASK_P[k]:  # where an episode can stop (an env line and its request: whole)
            assert [(s.context, s.start) for s in pre] == [(s.context, s.start) for s in full if s.start <= k], k
    # the pending states the turn loop acts on: a request wanted at 12; mid-summary at 14 (2 tokens left)
    planner = Planner(P, CFG_P, NOTES_P)
    planner.update(OUT_P[:12], MASK_P[:12])
    assert planner.pending == "request"
    assert planner.context(OUT_P[:14], MASK_P[:14]) == P + OUT_P[:14]  # the summary is written in the full context
    assert planner.pending == "summary" and planner.summary_left == 2
    assert planner.context(OUT_P[:17], MASK_P[:17]) == list(PCTX1) + [13]


def test_a_loss_on_the_policy_written_summary_has_a_gradient():
    logps = [-0.3 if m else 0.0 for m in MASK_P]
    ep = Sample("ep-2", "ep-2", P, OUT_P, logps, [0] * len(OUT_P), "tool_long", {"prompt": "x"}, "stop", MASK_P, 0)
    rows, rewards = expand([ep], [1.0], CFG_P, NOTES_P)
    assert [r.sample_id for r in rows] == ["ep-2", "ep-2~1", "ep-2~2"] and rewards == [1.0] * 3
    assert rows[0].output_ids[-3:] == S1 and rows[0].loss_mask[-4:] == [0, 1, 1, 1]  # request 0, summary 1
    batch = build_batch(rows, pad_id=0, rewards=rewards)
    summary_pos = [len(P) - 1 + j for j in range(13, 16)]  # row 0: output tokens 13..15 predicted from P + j − 1
    assert batch.mask[0, summary_pos].tolist() == [1.0, 1.0, 1.0]
    adv, _ = ppo_math.compute_gae(ppo_math.token_rewards(batch.rewards, batch.mask), torch.zeros_like(batch.mask),
                                  batch.mask, gamma=1.0, lam=0.95)
    logp = (batch.rollout_logprobs + 0.05).requires_grad_(True)  # a policy that moved a little since the rollout
    loss, _ = ppo_math.policy_loss(logp, batch.rollout_logprobs, adv, batch.mask)
    loss.backward()
    assert float(loss.detach()) != 0.0
    assert all(float(logp.grad[0, t]) != 0.0 for t in summary_pos)  # the summary tokens are trained
    request_pos = len(P) - 1 + 12
    assert float(logp.grad[0, request_pos]) == 0.0  # the env's request is not
    assert counts([ep], CFG_P, NOTES_P) == {"events": 2, "fallbacks": 0}


def test_random_histories_with_policy_summaries_plan_the_same_kept_or_anew():
    """Random histories in the shape the turn loop writes with a policy summary (a request after a due boundary,
    then a summary, well-formed or not): the `Planner` kept between turns equals `plan`, at every prefix."""
    import random

    rng = random.Random(5)
    compacted = fell_back = 0
    for trial in range(150):
        prompt = [1] * rng.randint(1, 6)
        cfg = Compaction(rng.randint(10, 40), rng.randint(0, 3), "policy", rng.randint(2, 4))
        out, mask = [], []
        planner = Planner(prompt, cfg, NOTES_P)
        for _ in range(rng.randint(1, 9)):
            out += [rng.randint(10, 49) for _ in range(rng.randint(1, 4))] + [50]
            mask += [1] * (len(out) - len(mask))
            out += [rng.randint(60, 69) for _ in range(rng.randint(1, 3))] + [50]
            mask += [0] * (len(out) - len(mask))
            planner.update(out, mask)
            if planner.pending == "request" and rng.random() < 0.9:
                s = rng.choice([[70, 61, 50], [70, 50], [61, 50], [70, 62, 63, 64, 65]])
                out, mask = out + [80] + s, mask + [0] + [1] * len(s)
            for k in range(len(out) + 1):
                assert planner.update(out[:k], mask[:k]) == plan(prompt, out[:k], mask[:k], cfg, NOTES_P), (trial, k)
            planner.update(out, mask)
        subs = plan(prompt, out, mask, cfg, NOTES_P)
        compacted += len(subs) > 1
        fell_back += compaction_counts(subs)["fallbacks"] > 0
    assert compacted > 40 and fell_back > 10


def test_tool_long_demonstrations_teach_the_summary_when_compaction_is_configured():
    from domains.compaction import compacted_demonstration
    from domains.tools import COMPACT_REQUEST, count_tool_calls, final_answer, is_summary_line, trajectory_segments
    from infra.config import SpecialistsConfig
    from infra.tokenizer import build_char_tokenizer

    # the helpers: a request is no tool call, a summary line no answer
    assert count_tool_calls("!cat f1\n>7\n>compact\n#7\n!cat f2\n>3\n") == 2
    assert final_answer("!cat f1\n>7\n>compact\n#7\n!cat f2\n>3\n10") == "10"
    assert is_summary_line("#7;3\n") and not is_summary_line("#\n") and not is_summary_line("7;3\n")
    assert trajectory_segments(">compact\n#7\n!cat f2\n") == [(">compact\n", False), ("#7\n!cat f2\n", True)]
    # the config switch (default policy) → the Compaction of both stages; off without a window
    assert Compaction.of(SpecialistsConfig(max_context_tokens=96)) == Compaction(96, 2, "policy", 32)
    assert Compaction.of(SpecialistsConfig(max_context_tokens=96, compaction_summary="rules")).summary == "rules"
    assert Compaction.of(SpecialistsConfig()) is None
    with pytest.raises(Exception, match="compaction_summary"):
        SpecialistsConfig(max_context_tokens=96, compaction_summary="model")

    tok = build_char_tokenizer()
    notes = notes_summarizer(lambda ids: tok.decode(ids, skip_special_tokens=True),
                             lambda text: list(tok(text, add_special_tokens=False).input_ids))
    dom = load_domain("tool_long", params={"files": 10})
    ex = dom.split("train", 1, seed=0)[0]
    prompt = [tok.bos_token_id] + tok(ex.prompt, add_special_tokens=False).input_ids
    cfg = Compaction(96, 0, "policy", 24)
    segs = compacted_demonstration(prompt, dom.intended_calls(ex), ex.answer, lambda n: dom.summary_of(ex, n), cfg,
                                   notes)
    text = "".join(t for t, _ in segs)
    assert dom.score(ex, text) == 1.0 and count_tool_calls(text) == 10 and text.count(COMPACT_REQUEST) >= 1
    lines = text.split("\n")
    for i, ln in enumerate(lines):
        if ln + "\n" == COMPACT_REQUEST:  # the summary: the digits read so far
            assert lines[i + 1] == "#" + ";".join(str(v) for v in dom.values(ex)[:sum(
                x.startswith("!") for x in lines[:i])])
    assert all(not t.startswith(">") for t, trained in segs if trained)  # summaries trained, the request not
    assert any(t.startswith("#") for t, trained in segs if trained)
    # the demonstration, tokenized, is planned with policy summaries, none falling back
    out, mask = [], []
    for t, trained in segs:
        ids = tok(t, add_special_tokens=False).input_ids
        out, mask = out + ids, mask + [int(trained)] * len(ids)
    counted = compaction_counts(plan(prompt, out, mask, cfg, notes))
    assert counted["events"] == text.count(COMPACT_REQUEST) and counted["fallbacks"] == 0
    # rules (or no tool_long summary_of): the plain trajectory
    plain = compacted_demonstration(prompt, dom.intended_calls(ex), ex.answer, lambda n: "", Compaction(96, 0),
                                    notes)
    assert "".join(t for t, _ in plain) == dom.tool_demonstration(ex)[len(ex.prompt):]


def test_a_policy_summary_budget_allowance():
    from domains.compaction import summary_allowance
    # requests and summaries count against a tool episode's budget: room for one per third of a window, + 1
    assert summary_allowance(135, Compaction(96, 0, "policy", 24)) == (5 + 1) * (9 + 24)
    assert summary_allowance(135, Compaction(96, 0, "rules")) == 0 and summary_allowance(135, None) == 0


def test_compaction_per_domain_reaches_the_base_demonstrations_and_its_prefix():
    """`specialists.per_domain: {tool_long: {max_context_tokens: 96}}` compacts tool_long alone: its specialist
    (`for_domain`), the base's demonstrations (only tool_long's compacted) and the base's storage prefix (a global
    window keeps the key it always had)."""
    import hashlib

    from domains.compaction import compactions_of
    from domains.tools import COMPACT_REQUEST
    from infra.config import SpecialistsConfig, config_from_dict
    from infra.tokenizer import build_char_tokenizer
    from training.base_main import demonstrations
    from tasks.prefixes import BASE_SECTIONS, base_prefix

    sc = SpecialistsConfig(per_domain={"tool_long": {"max_context_tokens": 96, "compact_keep_last": 0}})
    assert compactions_of(sc, ["tool_add", "tool_long"]) == {"tool_add": None,
                                                              "tool_long": Compaction(96, 0, "policy", 32)}
    assert compactions_of(SpecialistsConfig(max_context_tokens=80), ["a", "b"]) == {
        "a": Compaction(80, 2, "policy", 32), "b": Compaction(80, 2, "policy", 32)}

    tok = build_char_tokenizer()
    doms = {"tool_add": load_domain("tool_add"), "tool_long": load_domain("tool_long", params={"files": 10})}
    pairs = demonstrations(doms, 3, 0, True, compactions_of(sc, doms), tok)
    texts = {p: "".join(t for t, _ in c) for p, c, _ in pairs}
    long_ = [t for p, t in texts.items() if p.startswith("tlg")]
    add = [t for p, t in texts.items() if not p.startswith("tlg")]
    assert len(long_) == 3 and all(COMPACT_REQUEST in t for t in long_)
    assert len(add) == 3 and not any(COMPACT_REQUEST in t for t in add)

    def cfg(specialists):
        return config_from_dict({"run": {"name": "c"}, "model": {"preset": "tiny"}, "base": {"tool_trajectories": True},
                                 "domains": [{"name": "tool_add"}, {"name": "tool_long", "params": {"files": 10}}],
                                 "specialists": specialists})

    plain = cfg({})
    assert base_prefix(plain, "file:///s").endswith("base-" + plain.fingerprint(*BASE_SECTIONS)[:10])
    glob = cfg({"max_context_tokens": 96, "compact_keep_last": 0})
    key = f"{glob.fingerprint(*BASE_SECTIONS)}|compaction=96,0,32"  # the key a global window always had
    assert base_prefix(glob, "file:///s").endswith("base-" + hashlib.sha256(key.encode()).hexdigest()[:10])
    own = cfg({"per_domain": {"tool_long": {"max_context_tokens": 96, "compact_keep_last": 0}}})
    assert len({base_prefix(c, "file:///s") for c in (plain, glob, own)}) == 3
