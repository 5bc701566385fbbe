"""Benchmark: APRIL partial rollouts vs the synchronous rollout, at equal batch size, on a long-tail workload.

    python bench/april.py --out bench/results/april.json [--batch 32] [--over-sampling 1.25,1.5,2.0] [--steps 30]
        [--warmup 10] [--repeats 2] [--max-staleness 64] [--bounded-staleness 2] [--quick]

Workload. A seeded stream of prompts (8–16 random character ids after BOS); prompt i has a *natural response
length* L_i drawn once from a heavy-tailed mixture: with probability 1 − p_tail (0.9) L ~ U{8..32}, else L is
log-uniform on [64, 512]. Both arms consume the same stream (prompt i, length L_i). Lengths are realised
honestly on a real engine: every request is sent with `ignore_eos` and `max_new_tokens` = the sample's remaining
budget (L_i minus the tokens it already has), so a sample finishes exactly when it has L_i tokens, having paid
for every token by decoding it (the bench checks each finished sample: `len(output_ids) == L_i`, finish "length").

Demo workload (`--workload demo`, issue 21): what `make demo`'s specialists roll out. For each domain of
configs/demo.yaml (at its difficulty) a `DemoCursor` cycles that domain's train prompts (the char tokenizer, BOS
first) and gives sample i the natural length min(len(answer tokens) + 1, 16): the answer and EOS, the length a
policy that answers in the expected format produces, cut at the demo's 16-token budget (the eval budget). Realised
as above (`ignore_eos`, budget = natural length). B = 64 (`specialists.batch_size`), max_staleness 2 (the
pipeline's `specialists.max_staleness`) in every APRIL arm; arms: sync, `april` (1.25, min_extra 4: the defaults)
and `april_os<x>` for `--demo-over-sampling`. A specialist trains one domain, so each domain runs on its own
(`--demo-steps` measured steps after `--demo-warmup`, every arm, arms rotated per repeat) and an arm's samples/s
pools all domains and repeats (Σ finished / Σ wall). `demo.best_arm` is the arm with the most finished samples/s.
At B = 64 `min_extra_requests` = 4 never binds (⌈1.05 · 64⌉ = 68 already): it matters only below B = 16.

Server. One embedded engine server (`python -m engine.server`, one torch thread, defaults otherwise: max
256 running sequences, so a step's ⌈1.25 B⌉ requests all run at once up to B = 204) on loopback serving the
`tiny` preset (`init_model_dir("tiny", dir, seed=0)`, with `max_position_embeddings` raised from 256 to 1024 in
its config so a 512-token sample fits; RoPE has no position weights, so no weight changes), shared by all arms;
sampling at temperature 1.

Arms — all run the real rollout code, `teachers.rollout.rollout_step` with a `Roller` (one `/generate` per
request, aborts through `/abort_request`), an `AprilBuffer`, and `plan_requests` / `collect_batch` /
`merge_continuation` inside it; the only differences are `over_sampling` and `max_staleness`:
- `sync` (baseline): over_sampling = 1.0. `plan_requests` asks for exactly B requests, `collect_batch` waits for
  all B (the B-th finished is the last one), nothing is ever aborted, the buffer stays empty: the classic
  synchronous rollout.
- `april`: over_sampling = the first `--over-sampling` (1.25, the pipeline's default `specialists.over_sampling`):
  max(⌈1.25 B⌉, B + 4) requests (`specialists.min_extra_requests` = 4, the pipeline's default, binds below B = 16),
  resumed partials first, stop at B finished, abort the rest, keep them as partials and resume
  them next step with the remaining budget. `max_staleness` = 64, larger than any sample's age here, so nothing
  is dropped and every long sample is eventually finished (its staleness is reported instead). This arm is the
  target's. `april_os<x>`: the same at the other over-samplings (1.5, 2.0).
- `april_s2` (context, not the target): the `april` arm with the config default `max_staleness` = 2: long samples
  age out and are dropped (counted, and their decoded tokens counted as wasted), so its finished samples skew short.

Adapters (in this file, not in `teachers/`): `LongTailCursor` is a `PromptCursor` whose fresh `Partial`s get
their natural length as budget; `FixedLengthClient` is the `EngineClient` with `ignore_eos=True` forced and stop
ids dropped (the `Roller` asks to stop at EOS; this workload's lengths are set by the budget instead).
The policy version is the step index (one optimizer step per rollout step; no weights are pushed, since
throughput does not depend on the weights' values), so resumed tokens age by one version per step.

Short steps. `rollout_step` returns fewer than B samples only if requests are aborted before B finished. Before
2026-11-25 that happened: `Roller.abort_all` aborts every request on the server, and when the step's last pending
requests finished on their own before the engine thread applied that abort, the abort stayed queued and hit the
next step's fresh requests. The engine now applies an abort only to requests submitted before it (as SGLang's
in-order scheduler does), so `short_steps` should be 0; it is still counted and kept in the measurement.

Measure. Each arm runs `--warmup` steps (dropped: the APRIL buffer fills to its steady state) then `--steps`
measured steps; same number of steps per arm, each step yields ≥ B finished samples (short steps aside).
Finished samples/s = samples finished in the measured steps / wall time of those `rollout_step` calls.
Also: samples/s counting at most B per step (`capped`), finished tokens/s (tokens of finished samples), engine
tokens/s (every token the engine decoded, including those of partials), input tokens the engine had to prefill
per finished sample (a resumed partial re-sends its prompt + output so far), the engine's own decode counters
(`/get_server_info`: decode forwards, rows per forward (and how many of them were finished rows not yet
compacted away, and the running batch's segments), ms per forward, their share of the wall time),
CPU seconds (the bench's own `getrusage` + the server's `process_cpu_seconds`), the buffer's tokens at the window's
start and end (a growing buffer would mean APRIL deferred work out of the window), the length distribution of the
finished samples, and the staleness of finished samples: versions behind = finishing version − version of their
oldest token, and the fraction of their tokens sampled by an older version. Arms run `--repeats` times in rotated
order (the shared machine's load drifts); the target ratio pools all repeats per B: (Σ finished / Σ wall) of
`april` over the same of `sync`. Target (issue 4): ≥ 1.5; `--check` exits 1 when it is missed at some B.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, exit_on_sigterm, own_cpu_s, start_meta, verdict, write_outputs  # noqa: E402

from infra.config import SpecialistsConfig  # noqa: E402
from infra.choices import MAX_RUNNING_REQUESTS  # noqa: E402
from engine.client import EngineClient  # noqa: E402
from teachers.april import AprilBuffer, Partial, plan_requests  # noqa: E402
from teachers.rollout import Roller, rollout_step  # noqa: E402

TARGET = 1.5
# APRIL arms over-provision at least this many requests beyond B (the pipeline's default; sync ignores it)
MIN_EXTRA = SpecialistsConfig.model_fields["min_extra_requests"].default
CONTEXT = 1024
DOMAIN = "longtail"


class LongTailCursor:
    """`PromptCursor` stand-in: prompt i (random ids after BOS) with natural length L_i from the seeded mixture
    body U{lo..hi} w.p. 1 − p_tail, tail log-uniform on [tlo, thi]. The i-th draw never depends on how prompts
    are taken, so every arm sees the same stream. Ids are `longtail-<i>` (as `PromptCursor`)."""

    def __init__(self, seed: int, body: tuple[int, int], tail: tuple[int, int], p_tail: float, bos: int = 1):
        self.rng, self.body, self.tail, self.p_tail, self.bos = random.Random(seed), body, tail, p_tail, bos
        self.cursor = 0
        self.lengths: list[int] = []
        self.prompts: list[list[int]] = []

    def natural_length(self, i: int) -> int:
        while len(self.lengths) <= i:
            if self.rng.random() < self.p_tail:
                lo, hi = self.tail
                n = int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))
            else:
                n = self.rng.randint(*self.body)
            self.lengths.append(n)
            self.prompts.append([self.bos] + [self.rng.randrange(5, 100) for _ in range(self.rng.randint(8, 16))])
        return self.lengths[i]

    def take(self, k: int, max_new_tokens: int, version: int) -> list[Partial]:
        out = []
        for _ in range(k):
            i = self.cursor
            n = min(self.natural_length(i), max_new_tokens)
            out.append(Partial.fresh(f"{DOMAIN}-{i:08d}", self.prompts[i], DOMAIN, {"natural_len": n}, n, version))
            self.cursor += 1
        return out


class FixedLengthClient(EngineClient):
    """The engine client with `ignore_eos=True` and no stop ids on every generation, so a request decodes exactly
    its `max_new_tokens` (unless aborted). Counts the tokens the engine returned (`decoded`) and the input tokens
    it had to prefill (`prefilled`: the prompt, plus the output so far for a resumed partial)."""

    decoded = prefilled = 0

    async def generate(self, input_ids, **kw):
        self.prefilled += sum(len(ids) for ids in input_ids)
        gens = await super().generate(input_ids, **{**kw, "ignore_eos": True, "stop_token_ids": None})
        self.decoded += sum(len(g.output_ids) for g in gens)
        return gens


async def engine_stats(client: EngineClient) -> dict:
    """The server's cumulative decode counters (`/get_server_info`)."""
    info = await client.request("GET", "/get_server_info")
    return {k: info[k] for k in ("decode_steps", "decode_rows", "decode_seconds", "engine_cpu_seconds",
                                        "bucketed_decode_steps", "prefill_forwards", "prefill_tokens",
                                        "prefill_padded_tokens", "prefill_seconds", "idle_seconds",
                                        "decode_segments", "decode_holes", "process_cpu_seconds")}


