"""APRIL (active partial rollouts): over-sample a rollout step, stop at the batch target, keep the unfinished work.

One rollout step, as the trainer runs it around the engine client:

    buffer.drop_stale(version)                                     # counted in buffer.dropped_stale
    n_resume, n_fresh = plan_requests(batch_target, over_sampling, len(buffer), min_extra)
    requests = buffer.take_resumable(version, n_resume) + [Partial.fresh(...) for _ in range(n_fresh)]
    finished, aborted = await collect_batch(submit, abort_all, batch_target, len(requests))
    for i, gen in finished + aborted:                              # gen: the new tokens of request i only
        out = merge_continuation(requests[i], gen.output_ids, gen.output_logprobs, version,
                                 finished=gen.finish_reason != "abort", finish_reason=gen.finish_reason)
        samples.append(out) if isinstance(out, Sample) else buffer.add_partial(out)
    batch = buffer.filter_untrained(samples); train(batch); buffer.mark_trained(s.sample_id for s in batch)
    save weights + cursor + buffer.state_dict() in one checkpoint

A resumed request sends `partial.input_ids` (prompt + output so far) with `max_new_tokens = remaining_budget`; its
tokens carry the policy version that sampled them (`token_versions`), so the trainer can correct them with TIS
(`teachers.ppo_math.tis_weights`) or drop them (`mask_offpolicy(mask, versions, current, max_staleness)`).
`loss_mask` is 1 on model tokens and 0 on tokens the environment inserted (tool output), which are never trained.

Exactly-once (every sample trains once, none is lost silently), given two things from the trainer: the buffer's
`state_dict()` is written into the same checkpoint as the weights and the prompt cursor, so the three commit
together (one atomic rename); and a fresh sample's id is a function of the cursor (e.g. f"{domain}-{cursor}"):

* A sample id lives in exactly one place: in flight (this step, in memory only), in the buffer (a partial), in the
  ledger (trained), or counted in `dropped_stale` (deliberately discarded: too off-policy to train).
  `add_partial` refuses an id that is already buffered or already trained, so no path can put it in two places.
* Not lost: a crash between checkpoints rolls weights, buffer, ledger and cursor back together. Partials taken
  out of the buffer in the lost steps are still in the restored buffer, and fresh prompts are re-issued by the
  restored cursor under the same ids, so every sample not in the restored ledger is regenerated.
* Not twice: the training done in the lost steps is rolled back with the weights, so retraining those ids is
  the first training *as far as the committed model is concerned*. Within the committed history,
  `filter_untrained` drops any sample whose id is in the ledger or repeats in the batch (e.g. a network retry
  that returned one request twice), and `mark_trained` adds the ids in the same commit as the weight update.
The ledger grows by one short string per trained sample (~30 bytes; 1M samples ≈ 30 MB of JSON).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from training.ledger import Ledger

STATE_FORMAT = 1
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Partial:
    """An unfinished trajectory. Token lists are aligned: `output_ids[t]` was sampled with log-prob
    `output_logprobs[t]` by policy version `token_versions[t]`; `loss_mask[t]` is 0 on environment tokens."""

    sample_id: str  # stable across resumes: the ledger key
    rollout_id: str  # shared by the sub-traces of one trajectory
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    domain: str
    example: dict  # JSON payload of the domain example (enough to rebuild a tool env on resume)
    remaining_budget: int  # max new tokens left (model and environment tokens both count: it bounds length)
    created_version: int
    loss_mask: list[int] = field(default_factory=list)  # empty → all ones (filled in __post_init__)
    # tool calls in `output_ids` the guard blocked: the finished trajectory's reward is 0 (domains.guard.guarded_reward);
    # it travels with the partial through resumes and checkpoints (a state saved before this field loads as 0)
    blocked_calls: int = 0
    # the tool calls in `output_ids` as the env recorded them (`domains.episodes.call_record`), for the rollout
    # records and traces; travels like `blocked_calls` (a state saved before this field loads as [])
    calls: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if not self.loss_mask and n:
            self.loss_mask = [1] * n
        where = f"partial {self.sample_id!r}"
        for name in ("output_logprobs", "token_versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{where}: {name} has {len(getattr(self, name))} entries for {n} output_ids")
        if not isinstance(self.remaining_budget, int) or self.remaining_budget < 0:
            raise ValueError(f"{where}: remaining_budget must be an int >= 0, got {self.remaining_budget!r}")
        if isinstance(self.blocked_calls, bool) or not isinstance(self.blocked_calls, int) or self.blocked_calls < 0:
            raise ValueError(f"{where}: blocked_calls must be an int >= 0, got {self.blocked_calls!r}")
        if not all(math.isfinite(x) for x in self.output_logprobs):
            raise ValueError(f"{where}: output_logprobs must be finite")

    @classmethod
    def fresh(cls, sample_id: str, prompt_ids: list[int], domain: str, example: dict, max_new_tokens: int,
              version: int, rollout_id: str | None = None) -> "Partial":
        """A request not started yet: empty output, the whole budget."""
        return cls(sample_id, rollout_id or sample_id, list(prompt_ids), [], [], [], domain, dict(example),
                   max_new_tokens, version)

    @property
    def input_ids(self) -> list[int]:
        """What a (re)submitted request sends: prompt + output so far."""
        return self.prompt_ids + self.output_ids

    def oldest_version(self) -> int | None:
        """Version of the oldest token, or None when no token was generated yet."""
        return min(self.token_versions) if self.token_versions else None


@dataclass
class Sample:
    """A finished trajectory (or sub-trace), ready to train. Same alignment as `Partial`."""

    sample_id: str
    rollout_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    domain: str
    example: dict
    finish_reason: str  # "stop" | "length"
    loss_mask: list[int] = field(default_factory=list)
    created_version: int = 0
    blocked_calls: int = 0  # tool calls the guard blocked, over every resume: reward 0 (domains.guard.guarded_reward)
    calls: list[dict] = field(default_factory=list)  # its tool calls as the env recorded them (`Partial.calls`)
    # per output token: the part of its reward the domain placed there (teachers/step_credit.py); empty: all at the end
    step_credit: list[float] = field(default_factory=list)


@dataclass
class GenResult:
    """Minimal generation result (`engine.client.Generation` has the same three fields and works too)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str


