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
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, ValidationError, ValidationInfo,
                      field_validator, model_serializer, model_validator)

from infra.choices import (MAX_RUNNING_REQUESTS, READ_TIMEOUT_S, Backend, SglangWeightSync, StageMode, WeightSync,
                           values)
from infra.tracking import REDACTED, flatten_config, is_secret

# The OPD losses `distill.loss` may name. They are implemented above infra (student/losses.py, which config must not
# import); that registry is keyed by this tuple and refuses, at import, any name missing here or any name here
# without an implementation, so this is the one list of names.
OPD_LOSSES = ("sampled_rkl", "topk_kl")


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted path of each bad field."""


def _mask(value: str | None) -> str | None:
    return None if value is None else REDACTED


# A credential: the value in Python, "***" in every JSON dump of the config (a Prefect flow-run parameter holding a
# RunContext, `alloy config`, MLflow params), so it never leaves the process inside a serialised config.
Secret = Annotated[str | None, PlainSerializer(_mask, return_type=str | None, when_used="json")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def ops_field(default: Any = ..., **kw) -> Any:
    """A `Field` for a setting that changes how a stage runs (scheduling, logging, serving, credentials, fault
    handling), not what it trains: `AlloyConfig.fingerprint` leaves it out, so changing it moves no checkpoint
    prefix and a rerun reuses the checkpoints."""
    return Field(default, json_schema_extra={"fingerprint": False}, **kw)


def result_settings(model_cls: type[BaseModel], data: Mapping) -> dict:
    """`data` (a dump of `model_cls`, or part of one) without its `ops_field`s, recursively (nested sections, lists
    of them, and `specialists.per_domain` overrides, which are partial SpecialistsConfigs; an override left empty
    is dropped): what a stage's fingerprint hashes."""
    out = {}
    for key, value in data.items():
        field = model_cls.model_fields.get(key)
        if field is None:
            out[key] = value
            continue
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("fingerprint") is False:
            continue
        if model_cls is SpecialistsConfig and key == "per_domain":
            value = {d: kept for d, over in value.items() if (kept := result_settings(SpecialistsConfig, over))}
        else:
            sub = _model_in(field.annotation)
            if sub is not None and isinstance(value, Mapping):
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


class RunConfig(_Strict):
    """Run identity and where its files go."""
    name: str = Field("alloy", description="Run name; used for the run directory and the MLflow parent run.")
    root: str = ops_field("runs", description="Local working directory for runs (logs, local copies of checkpoints).")
    storage: str | None = ops_field(None, description="fsspec URL where checkpoints and reports go: file://… or s3://bucket/prefix. "
                                                 "Default: file://<root>/<name>.")
    seed: int = Field(0, description="Global seed (model init, data order, sampling).")
    resume: bool = ops_field(True, description="Reuse complete checkpoints of an earlier run with the same name and config.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or any(c in v for c in "/\\ \t\n") or v.startswith("."):
            raise ValueError("must be a non-empty name without slashes or whitespace")
        return v


class ModelConfig(_Strict):
    """The model every stage starts from: a fresh preset model, or a local HF checkpoint."""
    preset: Literal["nano", "tiny", "small", "base"] = Field("tiny", description="Size preset of the freshly built tiny model.")
    path: str | None = Field(None, description="A local HF causal-LM checkpoint to start from instead of a fresh preset model.")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="How prompts become token ids in every stage (SFT, rollouts, scoring, distillation, "
        "evaluation): `auto` renders them with the tokenizer's chat template when it has one (the domain's `system` "
        "message, the prompt as the user turn); `none`, or a tokenizer without a template, feeds BOS + the prompt.")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        """A local path must be a directory; a value like `org/name` that names nothing here may be a Hub id (found
        in the local HF cache or not: `alloy run --dry-run` checks it). Only the base stage reads it: a process
        that never does (a specialist or distill flow run on another worker, a trainer process) loads the config
        with `check_model_path=False`, and the path need not exist there."""
        if v is None:
            return v
        if not v.strip():
            raise ValueError("must not be empty (leave model.path out to build a fresh preset model)")
        if info.context and info.context.get("check_model_path") is False:
            return v
        p = Path(v).expanduser()
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"{v} is not a directory (expected an HF checkpoint directory)")
            return v
        first = v.split("/", 1)[0]
        looks_local = (v.startswith(("/", ".", "~")) or "\\" in v or v.count("/") > 1
                       or ("/" in v and Path(first).expanduser().is_dir()))
        if looks_local:
            raise ValueError(f"no such directory: {v}")
        import re  # Hugging Face's repo-id rules: `name` or `org/name` of [A-Za-z0-9_.-], no `..`/`--`, ≤ 96 chars

        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", v, re.ASCII) or ".." in v or "--" in v or len(v) > 96:
            raise ValueError(f"no such directory: {v} (nor a Hugging Face Hub id `name` or `org/name`)")
        return v


