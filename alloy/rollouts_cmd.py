"""`alloy rollouts list | show | diff WHERE`: read what the policies sampled, from a run's rollout records.

WHERE is a run's storage (`file://…`, `s3://…` or a directory: every trainer's records under it), one trainer's
checkpoint prefix (`…/specialist-reverse-<hash>`), or a config YAML (its `run.storage`, else `<run.root>/<run.name>`).
The records are the Parquet files trainers write under `<prefix>/rollouts/` (training/rollout_records.py: a sample
every `record.every` steps, everything with `record.full`; and the first `record.sample` episodes per domain of
every evaluation, split "eval", and of a specialist's validations, split "val").

    alloy rollouts list runs/demo                                   trainers with records: split, steps, rows,
                                                                    mean reward
    alloy rollouts show runs/demo --domain reverse --step 40        the rows, filtered (--split, --stage,
                                                                    --min/--max-reward, --blocked, --limit), --long for
                                                                    whole texts, --json
    alloy rollouts diff runs/demo --domain reverse --steps 10 150   two steps side by side: reward, length, staleness,
                                                                    finish reasons, tool calls; the prompts both share
    alloy rollouts diff runs/demo --split eval --steps 0 150        two evaluations: the same prompts, both responses

`--split train|eval|val` keeps one kind of row (list and show: every split unless given; diff: train unless given,
as two steps are compared within one split).

Exit codes: 0, 2 for bad input (no records there, a step that was not recorded).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_OK, EXIT_USAGE = 0, 2
PREVIEW = 48  # characters of prompt / response in a table row


class RolloutsError(Exception):
    """Bad input: the message names the path, field or step."""


def storage_of(where: str) -> str:
    """The storage URL `where` names: a config's run storage, a URL as given, or a directory as file://."""
    if where.endswith((".yaml", ".yml")) and Path(where).is_file():
        from infra.config import load_config

        return load_config(where).storage_url
    if "://" in where:
        return where.rstrip("/")
    path = Path(where).expanduser()
    if not path.exists():
        raise RolloutsError(f"{where}: no such directory, URL or config")
    return f"file://{path.resolve()}"


def trainer_prefixes(url: str) -> list[str]:
    """Every trainer prefix under `url` that has rollout records (`<prefix>/rollouts/[<split>-]step-*.parquet`),
    sorted."""
    from infra.storage import get_fs
    from training.rollout_records import FOLDER, parse_name

    fs, path = get_fs(url)
    proto = url.split("://", 1)[0] + "://"
    hits = set()
    for pattern in (f"{path}/{FOLDER}/*step-*.parquet", f"{path}/**/{FOLDER}/*step-*.parquet"):
        for p in fs.glob(pattern):
            if parse_name(p) is not None:
                hits.add(proto + p.rsplit(f"/{FOLDER}/", 1)[0])  # a local path starts with "/": file:///…
    if not hits:
        raise RolloutsError(f"no rollout records under {url} (trainers write them as <prefix>/{FOLDER}/step-NNNNNN"
                            f".parquet; `specialists.record` / `distill.record` say how often)")
    return sorted(hits)


def load(where: str, split: str | None = None):
    """(DataFrame of every record under `where` with a `prefix` column, the prefixes); only `split`'s rows when
    given (train, eval, val: a RolloutsError when there are none)."""
    import pandas as pd

    from training.rollout_records import read_rollouts

    prefixes = trainer_prefixes(storage_of(where))
    frames = []
    for prefix in prefixes:
        df = read_rollouts(prefix, split=None)
        df["prefix"] = prefix
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    if split is not None:
        if split not in set(df.split):
            raise RolloutsError(f"--split {split}: no records of it under {where}; recorded splits: "
                                f"{sorted(set(df.split))}")
        df = df[df.split == split]
    return df, prefixes


