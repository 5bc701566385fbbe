"""GPU placement planner (infra/placement.py): plans derived by hand in the comments, the rules every plan keeps,
infeasible requests that name what does not fit, and what a planned process is launched with."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.config import config_from_dict
from engine.launcher import ServerSpec, build_command, launch_settings
from infra.placement import (PlacementError, Plan, Proc, estimate_params, make_plan, plan_problems, reward_server_name,
                             rollout_placement, server_launch, trainer_env, trainer_gb, visible_devices)
from preference_fixtures import tiny_reward_files

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOMAINS = [{"name": "addition"}, {"name": "reverse"}, {"name": "max_list"}]


def cfg(resources: dict, **sections):
    return config_from_dict({"domains": DOMAINS, "resources": resources, **sections})


def table(plan: Plan) -> list[tuple]:
    return [(p.stage, p.name, p.kind, p.gpus, p.mem_fraction) for p in plan.processes]


# A 1B model (model_gb 2 → 1e9 params, bf16) on 80 GB GPUs, default trainers (fp32, ZeRO-0, 1 rank):
#   server (rollout or teacher): 2 GB weights + KV max(1, 0.5·2) = 1 GB + 1 GB overhead = 4 GB = 0.05 of a GPU, tp 1
#   base trainer: 16 B/param · 1e9 = 16 GB + 4 GB overhead = 20 GB = 0.25 (fits under 0.95)
#   specialist trainer: policy 16 + critic 16 + fp32 reference (kl_coef 0.05 > 0) 4 + overhead 4 = 40 GB = 0.50
#   student trainer: 16 + 4 = 20 GB = 0.25
ONE_B = {"gpu_memory_gb": 80, "model_gb": 2}


def test_four_gpus_no_colocation():
    # base: GPU 0. specialists (max_parallel 2 of 3 domains → 2 lanes): trainers on GPUs 0 and 1, their rollout
    # servers spread over the free GPUs 2, 3 (least used first, ties to the lower id): lane-0 → 2, lane-1 → 3.
    # distill: student trainer GPU 0; free 1, 2, 3: rollout → 1 (5); teachers in domain order, each to the least
    # used free GPU: addition → 2 (1 holds 5), reverse → 3, max_list → 1 (all at 5, lowest id).
    plan = make_plan(cfg({**ONE_B}), 4)
    assert table(plan) == [
        ("base", "base", "trainer", (0,), 0.95),
        ("specialists", "lane-0", "trainer", (0,), 0.95), ("specialists", "lane-0", "rollout", (2,), 0.05),
        ("specialists", "lane-1", "trainer", (1,), 0.95), ("specialists", "lane-1", "rollout", (3,), 0.05),
        ("distill", "student", "trainer", (0,), 0.95), ("distill", "student", "rollout", (1,), 0.05),
        ("teachers", "addition", "teacher", (2,), 0.05), ("teachers", "reverse", "teacher", (3,), 0.05),
        ("teachers", "max_list", "teacher", (1,), 0.05),
    ]
    assert plan_problems(plan) == [] and plan.model_source == "resources.model_gb"


def test_two_gpus_colocated_rollout():
    # colocate_rollout: each lane is one GPU holding its trainer and its own rollout server (0.05), the trainer gets
    # the 0.95 − 0.05 = 0.90 left (its 0.50 fits). The student likewise on GPU 0; the three teachers can only go to
    # GPU 1 (the trainer's GPU is never shared with another's server): 3 × 0.05 there.
    plan = make_plan(cfg({**ONE_B, "colocate_rollout": True}), 2)
    assert table(plan) == [
        ("base", "base", "trainer", (0,), 0.95),
        ("specialists", "lane-0", "trainer", (0,), 0.90), ("specialists", "lane-0", "rollout", (0,), 0.05),
        ("specialists", "lane-1", "trainer", (1,), 0.90), ("specialists", "lane-1", "rollout", (1,), 0.05),
        ("distill", "student", "trainer", (0,), 0.90), ("distill", "student", "rollout", (0,), 0.05),
        ("teachers", "addition", "teacher", (1,), 0.05), ("teachers", "reverse", "teacher", (1,), 0.05),
        ("teachers", "max_list", "teacher", (1,), 0.05),
    ]
    assert plan_problems(plan) == []


def test_tensor_parallel_servers_on_aligned_pairs():
    # A 7B model (model_gb 14 → 7e9 params) on 8 GPUs, SGLang with sglang_args.tp_size 2:
    #   server: (14 GB + KV 7 GB) / 2 + 1 GB = 11.5 GB per GPU = 0.14375 → rounded up 0.15, on GPUs (2k, 2k+1)
    #   base: 8 ranks, ZeRO-3 bf16: 16 B / 8 = 2 B/param · 7e9 = 14 GB + 4 = 18 GB per rank: GPUs 0-7
    #   student: 4 ranks ZeRO-2 bf16: 2 + 14/4 = 5.5 B/param = 38.5 GB + 4 = 42.5 GB: GPUs 0-3
    #   specialists off. Student rollout: pairs (4,5), (6,7) both empty → (4,5). Teachers: addition → (6,7)
    #   (0 < 0.15), reverse → (4,5) (tie at 0.15, lower id), max_list → (6,7) (0.15 < 0.30).
    bf16 = {"dtype": "bf16"}
    plan = make_plan(cfg({"gpu_memory_gb": 80, "model_gb": 14},
                         engine={"backend": "sglang", "sglang_args": {"tp_size": 2}},
                         base={"train": {**bf16, "zero_stage": 3, "world_size": 8}},
                         specialists={"enabled": False},
                         distill={"train": {**bf16, "zero_stage": 2, "world_size": 4}}), 8)
    assert table(plan) == [
        ("base", "base", "trainer", tuple(range(8)), 0.95),
        ("distill", "student", "trainer", (0, 1, 2, 3), 0.95), ("distill", "student", "rollout", (4, 5), 0.15),
        ("teachers", "addition", "teacher", (6, 7), 0.15), ("teachers", "reverse", "teacher", (4, 5), 0.15),
        ("teachers", "max_list", "teacher", (6, 7), 0.15),
    ]
    assert plan_problems(plan) == []


def test_external_teachers_are_not_placed_and_no_gpus_is_an_empty_plan():
    c = cfg({**ONE_B}, teachers={"external": {"reverse": "http://t:1", "max_list": "http://t:2"}})
    assert [p.name for p in make_plan(c, 4).processes if p.kind == "teacher"] == ["addition"]
    assert make_plan(c, 0).processes == ()


def test_too_few_gpus_for_the_lanes_names_what_fits():
    # 2 GPUs, no colocation: 2 lanes need 2 trainer GPUs + at least one for the rollout servers; 1 lane fits
    # (trainer GPU 0, rollout GPU 1), and colocation would fit (0.50 + 0.05 ≤ 0.95). distill fits on 2 GPUs.
    with pytest.raises(PlacementError) as e:
        make_plan(cfg({**ONE_B}), 2)
    msg = str(e.value)
    assert "specialists: 2 lanes at once" in msg and "set specialists.max_parallel=1" in msg
    assert "resources.colocate_rollout: true" in msg and "distill" not in msg and "base" not in msg


def test_trainer_larger_than_its_share():
    # colocated, one GPU: a specialist trainer (0.50) beside its rollout server (KV 35 GB: 2 + 35 + 1 = 38 GB =
    # 0.475 → 0.48) would take 0.98 > 0.95: not even one lane fits
    with pytest.raises(PlacementError, match="not even one lane fits"):
        make_plan(cfg({**ONE_B, "colocate_rollout": True, "kv_cache_gb": 35}), 1)


def test_teacher_larger_than_a_gpu():
    # KV 200 GB: a server needs 2 + 200 + 1 = 203 GB; at the fixed tp_size 1 that is 2.54 GPUs
    c = cfg({**ONE_B, "kv_cache_gb": 200}, engine={"backend": "sglang", "sglang_args": {"tp_size": 1}})
    with pytest.raises(PlacementError) as e:
        make_plan(c, 8)
    assert "teachers: one teacher server (2.0 GB weights + 200.0 GB KV cache" in str(e.value)
    assert "larger than engine.sglang_args.tp_size=1 GPU(s) of 80 GB" in str(e.value)
    # without a fixed tp the planner takes tp 4: 203/4 + 1 = 51.75 GB = 0.65 per GPU, on aligned groups of 4
    # (GPUs 4k..4k+3): the student trainer holds GPU 0, so its rollout server gets 4-7 and the one launched
    # teacher (the others external) 8-11; GPUs 1-3 form no aligned group and stay idle
    plan = make_plan(cfg({**ONE_B, "kv_cache_gb": 200}, specialists={"enabled": False},
                         teachers={"external": {"reverse": "http://t:1", "max_list": "http://t:2"}}), 12)
    assert table(plan)[1:] == [("distill", "student", "trainer", (0,), 0.95),
                               ("distill", "student", "rollout", (4, 5, 6, 7), 0.65),
                               ("teachers", "addition", "teacher", (8, 9, 10, 11), 0.65)]


def test_plan_problems_catches_broken_plans():
    bad = Plan(4, 80, 1, "x", (Proc("s", "a", "trainer", (0,), 0.9), Proc("s", "b", "trainer", (0,), 0.05),
                                 Proc("s", "c", "teacher", (1,), 0.5), Proc("s", "d", "teacher", (1,), 0.5),
                                 Proc("s", "e", "trainer", (2,), 0.5), Proc("s", "f", "teacher", (2, 4), 0.1)))
    assert plan_problems(bad) == ["s: GPU 0 holds 2 trainers", "s: GPU 1 is 1.00 full",
                                  "s: GPU 2 holds trainer e and another's server", "s: GPU 4 does not exist (4 GPUs)"]


def test_memory_arithmetic():
    # Qwen2.5-1.5B: h 1536, 28 layers, 12 heads of 128, 2 KV heads, mlp 8960, vocab 151936, tied embeddings:
    # attention 1536·1536 + 2·1536·256 + 1536·1536 = 5,505,024; mlp 3·1536·8960 = 41,287,680;
    # 28 · 46,792,704 = 1,310,195,712 (the model card's 1.31B non-embedding) + 151936·1536 = 1,543,569,408
    qwen = {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_hidden_layers": 28,
            "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
    assert estimate_params(qwen) == 1_543_569_408
    assert estimate_params({"hidden_size": 8}) is None
    # 1e9 params, bf16, 4 ranks: z0 16 B, z1 2 + 2 + 12/4 = 7 B, z2 2 + 14/4 = 5.5 B, z3 16/4 = 4 B per param
    assert [trainer_gb(1e9, "bf16", z, 4, 1) for z in range(4)] == [16.0, 7.0, 5.5, 4.0]
    assert trainer_gb(1e9, "fp32", 2, 2, 2) == 2 * (4 + 12 / 2)


def test_model_size_from_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_hidden_layers": 10,
        "vocab_size": 1000, "torch_dtype": "float32"}))
    # 10 · (4 · 1024² + 3 · 1024 · 4096) + 2 · 1000 · 1024 = 167,772,160 + 2,048,000 params · 4 bytes
    plan = make_plan(config_from_dict({"domains": DOMAINS, "model": {"path": str(tmp_path)}}), 0)
    assert plan.model_gb == round(169_820_160 * 4 / 1e9, 3)
    with pytest.raises(PlacementError, match="set resources.model_gb"):
        make_plan(config_from_dict({"domains": DOMAINS, "model": {"path": str(tmp_path / "x")}},
                                   check_model_path=False), 1)


def test_launch_environment_and_sglang_flags():
    plan = make_plan(cfg({**ONE_B}), 4)
    visible = visible_devices("4,5,6,7", 4)  # the pipeline sees node GPUs 4-7 as plan GPUs 0-3
    env = trainer_env(plan, plan.get("specialists", "lane-1", "trainer"), visible)
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    rollout = rollout_placement(env)
    assert rollout["gpus"] == [3] and rollout["visible"] == ["4", "5", "6", "7"]
    # SGLang sees the node's devices and is pointed at plan GPU 3 by --base-gpu-id; the embedded server is confined
    assert server_launch(rollout, visible, True) == {
        "env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
        "options": {"base_gpu_id": 3, "tp_size": 1, "mem_fraction_static": 0.05}}
    # the embedded server (CPU or CUDA) gets its own GPU and its share of it, as SGLang does
    assert server_launch(rollout, visible, False) == {"env": {"CUDA_VISIBLE_DEVICES": "7"},
                                                      "options": {"mem_fraction_static": 0.05}}
    embedded = launch_settings(cfg({**ONE_B}, engine={"device": "cuda", "dtype": "bfloat16"}).engine, rollout)
    assert embedded["options"] == {"device": "cuda", "dtype": "bfloat16", "mem_fraction_static": 0.05}
    argv = build_command(ServerSpec("e", "/m", options=embedded["options"]), 1234)
    assert argv[-6:] == ["--device", "cuda", "--dtype", "bfloat16", "--mem-fraction-static", "0.05"]
    assert embedded["env"] == {"CUDA_VISIBLE_DEVICES": "7"}
    sg = cfg({**ONE_B}, engine={"backend": "sglang", "sglang_args": {"mem_fraction_static": 0.5}}).engine
    settings = launch_settings(sg, rollout)  # the plan wins over sglang_args
    argv = build_command(ServerSpec("x", "/m", backend="sglang", options=settings["options"]), 1234)
    assert argv[argv.index("--base-gpu-id") + 1] == "3" and argv[argv.index("--mem-fraction-static") + 1] == "0.05"
    assert argv[argv.index("--tp-size") + 1] == "1" and settings["env"] == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    with pytest.raises(PlacementError, match="shows 2 GPU"):
        visible_devices("0,1", 4)


def test_alloy_plan_cli(tmp_path):
    """`alloy plan configs/gpu-example.yaml --gpus 8 --json` keeps the rules; 1 GPU with 8 lanes exits 2."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "alloy.cli", "plan", "configs/gpu-example.yaml", *a],
                                    capture_output=True, text=True, cwd=REPO, timeout=120)
    out = run("--gpus", "8", "--json")
    assert out.returncode == 0, out.stderr
    procs = json.loads(out.stdout)["processes"]
    assert {tuple(sorted(p)) for p in procs} == {("gpus", "kind", "mem_fraction", "name", "stage")}
    plan = Plan(8, 80, 3.1, "", tuple(Proc(**{**p, "gpus": tuple(p["gpus"])}) for p in procs))
    assert plan_problems(plan) == [] and len(plan.trainers("specialists")) == 4
    assert len([p for p in procs if p["kind"] == "teacher"]) == 13
    bad = run("--gpus", "1", "--set", "specialists.max_parallel=8")
    assert bad.returncode == 2 and "specialists: 8 lanes at once" in bad.stderr, bad.stderr


