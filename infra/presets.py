"""The size presets of Alloy's fresh models (`model.preset`), and their parameter counts, without torch.

`infra.models` builds a preset (Llama or Qwen2 architecture, tied embeddings); `infra.placement` sizes one from
`preset_params` without importing torch or transformers. Both read this one table.
"""
from __future__ import annotations

from dataclasses import dataclass

CHAR_VOCAB = 100  # infra/tokenizer.py's char tokenizer: 4 specials + newline + printable ASCII (the pipeline's fresh model)


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
    # ~151M parameters: a model for one GPU (configs/gpu-1.yaml), not for the CPU
    "medium": Preset(hidden=1024, layers=12, heads=16, kv_heads=8, intermediate=3072, max_positions=512),
}


def preset_params(preset: str, vocab_size: int = CHAR_VOCAB, qkv_bias: bool = False) -> int:
    """Exact parameter count of preset `preset` as `infra.models.build_model` builds it (Llama layout, tied
    embeddings; `qkv_bias` for qwen2's q/k/v biases): per layer q, k, v, o projections + the gated MLP (3·h·I) + two
    RMSNorm weights; the embedding V·h (shared with the LM head) and the final norm."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    hd = p.hidden // p.heads
    attention = 2 * p.hidden * p.heads * hd + 2 * p.hidden * p.kv_heads * hd
    if qkv_bias:
        attention += p.heads * hd + 2 * p.kv_heads * hd
    layer = attention + 3 * p.hidden * p.intermediate + 2 * p.hidden
    return p.layers * layer + vocab_size * p.hidden + p.hidden
