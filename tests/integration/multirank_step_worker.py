"""The trainers' update steps on 1 or 2 ranks (run by tests/integration/test_multirank_step.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/multirank_step_worker.py OUT

As in the trainers (teachers/specialist_main.py, student/distill_main.py): rank 0 holds the global batches and
announces each update with `Ranks.call` (the batch travels in the broadcast), the other rank `follow`s; every rank
trains its strided shard (`ppo_shard`, `opd_update`). Two steps each: 5 rows (shards of 3 and 2), then 1 row (rank 1
has none: a masked dummy row); then the student's state is saved, stepped, restored and stepped again (resume on 2
ranks). Rank 0 writes OUT/result.json (metrics, world size) and OUT/<name>.safetensors (the
weights after both steps). The test imports `run` to do the same in-process as a world of one.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

VOCAB, PAD, K = 64, 0, 3
LENGTHS = [(5, 7), (3, 2), (6, 9), (4, 1), (2, 5)]  # (prompt, response) tokens per row


def settings():
    """eps = 1: Adam's first update ≈ lr·g (sees the gradient's scale, not only its sign); no clipping."""
    from training.deepspeed_backend import TrainSettings

    return TrainSettings(lr=0.05, eps=1.0, grad_clip=0.0, zero_stage=2, micro_batch_size=2, grad_accum=1, seed=0)


def ppo_samples(rows: list[tuple[int, int]], seed: int):
    from teachers.april import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, o) in enumerate(rows):
        ids = torch.randint(3, VOCAB, (p + o,), generator=g).tolist()
        lp = (-torch.rand(o, generator=g) * 3).tolist()
        out.append(Sample(f"s{seed}-{i}", f"r{seed}-{i}", [1] + ids[:p], ids[p:], lp, [0] * o, "d", {}, "stop"))
    return out, [float(x) for x in torch.rand(len(rows), generator=g)]


def opd_samples(rows: list[tuple[int, int]], seed: int):
    from student.sampler import StudentSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, o) in enumerate(rows):
        ids = torch.randint(3, VOCAB, (p + o,), generator=g).tolist()
        topk = np.stack([np.random.default_rng(seed * 100 + i).choice(VOCAB, K, replace=False) for _ in range(o)])
        topk_lp = np.log(np.full((o, K), 1.0 / (K + 1), dtype=np.float32))
        out.append(StudentSample(f"s{seed}-{i}", i, "ab"[i % 2], None, [1] + ids[:p], ids[p:],
                                 (-torch.rand(o, generator=g) * 3).tolist(), 0, "stop",
                                 teacher_logprobs=(-torch.rand(o, generator=g) * 3).tolist(),
                                 teacher_topk_ids=topk, teacher_topk_logprobs=topk_lp,
                                 reward=float(torch.rand(1, generator=g))))
    return out


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().contiguous().clone() for k, v in module.state_dict().items()}


def run(out: Path | None = None) -> dict:
    """Both trainers' two steps in the current process group; rank 0 returns (and writes under `out`) the result."""
    from infra.config import DistillConfig, SpecialistsConfig
    from training.deepspeed_backend import DeepSpeedBackend, init_distributed
    from infra.models import build_model
    from training.ranks import Ranks, led
    from student.losses import get_loss
    from student.trainer import opd_update
    from teachers.critic import ValueModel
    from teachers.specialist import ppo_shard

    init_distributed()
    ranks = Ranks()
    sc = SpecialistsConfig(ppo_epochs=2, entropy_coef=0.01)
    dc = DistillConfig(loss="topk_kl", reward_coef=0.5)
    policy = DeepSpeedBackend(build_model("nano", VOCAB, PAD, 1, 2, seed=0), settings())
    critic = DeepSpeedBackend(ValueModel.from_preset("nano", VOCAB, PAD, 1, 2, seed=1), settings())
    student = DeepSpeedBackend(build_model("nano", VOCAB, PAD, 1, 2, seed=2), settings())
    lead, lead_student = led(policy, ranks, "policy"), led(student, ranks, "student")
    ranks.on("ppo", lambda *a: ppo_shard(sc, PAD, policy, critic, None, *a, rank=ranks.rank, world=ranks.world_size))
    ranks.on("opd", lambda samples, version: opd_update(student, samples, version, dc, get_loss(dc.loss), PAD,
                                                        rank=ranks.rank, world=ranks.world_size))
    result = None
    if ranks.is_main:
        metrics = {"ppo": [], "opd": []}
        for step, rows in enumerate((LENGTHS, LENGTHS[:1])):
            samples, rewards = ppo_samples(rows, seed=10 + step)
            metrics["ppo"].append(ranks.call("ppo", samples, rewards, step, False))
            metrics["opd"].append(ranks.call("opd", opd_samples(rows, seed=20 + step), step))
        if out is not None:
            lead.save_hf(out / "policy-hf")  # the weight push's collective (followers take part)
            # resume on the same world size: save every rank's state, step, restore, the same step again
            lead_student.save_state(out / "student-state")
            ranks.call("opd", opd_samples(LENGTHS, seed=30), 2)
            stepped = weights(student.module)
            lead_student.load_state(out / "student-state")
            ranks.call("opd", opd_samples(LENGTHS, seed=30), 2)
            again = weights(student.module)
            result_resume = max((stepped[k] - again[k]).abs().max().item() for k in stepped)
            lead_student.load_state(out / "student-state")  # back to the weights after two steps
        ranks.finish()
        result = {"world_size": ranks.world_size, "metrics": metrics}
        if out is not None:
            result["resume_max_diff"] = result_resume
        if out is not None:
            for name, b in (("policy", policy), ("critic", critic), ("student", student)):
                save_file(weights(b.module), str(out / f"{name}.safetensors"))
            (out / "result.json").write_text(json.dumps(result))
        result["weights"] = {name: weights(b.module) for name, b in
                             (("policy", policy), ("critic", critic), ("student", student))}
    else:
        ranks.follow()
    for b in (policy, critic, student):
        b.close()
    return result


def opd_grouped(grad_accum: int, micro_batch_tokens: int | None = None,
                loss_agg: str = "token_mean") -> dict[str, torch.Tensor]:
    """One OPD step (world of one) on the 5 rows of LENGTHS in `grad_accum` micro-batches (opd_update sorts rows by
    length before splitting them), or in token-budget micro-batches of ≤ `micro_batch_tokens` padded positions →
    the student's weights after it."""
    from dataclasses import replace

    from infra.config import DistillConfig, TrainConfig
    from training.deepspeed_backend import DeepSpeedBackend, init_distributed
    from infra.models import build_model
    from student.losses import get_loss
    from student.trainer import opd_update

    init_distributed()
    dc = DistillConfig(loss="topk_kl", reward_coef=0.5, loss_agg=loss_agg,
                       train=TrainConfig(lr=0.05, micro_batch_size=2, grad_accum=grad_accum))
    student = DeepSpeedBackend(build_model("nano", VOCAB, PAD, 1, 2, seed=2),
                               replace(settings(), grad_accum=grad_accum, micro_batch_tokens=micro_batch_tokens))
    try:
        m = opd_update(student, opd_samples(LENGTHS, seed=20), 0, dc, get_loss(dc.loss), PAD)
        assert m["train/tokens"] == sum(o for _, o in LENGTHS)
        return weights(student.module)
    finally:
        student.close()


if __name__ == "__main__":
    from training.deepspeed_backend import shutdown_distributed

    try:
        run(Path(sys.argv[1]))
    finally:
        shutdown_distributed()