def engine_delta(a: dict, b: dict, wall: float) -> dict:
    """Decode steps (one forward for all running rows), mean rows per step, ms per step, and the share of the
    window's wall time spent in decode forwards (the rest: prefill, HTTP, scheduling, client side)."""
    d = {k: b[k] - a[k] for k in a}
    steps = max(d["decode_steps"], 1)
    return {"decode_steps": d["decode_steps"], "rows_per_decode_step": round(d["decode_rows"] / steps, 2),
            "holes_per_step": round(d["decode_holes"] / steps, 2),
            "segments_per_step": round(d["decode_segments"] / steps, 2),
            "ms_per_decode_step": round(1000 * d["decode_seconds"] / steps, 3),
            "decode_s": round(d["decode_seconds"], 3), "decode_share_of_wall": round(d["decode_seconds"] / wall, 3),
            "bucketed_share": round(d["bucketed_decode_steps"] / steps, 3),
            "prefill_forwards": d["prefill_forwards"], "prefill_s": round(d["prefill_seconds"], 3),
            "prefill_share_of_wall": round(d["prefill_seconds"] / wall, 3),
            "prefill_padding_frac": round(1 - d["prefill_tokens"] / max(d["prefill_padded_tokens"], 1), 3),
            "engine_cpu_s": round(d["engine_cpu_seconds"], 3), "idle_s": round(d["idle_seconds"], 3),
            "idle_share_of_wall": round(d["idle_seconds"] / wall, 3)}


