"""Base stage: SFT of a fresh tiny model (or a given HF checkpoint) on mixed-domain demonstrations.

Produces the base checkpoint every later stage starts from. The checkpoint is committed to storage with a
COMPLETE manifest; a rerun with the same config reuses it instead of training again.
"""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed
from infra.models import init_model_dir, load_model, load_tokenizer
from infra.progress import progress
from infra.sft import train_sft
from infra.storage import join, latest_complete, load_checkpoint, save_checkpoint
from tasks.context import RunContext, stage_timer

log = logging.getLogger("alloy")


def demonstrations(domains: dict, n_per_domain: int, seed: int) -> list[tuple[str, str]]:
    """Mixed-domain (prompt, answer) pairs from each domain's train split, shuffled."""
    pairs = [(ex.prompt, ex.answer) for dom in domains.values() for ex in dom.split("train", n_per_domain, seed)]
    random.Random(seed).shuffle(pairs)
    return pairs


def train_settings(train_cfg, total_steps: int, seed: int) -> TrainSettings:
    t = train_cfg
    return TrainSettings(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                         dtype=t.dtype, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                         warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule, total_steps=total_steps, seed=seed)


@task(name="train-base", cache_policy=NO_CACHE)
def train_base(ctx: RunContext) -> str:
    """Return the local directory of the base checkpoint (HF format)."""
    cfg = ctx.cfg
    prefix = join(ctx.storage_url, f"base-{cfg.fingerprint('model', 'domains', 'base', 'run')[:10]}")
    local = ctx.work_dir / "base"
    with stage_timer(ctx, "base"):
        found = latest_complete(prefix) if cfg.run.resume else None
        if found:
            log.info("base: reusing complete checkpoint %s", found)
            if local.exists():
                shutil.rmtree(local)
            load_checkpoint(found, str(local))
            return str(local)

        init_dir = ctx.work_dir / "base-init"
        if cfg.model.path:
            init_dir = Path(cfg.model.path)
        else:
            init_model_dir(cfg.model.preset, init_dir, seed=cfg.run.seed)
        tok = load_tokenizer(init_dir)
        model = load_model(init_dir)
        pairs = demonstrations(ctx.domains, cfg.base.n_train_per_domain, cfg.run.seed)
        log.info("base: SFT of %s on %d demonstrations from %d domains, %d steps",
                 cfg.model.path or f"a fresh '{cfg.model.preset}' model", len(pairs), len(ctx.domains), cfg.base.steps)
        init_distributed()
        backend = DeepSpeedBackend(model, train_settings(cfg.base.train, cfg.base.steps, cfg.run.seed))
        batch = cfg.base.train.micro_batch_size * backend.world_size
        with ctx.tracker.child("base", tags={"stage": "base"}) as run, progress("base SFT", cfg.base.steps) as bar:
            def on_step(step: int, m: dict) -> None:
                bar(step, loss=m["loss"], acc=m["token_acc"])
                if step % cfg.base.log_every == 0 or step == cfg.base.steps:
                    run.log_metrics({"sft/loss": m["loss"], "sft/token_acc": m["token_acc"],
                                     "sft/grad_norm": float(m.get("grad_norm", 0.0))}, step=step)

            train_sft(backend, tok, pairs, cfg.base.steps, batch, seed=cfg.run.seed, on_step=on_step)
        if local.exists():
            shutil.rmtree(local)
        backend.save_hf(str(local), tokenizer=tok)
        url = save_checkpoint(str(local), join(prefix, f"step-{cfg.base.steps:08d}"), step=cfg.base.steps,
                              meta={"stage": "base", "config_fingerprint": cfg.fingerprint()})
        log.info("base: committed %s", url)
        return str(local)
