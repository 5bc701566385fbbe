"""Base SFT as a process: `python -m training.base_main` (under torchrun when base.train.world_size > 1).

Every rank runs the same code on its shard of each global batch; rank 0 reports each step as a progress event
(training/progress_events.py), logs metrics (to an existing MLflow run, by id) and commits the HF model as
`<--out>/final`, like every trainer of the pipeline. The Prefect task `train_base` launches it through the stage
launcher (tasks/stage.py). The process around `run_base_sft` is the trainer skeleton's (training/worker.py).
"""
from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path
from typing import Callable

from domains.compaction import (Compaction, Compactions, compacted_demonstration, compaction_for, compactions_of,
                                tokenizer_summarizer)
from domains.evaluate import score_examples
from domains.registry import load_domains
from domains.tools import demonstration_segments
from infra.chat import PromptRenderer, system_of
from infra.tracking import NoopTracker
from training.mfu import mfu
from training.progress_events import report
from training.sft import train_sft
from training.session import commit_final, fresh_final, train_settings, trainable
from training.worker import Worker, WorkerRun, arg

log = logging.getLogger("alloy")


def demonstrations(domains: dict, n_per_domain: int, seed: int, tool_trajectories: bool = False,
                   compaction: Compactions = None, tokenizer=None, chat_template: str = "auto") -> list[tuple]:
    """Mixed-domain (prompt, completion, system message) triples from each domain's train split, shuffled. The
    completion is the answer; with `tool_trajectories` (`base.tool_trajectories`), for a domain with a
    `tool_demonstration`, the intended trajectory as `(text, trained)` segments, tool output lines untrained
    (`domains.tools.demonstration_segments`, `training.sft.encode_pair`). With a policy-summary `compaction`
    (`specialists.max_context_tokens`, `compaction_summary: policy`; one for every domain, or a mapping domain →
    compaction, `specialists.per_domain` merged in: `compactions_of`) and a `tokenizer`, a domain with `summary_of`
    is demonstrated compacted as its rollouts would be: the env's request untrained, the summary line trained
    (`domains.compaction.compacted_demonstration`), so the base knows how to write its summaries."""
    def policy_compaction(name: str) -> Compaction | None:
        c = compaction_for(compaction, name)
        return c if c is not None and c.summary == "policy" and tokenizer is not None else None

    policy = any(policy_compaction(name) for name in domains)
    render = PromptRenderer(tokenizer, chat_template) if policy else None
    summarize = tokenizer_summarizer(tokenizer) if policy else None

    def completion(dom, ex):
        if tool_trajectories and callable(getattr(dom, "tool_demonstration", None)):
            own = policy_compaction(dom.name)
            if own is not None and callable(getattr(dom, "summary_of", None)):
                return compacted_demonstration(render.example_ids(dom, ex), dom.intended_calls(ex), ex.answer,
                                               lambda n: dom.summary_of(ex, n), own, summarize)
            return demonstration_segments(dom, ex)
        return ex.answer

    pairs = [(ex.prompt, completion(dom, ex), system_of(dom, ex)) for dom in domains.values()
             for ex in dom.split("train", n_per_domain, seed)]
    random.Random(seed).shuffle(pairs)
    return pairs


def score_stop(cfg, domains: dict, tok, backend, tracker, history: list) -> Callable[[int], bool] | None:
    """`base.stop_at_score`'s check for `train_sft`: every `val_every` steps, the mean over the domains of the greedy
    score on `val_n` prompts of each one's val split; true once it reaches the target. Every rank scores its own
    whole copy of the weights (ZeRO ≤ 2, checked by the config), so all stop at the same step. Appends
    {step, mean, per domain} to `history`. None without `stop_at_score`."""
    b = cfg.base
    if b.stop_at_score is None:
        return None
    examples = {name: dom.split("val", b.val_n, cfg.run.seed) for name, dom in domains.items()}

    def check(step: int) -> bool:
        if step % b.val_every:
            return False
        backend.eval_mode()
        try:
            scores = score_examples(backend.module, tok, domains, examples, cfg.eval.max_new_tokens,
                                    cfg.eval.batch_size, chat_template=cfg.model.chat_template,
                                    compaction=compactions_of(cfg.specialists, domains))
        finally:
            backend.train_mode()
        per = {name: sum(v) / max(len(v), 1) for name, v in scores.items()}
        mean = sum(per.values()) / max(len(per), 1)
        history.append({"step": step, "mean": mean, "domains": per})
        if backend.is_main:
            log.info("base SFT step %d: validation mean %.3f over %d domains (stop at %.3f)", step, mean, len(per),
                     b.stop_at_score)
            tracker.log_metrics({"sft/val_mean": mean, **{f"sft/val/{n}": v for n, v in per.items()}}, step=step)
        return mean >= b.stop_at_score
    return check


