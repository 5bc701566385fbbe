"""Teacher scoring: route each student sample to its domain's teacher, fan out across all teachers at once.

One round of scoring takes the step's samples, groups them by domain, cuts each group into batches of
`batch_size` sequences, and sends every batch of every teacher concurrently (`asyncio.gather`): the teachers are
separate servers, so a round costs about one teacher call, not one per domain. Each call asks for the log-prob of
every response token and (for `topk_kl`) the teacher's top-k at each position (`EngineClient.score`).

Transport: every call asks for the packed float32/int32 log-prob body (`engine.wire`, by the `Accept`
header). Alloy's embedded teachers answer with it; an external SGLang teacher (`teachers.external`) ignores the
header and answers its JSON, which the client parses vectorised with the same checks. The answer's `Content-Type`
decides, so nothing is probed and a mixed fleet needs no configuration (`binary=False` forces JSON).

Failure handling, so that nothing bad reaches a gradient and nothing is lost silently:
- the client already retries connection errors and 502/503/504 with backoff (a teacher being restarted by the
  supervisor); if it still cannot reach the teacher, the whole batch is tried again up to `attempts` times, then
  its samples are dropped with reason `teacher_unavailable`;
- a malformed answer (NaN/inf, wrong lengths, wrong token ids: `EngineResponseError`), a refused request (4xx), or
  scores that fail `check_scores` (top-k ids out of the vocabulary or repeated, log-probs > 0) make a batch fall back
  to one call per sequence, so only the bad sequences are dropped (`teacher_bad_response`); the others train.
Every drop is returned as `(sample_id, reason)` and counted per teacher.

Per-teacher metrics (`TeacherStats.snapshot`): sampled-token reverse KL (mean of log π_rollout − log π_T over the
scored tokens, a Monte-Carlo estimate of KL(π_s‖π_T) per token), tokens scored, call latency p50/p95, errors,
client retries, dropped samples. A tool episode is scored whole (prompt + student turns + tool output, the context
the student saw), but its tool-output tokens (`loss_mask` 0) count in neither the reverse KL nor `tokens`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from engine.client import EngineClient, EngineRequestError, EngineResponseError, EngineUnavailable, ScoreResult
from student.sampler import StudentSample

DROP_UNAVAILABLE = "teacher_unavailable"
DROP_BAD = "teacher_bad_response"
_LOGP_SLACK = 1e-3  # log-probs a hair above 0 are float noise of a real teacher; more than this is garbage


def plan_batches(samples: Sequence[StudentSample], batch_size: int) -> dict[str, list[list[StudentSample]]]:
    """Group samples by domain (first-seen order of domains, sample order kept within a domain), then cut each
    group into consecutive batches of at most `batch_size`. Pure; every sample lands in exactly one batch."""
    if batch_size < 1:
        raise ValueError(f"plan_batches: batch_size must be >= 1, got {batch_size}")
    groups: dict[str, list[StudentSample]] = {}
    for s in samples:
        groups.setdefault(s.domain, []).append(s)
    return {d: [g[i:i + batch_size] for i in range(0, len(g), batch_size)] for d, g in groups.items()}


def check_scores(res: ScoreResult, n_tokens: int, vocab_size: int) -> str | None:
    """Why a teacher's (already finite, length-checked) scores are unusable, or None. The losses would reject such
    input mid-step (topk_kl raises on repeated/out-of-range ids), so it is caught per sample here instead."""
    if res.token_logprobs.shape != (n_tokens,):
        return f"token_logprobs has shape {res.token_logprobs.shape}, want ({n_tokens},)"
    if (res.token_logprobs > _LOGP_SLACK).any():
        return f"token log-prob {float(res.token_logprobs.max()):.4g} > 0"
    ids = res.topk_ids
    if ids.size:
        if ((ids < 0) | (ids >= vocab_size)).any():
            return f"top-k id outside the vocabulary [0, {vocab_size})"
        srt = np.sort(ids, axis=-1)
        if (srt[:, 1:] == srt[:, :-1]).any():
            return "top-k ids repeat within a position"
        if (res.topk_logprobs > _LOGP_SLACK).any():
            return f"top-k log-prob {float(res.topk_logprobs.max()):.4g} > 0"
    return None


def check_scores_batch(results: Sequence[ScoreResult], n_tokens: Sequence[int], vocab_size: int) -> list[str | None]:
    """`check_scores` of every result of one call, batch-wise: when the concatenated scores pass every check at
    once (the usual case), no result has a problem; otherwise each result is checked on its own, so the problems
    and their messages are `check_scores`'s."""
    def each() -> list[str | None]:
        return [check_scores(r, n, vocab_size) for r, n in zip(results, n_tokens)]

    if not results:
        return []
    widths = {r.topk_ids.shape[1:] for r in results} | {r.topk_logprobs.shape[1:] for r in results}
    shapes_ok = all(r.token_logprobs.shape == (n,) and len(r.topk_ids) == n for r, n in zip(results, n_tokens))
    if not shapes_ok or len(widths) != 1 or len(next(iter(widths))) != 1:
        return each()
    if (np.concatenate([r.token_logprobs for r in results]) > _LOGP_SLACK).any():
        return each()
    ids = np.concatenate([r.topk_ids for r in results])
    if ids.size:
        srt = np.sort(ids, axis=-1)
        if (((ids < 0) | (ids >= vocab_size)).any() or (srt[:, 1:] == srt[:, :-1]).any()
                or (np.concatenate([r.topk_logprobs for r in results]) > _LOGP_SLACK).any()):
            return each()
    return [None] * len(results)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default); nan for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


