"""Replay a recorded PPO step: its full rollout record (training/rollout_records.py, `specialists.record.full`)
rebuilt into the samples and rewards the update trained on, and trained again.

    trainer = build_specialist(cfg, domain, init_dir, prefix_with_the_checkpoint_before, work, tracker)
    trainer.resume()                              # the weights (and optimizer state) the step started from
    out = replay_step(trainer, records_prefix, step)
    out["replayed"] == out["recorded"]            # on the CPU with deterministic settings: bit for bit

A step's record holds every input of the update (prompt and response ids, the behaviour log-probs, each token's
weights version, the loss mask, the reward) and, in its metadata, the version the update started from and its
metrics (`step_meta`). The replay calls the trainer's own `update` with them, so it runs the code the step ran.

`train_on_records(trainer, prefix)` is `specialists.debug.train_only`: a whole run from records, one update per
recorded step in order, no engine server and no rollouts (teachers/specialist_main.py `train_only_stage`).
"""
from __future__ import annotations

import logging

import numpy as np

from teachers.april import Sample
from training.progress_events import report
from training.rollout_records import read_rollouts, recorded_step, step_meta

log = logging.getLogger("alloy.specialist")
LOSSES = ("pg_loss", "vf_loss")


def samples_of(df) -> tuple[list[Sample], list[float]]:
    """The rows of one step's record (in the order the update trained them) as (samples, rewards)."""
    samples, rewards = [], []
    for _, r in df.iterrows():
        n = len(r.output_ids)
        versions = [int(v) for v in r.token_versions] if r.token_versions is not None else [int(r.weight_version)] * n
        samples.append(Sample(r.sample_id, r.episode_id, [int(x) for x in r.prompt_ids],
                              [int(x) for x in r.output_ids], [float(x) for x in r.behaviour_logprobs], versions,
                              r.domain, {}, r.finish_reason,
                              [int(x) for x in r.loss_mask] if r.loss_mask is not None else [1] * n,
                              int(r.weight_version), int(r.blocked_calls)))
        credit = getattr(r, "step_credit", None)  # alloy.rollouts/3; null: the whole reward at the end
        if credit is not None:
            samples[-1].step_credit = [float(x) for x in credit]
        rewards.append(float(r.reward))
    return samples, rewards


def replay_step(trainer, prefix: str, step: int) -> dict:
    """Train `trainer` (its weights those the recorded step started from) on step `step`'s record under `prefix`;
    returns {"step", "version", "recorded": the step's metrics, "replayed": this update's}. A step recorded as a
    sample (not `full`) is refused: its update trained on rows the record does not hold."""
    df, meta = recorded_step(prefix, step, trainer.state.step)
    samples, rewards = samples_of(df)
    return {"step": step, "version": meta["version"], "recorded": meta["metrics"],
            "replayed": trainer.update(samples, rewards, meta["version"])}


def train_on_records(trainer, prefix: str) -> dict:
    """Train `trainer` on the rollout records under `prefix` instead of sampling: the recorded steps in order, one
    update each, from the trainer's step on (a resumed run goes on after its checkpoint's step), each sample's token
    versions moved to the trainer's version (the record's staleness kept); metrics logged and reported like the
    loop's, a checkpoint every `checkpoint_every` steps and at the end. Returns the summary `select_and_commit`
    reads (no validation: the last policy is the specialist)."""
    sc = trainer.sc
    df = read_rollouts(prefix)
    steps = sorted(int(s) for s in set(df.step))
    if step_meta(prefix, steps[0]).get("rows") not in (None, int((df.step == steps[0]).sum())):
        log.warning("train_only: %s holds a sample of each step's rows (record.full was off): training on those", prefix)
    total = len(steps)
    for recorded in steps[trainer.state.step:]:
        part = df[df.step == recorded]
        samples, rewards = samples_of(part)
        version = trainer.state.step
        shift = version - int(step_meta(prefix, recorded).get("version", recorded - 1))
        for smp in samples:
            smp.token_versions = [v + shift for v in smp.token_versions]
        m = trainer.update(samples, rewards, version)
        trainer.state.step = version + 1
        out = {"reward": float(np.mean(rewards)), "policy_loss": m.get("pg_loss"), "value_loss": m.get("vf_loss"),
               "samples": float(len(samples)), "recorded_step": float(recorded)}
        out = {k: float(v) for k, v in out.items() if v is not None}
        trainer.state.history.append({"step": trainer.state.step, **out})
        report(trainer.state.step, total, **out)
        if trainer.state.step % sc.log_every == 0 or trainer.state.step == total:
            trainer.tracker.log_metrics(out, step=trainer.state.step)
        if trainer.state.step % sc.checkpoint_every == 0 or trainer.state.step == total:
            trainer.checkpoint()
    return {"steps": trainer.state.step, "history": trainer.state.history, "trained_from": prefix,
            "validation": [], "best_step": None, "best_val": None, "stopped": None, "guard": {},
            "april": trainer.buffer.counters, "checkpoint": trainer.last_checkpoint, "device": str(trainer.policy.device)}
