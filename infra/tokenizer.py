"""Tokenizers saved in Hugging Face format: the built-in char tokenizer and a locally trained byte-level BPE.

Char: every printable ASCII character and newline is one token; three special tokens (PAD, BOS, EOS) and UNK
come first. The tokenizer is a `tokenizers.Tokenizer` (WordLevel over single characters, fused on decode)
wrapped in `PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(dir)` loads it offline.

BPE (`train_bpe_tokenizer`, `save_bpe_tokenizer`): a Qwen2-style byte-level BPE trained with the `tokenizers`
library on local text, with the ChatML specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|pad|>` and a
ChatML chat template. Like Qwen2-Instruct: no BOS, EOS = `<|im_end|>` (generation stops at the end of the
assistant turn), left padding. Its pipeline (NFC, Qwen2's pre-tokenizer regex, then ByteLevel without regex, a
BPE model with empty prefix/suffix) is exactly the one `Qwen2Tokenizer` rebuilds when transformers 5 loads a
`model_type: qwen2` checkpoint (it ignores `tokenizer_class` for qwen2), so `AutoTokenizer` gives the same
tokenizer.json, ids and template under either architecture. Text is NFC-normalized, as in Qwen2.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
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


# ------------------------------------------------------------------------------------------ byte-level BPE

ENDOFTEXT, IM_START, IM_END, BPE_PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
BPE_SPECIALS = [ENDOFTEXT, IM_START, IM_END, BPE_PAD]  # ids 0..3
# Qwen2's pre-tokenizer regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX, copied so a
# change there shows up as a test failure rather than a silent change of our ids)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# ChatML, as Qwen2-Instruct's template without its default system message: a system turn only when given
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MIN_BPE_VOCAB = 256 + len(BPE_SPECIALS)  # the byte alphabet and the specials


def _bpe_pipeline(core: Tokenizer) -> Tokenizer:
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    return core


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` (at most `vocab_size` tokens: fewer when the text has fewer merges).
    Deterministic for the same texts and size."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE: it needs at least "
                         f"{MIN_BPE_VOCAB} (256 bytes + {len(BPE_SPECIALS)} special tokens)")
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("no text to train the BPE tokenizer on (the training text is empty)")
    core = _bpe_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    # the BPE model exactly as Qwen2Tokenizer rebuilds it (empty prefix/suffix rather than null), so the saved
    # tokenizer.json and the one transformers loads for a qwen2 checkpoint are the same
    spec = json.loads(core.to_str())
    spec["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
    core = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=None, eos_token=IM_END, pad_token=BPE_PAD, unk_token=None,
        clean_up_tokenization_spaces=False, chat_template=CHATML_TEMPLATE, padding_side="left",
    )


def read_train_text(paths: Iterable[str | Path]) -> list[str]:
    """The training text of each file: a `.jsonl` file gives every string value of its rows (a dataset's prompts
    and answers), any other file its whole text (UTF-8). A missing file raises FileNotFoundError naming it."""
    texts: list[str] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"training text {path}: no such file")
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"training text {path}: not UTF-8 text ({exc})") from None
        if path.suffix != ".jsonl":
            texts.append(raw)
            continue
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"training text {path}: line {n} is not JSON: {exc}") from None
                texts += [v for v in (row.values() if isinstance(row, dict) else [row]) if isinstance(v, str)]
    return texts


def bpe_eos_ids(tok) -> list[int]:
    """The generation config's EOS list for a BPE tokenizer: end of turn first, then end of text (as Qwen2)."""
    return [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]


def save_bpe_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Save a `train_bpe_tokenizer` result in HF format: tokenizer.json, tokenizer_config.json (left padding,
    no BOS) and chat_template.jinja."""
    tok.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["padding_side"] = "left"
    cfg["model_max_length"] = 32768  # as Qwen2 (the default is a 1e30 sentinel)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return tok


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def generic_tokenizer(path: str | Path) -> bool:
    """Whether `AutoTokenizer` would build the dir's tokenizer as the generic fast tokenizer: tokenizer.json present,
    `tokenizer_class` TokenizersBackend / PreTrainedTokenizerFast, no custom code (`auto_map`), and transformers does
    not override that class for the model type (its table of checkpoints whose declared class is wrong, e.g.
    qwen2 → Qwen2Tokenizer)."""
    src = Path(path)
    tc = _json(src / "tokenizer_config.json")
    if tc.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES or "auto_map" in tc \
            or not (src / "tokenizer.json").is_file():
        return False
    from transformers.models.auto.tokenization_auto import (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
                                                            TOKENIZER_MAPPING_NAMES)

    model_type = _json(src / "config.json").get("model_type")
    registered = (TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend").removesuffix("Fast")
    return registered in ("TokenizersBackend", "PreTrainedTokenizer") \
        or model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def load_tokenizer(path: str | Path):
    """The HF tokenizer of the local dir `path` (the class `AutoTokenizer` picks), its pad token the EOS when it has
    none. A generic fast tokenizer (`generic_tokenizer`: Alloy's own char and Llama BPE tokenizers, many exported
    checkpoints) is built by that class directly: the same tokenizer, without AutoTokenizer's import of
    transformers' model configuration machinery (~2 s of CPU), so the engine server, which needs only the
    tokenizer, starts faster."""
    if generic_tokenizer(path):
        from transformers import PreTrainedTokenizerFast as Loader
    else:
        from transformers import AutoTokenizer as Loader

    tok = Loader.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
