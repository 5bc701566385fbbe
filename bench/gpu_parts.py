"""The pieces bench/gpu_profile.py and bench/gpu_perf.py share: a fresh model of a preset, the embedded engine
driven in process (`engine.scheduler.Engine.submit` with `Seq`s, its own counters read around a workload), HF's
fast `generate` on the same device (static cache + `torch.compile`, as the transformers docs recommend), one SFT
and one PPO step of the trainers at a given token budget, and the FLOPs of a training token.

Imports no torch at module level (the benches import this before they decide the device).
"""
from __future__ import annotations

import inspect
import random
import threading
import time
import traceback
from pathlib import Path

import yaml

from harness import REPO, safetensors_params

# the engine's own counters (engine/scheduler.py); read with getattr, so a renamed one reads as None
ENGINE_COUNTERS = ("steps", "decode_rows", "decode_seconds", "prefill_seconds", "prefill_forwards", "prefill_tokens",
                   "engine_cpu_seconds", "decode_cpu_seconds", "idle_seconds", "decode_segments", "decode_holes",
                   "bucketed_steps")
FIRST_ID = 5  # prompts draw ids >= 5: no pad/bos/eos/unk/newline of the char tokenizer (infra/tokenizer.py)


# -- device, models ------------------------------------------------------------------------------------------------
def resolve(device: str):
    """(torch.device, dtype, card name or None): cuda → the current GPU in bfloat16; cpu → float32."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device())
        return dev, torch.bfloat16, torch.cuda.get_device_name(dev)
    return torch.device("cpu"), torch.float32, None


def card_tag(name: str | None) -> str:
    """"NVIDIA H200" → "h200"; None (the CPU) → "cpu"."""
    if not name:
        return "cpu"
    words = [w for w in name.replace("-", " ").split() if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    return (words[0] if words else name).lower()


def sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def make_model(preset: str, root: Path, seed: int = 0) -> Path:
    """A fresh `preset` model + char tokenizer under `root/preset` (once)."""
    from infra.models import init_model_dir

    out = Path(root) / preset
    return out if (out / "config.json").is_file() else init_model_dir(preset, out, seed=seed)


def model_shape(model_dir: Path) -> dict:
    """{"params", "layers", "hidden", "context"} of an HF dir (params counted from the safetensors headers)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {"params": _params(Path(model_dir)), "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
            "context": cfg.get("max_position_embeddings")}


def _params(model_dir: Path) -> int:
    return sum(safetensors_params(st) for st in model_dir.glob("*.safetensors"))


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs of one token at context seq_len: the product's `training.mfu.flops_per_token`
    (6·N + 12·layers·hidden·seq_len), the count the trainers log their MFU with."""
    from training.mfu import ModelShape
    from training.mfu import flops_per_token as f

    return f(ModelShape(params, layers, hidden), seq_len)


def peak_tflops(card: str | None) -> float | None:
    """The card's dense bf16 peak (`training.mfu.PEAK_TFLOPS`; None for a CPU or an unknown card)."""
    from training.mfu import card_peak

    return card_peak(card)


# -- workloads -----------------------------------------------------------------------------------------------------
def prompts(n: int, length: int, seed: int, vocab: int = 100) -> list[list[int]]:
    """n prompts of `length` ids: BOS (1) then random ids in [FIRST_ID, vocab)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(FIRST_ID, vocab) for _ in range(length - 1)] for _ in range(n)]


def domain_lengths() -> list[int]:
    """Response lengths a trained policy makes on the pipeline's GPU domains (configs/gpu-1.yaml): each domain's
    reference answer + EOS, over 50 train examples per domain."""
    from domains.registry import load_domain

    cfg = yaml.safe_load((REPO / "configs" / "gpu-1.yaml").read_text())
    out = []
    for d in cfg["domains"]:
        dom = load_domain(d["name"], difficulty=d.get("difficulty", 1))
        out += [len(e.answer) + 1 for e in dom.split("train", 50, 0)]
    return out


def mix_lengths(n: int, cap: int, seed: int, batch: int, tail: float = 0.125) -> list[int]:
    """A rollout-like mix of `n` response lengths: a share `tail` of the rows run to `cap` (a policy that has not
    learnt to stop yet: the long tail), the rest draw a domain answer's length (`domain_lengths`). The first row of
    every `batch` is a tail row, so each batch's longest is `cap` (the same shapes for the compiled HF peer)."""
    rng = random.Random(seed)
    pool = domain_lengths()
    return [cap if (i % batch == 0 or rng.random() < tail) else min(cap, rng.choice(pool)) for i in range(n)]


