"""Teacher scoring: routing by domain, batching, concurrent fan-out, dropping bad answers, per-teacher metrics.

The teachers here are small protocol stubs on loopback (aiohttp, in-process, ~ms per call) standing in for *remote*
teacher servers, because the point is how the real `EngineClient` + `TeacherScorer` behave when a teacher answers
NaN, wrong shapes, 503s or nothing at all — which Alloy's own engine server never does on purpose. Each stub answers
log P(ids[p]) = −0.1·(teacher + 1) − 0.001·p, so a value names both the teacher and the position it was given.
"""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
from aiohttp import web

from engine.client import EngineClient, ScoreResult
from student.sampler import StudentSample, allocate, domain_weights
from student.scoring import (
    DROP_BAD, DROP_UNAVAILABLE, TeacherScorer, TeacherStats, check_scores, check_scores_batch, percentile,
    plan_batches,
)

pytestmark = pytest.mark.unit

V, POISON = 100, 99  # a sequence containing POISON makes the "nan" stub answer NaN for it


def lp(teacher: int, pos: int) -> float:
    return -0.1 * (teacher + 1) - 0.001 * pos


class Stub:
    """One stub teacher: records every call's sequences, counts in-flight calls across all stubs."""

    inflight = 0
    max_inflight = 0

    def __init__(self, index: int, mode: str = "ok", delay: float = 0.0, fail_first: int = 0):
        self.index, self.mode, self.delay, self.fail_first = index, mode, delay, fail_first
        self.calls: list[list[list[int]]] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": {"message": "restarting"}}, status=503)
        seqs, k = body["input_ids"], body.get("top_logprobs_num", 0)
        starts = body["logprob_start_len"]
        starts = starts if isinstance(starts, list) else [starts] * len(seqs)
        self.calls.append(seqs)
        Stub.inflight += 1
        Stub.max_inflight = max(Stub.max_inflight, Stub.inflight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            Stub.inflight -= 1
        out = []
        for ids, s in zip(seqs, starts):
            bad = self.mode == "nan" and POISON in ids
            tok = [[None, ids[s], None]] + [[float("nan") if bad else lp(self.index, p), ids[p], None]
                                            for p in range(s + 1, len(ids))]
            kk = k - 1 if self.mode == "short_topk" else k
            ids_k = (lambda p: [7] * kk) if self.mode == "dup_topk" else (lambda p: [(p + m) % V for m in range(kk)])
            top = [None] + [[[-(m + 1.0), i, None] for m, i in enumerate(ids_k(p))] for p in range(s + 1, len(ids))]
            out.append({"text": "", "output_ids": [], "meta_info": {
                "id": "x", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "completion_tokens": 0, "input_token_logprobs": tok, "input_top_logprobs": top}})
        return web.json_response(out)


async def serve(stubs: list[Stub]) -> tuple[list[str], list[web.AppRunner]]:
    urls, runners = [], []
    for st in stubs:
        app = web.Application()
        app.router.add_post("/generate", st.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        runners.append(runner)
    return urls, runners


def sample(i: int, domain: str, prompt_len: int = 3, out_len: int = 4, poison: bool = False) -> StudentSample:
    prompt = [1] + [10 + i % 50] * (prompt_len - 1)
    out = [20 + j for j in range(out_len)]
    if poison:
        out[1] = POISON
    return StudentSample(f"s{i}-{domain}", i, domain, None, prompt, out, [-0.5] * out_len, 0, "stop")


def run_scoring(stubs: list[Stub], domains: list[str], samples, **kw):
    """Serve the stubs, score `samples` with one EngineClient per stub (domain i → stub i), return the lot."""
    Stub.inflight = Stub.max_inflight = 0

    async def go():
        urls, runners = await serve(stubs)
        clients = {d: EngineClient(u, max_retries=3, backoff_base=0.01, backoff_max=0.02, timeout=5)
                   for d, u in zip(domains, urls)}
        scorer = TeacherScorer(clients, **{"top_k": 2, "batch_size": 4, "vocab_size": V, **kw})
        try:
            t = time.perf_counter()
            scored, dropped = await scorer.score(samples)
            return scorer, scored, dropped, time.perf_counter() - t
        finally:
            for c in clients.values():
                await c.aclose()
            for r in runners:
                await r.cleanup()

    return asyncio.run(go())


def test_plan_batches_groups_by_domain_keeps_order_and_cuts():
    doms = ["a", "b", "a", "a", "c", "b", "a"]
    ss = [sample(i, d) for i, d in enumerate(doms)]
    plan = plan_batches(ss, 2)
    assert {d: [[s.cursor for s in b] for b in bs] for d, bs in plan.items()} == {
        "a": [[0, 2], [3, 6]], "b": [[1, 5]], "c": [[4]]}
    assert list(plan) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        plan_batches(ss, 0)


def test_routes_each_sample_to_its_domains_teacher_aligned_to_response_tokens():
    domains = ["add", "rev", "sort"]
    stubs = [Stub(i, delay=0.2) for i in range(3)]
    # 5 add, 3 rev, 2 sort; prompts of different lengths so an off-by-one alignment would show in the values
    ss = [sample(i, domains[d], prompt_len=2 + i % 3) for i, d in enumerate([0, 1, 0, 2, 0, 1, 0, 2, 0, 1])]
    scorer, scored, dropped, wall = run_scoring(stubs, domains, ss)
    assert dropped == [] and [s.sample_id for s in scored] == [s.sample_id for s in ss]
    for s in scored:
        t, P = domains.index(s.domain), len(s.prompt_ids)
        assert s.teacher_logprobs == pytest.approx([lp(t, P + j) for j in range(4)], abs=1e-6)
        assert s.teacher_topk_ids.tolist() == [[(P + j) % V, (P + j + 1) % V] for j in range(4)]
        assert s.teacher_topk_logprobs.tolist() == [[-1.0, -2.0]] * 4
    # batch_size 4: add (5) → 2 calls of 4 + 1, rev (3) → 1, sort (2) → 1; each call holds one domain only
    assert [len(c) for c in stubs[0].calls] == [4, 1] and [len(c) for c in stubs[1].calls] == [3]
    assert [len(c) for c in stubs[2].calls] == [2]
    got = sorted(seq[1] for st in stubs for call in st.calls for seq in call)
    assert got == sorted(s.prompt_ids[1] for s in ss)  # every sample sent exactly once
    # all 4 calls in flight at once: the round costs ~one call (0.2 s), not four
    assert Stub.max_inflight == 4 and wall < 0.6
    m = scorer.metrics()
    # rollout log-prob −0.5 per token: rkl = mean(−0.5 − lp) over the teacher's tokens
    rev = [s for s in ss if s.domain == "rev"]
    want = np.mean([-0.5 - lp(1, len(s.prompt_ids) + j) for s in rev for j in range(4)])
    assert m["teacher/rev/rkl"] == pytest.approx(want, abs=1e-6)  # float32 teacher log-probs
    assert m["teacher/add/tokens"] == 20 and m["teacher/sort/tokens"] == 8
    assert m["teacher/add/errors"] == 0 and m["teacher/add/retries"] == 0 and m["teacher/add/dropped"] == 0
    assert 0.2 <= m["teacher/add/latency_p50_s"] <= m["teacher/add/latency_p95_s"] < 0.6
    assert scorer.metrics()["teacher/add/tokens"] == 0  # a window: nothing new since the last snapshot
    assert scorer.totals()["add"]["tokens"] == 20 and scorer.totals()["add"]["sequences"] == 5


def test_nan_answer_drops_only_that_sample_and_counts_it():
    ss = [sample(i, "add", poison=(i == 2)) for i in range(4)]
    scorer, scored, dropped, _ = run_scoring([Stub(0, mode="nan")], ["add"], ss)
    assert [s.cursor for s in scored] == [0, 1, 3]
    assert dropped == [("s2-add", DROP_BAD)]
    t = scorer.totals()["add"]
    # the batch call failed (1), then each sequence alone: the poisoned one failed again (1)
    assert t["errors"] == 2 and t["dropped"] == 1 and t["tokens"] == 12
    assert all(np.isfinite(s.teacher_logprobs).all() for s in scored)


@pytest.mark.parametrize("mode", ["short_topk", "dup_topk"])
def test_wrong_shapes_and_repeated_topk_ids_are_dropped(mode):
    ss = [sample(i, "add") for i in range(3)]
    scorer, scored, dropped, _ = run_scoring([Stub(0, mode=mode)], ["add"], ss)
    assert scored == [] and sorted(dropped) == [(f"s{i}-add", DROP_BAD) for i in range(3)]
    assert scorer.totals()["add"]["dropped"] == 3 and scorer.totals()["add"]["errors"] == 4


def test_503s_are_retried_and_counted():
    ss = [sample(i, "add") for i in range(3)]
    scorer, scored, dropped, _ = run_scoring([Stub(0, fail_first=2)], ["add"], ss)
    assert len(scored) == 3 and dropped == []
    assert scorer.metrics()["teacher/add/retries"] == 2 and scorer.totals()["add"]["errors"] == 0


def test_unreachable_teacher_drops_after_attempts_and_keeps_the_others():
    async def go():
        urls, runners = await serve([Stub(0)])
        dead = "http://127.0.0.1:9"  # discard port: connection refused
        clients = {"add": EngineClient(urls[0], max_retries=1, backoff_base=0.001, backoff_max=0.002),
                   "rev": EngineClient(dead, max_retries=1, backoff_base=0.001, backoff_max=0.002)}
        scorer = TeacherScorer(clients, top_k=0, batch_size=8, vocab_size=V, attempts=2)
        try:
            return scorer, *(await scorer.score([sample(0, "add"), sample(1, "rev"), sample(2, "rev")]))
        finally:
            for c in clients.values():
                await c.aclose()
            await runners[0].cleanup()

    scorer, scored, dropped = asyncio.run(go())
    assert [s.sample_id for s in scored] == ["s0-add"] and scored[0].teacher_topk_ids.shape == (4, 0)
    assert dropped == [("s1-rev", DROP_UNAVAILABLE), ("s2-rev", DROP_UNAVAILABLE)]
    t = scorer.totals()["rev"]
    assert t["errors"] == 2 and t["dropped"] == 2 and t["retries"] == 2  # 2 attempts × 1 client retry


def test_missing_teacher_is_refused_before_any_call():
    scorer = TeacherScorer({"add": EngineClient("http://127.0.0.1:9")}, top_k=0, batch_size=4, vocab_size=V)
    with pytest.raises(ValueError, match=r"no teacher for domain\(s\) \['rev'\]"):
        scorer.require(["add", "rev"])


def test_check_scores_by_hand():
    ok = ScoreResult(np.array([-0.1, -2.0], np.float32), np.array([[3, 4], [5, 6]]), np.array([[-0.1, -3], [-1, -2]], np.float32))
    assert check_scores(ok, 2, V) is None
    assert "shape" in check_scores(ok, 3, V)
    pos = ScoreResult(np.array([0.5, -1.0], np.float32), ok.topk_ids, ok.topk_logprobs)
    assert "> 0" in check_scores(pos, 2, V)
    oov = ScoreResult(ok.token_logprobs, np.array([[3, V], [5, 6]]), ok.topk_logprobs)
    assert "outside the vocabulary" in check_scores(oov, 2, V)


def test_check_scores_batch_is_check_scores_of_each():
    """The batch-wise check finds exactly what `check_scores` finds per result, with its messages."""
    ok = ScoreResult(np.array([-0.1, -2.0], np.float32), np.array([[3, 4], [5, 6]]), np.array([[-0.1, -3], [-1, -2]], np.float32))
    one = ScoreResult(np.array([-0.3], np.float32), np.array([[7, 8]]), np.array([[-0.5, -0.9]], np.float32))
    pos = ScoreResult(np.array([0.5, -1.0], np.float32), ok.topk_ids, ok.topk_logprobs)
    oov = ScoreResult(ok.token_logprobs, np.array([[3, V], [5, 6]]), ok.topk_logprobs)
    neg = ScoreResult(ok.token_logprobs, np.array([[3, -1], [5, 6]]), ok.topk_logprobs)
    rep = ScoreResult(ok.token_logprobs, np.array([[3, 3], [5, 6]]), ok.topk_logprobs)
    top_pos = ScoreResult(ok.token_logprobs, ok.topk_ids, np.array([[0.1, -3], [-1, -2]], np.float32))
    no_top = ScoreResult(np.array([-0.1, -2.0], np.float32), np.zeros((2, 0), np.int64), np.zeros((2, 0), np.float32))
    cases = [[ok, one], [ok, pos], [oov, one], [ok, neg], [rep], [top_pos, ok], [no_top, no_top], [ok, no_top], []]
    for results in cases:
        n = [len(r.token_logprobs) for r in results]
        assert check_scores_batch(results, n, V) == [check_scores(r, k, V) for r, k in zip(results, n)]
    assert check_scores_batch([ok, one], [2, 2], V) == [None, check_scores(one, 2, V)]  # a shape miss
    assert check_scores_batch([ok, one], [2, 1], V) == [None, None]


def test_percentile_and_stats_window_by_hand():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # 1 + 0.95·3 = 3.85 → between 3 and 4
    assert math.isnan(percentile([], 50))
    st = TeacherStats()
    s = sample(0, "add", out_len=2)
    s.rollout_logprobs, s.teacher_logprobs = [-1.0, -0.2], [-0.5, -0.7]
    st.record(0.1, [s])
    snap = st.snapshot(retries=3)
    # rkl = ((−1 + 0.5) + (−0.2 + 0.7)) / 2 = 0: a sampled estimate, negative terms allowed
    assert snap["rkl"] == pytest.approx(0.0) and snap["tokens"] == 2 and snap["retries"] == 3
    st.record(0.3, [s])
    snap2 = st.snapshot(retries=5)
    assert snap2["retries"] == 2 and snap2["retries_total"] == 5 and snap2["latency_p50_s"] == pytest.approx(0.3)


def test_allocate_carries_fractions_so_shares_are_exact_over_batches():
    credit: dict = {}
    # 10 slots over 3 equal domains: 3.33 each → 4,3,3 then the carried credit rotates the extra slot
    got = [allocate(10, {"a": 1, "b": 1, "c": 1}, credit) for _ in range(3)]
    assert got == [{"a": 4, "b": 3, "c": 3}, {"a": 3, "b": 4, "c": 3}, {"a": 3, "b": 3, "c": 4}]
    assert all(abs(v) < 1e-9 for v in credit.values())  # 30 slots = exactly 10 each
    credit = {}
    w = {"a": 0.5, "b": 0.25, "c": 0.25}
    total = {"a": 0, "b": 0, "c": 0}
    for _ in range(7):
        for d, n in allocate(6, w, credit).items():
            total[d] += n
    assert total == {"a": 21, "b": 11, "c": 10}  # 42 slots: 21, 10.5, 10.5 (tie → domain order first)


def test_domain_weights_by_hand():
    w = domain_weights(["a", "b", "c"], {"a": 3.0, "b": 1.0, "c": 0.0}, mix=0.5)
    # (1 − 0.5)/3 + 0.5 · (3/4, 1/4, 0)
    assert w == pytest.approx({"a": 1 / 6 + 3 / 8, "b": 1 / 6 + 1 / 8, "c": 1 / 6})
    assert sum(w.values()) == pytest.approx(1.0)
    # an unmeasured domain counts as the mean of the measured ones; mix 0 is uniform
    assert domain_weights(["a", "b"], {"a": 2.0}, mix=1.0) == pytest.approx({"a": 0.5, "b": 0.5})
    assert domain_weights(["a", "b"], {"a": 2.0, "b": -1.0}, mix=0.0) == pytest.approx({"a": 0.5, "b": 0.5})
    with pytest.raises(ValueError, match="mix must be in"):
        domain_weights(["a"], {}, mix=1.5)


def _two_scored_samples(b_version: int) -> tuple[StudentSample, StudentSample]:
    """Two scored samples by hand: a (prompt 3, response 2 tokens, version 3) and b (prompt 1, response 3)."""
    a = StudentSample("a", 0, "x", None, [1, 10, 11], [20, 21], [-0.5, -0.7], 3, "stop",
                      teacher_logprobs=[-0.1, -0.2], teacher_topk_ids=np.array([[20, 5], [21, 6]]),
                      teacher_topk_logprobs=np.array([[-0.1, -3.0], [-0.2, -2.0]]), reward=1.0)
    b = StudentSample("b", 1, "x", None, [1], [30, 31, 32], [-1.0, -2.0, -3.0], b_version, "length",
                      teacher_logprobs=[-1.5, -2.5, -3.5], teacher_topk_ids=np.array([[30, 1], [31, 1], [32, 1]]),
                      teacher_topk_logprobs=np.full((3, 2), -1.0), reward=0.0)
    return a, b


def test_scores_land_on_the_positions_that_predict_their_tokens():
    """collate: response token j of a prompt of length P is predicted at position P − 1 + j (by hand), and the
    loss sees the teacher's value there: with uniform student logits log π_s = −log V everywhere."""
    import torch

    from student.batch import collate, opd_loss

    a, b = _two_scored_samples(b_version=2)
    batch = collate([a, b], pad_id=0, version=3, with_topk=True)
    assert batch.input_ids.tolist() == [[1, 10, 11, 20, 21], [1, 30, 31, 32, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    np.testing.assert_allclose(batch.teacher_logp.numpy(), [[0, 0, -0.1, -0.2], [-1.5, -2.5, -3.5, 0]], atol=1e-7)
    np.testing.assert_allclose(batch.rollout_logp.numpy(), [[0, 0, -0.5, -0.7], [-1.0, -2.0, -3.0, 0]], atol=1e-7)
    assert batch.topk_ids[0, 2].tolist() == [20, 5] and batch.topk_ids[1, 0].tolist() == [30, 1]
    assert batch.reward_adv.tolist() == [0.5, -0.5] and batch.lag.tolist() == [0.0, 1.0] and batch.num_tokens == 5

    logits = torch.zeros(2, 5, V, requires_grad=True)
    _, m = opd_loss(logits, batch, loss="sampled_rkl", direction="forward", beta=0.5, reward_coef=0.0,
                    is_clip=None, global_token_count=5.0)
    # mean over the 5 response tokens of (−log 100 − teacher): −4.60517 − (−7.8 / 5)
    assert m["reverse_kl"] == pytest.approx(-math.log(100) + 1.56, abs=1e-5)
    # |−log 100 − rollout| averaged: (4.10517 + 3.90517 + 3.60517 + 2.60517 + 1.60517) / 5
    assert m["logp_abs_diff"] == pytest.approx(math.log(100) - 7.2 / 5, abs=1e-5)


@pytest.mark.parametrize("loss", ["sampled_rkl", "topk_kl"])
def test_row_weights_make_the_batch_loss_the_mean_of_its_samples_losses(loss):
    """`distill.loss_agg: seq_mean_token_mean`: collate's `row_weight` (seq_mean_weights of the batch: 2 and 3 tokens
    → 5/4, 5/6) lands on each sample's response positions, and the batch's loss over its 5 tokens is then the mean of
    the two samples' own losses, not their token-weighted mean."""
    import torch

    from student.batch import collate, opd_loss
    from training.rl_math import seq_mean_weights

    a, b = _two_scored_samples(b_version=3)
    torch.manual_seed(0)
    logits = torch.randn(2, 5, V)

    def loss_of(samples, rows, n, row_weight=None):
        batch = collate(samples, pad_id=0, version=3, with_topk=True, row_weight=row_weight)
        lg = logits[rows, :batch.input_ids.shape[1]]
        return opd_loss(lg, batch, loss=loss, direction="forward", beta=0.5, reward_coef=0.0, is_clip=2.0,
                        global_token_count=n)[0], batch

    w = seq_mean_weights([2, 3])
    assert w == pytest.approx([5 / 4, 5 / 6])
    weighted, batch = loss_of([a, b], [0, 1], 5.0, w)
    np.testing.assert_allclose(batch.token_weight.numpy(), [[0, 0, 5 / 4, 5 / 4], [5 / 6, 5 / 6, 5 / 6, 0]],
                               rtol=1e-6)
    alone = [loss_of([a], [0], 2.0)[0], loss_of([b], [1], 3.0)[0]]
    assert float(weighted) == pytest.approx(float(sum(alone)) / 2, rel=1e-5)
    tokens, _ = loss_of([a, b], [0, 1], 5.0)  # the token mean: 2/5 and 3/5 of the two
    assert float(tokens) == pytest.approx(float(2 * alone[0] + 3 * alone[1]) / 5, rel=1e-5)
    assert float(tokens) != pytest.approx(float(weighted), rel=1e-3)
    with pytest.raises(ValueError, match="1 row weights for 2 samples"):
        collate([a, b], pad_id=0, version=3, with_topk=True, row_weight=[1.0])
