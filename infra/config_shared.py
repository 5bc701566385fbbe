"""The config sections every stage reads, and the pieces every section is built from.

Pieces: `ConfigError` (raised by the loading in `infra.config`, and by `DatasetConfig.content_sha256` here, so it
lives below both), the strict base model `_Strict`, the `Secret` string type, `ops_field` (a setting left out of
the fingerprints) and `_problem` (one pydantic error as the config errors word it). Sections: run, model, domains
(with their dataset files), the DeepSpeed settings `TrainConfig`, eval, tracking, engine and resources.

The sections of the three stages (base, specialists with their guard, teachers, distill) are in
`infra.config_stages`; `AlloyConfig`, the loading, the secrets and the fingerprints in `infra.config`, which
re-exports every name of both modules: import them from `infra.config`. Split out of `infra/config.py` to keep each
file readable; the classes are unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from infra.choices import (DEFAULT_MAX_FILE_MB, DEFAULT_MAX_ROW_KB, MAX_LOGPROB_ENTRIES, MAX_RUNNING_REQUESTS,
                           READ_TIMEOUT_S, Backend, SglangWeightSync, WeightSync, values)
from infra.names import NAME_RULE, check_name
from infra.secrets import REDACTED


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted path of each bad field."""


def _mask(value: str | None) -> str | None:
    return None if value is None else REDACTED


