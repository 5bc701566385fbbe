"""The specialist trainer: critic-based PPO on one domain, rollouts through its own engine server with APRIL.

    per step k (policy version k):
        samples = rollout_step(...)                       teachers/rollout.py (APRIL, tools + guard)
        samples = ledger.filter_untrained(samples)        exactly once
        rewards = domain.verify(example, response)        a raising verifier gives 0 and is counted
                  or, for a model-rewarded domain, the batch's rewards in one call (domains/model_reward.py)
        attach_step_credit(domain, samples, rewards)      teachers/step_credit.py: parts of it on their tokens
        rows = expand(samples, rewards)                   teachers/compaction.py: a compacted episode's sub-traces
        ppo_update(policy, critic, batch(rows), rewards)  teachers/ppo_step.py (critic only during warm-up)
        push weights → engine (version k + 1); ledger += ids
    with `async_rollouts`, step k's update runs in a thread while the server samples step k+1's batch from version
    k (the loop waits for that batch before it pushes k + 1, so every token's version is exact; the push is then a
    snapshot, its load overlapping the next update); a step that ends with a checkpoint does not overlap
        every `val_every` (and before step 1): greedy score on the val split's prompts; a new best is kept
        (teachers/selection.py); `patience` / `stop_at` end the loop early
        every `checkpoint_every`: policy HF + both DeepSpeed states + the best policy so far + trainer.json (APRIL
        buffer with the ledger, prompt cursor, step, metric history, validations) as ONE checkpoint
        (infra.storage COMPLETE manifest)

Resume: the newest complete `step-*` under `out_url` restores all of it; the partial rollouts in the buffer resume
first. Off-policy tokens of resumed partials are corrected by TIS (trainer log-prob vs rollout log-prob, in
`ppo_update`) and, with `mask_offpolicy`, masked when older than `max_staleness` versions.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from domains.guard import guarded_reward
from domains.tools import count_tool_calls
from domains.verifiers import verifier_outcomes
from infra.checkpoint_budget import checkpoint_rule
from training.checkpoints import commit_checkpoint, restore_latest
from training.mfu import mfu, step_perf
from training.progress_events import report
from training.ranks import Ranks, led
from training.rollout_records import Recorder, RolloutRow, eval_rows
from teachers import ppo_math
from teachers.april import AprilBuffer, Sample
from teachers.compaction import Compaction, counts, expand
from teachers.ppo_step import build_batch, ppo_update, reduce_metrics, token_logprobs
from teachers.rollout import PromptCursor, Roller, rollout_step
from teachers.selection import Selection
from teachers.step_credit import attach_step_credit

log = logging.getLogger("alloy.specialist")
BEST_DIR = "best-hf"  # the best-validating policy (HF dir), in the work dir and in every checkpoint
STATE_PARTS = ("policy-state", "critic-state")  # the DeepSpeed states: only the newest checkpoint on a GPU keeps them


@dataclass
class SpecialistState:
    step: int = 0
    cursor: int = 0
    history: list[dict] = field(default_factory=list)  # per-step metrics (the progress artifact / report)
    guard_totals: dict[str, int] = field(default_factory=dict)
    verifier_errors: int = 0
    selection: Selection = field(default_factory=Selection)  # validation history and the best step
    stopped: str | None = None  # why training ended before `steps` (early stopping), else None

    def to_json(self) -> dict:
        return dict(vars(self), selection=self.selection.state_dict())

    @classmethod
    def from_json(cls, data: dict) -> SpecialistState:
        return cls(**dict(data, selection=Selection.from_state(data.get("selection"))))


def compaction_of(sc) -> Compaction | None:
    """The `Compaction` of `specialists.max_context_tokens` / `compact_keep_last` / `compaction_summary`, or None."""
    return Compaction.of(sc)


def offpolicy_mask(samples: list[Sample], mask: torch.Tensor, version: int, max_lag: int) -> torch.Tensor:
    """`mask` with the tokens of `samples` older than `max_lag` versions zeroed (batch alignment of build_batch:
    output token j of row b is predicted at position P_b + j − 1)."""
    versions = torch.full_like(mask, float(version))
    for b, s in enumerate(samples):
        P = len(s.prompt_ids)
        versions[b, P - 1:P - 1 + len(s.token_versions)] = torch.tensor(s.token_versions, dtype=versions.dtype)
    return ppo_math.mask_offpolicy(mask, versions, version, max_lag)


class SpecialistTrainer:
    """`sc`: infra.config.SpecialistsConfig; `policy`/`critic`: DeepSpeedBackends; `server`: a PolicyServer."""

    def __init__(self, sc, domain, tokenizer, policy, critic, server, *, out_url: str, work_dir, tracker, seed: int,
                 max_new_tokens: int, guard=None, ref_model=None, on_step=None, ranks=None,
                 chat_template: str = "auto", rewarder=None):
        # several ranks (torchrun): rank 0 drives this loop, the others run `ranks.follow()` (teachers/specialist_main)
        self.ranks = ranks or Ranks()
        # the update runs on every rank inside the announced call: on the backends themselves (bound here, before
        # `led` wraps them), never the led ones, whose collective methods would announce a call of their own
        self.backends = (policy, critic)  # the DeepSpeed backends themselves (`policy`, `critic` may be led)
        self.ranks.on(self.update_shard)
        policy, critic = led(policy, self.ranks, "policy"), led(critic, self.ranks, "critic")
        self.sc, self.domain, self.tok, self.policy, self.critic = sc, domain, tokenizer, policy, critic
        self.server, self.out_url, self.work_dir, self.tracker = server, out_url, Path(work_dir), tracker
        self.max_new_tokens, self.guard, self.on_step, self.seed = max_new_tokens, guard, on_step, seed
        self.ref_model = ref_model  # frozen base policy for the KL penalty (kl_coef > 0), else None
        self.rewarder = rewarder  # a model-rewarded domain's reward model or judge (domains/model_reward.py), or None
        self.buffer = AprilBuffer(max_staleness=sc.max_staleness)
        self.chat_template = chat_template  # model.chat_template: how prompts become ids (infra.chat)
        self.cursor = PromptCursor(domain, tokenizer, sc.n_prompts, seed, chat_template)
        self.state = SpecialistState()
        self.val_examples = domain.split("val", sc.val_n, seed) if sc.val_every else []
        self.work: dict[str, float] = {}  # this process's training FLOPs, update seconds, positions (`_perf`)
        self.last_checkpoint: str | None = None
        self.recorder = Recorder(sc.record, out_url, tracker, last_step=sc.steps)  # rollout records (rank 0)

    # -- resume / checkpoint -----------------------------------------------------------------------------------
    def resume(self) -> str | None:
        """Restore the newest complete checkpoint; returns its local HF dir (to serve), or None."""
        restored = restore_latest(self.work_dir, self.out_url, self.ranks.world_size,
                                  who=f"specialist {self.domain.name}",
                                  setting="specialists.policy_train/critic_train.world_size",
                                  state_parts=STATE_PARTS, keep_setting="specialists.keep_checkpoints")
        if restored is None:
            return None
        local, data, url = restored
        self.policy.load_state(local / "policy-state")
        self.critic.load_state(local / "critic-state")
        self.buffer.load_state_dict(data.pop("april"))
        self.state = SpecialistState.from_json(data)
        self.cursor.cursor = self.state.cursor
        shutil.rmtree(self.best_dir, ignore_errors=True)
        if (local / BEST_DIR).is_dir():
            shutil.copytree(local / BEST_DIR, self.best_dir)
        log.info("specialist %s: resumed %s at step %d (%d partials, %d trained ids)", self.domain.name, url,
                 self.state.step, len(self.buffer), len(self.buffer.state_dict()["ledger"]))
        return str(local / "hf")

    def checkpoint(self) -> str:
        """Commit policy (HF + DeepSpeed state), critic, the best policy so far, cursor and APRIL buffer (with its
        ledger) as one checkpoint (training/checkpoints.py); `specialists.keep_checkpoints` are kept (on a GPU the
        older ones without their DeepSpeed states)."""
        def write_parts(local: Path) -> None:
            self.policy.save_hf(local / "hf", tokenizer=self.tok)
            self.policy.save_state(local / "policy-state")
            self.critic.save_state(local / "critic-state")
            if self.best_dir.is_dir():
                shutil.copytree(self.best_dir, local / BEST_DIR)

        self.state.cursor = self.cursor.cursor
        keep, slim = checkpoint_rule(self.sc.keep_checkpoints, on_gpu=self.policy.device.type != "cpu")
        url = commit_checkpoint(self.work_dir, self.out_url, self.state.step, self.ranks.world_size,
                                dict(self.state.to_json(), april=self.buffer.state_dict()), write_parts,
                                meta={"stage": "specialist", "domain": self.domain.name}, keep_last=keep,
                                state_parts=STATE_PARTS, slim=slim)
        self.last_checkpoint = url
        self.recorder.flush()  # the committed steps' rows to the MLflow tables
        return url

    # -- the loop ------------------------------------------------------------------------------------------------
    @property
    def rewarders(self) -> dict | None:
        """{domain: rewarder} for the evaluations (`score_domains`), or None for a verifier domain."""
        return {self.domain.name: self.rewarder} if self.rewarder is not None else None

    @property
    def best_dir(self) -> Path:
        return self.work_dir / BEST_DIR

    async def run(self) -> dict:
        sc = self.sc
        if sc.val_every and not self.state.selection.history:
            self.validate()
        ahead: asyncio.Future | None = None  # async_rollouts: the next step's batch, sampled while this one trains
        try:
            while self.state.step < sc.steps and self.state.stopped is None:
                metrics, ahead = await self.train_step(ahead)
                if self.on_step is not None:
                    self.on_step(self, metrics)
                step = self.state.step
                if sc.val_every and (step % sc.val_every == 0 or step == sc.steps):
                    self.validate()
                    if step < sc.steps:  # at the last step nothing is stopped early
                        self.state.stopped = self.state.selection.stop_reason(sc.patience, sc.stop_at)
                    if self.state.stopped:
                        log.info("specialist %s: stopping early at step %d/%d: %s", self.domain.name, step, sc.steps,
                                 self.state.stopped)
                if step % sc.checkpoint_every == 0 and step < sc.steps and self.state.stopped is None:
                    self.checkpoint()  # (no batch is in flight at a checkpoint step: `_overlaps`)
        finally:
            if ahead is not None:  # stopped early (or failed) with a batch in flight: it is not trained
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)
        await self.server.wait_loaded()  # the last push's load (deferred with async_rollouts)
        self.checkpoint()
        sel = self.state.selection
        return {"steps": self.state.step, "history": self.state.history, "guard": dict(self.state.guard_totals),
                "april": self.buffer.counters, "verifier_errors": self.state.verifier_errors,
                "checkpoint": self.last_checkpoint, "validation": sel.history, "best_step": sel.best_step,
                "best_val": sel.best_score, "stopped": self.state.stopped, "device": str(self.policy.device),
                "weight_sync": {"strategy": str(self.server.sync), "last_path": str(self.server.last_path)},
                "rollout_records": self.recorder.summary(), **self.perf_summary()}

    def validate(self) -> float:
        """Greedy score of the current policy on the val-split prompts; a new best is saved to `best_dir`."""
        from domains.evaluate import score_domains

        t0 = time.perf_counter()
        self.policy.eval_mode()
        try:  # the first `record.sample` episodes kept: the validation's sample of the rollout records (split "val")
            scores = score_domains(self.policy.module, self.tok, {self.domain.name: self.domain},
                                   {self.domain.name: self.val_examples}, self.max_new_tokens,
                                   chat_template=self.chat_template, budgets={self.domain.name: self.max_new_tokens},
                                   keep=self.sc.record.sample, rewarders=self.rewarders)
        finally:
            self.policy.train_mode()
        # a model-rewarded domain selects on its model's reward, never on a ground truth it may have
        rewards = selection_rewards(scores[self.domain.name])
        score, step, sel = float(np.mean(rewards)), self.state.step, self.state.selection
        self.recorder.record_eval(step, eval_rows("specialist", step, step, scores, self.tok.decode, split="val"),
                                  meta={"version": step, "scores": {self.domain.name: {
                                      "score": score, "raw_score": float(np.mean(scores[self.domain.name].raw))}}})
        if sel.record(step, score):
            shutil.rmtree(self.best_dir, ignore_errors=True)
            self.policy.save_hf(self.best_dir, tokenizer=self.tok)
        self.tracker.log_metrics({"val/score": score, "val/best": sel.best_score}, step=step)
        log.info("specialist %s step %d: validation %.3f on %d held-out prompts (best %.3f at step %d, %.1fs)",
                 self.domain.name, step, score, len(rewards), sel.best_score, sel.best_step,
                 time.perf_counter() - t0)
        return score

    def _overlaps(self, version: int) -> bool:
        """Whether step `version` trains while the next step's batch is sampled: with `async_rollouts`, unless it is
        the last step or ends with a checkpoint (which must not hold a batch in flight)."""
        nxt = version + 1
        return self.sc.async_rollouts and nxt < self.sc.steps and nxt % self.sc.checkpoint_every != 0

    async def _collect(self, weights: int) -> RolloutBatch:
        """One step's batch sampled from policy version `weights` (waits until the server has loaded it), verified
        and expanded into training rows, with the guard's counters of its rollout."""
        sc = self.sc
        await self.server.wait_version(weights)
        t0 = time.perf_counter()
        det = sc.deterministic_rollouts  # seeded calls + the abort by token count: the same run under any load
        roller = Roller(self.server.client, self.domain, self.tok, temperature=sc.temperature, guard=self.guard,
                        seed=self.seed if det else None, chat_template=self.chat_template,
                        generation_config=getattr(self.policy.module, "generation_config", None),
                        compaction=compaction_of(sc))
        samples, april = await rollout_step(roller, self.buffer, self.cursor, batch_size=sc.batch_size,
                                            over_sampling=sc.over_sampling, max_new_tokens=self.max_new_tokens,
                                            version=weights, min_extra=sc.min_extra_requests, deterministic=det)
        rollout_s = time.perf_counter() - t0
        samples = self.buffer.filter_untrained(samples)
        errors0, outcomes0 = self.domain.verifier_errors, verifier_outcomes(self.domain)
        if self.rewarder is not None:  # the whole batch in one call to the served reward model or judge
            rewards, model_counts = await model_sample_rewards(self.rewarder, samples, roller.text,
                                                               self.max_new_tokens)
        else:
            rewards, model_counts = sample_rewards(self.domain, samples, roller.text), {}  # a blocked call: 0
        if sc.step_credit:  # where the domain says its reward was earned, on those tokens (teachers/step_credit.py)
            attach_step_credit(self.domain, samples, rewards, self.tok, roller.stops)
        self.state.verifier_errors += self.domain.verifier_errors - errors0
        reward_counts = {**reward_outcome_counts(outcomes0, verifier_outcomes(self.domain)), **model_counts}
        # compaction: each episode's sub-traces are its rows, each with the episode's reward (teachers/compaction.py)
        rows, row_rewards = expand(samples, rewards, roller.compaction, roller.summarize)
        compacted = counts(samples, roller.compaction, roller.summarize)
        guard = self.guard.snapshot_and_reset() if self.guard is not None else {}
        guard = {**guard, **reward_counts}  # the code verifier's zeros by reason count beside the guard's counters
        if self.guard is not None:
            guard["blocked_episodes"] = sum(1 for s in samples if s.blocked_calls)  # trained with reward 0
        return RolloutBatch(samples, rewards, rows, row_rewards, april, guard, reward_counts, rollout_s, compacted)

    async def train_step(self, ahead: asyncio.Future | None = None) -> tuple[dict, asyncio.Future | None]:
        """One PPO step on the batch `ahead` (sampled during the previous step) or on one sampled now; returns its
        metrics and, when this step overlaps (`_overlaps`), the next step's batch being sampled."""
        sc, version = self.sc, self.state.step
        t_step = time.perf_counter()
        b = await ahead if ahead is not None else await self._collect(version)
        nxt = None
        t1 = time.perf_counter()
        m: dict[str, float] = {}
        if self._overlaps(version):
            # the update runs in a thread while this loop samples the next batch from the weights before it
            train = asyncio.ensure_future(asyncio.to_thread(self.update, b.rows, b.row_rewards, version)
                                          if b.rows else asyncio.sleep(0, {}))
            try:
                nxt = asyncio.ensure_future(self._collect(version))
                m = await train
            except BaseException:
                if nxt is not None:
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                await asyncio.gather(train, return_exceptions=True)  # a thread cannot be cancelled: let it end
                raise
            train_s = time.perf_counter() - t1
            await asyncio.wait({nxt})  # the server ends that batch on these weights before it loads the next ones
        else:
            if b.rows:
                m = self.update(b.rows, b.row_rewards, version)
            train_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        # synchronous: the next rollout waits for the load; async: a snapshot, the load overlaps the next update
        await self.server.push(self.policy, self.tok, version + 1, wait=not sc.async_rollouts)
        push_s = time.perf_counter() - t2
        samples, rewards, rows, april, guard = b.samples, b.rewards, b.rows, b.april, b.guard
        self.buffer.mark_trained(s.sample_id for s in samples)
        self.state.step = version + 1
        self.recorder.record(self.state.step, zip(rows, b.row_rewards), lambda sr: self.rollout_row(*sr, version),
                             sample_id=lambda sr: sr[0].sample_id, meta={"version": version, "rows": len(rows), "metrics": m})
        self.state.cursor = self.cursor.cursor
        for k, v in guard.items():
            self.state.guard_totals[k] = self.state.guard_totals.get(k, 0) + v
        out = {"reward": float(np.mean(rewards)) if rewards else float("nan"), "policy_loss": m.get("pg_loss"),
               "value_loss": m.get("vf_loss"), "clip_frac": m.get("clip_frac"), "kl": m.get("approx_kl"),
               "entropy": m.get("entropy"), "explained_variance": m.get("explained_variance"),
               "tis_weight_mean": m.get("tis_weight_mean"), "rollout_s": b.rollout_s, "train_s": train_s,
               "push_s": push_s, "step_s": time.perf_counter() - t_step, "lag_mean": token_lag(rows, version),
               "train_tokens": float(sum(len(r.prompt_ids) + len(r.output_ids) for r in rows)),
               "samples": float(len(samples)), "response_tokens": float(sum(len(s.output_ids) for s in samples)),
               "subtraces": float(len(rows)), "step_credit_rows": float(sum(1 for r in rows if r.step_credit)),
               **{f"compaction_{k}": float(v) for k, v in b.compaction.items()},
               **{f"april_{k}": float(v) for k, v in april.items()},
               **{f"guard_{k}": float(guard.get(k, 0)) for k in ("tool_calls", "flagged", "blocked",
                                                                   "blocked_episodes")},
               **{f"guard_{k}": float(v) for k, v in b.reward_counts.items()}}
        out.update(self._perf(rows, m, train_s))
        out = {k: float(v) for k, v in out.items() if v is not None}
        self.state.history.append({"step": self.state.step, **out})
        report(self.state.step, sc.steps, **out)  # every step, as data, for the process that started us
        if self.state.step % sc.log_every == 0 or self.state.step == sc.steps:
            self.tracker.log_metrics(out, step=self.state.step)
            log.info("specialist %s step %d/%d: reward %.3f pg %.4f vf %.4f partials %d rollout %.2fs train %.2fs "
                     "step %.2fs", self.domain.name, self.state.step, sc.steps, out["reward"],
                     out.get("policy_loss", 0.0), out.get("value_loss", 0.0), april["partials"], b.rollout_s,
                     train_s, out["step_s"])
        return out, nxt

    def rollout_row(self, s: Sample, reward: float, version: int) -> RolloutRow:
        """Row `s` (trained with `reward` in the update of weights `version`) as a rollout record."""
        made = min(s.token_versions) if s.token_versions else s.created_version  # a resumed partial: its oldest
        response = self.tok.decode(s.output_ids)
        return RolloutRow(stage="specialist", domain=s.domain, step=version + 1, sample_id=s.sample_id,
                          episode_id=s.sample_id.split("~", 1)[0], weight_version=made, staleness=version - made,
                          prompt=self.tok.decode(s.prompt_ids), response=response, prompt_ids=list(s.prompt_ids),
                          output_ids=list(s.output_ids), behaviour_logprobs=list(s.output_logprobs),
                          reward=float(reward), finish_reason=s.finish_reason, loss_mask=list(s.loss_mask) or None,
                          blocked_calls=s.blocked_calls,
                          tool_calls=count_tool_calls(response) if hasattr(self.domain, "env") else 0,
                          calls=list(s.calls) or None, token_versions=list(s.token_versions),
                          step_credit=list(s.step_credit) or None)

    def _perf(self, rows: list[Sample], m: dict, train_s: float) -> dict:
        """This step's `perf/train_tokens_per_s` (positions of the rows over the update's time) and `perf/mfu` (one
        card's): the critic, and the policy unless the step trained the critic only, each trained `ppo_epochs`
        times (forward + backward) on the rows (training/mfu.py; the no-grad forwards are not training FLOPs).
        Adds to the run's totals (`summary`'s `mfu`); {} for a step that trained nothing."""
        if not rows or not m or train_s <= 0:
            return {}
        shapes = [self.critic.model_shape] + ([self.policy.model_shape] if "pg_loss" in m else [])
        lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rows]
        p = step_perf(shapes, lengths, train_s, self.policy.peak_tflops, self.ranks.world_size, self.sc.ppo_epochs)
        for k, v in (("flops", p["flops"]), ("train_s", train_s), ("tokens", float(sum(lengths)))):
            self.work[k] = self.work.get(k, 0.0) + v
        return {"perf/train_tokens_per_s": p["tokens_per_s"], "perf/mfu": p["mfu"]}

    def perf_summary(self) -> dict:
        """The run's `train_tokens_per_s` and one card's `mfu` over every update's time (None on the CPU)."""
        s = self.work.get("train_s", 0.0)
        return {"train_tokens_per_s": self.work["tokens"] / s if s else None,
                "mfu": mfu(self.work.get("flops"), s, self.policy.peak_tflops)}

    def update(self, samples: list[Sample], rewards: list[float], version: int) -> dict:
        """One PPO update of weights `version` on `samples` with their `rewards` (the loop's; a replayed step's:
        teachers/replay.py). Returns its metrics; none with `debug.rollout_only` (the step samples and records only)."""
        if self.sc.debug.rollout_only:
            return {}
        # every reward equal (all 0 on a hard domain, all 1 on a solved one): the whitened advantages would be pure
        # critic noise, and following them drifts the policy (seen as collapse to empty answers); train the critic only
        no_signal = max(rewards) - min(rewards) < 1e-9
        critic_only = version < self.sc.critic_warmup_steps or no_signal
        return self.ranks.call(self.update_shard, samples, rewards, version, critic_only)  # every rank: its shard

    def update_shard(self, samples: list[Sample], rewards: list[float], version: int, critic_only: bool) -> dict:
        """This rank's shard of one PPO update over the global batch `samples` (`ppo_shard`)."""
        policy, critic = self.backends
        return ppo_shard(self.sc, self.tok.pad_token_id, policy, critic, self.ref_model, samples, rewards, version,
                         critic_only, rank=self.ranks.rank, world=self.ranks.world_size)


