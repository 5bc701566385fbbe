"""The OPD student trainer: sampling + teacher scoring overlap with DeepSpeed training, bounded staleness, resume.

    producer (async)                                 consumer (async; the update runs in a worker thread)
    ─────────────────                                ─────────────────────────────────────────────────────
    policy.wait_version(k − max_staleness)           batch = queue.get()
    prompts = stream.take(batch_size)                drop samples with lag > max_staleness ("stale")
    samples = sample_batch(student engine)           drop ids already in the ledger
    scored, dropped = scorer.score(samples)          update (G micro-batches, token-level loss)
    queue.put(batch k)                               push weights → student engine (version k + 1)
                                                     ledger += trained ids; cursor = batch's cursor; checkpoint

Batch k is trained at version k (the number of steps applied so far), so the gate bounds every sample's lag by
`max_staleness`; the importance ratio π_now/π_rollout (truncated at `is_clip`) corrects the sampled-token losses of
samples from an older student. With max_staleness = 0 the loop is synchronous and on-policy (ratio ≡ 1).
`distill.deterministic`: batch k is sampled with seed `seed_for(seed, "distill-batch-k")` and always at version
k − max_staleness (the push of version v + 1 waits until batch v + max_staleness is sampled), so a run does not
depend on timing.

Exactly-once: ids are `s{cursor}-{domain}`. A checkpoint commits together (one manifest): HF weights, DeepSpeed
state (weights, optimizer, scheduler, RNG), and `trainer.json` with step, the cursor of the last committed batch, the
ledger of trained ids and every dropped id with its reason. Batches sampled ahead of the last commit are simply
re-issued after a resume (same ids), so `trained + dropped == cursor` always holds, with no id in both. Ids are
episodes: the sub-traces of a compacted tool episode (`<id>~k`, student/sampler.py) are trained or dropped together.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from domains.compaction import compaction_for, episode_of
from domains.episodes import episode_budget
from domains.evaluate import evaluate_domains, tool_metrics
from domains.tools import count_tool_calls
from infra.chat import stop_token_ids, token_budget
from infra.checkpoint_budget import checkpoint_rule
from training.batching import MAX_BUCKETS, length_buckets, length_sorted_split, step_micro_batches
from engine.client import seed_for
from training.ledger import Ledger
from training.checkpoints import commit_checkpoint, restore_latest
from training.progress_events import report
from training.mfu import mfu, step_perf
from training.rl_math import seq_mean_weights
from training.ranks import Ranks, led
from training.rollout_records import Recorder, RolloutRow, eval_rows
from training.step_metrics import host_floats
from student.batch import collate, opd_loss, reward_advantage
from student.losses import get_loss
from student.sampler import (PromptStream, StudentSample, check_student_domains, domain_weights, episode_reward,
                             is_tool_domain, sample_batch, split_subtraces)
from student.scoring import TeacherScorer

log = logging.getLogger("alloy.student")
DROP_STALE = "stale"
STATE_PARTS = ("state",)  # the DeepSpeed state: only the newest checkpoint on a GPU keeps it


@dataclass
class ScoredBatch:
    index: int
    stream_state: dict  # the prompt stream's state right after this batch was taken
    samples: list[StudentSample]
    dropped: list[tuple[str, str]]
    sampled_tokens: int
    sample_s: float
    score_s: float
    guard: dict[str, int] = field(default_factory=dict)  # the guards' counters of this batch (`guard_counts`)


@dataclass
class TrainerState:
    """Everything besides the DeepSpeed state that a resume needs (saved as trainer.json)."""

    step: int = 0  # batches consumed = the policy version of the weights after them
    cursor: int = 0  # prompt-stream cursor after the last committed batch
    stream: dict = field(default_factory=dict)  # the prompt stream's state after the last committed batch
    dropped: dict[str, str] = field(default_factory=dict)  # sample_id → reason
    updates: int = 0  # optimizer updates (a step whose samples were all dropped makes none)
    sampled_tokens: int = 0
    scored_tokens: int = 0
    evals: list[dict] = field(default_factory=list)
    guard_totals: dict[str, int] = field(default_factory=dict)  # committed batches' guard counters, summed


class DistillTrainer:
    """Wires the pieces; `await run()` trains to `dc.steps`. `backend` is a DeepSpeedBackend over the student,
    `policy` its PolicyServer, `scorer` a TeacherScorer, `dc` an `infra.config.DistillConfig`."""

    def __init__(self, dc, backend, tokenizer, policy, scorer: TeacherScorer, domains: dict, *, out_url: str,
                 work_dir: str | Path, tracker, seed: int = 0, eval_max_new_tokens: int = 16,
                 eval_batch_size: int = 128, on_step=None, ranks=None, chat_template: str = "auto",
                 compaction=None, guards: dict | None = None):
        """`compaction`: a `domains.compaction.Compaction` from `specialists.max_context_tokens`, or one per domain
        (`compactions_of`: `specialists.per_domain` merged in; None: off): tool episodes are then sampled from
        compacted contexts and trained as sub-traces, as the specialists' were.
        `guards`: {tool domain: `domains.guard.Guard` or None} (student/distill_main.py `student_guards`): the guard
        each tool domain's episodes run under; an episode with a blocked call gets reward 0 (student/sampler.py)."""
        # several ranks (torchrun): rank 0 drives this loop, the others run `ranks.follow()` (student/distill_main)
        self.ranks = ranks or Ranks()
        raw, backend = backend, led(backend, self.ranks, "student")
        self.loss = get_loss(dc.loss)  # the OPD loss, looked up once; it says what it needs (teacher top-k)
        self.raw_backend = raw  # the backend itself: the update runs on it on every rank, never the led one
        self.ranks.on(self.update_shard)
        self.dc, self.backend, self.tok, self.policy, self.scorer = dc, backend, tokenizer, policy, scorer
        self.domains, self.out_url, self.work_dir, self.tracker = domains, out_url, Path(work_dir), tracker
        self.seed, self.eval_max_new_tokens, self.eval_batch_size = seed, eval_max_new_tokens, eval_batch_size
        self.on_step = on_step  # called as on_step(trainer, metrics) after every committed step (tests, progress)
        self.recorder = Recorder(dc.record, out_url, tracker, last_step=dc.steps)  # rollout records (rank 0)
        self.pad, self.chat_template = tokenizer.pad_token_id, chat_template
        # stop ids (infra.chat: EOS, the generation config's, the end of turn) and each domain's budget in tokens
        self.stops = stop_token_ids(tokenizer, getattr(getattr(backend, "module", None), "generation_config", None),
                                    chat_template)
        self.budgets = {n: token_budget(d, tokenizer, dc.max_new_tokens) for n, d in domains.items()}
        # a tool domain's budget is a whole episode's, tool output and the policy's compaction requests and summaries
        # included (`domains.episodes.episode_budget`, as the specialists' rollouts and evaluation)
        self.budgets.update({n: episode_budget(d, self.budgets[n], compaction_for(compaction, n))
                             for n, d in domains.items() if is_tool_domain(d)})
        config = getattr(getattr(backend, "module", None), "config", None)
        self.context_len = getattr(config, "max_position_embeddings", None)
        self.state = TrainerState()
        self.ledger = Ledger()  # the exactly-once ledger of trained ids
        self.stream = PromptStream(domains, tokenizer, dc.n_prompts_per_domain, seed, chat_template)
        # tool domains the sampler cannot run correctly are refused here, before any server starts or any sampling
        check_student_domains(domains, budgets=self.budgets, longest_prompt=self.stream.longest_prompt(),
                              context_len=self.context_len, compaction=compaction)
        self.compaction = compaction
        self.guards = dict(guards or {})
        self.train_tokens = 0  # prompt + response positions forwarded through training updates (this process)
        self.train_flops = 0.0  # one card's training FLOPs of those updates (training/mfu.py)
        self.timing = {"sample_s": 0.0, "score_s": 0.0, "train_s": 0.0, "push_s": 0.0, "push_load_s": 0.0,
                       "eval_s": 0.0, "ckpt_s": 0.0}
        self._sampled_changed = asyncio.Condition()  # notified when a batch has been sampled (`_wait_sampled`)
        self._sampled = 0  # batches whose sampling returned (the producer's next index)
        self._producer: asyncio.Task | None = None
        self._last_metrics: dict = {}

    # -- resume ---------------------------------------------------------------------------------------------------
    def resume(self) -> str | None:
        """Restore the newest complete checkpoint under out_url, if any (DeepSpeed state, ledger, stream, counters).
        Returns the local HF dir of its weights, which the caller serves as version `state.step`; None if none."""
        restored = restore_latest(self.work_dir, self.out_url, self.ranks.world_size, who="student",
                                  setting="distill.train.world_size", state_parts=STATE_PARTS,
                                  keep_setting="distill.keep_checkpoints")
        if restored is None:
            return None
        local, data, url = restored
        self.backend.load_state(local / "state")
        self.ledger.load_state_dict(data.pop("ledger"))
        self.state = TrainerState(**data)
        if self.state.stream:
            self.stream.load_state_dict(self.state.stream)
        log.info("student: resumed %s at step %d (cursor %d, %d trained ids)", url, self.state.step,
                 self.state.cursor, self.ledger.n_trained)
        return str(local / "hf")

    # -- the loop -------------------------------------------------------------------------------------------------
    async def run(self) -> dict:
        """Train until `dc.steps`; returns the summary (see `summary`)."""
        self.scorer.require(self.stream.names)
        self.tracker.log_dict({"teachers": {d: c.base_url for d, c in self.scorer.clients.items()},
                               "resumed_at_step": self.state.step}, "distill/teachers.json")
        t0 = self._t_start = time.perf_counter()
        self._tokens_at_start = (self.state.sampled_tokens, self.state.scored_tokens)
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.dc.max_staleness + 1)
        self._sampled = self.state.step  # the server starts with the weights of this step (its loaded_version)
        producer = self._producer = asyncio.create_task(self._produce(queue))
        try:
            if self.state.step == 0 and self.dc.eval_every and not self.state.evals:
                await self._evaluate()  # the start of the per-domain curves (overlaps the first sampling)
            while self.state.step < self.dc.steps:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    producer.result()  # re-raises the producer's error
                    raise RuntimeError("student: the sampler stopped before the last step")
                await self._consume(get.result())
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            # the last push's load: the server is current
            done = await asyncio.gather(self.policy.wait_loaded(), return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException):
                raise r
        self.timing["push_load_s"] = self.policy.load_s  # the overlapped loads, as the server timed them
        self.wall_s = time.perf_counter() - t0
        if self.dc.eval_every and (not self.state.evals or self.state.evals[-1]["step"] != self.state.step):
            await self._evaluate()
        await asyncio.to_thread(self.checkpoint)
        return self.summary()

    async def _produce(self, queue: asyncio.Queue) -> None:
        k = self.state.step
        while k < self.dc.steps:
            try:  # bounded staleness: batch k trains at version k, sampled from weights the server has LOADED
                # (a push loads while the next batch trains: double buffering)
                await self.policy.wait_version(k - self.dc.max_staleness)
            except Exception as e:  # a failed load: the run must not wait on weights that will not come
                raise RuntimeError(f"student: loading weights into the rollout server failed: {e}") from e
            weights = None
            if self.dc.domain_weighting == "rkl":  # more prompts for the teachers the student is furthest from
                weights = domain_weights(self.stream.names, self.scorer.recent_rkl(), self.dc.rkl_mix)
            items = self.stream.take(self.dc.batch_size, weights)
            t = time.perf_counter()
            samples = await sample_batch(self.policy.client, items, max_new_tokens=self.budgets,
                                         temperature=self.dc.temperature, eos_id=self.stops,
                                         expected_version=self.state.step,
                                         sampling_seed=seed_for(self.seed, f"distill-batch-{k}")
                                         if self.dc.deterministic else None,
                                         domains=self.domains, tokenizer=self.tok,  # tool domains: full episodes
                                         compaction=self.compaction, guards=self.guards)
            t_sample = time.perf_counter() - t
            async with self._sampled_changed:
                self._sampled = k + 1
                self._sampled_changed.notify_all()
            for s in samples:  # on whole episodes; then a compacted one becomes its sub-traces, each with its reward
                s.reward = episode_reward(self.domains[s.domain], s, self.tok, self.stops)  # a blocked call: 0
            guard = guard_counts(self.guards, samples)
            samples = split_subtraces(samples, self.compaction, self.tok)
            t = time.perf_counter()
            scored, dropped = await self.scorer.score(samples)
            await queue.put(ScoredBatch(k, self.stream.state_dict(), scored, dropped,
                                        sum(len(s.output_ids) for s in samples), t_sample, time.perf_counter() - t,
                                        guard))
            k += 1

    async def _consume(self, batch: ScoredBatch) -> None:
        st, version = self.state, self.state.step
        samples, dropped = whole_episodes(batch.samples, batch.dropped)  # ledger and drops count episodes
        fresh = [s for s in samples if version - s.version <= self.dc.max_staleness]
        dropped += [(e, DROP_STALE) for e in dict.fromkeys(s.episode for s in samples
                                                           if version - s.version > self.dc.max_staleness)]
        fresh = untrained(self.ledger, fresh)
        metrics: dict = {}
        if fresh:
            t = time.perf_counter()
            metrics = await asyncio.to_thread(self.update, fresh, version)
            train_s = time.perf_counter() - t
            self.timing["train_s"] += train_s
            self.train_tokens += sum(len(s.prompt_ids) + len(s.output_ids) for s in fresh)  # positions trained
            st.updates += 1
            if metrics:  # an update ran (none with distill.debug.rollout_only)
                metrics.update(self._perf(fresh, train_s))
        if self.dc.deterministic:  # batch version + max_staleness must still be sampled from these weights
            await self._wait_sampled(min(version + self.dc.max_staleness, self.dc.steps - 1) + 1)
        t = time.perf_counter()
        # the weights are copied out now (before the next update touches them); the server loads them while the
        # next batch trains, and the producer's gate (`wait_version`) waits for the load only when staleness needs it
        await self.policy.push(self.backend, self.tok, version + 1, wait=False)
        self.timing["push_s"] += time.perf_counter() - t
        self.recorder.record(version + 1, fresh, lambda s: self.rollout_row(s, version),
                             meta={"version": version, "rows": len(fresh), "metrics": metrics})
        # commit point of this batch (in memory; durable at the next checkpoint, together with the weights)
        self.ledger.mark_trained(s.episode for s in fresh)
        st.dropped.update(dropped)
        st.stream, st.cursor, st.step = batch.stream_state, batch.stream_state["cursor"], version + 1
        st.sampled_tokens += batch.sampled_tokens
        st.scored_tokens += sum(len(s.output_ids) for s in batch.samples)
        for k, v in batch.guard.items():
            st.guard_totals[k] = st.guard_totals.get(k, 0) + v
        self.timing["sample_s"] += batch.sample_s
        self.timing["score_s"] += batch.score_s
        metrics.update(self._step_metrics(batch, fresh, dropped, version))
        self._last_metrics = metrics
        report(st.step, self.dc.steps, **metrics)  # every step, as data, for the process that started us
        if st.step % self.dc.log_every == 0 or st.step == self.dc.steps:
            # a thread: a slow tracking server must not stall the producer's HTTP on this loop
            await asyncio.to_thread(self.tracker.log_metrics, {**metrics, **self.scorer.metrics()}, st.step)
            log.info("student step %d/%d: loss %.4f rkl %.4f reward %.3f lag %.2f dropped %d", st.step, self.dc.steps,
                     metrics.get("train/loss", float("nan")), metrics.get("train/reverse_kl", float("nan")),
                     metrics["train/reward"], metrics["train/lag_mean"], len(dropped))
        if self.dc.eval_every and st.step % self.dc.eval_every == 0 and st.step < self.dc.steps:
            await self._evaluate()
        if st.step % self.dc.checkpoint_every == 0 and st.step < self.dc.steps:
            await asyncio.to_thread(self.checkpoint)
        if self.on_step is not None:
            self.on_step(self, metrics)

    async def _wait_sampled(self, n: int) -> None:
        """Until the producer has sampled `n` batches; re-raises its error if it stops first."""
        if self._sampled >= n:
            return

        async def sampled() -> None:
            async with self._sampled_changed:
                await self._sampled_changed.wait_for(lambda: self._sampled >= n)

        waiter = asyncio.ensure_future(sampled())
        await asyncio.wait({waiter, self._producer}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            if self._sampled >= n:
                return
            self._producer.result()  # re-raises the producer's error
            raise RuntimeError(f"student: the sampler stopped before batch {n - 1} was sampled")

    def _step_metrics(self, batch: ScoredBatch, fresh: list, dropped: list, version: int) -> dict:
        rewards = [s.reward for s in batch.samples] or [0.0]
        lags = [version - s.version for s in batch.samples] or [0]
        return {"train/reward": float(np.mean(rewards)), "train/lag_mean": float(np.mean(lags)),
                "train/lag_max": float(max(lags)), "train/samples": float(len(fresh)),
                "train/dropped": float(len(dropped)), "train/cursor": float(self.state.cursor),
                **{f"train/guard_{k}": float(v) for k, v in batch.guard.items()},
                **{f"throughput/{k}": v for k, v in self.throughput().items()}}

    # -- one update (worker thread) ---------------------------------------------------------------------------------
    def update(self, samples: list[StudentSample], version: int) -> dict:
        """One optimizer step of weights `version` over `samples` (the loop's; a replayed step's: student/replay.py):
        rank 0 announces it and every rank runs its shard (`update_shard`). Returns its metrics; none with
        `distill.debug.rollout_only` (the step samples, scores and records only)."""
        if self.dc.debug.rollout_only:
            return {}
        return self.ranks.call(self.update_shard, samples, version)

    def update_shard(self, samples: list[StudentSample], version: int) -> dict:
        """This rank's shard of one optimizer step over the global batch `samples` (`opd_update`)."""
        return opd_update(self.raw_backend, samples, version, self.dc, self.loss, self.tok.pad_token_id,
                          rank=self.ranks.rank, world=self.ranks.world_size)

    def rollout_row(self, s: StudentSample, version: int) -> RolloutRow:
        """Sample `s` (trained in the update of weights `version`) as a rollout record."""
        response = self.tok.decode(s.output_ids)
        return RolloutRow(stage="student", domain=s.domain, step=version + 1, sample_id=s.sample_id,
                          episode_id=s.episode, weight_version=s.version, staleness=version - s.version,
                          prompt=self.tok.decode(s.prompt_ids), response=response, prompt_ids=list(s.prompt_ids),
                          output_ids=list(s.output_ids), behaviour_logprobs=list(s.rollout_logprobs),
                          teacher_logprobs=None if s.teacher_logprobs is None else list(s.teacher_logprobs),
                          reward=float(s.reward or 0.0), finish_reason=s.finish_reason,
                          loss_mask=None if s.loss_mask is None else list(s.loss_mask),
                          blocked_calls=s.blocked_calls,
                          tool_calls=count_tool_calls(response) if hasattr(self.domains.get(s.domain), "env") else 0,
                          calls=list(s.calls) or None, token_versions=[s.version] * len(s.output_ids),
                          teacher_topk_ids=None if s.teacher_topk_ids is None else np.asarray(s.teacher_topk_ids).tolist(),
                          teacher_topk_logprobs=None if s.teacher_topk_logprobs is None
                          else np.asarray(s.teacher_topk_logprobs).tolist())

    # -- eval, checkpoint, summary ----------------------------------------------------------------------------------
    async def _evaluate(self) -> dict:
        t = time.perf_counter()

        def run():
            self.backend.eval_mode()
            try:  # the first `record.sample` episodes of each domain kept: the eval sample of the rollout records
                df, kept = evaluate_domains(self.backend.module, self.tok, self.domains, self.dc.eval_n, self.seed,
                                            "student", max_new_tokens=self.eval_max_new_tokens,
                                            batch_size=self.eval_batch_size, chat_template=self.chat_template,
                                            compaction=self.compaction, keep=self.dc.record.sample)
            finally:
                self.backend.train_mode()
            step = self.state.step  # the weights evaluated are this step's
            self.recorder.record_eval(step, eval_rows("student", step, step, kept, self.tok.decode),
                                      meta={"version": step, "scores": {
                                          r.domain: {"score": float(r.score), "raw_score": float(r.raw_score)}
                                          for r in df.itertuples()}})
            return df

        df = await asyncio.to_thread(run)
        scores = {r.domain: float(r.score) for r in df.itertuples()}
        extra = tool_metrics(df, "eval/")  # tool domains: raw score and hack attempts beside the clean one
        self.timing["eval_s"] += time.perf_counter() - t
        mean = float(np.mean(list(scores.values())))
        self.state.evals.append({"step": self.state.step, "scores": scores, "mean": mean})
        self.tracker.log_metrics({**{f"eval/{d}": v for d, v in scores.items()}, **extra, "eval/mean": mean},
                                 step=self.state.step)
        log.info("student eval at step %d: mean %.3f", self.state.step, mean)
        return scores

    def checkpoint(self) -> str:
        """Commit weights (HF + DeepSpeed state), cursor, ledger and drops as one checkpoint; keep the last
        `distill.keep_checkpoints` (on a GPU the older ones without their DeepSpeed state)."""
        t = time.perf_counter()

        def write_parts(local: Path) -> None:
            self.backend.save_hf(local / "hf", tokenizer=self.tok)
            self.backend.save_state(local / "state")

        keep, slim = checkpoint_rule(self.dc.keep_checkpoints, on_gpu=self.backend.device.type != "cpu")
        url = commit_checkpoint(self.work_dir, self.out_url, self.state.step, self.ranks.world_size,
                                dict(vars(self.state), ledger=self.ledger.state_dict()), write_parts,
                                meta={"stage": "student", "cursor": self.state.cursor}, keep_last=keep,
                                state_parts=STATE_PARTS, slim=slim)
        self.timing["ckpt_s"] += time.perf_counter() - t
        self.last_checkpoint = url
        self.recorder.flush()  # the committed steps' rows to the MLflow tables
        return url

    def _perf(self, fresh: list, train_s: float) -> dict:
        """One update's `perf/train_tokens_per_s` (prompt + response positions over its time) and `perf/mfu` (one
        card's; absent without a known peak, as on the CPU): the student trained once (forward + backward) on every
        row (training/mfu.py). Adds its FLOPs to the run's (`summary`'s `mfu`)."""
        if train_s <= 0:
            return {}
        p = step_perf([self.backend.model_shape], [len(s.prompt_ids) + len(s.output_ids) for s in fresh], train_s,
                      self.backend.peak_tflops, self.ranks.world_size)
        self.train_flops += p["flops"]
        return {k: v for k, v in (("perf/train_tokens_per_s", p["tokens_per_s"]), ("perf/mfu", p["mfu"]))
                if v is not None}

    def throughput(self) -> dict[str, float]:
        """Tokens per second of this run's producer/consumer loop (wall clock: the overlap is the point)."""
        if not hasattr(self, "_t_start"):
            return {"sampled_tokens_per_s": 0.0, "teacher_scored_tokens_per_s": 0.0}
        wall = getattr(self, "wall_s", None) or time.perf_counter() - self._t_start
        s0, c0 = self._tokens_at_start
        return {"sampled_tokens_per_s": (self.state.sampled_tokens - s0) / wall if wall else 0.0,
                "teacher_scored_tokens_per_s": (self.state.scored_tokens - c0) / wall if wall else 0.0}

    def summary(self) -> dict:
        return {
            "steps": self.state.step, "updates": self.state.updates, "cursor": self.state.cursor,
            "trained_samples": self.ledger.n_trained, "dropped": dict(self.state.dropped),
            "duplicates_skipped": self.ledger.duplicates_skipped, "wall_s": self.wall_s, "timing_s": dict(self.timing),
            "train_tokens": self.train_tokens, "device": str(self.backend.device),
            "train_tokens_per_s": self.train_tokens / self.timing["train_s"] if self.timing["train_s"] else None,
            "mfu": mfu(self.train_flops, self.timing["train_s"], self.backend.peak_tflops),
            "weight_sync": {"strategy": str(self.policy.sync), "last_path": str(self.policy.last_path)},
            "sampled_tokens": self.state.sampled_tokens, "scored_tokens": self.state.scored_tokens,
            "throughput": self.throughput(), "teachers": self.scorer.totals(), "evals": list(self.state.evals),
            "guard": dict(self.state.guard_totals),
            "checkpoint": getattr(self, "last_checkpoint", None), "last_metrics": self._last_metrics,
            "rollout_records": self.recorder.summary(),
        }


GUARD_METRICS = ("tool_calls", "flagged", "blocked")


def guard_counts(guards: dict, samples: list[StudentSample]) -> dict[str, int]:
    """One batch's guard counters (empty when no tool domain has a guard): the guards' `tool_calls`, `flagged` and
    `blocked` since the last batch (`snapshot_and_reset`; a guard shared by several domains counted once), and
    `blocked_episodes`, the whole episodes with a blocked call (reward 0)."""
    distinct = {id(g): g for g in guards.values() if g is not None}
    if not distinct:
        return {}
    out = dict.fromkeys(GUARD_METRICS, 0)
    for g in distinct.values():
        snap = g.snapshot_and_reset()
        for k in GUARD_METRICS:
            out[k] += int(snap.get(k, 0))
    out["blocked_episodes"] = sum(1 for s in samples if s.blocked_calls)
    return out


def whole_episodes(samples: list[StudentSample], dropped: list[tuple[str, str]]
                   ) -> tuple[list[StudentSample], list[tuple[str, str]]]:
    """Drops per episode: a dropped sub-trace (`<episode id>~k`, `student.sampler.split_subtraces`) drops its whole
    episode, recorded once under the episode's id with the first reason, so `trained + dropped == cursor` holds in
    episodes. Without sub-traces nothing changes."""
    bad: dict[str, str] = {}
    for sid, reason in dropped:
        bad.setdefault(episode_of(sid), reason)
    return [s for s in samples if s.episode not in bad], list(bad.items())


def untrained(ledger: Ledger, samples: list[StudentSample]) -> list[StudentSample]:
    """`ledger.filter_untrained` by episode: an episode is kept (all its sub-traces) iff its id is neither trained
    nor repeated in this batch."""
    keep = {s.sample_id for s in ledger.filter_untrained([s for s in samples if s.sample_id == s.episode])}
    seen: set[str] = set()
    out = []
    for s in samples:
        if s.episode in keep and s.sample_id not in seen:
            seen.add(s.sample_id)
            out.append(s)
    return out


def opd_update(backend, samples: list[StudentSample], version: int, dc, loss, pad: int, *, rank: int = 0,
               world: int = 1) -> dict:
    """One optimizer step over rank `rank`'s shard (samples rank, rank + W, ...) of the global batch `samples`, in
    exactly G = grad_accum micro-batches (DeepSpeed's boundary count) of rows sorted by length, each forwarded in a
    few length buckets (less padding). The loss is normalised by the token count of the whole global batch
    (`loss_normalizer`), so the W ranks together apply the update one rank applies to all of `samples`, however the
    rows are grouped. With `micro_batch_tokens` in the backend's settings (grad_accum 1) the shard goes in
    token-budget micro-batches instead (`training.batching.step_micro_batches`), one forward and backward each.
    Returns the global batch's metrics."""
    G = dc.train.grad_accum
    norm = backend.loss_normalizer(sum(s.model_tokens for s in samples))  # tool output is never a target
    mine = samples[rank::world]
    # the reward baseline of the global batch (what one rank with grad_accum 1 uses), not a shard's or a micro-batch's:
    # the update is then the same sum however the rows are grouped
    adv = reward_advantage([s.reward if s.reward is not None else 0.0 for s in samples],
                           [s.domain for s in samples])[rank::world]
    # `distill.loss_agg`: every token weighs the same, or every sample (its tokens' mean), with weights of the global
    # batch and the same normaliser, so the ranks' and micro-batches' parts still sum to the one-pass loss
    row_w = (seq_mean_weights([s.model_tokens for s in samples])[rank::world]
             if dc.loss_agg == "seq_mean_token_mean" else None)
    # micro-batches of similar lengths (sorted by prompt + response length, then split), each forwarded in up to
    # MAX_BUCKETS length buckets: every bucket is padded to its own longest row, so little padding is computed; the
    # loss is a sum over tokens / the global count, so the grouping changes nothing but float rounding. Fewer samples
    # than micro-batches: zero-loss micro-steps (first) keep DeepSpeed's boundary count
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in mine]
    # or token-budget micro-batches (`micro_batch_tokens`, G = 1): one forward each, however many a step has
    budget = step_micro_batches(backend, lengths)
    chunks = budget if budget is not None else sorted(length_sorted_split(lengths, G), key=len)
    # every bucket's loss metrics (device tensors) and every micro-step's backend.step result, with their token
    # counts, in the order they are summed: read back to the host once, after the optimizer step (no sync per
    # micro-batch, training/step_metrics.py), then summed as floats exactly as they always were
    parts: list[tuple[dict, int, bool]] = []  # (metrics, tokens, from a bucket's loss)
    m: dict[str, float] = {}
    tokens = 0
    backend.train_mode()
    for k, idx in enumerate(chunks):
        # a budget's step ends at its last micro-batch (`accumulate`); else DeepSpeed counts G micro-steps
        step = backend.step if budget is None else partial(backend.accumulate, last=k == len(chunks) - 1)
        if len(idx) == 0:
            one = collate(samples[:1], pad, version, with_topk=False)
            out = backend(input_ids=one.input_ids.to(backend.device),
                          attention_mask=one.attention_mask.to(backend.device))
            step(out.logits.sum() * 0.0)
            continue
        # one micro-batch, forwarded in a few length buckets (each padded to its own longest row; a token-budget
        # micro-batch in one), one backward
        total, n_mb = None, 0
        buckets = [list(range(len(idx)))] if budget is not None else \
            length_buckets([lengths[i] for i in idx], backend.forward_buckets(MAX_BUCKETS))
        for bucket in buckets:
            rows = [idx[j] for j in bucket]
            mb = collate([mine[i] for i in rows], pad, version, with_topk=loss.needs_teacher_topk,
                         reward_adv=[adv[i] for i in rows], row_weight=None if row_w is None else [row_w[i] for i in rows])
            out = backend(input_ids=mb.input_ids.to(backend.device),
                          attention_mask=mb.attention_mask.to(backend.device))
            loss_t, bm = opd_loss(out.logits, mb, loss=loss, direction=dc.direction, beta=dc.beta,
                                  reward_coef=dc.reward_coef, is_clip=dc.is_clip, global_token_count=norm)
            total = loss_t if total is None else total + loss_t
            n = mb.num_tokens  # the host mask's count: no device read
            n_mb += n
            parts.append((bm, n, True))
        m = step(total)
        tokens += n_mb
        parts.append((m, n_mb, False))
    sums: dict[str, float] = {}
    for (_, n, from_loss), pm in zip(parts, host_floats(*(p[0] for p in parts))):
        for k, v in pm.items():  # token-weighted means; `loss` is already a share of the global mean
            sums[k] = sums.get(k, 0.0) + (v if from_loss and k in ("loss", "reward_pg_loss") else v * n)
    out_m = {f"train/{k}": (v / G if k in ("loss", "reward_pg_loss") else v / max(tokens, 1))
             for k, v in sums.items() if k not in ("stepped", "lr", "grad_norm")}
    out_m.update({"train/lr": sums.get("lr", 0.0) / max(tokens, 1), "train/grad_norm": m.get("grad_norm", 0.0),
                  "train/tokens": float(tokens)})
    return _global_metrics(out_m, backend, tokens) if world > 1 else out_m


def _global_metrics(local: dict, backend, tokens: int) -> dict:
    """A shard's `opd_update` metrics → the global batch's (a collective). Every rank sends the same keys: a rank
    whose micro-batches were all empty has none of the loss's own keys, so the union is agreed on first."""
    import torch.distributed as dist

    keys: list = [None] * backend.world_size
    dist.all_gather_object(keys, sorted(local))
    names = sorted(set().union(*keys))
    tokens_all = backend.all_reduce_sum(tokens)
    out = {}
    for k in names:
        v = local.get(k, 0.0)
        if k == "train/tokens":
            out[k] = tokens_all
        elif k in ("train/loss", "train/reward_pg_loss"):  # shares of the global token mean
            out[k] = backend.all_reduce_mean(v)
        elif k in ("train/grad_norm", "train/lr"):  # the same on every rank that trained a row
            out[k] = backend.all_reduce_sum(v if tokens else 0.0) / max(backend.all_reduce_sum(float(tokens > 0)), 1.0)
        else:
            out[k] = backend.all_reduce_sum(v * tokens) / max(tokens_all, 1.0)
    return out
