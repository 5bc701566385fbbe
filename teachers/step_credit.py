"""Step credit: a domain's partial credit placed on the tokens that earned it (`specialists.step_credit`).

A long answer's reward read only at its end tells PPO that *something* in 40 tokens was wrong, not what: the
advantage of every early token is the whole trajectory's noise. A domain whose partial credit is a sum over parts
of the answer (steps of a computation, positions, fields) says where each part sits (`Domain.credit`: one value
per character of the response); this module turns that into one value per output token, which `build_batch`
aligns and `ppo_math.token_rewards` adds to the per-token rewards, putting the rest of the reward on the last token.
The trajectory's return is unchanged, so the objective is the same; only the variance of the advantages falls.

    rewards = sample_rewards(domain, samples, text)      the whole reward per trajectory, as always
    attach_step_credit(domain, samples, rewards, tok, stops)   Sample.step_credit, where the domain gives one

No credit is attached to a trajectory whose reward the guard zeroed (a blocked call), to multi-turn episodes (their
output holds environment tokens), or when the domain's values are not a valid split of its reward (negative,
non-finite, wrong length, or summing above it): those keep the whole reward at the end.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from domains.base import Example
from infra.chat import response_text

_SLACK = 1e-9  # float sums of per-character credit may exceed the score by rounding


def token_credit(char_credit: Sequence[float], output_ids: Sequence[int], decode: Callable[[list[int]], str],
                 stop_ids: int | Sequence[int]) -> list[float]:
    """Per output token, the sum of `char_credit` over the characters it decodes to: token i holds the characters
    `[len(decode(ids[:i])), len(decode(ids[:i + 1])))` of the response text (before the first stop id). Lengths are
    made non-decreasing (a byte-level token that ends inside a multi-byte character decodes to a replacement char
    until the character is complete) and cut at the text's length; credit on characters no token reaches stays off
    the list (the caller's terminal reward carries it). Tokens from the first stop id on get 0.

    char_credit: (C,) one value per character of the response text; output_ids: (O,) → (O,) floats."""
    stops = {int(stop_ids)} if isinstance(stop_ids, int) else {int(t) for t in stop_ids}
    ids = [int(t) for t in output_ids]
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    out = [0.0] * len(ids)
    start = 0
    for i in range(cut):
        end = min(max(start, len(decode(ids[:i + 1]))), len(char_credit))
        out[i] = float(sum(char_credit[start:end]))
        start = end
    return out


def valid_credit(marks: object, response: str, reward: float) -> bool:
    """Whether `marks` (a domain's `credit`) splits `reward` of `response`: one finite value ≥ 0 per character,
    summing to at most the reward."""
    if not isinstance(marks, (list, tuple)) or len(marks) != len(response):
        return False
    try:
        values = [float(m) for m in marks]
    except (TypeError, ValueError):
        return False
    return all(math.isfinite(v) and v >= 0.0 for v in values) and sum(values) <= reward + _SLACK


def attach_step_credit(domain, samples: Sequence, rewards: Sequence[float], tokenizer,
                       stop_ids: int | Sequence[int]) -> int:
    """Set `Sample.step_credit` on each of `samples` whose domain places its reward (`domain.credit`); returns how
    many got it. `rewards` are the samples' whole rewards (`sample_rewards`), 0 for a blocked call."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 (as response_text decodes)
    n = 0
    for s, reward in zip(samples, rewards):
        if reward <= 0.0 or s.blocked_calls or 0 in s.loss_mask:  # a 0 in the mask: an env token, multi-turn
            continue
        text = response_text(tokenizer, s.output_ids, stop_ids)
        try:
            marks = domain.credit(Example(**s.example), text)
        except Exception:  # a plugin's credit bug costs its samples the step credit, never the training step
            continue
        if marks is None or not valid_credit(marks, text, reward):
            continue
        s.step_credit = token_credit(marks, s.output_ids, decode, stop_ids)
        n += 1
    return n