@dataclass
class TeacherStats:
    """Counters of one teacher. `snapshot()` reports the window since the last snapshot plus running totals."""

    tokens: int = 0
    sequences: int = 0
    rkl_sum: float = 0.0
    calls: int = 0
    errors: int = 0
    dropped: int = 0
    latencies: list[float] = field(default_factory=list)
    rkl_ema: float = float("nan")  # exponential moving average of the per-call reverse KL (per token)
    _mark: dict = field(default_factory=dict)

    EMA_DECAY = 0.8

    def record(self, latency_s: float, samples: Sequence[StudentSample]) -> None:
        self.calls += 1
        self.latencies.append(latency_s)
        tokens, rkl = 0, 0.0
        for s in samples:  # the student's own tokens only: tool output (loss_mask 0) is not the student's choice
            diff = np.asarray(s.rollout_logprobs, np.float64) - np.asarray(s.teacher_logprobs, np.float64)
            if s.loss_mask is not None:
                diff = diff[np.asarray(s.loss_mask, dtype=bool)]
            tokens += len(diff)
            rkl += float(np.sum(diff))
        self.sequences += len(samples)
        self.tokens += tokens
        self.rkl_sum += rkl
        if tokens:
            x = rkl / tokens
            self.rkl_ema = x if np.isnan(self.rkl_ema) else self.EMA_DECAY * self.rkl_ema + (1 - self.EMA_DECAY) * x

    def snapshot(self, retries: int) -> dict[str, float]:
        """{rkl, tokens, latency_p50_s, latency_p95_s, errors, retries, dropped} over the window since the last
        snapshot (rkl: per token; tokens/errors/retries/dropped: counts in the window), plus `*_total` counts."""
        m = self._mark or {"tokens": 0, "rkl_sum": 0.0, "calls": 0, "errors": 0, "dropped": 0, "retries": 0}
        d_tok = self.tokens - m["tokens"]
        window = self.latencies[m["calls"]:]
        out = {
            "rkl": (self.rkl_sum - m["rkl_sum"]) / d_tok if d_tok else float("nan"),
            "tokens": float(d_tok),
            "latency_p50_s": percentile(window, 50), "latency_p95_s": percentile(window, 95),
            "errors": float(self.errors - m["errors"]), "retries": float(retries - m["retries"]),
            "dropped": float(self.dropped - m["dropped"]),
            "tokens_total": float(self.tokens), "errors_total": float(self.errors), "retries_total": float(retries),
            "dropped_total": float(self.dropped),
        }
        self._mark = {"tokens": self.tokens, "rkl_sum": self.rkl_sum, "calls": len(self.latencies),
                      "errors": self.errors, "dropped": self.dropped, "retries": retries}
        return out