# Shared GPUs (resources.share_gpus): a 100M model (model_gb 0.2 → 1e8 params), default trainers (fp32, ZeRO-0):
#   server: 0.2 GB + KV max(1, 0.1) = 1 GB + 1 GB = 2.2 GB = 0.0275 → 0.03
#   specialist trainer: 16 B · 1e8 = 1.6 GB × 2 (policy, critic) + 0.4 GB fp32 reference + 4 GB = 7.6 GB → 0.10
#   student trainer: 1.6 + 4 = 5.6 GB → 0.07; base: alone in its stage, 0.95
SMALL_SHARED = {"gpu_memory_gb": 80, "model_gb": 0.2, "share_gpus": True}


def test_shared_one_gpu_everything_on_gpu_0():
    # specialists: 2 lanes, trainers 0.10 each + rollouts 0.03 each = 0.26 on GPU 0; the 0.69 left is split between
    # the two trainers (0.34 each, in whole hundredths): 0.44 + 0.44 + 0.03 + 0.03 = 0.94.
    # distill: student 0.07 + its rollout 0.03 + 3 teachers 0.03 = 0.19; the student gets the 0.76 left: 0.83.
    plan = make_plan(cfg(SMALL_SHARED), 1)
    assert table(plan) == [
        ("base", "base", "trainer", (0,), 0.95),
        ("specialists", "lane-0", "trainer", (0,), 0.44), ("specialists", "lane-0", "rollout", (0,), 0.03),
        ("specialists", "lane-1", "trainer", (0,), 0.44), ("specialists", "lane-1", "rollout", (0,), 0.03),
        ("distill", "student", "trainer", (0,), 0.83), ("distill", "student", "rollout", (0,), 0.03),
        ("teachers", "addition", "teacher", (0,), 0.03), ("teachers", "reverse", "teacher", (0,), 0.03),
        ("teachers", "max_list", "teacher", (0,), 0.03),
    ]
    assert plan.shared and plan_problems(plan) == []
    # each trainer gets its GPU and its fraction; its ranks cap their allocator at it
    env = trainer_env(plan, plan.get("specialists", "lane-1", "trainer"), visible_devices("3", 1))
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["ALLOY_GPU_MEM_FRACTION"] == "0.44"
    assert rollout_placement(env)["gpus"] == [0] and rollout_placement(env)["mem_fraction"] == 0.03
    # the default (unshared) plan gives no fraction to enforce
    unshared = make_plan(cfg(ONE_B), 4)
    assert "ALLOY_GPU_MEM_FRACTION" not in trainer_env(unshared, unshared.trainers("specialists")[0], "0123")