class DatasetConfig(_Strict):
    """A dataset domain's file and columns (domains/README.md, "Dataset domains"): one row per example, split
    train/val/eval by the hash of the prompt."""
    path: str = Field(..., description="The dataset file: a local path (relative to the working directory) or an "
                      "fsspec URL (s3://bucket/key, options from the AWS environment variables as for run.storage); "
                      ".jsonl, .json, .parquet or .csv.")
    prompt: str = Field("prompt", description="Column of the prompts (any text, multi-line, any Unicode).")
    answer: str = Field("answer", description="Column of the reference answers (text or numbers).")
    system: str | None = Field(None, description="System message of this domain's prompts (or the domain's system).")
    fields: list[str] = Field(default_factory=list, description="Extra columns the verifier reads (e.g. choices, "
                              "tests), passed along with each row.")
    max_new_tokens: int | None = Field(None, ge=1, description="Response budget in tokens; None: twice the longest "
                                       "train answer in the model's tokens, plus 8.")

    @field_validator("path")
    @classmethod
    def _local_file_exists(cls, v: str) -> str:
        """A local path must be an existing file; a remote URL (s3://…) is read when the domains load."""
        if not v.strip():
            raise ValueError("must not be empty")
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme in ("", "file", "local"):
            p = Path(v.split("://", 1)[1] if scheme else v).expanduser()
            if not p.exists():
                raise ValueError(f"no such file: {v}")
            if not p.is_file():
                raise ValueError(f"{v} is not a file")
        return v

    def content_sha256(self, where: str = "dataset.path") -> str:
        """The sha256 of the file's bytes (read once per process: infra/datasets.py); a ConfigError naming `where`
        if it cannot be read."""
        from infra.datasets import dataset_sha256

        try:
            return dataset_sha256(self.path)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {self.path}: {type(exc).__name__}: {exc}") from exc


