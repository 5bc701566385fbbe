"""`alloy rm train`: train one reward model (training/reward_main.py) outside the pipeline, by the stage's own launcher
(tasks/reward_models.py), so a checkpoint it commits is one the pipeline reuses.

    alloy rm train CONFIG --name NAME [--set a.b=c]     reward_models.NAME of a config, at the prefix the pipeline
                                                         uses (init: base needs the run's base checkpoint committed)
    alloy rm train --data PAIRS --model HF_DIR --out DIR_OR_URL [--val-data V | --val-fraction F] [--steps N]
                   [--lr X] [--batch-size B] [--max-length T] [--seed S] [--margin-column C] [--system TEXT]
                                                         from flags alone (a config with that one reward model is
                                                         written under --work-dir and passed to the trainer)

It prints where the checkpoint went (`<out>/final`: `AutoModelForSequenceClassification.from_pretrained` loads it,
with `reward_model.json` beside the weights) and its held-out pair accuracy. A complete `final/` already there is
reused, not retrained (`--set run.resume=false` in config mode trains again); it says so, and opens no MLflow run
(with tracking on, the parent run `rm-<name>` and its child `reward_model/<name>` are opened when training starts,
as the pipeline opens no run for a stage it reuses). Exit codes: 0, 1 the training failed,
2 bad input, 130 interrupted. Nothing here imports torch until a command runs.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_parser(sub) -> None:
    rm = sub.add_parser("rm", help="reward models: train one on preference pairs (alloy rm train --help)")
    rsub = rm.add_subparsers(dest="rm_command", required=True)
    t = rsub.add_parser("train", help="train a reward model from a config's reward_models.NAME, or from flags")
    t.add_argument("config", nargs="?", default=None, help="YAML config with a reward_models section")
    t.add_argument("--name", default=None, help="the reward model (config mode: a key of reward_models; flags "
                   "mode: its name, default rm)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    t.add_argument("--data", default=None, help="flags mode: the preference file (prompt, chosen, rejected)")
    t.add_argument("--val-data", default=None, help="flags mode: a held-out preference file")
    t.add_argument("--val-fraction", type=float, default=None, help="flags mode: share of prompts held out (0.1)")
    t.add_argument("--model", default=None, help="flags mode: the HF checkpoint directory to start from")
    t.add_argument("--out", default=None, help="storage prefix or directory of the checkpoints (<out>/final); "
                   "config mode: default the pipeline's rm-<name>-<hash> prefix")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--batch-size", type=int, default=None, help="pairs per step (per rank)")
    t.add_argument("--max-length", type=int, default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--margin-column", default=None)
    t.add_argument("--system", default=None, help="system message the prompts are rendered with")
    t.add_argument("--work-dir", default="runs", help="flags mode: its config, logs and scratch go under "
                   "WORK_DIR/rm-NAME")
    t.set_defaults(fn=cmd_rm_train)


def flags_config(args, name: str) -> dict:
    """The config dict of flags mode: one reward model, tracking off. The pipeline's config needs a domain; the
    reward-model trainer reads none (any built-in name would do)."""
    rm = {"data": str(Path(args.data).resolve()) if "://" not in args.data else args.data,
          "init": str(Path(args.model).resolve())}
    for key, value in (("val_data", args.val_data), ("val_fraction", args.val_fraction), ("steps", args.steps),
                       ("max_length", args.max_length), ("seed", args.seed), ("margin_column", args.margin_column),
                       ("system", args.system)):
        if value is not None:
            rm[key] = str(Path(value).resolve()) if key == "val_data" and "://" not in value else value
    train = {k: v for k, v in (("lr", args.lr), ("micro_batch_size", args.batch_size)) if v is not None}
    if train:
        rm["train"] = train
    return {"run": {"name": f"rm-{name}", "root": str(Path(args.work_dir).resolve())}, "tracking": {"enabled": False},
            "domains": [{"name": "reverse"}], "reward_models": {name: rm}}


def cmd_rm_train(args) -> int:
    import yaml

    from infra.config import ConfigError, load_config, secret_overrides_env, split_secret_overrides

    flag_mode = args.config is None
    try:
        if flag_mode:
            missing = [f for f, v in (("--data", args.data), ("--model", args.model), ("--out", args.out)) if not v]
            if missing:
                raise ConfigError(f"alloy rm train: give a CONFIG, or {', '.join(missing)}")
            name = args.name or "rm"
            data = flags_config(args, name)
            path = Path(data["run"]["root"]) / data["run"]["name"] / "rm-config.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            config_path = str(path)
        else:
            config_path = args.config
        import os

        overrides, secret = split_secret_overrides(args.set)
        os.environ.update(secret_overrides_env(secret, os.environ))
        cfg = load_config(config_path, overrides)
        name = args.name or ("rm" if flag_mode else None)
        if name is None or name not in cfg.reward_models:
            raise ConfigError(f"--name: give one of the config's reward models {sorted(cfg.reward_models)}"
                              + (f" (not {name!r})" if name else ""))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = args.out
    if out and "://" not in out:
        out = "file://" + str(Path(out).resolve())
    return _train(cfg, config_path, overrides, name, out)


def _train(cfg, config_path: str, overrides: list[str], name: str, out: str | None) -> int:
    from infra.config import ConfigError
    from infra.procs import Stopped
    from tasks.context import RunContext
    from tasks.reward_models import train_reward_model

    work = Path(cfg.run.root).resolve() / cfg.run.name / "work"
    work.mkdir(parents=True, exist_ok=True)
    tracker = _tracker(cfg, name)
    ctx = RunContext(cfg=cfg, config_path=config_path, overrides=list(overrides), work_dir=work,
                     storage_url=cfg.storage_url, tracker=tracker, parent_run_id=None, domains={})
    status = "FAILED"
    try:
        base_dir = (lambda: _base_dir(ctx)) if cfg.reward_models[name].init == "base" else None  # only to train
        summary = train_reward_model(ctx, name, base_dir, out_url=out)
        status = "FINISHED"
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, Stopped):
        status = "KILLED"
        print("interrupted; run the same command again to resume from the last checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        print(f"error: reward model {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        tracker.end(status)  # the parent run, if training opened one
    if summary.get("reused"):
        print(f"reward model {name}: reused the complete checkpoint already there (not trained again; no MLflow run "
              f"opened)")
    print(f"reward model {name}: held-out pair accuracy {summary['val_accuracy']:.3f} on {summary['val_pairs']} "
          f"pairs after {summary['steps']} steps")
    print(f"checkpoint: {summary['checkpoint']} (local copy {summary['local_dir']})")
    return EXIT_OK


class ParentOnDemand:
    """The tracker `alloy rm train` hands the stage: its parent run `rm-<name>` is created when the stage opens its
    child run, which it does only to train (tasks/reward_models.py), so a reused checkpoint leaves no empty run.
    Anything else is the wrapped tracker's (bound once the parent exists)."""

    def __init__(self, tracker, name: str):
        self._tracker, self._name = tracker, name
        self.parent_run_id: str | None = None

    @contextlib.contextmanager
    def child(self, name: str, tags: dict | None = None, resume: bool = True):
        if self.parent_run_id is None:
            self.parent_run_id = self._tracker.start_parent(f"rm-{self._name}", tags={"stage": "reward_model"})
        with self._tracker.child(name, tags=tags, resume=resume) as run:
            yield run

    def end(self, status: str = "FINISHED") -> None:
        if self.parent_run_id is not None:
            self._tracker.end(status)

    def __getattr__(self, attr):
        return getattr(self._tracker, attr)


def _tracker(cfg, name: str):
    """`ParentOnDemand` over an MLflow tracker when tracking is on, else a NoopTracker."""
    from infra.tracking import NoopTracker, Tracker

    if not cfg.tracking.enabled:
        return NoopTracker()
    return ParentOnDemand(Tracker(runs_root=cfg.run.root, experiment=cfg.tracking.experiment, uri=cfg.tracking.uri),
                          name)


def _base_dir(ctx) -> Path:
    """A local copy of the run's committed base checkpoint (FileNotFoundError naming it when there is none)."""
    from infra.storage import load_checkpoint
    from tasks.base import base_checkpoint_url

    local = ctx.work_dir / "base"
    load_checkpoint(base_checkpoint_url(ctx), local)
    return local
