"""The trainer-process skeleton: what every `python -m <worker>` of the pipeline does around its training loop.

A worker module describes itself once, as a `Worker` (its module, its own flags, its torch thread count), and its
`main` is `WORKER.main(run)`: `run(w: WorkerRun) -> dict` is the loop and nothing else. The skeleton

1. parses the common flags `--config PATH [--set a.b=c ...] [--mlflow-run-id ID] [--result PATH] [--work-dir DIR]`
   plus the worker's own, sets up logging, loads the config (secret overrides come from the environment,
   infra.config), sets torch's thread count;
2. turns SIGTERM and SIGINT into `WorkerStopped` (a KeyboardInterrupt) raised in the main thread, once: every
   `finally` runs, engine servers under an `engine.launcher.Supervisor` are stopped (`procs.request_stop`), a
   checkpoint being committed is either complete or absent (infra/storage.py writes its COMPLETE manifest last, in a
   hidden staging dir renamed into place; loaders skip anything else), and the worker exits 128 + signal;
3. joins torch.distributed (`init_distributed`; rank and world size from the launcher, e.g. torchrun) and leaves it
   at the end (`shutdown_distributed`), however `run` ends;
4. resumes the MLflow run `--mlflow-run-id` on rank 0 (a `NoopTracker` elsewhere, or without an id, or with
   tracking off) and ends it KILLED when stopped by a signal (the stage that started it ends it otherwise); on a
   GPU it logs MLflow's system metrics there too (GPU utilisation and memory: `start_system_metrics`);
5. writes `run`'s result as JSON to `--result` atomically (rank 0): a reader sees the whole file or none.

The tasks that start workers use the same description: `WORKER.argv(init=..., out=...)` is the command line, so a
module name or flag is written in one place.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infra import procs

log = logging.getLogger("alloy.worker")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class WorkerStopped(KeyboardInterrupt):
    """SIGTERM/SIGINT reached a worker: raised in its main thread (a KeyboardInterrupt, so `except Exception` in the
    loop does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass(frozen=True)
class Arg:
    """One worker-specific flag: `Arg("--init", required=True, help=...)` (argparse's keywords)."""

    flag: str
    kwargs: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def arg(flag: str, **kwargs) -> Arg:
    return Arg(flag, kwargs)


COMMON = (arg("--config", required=True, help="the pipeline's YAML config"),
          arg("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"),
          arg("--mlflow-run-id", default=None, help="log to this existing MLflow run (rank 0)"),
          arg("--result", default=None, help="write the run's summary here as JSON (rank 0)"),
          arg("--work-dir", default=None, help="local scratch (default: a folder beside --result, else in the cwd)"))


@dataclass
class WorkerRun:
    """What `run` gets: the parsed flags, the config, the tracker (rank 0's MLflow run, else a NoopTracker), the
    distributed rank / world size and the local work dir."""

    args: argparse.Namespace
    cfg: Any
    tracker: Any
    rank: int
    world_size: int
    work_dir: Path

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Worker:
    """One trainer process: `python -m <module>` with the common flags and `args`. `threads(cfg, args)` gives torch's
    intra-op thread count (None: torch's default); `work_subdir` names the default work dir."""

    module: str
    description: str
    args: tuple[Arg, ...] = ()
    threads: Callable[[Any, argparse.Namespace], int | None] = lambda cfg, args: None
    work_subdir: str = "work"

    # -- the command line, for whoever starts the worker ---------------------------------------------------------
    def flags(self, **values) -> list[str]:
        """`--flag value` for every keyword (`mlflow_run_id=` → `--mlflow-run-id`), in the order given; None is
        left out, a list repeats the flag. Unknown names raise."""
        known = {a.dest: a.flag for a in COMMON + self.args}
        out: list[str] = []
        for name, value in values.items():
            if name not in known:
                raise TypeError(f"worker {self.module}: no flag for {name!r}; known: {sorted(known)}")
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if v is not None:
                    out += [known[name], str(v)]
        return out

    def argv(self, **values) -> list[str]:
        """The whole command: `[python, -m, module, --flag, value, ...]`."""
        return [sys.executable, "-m", self.module, *self.flags(**values)]

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"python -m {self.module}", description=self.description)
        for a in COMMON + self.args:
            p.add_argument(a.flag, **a.kwargs)
        return p

    # -- the process ---------------------------------------------------------------------------------------------
    def main(self, run: Callable[[WorkerRun], dict | None], argv: list[str] | None = None) -> int:
        """Parse, set up, `run`, write the result, tear down (see the module docstring); returns the exit code."""
        args = self.parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
        from infra.config import load_config

        cfg = load_config(args.config, args.set, check_model_path=False)  # the flow that started us checked it
        threads = self.threads(cfg, args)
        if threads is not None:  # None: torch's default (one per core, or $OMP_NUM_THREADS)
            import torch

            torch.set_num_threads(threads)
        base = Path(args.result).resolve().parent if args.result else Path.cwd()
        work = Path(args.work_dir) if args.work_dir else base / self.work_subdir
        tracker = None
        with stop_on_signals():
            try:
                from training.deepspeed_backend import init_distributed, shutdown_distributed

                monitor = None
                try:
                    rank, world = init_distributed()
                    tracker = open_tracker(cfg, args.mlflow_run_id if rank == 0 else None)
                    monitor = start_system_metrics(tracker)
                    result = run(WorkerRun(args, cfg, tracker, rank, world, work))
                finally:
                    if monitor is not None:
                        monitor.finish()
                    shutdown_distributed()
            except WorkerStopped as stop:
                log.warning("%s: %s; exiting", self.module, stop)
                if tracker is not None and getattr(tracker, "run_id", None):
                    tracker.end("KILLED")
                return 128 + stop.signum
        if rank == 0 and args.result and result is not None:
            write_json_atomic(args.result, {**result, **gpu_memory()})
        return 0


