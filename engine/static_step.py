"""Sampling, log-probs, top-k and stop tokens of a static decode step, for the whole batch on the device, read back
with one device→host copy (`StepParams`, `sample_and_read`).

The segment path (`Engine._sample_and_check`) asks the device small questions as it goes (does any row sample? which
rows want log-probs? one transfer per top-k size), and builds index tensors from Python lists each step: on the CPU
those cost nothing, on a GPU each is a sync that idles the card. Here everything a step needs from the rows'
requests is built on the host once per change of the batch (`StepParams`), and a step is: sample (no sync:
`sampling.sample_tokens` with the host's flags), log-probs and top-k for every row at the batch's largest k, the
requested token ids' log-probs, a stop-token hit flag, all packed into one (n, W) float64 tensor (token ids and
float32 log-probs are exact in float64) and copied to the host once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import GREEDY_EPS, report_logprobs, sample_tokens


@dataclass
class StepParams:
    """What a step needs from its n rows' requests, on the device (built once per batch membership)."""

    temperature: torch.Tensor  # (n,) float32
    top_p: torch.Tensor  # (n,) float32
    top_k: torch.Tensor  # (n,) long
    any_sampled: bool  # some row has temperature ≥ 1e-6
    any_filter: bool  # some sampling row keeps less than the whole vocabulary (top-k or top-p)
    seeded: list  # (row, torch.Generator) of sampling rows with their own seed
    logprobs: bool  # some row returns log-probs
    top_k_max: int  # the largest top_logprobs_num
    token_ids: torch.Tensor | None  # (n, J) long: each row's token_ids_logprob, padded with 0; None: no row asks
    stop_ids: torch.Tensor | None  # (n, S) long: stop tokens (+ EOS unless ignore_eos), padded with -1; None: none


def step_params(seqs: list, device: torch.device, vocab: int, eos_ids: frozenset) -> StepParams:
    """`StepParams` of the rows `seqs` (engine `Seq`s, in batch order)."""
    sp = [s.spec.sampling for s in seqs]
    sampled = [p.temperature >= GREEDY_EPS for p in sp]
    filt = any(smp and (p.top_p < 1.0 or 0 < p.top_k < vocab) for smp, p in zip(sampled, sp))
    ids_rows = [list(s.spec.token_ids_logprob) if s.spec.token_ids_logprob is not None else [] for s in seqs]
    width = max((len(r) for r in ids_rows), default=0)
    token_ids = None
    if any(s.spec.token_ids_logprob is not None for s in seqs):
        token_ids = torch.tensor([r + [0] * (width - len(r)) for r in ids_rows], dtype=torch.long).to(device)
    # as `Engine._check_stop`: with ignore_eos no token stops a row (stop strings and length still do)
    stops = [[] if p.ignore_eos else sorted(set(p.stop_token_ids) | set(eos_ids)) for p in sp]
    s_width = max((len(r) for r in stops), default=0)
    stop_ids = None
    if s_width:
        stop_ids = torch.tensor([r + [-1] * (s_width - len(r)) for r in stops], dtype=torch.long).to(device)
    return StepParams(
        temperature=torch.tensor([p.temperature for p in sp], dtype=torch.float32).to(device),
        top_p=torch.tensor([p.top_p for p in sp], dtype=torch.float32).to(device),
        top_k=torch.tensor([p.top_k for p in sp], dtype=torch.long).to(device),
        any_sampled=any(sampled), any_filter=filt,
        seeded=[(i, s.generator) for i, s in enumerate(seqs) if s.generator is not None and sampled[i]],
        logprobs=any(s.spec.return_logprob for s in seqs),
        top_k_max=max((s.spec.top_logprobs_num for s in seqs if s.spec.return_logprob), default=0),
        token_ids=token_ids, stop_ids=stop_ids)


@dataclass
class StepRead:
    """One step's results on the host, row by row (python lists)."""

    ids: list[int]
    stop_hit: list[bool]
    logprob: list[float] | None  # the sampled token's reported log-prob
    top: list[tuple[list[float], list[int]]] | None  # top-k (values, ids) at the batch's largest k
    token_ids_logprobs: list[list[float]] | None


def sample_and_read(logits: torch.Tensor, params: StepParams, generator: torch.Generator | None,
                    original_logprob: bool) -> tuple[torch.Tensor, StepRead]:
    """Sample one token per row of `logits` (n, V) and read everything the rows asked for back in one copy.
    Returns (the sampled ids (n,) on the device, for the next step's input; the host-side `StepRead`).

    Random numbers are drawn as `Engine._sample_and_check` draws them (one uniform per row from the engine's
    generator, then a row's own seeded generator overrides its number), so a seed gives the same tokens."""
    n, dev = logits.shape[0], logits.device
    uniform = torch.zeros(n, device=dev)
    if params.any_sampled:
        uniform = torch.rand(n, generator=generator, device=dev)
        for i, g in params.seeded:
            uniform[i] = torch.rand(1, generator=g, device=dev)
    ids = sample_tokens(logits, params.temperature, params.top_p, params.top_k, uniform,
                        flags=(params.any_sampled, params.any_filter))
    cols = [ids.double()[:, None]]
    if params.stop_ids is not None:
        cols.append((ids[:, None] == params.stop_ids).any(dim=1, keepdim=True).double())
    else:
        cols.append(torch.zeros((n, 1), dtype=torch.float64, device=dev))
    k, j = params.top_k_max, 0
    if params.logprobs:
        logp = report_logprobs(logits, params.temperature, original_logprob)  # (n, V) float32
        cols.append(logp.gather(1, ids[:, None]).double())
        if k > 0:
            k = min(k, logp.shape[-1])
            vals, top_ids = torch.topk(logp, k, dim=-1, sorted=True)
            cols += [vals.double(), top_ids.double()]
        if params.token_ids is not None:
            j = params.token_ids.shape[1]
            cols.append(logp.gather(1, params.token_ids).double())
    host = torch.cat(cols, dim=1).cpu().tolist()  # the step's one device→host copy
    read = StepRead(ids=[int(r[0]) for r in host], stop_hit=[r[1] > 0.5 for r in host], logprob=None, top=None,
                    token_ids_logprobs=None)
    if params.logprobs:
        read.logprob = [r[2] for r in host]
        if k > 0:
            read.top = [(r[3:3 + k], [int(x) for x in r[3 + k:3 + 2 * k]]) for r in host]
        if j:
            at = 3 + 2 * k
            read.token_ids_logprobs = [r[at:at + j] for r in host]
    return ids, read