# -- the engine, in process ----------------------------------------------------------------------------------------
def engine_kwargs_supported() -> set[str]:
    from engine.scheduler import Engine

    return set(inspect.signature(Engine.__init__).parameters)


def start_engine(model_dir: Path, device, max_running: int, cuda_graph: bool | None = None):
    """An `Engine` on `device` (dtype auto: bf16 on CUDA), started and ready. `cuda_graph` is passed only when the
    Engine takes it (the option the decode-step rewrite adds)."""
    from engine.scheduler import Engine

    kw = {}
    if cuda_graph is not None and "cuda_graph" in engine_kwargs_supported():
        kw["cuda_graph"] = cuda_graph
    eng = Engine(str(model_dir), device=str(device), dtype="auto", max_running_requests=max_running, **kw)
    eng.start()
    if not eng.ready.wait(600) or eng.load_error:
        raise RuntimeError(f"engine on {device} did not start: {eng.load_error}")
    return eng


def engine_options(eng) -> dict:
    """What the engine ran with, for the JSON's meta (options the engine may not have read as None)."""
    return {"device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", ""),
            "max_running_requests": eng.max_running_requests, "cuda_graph": getattr(eng, "cuda_graph", None),
            **graph_info(eng),
            "init_kwargs": sorted(engine_kwargs_supported() - {"self"})}


def graph_info(eng) -> dict:
    """The decode path and its CUDA graph counters (graphs captured, replays, capture seconds, a capture error)."""
    info = eng.graph_info() if hasattr(eng, "graph_info") else {}
    return {"decode_path": "static" if getattr(eng, "_static", False) else "segments", **info}


def counters(eng) -> dict:
    return {k: getattr(eng, k, None) for k in ENGINE_COUNTERS}


def counter_delta(before: dict, after: dict) -> dict:
    """The counters' change over a workload, and per decode step: decode wall ms, engine-thread CPU ms (the host
    work of a step: on a GPU the launches and syncs; prefill steps included), rows."""
    d = {k: (after[k] - before[k]) if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))
         else None for k in after}
    steps = d.get("steps") or 0
    per = {}
    if steps:
        per = {"decode_ms_per_step": _ms(d.get("decode_seconds"), steps),
               "engine_cpu_ms_per_step": _ms(d.get("engine_cpu_seconds"), steps),
               "rows_per_step": round(d["decode_rows"] / steps, 2) if d.get("decode_rows") is not None else None}
    return {"delta": d, **per}


def _ms(seconds, steps):
    return None if seconds is None else round(1000 * seconds / steps, 4)


