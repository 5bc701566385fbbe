"""Continuous batching internals of the embedded engine: the fused decode step and the padded running batch.

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

from infra.engine.decode import FusedDecoder
from infra.engine.kv_cache import BatchKVCache
from infra.engine.protocol import SamplingSpec, SeqSpec
from infra.engine import scheduler
from infra.engine.scheduler import Engine, Seq

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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_decoder_matches_hf_forward(model, arch, padded):
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
        for step in range(steps):
            t = caches[0].seq_len + 1
            m4 = None
            if padded:  # (B, 1, 1, T+1) bool, True = attend: the engine's decode-step mask
                m4 = torch.cat([mask.bool(), torch.ones((B, t - L), dtype=torch.bool)], 1)[:, None, None, :]
            want = m(input_ids=last[:, None], attention_mask=m4, position_ids=p[:, None], past_key_values=caches[0],
                     use_cache=True).logits[:, -1]
            got = dec(last, p, caches[1], m4)
            assert got.shape == want.shape == (B, m.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            last, p = want.argmax(-1), p + 1
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert a.length == b.length == L + steps
            torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-6)
            torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lens,keep", [([7], 1), ([5, 5, 5], 2), ([3, 12, 5], 1), ([3, 12, 5], 8), ([40, 4], 3),
                                       ([100, 6, 70, 70, 5, 130], 2)])  # long ones attend alone / equal together
def test_fused_prefill_matches_left_padded_hf_forward(model, arch, lens, keep):
    """The packed prefill gives the left-padded HF forward's logits (real positions) and writes the same keys and
    values into the cache (real columns), for one prompt, equal lengths (no mask) and mixed lengths."""
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
        got, got_mask = dec.prefill(prompts, keep, got_cache)
    assert torch.equal(got_mask, mask) and got.shape == want.shape == (len(lens), keep, m.config.vocab_size)
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


def _run_engine(model_dir, monkeypatch, fused: bool, waves=None) -> tuple[Engine, list[Seq]]:
    """Two waves of greedy sequences: the second arrives while the first is decoding (merge into a padded batch);
    prompt lengths 3..19 and output lengths 5..90, so rows leave at different steps and padding lives to the end.
    The fused run also shrinks the mask buffer's head-room to 4 columns, so decode steps keep regrowing it."""
    monkeypatch.setenv("ALLOY_ENGINE_FUSED_DECODE", "1" if fused else "0")
    monkeypatch.setattr(scheduler, "_MASK_SPARE", 4 if fused else 64)
    eng = Engine(str(model_dir), max_batch=16)
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
        assert out == logits.argmax(-1).tolist(), s.spec.rid
        want = logp.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.result.out_logprobs), want, rtol=0, atol=1e-4)


def test_staggered_padded_batch_matches_single_sequence_forward(tiny_model_dir, model, monkeypatch):
    eng, seqs = _run_engine(tiny_model_dir, monkeypatch, fused=True)
    assert eng.steps >= 89  # the first token of each sequence comes from its prefill
    _assert_single_sequence_outputs(model, seqs)
    _, plain = _run_engine(tiny_model_dir, monkeypatch, fused=False)
    for a, b in zip(seqs, plain):
        assert a.spec.input_ids == b.spec.input_ids and a.result.output_ids == b.result.output_ids
        torch.testing.assert_close(torch.tensor(a.result.out_logprobs), torch.tensor(b.result.out_logprobs),
                                   rtol=0, atol=1e-5)


def test_long_and_short_rows_prefill_apart_and_attend_in_width_buckets(tiny_model_dir, model, monkeypatch):
    """A 150-token prompt decoding when short prompts arrive (and a 160-token one): the short ones prefill in
    their own group, are merged *above* the long row (rows stay sorted by padding: a reordering merge), and decode
    attention runs in width buckets. Every sequence still gets exactly its single-sequence greedy tokens."""
    waves = ([(150, 60)], [(4, 50), (160, 30), (6, 40)])
    eng, seqs = _run_engine(tiny_model_dir, monkeypatch, fused=True, waves=waves)
    assert eng.bucketed_steps > 20, eng.bucketed_steps
    _assert_single_sequence_outputs(model, seqs)
    _, plain = _run_engine(tiny_model_dir, monkeypatch, fused=False, waves=waves)  # HF forward: one bucket
    for a, b in zip(seqs, plain):
        assert a.result.output_ids == b.result.output_ids
        torch.testing.assert_close(torch.tensor(a.result.out_logprobs), torch.tensor(b.result.out_logprobs),
                                   rtol=0, atol=1e-5)


def test_an_abort_never_hits_requests_submitted_after_it(tiny_model_dir):
    """`abort_all` queued while the engine thread is busy: the sequence submitted right after it (the next APRIL
    step's fresh request) must run to its end, the one submitted before it is aborted."""
    eng = Engine(str(tiny_model_dir), max_batch=16)
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
    eng = Engine(str(tiny_model_dir), max_batch=16)
    eng._load_initial()  # driven step by step, so the batch state is checked at the exact merge
    g = torch.Generator().manual_seed(5)

    def seq(i: int, n_prompt: int, n_new: int) -> Seq:
        prompt = tuple([1] + torch.randint(4, 100, (n_prompt - 1,), generator=g).tolist())
        return Seq(SeqSpec(rid=f"h{i}", input_ids=prompt, return_logprob=True, logprob_start=n_prompt,
                           sampling=SamplingSpec(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)))

    # the 24-token row finishes first; its 8 columns of padding for the others stay (8 pad < half the width)
    wave1 = [seq(0, 24, 3), seq(1, 5, 40), seq(2, 9, 40), seq(3, 16, 40)]
    wave2 = [seq(4, 4, 20), seq(5, 12, 25)]
    with torch.inference_mode():
        eng.submit(wave1)
        while wave1[0].result.finish_reason is None:
            eng._step()
        assert eng._holes and len(eng._run) == 4  # a hole; the finished row's columns are still in the cache
        assert eng._cache.seq_len == 24 + 2
        eng.submit(wave2)
        copies = []  # select_rows = a compaction copy; the merge must not need one
        select_rows = BatchKVCache.select_rows
        monkeypatch.setattr(BatchKVCache, "select_rows", lambda *a, **k: copies.append(1) or select_rows(*a, **k))
        eng._step()  # prefill + merge (+ one decode step)
        assert copies == []
        assert not eng._holes and len(eng._run) == 5
        assert wave1[0] not in eng._run
        # the finished row's 8 leading columns left with it: the widest live row is 16 prompt + 3 tokens
        assert eng._cache.seq_len == 16 + 3
        assert eng._lead == sorted(eng._lead, reverse=True)
        while any(s.result.finish_reason is None for s in wave1 + wave2):
            eng._step()
    _assert_single_sequence_outputs(model, wave1 + wave2)
