"""Continuous batching internals of the embedded engine: the fused decode step and the running batch's segments.

- `FusedDecoder` (the engine's decode step for Llama/Qwen2, bypassing transformers' module dispatch) gives the
  same logits and writes the same KV columns as the HF forward, with and without left padding, with GQA and
  with q/k/v biases (Qwen2); so does its packed prefill of prompts of different lengths; it declines models it
  does not cover.
- An in-process `Engine` fed staggered arrivals of different prompt lengths and different output lengths (so
  rows are merged into a running batch, leave it, and padding lives longer than the mask buffer's head-room)
  produces, per sequence, the greedy tokens and log-probs of a plain single-sequence HF forward, and the same
  tokens/log-probs with the fused step turned off.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.decode import FusedDecoder
from engine.kv_cache import BatchKVCache
from engine.protocol import SamplingSpec, SeqSpec
from engine import running
from engine.scheduler import Engine, Seq
from engine_proc import REFERENCE_NUMERICS, TINY_LP_TOL, engine_kwargs

pytestmark = pytest.mark.integration


def _qwen2_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero q/k/v biases, so a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _split(cache: BatchKVCache, rows: list[int]) -> BatchKVCache:
    """A copy of `rows` of a cache (the same columns), as a segment of the running batch holds them."""
    out = BatchKVCache(len(cache.layers))
    for a, b in zip(cache.layers, out.layers):
        b.set_buffers(a._k[rows].clone(), a._v[rows].clone(), a.length)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_fused_decoder_matches_hf_forward(model, arch, padded, segments):
    """The fused decode step gives the HF forward's logits and KV columns; with `segments`, rows 0 and 1–2 keep
    their KV in two caches (two segments of the running batch) and attend each over their own, in one step."""
    m = model if arch == "llama" else _qwen2_model()
    dec = FusedDecoder.for_model(m)
    assert dec is not None
    B, L, steps = 3, 7, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (B, L), generator=g)
    mask = torch.ones((B, L), dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # row 0: 4 real tokens, left-padded
        mask[2, :1] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        caches = [BatchKVCache(m.config.num_hidden_layers) for _ in range(2)]
        for c in caches:
            m(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=c, use_cache=True)
        last, p = ids[:, -1].clone(), pos[:, -1] + 1
        parts_cache = [_split(caches[1], [0]), _split(caches[1], [1, 2])] if segments else None
        for step in range(steps):
            t = caches[0].seq_len + 1
            m4 = None
            if padded:  # (B, 1, 1, T+1) bool, True = attend: the engine's decode-step mask
                m4 = torch.cat([mask.bool(), torch.ones((B, t - L), dtype=torch.bool)], 1)[:, None, None, :]
            want = m(input_ids=last[:, None], attention_mask=m4, position_ids=p[:, None], past_key_values=caches[0],
                     use_cache=True).logits[:, -1]
            if segments:
                got = dec.step(last, p, [(0, 1, parts_cache[0], None if m4 is None else m4[:1], None),
                                         (1, 3, parts_cache[1], None if m4 is None else m4[1:], None)])
            else:
                got = dec(last, p, caches[1], m4)
            assert got.shape == want.shape == (B, m.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            last, p = want.argmax(-1), p + 1
        if segments:  # the two segments' columns, stacked, are the one cache's
            for a, b0, b1 in zip(caches[1].layers, parts_cache[0].layers, parts_cache[1].layers):
                a.set_buffers(torch.cat([b0.keys, b1.keys]), torch.cat([b0.values, b1.values]), b0.length)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert a.length == b.length == L + steps
            torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-6)
            torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lens,keep", [([7], 1), ([5, 5, 5], 2), ([3, 12, 5], 1), ([3, 12, 5], 8), ([40, 4], 3),
                                       ([100, 6, 70, 70, 5, 130], 2)])  # long ones attend alone / equal together
def test_fused_prefill_matches_left_padded_hf_forward(model, arch, lens, keep):
    """The packed prefill gives the left-padded HF forward's logits (real positions) and writes the same keys and
    values into the cache (real columns), for one prompt, equal lengths (no mask) and mixed lengths; split into
    two caches (segments: even and odd prompts), each is left-padded to its own longest prompt only."""
    m = model if arch == "llama" else _qwen2_model()
    dec = FusedDecoder.for_model(m)
    g = torch.Generator().manual_seed(len(lens) + keep)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in lens]
    L = max(lens)
    ids = torch.zeros((len(lens), L), dtype=torch.long)
    mask = torch.zeros((len(lens), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
    with torch.inference_mode():
        want_cache, got_cache = BatchKVCache(2), BatchKVCache(2)
        want = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                 past_key_values=want_cache, use_cache=True, logits_to_keep=keep).logits
        got, (got_mask,) = dec.prefill(prompts, keep, [(list(range(len(lens))), got_cache)])
        halves = [list(range(0, len(lens), 2)), list(range(1, len(lens), 2))]
        halves = [(idx, BatchKVCache(2)) for idx in halves if idx]
        got_split, split_masks = dec.prefill(prompts, keep, halves)
    assert torch.equal(got_mask, mask) and got.shape == want.shape == (len(lens), keep, m.config.vocab_size)
    torch.testing.assert_close(got_split, got, rtol=0, atol=0)
    for (idx, cache), seg_mask in zip(halves, split_masks):
        ls = max(lens[i] for i in idx)
        want_mask = mask[idx][:, L - ls:]
        assert torch.equal(seg_mask, want_mask) and not bool(mask[idx][:, : L - ls].any())
        rows = mask[idx].bool()[:, None, :, None]
        cols = want_mask.bool()[:, None, :, None]
        for a, b in zip(want_cache.layers, cache.layers):
            assert b.length == ls and b._k.shape[2] > ls
            ak, bk = a.keys[idx], b.keys
            torch.testing.assert_close(bk[cols.expand_as(bk)], ak[rows.expand_as(ak)], rtol=0, atol=1e-6)
            av, bv = a.values[idx], b.values
            torch.testing.assert_close(bv[cols.expand_as(bv)], av[rows.expand_as(av)], rtol=0, atol=1e-6)
    real = torch.zeros((len(lens), keep), dtype=torch.bool)
    for i, n in enumerate(lens):
        real[i, max(0, keep - n):] = True
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    cols = mask.bool()[:, None, :, None]
    for a, b in zip(want_cache.layers, got_cache.layers):
        assert b.length == L and b._k.shape[2] > L  # decode head-room allocated
        torch.testing.assert_close(b.keys[cols.expand_as(b.keys)], a.keys[cols.expand_as(a.keys)], rtol=0, atol=1e-6)
        torch.testing.assert_close(b.values[cols.expand_as(b.values)], a.values[cols.expand_as(a.values)],
                                   rtol=0, atol=1e-6)


def test_fused_decoder_declines_uncovered_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert FusedDecoder.for_model(eager) is None  # SDPA semantics only
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert FusedDecoder.for_model(gpt2) is None


def _run_engine(model_dir, monkeypatch, fused: bool, waves=None, max_segments: int = 4) -> tuple[Engine, list[Seq]]:
    """Two waves of greedy sequences: the second arrives while the first is decoding (merge into a padded batch);
    prompt lengths 3..19 and output lengths 5..90, so rows leave at different steps and padding lives to the end.
    The fused run also shrinks the mask buffer's head-room to 4 columns, so decode steps keep regrowing it."""
    monkeypatch.setenv("ALLOY_ENGINE_FUSED_DECODE", "1" if fused else "0")
    monkeypatch.setattr(running, "_MASK_SPARE", 4 if fused else 64)
    eng = Engine(str(model_dir), max_running_requests=16, max_segments=max_segments, **engine_kwargs())
    eng.start()
    assert eng.ready.wait(60), eng.load_error
    assert (eng._fused is not None) == fused
    g = torch.Generator().manual_seed(3)
    done = threading.Semaphore(0)

    def seq(i: int, n_prompt: int, n_new: int) -> Seq:
        prompt = tuple([1] + torch.randint(4, 100, (n_prompt - 1,), generator=g).tolist())
        spec = SeqSpec(rid=f"r{i}", input_ids=prompt, return_logprob=True, logprob_start=n_prompt,
                       sampling=SamplingSpec(max_new_tokens=n_new, temperature=0.0, ignore_eos=True))
        return Seq(spec, on_done=lambda _s: done.release())

    w1, w2 = waves or ([(3, 90), (11, 40), (6, 5), (19, 70)], [(15, 80), (4, 30), (9, 12)])
    wave1 = [seq(i, n, k) for i, (n, k) in enumerate(w1)]
    wave2 = [seq(len(w1) + i, n, k) for i, (n, k) in enumerate(w2)]
    try:
        eng.submit(wave1)
        deadline = time.time() + 30
        while len(wave1[0].result.output_ids) < 8 and time.time() < deadline:
            time.sleep(0.001)
        assert 8 <= len(wave1[0].result.output_ids) < w1[0][1]  # wave 2 joins a batch that is mid-decode
        eng.submit(wave2)
        for _ in wave1 + wave2:
            assert done.acquire(timeout=60)
    finally:
        eng.stop()
    return eng, wave1 + wave2


