"""The engine's decode step and prefill for Llama-family models, computed from the model's own weights (see
`FusedDecoder`)."""
from __future__ import annotations

import torch

from engine.kv_cache import BatchKVCache
from engine.prefill import grouped_causal_attention, left_padded, plan


class FusedDecoder:
    """One decode step (one new token per row) of a Llama-family model (Llama, Qwen2) over a `BatchKVCache`,
    computed from the model's own weights without transformers' per-module dispatch.

    Why: on CPU with a tiny model the decode step is dominated by Python overhead (≈ 30 `nn.Module` calls per
    layer, output dataclasses, mask preprocessing), not by the matmuls. This does the same arithmetic as
    `LlamaDecoderLayer` with SDPA, in the same order and dtypes, with q/k/v and gate/up fused into one matmul each
    (every output element is still the same dot product), so the logits match the HF forward (tested to 1e-5;
    bitwise in practice). `prefill` runs prompts of different lengths the same way (see there).

    Per layer, x (B, 1, H):  h = x + W_o · SDPA(RoPE(W_q n), RoPE(W_k n), W_v n) with n = RMSNorm(x);
                             out = h + W_down (silu(W_gate m) ⊙ W_up m) with m = RMSNorm(h).
    `for_model` returns None for anything else (other architectures, non-default RoPE, sliding windows, non-SDPA
    attention); the engine then runs the plain HF forward. The fused q/k/v and gate/up matrices are copies made at
    construction (≈ +60% of the layer weights in memory), so the engine builds a new decoder whenever it loads
    a new model, and calls `refresh` after copying new weights into the model's parameters in place (every other
    tensor here is the model's own parameter, so it follows by itself).
    """

    def __init__(self, model):
        cfg, inner = model.config, model.model
        self.embed = inner.embed_tokens.weight
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.final_norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = (model.lm_head.weight, model.lm_head.bias)
        self.layers = []
        for layer in inner.layers[: cfg.num_hidden_layers]:
            a, mlp = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu_b = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            self.layers.append(dict(
                in_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                qkv=(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b),
                split=(a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features),
                o=(a.o_proj.weight, a.o_proj.bias), scaling=a.scaling, head_dim=a.head_dim,
                groups=a.num_key_value_groups,
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                gate_up=(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gu_b),
                inter=mlp.gate_proj.out_features, down=(mlp.down_proj.weight, mlp.down_proj.bias),
                # the model's own (unfused) projections: for many-token prefills separate matmuls are faster
                q=(a.q_proj.weight, a.q_proj.bias), k=(a.k_proj.weight, a.k_proj.bias),
                v=(a.v_proj.weight, a.v_proj.bias), gate=(mlp.gate_proj.weight, mlp.gate_proj.bias),
                up=(mlp.up_proj.weight, mlp.up_proj.bias)))

    def refresh(self) -> None:
        """Re-fill the fused q/k/v and gate/up copies (and biases) from the model's parameters, in place."""
        with torch.no_grad():
            self._refresh()

    def _refresh(self) -> None:
        for p in self.layers:
            for fused, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
                w, b = p[fused]
                torch.cat([p[x][0] for x in parts], out=w)
                if b is not None:
                    torch.cat([p[x][1] for x in parts], out=b)

    @classmethod
    def for_model(cls, model) -> "FusedDecoder | None":
        """A decoder for `model` if it is a plain Llama/Qwen2 causal LM on SDPA attention, else None."""
        cfg = model.config
        inner = getattr(model, "model", None)
        ok = (getattr(cfg, "model_type", None) in ("llama", "qwen2")
              and getattr(cfg, "_attn_implementation", None) == "sdpa"
              and getattr(cfg, "hidden_act", None) == "silu"
              and getattr(cfg, "pretraining_tp", 1) == 1
              and not getattr(cfg, "use_sliding_window", False)
              and inner is not None and hasattr(inner, "rotary_emb") and hasattr(model, "lm_head")
              and getattr(inner.rotary_emb, "rope_type", "default") == "default"
              and hasattr(inner.rotary_emb, "inv_freq"))
        return cls(model) if ok else None

    @staticmethod
    def _rms(x: torch.Tensor, norm) -> torch.Tensor:
        """`LlamaRMSNorm`: w · x / sqrt(mean(x²) + eps), computed in float32 like HF."""
        w, eps = norm
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def _cos_sin(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for positions `pos` (any shape S) → cos, sin (S, 1, D), computed in fp32 like HF."""
        freqs = pos.float()[..., None] * self.inv_freq  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)
        return cos[..., None, :], sin[..., None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary_pos_emb` for one of q/k: x · cos + rotate_half(x) · sin (last dim D)."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    @staticmethod
    def _attend(q, keys, values, mask, scaling: float, g: int) -> torch.Tensor:
        """SDPA of one query token per row: q (B, Hq, 1, D), keys/values (B, Hkv, T, D), mask None or
        (B, 1, 1, T) bool."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if mask is None or g == 1:  # as transformers' sdpa_attention_forward, for bitwise-equal results
            return sdpa(q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=g > 1)
        # one query token: fold the query heads of each kv group into the query-length axis (pack_gqa)
        b, _, _, d = q.shape
        return sdpa(q.reshape(b, -1, g, d), keys, values, attn_mask=mask, scale=scaling)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: BatchKVCache,
                 mask: torch.Tensor | None, buckets: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """One decode step of a batch in one cache: `step` with a single part."""
        return self.step(ids, pos, [(0, ids.shape[0], cache, mask, buckets)])

    def step(self, ids: torch.Tensor, pos: torch.Tensor, parts: list[tuple]) -> torch.Tensor:
        """ids (B,) long, pos (B,) long positions of the new tokens → logits (B, V). `parts`: the batch's segments
        (`engine.running`) as `(start, end, cache, mask, buckets)`: rows `start:end` keep their keys and
        values in `cache` (each layer's new column is appended to it) and attend under `mask`, None or
        (end-start, 1, 1, T+1) bool (True = attend). Projections and the MLP run once over all B rows.

        `buckets` (with a mask; `engine.batching.attention_buckets`): rows `s:e` of the part attend only over
        columns `first_column:` — every column before it is padding for those rows, so the softmax is the same
        (masked columns weigh exactly 0) while short rows stop paying for the part's longest row."""
        def attend(i: int, p: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            d, g = p["head_dim"], p["groups"]
            outs = []
            for start, end, cache, mask, buckets in parts:
                qs = q[start:end]
                keys, values = cache.layers[i].update(k[start:end], v[start:end])
                if mask is None or not buckets:
                    outs.append(self._attend(qs, keys, values, mask, p["scaling"], g))
                else:
                    outs += [self._attend(qs[s:e], keys[s:e, :, c:], values[s:e, :, c:], mask[s:e, :, :, c:],
                                          p["scaling"], g) for s, e, c in buckets]
            # (rows, Hq, 1, D) or, with a mask, (rows, Hkv, g, D): the same memory order of the query heads
            return outs[0] if len(outs) == 1 else torch.cat([x.reshape(x.shape[0], -1, 1, d) for x in outs])

        return self._decode(ids, pos, attend)

    def step_static(self, ids: torch.Tensor, pos: torch.Tensor, pool, columns: int) -> torch.Tensor:
        """One decode step of rows `0 … B-1` of a `static_batch.KVPool`: ids (B,) long, pos (B,) long (each row's
        new token goes to column pos[r] of its row) → logits (B, V). Attention reads the first `columns` columns
        (> every pos) under the mask `column ≤ pos[r]`. Every shape depends only on (B, columns) and every tensor
        is read in place, so the step can be captured in a CUDA graph (`engine.cuda_graphs`) and replayed after
        the pool's `last`/`pos` buffers change. The arithmetic is `step`'s, per row the same as over a
        left-padded cache (masked columns weigh exactly 0)."""
        b = ids.shape[0]
        rows = pool.row_index[:b]
        mask = (pool.col_index[None, :columns] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, columns)

        def attend(i: int, p: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kb, vb = pool.k[i], pool.v[i]
            kb[rows, :, pos] = k[:, :, 0]  # (B, Hkv, D) into column pos[r] of row r
            vb[rows, :, pos] = v[:, :, 0]
            return self._attend(q, kb[:b, :, :columns], vb[:b, :, :columns], mask, p["scaling"], p["groups"])

        return self._decode(ids, pos, attend)

    def _decode(self, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """The decode step's layers around a path's attention: `attend(layer, p, q, k, v)` gets this layer's
        RoPE'd q (B, Hq, 1, D), k and v (B, Hkv, 1, D), stores k/v in its cache and returns the attention output
        in (rows, Hq, 1, D) or (rows, Hkv, g, D) memory order of the query heads."""
        lin = torch.nn.functional.linear
        b = ids.shape[0]
        h = torch.nn.functional.embedding(ids[:, None], self.embed)  # (B, 1, H)
        cos, sin = self._cos_sin(pos[:, None], h.dtype)  # (B, 1, 1, D): broadcast over heads of (B, heads, 1, D)
        for i, p in enumerate(self.layers):
            d = p["head_dim"]
            n = self._rms(h, p["in_norm"])
            q, k, v = lin(n, *p["qkv"]).split(p["split"], dim=-1)
            q = q.view(b, 1, -1, d).transpose(1, 2)  # (B, Hq, 1, D)
            k = k.view(b, 1, -1, d).transpose(1, 2)  # (B, Hkv, 1, D)
            v = v.view(b, 1, -1, d).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            o = attend(i, p, q, k, v)
            o = o.reshape(b, -1, 1, d).transpose(1, 2).reshape(b, 1, -1)
            h = h + lin(o, *p["o"])
            m = self._rms(h, p["post_norm"])
            gate, up = lin(m, *p["gate_up"]).split(p["inter"], dim=-1)
            h = h + lin(torch.nn.functional.silu(gate) * up, *p["down"])
        return lin(self._rms(h, self.final_norm)[:, -1], *self.lm_head)

    def prefill(self, prompts: list, keep: int, caches: list[tuple[list[int], BatchKVCache]] | None = None,
                spare: int = 32, static: tuple | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward of G prompts of different lengths → (logits of the last `keep` positions of each prompt
        (G, keep, V), right-aligned like a left-padded batch; a mask (g_s, L_s) long per entry of `caches`).

        `caches` (None: no KV kept, e.g. scoring): `(indices, cache)` pairs, one per segment of the running batch
        (`engine.running`); each cache gets the keys/values of its prompts, left-padded to its own longest
        prompt L_s, `(g_s, H_kv, L_s + spare, D)`, zeros in the padding, decode head-room after L_s.

        The same result as the left-padded HF forward the engine used before (tested to 1e-5), cheaper: the
        projections and the MLP run on the N = Σ L_i real tokens packed into one `(N, H)` matrix, so padding costs
        nothing there (a 400-token resumed partial and fifteen 20-token prompts are 700 rows, not 16 × 400), and
        attention runs by groups of similar length (`engine.prefill`), so it does not either. No per-module
        dispatch, which was ~0.8 ms of every HF forward here. So one prefill takes every waiting prompt.
        Logit rows of a prompt shorter than `keep` are 0 in its padding columns (the engine reads only real ones).

        `static` (instead of `caches`): `(pool, slots)`, a `static_batch.KVPool` and one pool row per prompt (G,)
        long: prompt i's keys/values go to columns 0 … L_i-1 of row slots[i] (no padding), for the static step.
        """
        lin, emb_f = torch.nn.functional.linear, torch.nn.functional.embedding
        dev = self.embed.device  # index tensors are built on the host (small) and moved to the model's device once
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        g, L = len(prompts), int(lens.max())
        starts = lens.cumsum(0) - lens
        row = torch.repeat_interleave(torch.arange(g), lens)  # (N,) prompt of each packed token
        pos = torch.arange(row.shape[0]) - torch.repeat_interleave(starts, lens)  # (N,) 0 … L_i-1
        col = pos + (L - lens)[row]  # (N,) column in a left-padded (G, L) layout
        row, pos, col = row.to(dev), pos.to(dev), col.to(dev)
        h = emb_f(torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev), self.embed)  # (N, H)
        cos, sin = self._cos_sin(pos, h.dtype)  # (N, 1, D): broadcast over the heads of (N, heads, D)
        n_tok = row.shape[0]
        segs, masks = [], []  # per cache: its packed tokens, their (row, column) in its left-padded layout
        for idx, cache in caches or []:
            tok, r, c, ls = left_padded(lens, torch.tensor(idx, dtype=torch.long))
            mask = torch.zeros((len(idx), ls), dtype=torch.long)
            mask[r, c] = 1
            segs.append((tok.to(dev), r.to(dev), c.to(dev), ls, len(idx), cache))
            masks.append(mask.to(dev))
        if static is not None:
            pool, slots = static
            slot_tok = slots[row]  # (N,) pool row of each packed token; its column is its position
        groups = plan(lens.tolist(), device=dev)
        for i, p in enumerate(self.layers):
            d = p["head_dim"]
            n = self._rms(h, p["in_norm"])
            q, k, v = lin(n, *p["q"]), lin(n, *p["k"]), lin(n, *p["v"])
            q, k, v = q.view(n_tok, -1, d), k.view(n_tok, -1, d), v.view(n_tok, -1, d)  # (N, heads, D)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            for tok, r, c, ls, gs, cache in segs:  # (g_s, H_kv, L_s + spare, D), zeros but for the real tokens
                kp = k.new_zeros((gs, k.shape[1], ls + spare, d))
                vp = v.new_zeros((gs, v.shape[1], ls + spare, d))
                kp.transpose(1, 2)[r, c] = k[tok]
                vp.transpose(1, 2)[r, c] = v[tok]
                cache.layers[i].set_buffers(kp, vp, ls)
            if static is not None:
                pool.k[i].transpose(1, 2)[slot_tok, pos] = k
                pool.v[i].transpose(1, 2)[slot_tok, pos] = v
            o = grouped_causal_attention(q, k, v, groups, p["scaling"])  # (N, Hq, D)
            h = h + lin(o.reshape(n_tok, -1), *p["o"])
            m = self._rms(h, p["post_norm"])
            h = h + lin(torch.nn.functional.silu(lin(m, *p["gate"])) * lin(m, *p["up"]), *p["down"])
        tail = col >= L - keep  # packed tokens whose logits are kept
        logits_tail = lin(self._rms(h[tail], self.final_norm), *self.lm_head)
        logits = logits_tail.new_zeros((g, keep, logits_tail.shape[-1]))
        logits[row[tail], col[tail] - (L - keep)] = logits_tail
        return logits, masks
