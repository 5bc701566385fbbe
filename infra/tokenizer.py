"""Character-level tokenizer saved in Hugging Face format.

Every printable ASCII character and newline is one token; three special tokens (PAD, BOS, EOS) and UNK
come first. The tokenizer is a `tokenizers.Tokenizer` (WordLevel over single characters, fused on decode)
wrapped in `PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(dir)` loads it offline.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]


def char_vocab() -> dict[str, int]:
    """Token → id: specials at 0..3, then newline and printable ASCII (100 ids in all)."""
    return {tok: i for i, tok in enumerate(SPECIALS + CHARS)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fast char-level tokenizer: 'ab' → [id('a'), id('b')]; decode concatenates without spaces."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # like Llama's tokenizer, encoding text adds BOS (so a server given `text` sees what training saw: BOS + prompt)
    bos_id = char_vocab()[BOS]
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    tok.padding_side = "left"  # left padding: batched generation appends at the right edge
    return tok


def save_char_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Save in HF format. `tokenizer_class` is pinned so AutoTokenizer does not swap in the model family's own
    tokenizer class (transformers 5 would load a Qwen2 checkpoint's tokenizer as Qwen2Tokenizer and replace the
    char-level pre-tokenizer with a BPE regex)."""
    tok = build_char_tokenizer()
    tok.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg["padding_side"] = "left"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return tok
