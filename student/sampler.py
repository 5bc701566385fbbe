"""On-policy sampling for the OPD student: a deterministic prompt stream and batched sampling through the engine.

The student is served by its own engine server (`infra.policy_server.PolicyServer`); the trainer pushes new weights
to it after every step. One sampling round is ONE `/generate` call with every prompt of the batch (the server
batches them continuously), so a step costs one HTTP round trip, not one per prompt.

Exactly-once bookkeeping starts here: a prompt's `sample_id` carries the stream cursor (`s{cursor:08d}-{domain}`),
and the stream's state is committed with the weights, so after a crash the restored stream re-issues ids from the
committed cursor on, and the trainer's ledger (trained ids, same commit) says which ids were already learned from.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from infra.chat import PromptRenderer, response_text
from infra.engine.client import EngineClient


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

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


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


async def sample_batch(client: EngineClient, items: Sequence[PromptItem], *, max_new_tokens: int | Mapping[str, int],
                       temperature: float, eos_id: int | Sequence[int], expected_version: int,
                       sampling_seed: int | None = None) -> list[StudentSample]:
    """Sample one response per prompt in ONE /generate call. Each sample carries the version the server reports
    (it applies weight updates between requests, never inside one) and the rollout log-probs of its tokens.
    `sampling_seed`: item i samples with seed `sampling_seed + i` (`EngineClient.generate`); None: the server's.
    `max_new_tokens`: one budget, or one per domain (the batch mixes domains: each request gets its own's).
    `eos_id`: the stop id(s) (`infra.chat.stop_token_ids`: EOS, the generation config's, the end of turn).

    The stop token, when sampled, stays in `output_ids`: the student must learn to stop, and the teacher scores it.
    """
    if not items:
        return []
    budget: int | list[int] = max_new_tokens  # type: ignore[assignment]
    if isinstance(max_new_tokens, Mapping):
        per = [int(max_new_tokens[it.domain]) for it in items]
        budget = per[0] if len(set(per)) == 1 else per
    stops = [int(eos_id)] if isinstance(eos_id, int) else [int(t) for t in eos_id]
    gens = await client.generate([it.prompt_ids for it in items], max_new_tokens=budget,
                                 temperature=temperature, stop_token_ids=stops, return_logprob=True,
                                 rid=[it.sample_id for it in items], sampling_seed=sampling_seed)
    return [StudentSample(it.sample_id, it.cursor, it.domain, it.example, it.prompt_ids, g.output_ids,
                          g.output_logprobs, parse_version(g.weight_version, expected_version), g.finish_reason)
            for it, g in zip(items, gens)]


def decode_response(tokenizer, output_ids: Sequence[int], eos_id: int | Sequence[int]) -> str:
    """The response text a verifier sees: tokens up to (not including) the first stop id (`eos_id`: one or
    several), specials removed (as in evaluation)."""
    return response_text(tokenizer, output_ids, eos_id)