class TeacherScorer:
    """Scores student samples with their domain's teacher. `clients`: {domain: EngineClient}, one client (one HTTP
    session per loop) per teacher endpoint; `top_k` = 0 asks for the sampled-token log-prob only."""

    def __init__(self, clients: Mapping[str, EngineClient], *, top_k: int, batch_size: int, vocab_size: int,
                 attempts: int = 3, binary: bool = True):
        if attempts < 1:
            raise ValueError(f"TeacherScorer: attempts must be >= 1, got {attempts}")
        self.clients = dict(clients)
        self.top_k, self.batch_size, self.vocab_size, self.attempts = int(top_k), int(batch_size), vocab_size, attempts
        self.binary = bool(binary)
        self.stats = {d: TeacherStats() for d in self.clients}
        self._retries0 = {d: c.counters["retries"] for d, c in self.clients.items()}

    def require(self, domains: Sequence[str]) -> None:
        """Fail before any sampling when a domain has no teacher (routing would otherwise fail mid-run)."""
        missing = sorted(set(domains) - set(self.clients))
        if missing:
            raise ValueError(f"no teacher for domain(s) {missing}; teachers are registered for {sorted(self.clients)}")

    def retries(self, domain: str) -> int:
        return self.clients[domain].counters["retries"] - self._retries0[domain]

    def recent_rkl(self) -> dict[str, float]:
        """{domain: moving average of the student's per-token reverse KL to that teacher} (measured ones only)."""
        return {d: st.rkl_ema for d, st in self.stats.items() if not np.isnan(st.rkl_ema)}

    def metrics(self) -> dict[str, float]:
        """`teacher/<domain>/<metric>` for every teacher (window since the previous call, plus totals)."""
        out = {}
        for d, st in self.stats.items():
            out.update({f"teacher/{d}/{k}": v for k, v in st.snapshot(self.retries(d)).items()})
        return out

    def totals(self) -> dict[str, dict[str, float]]:
        """Run totals per teacher: tokens, sequences, rkl (per token), errors, retries, dropped, latency p50/p95."""
        return {d: {"tokens": st.tokens, "sequences": st.sequences,
                    "rkl": st.rkl_sum / st.tokens if st.tokens else float("nan"), "errors": st.errors,
                    "retries": self.retries(d), "dropped": st.dropped,
                    "latency_p50_s": percentile(st.latencies, 50), "latency_p95_s": percentile(st.latencies, 95)}
                for d, st in self.stats.items()}

    async def score(self, samples: Sequence[StudentSample]) -> tuple[list[StudentSample], list[tuple[str, str]]]:
        """Fill `teacher_logprobs` (and top-k) of every sample its teacher scored. Returns (scored, dropped) with
        dropped = [(sample_id, reason)]; scored keeps the input order."""
        plan = plan_batches(samples, self.batch_size)
        self.require(list(plan))
        jobs = [self._score_batch(d, b) for d, batches in plan.items() for b in batches]
        results = await asyncio.gather(*jobs)
        ok_ids = {s.sample_id for good, _ in results for s in good}
        dropped = [x for _, bad in results for x in bad]
        return [s for s in samples if s.sample_id in ok_ids], dropped

    async def _score_batch(self, domain: str, batch: list[StudentSample]) -> tuple[list[StudentSample], list]:
        client, st = self.clients[domain], self.stats[domain]
        for _ in range(self.attempts):
            t0 = time.perf_counter()
            try:
                res = await client.score([s.input_ids for s in batch], [len(s.prompt_ids) for s in batch],
                                         top_k=self.top_k, binary=self.binary)
            except EngineUnavailable:
                st.errors += 1
                continue
            except (EngineResponseError, EngineRequestError):
                st.errors += 1
                return await self._isolate(domain, batch)
            problems = check_scores_batch(res, [len(s.output_ids) for s in batch], self.vocab_size)
            if any(problems):
                st.errors += 1
                return await self._isolate(domain, batch)
            for r, s in zip(res, batch):
                s.teacher_logprobs = r.token_logprobs.tolist()
                s.teacher_topk_ids, s.teacher_topk_logprobs = r.topk_ids, r.topk_logprobs
            st.record(time.perf_counter() - t0, batch)
            return batch, []
        st.dropped += len(batch)
        return [], [(s.sample_id, DROP_UNAVAILABLE) for s in batch]

    async def _isolate(self, domain: str, batch: list[StudentSample]) -> tuple[list[StudentSample], list]:
        """A batch with a bad answer: re-score each sequence alone so only the bad ones are dropped."""
        if len(batch) == 1:
            self.stats[domain].dropped += 1
            return [], [(batch[0].sample_id, DROP_BAD)]
        parts = await asyncio.gather(*(self._score_batch(domain, [s]) for s in batch))
        return [s for good, _ in parts for s in good], [x for _, bad in parts for x in bad]