def test_shared_spreads_before_sharing():
    # The 1B model (ONE_B) shared on 2 GPUs: specialist trainers (0.50) spread, one per GPU; rollouts to the least
    # used (tie at 0.50: GPU 0, then GPU 1); each trainer gets 0.95 − 0.55 left on its GPU: 0.90.
    # distill: student 0.25 on GPU 0, its rollout to GPU 1 (0 < 0.25), the teachers to GPU 1 too (0.05, 0.10, 0.15
    # all under 0.25); the student keeps GPU 0's rest: 0.95.
    plan = make_plan(cfg({**ONE_B, "share_gpus": True}), 2)
    assert [r for r in table(plan) if r[0] != "base"] == [
        ("specialists", "lane-0", "trainer", (0,), 0.90), ("specialists", "lane-0", "rollout", (0,), 0.05),
        ("specialists", "lane-1", "trainer", (1,), 0.90), ("specialists", "lane-1", "rollout", (1,), 0.05),
        ("distill", "student", "trainer", (0,), 0.95), ("distill", "student", "rollout", (1,), 0.05),
        ("teachers", "addition", "teacher", (1,), 0.05), ("teachers", "reverse", "teacher", (1,), 0.05),
        ("teachers", "max_list", "teacher", (1,), 0.05),
    ]
    assert plan_problems(plan) == []


