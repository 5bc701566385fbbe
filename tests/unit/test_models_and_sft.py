"""Model factory, char tokenizer in HF format, SFT batching/loss, report building: small pieces with exact numbers."""
import math
import subprocess
import sys

import pandas as pd
import pytest
import torch

from infra.models import PRESETS, build_model, init_model_dir
from infra.report import build_report, domain_table, render_table
from domains.registry import load_domain
from domains.builtin.tool_add import ToolAdd
from domains.tools import trajectory_segments
from training.sft import collate, encode_pair, sft_loss, trained_tokens
from infra.tokenizer import build_char_tokenizer
from training.base_main import demonstrations

pytestmark = pytest.mark.unit


def test_char_tokenizer_roundtrip_and_specials():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 100
    text = "add:12+3=\n x~"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)  # one id per character, whitespace included
    assert tok.decode(ids) == text
    assert tok("é", add_special_tokens=False).input_ids == [3]  # outside printable ASCII → <unk>


def test_saved_dir_loads_offline_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = init_model_dir("nano", tmp_path / "m", seed=1)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= names
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("ab c", add_special_tokens=False).input_ids == build_char_tokenizer()("ab c", add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.vocab_size == 100
    ref = build_model("nano", 100, 0, 1, 2, seed=1)
    ids = torch.tensor([[1, 70, 71, 2]])
    assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-6)


def test_presets_grow():
    sizes = [sum(p.numel() for p in build_model(name, 100, 0, 1, 2).parameters()) for name in ("nano", "tiny", "small")]
    assert sizes == sorted(sizes) and set(PRESETS) >= {"nano", "tiny", "small", "base"}
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_model("huge", 100, 0, 1, 2)


def test_preset_parameter_counts_without_torch():
    """infra.presets.preset_params (what the placement planner sizes a fresh model by) counts exactly what
    build_model builds, for every preset and both architectures (built on the meta device: no memory, fast).
    medium: 12 · (attention 2·1024·1024 + 2·1024·512 + MLP 3·1024·3072 + norms 2·1024) + embedding 100·1024 (tied)
    + final norm 1024 = 151,122,944."""
    from infra.models import model_config
    from infra.presets import CHAR_VOCAB, preset_params
    from infra.tokenizer import char_vocab

    assert CHAR_VOCAB == len(char_vocab()) == 100
    assert preset_params("medium") == 12 * (2 * 1024 ** 2 + 2 * 1024 * 512 + 3 * 1024 * 3072 + 2 * 1024) \
        + 100 * 1024 + 1024 == 151_122_944
    for arch, cls in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        import transformers

        for name in PRESETS:
            with torch.device("meta"):
                model = getattr(transformers, cls)(model_config(name, 100, 0, 1, 2, arch=arch))
            assert sum(p.numel() for p in model.parameters()) == preset_params(name, 100, arch == "qwen2"), name
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset_params("huge")
    import typing

    from infra.config import ModelConfig

    assert typing.get_args(ModelConfig.model_fields["preset"].annotation) == tuple(PRESETS)  # model.preset takes each


def test_encode_and_collate_masks_only_the_completion():
    tok = build_char_tokenizer()
    ids, n_ctx = encode_pair(tok, "ab=", "xy")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 1 + 3 + 2 + 1 and n_ctx == 4
    batch = collate([(ids, n_ctx), ([1, 5, 2], 2)], pad_id=0)
    # row 0: positions 3, 4, 5 predict 'x', 'y', EOS; row 1: position 1 predicts EOS; padding never counts
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0]]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0]