def plan_requests(batch_target: int, over_sampling: float, n_resumable: int,
                  min_extra: int = 0) -> tuple[int, int]:
    """How many requests to submit, resumed partials first:

        N = max(ceil(batch_target · over_sampling), batch_target + min_extra)   if over_sampling > 1, else batch_target
        n_resume = min(n_resumable, N),   n_fresh = N − n_resume

    `min_extra`: over-provisioning by a fraction leaves few spare requests at small batches (ceil(1.25 · 8) = 10:
    two), and a step then waits for its slowest 8 of 10; over_sampling = 1 (synchronous rollouts) adds none.
    """
    if isinstance(batch_target, bool) or not isinstance(batch_target, int) or batch_target < 1:
        raise ValueError(f"plan_requests: batch_target must be an int >= 1, got {batch_target!r}")
    if not over_sampling >= 1.0:
        raise ValueError(f"plan_requests: over_sampling must be >= 1.0, got {over_sampling!r}")
    if n_resumable < 0:
        raise ValueError(f"plan_requests: n_resumable must be >= 0, got {n_resumable!r}")
    if isinstance(min_extra, bool) or not isinstance(min_extra, int) or min_extra < 0:
        raise ValueError(f"plan_requests: min_extra must be an int >= 0, got {min_extra!r}")
    total = math.ceil(batch_target * over_sampling - 1e-9)  # 8 · 1.5 is 12, not 13 from rounding noise
    if total > batch_target:
        total = max(total, batch_target + min_extra)
    n_resume = min(n_resumable, total)
    return n_resume, total - n_resume


