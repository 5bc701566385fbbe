"""Extra memory of the OPD losses and the specialists' sampled-token log-probs at a real vocabulary, before and after
chunking (training/logprobs.py), as a multiple of the logits' bytes.

    python bench/loss_memory.py [--quick] [--device cpu|cuda] [--shapes 1x1024,4x1024] [--out PATH]

For every variant × implementation × shape, a fresh subprocess builds bf16 logits (B, T, V = 151,936, Qwen's
vocabulary) that require grad, then measures the peak memory above that point of one forward + backward:

- CPU: the Linux peak resident set size. After the logits and the batch exist, writing "5" to /proc/self/clear_refs
  resets the peak (VmHWM) to the current RSS (VmRSS); after forward + backward, VmHWM − that VmRSS is the highest
  memory the step held at once beyond what existed before. Sound because the child does nothing else, every large
  tensor is written (so resident) when it is created, torch's CPU allocator keeps no cache, and the one-time costs
  (kernel set-up, thread pools) are paid by a warm-up run of the same code on a small vocabulary before the reset.
  The child runs with MALLOC_MMAP_THRESHOLD_=1 MiB: glibc otherwise raises its mmap threshold after the first
  frees and keeps later chunk-sized blocks in its heap, so the RSS would also count freed memory (measured: the
  chunked ppo_logp_entropy at 1 × 1024 read 1.44–1.62× with the default, 1.16× with the fixed threshold).
- CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated() before.

Both include the gradient of the logits (`logits.grad`, one bf16 copy), which any implementation must produce.
Variants: `topk_kl` (`student.losses.topk_kl_loss`, top-16 + tail, forward KL), `opd_sampled_rkl` and `opd_topk_kl`
(`student.batch.opd_loss` with each registered loss; topk_kl with reward_coef 0.5, so both the top-k and the
sampled-token log-probs carry gradient), `ppo_logp_entropy` (the specialists' `_logp_and_entropy`: sampled-token
log-prob and entropy, a loss on both). `old` is the implementation before chunking, reproduced below.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, start_meta, verdict, write_json  # noqa: E402
from infra.procs import pythonpath_first  # noqa: E402

V_QWEN = 151_936
K = 16
VARIANTS = ("topk_kl", "opd_sampled_rkl", "opd_topk_kl", "ppo_logp_entropy")
# the old implementation's extra memory per variant, in logits (measured: results/loss_memory.json); a run whose
# logits + this would not fit in --mem-fraction of the available (CPU or GPU) memory is skipped, not swapped or killed
OLD_MULTIPLE = {"topk_kl": 6, "opd_sampled_rkl": 6, "opd_topk_kl": 8, "ppo_logp_entropy": 12}


# ---- the implementations before chunking (as they were in student/losses.py, student/batch.py, ppo_step.py) ----
def old_topk_kl(logits, ids, t_logp, mask, direction="forward", beta=0.5, gtc=None):
    import torch

    from student.losses import LOG_FLOOR, _kl, _token_mean, _with_tail

    B, T, V = logits.shape
    Kk = ids.shape[-1]
    valid = mask != 0
    valid_k = valid[..., None].expand(B, T, Kk)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ids = torch.where(valid_k, ids.long(), torch.arange(Kk, device=ids.device).expand(B, T, Kk))
    t_top = torch.where(valid_k, t_logp.detach().to(dtype), torch.full((), -math.log(Kk), dtype=dtype))
    z = torch.where(valid[..., None], logits.to(dtype), torch.zeros((), dtype=dtype, device=logits.device))
    s_log = _with_tail(torch.log_softmax(z, dim=-1).gather(-1, ids).clamp_min(LOG_FLOOR))
    t_log = _with_tail(t_top.clamp_min(LOG_FLOOR))
    per_tok = _kl(t_log, s_log) if direction == "forward" else _kl(s_log, t_log)
    return _token_mean(per_tok, valid, gtc)


def old_opd_loss(logits, batch, name, reward_coef):
    from student.losses import sampled_rkl_loss

    logits = logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None].to(logits.device)).squeeze(-1)
    adv = batch.reward_adv if reward_coef else None
    if name == "sampled_rkl":
        return sampled_rkl_loss(logp, batch.teacher_logp, batch.mask, rollout_logp=batch.rollout_logp,
                                reward_adv=adv, reward_coef=reward_coef, is_clip=2.0, global_token_count=None)[0]
    total = old_topk_kl(logits, batch.topk_ids, batch.topk_logp, batch.mask)
    return total + sampled_rkl_loss(logp, logp.detach(), batch.mask, rollout_logp=batch.rollout_logp, reward_adv=adv,
                                    reward_coef=reward_coef, is_clip=2.0, global_token_count=None)[0]


def old_logp_entropy(logits, input_ids):
    import torch

    from teachers.ppo_math import entropy_from_logits

    logits = logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([logp, torch.zeros_like(logp[:, :1])], dim=1), entropy_from_logits(logits)


# ---- one measurement (child process) -----------------------------------------------------------------------------
def _inputs(B, T, V, device, seed=0):
    """bf16 logits (B, T, V) with grad, filled in place row by row (no float32 temporary), and an OPD batch on
    them: every row a 1/4 prompt, the rest response, the teacher's top-16 random distinct ids."""
    import torch

    from student.batch import OPDBatch

    torch.manual_seed(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.empty(B, T, V, dtype=torch.bfloat16, device=device)
    for b in range(B):
        logits[b].normal_(0.0, 3.0)
    logits.requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T - 1)
    mask[:, T // 4:] = 1.0
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(4)])
    topk_ids = topk_ids[torch.randint(0, 4, (B * (T - 1),), generator=g)].view(B, T - 1, K)
    topk_logp = torch.log_softmax(torch.randn(B, T - 1, K, generator=g), -1) - 0.5
    parts = (ids, torch.ones_like(ids), mask, -torch.rand(B, T - 1, generator=g), -torch.rand(B, T - 1, generator=g),
             topk_ids, topk_logp, torch.randn(B, generator=g), torch.zeros(B))
    batch = OPDBatch(*(x.to(device) for x in parts), [str(b) for b in range(B)])
    return logits, batch