def run_engine(eng, prompt_list: list[list[int]], lengths: list[int], concurrency: int, ignore_eos: bool,
               temperature: float = 1.0, tag: str = "r") -> dict:
    """Run every prompt through `eng` with at most `concurrency` in flight (closed loop: a finished request's slot
    is refilled at once, as `concurrency` clients would); row i decodes at most lengths[i] tokens (exactly, with
    `ignore_eos`). Returns wall, output tokens, tokens/s and the engine's counters over the run."""
    from engine.protocol import SamplingSpec, SeqSpec
    from engine.scheduler import Seq

    n = len(prompt_list)
    done = threading.Event()
    lock = threading.Lock()
    state = {"next": 0, "finished": 0, "tokens": 0, "errors": []}

    def make(i: int):
        sp = SamplingSpec(max_new_tokens=lengths[i], temperature=temperature, top_p=1.0, top_k=-1,
                          ignore_eos=ignore_eos)
        s = Seq(SeqSpec(rid=f"{tag}-{i}", input_ids=tuple(prompt_list[i]), sampling=sp, abort_keys=frozenset()))
        s.on_done = on_done
        return s

    def on_done(s) -> None:
        fr = (s.result.finish_reason or {}).get("type")
        nxt = None
        with lock:
            state["finished"] += 1
            state["tokens"] += len(s.result.output_ids)
            if fr not in ("length", "stop"):
                state["errors"].append(s.result.finish_reason)
            if state["next"] < n:
                nxt = state["next"]
                state["next"] += 1
            if state["finished"] == n:
                done.set()
        if nxt is not None:
            eng.submit([make(nxt)])

    before = counters(eng)
    first = min(concurrency, n)
    state["next"] = first
    t0 = time.perf_counter()
    eng.submit([make(i) for i in range(first)])
    if not done.wait(1800):
        raise RuntimeError(f"engine run {tag}: {state['finished']} of {n} requests finished in 1800 s")
    wall = time.perf_counter() - t0
    if state["errors"]:
        raise RuntimeError(f"engine run {tag}: {len(state['errors'])} requests failed: {state['errors'][:3]}")
    return {"requests": n, "concurrency": concurrency, "wall_s": round(wall, 4), "output_tokens": state["tokens"],
            "tokens_per_s": round(state["tokens"] / wall, 1), **counter_delta(before, counters(eng))}


# -- HF generate, configured for speed ---------------------------------------------------------------------------
def hf_fast_model(model_dir: Path, device, dtype, compile_forward: bool):
    """The HF model as transformers' docs configure it for fast generation ("LLM inference optimization"):
    a static KV cache, and `model.forward` under `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA
    graphs). Without `compile_forward` (the CPU default: no CUDA graphs there) only the static cache."""
    import torch

    from infra.models import load_model

    model = load_model(model_dir, dtype=dtype, device=device)
    model.generation_config.cache_implementation = "static"
    if compile_forward:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model


def hf_generate(model, prompt_list: list[list[int]], lengths: list[int], batch: int, honour_eos: bool) -> dict:
    """`model.generate` over the prompts in batches of `batch` (same-length prompts: no padding), sampled at
    temperature 1 over the full vocabulary. Row i stops after lengths[i] tokens (a per-row StoppingCriteria: the row
    pads on, as a row that sampled EOS does, until the batch's longest ends) or at EOS when `honour_eos`. Useful
    tokens: each row's tokens up to its stop (EOS included)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    dev = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos

    class RowLengths(StoppingCriteria):
        def __init__(self, prompt_len: int, lens: list[int]):
            self.p, self.lens = prompt_len, torch.tensor(lens, device=dev)

        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - self.p) >= self.lens  # (B,) bool on the device: no host sync

    useful, t0 = 0, time.perf_counter()
    for a in range(0, len(prompt_list), batch):
        rows, lens = prompt_list[a:a + batch], lengths[a:a + batch]
        ids = torch.tensor(rows, device=dev)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max(lens), min_new_tokens=0,
                             eos_token_id=eos if honour_eos else None, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([RowLengths(ids.shape[1], lens)]))
        gen = out[:, ids.shape[1]:].tolist()
        for g, L in zip(gen, lens):
            g = g[:L]
            useful += (g.index(eos) + 1) if (honour_eos and eos in g) else len(g)
    sync(dev)
    wall = time.perf_counter() - t0
    return {"requests": len(prompt_list), "batch": batch, "wall_s": round(wall, 4), "output_tokens": useful,
            "tokens_per_s": round(useful / wall, 1)}


# -- the trainers: one SFT step, one PPO step ---------------------------------------------------------------------
def train_settings(device, micro_batch: int):
    from training.ds_config import TrainSettings

    return TrainSettings(lr=1e-5, dtype="bf16" if device.type == "cuda" else "fp32", micro_batch_size=micro_batch,
                         seed=0)


def sft_setup(model_dir: Path, device, rows: int, seq_len: int):
    """(backend, tokenizer, pairs) for SFT steps of `rows` sequences of exactly `seq_len` tokens (a 16-char prompt,
    the rest completion), through the product's `training.sft.train_sft`."""
    from training.session import trainable

    tok, backend = trainable(str(model_dir), train_settings(device, rows))
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    n_completion = seq_len - 2 - 15  # BOS + 15 prompt chars + completion + EOS
    pairs = [("".join(rng.choice(letters) for _ in range(15)), "".join(rng.choice(letters) for _ in range(n_completion)))
             for _ in range(rows)]
    return backend, tok, pairs