def buffered_tokens(buffer: AprilBuffer) -> int:
    return sum(len(p["output_ids"]) for p in buffer.state_dict()["partials"])


def dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"n": len(s), "mean": round(statistics.fmean(s), 2), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": s[-1], "min": s[0]}


class DemoCursor:
    """`PromptCursor` stand-in for one demo domain: its train prompts in order, cycled; sample i's budget is its
    natural length min(len(answer tokens) + 1, max_new_tokens) (see the module docstring)."""

    def __init__(self, name: str, difficulty: int, tokenizer, max_new_tokens: int, n: int = 2000, seed: int = 0):
        from domains.registry import load_domain

        self.name, self.cursor = name, 0
        exs = load_domain(name, difficulty=difficulty).split("train", n, seed)
        enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        self.pool = [([tokenizer.bos_token_id] + enc(e.prompt), min(len(enc(e.answer)) + 1, max_new_tokens))
                     for e in exs]

    def take(self, k: int, max_new_tokens: int, version: int) -> list[Partial]:
        out = []
        for _ in range(k):
            ids, n = self.pool[self.cursor % len(self.pool)]
            n = min(n, max_new_tokens)
            out.append(Partial.fresh(f"{self.name}-{self.cursor:08d}", ids, self.name, {"natural_len": n}, n, version))
            self.cursor += 1
        return out


