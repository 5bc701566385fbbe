"""A reward model trained on preference pairs, as a process: `python -m training.reward_main --name NAME ...` (under
torchrun when `reward_models.<name>.train.world_size > 1`). The process around `train_reward_model` is the trainer
skeleton's (training/worker.py); the stage task (tasks/reward_models.py) and `alloy rm train` launch it through the
stage launcher (tasks/stage.py).

The model: `AutoModelForSequenceClassification` (num_labels 1, `config.pad_token_id` set) from any HF causal-LM
checkpoint: the body loads, the scalar `score` head is new (seeded). Its score for a sequence is the head's output at
the last token that is not the pad token (HF's pooling), on the ids `domains.preferences.reward_input_ids` renders:
the prompt as the policy sees it, then the response and the turn's end. Each step trains on `micro_batch_size ×
grad_accum × world_size` pairs (each rank its strided share, chosen and rejected in one forward) with the
Bradley–Terry loss (training/rm_math.py), normalised by the step's global pair count so W ranks make the 1-rank update.

Checkpoints (training/checkpoints.py): every `checkpoint_every` steps `<out>/step-N` (the DeepSpeed state of every
rank + trainer.json: step, validation history); a rerun resumes the newest that verifies (the pair order is a pure
function of the step and the seed). At the end `<out>/final`: the HF model (`save_pretrained` + tokenizer, so
`AutoModelForSequenceClassification.from_pretrained(final)` loads it) and `reward_model.json` (RM_FILE: what a
server or client needs), committed with its manifest. Every rank validates on the whole held-out split every
`val_every` steps and at the end (pair accuracy, mean score gap, loss); rank 0 reports progress and logs to MLflow.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForSequenceClassification

from domains.preferences import PreferencePair, load_preferences, reward_input_ids, split_pairs
from infra.checkpoint_budget import checkpoint_rule
from infra.models import load_tokenizer, placement_kwargs
from infra.tracking import NoopTracker
from training.checkpoints import commit_checkpoint, restore_latest
from training.deepspeed_backend import DeepSpeedBackend, init_distributed
from training.progress_events import report
from training.rm_math import bradley_terry_loss
from training.session import commit_final, fresh_final, train_device, train_settings
from training.step_metrics import host_floats
from training.worker import Worker, WorkerRun, arg

log = logging.getLogger("alloy")
RM_FILE = "reward_model.json"
STATE_PARTS = ("state",)
Row = tuple[list[int], list[int], float]  # (chosen ids, rejected ids, margin)


def preference_splits(rm) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, val) pairs of a `RewardModelConfig`: `val_data` as the held-out split, else `val_fraction` of
    `data`'s prompts (domains.preferences.split_pairs)."""
    def read(path: str) -> tuple[PreferencePair, ...]:
        return load_preferences(path, rm.prompt, rm.chosen, rm.rejected, rm.margin_column, rm.max_file_mb,
                                rm.max_row_kb)

    pairs = read(rm.data)
    if rm.val_data:
        return list(pairs), list(read(rm.val_data))
    return split_pairs(pairs, rm.val_fraction)


def encode(tok, pairs: Sequence[PreferencePair], rm, mode: str) -> list[Row]:
    """Each pair's chosen and rejected sequences as `reward_input_ids` renders them, with its margin."""
    def ids(p: PreferencePair, response: str) -> list[int]:
        return reward_input_ids(tok, p.prompt, response, rm.system or "", mode, rm.max_length)

    return [(ids(p, p.chosen), ids(p, p.rejected), p.margin) for p in pairs]


def collate(rows: Sequence[Row], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (2B, T) right-padded with `pad_id`: the B chosen rows then the B rejected ones, attention_mask
    (2B, T), margin (B,)) on `device`."""
    seqs = [r[0] for r in rows] + [r[1] for r in rows]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    margin = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return ids.to(device), mask.to(device), margin.to(device)


def pair_scores(model, rows: Sequence[Row], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen scores (B,), rejected scores (B,), margins (B,)): one forward of `model` (a backend, or its module)
    over the 2B sequences; the head's float32 output at each row's last non-pad token."""
    ids, mask, margin = collate(rows, pad_id, device)
    scores = model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    return scores[:len(rows)], scores[len(rows):], margin


