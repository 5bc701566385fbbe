"""The config sections of the pipeline's stages: base (SFT), specialists (PPO, with the anti-hack guard and the
per-domain overrides), teachers and distill (the OPD student).

They are built from the pieces and shared sections of `infra.config_shared` (`TrainConfig` above all);
`infra.config` puts them into `AlloyConfig` and re-exports every name here: import them from `infra.config`. Split
out of `infra/config.py` to keep each file readable; the classes are unchanged.
"""
from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError, field_validator, model_serializer, model_validator

from infra.choices import StageMode, values
from infra.choices import DEFAULT_MAX_FILE_MB, DEFAULT_MAX_ROW_KB
from infra.config_shared import RecordConfig, Secret, TrainConfig, _problem, _Strict, check_data_file, ops_field

# The OPD losses `distill.loss` may name. They are implemented above infra (student/losses.py, which config must not
# import); that registry is keyed by this tuple and refuses, at import, any name missing here or any name here
# without an implementation, so this is the one list of names.
OPD_LOSSES = ("sampled_rkl", "topk_kl")


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
    threads: int | None = ops_field(None, ge=1, description=(
        "Torch threads of each base SFT process. null: torch's default, one per core, the fastest when the base "
        "has the machine to itself (under torchrun each rank gets `OMP_NUM_THREADS`, torchrun's 1). Set 1 where "
        "other trainers share the cores, e.g. two pipelines on one machine: two 2-thread trainers on 2 cores spin "
        "in OpenMP waiting for each other (docs/tuning.md)."))
    stop_at_score: float | None = Field(None, gt=0, le=1, description=(
        "Stop the SFT early once the base's mean greedy score over the domains, on `val_n` validation prompts each "
        "(the val split: never the eval split), reaches this; checked every `val_every` steps, `steps` stays the "
        "cap. A base stopped by its score, not its step count, leaves RL the same room on any machine and seed "
        "(the demo's base: RL needs headroom). null: train all `steps`."))
    val_every: int = Field(50, ge=1, description="With `stop_at_score`: validate every N steps.")
    val_n: int = Field(50, ge=1, description="With `stop_at_score`: validation prompts per domain.")

    @model_validator(mode="after")
    def _ranks(self) -> "BaseConfig":
        if self.stop_at_score is not None:  # every rank validates its own copy of the weights and stops alike
            _refuse_sharded_weights("base.train", self.train)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        """As usual, except in a fingerprint: `tool_trajectories` left at false is left out, and so are
        `stop_at_score` left at null with its `val_every` / `val_n`, so a base keys its checkpoints as before the
        settings existed."""
        data = handler(self)
        fingerprint = isinstance(info.context, dict) and info.context.get("fingerprint")
        if fingerprint and data.get("tool_trajectories") is False:
            del data["tool_trajectories"]
        if fingerprint and data.get("stop_at_score") is None:
            for key in ("stop_at_score", "val_every", "val_n"):
                data.pop(key, None)
        return data


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


class DistillDebugConfig(_Strict):
    """The student's debug modes: sample and score without training."""
    rollout_only: bool = Field(False, description="Sample, score and record (`record.full: true` for every row) "
                               "without training: the student stays its init, every step samples from it.")


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
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = Field("token_mean", description="How the loss averages "
                                                                  "over a batch: every response token weighs the same "
                                                                  "(token_mean), or every sample, its tokens averaged "
                                                                  "(seq_mean_token_mean: a 3-token answer weighs as "
                                                                  "much as a 16-token one; docs/tuning.md#distill).")
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
    keep_checkpoints: int | None = ops_field(None, ge=1, description=(
        "Resumable checkpoints kept under the student's prefix (a new one is committed before the oldest is "
        "pruned; the newest that verifies is resumed). null: 1 when the student trains on a GPU, where a checkpoint "
        "holds its fp32 master weights and Adam moments (12 of a bf16 checkpoint's 14 bytes per parameter: GBs a "
        "round), 2 on the CPU, where the older one is the fallback when the newest fails verification. On a GPU only "
        "the newest keeps its DeepSpeed state: an older one keeps its HF weights and trainer.json, and a resume that "
        "would fall back to it is refused, naming it (docs/architecture.md, \"Checkpoints\")."))
    log_every: int = ops_field(25, ge=1, description="Log train and per-teacher metrics every N steps.")
    record: RecordConfig = ops_field(RecordConfig(), description="Rollout records: a sample every N steps "
                                     "(always on), or the full record (training/rollout_records.py).")
    debug: DistillDebugConfig = Field(DistillDebugConfig(), description="Debug modes.")
    threads: int = ops_field(1, ge=1, description="Torch threads of the student trainer process.")
    mode: Literal[values(StageMode)] = ops_field(StageMode.LOCAL.value, description="local: the student trains in the pipeline's "
                                                 "flow run; deployment: run_deployment of `distill.deployment` with "
                                                 "storage URLs of the base and the teachers (docs/scale-out.md).")
    deployment: str = ops_field("alloy-distill/default", description="Deployment the distill stage runs as in "
                                                                   "deployment mode.")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(lr=1e-3, micro_batch_size=128))

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        """As usual, except in a fingerprint: `loss_agg` left at token_mean is left out, so a student keys its
        checkpoints as before the setting existed."""
        data = handler(self)
        if isinstance(info.context, dict) and info.context.get("fingerprint") and data.get("loss_agg") == "token_mean":
            del data["loss_agg"]
        return data

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


