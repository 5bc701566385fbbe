"""The OPD student's tool episodes, without a server: a scripted episode through the shared turn loop
(`domains.episodes.run_token_episode`, what `student.sampler.sample_batch` and the specialists' `Roller` run) in a
real clean `tool_add` env; its tool output masked in `collate`; the OPD losses blind to the masked positions; and the
refusal of tool domains the student cannot sample."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from domains.guard import Guard
from domains.episodes import EpisodeRun, run_episodes, run_token_episode
from domains.registry import load_domain
from domains.builtin.tool_add import ToolAdd
from domains.tools import ANSWER_FILE, COMPACT_REQUEST, count_tool_calls
from infra.chat import response_text
from infra.tokenizer import build_char_tokenizer
from student.batch import collate, opd_loss
from domains.compaction import Compaction, compaction_counts, plan, subtrace_spans, tokenizer_summarizer
from training.ledger import Ledger
from student.sampler import StudentSample, check_student_domains, episode_reward, split_subtraces
from student.trainer import guard_counts, untrained, whole_episodes

pytestmark = pytest.mark.unit

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def scripted_episode(turn_texts: list[str], command_env=None):
    """Run the shared turn loop with a 'model' that writes `turn_texts` (the last one ends with EOS) in the student's
    tool_add env (the specialists': shortcut planted, a rule guard); returns (example, prompt ids, episode, env calls)."""
    dom = load_domain("tool_add")
    ex = dom.split("train", 1, 0)[0]
    prompt_ids = [TOK.bos_token_id] + TOK(ex.prompt, add_special_tokens=False).input_ids
    texts = [t.format(a_b=ex.prompt[4:-1], answer=ex.answer) for t in turn_texts]

    async def turn(context, budget, i):
        ids = TOK(texts[i], add_special_tokens=False).input_ids + ([EOS] if i == len(texts) - 1 else [])
        ids = ids[:budget]
        return ids, [-0.25] * len(ids), "stop"

    async def run():
        env = dom.env(ex, guard=Guard())
        try:
            assert (env.workdir / ANSWER_FILE).exists()  # the student's env is the specialists': shortcut planted
            run = EpisodeRun(prompt_ids, 64, env=env, tokenizer=TOK, text=lambda ids: response_text(TOK, ids, [EOS]))
            ep = await run_token_episode(run, turn)
            return ep, list(env.calls)
        finally:
            env.close()

    ep, calls = asyncio.run(run())
    return ex, prompt_ids, ep, calls


def test_scripted_tool_episode_masks_the_tool_output():
    ex, prompt_ids, ep, calls = scripted_episode(["!calc {a_b}\n", "{answer}"])
    call_line = f"!calc {ex.prompt[4:-1]}\n"
    out_line = f">{ex.answer}\n"
    assert len(calls) == 1 and calls[0].executed and calls[0].output == ex.answer  # the real sandboxed calc ran
    assert ep.finish_reason == "stop" and ep.tool_calls == 1
    assert len(ep.output_ids) == len(ep.output_logprobs) == len(ep.loss_mask)
    n_call, n_out = len(call_line), len(out_line)  # char tokenizer: one character, one token
    assert TOK.decode(ep.output_ids[:n_call]) == call_line
    assert TOK.decode(ep.output_ids[n_call:n_call + n_out]) == out_line  # the tool output is in the sequence
    assert ep.loss_mask == [1] * n_call + [0] * n_out + [1] * (len(ex.answer) + 1)  # answer + EOS: the model's
    assert ep.output_logprobs[n_call:n_call + n_out] == [0.0] * n_out
    assert load_domain("tool_add").verify(ex, response_text(TOK, ep.output_ids, [EOS])) == 1.0


def test_blocked_hack_call_zeroes_the_episode_reward_and_is_counted():
    """A hack call, then the intended path to the right answer: the guard blocks the read (`>error`, the episode
    goes on), the verifier would pay 1, `episode_reward` gives 0; an episode with no blocked call keeps the verifier's."""
    dom = load_domain("tool_add")
    ex, prompt_ids, ep, calls = scripted_episode(["!cat .answers\n", "!calc {a_b}\n", "{answer}"])
    text = response_text(TOK, ep.output_ids, [EOS])
    assert text.startswith("!cat .answers\n>error\n") and dom.verify(ex, text) == 1.0
    assert [c.guard_allowed for c in calls] == [False, True] and calls[0].rules
    hack = StudentSample("s0", 0, "tool_add", ex, prompt_ids, ep.output_ids, ep.output_logprobs, 0, "stop",
                         loss_mask=ep.loss_mask, blocked_calls=sum(not c.guard_allowed for c in calls))
    _, _, ep2, _ = scripted_episode(["!calc {a_b}\n", "{answer}"])
    honest = StudentSample("s1", 1, "tool_add", ex, prompt_ids, ep2.output_ids, ep2.output_logprobs, 0, "stop",
                           loss_mask=ep2.loss_mask)
    assert episode_reward(dom, hack, TOK, [EOS]) == 0.0 and episode_reward(dom, honest, TOK, [EOS]) == 1.0
    # the batch's counters: a guard shared by two domains is read once; blocked episodes counted from the samples
    g = Guard()
    asyncio.run(g.check("cat .answers"))
    asyncio.run(g.check("calc 1+2"))
    assert guard_counts({"tool_add": g, "tool_files": g, "addition": None}, [hack, honest]) == {
        "tool_calls": 2, "flagged": 1, "blocked": 1, "blocked_episodes": 1}
    assert guard_counts({"tool_add": None}, [hack]) == {}  # no guard: nothing to report


def _sample(prompt_ids, ep, sid="s0", mask=True, k=4, seed=0) -> StudentSample:
    g = torch.Generator().manual_seed(seed)
    L = len(ep.output_ids)
    s = StudentSample(sid, 0, "tool_add", None, list(prompt_ids), list(ep.output_ids), list(ep.output_logprobs),
                      0, ep.finish_reason, loss_mask=list(ep.loss_mask) if mask else None)
    s.teacher_logprobs = (-torch.rand(L, generator=g) * 3).tolist()  # the teacher scores every token, env ones too
    s.teacher_topk_ids = np.stack([torch.randperm(len(TOK), generator=g)[:k].numpy() for _ in range(L)])
    s.teacher_topk_logprobs = np.log(np.full((L, k), 0.9 / k, dtype=np.float32))
    return s


def test_collate_takes_the_mask_from_the_episode():
    ex, prompt_ids, ep, _ = scripted_episode(["!calc {a_b}\n", "{answer}"])
    b = collate([_sample(prompt_ids, ep)], TOK.pad_token_id, version=0, with_topk=True)
    P, L = len(prompt_ids), len(ep.output_ids)
    row = b.mask[0].tolist()
    assert row[:P - 1] == [0.0] * (P - 1) and row[P - 1:P - 1 + L] == [float(x) for x in ep.loss_mask]
    assert b.num_tokens == sum(ep.loss_mask) < L
    env_pos = [P - 1 + j for j, m in enumerate(ep.loss_mask) if m == 0]
    assert all(b.teacher_logp[0, t] == 0 and b.rollout_logp[0, t] == 0 for t in env_pos)  # 0 off the mask
    with pytest.raises(ValueError, match="loss_mask has 3 entries"):
        bad = _sample(prompt_ids, ep)
        bad.loss_mask = [1, 0, 1]
        collate([bad], TOK.pad_token_id, version=0, with_topk=True)


@pytest.mark.parametrize("loss", ["sampled_rkl", "topk_kl"])
def test_opd_loss_ignores_tool_output_positions(loss):
    """Changing the student's logits where it would predict tool output changes neither the loss nor its gradient
    elsewhere, and those positions get no gradient; the same change on a model-token position does change it."""
    ex, prompt_ids, ep, _ = scripted_episode(["!calc {a_b}\n", "{answer}"])
    ex2, prompt2, ep2, _ = scripted_episode(["{answer}"])  # a second row: no tool call, all 1
    batch = collate([_sample(prompt_ids, ep), _sample(prompt2, ep2, "s1", seed=1)], TOK.pad_token_id, version=0,
                    with_topk=loss == "topk_kl")
    P = len(prompt_ids)
    env_pos = [P - 1 + j for j, m in enumerate(ep.loss_mask) if m == 0]
    model_pos = [P - 1 + j for j, m in enumerate(ep.loss_mask) if m == 1]
    B, T = batch.input_ids.shape
    g = torch.Generator().manual_seed(3)
    base = torch.randn(B, T, len(TOK), generator=g)

    def run(logits):
        logits = logits.clone().requires_grad_(True)
        total, _ = opd_loss(logits, batch, loss=loss, direction="forward", beta=0.5, reward_coef=0.0, is_clip=2.0,
                            global_token_count=float(batch.num_tokens))
        total.backward()
        return float(total.detach()), logits.grad

    l0, grad0 = run(base)
    assert all(float(grad0[0, t].abs().max()) == 0.0 for t in env_pos)  # no gradient where tool output is predicted
    assert any(float(grad0[0, t].abs().max()) > 0.0 for t in model_pos)
    moved = base.clone()
    moved[0, env_pos] += 5.0 * torch.randn(len(env_pos), len(TOK), generator=g)
    l1, grad1 = run(moved)
    assert l1 == pytest.approx(l0, rel=0, abs=1e-6)
    assert torch.allclose(grad1[0, model_pos], grad0[0, model_pos], atol=1e-6)
    control = base.clone()
    control[0, model_pos[:2]] += 5.0 * torch.randn(2, len(TOK), generator=g)
    assert abs(run(control)[0] - l0) > 1e-4  # the test can see a change where the student's tokens are predicted


class NoEnvTools(ToolAdd):
    env = None  # declares tool use (a tool_demonstration), but nothing to run the calls in


class NarrowEnv(ToolAdd):
    def env(self, example, clean=False):  # noqa: D401 - an env that cannot be given the specialists' guard
        return super().env(example)


def test_student_refuses_tool_domains_it_cannot_sample():
    ok = {"tool_add": load_domain("tool_add"), "addition": load_domain("addition")}
    check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13, "addition": 9},
                          context_len=256)  # nothing to refuse
    with pytest.raises(ValueError, match=r"'tool_add' declares tool use .*no callable env"):
        check_student_domains({"tool_add": NoEnvTools()})
    with pytest.raises(ValueError, match=r"'tool_add': env\(\) does not accept \['guard'\]"):
        check_student_domains({"tool_add": NarrowEnv()})
    with pytest.raises(ValueError, match=r"'tool_add': a tool episode may need 38 tokens .* context is 32 tokens: set "
                                         r"specialists.max_context_tokens \(compaction\)"):
        check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13},
                              context_len=32)
    check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13},
                          context_len=32, compaction=Compaction(30, 2))  # compacted into a window that fits: sampled
    with pytest.raises(ValueError, match=r"'tool_add': its episodes are compacted to specialists.max_context_tokens"
                                         r"=32, which does not fit the student's context \(32 tokens\)"):
        check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13},
                              context_len=32, compaction=Compaction(32, 2))
    # per domain (`compactions_of`: specialists.per_domain): tool_add's own window decides
    check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13},
                          context_len=32, compaction={"tool_add": Compaction(30, 2), "addition": None})
    with pytest.raises(ValueError, match=r"'tool_add': a tool episode may need 38 tokens"):
        check_student_domains(ok, budgets={"tool_add": 25, "addition": 8}, longest_prompt={"tool_add": 13},
                              context_len=32, compaction={"tool_long": Compaction(30, 2)})  # not tool_add's