# A credential: the value in Python, "***" in every JSON dump of the config (a Prefect flow-run parameter holding a
# RunContext, `alloy config`, MLflow params), so it never leaves the process inside a serialised config.
Secret = Annotated[str | None, PlainSerializer(_mask, return_type=str | None, when_used="json")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _partial_sections_keep_their_defaults(cls, data: Any) -> Any:
        """A sub-section given in part (a YAML mapping with some of its keys, a `--set a.b.c=…`) fills the keys it
        leaves out from the default instance the parent's `default_factory` builds, not from the section class's
        own defaults: `specialists.policy_train.lr=…` keeps the stage's micro_batch_size 64 (TrainConfig's is 32).
        Only the fields where that instance differs from the class defaults are added, so a section whose default
        is its class (`default_factory=GuardConfig`) validates exactly as given."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            given = data.get(name)
            if isinstance(given, Mapping) and field.default_factory is not None:
                default = field.default_factory()
                if isinstance(default, BaseModel):
                    out[name] = {**default.model_dump(exclude_defaults=True), **given}
        return out


def ops_field(default: Any = ..., **kw) -> Any:
    """A `Field` for a setting that changes how a stage runs (scheduling, logging, serving, credentials, fault
    handling), not what it trains: `AlloyConfig.fingerprint` leaves it out, so changing it moves no checkpoint
    prefix and a rerun reuses the checkpoints."""
    return Field(default, json_schema_extra={"fingerprint": False}, **kw)


def keyed_when_set(default: Any = None, **kw) -> Any:
    """A `Field` for a setting that changes what is trained, added after run roots existed: at its default
    (`default`, None) `AlloyConfig.fingerprint` leaves it out, so a config without it keys what it keyed before the
    field existed (its checkpoints are reused); set, it keys the stage like any other setting."""
    return Field(default, json_schema_extra={"fingerprint": "when_set"}, **kw)


def _problem(err: Mapping) -> str:
    """One pydantic error's message as the config errors show it."""
    return "unknown key" if err.get("type") == "extra_forbidden" else str(err.get("msg")).removeprefix("Value error, ")


class RunConfig(_Strict):
    """Run identity and where its files go."""
    name: str = Field("alloy", description="Run name; used for the run directory and the MLflow parent run: "
                      f"{NAME_RULE}.")
    root: str = ops_field("runs", description="Local working directory for runs (logs, local copies of checkpoints).")
    storage: str | None = ops_field(None, description="fsspec URL where checkpoints and reports go: file://… or s3://bucket/prefix. "
                                                 "Default: file://<root>/<name>.")
    seed: int = Field(0, description="Global seed (model init, data order, sampling).")
    resume: bool = ops_field(True, description="Reuse complete checkpoints of an earlier run with the same name and config.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name(v, "")  # the run's directory: one safe path segment (infra/names.py)


class ModelConfig(_Strict):
    """The model every stage starts from: a fresh preset model, or a local HF checkpoint."""
    preset: Literal["nano", "tiny", "small", "base", "medium"] = Field(
        "tiny", description="Size preset of the freshly built model (infra/presets.py): nano, tiny, small, base (4.7M "
        "parameters) are CPU-sized; medium (151M) is for a GPU.")
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


def check_data_file(v: str) -> str:
    """A data file setting (a dataset domain's, a reward model's preference data): a local path must be an existing
    file; a remote URL (s3://…) is read when the data loads."""
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
    max_file_mb: float = ops_field(DEFAULT_MAX_FILE_MB, gt=0, description="Largest dataset file read, in MiB: a "
                                   "larger file is refused before it is read (the whole file stays in a per-process "
                                   "cache).")
    max_row_kb: float = ops_field(DEFAULT_MAX_ROW_KB, gt=0, description="Largest row, in KiB: the UTF-8 bytes of the "
                                  "cells the domain reads (prompt, answer, fields; non-text cells as JSON). Larger "
                                  "rows are refused by row number (and line, for JSONL).")

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mb * 2 ** 20)

    @property
    def max_row_bytes(self) -> int:
        return int(self.max_row_kb * 2 ** 10)

    @field_validator("path")
    @classmethod
    def _local_file_exists(cls, v: str) -> str:
        return check_data_file(v)

    def content_sha256(self, where: str = "dataset.path") -> str:
        """The sha256 of the file's bytes (read once per process: infra/datasets.py); a ConfigError naming `where`
        if it cannot be read."""
        from infra.datasets import DatasetLimitError, dataset_sha256

        try:
            return dataset_sha256(self.path, self.max_file_bytes)
        except DatasetLimitError as exc:
            raise ConfigError(f"{where.rsplit('.', 1)[0]}.{exc.field}: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {self.path}: {type(exc).__name__}: {exc}") from exc


class RewardConfig(_Strict):
    """A dataset domain rewarded by a model instead of its verifier (issue 54; docs/architecture.md, "Domains
    without a verifier"): `kind: model`, a reward model on SGLang's `/classify` (one of this run's `reward_models`,
    served by the pipeline, or an external `url`); `kind: judge`, a chat model asked to grade each answer against a
    `rubric` (an external OpenAI-compatible `url`, or a chat checkpoint `model` the pipeline serves). The specialist
    is trained on this reward; evaluation reports it beside the ground truth `truth` when the domain has one."""
    kind: Literal["model", "judge"] = Field(..., description="`model`: a reward model's score; `judge`: a chat "
                                            "model's graded answer to the rubric.")
    reward_model: str | None = Field(None, description="kind model: the name of a `reward_models` entry, trained and "
                                     "served by the pipeline (exclusive with url).")
    url: str | None = Field(None, description="An external server: kind model, a reward model's `/classify` "
                            "(SGLang or `alloy serve`); kind judge, any OpenAI-compatible chat server (`/v1` "
                            "optional).")
    model: str | None = Field(None, description="kind judge: a local chat checkpoint directory (with a chat "
                              "template) that the pipeline serves for the specialists and evaluation (exclusive "
                              "with url).")
    truth: str | None = Field(None, description="A ground-truth verifier spec (as `domains.<i>.verifier`) that "
                              "evaluation reports as the domain's score beside the reward; never a training "
                              "reward. null: the reward is the score.")
    normalize: Literal["batch", "sigmoid"] = Field("batch", description="kind model, training reward: `batch`: "
                                                  "σ of the raw score's z-score over the step's batch; `sigmoid`: σ "
                                                  "of the raw score. Evaluation always reports the mean σ(raw score).")
    length_penalty: float = Field(0.0, ge=0, description="Training reward minus this × (response tokens beyond "
                                  "length_free) / the domain's token budget, clamped to [0, 1]: a length control "
                                  "against a reward that pays for length.")
    length_free: int = Field(0, ge=0, description="Response tokens the length penalty does not charge (what a right "
                             "answer needs), so it holds back only answers longer than the task asks for.")
    max_length: int | None = Field(None, ge=8, description="kind model: tokens of one scored sequence (null: the "
                                   "reward model's own max_length; with url: 512).")
    rubric: str | None = Field(None, description="kind judge: the grading instructions; the judge is asked to end "
                               "with `Score: N/<scale>`.")
    scale: int = Field(10, ge=1, description="kind judge: the top of the score scale (`Score: 7` reads 7/scale).")
    max_tokens: int = Field(64, ge=1, description="kind judge: tokens of the judge's answer.")
    max_unparseable: float = Field(0.5, ge=0, le=1, description="kind judge: the largest share of a batch whose "
                                   "answers hold no score before the step fails (each such sample gets the batch's "
                                   "mean reward and is counted as reward_unparseable).")
    served_url: str | None = ops_field(None, description="Set by the pipeline for its workers: the URL where it "
                                       "serves `reward_model` / `model`. Leave unset.")
    api_key: Secret = ops_field(None, description="Bearer key of an external url (null: engine.api_key for a "
                                "served one).")
    batch_size: int = ops_field(64, ge=1, description="Sequences per /classify request.")
    timeout_s: float = ops_field(120.0, gt=0, description="Seconds per request to the reward server.")

    @model_validator(mode="after")
    def _one_source(self) -> "RewardConfig":
        if self.kind == "model":
            if (self.reward_model is None) == (self.url is None):
                raise ValueError("kind model: set exactly one of reward_model (a reward_models name) and url")
            wrong = [k for k in ("model", "rubric") if getattr(self, k) is not None]
            if wrong:
                raise ValueError(f"kind model: {', '.join(wrong)} belong to kind judge")
        else:
            if (self.model is None) == (self.url is None):
                raise ValueError("kind judge: set exactly one of model (a chat checkpoint to serve) and url")
            if self.reward_model is not None:
                raise ValueError("kind judge: reward_model belongs to kind model")
            if not (self.rubric or "").strip():
                raise ValueError("kind judge: rubric is required (what the judge grades)")
        if self.truth is not None and not self.truth.strip():
            raise ValueError("truth: must be a verifier spec or null")
        return self


class DomainConfig(_Strict):
    """One domain of the run: a built-in by name, a plugin class, or a dataset file (domains/README.md)."""
    name: str = Field(..., description="Built-in domain name, or the name of a plugin or dataset domain: "
                      f"{NAME_RULE} (it names work dirs, logs and storage prefixes).")
    impl: str | None = Field(None, description='Plugin class as "package.module:ClassName" (any importable module).')
    difficulty: int = Field(1, ge=1, le=10, description="Difficulty knob of the domain's generator.")
    params: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the domain class.")
    dataset: DatasetConfig | None = Field(None, description="Read the examples from a dataset file instead of a "
                                          "generator (exclusive with impl).")
    verifier: str = Field("exact", description="A dataset domain's reward: exact, numeric[:REL_TOL], choice, "
                          "regex:PATTERN, math or code (domains/verifiers.py).")
    system: str | None = Field(None, description="System message of the domain's prompts (used with a chat template).")
    reward: RewardConfig | None = Field(None, description="A dataset domain's training reward from a model (reward "
                                        "model or rubric judge) instead of its verifier; null: the verifier.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name(v, "")  # a work dir, log file and storage prefix (infra/names.py)

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
            if self.reward is not None:
                raise ValueError("reward: applies to dataset domains only (a built-in or plugin domain scores with "
                                 "its own score method)")
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
            for key, default in (("dataset", None), ("verifier", "exact"), ("system", None), ("reward", None)):
                if key in data and data[key] == default:
                    del data[key]
        return data


class RecordConfig(_Strict):
    """What a trainer records of its rollouts (`specialists.record`, `distill.record`; training/rollout_records.py):
    Parquet files under its checkpoint prefix (`rollouts/step-NNNNNN.parquet`) and a table in its MLflow run; and of
    each evaluation, the first `sample` episodes per domain (`rollouts/eval-step-NNNNNN.parquet`, a specialist's
    validations `val-step-NNNNNN.parquet`)."""
    every: int = Field(10, ge=0, description="Record a sample of the trained rollouts every N steps and at the last "
                                             "step (0: never, unless `full`).")
    sample: int = Field(4, ge=0, description="Rows in each recorded step's sample (chosen by a hash of the sample "
                                             "ids), and in the MLflow table; also the episodes per domain each "
                                             "evaluation records (its first ones: the same prompts at every "
                                             "evaluation), whatever `every` says (0: none).")
    full: bool = Field(False, description="Record every step's every row (prompt and response ids, behaviour and "
                                          "teacher log-probs, rewards): the debug record. Off by default.")


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
                                                         "cosine decay to 0 at the stage's last step (or at lr_decay_steps).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    lr_decay_steps: int | None = keyed_when_set(None, ge=1, description=(
        "With lr_schedule cosine: the optimizer steps the cosine decays over (Megatron's --lr-decay-iters). null: "
        "the stage's steps (the lr reaches 0 at its last step). More than the stage's steps: training stops on "
        "the way down, the first steps exactly those of a run of lr_decay_steps steps (the last lr "
        "lr·½(1 + cos(π·(steps − warmup)/(lr_decay_steps − warmup))))."))
    world_size: int = Field(1, ge=1, description="Ranks per trainer; > 1 launches the trainer under torchrun.")
    micro_batch_tokens: int | None = ops_field(None, ge=1, description=(
        "Token-budget micro-batches: each optimizer step's rows (one rank's share) are sorted by length and cut "
        "into micro-batches of at most this many padded positions (rows × the micro-batch's longest row; a longer "
        "row alone), one forward and backward each, so a step holds the activations of one such micro-batch and "
        "computes little padding (training/batching.token_budget_groups). The loss stays the token sum over the "
        "whole step / its token count: the same update as one pass over all rows, up to float rounding, hence "
        "not in the fingerprints. Needs grad_accum 1 (the budget decides the micro-batches). null: today's split "
        "(base SFT one pass, specialists one pass in length buckets, the student grad_accum parts)."))
    gradient_checkpointing: bool = ops_field(False, description=(
        "Activation checkpointing (HF gradient_checkpointing_enable, non-reentrant): layer activations are "
        "recomputed in the backward instead of kept, for models whose activations do not fit. The same loss and "
        "gradients (about a third more compute), hence not in the fingerprints."))

    @model_validator(mode="after")
    def _budget_decides_the_micro_batches(self) -> "TrainConfig":
        if self.micro_batch_tokens is not None and self.grad_accum != 1:
            raise ValueError(f"grad_accum={self.grad_accum}: with micro_batch_tokens the token budget decides the "
                             "micro-batches of a step; leave grad_accum at 1")
        return self


