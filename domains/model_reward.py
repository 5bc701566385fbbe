"""Rewards from a model (issue 54): a domain's `reward: {kind: model | judge}` (infra.config.RewardConfig) scored
through a served model, a whole batch per call.

    rewarders = rewarders_of(cfg, domains, tokenizer)         {domain: ModelRewarder | JudgeRewarder}
    batch = await rewarders[name].score(examples, responses, lengths, budget)
    batch.rewards        the training reward of each sample, in [0, 1]
    batch.scores         the evaluation reward of each (σ(raw) for a reward model; the judge's score; None: unparsed)

`ModelRewarder`: the reward model's `/classify` (SGLang's shape; the embedded server or SGLang) on the ids
`domains.preferences.reward_input_ids` renders, the one rendering the reward model was trained on, all of a batch in
`batch_size`-row requests sent at once; raw scores normalised as `domains/reward_math.py` says (per batch for
training, σ(raw) for evaluation), then the length control. `JudgeRewarder`: one `/v1/chat/completions` per sample
(at most `CONCURRENCY` at once) with the rubric as the system message and the prompt and response as the user's;
its answer's last "Score: N/M" is the reward (`parse_judge_score`). An answer without one is an error that is
counted (`RewardBatch.unparseable`, the specialist's `guard_reward_unparseable`), never a 0: in training the
sample gets the mean reward of the batch's parsed ones (no preference either way), in evaluation it is left out of
the mean; a batch over `max_unparseable` unparsed (or with none parsed) fails the step (`RewardError`): a judge
that ignores the format would otherwise train the policy on noise.

Every call goes through the one HTTP client, `engine.client.EngineClient`: one per rewarder, so one aiohttp session
per event loop it is used on, kept across that loop's batches (a specialist's PPO steps share one). `aclose()`
closes the session of the loop it is awaited on (the specialist's training loop: `closers` in
teachers/specialist_main.py); evaluation and validation score each batch on a one-shot loop and close it there
(domains/evaluate.py `score_batch`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping, Sequence

from domains.preferences import reward_input_ids
from domains.reward_math import (JudgeScoreError, fill_unparsed, length_penalized, normalized, parse_judge_score,
                                 sigmoid)
from engine.client import EngineClient

CONCURRENCY = 16  # judge requests in flight at once
DEFAULT_MAX_LENGTH = 512  # tokens of a scored sequence for an external reward model without `max_length`
JUDGE_FORMAT = ("Grade the response. End your answer with one line: Score: N/{scale} (N a whole number from 0 to "
                "{scale}).")
JUDGE_USER = "Prompt:\n{prompt}\n\nResponse:\n{response}"


class RewardError(RuntimeError):
    """A reward that cannot be computed: no server handed to this process, or a judge whose answers hold no score."""


class _ServedModel:
    """The rewarders' one `EngineClient` (one session per event loop, module docstring): `client()`, `aclose()`.
    A caller that scores on a one-shot loop closes it before the loop ends (domains/evaluate.py `score_batch`)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        self._client = EngineClient(url, api_key=api_key, timeout=timeout_s)

    @property
    def counters(self) -> dict[str, int]:
        """The client's {"requests", "retries", "errors"} since creation (all loops)."""
        return self._client.counters

    def client(self) -> EngineClient:
        return self._client

    async def aclose(self) -> None:
        """Close the session of the event loop this is awaited on (the client stays usable: a later call opens a
        new one)."""
        await self._client.aclose()


@dataclass
class RewardBatch:
    rewards: list[float]  # the training reward of each sample, in [0, 1]
    scores: list[float | None]  # evaluation: σ(raw) (model) or the judge's score; None = unparseable (judge)
    raw: list[float | None]  # the reward model's raw score, or the judge's score
    unparseable: int = 0  # judge answers without a score


class ModelRewarder(_ServedModel):
    """A served reward model's batched score (module docstring). `tokenizer`: the policy's (the reward model was
    trained from the base, so they agree; `reward_input_ids` renders with it)."""

    kind = "model"

    def __init__(self, url: str, tokenizer, *, api_key: str | None = None, system: str = "",
                 chat_template: str = "auto", max_length: int = DEFAULT_MAX_LENGTH, normalize: str = "batch",
                 length_penalty: float = 0.0, length_free: int = 0, batch_size: int = 64, timeout_s: float = 120.0):
        self.url, self.tok, self._api_key = url, tokenizer, api_key
        self.length_free = length_free
        self.system, self.chat_template, self.max_length = system, chat_template, max_length
        self.normalize, self.length_penalty = normalize, length_penalty
        self.batch_size, self.timeout_s = batch_size, timeout_s
        super().__init__(url, api_key, timeout_s)

    def __repr__(self) -> str:
        return f"ModelRewarder({self.url!r}, normalize={self.normalize!r}, length_penalty={self.length_penalty})"

    def input_ids(self, prompt: str, response: str) -> list[int]:
        return reward_input_ids(self.tok, prompt, response, self.system, self.chat_template, self.max_length)

    async def score(self, examples: Sequence, responses: Sequence[str], lengths: Sequence[int],
                    budget: int) -> RewardBatch:
        if not examples:
            return RewardBatch([], [], [])
        ids = [self.input_ids(ex.prompt, r) for ex, r in zip(examples, responses)]
        raw = await self.client().classify(ids, batch_size=self.batch_size)
        rewards = length_penalized(normalized(raw, self.normalize), lengths, budget, self.length_penalty,
                                   self.length_free)
        return RewardBatch(rewards, [sigmoid(r) for r in raw], list(raw))


