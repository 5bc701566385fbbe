"""GPU placement: which GPUs each trainer, rollout server and teacher server of a run gets (docs/placement.md).

Pure: no torch, no Prefect, no I/O except reading a checkpoint's `config.json` (`model_size`). `make_plan(cfg, gpus)`
turns a config (an `infra.config.AlloyConfig`, read by attribute) and the GPUs of one node into a `Plan`: a list of
`Proc(stage, name, kind, gpus, mem_fraction)`. The launcher side (`trainer_env`, `server_launch`) turns one entry
into what the process gets: `CUDA_VISIBLE_DEVICES` for a trainer, `--base-gpu-id/--tp-size/--mem-fraction-static`
for an SGLang server.

Memory model (GB = 1e9 bytes; all fractions in whole hundredths of one GPU, so sums are exact):
- a model copy weighs `params × bytes` (bytes of the checkpoint's dtype; `resources.model_gb` overrides);
- a server (rollout or teacher) with tensor-parallel size tp needs, on each of its tp GPUs,
  (weights + KV cache) / tp + SERVER_OVERHEAD_GB; its mem_fraction is that over the GPU size, rounded up;
- a trainer rank holds its DeepSpeed state, per parameter (W ranks, ZeRO stage z; bf16/fp16: 2 B weights, 2 B
  grads, 12 B fp32 master + Adam m, v; fp32: 4 + 4 + 8):
      z0: w + g + o    z1: w + g + o/W    z2: w + (g + o)/W    z3: (w + g + o)/W
  times the models it trains (specialists: policy + critic; student: one), plus a frozen reference policy
  (specialists with kl_coef > 0: in the policy's dtype, unsharded) and `resources.trainer_overhead_gb`
  (activations, CUDA context); the guard's judge server (its own checkpoint's size) beside the specialists' lanes;
  the model rewards' servers (`reward_servers`) beside them too, their GPUs kept through the distill stage.
Rules, per stage: the fractions on one GPU sum to at most BUDGET (0.95); no GPU holds two trainers; a server shares
a trainer's GPU only when it is that trainer's own rollout server and `resources.colocate_rollout` is true (the
trainer then gets what the server leaves). The distill stage's student and the teachers run at the same time, so
they are planned together on one node's GPUs (the JSON still labels them "distill" and "teachers"). The reward
servers run from the specialists stage through the distill stage: planned (and labelled) in the first, they keep
their GPUs and shares in the second.
With `resources.share_gpus` (the shared mode) the two exclusivity rules go: a trainer takes only its estimated share
of each of its GPUs, trainers and servers are packed onto the GPUs by those shares (trainers first, then servers,
each to the least-used place), and each trainer's mem_fraction is its share plus an even part of what its GPUs have
left; `trainer_env` passes it to the trainer (GPU_MEM_FRACTION_ENV), whose ranks cap their CUDA allocator at it.
"""
from __future__ import annotations

import hashlib

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from infra.choices import Backend
from infra.presets import preset_params

GB = 1e9
BUDGET = 95  # hundredths of one GPU that one stage's processes may take together (SGLang's own margin aside)
SERVER_OVERHEAD_GB = 1.0  # per server process and GPU: CUDA context, activations, CUDA graphs
DEFAULT_GPU_MEMORY_GB = 80.0  # an A100/H100 80 GB
PLACEMENT_ENV = "ALLOY_PLACEMENT"  # JSON a trainer process gets: its own rollout server's placement (see trainer_env)
GPU_MEM_FRACTION_ENV = "ALLOY_GPU_MEM_FRACTION"  # a shared-mode trainer's mem_fraction: its ranks' allocator cap
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


class PlacementError(ValueError):
    """A request that does not fit; the message says which stage, what it needs, and what to change."""


@dataclass(frozen=True)
class Proc:
    """One planned process. `mem_fraction`: the share of each listed GPU it may use (SGLang's mem_fraction_static
    for a server; for a trainer, what the plan leaves it on its GPUs)."""
    stage: str  # "base" | "specialists" | "distill" | "teachers"
    name: str  # "base", "lane-0", "student", or a teacher's domain
    kind: str  # "trainer" | "rollout" | "teacher" | "judge" | "reward"
    gpus: tuple[int, ...]
    mem_fraction: float

    def to_json(self) -> dict:
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        return d


@dataclass(frozen=True)
class Plan:
    gpus: int
    gpu_memory_gb: float
    model_gb: float
    model_source: str  # where model_gb came from
    processes: tuple[Proc, ...] = field(default_factory=tuple)
    shared: bool = False  # resources.share_gpus: trainers share GPUs by memory fraction (plan_problems, trainer_env)

    def to_json(self) -> dict:
        return {"processes": [p.to_json() for p in self.processes]}

    def get(self, stage: str, name: str, kind: str) -> Proc | None:
        return next((p for p in self.processes if (p.stage, p.name, p.kind) == (stage, name, kind)), None)

    def trainers(self, stage: str) -> list[Proc]:
        return [p for p in self.processes if p.stage == stage and p.kind == "trainer"]


# ------------------------------------------------------------------------------------------ model size


