"""The domain interface: a seeded prompt generator with a disjoint train/eval split, and a verifier.

A domain is a small verifiable task (`add:12+34=` → `46`). Subclasses implement two methods:

* `generate(rng) -> Example`: one random example. The answer must be a function of the prompt.
* `score(example, response) -> float`: the reward of a model response in [0, 1] (1.0 = exactly right).

Everything else is shared and lives here: parameter validation, `verify` (the never-raising, clamped wrapper that
trainers and evaluation call), and `split` (n distinct examples of one of three splits, chosen by the sha256 of the
prompt: *eval* is a fixed 20% bucket, *val* a fixed 5% bucket, *train* the other 75%; disjoint by construction, for
every seed, and val and eval draw from the same generator distribution).
"""
from __future__ import annotations

import hashlib
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

SPLITS = ("train", "val", "eval")
EVAL_BUCKETS = 5  # eval = bucket 0 of 5 → 20% of the prompt space is held out for the final measurement
VAL_BUCKETS = 20  # val = bucket 1 of 20 (never eval: 1 % 5 != 0) → 5% held out for model selection during training
MAX_BAD_ROWS = 20  # `split` stops drawing after this many malformed rows and reports them all in one ValueError


@dataclass(frozen=True)
class Example:
    domain: str
    prompt: str  # what the model sees, e.g. "add:12+34="
    answer: str  # the exact target completion, e.g. "46"
    difficulty: int
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # optional extras; not part of identity


def prompt_split(prompt: str) -> str:
    """The split a prompt belongs to, from a stable hash (sha256, not Python's salted `hash`): "eval" if it falls in
    bucket 0 of 5, else "val" if in bucket 1 of 20, else "train". (Eval membership is the same as before the val split
    existed, so eval scores stay comparable across versions.)"""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    if h % EVAL_BUCKETS == 0:
        return "eval"
    return "val" if h % VAL_BUCKETS == 1 else "train"


def is_eval_prompt(prompt: str) -> bool:
    """Whether a prompt belongs to the eval split."""
    return prompt_split(prompt) == "eval"


def positional_credit(answer: str, response: str, weight: float = 0.5) -> float:
    """Partial credit for string answers: 1.0 if `response == answer`, else
    `weight * #{i : response[i] == answer[i]} / max(len(answer), len(response))`.

    Dividing by the longer length caps wrong-length responses (extra or missing characters count as wrong),
    and `weight < 1` keeps every near miss well below an exact match.
    """
    if response == answer:
        return 1.0
    longest = max(len(answer), len(response))
    if longest == 0:
        return 0.0
    matches = sum(a == r for a, r in zip(answer, response))
    return weight * matches / longest


def positional_marks(answer: str, response: str, weight: float = 0.5) -> list[float]:
    """Where `positional_credit(answer, response.strip())` was earned, per character of the raw `response`
    (`Domain.credit`): `weight / max(len(answer), len(stripped))` on each character of the stripped response that
    matches `answer` at its position, 0 elsewhere. The marks sum to the partial credit; for an exact answer they sum
    to `weight` and the rest of its 1.0 goes on the last token (teachers/step_credit.py)."""
    stripped = response.strip()
    lead = len(response) - len(response.lstrip())
    marks = [0.0] * len(response)
    longest = max(len(answer), len(stripped))
    for i, (a, r) in enumerate(zip(answer, stripped)):
        if a == r:
            marks[lead + i] = weight / longest
    return marks


def _clean_text(s: object) -> bool:
    """Non-empty printable ASCII without newlines (every character is one token of the char tokenizer)."""
    return isinstance(s, str) and len(s) > 0 and s.isascii() and s.isprintable()


