"""Benchmark: teacher scoring time per (log-prob, id) pair, SGLang JSON parsed item by item (before) vs JSON parsed
vectorised vs the binary transport (`engine.wire`).

    python bench/scoring_transport.py --out bench/results/scoring_transport.json [--repeats 5] [--quick]

Two operating points, each one embedded engine server (subprocess, one torch thread) serving a tiny-preset Llama
(vocabulary 100; its RoPE context raised to 2,048 positions so 1k-token responses fit) and one `TeacherScorer` in
this process (score batch 32, the trainer's default):
- `tiny`: the tiny preset's OPD step, 96 samples × 16-token responses (16-token prompts), top-16;
- `realistic`: the issue's example, 64 samples × 1,024-token responses (32-token prompts), top-20
  (64 · 1,024 · 21 = 1.38M pairs).
A pair is one (log-prob, id): each response token carries its sampled-token log-prob plus top-k, so a sample of L
response tokens is L · (k + 1) pairs.

Measured, per point:
1. End to end: `TeacherScorer.score(samples)` (HTTP, the server's forward and response encoding, the client's
   parse and checks, `check_scores`), wall seconds per round and the client's / server's CPU seconds, for three
   variants run in rotation `--repeats` times (median reported): `json_items` = the code before this change: a
   second server started from `git archive --before-ref` (default d0da0ed: no GC pause while it builds the JSON)
   and this client with plain `orjson.loads` and the item-by-item parser (`client.parse_score_items`, the old
   `parse_score`); `json_vectorised` = this server's JSON through `client.parse_score`; `binary` = the packed body.
   All three must hand the trainer identical arrays (checked). Also the pure compute of the same batches in-process
   (one padded forward + log_softmax + gather + top-k per score batch, one thread).
2. Client parse alone: the raw body of one score batch (captured from the server) parsed `--repeats` × 3 times by
   each path (`json_items`: orjson.loads with the GC on + parse_score_items, as at git HEAD; `json_vectorised`:
   client.loads_json (GC paused over 64 KiB) + parse_score; `binary`: wire.decode + parse_score_arrays; and
   `orjson_loads_only`: loads_json alone); the best run is reported (pure single-threaded CPU: the best run is
   the least disturbed by other jobs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, end_meta, exit_on_sigterm, start_meta, verdict  # noqa: E402
from infra.procs import pythonpath_first  # noqa: E402

VARIANTS = ("json_items", "json_vectorised", "binary")
POINTS = {"tiny": dict(samples=96, prompt_len=16, response_len=16, top_k=16),
          "realistic": dict(samples=64, prompt_len=32, response_len=1024, top_k=20)}
QUICK = {"tiny": dict(samples=24, prompt_len=16, response_len=16, top_k=16),
         "realistic": dict(samples=4, prompt_len=32, response_len=128, top_k=20)}
SCORE_BATCH = 32
BEFORE_REF = "d0da0ed"  # the last commit before the binary transport, vectorised JSON parse and GC pauses


def make_model(root: Path) -> Path:
    from infra.models import init_model_dir

    d = init_model_dir("tiny", root / "teacher", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def samples_for(p: dict, seed: int):
    import numpy as np

    from student.sampler import StudentSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(p["samples"]):
        prompt = [1] + rng.integers(4, 100, p["prompt_len"] - 1).tolist()
        resp = rng.integers(4, 100, p["response_len"]).tolist()
        out.append(StudentSample(sample_id=f"s{i}", cursor=i, domain="d", example=None, prompt_ids=prompt,
                                 output_ids=resp, rollout_logprobs=[-1.0] * len(resp), version=0, finish_reason="length"))
    return out


def pairs_of(p: dict) -> int:
    return p["samples"] * p["response_len"] * (p["top_k"] + 1)


def export_tree(ref: str, dest: Path) -> Path | None:
    """The repository at `ref` (`git archive`, read-only for this checkout) in `dest`, or None without git/ref."""
    dest.mkdir(parents=True)
    try:
        tar = subprocess.run(["git", "archive", ref], cwd=str(REPO), capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return dest


def start_server(model: Path, log: Path, tree: Path = REPO) -> tuple[subprocess.Popen, str]:
    from engine.launcher import free_port

    port = free_port()
    # the engine was `infra.engine` until the restructuring of issue 32; an exported tree runs its own copy, first
    # on PYTHONPATH (the editable install would otherwise supply this checkout's modules it lacks)
    module = "engine.server" if (tree / "engine" / "server.py").is_file() else "infra.engine.server"
    cmd = [sys.executable, "-m", module, "--model", str(model), "--port", str(port), "--threads", "1",
           "--max-total-tokens", "262144", "--max-prefill-tokens", "16384", "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath_first(tree))
    proc = subprocess.Popen(cmd, cwd=str(tree), stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def run_variant(variant: str, url: str, server_pid: int, samples, top_k: int) -> dict:
    """One scoring round of every sample through `TeacherScorer`: wall, client CPU, server CPU."""
    import orjson
    import psutil

    import engine.client as client_mod
    from engine.client import EngineClient
    from student.scoring import TeacherScorer

    fresh = [type(s)(**{**s.__dict__, "teacher_logprobs": None, "teacher_topk_ids": None,
                        "teacher_topk_logprobs": None}) for s in samples]
    client = EngineClient(url, timeout=600)
    scorer = TeacherScorer({"d": client}, top_k=top_k, batch_size=SCORE_BATCH, vocab_size=100,
                           binary=variant == "binary")
    server = psutil.Process(server_pid)
    saved = client_mod.parse_score, client_mod.loads_json
    if variant == "json_items":  # git HEAD's client: plain orjson.loads (GC on) and the item-by-item parser
        client_mod.parse_score, client_mod.loads_json = client_mod.parse_score_items, orjson.loads
    try:
        s_cpu0, c_cpu0, t0 = sum(server.cpu_times()[:2]), time.process_time(), time.perf_counter()
        good, dropped = client.run_sync(scorer.score(fresh))
        wall = time.perf_counter() - t0
        c_cpu, s_cpu = time.process_time() - c_cpu0, sum(server.cpu_times()[:2]) - s_cpu0
    finally:
        client_mod.parse_score, client_mod.loads_json = saved
    assert not dropped and len(good) == len(samples), (variant, dropped)
    return {"wall_s": wall, "client_cpu_s": c_cpu, "server_cpu_s": s_cpu, "result": good}


def compute_only(model_dir: Path, samples, top_k: int, repeats: int) -> list[float]:
    """The pure compute of the same scoring: per score batch one left-padded forward, log_softmax, the sampled
    tokens' log-probs and the top-k, in this process (one torch thread)."""
    import torch

    from infra.models import load_model

    torch.set_num_threads(1)
    model = load_model(model_dir)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(samples), SCORE_BATCH):
            batch = samples[i:i + SCORE_BATCH]
            L = max(len(s.input_ids) for s in batch)
            ids = torch.zeros((len(batch), L), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, s in enumerate(batch):
                ids[r, L - len(s.input_ids):] = torch.tensor(s.input_ids)
                mask[r, L - len(s.input_ids):] = 1
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
                R = len(batch[0].output_ids)
                logp = torch.log_softmax(logits[:, L - R - 1:L - 1].float(), dim=-1)
                logp.gather(-1, ids[:, L - R:, None]).squeeze(-1).numpy()
                torch.topk(logp, top_k, dim=-1)
        runs.append(time.perf_counter() - t0)
    return runs


def post(url: str, payload: bytes, accept: str | None) -> bytes:
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
    with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=payload, headers=headers), timeout=600) as r:
        return r.read()


