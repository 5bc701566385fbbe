"""Episodes on token ids: the one turn loop of the specialists' rollouts (teachers/rollout.py `Roller`), the OPD
student's sampling (student/sampler.py) and evaluation (domains/evaluate.py, on the in-process model), so every
stage runs, and is measured on, the same episodes: one budget unit (tokens), the same compaction, the same turn end.

    while budget > 0:
        context, room = run.request()         prompt + tokens so far, or the compacted context (domains.compaction)
        ids, logprobs, finish = generate(context, room)                       model tokens, loss mask 1
        run.apply(...): stop unless the turn's text ends with TURN_END (a newline) and the env answers the tool call
        env line (`>…⏎`) → token ids, cut to the budget                         env tokens, loss mask 0, log-prob 0

An `EpisodeRun` is one episode as a state machine (what to generate next, what a generated turn does), so the two
drivers below share every rule: `run_token_episode` runs one episode turn after turn (the specialists: each episode
its own task, as APRIL needs), `run_episodes` runs many in rounds, the next turn of every unfinished episode in ONE
generate call per round (the student and evaluation: a plain prompt is an episode of one turn, so a batch of plain
prompts is one call). The generator is an engine server (`engine.client`) or the in-process model
(`domains.evaluate.model_episodes`). An episode without an env (a plain domain) is one turn. A turn that comes back `"abort"` ends the episode as
a partial (finish_reason "abort", APRIL resumes it). Tool output counts against the budget, like APRIL's
`remaining_budget`: the budget bounds the sequence, not only what the model wrote.

With a `Compaction` the engine is given the episode's compacted context (its `Planner` keeps the plan between turns)
and each call may write at most the room it leaves; when there is no room even after compaction the episode ends,
finish "length". The episode itself keeps its full history. With a policy summary (`Compaction.summary "policy"`),
when the plan wants one after a tool output the env appends the request `COMPACT_REQUEST` (env tokens, if the
budget holds it and one more token) and the next call is the summary turn: at most `summary_tokens`, no tool runs
after it, and the episode goes on from the compacted context (a summary turn that stops before its line is done,
EOS or no room, ends the episode).

The env is the caller's: its guard (specialists) or none, planted shortcut or `clean` (the OPD student), and it is
the caller who closes it. `text(ids)` is the response text a verifier sees (`infra.chat.response_text`); `prior_ids`
/ `prior_mask` the response tokens of the same episode produced before this call (a resumed partial), so the env
sees the whole response when it parses the last line and the compaction plans the whole history.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from domains.compaction import Compaction, Planner, Summarize, summary_allowance
from domains.tools import TURN_END

# generate(context ids, max new tokens, turn index) → (output ids, their log-probs, finish reason)
Generate = Callable[[list[int], int, int], Awaitable[tuple[list[int], list[float], str]]]
# generate_batch([(run index, context ids, max new tokens, turn index)]) → one (ids, log-probs, finish) per request
GenerateBatch = Callable[[list[tuple[int, list[int], int, int]]], Awaitable[list[tuple[list[int], list[float], str]]]]


@dataclass
class Episode:
    """New tokens of one request (model and env tokens), their log-probs (0 on env tokens) and loss mask
    (1 = written by the model, 0 = inserted by the environment)."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "abort"
    # one entry per tool call of this episode, in order: whether the guard blocked it (`EpisodeRun.apply` reads the
    # env's call record; empty for a plain domain). Call k's output is the k-th env run.
    call_blocked: list[bool] = field(default_factory=list)
    # the same calls as the env recorded them (`call_record`: command, output, guard verdict and rules, exit code):
    # what a rollout record and its MLflow trace show (training/rollout_records.py)
    calls: list[dict] = field(default_factory=list)

    @property
    def blocked_calls(self) -> int:
        """Calls of this episode the guard blocked (a hack attempt: the episode's reward is 0, `domains.guard`)."""
        return sum(self.call_blocked)

    @property
    def tool_calls(self) -> int:
        """Env insertions in this episode (runs of loss-mask-0 tokens)."""
        m = self.loss_mask
        return sum(1 for i, x in enumerate(m) if x == 0 and (i == 0 or m[i - 1] == 1))


def call_record(c) -> dict:
    """A `domains.tools.CallRecord` as plain data (it travels with partials through checkpoints, into records)."""
    return {"command": c.command, "output": c.output, "executed": bool(c.executed),
            "guard_allowed": bool(c.guard_allowed), "rules": list(c.rules), "exit_code": c.exit_code}


def episode_budget(domain: object, max_new_tokens: int, compaction: Compaction | None = None) -> int:
    """Tokens one eval episode may add, as its specialist's rollouts get them (`teachers.specialist_main.response_budget`
    without a configured budget), the OPD student's samples and evaluation: the domain's `episode_chars` (one tool call, its output and the
    answer) plus, with a policy-written compaction summary, `summary_allowance` for its requests and summaries;
    never less than `max_new_tokens`."""
    episode = int(getattr(domain, "episode_chars", 0) or 0)
    return max(max_new_tokens, episode + summary_allowance(episode, compaction) if episode else 0)


def env_token_ids(tokenizer, line: str, budget: int) -> list[int]:
    """The token ids of one env line (no special tokens), cut to `budget`."""
    return list(tokenizer(line, add_special_tokens=False).input_ids)[:max(budget, 0)]


