"""The pure arithmetic of model rewards (`domains/model_reward.py`): a reward model's raw score to a [0, 1] reward,
the length control, and a rubric judge's answer to a score. No I/O; hand-derived tests in
tests/unit/test_reward_math.py.

Normalisation. A Bradley–Terry reward model's raw score r is defined up to a shift (only differences are trained),
so a raw score means nothing on its own; σ(r_a − r_b) is the model's probability that a beats b.

    training (`normalize: batch`, the default):  u_i = σ((r_i − mean(r)) / std(r))   over the step's batch
    training (`normalize: sigmoid`) and every evaluation:  u_i = σ(r_i)

Batch z-scoring removes the shift and the scale the reward model happens to have, and keeps the batch's order (PPO
whitens its advantages anyway); a batch whose scores are all equal (std 0) gets 0.5 everywhere: no preference, no
signal. Evaluation needs a number comparable across stages (base, specialist, student are scored in separate
batches), so it uses the fixed σ(r): its mean moves only when the scores do.

Length control: u − λ · max(0, tokens − free) / budget, clamped to [0, 1]; λ = `reward.length_penalty`, free =
`reward.length_free` (tokens an answer may take at no charge: a reward model that pays for length is then held
back only where answers outgrow what the task needs, not on every token of a right answer).
"""
from __future__ import annotations

import math
import re
from typing import Sequence


class JudgeScoreError(ValueError):
    """A judge's answer holds no score that can be read."""


def sigmoid(x: float) -> float:
    """σ(x) = 1 / (1 + e^−x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def batch_normalized(raw: Sequence[float]) -> list[float]:
    """σ of each score's z-score over `raw` (population std); all 0.5 when the scores are all equal."""
    n = len(raw)
    if n == 0:
        return []
    mean = sum(raw) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / n)
    if std < 1e-12:
        return [0.5] * n
    return [sigmoid((r - mean) / std) for r in raw]


def normalized(raw: Sequence[float], how: str) -> list[float]:
    """`raw` reward-model scores as [0, 1] rewards: `batch` (z-score over `raw`, then σ) or `sigmoid` (σ of each)."""
    if how == "batch":
        return batch_normalized(raw)
    if how == "sigmoid":
        return [sigmoid(r) for r in raw]
    raise ValueError(f"normalize must be 'batch' or 'sigmoid', got {how!r}")


def length_penalized(rewards: Sequence[float], lengths: Sequence[int], budget: int, penalty: float,
                     free: int = 0) -> list[float]:
    """Each reward minus `penalty` × (its response's tokens beyond `free`) / `budget`, clamped to [0, 1]; unchanged
    at penalty 0."""
    if len(rewards) != len(lengths):
        raise ValueError(f"length_penalized: {len(rewards)} rewards for {len(lengths)} lengths")
    if penalty == 0:
        return list(rewards)
    b = max(int(budget), 1)
    return [min(1.0, max(0.0, r - penalty * max(0, n - free) / b)) for r, n in zip(rewards, lengths)]


# "Score: 7/10", "score = 0.8", "**Score:** 7 out of 10", "Rating: 3/5"; the last such mention decides
_SCORE_RE = re.compile(r"(?:score|rating|grade)\W{0,4}\s*(-?\d+(?:\.\d+)?)\s*(?:(?:/|out of)\s*(\d+(?:\.\d+)?))?",
                       re.I)
_THINK_RE = re.compile(r"<think>.*?</think>", re.S | re.I)


def parse_judge_score(text: object, scale: int) -> float:
    """A judge's answer → its score in [0, 1]: the last "Score: N" (or "Score: N/M", "N out of M"; also "Rating",
    "Grade"; case and markdown tolerated) after any `<think>…</think>`, read as N/M, or N/`scale` when no M is
    given. Raises `JudgeScoreError` when there is none, when M is 0, or when N is outside [0, M]: a judge that
    does not follow the format is an error to count, never a 0."""
    if not isinstance(text, str):
        raise JudgeScoreError(f"the judge's answer is {type(text).__name__}, not text")
    body = _THINK_RE.sub(" ", text)
    found = _SCORE_RE.findall(body)
    if not found:
        raise JudgeScoreError(f"no 'Score: N/{scale}' in the judge's answer {text[:200]!r}")
    num, den = found[-1]
    top = float(den) if den else float(scale)
    value = float(num)
    if top <= 0 or not 0 <= value <= top:
        raise JudgeScoreError(f"score {num}/{den or scale} is outside [0, {den or scale}] in {text[:200]!r}")
    return value / top


def fill_unparsed(values: Sequence[float | None]) -> list[float]:
    """A judged batch's rewards with each unparseable sample (None) given the mean of the parsed ones: no
    preference either way (the judge said nothing about it). All None: ValueError."""
    parsed = [v for v in values if v is not None]
    if not parsed:
        raise ValueError("no sample of the batch has a parseable judge score")
    mean = sum(parsed) / len(parsed)
    return [mean if v is None else float(v) for v in values]