def gpu_memory() -> dict:
    """{"gpu": name, peak allocated / reserved bytes} of this process's CUDA device, when it used one (else {}):
    what a benchmark reports per trainer process."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"gpu": {"name": torch.cuda.get_device_name(), "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}}


def open_tracker(cfg, run_id: str | None):
    """The MLflow run `run_id` resumed, or a NoopTracker (no id, or tracking off)."""
    from infra.tracking import NoopTracker, Tracker

    if not run_id or not cfg.tracking.enabled:
        return NoopTracker()
    return Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri).resume(run_id)


def start_system_metrics(tracker):
    """MLflow's system-metrics monitor on the tracker's run when this process trains on a GPU (DeepSpeed's
    accelerator is cuda) or MLflow's switch asks for it (`infra.tracking.system_metrics_wanted`), else None; a
    NoopTracker (rank > 0, tracking off) never starts one."""
    from deepspeed.accelerator import get_accelerator

    from infra.tracking import system_metrics_wanted

    if not getattr(tracker, "run_id", None):
        return None
    if not system_metrics_wanted(get_accelerator().device_name() == "cuda"):
        return None
    return tracker.start_system_metrics()


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """JSON to a temp file beside `path`, then `os.replace`: a reader sees the old file, the new one, or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=float))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class stop_on_signals:
    """`with stop_on_signals(): ...` — the first SIGTERM/SIGINT asks everything in the process to stop
    (`procs.request_stop`, in a thread of its own: supervisors stop their servers) and raises `WorkerStopped` in the
    main thread (while it runs an event loop under `procs.run_async`: cancels that loop's task, which then raises it); later ones are logged and ignored, so they cannot break into the `finally` blocks that are running.
    Previous handlers are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.fired: int | None = None
        self._prev: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if self.fired is not None:
            log.warning("%s again: already stopping", signal.Signals(signum).name)
            return
        self.fired = signum
        # not inline: the stop callbacks may need a lock the interrupted code holds (a supervisor's, for one)
        threading.Thread(target=procs.request_stop, name="alloy-stop", daemon=True).start()
        if procs.cancel_main_loop(WorkerStopped(signum)):  # an event loop runs: stopped through it, not from outside
            return
        raise WorkerStopped(signum)

    def __enter__(self) -> "stop_on_signals":
        for sig in self.SIGNALS:
            self._prev[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)
        return False
