"""Log-probs of chosen ids under a full-vocabulary softmax, computed in token chunks (pure math, no I/O).

At real vocabularies (Qwen: V = 151,936) the logits are the largest tensor of a training step, and the textbook
`torch.log_softmax(logits.float(), -1).gather(-1, ids)` keeps several float32 copies of them alive for backward
(the cast, the log-softmax output, its gradient): ~6× the bytes of bf16 logits. `gather_log_softmax` computes the
same values token chunk by token chunk in a custom autograd Function that saves only the logits (no copy) and, in
backward, recomputes each chunk's softmax and writes its gradient into one buffer of the logits' shape and dtype,
so the extra memory is that buffer (1×) plus a few chunk-sized float32 temporaries (bench/loss_memory.py).

Used by both trainers (student OPD losses and the specialists' PPO step), so it lives below both (docs/architecture.md,
"Layering").
"""
from __future__ import annotations

import math

import torch

# Chunk size: at least CHUNK_ELEMENTS elements (tokens × V; 1M float32 = 4 MiB per temporary, 6 tokens at
# V = 151,936), else 1/CHUNK_FRACTION of the positions (32 chunks per pass), so a chunk's float32 temporaries stay a
# small fraction of the logits at any batch size.
# Importance ratios exp(log p - log q) in the PPO and OPD losses are computed from a log-ratio clamped to this: exp()
# of a log-ratio above ~88 overflows float32; real ratios never get near 20, so the clamp only guards against inf.
MAX_LOG_RATIO = 20.0
CHUNK_ELEMENTS = 1 << 20
CHUNK_FRACTION = 32


