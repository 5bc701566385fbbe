"""Context compaction of long tool episodes into sub-traces (docs/architecture.md, "Compaction into sub-traces").

An episode is kept whole (prompt + every model and env token, as APRIL's `Partial`/`Sample` hold it: the verifier,
the call budget and a resume all see the full response); what the engine is given for the next turn is its *current
context*, a pure function of that full history and a `Compaction` config:

    turns      = split_turns(loss_mask)          a turn: a run of model tokens (mask 1) + the env tokens after it (0)
    at every turn boundary b (after t turns), with the current sub-trace's context C and L = |C| + tokens since:
        if max_context_tokens − L < longest turn so far            (the next turn might not fit)
        and k = keep_last, dropped = turns[: t − k]  is not empty
        and |prompt + summary(dropped) + turns[t − k : t]| < L      (the compaction gains room)
        → a new sub-trace starts at b with context  prompt + summary(dropped) + turns[t − k : t]

The summary is deterministic: `notes_summarizer` condenses the tool outputs of every dropped turn (the whole history
before the kept turns, so nothing read is lost to a second compaction) into ONE env line, `>notes: 7; 3; 5⏎`. It is
not written by the policy.

Compaction happens only at turn boundaries (before a model turn starts), so it never splits a turn: an APRIL partial
(aborted mid-turn, or cut by `cut_by_tokens`) resumes from its full history, the plan is recomputed from it and gives
the same context it was generated from. A model turn that does not fit the room left (even after compaction) is cut
by the room: the rollout then ends the episode with finish_reason "length".

`subtrace_spans` gives what trains: per sub-trace its context and the output range generated in it (trailing env
tokens of a non-final sub-trace left out: the next context holds them; sub-traces without a model token left out).
PPO rows (teachers/compaction.py) and OPD scoring (a sub-trace scored by the teacher on its own context) both use it.
Pure functions on token ids; here in `domains` (beside `domains.episodes`) so the specialists (`teachers`) and the
OPD student (`student`) share it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from domains.tools import RESULT_PREFIX

# summarize(output_ids, dropped turns as (start, end) ranges of output_ids) → token ids of the summary turn
Summarize = Callable[[Sequence[int], Sequence[tuple[int, int]]], list[int]]
NOTES = "notes: "


@dataclass(frozen=True)
class Compaction:
    """`max_context_tokens`: the most tokens the engine is given (context + the turn it writes); `keep_last`:
    completed turns kept verbatim after the summary (`specialists.compact_keep_last`, whose default is the one)."""

    max_context_tokens: int
    keep_last: int

    def __post_init__(self) -> None:
        if not isinstance(self.max_context_tokens, int) or self.max_context_tokens < 2:
            raise ValueError(f"Compaction: max_context_tokens must be an int >= 2, got {self.max_context_tokens!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"Compaction: keep_last must be an int >= 0, got {self.keep_last!r}")


@dataclass(frozen=True)
class SubTrace:
    """`context`: the ids the engine was given when this sub-trace started; `output_ids[start:end]` of the episode
    were generated in it (model tokens and the env tokens inserted after them)."""

    context: tuple[int, ...]
    start: int
    end: int


def split_turns(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """Completed turns as (start, end) ranges: a run of model tokens (1) and the run of env tokens (0) after it.
    Model tokens after the last env run (a turn in progress, or a final answer) belong to no completed turn.
    `[1,1,0,1,0,0,1]` → `[(0, 3), (3, 6)]`."""
    turns, start = [], 0
    for i, m in enumerate(loss_mask):
        if m and i > 0 and not loss_mask[i - 1]:  # a model token right after env tokens starts the next turn
            turns.append((start, i))
            start = i
    if loss_mask and not loss_mask[-1]:
        turns.append((start, len(loss_mask)))
    return turns


class Planner:
    """`plan` kept between turns: an episode in progress calls `update` (or `context`) before every model turn with
    its whole history so far, and only the turns completed since the last call are planned; the sub-traces already
    planned are kept. The result always equals `plan` on the same history (a history that extended a turn this
    planner had already closed, which the turn loop never writes, is planned again from the start)."""

    def __init__(self, prompt_ids: Sequence[int], cfg: Compaction, summarize: Summarize):
        self.prompt, self.cfg, self.summarize = tuple(prompt_ids), cfg, summarize
        self._reset()

    def _reset(self) -> None:
        self.subs = [SubTrace(self.prompt, 0, 0)]
        self.turns: list[tuple[int, int]] = []
        self.longest = 0
        self.seen = 0  # output tokens covered by planned turns (every turn before `seen` is complete)

    def update(self, output_ids: Sequence[int], loss_mask: Sequence[int]) -> list[SubTrace]:
        """The sub-traces of the history `output_ids` / `loss_mask` (see the module docstring)."""
        if len(loss_mask) != len(output_ids):
            raise ValueError(f"compaction.plan: loss_mask has {len(loss_mask)} entries for {len(output_ids)} "
                             "output_ids")
        if len(output_ids) < self.seen or (self.seen and len(loss_mask) > self.seen and not loss_mask[self.seen]):
            self._reset()  # a shorter history, or env tokens that extend the last planned turn: plan anew
        for s, e in split_turns(loss_mask[self.seen:]):
            self._add_turn(s + self.seen, e + self.seen, output_ids)
        self.seen = self.turns[-1][1] if self.turns else 0
        self.subs[-1] = replace(self.subs[-1], end=len(output_ids))
        return list(self.subs)

    def context(self, output_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
        """What the engine is given to continue the episode: the last sub-trace's context + the tokens since."""
        last = self.update(output_ids, loss_mask)[-1]
        return list(last.context) + list(output_ids[last.start:])

    def _add_turn(self, s: int, e: int, output_ids: Sequence[int]) -> None:
        self.turns.append((s, e))
        t, cfg = len(self.turns), self.cfg
        self.longest = max(self.longest, e - s)
        cur = self.subs[-1]
        used = len(cur.context) + e - cur.start
        if cfg.max_context_tokens - used >= self.longest:
            return
        n_drop = max(t - cfg.keep_last, 0)
        if n_drop == 0:
            return
        kept_from = self.turns[n_drop][0] if n_drop < t else e
        context = self.prompt + tuple(self.summarize(output_ids, self.turns[:n_drop])) + tuple(output_ids[kept_from:e])
        if len(context) >= used:
            return  # no room gained (e.g. a summary longer than the turns it replaces)
        self.subs[-1] = replace(cur, end=e)
        self.subs.append(SubTrace(context, e, e))


