"""Compaction into sub-traces for PPO (docs/architecture.md, "Compaction into sub-traces"). The compaction itself (when,
the summary, the current context of an episode, its sub-traces) is `domains/compaction.py`, shared with the OPD
student; this module turns a finished episode (`teachers.april.Sample`, full history) into the rows PPO trains:

each sub-trace becomes its own row: prompt_ids = the context it was generated from (what the critic sees), output =
the tokens generated in it (env tokens keep loss mask 0; trailing env tokens of a non-final sub-trace are dropped:
the next sub-trace's context holds them), reward = the episode's final reward (so its own GAE advantages end at its
own last model token). The ledger keeps the episode id; sub-trace ids are `<episode id>/<j>` (j: the sub-trace's
index in `plan`) with `rollout_id` = the episode id. An episode that was never compacted stays one unchanged row.
"""
from __future__ import annotations

from typing import Sequence

from domains.compaction import (Compaction, SubTrace, Summarize, current_context, notes_summarizer, plan,  # noqa: F401
                                split_turns, subtrace_spans, tokenizer_summarizer)
from teachers.april import Sample


def subtrace_samples(sample: Sample, cfg: Compaction, summarize: Summarize) -> list[Sample]:
    """`sample` as the rows PPO trains (module docstring)."""
    mask = list(sample.loss_mask) or [1] * len(sample.output_ids)
    subs = plan(sample.prompt_ids, sample.output_ids, mask, cfg, summarize)
    if len(subs) == 1:
        return [sample]
    index = {s.start: j for j, s in enumerate(subs)}
    out = []
    for sub in subtrace_spans(sample.prompt_ids, sample.output_ids, mask, cfg, summarize):
        j, sl = index[sub.start], slice(sub.start, sub.end)
        out.append(Sample(f"{sample.sample_id}/{j}", sample.sample_id, list(sub.context), sample.output_ids[sl],
                          sample.output_logprobs[sl], sample.token_versions[sl], sample.domain, sample.example,
                          sample.finish_reason if j == len(subs) - 1 else "stop", mask[sl],
                          sample.created_version))
    return out


def expand(samples: Sequence[Sample], rewards: Sequence[float], cfg: Compaction | None,
           summarize: Summarize | None) -> tuple[list[Sample], list[float]]:
    """Every episode's sub-traces, each with its episode's reward (cfg None: the samples unchanged)."""
    if len(samples) != len(rewards):
        raise ValueError(f"compaction.expand: {len(rewards)} rewards for {len(samples)} samples")
    if cfg is None:
        return list(samples), list(rewards)
    if summarize is None:
        raise ValueError("compaction.expand: a Compaction needs its summarize function")
    rows, row_rewards = [], []
    for s, r in zip(samples, rewards):
        subs = subtrace_samples(s, cfg, summarize)
        rows += subs
        row_rewards += [r] * len(subs)
    return rows, row_rewards