def sft_steps(backend, tok, pairs, steps: int, on_step=None) -> list[dict]:
    """`steps` SFT steps on `pairs` (one batch of all of them each step); per step wall s and tokens forwarded."""
    from training.sft import train_sft

    marks = []
    t = [time.perf_counter()]

    def cb(step, metrics):
        sync(backend.device)
        now = time.perf_counter()
        marks.append({"wall_s": now - t[0], "tokens": metrics.get("forward_tokens"), "loss": metrics.get("loss")})
        t[0] = now
        if on_step is not None:
            on_step(step)

    train_sft(backend, tok, pairs, steps=steps, batch_size=len(pairs), on_step=cb)
    return marks


def ppo_setup(model_dir: Path, device, rows: int, seq_len: int, prompt_len: int = 16):
    """(policy, critic, batch): two DeepSpeed backends built as teachers/specialist_main.py builds them, and one
    PPO batch (`teachers.ppo_step.build_batch`) of `rows` samples of `seq_len` tokens: a `prompt_len` prompt and
    random outputs with rollout log-probs log(1/100), rewards alternating 1 / 0."""
    from teachers.april import Sample
    from teachers.critic import ValueModel
    from teachers.ppo_step import build_batch
    from training.deepspeed_backend import DeepSpeedBackend
    from training.session import train_device, trainable

    settings = train_settings(device, rows)
    tok, policy = trainable(str(model_dir), settings)
    critic = DeepSpeedBackend(ValueModel.from_pretrained(model_dir, device=train_device(settings)), settings)
    n_out = seq_len - prompt_len
    rng = random.Random(1)
    samples = [Sample(sample_id=f"s{i}", rollout_id=f"s{i}", prompt_ids=prompts(1, prompt_len, i)[0],
                      output_ids=[rng.randrange(FIRST_ID, 100) for _ in range(n_out)],
                      output_logprobs=[-4.6] * n_out, token_versions=[0] * n_out, domain="bench", example={},
                      finish_reason="length") for i in range(rows)]
    batch = build_batch(samples, tok.pad_token_id, rewards=[float(i % 2) for i in range(rows)])
    return policy, critic, batch


def ppo_steps(policy, critic, batch, steps: int, on_step=None) -> list[dict]:
    """`steps` PPO updates (`teachers.ppo_step.ppo_update`, one epoch: one optimizer step of policy and critic)."""
    from teachers.ppo_step import ppo_update

    marks = []
    for step in range(steps):
        t0 = time.perf_counter()
        m = ppo_update(policy, critic, batch, ppo_epochs=1)
        sync(policy.device)
        marks.append({"wall_s": time.perf_counter() - t0, "tokens": int(batch.attention_mask.sum()),
                      "trained_tokens": m.get("num_tokens"), "pg_loss": m.get("pg_loss")})
        if on_step is not None:
            on_step(step)
    return marks


def close(*backends) -> None:
    import gc

    for b in backends:
        try:
            b.close()
        except Exception:  # noqa: BLE001 - best effort: the next part needs the memory, not the error
            pass
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def run_part(bench: str, name: str, fn, parts: dict) -> dict:
    """`fn()` as part `name` of a bench that must not lose its other parts to one failure: its result, or its error
    and traceback, with `part_s`, stored in `parts[name]` and printed on one line."""
    t0 = time.monotonic()
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - one failed part must not lose the others
        res = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-3000:]}
    res["part_s"] = round(time.monotonic() - t0, 2)
    parts[name] = res
    status = "FAILED " + res["error"][:300] if "error" in res else res.get("skipped", "ok")
    print(f"{bench} {name}: {status} ({res['part_s']} s)", flush=True)
    return res