def merge_continuation(partial: Partial, new_ids: list[int], new_logprobs: list[float], version: int,
                       finished: bool, finish_reason: str | None = None,
                       loss_mask: list[int] | None = None, blocked_calls: int = 0,
                       calls: list[dict] | None = None) -> Partial | Sample:
    """Append one continuation (new tokens, their rollout log-probs, `version` for each) and spend the budget.
    `blocked_calls`: the continuation's tool calls the guard blocked (added to the partial's); `calls`: its tool
    calls' records (appended to the partial's).

    Returns a `Sample` when `finished` or when the budget reaches 0 (then finish_reason "length"), else a `Partial`
    (e.g. aborted mid-way, or stopped at a tool call: append the tool output with `loss_mask=[0]*n` next).
    `finish_reason` defaults to "length" if the budget is spent, else "stop".
    """
    where = f"merge_continuation({partial.sample_id!r})"
    if len(new_ids) != len(new_logprobs):
        raise ValueError(f"{where}: {len(new_ids)} new_ids but {len(new_logprobs)} new_logprobs")
    if len(new_ids) > partial.remaining_budget:
        raise ValueError(f"{where}: {len(new_ids)} new tokens exceed remaining_budget={partial.remaining_budget}")
    mask = [1] * len(new_ids) if loss_mask is None else list(loss_mask)
    if len(mask) != len(new_ids):
        raise ValueError(f"{where}: loss_mask has {len(mask)} entries for {len(new_ids)} new tokens")
    if finish_reason is not None and finish_reason not in FINISH_REASONS:
        raise ValueError(f"{where}: finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    if finished and finish_reason == "abort":
        raise ValueError(f"{where}: an aborted continuation is not finished")
    if partial.token_versions and version < max(partial.token_versions):
        raise ValueError(f"{where}: version {version} is older than the partial's newest token "
                         f"({max(partial.token_versions)}): policy versions only grow")
    merged = replace(partial, output_ids=partial.output_ids + list(new_ids),
                     output_logprobs=partial.output_logprobs + [float(x) for x in new_logprobs],
                     token_versions=partial.token_versions + [version] * len(new_ids),
                     loss_mask=partial.loss_mask + mask, remaining_budget=partial.remaining_budget - len(new_ids),
                     blocked_calls=partial.blocked_calls + blocked_calls,
                     calls=partial.calls + list(calls or []))
    if not finished and merged.remaining_budget > 0:
        return merged
    reason = finish_reason if finished and finish_reason else ("length" if merged.remaining_budget == 0 else "stop")
    return Sample(merged.sample_id, merged.rollout_id, merged.prompt_ids, merged.output_ids, merged.output_logprobs,
                  merged.token_versions, merged.domain, merged.example, reason, merged.loss_mask,
                  merged.created_version, merged.blocked_calls, merged.calls)


class AprilBuffer(Ledger):
    """Partial rollouts waiting to be resumed, plus the ledger of trained sample ids (training/ledger.py: `mark_trained`,
    `was_trained`, `filter_untrained`). Single event loop, no locks."""

    def __init__(self, max_staleness: int):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"AprilBuffer: max_staleness must be an int >= 0, got {max_staleness!r}")
        self.max_staleness = max_staleness
        self._partials: dict[str, tuple[int, Partial]] = {}  # sample_id → (insertion seq, partial)
        self._seq = 0
        super().__init__()  # the ledger
        self.added = self.resumed = self.dropped_stale = self.duplicates_skipped = 0

    def __len__(self) -> int:
        return len(self._partials)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._partials

    @property
    def counters(self) -> dict[str, int]:
        return {"added": self.added, "resumed": self.resumed, "dropped_stale": self.dropped_stale,
                "duplicates_skipped": self.duplicates_skipped, "buffered": len(self), "trained": len(self._ledger)}

    def add_partial(self, p: Partial) -> None:
        """Keep an unfinished trajectory for a later step. Refuses ids already buffered or trained (exactly-once)."""
        if p.sample_id in self._partials:
            raise ValueError(f"AprilBuffer.add_partial: sample_id {p.sample_id!r} is already in the buffer")
        if p.sample_id in self._ledger:
            raise ValueError(f"AprilBuffer.add_partial: sample_id {p.sample_id!r} was already trained")
        if p.remaining_budget <= 0:
            raise ValueError(f"AprilBuffer.add_partial: partial {p.sample_id!r} has no budget left; "
                             f"it is a finished Sample (finish_reason 'length')")
        self._partials[p.sample_id] = (self._seq, p)
        self._seq += 1
        self.added += 1

    def is_stale(self, p: Partial, current_version: int) -> bool:
        """current_version − (oldest token's version) > max_staleness. A partial without tokens is never stale."""
        oldest = p.oldest_version()
        return oldest is not None and current_version - oldest > self.max_staleness

    def drop_stale(self, current_version: int) -> list[Partial]:
        """Remove (and count) every stale partial; returns them (for logging)."""
        stale = [p for _, p in self._partials.values() if self.is_stale(p, current_version)]
        for p in stale:
            del self._partials[p.sample_id]
        self.dropped_stale += len(stale)
        return stale

    def take_resumable(self, current_version: int, k: int) -> list[Partial]:
        """Drop stale partials, then remove and return up to k partials, oldest first (oldest token version, then
        insertion order). Taken partials are in flight: merge them and add back whatever is still unfinished."""
        if k < 0:
            raise ValueError(f"AprilBuffer.take_resumable: k must be >= 0, got {k}")
        self.drop_stale(current_version)

        def age(entry: tuple[int, Partial]) -> tuple[int, int]:
            seq, p = entry
            oldest = p.oldest_version()
            return (p.created_version if oldest is None else oldest, seq)

        taken = [p for _, p in sorted(self._partials.values(), key=age)[:k]]
        for p in taken:
            del self._partials[p.sample_id]
        self.resumed += len(taken)
        return taken

    # -- the ledger ----------------------------------------------------------------------------------------------
    def mark_trained(self, ids: Iterable[str]) -> None:
        """Record sample ids as trained (call with the same commit as the weight update they went into); an id that
        is still a buffered partial is refused (exactly-once: one place per id)."""
        ids = list(ids)
        for sid in ids:
            if sid in self._partials:
                raise ValueError(f"AprilBuffer.mark_trained: {sid!r} is still a buffered partial")
        super().mark_trained(ids)

    # -- persistence ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state: partials in insertion order, counters, ledger (sorted)."""
        ordered = sorted(self._partials.values(), key=lambda e: e[0])
        return {"format": STATE_FORMAT, "max_staleness": self.max_staleness,
                "partials": [asdict(p) for _, p in ordered],
                "counters": {"added": self.added, "resumed": self.resumed, "dropped_stale": self.dropped_stale,
                             "duplicates_skipped": self.duplicates_skipped},
                "ledger": sorted(self._ledger)}

    def load_state_dict(self, state: dict) -> None:
        """Replace this buffer's state. `max_staleness` stays the constructor's (a config value, may change)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"AprilBuffer.load_state_dict: expected format {STATE_FORMAT}, got {got!r}")
        partials: dict[str, tuple[int, Partial]] = {}
        for i, d in enumerate(state.get("partials", [])):
            try:
                p = Partial(**d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"AprilBuffer.load_state_dict: partials[{i}] is invalid: {e}") from e
            if p.sample_id in partials:
                raise ValueError(f"AprilBuffer.load_state_dict: partials[{i}] repeats sample_id {p.sample_id!r}")
            partials[p.sample_id] = (i, p)
        ledger = set(state.get("ledger", []))
        both = sorted(ledger & set(partials))
        if both:
            raise ValueError(f"AprilBuffer.load_state_dict: ids both buffered and trained: {both[:5]}")
        counters = state.get("counters", {})
        self._partials, self._seq, self._ledger = partials, len(partials), ledger
        self.added, self.resumed = int(counters.get("added", 0)), int(counters.get("resumed", 0))
        self.dropped_stale = int(counters.get("dropped_stale", 0))
        self.duplicates_skipped = int(counters.get("duplicates_skipped", 0))

    def save(self, path: str | Path) -> None:
        """Write the state as JSON atomically: a temp file beside `path`, fsync, then `os.replace`."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        data = json.dumps(self.state_dict(), allow_nan=False, separators=(",", ":"))
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | Path) -> None:
        try:
            state = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"AprilBuffer.load: {path} is not valid JSON: {e}") from e
        self.load_state_dict(state)


