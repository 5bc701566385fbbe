"""Replay a recorded OPD step: its full rollout record (training/rollout_records.py, `distill.record.full`) rebuilt
into the samples the student's update trained on (its own log-probs, the teacher's log-probs and top-k), and trained
again on the weights the step started from; the counterpart of teachers/replay.py, which says how.
"""
from __future__ import annotations

import numpy as np

from student.sampler import StudentSample
from training.rollout_records import recorded_step


def samples_of(df) -> list[StudentSample]:
    """The rows of one step's record (in the order the update trained them) as StudentSamples."""
    out = []
    for _, r in df.iterrows():
        topk = r.teacher_topk_ids is not None
        out.append(StudentSample(
            r.sample_id, 0, r.domain, None, [int(x) for x in r.prompt_ids], [int(x) for x in r.output_ids],
            [float(x) for x in r.behaviour_logprobs], int(r.weight_version), r.finish_reason,
            teacher_logprobs=None if r.teacher_logprobs is None else [float(x) for x in r.teacher_logprobs],
            teacher_topk_ids=np.stack(r.teacher_topk_ids).astype(np.int64) if topk else None,
            teacher_topk_logprobs=np.stack(r.teacher_topk_logprobs).astype(np.float32) if topk else None,
            reward=float(r.reward), loss_mask=None if r.loss_mask is None else [int(x) for x in r.loss_mask],
            episode_id=r.episode_id if r.episode_id != r.sample_id else None, blocked_calls=int(r.blocked_calls)))
    return out


def replay_step(trainer, prefix: str, step: int) -> dict:
    """Train the student `trainer` (its weights those the recorded step started from) on step `step`'s record under
    `prefix`; returns {"step", "version", "recorded", "replayed"} (the step's metrics, this update's)."""
    df, meta = recorded_step(prefix, step, trainer.state.step)
    return {"step": step, "version": meta["version"], "recorded": meta["metrics"],
            "replayed": trainer.update(samples_of(df), meta["version"])}