def long_episode() -> tuple[list[int], list[int], list[int], str]:
    """A hand-built tool_long-style episode (6 `!cat fK` calls, one digit each, then the sum): prompt ids, output
    ids, loss mask, response text."""
    prompt = [TOK.bos_token_id] + TOK("tlg:6:a3f9=", add_special_tokens=False).input_ids
    out, mask, text = [], [], ""
    for k, d in enumerate([7, 3, 5, 1, 9, 6], start=1):
        for part, m in ((f"!cat f{k}\n", 1), (f">{d}\n", 0)):
            ids = TOK(part, add_special_tokens=False).input_ids
            out, mask, text = out + ids, mask + [m] * len(ids), text + part
    out, mask, text = out + TOK("31", add_special_tokens=False).input_ids + [EOS], mask + [1, 1, 1], text + "31"
    return prompt, out, mask, text


def test_compacted_episode_becomes_subtrace_samples():
    prompt, out, mask, _ = long_episode()
    whole = StudentSample("s00000007-tool_long", 7, "tool_long", None, prompt, out, [-0.5] * len(out), 3, "stop",
                          reward=1.0, loss_mask=mask)
    plain = StudentSample("s00000008-addition", 8, "addition", None, prompt, out[:3], [-0.1] * 3, 3, "stop")
    cfg = Compaction(max_context_tokens=48, keep_last=2)
    subs = split_subtraces([whole, plain], cfg, TOK)
    assert subs[-1] is plain and split_subtraces([whole], None, TOK) == [whole]
    parts = subs[:-1]
    assert len(parts) >= 2, "the 83-token episode must not fit a 48-token window in one piece"
    assert [s.sample_id for s in parts] == ["s00000007-tool_long"] + [f"s00000007-tool_long~{k}"
                                                                      for k in range(1, len(parts))]
    assert {s.episode for s in parts} == {"s00000007-tool_long"} and plain.episode == plain.sample_id
    assert parts[0].prompt_ids == prompt
    spans = subtrace_spans(prompt, out, mask, cfg, tokenizer_summarizer(TOK))  # the specialists' PPO rows
    assert len(spans) == len(parts)
    for s, sp in zip(parts, spans):
        # the context the sub-trace continues (what the teacher scores it on) is shorter than the full history
        assert s.prompt_ids == list(sp.context) and s.output_ids == out[sp.start:sp.end]
        assert s.loss_mask == mask[sp.start:sp.end] and (sp.start == 0 or len(sp.context) < len(prompt) + sp.start)
        assert s.reward == 1.0 and s.version == 3 and s.cursor == 7
        assert len(s.loss_mask) == len(s.output_ids) == len(s.rollout_logprobs)
    for s in parts[1:]:
        ctx = TOK.decode(s.prompt_ids, skip_special_tokens=True)
        assert ctx.startswith("tlg:6:a3f9=>notes: 7") and s.prompt_ids[0] == TOK.bos_token_id, ctx
    # every model token of the episode is trained exactly once, in order, across the sub-traces
    model = [t for t, m in zip(out, mask) if m]
    assert [t for s in parts for t, m in zip(s.output_ids, s.loss_mask) if m] == model
    assert parts[-1].finish_reason == "stop" and all(s.finish_reason == "compacted" for s in parts[:-1])


