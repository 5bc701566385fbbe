"""Llama and Qwen2 checkpoints read for the engine without transformers' model classes (plain torch modules).

Why: the embedded engine computes every forward itself (`engine.decode.FusedDecoder`: decode steps and the packed
prefill) and uses the model object only as the holder of its weights. Importing transformers' Llama classes pulls
torch.distributed.tensor, torch._dynamo, scipy.optimize and accelerate, and the pipeline starts an engine per
specialist, per teacher and per student. With this loader (and the generic tokenizer built without AutoTokenizer,
`infra.tokenizer.load_tokenizer`) an engine server's start costs 2.5 CPU-s instead of 4.4 (the demo's base, start to
healthy; docs/results.md).

`load_native(path, dtype, device)` builds a module tree with transformers' names and shapes
(`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, …, `lm_head`; tied embeddings share one parameter) from
`config.json` and the safetensors weights (one file or an index of shards), so weight pushes, buffers and
`state_dict` names are the same as the HF model's. It returns None for anything the fused decoder does not compute
exactly as transformers does (another architecture, RoPE scaling, sliding windows, tensor-parallel pretraining, a
non-SiLU activation, weights not in safetensors); the engine then loads the HF model as before. The module has no
forward of its own: calling it raises (the engine only runs `FusedDecoder`, which reads these parameters).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def native_config(path: str | Path) -> SimpleNamespace | None:
    """The fields of `path/config.json` the engine and `FusedDecoder` read, or None when the fused decoder would not
    reproduce transformers' forward for it (the engine then loads the HF model)."""
    src = Path(path)
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = raw.get("architectures") or []
    kind = ARCHITECTURES.get(archs[0]) if len(archs) == 1 else None
    if kind is None or raw.get("model_type") != kind:
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    theta = rope.get("rope_theta", raw.get("rope_theta")) if isinstance(rope, dict) else None
    if rope_type != "default" or theta is None or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return None
    if raw.get("hidden_act", "silu") != "silu" or int(raw.get("pretraining_tp", 1)) != 1 \
            or raw.get("use_sliding_window", False) or raw.get("mlp_bias", False):
        return None
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    qkv_bias = True if kind == "qwen2" else bool(raw.get("attention_bias", False))
    return SimpleNamespace(
        model_type=kind, _attn_implementation="sdpa", hidden_act="silu", pretraining_tp=1,
        use_sliding_window=False, hidden_size=hidden, num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), max_position_embeddings=int(raw.get("max_position_embeddings") or 1 << 20),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=kind == "llama" and bool(raw.get("attention_bias", False)),
        eos_token_id=raw.get("eos_token_id"))


def _param(*shape: int) -> nn.Parameter:
    """A placeholder of the checkpoint tensor's shape on the meta device (no memory, no init: `load_native` assigns
    the real tensor). nn.Linear / nn.Embedding would initialise random weights first (on the meta device that path
    imports torch's compiler stack, ~1.5 s)."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    """`nn.Linear`'s attributes (weight (out, in), bias or None, in/out_features) without its initialisation."""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = _param(n_out, n_in)
        self.bias = _param(n_out) if bias else None


class Embedding(nn.Module):
    def __init__(self, n: int, dim: int):
        super().__init__()
        self.weight = _param(n, dim)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _param(size)
        self.variance_epsilon = eps


class Attention(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.q_proj = Linear(c.hidden_size, hq * d, c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, hkv * d, c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, hkv * d, c.qkv_bias)
        self.o_proj = Linear(hq * d, c.hidden_size, c.o_bias)
        self.head_dim, self.scaling, self.num_key_value_groups = d, d ** -0.5, hq // hkv


class MLP(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, False)


class DecoderLayer(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """transformers' default RoPE frequencies, computed the same way (int64 arange, then float32)."""

    def __init__(self, c: SimpleNamespace):
        super().__init__()
        d = c.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_type, self.attention_scaling = "default", 1.0


class Backbone(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)


class NativeCausalLM(nn.Module):
    """A Llama/Qwen2 causal LM's weights under transformers' names; the engine's `FusedDecoder` computes with them."""

    def __init__(self, config: SimpleNamespace, generation_config: SimpleNamespace):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> Embedding:
        return self.model.embed_tokens

    def forward(self, *args, **kwargs):
        raise NotImplementedError("NativeCausalLM holds weights for engine.decode.FusedDecoder; it has no forward "
                                  "(ALLOY_ENGINE_FUSED_DECODE=0 loads the HF model instead)")


def _weight_files(src: Path) -> list[Path] | None:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / s for s in shards]
    one = src / "model.safetensors"
    return [one] if one.is_file() else None


def load_native(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None) -> NativeCausalLM | None:
    """The checkpoint at `path` as a `NativeCausalLM` in `dtype` on `device` (None: the host), in eval mode; None
    when it is not one the fused decoder computes exactly (see `native_config`). Raises `ValueError` naming the
    tensor when the weights do not fit the config (a missing, unexpected or misshapen tensor)."""
    from safetensors import safe_open

    src = Path(path)
    config, files = native_config(src), _weight_files(src)
    if config is None or files is None:
        return None
    gen = {}
    if (src / "generation_config.json").is_file():
        gen = json.loads((src / "generation_config.json").read_text())
    model = NativeCausalLM(config, SimpleNamespace(eos_token_id=gen.get("eos_token_id", config.eos_token_id)))
    where = "cpu" if device is None else str(device)
    state: dict[str, torch.Tensor] = {}
    for f in files:  # tensor by tensor, each cast as it is read: never a whole float32 copy on the device
        with safe_open(str(f), framework="pt", device=where) as fh:
            for k in fh.keys():
                state[k] = fh.get_tensor(k).to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = dict(model.named_parameters())  # a tied lm_head is the embedding's parameter: listed once
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{src}: weights do not match the {config.model_type} config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, p in expected.items():
        if tuple(state[k].shape) != tuple(p.shape):
            raise ValueError(f"{src}: tensor {k} has shape {tuple(state[k].shape)}, the config says {tuple(p.shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(where)
    return model.eval()


def fused_decode() -> bool:
    """Whether Llama/Qwen2 models run on `FusedDecoder` (default); ALLOY_ENGINE_FUSED_DECODE=0 runs the HF forward."""
    return os.environ.get("ALLOY_ENGINE_FUSED_DECODE", "1").lower() not in ("0", "false", "no")


def engine_model(path, dtype: torch.dtype, device=None):
    """The model the engine serves from the HF dir `path`: a Llama/Qwen2 checkpoint the fused decoder computes
    exactly is read without transformers' model classes (`load_native`: a faster server start),
    anything else (or ALLOY_ENGINE_FUSED_DECODE=0) as the HF model (`infra.models.load_model`)."""
    if fused_decode():
        model = load_native(path, dtype=dtype, device=device)
        if model is not None:
            return model
    from infra.models import load_model

    return load_model(path, dtype=dtype, device=device)
