"""Long-answer domains: every correct answer is 40 or more characters (= tokens of the char tokenizer), and the
reward reads the whole answer, with partial credit where it is natural.

They exist for the merge comparison of issue 56: on-policy distillation should beat offline distillation and mixed
RL where answers are long, since a student trained on its teachers' tokens drifts into states they never showed it
only over many tokens. Each output position is a short function of a few inputs (tasks the small presets can learn),
so RL has room above an under-trained base. Difficulty d lengthens the answer (`min_answer_chars` and up).

* `prefix_mod` — a worked multi-step computation whose intermediate results are checked: the running digit sum
  modulo 10 after each digit. A step is right when it follows from the step before it (`step_credit`), so one slip
  does not zero every later step.
* `cycle_walk` — the same kind of computation, learnable by `tiny`: each step is the letter after the previous step's
  in a cycle of letters the prompt gives; credit per step.
* `rle_expand` — a long sequence produced step by step: run-length expansion, credit per run.
* `record` — a structured record to fill: named fields from positional values, credit per field.

Reward: exact match of `response.strip()` = 1.0; otherwise partial credit weighted 0.5 (below any exact answer),
divided by the longer of the two lengths so extra or missing output counts as wrong. Each domain also says where in
the answer its credit was earned (`credit`: per step, position or field), so the specialist's PPO gets it on the
tokens that earned it (`specialists.step_credit`): with the whole reward on the last of 40+ tokens, PPO from a
`tiny` base did not move these domains in 400 steps (docs/results.md#long).
"""
from __future__ import annotations

import random
import re
from typing import ClassVar

from domains.base import Domain, Example
from domains.builtin.text import LOWER, _word

MIN_ANSWER_CHARS = 40  # issue 56: a long answer is at least this many tokens
PARTIAL = 0.5  # the weight of partial credit, as `positional_credit`'s


class _LongAnswer(Domain):
    """Shared sizing: answers of `MIN_ANSWER_CHARS` to `MIN_ANSWER_CHARS + 4 (d - 1) + 3` characters."""

    long_answer: ClassVar[bool] = True

    def setup(self) -> None:
        self.min_chars = MIN_ANSWER_CHARS + 4 * (self.difficulty - 1)
        self.max_answer_chars = self.min_chars + 3

    def token_budget(self, tokenizer) -> int:
        """The answer budget in tokens (`infra.chat.token_budget`), which the short domains take from the config's
        `max_new_tokens` (16 in the demo): the longest answer plus 8 for EOS and format. An answer is printable ASCII,
        so no tokenizer (char or byte-level BPE) needs more tokens than it has characters."""
        return self.max_answer_chars + 8


def step_marks(digits: str, response: str, modulus: int = 10) -> list[float]:
    """`prefix_mod`'s partial credit per character of the raw `response` (`Domain.credit`): step i of the stripped
    response is right when it is `(previous step + digits[i]) % modulus` (the step before the first read as 0),
    whatever the steps before it were, so a single slip costs one step; a right step earns
    `PARTIAL / max(len(digits), len(stripped))` on its character. A character that is not a digit below `modulus`
    is a wrong step, and the step after it is read from 0."""
    stripped = response.strip()
    lead = len(response) - len(response.lstrip())
    marks = [0.0] * len(response)
    longest = max(len(digits), len(stripped))
    prev = 0
    for i, (d, r) in enumerate(zip(digits, stripped)):
        if r not in "0123456789"[:modulus]:  # str.isdigit would let "²" through to int()
            prev = 0
            continue
        if int(r) == (prev + int(d)) % modulus:
            marks[lead + i] = PARTIAL / longest
        prev = int(r)
    return marks


def step_credit(digits: str, response: str, modulus: int = 10) -> float:
    """Partial credit of a running sum (`prefix_mod`): the sum of `step_marks`, `PARTIAL` × right steps / the
    longer length."""
    return sum(step_marks(digits, response, modulus))


