"""Tiny Hugging Face causal LMs built from size presets (Llama architecture), plus loading from a local dir.

The embedded default never downloads weights: `init_model_dir` builds a fresh model and the char tokenizer and
saves both (safetensors) so that `AutoModelForCausalLM.from_pretrained(dir)` works offline. The same loaders
take any local HF checkpoint.

Why Llama and not Qwen2: transformers 5 lists qwen2 among models whose hub tokenizer class is "known incorrect",
so AutoTokenizer would load our char tokenizer as Qwen2Tokenizer and replace its pre-tokenizer with a BPE regex.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, LlamaConfig, LlamaForCausalLM

from infra.tokenizer import save_char_tokenizer

hf_logging.disable_progress_bar()  # per-shard "Loading weights" bars are noise for tiny local checkpoints


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 256


PRESETS: dict[str, Preset] = {
    "nano": Preset(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64),
    "tiny": Preset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192),
    "small": Preset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384),
    "base": Preset(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=768, max_positions=512),
}


def model_config(preset: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> LlamaConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=p.hidden, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate,
        max_position_embeddings=p.max_positions, tie_word_embeddings=True,
        pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, use_cache=True,
    )


def build_model(preset: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(preset, vocab_size, pad_id, bos_id, eos_id))


def init_model_dir(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a fresh tiny model + char tokenizer to `out_dir` (HF format, safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = save_char_tokenizer(out)
    model = build_model(preset, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