class EpisodeRun:
    """One episode in progress (module docstring). `env`: a `domains.tools.ToolEnv`-like object with
    `async step(response) -> line | None`, or None for a plain domain (`tokenizer` and `text` are then unused).
    `done` once it has ended; `ep` holds what it produced, `turn` the turns generated so far."""

    def __init__(self, prompt_ids: Sequence[int], budget: int, *, env=None, tokenizer=None,
                 text: Callable[[Sequence[int]], str] | None = None, prior_ids: Sequence[int] = (),
                 prior_mask: Sequence[int] | None = None, compaction: Compaction | None = None,
                 summarize: Summarize | None = None):
        if compaction is not None and summarize is None:
            raise ValueError("EpisodeRun: a Compaction needs its summarize function")
        self.prompt_ids, self.budget, self.env, self.tok, self.text = list(prompt_ids), budget, env, tokenizer, text
        self.prior_ids = list(prior_ids)
        self.prior_mask = list(prior_mask) if prior_mask and len(prior_mask) == len(prior_ids) else [1] * len(prior_ids)
        self.compaction = compaction
        self.planner = None if compaction is None else Planner(prompt_ids, compaction, summarize)
        self.ep, self.turn, self.done = Episode(), 0, False
        self.in_summary = False  # the turn requested last is the policy's compaction summary

    def _end(self, finish: str) -> None:
        self.ep.finish_reason, self.done = finish, True

    def request(self) -> tuple[list[int], int] | None:
        """(context, max new tokens) of the next turn, or None when the episode has ended (a budget spent, or no
        room left in the compaction window: it ends then, finish "length")."""
        if self.done:
            return None
        if self.budget <= 0:
            self._end("length")
            return None
        out = self.prior_ids + self.ep.output_ids
        if self.planner is None:
            return self.prompt_ids + out, self.budget
        context = self.planner.context(out, self.prior_mask + self.ep.loss_mask)
        room = min(self.budget, self.compaction.max_context_tokens - len(context))
        self.in_summary = self.planner.pending == "summary"
        if self.in_summary:
            room = min(room, self.planner.summary_left)
        if room <= 0:
            self._end("length")
            return None
        return context, room

    async def apply(self, ids: Sequence[int], logprobs: Sequence[float], finish: str) -> None:
        """Add a generated turn; run the tool call it ends with, if any (its output line: env tokens)."""
        ids, logprobs = list(ids), list(logprobs)
        self.turn += 1
        ep = self.ep
        ep.output_ids += ids
        ep.output_logprobs += logprobs
        ep.loss_mask += [1] * len(ids)
        self.budget -= len(ids)
        if finish == "abort":
            self.done = True  # partial (finish_reason stays "abort"): resumes next step
            return
        if self.in_summary:  # the policy's summary: no tool runs; the episode goes on if the line is complete
            self.in_summary = False
            self.planner.update(self.prior_ids + ep.output_ids, self.prior_mask + ep.loss_mask)
            if self.budget <= 0 or not ids or self.planner.pending == "summary":
                self._end(finish)
            return
        if self.env is None or not ids or not self.text(ids).endswith(TURN_END) or self.budget <= 0:
            self._end(finish)
            return
        line = await self.env.step(self.text(self.prior_ids + ep.output_ids))
        if line is None:  # a newline-terminated final answer
            self._end("stop")
            return
        calls = getattr(self.env, "calls", None)  # domains.tools.ToolEnv: one CallRecord per call, with the verdict
        if calls:
            ep.call_blocked.append(not calls[-1].guard_allowed)
            ep.calls.append(call_record(calls[-1]))
        env_ids = env_token_ids(self.tok, line, self.budget)
        ep.output_ids += env_ids
        ep.output_logprobs += [0.0] * len(env_ids)
        ep.loss_mask += [0] * len(env_ids)
        self.budget -= len(env_ids)
        if self.planner is not None and self.planner.policy is not None:
            self.planner.update(self.prior_ids + ep.output_ids, self.prior_mask + ep.loss_mask)
            marker = list(self.planner.policy.marker)
            if self.planner.pending == "request" and self.budget > len(marker) + 1:
                ep.output_ids += marker  # the env asks the policy for its summary (the next turn)
                ep.output_logprobs += [0.0] * len(marker)
                ep.loss_mask += [0] * len(marker)
                self.budget -= len(marker)


async def run_token_episode(run: EpisodeRun, generate: Generate, *,
                            stopped: Callable[[], bool] = lambda: False) -> Episode:
    """Run one episode turn after turn. `stopped()`: checked before every turn (an APRIL abort of the whole batch);
    when true the episode ends as a partial (finish "abort")."""
    while not stopped():
        req = run.request()
        if req is None:
            return run.ep
        await run.apply(*await generate(req[0], req[1], run.turn))
    if not run.done:
        run.ep.finish_reason = "abort"
    return run.ep


async def run_episodes(runs: Sequence[EpisodeRun], generate: GenerateBatch) -> list[Episode]:
    """Run every episode to its end in rounds: each round sends the next turn of every unfinished episode in ONE
    `generate` call, then applies the turns (their tool calls run concurrently)."""
    while True:
        batch = []
        for i, run in enumerate(runs):
            req = run.request()
            if req is not None:
                batch.append((i, req[0], req[1], run.turn))
        if not batch:
            return [run.ep for run in runs]
        results = await generate(batch)
        if len(results) != len(batch):
            raise RuntimeError(f"run_episodes: {len(results)} turns generated for {len(batch)} requests")
        await asyncio.gather(*(runs[i].apply(*res) for (i, *_), res in zip(batch, results)))