class PrefixMod(_LongAnswer):
    """`pmd:1201...=` → `1001...`: after each digit, the sum of the digits so far modulo `modulus` (3 by default,
    digits 0-2: 1, 1+2 = 3 → 0, 0+0 = 0, 0+1 = 1: `1001` for `1201`; `modulus: 10` with digits 0-9 is the
    decimal running sum, which the tiny presets do not learn). As many digits in as out: 40 to 43 at d = 1, 4 more
    per difficulty step. Partial credit per step (`step_marks`), placed on each step's token (`credit`)."""

    name, tag = "prefix_mod", "pmd"
    description = "Running digit sum modulo 3 (param modulus) after each digit of a 40+ digit string (40 to 43 at d = 1)."
    defaults: ClassVar[dict] = {"modulus": 3}

    def setup(self) -> None:
        super().setup()
        m = self.params["modulus"]
        if isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= 10:
            raise ValueError(f"domain {self.name!r}: param modulus must be an int in [2, 10], got {m!r}")
        self.modulus = m

    def running(self, digits: str) -> str:
        out, total = [], 0
        for d in digits:
            total = (total + int(d)) % self.modulus
            out.append(str(total))
        return "".join(out)

    def generate(self, rng: random.Random) -> Example:
        alphabet = "0123456789"[:self.modulus]
        digits = "".join(rng.choice(alphabet) for _ in range(rng.randint(self.min_chars, self.max_answer_chars)))
        return self.make(digits, self.running(digits))

    def digits(self, example: Example) -> str:
        return example.prompt[len(self.tag) + 1:-1]

    def score(self, example: Example, response: str) -> float:
        if response.strip() == example.answer:
            return 1.0
        return step_credit(self.digits(example), response, self.modulus)

    def credit(self, example: Example, response: str) -> list[float]:
        return step_marks(self.digits(example), response, self.modulus)


class CycleWalk(_LongAnswer):
    """`cyc:mzgtfhue,z,40=` → `gtfhuemzgtfh...`: walk a cycle of distinct letters from the start letter, one letter per
    step (each step's letter is the one after the previous step's in the cycle, the last wrapping to the first), for
    the number of steps the prompt ends with: 40 at d = 1 (4 more per difficulty step). The cycle has 8 letters (+1 per 3 difficulty steps). A
    worked multi-step computation a `tiny` model learns in part: each step reads only the previous step and the cycle.
    Credit per step (`credit`): a step is right when it follows the response's own previous letter, so a walk that
    goes on from a slip loses only the slip."""

    name, tag = "cycle_walk", "cyc"
    description = "Walk a cycle of 8 distinct letters from a start letter for 40 steps (4 more per difficulty step)."

    def setup(self) -> None:
        super().setup()
        self.max_answer_chars = self.min_chars  # one length per difficulty: the model can learn where to stop
        self.cycle_len = 8 + (self.difficulty - 1) // 3

    def generate(self, rng: random.Random) -> Example:
        cycle = rng.sample(LOWER, self.cycle_len)
        start = rng.randrange(self.cycle_len)
        walk = "".join(cycle[(start + i) % self.cycle_len] for i in range(1, self.min_chars + 1))
        return self.make(f"{''.join(cycle)},{cycle[start]},{self.min_chars}", walk)

    @staticmethod
    def parts(example: Example) -> tuple[str, str]:
        """(the cycle, the start letter) of `example`'s prompt."""
        cycle, start, _steps = example.prompt.split(":", 1)[1][:-1].split(",")
        return cycle, start

    def score(self, example: Example, response: str) -> float:
        if response.strip() == example.answer:
            return 1.0
        return sum(self.credit(example, response))

    def credit(self, example: Example, response: str) -> list[float]:
        """`PARTIAL / max(len(answer), len(stripped))` on each step that is the cycle's successor of the step before
        it (the start letter before the first); a letter off the cycle is a wrong step, and so is the one after it."""
        cycle, prev = self.parts(example)
        stripped = response.strip()
        lead = len(response) - len(response.lstrip())
        marks = [0.0] * len(response)
        longest = max(len(example.answer), len(stripped))
        for i, r in enumerate(stripped[:len(example.answer)]):
            if prev in cycle and r == cycle[(cycle.index(prev) + 1) % len(cycle)]:
                marks[lead + i] = PARTIAL / longest
            prev = r
        return marks


