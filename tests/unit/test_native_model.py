"""`engine.native_model`: Llama/Qwen2 checkpoints read without transformers' model classes hold exactly the HF
model's tensors under the same names, and the engine's fused decoder computes the same logits from them (bitwise);
anything the fused decoder would not compute exactly is left to the HF loader (None); weights that do not fit the
config are refused naming the tensor. `infra.tokenizer.load_tokenizer` builds a generic fast tokenizer without
AutoTokenizer, and the result encodes and decodes as AutoTokenizer's does."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.decode import FusedDecoder
from engine.native_model import NativeCausalLM, engine_model, load_native, native_config
from infra.models import load_model
from infra.tokenizer import load_tokenizer

PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10], [1, 40, 41, 42, 43]]


def same_model(native, hf) -> None:
    a, b = native.state_dict(), hf.state_dict()
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(native.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    la, _ = FusedDecoder.for_model(native).prefill(PROMPTS, 4, None)
    lb, _ = FusedDecoder.for_model(hf).prefill(PROMPTS, 4, None)
    assert torch.equal(la, lb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_checkpoint_is_the_hf_models_tensors_and_logits(tiny_model_dir, dtype):
    native = load_native(tiny_model_dir, dtype=dtype)
    assert isinstance(native, NativeCausalLM) and native.lm_head.weight is native.model.embed_tokens.weight  # tied
    same_model(native, load_model(tiny_model_dir, dtype=dtype))
    with pytest.raises(NotImplementedError, match="FusedDecoder"):
        native(input_ids=torch.tensor([[1, 2]]))


def test_a_qwen2_checkpoint_with_qkv_biases(qwen2_bpe_dir):
    native = load_native(qwen2_bpe_dir)
    assert native is not None and native.model.layers[0].self_attn.q_proj.bias is not None
    same_model(native, load_model(qwen2_bpe_dir))


def test_untied_embeddings_and_sharded_weights(tiny_model_dir, tmp_path):
    src = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    state = load_file(str(src / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone() * 0.5
    (src / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(src / f))
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    native = load_native(src)
    assert native.lm_head.weight is not native.model.embed_tokens.weight
    same_model(native, load_model(src))


@pytest.mark.parametrize("change", [
    {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {"hidden_act": "gelu"},
    {"use_sliding_window": True},
    {"pretraining_tp": 2},
])
def test_what_the_fused_decoder_does_not_compute_exactly_goes_to_the_hf_loader(tiny_model_dir, tmp_path, change):
    src = tmp_path / "m"
    shutil.copytree(tiny_model_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    assert native_config(src) is None and load_native(src) is None


def test_weights_only_as_pytorch_bin_go_to_the_hf_loader(tiny_model_dir, tmp_path):
    src = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, src)
    torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    assert load_native(src) is None
    assert type(engine_model(src, torch.float32)).__name__ == "LlamaForCausalLM"


def test_weights_that_do_not_fit_the_config_name_the_tensor(tiny_model_dir, tmp_path):
    src = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, src)
    state = load_file(str(src / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_native(src)
    del state["model.norm.weight"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_native(src)


def test_the_fused_decode_switch_serves_the_hf_model(tiny_model_dir, monkeypatch):
    assert isinstance(engine_model(tiny_model_dir, torch.float32), NativeCausalLM)
    monkeypatch.setenv("ALLOY_ENGINE_FUSED_DECODE", "0")
    assert type(engine_model(tiny_model_dir, torch.float32)).__name__ == "LlamaForCausalLM"


def test_an_engine_import_and_load_leaves_transformers_model_classes_alone(tiny_model_dir):
    code = ("import sys, torch; import engine.server; from infra.tokenizer import load_tokenizer; "
            "from engine.native_model import engine_model; "
            f"load_tokenizer({str(tiny_model_dir)!r}); engine_model({str(tiny_model_dir)!r}, torch.float32); "
            "print(sorted(m for m in ('transformers.models.llama.modeling_llama', 'torch._dynamo', "
            "'transformers.integrations.hub_kernels', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("which", ["tiny_model_dir", "qwen2_bpe_dir"])
def test_the_generic_tokenizer_encodes_and_decodes_as_autotokenizer(request, which):
    from transformers import AutoTokenizer

    path = request.getfixturevalue(which)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    if auto.pad_token_id is None:
        auto.pad_token = auto.eos_token
    assert type(ours) is type(auto)
    for text in ("hello world", "Reverse: abc\n", "x = [3, 1, 2] ✓"):
        ids = auto(text).input_ids
        assert ours(text).input_ids == ids
        for skip in (True, False):
            assert ours.decode(ids + [auto.eos_token_id], skip_special_tokens=skip) == \
                auto.decode(ids + [auto.eos_token_id], skip_special_tokens=skip)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == \
        (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id)


def test_a_model_specific_tokenizer_class_goes_through_autotokenizer(tiny_model_dir, tmp_path, monkeypatch):
    import transformers

    src = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizer"}))

    def auto(*args, **kwargs):
        raise LookupError(f"AutoTokenizer {args}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", auto)
    with pytest.raises(LookupError, match="AutoTokenizer"):
        load_tokenizer(src)
    load_tokenizer(tiny_model_dir)  # the generic class: not through AutoTokenizer
