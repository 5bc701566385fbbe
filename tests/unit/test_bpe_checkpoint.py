"""Qwen2 + byte-level BPE checkpoints made here (`infra.models.init_model_dir`, `alloy model init --arch qwen2
--tokenizer bpe`): the tokenizer loads back identical through `AutoTokenizer` under either architecture (ids of
multi-line Unicode text, tokenizer.json, chat template, specials), the model loads with `AutoModelForCausalLM`
with q/k/v biases and the generation config's EOS list, bad inputs are refused by name, streamed text never ends
inside a multi-byte character, and the teacher/student tokenizer fingerprint tells two BPEs apart."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from bpe_fixtures import CORPUS
from infra.tokenizer import CHATML_TEMPLATE, train_bpe_tokenizer

pytestmark = pytest.mark.unit

TEXT = ("Frage: Wie viel kostet 1,35 €?\n  日本語のテキスト 🙂 ✓\n\n"
        "\tΕλληνικά — русский it's 12345\r\nend")
MESSAGES = [{"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "Anna hat 12 Äpfel\nund kauft 30 dazu. Wie viele?"}]


def test_bpe_checkpoint_loads_back_identical_with_the_auto_classes(qwen2_bpe_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Tokenizer

    saved = json.loads((qwen2_bpe_dir / "tokenizer.json").read_text())
    ref = train_bpe_tokenizer([CORPUS], 512)  # training is deterministic: the same tokenizer as the fixture's
    llama_dir = tmp_path / "as-llama"  # the same tokenizer files beside a llama config.json
    shutil.copytree(qwen2_bpe_dir, llama_dir)
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    want_ids = ref(TEXT).input_ids
    assert len(ref) == 512 and len(want_ids) < len(TEXT.encode())  # real merges, not one token per byte
    for d in (qwen2_bpe_dir, llama_dir):
        tok = AutoTokenizer.from_pretrained(d)
        assert isinstance(tok, Qwen2Tokenizer) == (d == qwen2_bpe_dir)  # transformers swaps the class for qwen2 …
        assert json.loads(tok.backend_tokenizer.to_str()) == saved  # … and rebuilds exactly the saved pipeline
        assert tok(TEXT).input_ids == want_ids and tok.decode(want_ids) == TEXT  # no BOS, lossless
        assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (None, "<|im_end|>", "<|pad|>", None)
        assert tok.padding_side == "left" and tok.chat_template == CHATML_TEMPLATE
        rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nAnna hat 12 Äpfel"
                            "\nund kauft 30 dazu. Wie viele?<|im_end|>\n<|im_start|>assistant\n")
        ids = tok(rendered, add_special_tokens=False).input_ids
        assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 2
        plain = rendered.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert tok.decode(ids, skip_special_tokens=True) == plain
        assert tok.apply_chat_template(MESSAGES[1:], tokenize=False) == (  # no default system turn
            "<|im_start|>user\nAnna hat 12 Äpfel\nund kauft 30 dazu. Wie viele?<|im_end|>\n")
    model = AutoModelForCausalLM.from_pretrained(qwen2_bpe_dir)
    attn = model.model.layers[0].self_attn
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 512
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.o_proj.bias is None
    gen = model.generation_config
    assert gen.eos_token_id == [ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>")]
    assert gen.pad_token_id == ref.pad_token_id and gen.bos_token_id is None
    with torch.no_grad():
        assert model(torch.tensor([want_ids])).logits.shape == (1, len(want_ids), 512)


def test_bpe_training_refuses_bad_inputs(tmp_path):
    from infra.models import init_model_dir
    from infra.tokenizer import read_train_text

    with pytest.raises(ValueError, match="vocab_size 100 is too small.*at least 260"):
        train_bpe_tokenizer([CORPUS], 100)
    with pytest.raises(ValueError, match="training text is empty"):
        train_bpe_tokenizer(["", ""], 512)
    with pytest.raises(FileNotFoundError, match="training text .*nope.txt: no such file"):
        init_model_dir("nano", tmp_path / "m", arch="qwen2", tokenizer="bpe", train_text=[tmp_path / "nope.txt"])
    assert not (tmp_path / "m").exists()  # nothing written before the inputs are checked
    with pytest.raises(ValueError, match="char tokenizer needs arch 'llama'"):
        init_model_dir("nano", tmp_path / "m", arch="qwen2")
    with pytest.raises(ValueError, match="needs training text"):
        init_model_dir("nano", tmp_path / "m", tokenizer="bpe")
    rows = tmp_path / "rows.jsonl"  # a dataset file: the string values of its rows
    rows.write_text(json.dumps({"question": "Wie viel?\nZwei.", "answer": "2", "n": 3}, ensure_ascii=True) + "\n\n")
    assert read_train_text([rows]) == ["Wie viel?\nZwei.", "2"]
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 2 is not JSON"):
        read_train_text([tmp_path / "bad.jsonl"])


def test_cli_model_init_qwen2_bpe_in_process(tmp_path, capsys):
    from alloy.cli import main
    from transformers import AutoTokenizer

    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS, encoding="utf-8")
    out = tmp_path / "ckpt"
    rc = main(["model", "init", "--preset", "nano", "--out", str(out), "--arch", "qwen2", "--tokenizer", "bpe",
               "--train-text", str(text), "--train-text", str(text), "--vocab-size", "400"])
    assert rc == 0 and "'nano' qwen2 model and bpe tokenizer" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 400 and tok.decode(tok(TEXT).input_ids) == TEXT
    for args, msg in [(["--tokenizer", "bpe", "--train-text", str(tmp_path / "missing.txt")],
                       f"--train-text {tmp_path / 'missing.txt'}: no such file"),
                      (["--tokenizer", "bpe"], "--tokenizer bpe needs at least one --train-text"),
                      (["--arch", "qwen2"], "char tokenizer needs arch 'llama'"),
                      (["--tokenizer", "bpe", "--train-text", str(text), "--vocab-size", "50"], "too small"),
                      (["--tokenizer", "char", "--train-text", str(text)], "--train-text is only for --tokenizer bpe")]:
        assert main(["model", "init", "--preset", "nano", "--out", str(tmp_path / "x"), *args]) == 2, args
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal of an unknown choice
        main(["model", "init", "--out", str(tmp_path / "x"), "--arch", "gpt2"])
    assert exc.value.code == 2 and "invalid choice: 'gpt2'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_streamed_text_never_ends_inside_a_character(qwen2_bpe_dir):
    """A streamed prefix cut inside a character's bytes holds them back; the full text is exact."""
    from engine.protocol import SamplingSpec, SeqResult, SeqSpec, output_text
    from infra.models import load_tokenizer

    tok = load_tokenizer(qwen2_bpe_dir)
    text = "Grüße 🦜 日本\n→ 42"  # 🦜 is not in the corpus: one token per byte
    ids = tok(text).input_ids
    spec = SeqSpec(rid="r", input_ids=(0,), sampling=SamplingSpec(max_new_tokens=64))
    res = SeqResult()
    res.output_ids = list(ids)
    prefixes = [output_text(tok, spec, res, upto=k) for k in range(len(ids) + 1)]
    assert "\ufffd" in "".join(tok.decode(ids[:k]) for k in range(len(ids)))  # the raw decode does break
    assert all("\ufffd" not in p and text.startswith(p) for p in prefixes)
    assert prefixes[-1] == output_text(tok, spec, res) == text
    assert sum(a != b for a, b in zip(prefixes, prefixes[1:])) < len(ids)  # held back at least once


