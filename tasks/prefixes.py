"""Where each stage's checkpoints live: `<storage>/<stage>-<fingerprint>/`.

A fingerprint hashes the config sections a stage's result depends on, minus the settings marked `ops_field` in
the config (scheduling, logging, serving, credentials): changing those moves no prefix, so a rerun reuses every
complete checkpoint. Kept free of heavy imports: `alloy run --dry-run` computes the same prefixes as the stages.
"""
from __future__ import annotations

import hashlib
import json

from domains.compaction import compactions_of
from infra.config import ConfigError, RewardModelConfig, result_settings
from infra.datasets import DatasetLimitError, dataset_sha256
from infra.names import check_name
from infra.storage import join

BASE_SECTIONS = ("run", "model", "domains", "base")
# a specialist also depends on its own settings, the eval budget (its rollout budget when specialists.max_new_tokens
# is unset, and its score) and the rollout engine (backend and batching change which APRIL samples finish first)
SPECIALIST_SECTIONS = BASE_SECTIONS + ("specialists", "eval", "engine")
# the student also depends on its teachers (specialists or `teachers.external` URLs) and its own settings
STUDENT_SECTIONS = SPECIALIST_SECTIONS + ("teachers", "distill")


def base_prefix(cfg, storage_url: str) -> str:
    """Storage prefix of the base checkpoint (`cfg`: an infra.config.AlloyConfig). With tool trajectories and a
    policy-written compaction summary the base's demonstrations are compacted as the specialists' rollouts
    (training/base_main.py), so those compaction settings count too (and only then: other bases keep their prefix)."""
    fp = cfg.fingerprint(*BASE_SECTIONS)
    if cfg.base.tool_trajectories:
        own = compactions_of(cfg.specialists, [d.name for d in cfg.domains])  # per_domain merged in
        policy = {n: c for n, c in own.items() if c is not None and c.summary == "policy"}
        if policy:
            first = next(iter(policy.values()))
            if len(set(policy.values())) == 1 and len(policy) == len(own):  # one for all: the key it always had
                key = f"{fp}|compaction={first.max_context_tokens},{first.keep_last},{first.summary_tokens}"
            else:
                key = fp + "".join(f"|compaction[{n}]={c.max_context_tokens},{c.keep_last},{c.summary_tokens}"
                                   for n, c in sorted(policy.items()))
            fp = hashlib.sha256(key.encode()).hexdigest()
    return join(storage_url, f"base-{fp[:10]}")


def specialist_prefix_of(cfg, storage_url: str, domain: str) -> str:
    """Storage prefix of `domain`'s specialist: its own settings count (`specialists.per_domain[domain]` merged in),
    another domain's overrides do not."""
    check_name(domain, "domain name")  # one path segment (the config checked it; a caller's string is checked here too)
    own = cfg.specialists.for_domain(domain).model_copy(update={"per_domain": {}})
    fp = cfg.model_copy(update={"specialists": own}).fingerprint(*SPECIALIST_SECTIONS)
    fp = _with_reward_models(fp, cfg, [domain])
    return join(storage_url, f"specialist-{domain}-{fp[:10]}")


def student_prefix_of(cfg, storage_url: str) -> str:
    """Storage prefix of the student."""
    fp = _with_reward_models(cfg.fingerprint(*STUDENT_SECTIONS), cfg, [d.name for d in cfg.domains])
    return join(storage_url, f"student-{fp[:10]}")


def _with_reward_models(fp: str, cfg, domains: list[str]) -> str:
    """`fp`, keyed also by the reward model each of `domains` is trained on (`reward.reward_model`: its own prefix,
    so a retrained reward model moves its specialists and the student); unchanged when none is."""
    names = sorted({d.reward.reward_model for d in cfg.domains
                    if d.name in domains and d.reward is not None and d.reward.reward_model})
    if not names:
        return fp
    keys = "".join(f"|rm[{n}]={reward_model_prefix_of(cfg, '', n).rsplit('/', 1)[-1]}" for n in names)
    return hashlib.sha256((fp + keys).encode()).hexdigest()


def reward_model_prefix_of(cfg, storage_url: str, name: str) -> str:
    """Storage prefix of the reward model `reward_models.<name>`: `rm-<name>-<hash>` of its own settings (ops fields
    left out), the contents of its preference files, `model.chat_template` (how its text is rendered), the seed it
    trains with (its own, else run.seed) and where it starts: the base's own key (`base_prefix`) for `init: base`,
    else the checkpoint path. Another reward model's settings, and every other stage's, do not count."""
    check_name(name, "reward model name")
    rm = cfg.reward_models[name]
    own = result_settings(RewardModelConfig, rm.model_dump())
    own["seed"] = rm.seed if rm.seed is not None else cfg.run.seed
    files = {}
    for field in ("data", "val_data"):
        path = getattr(rm, field)
        if path is None:
            continue
        try:
            files[field] = dataset_sha256(path, int(rm.max_file_mb * 2 ** 20))
        except DatasetLimitError as exc:
            raise ConfigError(f"reward_models.{name}.max_file_mb: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"reward_models.{name}.{field}: cannot read {path}: {type(exc).__name__}: {exc}") from exc
    start = base_prefix(cfg, "").rsplit("/", 1)[-1] if rm.init == "base" else rm.init
    key = json.dumps({"rm": own, "sha256": files, "chat_template": cfg.model.chat_template, "init": start},
                     sort_keys=True)
    return join(storage_url, f"rm-{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")
