"""The harness every bench shares: the run's `meta` (what ran, where, under which load), `--check` (exit non-zero on
a missed target), CPU accounting, the OPD benches' models and configs, and the JSON + markdown writer.

Importing it puts the repository (and `tests/`, for the distillation fixtures) on `sys.path` and sets Alloy's quiet
environment defaults; it imports no torch (a bench decides when).

CPU seconds come from each process's own accounting, never from sampling `/proc` ticks of other processes: this
process's `resource.getrusage(RUSAGE_SELF)` (every thread) plus `RUSAGE_CHILDREN` (its descendants already waited
for), and for each live engine server the `process_cpu_seconds` it reports itself (`/get_server_info`:
its own `getrusage(RUSAGE_SELF)`).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from alloy.cli import env_defaults  # noqa: E402  (offline/quiet env before torch is imported)
from infra.hostinfo import cpu_model, git_state, now_utc, run_meta  # noqa: E402,F401  (one source with the reports)

env_defaults()

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
              "TORCH_NUM_THREADS")
PLAIN_BUILTINS = ["addition", "subtraction", "multiplication", "max_list", "digit_sum", "binary", "reverse", "copy",
                  "sort_digits", "case_swap", "caesar", "count_char", "brackets"]
# past the 13 plain built-ins: the same class under another config name, at difficulty 2
ALIASES = [("reverse_d2", "domains.builtin.text:Reverse"), ("sort_digits_d2", "domains.builtin.text:SortDigits"),
           ("addition_d2", "domains.builtin.arithmetic:Addition"), ("copy_d2", "domains.builtin.text:Copy")]


# -- meta: what ran, where, under which load -------------------------------------------------------------------------
def thread_settings() -> dict:
    """torch's intra-/inter-op threads in this process (None until torch is imported) and the thread env vars."""
    torch = sys.modules.get("torch")
    return {"torch_threads": torch.get_num_threads() if torch else None,
            "torch_interop_threads": torch.get_num_interop_threads() if torch else None,
            "env": {k: os.environ.get(k) for k in THREAD_ENV}}


def start_meta() -> dict:
    """The run's meta, taken when a bench starts: commit (+ dirty), CPU model, cores (all, and the ones this process
    may run on), thread settings, load average, python/torch versions, the exact command line (`sys.argv`)."""
    return run_meta(cores=sorted(os.sched_getaffinity(0)), threads_start=thread_settings())


def end_meta(meta: dict) -> dict:
    """`meta` completed when the bench ends: load average and thread settings then (torch is loaded by now)."""
    if "loadavg_end" not in meta:
        meta.update({"loadavg_end": list(os.getloadavg()), "threads": thread_settings(),
                     "ended_at": now_utc()})
    return meta


def pin_cores(spec: str | None) -> list[int]:
    """Restrict this process (and every process it starts after) to the cores of `spec` ("0,1", "0-3"; None: the
    ones it may use now) so every side of a comparison runs on the same cores; returns them."""
    if spec:
        cores = set()
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))


# -- --check ---------------------------------------------------------------------------------------------------------
def add_check(parser, what: str | None, always: bool = False) -> None:
    """`--check`: exit non-zero when the bench's target (`what`; None: the bench has none) is missed. `always`: the
    bench checks it on every run (a correctness check), and `--check` is accepted so every bench takes it."""
    if always:
        text = f"always on here: exit 1 when {what}"
    elif what:
        text = f"exit 1 when the target is missed ({what}), 2 when this run cannot judge it"
    else:
        text = "no target: only checks that the bench ran (a failure exits non-zero with or without it)"
    parser.add_argument("--check", action="store_true", help=text)


def verdict(bench: str, met: bool | None, check: bool, has_target: bool = True) -> int:
    """The exit code of a bench that ran to its end: 0 without `--check`; with it 0 if the target was met, 1 if
    missed, 2 if the run could not judge it (`met` None, e.g. a setting that does not measure the target's point).
    A bench without a target (`has_target` False): `--check` only checks that it ran (0)."""
    if not check:
        return 0
    if not has_target:
        print(f"{bench}: --check: no target; the run completed", file=sys.stderr)
        return 0
    if met is None:
        print(f"{bench}: --check: this run does not measure the target (met: null)", file=sys.stderr)
        return 2
    if not met:
        print(f"{bench}: --check: target MISSED", file=sys.stderr)
        return 1
    print(f"{bench}: --check: target met", file=sys.stderr)
    return 0


def spread(xs: list[float]) -> dict:
    """min / median / max of repeated measurements."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


# -- CPU accounting --------------------------------------------------------------------------------------------------
def own_cpu_s() -> float:
    """CPU seconds (user + system) of this process (every thread) and of its descendants already waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def server_cpu_s(urls: list[str]) -> float:
    """CPU seconds the engine servers behind `urls` report for themselves (`process_cpu_seconds`)."""
    return server_cpu_split(urls)["servers"]


