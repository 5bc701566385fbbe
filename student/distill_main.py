"""OPD distillation as a process: the student's own torch.distributed group, engine server and event loop.

    python -m student.distill_main --config PATH [--set a.b=c ...] --student-init DIR --teachers JSON --out URL
        [--work-dir DIR] [--result PATH] [--mlflow-run-id ID]

`--teachers` is a JSON object {domain: url} (inline, or a path to a .json file) of running teacher servers; the
pipeline launches and supervises them (tasks/teachers.py) and checks their tokenizers before this starts.
`--out` is the storage prefix of the student's checkpoints: resumable `step-*` checkpoints, and `final/` (the HF
model) at the end. A rerun with the same `--out` resumes from the newest complete `step-*`.
The result (summary, throughput, per-teacher totals, evals, the final checkpoint URL) goes to `--result` as JSON.

The recipe (`run_distillation`): build the DeepSpeed student and its trainer (student/trainer.py, one EngineClient per
teacher endpoint), then the stage order every RL trainer shares (`training.session.run_stage`): resume if a
checkpoint exists → serve it on an engine server → train → commit `final/`.
Tool domains' episodes run under the specialists' guard, rules only (`student_guards`).
With `distill.train.world_size` W > 1 the task starts this under torchrun: rank 0 runs the recipe (engine server,
sampling, teacher scoring, ledger, evals, MLflow, commits) and announces each update, weight save and state
save/load; ranks 1..W-1 follow (training/ranks.py) and train their shards of each batch (student/trainer.opd_update).
The process around the recipe (flags, config, MLflow, torch.distributed, signals, the result file) is the
trainer skeleton's, training/worker.py; `WORKER` describes this entry point to the tasks that start it.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from domains.compaction import compactions_of
from domains.guard import Guard
from domains.registry import load_domains
from engine.client import EngineClient
from infra.checkpoint_budget import checkpoint_rule
from training.ranks import Ranks
from training.session import commit_final, run_stage, train_settings, trainable
from training.worker import Worker, WorkerRun, arg
from student.losses import get_loss
from student.sampler import is_tool_domain
from student.scoring import TeacherScorer
from student.trainer import DistillTrainer

log = logging.getLogger("alloy.student")


def teacher_clients(endpoints: dict[str, str], dc, api_key: str | None) -> dict[str, EngineClient]:
    """{domain: client}, one EngineClient (one HTTP session per loop) per distinct endpoint: domains served by the
    same server share it. Retries (≤ 4 s apart) ride out a supervisor restart of a teacher."""
    by_url: dict[str, EngineClient] = {}
    for url in sorted(set(endpoints.values())):
        by_url[url] = EngineClient(url, api_key=api_key, timeout=dc.teacher_timeout_s, max_retries=dc.teacher_retries,
                                   backoff_base=0.25, backoff_max=4.0)
    return {d: by_url[u] for d, u in endpoints.items()}


def student_guards(cfg, domains: dict) -> dict[str, Guard | None]:
    """{tool domain: the guard its episodes run under}: the domain's specialist guard config
    (`specialists.guard`, per_domain merged in), rules only, or None where that guard is disabled. Rules only: the
    judge (`judge_path`) is served for the specialists stage alone, and the rules are what evaluation scores a hack
    attempt by (`domains/evaluate.py`: a flagged call is a clean 0), so the student's reward matches the clean score.
    Domains with the same `allowed_hosts` share one guard."""
    shared: dict[tuple[str, ...], Guard] = {}
    out: dict[str, Guard | None] = {}
    for name, dom in domains.items():
        if not is_tool_domain(dom):
            continue
        gc = cfg.specialists.for_domain(name).guard
        if not gc.enabled:
            log.warning("student: %s runs its tool episodes unguarded (specialists.guard.enabled=false)", name)
            out[name] = None
            continue
        hosts = tuple(sorted(gc.allowed_hosts))
        out[name] = shared.setdefault(hosts, Guard(None, allowed_hosts=set(hosts)))
    return out


def build_student(cfg, domains: dict, student_init: str, out_url: str, work_dir: str | Path, tracker,
                  teachers: dict[str, str] | None = None, on_step=None) -> DistillTrainer:
    """The OPD student's trainer from `student_init` (nothing served yet), after joining torch.distributed: the
    trainer of `run_distillation`, and of a replay (student/replay.py). Rank 0 scores through `teachers`
    ({domain: url}; None: no scorer, as on a rank > 0 or in a replay) and runs tool episodes under the guards."""
    dc = cfg.distill
    tok, backend = trainable(student_init, train_settings(dc.train, max(dc.steps, 1), cfg.run.seed))
    ranks = Ranks()
    main = ranks.is_main  # rank 0 samples and scores; a rank > 0 only trains its shards of rank 0's batches
    scorer = TeacherScorer(teacher_clients(teachers, dc, cfg.engine.api_key),
                           top_k=dc.top_k if get_loss(dc.loss).needs_teacher_topk else 0,
                           batch_size=dc.score_batch_size, vocab_size=len(tok),
                           attempts=dc.score_attempts) if main and teachers is not None else None
    # the specialists' compaction of long tool episodes, per domain (`specialists.per_domain` merged in): the
    # student's episodes follow it (sampled and trained as sub-traces on the contexts the teachers were trained on)
    return DistillTrainer(dc, backend, tok, None, scorer, domains, out_url=out_url, work_dir=Path(work_dir),
                          tracker=tracker, seed=cfg.run.seed, eval_max_new_tokens=cfg.eval.max_new_tokens,
                          eval_batch_size=cfg.eval.batch_size, on_step=on_step, ranks=ranks,
                          chat_template=cfg.model.chat_template, compaction=compactions_of(cfg.specialists, domains),
                          guards=student_guards(cfg, domains) if main else None)


def run_distillation(cfg, domains: dict, student_init: str, teachers: dict[str, str], out_url: str,
                     work_dir: str | Path, tracker, on_step=None) -> dict:
    """Distill `teachers` ({domain: url}) into the student initialised from `student_init` (HF dir); returns the
    trainer summary plus `student_checkpoint` (the committed `final/` URL) and `student_dir` (a local HF copy)."""
    dc, work = cfg.distill, Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    trainer = build_student(cfg, domains, student_init, out_url, work, tracker, teachers, on_step)
    backend, scorer = trainer.raw_backend, trainer.scorer

    def finish(summary: dict, final: Path) -> dict:
        trainer.backend.save_hf(final, tokenizer=trainer.tok)  # on rank 0 of several: announced to the other ranks
        _, slim = checkpoint_rule(dc.keep_checkpoints, on_gpu=backend.device.type != "cpu")
        summary["student_checkpoint"] = commit_final(final, out_url, trainer.state.step,
                                                     meta={"stage": "student", "steps": trainer.state.step},
                                                     drop_resume=slim)  # on a GPU its step-* go: a rerun reuses final/
        summary["student_dir"] = str(final)
        return summary

    return run_stage(trainer, trainer.ranks, engine_cfg=cfg.engine, work=work, init_dir=student_init,
                     server_name="student", server_dir="student-server", seed=cfg.run.seed, backends=(backend,),
                     finish=finish, attach=lambda server: setattr(trainer, "policy", server),
                     closers={id(c): c for c in scorer.clients.values()}.values() if scorer is not None else ())


def parse_teachers(raw: str) -> dict[str, str]:
    """`--teachers`: a JSON object {domain: url}, inline or the path of a .json file."""
    teachers = json.loads(Path(raw).read_text() if not raw.lstrip().startswith("{") else raw)
    if not isinstance(teachers, dict) or not all(isinstance(v, str) for v in teachers.values()):
        raise SystemExit(f"--teachers must be a JSON object {{domain: url}}, got {raw[:200]!r}")
    return teachers


def _run(w: WorkerRun) -> dict:
    return run_distillation(w.cfg, load_domains(w.cfg), w.args.student_init, parse_teachers(w.args.teachers),
                            w.args.out, w.work_dir, w.tracker)


WORKER = Worker("student.distill_main", "Alloy OPD student: sample on-policy, teachers score, train",
                args=(arg("--student-init", required=True, help="HF dir the student starts from (the base checkpoint)"),
                      arg("--teachers", required=True, help='{"domain": "http://host:port", ...} inline or a .json path'),
                      arg("--out", required=True, help="storage URL prefix of the student's checkpoints")),
                threads=lambda cfg, args: cfg.distill.threads, work_subdir="distill")


def main(argv: list[str] | None = None) -> int:
    return WORKER.main(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