def demo_domains(config: str = "demo.yaml") -> list[tuple[str, int]]:
    """(name, difficulty) of every domain of configs/demo.yaml (or another of configs/)."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    return [(d["name"], int(d.get("difficulty", 1))) for d in cfg["domains"]]


async def run_arm(url: str, tokenizer, *, name: str, batch: int, over_sampling: float, max_staleness: int,
                  steps: int, warmup: int, make_cursor, max_new_tokens: int, min_extra: int = 0,
                  domain: str = DOMAIN) -> dict:
    """`warmup + steps` calls of `rollout_step` on a fresh `make_cursor()`; statistics over the last `steps`."""
    client = FixedLengthClient(url, timeout=600.0)
    roller = Roller(client, SimpleNamespace(name=domain), tokenizer, temperature=1.0)
    buffer, cursor = AprilBuffer(max_staleness), make_cursor()
    per_step, finished_lens, behind, old_tokens, all_tokens = [], [], [], 0, 0
    dropped_tokens = wall = 0.0
    try:
        for version in range(warmup + steps):
            measured = version >= warmup
            if version == warmup:
                buf_start, cpu0, eng0 = buffered_tokens(buffer), own_cpu_s(), await engine_stats(client)
            # rollout_step starts with this same call; made here first to count the dropped partials' tokens
            stale = buffer.drop_stale(version)
            dec0, pre0 = client.decoded, client.prefilled
            t0 = time.perf_counter()
            samples, c = await rollout_step(roller, buffer, cursor, batch_size=batch, over_sampling=over_sampling,
                                            max_new_tokens=max_new_tokens, version=version, min_extra=min_extra)
            dt = time.perf_counter() - t0
            for s in samples:  # the workload is realised honestly: each sample decoded exactly its natural length
                if s.finish_reason != "length" or len(s.output_ids) != s.example["natural_len"]:
                    raise AssertionError(f"{name}: sample {s.sample_id} finished {s.finish_reason!r} with "
                                         f"{len(s.output_ids)} tokens, natural length {s.example['natural_len']}")
            step = {"step": version, "wall_s": round(dt, 6), **c, "dropped_stale": len(stale),
                    "engine_tokens": client.decoded - dec0, "prefill_tokens": client.prefilled - pre0,
                    "finished_tokens": sum(len(s.output_ids) for s in samples)}
            per_step.append(step)
            if measured:
                wall += dt
                dropped_tokens += sum(len(p.output_ids) for p in stale)
                for s in samples:
                    finished_lens.append(len(s.output_ids))
                    behind.append(version - min(s.token_versions))
                    old_tokens += sum(v < version for v in s.token_versions)
                    all_tokens += len(s.token_versions)
        cpu1, eng1 = own_cpu_s(), await engine_stats(client)
        cpu_s = cpu1 - cpu0 + eng1["process_cpu_seconds"] - eng0["process_cpu_seconds"]  # this process + server
    finally:
        await client.aclose()
    m = per_step[warmup:]
    fin = sum(x["finished"] for x in m)
    capped = sum(min(x["finished"], batch) for x in m)
    return {
        "arm": name, "over_sampling": over_sampling, "max_staleness": max_staleness, "measured_steps": len(m),
        "wall_s": round(wall, 6), "cpu_s": round(cpu_s, 3), "finished": fin, "finished_capped": capped,
        "samples_per_s": round(fin / wall, 3), "capped_samples_per_s": round(capped / wall, 3),
        "finished_tokens_per_s": round(sum(x["finished_tokens"] for x in m) / wall, 1),
        "engine_tokens_per_s": round(sum(x["engine_tokens"] for x in m) / wall, 1),
        "prefill_tokens_per_sample": round(sum(x["prefill_tokens"] for x in m) / fin, 2),
        "cpu_s_per_sample": round(cpu_s / fin, 5), "step_s": dist([x["wall_s"] for x in m]),
        "engine": engine_delta(eng0, eng1, wall),
        "requests_per_step": round(statistics.fmean(x["requests"] for x in m), 2),
        "resumed": sum(x["resumed"] for x in m), "dropped_stale": sum(x["dropped_stale"] for x in m),
        "short_steps": sum(x["finished"] < batch for x in m),  # see the note on abort_all in the module docstring
        "dropped_tokens": int(dropped_tokens), "buffer_tokens_start": buf_start,
        "buffer_tokens_end": buffered_tokens(buffer), "buffer_partials_end": len(buffer),
        "finished_length": dist(finished_lens),
        "staleness": {"versions_behind": dict(sorted(Counter(behind).items())),
                      "mean": round(statistics.fmean(behind), 3),
                      "max": max(behind), "resumed_samples": sum(b > 0 for b in behind),
                      "offpolicy_token_frac": round(old_tokens / max(all_tokens, 1), 4)},
        "steps": per_step,
    }


def pooled(runs: list[dict], key: str = "finished") -> float:
    return sum(r[key] for r in runs) / sum(r["wall_s"] for r in runs)


def summarize(runs: list[dict]) -> dict:
    """Per (batch, arm): pooled over repeats (Σ count / Σ wall); ratio to the same batch's `sync`."""
    out: dict = {}
    for b in dict.fromkeys(r["batch"] for r in runs):
        base = pooled([r for r in runs if r["batch"] == b and r["arm"] == "sync"])
        for arm in dict.fromkeys(r["arm"] for r in runs if r["batch"] == b):
            rs = [r for r in runs if r["batch"] == b and r["arm"] == arm]
            fin, wall = sum(r["finished"] for r in rs), sum(r["wall_s"] for r in rs)
            steps = sum(r["engine"]["decode_steps"] for r in rs)
            out.setdefault(str(b), {})[arm] = {
                "over_sampling": rs[0]["over_sampling"], "max_staleness": rs[0]["max_staleness"],
                "samples_per_s": fin / wall, "capped_samples_per_s": pooled(rs, "finished_capped"),
                "finished_tokens_per_s": sum(r["finished_tokens_per_s"] * r["wall_s"] for r in rs) / wall,
                "engine_tokens_per_s": sum(r["engine_tokens_per_s"] * r["wall_s"] for r in rs) / wall,
                "mean_step_s": wall / sum(r["measured_steps"] for r in rs),
                "mean_finished_len": sum(r["finished_length"]["mean"] * r["finished"] for r in rs) / fin,
                "cpu_s_per_sample": sum(r["cpu_s"] for r in rs) / fin,
                "decode_steps_per_sample": steps / fin,
                "prefill_tokens_per_sample": sum(r["prefill_tokens_per_sample"] * r["finished"] for r in rs) / fin,
                "rows_per_decode_step": sum(r["engine"]["rows_per_decode_step"] * r["engine"]["decode_steps"]
                                            for r in rs) / max(steps, 1),
                "ms_per_decode_step": 1000 * sum(r["engine"]["decode_s"] for r in rs) / max(steps, 1),
                "decode_share_of_wall": sum(r["engine"]["decode_s"] for r in rs) / wall,
                "dropped_stale": sum(r["dropped_stale"] for r in rs), "short_steps": sum(r["short_steps"] for r in rs),
                "mean_behind": sum(r["staleness"]["mean"] * r["finished"] for r in rs) / fin,
                "max_behind": max(r["staleness"]["max"] for r in rs), "ratio_to_sync": fin / wall / base,
                "finished_tokens_ratio_to_sync": None, "per_repeat_samples_per_s": [r["samples_per_s"] for r in rs]}
        sync_tok = out[str(b)]["sync"]["finished_tokens_per_s"]
        for v in out[str(b)].values():
            v["finished_tokens_ratio_to_sync"] = v["finished_tokens_per_s"] / sync_tok
    return out


