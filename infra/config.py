"""Typed configuration: one pydantic model per component, loaded from YAML once at the flow boundary.

`load_config(path, overrides)` reads YAML, applies `--set a.b.c=value` overrides (values parsed as YAML scalars,
list items addressed by index: `domains.0.difficulty=2`), and validates. Unknown keys and wrong types fail here,
with the dotted path of every bad field, as a `ConfigError` (the CLI exits with code 2).

Secrets (API keys) come from the environment, never from argv or flow parameters (which `ps` and the Prefect UI
show): `ALLOY_ENGINE_API_KEY` → `engine.api_key`, `ALLOY_JUDGE_API_KEY` → `specialists.guard.judge_api_key`, and
`ALLOY_SECRET_OVERRIDES` (a JSON list of `a.b=value` overrides) for any other field whose name marks a secret.
`load_config` applies them between the YAML file and the `--set` overrides (precedence: --set > environment >
file). `secret_overrides_env` turns secret overrides into that environment, for `alloy run` and trainer processes.
The `Secret` fields dump as "***" in JSON mode (what Prefect records for a parameter holding the config).

Here: `AlloyConfig` (the whole config) and its `fingerprint`, the loading, the secrets. The sections are in
`infra.config_shared` (what every stage reads, and `ConfigError`, `Secret`, `ops_field`) and `infra.config_stages`
(base, specialists, teachers, distill); this module re-exports every name of both (`__all__`), so the rest of the
tree imports them all from `infra.config`.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

# The sections live in two modules (what every stage reads | the stages' own); every name is re-exported here, and
# `from infra.config import X` is how the rest of the tree imports them.
from infra.choices import Backend
from infra.names import check_name
from infra.config_shared import (ConfigError, DatasetConfig, DomainConfig, EngineConfig, EvalConfig, ModelConfig,
                                 RecordConfig, ResourcesConfig, RewardConfig, RunConfig, Secret, TrackingConfig, TrainConfig, _problem, _Strict,
                                 ops_field)
from infra.config_stages import (OPD_LOSSES, STAGE_WIDE, BaseConfig, DistillConfig, GuardConfig, RewardModelConfig,
                                 SpecialistsConfig, TeachersConfig)
from infra.secrets import is_secret
from infra.tracking import flatten_config

__all__ = [
    # sections and their pieces (infra.config_shared, infra.config_stages)
    "ConfigError", "Secret", "ops_field", "OPD_LOSSES", "STAGE_WIDE", "RunConfig", "ModelConfig", "DatasetConfig",
    "DomainConfig", "RewardConfig", "TrainConfig", "BaseConfig", "EvalConfig", "TrackingConfig", "EngineConfig", "TeachersConfig",
    "ResourcesConfig", "RecordConfig", "DistillConfig", "GuardConfig", "SpecialistsConfig", "RewardModelConfig",
    # this module: the whole config, fingerprints, loading, secrets
    "AlloyConfig", "result_settings", "apply_overrides", "format_validation_error", "config_from_dict", "load_config",
    "SECRET_ENV", "SECRET_OVERRIDES_ENV", "is_secret_override", "split_secret_overrides", "secret_overrides_env",
    "secret_env_overrides", "refuse_secret_overrides", "secret_override_error",
]


def result_settings(model_cls: type[BaseModel], data: Mapping) -> dict:
    """`data` (a dump of `model_cls`, or part of one) without its `ops_field`s, recursively (nested sections, lists
    and name → section mappings of them (`reward_models`), and `specialists.per_domain` overrides, which are partial SpecialistsConfigs; an override left empty
    is dropped): what a stage's fingerprint hashes."""
    out = {}
    for key, value in data.items():
        field = model_cls.model_fields.get(key)
        if field is None:
            out[key] = value
            continue
        extra = field.json_schema_extra
        if isinstance(extra, dict) and (extra.get("fingerprint") is False
                                        or extra.get("fingerprint") == "when_set" and value == field.default):
            continue
        if model_cls is SpecialistsConfig and key == "per_domain":
            value = {d: kept for d, over in value.items() if (kept := result_settings(SpecialistsConfig, over))}
        else:
            sub = _model_in(field.annotation)
            if sub is not None and getattr(field.annotation, "__origin__", None) is dict and isinstance(value, Mapping):
                value = {k: result_settings(sub, v) if isinstance(v, Mapping) else v for k, v in value.items()}
            elif sub is not None and isinstance(value, Mapping):
                value = result_settings(sub, value)
            elif sub is not None and isinstance(value, list):
                value = [result_settings(sub, v) if isinstance(v, Mapping) else v for v in value]
        out[key] = value
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model class in a field's annotation (`TrainConfig`, `list[DomainConfig]`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