class Domain(ABC):
    """Base class of every domain, built-in or plugin.

    Subclasses set the class attributes below, implement `generate` and `score`, and may override `setup()` to
    derive sizes from `self.difficulty` and `self.params` (raise ValueError naming the bad param there).
    """

    name: str = ""  # registry key, stamped on every Example (load_domain may set a config alias per instance)
    tag: ClassVar[str] = ""  # short prompt prefix, unique per domain: prompts look like f"{tag}:{body}="
    description: ClassVar[str] = ""
    max_answer_chars: int = 16  # upper bound on len(answer) at this instance's difficulty: the generation budget
    max_difficulty: ClassVar[int] = 10
    defaults: ClassVar[dict[str, Any]] = {}  # the accepted extra params and their default values
    # params added after a domain's examples were fixed: at their default they stay out of `split`'s seed, so adding
    # one does not move the existing examples (a non-default value seeds like any param)
    late_params: ClassVar[frozenset[str]] = frozenset()
    system: str = ""  # system message of this domain's prompts (chat templates); config: domains.<i>.system

    def __init__(self, difficulty: int = 1, **params: Any):
        cls = type(self).__name__
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"domain class {cls} must set a non-empty class attribute 'name'")
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= self.max_difficulty:
            raise ValueError(f"domain {self.name!r}: difficulty must be an int in [1, {self.max_difficulty}], "
                             f"got {difficulty!r}")
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"domain {self.name!r}: unknown param {', '.join(map(repr, unknown))} (allowed: {allowed})")
        self.difficulty = difficulty
        self.params: dict[str, Any] = {**self.defaults, **params}
        self.verifier_errors = 0  # exceptions (or non-finite scores) swallowed by `verify`
        self.setup()

    def setup(self) -> None:
        """Hook: validate params and derive sizes (e.g. `self.max_answer_chars`) from the difficulty."""

    # -- the two methods a domain implements ---------------------------------------------------------------------

    @abstractmethod
    def generate(self, rng: random.Random) -> Example:
        """One random example, drawn with `rng` only (so splits are reproducible)."""

    @abstractmethod
    def score(self, example: Example, response: str) -> float:
        """Reward of `response` (the raw completion text, without the prompt) in [0, 1]."""

    def credit(self, example: Example, response: str) -> list[float] | None:
        """Where in `response` its reward was earned, for domains whose partial credit comes from parts of the answer
        (steps, positions, fields): one value per character of `response`, each ≥ 0, summing to at most
        `score(example, response)`. The specialist trainer puts each value on the token that holds its character and
        the rest of the score on the last token (`specialists.step_credit`, teachers/step_credit.py): the return of
        a trajectory is unchanged, only when its parts arrive moves, which is what lets PPO tell which of 40 tokens
        was wrong. None (the default): the whole reward arrives at the end."""
        return None

    # -- shared behaviour -----------------------------------------------------------------------------------------

    def make(self, body: str, answer: str, **meta: Any) -> Example:
        """An Example of this domain with the standard prompt format `f"{tag}:{body}="`."""
        return Example(self.name, f"{self.tag}:{body}=", answer, self.difficulty, meta)

    @property
    def max_response_chars(self) -> int:
        """Responses longer than this score 0.0 without reaching `score` (a guard against pathological input)."""
        return 1024 + 16 * self.max_answer_chars

    def verify(self, example: Example, response: object) -> float:
        """The reward trainers and evaluation use: `score`, made safe. Never raises.

        Non-str or over-long responses → 0.0. An exception in `score`, or a score that is None/NaN/inf/not a number,
        → 0.0 and `self.verifier_errors += 1`. Otherwise the score clamped to [0, 1].
        """
        if not isinstance(response, str) or len(response) > self.max_response_chars:
            return 0.0
        try:
            value = float(self.score(example, response))
        except Exception:  # a verifier bug must not crash a training step; it is counted instead
            self.verifier_errors += 1
            return 0.0
        if not math.isfinite(value):
            self.verifier_errors += 1
            return 0.0
        return min(1.0, max(0.0, value))

    def is_correct(self, example: Example, response: object) -> bool:
        """Exact match: `response.strip() == example.answer` (the 0/1 accuracy, ignoring partial credit)."""
        return isinstance(response, str) and response.strip() == example.answer

    def demonstration(self, example: Example) -> str:
        """The full text SFT trains on: prompt followed by the answer (the trainer appends EOS)."""
        return example.prompt + example.answer

    def split(self, split: str, n: int, seed: int) -> list[Example]:
        """n distinct examples (distinct prompts) of the "train", "val" or "eval" split, deterministic in
        (name, split, n, seed, difficulty, params; `late_params` at their default excepted), and prefix-stable (the
        first k of n are `split(.., k, ..)`).

        Rejection sampling: draw, keep a prompt iff its hash bucket (`prompt_split`) is the split's and it is new.
        Draws are bounded (50·n + 5000 in all for train and eval, 200·n + 5000 for the 5% val bucket: ~10x what the
        bucket needs; and 20,000 in a row without a new example), so a prompt space too small for n distinct examples
        ends in a ValueError instead of a hang.

        Every drawn row is checked against the Example contract before it is used; the malformed ones are collected
        (up to MAX_BAD_ROWS) and reported together in one ValueError naming each by its 0-based draw number.
        """
        if split not in SPLITS:
            raise ValueError(f"domain {self.name!r}: split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"domain {self.name!r}: n must be a non-negative int, got {n!r}")
        # A str seed is hashed with sha512 by `random.seed`: stable across processes (unlike Python's hash).
        params = repr(sorted((k, v) for k, v in self.params.items()
                             if not (k in self.late_params and v == self.defaults[k])))
        rng = random.Random(f"{self.name}|{split}|{seed}|{self.difficulty}|{params}")
        seen: set[str] = set()
        out: list[Example] = []
        bad: list[tuple[int, object, str]] = []  # (draw number, row, problem) of every malformed row drawn
        max_attempts, max_stall = (200 if split == "val" else 50) * n + 5000, 20_000
        attempts = stall = 0
        while len(out) < n and attempts < max_attempts and stall < max_stall and len(bad) < MAX_BAD_ROWS:
            row, attempts, stall = attempts, attempts + 1, stall + 1
            ex = self.generate(rng)
            problem = self._check_example(ex)  # before reading `ex.prompt`: `ex` may not even be an Example
            if problem:
                bad.append((row, ex, problem))
                continue
            if ex.prompt in seen or prompt_split(ex.prompt) != split:
                continue
            stall = 0
            seen.add(ex.prompt)
            out.append(ex)
        if bad:
            raise ValueError(self._bad_rows_message(bad))
        if len(out) < n:
            raise ValueError(
                f"domain {self.name!r} (difficulty {self.difficulty}): found only {len(out)} distinct {split} examples "
                f"in {attempts} draws, {n} requested; the prompt space is too small, ask for fewer examples or raise "
                f"the difficulty")
        return out

    def _check_example(self, ex: object) -> str | None:
        """What is wrong with one generated row (it breaks the Example contract), or None if it is a good Example."""
        if not isinstance(ex, Example):
            return f"generate() returned {type(ex).__name__}, not Example"
        if not _clean_text(ex.prompt):
            return "prompt must be non-empty printable ASCII without newlines"
        if not _clean_text(ex.answer) or ex.answer != ex.answer.strip():
            return "answer must be non-empty printable ASCII without newlines or surrounding spaces"
        if len(ex.answer) > self.max_answer_chars:
            return f"answer is longer than max_answer_chars={self.max_answer_chars}"
        return None

    def _bad_rows_message(self, bad: list[tuple[int, object, str]]) -> str:
        """One message naming the domain and every malformed row by its 0-based draw number, e.g.
        "domain 'add': bad example at row 3: Example(...): prompt must be ..." (one row), or a header listing the rows
        followed by one "row i: <row>: <problem>" line each."""
        if len(bad) == 1:
            row, ex, problem = bad[0]
            return f"domain {self.name!r}: bad example at row {row}: {ex!r}: {problem}"
        more = " (stopped collecting there)" if len(bad) >= MAX_BAD_ROWS else ""
        rows = ", ".join(str(row) for row, _, _ in bad)
        lines = "".join(f"\n  row {row}: {ex!r}: {problem}" for row, ex, problem in bad)
        return (f"domain {self.name!r}: bad example at rows {rows}{more} (0-based draws of generate()); "
                f"each breaks the Example contract:{lines}")

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}(name={self.name!r}, difficulty={self.difficulty}{extra})"
