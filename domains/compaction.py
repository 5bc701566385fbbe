"""Context compaction of long tool episodes into sub-traces (docs/architecture.md, "Compaction into sub-traces").

An episode is kept whole (prompt + every model and env token, as APRIL's `Partial`/`Sample` hold it: the verifier,
the call budget and a resume all see the full response); what the engine is given for the next turn is its *current
context*, a pure function of that full history and a `Compaction` config:

    turns      = the completed turns: a run of model tokens (mask 1) + the env tokens after it (0)
    at every turn boundary b (after t turns), with the current sub-trace's context C and L = |C| + tokens since:
        if max_context_tokens − L < longest turn so far (+ reserve)  (the next turn might not fit)
        and k = keep_last, dropped = turns[: t − k]  is not empty
        → compaction is due at b

What happens then depends on `Compaction.summary`:

- `"rules"` (and the fallback of `"policy"`): if |prompt + notes(dropped) + turns[t − k : t]| < L (the compaction
  gains room) a new sub-trace starts at b with that context. `notes_summarizer` condenses the tool outputs of every
  dropped turn (the whole history before the kept turns) into ONE env line, `>notes: 7; 3; 5⏎`: deterministic, not
  written by the policy.
- `"policy"`: the reserve is the request line + `summary_tokens`, the room the policy needs to write its summary in
  the current context (a boundary with less room than the reserve left compacts by the rules). The env appends
  the request `>compact⏎` (env tokens, loss mask 0; `PolicySummary.marker`) and the policy writes ONE summary
  line, `#7;3;5⏎` (model tokens, loss mask 1: sampled and trained like any turn),
  which ends at the first token whose text holds a newline (or after `summary_tokens` tokens). Both stay in the
  history. At the summary's end e the sub-trace ends (the summary is its last, trained, turn) and the next starts
  with context  prompt + turns[t − k : t] + request + summary  (the history with the dropped turns cut out: the
  summary stands for everything before it). A summary that is not well-formed (`PolicySummary.valid`: `#` + text +
  newline), or whose context gains no room or leaves less than the longest turn for the next one, falls back to
  the rules' context at e (`SubTrace.made_by` "fallback", counted as `compaction_fallbacks`). A history with no
  request after a due boundary (a budget too small for it) compacts by the rules at b.

The plan stays a pure function of the history, so an APRIL partial (aborted mid-turn or mid-summary, or cut by
`cut_by_tokens`) resumes from its full history, the plan is recomputed from it and gives the same context it was
generated from, and the OPD student's sub-traces of the same episode are the specialists'. Compaction happens only
at turn boundaries (before a model turn starts), so it never splits a turn. A model turn that does not fit the room
left (even after compaction) is cut by the room: the rollout then ends the episode with finish_reason "length".

`subtrace_spans` gives what trains: per sub-trace its context and the output range generated in it (trailing env
tokens of a non-final sub-trace left out: the next context holds them; sub-traces without a model token left out).
PPO rows (teachers/compaction.py) and OPD scoring (a sub-trace scored by the teacher on its own context) both use it.
Pure functions on token ids; here in `domains` (beside `domains.episodes`) so the specialists (`teachers`) and the
OPD student (`student`) share it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from domains.tools import COMPACT_REQUEST, RESULT_PREFIX, SUMMARY_PREFIX, TURN_END, is_summary_line

# summarize(output_ids, dropped turns as (start, end) ranges of output_ids) → token ids of the summary turn
Summarize = Callable[[Sequence[int], Sequence[tuple[int, int]]], list[int]]
NOTES = "notes: "
SUMMARY_MODES = ("policy", "rules")


@dataclass(frozen=True)
class Compaction:
    """`max_context_tokens`: the most tokens the engine is given (context + the turn it writes); `keep_last`:
    completed turns kept verbatim after the summary (`specialists.compact_keep_last`); `summary`: who writes the
    summary, `"policy"` (a model turn after the env's request, the rules' notes as its fallback) or `"rules"`
    (`specialists.compaction_summary`); `summary_tokens`: the most tokens a policy summary may take
    (`specialists.compact_summary_tokens`)."""

    max_context_tokens: int
    keep_last: int
    summary: str = "rules"
    summary_tokens: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.max_context_tokens, int) or self.max_context_tokens < 2:
            raise ValueError(f"Compaction: max_context_tokens must be an int >= 2, got {self.max_context_tokens!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"Compaction: keep_last must be an int >= 0, got {self.keep_last!r}")
        if self.summary not in SUMMARY_MODES:
            raise ValueError(f"Compaction: summary must be one of {SUMMARY_MODES}, got {self.summary!r}")
        if not isinstance(self.summary_tokens, int) or self.summary_tokens < 2:
            raise ValueError(f"Compaction: summary_tokens must be an int >= 2, got {self.summary_tokens!r}")

    @classmethod
    def of(cls, specialists) -> "Compaction | None":
        """The compaction of a `specialists` config section (`max_context_tokens`, `compact_keep_last`,
        `compaction_summary`, `compact_summary_tokens`), or None (off): the specialists' and the student's."""
        window = getattr(specialists, "max_context_tokens", None)
        if window is None:
            return None
        return cls(window, specialists.compact_keep_last, getattr(specialists, "compaction_summary", "rules"),
                   getattr(specialists, "compact_summary_tokens", 32))


def compactions_of(specialists, names: Iterable[str]) -> dict[str, Compaction | None]:
    """Each domain's compaction, as its specialist trains with it: `specialists.per_domain[name]` merged in
    (`for_domain`), so `per_domain: {tool_long: {max_context_tokens: 96}}` compacts tool_long's episodes only."""
    own = getattr(specialists, "for_domain", None)
    return {name: Compaction.of(own(name) if own is not None else specialists) for name in names}