def test_fingerprint_tells_two_bpe_tokenizers_apart(qwen2_bpe_dir, tmp_path):
    from infra.models import load_tokenizer
    from teachers.registry import describe_difference, tokenizer_fingerprint

    tok = load_tokenizer(qwen2_bpe_dir)
    fp = tokenizer_fingerprint(tok)
    assert describe_difference(fp, tokenizer_fingerprint(train_bpe_tokenizer([CORPUS], 512))) == ""
    resaved = tmp_path / "resaved"  # a trained checkpoint's tokenizer is the loaded one saved again (save_hf)
    tok.save_pretrained(str(resaved))
    shutil.copy(qwen2_bpe_dir / "config.json", resaved / "config.json")
    again = load_tokenizer(resaved)
    assert (resaved / "tokenizer.json").read_text() == (qwen2_bpe_dir / "tokenizer.json").read_text()
    assert describe_difference(fp, tokenizer_fingerprint(again)) == "" and again.chat_template == CHATML_TEMPLATE
    assert again.padding_side == "left" and again(TEXT).input_ids == tok(TEXT).input_ids
    other = tokenizer_fingerprint(train_bpe_tokenizer([CORPUS.upper()], 512))  # same size, other text
    assert "vocab size 512 vs student 512" in describe_difference(fp, other)
    # the same vocab and specials with the merges in another order: only the pipeline hash can tell
    spec = json.loads((qwen2_bpe_dir / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges[-1:] + merges[:-1]
    odd = tmp_path / "odd"
    shutil.copytree(qwen2_bpe_dir, odd)
    (odd / "tokenizer.json").write_text(json.dumps(spec))
    odd_fp = tokenizer_fingerprint(load_tokenizer(odd))
    assert odd_fp["vocab"] == fp["vocab"] and odd_fp["special_ids"] == fp["special_ids"]
    assert describe_difference(fp, odd_fp) == "tokenizer.json differs in model (merges)"