Indexed = list[tuple[int, Any]]  # (request index, generation result)


async def collect_batch(submit: Callable[[int], Awaitable[Any]], abort_all: Callable[[], Any], batch_target: int,
                        n_requests: int, abort_timeout_s: float = 30.0) -> tuple[Indexed, Indexed]:
    """Start `submit(0) … submit(n_requests−1)` at once; as soon as `batch_target` of them finished
    ("stop"/"length"), call `abort_all()` (sync or async) and gather the rest, whose results come back with
    finish_reason "abort" and their partial output.

    Returns `(finished, partials)`, lists of `(request index, result)`; `finished` is in completion order and may
    exceed `batch_target` (requests that finished while the abort was in flight are kept, not wasted). A request
    still running `abort_timeout_s` after the abort (an engine that ignores it) is cancelled and returned as a
    partial with no new tokens (`GenResult([], [], "abort")`), so its sample is not lost. If a request raises, the
    others are aborted and cancelled and the first exception propagates (the caller still holds the unchanged
    partials it submitted and puts them back, or restarts from the checkpoint).
    """
    if batch_target < 1 or n_requests < 0:
        raise ValueError(f"collect_batch: need batch_target >= 1 and n_requests >= 0, got {batch_target}, {n_requests}")
    tasks = {asyncio.ensure_future(submit(i)): i for i in range(n_requests)}
    finished: Indexed = []
    partials: Indexed = []
    pending = set(tasks)
    aborted = False

    async def abort() -> None:
        nonlocal aborted
        aborted = True
        r = abort_all()
        if inspect.isawaitable(r):
            await r

    def take(done: set) -> None:
        for t in sorted(done, key=tasks.__getitem__):
            res = t.result()  # re-raises a request's exception
            if res.finish_reason == "abort":
                partials.append((tasks[t], res))
            elif res.finish_reason in ("stop", "length"):
                finished.append((tasks[t], res))
            else:
                raise ValueError(f"collect_batch: request {tasks[t]} returned finish_reason {res.finish_reason!r}")

    # completions arrive through one queue (a done-callback per task): O(1) per completion, where a loop of
    # asyncio.wait(FIRST_COMPLETED) re-registers a callback on every pending task at each wake-up (O(n) each)
    completed: asyncio.Queue = asyncio.Queue()
    for t in tasks:
        t.add_done_callback(completed.put_nowait)
    try:
        while pending and not aborted:
            done = {await completed.get()}
            while not completed.empty():  # everything else that completed meanwhile, in index order (as before)
                done.add(completed.get_nowait())
            pending -= done
            take(done)
            if len(finished) >= batch_target and pending:
                await abort()
        if pending:
            done, pending = await asyncio.wait(pending, timeout=abort_timeout_s)
            take(done)
            for t in pending:  # the engine ignored the abort: give up on these requests' new tokens only
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            partials.extend((tasks[t], GenResult([], [], "abort")) for t in pending)
            pending = set()
    except BaseException:
        for t in tasks:  # retrieve every finished task's exception so none is reported as "never retrieved"
            if t.done() and not t.cancelled():
                t.exception()
        live = [t for t in tasks if not t.done()]
        if live and not aborted:
            try:
                await abort()
            except Exception:  # the original error matters more than a failed abort
                pass
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        raise
    partials.sort(key=lambda e: e[0])
    return finished, partials
