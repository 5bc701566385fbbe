"""Progress for long stages: a rich progress bar on a terminal, periodic log lines otherwise (CI, Prefect workers)."""
from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger("alloy")


def _fmt_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


@contextmanager
def progress(desc: str, total: int, logger: logging.Logger | None = None,
             every_frac: float = 0.1) -> Iterator[Callable[..., None]]:
    """Yield `update(done, **metrics)`. On a TTY draws a rich bar; otherwise logs about every 10 % of `total`."""
    logger = logger or log
    start = time.monotonic()
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False) as bar:
            tid = bar.add_task(desc, total=total, info="")

            def update(done: int, **metrics) -> None:
                bar.update(tid, completed=done, info=_fmt_metrics(metrics))

            yield update
    else:
        step = max(1, int(total * every_frac))
        last = {"n": -1}

        def update(done: int, **metrics) -> None:
            if done - last["n"] >= step or done >= total:
                last["n"] = done
                logger.info("%s: %d/%d (%.0fs) %s", desc, done, total, time.monotonic() - start, _fmt_metrics(metrics))

        yield update
    logger.info("%s: done in %.1fs", desc, time.monotonic() - start)


def throttled(fn: Callable[..., None], every_s: float,
              clock: Callable[[], float] = time.monotonic) -> Callable[..., bool]:
    """`fn` called at most once every `every_s` seconds of `clock`: the wrapper runs `fn(*args)` when `every_s` have
    passed since the last run (the first call always runs) and returns whether it ran. For updates that cost an API
    call each (a Prefect progress artifact), where the newest value is what matters."""
    last = [None]

    def call(*args) -> bool:
        now = clock()
        if last[0] is not None and now - last[0] < every_s:
            return False
        last[0] = now
        fn(*args)
        return True

    return call