def _assert_single_sequence_outputs(model, seqs):
    for s in seqs:
        prompt, out = list(s.spec.input_ids), s.result.output_ids
        assert s.result.finish_reason == {"type": "length", "length": s.spec.sampling.max_new_tokens}
        assert len(out) == len(s.result.out_logprobs) == s.spec.sampling.max_new_tokens
        with torch.inference_mode():  # teacher-forced single-row forward over prompt + output: no padding, no cache
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1: -1]
        logp = torch.log_softmax(logits.float(), -1)
        if REFERENCE_NUMERICS:  # another dtype/device may break near-ties differently: log-probs only
            assert out == logits.argmax(-1).tolist(), s.spec.rid
        want = logp.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.result.out_logprobs), want, rtol=0, atol=TINY_LP_TOL)


def test_staggered_padded_batch_matches_single_sequence_forward(tiny_model_dir, model, monkeypatch):
    eng, seqs = _run_engine(tiny_model_dir, monkeypatch, fused=True)
    assert eng.steps >= 89  # the first token of each sequence comes from its prefill
    _assert_single_sequence_outputs(model, seqs)
    _, plain = _run_engine(tiny_model_dir, monkeypatch, fused=False)
    _assert_single_sequence_outputs(model, plain)
    for a, b in zip(seqs if REFERENCE_NUMERICS else (), plain):  # exact agreement: CPU float32 only
        assert a.spec.input_ids == b.spec.input_ids and a.result.output_ids == b.result.output_ids
        torch.testing.assert_close(torch.tensor(a.result.out_logprobs), torch.tensor(b.result.out_logprobs),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_segments", [4, 1])
def test_long_and_short_rows_decode_in_segments_or_width_buckets(tiny_model_dir, model, monkeypatch, max_segments):
    """A 150-token prompt decoding when short prompts arrive (and a 160-token one). With segments, the short ones
    get their own cache (the 160-token one joins the long row's): two segments decode in each step. With one
    segment (the cap), the short rows are merged *above* the long row (a reordering merge) and attention runs in
    width buckets. Either way every sequence gets exactly its single-sequence greedy tokens."""
    waves = ([(150, 60)], [(4, 50), (160, 30), (6, 40)])
    eng, seqs = _run_engine(tiny_model_dir, monkeypatch, fused=True, waves=waves, max_segments=max_segments)
    if max_segments > 1:
        assert eng.decode_segments - eng.steps > 20, (eng.decode_segments, eng.steps)  # steps with 2 segments
    else:
        assert eng.decode_segments == eng.steps and eng.bucketed_steps > 20, eng.bucketed_steps
    _assert_single_sequence_outputs(model, seqs)
    _, plain = _run_engine(tiny_model_dir, monkeypatch, fused=False, waves=waves)  # HF forward: one segment
    _assert_single_sequence_outputs(model, plain)
    for a, b in zip(seqs if REFERENCE_NUMERICS else (), plain):  # exact agreement: CPU float32 only
        assert a.result.output_ids == b.result.output_ids
        torch.testing.assert_close(torch.tensor(a.result.out_logprobs), torch.tensor(b.result.out_logprobs),
                                   rtol=0, atol=1e-5)


def test_rows_finished_by_their_first_token_leave_before_joining(tiny_model_dir, model):
    """A one-token request finishes in its prefill: its segment drops it (and the padding columns only it used)
    before joining the batch, so no hole is decoded for it; the others get their single-sequence greedy tokens."""
    eng = Engine(str(tiny_model_dir), max_running_requests=16, **engine_kwargs())
    eng._load_initial()  # driven step by step, so the batch is checked right after the prefill
    g = torch.Generator().manual_seed(7)

    def seq(i: int, n_prompt: int, n_new: int) -> Seq:
        prompt = tuple([1] + torch.randint(4, 100, (n_prompt - 1,), generator=g).tolist())
        return Seq(SeqSpec(rid=f"f{i}", input_ids=prompt, return_logprob=True, logprob_start=n_prompt,
                           sampling=SamplingSpec(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)))

    wave = [seq(0, 5, 12), seq(1, 20, 1), seq(2, 9, 15)]
    with torch.inference_mode():
        eng.submit(wave)
        eng._step()  # prefill (+ one decode step)
        (seg,) = eng._batch.segs
        assert wave[1].result.finish_reason == {"type": "length", "length": 1}
        assert seg.seqs == [wave[0], wave[2]] and not seg.holes
        assert seg.width == 9 + 1  # the 20-token prompt's columns left with it
        while any(s.result.finish_reason is None for s in wave):
            eng._step()
    _assert_single_sequence_outputs(model, wave)


def test_an_abort_never_hits_requests_submitted_after_it(tiny_model_dir):
    """`abort_all` queued while the engine thread is busy: the sequence submitted right after it (the next APRIL
    step's fresh request) must run to its end, the one submitted before it is aborted."""
    eng = Engine(str(tiny_model_dir), max_running_requests=16, **engine_kwargs())
    eng._load_initial()  # no thread: the test drives the engine loop itself, so the interleaving is exact

    def seq(rid: str) -> Seq:
        return Seq(SeqSpec(rid=rid, input_ids=(1, 5, 6, 7), sampling=SamplingSpec(max_new_tokens=6, ignore_eos=True)))

    old, new = seq("old"), seq("new")
    eng.submit([old])
    eng.abort(None, abort_all=True)
    eng.submit([new])
    with torch.inference_mode():
        while new.result.finish_reason is None:
            eng._step()
    assert old.result.finish_reason["type"] == "abort"
    assert new.result.finish_reason == {"type": "length", "length": 6} and len(new.result.output_ids) == 6


def test_finished_rows_leave_in_the_same_copy_as_a_merge(tiny_model_dir, model, monkeypatch):
    """A row that finished (a hole in the batch) when new rows arrive: the merge drops it and the padding columns
    only it used in the one cache copy it makes (no compaction first), keeps the rows sorted by padding, and every
    sequence still gets exactly its single-sequence greedy tokens and log-probs."""
    eng = Engine(str(tiny_model_dir), max_running_requests=16, **engine_kwargs())
    eng._load_initial()  # driven step by step, so the batch state is checked at the exact merge
    g = torch.Generator().manual_seed(5)

    def seq(i: int, n_prompt: int, n_new: int) -> Seq:
        prompt = tuple([1] + torch.randint(4, 100, (n_prompt - 1,), generator=g).tolist())
        return Seq(SeqSpec(rid=f"h{i}", input_ids=prompt, return_logprob=True, logprob_start=n_prompt,
                           sampling=SamplingSpec(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)))

    # the 24-token row finishes first; its 8 columns of padding for the others stay (8 pad < half the width),
    # and one hole in five rows is under the quarter that compacts a segment
    wave1 = [seq(0, 24, 3), seq(1, 5, 40), seq(2, 9, 40), seq(3, 16, 40), seq(6, 7, 40)]
    wave2 = [seq(4, 4, 20), seq(5, 12, 25)]
    with torch.inference_mode():
        eng.submit(wave1)
        while wave1[0].result.finish_reason is None:
            eng._step()
        (seg,) = eng._batch.segs  # prompts of 5..24 tokens: one width class
        assert seg.holes and len(seg) == 5  # a hole; the finished row's columns are still in the cache
        assert seg.width == 24 + 2
        eng.submit(wave2)
        copies = []  # select_rows = a compaction copy; the merge must not need one
        select_rows = BatchKVCache.select_rows
        monkeypatch.setattr(BatchKVCache, "select_rows", lambda *a, **k: copies.append(1) or select_rows(*a, **k))
        eng._step()  # prefill + merge (+ one decode step)
        assert copies == []
        assert eng._batch.segs == [seg]  # the new rows joined the segment of their width
        assert not seg.holes and len(seg) == 6
        assert wave1[0] not in seg.seqs
        # the finished row's 8 leading columns left with it: the widest live row is 16 prompt + 3 tokens
        assert seg.width == 16 + 3
        assert seg.lead == sorted(seg.lead, reverse=True)
        while any(s.result.finish_reason is None for s in wave1 + wave2):
            eng._step()
    _assert_single_sequence_outputs(model, wave1 + wave2)
