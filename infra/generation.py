"""Batched in-process generation with a HF causal LM (left padding, greedy or sampled).

Used by evaluation (greedy, deterministic) where a server round-trip buys nothing: `generate_turns` is the in-process
backend of the one episode loop (`domains.episodes.run_episodes`, which rollouts and the student drive through an
engine server). Prompts are rendered by `infra.chat` (the rendering every stage uses); generation stops at its stop
ids (EOS, the generation config's, the chat template's end of turn).
"""
from __future__ import annotations

from typing import Sequence

import torch

from infra.chat import render_prompt_ids, response_text, stop_token_ids
from infra.models import model_device


def generate_ids(model, tokenizer, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 batch_size: int = 128, greedy: bool = True, temperature: float = 1.0,
                 stop_ids: Sequence[int] | None = None) -> list[str]:
    """Complete each prompt (token ids); returns the decoded completions in input order: each cut at its first stop
    id (default `infra.chat.stop_token_ids` of the tokenizer and the model's generation config) and at its own
    budget (`max_new_tokens`: one for all or one per prompt), special tokens removed. Batches in input order
    (`generate_turns` without sorting), left-padded."""
    budgets = (list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple))
               else [int(max_new_tokens)] * len(prompt_ids))
    if stop_ids is None:
        stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    stops = list(stop_ids)
    outs = generate_turns(model, prompt_ids, budgets, stops, pad_id=tokenizer.pad_token_id, batch_size=batch_size,
                          greedy=greedy, temperature=temperature, sort=False)
    return [response_text(tokenizer, ids, stops) for ids, _ in outs]


def generate_batch(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 128,
                   greedy: bool = True, temperature: float = 1.0, add_bos: bool = True, system: str = "",
                   chat_template: str = "auto") -> list[str]:
    """`generate_ids` on text prompts rendered by `infra.chat.render_prompt_ids` (`add_bos=False`: the raw prompt
    ids, no BOS and no template)."""
    ids = [render_prompt_ids(tokenizer, p, system, chat_template) if add_bos
           else tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return generate_ids(model, tokenizer, ids, max_new_tokens, batch_size, greedy, temperature)


@torch.no_grad()
def generate_turns(model, contexts: Sequence[Sequence[int]], budgets: Sequence[int], stop_ids: Sequence[int], *,
                   turn_end_ids: frozenset[int] = frozenset(), pad_id: int | None = None, batch_size: int = 128,
                   greedy: bool = True, temperature: float = 1.0, sort: bool = True) -> list[tuple[list[int], str]]:
    """One turn per context (token ids), as an engine server returns it: the new ids up to and including the first
    stop id (finish "stop"), or the first of `turn_end_ids` (a tool turn's line end, the server's stop string
    "\n": finish "stop"), else `budgets[i]` ids (finish "length"). Contexts go through `model.generate` sorted by
    length (`sort`; else in input order) in batches of `batch_size`, left-padded (each batch runs until its longest
    row stops: how HF batches).
    Sampled turns (`greedy=False`) draw from torch's global RNG."""
    stops = list(stop_ids)
    pad = stops[0] if pad_id is None else pad_id
    enders = set(stops) | set(turn_end_ids)
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i])) if sort else list(range(len(contexts)))
    out: list[tuple[list[int], str]] = [([], "length")] * len(contexts)
    dev = model_device(model)  # the model's device (a GPU model gets its batch there)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        T = max(len(contexts[i]) for i in idx)
        input_ids = torch.full((len(idx), T), pad, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        for r, i in enumerate(idx):
            input_ids[r, T - len(contexts[i]):] = torch.tensor(list(contexts[i]))
            attn[r, T - len(contexts[i]):] = 1
        limits = [int(budgets[i]) for i in idx]
        gen = model.generate(input_ids=input_ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=max(limits),
                             do_sample=not greedy, temperature=None if greedy else temperature, top_p=None,
                             top_k=None, eos_token_id=stops + sorted(set(turn_end_ids) - set(stops)),
                             pad_token_id=pad)
        for i, limit, row in zip(idx, limits, gen[:, T:].tolist()):
            kept, finish = [], "length"
            for t in row[:limit]:  # a row's own end; rows that ended early are padded after it
                kept.append(t)
                if t in enders:
                    finish = "stop"
                    break
            out[i] = (kept, finish)
    return out

