"""Base SFT as a process: `python -m tasks.base_worker` (under torchrun when base.train.world_size > 1).

Every rank runs the same code on its shard of each global batch; rank 0 logs metrics (to an existing MLflow run,
by id) and writes the HF checkpoint. The Prefect task `train_base` runs this in-process for one rank, or launches it
under torchrun for several.
"""
from __future__ import annotations

import argparse
import logging
import random
import sys

from infra.config import load_config
from infra.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed, shutdown_distributed
from infra.models import load_model, load_tokenizer
from infra.progress import progress
from infra.sft import train_sft
from infra.tracking import NoopTracker, Tracker

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


def run_base_sft(cfg, domains: dict, init_dir: str, out_dir: str, tracker) -> dict:
    """SFT `init_dir` on the config's demonstrations; rank 0 saves the result to `out_dir` (HF format)."""
    tok = load_tokenizer(init_dir)
    model = load_model(init_dir)
    pairs = demonstrations(domains, cfg.base.n_train_per_domain, cfg.run.seed)
    init_distributed()
    backend = DeepSpeedBackend(model, train_settings(cfg.base.train, cfg.base.steps, cfg.run.seed))
    if not backend.is_main:
        tracker = NoopTracker()
    log.info("base: SFT on %d demonstrations from %d domains, %d steps, %d rank(s)",
             len(pairs), len(domains), cfg.base.steps, backend.world_size)
    batch = cfg.base.train.micro_batch_size * backend.world_size
    with progress("base SFT", cfg.base.steps) as bar:
        def on_step(step: int, m: dict) -> None:
            if backend.is_main:
                bar(step, loss=m["loss"], acc=m["token_acc"])
            if step % cfg.base.log_every == 0 or step == cfg.base.steps:
                tracker.log_metrics({"sft/loss": m["loss"], "sft/token_acc": m["token_acc"],
                                     "sft/grad_norm": float(m.get("grad_norm", 0.0))}, step=step)

        last = train_sft(backend, tok, pairs, cfg.base.steps, batch, seed=cfg.run.seed, on_step=on_step)
    backend.save_hf(out_dir, tokenizer=tok)
    return last


def main(argv: list[str] | None = None) -> int:
    from tasks.context import load_domains

    p = argparse.ArgumentParser(description="Alloy base SFT worker (one process per rank)")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--init", required=True, help="HF dir to start from")
    p.add_argument("--out", required=True, help="where rank 0 writes the HF checkpoint")
    p.add_argument("--mlflow-run-id", default=None, help="log metrics to this existing MLflow run (rank 0)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(args.config, args.set)
    tracker = NoopTracker()
    if args.mlflow_run_id and cfg.tracking.enabled:
        tracker = Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri)
        tracker = tracker.resume(args.mlflow_run_id)
    try:
        run_base_sft(cfg, load_domains(cfg), args.init, args.out, tracker)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
