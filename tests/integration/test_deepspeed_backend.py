"""The DeepSpeed backend for real: a 2-rank ZeRO-2 run under torchrun against 1 rank and plain torch, resume,
HF export (also from ZeRO-3), and the pure config arithmetic.

The key claim: with losses normalised by the GLOBAL token count (`backend.loss_normalizer`), 1 rank and 2 ranks
on the same global batch apply the same update. A negative control shows the batch tells the normalisations apart.
The 2-rank run is a subprocess (tests/integration/ds_rank_worker.py); everything else runs in this process as a
world of one. DeepSpeed's CPU shm all-reduce op (inference only) is never compiled (checked below).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.deepspeed_backend import CHECKPOINT_TAG, DeepSpeedBackend, init_distributed, param_groups
from training.ds_config import TrainSettings, build_ds_config, loss_normalizer, lr_multiplier, shard_for_rank
from infra.models import build_model, load_model, load_tokenizer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER_PATH = Path(__file__).with_name("ds_rank_worker.py")
_spec = importlib.util.spec_from_file_location("ds_rank_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TOL = 1e-5  # fp32: 1 rank vs 2 ranks differ only by the order of float sums (observed ~1e-8)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    keys = set(a) & set(b)
    assert keys, "no common tensors to compare"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in keys)


def torch_reference(normalise: str) -> dict:
    """The two steps of ds_rank_worker.train in plain torch on one process, no DeepSpeed.

    normalise="global": loss = Σ_all ℓ / N (the token mean; what the backend must reproduce on any world size).
    normalise="local":  loss = ½ Σ_r (Σ_{r} ℓ / N_r), the mean of per-rank token means over the 2 strided shards
    (what averaging naively normalised ranks would give): the negative control.
    """
    s = worker.settings(0, 1)
    model = worker.build_model()
    opt = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr, betas=s.betas, eps=s.eps,
                            weight_decay=s.weight_decay)
    losses, norms = [], []
    for seed in (11, 12):
        rows = worker.global_batch(seed)
        parts = [rows] if normalise == "global" else [shard_for_rank(rows, r, 2) for r in range(2)]
        loss = 0.0
        for part in parts:
            ids, attn, scored = worker.collate(part)
            nll = worker.summed_token_nll(model(input_ids=ids, attention_mask=attn).logits, ids, scored)
            loss = loss + nll / scored.sum() / len(parts)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "grad_norms": norms, "weights": state(model)}


def launch_two_ranks(out_dir: Path, zero_stage: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()  # this process's world-of-one rendezvous must not leak in
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER_PATH), str(out_dir), str(zero_stage)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def backends():
    """Build backends through this, so each engine's hooks are released after the test."""
    made: list[DeepSpeedBackend] = []

    def make(model, settings):
        made.append(DeepSpeedBackend(model, settings))
        return made[-1]

    yield make
    for b in made:
        b.close()


# ---- the key test: 2 ranks == 1 rank == plain torch ----------------------------------------------------------

@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_match_one_rank_and_torch(tmp_path, backends, zero_stage):
    """ZeRO-2 shards gradients and optimizer state across the 2 ranks; ZeRO-3 also the parameters, so its
    save_hf gathers each layer from both ranks."""
    t0 = time.time()
    proc = launch_two_ranks(tmp_path, zero_stage)  # runs while this process does the 1-rank side
    try:
        one = backends(worker.build_model(), worker.settings(zero_stage, 1))
        one_result = worker.train(one)
        one.save_hf(tmp_path / "one")  # under ZeRO-3 the module's own tensors are empty shards
        one_weights = load_file(str(tmp_path / "one" / "model.safetensors"))
        ref = torch_reference("global")
        control = torch_reference("local")
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{log[-4000:]}"
    two_result = json.loads((tmp_path / "result.json").read_text())
    two_weights = load_file(str(tmp_path / "model" / "model.safetensors"))
    print(f"1-vs-2 ranks, ZeRO-{zero_stage}: {time.time() - t0:.1f}s")

    assert two_result["world_size"] == 2 and one_result["world_size"] == 1
    for name in ("losses", "grad_norms"):  # global token-mean loss and pre-clip global grad norm, both steps
        for a, b, r in zip(two_result[name], one_result[name], ref[name], strict=True):
            assert abs(a - r) < TOL and abs(b - r) < TOL, (name, a, b, r)
    assert two_result["lrs"] == one_result["lrs"] == [0.1, 0.1]
    assert len(two_weights) >= 10
    assert max_diff(two_weights, one_weights) < TOL
    assert max_diff(two_weights, ref["weights"]) < TOL
    assert max_diff(one_weights, ref["weights"]) < TOL
    # the update moved the weights by far more than TOL, and the per-rank-mean normalisation lands elsewhere:
    # the batch's unequal rows (27 vs 5 scored tokens per rank) make the check able to fail
    assert max_diff(ref["weights"], state(worker.build_model())) > 1e-2
    assert max_diff(two_weights, control["weights"]) > 100 * TOL
    assert abs(control["losses"][0] - ref["losses"][0]) > 1e-3
    assert abs(control["grad_norms"][0] - ref["grad_norms"][0]) > 0.1


