"""How long an engine server takes to start, fresh (`python -m engine.server`) and forked from the zygote.

    python bench/process_start.py [--starts 4] [--out bench/results/process_start.json] [--check [--target 0.5]]

Each arm runs in its own process (`ALLOY_ZYGOTE=0` for the fresh arm, unset for the forked one), imports what the
flow process imports (`training`), and launches `--starts` servers of one tiny model one after the other through
`engine.launcher.Supervisor`, as the pipeline does: wall from launch to `/health` 200, and the CPU seconds the
server reports for itself right after (`process_cpu_seconds`: its getrusage; a forked server's counts from the
fork, which resets it). The forked arm's first start includes the
zygote's import of the engine, so the target compares the later starts: `--check` exits 1 when the median CPU of a
forked start (2nd onwards) is not below `--target` × the median of a fresh one (default 0.5). On a GPU host the
zygote is off (infra/zygote.py): the forked arm then measures fresh starts and the target is not judged (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, spread, start_meta, verdict, write_json  # noqa: E402

ARM = r'''
import json, sys, time
sys.path.insert(0, sys.argv[4])
from harness import server_cpu_s
import training  # noqa: F401  (as the flow process: DS_ACCELERATOR, TORCH_EXTENSIONS_DIR)
from engine.launcher import Supervisor, ServerSpec
model, n, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = []
with Supervisor(logs, install_signal_handlers=False) as sup:
    for i in range(n):
        t = time.monotonic()
        url = sup.start([ServerSpec(f"s{i}", model)])[f"s{i}"]
        wall = time.monotonic() - t
        out.append({"wall_s": round(wall, 3), "cpu_s": server_cpu_s([url])})
print(json.dumps(out))
'''


def run_arm(model: str, starts: int, zygote_on: bool, work: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "ALLOY_ZYGOTE"}
    if not zygote_on:
        env["ALLOY_ZYGOTE"] = "0"
    logs = work / ("forked" if zygote_on else "fresh")
    r = subprocess.run([sys.executable, "-c", ARM, model, str(starts), str(logs), str(REPO / "bench")],
                       cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"the {'forked' if zygote_on else 'fresh'} arm failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=4, help="servers launched per arm, one after the other")
    p.add_argument("--quick", action="store_true", help="2 starts per arm (the tests' smoke run)")
    p.add_argument("--model", default=None, help="HF dir to serve (default: a fresh tiny Llama)")
    p.add_argument("--target", type=float, default=0.5, help="forked CPU / fresh CPU must be below this")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "process_start.json"))
    add_check(p, "median forked start CPU >= --target x median fresh start CPU")
    args = p.parse_args(argv)
    meta = start_meta()
    starts = 2 if args.quick else args.starts
    from infra import zygote

    with tempfile.TemporaryDirectory(prefix="alloy-process-start-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from infra.models import init_model_dir

            model = str(work / "model")
            init_model_dir("tiny", model)
        t0 = time.monotonic()
        fresh = run_arm(model, starts, False, work)
        forked = run_arm(model, starts, True, work)
        wall = time.monotonic() - t0
    fresh_cpu = statistics.median(s["cpu_s"] for s in fresh)
    later = forked[1:]
    forked_cpu = statistics.median(s["cpu_s"] for s in later)
    ratio = forked_cpu / fresh_cpu if fresh_cpu > 0 else None
    judged = zygote.enabled() and ratio is not None
    met = (ratio < args.target) if judged else None
    result = {"meta": meta, "starts": starts, "model": args.model or "fresh tiny llama (infra.models preset tiny)",
              "fresh": {"starts": fresh, "wall_s": spread([s["wall_s"] for s in fresh]),
                        "cpu_s": spread([s["cpu_s"] for s in fresh])},
              "forked": {"starts": forked, "first_start": forked[0],
                         "wall_s": spread([s["wall_s"] for s in later]),
                         "cpu_s": spread([s["cpu_s"] for s in later])},
              "cpu_ratio_forked_over_fresh": ratio, "bench_wall_s": round(wall, 1),
              "target": {"what": f"median forked start CPU (2nd onwards) < {args.target} x median fresh start CPU",
                         "ratio": args.target, "met": met, "zygote_enabled": zygote.enabled()}}
    write_json(Path(args.out), result)
    print(f"fresh: wall {result['fresh']['wall_s']['median']:.2f} s, CPU {fresh_cpu:.2f} s; forked (2nd on): wall "
          f"{result['forked']['wall_s']['median']:.2f} s, CPU {forked_cpu:.2f} s; ratio "
          f"{'n/a' if ratio is None else f'{ratio:.2f}'} (target < {args.target}: {met})")
    return verdict("process_start", met, args.check)


if __name__ == "__main__":
    sys.exit(main())
