"""One tool-use episode on token ids: the turn loop shared by the specialists' rollouts (teachers/rollout.py
`Roller`) and the OPD student's sampling (student/sampler.py), so both stages run the same episodes.

    loop while budget > 0:
        ids, logprobs, finish = await turn(new ids so far, budget, turn index)   model tokens, loss mask 1
        stop unless the turn's text ends with TURN_END (a newline) and the env answers the tool call on that line
        env line (`>…⏎`) → token ids, cut to the budget                         env tokens, loss mask 0, log-prob 0

`turn` is the caller's generation (an engine `/generate` call with the stop ids of `infra.chat.stop_token_ids` and,
for a tool domain, the stop string TURN_END). An episode without an env (a plain domain) is one turn. A turn that
comes back `"abort"` ends the episode as a partial (finish_reason "abort", APRIL resumes it). Tool output counts
against the budget, like APRIL's `remaining_budget`: the budget bounds the sequence, not only what the model wrote.

The env is the caller's: its guard (specialists) or none, planted shortcut or `clean` (the OPD student), and it is
the caller who closes it. `text(ids)` is the response text a verifier sees (`infra.chat.response_text`), `prior_ids`
the response tokens of the same episode produced before this call (a resumed partial), so the env sees the whole
response when it parses the last line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from domains.tools import TURN_END

# turn(new output ids so far, remaining budget, turn index) → (output ids, their log-probs, finish reason)
Turn = Callable[[list[int], int, int], Awaitable[tuple[list[int], list[float], str]]]


@dataclass
class Episode:
    """New tokens of one request (model and env tokens), their log-probs (0 on env tokens) and loss mask
    (1 = written by the model, 0 = inserted by the environment)."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "abort"

    @property
    def tool_calls(self) -> int:
        """Env insertions in this episode (runs of loss-mask-0 tokens)."""
        m = self.loss_mask
        return sum(1 for i, x in enumerate(m) if x == 0 and (i == 0 or m[i - 1] == 1))


def env_token_ids(tokenizer, line: str, budget: int) -> list[int]:
    """The token ids of one env line (no special tokens), cut to `budget`."""
    return list(tokenizer(line, add_special_tokens=False).input_ids)[:max(budget, 0)]


async def run_token_episode(turn: Turn, env, tokenizer, text: Callable[[Sequence[int]], str], budget: int, *,
                            prior_ids: Sequence[int] = (), stopped: Callable[[], bool] = lambda: False) -> Episode:
    """Run one episode (see the module docstring). `env`: a `domains.tools.ToolEnv`-like object with
    `async step(response) -> line | None`, or None for a plain domain. `stopped()`: checked before every turn (an
    APRIL abort of the whole batch); when true the episode ends as a partial."""
    ep = Episode()
    i = 0
    while budget > 0 and not stopped():
        ids, logprobs, finish = await turn(ep.output_ids, budget, i)
        i += 1
        ids, logprobs = list(ids), list(logprobs)
        ep.output_ids += ids
        ep.output_logprobs += logprobs
        ep.loss_mask += [1] * len(ids)
        budget -= len(ids)
        if finish == "abort":
            return ep  # partial: resumes next step
        if env is None or not ids or not text(ids).endswith(TURN_END) or budget <= 0:
            ep.finish_reason = finish
            return ep
        line = await env.step(text(list(prior_ids) + ep.output_ids))
        if line is None:  # a newline-terminated final answer
            ep.finish_reason = "stop"
            return ep
        env_ids = env_token_ids(tokenizer, line, budget)
        ep.output_ids += env_ids
        ep.output_logprobs += [0.0] * len(env_ids)
        ep.loss_mask += [0] * len(env_ids)
        budget -= len(env_ids)
    ep.finish_reason = "length" if budget <= 0 else "abort"
    return ep