class RleExpand(_LongAnswer):
    """`rlx:a3b2c4=` → `aaabbcccc`: each letter repeated its count (2 to 5) times, run after run, until the answer
    is 40 to 43 characters at d = 1 (the last count is cut to fit; 4 more per difficulty step). Neighbouring runs use
    different letters. Credit per run: `PARTIAL` × runs right in place (run i of the response, a maximal run of one
    character, has run i's letter and count) / the larger run count, on each right run's last character. Per run,
    not per position: a miscounted run costs that run, where positional credit would also take every later
    position, shifted by one (a tiny base miscounts by one in most answers, and PPO did not learn from positions)."""

    name, tag = "rle_expand", "rlx"
    description = "Expand a run-length code (letter, count 2-5) into a 40+ character string (40 to 43 at d = 1)."

    def generate(self, rng: random.Random) -> Example:
        target = rng.randint(self.min_chars, self.max_answer_chars)
        runs: list[tuple[str, int]] = []
        total = 0
        while total < target:
            letter = rng.choice([c for c in LOWER if not runs or c != runs[-1][0]])
            n = min(rng.randint(2, 5), target - total)
            if n < 2 and runs:  # a run of one would be legal but rare: give the rest to the previous run instead
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((letter, n))
            total += n
        return self.make("".join(f"{c}{n}" for c, n in runs), "".join(c * n for c, n in runs))

    @staticmethod
    def runs(text: str) -> list[tuple[str, int, int]]:
        """The maximal runs of one character in `text`: (character, length, index of its last character)."""
        return [(m.group(1), len(m.group()), m.end() - 1) for m in re.finditer(r"(.)\1*", text, re.S)]

    def score(self, example: Example, response: str) -> float:
        if response.strip() == example.answer:
            return 1.0
        return sum(self.credit(example, response))

    def credit(self, example: Example, response: str) -> list[float]:
        want, got = self.runs(example.answer), self.runs(response.strip())
        lead = len(response) - len(response.lstrip())
        marks = [0.0] * len(response)
        for (wc, wn, _), (gc, gn, end) in zip(want, got):
            if (wc, wn) == (gc, gn):
                marks[lead + end] = PARTIAL / max(len(want), len(got))
        return marks


class Record(_LongAnswer):
    """`rec:ann,7,rome;bob,12,oslo=` → `name:ann age:7 city:rome|name:bob age:12 city:oslo`: each `;`-separated
    row of values (a name of 3-4 letters, an age 1-99, a city of 3-5 letters) filled into a record with named fields,
    records joined by `|`. Rows are added until the answer is at least 40 characters at d = 1 (two rows), 4 more per
    difficulty step. Credit per field: `PARTIAL` × fields right in place (record i, field j: its `key:value` exactly)
    / the larger field count."""

    name, tag = "record", "rec"
    description = "Fill name/age/city records from rows of values; 40+ character answers (2 rows or more at d = 1)."
    FIELDS: ClassVar[tuple[str, ...]] = ("name", "age", "city")

    def setup(self) -> None:
        super().setup()
        # one row is at most len("name:abcd age:99 city:abcde") = 27 characters, + 1 for the `|`
        self.max_answer_chars = self.min_chars + 27

    @classmethod
    def fill(cls, rows: list[tuple[str, str, str]]) -> str:
        return "|".join(" ".join(f"{k}:{v}" for k, v in zip(cls.FIELDS, row)) for row in rows)

    def generate(self, rng: random.Random) -> Example:
        rows: list[tuple[str, str, str]] = []
        while not rows or len(self.fill(rows)) < self.min_chars:
            rows.append((_word(rng, LOWER, 3, 4), str(rng.randint(1, 99)), _word(rng, LOWER, 3, 5)))
        return self.make(";".join(",".join(r) for r in rows), self.fill(rows))

    @staticmethod
    def fields(text: str) -> list[str]:
        """`key:value` tokens in order, record after record."""
        return [f for rec in text.split("|") for f in rec.split(" ") if f]

    def score(self, example: Example, response: str) -> float:
        response = response.strip()
        if response == example.answer:
            return 1.0
        want, got = self.fields(example.answer), self.fields(response)
        return PARTIAL * sum(w == g for w, g in zip(want, got)) / max(len(want), len(got), 1)

    def credit(self, example: Example, response: str) -> list[float]:
        """Each right field's credit on its last character (the fields found as `fields` finds them)."""
        want = self.fields(example.answer)
        got = list(re.finditer(r"[^| ]+", response.strip()))
        lead = len(response) - len(response.lstrip())
        marks = [0.0] * len(response)
        for w, g in zip(want, got):
            if w == g.group():
                marks[lead + g.end() - 1] = PARTIAL / max(len(want), len(got), 1)
        return marks