def table(summary: dict) -> str:
    rows = ["| B | arm | over-sampling | max_staleness | finished samples/s | ≤ B/step samples/s | finished tok/s "
            "| engine tok/s | mean step (s) | mean finished len | decode steps / sample | rows / decode step "
            "| ms / decode step | prefilled tokens / sample | CPU ms/sample "
            "| dropped stale | short steps | versions behind mean / max | samples/s ratio to sync "
            "| finished tok/s ratio |",
            "|" + "---|" * 20]
    for b, arms in summary.items():
        for arm, s in arms.items():
            ms = "—" if arm == "sync" else s["max_staleness"]
            rows.append(
                f"| {b} | {arm} | {s['over_sampling']} | {ms} | {s['samples_per_s']:.1f} "
                f"| {s['capped_samples_per_s']:.1f} "
                f"| {s['finished_tokens_per_s']:.0f} | {s['engine_tokens_per_s']:.0f} | {s['mean_step_s']:.3f} "
                f"| {s['mean_finished_len']:.1f} | {s['decode_steps_per_sample']:.2f} "
                f"| {s['rows_per_decode_step']:.1f} "
                f"| {s['ms_per_decode_step']:.2f} | {s['prefill_tokens_per_sample']:.0f} "
                f"| {1000 * s['cpu_s_per_sample']:.2f} | {s['dropped_stale']} | {s['short_steps']} "
                f"| {s['mean_behind']:.2f} / {s['max_behind']} "
                f"| **{s['ratio_to_sync']:.2f}** | {s['finished_tokens_ratio_to_sync']:.2f} |")
    return "\n".join(rows)


