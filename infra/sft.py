"""Supervised fine-tuning on (prompt, completion) pairs with the DeepSpeed backend: the base stage's trainer.

Domain-agnostic: callers turn domain examples into text pairs, (prompt, completion) or (prompt, completion, system
message); prompts are rendered by `infra.chat` like in every other stage. The loss is token-level cross-entropy on the
completion tokens (and EOS) only; the prompt is context, not target.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from infra.chat import completion_ids, render_prompt_ids


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, T) long, right-padded with pad_id
    attention_mask: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float: 1 where the *next* token is a completion token


def encode_pair(tokenizer, prompt: str, completion: str, system: str = "",
                mode: str = "auto") -> tuple[list[int], int]:
    """ids = the rendered prompt (`infra.chat.render_prompt_ids`: [BOS] + prompt for the char tokenizer, the chat
    template otherwise) + completion + the turn's end (EOS, or the template's end-of-turn token); returns
    (ids, n_context) where n_context = the rendered prompt's length."""
    p = render_prompt_ids(tokenizer, prompt, system, mode)
    return p + completion_ids(tokenizer, completion, mode), len(p)


def collate(encoded: Sequence[tuple[list[int], int]], pad_id: int) -> SFTBatch:
    """Right-pad a list of (ids, n_context). loss_mask[t] = 1 iff position t predicts a completion/EOS token."""
    T = max(len(ids) for ids, _ in encoded)
    B = len(encoded)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (ids, n_ctx) in enumerate(encoded):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        # position t predicts ids[t+1]; completion tokens start at index n_ctx
        loss_mask[i, n_ctx - 1 : len(ids) - 1] = 1.0
    return SFTBatch(input_ids, attn, loss_mask)


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             token_normalizer: float | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level next-token cross-entropy.

    logits (B, T, V), input_ids (B, T), loss_mask (B, T). loss = Σ_t m_t · CE(logits_t, ids_{t+1}) / N,
    N = `token_normalizer` (e.g. the global token count across ranks) or Σ m.
    """
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    target = input_ids[:, 1:]
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    m = loss_mask[:, :-1]
    n = token_normalizer if token_normalizer is not None else m.sum().clamp_min(1.0)
    loss = (nll * m).sum() / n
    with torch.no_grad():
        acc = ((logp.argmax(-1) == target).float() * m).sum() / m.sum().clamp_min(1.0)
    return loss, {"loss": float(loss.detach()), "token_acc": float(acc), "tokens": float(m.sum())}


def train_sft(backend, tokenizer, pairs: Sequence[tuple[str, ...]], steps: int, batch_size: int, seed: int = 0,
              on_step: Callable[[int, dict], None] | None = None, chat_template: str = "auto") -> dict:
    """Run `steps` optimizer steps of SFT on random batches of `pairs` (sampled without replacement per epoch).

    A pair is (prompt, completion) or (prompt, completion, system); `chat_template` is the `model.chat_template`
    mode the prompts are rendered in (`encode_pair`).

    `backend` is an `infra.deepspeed_backend.DeepSpeedBackend`; each rank draws its shard of the same global batch.
    Returns the last step's metrics.
    """
    if not pairs:
        raise ValueError("train_sft: no training pairs")
    encoded = [encode_pair(tokenizer, p[0], p[1], p[2] if len(p) > 2 else "", chat_template) for p in pairs]
    rng = random.Random(seed)
    order: list[int] = []
    metrics: dict = {}
    backend.train_mode()
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            fresh = list(range(len(encoded)))
            rng.shuffle(fresh)
            order.extend(fresh)
        global_idx, order = order[:batch_size], order[batch_size:]
        local_idx = global_idx[backend.rank :: backend.world_size]
        batch = collate([encoded[i] for i in local_idx], tokenizer.pad_token_id)
        # normalise by the global token count (N / W per rank) so N ranks and 1 rank give the same update
        global_tokens = float(sum(len(encoded[i][0]) - encoded[i][1] for i in global_idx))
        out = backend(input_ids=batch.input_ids.to(backend.device), attention_mask=batch.attention_mask.to(backend.device))
        loss, metrics = sft_loss(out.logits, batch.input_ids.to(backend.device), batch.loss_mask.to(backend.device),
                                 token_normalizer=backend.loss_normalizer(global_tokens))
        metrics.update(backend.step(loss))
        if on_step is not None:
            on_step(step, metrics)
    backend.eval_mode()
    return metrics
