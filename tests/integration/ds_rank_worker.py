"""One rank of the 1-vs-N-ranks equivalence check (run by tests/integration/test_deepspeed_backend.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/ds_rank_worker.py OUT [STAGE]

or with the deepspeed launcher (it adds --local_rank, which is ignored):

    deepspeed --num_accelerators 2 --master_port P tests/integration/ds_rank_worker.py OUT 2

Every rank builds the same nano Llama (seed 0) and the same two global batches, takes its rows with
`shard_for_rank`, and trains two steps with a token-level masked CE normalised by the GLOBAL token count
(`backend.loss_normalizer`). Rank 0 writes OUT/result.json (global token-mean loss, grad norm and lr per step);
all ranks take part in `save_hf(OUT/model)`. The test imports the same functions to run the 1-rank side in-process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 100
# Unequal rows, so the normalisation matters: with 2 ranks (strided shards) rank 0 gets rows 0, 2 and rank 1
# rows 1, 3. (length, completion tokens scored) per row; rows are right-padded to the longest.
ROWS = [(16, 14), (6, 2), (13, 11), (5, 3)]


def settings(zero_stage: int, world_size: int):
    """The test's settings. Adam's first update is lr·g/(|g| + eps); with the usual eps = 1e-8 that is lr·sign(g),
    blind to the gradient's scale. eps = 1 makes it ≈ lr·g for |g| ≪ 1, so the compared weights see both the
    direction and the scale of the gradient; grad_clip = 0 for the same reason (clipping rescales)."""
    from training.deepspeed_backend import TrainSettings

    # ZeRO-3 keeps parameters under 1e5 elements whole ("persistent"); threshold 0 really shards the nano model
    shard_all = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else {}
    return TrainSettings(lr=0.1, eps=1.0, weight_decay=0.01, grad_clip=0.0, zero_stage=zero_stage,
                         micro_batch_size=len(ROWS) // world_size, grad_accum=1, seed=0,
                         ds_config_overrides=shard_all)


def build_model():
    from infra.models import build_model as build

    return build("nano", VOCAB, 0, 1, 2, seed=0)


def global_batch(seed: int) -> list[dict]:
    """The global batch as rows: {"ids": (T,) long, "scored": (T-1,) float} where scored[t] = 1 iff position t's
    prediction of ids[t+1] is a completion token (the last `n_scored` real tokens)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length, n_scored in ROWS:
        ids = torch.randint(4, VOCAB, (length,), generator=g)
        scored = torch.zeros(length - 1)
        scored[length - 1 - n_scored:] = 1.0
        rows.append({"ids": ids, "scored": scored})
    return rows


def collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad rows: input_ids (B, T) with pad 0, attention_mask (B, T), scored (B, T-1)."""
    T = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    scored = torch.zeros(len(rows), T - 1)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], attn[i, :n], scored[i, : n - 1] = r["ids"], 1, r["scored"]
    return ids, attn, scored


def summed_token_nll(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Σ_{b,t} scored[b,t] · −log p(ids[b,t+1] | ids[b,:t+1]).  logits (B, T, V), ids (B, T), scored (B, T-1)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * scored).sum()


def train(backend, steps_seeds=(11, 12)) -> dict:
    """Two optimizer steps on this rank's shard of each global batch. Returns per-step global metrics."""
    from training.ds_config import shard_for_rank

    out = {"world_size": backend.world_size, "losses": [], "grad_norms": [], "lrs": []}
    for seed in steps_seeds:
        rows = global_batch(seed)
        n_global = float(sum(r["scored"].sum() for r in rows))
        ids, attn, scored = collate(shard_for_rank(rows, backend.rank, backend.world_size))
        logits = backend(input_ids=ids.to(backend.device), attention_mask=attn.to(backend.device)).logits
        loss = summed_token_nll(logits, ids.to(backend.device), scored.to(backend.device))
        loss = loss / backend.loss_normalizer(n_global)
        metrics = backend.step(loss)
        out["losses"].append(backend.all_reduce_mean(float(loss.detach())))  # = global token-mean loss
        out["grad_norms"].append(metrics["grad_norm"])
        out["lrs"].append(metrics["lr"])
    return out


def main(out_dir: str, zero_stage: int) -> None:
    from training.deepspeed_backend import DeepSpeedBackend, init_distributed, shutdown_distributed

    _, world = init_distributed()
    backend = DeepSpeedBackend(build_model(), settings(zero_stage, world))
    result = train(backend)
    backend.save_hf(Path(out_dir) / "model")
    if backend.is_main:
        (Path(out_dir) / "result.json").write_text(json.dumps(result))
    backend.barrier()
    backend.close()
    shutdown_distributed()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    main(args[0], int(args[1]) if len(args) > 1 else 2)