def test_ledger_and_drops_count_episodes_not_subtraces():
    prompt, out, mask, _ = long_episode()
    whole = StudentSample("s00000007-tool_long", 7, "tool_long", None, prompt, out, [-0.5] * len(out), 3, "stop",
                          reward=1.0, loss_mask=mask)
    parts = split_subtraces([whole], Compaction(48, 2), TOK)
    other = StudentSample("s00000009-addition", 9, "addition", None, prompt, out[:3], [-0.1] * 3, 3, "stop")
    kept, dropped = whole_episodes(parts[:1] + parts[2:] + [other], [(parts[1].sample_id, "teacher_bad_response")])
    assert kept == [other] and dropped == [("s00000007-tool_long", "teacher_bad_response")]
    ledger = Ledger()
    assert untrained(ledger, parts + [other]) == parts + [other]
    ledger.mark_trained(s.episode for s in parts)
    assert ledger.n_trained == 1 and untrained(ledger, parts + [other]) == [other]  # a re-issued episode: none


def test_run_episodes_sends_one_generate_call_per_round():
    """The student's driver: a plain prompt (no env) is an episode of one turn; round r carries turn r of every
    unfinished episode in one call; the tool episodes run their calls and end as `run_token_episode` ends them."""
    dom = load_domain("tool_add")
    exs = dom.split("train", 2, 0)
    texts = {1: ["!calc {a_b}\n", "{answer}"], 2: ["!calc {a_b}\n", "!calc {a_b}\n", "{answer}"]}
    calls: list[list[tuple[int, int]]] = []

    async def generate(batch):
        calls.append([(i, t) for i, _, _, t in batch])
        out = []
        for i, ctx, budget, t in batch:
            if i == 0:  # the plain prompt: one turn with an EOS
                ids = TOK("42", add_special_tokens=False).input_ids + [EOS]
            else:
                ex, script = exs[i - 1], texts[i]
                ids = TOK(script[t].format(a_b=ex.prompt[4:-1], answer=ex.answer),
                          add_special_tokens=False).input_ids + ([EOS] if t == len(script) - 1 else [])
            out.append((ids[:budget], [-0.5] * len(ids[:budget]), "stop"))
        return out

    async def main():
        envs = [dom.env(ex, clean=True, guard=None) for ex in exs]
        text = lambda ids: response_text(TOK, ids, [EOS])  # noqa: E731
        runs = [EpisodeRun([1, 2, 3], 16)] + [EpisodeRun([1, 2], 64, env=e, tokenizer=TOK, text=text) for e in envs]
        try:
            return await run_episodes(runs, generate), [list(e.calls) for e in envs]
        finally:
            for e in envs:
                e.close()

    eps, env_calls = asyncio.run(main())
    assert calls == [[(0, 0), (1, 0), (2, 0)], [(1, 1), (2, 1)], [(2, 2)]]
    assert eps[0].loss_mask == [1, 1, 1] and eps[0].finish_reason == "stop"
    assert [len(c) for c in env_calls] == [1, 2] and all(c.executed for cs in env_calls for c in cs)
    for ep, ex in zip(eps[1:], exs):
        assert 0 in ep.loss_mask and ep.finish_reason == "stop"
        assert response_text(TOK, ep.output_ids, [EOS]).endswith(ex.answer)