def test_shared_refusals_name_what_fits():
    # 1B on one shared GPU: two specialist lanes need 2 · (0.50 + 0.05) = 1.10 > 0.95: one fits
    with pytest.raises(PlacementError) as e:
        make_plan(cfg({**ONE_B, "share_gpus": True}), 1)
    msg = str(e.value)
    assert "specialists: 2 lanes at once" in msg and "shared by memory fraction (resources.share_gpus: true)" in msg
    assert "about 40.0 GB = 0.50 of a GPU per rank" in msg and "at most 1 fit: set specialists.max_parallel=1" in msg
    assert "colocate_rollout" not in msg and "distill" not in msg
    # unshared, the same GPU fits nothing, and the refusal says sharing would fit the student with its teachers
    with pytest.raises(PlacementError) as e:
        make_plan(cfg({**ONE_B}, specialists={"enabled": False}), 1)
    assert "distill: the student does not fit on 1 GPU(s)" in str(e.value)
    assert "or set resources.share_gpus: true" in str(e.value)
    # teachers beside the student: KV 20 GB → a server of 2 + 20 + 1 = 23 GB = 0.29; student 0.25 + rollout 0.29
    # + one teacher 0.29 = 0.83; a second would make 1.12
    with pytest.raises(PlacementError) as e:
        make_plan(cfg({**ONE_B, "share_gpus": True, "kv_cache_gb": 20}, specialists={"enabled": False}), 1)
    assert ("teachers: 3 teacher servers (tp 1, mem_fraction 0.29 per GPU each) do not fit on the 1 GPU(s) of 80 GB "
            "shared by memory fraction (resources.share_gpus: true) with the student trainer (0.25 of GPUs [0]) and "
            "its rollout server (0.29): 1 fit; add GPUs, lower resources.kv_cache_gb") in str(e.value)