def _rows(valid: torch.Tensor | None, shape: tuple[int, int],
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) indices of the positions to compute: the valid ones, or all of them (row-major)."""
    if valid is None:
        B, T = shape
        b = torch.arange(B, device=device).repeat_interleave(T)
        return b, torch.arange(T, device=device).repeat(B)
    b, t = valid.nonzero(as_tuple=True)
    return b, t


def _chunk_logp(logits: torch.Tensor, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype,
                temperature: float) -> torch.Tensor:
    """log_softmax(logits[b, t] / temperature) in `dtype`: (c, V)."""
    x = logits[b, t].to(dtype)  # advanced indexing: a (c, V) copy, whatever the strides of `logits`
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[:, v]·b[:, v] per row, (c, V) × (c, V) → (c,), without a (c, V) product temporary."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


def chunk_tokens_for(shape: tuple[int, int, int]) -> int:
    """Positions per chunk for logits of `shape` (B, T, V): 1/CHUNK_FRACTION of all positions, at least
    CHUNK_ELEMENTS // V, at least 1. A float32 chunk temporary is then 4/(CHUNK_FRACTION·itemsize) of the logits'
    bytes (1/16 for bf16; a few live at once) once the batch is large, and a long batch needs few chunks (few kernel
    launches on a GPU)."""
    B, T, V = shape
    return max(1, CHUNK_ELEMENTS // max(V, 1), (B * T) // CHUNK_FRACTION)


class _GatherLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, rows_b, rows_t, temperature, with_entropy, chunk):
        B, T, V = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        fill = -math.log(V)  # log_softmax of an all-zero row: where positions not computed stand (never read)
        out = torch.full((B, T, ids.shape[-1]), fill, dtype=dtype, device=logits.device)
        ent = torch.full((B, T), -fill, dtype=dtype, device=logits.device) if with_entropy else None
        for s in range(0, rows_b.numel(), chunk):
            b, t = rows_b[s:s + chunk], rows_t[s:s + chunk]
            logp = _chunk_logp(logits, b, t, dtype, temperature)
            out[b, t] = logp.gather(-1, ids[b, t])
            if with_entropy:
                ent[b, t] = -_rowdot(logp.exp(), logp)
            del logp
        ctx.save_for_backward(logits, ids, rows_b, rows_t)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return (out, ent) if with_entropy else out

    @staticmethod
    def backward(ctx, grad_out, grad_ent=None):
        logits, ids, rows_b, rows_t = ctx.saved_tensors
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.zeros_like(logits)  # the one logits-sized buffer; positions not computed get exactly 0
        for s in range(0, rows_b.numel(), ctx.chunk):
            b, t = rows_b[s:s + ctx.chunk], rows_t[s:s + ctx.chunk]
            logp = _chunk_logp(logits, b, t, dtype, ctx.temperature)
            p = logp.exp()
            ent_term = None
            if ctx.with_entropy and grad_ent is not None:
                # H = −Σ p·logp,  dH/dx_j = −p_j·(logp_j + H): built in logp's buffer
                h = -_rowdot(p, logp)
                ent_term = logp.add_(h[:, None]).mul_(p).mul_(-grad_ent[b, t][:, None])
            del logp
            # d/dx of logp[ids] (log-softmax then gather): onehot(ids)·g − p·Σ_k g_k, built in p's buffer
            g = grad_out[b, t] if grad_out is not None else torch.zeros_like(ids[b, t], dtype=dtype)
            gx = p.mul_(-g.sum(-1, keepdim=True))
            gx.scatter_add_(-1, ids[b, t], g)
            if ent_term is not None:
                gx.add_(ent_term)
            if ctx.temperature != 1.0:
                gx.div_(ctx.temperature)
            grad[b, t] = gx.to(grad.dtype)
            del p, gx, ent_term
        return grad, None, None, None, None, None, None


def gather_log_softmax(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None, *,
                       temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int | None = None):
    """log_softmax(logits / temperature)[..., ids] per position, in float32 or wider, with gradient to `logits`.

    Equal (to float rounding) to ``torch.log_softmax(torch.where(valid, logits, 0).float() / temperature,
    -1).gather(-1, ids)`` but computed `chunk_tokens` positions at a time (default: ``chunk_tokens_for``), so
    forward + backward hold no float32 copy of the whole logits. Positions where `valid` is False are not computed:
    their values are −log V (the log-softmax of an all-zero row) and their gradient is exactly 0, so padding with
    garbage (inf/nan) logits can reach neither a value nor a gradient there. `valid` None: every position.
    ``with_entropy``: also return the entropy H = −Σ_v p_v log p_v of the tempered softmax per position (log V off
    `valid`), with gradient.

    Shapes: logits (B, T, V) any float dtype and strides; ids (B, T, K) integer ids in [0, V) at computed positions;
    valid (B, T) bool → (B, T, K) [, entropy (B, T)].
    """
    if logits.dim() != 3:
        raise ValueError(f"gather_log_softmax: logits must be (B, T, V), got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (B, T):
        raise ValueError(f"gather_log_softmax: ids has shape {tuple(ids.shape)}, expected ({B}, {T}, K)")
    if valid is not None and tuple(valid.shape) != (B, T):
        raise ValueError(f"gather_log_softmax: valid has shape {tuple(valid.shape)}, expected ({B}, {T})")
    if temperature <= 0:
        raise ValueError(f"gather_log_softmax: temperature must be > 0, got {temperature}")
    chunk = chunk_tokens if chunk_tokens is not None else chunk_tokens_for((B, T, V))
    if chunk < 1:
        raise ValueError(f"gather_log_softmax: chunk_tokens must be >= 1, got {chunk}")
    ids = ids.to(device=logits.device, dtype=torch.long)
    # the valid positions' indices are found where `valid` lives (a host mask: no device sync), then moved
    rows_b, rows_t = _rows(None if valid is None else valid.bool(), (B, T), logits.device)
    rows_b, rows_t = rows_b.to(logits.device), rows_t.to(logits.device)
    return _GatherLogSoftmax.apply(logits, ids, rows_b, rows_t, float(temperature), bool(with_entropy), int(chunk))
