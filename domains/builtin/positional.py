"""Positional string domains: rotate, swap adjacent pairs, interleave two words, collapse runs.

Each output character is a short, fixed function of a few input positions: tasks a small attention model can
represent, so RL has something to improve when the base is under-trained (the arithmetic domains need carries and
the tiny presets do not learn them; see the README's demo notes). Reward: exact match = 1.0, else positional partial
credit below 0.5 (`positional_credit`), like the other string transforms.
"""
from __future__ import annotations

import random

from domains.base import Example
from domains.builtin.text import LOWER, _Transform, _word


class Rotate(_Transform):
    """`rot:abcd=` → `bcda`: the first character moves to the end."""

    name, tag = "rotate", "rot"
    description = "Rotate a lowercase string of length 2 to d+3 left by one character."

    def transform(self, s: str) -> str:
        return s[1:] + s[:1]


class SwapPairs(_Transform):
    """`spr:abcde=` → `badce`: swap characters 0↔1, 2↔3, …; an odd last character stays."""

    name, tag = "swap_pairs", "spr"
    description = "Swap each adjacent pair of characters of a lowercase string of length 2 to d+3."

    def transform(self, s: str) -> str:
        return "".join(s[i + 1] + s[i] if i + 1 < len(s) else s[i] for i in range(0, len(s), 2))


class Interleave(_Transform):
    """`itl:abc,xyz=` → `axbycz`: two words of equal length 1..ceil((d+3)/2), alternated character by character."""

    name, tag = "interleave", "itl"
    description = "Interleave two equal-length lowercase words (1 to ceil((d+3)/2) letters each)."

    def setup(self) -> None:
        self.word_len = (self.difficulty + 4) // 2
        self.max_answer_chars = 2 * self.word_len

    def generate(self, rng: random.Random) -> Example:
        n = rng.randint(1, self.word_len)
        a, b = _word(rng, LOWER, n, n), _word(rng, LOWER, n, n)
        return self.make(f"{a},{b}", "".join(x + y for x, y in zip(a, b)))


class Dedupe(_Transform):
    """`ddp:aabccc=` → `abc`: each run of a repeated letter collapses to one. The string has length 3..d+6 over the
    first d+3 letters (`abcd` at d = 1: over 16,000 prompts), so runs are common."""

    name, tag = "dedupe", "ddp"
    description = "Collapse runs of repeated letters in a string of length 3 to d+6 over the first d+3 letters."
    min_len = 3

    def setup(self) -> None:
        self.alphabet = LOWER[: self.difficulty + 3]
        self.max_len = self.difficulty + 6
        self.max_answer_chars = self.max_len

    def transform(self, s: str) -> str:
        return "".join(c for i, c in enumerate(s) if i == 0 or s[i - 1] != c)
