"""Numeric domains: addition, subtraction, multiplication, max of a list, digit sum mod 10, decimal → binary.

Numbers are written in plain decimal without leading zeros or signs (subtraction keeps a ≥ b, so answers are never
negative). Difficulty d sets the operand sizes; at d = 1 every prompt space holds ≥ 4,000 prompts, enough for the
default 2,000 train and a few hundred eval examples. Reward: exact match of `response.strip()` = 1.0, else 0.0,
except `binary`, which gives positional partial credit (see `positional_credit`). No partial credit for decimal
numbers: a near-miss number is simply wrong, and digit-level credit would mostly reward copying operand digits.
"""
from __future__ import annotations

import random

from domains.base import Domain, Example, positional_credit


class _ExactMatch(Domain):
    """Reward 1.0 iff the stripped response equals the answer exactly, else 0.0."""

    def score(self, example: Example, response: str) -> float:
        return 1.0 if response.strip() == example.answer else 0.0


class Addition(_ExactMatch):
    """`add:57+68=` → `125`. Operands uniform in [0, 10^(d+1)): two digits at d = 1."""

    name, tag = "addition", "add"
    description = "Sum of two non-negative integers with up to d+1 digits each."

    def setup(self) -> None:
        self.digits = self.difficulty + 1
        self.max_answer_chars = self.digits + 1

    def generate(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        return self.make(f"{a}+{b}", str(a + b))


class Subtraction(_ExactMatch):
    """`sub:68-57=` → `11`. Operands uniform in [0, 10^(d+1)), ordered so the result is ≥ 0."""

    name, tag = "subtraction", "sub"
    description = "Difference a-b of two non-negative integers with a >= b, up to d+1 digits each."

    def setup(self) -> None:
        self.digits = self.difficulty + 1
        self.max_answer_chars = self.digits

    def generate(self, rng: random.Random) -> Example:
        a, b = sorted((rng.randrange(10**self.digits), rng.randrange(10**self.digits)), reverse=True)
        return self.make(f"{a}-{b}", str(a - b))


class Multiplication(_ExactMatch):
    """`mul:123*7=` → `861`. a has up to d+2 digits, b up to ceil(d/2): 3-digit × 1-digit at d = 1."""

    name, tag = "multiplication", "mul"
    description = "Product of an integer with up to d+2 digits and one with up to ceil(d/2) digits."

    def setup(self) -> None:
        self.a_digits, self.b_digits = self.difficulty + 2, (self.difficulty + 1) // 2
        self.max_answer_chars = self.a_digits + self.b_digits

    def generate(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10**self.a_digits), rng.randrange(10**self.b_digits)
        return self.make(f"{a}*{b}", str(a * b))


class MaxList(_ExactMatch):
    """`max:3,9,1=` → `9`. 3..3+min(d, 5) numbers of up to ceil(d/2) digits: single digits at d = 1, 2."""

    name, tag = "max_list", "max"
    description = "Largest of a comma-separated list of 3 to 3+min(d,5) integers with up to ceil(d/2) digits."

    def setup(self) -> None:
        self.digits = (self.difficulty + 1) // 2
        self.max_len = 3 + min(self.difficulty, 5)  # capped: long lists add length, not new skill
        self.max_answer_chars = self.digits

    def generate(self, rng: random.Random) -> Example:
        xs = [rng.randrange(10**self.digits) for _ in range(rng.randint(3, self.max_len))]
        return self.make(",".join(map(str, xs)), str(max(xs)))


class DigitSum(_ExactMatch):
    """`dsm:4821=` → `5` (4+8+2+1 = 15, mod 10). A digit string of length 3..d+3."""

    name, tag = "digit_sum", "dsm"
    description = "Sum of the digits of a 3 to d+3 digit string, modulo 10 (a single-digit answer)."
    max_answer_chars = 1

    def setup(self) -> None:
        self.max_len = self.difficulty + 3

    def generate(self, rng: random.Random) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, self.max_len)))
        return self.make(digits, str(sum(map(int, digits)) % 10))


class ToBinary(Domain):
    """`bin:13=` → `1101`. n uniform in [0, 2^(10+2d)): up to 12 bits at d = 1 (the smallest space that still holds
    the default 2,000 train examples). Partial credit: positional, see `positional_credit`."""

    name, tag = "binary", "bin"
    description = "Decimal to binary (no prefix, no leading zeros) of an integer below 2^(10+2d)."

    def setup(self) -> None:
        self.bits = 10 + 2 * self.difficulty
        self.max_answer_chars = self.bits

    def generate(self, rng: random.Random) -> Example:
        n = rng.randrange(2**self.bits)
        return self.make(str(n), format(n, "b"))

    def score(self, example: Example, response: str) -> float:
        return positional_credit(example.answer, response.strip())
