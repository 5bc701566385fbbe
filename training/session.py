"""What the base, specialist and student trainers share, and the one stage order of the two RL trainers
(teachers/specialist_main.py, student/distill_main.py), `run_stage`:

    tok, backend = trainable(init_dir, train_settings(section, steps, seed))    join torch.distributed, build
    trainer = ...Trainer(..., ranks=ranks)                                    once, on every rank (services on rank 0)
    run_stage(trainer, ranks, ...):
        ranks > 0: follow rank 0's collective steps until it finishes, close the backends
        rank 0:    serve_dir = trainer.resume() or init_dir                   training/checkpoints.py
                   summary = serve_and_run(engine_cfg, work, name, serve_dir, loop=trainer.run, ...)
                   summary = finish(summary, fresh_final(work))               the stage's own: select, save, eval, commit
                   end_stage(summary, ranks, backends)                        world size, release followers, close
"""
from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import torch

from training.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed
from engine.launcher import Supervisor
from infra.devices import resolve_dtype
from infra.procs import run_async
from infra.models import load_model, load_tokenizer
from training.policy_server import PolicyServer
from training.checkpoints import drop_resume_checkpoints
from training.ranks import process_world_size
from infra.storage import join, save_checkpoint


def train_settings(t, total_steps: int, seed: int, **overrides) -> TrainSettings:
    """`TrainSettings` from a config's `TrainConfig` section `t` (`base.train`, `specialists.policy_train`,
    `distill.train`, ...) for `total_steps` optimizer steps; `overrides` replace single fields (grad_accum=1). A
    cosine decays over `t.lr_decay_steps` when set (the stage then stops on the way down), else over `total_steps`."""
    kw = dict(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage, dtype=t.dtype,
              micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, warmup_steps=t.warmup_steps,
              lr_schedule=t.lr_schedule, total_steps=t.lr_decay_steps or total_steps, seed=seed,
              micro_batch_tokens=t.micro_batch_tokens, gradient_checkpointing=t.gradient_checkpointing)
    return TrainSettings(**{**kw, **overrides})


def train_device(settings: TrainSettings) -> torch.device:
    """Where this rank's trained weights are read to: its accelerator device (DeepSpeed's, after
    `init_distributed`), in float32 (DeepSpeed keeps the fp32 master weights and casts its bf16/fp16 copy itself).
    ZeRO-3 reads them on the host: each rank keeps only its shard, and a whole copy per GPU could not fit there."""
    from deepspeed.accelerator import get_accelerator

    return torch.device("cpu") if settings.zero_stage == 3 else torch.device(get_accelerator().current_device_name())


def trainable(init_dir: str | Path, settings: TrainSettings) -> tuple[Any, DeepSpeedBackend]:
    """(tokenizer, DeepSpeed backend over the model) of the HF dir `init_dir`, after joining torch.distributed."""
    tok = load_tokenizer(init_dir)
    init_distributed()
    return tok, DeepSpeedBackend(load_model(init_dir, device=train_device(settings)), settings)


def frozen_copy(model_dir: str | Path, beside: DeepSpeedBackend) -> torch.nn.Module:
    """The HF dir `model_dir` as a frozen model next to `beside`'s: on its device, in its training dtype (bf16 or
    fp16 as it trains, fp32 otherwise): the specialists' KL reference and the selected best policy. No float32
    host copy of a model that trains on a GPU."""
    return load_model(model_dir, dtype=resolve_dtype(beside.settings.dtype, beside.device), device=beside.device)


def serve_and_run(engine_cfg, work: Path, name: str, model_dir: str | Path, *, version: int, seed: int,
                  server_dir: str, attach: Callable[[PolicyServer], None], loop: Callable[[], Awaitable[dict]],
                  closers: Iterable[Any] = ()) -> dict:
    """Serve `model_dir` as engine server `name` (an `engine.launcher.Supervisor` restarts it if it dies; logs
    under `work/logs`, weight pushes staged in `work/<server_dir>`), hand the `PolicyServer` to the trainer with
    `attach`, and run `loop()` in a fresh event loop. However the loop ends (a signal included), the server client
    and every `closers` item (`await c.aclose()`) are closed and the supervisor stops the server process."""
    with Supervisor.for_engine(work / "logs", engine_cfg) as sup:
        server = PolicyServer.for_engine(engine_cfg, sup, name, str(model_dir), work / server_dir, version=version,
                                         seed=seed)
        attach(server)
        gc.freeze()  # models, optimizer, libraries loaded: keep the cyclic GC off them for the rest of the run

        async def go() -> dict:
            try:
                return await loop()
            finally:
                await server.aclose()
                for c in closers:
                    await c.aclose()

        return run_async(go())  # a stop signal cancels go() through the loop: the finally above runs in full


def run_stage(trainer, ranks, *, engine_cfg, work: Path, init_dir: str | Path, server_name: str, server_dir: str,
              seed: int, attach: Callable[[PolicyServer], None], backends: Iterable[Any],
              finish: Callable[[dict, Path], dict], closers: Iterable[Any] = ()) -> dict:
    """Run one RL trainer's stage, in the order of the module docstring, and return its summary.

    `trainer` has `resume()` (the local HF dir of the newest checkpoint it restored, or None), `run()` (the loop,
    a coroutine) and `state.step`; it was built with `ranks`, so its collective steps are registered on every rank.
    Rank 0 serves the restored weights (else `init_dir`) as engine server `server_name` (`serve_and_run`), runs the
    loop, then `finish(summary, final_dir)` writes and commits `final/` and returns the summary. A rank > 0 (torchrun)
    follows rank 0's announced steps (its shard of each batch, its part of each save) until rank 0 finishes and
    returns its `world_size`. `backends` (the trainer's DeepSpeed backends) are closed on every rank."""
    backends = tuple(backends)
    if not ranks.is_main:
        ranks.follow()
        for b in backends:
            b.close()
        return {"world_size": ranks.world_size}
    serve_dir = trainer.resume() or init_dir
    summary = serve_and_run(engine_cfg, work, server_name, serve_dir, version=trainer.state.step, seed=seed,
                            server_dir=server_dir, attach=attach, loop=trainer.run, closers=closers)
    return end_stage(finish(summary, fresh_final(work)), ranks, backends)


def end_stage(summary: dict, ranks, backends: Iterable[Any]) -> dict:
    """Rank 0 after the final commit: `summary` with the world size this stage trained in (report.json), the
    followers released, the backends closed."""
    summary["world_size"] = process_world_size()
    ranks.finish()
    for b in backends:
        b.close()
    return summary


def fresh_final(work: Path) -> Path:
    """`work/final`, emptied: where a trainer writes the HF model it commits as `final/`."""
    final = work / "final"
    shutil.rmtree(final, ignore_errors=True)
    return final


def commit_final(final: Path, out_url: str, step: int, meta: dict, *, drop_resume: bool = False) -> str:
    """Commit the HF dir `final` as `<out_url>/final` (COMPLETE manifest last); returns its URL. `drop_resume` (a
    trainer on a GPU: `infra.checkpoint_budget.checkpoint_rule`): then delete its resumable `step-*` checkpoints,
    which a rerun never reads once final/ is complete."""
    url = save_checkpoint(str(final), join(out_url, "final"), step, meta=meta)
    if drop_resume:
        drop_resume_checkpoints(out_url)
    return url