class DomainConfig(_Strict):
    """One domain of the run: a built-in by name, a plugin class, or a dataset file (domains/README.md)."""
    name: str = Field(..., description="Built-in domain name, or the name of a plugin or dataset domain.")
    impl: str | None = Field(None, description='Plugin class as "package.module:ClassName" (any importable module).')
    difficulty: int = Field(1, ge=1, le=10, description="Difficulty knob of the domain's generator.")
    params: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the domain class.")
    dataset: DatasetConfig | None = Field(None, description="Read the examples from a dataset file instead of a "
                                          "generator (exclusive with impl).")
    verifier: str = Field("exact", description="A dataset domain's reward: exact, numeric[:REL_TOL], choice, "
                          "regex:PATTERN, math or code (domains/verifiers.py).")
    system: str | None = Field(None, description="System message of the domain's prompts (used with a chat template).")

    @field_validator("impl")
    @classmethod
    def _impl_form(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError('must look like "package.module:ClassName"')
        return v

    @field_validator("verifier")
    @classmethod
    def _verifier_of_a_dataset(cls, v: str, info: ValidationInfo) -> str:
        """The spec itself is checked by `domains.registry.load_domains` (infra does not import domains)."""
        if not v.strip():
            raise ValueError("must not be empty (exact, numeric, choice, regex:<pattern>, math or code)")
        if "dataset" in info.data and info.data["dataset"] is None and v != "exact":
            raise ValueError("applies to dataset domains only (a built-in or plugin domain scores with its own "
                             "score method)")
        return v

    @field_validator("system")
    @classmethod
    def _one_system(cls, v: str | None, info: ValidationInfo) -> str | None:
        ds = info.data.get("dataset")
        if v is not None and ds is not None and ds.system is not None:
            raise ValueError("dataset.system is set too: set one of them")
        return v

    @model_validator(mode="after")
    def _dataset_rules(self) -> "DomainConfig":
        if self.dataset is None:
            return self
        if self.impl is not None:
            raise ValueError("dataset and impl are exclusive: a domain reads a dataset file or runs a plugin class")
        if self.params:
            raise ValueError("params: a dataset domain takes none (set dataset.prompt / answer / fields instead)")
        if self.difficulty != 1:
            raise ValueError("difficulty: means nothing for a dataset domain; leave it out")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        """As usual, except in a fingerprint (`AlloyConfig.fingerprint`, which adds each dataset's sha256): the
        dataset settings left at their defaults are left out, so a generator domain keys its checkpoints as
        before they existed."""
        data = handler(self)
        if isinstance(info.context, dict) and info.context.get("fingerprint"):
            for key, default in (("dataset", None), ("verifier", "exact"), ("system", None)):
                if key in data and data[key] == default:
                    del data[key]
        return data


class TrainConfig(_Strict):
    """DeepSpeed settings shared by every trainer (base SFT, specialists, student)."""
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (torch AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip (0 = off).")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage (2/3 shard optimizer "
                                                                   "state, gradients, weights).")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Training precision; bf16 keeps fp32 "
                                                   "master weights, fp16 uses dynamic loss scaling.")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward pass on one rank.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warm-up: constant, or "
                                                         "cosine decay to 0 at the stage's last step.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    world_size: int = Field(1, ge=1, description="Ranks per trainer; > 1 launches the trainer under torchrun.")


def _refuse_sharded_weights(where: str, t: TrainConfig) -> None:
    """Multi-rank specialists and student: rank 0 alone generates with the trained module (validation, evals), so
    every rank must hold whole weights (ZeRO ≤ 2)."""
    if t.world_size > 1 and t.zero_stage == 3:
        raise ValueError(f"{where}.zero_stage: 3 shards the weights over the {t.world_size} ranks of "
                         f"{where}.world_size, but rank 0 alone generates with them (validation, evals); "
                         "use zero_stage 0-2 with world_size > 1")


class BaseConfig(_Strict):
    """The base stage: SFT of a fresh model on mixed-domain demonstrations."""
    steps: int = Field(300, ge=0, description="Optimizer steps of supervised fine-tuning.")
    n_train_per_domain: int = Field(2000, ge=1, description="Training examples drawn per domain (train split).")
    tool_trajectories: bool = Field(False, description="Tool domains (those with a `tool_demonstration`) are "
                                    "demonstrated by their intended tool trajectory, tool output lines loss-masked, "
                                    "instead of prompt + answer: a base that knows the tool protocol.")
    train: TrainConfig = Field(default_factory=TrainConfig)
    log_every: int = ops_field(25, ge=1, description="Log SFT metrics every N steps.")

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        """As usual, except in a fingerprint: `tool_trajectories` left at false is left out, so a base keys its
        checkpoints as before the setting existed."""
        data = handler(self)
        fingerprint = isinstance(info.context, dict) and info.context.get("fingerprint")
        if fingerprint and data.get("tool_trajectories") is False:
            del data["tool_trajectories"]
        return data


class EvalConfig(_Strict):
    """Evaluation of the base, the specialists and the student: greedy, on each domain's eval split."""
    n_eval: int = Field(100, ge=1, description="Held-out examples per domain (eval split).")
    max_new_tokens: int = Field(16, ge=1, le=512, description="Greedy answer budget per eval prompt.")
    batch_size: int = ops_field(128, ge=1, description="Prompts per batched generation call.")


