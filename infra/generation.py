"""Batched in-process generation with a HF causal LM (left padding, greedy or sampled).

Used by evaluation (greedy, deterministic) where a server round-trip buys nothing. Rollouts for training go through
the engine server instead (see `infra.engine`).
"""
from __future__ import annotations

from typing import Sequence

import torch


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 128,
                   greedy: bool = True, temperature: float = 1.0, add_bos: bool = True) -> list[str]:
    """Complete each prompt; returns the decoded completions (special tokens removed), in input order.

    Prompts are encoded as [BOS] + prompt (the format the base stage trains on), left-padded per batch.
    """
    outputs: list[str] = []
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = [([tokenizer.bos_token_id] if add_bos else []) + tokenizer(p, add_special_tokens=False).input_ids for p in chunk]
        T = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), T), pad, dtype=torch.long)
        attn = torch.zeros((len(ids), T), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, T - len(x) :] = torch.tensor(x)
            attn[i, T - len(x) :] = 1
        out = model.generate(
            input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
            do_sample=not greedy, temperature=temperature if not greedy else None, top_p=None, top_k=None,
            eos_token_id=eos, pad_token_id=pad,
        )
        for row in out[:, T:].tolist():
            if eos in row:
                row = row[: row.index(eos)]
            outputs.append(tokenizer.decode([t for t in row if t != pad], skip_special_tokens=True))
    return outputs