def parse_times(url: str, samples, top_k: int, repeats: int) -> dict:
    """Best-of parse seconds of one score batch's raw body, per path; and the body sizes."""
    import orjson

    from engine import wire
    from engine.client import loads_json, parse_score, parse_score_arrays, parse_score_items

    batch = samples[:SCORE_BATCH]
    seqs, starts = [s.input_ids for s in batch], [len(s.prompt_ids) for s in batch]
    payload = orjson.dumps({"input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                            "return_logprob": True, "logprob_start_len": [st - 1 for st in starts],
                            "top_logprobs_num": top_k})
    raw_json, raw_bin = post(url, payload, None), post(url, payload, wire.ACCEPT)
    assert raw_bin.startswith(wire.MAGIC) and raw_json.startswith(b"[")

    def items():  # git HEAD's client: plain orjson.loads, item-by-item checks
        return [parse_score_items(o, s, st, top_k) for o, s, st in zip(orjson.loads(raw_json), seqs, starts)]

    def vectorised():
        return [parse_score(o, s, st, top_k) for o, s, st in zip(loads_json(raw_json), seqs, starts)]

    def binary():
        return [parse_score_arrays(o, a, s, st, top_k) for (o, a), s, st in zip(wire.decode(raw_bin)[1], seqs, starts)]

    def loads_only():
        return loads_json(raw_json)

    ref = items()
    for fn in (vectorised, binary):  # the three parses agree exactly before anything is timed
        for a, b in zip(ref, fn()):
            assert (a.token_logprobs == b.token_logprobs).all() and (a.topk_ids == b.topk_ids).all()
            assert (a.topk_logprobs == b.topk_logprobs).all()
    out = {"batch_sequences": len(batch), "pairs": len(batch) * len(batch[0].output_ids) * (top_k + 1),
           "body_bytes": {"json": len(raw_json), "binary": len(raw_bin)}, "runs_s": {}}
    for name, fn in (("json_items", items), ("json_vectorised", vectorised), ("binary", binary),
                     ("orjson_loads_only", loads_only)):
        runs = []
        for _ in range(max(3, repeats * 3)):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        out["runs_s"][name] = runs
    out["us_per_pair"] = {k: min(v) / out["pairs"] * 1e6 for k, v in out["runs_s"].items()}
    return out


