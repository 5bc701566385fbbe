"""On-policy sampling for the OPD student: a deterministic prompt stream and batched sampling through the engine.

The student is served by its own engine server (`training.policy_server.PolicyServer`); the trainer pushes new weights
to it after every step. Every prompt is an episode of the specialists' turn loop (`domains.episodes`, the same
`EpisodeRun` as `teachers.rollout.Roller`), sampled in rounds: round r is ONE `/generate` call with turn r of every
unfinished episode. A plain domain's prompt is an episode of one turn, so a batch of plain prompts costs one HTTP
round trip, not one per prompt.

Tool domains (a domain with `env(example, guard=...)`, e.g. `tool_add`): each prompt is a FULL episode: the
student generates until a stop id or a newline, the tool call on that line runs in the domain's env, its output line
is inserted into the context as environment tokens (`loss_mask` 0: never trained, excluded from every OPD loss by
`student.batch.collate`), and the episode continues with the remaining budget in the next round (the round's tool
calls run concurrently). The env is the one the specialists' rollouts see: `env(example, guard=...)`, the
planted shortcut included, under the domain's guard (`guards`: the specialists' `specialists.guard`, rules only:
student/distill_main.py `student_guards`). A call the guard blocks is answered with the guard's dummy output (as in
`teachers/rollout.py`) and the episode goes on; the episode's `blocked_calls` counts them and `episode_reward` gives
an episode with a blocked call reward 0, so `distill.reward_coef` never pays a hack attempt (in a clean, unguarded
env the failed read cost nothing and the intended path after it earned the episode 1, hack call included: issue 36,
tool_files). The teacher scores the whole sequence (prompt + student turns + tool output) and only the student's
own tokens count. `check_student_domains` refuses what this path cannot sample correctly.

Compaction (`specialists.max_context_tokens`, the specialists' setting, so the student sees the contexts its teachers
were trained on): the engine is given the episode's current compacted context (`domains.compaction`, the same
functions as the specialists' rollouts), and after the reward is taken on the whole episode `split_subtraces` turns
it into one sample per sub-trace (its own context as the prompt, the episode's reward), each scored by the teacher on
its own context. Sub-trace k > 0 has id `<episode id>~k` (`domains.compaction.subtrace_id`, as the specialists' PPO
rows); exactly-once bookkeeping stays per episode (`episode_id`).

Exactly-once bookkeeping starts here: a prompt's `sample_id` carries the stream cursor (`s{cursor:08d}-{domain}`),
and the stream's state is committed with the weights, so after a crash the restored stream re-issues ids from the
committed cursor on, and the trainer's ledger (trained ids, same commit) says which ids were already learned from.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from domains.compaction import (Compactions, any_compaction, compaction_for, subtrace_id, subtrace_spans,
                                tokenizer_summarizer)
from domains.episodes import EpisodeRun, run_episodes
from domains.guard import guarded_reward
from domains.tools import TURN_END
from infra.chat import PromptRenderer, response_text
from engine.client import EngineClient, seed_for


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the stream: its ledger id, domain, the domain example (for the verifier) and token ids."""

    sample_id: str
    cursor: int
    domain: str
    example: object  # domains.base.Example
    prompt_ids: list[int]


@dataclass
class StudentSample:
    """A response the student sampled. `rollout_logprobs[t]` = log π_version(output_ids[t] | prefix) as the engine
    computed it (the behaviour policy of the importance ratio); `version` = the engine's weight version."""

    sample_id: str
    cursor: int
    domain: str
    example: object
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]
    version: int
    finish_reason: str
    # filled in by scoring (student.scoring): teacher log-probs aligned to output_ids, top-k (L, K) or None
    teacher_logprobs: list[float] | None = None
    teacher_topk_ids: object = None
    teacher_topk_logprobs: object = None
    reward: float | None = field(default=None)
    # per output token: 1 = written by the student, 0 = tool output inserted by the env (log-prob 0, never trained);
    # None = every token is the student's (a plain domain)
    loss_mask: list[int] | None = None
    # the episode this sample is a sub-trace of (compaction: `split_subtraces`); None = its own (`episode`)
    episode_id: str | None = None
    # tool calls of the episode the guard blocked (`episode_reward`: > 0 means reward 0); 0 for a plain domain
    blocked_calls: int = 0
    # the episode's tool calls as the env recorded them (`domains.episodes.call_record`): rollout records, traces
    calls: list[dict] = field(default_factory=list)

    @property
    def episode(self) -> str:
        """The id the exactly-once ledger and the drop records use: the episode's, shared by its sub-traces."""
        return self.episode_id or self.sample_id

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def model_tokens(self) -> int:
        """Response tokens the student wrote (the ones every loss counts)."""
        return len(self.output_ids) if self.loss_mask is None else int(sum(self.loss_mask))