def test_plan_problems_in_a_shared_plan():
    # two trainers and another's server on one GPU are allowed when shared; the sum over 0.95 still is not
    procs = (Proc("s", "a", "trainer", (0,), 0.4), Proc("s", "b", "trainer", (0,), 0.4),
             Proc("s", "a", "rollout", (0,), 0.05), Proc("s", "b", "rollout", (0,), 0.05))
    assert plan_problems(Plan(1, 80, 1, "x", procs, shared=True)) == []
    assert plan_problems(Plan(1, 80, 1, "x", procs)) == ["s: GPU 0 holds 2 trainers",
                                                         "s: GPU 0 holds trainer a and another's server"]
    over = procs + (Proc("t", "c", "teacher", (0,), 0.5), Proc("s", "d", "teacher", (0,), 0.1))
    assert plan_problems(Plan(1, 80, 1, "x", over, shared=True)) == ["s: GPU 0 is 1.00 full"]


def test_fresh_preset_model_size():
    # no model.path: the preset's exact parameter count (char vocabulary) in bf16 bytes
    plan = make_plan(config_from_dict({"domains": DOMAINS, "model": {"preset": "medium"}}), 0)
    assert plan.model_gb == round(151_122_944 * 2 / 1e9, 3)
    assert plan.model_source == "model.preset medium, 151.1M params in bf16"


