"""The one launcher of a trained stage (the base SFT, the specialists, the student): reuse what storage holds, or run
the trainer process, then bring its `final/` checkpoint here.

    summary, final = reuse_or_train(ctx, prefix, label, train=lambda: run_trainer(cmd, ctx, lane, log, steps, label))

A stage's trainer commits `<prefix>/final` (COMPLETE manifest last) and writes its summary to a result file; this
stores the summary beside the checkpoint (`<prefix>/result.json`), so a rerun with `run.resume` reuses both without
starting the trainer; the result file then gets the stored summary, so it holds the stage's summary either way.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

from infra.storage import join, load_checkpoint, read_json, verify_checkpoint, write_json
from tasks.gpu_lanes import trainer_lane
from tasks.worker_process import run_worker

log = logging.getLogger("alloy")


def run_trainer(cmd: list[str], ctx, lane: str, log_path: Path, steps: int, label: str,
                on_step: Callable[[int], None] | None = None) -> None:
    """Run the trainer process `cmd` on its GPU lane of stage `lane` (tasks/gpu_lanes.py; as is without GPUs),
    following its progress events (tasks/worker_process.py)."""
    with trainer_lane(cmd, ctx.cfg, lane) as placed:
        run_worker(placed, log_path, steps, label, on_step)


def reuse_or_train(ctx, prefix: str, label: str, result: Path, local: Path,
                   train: Callable[[], None]) -> tuple[dict, str]:
    """(the stage's summary, its committed `final/` URL), with `final/` loaded into `local`: the stored summary when
    `run.resume` and `<prefix>/final` verifies, else `train()` (which commits `final/` and writes `result`), its
    summary stored beside the checkpoint. Either way `result` ends up holding the summary."""
    final = join(prefix, "final")
    if ctx.cfg.run.resume and verify_checkpoint(final)[0]:
        log.info("%s: reusing complete %s", label, final)
        summary = read_json(join(prefix, "result.json"))
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text(json.dumps(summary))
    else:
        result.unlink(missing_ok=True)  # a result file of an earlier attempt must not pass for this one's
        train()
        summary = json.loads(result.read_text())
        write_json(join(prefix, "result.json"), summary)
    shutil.rmtree(local, ignore_errors=True)
    load_checkpoint(final, local)
    return summary, final