def estimate_params(hf_config: dict) -> float | None:
    """Parameters of a decoder-only transformer from its HF `config.json` (Llama/Qwen/Mistral layout: gated MLP,
    grouped-query attention), or None when a field is missing. Norms and biases (< 0.1 %) are left out:
        attention = h·(nh·hd) [q] + 2·h·(kvh·hd) [k, v] + (nh·hd)·h [o];  mlp = 3·h·I;
        params = L·(attention + mlp) + V·h · (1 if tie_word_embeddings else 2)."""
    c = hf_config.get("text_config", hf_config)
    try:
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        inter, nh = int(c["intermediate_size"]), int(c["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kvh = int(c.get("num_key_value_heads") or nh)
    hd = int(c.get("head_dim") or h // nh)
    attention = h * nh * hd + 2 * h * kvh * hd + nh * hd * h
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", hf_config.get("tie_word_embeddings")) else 2)
    return float(layers * (attention + 3 * h * inter) + embeddings)


def model_size(model_path: str | None, model_gb: float | None = None,
               preset: str = "tiny") -> tuple[float, int, str]:
    """(params, bytes per parameter, source) of the run's model: `resources.model_gb` if given (taken as bf16),
    else the checkpoint's config.json (params × its torch_dtype; 2 bytes when unnamed), else the weight files'
    size on disk, else (no model.path) the fresh `preset` model: its exact parameter count with the char
    tokenizer's vocabulary (`infra.presets.preset_params`), served in bf16. Raises PlacementError when nothing is
    readable."""
    if model_gb is not None:
        return model_gb * GB / 2, 2, "resources.model_gb"
    if not model_path:
        params = preset_params(preset)
        return float(params), 2, f"model.preset {preset}, {params / 1e6:.1f}M params in bf16"
    d = Path(model_path).expanduser()
    cfg_file = d / "config.json"
    if cfg_file.is_file():
        try:
            hf = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError):
            hf = {}
        params = estimate_params(hf) if isinstance(hf, dict) else None
        if params:
            name = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").removeprefix("torch.")
            return params, _DTYPE_BYTES.get(name, 2), f"{cfg_file} ({params / 1e9:.2f}B params, {name})"
    files = [f for f in d.glob("*") if f.suffix in (".safetensors", ".bin") and f.is_file()] if d.is_dir() else []
    if files:
        size = sum(f.stat().st_size for f in files)
        return size / 2, 2, f"size of the weight files in {d}"
    raise PlacementError(f"cannot estimate the size of model.path {model_path!r} (no readable config.json or weight "
                         "files here): set resources.model_gb (GB of one bf16 copy of the weights)")


def trainer_gb(params: float, dtype: str, zero_stage: int, world_size: int, n_models: int) -> float:
    """GB one trainer rank holds for `n_models` trained models (module docstring), without overhead."""
    w, g, o = (4, 4, 8) if dtype == "fp32" else (2, 2, 12)
    per_param = {0: w + g + o, 1: w + g + o / world_size, 2: w + (g + o) / world_size,
                 3: (w + g + o) / world_size}[zero_stage]
    return params * per_param * n_models / GB


def hundredths(gb: float, gpu_gb: float) -> int:
    """`gb` as whole hundredths of a `gpu_gb` GPU, rounded up (a process never gets less than it needs)."""
    return max(1, math.ceil(round(gb / gpu_gb * 100, 6)))


# ------------------------------------------------------------------------------------------ packing


@dataclass(frozen=True)
class _Server:
    name: str
    kind: str
    tp: int
    share: int  # hundredths on each of its tp GPUs


def server_share(model_gb: float, kv_gb: float, tp: int, gpu_gb: float) -> int:
    """Hundredths of each GPU a server of tensor-parallel size `tp` needs."""
    return hundredths((model_gb + kv_gb) / tp + SERVER_OVERHEAD_GB, gpu_gb)


def server_tp(model_gb: float, kv_gb: float, gpu_gb: float, fixed: int | None, most: int) -> int | None:
    """The tensor-parallel size of a server: `fixed` (engine.sglang_args.tp_size) if given, else the smallest power
    of two ≤ `most` GPUs whose per-GPU share fits a GPU; None when none does (the server is larger than `most`
    GPUs)."""
    options = [fixed] if fixed else [t for t in (1, 2, 4, 8, 16) if t <= max(most, 1)]
    for tp in options:
        if server_share(model_gb, kv_gb, tp, gpu_gb) <= BUDGET:
            return tp
    return None


def pack(servers: Sequence[_Server], free: Sequence[int], used: dict[int, int]) -> dict[str, tuple[int, ...]] | None:
    """Spread, in the given order: each server goes on the least-used GPU (tp = 1; ties: the lowest id) or the least-
    used aligned group of tp consecutive GPUs (tp > 1: ids [k·tp, (k+1)·tp) all in `free`; load = its fullest GPU)
    where its share still fits under BUDGET. So servers share a GPU only once every free GPU holds one. Updates
    `used` (hundredths per GPU); None (and `used` untouched) when some server finds no place."""
    return place([(s.name, (s.share,) * s.tp) for s in servers], free, used)


def place(items: Sequence[tuple[str, tuple[int, ...]]], free: Sequence[int],
          used: dict[int, int]) -> dict[str, tuple[int, ...]] | None:
    """`pack` for any process: an item (name, loads) takes an aligned block of len(loads) consecutive GPUs (ids
    [k·b, (k+1)·b) all in `free`), adding loads[i] hundredths to the block's i-th GPU; each item goes to the block
    whose fullest GPU is least used (ties: the lowest id) among those where every load still fits under BUDGET.
    Updates `used`; None (and `used` untouched) when some item finds no place."""
    trial, out, free = dict(used), {}, list(free)
    for name, loads in items:
        b = len(loads)
        groups = [tuple(range(g, g + b)) for g in free if g % b == 0]
        groups = [g for g in groups if all(x in free for x in g)
                  and all(trial.get(x, 0) + load <= BUDGET for x, load in zip(g, loads))]
        if not groups:
            return None
        spot = min(groups, key=lambda g: (max(trial.get(x, 0) for x in g), g[0]))
        for x, load in zip(spot, loads):
            trial[x] = trial.get(x, 0) + load
        out[name] = spot
    used.update(trial)
    return out


# ------------------------------------------------------------------------------------------ the plan


@dataclass
class _Sizes:
    params: float
    bytes: int
    gpu_gb: float
    kv_gb: float
    overhead_gb: float
    colocate: bool
    fixed_tp: int | None
    shared: bool = False

    @property
    def model_gb(self) -> float:
        return self.params * self.bytes / GB


def _sizes(cfg) -> tuple[_Sizes, str]:
    r = cfg.resources
    params, nbytes, source = model_size(cfg.model.path, r.model_gb, cfg.model.preset)
    model_gb = params * nbytes / GB
    kv = r.kv_cache_gb if r.kv_cache_gb is not None else max(1.0, 0.5 * model_gb)
    fixed = (cfg.engine.sglang_args or {}).get("tp_size") if cfg.engine.backend == Backend.SGLANG else None
    return _Sizes(params, nbytes, r.gpu_memory_gb, kv, r.trainer_overhead_gb, r.colocate_rollout,
                  int(fixed) if fixed else None, r.share_gpus), source


def _trainer_share(sz: _Sizes, train, n_models: int, extra_gb: float = 0.0) -> tuple[int, float]:
    """(hundredths, GB) one rank of a trainer with TrainConfig `train` needs on its GPU."""
    gb = trainer_gb(sz.params, train.dtype, train.zero_stage, train.world_size, n_models) + extra_gb + sz.overhead_gb
    return hundredths(gb, sz.gpu_gb), gb


def _rollout(sz: _Sizes, most: int, stage: str) -> _Server:
    tp = server_tp(sz.model_gb, sz.kv_gb, sz.gpu_gb, sz.fixed_tp, most)
    if tp is None:
        raise PlacementError(f"{stage}: a rollout server of the model ({sz.model_gb:.1f} GB weights + {sz.kv_gb:.1f} GB "
                             f"KV cache) does not fit on {sz.fixed_tp or most} GPU(s) of {sz.gpu_gb:g} GB")
    return _Server("", "rollout", tp, server_share(sz.model_gb, sz.kv_gb, tp, sz.gpu_gb))


def _names(stage: str, n: int) -> list[str]:
    return ["student" if stage == "distill" else f"lane-{i}" for i in range(n)]


def _lanes(stage: str, n: int, world: int, t_share: int, t_gb: float, sz: _Sizes, gpus: int,
           what: str, shared_fits: Callable[[], bool] | None = None,
           reserved: dict[int, int] | None = None) -> list[Proc]:
    """`n` lanes of one trainer (`world` ranks, `t_share` hundredths per rank) plus its own rollout server each, on
    GPUs 0..gpus-1, or PlacementError naming the largest number of lanes that fits. `shared_fits` (default: these
    lanes in the shared mode) says whether `resources.share_gpus: true` would make the stage fit, for the hint.
    `reserved`: hundredths per GPU already held by servers that outlive an earlier stage (the reward servers)."""
    reserved = reserved or {}
    fit = _fit_lanes(n, world, t_share, sz, gpus, stage, reserved)
    if isinstance(fit, list):
        return fit
    best = max((k for k in range(n - 1, 0, -1)
                if isinstance(_fit_lanes(k, world, t_share, sz, gpus, stage, reserved), list)), default=0)
    server = _rollout(sz, gpus, stage)
    per_rank = f"about {t_gb:.1f} GB" + (f" = {t_share / 100:.2f} of a GPU" if sz.shared else "")
    need = (f"{world} GPU(s) for the trainer ({what}.world_size={world}, {per_rank} per rank) "
            f"{'shared with' if sz.colocate else 'plus'} its own rollout server (tp {server.tp}, mem_fraction "
            f"{server.share / 100:.2f} per GPU)")
    where = f"on {gpus} GPU(s) of {sz.gpu_gb:g} GB" + (" shared by memory fraction (resources.share_gpus: true)"
                                                        if sz.shared else "")
    if stage == "specialists":
        what_fails = (f"specialists: {n} lanes at once (specialists.max_parallel, at most one per domain) do not fit "
                      f"{where}; each lane needs {need}")
        hint = (f"at most {best} fit: set specialists.max_parallel={best}" if best
                else "not even one lane fits")
    else:
        what_fails = f"{stage}: the student does not fit {where}; it needs {need}"
        hint = "add GPUs"
    if not sz.shared and not sz.colocate and t_share + server.share <= BUDGET:
        hint += ", or set resources.colocate_rollout: true (a trainer shares its GPUs with its own rollout server)"
    if not sz.shared:
        shared = replace(sz, shared=True)
        if (shared_fits or (lambda: isinstance(_fit_lanes(n, world, t_share, shared, gpus, stage, reserved),
                                               list)))():
            hint += ", or set resources.share_gpus: true (trainers share GPUs by memory fraction)"
    raise PlacementError(f"{what_fails}: {hint}")


def _fit_lanes(n: int, world: int, t_share: int, sz: _Sizes, gpus: int, stage: str,
               reserved: dict[int, int]) -> list[Proc] | str:
    """`_lanes`' placement, or "no". Unshared, a trainer never takes a GPU that holds a `reserved` load, and a
    rollout server fits beside what is reserved."""
    if t_share > BUDGET:
        raise PlacementError(f"{stage}: one trainer rank needs {t_share / 100:.2f} of a {sz.gpu_gb:g} GB GPU, over "
                             f"the {BUDGET / 100:.2f} a stage may use: raise its zero_stage or world_size, or check "
                             "resources.gpu_memory_gb / model_gb / trainer_overhead_gb")
    server = _rollout(sz, gpus, stage)
    procs: list[Proc] = []
    if sz.shared:
        return _shared_lanes(n, world, t_share, server, sz.colocate, gpus, stage, reserved)
    if sz.colocate:  # lane i: a block of max(world, tp) GPUs; rollout on its first tp, trainer on its first world
        block = max(world, server.tp)
        if n * block > gpus or t_share + server.share > BUDGET:
            return "no"
        for i in range(n):
            name = "student" if stage == "distill" else f"lane-{i}"
            t_gpus = tuple(range(i * block, i * block + world))
            r_gpus = tuple(range(i * block, i * block + server.tp))
            if any(reserved.get(g, 0) for g in t_gpus) or any(reserved.get(g, 0) + server.share > BUDGET
                                                              for g in r_gpus):
                return "no"
            left = BUDGET - (server.share if set(t_gpus) & set(r_gpus) else 0)
            procs += [Proc(stage, name, "trainer", t_gpus, left / 100),
                      Proc(stage, name, "rollout", r_gpus, server.share / 100)]
        return procs
    if n * world >= gpus or any(reserved.get(g, 0) for g in range(n * world)):
        return "no"  # trainers take the first n·world GPUs; the rollout servers pack onto the rest
    used = dict(reserved)
    names = _names(stage, n)
    placed = pack([_Server(nm, "rollout", server.tp, server.share) for nm in names], range(n * world, gpus), used)
    if placed is None:
        return "no"
    for i, nm in enumerate(names):
        procs += [Proc(stage, nm, "trainer", tuple(range(i * world, (i + 1) * world)), BUDGET / 100),
                  Proc(stage, nm, "rollout", placed[nm], server.share / 100)]
    return procs


def _shared_lanes(n: int, world: int, t_share: int, server: _Server, colocate: bool, gpus: int,
                  stage: str, reserved: dict[int, int]) -> list[Proc] | str:
    """The shared mode's lanes: packed onto GPUs 0..gpus-1 by their shares with `place`, the trainers first (an
    aligned block of `world` GPUs each, spread), then the rollout servers (spread over what is least used); with
    colocate_rollout each lane's trainer and server go as one block of max(world, tp) GPUs. A trainer's
    mem_fraction here is its share; `_with_slack` adds its part of what is left once the stage is placed."""
    names, used = _names(stage, n), dict(reserved)
    if colocate:
        block = max(world, server.tp)
        loads = tuple((t_share if i < world else 0) + (server.share if i < server.tp else 0) for i in range(block))
        lanes = place([(nm, loads) for nm in names], range(gpus), used)
        if lanes is None:
            return "no"
        t_gpus = {nm: g[:world] for nm, g in lanes.items()}
        r_gpus = {nm: g[:server.tp] for nm, g in lanes.items()}
    else:
        t_gpus = place([(nm, (t_share,) * world) for nm in names], range(gpus), used)
        r_gpus = None if t_gpus is None else pack([_Server(nm, "rollout", server.tp, server.share) for nm in names],
                                                  range(gpus), used)
        if r_gpus is None:
            return "no"
    return [proc for nm in names for proc in (Proc(stage, nm, "trainer", t_gpus[nm], t_share / 100),
                                              Proc(stage, nm, "rollout", r_gpus[nm], server.share / 100))]


def _loads(procs: Sequence[Proc]) -> dict[int, int]:
    """Hundredths planned on each GPU by `procs`."""
    used: dict[int, int] = {}
    for p in procs:
        for g in p.gpus:
            used[g] = used.get(g, 0) + round(p.mem_fraction * 100)
    return used


def _with_slack(procs: list[Proc], held: Sequence[Proc] = ()) -> list[Proc]:
    """The shared mode's last step: each trainer's mem_fraction becomes its share plus an even part of what the
    stage leaves free on its GPUs (the smallest such part over its GPUs, in whole hundredths), so a GPU's sum stays
    ≤ BUDGET and a trainer whose activations outgrow the estimate has room before its allocator cap. `held`: servers
    of an earlier stage still running (the reward servers), which take their share too."""
    used = _loads([*procs, *held])
    trainers: dict[int, int] = {}
    for p in procs:
        for g in p.gpus if p.kind == "trainer" else ():
            trainers[g] = trainers.get(g, 0) + 1
    return [replace(p, mem_fraction=(round(p.mem_fraction * 100) + min((BUDGET - used[g]) // trainers[g]
                                                                      for g in p.gpus)) / 100)
            if p.kind == "trainer" else p for p in procs]


def _shared_fits(stage, cfg, sz: _Sizes, gpus: int) -> bool:
    """Whether `stage` (a planning function) fits in the shared mode: for the hint of a refusal without it."""
    try:
        stage(cfg, replace(sz, shared=True), gpus)
    except PlacementError:
        return False
    return True


def _kl_ref(cfg) -> bool:
    sc = cfg.specialists
    return any(sc.for_domain(d).kl_coef > 0 for d in cfg.domain_names())


def _base(cfg, sz: _Sizes, gpus: int) -> list[Proc]:
    """One trainer, base.train.world_size ranks on GPUs 0..W-1, nothing beside it."""
    bt = cfg.base.train
    if bt.world_size > gpus:
        raise PlacementError(f"base: base.train.world_size={bt.world_size} ranks need {bt.world_size} GPUs; "
                             f"{gpus} available")
    share, gb = _trainer_share(sz, bt, 1)
    if share > BUDGET:
        raise PlacementError(f"base: one trainer rank needs about {gb:.1f} GB (ZeRO-{bt.zero_stage}, "
                             f"{bt.world_size} rank(s)), over {BUDGET / 100:.2f} of a {sz.gpu_gb:g} GB GPU: raise "
                             "base.train.zero_stage or world_size")
    return [Proc("base", "base", "trainer", tuple(range(bt.world_size)), BUDGET / 100)]


def _specialists(cfg, sz: _Sizes, gpus: int) -> list[Proc]:
    """min(max_parallel, domains) lanes, each a trainer (policy + critic share its ranks) + its rollout server; the
    guard's judge and the reward servers beside them."""
    sc = cfg.specialists
    if not sc.enabled:  # the reward servers still run, for the evaluations and through the distill stage
        return _rewards(cfg, sz, gpus, [])
    world = max(sc.policy_train.world_size, sc.critic_train.world_size)
    ref_gb = sz.params * (4 if sc.policy_train.dtype == "fp32" else 2) / GB if _kl_ref(cfg) else 0.0
    p_gb = trainer_gb(sz.params, sc.policy_train.dtype, sc.policy_train.zero_stage, world, 1)
    c_gb = trainer_gb(sz.params, sc.critic_train.dtype, sc.critic_train.zero_stage, world, 1)
    gb = p_gb + c_gb + ref_gb + sz.overhead_gb
    n = min(sc.max_parallel, len(cfg.domain_names()))
    lanes = _lanes("specialists", n, world, hundredths(gb, sz.gpu_gb), gb, sz, gpus, "specialists.policy_train")
    lanes += _judge(cfg, sz, gpus, lanes)
    lanes += _rewards(cfg, sz, gpus, lanes)
    return _with_slack(lanes) if sz.shared else lanes


def _judge(cfg, sz: _Sizes, gpus: int, lanes: list[Proc]) -> list[Proc]:
    """The guard's judge server (tasks/judge.py serves `specialists.guard.judge_path` for the whole stage when no
    `judge_url` is given): its own checkpoint's size, on the GPUs no specialist trainer holds, or anywhere in the
    shared mode, beside the lanes."""
    gc = cfg.specialists.guard
    if not (gc.enabled and gc.judge_path and not gc.judge_url):
        return []
    try:
        params, nbytes, _ = model_size(gc.judge_path)
    except PlacementError:
        raise PlacementError(f"specialists: cannot size the judge at specialists.guard.judge_path="
                             f"{gc.judge_path!r} (no readable config.json or weight files): build it first, or set "
                             "specialists.guard.judge_url to a judge served elsewhere") from None
    model_gb = params * nbytes / GB
    kv_gb = max(0.5, 0.5 * model_gb)
    tp = server_tp(model_gb, kv_gb, sz.gpu_gb, None, 1)
    held = {g for p in lanes if p.kind == "trainer" for g in p.gpus}
    free = list(range(gpus)) if sz.shared else [g for g in range(gpus) if g not in held]
    placed = None if tp is None else pack([_Server("judge", "judge", tp, server_share(model_gb, kv_gb, tp, sz.gpu_gb))],
                                          free, _loads(lanes))
    if placed is None:
        where = f"the {gpus} GPU(s)" if sz.shared else f"the {len(free)} GPU(s) no specialist trainer holds"
        raise PlacementError(f"specialists: the guard's judge server ({model_gb:.1f} GB weights + {kv_gb:.1f} GB KV "
                             f"cache) does not fit on {where} beside the specialists' lanes: lower "
                             "specialists.max_parallel, set resources.share_gpus: true, or serve the judge elsewhere "
                             "(specialists.guard.judge_url)")
    return [Proc("specialists", "judge", "judge", placed["judge"],
                 server_share(model_gb, kv_gb, tp, sz.gpu_gb) / 100)]


def reward_server_name(rc) -> str:
    """The one name of the server a domain's reward config (`rc`: `kind: model | judge`) is served by, in the plan
    and for the launcher: `rm-<reward_models name>`; for a judge `judge-<dir name>-<8 hex of its resolved path>`, so
    two judge directories that share a folder name get two servers."""
    if rc.kind == "model":
        return f"rm-{rc.reward_model}"
    path = Path(rc.model).expanduser()
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return f"judge-{path.name[:40]}-{digest}"


@dataclass(frozen=True)
class RewardServer:
    """A reward model or judge checkpoint the pipeline serves for its model-rewarded domains (tasks/reward_servers.py
    `serve_rewards`: one server per checkpoint, shared by every domain that names it)."""
    name: str  # `reward_server_name`'s (tasks/reward_servers.py names its servers with it)
    path: str | None  # the checkpoint it is sized from; None: the run's model (a reward model with `init: base`)
    field: str  # the config field that names that checkpoint, for a refusal
    domains: tuple[int, ...] = ()  # indices of the domains it serves


def reward_servers(cfg) -> list[RewardServer]:
    """The reward servers `cfg` needs, in domain order: one per `reward_models` entry that a `kind: model` domain
    names (sized from its `init`: a checkpoint dir, or `base`, the run's model; the scalar head that replaces the LM
    head is negligible), one per judge checkpoint dir (`reward.model`, de-duplicated by its path as `serve_rewards`
    does), none for a domain with an external `reward.url`. A `reward.served_url` (which the pipeline sets for its
    workers once it serves the checkpoint) removes nothing: the flow process and its workers plan the same GPUs."""
    out: dict[str, RewardServer] = {}
    for i, d in enumerate(cfg.domains):
        rc = d.reward
        if rc is None or rc.url:
            continue
        if rc.kind == "model":
            init = cfg.reward_models[rc.reward_model].init
            key = f"rm:{rc.reward_model}"  # one trained checkpoint per reward_models entry
            server = RewardServer(reward_server_name(rc), None if init == "base" else init,
                                  f"reward_models.{rc.reward_model}.init")
        else:
            path = Path(rc.model).expanduser()
            key = f"judge:{path}"
            server = RewardServer(reward_server_name(rc), str(path), f"domains.{i}.reward.model")
        first = out.setdefault(key, server)
        out[key] = replace(first, domains=(*first.domains, i))
    return list(out.values())


def _reward_gb(server: RewardServer, sz: _Sizes) -> float:
    """GB of one copy of a reward server's weights: the run's model for `init: base`, else its checkpoint's size."""
    if server.path is None:
        return sz.model_gb
    try:
        params, nbytes, _ = model_size(server.path)
    except PlacementError:
        raise PlacementError(f"specialists: cannot size the reward server {server.name} at {server.field}="
                             f"{server.path!r} (no readable config.json or weight files): build it first, or serve it "
                             f"elsewhere ({_reward_urls(server)})") from None
    return params * nbytes / GB


def _reward_urls(server: RewardServer) -> str:
    return ", ".join(f"domains.{i}.reward.url" for i in server.domains)


def _rewards(cfg, sz: _Sizes, gpus: int, lanes: list[Proc]) -> list[Proc]:
    """The model rewards' servers (`reward_servers`), as the guard's judge: each a server of its checkpoint's size,
    tp 1, packed beside the specialists' lanes (and the judge) on the GPUs no trainer holds, or anywhere in the
    shared mode. KV cache: the judge's rule, half the weights and at least 0.5 GB; a reward model only runs prefill
    forwards of one /classify batch (reward.batch_size × max_length tokens: 64 × 512 of Qwen2.5-1.5B's 28 KB per
    token = 0.94 GB, under its 1.55 GB), a judge answers in reward.max_tokens. `serve_rewards` keeps them from the
    base evaluation through the student's, so the distill stage runs beside them too: unshared, they also avoid the
    student trainer's GPUs (the first distill.train.world_size), and `_distill` counts them (`held`)."""
    servers = reward_servers(cfg)
    if not servers:
        return []
    held = {g for p in lanes if p.kind == "trainer" for g in p.gpus} | set(range(cfg.distill.train.world_size))
    free = list(range(gpus)) if sz.shared else [g for g in range(gpus) if g not in held]
    used, procs = _loads(lanes), []
    for s in servers:
        model_gb = _reward_gb(s, sz)
        kv_gb = max(0.5, 0.5 * model_gb)
        tp = server_tp(model_gb, kv_gb, sz.gpu_gb, None, 1)
        share = server_share(model_gb, kv_gb, 1, sz.gpu_gb)
        placed = None if tp is None else pack([_Server(s.name, "reward", tp, share)], free, used)
        if placed is None:
            where = (f"the {gpus} GPU(s)" if sz.shared else
                     f"the {len(free)} GPU(s) no specialist or student trainer holds")
            raise PlacementError(
                f"specialists: the reward server {s.name} ({model_gb:.1f} GB weights + {kv_gb:.1f} GB KV cache = "
                f"{share / 100:.2f} of a {sz.gpu_gb:g} GB GPU) does not fit on {where} beside the specialists' lanes"
                f"{' and the servers before it' if procs else ''}: lower specialists.max_parallel, set "
                f"resources.share_gpus: true, or serve it elsewhere ({_reward_urls(s)})")
        procs.append(Proc("specialists", s.name, "reward", placed[s.name], share / 100))
    return procs


def _distill(cfg, sz: _Sizes, gpus: int, held: Sequence[Proc] = ()) -> list[Proc]:
    """The student's trainer + rollout server, and the teachers beside them (they run at the same time): on the GPUs
    the student trainer leaves free, or in the shared mode on every GPU, beside the student's share. `held`: the
    reward servers, still running (`_rewards`): their GPUs keep their shares."""
    teachers = [d for d in cfg.domain_names() if d not in cfg.teachers.external]
    if teachers and server_tp(sz.model_gb, sz.kv_gb, sz.gpu_gb, sz.fixed_tp, gpus) is None:
        raise PlacementError(f"teachers: one teacher server ({sz.model_gb:.1f} GB weights + {sz.kv_gb:.1f} GB KV "
                             f"cache + {SERVER_OVERHEAD_GB:g} GB) is larger than "
                             + (f"engine.sglang_args.tp_size={sz.fixed_tp} GPU(s)" if sz.fixed_tp else
                                f"the {gpus} GPU(s)") + f" of {sz.gpu_gb:g} GB (at most {BUDGET / 100:.2f} of each)")
    dt = cfg.distill.train
    share, gb = _trainer_share(sz, dt, 1)
    shared_fits = (lambda: _shared_fits(partial(_distill, held=held), cfg, sz, gpus)) if not sz.shared else None
    student = _lanes("distill", 1, dt.world_size, share, gb, sz, gpus, "distill.train", shared_fits, _loads(held))
    if not teachers:
        return _with_slack(student, held) if sz.shared else student
    if sz.shared:  # the student trainer holds its share; teachers may go anywhere
        used, free = _loads([*student, *held]), list(range(gpus))
    else:  # the student trainer holds its GPUs whole
        used = _loads([*student[1:], *held])
        used.update({g: used.get(g, 0) + BUDGET for g in student[0].gpus})
        free = [g for g in range(gpus) if g not in student[0].gpus]
    tp = server_tp(sz.model_gb, sz.kv_gb, sz.gpu_gb, sz.fixed_tp, len(free))
    if tp is None:
        raise PlacementError(f"teachers: one teacher server ({sz.model_gb:.1f} GB weights + {sz.kv_gb:.1f} GB KV "
                             f"cache) is larger than the {len(free)} GPU(s) of {sz.gpu_gb:g} GB left beside the "
                             f"student trainer (GPUs {list(student[0].gpus)})")
    share = server_share(sz.model_gb, sz.kv_gb, tp, sz.gpu_gb)
    servers = [_Server(d, "teacher", tp, share) for d in teachers]
    placed = pack(servers, free, used)
    if placed is None:
        fits = max((k for k in range(len(servers)) if pack(servers[:k], free, dict(used)) is not None), default=0)
        if sz.shared:
            where = (f"the {gpus} GPU(s) of {sz.gpu_gb:g} GB shared by memory fraction (resources.share_gpus: true) "
                     f"with the student trainer ({student[0].mem_fraction:.2f} of GPUs {list(student[0].gpus)}) and "
                     f"its rollout server ({student[1].mem_fraction:.2f})"
                     + (f" and {len(held)} reward server(s)" if held else ""))
            hint = "add GPUs, lower resources.kv_cache_gb, or serve some teachers elsewhere (teachers.external)"
        else:
            where = (f"the {len(free)} GPU(s) left beside the student trainer (GPUs {list(student[0].gpus)}) and its "
                     "rollout server" + (f" and {len(held)} reward server(s)" if held else ""))
            hint = "add GPUs, or serve some teachers elsewhere (teachers.external)"
            if shared_fits():
                hint += ", or set resources.share_gpus: true (trainers share GPUs by memory fraction)"
        raise PlacementError(
            f"teachers: {len(servers)} teacher servers (tp {tp}, mem_fraction {share / 100:.2f} per GPU each) do not "
            f"fit on {where}: {fits} fit; {hint}")
    procs = student + [Proc("teachers", d, "teacher", placed[d], share / 100) for d in teachers]
    return _with_slack(procs, held) if sz.shared else procs


def make_plan(cfg, gpus: int) -> Plan:
    """The placement of every stage of `cfg` on one node with `gpus` GPUs (module docstring). A stage that does not
    fit raises PlacementError, whose message names every stage that does not fit and why. `gpus` = 0: an empty
    plan (CPU: nothing is placed)."""
    sz, source = _sizes(cfg)
    plan = dict(gpus=gpus, gpu_memory_gb=sz.gpu_gb, model_gb=round(sz.model_gb, 3), model_source=source)
    if gpus <= 0:
        return Plan(**plan, shared=sz.shared)
    procs: list[Proc] = []
    errors: list[str] = []
    for stage in (_base, _specialists, _distill):
        held = [p for p in procs if p.kind == "reward"]  # the reward servers run on through the distill stage
        try:
            procs += _distill(cfg, sz, gpus, held) if stage is _distill else stage(cfg, sz, gpus)
        except PlacementError as exc:
            errors.append(str(exc))
    if errors:
        raise PlacementError(f"does not fit on {gpus} GPU(s):\n  " + "\n  ".join(errors))
    return Plan(**plan, processes=tuple(procs), shared=sz.shared)


def plan_problems(plan: Plan) -> list[str]:
    """The rules a plan breaks (empty for every plan `make_plan` returns): per stage (distill and teachers counted
    together, they run at once; the reward servers, planned in the specialists stage, counted in the distill stage
    too, which they outlive), fractions on one GPU sum to ≤ BUDGET, and unless the plan is `shared`
    (resources.share_gpus), no GPU holds two trainers and a GPU holding a trainer holds nothing else but that
    trainer's own rollout server."""
    problems: list[str] = []
    groups: dict[str, list[Proc]] = {}
    for p in plan.processes:
        groups.setdefault("distill" if p.stage == "teachers" else p.stage, []).append(p)
        if p.kind == "reward" and p.stage != "distill":
            groups.setdefault("distill", []).append(p)
    for stage, procs in groups.items():
        for g in sorted({g for p in procs for g in p.gpus}):
            on = [p for p in procs if g in p.gpus]
            total = sum(round(p.mem_fraction * 100) for p in on)
            if total > BUDGET:
                problems.append(f"{stage}: GPU {g} is {total / 100:.2f} full")
            trainers = [p for p in on if p.kind == "trainer"] if not plan.shared else []
            if len(trainers) > 1:
                problems.append(f"{stage}: GPU {g} holds {len(trainers)} trainers")
            if trainers and any(p.kind != "rollout" or p.name != trainers[0].name for p in on if p.kind != "trainer"):
                problems.append(f"{stage}: GPU {g} holds trainer {trainers[0].name} and another's server")
            if g >= plan.gpus:
                problems.append(f"{stage}: GPU {g} does not exist ({plan.gpus} GPUs)")
    return problems


# ------------------------------------------------------------------------------------------ launching


def visible_devices(environ_value: str | None, gpus: int) -> list[str]:
    """The node's device ids that plan GPU 0..gpus-1 stand for: the entries of CUDA_VISIBLE_DEVICES as the pipeline
    saw it, or 0..gpus-1 when it is unset. Raises when it lists fewer devices than the plan uses."""
    if environ_value is None or not environ_value.strip():
        return [str(i) for i in range(gpus)]
    ids = [x.strip() for x in environ_value.split(",") if x.strip()]
    if len(ids) < gpus:
        raise PlacementError(f"CUDA_VISIBLE_DEVICES={environ_value!r} shows {len(ids)} GPU(s), the plan uses {gpus} "
                             "(resources.gpus_per_node / --gpus)")
    return ids[:gpus]


def trainer_env(plan: Plan, trainer: Proc, visible: Sequence[str]) -> dict[str, str]:
    """What a trainer process gets: CUDA_VISIBLE_DEVICES = its GPUs (its ranks see them as cuda:0..W-1),
    PLACEMENT_ENV = JSON of its own rollout server's placement (read back by `rollout_placement`), and in a shared
    plan GPU_MEM_FRACTION_ENV = its mem_fraction (each rank caps its CUDA allocator at it:
    `training.deepspeed_backend.apply_gpu_memory_fraction`)."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] for g in trainer.gpus)}
    if plan.shared:
        env[GPU_MEM_FRACTION_ENV] = f"{trainer.mem_fraction:.2f}"
    rollout = plan.get(trainer.stage, trainer.name, "rollout")
    if rollout is not None:
        env[PLACEMENT_ENV] = json.dumps({"visible": list(visible), **rollout.to_json()})
    return env


def placements_of(plan: Plan, visible: Sequence[str], kind: str) -> dict[str, dict]:
    """{name: placement} of the planned servers of `kind` ("teacher", "judge", "reward"), each a `Proc.to_json()`
    plus the node's `visible` devices: what `engine.launcher.launch_settings` takes."""
    return {p.name: {"visible": list(visible), **p.to_json()} for p in plan.processes if p.kind == kind}


def rollout_placement(environ: dict[str, str] | Any) -> dict | None:
    """The rollout server placement a trainer process was given (`trainer_env`), or None."""
    raw = environ.get(PLACEMENT_ENV)
    return json.loads(raw) if raw else None


def server_launch(proc: dict, visible: Sequence[str], takes_sglang_args: bool) -> dict[str, Any]:
    """{"env": ..., "options": ...} for a server placed as `proc` (a `Proc.to_json()`). SGLang sees the node's
    devices and gets --base-gpu-id (first GPU) --tp-size (GPU count) --mem-fraction-static; a server that takes no
    SGLang options (the embedded server, CPU or CUDA) gets CUDA_VISIBLE_DEVICES = its own GPUs and, placed on
    some, --mem-fraction-static (its share of each: several embedded servers share one GPU by the plan's fractions;
    ignored by a server that runs on CPU)."""
    gpus = list(proc["gpus"])
    if takes_sglang_args:
        return {"env": {"CUDA_VISIBLE_DEVICES": ",".join(visible)},
                "options": {"base_gpu_id": gpus[0], "tp_size": len(gpus), "mem_fraction_static": proc["mem_fraction"]}}
    options = {"mem_fraction_static": proc["mem_fraction"]} if gpus else {}
    return {"env": {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] for g in gpus)}, "options": options}
