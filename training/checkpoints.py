"""A trainer's resumable checkpoint, written and read one way by every trainer (the specialists' PPO, the OPD
student): a staging folder holding the trainer's own parts (HF weights, DeepSpeed states, …) plus `trainer.json`
(its step, cursor, ledger, … and the `world_size` that wrote it), committed under `<out_url>/step-N` with the
storage manifest (infra/storage.py), then pruned to the last `keep_last`. A resume loads the newest checkpoint that
verifies and refuses one written by another number of ranks, naming the setting.

Only the newest needs its DeepSpeed states (weights in the training dtype, fp32 master weights, Adam moments, RNG):
with `slim` (a trainer on a GPU: `infra.checkpoint_budget.checkpoint_rule`) an older kept checkpoint drops them
(`drop_parts`) and keeps its HF weights and `trainer.json`. A resume that falls back to such a checkpoint (the
newer ones did not verify) is refused, naming it: resuming from weights alone would restart the optimizer. Once
the trainer's `final/` is committed, a rerun reuses it and never reads `step-*`: a slim trainer then deletes them
all (`drop_resume_checkpoints`, from `training.session.commit_final`).

    url = commit_checkpoint(work_dir, out_url, step, world_size, state, write_parts, meta, keep_last=1,
                            state_parts=("state",), slim=True)
    restored = restore_latest(work_dir, out_url, world_size, who="student", setting="distill.train.world_size",
                              state_parts=("state",), keep_setting="distill.keep_checkpoints")
    if restored: local, state, url = restored   # state: trainer.json without world_size; parts under `local`
"""
from __future__ import annotations

import json
import logging
import posixpath
import shutil
from pathlib import Path
from typing import Callable

from infra.storage import (MANIFEST, checkpoint_name, delete_checkpoint, get_fs, join, list_checkpoints,
                           load_latest, prune, save_checkpoint, write_bytes)
from training.ranks import require_same_world

log = logging.getLogger("alloy.checkpoints")
STATE_FILE = "trainer.json"


def commit_checkpoint(work_dir: str | Path, out_url: str, step: int, world_size: int, state: dict,
                      write_parts: Callable[[Path], None], meta: dict, *, keep_last: int,
                      state_parts: tuple[str, ...] = (), slim: bool = False) -> str:
    """Stage the trainer's parts (`write_parts(folder)`) and `state` (+ `world_size`) as `trainer.json`, commit them
    as `<out_url>/step-N`, keep the last `keep_last`; with `slim`, the older kept ones lose their `state_parts` (the
    DeepSpeed state folders). Returns the checkpoint's URL."""
    local = Path(work_dir) / "ckpt-staging"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    write_parts(local)
    (local / STATE_FILE).write_text(json.dumps(dict(state, world_size=world_size)))
    url = save_checkpoint(str(local), join(out_url, checkpoint_name(step)), step, meta=meta)
    prune(out_url, keep_last=keep_last)
    shutil.rmtree(local, ignore_errors=True)
    if slim and state_parts:
        complete = [c for c in list_checkpoints(out_url) if c.complete]
        for c in complete[:-1]:  # every one but the newest (sorted by step)
            drop_parts(c.url, c.manifest, state_parts)
    return url


def drop_parts(url: str, manifest: dict, parts: tuple[str, ...]) -> int:
    """Rewrite the committed checkpoint at `url` (its `manifest`) without the files under the top-level folders
    `parts`: the manifest first, replaced atomically (the checkpoint is complete at every moment; after it the
    dropped files are merely unlisted, and a crash here leaves only unlisted files), then the folders. Returns the
    bytes dropped (0 when it holds none of them: already slim)."""
    gone = {rel: f for rel, f in manifest["files"].items() if rel.split("/", 1)[0] in parts}
    if not gone:
        return 0
    kept = {rel: f for rel, f in manifest["files"].items() if rel not in gone}
    meta = dict(manifest.get("meta") or {}, dropped=sorted({rel.split("/", 1)[0] for rel in gone}))
    write_bytes(join(url, MANIFEST), (json.dumps(dict(manifest, files=kept, meta=meta), indent=2) + "\n").encode())
    fs, path = get_fs(url)
    for part in parts:
        try:
            fs.rm(posixpath.join(path, part), recursive=True)
        except FileNotFoundError:
            pass
    size = sum(f["size"] for f in gone.values())
    log.info("dropped %s from the older checkpoint %s (%.1f MB): only the newest keeps them",
             ", ".join(meta["dropped"]), url, size / 1e6)
    return size


def drop_resume_checkpoints(out_url: str) -> list[str]:
    """Delete every complete resumable checkpoint (`step-*`) under `out_url`, oldest first; returns their URLs. For
    a trainer whose `final/` is committed (a rerun reuses final/); an incomplete directory is left alone, as
    `prune` leaves it (it may be another writer's save in progress)."""
    doomed = [c.url for c in list_checkpoints(out_url) if c.complete]
    for url in doomed:
        delete_checkpoint(url)
    return doomed


def restore_latest(work_dir: str | Path, out_url: str, world_size: int, *, who: str, setting: str,
                   state_parts: tuple[str, ...] = (), keep_setting: str = "") -> tuple[Path, dict, str] | None:
    """(local folder of the newest complete checkpoint, its `trainer.json` without `world_size`, its URL), or None
    when there is none. A checkpoint another number of ranks wrote is refused (ValueError naming `setting`), and so
    is one without its `state_parts` (an older checkpoint that `drop_parts` slimmed; ValueError naming it and
    `keep_setting`)."""
    local = Path(work_dir) / "resume"
    url = load_latest(out_url, local)  # newest checkpoint that verifies; a corrupt one is skipped
    if url is None:
        return None
    missing = [p for p in state_parts if not (local / p).is_dir()]
    if missing:
        raise ValueError(
            f"{who}: cannot resume from {url}: it keeps only its weights ({', '.join(missing)} dropped: on a GPU only "
            f"the newest checkpoint keeps its DeepSpeed states, {keep_setting}), and every newer checkpoint under "
            f"{out_url} failed verification (the warnings above). Resuming from weights alone would restart the "
            f"optimizer: remove {out_url} to train {who} from its start")
    state = json.loads((local / STATE_FILE).read_text())
    require_same_world(state.pop("world_size", None), world_size, who, setting, url)
    return local, state, url