def server_cpu_split(urls: list[str]) -> dict[str, float]:
    """The CPU seconds the engine servers behind `urls` report (`/get_server_info`), summed: `servers` (each whole
    process) and `servers_engine_thread` (the engine thread's scheduling steps, `engine_cpu_seconds`); the rest of a
    server's process is its HTTP side (aiohttp, request parsing, building answers) and weight loads."""
    from engine.client import API_KEY_ENV

    key = os.environ.get(API_KEY_ENV)
    total = {"servers": 0.0, "servers_engine_thread": 0.0}
    for url in urls:
        req = urllib.request.Request(url.rstrip("/") + "/get_server_info",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(req, timeout=60) as r:
            info = json.loads(r.read())
        total["servers"] += float(info["process_cpu_seconds"])
        total["servers_engine_thread"] += float(info["engine_cpu_seconds"])
    return total


def exit_on_sigterm() -> None:
    """SIGTERM → SystemExit, so `finally` blocks stop the engine servers this bench launched."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class StepClock:
    """`on_step` hook of the student trainer: wall time between consecutive committed steps, and CPU seconds over the
    measured steps. The first interval starts at creation (start-up included) and goes with the warm-up.

    CPU is read twice, after the warm-up and after the last step: the trainer (`own_cpu_s`: this process and its
    reaped children) and the servers (`server_cpu_s` of the student's rollout server and `teachers`). The first
    reading is taken before the wall clock of the next step starts, so its HTTP calls cost no measured step."""

    def __init__(self, warmup: int, steps: int, teachers: list[str]):
        if not 1 <= warmup < steps:
            raise ValueError(f"StepClock: need 1 <= warmup ({warmup}) < steps ({steps})")
        self.warmup, self.steps, self.teachers = warmup, steps, list(teachers)
        self.t = [time.perf_counter()]
        self.metrics: list[dict] = []
        self.cpu: list[dict] = []  # {"trainer", "servers"} at the end of the warm-up and at the last step

    def reading(self, trainer) -> dict:
        return {"trainer": own_cpu_s(), **server_cpu_split([trainer.policy.url] + self.teachers)}

    def __call__(self, trainer, metrics: dict) -> None:
        self.t.append(time.perf_counter())
        self.metrics.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        if len(self.metrics) in (self.warmup, self.steps):
            self.cpu.append(self.reading(trainer))
            if len(self.metrics) == self.warmup:
                self.t[-1] = time.perf_counter()  # the next interval starts after the reading

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.t, self.t[1:])][self.warmup:]

    def cpu_by_role_per_step(self) -> dict[str, float]:
        """Mean CPU seconds per measured step of each role: `trainer` (the loop, its client, the weight snapshots)
        and `servers` (the student's and the teachers' engine servers), and of the servers' engine threads
        (`servers_engine_thread`, part of `servers`)."""
        if len(self.cpu) != 2:
            raise RuntimeError(f"StepClock: {len(self.metrics)} steps committed, expected {self.steps}")
        a, b = self.cpu
        return {k: (b[k] - a[k]) / (self.steps - self.warmup) for k in a}

    def cpu_per_step(self) -> float:
        by = self.cpu_by_role_per_step()
        return by["trainer"] + by["servers"]


# -- the OPD benches' models and configs -----------------------------------------------------------------------------
def domain_specs(n: int) -> list[dict]:
    """n distinct domain configs (`{"name", "impl"?, "difficulty"?}`): plain built-ins first, then aliases."""
    specs = [{"name": d} for d in PLAIN_BUILTINS] + [{"name": a, "impl": impl, "difficulty": 2} for a, impl in ALIASES]
    if n > len(specs):
        raise ValueError(f"domain_specs: at most {len(specs)} distinct domains, asked for {n}")
    return specs[:n]


def build_student_and_teacher(root: Path, domains: list[str], base_steps: int, teacher_steps: int,
                              seed: int = 0) -> tuple[Path, Path]:
    """A tiny base (the student's start) and one teacher = base + `teacher_steps` more SFT steps (plain torch)."""
    from distill_fixtures import build_base, sft_plain
    from domains.registry import load_domain

    base = build_base(root, domains, base_steps, seed=seed)
    pairs = [(e.prompt, e.answer) for d in domains for e in load_domain(d).split("train", 200, seed + 1)]
    teacher = sft_plain(base, root / "teacher", pairs, teacher_steps, seed=seed + 1)
    return base, teacher


def make_cfg(root: Path, specs: list[dict], seed: int = 0, **distill):
    """An AlloyConfig for a distillation run over `specs`; `distill` overrides the `distill:` section."""
    from infra.config import config_from_dict

    train = {"lr": 1e-3, "micro_batch_size": distill.get("batch_size", 96), **distill.pop("train", {})}
    return config_from_dict({
        "run": {"name": "bench", "root": str(root), "seed": seed}, "model": {"preset": "tiny"},
        "domains": specs, "eval": {"n_eval": 20, "max_new_tokens": distill.get("max_new_tokens", 16)},
        "distill": {"eval_every": 0, "checkpoint_every": 100000, "log_every": 100000, "n_prompts_per_domain": 200,
                    "train": train, **distill}})


# -- output ----------------------------------------------------------------------------------------------------------
def write_json(out: Path, result: dict, **dump) -> None:
    """`result` as JSON at `out`, its `meta` (if any) completed first."""
    if "meta" in result:
        end_meta(result["meta"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, **({"indent": 2, "default": float} | dump)))


def write_outputs(out: Path, result: dict, table_md: str) -> None:
    """The JSON (with `table_md`) and the table as markdown beside it (`.md`)."""
    result["table_md"] = table_md
    write_json(out, result)
    out.with_suffix(".md").write_text(table_md + "\n")
    print(table_md)


def safetensors_params(path: Path) -> int:
    """Parameters in a safetensors file, counted from its header (no tensor is read)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for k, v in header.items():
        if k != "__metadata__":
            n = 1
            for d in v["shape"]:
                n *= d
            total += n
    return total

