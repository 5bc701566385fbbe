"""MixedDomain: the several-domains prompt source and per-row verifier routing of mixed multi-task RL."""
import random

import pytest

from domains.base import Domain
from domains.registry import load_domain
from teachers.mixed_domain import MixedDomain

pytestmark = pytest.mark.unit


class Boom(Domain):
    name, tag = "boom", "bm"

    def generate(self, rng: random.Random):
        return self.make(str(rng.randrange(10 ** 6)), "x")

    def score(self, example, response):
        raise RuntimeError("verifier bug")


def test_split_interleaves_each_domains_own_split():
    a, b, c = load_domain("sort_digits"), load_domain("case_swap", difficulty=5), load_domain("caesar")
    mixed = MixedDomain([a, b, c])
    got = mixed.split("train", 7, seed=3)
    # 7 over 3 domains: 3, 2, 2, round-robin a b c a b c a; each part is that domain's own split
    assert [e.domain for e in got] == ["sort_digits", "case_swap", "caesar"] * 2 + ["sort_digits"]
    assert got[0::3] == a.split("train", 3, 3)
    assert got[1::3] == b.split("train", 2, 3) and got[2::3] == c.split("train", 2, 3)
    assert all(e.difficulty == 5 for e in got if e.domain == "case_swap")
    assert mixed.split("eval", 6, 0) == [x for trio in zip(a.split("eval", 2, 0), b.split("eval", 2, 0),
                                                              c.split("eval", 2, 0)) for x in trio]


def test_verify_routes_each_row_to_its_domain():
    a, c = load_domain("sort_digits"), load_domain("caesar")
    mixed = MixedDomain([a, c])
    ea, ec = a.split("train", 1, 0)[0], c.split("train", 1, 0)[0]
    assert mixed.verify(ea, ea.answer) == 1.0 and mixed.verify(ec, ec.answer) == 1.0
    # a near miss gets that domain's own partial credit: the answer with its last character changed
    wrong = ec.answer[:-1] + ("a" if ec.answer[-1] != "a" else "b")
    assert mixed.verify(ec, wrong) == pytest.approx(c.verify(ec, wrong)) == pytest.approx(
        0.5 * (len(ec.answer) - 1) / len(ec.answer))
    with pytest.raises(KeyError, match="reverse"):
        mixed.verify(load_domain("reverse").split("train", 1, 0)[0], "x")


def test_verifier_errors_are_summed_and_tool_domains_refused():
    boom = Boom()
    mixed = MixedDomain([load_domain("sort_digits"), boom])
    ex = boom.split("train", 1, 0)[0]
    assert mixed.verify(ex, "x") == 0.0 and mixed.verifier_errors == 1 == boom.verifier_errors
    with pytest.raises(ValueError, match="tool domains"):
        MixedDomain([load_domain("tool_add")])
    with pytest.raises(ValueError, match="distinct"):
        MixedDomain([load_domain("caesar"), load_domain("caesar")])


def test_prompt_cursor_draws_mixed_batches(tiny_model_dir):
    from infra.models import load_tokenizer
    from teachers.rollout import PromptCursor

    tok = load_tokenizer(tiny_model_dir)
    mixed = MixedDomain([load_domain("sort_digits"), load_domain("caesar")])
    cursor = PromptCursor(mixed, tok, 4, seed=0)
    batch = cursor.take(6, max_new_tokens=8, version=0)  # cycles the pool of 4: s c s c s c
    assert [p.sample_id for p in batch] == [f"mixed-{i:08d}" for i in range(6)]
    assert [p.example["domain"] for p in batch] == ["sort_digits", "caesar"] * 3
    assert batch[4].example == batch[0].example