@dataclass
class RolloutBatch:
    """One step's rollout, verified (`SpecialistTrainer._collect`): what a PPO step trains on."""
    samples: list[Sample]
    rewards: list[float]
    rows: list[Sample]  # the samples, a compacted episode as its sub-traces
    row_rewards: list[float]
    april: dict
    guard: dict[str, int]  # the guard's counters of this rollout, with the reward outcome counts
    reward_counts: dict[str, int]
    rollout_s: float
    compaction: dict[str, int] = field(default_factory=dict)  # teachers.compaction.counts: events, fallbacks


def token_lag(rows: list[Sample], version: int) -> float | None:
    """Mean over the generated tokens of `rows` of (training version − the version that sampled them): 0 for a
    synchronous step's fresh samples, 1 for an async step's, more for resumed partials' older tokens."""
    lags = [version - v for r in rows for v in r.token_versions]
    return float(np.mean(lags)) if lags else None


def reward_outcome_counts(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The verifier outcomes of one step (`domains.verifiers.verifier_outcomes` after minus before) as guard
    counters `reward_<reason>` (for `code`: reward_wrong, reward_error, reward_not_plain, reward_solution_error,
    reward_exit, reward_crash, reward_timeout, reward_malformed), the passes left out; only non-zero ones."""
    return {f"reward_{k}": n for k, v in after.items() if k != "pass" and (n := v - before.get(k, 0)) > 0}


def ppo_shard(sc, pad_id: int, policy, critic, ref_model, samples: list[Sample], rewards: list[float], version: int,
              critic_only: bool, *, rank: int = 0, world: int = 1) -> dict:
    """One PPO update on rank `rank`'s shard (rows rank, rank + W, ...) of the global batch `samples`; with the
    global-token loss normalisation and global advantage whitening of `ppo_update` the W ranks together apply the
    update one rank applies to the whole batch. A rank without rows trains on a fully masked copy of row 0 (zero
    gradient; it must still take part in every collective). Returns the global batch's metrics ({} when
    `mask_offpolicy` leaves no token on any rank)."""
    rows = list(range(rank, len(samples), world))
    part = [samples[i] for i in rows or [0]]
    batch = build_batch(part, pad_id, [rewards[i] for i in rows or [0]])
    if not rows:
        batch.mask = torch.zeros_like(batch.mask)
    if sc.mask_offpolicy:
        batch.mask = offpolicy_mask(part, batch.mask, version, sc.max_staleness)
        if policy.all_reduce_sum(batch.num_tokens) == 0:
            return {}
    ref = None
    if sc.kl_coef and ref_model is not None:
        with torch.no_grad():
            ref = token_logprobs(ref_model, batch, sc.temperature)
    m = ppo_update(policy, critic, batch, ppo_epochs=sc.ppo_epochs, eps_clip=sc.eps_clip,
                   eps_clip_high=sc.eps_clip_high, eps_clip_c=sc.eps_clip_c, value_clip=sc.value_clip,
                   gamma=sc.gamma, lam=sc.lam, entropy_coef=sc.entropy_coef,
                   kl_coef=sc.kl_coef if ref is not None else 0.0, ref_logprobs=ref,
                   tis_clip=sc.tis_clip, critic_only=critic_only, temperature=sc.temperature)
    return reduce_metrics(m, policy, len(rows))


def selection_rewards(scores) -> list[float]:
    """What a validation selects on (`DomainScores` of the val split): a model-rewarded domain's model reward (an
    unparsed judge answer: the parsed ones' mean), else the clean score."""
    from domains.reward_math import fill_unparsed

    return fill_unparsed(scores.reward) if scores.reward is not None else scores.clean