class DebugConfig(_Strict):
    """A specialist's debug modes: train from recorded rollouts instead of sampling, or sample without training."""
    train_only: str | None = Field(None, description="Train from the rollout records under this trainer prefix "
                                   "(file:// or s3://, a run's `specialist-<domain>-<hash>`; `record.full` gives every "
                                   "row) instead of sampling: no engine server, no rollouts, one update per recorded "
                                   "step in order (teachers/replay.py). null: train as usual.")
    rollout_only: bool = Field(False, description="Sample, score and record rollouts (`record.full: true` for every "
                               "row) without training: the policy stays the base, every step samples from it.")


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
    async_rollouts: bool = Field(
        False, description="true: the rollout server generates step k+1's batch while the trainer trains on step k's "
        "(decoupled rollout, as slime's async RL): the batch comes from the weights before step k's update (one "
        "version behind, corrected by TIS like resumed partials), the weight push is a snapshot on the critical path "
        "and a load in the background, and the next rollout starts once the server has loaded it, so every token's "
        "version is exact; with deterministic_rollouts the run is still the same under any load. Needs "
        "max_staleness ≥ 1. A step that ends with a checkpoint does not overlap its successor's rollout (the "
        "checkpoint's prompt cursor and APRIL buffer hold no batch in flight).")
    max_new_tokens: int | None = Field(None, ge=1, le=512, description="Response budget (None: eval.max_new_tokens).")
    max_context_tokens: int | None = Field(
        None, ge=2, description="Compaction (teachers/compaction.py): a tool episode whose context (prompt + response "
        "so far) would outgrow this many tokens continues from a compacted one (a summary, see compaction_summary, "
        "with the last compact_keep_last turns); each sub-trace trains as its own PPO row with the "
        "episode's reward. None: off (an episode is one sequence).")
    compact_keep_last: int = Field(2, ge=0, description="Completed turns kept verbatim after a compaction's summary.")
    compaction_summary: Literal["policy", "rules"] = Field(
        "policy", description="Who writes a compaction's summary (domains/compaction.py). policy: the env appends a "
        "request line (`>compact`, not trained) and the policy writes one summary line (`#…`, sampled and trained "
        "with its sub-trace, as the OPD student's), which with the kept turns is the next context; a summary that is "
        "not one well-formed line or gains no room falls back to the rules' notes (metric compaction_fallbacks). "
        "rules: the deterministic `>notes: …` line of the older tool outputs. Needs max_context_tokens.")
    compact_summary_tokens: int = Field(32, ge=2, le=256, description="The most tokens a policy-written compaction "
                                        "summary may take; compaction is due early enough to leave it room.")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    n_prompts: int = Field(2000, ge=1, description="Train-split prompts per specialist; the cursor cycles them.")
    ppo_epochs: int = Field(4, ge=1, description="Optimizer steps per rollout batch (clipping bounds the drift).")
    eps_clip: float = Field(0.2, gt=0, description="PPO ratio clip: ratios outside [1 − ε, 1 + ε_high] get "
                                                   "no gradient.")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper clip ε_high (None: eps_clip).")
    eps_clip_c: float | None = Field(None, gt=1, description="Dual-clip constant (> 1) or None.")
    value_clip: float | None = Field(0.2, gt=0, description="Value-loss clip around the rollout's "
                                                             "values (None: unclipped).")
    step_credit: bool = Field(True, description="Domains that say where in an answer their partial credit was earned "
                              "(Domain.credit: the long-answer built-ins' steps, runs and fields, the string transforms' "
                              "positions) get each part on "
                              "the token that earned it and the rest of the reward on the last token, instead of the "
                              "whole reward on the last token (teachers/step_credit.py). The return is the same; the "
                              "advantages of early tokens are less noisy. Other domains are unaffected.")
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
    keep_checkpoints: int | None = ops_field(None, ge=1, description=(
        "Resumable checkpoints kept under each specialist's prefix (a new one is committed before the oldest is "
        "pruned; the newest that verifies is resumed). null: 1 when the specialist trains on a GPU, where a "
        "checkpoint holds the policy's and the critic's fp32 master weights and Adam moments (12 of a bf16 "
        "checkpoint's 14 bytes per parameter: GBs a round), 2 on the CPU, where the older one is the fallback when "
        "the newest fails verification. On a GPU only the newest keeps its DeepSpeed states: an older one keeps its "
        "HF weights and trainer.json, and a resume that would fall back to it is refused, naming it "
        "(docs/architecture.md, \"Checkpoints\")."))
    log_every: int = ops_field(5, ge=1, description="Log training metrics every N steps.")
    record: RecordConfig = ops_field(RecordConfig(), description="Rollout records: a sample every N steps "
                                     "(always on), or the full record (training/rollout_records.py).")
    debug: DebugConfig = Field(DebugConfig(), description="Debug modes (teachers/replay.py).")
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

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        """As usual, except in a fingerprint: without compaction (`max_context_tokens` None) its summary settings
        are left out, so a run without compaction keys its checkpoints as before they existed."""
        data = handler(self)
        fingerprint = isinstance(info.context, dict) and info.context.get("fingerprint")
        if fingerprint and data.get("max_context_tokens") is None:
            for name in ("compaction_summary", "compact_summary_tokens"):
                data.pop(name, None)
        return data

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
        if self.async_rollouts and self.max_staleness < 1:
            raise ValueError("specialists.async_rollouts trains each batch one version after the weights that sampled "
                             "it: set specialists.max_staleness ≥ 1 (it is 0)")
        if self.val_every == 0 and (self.patience or self.stop_at is not None):
            raise ValueError("specialists.patience / specialists.stop_at need validations: set specialists.val_every > 0")
        return self


