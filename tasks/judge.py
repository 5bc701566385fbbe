"""The anti-hack guard's judge server: `specialists.guard.judge_path` served for the specialists stage.

    with serve_judge(ctx) as ctx:          # ctx.overrides now hand the judge's URL to every specialist worker
        ... train the specialists ...

When the config names a judge checkpoint (`specialists.guard.judge_path`, no `judge_url`) and some configured
domain has tools, one engine server (`engine.backend`, bound to `engine.host`, `engine.api_key`) serves it for the
whole stage, shared by every specialist, under a `Supervisor` that restarts it on the same port if it dies, like
the teachers (tasks/teachers.py). The specialists learn its URL through config overrides on their command line
(`specialists.guard.judge_url`, `judge_kind=sglang`, the prompt limit from the checkpoint's context length, and the
engine's key as the judge's key, which travels in the environment: tasks/worker_process.py). Those overrides are
not part of the config the stage fingerprints, so a judge on another port moves no checkpoint prefix.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterator

from engine.launcher import ServerSpec, Supervisor
from tasks.context import RunContext
from tasks.gpu_lanes import server_placements

log = logging.getLogger("alloy")
PROMPT_MARGIN = 2  # BOS + one spare position


def judge_prompt_chars(path: str | Path, max_tokens: int) -> int:
    """The judge prompt's length in characters for a checkpoint: the one it was trained on when it records one
    (`judge_training.json`'s `prompt_chars`: teachers/judge_model.py), else the longest its context holds with
    `max_tokens` new tokens (with the char tokenizer one character is one token; a BPE token holds one or more)."""
    trained = Path(path) / "judge_training.json"
    if trained.is_file():
        try:
            return int(json.loads(trained.read_text())["prompt_chars"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"specialists.guard.judge_path: {trained} has no prompt_chars: {e}") from None
    cfg_file = Path(path) / "config.json"
    try:
        n = int(json.loads(cfg_file.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"specialists.guard.judge_path: cannot read max_position_embeddings from {cfg_file}: "
                         f"{e}") from None
    if n - max_tokens - PROMPT_MARGIN < 64:
        raise ValueError(f"specialists.guard.judge_path: the judge's context ({n} positions) leaves no room for a "
                         f"prompt with judge_max_tokens={max_tokens}")
    return n - max_tokens - PROMPT_MARGIN


def wants_judge_server(ctx: RunContext, domains: list[str] | None = None) -> bool:
    """Whether to serve `judge_path`: a guard with a checkpoint and no URL, and at least one tool domain among
    `domains` (None: every configured domain)."""
    gc = ctx.cfg.specialists.guard
    names = list(ctx.domains) if domains is None else domains
    return bool(gc.enabled and gc.judge_path and not gc.judge_url
                and any(hasattr(ctx.domains[d], "env") for d in names if d in ctx.domains))


def judge_overrides(gc, url: str, engine_api_key: str | None, path: str) -> list[str]:
    """The config overrides that point a specialist worker at the served judge."""
    out = [f"specialists.guard.judge_url={url}", "specialists.guard.judge_kind=sglang"]
    if gc.judge_prompt_chars is None:
        out.append(f"specialists.guard.judge_prompt_chars={judge_prompt_chars(path, gc.judge_max_tokens)}")
    if engine_api_key and not gc.judge_api_key:
        out.append(f"specialists.guard.judge_api_key={engine_api_key}")  # a secret: sent in the env, never argv
    return out


def judge_checkpoint(gc) -> Path:
    """The checkpoint directory of `specialists.guard.judge_path` (`gc`: the guard config); a ValueError naming the
    field when it is no checkpoint. Checked when the pipeline flow starts (a deployment run has no `alloy run`
    before it) and again when the stage serves it."""
    path = Path(gc.judge_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"specialists.guard.judge_path: {gc.judge_path} is not a model checkpoint directory "
                         f"(no config.json, from {Path.cwd()}); build one with `python -m teachers.judge_model DIR`")
    return path


@contextlib.contextmanager
def serve_judge(ctx: RunContext, domains: list[str] | None = None) -> Iterator[RunContext]:
    """Serve `specialists.guard.judge_path` while the block runs and yield a context whose worker overrides point
    at it (`ctx` itself when no judge is served, e.g. no tool domain among `domains`). The server stops when the
    block ends, however it ends."""
    if not wants_judge_server(ctx, domains):
        yield ctx
        return
    gc, ec = ctx.cfg.specialists.guard, ctx.cfg.engine
    path = judge_checkpoint(gc)
    overrides = judge_overrides(gc, "", ec.api_key, str(path))  # checks the context before anything starts
    sup = Supervisor.for_engine(ctx.work_dir / "logs" / "judge", ec, ctx.cfg.teachers)  # the teachers' budget
    try:
        placement = server_placements(ctx.cfg, "judge").get("judge")  # its GPU of the plan, if any
        url = sup.start([ServerSpec.for_engine("judge", path, ec, placement)])["judge"]
        log.info("guard: judge %s served at %s for the specialists", path, url)
        overrides = [f"specialists.guard.judge_url={url}", *overrides[1:]]
        ctx.tracker.set_tags({"alloy.guard.judge": str(path)})
        yield dataclasses.replace(ctx, overrides=[*ctx.overrides, *overrides])
    finally:
        sup.stop()