# what the trainers take: one compaction for every domain, one per domain (`compactions_of`), or None (off)
Compactions = Compaction | Mapping[str, Compaction | None] | None


def compaction_for(compaction: Compactions, domain: str) -> Compaction | None:
    """`domain`'s compaction under `compaction` (`Compactions`)."""
    return compaction.get(domain) if isinstance(compaction, Mapping) else compaction


def any_compaction(compaction: Compactions) -> bool:
    """Whether any domain compacts under `compaction` (as `compaction_for` reads it)."""
    if isinstance(compaction, Mapping):
        return any(c is not None for c in compaction.values())
    return compaction is not None


@dataclass(frozen=True)
class PolicySummary:
    """How a policy-written summary is recognised on token ids: `marker` the env's request (`COMPACT_REQUEST`'s
    ids), `line_end(token)` whether a token's text holds a newline (a model turn ends there), `valid(ids)` whether
    the summary turn is a well-formed summary line."""

    marker: tuple[int, ...]
    line_end: Callable[[int], bool]
    valid: Callable[[Sequence[int]], bool]


@dataclass(frozen=True)
class SubTrace:
    """`context`: the ids the engine was given when this sub-trace started; `output_ids[start:end]` of the episode
    were generated in it (model tokens and the env tokens inserted after them). `made_by`: how its context was
    compacted ("" for the first, "rules", "policy", "fallback": the rules' notes after a policy summary that did
    not do)."""

    context: tuple[int, ...]
    start: int
    end: int
    made_by: str = field(default="", compare=False)