class RewardModelConfig(_Strict):
    """One reward model (`reward_models.<name>`): a scalar head on an HF checkpoint trained with the Bradley–Terry
    loss on preference pairs (training/reward_main.py, docs/architecture.md "Reward models"), after the base stage
    and before the specialists; `alloy rm train` trains one alone. Its checkpoint prefix is keyed by these settings
    (minus the ops ones), the preference files' contents, `model.chat_template`, the run seed when `seed` is null,
    and the base's own key when it starts from the base."""
    data: str = Field(..., description="The preference file: a local path or an fsspec URL (s3://…); .jsonl, .json, "
                      ".parquet or .csv with one pair per row (columns `prompt`, `chosen`, `rejected`).")
    val_data: str | None = Field(None, description="A separate held-out preference file (same columns). null: hold "
                                 "out `val_fraction` of `data`'s prompts.")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="Without `val_data`: the share of `data`'s prompts held "
                                "out for validation, chosen by a hash of the prompt (every pair of a prompt on one "
                                "side; the same split for any seed or row order).")
    prompt: str = Field("prompt", description="Column of the prompts.")
    chosen: str = Field("chosen", description="Column of the preferred responses.")
    rejected: str = Field("rejected", description="Column of the dispreferred responses.")
    margin_column: str | None = Field(None, description="Column of a per-pair margin m ≥ 0 (the loss is "
                                      "−log σ(r_chosen − r_rejected − m)); null: no margin.")
    system: str | None = Field(None, description="System message the prompts are rendered with (chat templates), as "
                               "the policy's domain renders them.")
    init: str = Field("base", description="Where the model starts: `base` (the base stage's checkpoint) or a local "
                      "HF causal-LM checkpoint directory; its body is loaded into an "
                      "AutoModelForSequenceClassification with a new scalar head.")
    steps: int = Field(200, ge=1, description="Optimizer steps, each on `train.micro_batch_size` × `train.grad_accum` "
                       "pairs per rank.")
    max_length: int = Field(512, ge=8, description="Tokens of one scored sequence (rendered prompt + response + end "
                            "of turn); longer ones lose the start of the prompt.")
    seed: int | None = Field(None, description="Seed of the head's initialisation and the pair order; null: run.seed.")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(micro_batch_size=16))
    val_every: int = ops_field(50, ge=1, description="Validate (held-out pair accuracy) every N steps, and at the end.")
    checkpoint_every: int = ops_field(50, ge=1, description="Commit a resumable checkpoint every N steps.")
    keep_checkpoints: int | None = ops_field(None, ge=1, description="Resumable checkpoints kept (null: 1 on a GPU, "
                                             "2 on the CPU, as `distill.keep_checkpoints`).")
    log_every: int = ops_field(25, ge=1, description="Log train metrics every N steps.")
    threads: int | None = ops_field(None, ge=1, description="Torch threads of the trainer process (null: torch's "
                                    "default).")
    max_file_mb: float = ops_field(DEFAULT_MAX_FILE_MB, gt=0, description="Largest preference file read, in MiB.")
    max_row_kb: float = ops_field(DEFAULT_MAX_ROW_KB, gt=0, description="Largest row, in KiB (the UTF-8 bytes of "
                                  "the cells read).")

    @field_validator("data", "val_data")
    @classmethod
    def _data_file(cls, v: str | None) -> str | None:
        return v if v is None else check_data_file(v)

    @field_validator("init")
    @classmethod
    def _init(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be `base` or a local HF checkpoint directory")
        return v

    @model_validator(mode="after")
    def _columns(self) -> "RewardModelConfig":
        cols = [self.prompt, self.chosen, self.rejected] + ([self.margin_column] if self.margin_column else [])
        if len(set(cols)) != len(cols):
            raise ValueError(f"prompt, chosen, rejected and margin_column must name different columns, got {cols}")
        return self
