"""Evaluation: mean verifier reward per domain on the held-out eval split, greedy decoding, batched.

Returns a pandas DataFrame with one row per (domain, stage), shared by the report, MLflow (`log_table`) and the
benchmarks: columns `domain, stage, score, n_eval, checkpoint`.
"""
from __future__ import annotations

from typing import Callable, Mapping

import pandas as pd

from infra.generation import generate_batch
from infra.models import load_model, load_tokenizer

COLUMNS = ["domain", "stage", "score", "n_eval", "checkpoint"]


def evaluate_model(model, tokenizer, domains: Mapping[str, object], n_eval: int, seed: int, stage: str,
                   max_new_tokens: int = 16, batch_size: int = 128, checkpoint: str = "",
                   progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Score `model` on each domain's eval split (`domain.split("eval", n_eval, seed)`), greedy.

    All domains' prompts go through one batched generation pass (sorted by length to limit padding).
    """
    items = []  # (domain name, example)
    for name, dom in domains.items():
        items.extend((name, ex) for ex in dom.split("eval", n_eval, seed))
    order = sorted(range(len(items)), key=lambda i: len(items[i][1].prompt))
    completions: list[str] = [""] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        outs = generate_batch(model, tokenizer, [items[i][1].prompt for i in idx], max_new_tokens, batch_size=batch_size)
        for i, text in zip(idx, outs):
            completions[i] = text
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    rewards: dict[str, list[float]] = {name: [] for name in domains}
    for (name, ex), text in zip(items, completions):
        rewards[name].append(domains[name].verify(ex, text))
    rows = [{"domain": n, "stage": stage, "score": sum(r) / len(r), "n_eval": len(r), "checkpoint": checkpoint}
            for n, r in rewards.items()]
    return pd.DataFrame(rows, columns=COLUMNS)


def evaluate(checkpoint_dir: str, domains: Mapping[str, object], n_eval: int, seed: int, stage: str,
             max_new_tokens: int = 16, batch_size: int = 128, progress=None) -> pd.DataFrame:
    """Load an HF checkpoint directory and evaluate it (see `evaluate_model`)."""
    model = load_model(checkpoint_dir)
    tok = load_tokenizer(checkpoint_dir)
    return evaluate_model(model, tok, domains, n_eval, seed, stage, max_new_tokens, batch_size,
                          checkpoint=str(checkpoint_dir), progress=progress)
