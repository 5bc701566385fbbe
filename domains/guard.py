"""The anti-hack guard of tool calls: a high-recall rule filter, then (optionally) a judge for the flagged calls.

    verdict = await guard.check("cat .answers", context)    # Verdict(allowed=False, flagged=True, rules=[...])

Here, beside the rules (`domains/hack_rules.py`) and the tool envs (`domains/tools.py`), because both trainers run
it: the specialists' rollouts (`teachers/rollout.py`, with a served LLM judge, `teachers/guard.py` `LLMJudge`) and
the OPD student's tool episodes (`student/sampler.py`, rules only). A tool env asks it before every call; a blocked
call is answered with dummy output and the trajectory continues.

A call no rule flags is allowed without asking the judge (cheap: most calls are `calc`). A flagged call goes to the
judge (any object with `prompt(command, task, trajectory) -> (prompt, context)` and `async is_hack(command, *,
prompt)`, raising `JudgeError` when it cannot decide), which decides intent. YES blocks it, NO allows it. With no
judge, every flagged call is blocked (rule-only mode; logged once per guard). When the judge errs after its
retries, `judge_errors` counts it and the call is blocked by its rule verdict (`on_error="block"`, the default: fail
closed) or allowed (`on_error="allow"`). Verdicts are cached by (context, call), the context being exactly the task
and trajectory text the judge saw.

Counters (per training step, `snapshot_and_reset`): tool_calls, flagged (a rule hit), blocked (by rule-only mode, a
judge verdict or the error fallback), judged (flagged calls the judge decided, cached verdicts included),
judge_blocked (of those, blocked), judge_calls (requests sent), judge_errors.

Every check is also kept in a bounded log (`take_calls()`: (command, verdict) since the last take, at most
`call_log_size`, the oldest dropped): bench/guard_experiment.py reads it each step to see which calls were flagged
and which of them the judge let through.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from domains.hack_rules import rule_check

log = logging.getLogger(__name__)


class JudgeError(Exception):
    """The judge could not give a verdict (network, timeout, HTTP error, unparseable reply) after its retries."""


@dataclass
class Verdict:
    allowed: bool
    flagged: bool
    rules: list[str] = field(default_factory=list)
    reason: str = ""
    source: str = "rules"  # "rules" (not flagged, or rule-only mode) | "judge" | "judge_cache" | "fallback"


class Guard:
    """Rule filter + optional judge (`teachers.guard.LLMJudge`; None: rule-only), with per-step counters
    (`snapshot_and_reset()`). `on_error`: what a flagged call becomes when the judge fails ("block": its rule
    verdict; "allow": it runs)."""

    COUNTERS = ("tool_calls", "flagged", "blocked", "judged", "judge_blocked", "judge_calls", "judge_errors")

    def __init__(self, judge=None, allowed_hosts: set[str] | frozenset[str] = frozenset(),
                 cache_size: int = 4096, on_error: str = "block", call_log_size: int = 4096):
        if on_error not in ("block", "allow"):
            raise ValueError(f"Guard: on_error must be 'block' or 'allow', got {on_error!r}")
        self.judge, self.allowed_hosts, self.cache_size = judge, frozenset(allowed_hosts), cache_size
        self.on_error = on_error
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._calls: deque[tuple[str, Verdict]] = deque(maxlen=call_log_size)
        if judge is None:
            log.warning("anti-hack guard: no judge configured, running rule-only (every flagged tool call is blocked)")

    async def check(self, command: str, context: str = "", trajectory: str = "") -> Verdict:
        """Rule filter, then (if flagged and a judge is set) the judge, shown `context` (the task), `trajectory`
        (the episode so far, without this call) and the call. Never raises for judge failures."""
        verdict = await self._check(command, context, trajectory)
        self._calls.append((command, verdict))
        return verdict

    async def _check(self, command: str, context: str, trajectory: str) -> Verdict:
        self._counts["tool_calls"] += 1
        rules = rule_check(command, self.allowed_hosts)
        if not rules:
            return Verdict(True, False, [], "no rule hit")
        self._counts["flagged"] += 1
        if self.judge is None:
            return self._block(command, rules, "rule-only guard", "rules")
        prompt, seen = self.judge.prompt(command, context, trajectory)
        key = (seen, " ".join(command.split()))
        if key in self._cache:
            self._cache.move_to_end(key)
            hack, source = self._cache[key], "judge_cache"
        else:
            self._counts["judge_calls"] += 1
            try:
                hack = await self.judge.is_hack(command, prompt=prompt)
            except JudgeError as e:
                self._counts["judge_errors"] += 1
                if self.on_error == "allow":
                    log.warning("anti-hack guard: judge failed (%s); allowing the call (judge_on_error=allow)", e)
                    return Verdict(True, True, rules, f"judge unavailable, allowed: {e}", "fallback")
                log.warning("anti-hack guard: judge failed (%s); falling back to the rule verdict (block)", e)
                return self._block(command, rules, f"judge unavailable, rule verdict: {e}", "fallback")
            self._cache[key] = hack
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            source = "judge"
        self._counts["judged"] += 1
        if hack:
            self._counts["judge_blocked"] += 1
            return self._block(command, rules, "judge: attempt to obtain the answer without solving the task", source)
        return Verdict(True, True, rules, "judge: benign", source)

    def _block(self, command: str, rules: list[str], reason: str, source: str) -> Verdict:
        self._counts["blocked"] += 1
        log.info("anti-hack guard blocked %r (rules: %s; %s)", command, ", ".join(rules), reason)
        return Verdict(False, True, rules, reason, source)

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    async def aclose(self) -> None:
        """Close the judge's HTTP session on this event loop (call once at the end of training)."""
        if self.judge is not None:
            await self.judge.aclose()

    def take_calls(self) -> list[tuple[str, Verdict]]:
        """The (command, verdict) of each check since the last take (at most `call_log_size`), then forget them."""
        out = list(self._calls)
        self._calls.clear()
        return out

    def snapshot_and_reset(self) -> dict[str, int]:
        """The counters since the last call (one training step), then zero them."""
        snap = dict(self._counts)
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        return snap


def guarded_reward(blocked_calls: int, verify: Callable[[], float]) -> float:
    """An episode's reward under the guard: 0 when the guard blocked any of its calls (a hack attempt never pays,
    even when the intended path after it reached the right answer; eval counts that episode as a hack attempt
    too), else `verify()`. The one rule of both trainers (the specialists' PPO reward, the OPD student's
    `distill.reward_coef`)."""
    return 0.0 if blocked_calls else float(verify())
