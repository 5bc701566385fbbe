"""Hand-offs between flow runs that may run on different workers (docs/scale-out.md).

In deployment mode (`specialists.mode` / `distill.mode`) a stage runs as its own flow run, on whatever worker its
work pool gives it, with no disk shared with the pipeline's flow run. So everything handed from one flow run to
another is a storage URL (the committed base checkpoint, each specialist's `final/` and `result.json`, the student's
`final/` and `summary.json`), never a local path: a flow run pulls what it needs from storage into its own work dir
(its own `run.root`) and pushes what it makes. Nor is a server of this machine handed over: a reward model's
`domains.<i>.reward.served_url` (usually a loopback URL) is left out; the flow run serves its own from storage.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from infra.secrets import mask_secrets
from infra.storage import is_local, load_checkpoint, verify_checkpoint
from tasks.context import RunContext

log = logging.getLogger("alloy")

SHARED_STORAGE_HINT = ("set run.storage to storage every worker reads, e.g. s3://bucket/prefix "
                       "(docs/scale-out.md)")
# how often a `run_deployment` waiting on a stage's flow run asks the API for its state (Prefect's default: 5 s).
# One GET of one flow run a second per waiting stage, a read: a stage's end is seen ~2 s sooner on average.
DEPLOYMENT_POLL_S = 1.0


# a reward server of this machine (tasks/reward_servers.py): never handed to another worker
_SERVED_URL = re.compile(r"domains\.\d+\.reward\.served_url")


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def _local_only(key: str) -> bool:
    return key in ("run.root", "run.storage") or bool(_SERVED_URL.fullmatch(key))


def dispatch_overrides(ctx: RunContext) -> list[str]:
    """`ctx.overrides` for a flow run on another worker: `run.root` left out (the worker's own scratch dir: the
    config's run.root in its working directory; this machine's path may not exist there), so are the reward servers'
    `domains.<i>.reward.served_url` (this machine's servers: the flow run serves its own), and `run.storage`
    pinned to this run's storage URL, so every worker reads and commits where this pipeline does (all three are
    `ops_field`s: no checkpoint prefix moves)."""
    keep = [o for o in ctx.overrides if not _local_only(_key(o))]
    return keep + [f"run.storage={json.dumps(ctx.storage_url)}"]


def warn_unshared_storage(ctx: RunContext, field: str) -> None:
    """Deployment mode with a file:// storage works only where every worker sees that path (one machine, or a
    shared mount at the same path); it is allowed, with this warning, rather than refused for that reason."""
    if is_local(ctx.storage_url):
        log.warning("%s=deployment with a local run.storage (%s): flow runs on other machines cannot read or "
                    "write it unless it is a shared mount at the same path on every worker; %s", field,
                    ctx.storage_url, SHARED_STORAGE_HINT)


def fetch_checkpoint(url_or_dir: str, local: Path, what: str) -> str:
    """A checkpoint handed over by another flow run, as a local HF dir: a storage URL is loaded (verified against
    its manifest) into `local`; a plain local directory (local mode, one machine) is used as it is."""
    if "://" not in url_or_dir:
        if Path(url_or_dir).expanduser().is_dir():
            return url_or_dir
        raise FileNotFoundError(f"{what}: {url_or_dir} is not a directory on this worker; a flow run on another "
                                f"worker is handed a storage URL (s3://…, file://…), not a local path")
    ok, why = verify_checkpoint(url_or_dir)
    if not ok:
        local_hint = (f"; {url_or_dir} is a path on the machine that wrote it: {SHARED_STORAGE_HINT}"
                      if is_local(url_or_dir) else "")
        raise FileNotFoundError(f"{what}: no complete checkpoint at {url_or_dir} as seen from this worker "
                                f"({why}){local_hint}")
    shutil.rmtree(local, ignore_errors=True)
    load_checkpoint(url_or_dir, local)
    log.info("%s: pulled %s into %s", what, url_or_dir, local)
    return str(local)


def where_am_i(flow: str, ctx: RunContext) -> str:
    """One line for the flow run's log: which code (this repository copy) and which work dir it runs with."""
    code = Path(__file__).resolve().parents[1]
    return f"{flow}: code {code}, work dir {ctx.work_dir}, storage {mask_secrets(ctx.storage_url)}"