def domain_weights(names: Sequence[str], rkl: Mapping[str, float], mix: float) -> dict[str, float]:
    """Sampling weight per domain: w_d = (1 − mix)/D + mix · r_d / Σ_e r_e, with r_d = max(rkl_d, 0) the student's
    current reverse KL to domain d's teacher (a domain without a measurement yet counts as the mean of the others).
    mix = 0 is uniform; mix = 1 samples purely in proportion to the remaining gap. Σ_d w_d = 1."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"domain_weights: mix must be in [0, 1], got {mix}")
    D = len(names)
    known = [max(float(rkl[n]), 0.0) for n in names if n in rkl and np.isfinite(rkl[n])]
    fill = sum(known) / len(known) if known else 1.0
    r = [max(float(rkl[n]), 0.0) if n in rkl and np.isfinite(rkl[n]) else fill for n in names]
    total = sum(r)
    share = [x / total for x in r] if total > 0 else [1.0 / D] * D
    return {n: (1.0 - mix) / D + mix * s for n, s in zip(names, share)}


def allocate(n: int, weights: Mapping[str, float], credit: dict[str, float]) -> dict[str, int]:
    """Split n slots over domains by weight, carrying the fractional remainders in `credit` (updated in place) so
    that over many batches each domain gets exactly its share: credit_d += n·w_d; count_d = ⌊credit_d⌋, the
    leftover slots go to the largest remaining credits (ties: domain order); credit_d −= count_d."""
    names = list(weights)
    total = sum(weights.values())
    for d in names:
        credit[d] = credit.get(d, 0.0) + n * weights[d] / total
    counts = {d: max(int(np.floor(credit[d])), 0) for d in names}
    left = n - sum(counts.values())
    for d in sorted(names, key=lambda d: (-(credit[d] - counts[d]), names.index(d)))[:max(left, 0)]:
        counts[d] += 1
    for d in names:
        credit[d] -= counts[d]
    return counts


class PromptStream:
    """Mixed-domain prompts. Each `take(n, weights)` splits n slots over the domains (`allocate`, uniform by
    default) and hands out each domain's next train examples (its pool shuffled once with the seed, then cycled).

    The ids are `s{cursor:08d}-{domain}`: unique, and the stream's state (`state_dict`: cursor, per-domain counters
    and allocation credit) is committed with the weights, so after a crash the same takes re-issue the same ids.
    """

    def __init__(self, domains: Mapping[str, object], tokenizer, n_per_domain: int, seed: int,
                 chat_template: str = "auto"):
        if not domains:
            raise ValueError("PromptStream: no domains")
        self.names = list(domains)
        self.pools: dict[str, list] = {}
        for name, dom in domains.items():
            pool = list(dom.split("train", n_per_domain, seed))
            random.Random(f"distill|{name}|{seed}").shuffle(pool)
            self.pools[name] = pool
        # rendered as in every stage (infra.chat: model.chat_template, the domain's system message); once, not per step
        render = PromptRenderer(tokenizer, chat_template)
        self._ids = {name: [render.example_ids(domains[name], ex) for ex in pool] for name, pool in self.pools.items()}
        self.cursor = 0
        self.taken = {n: 0 for n in self.names}
        self.credit = {n: 0.0 for n in self.names}

    def take(self, n: int, weights: Mapping[str, float] | None = None) -> list[PromptItem]:
        """The next n prompts (domain by domain); advances the cursor and the per-domain counters."""
        counts = allocate(n, weights or {d: 1.0 for d in self.names}, self.credit)
        items = []
        for d in self.names:
            for _ in range(counts.get(d, 0)):
                j = self.taken[d] % len(self.pools[d])
                items.append(PromptItem(f"s{self.cursor:08d}-{d}", self.cursor, d, self.pools[d][j],
                                        list(self._ids[d][j])))
                self.taken[d] += 1
                self.cursor += 1
        return items

    def longest_prompt(self) -> dict[str, int]:
        """{domain: tokens of its longest rendered prompt}."""
        return {name: max((len(x) for x in ids), default=0) for name, ids in self._ids.items()}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "taken": dict(self.taken), "credit": dict(self.credit)}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["taken"]) - set(self.names))
        if unknown:
            raise ValueError(f"PromptStream.load_state_dict: state has domains {unknown} this run does not configure")
        self.cursor = int(state["cursor"])
        self.taken = {n: int(state["taken"].get(n, 0)) for n in self.names}
        self.credit = {n: float(state["credit"].get(n, 0.0)) for n in self.names}


def parse_version(weight_version: str | None, fallback: int) -> int:
    """The engine reports `weight_version` as a string; ours are step numbers. Unknown → `fallback`."""
    try:
        return int(weight_version) if weight_version is not None else fallback
    except ValueError:
        return fallback


def is_tool_domain(domain: object) -> bool:
    """A domain the student samples as tool episodes: one with a callable `env` (as `domains.evaluate` decides)."""
    return callable(getattr(domain, "env", None))


def _declares_tools(domain: object) -> str | None:
    """Why `domain` looks like a tool-use domain (an `env` attribute, `uses_tools`, a `tool_demonstration`), or None."""
    if getattr(domain, "env", None) is not None:
        return "it has an `env` attribute"
    if getattr(domain, "uses_tools", False):
        return "uses_tools is true"
    if getattr(domain, "tool_demonstration", None) is not None:
        return "it has a tool_demonstration"
    return None


def check_student_domains(domains: Mapping[str, object], *, budgets: Mapping[str, int] | None = None,
                          longest_prompt: Mapping[str, int] | None = None, context_len: int | None = None,
                          compaction: Compactions = None) -> None:
    """Refuse, before any sampling, a domain the student cannot sample correctly (it would otherwise be distilled
    without its tool outputs, or fail mid-run), naming the domain and the reason:

    - a domain that declares tool use (an `env` attribute, `uses_tools`, a `tool_demonstration`) but has no callable
      `env(example, guard=...)`;
    - a tool domain whose `env` does not accept `guard` (the student's episodes run under the specialists' guard);
    - without `compaction`: a tool domain whose longest prompt + episode budget (`budgets`, tool output included)
      does not fit the student's context (`context_len`; the engine refuses such a request);
    - with `compaction` (the specialists' `max_context_tokens`, which the student's episodes then follow too; one
      for every domain or a mapping per domain, `domains.compaction.compaction_for`): a tool domain when its window
      does not fit the student's context.
    """
    problems = []
    for name, dom in domains.items():
        why = _declares_tools(dom)
        if why is None:
            continue
        env = getattr(dom, "env", None)
        if not callable(env):
            problems.append(f"domain {name!r} declares tool use ({why}) but has no callable "
                            "env(example, guard=...)")
            continue
        try:
            params = inspect.signature(env).parameters
        except (TypeError, ValueError):
            params = {}
        if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            missing = [k for k in ("guard",) if k not in params]
            if missing:
                problems.append(f"domain {name!r}: env() does not accept {missing}; the student runs its episodes "
                                "with env(example, guard=...)")
                continue
        if budgets is None or longest_prompt is None or name not in budgets:
            continue
        need = int(longest_prompt.get(name, 0)) + int(budgets[name])
        own = compaction_for(compaction, name)
        if own is not None and need > own.max_context_tokens:
            if context_len and own.max_context_tokens >= context_len:
                problems.append(f"domain {name!r}: its episodes are compacted to specialists.max_context_tokens="
                                f"{own.max_context_tokens}, which does not fit the student's context "
                                f"({context_len} tokens)")
        elif context_len and need >= context_len:
            problems.append(f"domain {name!r}: a tool episode may need {need} tokens (longest prompt "
                            f"{longest_prompt.get(name, 0)} + episode budget {budgets[name]}, tool output "
                            f"included) but the student's context is {context_len} tokens: set "
                            "specialists.max_context_tokens (compaction), lower distill.max_new_tokens or use a "
                            "model with a longer context")
    if problems:
        raise ValueError("distill: the student cannot sample these domains correctly (refused rather than distilled "
                         "without their tool outputs): " + "; ".join(problems))


async def sample_batch(client: EngineClient, items: Sequence[PromptItem], *, max_new_tokens: int | Mapping[str, int],
                       temperature: float, eos_id: int | Sequence[int], expected_version: int,
                       sampling_seed: int | None = None, domains: Mapping[str, object] | None = None,
                       tokenizer=None, compaction: Compactions = None,
                       guards: Mapping[str, object] | None = None) -> list[StudentSample]:
    """Sample one response per prompt, every prompt as an episode (`domains.episodes.run_episodes`): a plain
    domain's is one turn, a tool domain's (`domains[item.domain]` has an `env`; `tokenizer` is then required) a full
    episode (module docstring); round r sends turn r of every unfinished episode in ONE /generate call. Each
    sample carries the version the server reports (it applies weight updates between requests, never inside one;
    an episode whose turns saw several versions carries the oldest, so its lag is never underestimated) and the
    rollout log-probs of its tokens (0 on tool output, whose `loss_mask` is 0).
    `sampling_seed`: the k-th plain item samples with seed `sampling_seed + k`, turn t of a tool episode with
    `seed_for(sampling_seed, "<sample_id>-<t>")`; None: the server's.
    `max_new_tokens`: one budget, or one per domain (the batch mixes domains: each request gets its own's); a tool
    episode's budget counts its tool output too.
    `eos_id`: the stop id(s) (`infra.chat.stop_token_ids`: EOS, the generation config's, the end of turn).
    `compaction`: each turn of a tool episode is generated from the episode's compacted context, within
    `max_context_tokens` (module docstring); the samples still hold whole episodes (`split_subtraces` cuts them).
    `guards`: {domain: a `domains.guard.Guard` or None}: a tool episode's env is `env(example, guard=...)`, the env
    the specialists' rollouts run (planted shortcut included); a domain not in it runs unguarded. Each sample
    carries the calls its guard blocked (`blocked_calls`).

    The stop token, when sampled, stays in `output_ids`: the student must learn to stop, and the teacher scores it.
    """
    if not items:
        return []
    stops = [int(eos_id)] if isinstance(eos_id, int) else [int(t) for t in eos_id]
    per = [int(max_new_tokens[it.domain]) if isinstance(max_new_tokens, Mapping) else int(max_new_tokens)
           for it in items]
    tools = {i for i, it in enumerate(items) if domains is not None and is_tool_domain(domains[it.domain])}
    if tools and tokenizer is None:
        raise ValueError("sample_batch: tool-domain prompts need the tokenizer (tool output becomes tokens)")
    plain_seed = {i: k for k, i in enumerate(i for i in range(len(items)) if i not in tools)}  # item → k-th plain

    def text(ids: Sequence[int]) -> str:
        return response_text(tokenizer, ids, stops)

    summarize = tokenizer_summarizer(tokenizer) if any_compaction(compaction) and tools else None
    runs: list[EpisodeRun] = []
    versions: list[list[int]] = [[] for _ in items]

    def rid_seed(i: int, turn: int) -> tuple[str, int | None]:
        """A plain prompt's one turn: rid = its sample id, seed = sampling_seed + its index among the plain ones
        (as one plain /generate call would number them); turn t of a tool episode: `<sample_id>-<t>`, seeded by
        its name."""
        if i not in tools:
            return items[i].sample_id, None if sampling_seed is None else sampling_seed + plain_seed[i]
        call = f"{items[i].sample_id}-{turn}"
        return call, None if sampling_seed is None else seed_for(sampling_seed, call)

    async def generate(batch: list[tuple[int, list[int], int, int]]) -> list[tuple[list[int], list[float], str]]:
        named = [rid_seed(i, t) for i, _, _, t in batch]
        budgets = [m for _, _, m, _ in batch]
        gens = await client.generate([ctx for _, ctx, _, _ in batch],
                                     max_new_tokens=budgets[0] if len(set(budgets)) == 1 else budgets,
                                     temperature=temperature, stop_token_ids=stops,
                                     stop=[[TURN_END] if i in tools else None for i, *_ in batch] if tools else None,
                                     return_logprob=True, rid=[r for r, _ in named],
                                     sampling_seed=None if sampling_seed is None else [x for _, x in named])
        for (i, *_), g in zip(batch, gens):
            versions[i].append(parse_version(g.weight_version, expected_version))
        return [(g.output_ids, g.output_logprobs, g.finish_reason) for g in gens]

    try:  # every env opened is closed, also when a later one fails to open
        for i, it in enumerate(items):
            # the specialists' env (teachers/rollout.py `Roller.episode`): shortcut planted, the domain's guard
            env = domains[it.domain].env(it.example, guard=(guards or {}).get(it.domain)) if i in tools else None
            runs.append(EpisodeRun(it.prompt_ids, per[i], env=env, tokenizer=tokenizer, text=text,
                                   compaction=compaction_for(compaction, it.domain) if env is not None else None,
                                   summarize=summarize))
        episodes = await run_episodes(runs, generate)
    finally:
        for run in runs:
            if run.env is not None:
                run.env.close()
    return [StudentSample(it.sample_id, it.cursor, it.domain, it.example, it.prompt_ids, ep.output_ids,
                          ep.output_logprobs, min(versions[i], default=expected_version), ep.finish_reason,
                          loss_mask=ep.loss_mask if i in tools else None, blocked_calls=ep.blocked_calls,
                          calls=ep.calls)
            for i, (it, ep) in enumerate(zip(items, episodes))]


def episode_reward(domain, sample: StudentSample, tokenizer, eos_id: int | Sequence[int]) -> float:
    """A whole episode's reward (`distill.reward_coef`): the domain's verifier on the response text, and 0 for an
    episode with a call the guard blocked (`sample.blocked_calls`): a hack attempt never pays, even when the
    intended path after it reached the right answer. Take it before `split_subtraces` (sub-traces inherit it)."""
    return guarded_reward(sample.blocked_calls,
                          lambda: domain.verify(sample.example, decode_response(tokenizer, sample.output_ids, eos_id)))


def split_subtraces(samples: Sequence[StudentSample], compaction: Compactions, tokenizer) -> list[StudentSample]:
    """Each compacted tool episode → one sample per sub-trace (`domains.compaction.subtrace_spans`): prompt = the
    context the sub-trace was generated from, output = its tokens (with their loss mask and rollout log-probs), the
    episode's reward, version and cursor; sub-trace k > 0 is `<id>~k`, and every one has `episode_id` = the
    episode's id. Samples without compaction (plain, or a tool episode that never outgrew the window) are returned
    as they are. Call after the reward is taken on the whole episode."""
    if not any_compaction(compaction):
        return list(samples)
    summarize = tokenizer_summarizer(tokenizer)
    out: list[StudentSample] = []
    for s in samples:
        own = compaction_for(compaction, s.domain)
        spans = [] if s.loss_mask is None or own is None else subtrace_spans(s.prompt_ids, s.output_ids, s.loss_mask,
                                                                              own, summarize)
        if len(spans) <= 1:
            out.append(s)
            continue
        for k, sp in enumerate(spans):
            out.append(StudentSample(
                subtrace_id(s.sample_id, k), s.cursor, s.domain, s.example, list(sp.context),
                s.output_ids[sp.start:sp.end], s.rollout_logprobs[sp.start:sp.end], s.version,
                s.finish_reason if k == len(spans) - 1 else "compacted", reward=s.reward,
                loss_mask=s.loss_mask[sp.start:sp.end], episode_id=s.sample_id, blocked_calls=s.blocked_calls,
                calls=s.calls))  # the episode's calls: a record matches those in its own response
    return out


def decode_response(tokenizer, output_ids: Sequence[int], eos_id: int | Sequence[int]) -> str:
    """The response text a verifier sees: tokens up to (not including) the first stop id (`eos_id`: one or
    several), specials removed (as in evaluation)."""
    return response_text(tokenizer, output_ids, eos_id)