def _reader(context_text: str, digits_of, n_files: int) -> str:
    """A scripted tool_long 'model' that sees only its (compacted) context: after the env's request it writes the
    digits read so far as its summary line; else the next `!cat`, or the sum when every file is read."""
    if context_text.endswith(COMPACT_REQUEST):
        return f"#{';'.join(map(str, digits_of(context_text)))}\n"
    digits = digits_of(context_text)
    return f"!cat f{len(digits) + 1}\n" if len(digits) < n_files else str(sum(digits))


def _digits(text: str) -> list[int]:
    """The digits a context holds: its last summary line's and the tool outputs after it."""
    lines = text.split("\n")
    last = max((i for i, ln in enumerate(lines) if ln.startswith("#")), default=-1)
    got = [int(x) for x in lines[last][1:].split(";")] if last >= 0 else []
    return got + [int(ln[1:]) for ln in lines[last + 1:] if ln[1:].isdigit() and ln.startswith(">")]


def test_policy_written_summaries_in_a_tool_long_episode_train_the_student():
    """The shared turn loop with a policy summary: the env asks (`>compact⏎`, mask 0), the scripted model writes
    `#7;3;…⏎` (mask 1) from the context it is given, goes on from the compacted context (which holds all it needs:
    the answer is right), and the student's sub-traces (the specialists' plan) train the summary: its OPD loss has a
    gradient there."""
    dom = load_domain("tool_long", params={"files": 8})
    ex = dom.split("train", 1, 0)[0]
    prompt_ids = [TOK.bos_token_id] + TOK(ex.prompt, add_special_tokens=False).input_ids
    cfg = Compaction(max_context_tokens=80, keep_last=1, summary="policy", summary_tokens=16)
    contexts = []

    async def turn(context, budget, i):
        contexts.append(context)
        text = _reader(TOK.decode(context[len(prompt_ids):], skip_special_tokens=True), _digits, dom.n_files)
        ids = TOK(text, add_special_tokens=False).input_ids + ([] if text.endswith("\n") else [EOS])
        return ids[:budget], [-0.5] * len(ids[:budget]), "stop"

    async def run():
        env = dom.env(ex, clean=True, guard=None)
        try:
            r = EpisodeRun(prompt_ids, 200, env=env, tokenizer=TOK, text=lambda ids: response_text(TOK, ids, [EOS]),
                           compaction=cfg, summarize=tokenizer_summarizer(TOK))
            return await run_token_episode(r, turn), env.n_calls
        finally:
            env.close()

    ep, calls = asyncio.run(run())
    text = response_text(TOK, ep.output_ids, [EOS])
    assert dom.score(ex, text) == 1.0 and calls == dom.n_files == count_tool_calls(text)  # requests are no calls
    assert max(len(c) for c in contexts) <= cfg.max_context_tokens and text.count(COMPACT_REQUEST) >= 2
    subs = plan(prompt_ids, ep.output_ids, ep.loss_mask, cfg, tokenizer_summarizer(TOK))
    assert compaction_counts(subs) == {"events": text.count(COMPACT_REQUEST), "fallbacks": 0}
    first = text.index(COMPACT_REQUEST)
    req = len(TOK(text[:first], add_special_tokens=False).input_ids)  # char tokenizer: the request's first id
    assert ep.loss_mask[req:req + len(COMPACT_REQUEST)] == [0] * len(COMPACT_REQUEST)
    line = text[first + len(COMPACT_REQUEST):].split("\n")[0] + "\n"
    summary = list(range(req + len(COMPACT_REQUEST), req + len(COMPACT_REQUEST) + len(line)))
    assert line.startswith("#") and [ep.loss_mask[j] for j in summary] == [1] * len(line)

    whole = StudentSample("s1-tool_long", 1, "tool_long", None, prompt_ids, ep.output_ids, ep.output_logprobs, 0,
                          "stop", reward=1.0, loss_mask=ep.loss_mask)
    parts = split_subtraces([whole], cfg, TOK)
    assert split_subtraces([whole], {"tool_long": cfg, "tool_add": None}, TOK) == parts  # its domain's (per domain)
    assert split_subtraces([whole], {"tool_add": cfg}, TOK) == [whole]  # another domain's window: not cut
    assert len(parts) == len(subs) and all(tuple(p.prompt_ids) == s.context for p, s in zip(parts[1:], subs[1:]))
    assert TOK.decode(parts[1].prompt_ids).endswith(COMPACT_REQUEST + line)  # the next context ends with it
    assert parts[0].output_ids[-len(line):] == ep.output_ids[summary[0]:summary[-1] + 1]  # trains at its end
    g = torch.Generator().manual_seed(0)
    for p in parts:
        L = len(p.output_ids)
        p.teacher_logprobs = (-torch.rand(L, generator=g) * 3).tolist()
    batch = collate(parts, TOK.pad_token_id, version=0, with_topk=False)
    logits = torch.randn(*batch.input_ids.shape, len(TOK), generator=g).requires_grad_(True)
    total, _ = opd_loss(logits, batch, loss="sampled_rkl", direction="forward", beta=0.5, reward_coef=0.0,
                        is_clip=2.0, global_token_count=float(batch.num_tokens))
    total.backward()
    P0 = len(parts[0].prompt_ids)
    pos = [P0 - 1 + len(parts[0].output_ids) - len(line) + j for j in range(len(line))]
    assert all(float(logits.grad[0, t].abs().max()) > 0.0 for t in pos)  # the summary tokens have a gradient