def select(df, args):
    """The rows the filters of `show` / `diff` keep."""
    if args.stage:
        df = df[df.stage == args.stage]
    if args.domain:
        if args.domain not in set(df.domain):
            raise RolloutsError(f"--domain {args.domain}: no records of it; recorded domains: {sorted(set(df.domain))}")
        df = df[df.domain == args.domain]
    if getattr(args, "step", None) is not None:
        if args.step not in set(df.step):
            raise RolloutsError(f"--step {args.step}: not recorded; recorded steps: {sorted(set(df.step))}")
        df = df[df.step == args.step]
    if getattr(args, "min_reward", None) is not None:
        df = df[df.reward >= args.min_reward]
    if getattr(args, "max_reward", None) is not None:
        df = df[df.reward <= args.max_reward]
    if getattr(args, "blocked", False):
        df = df[df.blocked_calls > 0]
    return df


def _cut(text: str, n: int = PREVIEW) -> str:
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= n else flat[:n - 1] + "…"


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_list(args) -> int:
    from training.rollout_records import SPLITS

    df, prefixes = load(args.where, args.split)
    df = df.assign(_order=df.split.map(SPLITS.index))  # train, val, eval
    rows = [("stage", "split", "domain", "steps recorded", "rows", "mean reward", "prefix")]
    for (prefix, stage, domain, _, split), part in df.groupby(["prefix", "stage", "domain", "_order", "split"],
                                                               sort=True):
        steps = sorted(set(part.step))
        span = f"{steps[0]}..{steps[-1]} ({len(steps)})" if len(steps) > 1 else str(steps[0])
        rows.append((stage, split, domain, span, len(part), f"{part.reward.mean():.3f}", prefix))
    print(table(rows))
    return EXIT_OK


def row_dict(r) -> dict:
    keep = ("stage", "split", "domain", "step", "sample_id", "episode_id", "weight_version", "staleness", "reward",
            "finish_reason", "blocked_calls", "tool_calls", "prompt", "response")
    out = {k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in keep}
    out["response_tokens"] = len(r["output_ids"])
    return out


def cmd_show(args) -> int:
    df, _ = load(args.where, args.split)
    df = select(df, args).sort_values(["step", "stage", "split", "domain", "sample_id"]).head(args.limit)
    if args.json:
        print(json.dumps([row_dict(r) for _, r in df.iterrows()], indent=1))
        return EXIT_OK
    if df.empty:
        print("no rows match")
        return EXIT_OK
    if args.long:
        for _, r in df.iterrows():
            print(f"--- {r.stage} {r.domain} {'' if r.split == 'train' else r.split + ' '}step {r.step} "
                  f"{r.sample_id}: reward {r.reward:.3f}, staleness "
                  f"{r.staleness}, {r.finish_reason}, {len(r.output_ids)} tokens, tool calls {r.tool_calls}, blocked "
                  f"{r.blocked_calls}")
            print(f"prompt:   {r.prompt}\nresponse: {r.response}")
        return EXIT_OK
    rows = [("step", "stage", "split", "domain", "reward", "stale", "finish", "tokens", "tools", "blocked", "prompt",
             "response")]
    rows += [(r.step, r.stage, r.split, r.domain, f"{r.reward:.3f}", r.staleness, r.finish_reason, len(r.output_ids),
              r.tool_calls, r.blocked_calls, _cut(r.prompt), _cut(r.response)) for _, r in df.iterrows()]
    print(table(rows))
    return EXIT_OK


def step_summary(part) -> dict:
    return {"rows": int(len(part)), "mean_reward": float(part.reward.mean()),
            "mean_tokens": float(part.output_ids.map(len).mean()), "mean_staleness": float(part.staleness.mean()),
            "tool_calls": int(part.tool_calls.sum()), "blocked_calls": int(part.blocked_calls.sum()),
            "finish": {k: int(v) for k, v in part.finish_reason.value_counts().sort_index().items()}}


