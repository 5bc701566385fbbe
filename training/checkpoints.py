"""A trainer's resumable checkpoint, written and read one way by every trainer (the specialists' PPO, the OPD
student): a staging folder holding the trainer's own parts (HF weights, DeepSpeed states, …) plus `trainer.json`
(its step, cursor, ledger, … and the `world_size` that wrote it), committed under `<out_url>/step-N` with the
storage manifest (infra/storage.py) and pruned to the last `KEEP_LAST`. A resume loads the newest checkpoint that
verifies and refuses one written by another number of ranks, naming the setting.

    url = commit_checkpoint(work_dir, out_url, step, world_size, state, write_parts, meta)
    restored = restore_latest(work_dir, out_url, world_size, who="student", setting="distill.train.world_size")
    if restored: local, state, url = restored   # state: trainer.json without world_size; parts under `local`
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from infra.storage import checkpoint_name, join, load_latest, prune, save_checkpoint
from training.ranks import require_same_world

STATE_FILE = "trainer.json"
KEEP_LAST = 2  # checkpoints kept under a trainer's prefix (the newest that verifies is resumed)


def commit_checkpoint(work_dir: str | Path, out_url: str, step: int, world_size: int, state: dict,
                      write_parts: Callable[[Path], None], meta: dict) -> str:
    """Stage the trainer's parts (`write_parts(folder)`) and `state` (+ `world_size`) as `trainer.json`, commit them
    as `<out_url>/step-N`, keep the last KEEP_LAST; returns the checkpoint's URL."""
    local = Path(work_dir) / "ckpt-staging"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    write_parts(local)
    (local / STATE_FILE).write_text(json.dumps(dict(state, world_size=world_size)))
    url = save_checkpoint(str(local), join(out_url, checkpoint_name(step)), step, meta=meta)
    prune(out_url, keep_last=KEEP_LAST)
    shutil.rmtree(local, ignore_errors=True)
    return url


def restore_latest(work_dir: str | Path, out_url: str, world_size: int, *, who: str,
                   setting: str) -> tuple[Path, dict, str] | None:
    """(local folder of the newest complete checkpoint, its `trainer.json` without `world_size`, its URL), or None
    when there is none. A checkpoint another number of ranks wrote is refused (ValueError naming `setting`)."""
    local = Path(work_dir) / "resume"
    url = load_latest(out_url, local)  # newest checkpoint that verifies; a corrupt one is skipped
    if url is None:
        return None
    state = json.loads((local / STATE_FILE).read_text())
    require_same_world(state.pop("world_size", None), world_size, who, setting, url)
    return local, state, url
