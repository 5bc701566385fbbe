"""`alloy plan CONFIG --gpus N [--json] [--set a.b=c ...]`: the GPU placement of a config (infra/placement.py).

Prints which GPUs each trainer, rollout server and teacher server gets, as a table or, with --json, exactly
`{"processes": [{"stage", "name", "kind", "gpus", "mem_fraction"}, ...]}`. A request that does not fit exits 2 with
the planner's message. The table is followed by the run's checkpoint bytes (`alloy.plan.check_checkpoint_bytes`);
checkpoints that would not fit the storage's free space exit 2 too, naming the fields that size them. (`alloy run
--dry-run`, alloy/plan.py, is the other "plan": what a run would train.)
"""
from __future__ import annotations

import json
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def node_gpus(cfg, cli_gpus: int | None) -> int:
    """GPUs to plan for: `--gpus`, else `resources.gpus_per_node`, else the CUDA devices this process sees."""
    if cli_gpus is not None:
        return cli_gpus
    from tasks.gpu_lanes import node_gpus as configured_gpus

    return configured_gpus(cfg)


def _gpus_text(gpus: tuple[int, ...]) -> str:
    if len(gpus) > 2 and list(gpus) == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(str(g) for g in gpus)


def render(plan, config: str) -> str:
    lines = [f"placement of {config} on {plan.gpus} GPU(s) of {plan.gpu_memory_gb:g} GB "
             f"(model {plan.model_gb:g} GB: {plan.model_source})"]
    if not plan.processes:
        return lines[0] + "\nno GPUs: nothing is placed (every process runs as on a CPU machine)"
    rows = [("stage", "name", "kind", "gpus", "mem_fraction")]
    rows += [(p.stage, p.name, p.kind, _gpus_text(p.gpus), f"{p.mem_fraction:.2f}") for p in plan.processes]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from infra.config import ConfigError, load_config
    from infra.placement import PlacementError, make_plan, plan_problems

    if args.gpus is not None and args.gpus < 0:
        print(f"error: --gpus {args.gpus}: must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        # model.path need not exist on the machine that plans (resources.model_gb can stand for it); the planner
        # says so when it needs the checkpoint's config.json and cannot read it
        cfg = load_config(args.config, args.set, check_model_path=False)
        gpus = node_gpus(cfg, args.gpus)
        plan = make_plan(cfg, gpus)
    except (ConfigError, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problems = plan_problems(plan)
    if problems:  # a planner bug: never hand out a plan that breaks its own rules
        print("error: the plan breaks its rules:\n  " + "\n  ".join(problems), file=sys.stderr)
        return EXIT_FAILED
    if args.json:  # one process per line
        rows = ",\n".join("  " + json.dumps(p) for p in plan.to_json()["processes"])
        print('{"processes": [\n' + rows + "\n]}" if rows else '{"processes": []}')
    else:
        print(render(plan, args.config))
    from alloy.plan import check_checkpoint_bytes

    budget, lines = check_checkpoint_bytes(cfg, gpus, cfg.domain_names())
    if not args.json:
        print("\n".join(lines))
    if not budget.ok:
        print(f"error: {budget.name}: {budget.detail}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the GPU placement of a config (which GPUs each trainer and server gets)")
    p.add_argument("config", help="YAML config, e.g. configs/gpu-example.yaml")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="GPUs of the node (default: resources.gpus_per_node, else the CUDA devices seen here)")
    p.add_argument("--json", action="store_true", help='print {"processes": [...]} as JSON')
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(fn=cmd_plan)