class AlloyConfig(_Strict):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    domains: list[DomainConfig] = Field(..., min_length=1)
    base: BaseConfig = Field(default_factory=BaseConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    specialists: SpecialistsConfig = Field(default_factory=SpecialistsConfig)
    teachers: TeachersConfig = Field(default_factory=TeachersConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    reward_models: dict[str, RewardModelConfig] = Field(default_factory=dict, description=(
        "name → a reward model trained on preference pairs after the base stage (docs/architecture.md, \"Reward "
        "models\"); none by default. The name keys its checkpoint prefix `rm-<name>-<hash>`."))

    @model_validator(mode="after")
    def _unique_domains(self) -> "AlloyConfig":
        names = [d.name for d in self.domains]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"domain names must be unique; repeated: {dupes}")
        unknown = sorted(set(self.teachers.external) - set(names))
        if unknown:
            raise ValueError(f"teachers.external names domains that are not configured: {unknown}")
        unknown = sorted(set(self.specialists.per_domain) - set(names))
        if unknown:
            raise ValueError(f"specialists.per_domain names domains that are not configured: {unknown}")
        for name in self.reward_models:
            try:
                check_name(name, "")
            except ValueError as exc:
                raise ValueError(f"reward_models: {name!r}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _rewards_resolve(self) -> "AlloyConfig":
        """A model-rewarded domain names a configured reward model, and the student adds no task reward (it has no
        reward model to ask: only the specialists and evaluation are handed one)."""
        rewarded = [(i, d) for i, d in enumerate(self.domains) if d.reward is not None]
        for i, d in rewarded:
            name = d.reward.reward_model
            if name is not None and name not in self.reward_models:
                raise ValueError(f"domains.{i}.reward.reward_model: no reward model {name!r} in reward_models "
                                 f"(configured: {sorted(self.reward_models) or 'none'})")
        if rewarded and self.distill.reward_coef:
            raise ValueError(f"distill.reward_coef={self.distill.reward_coef}: domains.{rewarded[0][0]}.reward is a "
                             "model reward the student cannot compute; set distill.reward_coef to 0")
        return self

    @model_validator(mode="after")
    def _schedules_fit(self) -> "AlloyConfig":
        """A cosine schedule decays over the steps after its warm-up: a warm-up as long as the stage, and an
        `lr_decay_steps` below the stage's steps or on a constant schedule, are refused here, when the config loads
        (`alloy config`, `--dry-run`), not minutes later in the stage's trainer."""
        checks = [("base", "train", self.base.train, self.base.steps),
                  ("distill", "train", self.distill.train, self.distill.steps)]
        if self.specialists.enabled:
            for d in self.domain_names():
                sc = self.specialists.for_domain(d)
                where = f"specialists.per_domain.{d}" if d in self.specialists.per_domain else "specialists"
                checks += [(where, "policy_train", sc.policy_train, sc.steps),
                           (where, "critic_train", sc.critic_train, sc.steps)]
        checks += [(f"reward_models.{n}", "train", rm.train, rm.steps) for n, rm in self.reward_models.items()]
        for where, name, t, steps in checks:
            if t.lr_decay_steps is not None:
                if t.lr_schedule != "cosine":
                    raise ValueError(f"{where}.{name}.lr_decay_steps={t.lr_decay_steps} applies to lr_schedule "
                                     f"cosine only (this one is {t.lr_schedule!r}): remove it or set lr_schedule: cosine")
                if t.lr_decay_steps < steps:
                    raise ValueError(f"{where}.{name}.lr_decay_steps={t.lr_decay_steps} is below {where}.steps={steps}: "
                                     "its last steps would train at lr 0; use at least the stage's steps (or null)")
            if t.lr_schedule == "cosine" and t.warmup_steps >= max(steps, 1):
                raise ValueError(f"{where}.{name}.warmup_steps={t.warmup_steps} must be below {where}.steps={steps} "
                                 "with lr_schedule cosine (it decays over the steps after the warm-up)")
        return self

    @model_validator(mode="after")
    def _scoring_fits(self) -> "AlloyConfig":
        """A teacher scoring call of the student (score_batch_size sequences × up to max_new_tokens + 1 positions ×
        (1 + top_k)) must fit the embedded servers' answer cap (engine.max_logprob_entries), or every call of the
        stage would be refused; refused here, when the config loads."""
        d, e = self.distill, self.engine
        need = d.score_batch_size * (d.max_new_tokens + 1) * (1 + d.top_k)
        if e.backend == Backend.EMBEDDED and d.steps > 0 and need > e.max_logprob_entries:
            raise ValueError(f"a teacher scoring call needs up to distill.score_batch_size={d.score_batch_size} × "
                             f"(distill.max_new_tokens={d.max_new_tokens} + 1) × (1 + distill.top_k={d.top_k}) = "
                             f"{need} log-prob entries, over engine.max_logprob_entries={e.max_logprob_entries}: "
                             "lower score_batch_size or top_k, or raise engine.max_logprob_entries")
        return self

    @property
    def storage_url(self) -> str:
        if self.run.storage:
            return self.run.storage.rstrip("/")
        return "file://" + str((Path(self.run.root) / self.run.name).resolve())

    def domain_names(self) -> list[str]:
        return [d.name for d in self.domains]

    def fingerprint(self, *sections: str) -> str:
        """A short hash of the given config sections (all if none): a stage's cache key. Only settings that change
        what is trained count: `ops_field`s (scheduling, logging, serving, credentials) are left out."""
        # python mode: secrets unmasked (JSON mode masks); the context drops unset dataset settings (DomainConfig._dump)
        data = result_settings(AlloyConfig, self.model_dump(context={"fingerprint": True}))
        if not data.get("reward_models"):  # a config without reward models keys what it keyed before they existed
            data.pop("reward_models", None)
        if sections:
            data = {k: data[k] for k in sections}
        for i, d in enumerate(self.domains if "domains" in data else ()):
            if d.dataset is not None:  # the file's content keys the checkpoints: a changed file moves them
                data["domains"][i]["dataset"]["sha256"] = d.dataset.content_sha256(f"domains.{i}.dataset.path")
        if "specialists" in data:
            _judge_by_content(data["specialists"])
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def _judge_by_content(specialists: dict) -> None:
    """Key a served judge (`specialists.guard.judge_path`, also one in `per_domain`) by its checkpoint's files, not
    its path: a run root copied or moved with its judge inside keeps its specialists, a retrained judge moves them.
    A path that is no directory (yet) keys by its string; the stage refuses it before it trains (alloy/plan.py)."""
    from infra.storage import tree_sha256

    guards = [specialists.get("guard")] + [o.get("guard") for o in (specialists.get("per_domain") or {}).values()
                                           if isinstance(o, dict)]
    for guard in guards:
        path = guard.get("judge_path") if isinstance(guard, dict) else None
        if path and Path(path).expanduser().is_dir():
            guard["judge_path"] = "sha256:" + tree_sha256(Path(path).expanduser())


# --------------------------------------------------------------------------------------------- loading


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. base.steps=100")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {item!r}: empty path segment in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a raw config dict (lists indexed by number). Returns the same dict."""
    for item in overrides or []:
        path, value = _parse_override(item)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            where = ".".join(path[: i + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {'.'.join(path)}: {where} is not a valid list index (list has {len(node)} items)")
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise ConfigError(f"--set {'.'.join(path)}: {where} is not a mapping")
        last = path[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"--set {'.'.join(path)}: {last!r} is not a valid list index")
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"--set {'.'.join(path)}: parent is not a mapping")
    return data


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}: {exc.error_count()} error(s)"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = _problem(err)
        got = err.get("input")
        shown = "" if err["type"] == "missing" or isinstance(got, (dict, list)) else f" (got {got!r})"
        lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<dict>", check_model_path: bool = True) -> AlloyConfig:
    """Validate `data`; `check_model_path=False` skips the local `model.path` existence check (see ModelConfig)."""
    try:
        return AlloyConfig.model_validate(data, context={"check_model_path": check_model_path})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None, check_model_path: bool = True) -> AlloyConfig:
    """Read YAML, apply the secrets of the environment (module docstring), then the overrides, and validate.
    Raises ConfigError with dotted paths. `check_model_path=False`: for a process that never reads `model.path`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(data).__name__}")
    apply_overrides(data, secret_env_overrides(os.environ))
    apply_overrides(data, overrides or [])
    return config_from_dict(data, source=str(path), check_model_path=check_model_path)


# --------------------------------------------------------------------------------------------- secrets

SECRET_ENV = {"engine.api_key": "ALLOY_ENGINE_API_KEY", "specialists.guard.judge_api_key": "ALLOY_JUDGE_API_KEY"}
SECRET_OVERRIDES_ENV = "ALLOY_SECRET_OVERRIDES"  # JSON list of "a.b=value" overrides of any other secret field


def is_secret_override(item: str) -> bool:
    """Whether an `a.b=value` override sets a secret: its key, or a key inside a mapping value, names one (the
    rule MLflow redaction uses, `infra.secrets.is_secret`), e.g. `engine.api_key=…` or `engine={api_key: …}`."""
    path, value = _parse_override(item)
    key = ".".join(path)
    flat = flatten_config(value, key) if isinstance(value, (dict, list)) and value else {key: value}
    return any(is_secret(k, v) for k, v in flat.items())


def split_secret_overrides(overrides: list[str] | None) -> tuple[list[str], list[str]]:
    """(plain overrides, secret overrides), each in the given order."""
    plain: list[str] = []
    secret: list[str] = []
    for item in overrides or []:
        (secret if is_secret_override(item) else plain).append(item)
    return plain, secret


def secret_overrides_env(secret_overrides: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that carry secret overrides to `load_config` (in a child process, or in this one after
    `os.environ.update`), on top of `environ` (the environment they will be added to): a string value of a
    SECRET_ENV field goes in its own variable, anything else (other secret fields, null, mappings) is appended to
    ALLOY_SECRET_OVERRIDES, applied exactly as `--set` would apply it, after the variables of `environ`."""
    env: dict[str, str] = {}
    rest = secret_env_overrides({SECRET_OVERRIDES_ENV: (environ or {}).get(SECRET_OVERRIDES_ENV, "")})
    for item in secret_overrides:
        path, value = _parse_override(item)
        name = SECRET_ENV.get(".".join(path))
        if name and isinstance(value, str) and value and not rest:  # the own variables are applied first: keep order
            env[name] = value
        else:
            rest.append(item)
    if rest:
        env[SECRET_OVERRIDES_ENV] = json.dumps(rest)
    return env


def secret_env_overrides(environ: Mapping[str, str]) -> list[str]:
    """The overrides the secrets of `environ` stand for (see `secret_overrides_env`; empty variables are unset)."""
    out = [f"{key}={json.dumps(environ[name])}" for key, name in SECRET_ENV.items() if environ.get(name)]
    raw = environ.get(SECRET_OVERRIDES_ENV)
    if raw:
        try:
            extra = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{SECRET_OVERRIDES_ENV} is not valid JSON: {exc.msg}") from None
        if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
            raise ConfigError(f"{SECRET_OVERRIDES_ENV} must be a JSON list of \"a.b=value\" strings")
        out += extra
    return out


def refuse_secret_overrides(overrides: list[str] | None, where: str) -> None:
    """Raise ConfigError naming the environment variable to use instead, if any override sets a secret. For flows:
    Prefect has stored their parameters before the flow body runs, so this can only refuse, not hide."""
    secret = split_secret_overrides(overrides)[1]
    if secret:
        raise secret_override_error(secret, where)


def secret_override_error(secret_overrides: list[str], where: str) -> ConfigError:
    """The refusal of secret overrides passed where they would be recorded (flow parameters, argv)."""
    keys = [".".join(_parse_override(item)[0]) for item in secret_overrides]
    how = "; ".join(f"{k}: set {SECRET_ENV[k]}" if k in SECRET_ENV else
                    f"{k}: put it in {SECRET_OVERRIDES_ENV} (a JSON list of \"{k}=…\" overrides)" for k in keys)
    return ConfigError(f"{where}: secret override(s) {keys} refused: a value passed here is recorded where others can "
                       f"read it; pass secrets through the environment instead ({how}), or use `alloy run --set`, "
                       f"which does that for you")