def test_tool_trajectory_segments_mask_the_tool_output_line():
    tok = build_char_tokenizer()
    segs = trajectory_segments("!calc 1+2\n>3\n3")
    assert segs == [("!calc 1+2\n", True), (">3\n", False), ("3", True)]
    ids, n_ctx, masked = encode_pair(tok, "tla:1+2=", segs)
    # [BOS] + 8 prompt chars = 9 context ids; completion ids 9..18 '!calc 1+2\n', 19..21 '>3\n', 22 '3', 23 EOS
    assert ids == encode_pair(tok, "tla:1+2=", "!calc 1+2\n>3\n3")[0]  # the char path: same ids as the joined text
    assert (n_ctx, masked, len(ids), ids[-1]) == (9, ((19, 22),), 24, tok.eos_token_id)
    assert tok.decode(ids[19:22]) == ">3\n"
    batch = collate([(ids, n_ctx, masked), (ids, n_ctx)], pad_id=0)
    # position t predicts ids[t+1]: 8..17 predict '!calc 1+2\n', 18..20 would predict '>3\n' (masked), 21 → '3',
    # 22 → EOS; the str row beside it trains the output line too
    assert batch.loss_mask[0].tolist() == [0] * 8 + [1] * 10 + [0] * 3 + [1] * 2 + [0]
    assert batch.loss_mask[1].tolist() == [0] * 8 + [1] * 15 + [0]
    assert trained_tokens((ids, n_ctx, masked)) == 12 == batch.loss_mask[0].sum()
    assert trained_tokens((ids, n_ctx)) == 15
    with pytest.raises(TypeError, match="segment 1"):
        encode_pair(tok, "p", [("a", True), "b"])


def test_base_demonstrations_use_tool_trajectories_only_when_asked():
    doms = {"tool_add": ToolAdd(), "reverse": load_domain("reverse")}
    plain = demonstrations(doms, 4, 0)
    assert all(isinstance(c, str) for _, c, _ in plain)  # the default: prompt + answer for every domain
    tools = demonstrations(doms, 4, 0, tool_trajectories=True)
    assert [p for p, *_ in tools] == [p for p, *_ in plain]  # same examples, same order
    for (prompt, c, _), (_, answer, _) in zip(tools, plain):
        if prompt.startswith("tla:"):
            a, b = prompt[4:-1].split("+")
            assert c == [(f"!calc {a}+{b}\n", True), (f">{answer}\n", False), (answer, True)]
        else:
            assert c == answer


def test_sft_loss_hand_numbers():
    # vocab 2, uniform logits → CE = log 2 per counted token; one row with 2 counted positions
    logits = torch.zeros(1, 3, 2)
    ids = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = sft_loss(logits, ids, mask)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7) and m["tokens"] == 2.0
    loss_n, _ = sft_loss(logits, ids, mask, token_normalizer=4.0)  # a global count of 4 tokens halves it
    assert loss_n.item() == pytest.approx(math.log(2) / 2, abs=1e-7)


def test_report_recovery_and_summary():
    scores = pd.DataFrame([
        {"domain": "a", "stage": "base", "score": 0.2, "n_eval": 10},
        {"domain": "a", "stage": "specialist", "score": 0.8, "n_eval": 10},
        {"domain": "a", "stage": "student", "score": 0.6, "n_eval": 10},
        {"domain": "b", "stage": "base", "score": 0.4, "n_eval": 10},
        {"domain": "b", "stage": "specialist", "score": 0.5, "n_eval": 10},
        {"domain": "b", "stage": "student", "score": 0.5, "n_eval": 10},
    ])
    table = domain_table(scores, ["a", "b"])
    assert table["a"]["recovery"] == pytest.approx(0.75) and table["b"]["recovery"] == pytest.approx(1.0)
    rep = build_report(config="c.yaml", run_id="r", mlflow={}, scores=scores, domains=["a", "b"], n_teachers=2,
                       timings_s={"base": 1.5})
    s = rep["summary"]
    assert s["base_mean"] == pytest.approx(0.3) and s["mean_recovery"] == pytest.approx(0.875) and s["min_recovery"] == 0.75
    assert rep["timings_s"]["base"] == 1.5 and rep["timings_s"]["distill"] is None
    assert "a" in render_table(rep) and "0.750" in render_table(rep)
    # a specialist that scores 0 gives an undefined recovery, not a division error
    zero = pd.DataFrame([{"domain": "a", "stage": "specialist", "score": 0.0, "n_eval": 5},
                         {"domain": "a", "stage": "student", "score": 0.1, "n_eval": 5}])
    assert domain_table(zero, ["a"])["a"]["recovery"] is None


def test_cli_model_init(tmp_path):
    out = tmp_path / "cli-model"
    proc = subprocess.run([sys.executable, "-m", "alloy.cli", "model", "init", "--preset", "nano", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "alloy.cli", "model", "init", "--preset", "huge", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown preset" in bad.stderr


def test_text_encoding_adds_bos_like_llama():
    tok = build_char_tokenizer()
    assert tok("ab").input_ids == [1] + tok("ab", add_special_tokens=False).input_ids
    assert tok.decode(tok("ab").input_ids, skip_special_tokens=True) == "ab"
