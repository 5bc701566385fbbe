"""Supervised fine-tuning on (prompt, completion) pairs with the DeepSpeed backend: the base stage's trainer.

Domain-agnostic: callers turn domain examples into text pairs, (prompt, completion) or (prompt, completion, system
message); prompts are rendered by `infra.chat` like in every other stage. The loss is token-level cross-entropy on the
completion tokens (and EOS) only; the prompt is context, not target.

A completion is a str, or a sequence of `(text, trained)` segments: a tool trajectory whose tool output lines are
context the environment wrote, not targets (`domains.tools.trajectory_segments`), so they are loss-masked like in
the RL rollouts and the OPD student's episodes.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F

from infra.chat import completion_ids, end_of_turn_ids, render_prompt_ids
from training.batching import step_micro_batches
from training.mfu import train_flops
from training.step_metrics import host_floats


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, T) long, right-padded with pad_id
    attention_mask: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float: 1 where the *next* token is a completion token


Segments = Sequence[tuple[str, bool]]  # (text, trained): a completion whose parts are not all targets
Completion = Union[str, Segments]
# (ids, n_context) for a str completion; (ids, n_context, masked) for segments: `masked` the [start, end) index ranges
# of ids whose tokens are not trained (the untrained segments)
Encoded = Union[tuple[list[int], int], tuple[list[int], int, tuple[tuple[int, int], ...]]]


def encode_pair(tokenizer, prompt: str, completion: Completion, system: str = "", mode: str = "auto") -> Encoded:
    """ids = the rendered prompt (`infra.chat.render_prompt_ids`: [BOS] + prompt for the char tokenizer, the chat
    template otherwise) + completion + the turn's end (EOS, or the template's end-of-turn token); returns
    (ids, n_context) where n_context = the rendered prompt's length.

    `completion` as segments `[(text, trained), ...]`: each segment is tokenized on its own (no special tokens) and
    the ids concatenated, then the turn's end; returns (ids, n_context, masked), `masked` the index ranges of ids
    of the untrained segments (the turn's end is always trained). With the char tokenizer the ids equal those of the
    joined text; with a BPE tokenizer tokenizing segment by segment can differ from tokenizing the whole text at
    a boundary (a merge across it). That is acceptable for SFT: the sequence is still the text, and the rollouts
    insert tool output the same way, as separately tokenized env lines (`domains.episodes.env_token_ids`)."""
    p = render_prompt_ids(tokenizer, prompt, system, mode)
    if isinstance(completion, str):
        return p + completion_ids(tokenizer, completion, mode), len(p)
    ids, masked = list(p), []
    for i, seg in enumerate(completion):
        if not (isinstance(seg, (tuple, list)) and len(seg) == 2 and isinstance(seg[0], str)):
            raise TypeError(f"encode_pair: completion segment {i} is {seg!r}, expected (text, trained)")
        text, trained = seg
        if not text:
            continue
        start = len(ids)
        ids += list(tokenizer(text, add_special_tokens=False).input_ids)
        if not trained:
            if masked and masked[-1][1] == start:  # adjacent untrained segments: one range
                start = masked.pop()[0]
            masked.append((start, len(ids)))
    return ids + end_of_turn_ids(tokenizer, mode), len(p), tuple(masked)


def trained_tokens(enc: Encoded) -> int:
    """How many tokens of one encoded pair are targets: the completion and its end, minus the masked ranges."""
    ids, n_ctx = enc[0], enc[1]
    masked = enc[2] if len(enc) > 2 else ()
    return len(ids) - n_ctx - sum(e - s for s, e in masked)


def collate(encoded: Sequence[Encoded], pad_id: int) -> SFTBatch:
    """Right-pad a list of `encode_pair` results. loss_mask[t] = 1 iff position t predicts a completion/EOS token
    outside the masked ranges."""
    T = max(len(enc[0]) for enc in encoded)
    B = len(encoded)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, enc in enumerate(encoded):
        ids, n_ctx = enc[0], enc[1]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        # position t predicts ids[t+1]; completion tokens start at index n_ctx
        loss_mask[i, n_ctx - 1 : len(ids) - 1] = 1.0
        for start, end in (enc[2] if len(enc) > 2 else ()):
            loss_mask[i, start - 1 : end - 1] = 0.0  # tokens [start, end) are predicted at [start-1, end-1)
    return SFTBatch(input_ids, attn, loss_mask)


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             token_normalizer: float | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level next-token cross-entropy.

    logits (B, T, V), input_ids (B, T), loss_mask (B, T). loss = Σ_t m_t · CE(logits_t, ids_{t+1}) / N,
    N = `token_normalizer` (e.g. the global token count across ranks) or Σ m. Metrics `loss`, `token_acc`, `tokens`
    are detached 0-d tensors (read back after the optimizer step: training/step_metrics.py).
    """
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    target = input_ids[:, 1:]
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    m = loss_mask[:, :-1]
    n = token_normalizer if token_normalizer is not None else m.sum().clamp_min(1.0)
    loss = (nll * m).sum() / n
    with torch.no_grad():
        acc = ((logp.argmax(-1) == target).float() * m).sum() / m.sum().clamp_min(1.0)
    return loss, {"loss": loss.detach(), "token_acc": acc, "tokens": m.sum()}


def _budget_step(backend, rows: Sequence[Encoded], groups: list[list[int]], pad_id: int,
                 norm: float) -> tuple[dict, dict]:
    """One optimizer step over `rows` in token-budget micro-batches (`training.batching.step_micro_batches`): one
    forward and backward per group, each group's summed token loss divided by the step's `norm`, so the gradients
    add up to those of one pass over all rows. An empty group is a zero-loss pass (over the first row). Returns
    (the last `backend.accumulate` result, the step's metrics: `loss` summed over the groups, `token_acc`
    token-weighted, `tokens`), read back once after the update."""
    parts: list[dict] = []
    stepped: dict = {}
    for k, g in enumerate(groups):
        mb = collate([rows[j] for j in g] or rows[:1], pad_id)
        ids = mb.input_ids.to(backend.device)
        out = backend(input_ids=ids, attention_mask=mb.attention_mask.to(backend.device))
        loss, m = sft_loss(out.logits, ids, mb.loss_mask.to(backend.device), token_normalizer=norm)
        if g:
            parts.append(m)
        stepped = backend.accumulate(loss if g else loss * 0.0, last=k == len(groups) - 1)
    got = host_floats(*parts)
    tokens = sum(m["tokens"] for m in got)
    return stepped, {"loss": sum(m["loss"] for m in got), "tokens": tokens,
                     "token_acc": sum(m["token_acc"] * m["tokens"] for m in got) / max(tokens, 1.0)}


def train_sft(backend, tokenizer, pairs: Sequence[tuple], steps: int, batch_size: int, seed: int = 0,
              on_step: Callable[[int, dict], None] | None = None, chat_template: str = "auto",
              should_stop: Callable[[int], bool] | None = None) -> dict:
    """Run `steps` optimizer steps of SFT on random batches of `pairs` (sampled without replacement per epoch), or
    fewer: after each step (and `on_step`) `should_stop(step)` true ends the training there (every rank must answer
    alike). The returned metrics carry `steps`, the steps taken.

    A pair is (prompt, completion) or (prompt, completion, system), the completion a str or `(text, trained)`
    segments; `chat_template` is the `model.chat_template` mode the prompts are rendered in (`encode_pair`).

    `backend` is an `training.deepspeed_backend.DeepSpeedBackend`; each rank draws its shard of the same global batch.
    Each step's metrics carry this rank's `forward_tokens`, `train_flops` and the step's `step_s`. Returns the last
    step's metrics. With `micro_batch_tokens` in the backend's settings a step's rows go in token-budget
    micro-batches (`_budget_step`), the same update up to float rounding.
    """
    if not pairs:
        raise ValueError("train_sft: no training pairs")
    encoded = [encode_pair(tokenizer, p[0], p[1], p[2] if len(p) > 2 else "", chat_template) for p in pairs]
    rng = random.Random(seed)
    order: list[int] = []
    metrics: dict = {}
    backend.train_mode()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if len(order) < batch_size:
            fresh = list(range(len(encoded)))
            rng.shuffle(fresh)
            order.extend(fresh)
        global_idx, order = order[:batch_size], order[batch_size:]
        local_idx = global_idx[backend.rank :: backend.world_size]
        batch = collate([encoded[i] for i in local_idx], tokenizer.pad_token_id)
        # normalise by the global token count (N / W per rank) so N ranks and 1 rank give the same update
        global_tokens = float(sum(trained_tokens(encoded[i]) for i in global_idx))
        norm = backend.loss_normalizer(global_tokens)
        groups = step_micro_batches(backend, [len(encoded[i][0]) for i in local_idx])
        if groups is None:  # one pass over this rank's rows
            out = backend(input_ids=batch.input_ids.to(backend.device),
                          attention_mask=batch.attention_mask.to(backend.device))
            loss, metrics = sft_loss(out.logits, batch.input_ids.to(backend.device),
                                     batch.loss_mask.to(backend.device), token_normalizer=norm)
            stepped = backend.step(loss)
            metrics = host_floats(metrics)[0]  # one device→host read per step, after the update was queued
        else:
            stepped, metrics = _budget_step(backend, [encoded[i] for i in local_idx], groups, tokenizer.pad_token_id,
                                            norm)
        metrics.update(stepped, forward_tokens=float(batch.attention_mask.sum()))  # this rank's positions (host)
        # this rank's training FLOPs (training/mfu.py, rows at their own length) and the step's time, the update's
        # read-back above included: a trainer reports MFU and tokens/s from these
        metrics.update(train_flops=train_flops(backend.model_shape, [len(encoded[i][0]) for i in local_idx]),
                       step_s=time.perf_counter() - t0)
        if on_step is not None:
            on_step(step, metrics)
        if should_stop is not None and step < steps and should_stop(step):
            break
    backend.eval_mode()
    return {**metrics, "steps": step if steps else 0}