def test_alloy_plan_gpu_1_on_one_gpu():
    """configs/gpu-1.yaml: every trainer, rollout server and all 12 teachers on GPU 0, each stage ≤ 0.95 (on 80 and
    141 GB); more lanes than fit are refused naming the field and what fits."""
    # the run's checkpoints (~43 GB on one GPU) are checked against a budget, not this machine's disk
    env = {**os.environ, "ALLOY_STORAGE_FREE_BYTES": str(10**15)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "alloy.cli", "plan", "configs/gpu-1.yaml", "--gpus", "1",
                                     *a], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    for extra in ((), ("--set", "resources.gpu_memory_gb=141")):
        out = run("--json", *extra)
        assert out.returncode == 0, out.stderr
        procs = json.loads(out.stdout)["processes"]
        assert all(p["gpus"] == [0] for p in procs)
        kinds = {}
        for p in procs:
            kinds.setdefault((p["stage"], p["kind"]), []).append(p["name"])
        assert kinds[("base", "trainer")] == ["base"] and kinds[("distill", "trainer")] == ["student"]
        assert len(kinds[("specialists", "trainer")]) == len(kinds[("specialists", "rollout")]) == 4
        assert kinds[("distill", "rollout")] == ["student"] and len(kinds[("teachers", "teacher")]) == 12
        for stage in ("base", "specialists", ("distill", "teachers")):
            total = sum(round(p["mem_fraction"] * 100) for p in procs if p["stage"] in stage)
            assert total <= 95, (stage, total)
        plan = Plan(1, 80, 0.3, "", tuple(Proc(**{**p, "gpus": tuple(p["gpus"])}) for p in procs), shared=True)
        assert plan_problems(plan) == []
    bad = run("--set", "specialists.max_parallel=8")
    assert bad.returncode == 2
    assert "specialists: 8 lanes at once (specialists.max_parallel" in bad.stderr, bad.stderr
    assert "at most 6 fit: set specialists.max_parallel=6" in bad.stderr, bad.stderr


def test_trainer_ranks_cap_their_allocator_at_the_planned_fraction(monkeypatch):
    """training.deepspeed_backend.apply_gpu_memory_fraction (run by init_distributed, which every trainer passes
    through before it allocates): with ALLOY_GPU_MEM_FRACTION and CUDA, the rank's device (LOCAL_RANK) is capped."""
    import torch

    from training.deepspeed_backend import apply_gpu_memory_fraction

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.delenv("ALLOY_GPU_MEM_FRACTION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_gpu_memory_fraction() is None and calls == []  # not shared: nothing
    monkeypatch.setenv("ALLOY_GPU_MEM_FRACTION", "0.44")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert apply_gpu_memory_fraction() == 0.44 and calls == [(0.44, 1)]
    monkeypatch.setenv("ALLOY_GPU_MEM_FRACTION", "1.5")
    with pytest.raises(ValueError, match="ALLOY_GPU_MEM_FRACTION='1.5'"):
        apply_gpu_memory_fraction()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine: nothing
    assert apply_gpu_memory_fraction() is None and calls == [(0.44, 1)]


def _judge_dir(tmp_path) -> str:
    # 169,820,160 params in fp32 (test_model_size_from_checkpoint_config) = 0.679 GB; KV max(0.5, 0.34) = 0.5 GB;
    # + 1 GB overhead = 2.18 GB of 80 = 2.7 → 0.03 of a GPU
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_hidden_layers": 10,
        "vocab_size": 1000, "torch_dtype": "float32"}))
    return str(tmp_path)


def test_the_guards_judge_server_is_placed_beside_the_specialists(tmp_path):
    judge = {"guard": {"enabled": True, "judge_path": _judge_dir(tmp_path)}}
    # four GPUs, no colocation: the lanes' trainers hold GPUs 0 and 1 whole; the judge goes to the least used GPU
    # no trainer holds (2 and 3 both hold a rollout server at 0.05: the lower id)
    plan = make_plan(cfg({**ONE_B}, specialists=judge), 4)
    assert [r for r in table(plan) if r[2] == "judge"] == [("specialists", "judge", "judge", (2,), 0.03)]
    assert plan_problems(plan) == []
    # a judge served elsewhere, or no guard: nothing planned
    for spec in ({"guard": {**judge["guard"], "judge_url": "http://judge:30000"}}, {}):
        assert not [p for p in make_plan(cfg({**ONE_B}, specialists=spec), 4).processes if p.kind == "judge"]
    # shared mode on one GPU: beside everything, the GPU's sum still within the budget
    plan = make_plan(cfg({**ONE_B, "share_gpus": True}, specialists={**judge, "max_parallel": 1}), 1)
    assert [r[3] for r in table(plan) if r[2] == "judge"] == [(0,)] and plan_problems(plan) == []
    # every GPU holds a trainer (colocated lanes on two GPUs): refused, naming the ways out
    with pytest.raises(PlacementError, match=r"judge server .*specialists.guard.judge_url"):
        make_plan(cfg({**ONE_B, "colocate_rollout": True}, specialists=judge), 2)
    with pytest.raises(PlacementError, match="cannot size the judge at specialists.guard.judge_path"):
        make_plan(cfg({**ONE_B}, specialists={"guard": {"enabled": True, "judge_path": str(tmp_path / "none")}}), 4)