def load_reward_model(init_dir: str | Path, tok, device, seed: int) -> torch.nn.Module:
    """`AutoModelForSequenceClassification` (one label) of the HF dir `init_dir` (a causal LM: a new head, seeded
    with `seed`; or a reward model), its pad id the tokenizer's (EOS when it has none), in float32 on `device`."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(str(init_dir), num_labels=1, dtype=torch.float32,
                                                               **placement_kwargs(device))
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model


def step_pairs(step: int, n: int, size: int, seed: int) -> list[int]:
    """The indices of step `step`'s (1-based) `size` pairs of `n`: position i of the stream (step − 1)·size + j is
    pair perm_e[i mod n] of epoch e = i // n, each epoch a seeded shuffle. Pure in (step, n, size, seed): a resumed
    run trains on exactly the pairs the uninterrupted one would have."""
    out, perms = [], {}
    for i in range((step - 1) * size, step * size):
        e = i // n
        if e not in perms:
            perms[e] = list(range(n))
            random.Random(f"rm|{seed}|{e}").shuffle(perms[e])
        out.append(perms[e][i % n])
    return out


@torch.no_grad()
def validate(backend, rows: Sequence[Row], pad_id: int, batch: int) -> dict:
    """Held-out `val_loss` (Bradley–Terry, margins included), `val_accuracy` (r_c > r_r) and `val_margin` (mean
    r_c − r_r) over every row, in chunks of `batch` pairs, through the backend's module in eval mode (every rank
    runs the same forwards: under ZeRO-3 they are collectives)."""
    backend.eval_mode()
    try:
        parts = []
        for k in range(0, len(rows), batch):
            chunk = rows[k:k + batch]
            c, r, m = pair_scores(backend.module, chunk, pad_id, backend.device)
            loss, met = bradley_terry_loss(c, r, m, normalizer=len(rows))  # the chunks' losses sum to the mean
            parts.append({"loss": loss, "correct": met["accuracy"] * len(chunk), "gap": met["margin"] * len(chunk)})
    finally:
        backend.train_mode()
    got = host_floats(*parts)
    n = len(rows)
    return {"val_loss": sum(p["loss"] for p in got), "val_accuracy": sum(p["correct"] for p in got) / n,
            "val_margin": sum(p["gap"] for p in got) / n, "val_pairs": n}


def train_reward_model(cfg, name: str, init_dir: str | Path, work: Path, out_url: str, tracker) -> dict:
    """Train `cfg.reward_models[name]` from `init_dir` (module docstring); rank 0 commits `<out_url>/final` and
    returns the summary (every rank returns one)."""
    t_start = time.perf_counter()
    rm, mode = cfg.reward_models[name], cfg.model.chat_template
    seed = rm.seed if rm.seed is not None else cfg.run.seed
    settings = train_settings(rm.train, rm.steps, seed)
    tok = load_tokenizer(init_dir)
    init_distributed()
    backend = DeepSpeedBackend(load_reward_model(init_dir, tok, train_device(settings), seed), settings)
    pad_id = backend.module.config.pad_token_id
    if not backend.is_main:
        tracker = NoopTracker()
    train_pairs, val_pairs = preference_splits(rm)
    train_rows, val_rows = encode(tok, train_pairs, rm, mode), encode(tok, val_pairs, rm, mode)
    per_rank = rm.train.micro_batch_size
    size = per_rank * rm.train.grad_accum * backend.world_size  # pairs per optimizer step, all ranks
    log.info("reward model %s: %d train / %d held-out pairs, %d steps of %d pairs, %d rank(s)", name, len(train_rows),
             len(val_rows), rm.steps, size, backend.world_size)

    work = Path(work)
    keep, slim = checkpoint_rule(rm.keep_checkpoints, on_gpu=backend.device.type != "cpu")
    history: list[dict] = []
    start, resumed_from = _resume(backend, work, out_url, name)
    if start:
        history = json.loads((work / "resume" / "trainer.json").read_text()).get("validation", [])

    def checkpoint(step: int) -> None:
        staged = work / "rm-state"
        if backend.is_main:
            shutil.rmtree(staged, ignore_errors=True)
        backend.barrier()
        backend.save_state(staged)  # a collective: every rank writes its part into rank 0's folder (one node)
        if backend.is_main:
            commit_checkpoint(work, out_url, step, backend.world_size, {"step": step, "validation": history},
                              lambda local: shutil.move(str(staged), str(local / "state")),
                              meta={"stage": "reward_model", "name": name}, keep_last=keep, state_parts=STATE_PARTS,
                              slim=slim)

    def validation(step: int) -> dict:
        v = validate(backend, val_rows, pad_id, per_rank)
        history.append({"step": step, **v})
        if backend.is_main:
            log.info("reward model %s step %d: held-out pair accuracy %.3f, margin %.3g", name, step,
                     v["val_accuracy"], v["val_margin"])
            tracker.log_metrics({f"rm/{k}": v[k] for k in ("val_loss", "val_accuracy", "val_margin")}, step=step)
        return v

    backend.train_mode()
    m: dict = {}
    t0 = time.perf_counter()
    for step in range(start + 1, rm.steps + 1):
        idx = step_pairs(step, len(train_rows), size, seed)
        parts = []
        for g in range(rm.train.grad_accum):  # each micro-batch: this rank's strided share of its slice
            mine = idx[g * per_rank * backend.world_size:(g + 1) * per_rank * backend.world_size][backend.rank::backend.world_size]
            c, r, margin = pair_scores(backend, [train_rows[i] for i in mine], pad_id, backend.device)
            loss, met = bradley_terry_loss(c, r, margin, normalizer=backend.loss_normalizer(size))
            stepped = backend.step(loss)
            parts.append(met)
        got = host_floats(*parts)
        n = sum(p["pairs"] for p in got)  # this rank's pairs; each part's loss is its sum / loss_normalizer(size)
        m = {"loss": sum(p["loss"] for p in got) * backend.loss_normalizer(size) / n,
             "accuracy": sum(p["accuracy"] * p["pairs"] for p in got) / n,
             "margin": sum(p["margin"] * p["pairs"] for p in got) / n,
             "grad_norm": stepped.get("grad_norm", float("nan")), "lr": stepped["lr"]}
        if backend.is_main:
            report(step, rm.steps, loss=m["loss"], accuracy=m["accuracy"], margin=m["margin"])
            if step % rm.log_every == 0 or step == rm.steps:
                log.info("reward model %s step %d/%d: loss %.4g, pair accuracy %.3f, margin %.3g", name, step,
                         rm.steps, m["loss"], m["accuracy"], m["margin"])
                tracker.log_metrics({f"rm/{k}": v for k, v in m.items()}, step=step)
        if step % rm.val_every == 0 and step < rm.steps:
            validation(step)
        if step % rm.checkpoint_every == 0 and step < rm.steps:
            checkpoint(step)
    train_s = time.perf_counter() - t0
    final_val = validation(rm.steps)
    final = fresh_final(work) if backend.is_main else work / "final"
    backend.save_hf(final, tokenizer=tok)  # a collective: every rank takes part, rank 0 writes
    summary = {"name": name, "steps": rm.steps, "train": m, **final_val, "validation": history,
               "train_pairs": len(train_rows), "resumed_from": resumed_from, "world_size": backend.world_size,
               "device": str(backend.device), "train_s": train_s}
    if backend.is_main:
        (final / RM_FILE).write_text(json.dumps(reward_model_card(rm, mode, pad_id, name, summary), indent=2) + "\n")
        summary["checkpoint"] = commit_final(final, out_url, rm.steps,
                                             meta={"stage": "reward_model", "name": name,
                                                   "val_accuracy": final_val["val_accuracy"],
                                                   "world_size": backend.world_size})
    backend.close()
    return {**summary, "wall_s": time.perf_counter() - t_start}


def _resume(backend, work: Path, out_url: str, name: str) -> tuple[int, str | None]:
    """(the step the newest verified checkpoint under `out_url` reached, its URL), its DeepSpeed state loaded on
    every rank; (0, None) without one. Rank 0 fetches it into `work/resume`, which the ranks share."""
    restored = None
    if backend.is_main:
        restored = restore_latest(work, out_url, backend.world_size, who=f"reward model {name}",
                                  setting=f"reward_models.{name}.train.world_size", state_parts=STATE_PARTS,
                                  keep_setting=f"reward_models.{name}.keep_checkpoints")
    step = int(backend.all_reduce_max(restored[1]["step"] if restored else 0.0))
    if not step:
        return 0, None
    backend.load_state(work / "resume" / "state")
    url = restored[2] if restored else None
    if backend.is_main:
        log.info("reward model %s: resumed %s at step %d", name, url, step)
    return step, url


def reward_model_card(rm, mode: str, pad_id: int, name: str, summary: dict) -> dict:
    """`reward_model.json`: what a server or a client of the reward model needs besides the weights."""
    return {"kind": "reward_model", "name": name, "model_class": "AutoModelForSequenceClassification", "num_labels": 1,
            "score": "the head's output at the last token that is not pad_token_id (HF's pooling); higher is better",
            "pad_token_id": pad_id, "max_length": rm.max_length,
            "render": {"function": "domains.preferences.reward_input_ids", "chat_template": mode,
                       "system": rm.system or "", "text": "infra.chat.render_prompt_ids(prompt, system) + "
                       "infra.chat.completion_ids(response): the response and the turn's end",
                       "truncation": "longer than max_length: the last max_length ids"},
            "loss": "bradley_terry", "margin_column": rm.margin_column, "steps": summary["steps"],
            "train_pairs": summary["train_pairs"], "val_pairs": summary["val_pairs"],
            "val_accuracy": summary["val_accuracy"], "val_margin": summary["val_margin"]}


WORKER = Worker("training.reward_main", "Alloy reward-model worker (one process per rank)",
                args=(arg("--name", required=True, help="the reward model: a key of the config's reward_models"),
                      arg("--init", required=True, help="HF dir to start from (a causal LM or a reward model)"),
                      arg("--out", required=True, help="storage prefix: step-N checkpoints and <out>/final")),
                threads=lambda cfg, args: cfg.reward_models[args.name].threads, work_subdir="rm-work")


def _run(w: WorkerRun) -> dict:
    if w.args.name not in w.cfg.reward_models:
        raise SystemExit(f"--name {w.args.name!r}: no such reward model in the config's reward_models "
                         f"({sorted(w.cfg.reward_models)})")
    return train_reward_model(w.cfg, w.args.name, w.args.init, w.work_dir, w.args.out, w.tracker)


def main(argv: list[str] | None = None) -> int:
    return WORKER.main(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
