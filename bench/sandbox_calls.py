"""Benchmark: tool calls from a process that holds a trainer's memory, forked in place vs from the lean helper.

    python bench/sandbox_calls.py --out bench/results/sandbox_calls.json [--ballast-mb 0,1024] [--calls 200]
                                  [--concurrency 6] [--repeats 3] [--check]

Every tool call of an episode runs `sandbox.runner.run_tool`, which forks the caller (its `preexec_fn` rules out
vfork/posix_spawn): the fork copies the caller's page tables, so its cost grows with the caller's memory. An eval,
a PPO trainer and the student's sampler run their episodes' calls while holding torch and a model. This bench
holds `--ballast-mb` MiB of touched memory in the calling process (a stand-in for the model and optimizer; 0 = a
bare interpreter with torch imported) and runs `--calls` `cat` calls on `--concurrency` threads (the default
executor width of `asyncio.to_thread` on 2 cores is 6), two ways, alternating, `--repeats` times each:
  - direct: `run_tool` in the calling process (every call forks it);
  - pooled: `sandbox.pool.run_tool_pooled` (forked from the helper process, `python -m sandbox.pool`), as
    `domains.tools.ToolEnv` and the code verifier do.
Every call must print the file (a fast but wrong path fails the bench). Reported: calls/s (median of repeats, with
spread), and the speedup pooled / direct per ballast. Target: pooled ≥ `--target` (default 2) × direct at the
largest ballast; `--check` exits 1 when it is missed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_check, spread, start_meta, verdict, write_json  # noqa: E402


def rate(fn, workdir: str, calls: int, concurrency: int) -> float:
    """Calls per second of `fn("cat notes.txt", workdir)` on `concurrency` threads; raises on a wrong output."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(lambda _: fn("cat notes.txt", workdir), range(calls)))
    dt = time.perf_counter() - t0
    bad = [r for r in results if r.stdout != "hello\n"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {calls} calls printed the wrong output, e.g. {bad[0]}")
    return calls / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/sandbox_calls.json")
    p.add_argument("--ballast-mb", default="0,1024", help="comma-separated MiB of touched memory held by the caller")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", type=float, default=2.0, help="pooled / direct calls/s at the largest ballast")
    add_check(p, "pooled < --target x direct calls/s at the largest ballast")
    args = p.parse_args(argv)
    meta = start_meta()
    import torch  # noqa: F401  (every caller that matters has it loaded)

    from sandbox.pool import run_tool_pooled, shutdown
    from sandbox.runner import run_tool

    work = tempfile.mkdtemp(prefix="alloy-bench-sbx-")
    os.chmod(work, 0o755)
    Path(work, "notes.txt").write_text("hello\n")
    os.chmod(Path(work, "notes.txt"), 0o644)
    rows, ballast = [], []
    try:
        rate(run_tool_pooled, work, 10, args.concurrency)  # start the helper (its start-up is a one-off)
        for mb in sorted(int(x) for x in args.ballast_mb.split(",")):
            ballast = [bytearray(b"\1" * (1 << 20)) for _ in range(mb)]  # touched pages, like a loaded model
            runs: dict[str, list[float]] = {"direct": [], "pooled": []}
            for _ in range(args.repeats):
                for name, fn in (("direct", run_tool), ("pooled", run_tool_pooled)):
                    runs[name].append(rate(fn, work, args.calls, args.concurrency))
            d, q = spread(runs["direct"]), spread(runs["pooled"])
            rows.append({"ballast_mb": mb, "direct_calls_per_s": d, "pooled_calls_per_s": q,
                         "speedup": q["median"] / d["median"]})
            print(f"ballast {mb:5d} MiB: direct {d['median']:7.1f} calls/s, pooled {q['median']:7.1f} calls/s, "
                  f"x{rows[-1]['speedup']:.2f}", flush=True)
            del ballast
    finally:
        shutdown()
        shutil.rmtree(work, ignore_errors=True)
    met = rows[-1]["speedup"] >= args.target
    result = {"meta": meta, "calls": args.calls, "concurrency": args.concurrency, "repeats": args.repeats,
              "rows": rows, "target": {"pooled_over_direct": args.target, "at_ballast_mb": rows[-1]["ballast_mb"],
                                       "met": met}}
    write_json(Path(args.out), result)
    return verdict("sandbox_calls", met, args.check)


if __name__ == "__main__":
    sys.exit(main())