async def model_sample_rewards(rewarder, samples: list[Sample], text, budget: int) -> tuple[list[float], dict]:
    """A model-rewarded domain's PPO rewards for a whole batch (one batched call to its reward model or judge,
    domains/model_reward.py), 0 for a trajectory with a call the guard blocked; and its counters
    (`reward_unparseable`: judge answers without a score, each given the batch's mean; only when non-zero)."""
    from domains.base import Example

    if not samples:
        return [], {}
    batch = await rewarder.score([Example(**s.example) for s in samples], [text(s.output_ids) for s in samples],
                                 [len(s.output_ids) for s in samples], budget)
    rewards = [guarded_reward(s.blocked_calls, lambda r=r: r) for s, r in zip(samples, batch.rewards)]
    return rewards, ({"reward_unparseable": batch.unparseable} if batch.unparseable else {})


def sample_rewards(domain, samples: list[Sample], text) -> list[float]:
    """Each finished trajectory's PPO reward: the domain's verifier on its response text (`text(output_ids)`), and 0
    for a trajectory with a call the guard blocked in any of its segments (`Sample.blocked_calls`): a hack attempt
    never pays, even when the intended path after it reached the right answer (`domains.guard.guarded_reward`)."""
    from domains.base import Example

    return [guarded_reward(s.blocked_calls, partial(domain.verify, Example(**s.example), text(s.output_ids)))
            for s in samples]
