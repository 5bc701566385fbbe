"""Next-token sampling and log-prob bookkeeping for a batch of rows with per-row sampling parameters (pure tensors).

Semantics follow SGLang's sampler (python/sglang/srt/layers/sampler.py, SamplingParams):

- `temperature < 1e-6` means greedy: argmax of the logits (SGLang rewrites it to top_k=1, temperature=1).
- Otherwise: p = softmax(logits / T); keep the top-k tokens (`top_k = -1` keeps all) and the smallest prefix of the
  descending-sorted p whose mass reaches `top_p` (the first token is always kept); renormalise; sample.
- The reported log-prob of a token is `log softmax(logits / T_eff)` with `T_eff = 1` for greedy rows and `T` otherwise:
  SGLang reports `log(probs)` taken **after temperature scaling and before the top-k/top-p renormalisation**
  (greedy rows: raw `log_softmax(logits)`). Setting `SGLANG_RETURN_ORIGINAL_LOGPROB=1` makes SGLang (and us)
  report the raw `log_softmax(logits)` for every row. Prompt (input) log-probs are always raw `log_softmax`.

Sampling is by inverse CDF with one uniform number per row, so each row can draw from its own seeded generator.
"""
from __future__ import annotations

import torch

GREEDY_EPS = 1e-6


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  uniform: torch.Tensor, flags: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Pick one token per row.

    logits (B, V) float; temperature (B,) float (< 1e-6 → greedy); top_p (B,) in (0, 1]; top_k (B,) long, ≤ 0 or
    ≥ V means all; uniform (B,) in [0, 1), used only by non-greedy rows. Returns ids (B,) long.

    Non-greedy row: with p = softmax(logits / T) sorted descending (p_(1) ≥ p_(2) ≥ …), token rank r is kept iff
    r < top_k and sum_{j<r} p_(j) ≤ top_p; the kept masses are renormalised and the token is the first rank whose
    cumulative kept mass exceeds `uniform · total`.

    `flags` (any row samples, any sampling row filters by top-k/top-p), when the caller knows them from the rows'
    requests: then nothing here waits for the device (no `bool(tensor)`, no `nonzero`; every row's draw is computed
    and greedy rows keep their argmax), which a GPU step needs. Each row's result is the same either way.
    """
    if flags is not None:
        return _sample_no_sync(logits, temperature, top_p, top_k, uniform, *flags)
    ids = logits.argmax(dim=-1)
    sampled = temperature >= GREEDY_EPS
    if not bool(sampled.any()):
        return ids
    rows = sampled.nonzero().squeeze(1)
    probs = torch.softmax(logits[rows].float() / temperature[rows, None], dim=-1)  # (S, V)
    vocab = probs.shape[-1]
    k = top_k[rows]
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    if bool((top_p[rows] < 1.0).any()) or bool((k < vocab).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        rank = torch.arange(vocab, device=probs.device)
        drop = (mass_before > top_p[rows, None]) | (rank[None, :] >= k[:, None])
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    else:
        sorted_p, order = probs, None
    cdf = sorted_p.cumsum(dim=-1)
    target = uniform[rows].to(cdf.dtype) * cdf[:, -1]
    choice = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=vocab - 1)
    picked = choice.squeeze(1) if order is None else order.gather(1, choice).squeeze(1)
    ids[rows] = picked
    return ids


def _sample_no_sync(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                    uniform: torch.Tensor, any_sampled: bool, any_filter: bool) -> torch.Tensor:
    """`sample_tokens` over every row at once, branching only on the host's flags (see there)."""
    ids = logits.argmax(dim=-1)
    if not any_sampled:
        return ids
    sampled = temperature >= GREEDY_EPS
    t = torch.where(sampled, temperature, torch.ones_like(temperature))  # greedy rows: any finite draw, discarded
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)  # (B, V)
    vocab = probs.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    order = None
    if any_filter:
        probs, order = probs.sort(dim=-1, descending=True)
        mass_before = probs.cumsum(dim=-1) - probs
        rank = torch.arange(vocab, device=probs.device)
        probs = probs.masked_fill((mass_before > top_p[:, None]) | (rank[None, :] >= k[:, None]), 0.0)
    cdf = probs.cumsum(dim=-1)
    target = uniform.to(cdf.dtype) * cdf[:, -1]
    choice = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=vocab - 1)
    picked = choice.squeeze(1) if order is None else order.gather(1, choice).squeeze(1)
    return torch.where(sampled, picked, ids)


def report_logprobs(logits: torch.Tensor, temperature: torch.Tensor, original: bool = False) -> torch.Tensor:
    """Log-probs reported for sampled tokens: log_softmax(logits / T_eff), (B, V) → (B, V).

    T_eff = 1 for greedy rows (T < 1e-6) or when `original` (SGLANG_RETURN_ORIGINAL_LOGPROB); else T.
    Clamped to the dtype's finite minimum like SGLang, so JSON never carries -inf.
    """
    t = temperature.float()  # not the logits' dtype: a bfloat16 model's T = 0.7 would become 0.69921875
    if original:
        t = torch.ones_like(t)
    else:
        t = torch.where(t < GREEDY_EPS, torch.ones_like(t), t)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    return logp.clamp_(min=torch.finfo(logp.dtype).min)


