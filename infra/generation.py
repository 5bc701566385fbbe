"""Batched in-process generation with a HF causal LM (left padding, greedy or sampled).

Used by evaluation (greedy, deterministic) where a server round-trip buys nothing. Rollouts for training go through
the engine server instead (see `engine`). Prompts are rendered by `infra.chat` (the rendering every stage
uses); generation stops at its stop ids (EOS, the generation config's, the chat template's end of turn).
"""
from __future__ import annotations

from typing import Sequence

import torch

from infra.chat import render_prompt_ids, response_text, stop_token_ids
from infra.models import model_device


@torch.no_grad()
def generate_ids(model, tokenizer, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 batch_size: int = 128, greedy: bool = True, temperature: float = 1.0,
                 stop_ids: Sequence[int] | None = None) -> list[str]:
    """Complete each prompt (token ids); returns the decoded completions in input order: each cut at its first stop
    id (default `infra.chat.stop_token_ids` of the tokenizer and the model's generation config) and at its own
    budget (`max_new_tokens`: one for all or one per prompt), special tokens removed. Left-padded per batch."""
    budgets = (list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple))
               else [int(max_new_tokens)] * len(prompt_ids))
    if stop_ids is None:
        stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    stops = list(stop_ids)
    outputs: list[str] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    for start in range(0, len(prompt_ids), batch_size):
        ids, limits = prompt_ids[start : start + batch_size], budgets[start : start + batch_size]
        T = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), T), pad, dtype=torch.long)
        attn = torch.zeros((len(ids), T), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, T - len(x) :] = torch.tensor(list(x))
            attn[i, T - len(x) :] = 1
        dev = model_device(model)  # the model's device (a GPU model gets its batch there)
        out = model.generate(
            input_ids=input_ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=max(limits),
            do_sample=not greedy, temperature=temperature if not greedy else None, top_p=None, top_k=None,
            eos_token_id=stops, pad_token_id=pad,
        )
        for row, limit in zip(out[:, T:].tolist(), limits):
            outputs.append(response_text(tokenizer, [t for t in row[:limit] if t != pad or t in stops], stops))
    return outputs


def generate_batch(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 128,
                   greedy: bool = True, temperature: float = 1.0, add_bos: bool = True, system: str = "",
                   chat_template: str = "auto") -> list[str]:
    """`generate_ids` on text prompts rendered by `infra.chat.render_prompt_ids` (`add_bos=False`: the raw prompt
    ids, no BOS and no template)."""
    ids = [render_prompt_ids(tokenizer, p, system, chat_template) if add_bos
           else tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return generate_ids(model, tokenizer, ids, max_new_tokens, batch_size, greedy, temperature)