def _step(variant, impl, logits, batch):
    """Forward + backward of one variant."""
    import torch

    from training.logprobs import gather_log_softmax
    from student.batch import opd_loss
    from student.losses import topk_kl_loss

    dev = logits.device
    if variant == "topk_kl":
        # on the whole (B, T, V) tensor, last position masked (a slice of the logits would add SliceBackward's copy)
        pad = lambda t: torch.cat([t, t[:, :1] * 0], dim=1).to(dev)  # noqa: E731
        x, ids, tl, m = logits, pad(batch.topk_ids), pad(batch.topk_logp), pad(batch.mask)
        loss = old_topk_kl(x, ids, tl, m) if impl == "old" else topk_kl_loss(x, ids, tl, m)[0]
    elif variant.startswith("opd_"):
        name, rc = variant[4:], (0.5 if variant == "opd_topk_kl" else 0.0)
        if impl == "old":
            loss = old_opd_loss(logits, batch, name, rc)
        else:
            loss = opd_loss(logits, batch, loss=name, direction="forward", beta=0.5, reward_coef=rc, is_clip=2.0,
                            global_token_count=float(batch.mask.sum()))[0]
    else:  # ppo_logp_entropy: what ppo_update's policy loss needs from the logits
        ids = batch.input_ids.to(dev)
        if impl == "old":
            logp, ent = old_logp_entropy(logits, ids)
        else:
            tg = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1).unsqueeze(-1)
            lp, ent = gather_log_softmax(logits, tg, with_entropy=True)
            logp = torch.cat([lp[:, :-1, 0], torch.zeros_like(lp[:, :1, 0])], dim=1)
        w = torch.nn.functional.pad(batch.mask, (0, 1)).to(dev)
        loss = (logp * w).sum() / w.sum() - 0.01 * (ent * w).sum() / w.sum()
    loss.backward()
    return float(loss.detach())


def _mem_available() -> int:
    d = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return int(d["MemAvailable"].split()[0]) * 1024


def _status() -> tuple[int, int]:
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmHWM"].split()[0]) * 1024, int(d["VmRSS"].split()[0]) * 1024


def measure(variant: str, impl: str, B: int, T: int, V: int, device: str) -> dict:
    import torch

    small, sb = _inputs(1, 16, 512, device, seed=1)  # warm-up: kernels, thread pools, lazy imports
    _step(variant, impl, small, sb)
    del small, sb
    logits, batch = _inputs(B, T, V, device)
    nbytes = logits.numel() * logits.element_size()
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = _step(variant, impl, logits, batch)
        torch.cuda.synchronize()
        extra, how = torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated"
    else:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
        _, base = _status()
        loss = _step(variant, impl, logits, batch)
        extra, how = _status()[0] - base, "VmHWM after /proc/self/clear_refs"
    return {"variant": variant, "impl": impl, "B": B, "T": T, "V": V, "device": device, "loss": loss,
            "logits_bytes": nbytes, "extra_bytes": int(extra), "extra_over_logits": round(extra / nbytes, 3),
            "seconds": round(time.perf_counter() - t0, 2), "method": how}


