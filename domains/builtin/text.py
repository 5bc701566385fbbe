"""String domains: reverse, copy, sort digits, case swap, Caesar shift, count a character, balanced brackets.

Strings have length 2..d+3 unless noted (2 to 4 characters at d = 1). Reward: exact match of `response.strip()`
= 1.0. The transformations (reverse, copy, sort_digits, case_swap, caesar) give positional partial credit below 0.5
(see `positional_credit`): a denser signal for RL on outputs that are right character by character, placed on the
characters that earned it (`credit`, `specialists.step_credit`). Counting and
yes/no answers are exact only (partial credit there would reward guessing).
"""
from __future__ import annotations

import math
import random
import string

from domains.base import Domain, Example, positional_credit, positional_marks

LOWER = string.ascii_lowercase
LETTERS = string.ascii_letters


def _word(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    """A random string over `alphabet` with a length uniform in [lo, hi]."""
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


class _Transform(Domain):
    """A string → string task over length min_len..d+3 inputs, with positional partial credit."""

    alphabet = LOWER
    min_len = 2

    def setup(self) -> None:
        self.max_len = self.difficulty + 3
        self.max_answer_chars = self.max_len

    def transform(self, s: str) -> str:
        raise NotImplementedError

    def generate(self, rng: random.Random) -> Example:
        s = _word(rng, self.alphabet, self.min_len, self.max_len)
        return self.make(s, self.transform(s))

    def score(self, example: Example, response: str) -> float:
        return positional_credit(example.answer, response.strip())

    def credit(self, example: Example, response: str) -> list[float]:
        """The positional credit on the characters that earned it (`specialists.step_credit`)."""
        return positional_marks(example.answer, response)


class Reverse(_Transform):
    """`rev:abcd=` → `dcba`."""

    name, tag = "reverse", "rev"
    description = "Reverse a lowercase string of length 2 to d+3."

    def transform(self, s: str) -> str:
        return s[::-1]


class Copy(_Transform):
    """`cpy:abcd=` → `abcd` (the easiest domain: a sanity check for every stage)."""

    name, tag = "copy", "cpy"
    description = "Copy a lowercase string of length 2 to d+3."

    def transform(self, s: str) -> str:
        return s


class SortDigits(_Transform):
    """`srt:3141=` → `1134`."""

    name, tag = "sort_digits", "srt"
    description = "Sort the digits of a 2 to d+3 digit string in ascending order."
    alphabet = string.digits

    def transform(self, s: str) -> str:
        return "".join(sorted(s))


class CaseSwap(_Transform):
    """`swp:aBcD=` → `AbCd`."""

    name, tag = "case_swap", "swp"
    description = "Swap upper and lower case of a mixed-case letter string of length 2 to d+3."
    alphabet = LETTERS

    def transform(self, s: str) -> str:
        return s.swapcase()


class Caesar(_Transform):
    """`csr:1:abz=` → `bca`: shift each lowercase letter forward by k, wrapping z → a.

    k is drawn from 1..min(25, 2d+1) per example (1..3 at d = 1), or fixed with the `shift` param; it is always part
    of the prompt so one model can learn every shift.
    """

    name, tag = "caesar", "csr"
    description = "Caesar shift of a lowercase string (length 2 to d+3) by the k given in the prompt."
    defaults = {"shift": None}

    def setup(self) -> None:
        super().setup()
        shift = self.params["shift"]
        if shift is not None and (isinstance(shift, bool) or not isinstance(shift, int) or not 1 <= shift <= 25):
            raise ValueError(f"domain {self.name!r}: param 'shift' must be an int in [1, 25] or null, got {shift!r}")
        self.max_shift = min(25, 2 * self.difficulty + 1)

    @staticmethod
    def shift_text(s: str, k: int) -> str:
        return "".join(LOWER[(LOWER.index(c) + k) % 26] for c in s)

    def generate(self, rng: random.Random) -> Example:
        k = self.params["shift"] or rng.randint(1, self.max_shift)
        s = _word(rng, LOWER, 2, self.max_len)
        return self.make(f"{k}:{s}", self.shift_text(s, k))


class CountChar(Domain):
    """`cnt:a:abcab=` → `2`. The string has length 4..d+6 over the first d+2 letters (`abc` at d = 1), so the
    counted letter is common and the count varies."""

    name, tag = "count_char", "cnt"
    description = "How many times a letter occurs in a string of length 4 to d+6 over the first d+2 letters."

    def setup(self) -> None:
        self.alphabet = LOWER[: self.difficulty + 2]
        self.max_len = self.difficulty + 6
        self.max_answer_chars = len(str(self.max_len))

    def generate(self, rng: random.Random) -> Example:
        target = rng.choice(self.alphabet)
        s = _word(rng, self.alphabet, 4, self.max_len)
        return self.make(f"{target}:{s}", str(s.count(target)))

    def score(self, example: Example, response: str) -> float:
        return 1.0 if response.strip() == example.answer else 0.0


BRACKETS = "()[]{}"
CLOSE_TO_OPEN = {")": "(", "]": "[", "}": "{"}


def is_balanced(s: str) -> bool:
    """Whether every bracket closes the most recent open one of the same kind: '([]{})' yes, '([)]' no."""
    stack: list[str] = []
    for c in s:
        if c in CLOSE_TO_OPEN:
            if not stack or stack.pop() != CLOSE_TO_OPEN[c]:
                return False
        elif c in BRACKETS:
            stack.append(c)
    return not stack


class Brackets(Domain):
    """`bal:([]{})=` → `yes`, `bal:([)]=` → `no`. Strings of 1..d+4 bracket pairs over `()[]{}` (length ≤ 10 at
    d = 1). Three kinds, because with fewer the balanced strings of length ≤ 10 number only ~1,600 and the yes
    class would run out before the default 2,000 train examples.

    Half the draws are balanced; the other half are a balanced string with one character replaced, a near miss
    that is always unbalanced (an open↔close flip breaks the counts, a kind change breaks the matching pair) and has
    the same even length, so parity gives nothing away. The answer is computed by `is_balanced` either way.

    The balanced string is **uniform over all balanced strings of up to d+4 pairs** (k pairs with weight
    Catalan(k)·3^k, then a uniform Dyck word and uniform kinds). A skewed draw makes the distinct-prompt splits
    (`Domain.split`) depend on their size: the few common "yes" prompts run out and the larger a split, or the
    smaller its hash bucket, the fewer "yes" answers it holds (with the old draw: eval 56% yes at n = 200, 44% at
    n = 1000, the 5% val bucket 39% at n = 200, so a constant "no" validated 0.61 and scored 0.44 on eval).
    """

    name, tag = "brackets", "bal"
    description = "Is a string of (), [] and {} brackets balanced? Answer yes or no."
    max_answer_chars = 3
    KINDS = ("()", "[]", "{}")

    def setup(self) -> None:
        self.max_pairs = self.difficulty + 4
        # the number of balanced strings of k pairs: Catalan(k) bracketings times a kind per pair
        self.pair_weights = [math.comb(2 * k, k) // (k + 1) * len(self.KINDS) ** k
                             for k in range(1, self.max_pairs + 1)]

    def _balanced(self, rng: random.Random, n_pairs: int) -> list[str]:
        """A uniform random balanced string of `n_pairs` pairs, as a list of chars: a uniform Dyck word (shuffle
        n opens and n closes, keep the first shuffle that never closes more than it opened: every Dyck word is equally
        likely, accepted with probability 1/(n+1)), then a uniform kind for each pair."""
        steps = [1] * n_pairs + [-1] * n_pairs
        while True:
            rng.shuffle(steps)
            depth = 0
            for step in steps:
                depth += step
                if depth < 0:
                    break
            else:
                break
        out, stack = [], []
        for step in steps:
            if step > 0:
                open_, close = rng.choice(self.KINDS)
                out.append(open_)
                stack.append(close)
            else:
                out.append(stack.pop())
        return out

    def generate(self, rng: random.Random) -> Example:
        n_pairs = rng.choices(range(1, self.max_pairs + 1), weights=self.pair_weights)[0]
        chars = self._balanced(rng, n_pairs)
        if rng.random() < 0.5:
            i = rng.randrange(len(chars))
            chars[i] = rng.choice([c for c in BRACKETS if c != chars[i]])
        s = "".join(chars)
        return self.make(s, "yes" if is_balanced(s) else "no")

    def score(self, example: Example, response: str) -> float:
        return 1.0 if response.strip() == example.answer else 0.0