def bench_point(name: str, p: dict, model: Path, servers: dict, repeats: int) -> dict:
    """`servers`: {variant: (url, pid)} (json_items goes to the server of the `--before-ref` tree)."""
    samples = samples_for(p, seed=len(name))
    pairs = pairs_of(p)
    url, server_pid = servers["binary"]
    run_variant("json_items", *servers["json_items"], samples, p["top_k"])  # warm-up of the before-server
    first = run_variant("binary", url, server_pid, samples, p["top_k"])  # warm-up; keep its scores for a check
    ref = {s.sample_id: s for s in first.pop("result")}
    runs = {v: [] for v in VARIANTS}
    for r in range(repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            res = run_variant(v, *servers[v], samples, p["top_k"])
            for s in res.pop("result"):  # every variant hands the trainer the very same arrays
                assert s.teacher_logprobs == ref[s.sample_id].teacher_logprobs
                assert (s.teacher_topk_ids == ref[s.sample_id].teacher_topk_ids).all()
                assert (s.teacher_topk_logprobs == ref[s.sample_id].teacher_topk_logprobs).all()
            runs[v].append(res)
    compute = compute_only(model, samples, p["top_k"], repeats)
    e2e = {}
    for v, rs in runs.items():
        med = statistics.median(x["wall_s"] for x in rs)
        e2e[v] = {"runs": rs, "wall_s_median": med, "us_per_pair": med / pairs * 1e6,
                  "client_cpu_s_median": statistics.median(x["client_cpu_s"] for x in rs),
                  "server_cpu_s_median": statistics.median(x["server_cpu_s"] for x in rs),
                  "ratio_to_compute": med / statistics.median(compute),
                  "cpu_us_per_pair": statistics.median(x["client_cpu_s"] + x["server_cpu_s"] for x in rs) / pairs * 1e6}
    return {"config": {**p, "score_batch": SCORE_BATCH, "pairs": pairs}, "e2e": e2e,
            "compute_runs_s": compute, "compute_s_median": statistics.median(compute),
            "parse": parse_times(url, samples, p["top_k"], repeats)}


def table(points: dict) -> str:
    rows = ["| point | pairs | variant | end-to-end s (median) | µs/pair end-to-end | × pure compute | client CPU s | "
            "server CPU s | CPU µs/pair (both) | client parse µs/pair | body bytes (one batch) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in points.items():
        for v in VARIANTS:
            e, pr = r["e2e"][v], r["parse"]
            body = pr["body_bytes"]["binary" if v == "binary" else "json"]
            rows.append(f"| {name} | {r['config']['pairs']:,} | {v} | {e['wall_s_median']:.3f} | {e['us_per_pair']:.3f} "
                        f"| {e['ratio_to_compute']:.2f} | {e['client_cpu_s_median']:.3f} | {e['server_cpu_s_median']:.3f} "
                        f"| {e['cpu_us_per_pair']:.3f} | {pr['us_per_pair'][v]:.3f} | {body:,} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scoring_transport.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before-ref", default=None, help="git ref whose engine server answers the json_items "
                    f"(before) variant; default {BEFORE_REF}, the commit before this transport ('' or --quick: this "
                    "checkout's server, i.e. only the client side is the old one)")
    ap.add_argument("--quick", action="store_true", help="smoke-sized points, 1 repeat (numbers mean nothing)")
    add_check(ap, None)
    args = ap.parse_args(argv)
    meta = start_meta()
    exit_on_sigterm()
    repeats = 1 if args.quick else args.repeats
    if args.before_ref is None:
        args.before_ref = "" if args.quick else BEFORE_REF
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        before_tree = export_tree(args.before_ref, Path(tmp) / "before") if args.before_ref else None
        procs = [start_server(model, Path(tmp) / "server.log")]
        if before_tree is not None:
            procs.append(start_server(model, Path(tmp) / "server_before.log", before_tree))
        try:
            from engine.client import EngineClient

            for _, url in procs:
                c = EngineClient(url)
                c.run_sync(c.wait_healthy(120))
            now, before = procs[0], procs[-1]
            servers = {"json_items": (before[1], before[0].pid), "json_vectorised": (now[1], now[0].pid),
                       "binary": (now[1], now[0].pid)}
            points = {name: bench_point(name, p, model, servers, repeats)
                      for name, p in (QUICK if args.quick else POINTS).items()}
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait()
    meta = end_meta(meta)
    cmd = "python bench/scoring_transport.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = table(points)
    headline = {name: {f"e2e_{v}": round(r["e2e"][v]["us_per_pair"], 4) for v in VARIANTS} |
                {f"cpu_{v}": round(r["e2e"][v]["cpu_us_per_pair"], 4) for v in VARIANTS} |
                {f"parse_{v}": round(r["parse"]["us_per_pair"][v], 4) for v in VARIANTS}
                for name, r in points.items()}
    out = {"bench": "scoring_transport", "quick": args.quick, "command": cmd.strip(), "meta": meta,
           "before_server": f"git {args.before_ref}" if before_tree is not None else
           f"this checkout (no --before-ref{' export: ' + args.before_ref if args.before_ref else ''}; the before "
           "variant differs in the client only)",
           "repeats": repeats, "us_per_pair": headline, "points": points, "table_md": md,
           "total_s": time.perf_counter() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".md").write_text(
        f"# scoring_transport\n\n`{out['command']}` — load average before {meta['loadavg_start']}, after "
        f"{meta['loadavg_end']}\n\n{md}")
    print(md)
    return verdict("scoring_transport", None, args.check, has_target=False)


if __name__ == "__main__":
    sys.exit(main())