# ---- one rank ------------------------------------------------------------------------------------------------

def _batch(seed: int = 5):
    rows = worker.global_batch(seed)
    ids, attn, scored = worker.collate(rows)
    return ids, attn, scored, float(scored.sum())


def _train_step(backend: DeepSpeedBackend, seed: int = 5) -> tuple[float, dict]:
    ids, attn, scored, n = _batch(seed)
    logits = backend(input_ids=ids, attention_mask=attn).logits
    loss = worker.summed_token_nll(logits, ids, scored) / backend.loss_normalizer(n)
    metrics = backend.step(loss)
    return float(loss.detach()), metrics


def test_init_distributed_is_idempotent_and_single_process():
    assert init_distributed() == (0, 1)
    assert init_distributed() == (0, 1)
    assert os.environ["WORLD_SIZE"] == "1" and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert torch.distributed.get_backend() == "gloo"


def test_the_cpu_shm_op_is_not_compiled():
    """DeepSpeed's CPU comm backend builds its shm all-reduce op (inference-only, ~35-100 s of C++ on 2 cores) unless
    it is marked unavailable: after init the backend holds none (none was built, nor loaded from an earlier build)."""
    import deepspeed.comm.comm as ds_comm

    init_distributed()
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None


def test_child_process_does_not_join_the_parents_world_of_one():
    """A subprocess inherits this process's RANK/WORLD_SIZE/MASTER_PORT; it must make its own world of one
    instead of hosting a second rendezvous store on the parent's (busy) port."""
    init_distributed()
    code = ("import os; from training.deepspeed_backend import init_distributed, shutdown_distributed; "
            "print(init_distributed(), os.environ['MASTER_PORT']); shutdown_distributed()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rank_world, port = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert rank_world == "(0, 1)" and port != os.environ["MASTER_PORT"]


def test_importing_the_backend_does_not_import_mlflow_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner probes MLflow at import (~1 s per trainer process); the backend hides it for that
    import only: a fresh process has no mlflow loaded after importing the backend, and can import it after."""
    code = ("import sys; import training.deepspeed_backend; from deepspeed.autotuning import autotuner; "
            "print('mlflow' in sys.modules, autotuner.has_mlflow); import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "mlflow"], out.stdout


def test_step_reduces_loss_on_a_repeated_batch(backends):
    b = backends(worker.build_model(), TrainSettings(lr=1e-2, micro_batch_size=4))
    assert (b.rank, b.world_size, b.is_main, b.device.type) == (0, 1, True, "cpu")
    losses = []
    for _ in range(6):
        loss, metrics = _train_step(b)
        losses.append(loss)
        assert metrics["stepped"] == 1.0 and metrics["grad_norm"] > 0 and metrics["lr"] == 1e-2
    assert b.global_step == 6
    assert all(x > y for x, y in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5, losses  # ≈ 4.6 → ≈ 3.6 at lr 1e-2


def test_grad_accum_steps_only_at_the_boundary(backends):
    """2 micro-batches × 2 rows with loss_normalizer(N) == 1 step on the 4 rows (N = tokens of all 4 rows)."""
    s = dict(lr=0.1, eps=1.0, grad_clip=0.0)
    full = backends(worker.build_model(), TrainSettings(micro_batch_size=4, **s))
    _train_step(full)
    acc = backends(worker.build_model(), TrainSettings(micro_batch_size=2, grad_accum=2, **s))
    rows = worker.global_batch(5)
    n = float(sum(r["scored"].sum() for r in rows))
    stepped = []
    for micro in (rows[:2], rows[2:]):  # rows 0,1 hold 16 scored tokens, rows 2,3 hold 14: unequal on purpose
        ids, attn, scored = worker.collate(micro)
        loss = worker.summed_token_nll(acc(input_ids=ids, attention_mask=attn).logits, ids, scored)
        stepped.append(acc.step(loss / acc.loss_normalizer(n))["stepped"])
    assert stepped == [0.0, 1.0] and acc.global_step == 1
    assert max_diff(state(acc.module), state(full.module)) < TOL


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_save_state_load_state_resumes_exactly(tmp_path, backends, zero_stage):
    settings = TrainSettings(lr=1e-2, micro_batch_size=4, zero_stage=zero_stage, warmup_steps=4,
                             lr_schedule="cosine", total_steps=10)
    a = backends(worker.build_model(), settings)
    _train_step(a, seed=1)
    _train_step(a, seed=2)
    tag_dir = a.save_state(tmp_path / "ckpt")
    draw_a = torch.rand(4)
    loss_a, m_a = _train_step(a, seed=3)
    weights_a = state(a.module)

    files = {p.relative_to(tmp_path / "ckpt").as_posix() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert tag_dir == tmp_path / "ckpt" / CHECKPOINT_TAG
    assert {"latest", "state/mp_rank_00_model_states.pt", "state/rng_rank0.pt"} <= files, files
    if zero_stage:
        assert "state/zero_pp_rank_0_mp_rank_00_optim_states.pt" in files, files

    other_init = build_model("nano", worker.VOCAB, 0, 1, 2, seed=1)  # load_state must overwrite these weights
    b = backends(other_init, settings)
    b.load_state(tmp_path / "ckpt")
    assert b.global_step == 2
    assert torch.equal(torch.rand(4), draw_a)  # RNG resumed
    loss_b, m_b = _train_step(b, seed=3)
    # the third update uses lr(2) = lr·3/4 (warm-up 4) and the saved Adam moments: bit-identical results
    assert m_a["lr"] == m_b["lr"] == pytest.approx(1e-2 * 3 / 4, abs=1e-12)
    assert loss_a == loss_b and m_a["grad_norm"] == m_b["grad_norm"]
    assert max_diff(state(b.module), weights_a) == 0.0


def test_load_state_of_missing_dir_names_it(tmp_path, backends):
    b = backends(worker.build_model(), TrainSettings(micro_batch_size=4))
    with pytest.raises(FileNotFoundError, match="no 'state' checkpoint"):
        b.load_state(tmp_path / "nowhere")


def test_save_hf_loads_with_auto_classes(tmp_path, tiny_model_dir, backends):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = load_tokenizer(tiny_model_dir)
    b = backends(load_model(tiny_model_dir), TrainSettings(lr=1e-2, micro_batch_size=4))
    b.train_mode()
    _train_step(b)
    b.eval_mode()
    b.save_hf(tmp_path / "hf", tokenizer=tok)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("ab").input_ids == tok("ab").input_ids
    ids = torch.tensor([tok("1+1=2", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, b.module(input_ids=ids).logits)
    assert max_diff(state(loaded), state(load_model(tiny_model_dir))) > 1e-3  # the trained weights, not the init
    # named_weights: the same tensors as the saved file, as CPU tensors (the tied LM head once, as the embeddings)
    nw, saved = b.named_weights(), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert nw.keys() == saved.keys() and all(torch.equal(nw[k], saved[k]) and nw[k].device.type == "cpu" for k in nw)


def test_zero3_save_hf_gathers_full_weights(tmp_path, backends):
    """ZeRO-3 shards parameters even on 1 rank (the module holds empty placeholders); save_hf must gather them.
    The saved weights equal a stage-0 run of the same step."""
    s = dict(lr=0.1, eps=1.0, grad_clip=0.0, micro_batch_size=4)
    z0 = backends(worker.build_model(), TrainSettings(zero_stage=0, **s))
    # ZeRO-3 keeps parameters under 1e5 elements whole ("persistent"): threshold 0 shards all of the nano model's
    shard_all = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    z3 = backends(worker.build_model(), TrainSettings(zero_stage=3, ds_config_overrides=shard_all, **s))
    _, m0 = _train_step(z0)
    _, m3 = _train_step(z3)
    assert abs(m0["grad_norm"] - m3["grad_norm"]) < TOL
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in z3.module.parameters())  # really partitioned
    # every forward of sharded parameters gathers them again: a trainer's length buckets collapse to one forward
    assert z3.forward_buckets(4) == 1 and z0.forward_buckets(4) == 4
    z3.save_hf(tmp_path / "z3")
    z0.save_hf(tmp_path / "z0")
    w3 = load_file(str(tmp_path / "z3" / "model.safetensors"))
    w0 = load_file(str(tmp_path / "z0" / "model.safetensors"))
    assert w3.keys() == w0.keys() and max_diff(w3, w0) < TOL
    loaded = load_model(tmp_path / "z3")
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)  # tie survives
    assert max_diff(state(loaded), state(z0.module)) < TOL
    # named_weights gathers too: a full set an engine's model takes in place (engine/weight_buffer.py)
    from engine.weight_buffer import copy_into

    nw3 = z3.named_weights()
    assert max_diff(nw3, w0) < TOL and all(t.numel() > 0 for t in nw3.values())
    # on_device (a tensor / NCCL weight push): gathered into copies on the parameters' device, the same names and
    # values, the tied head once, and the partitions stay partitioned
    on_dev = z3.named_weights(on_device=True)
    assert list(on_dev) == list(nw3) and max_diff(on_dev, nw3) == 0
    assert all(t.device == next(z3.module.parameters()).device and t.numel() > 0 for t in on_dev.values())
    assert all(p.numel() == 0 for p in z3.module.parameters())
    fresh = worker.build_model()
    copy_into(fresh, nw3)
    assert max_diff(state(fresh), state(z0.module)) < TOL


def test_all_reduce_mean_on_one_rank(backends):
    b = backends(worker.build_model(), TrainSettings(micro_batch_size=4))
    assert b.all_reduce_mean(2.5) == 2.5 and b.all_reduce_sum(-1.25) == -1.25
    b.barrier()


# ---- pure pieces ---------------------------------------------------------------------------------------------

def test_build_ds_config_arithmetic_and_flags():
    s = TrainSettings(micro_batch_size=3, grad_accum=5, zero_stage=2, dtype="bf16", grad_clip=0.5)
    cfg = build_ds_config(s, world_size=4)
    assert cfg["train_batch_size"] == 3 * 5 * 4 == 60
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 5
    assert cfg["zero_optimization"] == {"stage": 2}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    assert cfg["gradient_clipping"] == 0.5
    assert "optimizer" not in cfg and "scheduler" not in cfg  # torch objects, never FusedAdam
    z3 = build_ds_config(TrainSettings(zero_stage=3, dtype="fp16", grad_clip=0.0), 1)
    assert z3["zero_optimization"]["stage"] == 3 and z3["fp16"]["enabled"] and not z3["bf16"]["enabled"]
    assert z3["gradient_clipping"] == 0.0 and z3["train_batch_size"] == 16
    over = build_ds_config(TrainSettings(zero_stage=2, ds_config_overrides={
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "gradient_clipping": 2.0}), 2)
    assert over["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert over["gradient_clipping"] == 2.0
    with pytest.raises(ValueError, match="world_size=0"):
        build_ds_config(TrainSettings(), 0)


@pytest.mark.parametrize("field, value", [("dtype", "fp8"), ("zero_stage", 4), ("lr_schedule", "linear"),
                                          ("micro_batch_size", 0), ("grad_clip", -1.0), ("betas", (0.9, 1.0))])
def test_train_settings_reject_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=f"TrainSettings.{field}="):
        TrainSettings(**{field: value})


def test_cosine_needs_total_steps_past_warmup():
    with pytest.raises(ValueError, match="TrainSettings.total_steps=5: cosine needs total_steps > warmup_steps"):
        TrainSettings(lr_schedule="cosine", warmup_steps=5, total_steps=5)


def test_lr_multiplier_hand_values():
    assert [lr_multiplier(k, 4, "constant", None) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine, warm-up 2, total 10: p = (k − 2) / 8
    assert lr_multiplier(2, 2, "cosine", 10) == 1.0
    assert lr_multiplier(6, 2, "cosine", 10) == pytest.approx(0.5, abs=1e-12)  # p = 1/2
    assert lr_multiplier(4, 2, "cosine", 10) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    assert lr_multiplier(10, 2, "cosine", 10) == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(50, 2, "cosine", 10) == pytest.approx(0.0, abs=1e-12)


def test_loss_normalizer_and_shards():
    # 32 tokens over 2 ranks × 2 accumulation steps: each micro-batch divides its sum by 8
    assert loss_normalizer(32, 2, 2) == 8.0 and loss_normalizer(5, 1) == 5.0
    with pytest.raises(ValueError, match="global_tokens=0"):
        loss_normalizer(0, 2)
    items = list(range(6))
    assert shard_for_rank(items, 0, 2) == [0, 2, 4] and shard_for_rank(items, 1, 2) == [1, 3, 5]
    assert sorted(shard_for_rank(items, 0, 3) + shard_for_rank(items, 1, 3) + shard_for_rank(items, 2, 3)) == items
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_for_rank(items, 0, 4)
    with pytest.raises(ValueError, match="rank=2"):
        shard_for_rank(items, 2, 2)


def test_gradient_checkpointing_trains_the_same_step(backends):
    """TrainSettings.gradient_checkpointing recomputes activations in the backward: the same loss, gradient norm
    and updated weights as without (to float rounding), on the policy model and on the critic's backbone."""
    from teachers.critic import ValueModel

    plain = backends(worker.build_model(), TrainSettings(lr=1e-2, micro_batch_size=4))
    ckpt = backends(worker.build_model(), TrainSettings(lr=1e-2, micro_batch_size=4, gradient_checkpointing=True))
    assert ckpt.module.is_gradient_checkpointing and not plain.module.is_gradient_checkpointing and ckpt.module.training
    (loss_a, m_a), (loss_b, m_b) = _train_step(plain), _train_step(ckpt)
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and m_a["grad_norm"] == pytest.approx(m_b["grad_norm"], rel=1e-5)
    assert max_diff(state(plain.module), state(ckpt.module)) < TOL
    assert _train_step(plain)[0] == pytest.approx(_train_step(ckpt)[0], abs=1e-6)  # the next loss too
    critic = ValueModel(worker.build_model().model)
    backends(critic, TrainSettings(gradient_checkpointing=True))
    assert critic.backbone.is_gradient_checkpointing


def test_sft_in_token_budget_micro_batches_is_the_one_pass_step(backends, tiny_model_dir):
    """train_sft with `micro_batch_tokens`: each step's 6 rows (prompts and completions of different lengths) go in
    micro-batches of ≤ 40 padded positions, one `accumulate` backward each, one optimizer step: the loss is the
    token sum over the step's count, so the steps equal the one-pass steps (Adam with eps 1 updates ≈ lr·g: the
    weights compare the gradients), and so do the loss, the token accuracy and the token count."""
    from training.batching import token_budget_groups
    from training.sft import encode_pair, train_sft

    tok = load_tokenizer(tiny_model_dir)
    pairs = [("ab" * k, "c" * (7 - k)) for k in range(1, 7)]
    lengths = [len(encode_pair(tok, p, c)[0]) for p, c in pairs]
    assert len(token_budget_groups(lengths, 40)) >= 3  # several micro-batches
    s = dict(lr=1e-2, eps=1.0, grad_clip=0.0, micro_batch_size=6)
    plain = backends(load_model(tiny_model_dir), TrainSettings(**s))
    budget = backends(load_model(tiny_model_dir), TrainSettings(micro_batch_tokens=40, **s))
    init = state(plain.module)
    m_plain = train_sft(plain, tok, pairs, steps=2, batch_size=6, seed=1)
    m_budget = train_sft(budget, tok, pairs, steps=2, batch_size=6, seed=1)
    assert max_diff(init, state(plain.module)) > 1e-3  # the step moved the weights
    assert max_diff(state(plain.module), state(budget.module)) < 1e-6
    for k in ("loss", "token_acc", "tokens", "forward_tokens", "train_flops", "stepped", "lr"):
        assert m_plain[k] == pytest.approx(m_budget[k], abs=1e-6), k
