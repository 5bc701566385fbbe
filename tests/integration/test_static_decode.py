"""The engine's static decode path (`decode_path="static"`: one preallocated KV pool, fixed-shape steps, the batch's
sampling read back in one copy), run eagerly on the CPU, against the segment path the CPU uses by default.

- `FusedDecoder.step_static` gives `step`'s logits for rows of different lengths and writes their KV in place;
- an engine on each path, fed the same staggered mixed workload (greedy and seeded sampling, top-k/top-p, stop
  tokens and strings, EOS, log-probs with top-k and requested ids, one-token requests, an abort, a later wave that
  grows the pool mid-decode), returns the same tokens, finish reasons and log-probs for every request;
- a static decode step issues the same number of torch ops at 1 row as at 48 (nothing per row in Python builds a
  tensor) and none of the ops that wait for a GPU (`item`/`_local_scalar_dense`, `nonzero`, `is_nonzero`).
"""
from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.decode import FusedDecoder
from engine.kv_cache import BatchKVCache
from engine.protocol import SamplingSpec, SeqSpec
from engine.scheduler import Engine, Seq
from engine.static_batch import KVPool
from engine_proc import REFERENCE_NUMERICS, TINY_LP_TOL, engine_kwargs

pytestmark = pytest.mark.integration

SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select")
VIEW_OPS = {"view", "reshape", "alias", "select", "slice", "transpose", "unsqueeze", "squeeze", "split",
            "split_with_sizes", "chunk", "expand", "t", "permute", "as_strided"}


def test_static_step_matches_the_segment_step(model):
    dec = FusedDecoder.for_model(model)
    prompts = [[1, 5, 9, 13, 2, 7, 8], [1, 4, 6], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
    first = dec.layers[0]
    pool = KVPool(len(dec.layers), first["split"][1] // first["head_dim"], first["head_dim"], torch.float32,
                  torch.device("cpu"))
    pool.reserve(4, 40, keep_rows=0)
    with torch.inference_mode():
        cache = BatchKVCache(len(dec.layers))
        logits_a, (mask,) = dec.prefill(prompts, 1, [([0, 1, 2], cache)])
        slots = pool.row_index[:3]
        logits_b, _ = dec.prefill(prompts, 1, None, static=(pool, slots))
        torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=1e-5)
        ids = logits_a[:, -1].argmax(-1)
        lens = torch.tensor([len(p) for p in prompts])
        for _ in range(5):  # five steps on both paths, feeding the same tokens
            full = torch.cat([mask.bool(), torch.ones((3, 1), dtype=torch.bool)], dim=1)
            a = dec(ids, lens, cache, full[:, None, None, :])
            b = dec.step_static(ids, lens, pool, 64)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            mask = full
            ids, lens = a.argmax(-1), lens + 1
        # row r's keys live at columns 0 … len-1 of its pool row, as its real columns of the left-padded cache
        for r, n in enumerate(lens.tolist()):
            left = cache.layers[1].keys[r, :, -n:]
            torch.testing.assert_close(pool.k[1][r, :, :n], left, rtol=0, atol=1e-6)


def _workload(vocab_hi: int = 100) -> list[tuple[int, SeqSpec]]:
    """(wave, spec): a mixed, seeded workload; wave 1 arrives while wave 0 decodes."""
    g = torch.Generator().manual_seed(11)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple([1] + torch.randint(4, vocab_hi, (n - 1,), generator=g).tolist())

    out = []
    for i, (n, new, extra) in enumerate([
            (5, 40, {}), (12, 25, {"temperature": 0.8, "seed": 7}), (3, 1, {}),
            (9, 30, {"temperature": 1.0, "top_k": 5, "seed": 3}), (7, 20, {"temperature": 0.9, "top_p": 0.6, "seed": 4}),
            (6, 35, {"stop_token_ids": frozenset({17, 23, 42})}), (8, 30, {"ignore_eos": False}),
            (4, 60, {"stop_strs": ("e",)})]):
        sp = SamplingSpec(max_new_tokens=new, ignore_eos=extra.pop("ignore_eos", True),
                          temperature=extra.pop("temperature", 0.0), **extra)
        lp = i % 2 == 0
        out.append((0, SeqSpec(rid=f"a{i}", input_ids=prompt(n), sampling=sp, return_logprob=lp, logprob_start=n,
                               top_logprobs_num=3 if i % 4 == 0 else 0,
                               token_ids_logprob=(5, 9) if i == 4 else None)))
    for i, (n, new) in enumerate([(50, 100), (15, 30), (33, 12), (2, 70), (20, 1), (64, 40)] * 2):
        sp = SamplingSpec(max_new_tokens=new, ignore_eos=True, temperature=0.0 if i % 3 else 0.7, seed=100 + i)
        out.append((1, SeqSpec(rid=f"b{i}", input_ids=prompt(n), sampling=sp, return_logprob=True, logprob_start=n,
                               top_logprobs_num=2 if i % 2 else 0)))
    return out


