"""The `alloy` command line. Exit codes: 0 success, 1 the job failed, 2 bad input (config, arguments), 130 interrupted."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "alembic", "mlflow", "filelock", "botocore", "s3fs", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def env_defaults() -> None:
    """CPU-safe, quiet defaults for every Alloy process (the user's environment wins). Hub access is the user's:
    HF_HUB_OFFLINE is left as the environment has it, so a `model.path` that is a Hub id resolves where the machine
    has network (local checkpoints never touch the Hub); the tests set it (tests/conftest.py)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; avoids a telemetry error line
    # `alloy run` starts a temporary Prefect API; Prefect gives it 20 s, which a busy 2-core machine can exceed
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def version() -> str:
    """The installed package's version (pyproject's project `alloy-opd`), or "unknown" when not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("alloy-opd")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


# ------------------------------------------------------------------------------------------ commands


def cmd_run(args) -> int:
    from infra.config import ConfigError, load_config, secret_overrides_env, split_secret_overrides

    try:
        # secrets (`--set engine.api_key=…`) go to the environment, so they never become flow-run parameters
        overrides, secret = split_secret_overrides(args.set)
        os.environ.update(secret_overrides_env(secret, os.environ))
        cfg = load_config(args.config, overrides)  # fail fast, before Prefect starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.dry_run:  # every path and size a stage needs, before any stage (the dry run checks these too)
        from alloy.plan import preflight, report_failures

        if report_failures(preflight(cfg)[0]) != EXIT_OK:
            return EXIT_USAGE
    if args.dry_run:  # check everything that can be checked without training, print the plan (alloy/plan.py)
        from alloy.plan import dry_run

        return dry_run(args.config, overrides)
    from alloy.interrupt import EXIT_INTERRUPTED, interruptible, resume_command
    from flows.pipeline import pipeline

    try:  # Ctrl-C: a clean stop, then KeyboardInterrupt (twice: killed at once); alloy/interrupt.py
        report = interruptible(pipeline, config=args.config, overrides=overrides, report_path=args.report)
    except KeyboardInterrupt:
        print(f"interrupted; to resume from the last checkpoints: {resume_command(args.config, args.set, args.report)}",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except ConfigError as exc:  # e.g. a domain plugin that does not load
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # the flow logged the traceback
        print(f"error: pipeline failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    from infra.report import render_table

    print(render_table(report))
    if args.report:
        print(f"report written to {args.report}")
    return EXIT_OK


def cmd_config(args) -> int:
    from alloy.plan import preflight, report_failures
    from infra.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # what a run checks before its first stage: a plugin that fails to import or to build (named by its dotted
    # path), a dataset too small for the split sizes, the judge checkpoint, URL syntax, the storage
    if report_failures(preflight(cfg)[0]) != EXIT_OK:
        return EXIT_USAGE
    import yaml

    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return EXIT_OK


def cmd_model_init(args) -> int:
    from infra.models import PRESETS, init_model_dir

    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}", file=sys.stderr)
        return EXIT_USAGE
    if args.tokenizer == "bpe" and not args.train_text:
        print("error: --tokenizer bpe needs at least one --train-text FILE to train it on", file=sys.stderr)
        return EXIT_USAGE
    if args.tokenizer == "char" and args.train_text:
        print("error: --train-text is only for --tokenizer bpe", file=sys.stderr)
        return EXIT_USAGE
    for f in args.train_text:
        if not Path(f).is_file():
            print(f"error: --train-text {f}: no such file", file=sys.stderr)
            return EXIT_USAGE
    try:
        out = init_model_dir(args.preset, args.out, seed=args.seed, arch=args.arch, tokenizer=args.tokenizer,
                             train_text=args.train_text, vocab_size=args.vocab_size)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote a fresh '{args.preset}' {args.arch} model and {args.tokenizer} tokenizer to {out}")
    return EXIT_OK


def cmd_eval(args) -> int:
    from domains.compaction import compactions_of
    from domains.evaluate import evaluate
    from domains.registry import load_domains
    from infra.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
        domains = load_domains(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not Path(args.model).is_dir():
        print(f"error: --model {args.model}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    df = evaluate(args.model, domains, cfg.eval.n_eval, cfg.run.seed, args.stage,
                  max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                  chat_template=cfg.model.chat_template, device=cfg.eval.device, dtype=cfg.eval.dtype,
                  compaction=compactions_of(cfg.specialists, domains))
    print(df[["domain", "stage", "score", "n_eval"]].to_string(index=False))
    print(f"mean score {df['score'].mean():.4f}")
    if args.out:
        Path(args.out).write_text(df.to_json(orient="records", indent=2))
    return EXIT_OK


def cmd_report(args) -> int:
    from infra.report import render_table, report_problems

    p = Path(args.path)
    try:
        report = json.loads(p.read_text())
    except FileNotFoundError:
        print(f"error: no report at {p}", file=sys.stderr)
        return EXIT_USAGE
    except json.JSONDecodeError as exc:
        print(f"error: {p} is not valid JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problems = report_problems(report)
    if problems:
        print(f"error: {p} is not a report.json (infra/report.py, REPORT_SHAPE):\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return EXIT_USAGE
    print(render_table(report))
    return EXIT_OK


# ------------------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alloy", description="Alloy: RL specialists merged into one student by on-policy distillation.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"alloy {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the pipeline for a config (a Prefect flow run)")
    r.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. base.steps=50")
    r.add_argument("--report", default=None, metavar="PATH", help="also write report.json here")
    r.add_argument("--dry-run", action="store_true", help="check the config, model, domains, storage, ports and "
                   "external teachers, print what would be reused and what trained (with time estimates); train nothing")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("config", help="validate a config (and what a run checks before its first stage: domains, "
                       "dataset split sizes, the judge checkpoint, URLs, storage) and print it with defaults filled in")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(fn=cmd_config)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("init", help="write a fresh preset-sized model + tokenizer (char, or a byte-level BPE "
                         "trained on local text) in HF format")
    mi.add_argument("--preset", default="tiny")
    mi.add_argument("--out", required=True)
    mi.add_argument("--seed", type=int, default=0)
    mi.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                    help="model architecture (qwen2 = llama + q/k/v biases; needs --tokenizer bpe)")
    mi.add_argument("--tokenizer", choices=["char", "bpe"], default="char",
                    help="char: the built-in printable-ASCII tokenizer; bpe: a byte-level BPE with a ChatML chat "
                    "template, trained on --train-text")
    mi.add_argument("--train-text", action="append", default=[], metavar="FILE",
                    help="text to train the BPE on (repeatable; a .jsonl file gives its rows' string values)")
    mi.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size at most (default 512)")
    mi.set_defaults(fn=cmd_model_init)

    e = sub.add_parser("eval", help="evaluate a checkpoint on the config's domains (greedy, eval split)")
    e.add_argument("config")
    e.add_argument("--model", required=True, help="HF checkpoint directory")
    e.add_argument("--stage", default="eval", help="label for the stage column")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--out", default=None, help="write the scores as JSON")
    e.set_defaults(fn=cmd_eval)

    rp = sub.add_parser("report", help="print a report.json as a table")
    rp.add_argument("path")
    rp.set_defaults(fn=cmd_report)

    # `alloy serve …` is dispatched in main() straight to the server's own parser; listed here for --help
    sub.add_parser("serve", help="serve an HF checkpoint with the embedded SGLang-protocol engine (alloy serve --help)",
                   add_help=False)

    from alloy.placement_cmd import add_parser as add_plan_parser

    add_plan_parser(sub)  # plan: the GPU placement of a config (infra/placement.py)

    from alloy.rollouts_cmd import add_parser as add_rollouts_parser

    add_rollouts_parser(sub)  # rollouts list | show | diff: a run's rollout records (training/rollout_records.py)

    from alloy.rm_cmd import add_parser as add_rm_parser

    add_rm_parser(sub)  # rm train: a reward model on preference pairs (training/reward_main.py)

    from alloy.stack import add_parsers as add_stack_parsers

    add_stack_parsers(sub)  # up, down, status (the local Prefect + MLflow stack) and teachers up|down|status
    return p


def main(argv: list[str] | None = None) -> int:
    env_defaults()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # the server owns its flags (argparse REMAINDER would swallow none of them)
        _setup_logging(False)
        from engine.server import main as serve_main

        serve_main(argv[1:] or ["--help"], prog="alloy serve")
        return EXIT_OK
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `alloy config ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