def cmd_diff(args) -> int:
    split = args.split or "train"  # two steps within one split: an eval's rows are not a training step's
    df, _ = load(args.where, split)
    args.step = None
    df = select(df, args)
    a, b = args.steps
    for s in (a, b):
        if s not in set(df.step):
            raise RolloutsError(f"--steps: step {s} was not recorded (split {split}); recorded steps: "
                                f"{sorted(set(df.step))}")
    out = {}
    for domain, part in df.groupby("domain", sort=True):
        pa, pb = part[part.step == a], part[part.step == b]
        if pa.empty or pb.empty:
            continue
        shared = sorted(set(pa.prompt) & set(pb.prompt))
        out[domain] = {str(a): step_summary(pa), str(b): step_summary(pb),
                       "shared_prompts": [{"prompt": p, str(a): pa[pa.prompt == p].response.tolist(),
                                           str(b): pb[pb.prompt == p].response.tolist()} for p in shared]}
    if args.json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    rows = [("domain", "step", "rows", "reward", "tokens", "staleness", "tool calls", "blocked", "finish")]
    for domain, d in out.items():
        for s in (str(a), str(b)):
            x = d[s]
            rows.append((domain, s, x["rows"], f"{x['mean_reward']:.3f}", f"{x['mean_tokens']:.1f}",
                         f"{x['mean_staleness']:.2f}", x["tool_calls"], x["blocked_calls"],
                         ",".join(f"{k}:{v}" for k, v in x["finish"].items())))
    print(table(rows) if len(rows) > 1 else f"no domain has records at both steps {a} and {b}")
    for domain, d in out.items():
        for item in d["shared_prompts"]:
            print(f"\n{domain} {_cut(item['prompt'], 80)}\n  step {a}: {item[str(a)]}\n  step {b}: {item[str(b)]}")
    return EXIT_OK


def add_parser(sub) -> None:
    r = sub.add_parser("rollouts", help="read a run's rollout records: list, show, diff (what the policies sampled)")
    rsub = r.add_subparsers(dest="rollouts_command", required=True)

    def split_arg(p, default: str) -> None:
        p.add_argument("--split", choices=["train", "eval", "val"], default=None,
                       help=f"train: trained samples; eval: the evaluations' samples; val: a specialist's "
                            f"validations' ({default})")

    def common(p, step: bool) -> None:
        p.add_argument("where", help="run storage (dir, file:// or s3:// URL), a trainer's prefix, or a config YAML")
        split_arg(p, "default: every split" if step else "default: train")
        p.add_argument("--stage", choices=["specialist", "student"], default=None)
        p.add_argument("--domain", default=None)
        if step:
            p.add_argument("--step", type=int, default=None)
        p.add_argument("--min-reward", type=float, default=None)
        p.add_argument("--max-reward", type=float, default=None)
        p.add_argument("--blocked", action="store_true", help="only episodes with a guard-blocked tool call")
        p.add_argument("--json", action="store_true", help="JSON instead of a table")

    ls = rsub.add_parser("list", help="trainers with records: stage, split, domain, steps, rows, mean reward")
    ls.add_argument("where", help="run storage (dir, file:// or s3:// URL), a trainer's prefix, or a config YAML")
    split_arg(ls, "default: every split")
    ls.set_defaults(fn=run(cmd_list))
    sh = rsub.add_parser("show", help="print recorded rows, filtered")
    common(sh, step=True)
    sh.add_argument("--limit", type=int, default=20, help="rows at most (default 20)")
    sh.add_argument("--long", action="store_true", help="whole prompt and response of each row")
    sh.set_defaults(fn=run(cmd_show))
    df = rsub.add_parser("diff", help="two recorded steps side by side, per domain")
    common(df, step=False)
    df.add_argument("--steps", type=int, nargs=2, required=True, metavar=("A", "B"))
    df.set_defaults(fn=run(cmd_diff))


def run(fn):
    """`fn` with bad input turned into a message on stderr and exit code 2."""
    def wrapped(args) -> int:
        try:
            return fn(args)
        except (RolloutsError, FileNotFoundError) as e:
            print(f"alloy rollouts: {e}", file=sys.stderr)
            return EXIT_USAGE
    return wrapped
