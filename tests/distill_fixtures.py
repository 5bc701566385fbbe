"""Test helpers for the OPD student: a weak base and one stand-in specialist per domain, built with plain torch SFT.

Until the specialist PPO stage produces real specialists, a "specialist" here is the base SFT-ed further on its one
domain: it is much better than the base on that domain, which is all distillation needs from a teacher. Plain torch
(no DeepSpeed) keeps the setup to a few seconds.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from domains.registry import load_domain
from infra.models import init_model_dir, load_model, load_tokenizer
from training.sft import collate, encode_pair, sft_loss


def sft_plain(model_dir: Path, out_dir: Path, pairs: list[tuple[str, str]], steps: int, lr: float = 3e-3,
              batch: int = 64, seed: int = 0) -> Path:
    """`steps` AdamW steps of next-token SFT on `pairs`; saves model + tokenizer to out_dir (HF format)."""
    torch.manual_seed(seed)
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    enc = [encode_pair(tok, p, c) for p, c in pairs]
    rng = random.Random(seed)
    for _ in range(steps):
        b = collate(rng.sample(enc, min(batch, len(enc))), tok.pad_token_id)
        loss, _ = sft_loss(model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits, b.input_ids,
                           b.loss_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return out_dir


def build_base(root: Path, domains: list[str], steps: int, seed: int = 0) -> Path:
    """A mixed-domain base (plain-torch SFT of a fresh tiny model), the start of specialists and students."""
    pairs = [(e.prompt, e.answer) for d in domains for e in load_domain(d).split("train", 400, seed)]
    init = init_model_dir("tiny", root / "init", seed=seed)
    base = sft_plain(init, root / "base", pairs, steps, seed=seed)
    shutil.rmtree(init, ignore_errors=True)
    return base


def build_base_and_teachers(root: Path, domains: list[str], base_steps: int = 60, teacher_steps: int = 200,
                            seed: int = 0) -> tuple[Path, dict[str, Path]]:
    """A weak mixed-domain base and {domain: teacher dir}, each teacher = base + SFT on its domain only."""
    doms = {d: load_domain(d) for d in domains}
    pairs = {d: [(e.prompt, e.answer) for e in dom.split("train", 400, seed)] for d, dom in doms.items()}
    init = init_model_dir("tiny", root / "init", seed=seed)
    mixed = [p for d in domains for p in pairs[d]]
    base = sft_plain(init, root / "base", mixed, base_steps, seed=seed)
    teachers = {d: sft_plain(base, root / f"teacher-{d}", pairs[d], teacher_steps, seed=seed + 1) for d in domains}
    shutil.rmtree(init, ignore_errors=True)
    return base, teachers
