"""Compaction into sub-traces for PPO (docs/architecture.md, "Compaction into sub-traces"). The compaction itself (when,
the summary, the current context of an episode, its sub-traces) is `domains/compaction.py`, shared with the OPD
student; this module turns a finished episode (`teachers.april.Sample`, full history) into the rows PPO trains:

each sub-trace becomes its own row: prompt_ids = the context it was generated from (what the critic sees), output =
the tokens generated in it (env tokens keep loss mask 0; trailing env tokens of a non-final sub-trace are dropped:
the next sub-trace's context holds them), reward = the episode's final reward (so its own GAE advantages end at its
own last model token). The ledger keeps the episode id; sub-trace k has id `subtrace_id(episode id, k)` (`<episode
id>~k`, k > 0; the first keeps the episode's id, as the OPD student's sub-traces) with `rollout_id` = the episode
id. An episode that was never compacted stays one unchanged row. With a policy summary (`Compaction.summary
"policy"`) the summary turn is the last model turn of the sub-trace before the compaction: loss mask 1, trained with
the episode's reward like any turn; the request line before it is env (0). `counts` gives the step's compaction
events and fallbacks (the specialist's metrics `compaction_events`, `compaction_fallbacks`).
"""
from __future__ import annotations

from typing import Sequence

from domains.compaction import Compaction, Summarize, compaction_counts, plan, subtrace_id, trained_spans
from teachers.april import Sample


def subtrace_samples(sample: Sample, cfg: Compaction, summarize: Summarize) -> list[Sample]:
    """`sample` as the rows PPO trains (module docstring)."""
    mask = list(sample.loss_mask) or [1] * len(sample.output_ids)
    subs = plan(sample.prompt_ids, sample.output_ids, mask, cfg, summarize)
    if len(subs) == 1:
        return [sample]  # never compacted
    spans = trained_spans(subs, mask)
    # the last span holds the episode's end unless the last sub-trace had no model token (spans leave it out)
    last = bool(spans) and spans[-1].end == len(sample.output_ids)
    out = []
    for k, sub in enumerate(spans):
        sl = slice(sub.start, sub.end)
        final = k == len(spans) - 1 and last
        out.append(Sample(subtrace_id(sample.sample_id, k), sample.sample_id, list(sub.context),
                          sample.output_ids[sl], sample.output_logprobs[sl], sample.token_versions[sl], sample.domain,
                          sample.example, sample.finish_reason if final else "stop", mask[sl],
                          sample.created_version, sample.blocked_calls, sample.calls))  # the episode's calls
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


def counts(samples: Sequence[Sample], cfg: Compaction | None, summarize: Summarize | None) -> dict[str, int]:
    """`{"events", "fallbacks"}` summed over the episodes' plans (`domains.compaction.compaction_counts`); zeros
    without compaction."""
    total = {"events": 0, "fallbacks": 0}
    if cfg is None or summarize is None:
        return total
    for s in samples:
        mask = list(s.loss_mask) or [1] * len(s.output_ids)
        for k, v in compaction_counts(plan(s.prompt_ids, s.output_ids, mask, cfg, summarize)).items():
            total[k] += v
    return total
