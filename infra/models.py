"""Tiny Hugging Face causal LMs built from size presets (Llama or Qwen2 architecture), plus loading from a local dir.

The embedded default never downloads weights: `init_model_dir` builds a fresh model and a tokenizer and saves
both (safetensors) so that `AutoModelForCausalLM.from_pretrained(dir)` works offline. The same loaders take any
local HF checkpoint.

Architectures: `llama` (the default, and the demo's) or `qwen2` (Llama plus q/k/v biases; tied embeddings here,
as Qwen2's small sizes). Tokenizers: `char` (infra/tokenizer.py, Llama only) or `bpe`, a byte-level BPE trained
on local text with a ChatML chat template (Qwen2-Instruct's conventions: no BOS, EOS `<|im_end|>`, generation
config EOS [`<|im_end|>`, `<|endoftext|>`]). Why the char tokenizer cannot go with qwen2: transformers 5 lists
qwen2 among models whose hub tokenizer class is "known incorrect" and always loads a qwen2 checkpoint's tokenizer
as Qwen2Tokenizer, which rebuilds a byte-level BPE pipeline (replacing the char-level pre-tokenizer). The BPE
tokenizer is built with exactly that pipeline, so it loads back identical under either architecture.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from transformers.utils import logging as hf_logging
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          Qwen2Config, Qwen2ForCausalLM)

from infra.presets import PRESETS, Preset  # noqa: F401  (re-exported: the preset table lives without torch)
from infra.tokenizer import (bpe_eos_ids, load_tokenizer, read_train_text, save_bpe_tokenizer,  # noqa: F401
                            save_char_tokenizer, train_bpe_tokenizer)  # load_tokenizer: re-exported

hf_logging.disable_progress_bar()  # per-shard "Loading weights" bars are noise for tiny local checkpoints


ARCHS = ("llama", "qwen2")
TOKENIZERS = ("char", "bpe")
_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def model_config(preset: str, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int,
                 arch: str = "llama") -> LlamaConfig | Qwen2Config:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in _CLASSES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {list(ARCHS)}")
    p = PRESETS[preset]
    return _CLASSES[arch][0](
        vocab_size=vocab_size, hidden_size=p.hidden, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate,
        max_position_embeddings=p.max_positions, tie_word_embeddings=True,
        pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, use_cache=True,
    )


def build_model(preset: str, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int, seed: int = 0,
                arch: str = "llama") -> PreTrainedModel:
    cfg = model_config(preset, vocab_size, pad_id, bos_id, eos_id, arch=arch)
    torch.manual_seed(seed)
    return _CLASSES[arch][1](cfg)


def init_model_dir(preset: str, out_dir: str | Path, seed: int = 0, arch: str = "llama", tokenizer: str = "char",
                   train_text: Iterable[str | Path] = (), vocab_size: int = 512) -> Path:
    """Write a fresh preset-sized model + tokenizer to `out_dir` (HF format, safetensors).

    `tokenizer="char"`: the built-in char tokenizer (llama only); `"bpe"`: a byte-level BPE of at most
    `vocab_size` tokens trained on the files `train_text` (infra.tokenizer.read_train_text; required). The
    generation config carries the tokenizer's pad id and EOS id(s)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {list(ARCHS)}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {list(TOKENIZERS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    if tokenizer == "char" and arch != "llama":
        raise ValueError(f"the char tokenizer needs arch 'llama' (transformers loads a {arch} checkpoint's tokenizer "
                         "as its own BPE class); use tokenizer 'bpe'")
    train_text = list(train_text)
    if tokenizer == "bpe" and not train_text:
        raise ValueError("tokenizer 'bpe' needs training text: at least one file in train_text")
    if tokenizer == "char" and train_text:
        raise ValueError("train_text is only for tokenizer 'bpe'")
    bpe = train_bpe_tokenizer(read_train_text(train_text), vocab_size) if tokenizer == "bpe" else None
    out = Path(out_dir)  # written only once the inputs proved good
    out.mkdir(parents=True, exist_ok=True)
    if bpe is not None:
        tok = save_bpe_tokenizer(bpe, out)
        eos = bpe_eos_ids(tok)
    else:
        tok = save_char_tokenizer(out)
        eos = [tok.eos_token_id]
    model = build_model(preset, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, arch=arch)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
               ) -> PreTrainedModel:
    """An HF causal LM from the local dir `path`, in eval mode, its weights in `dtype` on `device` (None: the CPU),
    read straight in that dtype onto that device: a bf16 model on a GPU never exists as a float32 host copy."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **placement_kwargs(device))
    model.eval()
    return model


def placement_kwargs(device: str | torch.device | None) -> dict:
    """`from_pretrained` keywords that read the weights straight onto `device` (`device_map`: no full copy in host
    memory); none for the host (None or a CPU device)."""
    if device is None or torch.device(device).type == "cpu":
        return {}
    return {"device_map": {"": str(device)}}


def model_device(model) -> torch.device:
    """Where `model`'s weights live (its first parameter's device; the CPU for a model without parameters)."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next((p.device for p in model.parameters()), torch.device("cpu"))
