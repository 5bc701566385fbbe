"""The embedded engine serving a Qwen2 checkpoint with a byte-level BPE tokenizer (`qwen2_bpe_dir`):

- in-process, with non-zero q/k/v biases, the fused decode path is taken and every sequence of a left-padded,
  staggered batch of chat-template prompts gets the greedy tokens and log-probs of a plain single-sequence HF
  forward; the generation config's EOS list ([`<|im_end|>`, `<|endoftext|>`]) is what stops generation;
- as a real server: a `text` request of multi-line Unicode is tokenized like the tokenizer (no BOS), and the
  streamed cumulative texts of a sampled answer never end inside a multi-byte character and grow into the
  final text.
(The teacher/student tokenizer check with two BPEs: tests/integration/test_external_teachers.py.)
"""
from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from engine_proc import EngineProc, forward_logprobs, http

pytestmark = pytest.mark.integration

PROMPTS = ["Wie viel ist 12 + 30?", "日本語で答えてください：\n3 + 4 = ?",
           "Ελληνικά 🙂\nline two\nline three — fin",
           "A train travels 1,250 km in 5 hours.\nWhat is its average speed?\nA) 200\nB) 250\nC) 300"]


@pytest.fixture(scope="module")
def biased_dir(qwen2_bpe_dir, tmp_path_factory):
    """`qwen2_bpe_dir` with non-zero q/k/v biases (a trained Qwen2 has them; a fresh one has zeros)."""
    from infra.models import load_model

    out = tmp_path_factory.mktemp("qwen2-biased")
    shutil.copytree(qwen2_bpe_dir, out, dirs_exist_ok=True)
    model = load_model(qwen2_bpe_dir)
    torch.manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("fused", [True, False])
def test_engine_on_qwen2_bpe_matches_single_sequence_forward(biased_dir, monkeypatch, fused):
    from engine.protocol import SamplingSpec, SeqSpec
    from engine.scheduler import Engine, Seq
    from infra.models import load_model, load_tokenizer

    monkeypatch.setenv("ALLOY_ENGINE_FUSED_DECODE", "1" if fused else "0")
    tok, model = load_tokenizer(biased_dir), load_model(biased_dir)
    eng = Engine(str(biased_dir), max_running_requests=8)
    eng.start()
    assert eng.ready.wait(60), eng.load_error
    assert (eng._fused is not None) == fused  # Qwen2 is covered by the fused path
    assert eng.eos_ids == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    done = threading.Semaphore(0)
    seqs = [Seq(SeqSpec(rid=f"q{i}", input_ids=tuple(_chat_ids(tok, p)), return_logprob=True,
                        logprob_start=len(_chat_ids(tok, p)),
                        sampling=SamplingSpec(max_new_tokens=6 + 7 * i, temperature=0.0, ignore_eos=True)),
                on_done=lambda _s: done.release()) for i, p in enumerate(PROMPTS)]
    assert len({len(s.spec.input_ids) for s in seqs}) == len(seqs)  # different lengths: a left-padded batch
    try:
        eng.submit(seqs[:2])
        eng.submit(seqs[2:])
        for _ in seqs:
            assert done.acquire(timeout=60)
    finally:
        eng.stop()
    for s in seqs:
        prompt, out = list(s.spec.input_ids), s.result.output_ids
        assert len(out) == s.spec.sampling.max_new_tokens
        logp = forward_logprobs(model, prompt + out)[len(prompt) - 1: -1]
        assert out == logp.argmax(-1).tolist(), s.spec.rid
        want = logp.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.result.out_logprobs), want, rtol=0, atol=1e-4)


def test_server_text_request_and_stream_with_bpe(biased_dir, tmp_path):
    from infra.models import load_tokenizer

    tok = load_tokenizer(biased_dir)
    text = tok.apply_chat_template([{"role": "system", "content": "Réponds avec un nombre."},
                                    {"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True,
                                   tokenize=False)
    srv = EngineProc(biased_dir, tmp_path / "server.log").start().wait_healthy()
    try:
        # sampled from a fresh model's near-uniform distribution: mostly byte tokens, so characters split across
        # tokens (and invalid byte runs, which stay U+FFFD in the final text); seeded, so both requests agree
        sampling = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
        body = {"text": text, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": 0}
        status, raw = http(srv.url, "/generate", json.dumps(body).encode())
        assert status == 200, raw
        full = json.loads(raw)
        status, raw = http(srv.url, "/generate", json.dumps(dict(body, stream=True)).encode())
        assert status == 200, raw
    finally:
        srv.kill()
    want_ids = tok(text).input_ids
    assert [t for _, t, _ in full["meta_info"]["input_token_logprobs"]] == want_ids  # no BOS, the same ids
    assert full["meta_info"]["prompt_tokens"] == len(want_ids)
    assert full["text"] == tok.decode(full["output_ids"], skip_special_tokens=True)
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert len(chunks) >= 2 and raw.decode().rstrip().endswith("data: [DONE]")
    texts = [c["text"] for c in chunks]
    assert chunks[-1]["output_ids"] == full["output_ids"] and texts[-1] == full["text"]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a) and not a.endswith("\ufffd")  # whole characters only, growing to the final text
    # the raw decode of some streamed prefix did end inside a character: the hold-back was exercised
    assert any(tok.decode(c["output_ids"]).endswith("\ufffd") for c in chunks[:-1])