class TrackingConfig(_Strict):
    """MLflow tracking: one parent run per pipeline, a nested run per stage."""
    enabled: bool = ops_field(True, description="Log to MLflow; false = no tracking at all.")
    uri: str | None = ops_field(None, description="MLflow tracking URI; default sqlite:///<root>/mlflow.db. "
                                              "MLFLOW_TRACKING_URI in the environment wins.")
    experiment: str = ops_field("alloy", description="MLflow experiment of the parent run.")


class EngineConfig(_Strict):
    """Engine servers the run launches (rollout servers of the trainers, teacher servers)."""
    backend: Literal[values(Backend)] = Field(Backend.EMBEDDED.value, description="embedded = Alloy's CPU server; "
                                              "sglang = real SGLang (infra/choices.py; launched as engine/backends.py says).")
    host: str = ops_field("127.0.0.1", description="Bind address of launched servers (loopback unless told otherwise).")
    api_key: Secret = ops_field(None, description="Bearer key for launched servers and the client (or ALLOY_ENGINE_API_KEY).")
    threads: int = ops_field(1, ge=1, description="Torch threads per embedded server.")
    max_running_requests: int | None = Field(None, ge=1, description="Sequences a launched server decodes at once "
                                             "(--max-running-requests; the rest queue). None = the backend's own: "
                                             f"embedded {MAX_RUNNING_REQUESTS}, SGLang sized from GPU memory.")
    sglang_args: dict[str, Any] = Field(default_factory=dict, description="Extra sglang.launch_server options (GPU).")
    weight_sync: Literal[values(WeightSync)] = ops_field(
        WeightSync.MEMORY.value, description="How a trainer pushes new weights to its rollout server. memory: a weight buffer in "
        "/dev/shm (or the work dir) copied into the embedded server's model in place (the load can overlap the next "
        "step); disk: an HF dir loaded with update_weights_from_disk. Embedded servers only: an SGLang server takes "
        "no weight buffers (see sglang_weight_sync).")
    sglang_weight_sync: Literal[values(SglangWeightSync)] = ops_field(
        SglangWeightSync.AUTO.value, description="How a trainer pushes weights to its SGLang rollout server: tensor = CUDA IPC "
        "(update_weights_from_tensor, same machine), distributed = NCCL broadcast (update_weights_from_distributed), "
        "disk = update_weights_from_disk; auto = tensor on the same machine with CUDA, distributed elsewhere, disk "
        "without CUDA. A failed fast push falls back to disk for the rest of the run (docs/placement.md).")
    read_timeout_s: float = ops_field(READ_TIMEOUT_S, gt=0, description="Embedded servers: seconds a client gets to send "
                                      "a request's headers, and again its body (a stalled request is dropped; the "
                                      "response time is not limited).")
    max_body_mb: float | None = ops_field(None, gt=0, description="Embedded servers: larger request bodies get HTTP 413. "
                                          "None = the largest request the protocol accepts (6 MiB at the default "
                                          "max_total_tokens).")


class TeachersConfig(_Strict):
    """Teacher servers of the distill stage: one per specialist, or external URLs."""
    external: dict[str, str] = Field(default_factory=dict, description="domain → URL of a teacher already served elsewhere.")
    health_timeout_s: float = ops_field(300.0, gt=0, description="Seconds launched teacher servers get to become healthy.")
    max_restarts: int = ops_field(3, ge=0, description="Restarts of a dead teacher server (per 10 min) before giving up on it.")
    check_tokenizers: bool = ops_field(True, description="Refuse to distill when a teacher's tokenizer differs from the student's.")

    @field_validator("external")
    @classmethod
    def _urls(cls, v: dict[str, str]) -> dict[str, str]:
        for dom, url in v.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"teacher URL for {dom!r} must start with http:// or https://, got {url!r}")
        return v


