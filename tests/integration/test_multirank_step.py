"""The multi-rank trainers' claim: W ranks, each on its shard of rank 0's global batch, apply the update one rank
applies to the whole batch — for the PPO step (policy + critic: global-token losses, advantages whitened over the
global batch) and the OPD student step (global-token loss, global reward baseline).

2 ranks under torchrun (gloo, CPU; tests/integration/multirank_step_worker.py, through `Ranks.call` / `follow` as in
the trainers) against the same two steps as a world of one in this process: 5 rows (uneven shards), then 1 row (one
rank with no row of its own); and a save_state / load_state round trip on the 2 ranks.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER_PATH = Path(__file__).with_name("multirank_step_worker.py")
_spec = importlib.util.spec_from_file_location("multirank_step_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TOL = 1e-5  # fp32: only the order of float sums differs (observed max |Δ| 7e-9; per-shard whitening: 1.3e-3)
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_two_ranks_update_equals_one_rank_for_ppo_and_opd(tmp_path):
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}  # no world-of-one env from this process
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(WORKER_PATH), str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        one = worker.run()  # the 1-rank side, here, while the 2 ranks run
        log, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{log[-4000:]}"
    two = json.loads((tmp_path / "result.json").read_text())
    print(f"1 vs 2 ranks, PPO + OPD steps: {time.time() - t0:.1f}s")

    assert one["world_size"] == 1 and two["world_size"] == 2
    for name in ("policy", "critic", "student"):
        w2 = load_file(str(tmp_path / f"{name}.safetensors"))
        w1 = one["weights"][name]
        assert set(w1) == set(w2) and len(w1) >= 10
        moved = max((w1[k] - worker.weights(_init(name))[k]).abs().max().item() for k in w1)
        assert moved > 1e-3, f"{name}: the steps did not move the weights ({moved})"
        diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
        assert diff < TOL, f"{name}: 2-rank weights differ from 1-rank by {diff}"
    assert (tmp_path / "policy-hf" / "model.safetensors").is_file()  # followers took part in rank 0's save_hf
    assert (tmp_path / "student-state" / "state" / "rng_rank1.pt").is_file()  # and in its save_state
    assert two["resume_max_diff"] == 0.0  # a step after load_state repeats the step after save_state exactly
    for kind, keys in (("ppo", ("pg_loss", "vf_loss", "num_tokens", "clip_frac", "entropy")),
                       ("opd", ("train/loss", "train/tokens", "train/grad_norm"))):
        for m1, m2 in zip(one["metrics"][kind], two["metrics"][kind], strict=True):
            for k in keys:
                assert abs(m1[k] - m2[k]) < 1e-4 * max(1.0, abs(m1[k])), (kind, k, m1[k], m2[k])


def test_opd_update_is_the_same_in_any_number_of_length_sorted_micro_batches():
    """opd_update sorts a shard's rows by length before splitting them into grad_accum micro-batches (less padding);
    with the global-token normalisation and the global reward baseline the step is the same sum of token losses."""
    w1, w3 = worker.opd_grouped(1), worker.opd_grouped(3)
    init = worker.weights(_init("student"))
    assert max((w1[k] - init[k]).abs().max().item() for k in w1) > 1e-3
    diff = max((w1[k] - w3[k]).abs().max().item() for k in w1)
    assert diff < TOL, f"3 length-sorted micro-batches differ from 1 by {diff}"


def test_seq_mean_loss_splits_over_micro_batches_like_the_token_mean():
    """`distill.loss_agg: seq_mean_token_mean`: the row weights come from the global batch (5 rows of 7, 2, 9, 1, 5
    response tokens), so 3 length-sorted micro-batches still make the one-pass step; and it is another step than the
    token mean's (rows weigh alike, not by their tokens)."""
    s1, s3 = worker.opd_grouped(1, loss_agg="seq_mean_token_mean"), worker.opd_grouped(3, loss_agg="seq_mean_token_mean")
    diff = max((s1[k] - s3[k]).abs().max().item() for k in s1)
    assert diff < TOL, f"3 length-sorted micro-batches differ from 1 by {diff}"
    w1 = worker.opd_grouped(1)
    assert max((s1[k] - w1[k]).abs().max().item() for k in s1) > 1e-4


def test_opd_update_in_token_budget_micro_batches_is_the_one_pass_step():
    """`micro_batch_tokens` 16: the rows of 12, 5, 15, 5, 7 tokens go as [5, 5], [7], [12], [15] (4 backwards of
    ≤ 16 padded positions, or a row alone; `DeepSpeedBackend.accumulate`, one optimizer step): the same step as
    one micro-batch (Adam with eps 1 updates ≈ lr·g, so the weights compare the gradients)."""
    from training.batching import token_budget_groups

    assert token_budget_groups([p + o for p, o in worker.LENGTHS], 16) == [[1, 3], [4], [0], [2]]
    w1, wb = worker.opd_grouped(1), worker.opd_grouped(1, micro_batch_tokens=16)
    diff = max((w1[k] - wb[k]).abs().max().item() for k in w1)
    assert diff < 1e-6, f"token-budget micro-batches differ from one by {diff}"


def _init(name: str):
    """The initial module of `name`, as the worker builds it."""
    from infra.models import build_model
    from teachers.critic import ValueModel

    if name == "critic":
        return ValueModel.from_preset("nano", worker.VOCAB, worker.PAD, 1, 2, seed=1)
    return build_model("nano", worker.VOCAB, worker.PAD, 1, 2, seed={"policy": 0, "student": 2}[name])


def test_resume_needs_the_world_size_that_wrote_the_checkpoint():
    from training.ranks import require_same_world

    require_same_world(2, 2, "student", "distill.train.world_size", "file:///c/step-00000004")
    require_same_world(None, 1, "student", "distill.train.world_size", "file:///c/step-00000004")  # older: 1 rank
    with pytest.raises(ValueError) as err:
        require_same_world(2, 1, "specialist reverse", "specialists.policy_train/critic_train.world_size", "file:///s")
    msg = str(err.value)
    assert "written by 2 rank(s) and this run has 1" in msg
    assert "specialists.policy_train/critic_train.world_size=2" in msg


def test_world_size_above_one_launches_the_worker_under_torchrun():
    from tasks.worker_process import WorkerCommand, on_ranks

    cmd = WorkerCommand([sys.executable, "-m", "student.distill_main", "--out", "x"], {"ALLOY_ENGINE_API_KEY": "k"})
    assert on_ranks(cmd, 1) is cmd
    two = on_ranks(cmd, 2)
    assert list(two) == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                         "student.distill_main", "--out", "x"]
    assert two.env == {"ALLOY_ENGINE_API_KEY": "k"}  # secrets still ride in the environment, not argv