# ---- orchestration -------------------------------------------------------------------------------------------
def run_child(variant, impl, B, T, V, device, timeout) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath_first(REPO),
           # glibc: a fixed 1 MiB mmap threshold (no dynamic raise), so every tensor ≥ 1 MiB is its own mapping, given
           # back to the OS when freed: the RSS follows the live tensors instead of malloc's retained heap
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{variant},{impl},{B},{T},{V},{device}"]
    try:
        p = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "impl": impl, "B": B, "T": T, "error": f"timed out after {timeout} s"}
    if p.returncode != 0:
        return {"variant": variant, "impl": impl, "B": B, "T": T, "error": p.stderr[-1500:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    rows = ["| variant | B × T | logits | old: extra / logits | new: extra / logits |", "|---|---|---|---|---|"]
    by = {(r["variant"], r["B"], r["T"], r["impl"]): r for r in report["runs"]}
    for (v, B, T, impl), r in by.items():
        if impl != "new":
            continue
        o = by.get((v, B, T, "old"), {})
        def fmt(x: dict) -> str:
            if "extra_bytes" in x:
                return f"{x['extra_over_logits']:.2f}× ({x['extra_bytes'] / 2**30:.2f} GiB)"
            return "skipped" if "skipped" in x else x.get("error", "-")[:40].replace("\n", " ")
        rows.append(f"| {v} | {B} × {T} | {r['logits_bytes'] / 2**30:.2f} GiB | {fmt(o)} | {fmt(r)} |")
    return (f"# Loss memory ({report['device']}, V = {report['V']})\n\n`{report['command']}`\n\n" + "\n".join(rows)
            + f"\n\nMethod: {report['method']}. Target: new ≤ {report['target']}× the logits.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small shape (1 × 256), for the test")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--shapes", default="1x1024,4x1024", help="B×T list, e.g. 1x1024,4x1024")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--vocab", type=int, default=V_QWEN)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="skip runs needing more than this share of the free memory (MemAvailable, or the GPU's)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "loss_memory.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=1.5, help="the most a chunked run's extra memory may be, in logits")
    add_check(p, "a chunked run above --target x the logits, or none measured")
    args = p.parse_args(argv)
    if args.child:
        v, impl, B, T, V, dev = args.child.split(",")
        print(json.dumps(measure(v, impl, int(B), int(T), int(V), dev)))
        return 0
    meta = start_meta()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [(1, 256)] if args.quick else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    runs = []
    avail = _mem_available() if device == "cpu" else torch.cuda.mem_get_info()[0]
    for B, T in shapes:
        for v in args.variants.split(","):
            for impl in ("old", "new"):
                need = B * T * args.vocab * 2 * (1 + (OLD_MULTIPLE[v] if impl == "old" else 2))
                if need > args.mem_fraction * avail:
                    r = {"variant": v, "impl": impl, "B": B, "T": T,
                         "skipped": f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"}
                    runs.append(r)
                    print(f"loss_memory: {v} {impl} {B}x{T}: skipped ({r['skipped']})", file=sys.stderr)
                    continue
                r = run_child(v, impl, B, T, args.vocab, device, args.timeout)
                print(f"loss_memory: {v} {impl} {B}x{T}: {r.get('extra_over_logits', r.get('error', '')[-200:])}",
                      file=sys.stderr, flush=True)
                runs.append(r)
    news = [r["extra_over_logits"] for r in runs if r["impl"] == "new" and "extra_over_logits" in r]
    report = {
        "bench": "loss_memory", "meta": meta,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": device, "V": args.vocab, "K": K,
        "method": ("peak RSS above the RSS after allocating logits + batch (/proc/self/clear_refs then VmHWM), fresh "
                   "subprocess per run, after a warm-up" if device == "cpu" else
                   "torch.cuda.max_memory_allocated above memory_allocated after allocating logits + batch, fresh "
                   "subprocess per run, after a warm-up"),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "target": args.target, "max_new_over_logits": max(news) if news else None,
        "target_met": bool(news) and max(news) <= args.target and not any("error" in r for r in runs),
        "runs": runs,
    }
    out = Path(args.out)
    write_json(out, report)
    out.with_suffix(".md").write_text(markdown(report))
    print(f"loss_memory: wrote {out}; max new/logits {report['max_new_over_logits']}", file=sys.stderr)
    return 1 if any("error" in r for r in runs) else verdict("loss_memory", report["target_met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
