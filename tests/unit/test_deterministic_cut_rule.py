"""Timing-independent rollouts (`specialists.deterministic_rollouts`): the abort decided by token count
(`cut_by_tokens`) and the per-call sampling seeds (`seed_for`)."""
from __future__ import annotations

import pytest

from engine.client import seed_for
from teachers.rollout import Episode, cut_by_tokens

pytestmark = pytest.mark.unit


def ep(n: int, mask: list[int] | None = None, reason: str = "stop") -> Episode:
    return Episode(list(range(100, 100 + n)), [-0.5 - i for i in range(n)], mask or [1] * n, reason)


def test_the_shortest_finish_ties_by_index_and_the_rest_are_cut_to_the_last_finished_length():
    eps = [ep(9), ep(3), ep(5), ep(3, reason="length"), ep(5), ep(12)]
    finished, partials = cut_by_tokens(eps, 3)
    # lengths 3, 3, 5 (index 2) are the three shortest; index 4 is as short as the last of them: it finished too
    assert [i for i, _ in finished] == [1, 2, 3, 4]
    assert all(e is eps[i] for i, e in finished)
    assert [i for i, _ in partials] == [0, 5]
    for i, p in partials:  # a prefix of the episode, cut at T = 5 tokens, marked as aborted
        assert p.finish_reason == "abort" and len(p.output_ids) == 5
        assert p.output_ids == eps[i].output_ids[:5] and p.output_logprobs == eps[i].output_logprobs[:5]
        assert p.loss_mask == [1] * 5
    # a target of at least every request: nothing is cut
    assert cut_by_tokens(eps, 6) == ([(i, e) for i, e in enumerate(eps)], [])
    assert cut_by_tokens(eps, 60)[1] == []
    assert cut_by_tokens([], 4) == ([], [])


def test_a_cut_never_ends_at_or_inside_environment_tokens():
    # model call "!x⏎" (3 tokens), env line (2 tokens, mask 0), model answer (3 tokens)
    mask = [1, 1, 1, 0, 0, 1, 1, 1]
    eps = [ep(2), ep(8, mask), ep(8, mask), ep(8, mask)]
    for target_len, want in ((2, 2), (3, 2), (4, 2), (5, 2), (6, 6)):
        eps[0] = ep(target_len)
        _, partials = cut_by_tokens(eps, 1)
        cut = {len(p.output_ids) for _, p in partials}
        # T = 3: the cut would end right after the call's newline (the tool never ran): back to before it;
        # T = 4, 5: inside the env line: back to before the call's newline too; T = 6: inside the answer, kept
        assert cut == {want}, (target_len, cut)
        for _, p in partials:
            assert p.loss_mask == mask[:want]


def test_a_cut_partial_keeps_the_guard_verdicts_of_the_calls_it_keeps_only():
    # call 1 "!a⏎" → env run (blocked), call 2 "!b⏎" → env run (allowed), answer: 3+2+3+2+3 = 13 tokens
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    long = ep(13, mask)
    long.call_blocked = [True, False]
    assert long.blocked_calls == 1
    for target_len, want_len, want_verdicts in ((2, 2, []), (5, 2, []), (6, 6, [True]), (9, 7, [True]),
                                                (11, 11, [True, False])):
        _, partials = cut_by_tokens([ep(target_len), long], 1)
        (_, p), = partials
        # T = 9: inside call 2's output: back to before its newline, so call 2 reruns (and is judged again) on resume
        assert (len(p.output_ids), p.call_blocked) == (want_len, want_verdicts), target_len
        assert p.blocked_calls == sum(want_verdicts)
    finished, _ = cut_by_tokens([long], 1)
    assert finished[0][1].call_blocked == [True, False]  # a finished episode keeps every verdict


def test_unfinished_episodes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"episodes \[1\] did not finish .*'abort'"):
        cut_by_tokens([ep(2), ep(3, reason="abort")], 1)
    with pytest.raises(ValueError, match="batch_target must be >= 1"):
        cut_by_tokens([ep(2)], 0)


def test_call_seeds_are_stable_distinct_and_in_the_protocol_range():
    # pinned: the same in every process and on every machine (Python's own str hash is salted per process)
    assert seed_for(0, "reverse-00000001-v3-0") == 8970942452515764721
    seeds = {seed_for(s, f"reverse-{i:08d}-v{v}-{t}") for s in (0, 1) for i in range(50) for v in range(3)
             for t in range(2)}
    assert len(seeds) == 2 * 50 * 3 * 2  # every (run seed, sample, version, turn) draws its own stream
    assert all(0 <= x < 2**63 for x in seeds)