def split_turns(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """Completed turns as (start, end) ranges: a run of model tokens (1) and the run of env tokens (0) after it.
    Model tokens after the last env run (a turn in progress, or a final answer) belong to no completed turn.
    `[1,1,0,1,0,0,1]` → `[(0, 3), (3, 6)]`. (The `Planner` splits a policy summary off too.)"""
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
    its whole history so far, and only what was completed since the last call is planned; the sub-traces already
    planned are kept. The result always equals `plan` on the same history (a history that changed what this
    planner had already closed, which the turn loop never writes, is planned again from the start).

    After `update`, `pending` says what the history's end waits for: None; `"request"` (a policy compaction is due
    here: the env should append `COMPACT_REQUEST`; without it the rules compact here, as the result shows); or
    `"summary"` (the policy is writing its summary, at most `summary_left` more tokens)."""

    def __init__(self, prompt_ids: Sequence[int], cfg: Compaction, summarize: Summarize):
        self.prompt, self.cfg, self.summarize = tuple(prompt_ids), cfg, summarize
        self.policy: PolicySummary | None = None
        if cfg.summary == "policy":
            self.policy = getattr(summarize, "policy", None)
            if self.policy is None:
                raise ValueError("compaction.Planner: summary 'policy' needs a summarize with a `.policy` "
                                 "(PolicySummary; notes_summarizer / tokenizer_summarizer give one)")
        self.reserve = len(self.policy.marker) + cfg.summary_tokens if self.policy else 0
        self._reset()

    def _reset(self) -> None:
        self.subs = [SubTrace(self.prompt, 0, 0)]
        self.turns: list[tuple[int, int]] = []
        self.longest = 0
        self.seen = 0  # output tokens planned (every turn before `seen` is complete)
        self.due: tuple[int, int] | None = None  # (n_drop, kept_from) of a policy compaction due at `seen`
        self.pending: str | None = None
        self.summary_left = 0

    def update(self, output_ids: Sequence[int], loss_mask: Sequence[int]) -> list[SubTrace]:
        """The sub-traces of the history `output_ids` / `loss_mask` (see the module docstring)."""
        n = len(output_ids)
        if len(loss_mask) != n:
            raise ValueError(f"compaction.plan: loss_mask has {len(loss_mask)} entries for {n} output_ids")
        if n < self.seen or (self.seen and n > self.seen and not loss_mask[self.seen]
                             and not (self.due and self._request_from(output_ids, loss_mask, self.seen))):
            self._reset()  # a shorter history, or env tokens that extend the last planned turn: plan anew
        self.pending = None
        while True:
            if self.due is not None:
                if not self._resolve(output_ids, loss_mask):
                    break
                continue
            i = self.seen
            while i < n and loss_mask[i]:
                i += 1
            if i == n:
                break  # a turn in progress (or nothing since the last boundary)
            j = i
            while j < n and not loss_mask[j]:
                j += 1
            e, m = j, self.policy.marker if self.policy else ()
            if m and j - i > len(m) and tuple(output_ids[j - len(m):j]) == m:
                e = j - len(m)  # the env's request after the tool output: the boundary is before it
            self._add_turn(self.seen, e, output_ids)
            self.seen = e if self.due is not None else j
        subs = list(self.subs)
        if self.pending == "request" and self._rules_due(self.seen):  # nothing after the boundary yet: the rules'
            subs = self._rules_at(output_ids, *self.due, self.seen, "rules") or subs
        subs[-1] = replace(subs[-1], end=n)
        return subs

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
        if cfg.max_context_tokens - used >= self.longest + self.reserve:
            return
        n_drop = max(t - cfg.keep_last, 0)
        if n_drop == 0:
            return
        kept_from = self.turns[n_drop][0] if n_drop < t else e
        if self.policy is not None and cfg.max_context_tokens - used >= self.reserve:
            self.due = (n_drop, kept_from)  # room to write a summary: what follows the boundary decides (`_resolve`)
            return
        if self._rules_due(e):
            self.subs = self._rules_at(output_ids, n_drop, kept_from, e, "rules") or self.subs

    def _rules_due(self, b: int) -> bool:
        """Whether the rules compact at boundary `b` (the next turn might not fit; no reserve for a summary)."""
        cur = self.subs[-1]
        return self.cfg.max_context_tokens - (len(cur.context) + b - cur.start) < self.longest

    def _rules_at(self, output_ids: Sequence[int], n_drop: int, kept_from: int, b: int, made_by: str,
                  end: int | None = None) -> list[SubTrace] | None:
        """The sub-traces with a rules compaction of the turns before boundary `b` (the new sub-trace starting at
        `end`, b by default), or None when it gains no room."""
        end = b if end is None else end
        cur = self.subs[-1]
        used = len(cur.context) + end - cur.start
        notes = tuple(self.summarize(output_ids, self.turns[:n_drop]))
        context = self.prompt + notes + tuple(output_ids[kept_from:b])
        if len(context) >= used:
            return None  # no room gained (e.g. a summary longer than the turns it replaces)
        return self.subs[:-1] + [replace(cur, end=end), SubTrace(context, end, end, made_by)]

    def _request_from(self, output_ids: Sequence[int], loss_mask: Sequence[int], b: int) -> bool:
        """Whether the env tokens from `b` on are the request (or the start of it, at the history's end)."""
        got = tuple(output_ids[b:b + len(self.policy.marker)])
        return bool(got) and got == self.policy.marker[:len(got)] and not any(loss_mask[b:b + len(got)])

    def _resolve(self, output_ids: Sequence[int], loss_mask: Sequence[int]) -> bool:
        """Settle the policy compaction due at `self.seen` from what follows it; False while the history ends
        before that is known (`pending`)."""
        (n_drop, kept_from), b, n = self.due, self.seen, len(output_ids)
        marker, cap = self.policy.marker, self.cfg.summary_tokens
        s = b + len(marker)
        if n < s and (n == b or self._request_from(output_ids, loss_mask, b)):
            self.pending = "request"
            return False
        if tuple(output_ids[b:s]) != marker or any(loss_mask[b:s]):  # no request: the rules compact at b
            self.due = None
            if self._rules_due(b):
                self.subs = self._rules_at(output_ids, n_drop, kept_from, b, "rules") or self.subs
            return True
        k = s
        while k < n and loss_mask[k] and k - s < cap:
            k += 1
            if self.policy.line_end(output_ids[k - 1]):
                break
        ended = k < n or k - s >= cap or (k > s and self.policy.line_end(output_ids[k - 1]))
        if not ended:
            self.pending, self.summary_left = "summary", cap - (k - s)
            return False
        self.due, self.seen = None, k
        cur = self.subs[-1]
        used = len(cur.context) + k - cur.start
        context = self.prompt + tuple(output_ids[kept_from:k])  # kept turns + request + the policy's summary
        if (self.policy.valid(output_ids[s:k]) and len(context) < used
                and self.cfg.max_context_tokens - len(context) >= self.longest):
            self.subs = self.subs[:-1] + [replace(cur, end=k), SubTrace(context, k, k, "policy")]
        else:
            self.subs = self._rules_at(output_ids, n_drop, kept_from, b, "fallback", end=k) or self.subs
        return True


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


def summary_allowance(budget: int, cfg: Compaction | None, request_tokens: int = len(COMPACT_REQUEST)) -> int:
    """Tokens to add to a tool episode's budget `budget` for the policy's requests and summaries (they count
    against it, like tool output): room for one per third of a window of the episode, + 1; 0 without a policy
    summary. `request_tokens`: the request's length in tokens (its characters are an upper bound)."""
    if cfg is None or cfg.summary != "policy":
        return 0
    return (-(-budget // max(1, cfg.max_context_tokens // 3)) + 1) * (request_tokens + cfg.summary_tokens)


def compaction_counts(subs: Sequence[SubTrace]) -> dict[str, int]:
    """`{"events": compactions, "fallbacks": policy summaries replaced by the rules' notes}` of one plan."""
    return {"events": sum(1 for s in subs if s.made_by), "fallbacks": sum(1 for s in subs if s.made_by == "fallback")}


class NotesSummarizer:
    """The deterministic summary (a `Summarize`): every dropped turn's tool output (its env tokens' text without the
    `>` prefix and the newline) joined into one env line `>notes: out1; out2; …⏎`; `.policy` recognises the
    policy's own summary (`PolicySummary`). `decode(ids)` → text, `encode(text)` → ids without special tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str], encode: Callable[[str], list[int]]):
        self.decode, self.encode = decode, encode
        ends: dict[int, bool] = {}

        def line_end(token: int) -> bool:
            if token not in ends:
                ends[token] = TURN_END in decode([token])
            return ends[token]

        self.policy = PolicySummary(tuple(encode(COMPACT_REQUEST)), line_end,
                                    lambda ids: is_summary_line(decode(list(ids))))

    def __call__(self, output_ids: Sequence[int], dropped: Sequence[tuple[int, int]]) -> list[int]:
        outs = []
        for s, e in dropped:
            env = self.decode(list(output_ids[s:e]))  # the model part is decoded too, split off at its last newline
            line = env[:-1] if env.endswith("\n") else env
            line = line.rsplit("\n", 1)[-1]
            outs.append(line[len(RESULT_PREFIX):] if line.startswith(RESULT_PREFIX) else line)
        return self.encode(f"{RESULT_PREFIX}{NOTES}{'; '.join(o.strip() for o in outs)}\n")


def notes_summarizer(decode: Callable[[Sequence[int]], str], encode: Callable[[str], list[int]]) -> NotesSummarizer:
    """The deterministic notes summary (`NotesSummarizer`) on `decode` / `encode`."""
    return NotesSummarizer(decode, encode)


def tokenizer_summarizer(tokenizer) -> NotesSummarizer:
    """`notes_summarizer` on a HF tokenizer."""
    return notes_summarizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            lambda text: list(tokenizer(text, add_special_tokens=False).input_ids))


def compacted_demonstration(prompt_ids: Sequence[int], calls: Sequence[tuple[str, str]], answer: str,
                            summary_of: Callable[[int], str], cfg: Compaction,
                            summarize: NotesSummarizer) -> list[tuple[str, bool]]:
    """A tool trajectory as SFT segments `(text, trained)` with the policy summaries a rollout of it would ask for:
    the turns `calls` (command, output) then `answer`, and wherever the `Planner` (policy summary) wants a request,
    the env's `COMPACT_REQUEST` (untrained) and the summary line `# + summary_of(turns so far) + ⏎` (trained). What
    a base SFT warm-up (`base.tool_trajectories`) teaches when compaction is configured."""
    planner = Planner(prompt_ids, cfg, summarize)
    out: list[int] = []
    mask: list[int] = []
    segs: list[tuple[str, bool]] = []

    def add(text: str, trained: bool) -> None:
        ids = summarize.encode(text)
        out.extend(ids)
        mask.extend([int(trained)] * len(ids))
        if segs and segs[-1][1] == trained:
            segs[-1] = (segs[-1][0] + text, trained)
        else:
            segs.append((text, trained))

    for k, (cmd, output) in enumerate(calls, start=1):
        add(f"!{cmd}\n", True)
        add(f"{RESULT_PREFIX}{output}\n", False)
        planner.update(out, mask)
        if cfg.summary == "policy" and planner.pending == "request":
            add(COMPACT_REQUEST, False)
            add(f"{SUMMARY_PREFIX}{summary_of(k)}\n", True)
    if answer:
        add(answer, True)
    return segs


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