class EvalConfig(_Strict):
    """Evaluation of the base, the specialists and the student: greedy, on each domain's eval split."""
    n_eval: int = Field(100, ge=1, description="Held-out examples per domain (eval split).")
    max_new_tokens: int = Field(16, ge=1, le=512, description="Greedy answer budget per eval prompt.")
    batch_size: int = ops_field(128, ge=1, description="Prompts per batched generation call.")
    device: str = ops_field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="Where the evaluated model "
                            "generates: auto = the GPU when torch sees one, else the CPU; cpu; cuda; cuda:N.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = ops_field("auto", description="Weights of the evaluated model: "
                                                          "auto = bf16 on a GPU, fp32 on the CPU.")


class TrackingConfig(_Strict):
    """MLflow tracking: one parent run per pipeline, a nested run per stage."""
    enabled: bool = ops_field(True, description="Log to MLflow; false = no tracking at all.")
    uri: str | None = ops_field(None, description="MLflow tracking URI; default sqlite:///<root>/mlflow.db. "
                                              "MLFLOW_TRACKING_URI in the environment wins.")
    experiment: str = ops_field("alloy", description=f"MLflow experiment of the parent run: {NAME_RULE}.")

    @field_validator("experiment")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name(v, "")


class EngineConfig(_Strict):
    """Engine servers the run launches (rollout servers of the trainers, teacher servers)."""
    backend: Literal[values(Backend)] = Field(Backend.EMBEDDED.value, description="embedded = Alloy's own server (CPU, "
                                              "or CUDA: see device); sglang = real SGLang (infra/choices.py; launched "
                                              "as engine/backends.py says).")
    device: str = ops_field("auto", description="Embedded servers: auto | cpu | cuda | cuda:N, where the weights, KV "
                            "cache and sampling live (--device; auto = cuda when the server sees a GPU, else cpu).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = ops_field(
        "auto", description="Embedded servers: the weights' dtype (--dtype; auto = bfloat16 on cuda, float32 on cpu).")
    host: str = ops_field("127.0.0.1", description="Bind address of launched servers (loopback unless told otherwise).")
    api_key: Secret = ops_field(None, description="Bearer key for launched servers and the client (or ALLOY_ENGINE_API_KEY).")
    threads: int = ops_field(1, ge=1, description="Torch threads per embedded server.")
    max_running_requests: int | None = Field(None, ge=1, description="Sequences a launched server decodes at once "
                                             "(--max-running-requests; the rest queue). None = the backend's own: "
                                             f"embedded {MAX_RUNNING_REQUESTS}, SGLang sized from GPU memory.")
    sglang_args: dict[str, Any] = Field(default_factory=dict, description="Extra sglang.launch_server options (GPU).")
    weight_sync: Literal[values(WeightSync)] = ops_field(
        WeightSync.AUTO.value, description="How a trainer pushes new weights to its embedded rollout server. auto: "
        "tensor when the trainer has CUDA, else memory (CPU runs keep memory). memory: a weight buffer in /dev/shm (or "
        "the work dir) copied into the model in place (update_weights_from_buffer; the load can overlap the next "
        "step); tensor: SGLang's update_weights_from_tensor, CUDA IPC handles of the trainer's tensors (CPU tensors "
        "as shared-memory files), same machine; distributed: SGLang's init_weights_update_group + "
        "update_weights_from_distributed, a broadcast over NCCL (gloo when the trainer has no CUDA); disk: an HF dir "
        "loaded with update_weights_from_disk. A failed tensor/distributed push falls back to memory for the rest of "
        "the run. An SGLang server uses sglang_weight_sync instead.")
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
    max_logprob_entries: int = ops_field(MAX_LOGPROB_ENTRIES, ge=1, description="Embedded servers: a /generate "
                                         "whose answer would carry more (log-prob, id) entries, positions × (1 + "
                                         "top_logprobs_num + len(token_ids_logprob)) summed over its sequences, is "
                                         "HTTP 400 (--max-logprob-entries; the default is ~15x a student scoring "
                                         "call at the defaults: infra/choices.py).")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        import re

        if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+", v.strip().lower()):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v.strip().lower()


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
    share_gpus: bool = ops_field(False, description="GPUs are shared by memory fraction: a trainer takes only its "
                                 "estimated share of its GPU(s), so several specialist lanes, or the student, its "
                                 "rollout server and every teacher, fit on one GPU (each trainer capped at its "
                                 "fraction: docs/placement.md); false: a trainer has its GPU(s) to itself.")
