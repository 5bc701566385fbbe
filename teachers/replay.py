"""Replay a recorded PPO step: its full rollout record (training/rollout_records.py, `specialists.record.full`)
rebuilt into the samples and rewards the update trained on, and trained again.

    trainer = build_specialist(cfg, domain, init_dir, prefix_with_the_checkpoint_before, work, tracker)
    trainer.resume()                              # the weights (and optimizer state) the step started from
    out = replay_step(trainer, records_prefix, step)
    out["replayed"] == out["recorded"]            # on the CPU with deterministic settings: bit for bit

A step's record holds every input of the update (prompt and response ids, the behaviour log-probs, each token's
weights version, the loss mask, the reward) and, in its metadata, the version the update started from and its
metrics (`step_meta`). The replay calls the trainer's own `update` with them, so it runs the code the step ran.
"""
from __future__ import annotations

from teachers.april import Sample
from training.rollout_records import recorded_step

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
