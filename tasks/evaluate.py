"""Evaluation stage: greedy eval-split scores per domain for one checkpoint, logged to MLflow (a tool domain's
clean score as `eval/<stage>/<domain>`, its raw score and hack attempts per 100 episodes beside it; a model-rewarded
domain's model reward as `eval/<stage>/<domain>/reward`, scored by the servers `tasks/reward_servers.py` started)."""
from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from domains.compaction import compactions_of
from domains.evaluate import evaluate, reward_metrics, tool_metrics
from domains.model_reward import rewarders_of
from infra.progress import progress
from tasks.context import RunContext, stage_timer


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_stage(ctx: RunContext, checkpoint_dir: str, stage: str, domains: list[str] | None = None) -> pd.DataFrame:
    cfg = ctx.cfg
    doms = {n: d for n, d in ctx.domains.items() if domains is None or n in domains}
    with stage_timer(ctx, "eval"), progress(f"eval {stage}", len(doms) * cfg.eval.n_eval) as bar:
        df = evaluate(checkpoint_dir, doms, cfg.eval.n_eval, cfg.run.seed, stage,
                      max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                      progress=lambda done, total: bar(done), chat_template=cfg.model.chat_template,
                      device=cfg.eval.device, dtype=cfg.eval.dtype,
                      compaction=compactions_of(cfg.specialists, doms),  # tool episodes compacted as trained
                      rewarders=lambda tok: rewarders_of(cfg, doms, tok))
    ctx.tracker.log_metrics({f"eval/{stage}/{r.domain}": float(r.score) for r in df.itertuples()})
    ctx.tracker.log_metrics(tool_metrics(df, f"eval/{stage}/"))  # tool domains: raw score, hack attempts
    ctx.tracker.log_metrics(reward_metrics(df, f"eval/{stage}/"))  # model-rewarded domains: the model's reward
    ctx.tracker.log_metrics({f"eval/{stage}/mean": float(df["score"].mean())})
    return df