# Model-rewarded domains (issue 54): the reward servers tasks/reward_servers.py starts. The 1B model (ONE_B):
#   a reward model with `init: base`: the run's model, 2 GB + KV max(0.5, 1) = 1 GB + 1 GB = 4 GB = 0.05 of a GPU;
#   a judge of _judge_dir's checkpoint: 0.679 + 0.5 + 1 = 2.18 GB → 0.03.
@pytest.fixture()
def rewarded(tmp_path):
    """config(resources, *rewards, **sections): the domains `d0`, `d1`, ... (dataset files) rewarded by `rewards`,
    then `addition`; reward_models `pol` (init base) and `big` (init: a checkpoint dir); the judge dir."""
    rows, pairs = tiny_reward_files(tmp_path, "p{i}=")
    (tmp_path / "judge-ckpt").mkdir()
    judge = _judge_dir(tmp_path / "judge-ckpt")

    def config(resources, *rewards, reward_models=None, **sections):
        domains = [{"name": f"d{i}", "dataset": {"path": str(rows)}, "reward": r} for i, r in enumerate(rewards)]
        rms = reward_models or {"pol": {}}
        return config_from_dict({"domains": [*domains, {"name": "addition"}], "resources": resources,
                                 "reward_models": {n: {"data": str(pairs), **rm} for n, rm in rms.items()},
                                 **sections})
    config.judge = judge
    return config


RM = {"kind": "model", "reward_model": "pol"}


def judge_name(rewarded) -> str:
    return reward_server_name(SimpleNamespace(**rubric(rewarded.judge)))


def rubric(path):
    return {"kind": "judge", "model": path, "rubric": "polite?"}


def test_reward_servers_beside_the_specialists_and_through_the_distill_stage(rewarded, tmp_path, monkeypatch):
    from tasks.gpu_lanes import server_placements
    from tasks.reward_servers import reward_checkpoints

    c = rewarded({**ONE_B, "gpus_per_node": 2}, RM, rubric(rewarded.judge), specialists={"max_parallel": 1})
    # 2 GPUs, one lane: its trainer holds GPU 0, its rollout server (0.05) and both reward servers go to GPU 1, the
    # only GPU no trainer (specialist or student) holds: 0.05 + 0.05 + 0.03 = 0.13
    plan = make_plan(c, 2)
    assert [r for r in table(plan) if r[0] == "specialists"] == [
        ("specialists", "lane-0", "trainer", (0,), 0.95), ("specialists", "lane-0", "rollout", (1,), 0.05),
        ("specialists", "rm-pol", "reward", (1,), 0.05),
        ("specialists", reward_server_name(SimpleNamespace(**rubric(rewarded.judge))), "reward", (1,), 0.03)]
    # they run on through the distill stage: the student trainer on GPU 0, its rollout server and the 3 teachers
    # beside them on GPU 1: 0.08 + 0.05 + 3 · 0.05 = 0.28 there
    assert [r[3] for r in table(plan) if r[0] in ("distill", "teachers")] == [(0,), (1,), (1,), (1,), (1,)]
    assert plan_problems(plan) == []
    # the names are the servers' own (tasks/reward_servers.py), which the launcher looks its placement up by
    served = reward_checkpoints(c, {"pol": {"local_dir": str(tmp_path / "rm-final")}})
    assert sorted(name for name, _ in served.values()) == sorted(p.name for p in plan.processes if p.kind == "reward")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    placed = server_placements(c, "reward")
    assert placed["rm-pol"] == {"visible": ["0", "1"], "stage": "specialists", "name": "rm-pol", "kind": "reward",
                                "gpus": [1], "mem_fraction": 0.05}


def test_two_judge_directories_of_one_folder_name_get_two_servers(tmp_path):
    a, b = tmp_path / "a" / "judge", tmp_path / "b" / "judge"
    names = {reward_server_name(SimpleNamespace(**rubric(str(p)))) for p in (a, b)}
    assert len(names) == 2 and all(n.startswith("judge-judge-") for n in names)
    # one directory, however it is written, is one server
    assert reward_server_name(SimpleNamespace(**rubric(str(a)))) == reward_server_name(
        SimpleNamespace(**rubric(str(tmp_path / "a" / ".." / "a" / "judge"))))
    assert reward_server_name(SimpleNamespace(kind="model", reward_model="pol")) == "rm-pol"


