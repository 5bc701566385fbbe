"""Causal self-attention for a packed prefill: prompts of different lengths whose tokens are concatenated in one
`(N, heads, D)` tensor, attended group by group (`engine.batching.attention_groups`), never padded to the
longest prompt of the whole prefill.

Why: the engine's prefill runs the projections and the MLP of all waiting prompts at once on their N real
tokens (`FusedDecoder.prefill`). Attention is the only part that needs a prompt's tokens laid out together; a
left-padded `(G, H, L, L)` call over all of them costs every short prompt the longest one's L² and needs a
materialised mask, which on CPU selects SDPA's slower math kernel. Here prompts of equal length (any length) and
long prompts attend with the mask-free causal kernel, and only short prompts of similar length share a padded,
masked call (a padding query attends to itself, so no row is all -inf).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batching import attention_groups


@dataclass
class _Group:
    tokens: torch.Tensor  # (n,) packed indices of the group's tokens, prompt by prompt
    g: int  # prompts
    length: int  # the longest prompt's length
    at: torch.Tensor | None  # (n,) flat index in the left-padded (g * length) layout; None = no padding
    mask: torch.Tensor | None  # (g, 1, L, L) bool, True = attend; None = causal


def left_padded(lens: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Prompts `idx` of a packed prefill (all prompts' lengths `lens`, packed in that order), laid out left-padded
    to their longest, L. For each of their tokens, prompt by prompt: its index in the packed order, its row (the
    prompt's place in `idx`) and its column; and L."""
    glens = lens[idx]
    ln = int(glens.max())
    local = torch.arange(int(glens.sum())) - torch.repeat_interleave(glens.cumsum(0) - glens, glens)  # 0…n_i-1
    rows = torch.repeat_interleave(torch.arange(idx.shape[0]), glens)
    tokens = torch.repeat_interleave((lens.cumsum(0) - lens)[idx], glens) + local
    return tokens, rows, local + (ln - glens)[rows], ln


def plan(lens: list[int], long_from: int = 64, device: torch.device | str | None = None) -> list[_Group]:
    """The attention groups of prompts with lengths `lens` (packed in this order), with their gather indices and
    masks (built on the host, then on `device`: the model's)."""
    lens_t = torch.tensor(lens, dtype=torch.long)
    out = []
    for group in attention_groups(lens, long_from):
        idx = torch.tensor(group, dtype=torch.long)
        tokens, rows, cols, L = left_padded(lens_t, idx)
        g = len(group)
        if int(lens_t[idx].min()) == L:
            out.append(_Group(tokens.to(device), g, L, None, None))
            continue
        at = rows * L + cols
        real = torch.zeros((g, L), dtype=torch.bool)
        real.view(-1)[at] = True
        causal = torch.ones((L, L), dtype=torch.bool).tril_()
        mask = (causal[None] & real[:, None, :]) | torch.eye(L, dtype=torch.bool)[None]
        out.append(_Group(tokens.to(device), g, L, at.to(device), mask[:, None].to(device)))
    return out


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[_Group],
                             scaling: float) -> torch.Tensor:
    """q (N, Hq, D), k/v (N, Hkv, D) packed (RoPE applied) → attention output (N, Hq, D): each token attends to
    the tokens of its own prompt up to itself, softmax(q·kᵀ · scaling) v, with grouped-query heads (Hq = g·Hkv)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != k.shape[1]
    out = q.new_empty(q.shape)
    for gr in groups:
        qs, ks, vs = q.index_select(0, gr.tokens), k.index_select(0, gr.tokens), v.index_select(0, gr.tokens)
        if gr.at is not None:  # left-pad into (g · L, heads, D)
            qs = qs.new_zeros((gr.g * gr.length,) + qs.shape[1:]).index_copy_(0, gr.at, qs)
            ks = ks.new_zeros((gr.g * gr.length,) + ks.shape[1:]).index_copy_(0, gr.at, ks)
            vs = vs.new_zeros((gr.g * gr.length,) + vs.shape[1:]).index_copy_(0, gr.at, vs)
        shape = (gr.g, gr.length, -1, q.shape[2])  # (G, L, heads, D) → SDPA's (G, heads, L, D)
        o = sdpa(qs.view(shape).transpose(1, 2), ks.view(shape).transpose(1, 2), vs.view(shape).transpose(1, 2),
                 attn_mask=gr.mask, is_causal=gr.mask is None, scale=scaling, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(gr.g * gr.length, q.shape[1], q.shape[2])
        out.index_copy_(0, gr.tokens, o if gr.at is None else o.index_select(0, gr.at))
    return out
