"""The engine's decode step, host side: time, CPU time, torch ops (the kernel launches of a GPU step) and ops that
would wait for a GPU, per step, at 1 and 64 running rows, on each decode path (`segments`, `static`).

Question: does a decode step's host work grow with rows (Python per row building tensors, syncs), and what does a
step cost the host on each path? On the CPU the host time includes the arithmetic (tiny models make it small);
on a GPU the static path replays a CUDA graph, so its wall time per step is the replay plus sampling.

Method: an in-process `Engine` per (path, rows) on `--device`, `--preset` model built fresh (seed 0); `rows`
greedy requests of `--prompt` tokens and `--new-tokens` new tokens each (ignore_eos), submitted together; the
engine's own counters give decode seconds and decode CPU seconds per step (`decode_seconds`, `decode_cpu_seconds`,
`steps`). A second, short run drives the engine in this thread and counts the torch ops of single decode steps
(a TorchDispatchMode: every op, shape-only ops apart) and the ops that sync a GPU (`item`/`_local_scalar_dense`,
`nonzero`, `is_nonzero`, `masked_select`).

`--check`: the static path's step issues no syncing op and the same kernel ops at 64 rows as at 1.

    python bench/decode_step.py --out bench/results/decode_step.json --check
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness  # noqa: F401  (sys.path, quiet env)
from harness import add_check, start_meta, verdict, write_outputs

SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select")
VIEW_OPS = {"view", "reshape", "alias", "select", "slice", "transpose", "unsqueeze", "squeeze", "split",
            "split_with_sizes", "chunk", "expand", "t", "permute", "as_strided", "_unsafe_view"}


def _seqs(rows: int, prompt: int, new: int, tag: str):
    from engine.protocol import SamplingSpec, SeqSpec
    from engine.scheduler import Seq

    return [Seq(SeqSpec(rid=f"{tag}{i}", input_ids=tuple([1] + [4 + (i * 7 + j) % 90 for j in range(prompt - 1)]),
                        sampling=SamplingSpec(max_new_tokens=new, temperature=0.0, ignore_eos=True)))
            for i in range(rows)]


def timed(model_dir: Path, path: str, rows: int, args) -> dict:
    from engine.scheduler import Engine

    eng = Engine(str(model_dir), max_running_requests=max(rows, 1), decode_path=path, device=args.device,
                 threads=args.threads)
    eng.start()
    assert eng.ready.wait(300), eng.load_error
    try:
        done = threading.Semaphore(0)
        warm = _seqs(rows, args.prompt, 8, "w")
        for s in warm:
            s.on_done = lambda _s: done.release()
        eng.submit(warm)
        for _ in warm:
            done.acquire()
        base = (eng.steps, eng.decode_seconds, eng.decode_cpu_seconds)
        seqs = _seqs(rows, args.prompt, args.new_tokens, "t")
        for s in seqs:
            s.on_done = lambda _s: done.release()
        t0 = time.perf_counter()
        eng.submit(seqs)
        for _ in seqs:
            done.acquire()
        wall = time.perf_counter() - t0
        steps = eng.steps - base[0]
        return {"steps": steps, "ms_per_step": round(1000 * (eng.decode_seconds - base[1]) / steps, 4),
                "cpu_ms_per_step": round(1000 * (eng.decode_cpu_seconds - base[2]) / steps, 4),
                "tokens_per_s": round(rows * args.new_tokens / wall, 1), "wall_s": round(wall, 3),
                **({"cuda_graphs_captured": eng._graphs.captured, "cuda_graph_replays": eng._graphs.replays}
                   if eng._graphs is not None else {})}
    finally:
        eng.stop()


def ops_per_step(model_dir: Path, path: str, rows: int, args, steps: int = 3) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.scheduler import Engine

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*a, **(kw or {}))

    eng = Engine(str(model_dir), max_running_requests=max(rows, 1), decode_path=path, device=args.device,
                 threads=args.threads)
    eng._load_initial()
    eng.submit(_seqs(rows, args.prompt, steps + 3, "o"))
    with torch.inference_mode():
        eng._step()  # prefill + first step
        eng._step()
        counter = Counter()
        with counter:
            for _ in range(steps):
                eng._step()
    ops = counter.ops
    kernels = sum(v for k, v in ops.items() if k not in VIEW_OPS)
    return {"ops_per_step": round(sum(ops.values()) / steps, 1), "kernel_ops_per_step": round(kernels / steps, 1),
            "sync_ops_per_step": round(sum(ops[k] for k in SYNC_OPS) / steps, 2),
            "sync_ops": {k: ops[k] // steps for k in SYNC_OPS if ops[k]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="small")
    p.add_argument("--rows", default="1,64")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--paths", default="segments,static")
    p.add_argument("--judge-path", default="static", help="the path --check judges (segments: a planted miss, its "
                   "step asks the device whether any row samples)")
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_step.json"))
    add_check(p, "the static step syncs, or issues more kernel ops at 64 rows than at 1")
    args = p.parse_args(argv)
    meta = start_meta()
    from infra.models import init_model_dir

    rows_list = [int(x) for x in args.rows.split(",")]
    result: dict = {"bench": "decode_step", "meta": meta, "device": args.device, "preset": args.preset,
                    "prompt": args.prompt, "new_tokens": args.new_tokens, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(args.preset, Path(tmp) / "m", seed=0)
        for path in args.paths.split(","):
            for rows in rows_list:
                r = timed(model_dir, path, rows, args) | ops_per_step(model_dir, path, rows, args)
                result["runs"][f"{path}/{rows}"] = r
                print(f"{path:9s} rows={rows:4d}: {r}", file=sys.stderr)
    st = [result["runs"].get(f"{args.judge_path}/{r}") for r in rows_list]
    met = None
    if all(st):
        met = all(x["sync_ops_per_step"] == 0 for x in st) and \
            st[-1]["kernel_ops_per_step"] == st[0]["kernel_ops_per_step"]
    result["target"] = {"what": f"{args.judge_path} step: 0 syncing ops, kernel ops independent of rows", "met": met}
    lines = ["| path | rows | ms/step | CPU ms/step | kernel ops/step | sync ops/step | tok/s |", "|---|---|---|---|---|---|---|"]
    for key, r in result["runs"].items():
        path, rows = key.split("/")
        lines.append(f"| {path} | {rows} | {r['ms_per_step']} | {r['cpu_ms_per_step']} | {r['kernel_ops_per_step']} | "
                     f"{r['sync_ops_per_step']} | {r['tokens_per_s']} |")
    write_outputs(args.out, result, "\n".join(lines))
    return verdict("decode_step", met, args.check)


if __name__ == "__main__":
    sys.exit(main())