def test_reward_servers_in_the_shared_mode(rewarded):
    # one shared GPU, one lane: trainer 0.50 + rollout 0.05 + reward model 0.05 + judge 0.03 = 0.63; the trainer
    # gets the 0.32 left: 0.82. distill: student 0.25 + rollout 0.05 + 3 teachers 0.15 + the reward servers still
    # running 0.08 = 0.53; the student gets the 0.42 left: 0.67, and the GPU's sum is 0.95
    c = rewarded({**ONE_B, "share_gpus": True}, RM, rubric(rewarded.judge), specialists={"max_parallel": 1})
    plan = make_plan(c, 1)
    assert plan.get("specialists", "lane-0", "trainer").mem_fraction == 0.82
    assert [(p.name, p.gpus, p.mem_fraction) for p in plan.processes if p.kind == "reward"] == [
        ("rm-pol", (0,), 0.05), (judge_name(rewarded), (0,), 0.03)]
    assert plan.get("distill", "student", "trainer").mem_fraction == 0.67 and plan_problems(plan) == []


def test_external_served_and_shared_reward_servers(rewarded):
    plan = lambda *rewards, **kw: [(p.name, p.gpus) for p in make_plan(rewarded({**ONE_B}, *rewards, **kw), 4)
                                   .processes if p.kind == "reward"]
    # an external url: nothing to serve
    assert plan({"kind": "model", "url": "http://rm:30000"},
                {"kind": "judge", "url": "http://judge:30000", "rubric": "polite?"}) == []
    # two domains naming one reward model, two naming one judge dir: one server each. 4 GPUs, lanes on 0 and 1,
    # rollout servers on 2 and 3 (0.05 each): the reward model to 2, the judge to 3 (2 now holds 0.10)
    assert plan(RM, RM, rubric(rewarded.judge), rubric(rewarded.judge + "/")) == [
        ("rm-pol", (2,)), (judge_name(rewarded), (3,))]
    # the pipeline's served_url (set for its workers) changes nothing: the workers plan the GPUs the flow planned
    assert plan({**RM, "served_url": "http://127.0.0.1:5"}) == plan(RM) == [("rm-pol", (2,))]
    # specialists off: the servers still run (evaluations, distill stage), off the student trainer's GPU 0
    assert plan(RM, specialists={"enabled": False}) == [("rm-pol", (1,))]


def test_reward_servers_that_do_not_fit(rewarded, tmp_path):
    # colocated lanes hold both GPUs: no GPU is left for the reward model
    with pytest.raises(PlacementError) as e:
        make_plan(rewarded({**ONE_B, "colocate_rollout": True}, RM), 2)
    assert ("specialists: the reward server rm-pol (2.0 GB weights + 1.0 GB KV cache = 0.05 of a 80 GB GPU) does "
            "not fit on the 0 GPU(s) no specialist or student trainer holds beside the specialists' lanes: lower "
            "specialists.max_parallel, set resources.share_gpus: true, or serve it elsewhere (domains.0.reward.url)"
            ) in str(e.value)
    # a judge larger than a GPU: 80 layers · (4·8192² ... ) ≈ 69B params in bf16 = 138 GB
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({
        "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "vocab_size": 128256, "torch_dtype": "bfloat16"}))
    with pytest.raises(PlacementError, match=r"the reward server judge-big-[0-9a-f]{8} \(141\.1 GB weights .* serve it "
                                             r"elsewhere \(domains\.1\.reward\.url\)"):
        make_plan(rewarded({**ONE_B}, RM, rubric(str(big))), 4)
    # a reward model from a checkpoint dir that is not there: the field that names it
    with pytest.raises(PlacementError, match=r"cannot size the reward server rm-pol at reward_models\.pol\.init="):
        make_plan(rewarded({**ONE_B}, RM, reward_models={"pol": {"init": str(tmp_path / "none")}}), 4)


def test_plan_problems_counts_the_reward_servers_in_the_distill_stage():
    procs = (Proc("specialists", "rm-a", "reward", (1,), 0.5), Proc("distill", "student", "trainer", (0,), 0.95),
             Proc("teachers", "t", "teacher", (1,), 0.5), Proc("distill", "student", "rollout", (2,), 0.05),
             Proc("specialists", "rm-b", "reward", (0,), 0.05))
    assert plan_problems(Plan(3, 80, 1, "x", procs)) == [
        "distill: GPU 0 is 1.00 full", "distill: GPU 0 holds trainer student and another's server",
        "distill: GPU 1 is 1.00 full"]