class ResourcesConfig(_Strict):
    """GPUs of one node and the memory model of the placement planner (infra/placement.py, docs/placement.md):
    which GPUs each trainer, rollout server and teacher server gets. No GPUs (unset here, no CUDA): no placement."""
    gpus_per_node: int | None = ops_field(None, ge=0, description="GPUs of one node the plan spreads the processes "
                                          "over (`alloy plan --gpus N` wins); None: the CUDA devices this process "
                                          "sees, 0 on a CPU machine (nothing is placed).")
    gpu_memory_gb: float = ops_field(80.0, gt=0, description="Memory of one GPU in GB (1e9 bytes).")
    model_gb: float | None = ops_field(None, gt=0, description="GB of one bf16 copy of the model's weights; None: "
                                       "estimated from model.path's config.json (params × dtype bytes).")
    kv_cache_gb: float | None = ops_field(None, ge=0, description="KV cache of each engine server in GB; None: "
                                          "half the weights, at least 1 GB.")
    trainer_overhead_gb: float = ops_field(4.0, ge=0, description="Per trainer rank, beyond its DeepSpeed state: "
                                           "activations, CUDA context.")
    colocate_rollout: bool = ops_field(False, description="A trainer shares its GPU(s) with its own rollout server "
                                       "(the trainer gets what the server leaves); false: servers get other GPUs.")


class DistillConfig(_Strict):
    """The OPD student (docs/architecture.md, "OPD (the merge)"): it samples on-policy, each sample's domain
    teacher scores it."""
    steps: int = Field(150, ge=0, description="Optimizer steps of the student (one batch of samples per step).")
    batch_size: int = Field(128, ge=1, description="Prompts sampled (one response each) per step, all domains mixed.")
    n_prompts_per_domain: int = Field(1000, ge=1, description="Train-split prompts per domain; the cursor cycles them.")
    max_new_tokens: int = Field(16, ge=1, le=512, description="Response budget per sample (the eval budget by default).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; 1.0 keeps rollout log-probs on-policy.")
    loss: Literal[OPD_LOSSES] = Field("topk_kl", description="OPD loss (the registry in student/losses.py).")
    direction: Literal["forward", "reverse", "jsd"] = Field("forward", description="topk_kl divergence direction.")
    beta: float = Field(0.5, ge=0, le=1, description="Generalized-JSD mixing weight (direction: jsd).")
    top_k: int = Field(16, ge=1, description="Teacher top-k log-probs per position (topk_kl; plus one tail bucket).")
    reward_coef: float = Field(0.0, ge=0, description="Weight of the task-reward advantage (verifier reward minus "
                                                      "its per-domain batch mean) mixed into the loss; 0 = off.")
    domain_weighting: Literal["uniform", "rkl"] = Field("uniform", description="How a batch's prompts split over "
                                                        "domains: evenly, or more to teachers the student is furthest "
                                                        "from (recent reverse KL; see rkl_mix).")
    rkl_mix: float = Field(0.5, ge=0, le=1, description="domain_weighting rkl: weight = (1 − mix)/D + mix · rkl_d/Σ rkl.")
    max_staleness: int = Field(1, ge=0, description="Max policy-version lag of a trained sample; also how far "
                                                    "sampling+scoring runs ahead of training (0 = synchronous).")
    deterministic: bool = Field(False, description="true: the same seed gives the same run on an idle and a busy "
                                "machine. Each batch is sampled with its own seed (run seed, batch index), and "
                                "batch k always from the weights of step k − max_staleness: the weight push after a "
                                "step waits until the batch that must still see the old weights is sampled "
                                "(sampling still overlaps training). false: a batch is sampled as soon as the "
                                "staleness bound allows, so its version (and the server's random draws) depend on "
                                "timing.")
    is_clip: float | None = Field(2.0, gt=0, description="Truncation of the per-token importance ratio "
                                                         "π_now/π_rollout (None = untruncated).")
    score_batch_size: int = ops_field(32, ge=1, description="Sequences per teacher /generate (scoring) call.")
    teacher_timeout_s: float = ops_field(60.0, gt=0, description="Per-request timeout of teacher calls.")
    teacher_retries: int = ops_field(8, ge=0, description="Client retries (exponential backoff, ≤ 4 s apart) of a "
                                                      "teacher call: covers a supervisor restart.")
    score_attempts: int = ops_field(3, ge=1, description="Whole scoring attempts of a batch before its samples are "
                                                     "dropped and counted (teacher unreachable).")
    eval_every: int = Field(50, ge=0, description="Per-domain greedy eval of the student every N steps (0 = off).")
    eval_n: int = Field(50, ge=1, description="Eval-split examples per domain for the in-training evals.")
    checkpoint_every: int = ops_field(50, ge=1, description="Commit a resumable checkpoint every N steps (and at the end).")
    log_every: int = ops_field(25, ge=1, description="Log train and per-teacher metrics every N steps.")
    threads: int = ops_field(1, ge=1, description="Torch threads of the student trainer process.")
    mode: Literal[values(StageMode)] = ops_field(StageMode.LOCAL.value, description="local: the student trains in the pipeline's "
                                                 "flow run; deployment: run_deployment of `distill.deployment` with "
                                                 "storage URLs of the base and the teachers (docs/scale-out.md).")
    deployment: str = ops_field("alloy-distill/default", description="Deployment the distill stage runs as in "
                                                                   "deployment mode.")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(lr=1e-3, micro_batch_size=128))

    @model_validator(mode="after")
    def _ranks(self) -> "DistillConfig":
        _refuse_sharded_weights("distill.train", self.train)
        return self