class JudgeRewarder(_ServedModel):
    """A served chat model grading each response against a rubric (module docstring)."""

    kind = "judge"

    def __init__(self, url: str, rubric: str, *, api_key: str | None = None, scale: int = 10, max_tokens: int = 64,
                 max_unparseable: float = 0.5, length_penalty: float = 0.0, length_free: int = 0,
                 timeout_s: float = 120.0,
                 model: str | None = None):
        self.url, self.rubric, self._api_key, self.scale = url, rubric, api_key, scale
        self.max_tokens, self.max_unparseable, self.length_penalty = max_tokens, max_unparseable, length_penalty
        self.length_free = length_free
        self.timeout_s, self.model = timeout_s, model
        super().__init__(url, api_key, timeout_s)

    def __repr__(self) -> str:
        return f"JudgeRewarder({self.url!r}, scale={self.scale})"

    def messages(self, prompt: str, response: str) -> list[dict]:
        """What the judge is asked about one response: the rubric and the format rule, then prompt and response."""
        system = f"{self.rubric.strip()}\n{JUDGE_FORMAT.format(scale=self.scale)}"
        return [{"role": "system", "content": system},
                {"role": "user", "content": JUDGE_USER.format(prompt=prompt, response=response)}]

    async def answers(self, examples: Sequence, responses: Sequence[str]) -> list[str]:
        """The judge's answer text for each response (greedy), in order."""
        gate, client = asyncio.Semaphore(CONCURRENCY), self.client()

        async def one(ex, r: str) -> str:
            async with gate:
                reply = await client.chat(self.messages(ex.prompt, r), model=self.model,
                                          max_tokens=self.max_tokens, temperature=0.0)
                return reply.text
        return list(await asyncio.gather(*(one(ex, r) for ex, r in zip(examples, responses))))

    async def score(self, examples: Sequence, responses: Sequence[str], lengths: Sequence[int],
                    budget: int) -> RewardBatch:
        if not examples:
            return RewardBatch([], [], [])
        parsed: list[float | None] = []
        first_error = ""
        for text in await self.answers(examples, responses):
            try:
                parsed.append(parse_judge_score(text, self.scale))
            except JudgeScoreError as exc:
                parsed.append(None)
                first_error = first_error or str(exc)
        bad = sum(v is None for v in parsed)
        if bad and (bad == len(parsed) or bad > self.max_unparseable * len(parsed)):
            raise RewardError(f"judge {self.url}: {bad} of {len(parsed)} answers hold no score (over "
                              f"reward.max_unparseable={self.max_unparseable}); first: {first_error}")
        rewards = length_penalized(fill_unparsed(parsed), lengths, budget, self.length_penalty, self.length_free)
        return RewardBatch(rewards, parsed, list(parsed), unparseable=bad)


Rewarder = ModelRewarder | JudgeRewarder


def rewarders_of(cfg, domains: Mapping[str, object], tokenizer) -> dict[str, Rewarder]:
    """The rewarder of each domain of `domains` whose config has a `reward` (`cfg`: an AlloyConfig); {} when none
    has. A RewardError naming the setting when a served model's URL was not handed to this process."""
    out: dict[str, Rewarder] = {}
    for i, d in enumerate(cfg.domains):
        rc = d.reward
        if rc is None or d.name not in domains:
            continue
        url = rc.served_url or rc.url
        if not url:
            what = f"reward model {rc.reward_model!r}" if rc.kind == "model" else f"judge {rc.model}"
            raise RewardError(f"domains.{i}.reward: the {what} is served by the pipeline for the specialists and "
                              f"evaluation (domains.{i}.reward.served_url), and no server was handed to this process")
        key = rc.api_key or (cfg.engine.api_key if rc.served_url else None)
        system = getattr(domains[d.name], "system", "") or ""
        if rc.kind == "model":
            rm = cfg.reward_models.get(rc.reward_model) if rc.reward_model else None
            max_length = rc.max_length or (rm.max_length if rm is not None else DEFAULT_MAX_LENGTH)
            out[d.name] = ModelRewarder(url, tokenizer, api_key=key,
                                        system=(rm.system or "") if rm is not None else system,
                                        chat_template=cfg.model.chat_template, max_length=max_length,
                                        normalize=rc.normalize, length_penalty=rc.length_penalty,
                                        length_free=rc.length_free, batch_size=rc.batch_size, timeout_s=rc.timeout_s)
        else:
            out[d.name] = JudgeRewarder(url, rc.rubric, api_key=key, scale=rc.scale, max_tokens=rc.max_tokens,
                                        max_unparseable=rc.max_unparseable, length_penalty=rc.length_penalty,
                                        length_free=rc.length_free, timeout_s=rc.timeout_s)
    return out
