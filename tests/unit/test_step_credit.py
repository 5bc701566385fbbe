"""Step credit (teachers/step_credit.py): a domain's per-character credit on the tokens that hold the characters,
the rest of the reward at the end; hand-worked with the char tokenizer, checked for sums with a byte-level BPE."""
from __future__ import annotations

import pytest
import torch

from domains.registry import load_domain
from infra.tokenizer import build_char_tokenizer, load_tokenizer
from teachers.april import Sample
from teachers.ppo_step import build_batch
from teachers.ppo_math import token_rewards
from teachers.step_credit import attach_step_credit, token_credit, valid_credit

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _sample(tok, domain, ex, response: str, eos: bool = True, **kw) -> Sample:
    out = tok(response, add_special_tokens=False).input_ids + ([tok.eos_token_id] if eos else [])
    prompt = tok(ex.prompt).input_ids
    return Sample("s", "s", prompt, out, [0.0] * len(out), [0] * len(out), domain.name, ex.__dict__, "stop", **kw)


def test_token_credit_by_hand_char_tokenizer(tok):
    ids = tok("ab c", add_special_tokens=False).input_ids + [tok.eos_token_id, tok("z", add_special_tokens=False).input_ids[0]]
    decode = lambda i: tok.decode(i, skip_special_tokens=True)  # noqa: E731
    # one character per token; the EOS and anything after it get nothing
    assert token_credit([0.1, 0.2, 0.0, 0.3], ids, decode, tok.eos_token_id) == pytest.approx([0.1, 0.2, 0.0, 0.3, 0, 0])
    # two characters in one token: a decode that maps token 1 to "bX" (len 3 after it) gives it chars 1 and 2
    fake = lambda i: "".join({0: "a", 1: "bX", 2: "c"}[j] for j in i)  # noqa: E731
    assert token_credit([0.1, 0.2, 0.4, 0.3], [0, 1, 2], fake, stop_ids=[99]) == pytest.approx([0.1, 0.6, 0.3])


def test_valid_credit_rules():
    assert valid_credit([0.1, 0.2], "ab", 0.3) and valid_credit([0.0, 0.0], "ab", 0.0)
    assert not valid_credit([0.1], "ab", 1.0)  # one value per character
    assert not valid_credit([0.2, 0.2], "ab", 0.3)  # more than the reward
    assert not valid_credit([-0.1, 0.2], "ab", 1.0) and not valid_credit([float("nan"), 0], "ab", 1.0)
    assert not valid_credit(None, "ab", 1.0)


def test_attach_and_token_rewards_keep_the_reward(tok):
    rlx = load_domain("rle_expand")
    ex = rlx.make("a3b2", "aaabb")
    near = _sample(tok, rlx, ex, "aabb")  # runs (a, 2) wrong, (b, 2) right: 0.5 / 2 on its last character
    exact = _sample(tok, rlx, ex, "aaabb", loss_mask=[1] * 6)  # an all-ones mask is a single turn
    blocked = _sample(tok, rlx, ex, "aaabb", blocked_calls=1)
    rewards = [rlx.verify(ex, "aabb"), 1.0, 0.0]
    assert attach_step_credit(rlx, [near, exact, blocked], rewards, tok, tok.eos_token_id) == 2
    assert near.step_credit == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.0])  # the EOS: nothing
    assert exact.step_credit == pytest.approx([0, 0, 0.25, 0, 0.25, 0]) and blocked.step_credit == []
    batch = build_batch([near, exact, blocked], tok.pad_token_id, rewards)
    r = token_rewards(batch.rewards, batch.mask, step_credit=batch.step_credit)
    assert r.sum(dim=1).tolist() == pytest.approx([0.25, 1.0, 0.0])
    P = len(near.prompt_ids)  # output token j is predicted at P - 1 + j; the last (EOS) gets the rest
    assert r[0, P - 1:P + 4].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.0])
    assert r[1, P - 1:P + 5].tolist() == pytest.approx([0, 0, 0.25, 0, 0.25, 0.5])
    assert torch.count_nonzero(r[2]) == 0


def test_exact_only_domains_and_multi_turn_get_none(tok):
    mx = load_domain("max_list")
    ex = mx.split("train", 1, seed=0)[0]
    s = _sample(tok, mx, ex, ex.answer)
    assert attach_step_credit(mx, [s], [1.0], tok, tok.eos_token_id) == 0 and s.step_credit == []
    rev = load_domain("reverse")  # a string transform: positional credit, each right character's on its token
    t = _sample(tok, rev, rev.make("abc", "cba"), "cbx")
    assert attach_step_credit(rev, [t], [rev.verify(rev.make("abc", "cba"), "cbx")], tok, tok.eos_token_id) == 1
    assert t.step_credit == pytest.approx([0.5 / 3, 0.5 / 3, 0.0, 0.0])  # c, b right; x wrong; EOS: nothing
    rlx = load_domain("rle_expand")
    ex = rlx.make("a3b2", "aaabb")
    turn = _sample(tok, rlx, ex, "aaabb", loss_mask=[1, 1, 0, 0, 1, 1])  # multi-turn rows carry env tokens: no credit
    assert attach_step_credit(rlx, [turn], [1.0], tok, tok.eos_token_id) == 0


def test_byte_level_bpe_credit_sums_to_the_marks(qwen2_bpe_dir):
    bpe = load_tokenizer(qwen2_bpe_dir)
    rec = load_domain("record")
    for ex in rec.split("train", 20, seed=0):
        resp = ex.answer[:-4] + "xyzw"  # the last field wrong
        out = bpe(resp, add_special_tokens=False).input_ids + [bpe.eos_token_id]
        s = Sample("s", "s", bpe(ex.prompt).input_ids, out, [0.0] * len(out), [0] * len(out), "record", ex.__dict__,
                   "stop")
        reward = rec.verify(ex, resp)
        assert attach_step_credit(rec, [s], [reward], bpe, bpe.eos_token_id) == 1
        assert sum(s.step_credit) == pytest.approx(reward) and len(s.step_credit) == len(out)
