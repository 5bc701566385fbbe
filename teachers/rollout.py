"""One APRIL rollout step of a specialist through its engine server (plain and tool-use domains).

    buffer.drop_stale(version)
    n_resume, n_fresh = plan_requests(batch_size, over_sampling, len(buffer), min_extra)
    requests = buffer.take_resumable(version, n_resume) + fresh prompts from the stream
    finished, aborted = collect_batch(submit, abort_all, batch_size, len(requests))
    each result → merge_continuation → Sample (train) or Partial (back into the buffer)

A request is one *episode*: for a plain domain, one `/generate` call; for a tool domain (`domain.env(...)`), a loop
of turns — generate until EOS or a newline, run the tool call (guard first) in the sandboxed env, append its output
line as environment tokens (loss mask 0, log-prob 0), continue with the remaining budget (the loop is
`domains.episodes.run_token_episode`, shared with the OPD student's sampling). An abort stops the
episode after its current call; what it produced so far comes back as a partial and resumes next step (the env is
rebuilt from the example payload with the number of calls already made).

With a `Compaction` (config `specialists.max_context_tokens`) the engine is given the episode's *compacted*
context (domains/compaction.py: at turn boundaries, the policy's own summary line written after the env's
`>compact` request, or the rules' `>notes: …` line of the older tool outputs, plus the last `keep_last` turns) and
each call may write at most the room the context leaves; the episode itself (the partial,
the sample, the verifier's text) keeps the full history, so a resumed partial plans the same context again.

With `deterministic=True` (config `specialists.deterministic_rollouts`) a step does not depend on timing: every
generation call is seeded (`seed_for`), every request runs to the end of its episode, and `cut_by_tokens` decides
which train and which go back as partials by token count instead of completion time.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Sequence

from domains.base import Example
from domains.episodes import Episode, EpisodeRun, run_token_episode  # the turn loop, shared with the OPD student
from domains.tools import TURN_END, count_tool_calls
from infra.chat import PromptRenderer, response_text
from engine.client import EngineClient, seed_for
from engine.coalesce import Coalescer
from teachers.april import AprilBuffer, Partial, Sample, collect_batch, merge_continuation, plan_requests
from domains.compaction import Compaction, tokenizer_summarizer

log = logging.getLogger("alloy.specialist")


class PromptCursor:
    """The specialist's train prompts, shuffled once by the pool's seed and cycled; ids are `<domain>-<cursor>`
    so that a restored cursor re-issues the same ids (the ledger then says what was already trained)."""

    def __init__(self, domain, tokenizer, n: int, seed: int, chat_template: str = "auto"):
        self.domain, self.pool = domain, domain.split("train", n, seed)
        self.render, self.cursor = PromptRenderer(tokenizer, chat_template), 0

    def take(self, k: int, max_new_tokens: int, version: int) -> list[Partial]:
        out = []
        for _ in range(k):
            ex = self.pool[self.cursor % len(self.pool)]
            ids = self.render.example_ids(self.domain, ex)  # infra.chat: the rendering of every stage
            out.append(Partial.fresh(f"{self.domain.name}-{self.cursor:08d}", ids, self.domain.name, asdict(ex),
                                     max_new_tokens, version))
            self.cursor += 1
        return out


class Roller:
    """Runs episodes against the policy's engine server. `guard`: a `teachers.guard.Guard` for tool domains.
    `seed`: None lets the server draw the randomness (it depends on which requests share its batch); an int seeds
    every call with `seed_for(seed, rid)` (rid: sample, policy version, turn), so an episode's tokens depend only
    on the weights and its rid.
    Generation stops at the stop ids of `infra.chat.stop_token_ids` (EOS, the generation config's, the template's end
    of turn); a tool domain's turn also ends at the first token whose text holds a newline (the engine's `stop`
    string "\n", so a newline merged into a longer BPE token ends it too)."""

    def __init__(self, client: EngineClient, domain, tokenizer, *, temperature: float, guard=None,
                 env_kwargs: dict | None = None, seed: int | None = None, chat_template: str = "auto",
                 generation_config=None, compaction: Compaction | None = None):
        self.client, self.domain, self.tok, self.temperature, self.guard = client, domain, tokenizer, temperature, guard
        self.seed = seed
        self.compaction = compaction  # domains.compaction: the engine sees the compacted context (None: off)
        self.summarize = tokenizer_summarizer(tokenizer) if compaction is not None else None
        self.render = PromptRenderer(tokenizer, chat_template)
        self.stops = self.render.stop_ids(generation_config)
        self.uses_tools = hasattr(domain, "env")
        self.env_kwargs = dict(env_kwargs or {})
        self._aborting = False
        self.coalescer = Coalescer(client)  # used while `coalesce` (set per step by rollout_step)
        self.coalesce = False

    def text(self, ids: Sequence[int]) -> str:
        """The response text of `ids`: up to the first stop id, special tokens removed (what the verifier sees)."""
        return response_text(self.tok, ids, self.stops)

    async def abort_all(self) -> None:
        self._aborting = True
        await self.client.abort(abort_all=True)

    async def episode(self, p: Partial, version: int, rid: str) -> Episode:
        """One episode (domains.episodes): turns are `/generate` calls named `{rid}-{turn}`, from the partial's
        history on."""
        stop_strs = [TURN_END] if self.uses_tools else None
        env = None
        if self.uses_tools:
            ex = Example(**p.example)
            env = self.domain.env(ex, guard=self.guard, prior_calls=count_tool_calls(self.text(p.output_ids)),
                                  **self.env_kwargs)
        run = EpisodeRun(p.prompt_ids, p.remaining_budget, env=env, tokenizer=self.tok, text=self.text,
                         prior_ids=p.output_ids, prior_mask=p.loss_mask, compaction=self.compaction,
                         summarize=self.summarize)

        async def generate(context: list[int], max_new: int, i: int) -> tuple[list[int], list[float], str]:
            call = f"{rid}-{i}"
            seed = None if self.seed is None else seed_for(self.seed, call)
            gen = self.coalescer.generate if self.coalesce else self.client.generate
            g = (await gen([context], max_new_tokens=max_new, temperature=self.temperature,
                           stop_token_ids=self.stops, stop=stop_strs, return_logprob=True, rid=call,
                           sampling_seed=seed))[0]
            return g.output_ids, g.output_logprobs, g.finish_reason

        try:
            return await run_token_episode(run, generate, stopped=lambda: self._aborting)
        finally:
            if env is not None:
                env.close()


def cut_by_tokens(episodes: list[Episode], batch_target: int) -> tuple[list[tuple[int, Episode]],
                                                                         list[tuple[int, Episode]]]:
    """APRIL's abort decided by token count: of complete episodes (request i → `episodes[i]`), the `batch_target`
    with the fewest tokens (ties: lower index) finish, and so does any other no longer than the last of them (T
    tokens); every longer one is cut to its first T tokens and returned as a partial (finish_reason "abort"), as a
    lockstep engine that aborts when `batch_target` requests have finished would return it. A cut never ends
    inside or right before environment tokens (loss mask 0): it moves back to the model token before the tool call's
    closing newline, so the resumed episode writes that call again and the tool runs then; the partial keeps the
    guard's verdicts (`call_blocked`) of the calls whose output it keeps only. Both lists are in index order.
    Returns `(finished, partials)` like `collect_batch`."""
    if batch_target < 1:
        raise ValueError(f"cut_by_tokens: batch_target must be >= 1, got {batch_target}")
    bad = [i for i, ep in enumerate(episodes) if ep.finish_reason not in ("stop", "length")]
    if bad:
        raise ValueError(f"cut_by_tokens: episodes {bad[:5]} did not finish (finish_reason "
                         f"{episodes[bad[0]].finish_reason!r}); the cut needs complete episodes")
    if not episodes:
        return [], []
    order = sorted(range(len(episodes)), key=lambda i: (len(episodes[i].output_ids), i))
    cut = len(episodes[order[min(batch_target, len(episodes)) - 1]].output_ids)
    finished, partials = [], []
    for i, ep in enumerate(episodes):
        if len(ep.output_ids) <= cut:
            finished.append((i, ep))
            continue
        n, mask = cut, ep.loss_mask
        while n > 0 and (mask[n - 1] == 0 or mask[n] == 0):  # mask[n] exists: n ≤ cut < len(ep.output_ids)
            n -= 1
        kept = Episode(ep.output_ids[:n], ep.output_logprobs[:n], mask[:n], "abort")
        kept.call_blocked = ep.call_blocked[:kept.tool_calls]  # call k's output is the k-th env run
        kept.calls = ep.calls[:kept.tool_calls]
        partials.append((i, kept))
    return finished, partials


async def rollout_step(roller: Roller, buffer: AprilBuffer, cursor: PromptCursor, *, batch_size: int,
                       over_sampling: float, max_new_tokens: int, version: int,
                       min_extra: int = 0, deterministic: bool = False) -> tuple[list[Sample], dict]:
    """One APRIL step: returns (finished samples, counters {requests, resumed, fresh, finished, partials,
    dropped_stale}). Partials go back into `buffer`; finished samples are not yet checked against the ledger.
    `deterministic`: no abort by the clock: every request runs to its end and `cut_by_tokens` splits them (give
    the roller a seed too, or the server's sampling still depends on its batch)."""
    stale = buffer.drop_stale(version)
    n_resume, n_fresh = plan_requests(batch_size, over_sampling, len(buffer), min_extra)
    requests = buffer.take_resumable(version, n_resume) + cursor.take(n_fresh, max_new_tokens, version)
    roller._aborting = False
    # every request runs to its end (no abort by the clock): one engine request per step instead of one per
    # episode (engine/coalesce.py); a tool episode's turns keep their own calls, each turn as soon as it is ready
    roller.coalesce = not roller.uses_tools and (deterministic or len(requests) <= batch_size)

    async def submit(i: int) -> Episode:
        return await roller.episode(requests[i], version, f"{requests[i].sample_id}-v{version}")

    try:
        if deterministic:  # a batch target of every request: collect_batch never aborts, but still cleans up
            done, cut_off = await collect_batch(submit, roller.abort_all, max(len(requests), 1), len(requests))
            eps = dict(done + cut_off)  # an abort from elsewhere (cut_off) makes cut_by_tokens raise, naming it
            finished, aborted = cut_by_tokens([eps[i] for i in range(len(requests))], batch_size)
        else:
            finished, aborted = await collect_batch(submit, roller.abort_all, batch_size, len(requests))
    except BaseException:
        for p in requests:  # nothing lost: the unchanged requests go back (fresh ones too, cursor already moved)
            if p.sample_id not in buffer and not buffer.was_trained(p.sample_id):
                buffer.add_partial(p)
        raise
    samples: list[Sample] = []
    n_partial = 0
    for i, ep in finished + aborted:
        out = merge_continuation(requests[i], ep.output_ids, ep.output_logprobs, version,
                                 finished=ep.finish_reason != "abort",
                                 finish_reason=ep.finish_reason if ep.finish_reason != "abort" else None,
                                 loss_mask=ep.loss_mask, blocked_calls=ep.blocked_calls, calls=ep.calls)
        if isinstance(out, Sample):
            samples.append(out)
        else:
            buffer.add_partial(out)
            n_partial += 1
    return samples, {"requests": len(requests), "resumed": n_resume, "fresh": n_fresh, "finished": len(samples),
                     "partials": n_partial, "dropped_stale": len(stale), "buffer": len(buffer)}