def run_demo(url: str, tok, args, quick: bool = False) -> dict:
    """The demo workload (module docstring): every demo domain on its own, every arm, arms rotated per repeat;
    summaries pool all domains and repeats per arm."""
    B, L = args.demo_batch, 16
    ms = SpecialistsConfig.model_fields["max_staleness"].default
    default_os = SpecialistsConfig.model_fields["over_sampling"].default
    arms = [("sync", 1.0), ("april", default_os)]
    arms += [(f"april_os{float(x):g}", float(x)) for x in str(args.demo_over_sampling).split(",") if x]
    domains = demo_domains()[:2] if quick else demo_domains()
    runs = []
    for rep in range(args.repeats):
        for i, (d, diff) in enumerate(domains):
            k = (rep + i) % len(arms)
            for name, os_ in arms[k:] + arms[:k]:
                r = asyncio.run(run_arm(url, tok, name=name, batch=B, over_sampling=os_, max_staleness=ms,
                                        min_extra=MIN_EXTRA, steps=args.demo_steps, warmup=args.demo_warmup,
                                        max_new_tokens=L, domain=d,
                                        make_cursor=lambda d=d, diff=diff: DemoCursor(d, diff, tok, L,
                                                                                       n=args.demo_prompts)))
                r.pop("steps")  # per-step records of 12 domains x arms: the summaries keep what matters
                runs.append({"repeat": rep, "batch": B, "domain": d, **r})
        print(f"demo repeat {rep}: " + ", ".join(f"{a} {pooled([r for r in runs if r['arm'] == a]):.0f}/s"
                                                 for a, _ in arms), flush=True)
    summary = summarize(runs)[str(B)]
    per_domain = {d: {a: round(pooled([r for r in runs if r["domain"] == d and r["arm"] == a]), 1) for a, _ in arms}
                  for d, _ in domains}
    best = max(summary, key=lambda a: summary[a]["samples_per_s"])
    return {"batch": B, "max_new_tokens": L, "max_staleness": ms, "min_extra_requests": MIN_EXTRA,
            "domains": [{"name": d, "difficulty": x} for d, x in domains],
            "arms": [{"arm": a, "over_sampling": o, "requests_per_step": plan_requests(B, o, 0, MIN_EXTRA)[1]}
                     for a, o in arms],
            "summary": {a: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()}
                        for a, x in summary.items()},
            "ratio_to_sync": {a: round(x["ratio_to_sync"], 3) for a, x in summary.items()},
            "samples_per_s_by_domain": per_domain, "best_arm": best,
            "best_over_sampling": summary[best]["over_sampling"], "runs": runs}


def demo_table(demo: dict) -> str:
    head = (f"Demo workload (B = {demo['batch']}, ≤ {demo['max_new_tokens']} tokens, {len(demo['domains'])} domains,"
            f" max_staleness {demo['max_staleness']}): best arm **{demo['best_arm']}** "
            f"(over-sampling {demo['best_over_sampling']}).\n\n")
    rows = ["| arm | over-sampling | requests/step | finished samples/s | ratio to sync | mean finished len | "
            "decode steps / sample | CPU ms/sample | dropped stale |", "|" + "---|" * 9]
    req = {a["arm"]: a["requests_per_step"] for a in demo["arms"]}
    for a, s in demo["summary"].items():
        rows.append(f"| {a} | {s['over_sampling']} | {req[a]} | {s['samples_per_s']:.1f} | "
                    f"**{s['ratio_to_sync']:.2f}** | {s['mean_finished_len']:.1f} | {s['decode_steps_per_sample']:.2f} "
                    f"| {1000 * s['cpu_s_per_sample']:.2f} | {s['dropped_stale']} |")
    return head + "\n".join(rows)