def run_base_sft(cfg, domains: dict, init_dir: str, work: Path, out_url: str, tracker) -> dict:
    """SFT `init_dir` on the config's demonstrations; rank 0 commits the result as `<out_url>/final` (HF format)."""
    t_start = time.perf_counter()
    tok, backend = trainable(init_dir, train_settings(cfg.base.train, cfg.base.steps, cfg.run.seed))
    pairs = demonstrations(domains, cfg.base.n_train_per_domain, cfg.run.seed, cfg.base.tool_trajectories,
                           compactions_of(cfg.specialists, domains), tok, cfg.model.chat_template)
    if not backend.is_main:
        tracker = NoopTracker()
    log.info("base: SFT on %d demonstrations from %d domains, %d steps, %d rank(s)",
             len(pairs), len(domains), cfg.base.steps, backend.world_size)
    batch = cfg.base.train.micro_batch_size * backend.world_size
    forwarded = [0.0]  # positions this rank trained on (benchmarks: MFU)
    done = {"flops": 0.0, "step_s": 0.0}  # this rank's training FLOPs and its steps' time (training/mfu.py)

    def on_step(step: int, m: dict) -> None:
        forwarded[0] += m.get("forward_tokens", 0.0)
        done["flops"] += m.get("train_flops", 0.0)
        done["step_s"] += m.get("step_s", 0.0)
        if not backend.is_main:
            return
        report(step, cfg.base.steps, loss=m["loss"], token_acc=m["token_acc"])  # the stage launcher follows these
        if step % cfg.base.log_every == 0 or step == cfg.base.steps:
            log.info("base SFT step %d/%d: loss %.4g, token_acc %.4g", step, cfg.base.steps, m["loss"],
                     m["token_acc"])
            tracker.log_metrics({"sft/loss": m["loss"], "sft/token_acc": m["token_acc"],
                                 "sft/grad_norm": float(m.get("grad_norm", 0.0)),
                                 **perf_metrics(m, backend)}, step=step)

    val_history: list[dict] = []
    t0 = time.perf_counter()
    last = train_sft(backend, tok, pairs, cfg.base.steps, batch, seed=cfg.run.seed, on_step=on_step,
                     chat_template=cfg.model.chat_template,
                     should_stop=score_stop(cfg, domains, tok, backend, tracker, val_history))
    train_s = time.perf_counter() - t0
    stopped = None
    if last["steps"] < cfg.base.steps:
        stopped = (f"validation mean {val_history[-1]['mean']:.3f} >= stop_at_score {cfg.base.stop_at_score} "
                   f"at step {last['steps']}")
        if backend.is_main:
            log.info("base SFT: stopped at step %d of %d: %s", last["steps"], cfg.base.steps, stopped)
    final = fresh_final(Path(work)) if backend.is_main else Path(work) / "final"  # rank 0's folder, emptied by it
    backend.save_hf(final, tokenizer=tok)  # a collective: every rank takes part, rank 0 writes
    backend.close()
    # `steps`: the steps taken (fewer than base.steps when stopped by its score: `stopped` says why)
    summary = {**last, "world_size": backend.world_size, "device": str(backend.device), "train_s": train_s,
               "train_tokens": forwarded[0] * backend.world_size, "stopped": stopped, "validation": val_history,
               # over the steps' own time (validation left out): positions/s of all ranks, and this rank's card's MFU
               "train_tokens_per_s": forwarded[0] * backend.world_size / done["step_s"] if done["step_s"] else None,
               "mfu": mfu(done["flops"], done["step_s"], backend.peak_tflops)}
    if backend.is_main:
        summary["checkpoint"] = commit_final(final, out_url, cfg.base.steps,
                                             meta={"stage": "base", "config_fingerprint": cfg.fingerprint(),
                                                   "world_size": backend.world_size})
    # the process group it trained in (report.json `resources`); device, time and positions trained (benchmarks);
    # `wall_s` from the start to the commit (`alloy run --dry-run` estimates the base from it)
    return {**summary, "wall_s": time.perf_counter() - t_start}


def perf_metrics(m: dict, backend) -> dict:
    """One SFT step's `perf/train_tokens_per_s` (all ranks' positions) and `perf/mfu` (this rank's card; absent
    without a known peak, as on the CPU) from `train_sft`'s step metrics."""
    s = m.get("step_s") or 0.0
    out = {"perf/train_tokens_per_s": m.get("forward_tokens", 0.0) * backend.world_size / s if s else None,
           "perf/mfu": mfu(m.get("train_flops"), s, backend.peak_tflops)}
    return {k: v for k, v in out.items() if v is not None}


WORKER = Worker("training.base_main", "Alloy base SFT worker (one process per rank)",
                args=(arg("--init", required=True, help="HF dir to start from"),
                      arg("--out", required=True, help="storage prefix: rank 0 commits the HF model as <out>/final")),
                threads=lambda cfg, args: cfg.base.threads, work_subdir="base-work")
# `--result`: rank 0 writes the last step's metrics, `world_size`, `steps`, `wall_s` and `checkpoint` there


def _run(w: WorkerRun) -> dict:
    return run_base_sft(w.cfg, load_domains(w.cfg), w.args.init, w.work_dir, w.args.out, w.tracker)


def main(argv: list[str] | None = None) -> int:
    return WORKER.main(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