class GuardConfig(_Strict):
    """Anti-hack guard of tool-use domains (docs/architecture.md, "Anti-hack guard"): rule filter, then an LLM
    judge on flagged calls."""
    enabled: bool = Field(True, description="Guard the tool calls of tool-use domains; false = every call runs "
                                            "unchecked (only for the guard experiment, bench/guard_experiment.py).")
    judge_url: str | None = Field(None, description="Endpoint of the LLM judge (OpenAI-compatible or SGLang "
                                                    "/generate); wins over judge_path; None and no judge_path = "
                                                    "rule-only (said so in the log).")
    judge_path: str | None = Field(None, description="Local HF checkpoint of the judge: the specialists stage serves "
                                                     "it on one engine server per run (engine.backend, supervised "
                                                     "like the teachers), shared by every specialist, asked with "
                                                     "the sglang protocol (e.g. `python -m teachers.judge_model DIR`).")
    judge_kind: Literal["openai", "sglang"] = Field("openai", description="Protocol of judge_url (a judge_path "
                                                                          "server is always sglang).")
    judge_model: str | None = Field(None, description="Model name sent to an OpenAI-compatible judge.")
    judge_api_key: Secret = ops_field(None, description="Bearer key of the judge (or ALLOY_JUDGE_API_KEY); never logged.")
    allowed_hosts: list[str] = Field(default_factory=list, description="Hosts a fetch may reach without a flag.")
    judge_on_error: Literal["block", "allow"] = Field("block", description="A flagged call the judge could not "
                                                      "decide (error, timeout, after its retries): block (its rule "
                                                      "verdict) or allow; counted in guard.judge_errors either way.")
    judge_timeout_s: float = ops_field(10.0, gt=0, description="Timeout of one judge request (2 retries follow).")
    judge_max_tokens: int = Field(16, ge=1, description="New tokens the judge may write (its verdict: YES or NO).")
    judge_prompt_chars: int | None = Field(None, ge=64, description="The judge prompt (task, trajectory, call) is "
                                                                    "cut to this many characters, the trajectory "
                                                                    "from the left; None: the served judge_path's "
                                                                    "context length, else 4000.")


STAGE_WIDE = frozenset({"enabled", "max_parallel", "mode", "deployment", "retries", "per_domain"})


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _problem(err: Mapping) -> str:
    """One pydantic error's message as the config errors show it."""
    return "unknown key" if err.get("type") == "extra_forbidden" else str(err.get("msg")).removeprefix("Value error, ")