def widen_context(model_dir: Path, n_positions: int) -> None:
    """Raise `max_position_embeddings` in the checkpoint's config.json. The tiny Llama uses RoPE (no learned
    position table), so this changes only the limit the engine enforces, not a weight."""
    import json

    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), n_positions)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    from engine.launcher import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "engine.server", "--model", str(model_dir), "--port",
                                 str(port), "--threads", "1", "--log-level", "warning"], env=env, cwd=str(REPO),
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", default="32", help="B, finished samples a step needs (both arms); a comma list sweeps")
    p.add_argument("--over-sampling", default="1.25,1.5,2.0", help="the `april` arm's over-sampling; a comma list adds arms "
                   "`april_os<x>` for the others (the bounded-staleness arm uses the first)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per arm and repeat")
    p.add_argument("--warmup", type=int, default=10, help="steps dropped before measuring (APRIL buffer fills)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=64, help="the `april` arm's bound (drops nothing here)")
    p.add_argument("--bounded-staleness", type=int, default=2, help="the `april_s<k>` arm's bound; -1: no such arm")
    p.add_argument("--body", default="8,32", help="lo,hi of the uniform body of natural lengths")
    p.add_argument("--tail", default="64,512", help="lo,hi of the log-uniform tail of natural lengths")
    p.add_argument("--p-tail", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default=None, help="longtail, demo or both (comma list); default both, --quick: "
                   "longtail")
    p.add_argument("--demo-batch", type=int, default=64, help="B of the demo workload (configs/demo.yaml's)")
    p.add_argument("--demo-over-sampling", default="1.1,1.5", help="demo arms april_os<x> beside sync and april")
    p.add_argument("--demo-steps", type=int, default=10, help="measured steps per demo domain, arm and repeat")
    p.add_argument("--demo-warmup", type=int, default=3)
    p.add_argument("--demo-prompts", type=int, default=2000, help="train prompts a demo domain's cursor cycles")
    p.add_argument("--quick", action="store_true", help="smoke size (the integration test); numbers mean little")
    add_check(p, f"april / sync finished samples/s < {TARGET} at some B; the demo workload alone has no target")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.warmup, args.repeats, args.tail = "8", 6, 3, 1, "48,128"
        args.over_sampling = "2.0"
        args.demo_batch, args.demo_over_sampling, args.demo_steps, args.demo_warmup = 16, "", 3, 2
        args.demo_prompts = 200  # ≥ the ~100 prompts an arm takes in 5 steps of ≤ 20 requests: none repeats
    workloads = (args.workload or ("longtail" if args.quick else "longtail,demo")).split(",")
    if set(workloads) - {"longtail", "demo"} or not workloads:
        p.error(f"--workload: longtail and/or demo, got {args.workload!r}")
    meta = start_meta()
    exit_on_sigterm()

    from infra.models import init_model_dir, load_tokenizer

    batches = [int(b) for b in args.batch.split(",")]
    body, tail = (tuple(int(x) for x in v.split(",")) for v in (args.body, args.tail))
    oversampling = [float(x) for x in str(args.over_sampling).split(",")]
    arms = [("sync", 1.0, args.max_staleness), ("april", oversampling[0], args.max_staleness)]
    arms += [(f"april_os{x:g}", x, args.max_staleness) for x in oversampling[1:]]
    if args.bounded_staleness >= 0:
        arms.append((f"april_s{args.bounded_staleness}", oversampling[0], args.bounded_staleness))
    cursor_kw = {"seed": args.seed, "body": body, "tail": tail, "p_tail": args.p_tail}
    workload = LongTailCursor(**cursor_kw)
    n_workload = 2000
    lens = [workload.natural_length(i) for i in range(n_workload)]
    t_start = time.perf_counter()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir("tiny", Path(tmp) / "model", seed=0)
        widen_context(model_dir, CONTEXT)  # the preset's 256 positions < prompt + a 512-token tail sample
        tok = load_tokenizer(model_dir)
        proc, url = start_server(model_dir, Path(tmp) / "server.log")
        try:
            probe = EngineClient(url)
            probe.run_sync(probe.wait_healthy(timeout=120))
            loadavg_before = list(os.getloadavg())
            for rep in range(args.repeats if "longtail" in workloads else 0):
                for b in batches:
                    k = rep % len(arms)
                    for name, os_, ms in arms[k:] + arms[:k]:  # rotated: load drift hits every arm alike
                        r = asyncio.run(run_arm(url, tok, name=name, batch=b, over_sampling=os_, max_staleness=ms,
                                                min_extra=MIN_EXTRA,
                                                steps=args.steps, warmup=args.warmup, max_new_tokens=tail[1],
                                                make_cursor=lambda: LongTailCursor(**cursor_kw)))
                        runs.append({"repeat": rep, "batch": b, **r})
                        print(f"repeat {rep} B={b} {name}: {r['samples_per_s']:.1f} samples/s, "
                              f"{r['finished_tokens_per_s']:.0f} finished tok/s, "
                              f"mean step {r['step_s']['mean']:.3f} s, dropped {r['dropped_stale']}", flush=True)
            demo = run_demo(url, tok, args, quick=args.quick) if "demo" in workloads else None
            loadavg_after = list(os.getloadavg())
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
    if not runs:  # demo only
        result = {"bench": "april", "command": " ".join(["python bench/april.py"] + (argv if argv is not None else
                                                                                     sys.argv[1:])),
                  "quick": args.quick, "meta": meta,
                  "loadavg": {"before": loadavg_before, "after": loadavg_after}, "config": vars(args), "demo": demo,
                  "total_s": round(time.perf_counter() - t_start, 1)}
        write_outputs(Path(args.out), result, demo_table(demo))
        return verdict("april", None, args.check)
    summary = summarize(runs)
    ratios = {b: round(arms_["april"]["ratio_to_sync"], 3) for b, arms_ in summary.items()}
    by_arm = {a: {b: round(arms_[a]["ratio_to_sync"], 3) for b, arms_ in summary.items()}
              for a, _, _ in arms if a.startswith("april") and not a.startswith("april_s")}
    md = table(summary)
    result = {
        "bench": "april", "command": " ".join(["python bench/april.py"] + (argv if argv is not None else sys.argv[1:])),
        "quick": args.quick, "meta": meta, "loadavg": {"before": loadavg_before, "after": loadavg_after},
        "config": {**vars(args), "batches": batches,
                   "arms": [{"arm": a, "over_sampling": o, "max_staleness": m} for a, o, m in arms],
                   "min_extra_requests": MIN_EXTRA,
                   "model": f"tiny (init_model_dir seed 0), max_position_embeddings {CONTEXT}", "temperature": 1.0,
                   "server_threads": 1, "server_max_running_requests": MAX_RUNNING_REQUESTS,
                   "same": "steps per arm (warmup dropped); wall = sum of the measured rollout_step calls"},
        "workload": {"body_uniform": body, "tail_loguniform": tail, "p_tail": args.p_tail,
                     "natural_length_first_2000": dist(lens),
                     "tail_fraction_first_2000": round(sum(n > body[1] for n in lens) / n_workload, 4)},
        "summary": {b: {a: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
                        for a, s in arms_.items()} for b, arms_ in summary.items()},
        "target": {"metric": "finished samples/s, april / sync at equal B, pooled over repeats", "goal": TARGET,
                   "value_by_batch": ratios, "met_by_batch": {b: v >= TARGET for b, v in ratios.items()},
                   "met": all(v >= TARGET for v in ratios.values()),
                   "april_over_sampling": oversampling[0], "value_by_arm": by_arm,
                   "met_by_arm": {a: all(v >= TARGET for v in r.values()) for a, r in by_arm.items()}},
        "runs": runs, "total_s": round(time.perf_counter() - t_start, 1),
    }
    if demo is not None:
        result["demo"] = demo
        md += "\n\n" + demo_table(demo)
    write_outputs(Path(args.out), result, md)
    print(f"april / sync finished samples/s by B: {ratios} (target >= {TARGET}); wrote {args.out}")
    return verdict("april", result["target"]["met"], args.check)


if __name__ == "__main__":
    sys.exit(main())
