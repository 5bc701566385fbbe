"""OPD distillation as a process: the student's own torch.distributed group, engine server and event loop.

    python -m student.distill_main --config PATH [--set a.b=c ...] --student-init DIR --teachers JSON --out URL
        [--work-dir DIR] [--result PATH] [--mlflow-run-id ID]

`--teachers` is a JSON object {domain: url} (inline, or a path to a .json file) of running teacher servers; the
pipeline launches and supervises them (tasks/teachers.py) and checks their tokenizers before this starts.
`--out` is the storage prefix of the student's checkpoints: resumable `step-*` checkpoints, and `final/` (the HF
model) at the end. A rerun with the same `--out` resumes from the newest complete `step-*`.
The result (summary, throughput, per-teacher totals, evals, the final checkpoint URL) goes to `--result` as JSON.

The recipe (`run_distillation`): build the DeepSpeed student → resume if a checkpoint exists → serve it on an engine
server → one EngineClient per teacher endpoint → train (student/trainer.py) → commit `final/`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from infra.deepspeed_backend import DeepSpeedBackend, TrainSettings, init_distributed, shutdown_distributed
from infra.engine.client import EngineClient
from infra.engine.launcher import Supervisor
from infra.models import load_model, load_tokenizer
from infra.policy_server import PolicyServer
from infra.storage import join, save_checkpoint
from student.scoring import TeacherScorer
from student.trainer import DistillTrainer

log = logging.getLogger("alloy.student")


def train_settings(dc, seed: int) -> TrainSettings:
    t = dc.train
    return TrainSettings(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                         dtype=t.dtype, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                         warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule, total_steps=max(dc.steps, 1),
                         seed=seed)


def teacher_clients(endpoints: dict[str, str], dc, api_key: str | None) -> dict[str, EngineClient]:
    """{domain: client}, one EngineClient (one HTTP session per loop) per distinct endpoint: domains served by the
    same server share it. Retries (≤ 4 s apart) ride out a supervisor restart of a teacher."""
    by_url: dict[str, EngineClient] = {}
    for url in sorted(set(endpoints.values())):
        by_url[url] = EngineClient(url, api_key=api_key, timeout=dc.teacher_timeout_s, max_retries=dc.teacher_retries,
                                   backoff_base=0.25, backoff_max=4.0)
    return {d: by_url[u] for d, u in endpoints.items()}


def run_distillation(cfg, domains: dict, student_init: str, teachers: dict[str, str], out_url: str,
                     work_dir: str | Path, tracker, on_step=None) -> dict:
    """Distill `teachers` ({domain: url}) into the student initialised from `student_init` (HF dir); returns the
    trainer summary plus `student_checkpoint` (the committed `final/` URL) and `student_dir` (a local HF copy)."""
    dc, work = cfg.distill, Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(student_init)
    init_distributed()
    backend = DeepSpeedBackend(load_model(student_init), train_settings(dc, cfg.run.seed))
    scorer = TeacherScorer(teacher_clients(teachers, dc, cfg.engine.api_key),
                           top_k=dc.top_k if dc.loss == "topk_kl" else 0, batch_size=dc.score_batch_size,
                           vocab_size=len(tok), attempts=dc.score_attempts)
    trainer = DistillTrainer(dc, backend, tok, None, scorer, domains, out_url=out_url, work_dir=work,
                             tracker=tracker, seed=cfg.run.seed, eval_max_new_tokens=cfg.eval.max_new_tokens,
                             eval_batch_size=cfg.eval.batch_size, on_step=on_step)
    serve_dir = trainer.resume() or student_init
    tracker.log_dict({"teachers": teachers, "resumed_at_step": trainer.state.step}, "distill/teachers.json")
    with Supervisor(work / "logs", threads_per_server=cfg.engine.threads) as sup:
        trainer.policy = PolicyServer.for_engine(cfg.engine, sup, "student", serve_dir, work / "student-server",
                                                 version=trainer.state.step, seed=cfg.run.seed)

        async def go() -> dict:
            try:
                return await trainer.run()
            finally:
                await trainer.policy.aclose()
                for c in {id(c): c for c in scorer.clients.values()}.values():
                    await c.aclose()

        summary = asyncio.run(go())
    final = work / "final"
    shutil.rmtree(final, ignore_errors=True)
    backend.save_hf(final, tokenizer=tok)
    summary["student_checkpoint"] = save_checkpoint(str(final), join(out_url, "final"), trainer.state.step,
                                                    meta={"stage": "student", "steps": trainer.state.step})
    summary["student_dir"] = str(final)
    backend.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    from infra.config import load_config
    from infra.tracking import NoopTracker, Tracker
    from tasks.context import load_domains

    p = argparse.ArgumentParser(description="Alloy OPD student: sample on-policy, teachers score, train")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--student-init", required=True, help="HF dir the student starts from (the base checkpoint)")
    p.add_argument("--teachers", required=True, help='{"domain": "http://host:port", ...} inline or a .json path')
    p.add_argument("--out", required=True, help="storage URL prefix of the student's checkpoints")
    p.add_argument("--work-dir", default=None, help="local scratch (default: a 'distill' dir beside --result)")
    p.add_argument("--result", default=None, help="write the run summary here as JSON")
    p.add_argument("--mlflow-run-id", default=None, help="log to this existing MLflow run (the `student` child)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(args.config, args.set)
    torch.set_num_threads(cfg.distill.threads)
    raw = args.teachers
    teachers = json.loads(Path(raw).read_text() if not raw.lstrip().startswith("{") else raw)
    if not isinstance(teachers, dict) or not all(isinstance(v, str) for v in teachers.values()):
        raise SystemExit(f"--teachers must be a JSON object {{domain: url}}, got {raw[:200]!r}")
    tracker = NoopTracker()
    if args.mlflow_run_id and cfg.tracking.enabled:
        tracker = Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri)
        tracker = tracker.resume(args.mlflow_run_id)
    work = Path(args.work_dir) if args.work_dir else (Path(args.result).resolve().parent if args.result
                                                      else Path.cwd()) / "distill"
    try:
        summary = run_distillation(cfg, load_domains(cfg), args.student_init, teachers, args.out, work, tracker)
    finally:
        shutdown_distributed()
    if args.result:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps(summary, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