def _run(model_dir, decode_path: str) -> tuple[Engine, dict[str, Seq]]:
    eng = Engine(str(model_dir), max_running_requests=32, decode_path=decode_path, **engine_kwargs())
    eng.start()
    assert eng.ready.wait(60), eng.load_error
    assert eng._static == (decode_path == "static")
    done = threading.Semaphore(0)
    seqs = {spec.rid: (w, Seq(spec, on_done=lambda _s: done.release())) for w, spec in _workload()}
    waves = [[s for w, s in seqs.values() if w == k] for k in (0, 1)]
    try:
        eng.submit(waves[0])
        while len(waves[0][0].result.output_ids) < 6:
            threading.Event().wait(0.001)
        eng.abort("a6")  # mid-decode
        eng.submit(waves[1])
        for _ in seqs:
            assert done.acquire(timeout=120)
    finally:
        eng.stop()
    return eng, {rid: s for rid, (_w, s) in seqs.items()}


def test_static_engine_returns_what_the_segment_engine_returns(tiny_model_dir):
    static_eng, static = _run(tiny_model_dir, "static")
    _, seg = _run(tiny_model_dir, "segments")
    assert static_eng._batch.pool.generation > 1, "the second wave should have grown the pool mid-decode"
    assert static_eng._batch.pool.columns >= 128
    for rid, s in seg.items():
        t = static[rid]
        types = {t.result.finish_reason["type"], s.result.finish_reason["type"]}
        if "abort" in types:  # where an abort lands depends on the threads' timing (under load a6 may finish first)
            assert rid == "a6", (rid, types)
            continue
        assert len(types) == 1, (rid, types)
        # greedy rows in float32: the same tokens. A sampled row's draw near a boundary of its CDF may flip on the
        # last bits of the logits (each path sums in its own order; the segment path's padding depends on arrival
        # timing), as may a near-tie in bfloat16: those compare up to their first difference
        if REFERENCE_NUMERICS and s.spec.sampling.temperature < 1e-6:
            assert t.result.finish_reason == s.result.finish_reason, rid
            assert t.result.output_ids == s.result.output_ids, rid
        n = next((i for i, (x, y) in enumerate(zip(t.result.output_ids, s.result.output_ids)) if x != y),
                 min(len(t.result.output_ids), len(s.result.output_ids)))
        torch.testing.assert_close(torch.tensor(t.result.out_logprobs[:n]), torch.tensor(s.result.out_logprobs[:n]),
                                   rtol=0, atol=TINY_LP_TOL)
        if REFERENCE_NUMERICS:  # in bfloat16 near-ties may order differently; the sorted values still agree
            assert [ids for _v, ids in t.result.out_top[:n]] == [ids for _v, ids in s.result.out_top[:n]], rid
        for (tv, _), (sv, _) in zip(t.result.out_top[:n], s.result.out_top[:n]):
            torch.testing.assert_close(torch.tensor(tv), torch.tensor(sv), rtol=0, atol=TINY_LP_TOL)
        torch.testing.assert_close(torch.tensor(t.result.out_ids_logprobs[:n]),
                                   torch.tensor(s.result.out_ids_logprobs[:n]), rtol=0, atol=TINY_LP_TOL)
    assert static["a2"].result.output_ids and len(static["a2"].result.output_ids) == 1
    assert any(s.result.finish_reason.get("matched") in (17, 23, 42) for s in static.values()) or \
        static["a5"].result.finish_reason["type"] == "length"


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(model_dir, rows: int) -> collections.Counter:
    eng = Engine(str(model_dir), max_running_requests=64, decode_path="static", **engine_kwargs())
    eng._load_initial()  # driven step by step in this thread
    seqs = [Seq(SeqSpec(rid=f"s{i}", input_ids=(1, 4 + i % 50, 9, 12), return_logprob=True, logprob_start=4,
                        top_logprobs_num=2,
                        sampling=SamplingSpec(max_new_tokens=20, temperature=0.0 if i % 2 else 0.8,
                                              top_p=0.9, ignore_eos=True, seed=i if i % 3 == 0 else None)))
            for i in range(rows)]
    eng.submit(seqs)
    with torch.inference_mode():
        eng._step()  # prefill + the first decode step (builds the step's parameters)
        eng._step()
        counter = _OpCounter()
        with counter:
            eng._step()  # one decode step, nothing else waiting
    assert all(len(s.result.output_ids) == 4 for s in seqs)
    return counter.ops


def test_a_static_decode_step_costs_the_same_ops_at_any_batch_size_and_never_syncs(tiny_model_dir):
    one, many = _ops_per_step(tiny_model_dir, 1), _ops_per_step(tiny_model_dir, 48)
    assert not [op for op in SYNC_OPS if many[op] or one[op]], (one, many)
    # a seeded sampling row draws its own number (rows 0, 6, …, 42 here): a `rand` and a `copy_` into the batch's
    # numbers each, the only kernels that grow with rows; reshapes and views launch none
    seeded_rows_extra = many["rand"] - one["rand"]
    assert seeded_rows_extra == 8 - 1 and many["copy_"] - one["copy_"] == seeded_rows_extra
    kernels = lambda c: sum(v for op, v in c.items() if op not in VIEW_OPS)  # noqa: E731
    assert kernels(many) - kernels(one) == 2 * seeded_rows_extra, (kernels(one), kernels(many), many - one)