class SpecialistsConfig(_Strict):
    """Critic-based PPO per domain with APRIL partial rollouts (docs/architecture.md, "Critic-based PPO", "APRIL")."""
    enabled: bool = Field(True, description="Train specialists; false = the base model is every domain's teacher.")
    steps: int = Field(200, ge=0, description="PPO steps per specialist (one rollout batch each).")
    batch_size: int = Field(64, ge=1, description="Finished samples per step (APRIL batch target).")
    over_sampling: float = Field(1.25, ge=1.0, description="Requests per step = ceil(batch_size · over_sampling).")
    min_extra_requests: int = Field(4, ge=0, description="With over_sampling > 1, at least this many requests beyond "
                                    "batch_size (1.25 · 8 leaves two spare: bench/april.py measured 1.43x sync at "
                                    "B = 8, 1.67x with four).")
    max_staleness: int = Field(2, ge=0, description="Partials with tokens older than this many versions are dropped.")
    deterministic_rollouts: bool = Field(
        False, description="true: a step's samples do not depend on timing or machine load (the same seed gives the "
        "same run on an idle and a busy machine). Every generation call samples from its own seed (run seed, "
        "sample id, policy version, turn), so batch-mates on the server do not change its tokens; every request "
        "runs to the end of its episode, and the abort is decided by token count instead of the clock: the "
        "batch_size requests with the fewest new tokens (ties: request order) train, with any as short as the "
        "last of them, and the rest are cut to that length and kept as partials (APRIL as on a lockstep engine); "
        "samples train in request order. A step then waits for its slowest request, as with over_sampling = 1 "
        "(false: the first batch_size to finish by the clock train, the rest are aborted: faster, not "
        "reproducible).")
    mask_offpolicy: bool = Field(False, description="Mask resumed tokens older than max_staleness instead of TIS only.")
    max_new_tokens: int | None = Field(None, ge=1, le=512, description="Response budget (None: eval.max_new_tokens).")
    max_context_tokens: int | None = Field(
        None, ge=2, description="Compaction (teachers/compaction.py): a tool episode whose context (prompt + response "
        "so far) would outgrow this many tokens continues from a compacted one (a `>notes: …` line condensing the "
        "older tool outputs + the last compact_keep_last turns); each sub-trace trains as its own PPO row with the "
        "episode's reward. None: off (an episode is one sequence).")
    compact_keep_last: int = Field(2, ge=0, description="Completed turns kept verbatim after a compaction's notes.")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    n_prompts: int = Field(2000, ge=1, description="Train-split prompts per specialist; the cursor cycles them.")
    ppo_epochs: int = Field(4, ge=1, description="Optimizer steps per rollout batch (clipping bounds the drift).")
    eps_clip: float = Field(0.2, gt=0, description="PPO ratio clip: ratios outside [1 − ε, 1 + ε_high] get "
                                                   "no gradient.")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper clip ε_high (None: eps_clip).")
    eps_clip_c: float | None = Field(None, gt=1, description="Dual-clip constant (> 1) or None.")
    value_clip: float | None = Field(0.2, gt=0, description="Value-loss clip around the rollout's "
                                                             "values (None: unclipped).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the policy loss.")
    kl_coef: float = Field(0.05, ge=0, description="Per-token KL penalty (k1) to the base policy as the reference; "
                                                 "keeps low-signal domains from drifting.")
    tis_clip: float = Field(2.0, gt=0, description="Truncated importance sampling cap (rollout/trainer mismatch).")
    critic_warmup_steps: int = Field(20, ge=0, description="First steps train the critic only (a fresh value head "
                                                  "would otherwise feed noise into the advantages).")
    policy_train: TrainConfig = Field(default_factory=lambda: TrainConfig(lr=1e-3, micro_batch_size=64))
    critic_train: TrainConfig = Field(default_factory=lambda: TrainConfig(lr=1e-3, micro_batch_size=64))
    eval_n: int | None = Field(None, ge=1, description="Eval examples for the specialist's own score (None: eval.n_eval).")
    val_every: int = Field(50, ge=0, description="Steps between validations (greedy, on val_n val-split "
                                                 "prompts; also before the first step and after the last); 0: none "
                                                 "(the last policy is the specialist).")
    val_n: int = Field(200, ge=1, description="Val-split prompts per validation (a hash bucket never trained on, "
                                              "disjoint from eval).")
    select: Literal["best", "last"] = Field("best", description="The specialist is the policy with the best "
                                            "validation score (best) or the last one (last).")
    patience: int = Field(0, ge=0, description="Stop after this many validations without a new best (0: never).")
    stop_at: float | None = Field(None, gt=0, le=1, description="Stop once a validation score reaches this.")
    checkpoint_every: int = ops_field(20, ge=1, description="Commit a resumable checkpoint every N steps (and at the end).")
    log_every: int = ops_field(5, ge=1, description="Log training metrics every N steps.")
    max_parallel: int = ops_field(2, ge=1, description="Specialists trained at once (local mode).")
    mode: Literal[values(StageMode)] = ops_field(StageMode.LOCAL.value, description="local: concurrent subprocesses; deployment: "
                                                 "run_deployment of alloy-specialist/default per domain (work pool, "
                                                 "global concurrency limit `gpu`; checkpoints travel as storage URLs, "
                                                 "so run.storage must be shared, e.g. s3://; docs/scale-out.md).")
    deployment: str = ops_field("alloy-specialist/default", description="Deployment run per domain in deployment mode.")
    retries: int = ops_field(2, ge=0, description="Retries of a failed specialist (each resumes its checkpoint): "
                                              "task retries in local mode, new flow runs in deployment mode.")
    threads: int = ops_field(1, ge=1, description="Torch threads of each specialist trainer process.")
    guard: GuardConfig = Field(default_factory=GuardConfig)
    per_domain: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Overrides per domain, e.g. {interleave: {kl_coef: 0.0}}: any field above "
                                          "except the stage-wide ones (enabled, max_parallel, mode, deployment, "
                                          "retries); nested fields merge (policy_train: {lr: 2e-3}).")

    def for_domain(self, name: str) -> "SpecialistsConfig":
        """This config with `per_domain[name]` merged in (the settings `name`'s specialist trains with)."""
        if name not in self.per_domain:
            return self
        merged = _deep_merge(self.model_dump(exclude={"per_domain"}), self.per_domain[name])
        return SpecialistsConfig.model_validate(merged)

    @model_validator(mode="after")
    def _per_domain_fields(self) -> "SpecialistsConfig":
        for name, over in self.per_domain.items():
            wide = sorted(set(over) & STAGE_WIDE)
            if wide:
                raise ValueError(f"specialists.per_domain.{name}: {wide} apply to the whole stage, not to one domain")
            try:
                self.for_domain(name)
            except ValidationError as exc:
                problems = "; ".join(": ".join(filter(None, (".".join(str(x) for x in e["loc"]),
                                                             _problem(e).removeprefix("Value error, "))))
                                     for e in exc.errors())
                raise ValueError(f"specialists.per_domain.{name}: {problems}") from None
        return self

    @model_validator(mode="after")
    def _single_rank(self) -> "SpecialistsConfig":
        for name in ("policy_train", "critic_train"):
            t = getattr(self, name)
            if t.grad_accum != 1:
                raise ValueError(f"specialists.{name}.grad_accum: each PPO epoch is one optimizer step; must be 1")
            _refuse_sharded_weights(f"specialists.{name}", t)
        if self.policy_train.world_size != self.critic_train.world_size:
            raise ValueError(f"specialists.policy_train.world_size ({self.policy_train.world_size}) and "
                             f"specialists.critic_train.world_size ({self.critic_train.world_size}) must be equal: "
                             "policy and critic train in the same processes (one torchrun process group)")
        if self.val_every == 0 and (self.patience or self.stop_at is not None):
            raise ValueError("specialists.patience / specialists.stop_at need validations: set specialists.val_every > 0")
        return self


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
        if sections:
            data = {k: data[k] for k in sections}
        for i, d in enumerate(self.domains if "domains" in data else ()):
            if d.dataset is not None:  # the file's content keys the checkpoints: a changed file moves them
                data["domains"][i]["dataset"]["sha256"] = d.dataset.content_sha256(f"domains.{i}.dataset.path")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


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
    rule MLflow redaction uses, `infra.tracking.is_secret`), e.g. `engine.api_key=…` or `engine={api_key: …}`."""
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