def plan(prompt_ids: Sequence[int], output_ids: Sequence[int], loss_mask: Sequence[int], cfg: Compaction,
         summarize: Summarize) -> list[SubTrace]:
    """The sub-traces of an episode (see the module docstring); one sub-trace `(prompt, 0, len(output))` when no
    compaction happened. The last sub-trace ends at `len(output_ids)` (it may be empty: compacted, nothing yet).
    A history ending inside an env line counts that line as complete (the rollout never stops inside one)."""
    return Planner(prompt_ids, cfg, summarize).update(output_ids, loss_mask)


def current_context(prompt_ids: Sequence[int], output_ids: Sequence[int], loss_mask: Sequence[int],
                    cfg: Compaction, summarize: Summarize) -> list[int]:
    """What the engine is given to continue the episode: the last sub-trace's context + the tokens since."""
    return Planner(prompt_ids, cfg, summarize).context(output_ids, loss_mask)


def notes_summarizer(decode: Callable[[Sequence[int]], str], encode: Callable[[str], list[int]]) -> Summarize:
    """The deterministic summary: every dropped turn's tool output (its env tokens' text without the `>` prefix
    and the newline) joined into one env line `>notes: out1; out2; …⏎`. `decode(ids)` → text, `encode(text)` →
    ids without special tokens."""

    def summarize(output_ids: Sequence[int], dropped: Sequence[tuple[int, int]]) -> list[int]:
        outs = []
        for s, e in dropped:
            env = decode(list(output_ids[s:e]))  # the model part is decoded too, then split off at its last newline
            line = env[:-1] if env.endswith("\n") else env
            line = line.rsplit("\n", 1)[-1]
            outs.append(line[len(RESULT_PREFIX):] if line.startswith(RESULT_PREFIX) else line)
        return encode(f"{RESULT_PREFIX}{NOTES}{'; '.join(o.strip() for o in outs)}\n")

    return summarize


def tokenizer_summarizer(tokenizer) -> Summarize:
    """`notes_summarizer` on a HF tokenizer."""
    return notes_summarizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            lambda text: list(tokenizer(text, add_special_tokens=False).input_ids))


SUBTRACE_SEP = "~"  # sub-trace k > 0 of episode `e` is `e~k`; sub-trace 0 keeps the episode's id


def subtrace_id(episode_id: str, k: int) -> str:
    """The id of the k-th trained sub-trace of an episode (both trainers: PPO rows and OPD samples)."""
    return episode_id if k == 0 else f"{episode_id}{SUBTRACE_SEP}{k}"


def episode_of(sample_id: str) -> str:
    """The episode id of a sample id (`e~k` → `e`; a whole episode's id is its own)."""
    return sample_id.split(SUBTRACE_SEP, 1)[0]


def subtrace_spans(prompt_ids: Sequence[int], output_ids: Sequence[int], loss_mask: Sequence[int],
                   cfg: Compaction, summarize: Summarize) -> list[SubTrace]:
    """The sub-traces that train (module docstring): `plan`'s, each non-final one ending at its last model token,
    those without a model token left out. The context of each is what the engine (and the critic, and an OPD
    teacher) sees before `output_ids[start:end]`."""
    return trained_spans(plan(prompt_ids, output_ids, loss_mask, cfg, summarize), loss_mask)


def trained_spans(subs: Sequence[SubTrace], loss_mask: Sequence[int]) -> list[SubTrace]:
    """`subtrace_spans` of an episode whose `plan` is `subs` (for a caller that needs the plan too)."""
    out = []
    for j, sub in enumerate(subs):
        end = sub.end
        if j < len(subs) - 1:
            while end > sub.start and not loss_mask[end - 1]:
                end -= 1
        if any(loss_mask[sub.start:end]):
            out.append(replace(sub, end=end))
    return out