def top_logprobs(logp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Top-k (value, id) per row of `logp` (N, V), sorted descending; k is clipped to V. Returns python lists."""
    if k <= 0 or logp.shape[0] == 0:
        return [[] for _ in range(logp.shape[0])], [[] for _ in range(logp.shape[0])]
    vals, idx = torch.topk(logp, min(k, logp.shape[-1]), dim=-1, sorted=True)
    return vals.tolist(), idx.tolist()


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Prompt (input) log-probs: raw log_softmax(logits) with no temperature, (N, V) → (N, V), clamped finite.

    Row p of a prompt's logits is log P(· | ids[:p+1]), i.e. it scores token p+1.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.clamp_(min=torch.finfo(logp.dtype).min)


def prompt_logprobs(logits: torch.Tensor, asks: list[tuple]) -> list[tuple]:
    """Prompt log-probs of several prompts of one forward, read back in one device→host copy.

    logits (G, K, V): the last K positions' logits of each prompt (right-aligned, as the prefill keeps them);
    asks: per prompt that returns log-probs, `(g, input_ids, start, top_k, token_ids)` — its row of `logits`, its
    ids (length n), `logprob_start` (< n), `top_logprobs_num` and `token_ids_logprob` (None: not asked).
    Returns per ask `(chosen, top, by_id)`: chosen[j] = log P(ids[start+1+j] | ids[:start+1+j]) (raw log_softmax,
    n - 1 - start entries), top[j] = (values, ids) of the top-k (None when top_k = 0), by_id[j] = the log-probs of
    `token_ids` (None when not asked). One `topk` per distinct k (not one per prompt), one copy for everything.
    """
    K = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    spans = []
    for g, ids, st, _k, _tid in asks:
        n = len(ids)
        m = n - 1 - st  # positions st … n-2 score tokens st+1 … n-1; kept row K - n + p for position p
        spans.append((len(rows), m))
        rows += [g] * m
        cols += range(K - n + st, K - 1)
        targets += ids[st + 1:]
    if not rows:
        return [([], None if k <= 0 else [], None if tid is None else []) for _g, _i, _s, k, tid in asks]
    dev = logits.device
    logp = raw_logprobs(logits[torch.tensor(rows).to(dev), torch.tensor(cols).to(dev)])  # (M, V)
    flat = [logp.gather(1, torch.tensor(targets).to(dev)[:, None]).squeeze(1).double()]
    sizes = [len(rows)]
    by_k: dict[int, list[int]] = {}
    for a, (_g, _i, _s, k, _t) in enumerate(asks):
        if k > 0 and spans[a][1] > 0:
            by_k.setdefault(min(k, logp.shape[-1]), []).append(a)
    tops = {}
    for k, members in by_k.items():
        sel = torch.tensor([r for a in members for r in range(spans[a][0], spans[a][0] + spans[a][1])]).to(dev)
        vals, idx = torch.topk(logp[sel], k, dim=-1, sorted=True)
        tops[k] = members
        flat += [vals.flatten().double(), idx.flatten().double()]
        sizes += [vals.numel(), idx.numel()]
    id_asks = [a for a, ask in enumerate(asks) if ask[4] is not None and spans[a][1] > 0]
    for a in id_asks:
        start, m = spans[a]
        flat.append(logp[start:start + m][:, list(asks[a][4])].flatten().double())
        sizes.append(flat[-1].numel())
    host = torch.cat(flat).cpu().tolist()  # the one copy
    chunks, at = [], 0
    for s in sizes:
        chunks.append(host[at:at + s])
        at += s
    chosen_all = chunks[0]
    out_top: dict[int, list] = {}
    c = 1
    for k, members in tops.items():
        vals, idx = chunks[c], chunks[c + 1]
        c += 2
        at = 0
        for a in members:
            m = spans[a][1]
            out_top[a] = [(vals[(at + j) * k:(at + j + 1) * k], [int(x) for x in idx[(at + j) * k:(at + j + 1) * k]])
                          for j in range(m)]
            at += m
    out_ids = {}
    for a in id_asks:
        width = len(asks[a][4])
        flat_a = chunks[c]
        c += 1
        out_ids[a] = [flat_a[j * width:(j + 1) * width] for j in range(spans[a][1])]
    out = []
    for a, (_g, _i, _s, k, tid) in enumerate(asks):
        start, m = spans[a]
        out.append((chosen_all[start:start + m], (out_top.get(a, []) if k > 0 else None),
                    (out_ids.get(a, []) if tid is not None else None)))
    return out
