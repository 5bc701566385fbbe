"""The options with a fixed set of values that more than one floor compares, each declared once, and the engine
limits whose defaults the config, the embedded server and its scheduler share.

`infra.config` builds its fields from these (`Literal[values(Backend)]`: a YAML value is still a plain string, and a
wrong one fails at load naming the field), and code compares against the members (`cfg.engine.backend ==
Backend.SGLANG`): a `StrEnum` member equals its string, so nothing else changes. `engine.backends` keys its
launchers by `Backend` and refuses, at import, a member without one. Light on purpose: no torch, no pydantic.
"""
from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """`engine.backend`: which engine server a run launches (engine/backends.py says how)."""
    EMBEDDED = "embedded"  # Alloy's own server (engine/server.py)
    SGLANG = "sglang"  # a real SGLang server (`pip install .[sglang]`, GPU)


class WeightSync(StrEnum):
    """`engine.weight_sync`: how a trainer pushes new weights to an embedded rollout server."""
    AUTO = "auto"  # TENSOR when the trainer has CUDA (the server is its own, on its machine), else MEMORY
    MEMORY = "memory"  # a weight buffer copied into the live model in place (/update_weights_from_buffer)
    TENSOR = "tensor"  # SGLang's /update_weights_from_tensor: CUDA IPC (or shared-memory) handles, same machine
    DISTRIBUTED = "distributed"  # SGLang's /update_weights_from_distributed: a broadcast (NCCL, or gloo without CUDA)
    DISK = "disk"  # an HF dir loaded with /update_weights_from_disk


class SglangWeightSync(StrEnum):
    """`engine.sglang_weight_sync`: how a trainer pushes new weights to an SGLang rollout server."""
    AUTO = "auto"  # TENSOR on the same machine with CUDA, DISTRIBUTED elsewhere, DISK without CUDA
    TENSOR = "tensor"  # CUDA IPC handles (/update_weights_from_tensor)
    DISTRIBUTED = "distributed"  # an NCCL group (/update_weights_from_distributed)
    DISK = "disk"  # /update_weights_from_disk


class StageMode(StrEnum):
    """`specialists.mode` / `distill.mode`: where a stage runs."""
    LOCAL = "local"  # in the pipeline's flow run (subprocesses of its worker)
    DEPLOYMENT = "deployment"  # its own Prefect flow run (a deployment), handed storage URLs only


def values(choice: type[StrEnum]) -> tuple[str, ...]:
    """The allowed strings of `choice`, in declaration order (for `Literal[...]` fields and messages)."""
    return tuple(m.value for m in choice)


# Embedded server limits (`engine.*` fields, `python -m engine.server` flags and the scheduler's arguments).
# Sequences decoded at once (the rest queue); SGLang sizes its own unless told. 256 is vLLM's max_num_seqs default
# (SGLang sizes it as max_total_tokens // 2). At 64 a rollout step of the pipeline's default (B = 64 at 1.25x
# over-sampling: 80 requests) queued 16 requests, each joining the batch later through its own prefill and cache
# merge (bench/april.py at B = 64: 0.92x sync at 64, ~1.3x at 256).
MAX_RUNNING_REQUESTS = 256
MAX_TOTAL_TOKENS = 65536  # KV-cache tokens of all running sequences together
MAX_PREFILL_TOKENS = 16384  # prompt tokens prefilled in one forward
READ_TIMEOUT_S = 30.0  # a client gets this long for a request's headers, and again for its body
# (log-prob, id) entries one /generate answer may carry: positions x (1 + top_logprobs_num + len(token_ids_logprob)),
# summed over its sequences (positions: the prompt positions scored when input log-probs are asked for, plus
# max_new_tokens). Alloy's largest requests: a student scoring call at the defaults (32 sequences x <= 513 positions
# x (1 + top_k 16)) is ~279k; a PPO rollout (top 0) at most max_total_tokens = 65,536; even the whole token budget
# at top-k 16 is ~1.1M. 2^22 (~4.2M: ~100 MB of JSON, ~34 MB packed) is well above them and bounds what a ~40 KB
# request can make the server build (top_logprobs_num up to the vocabulary was ~10^10 entries).
MAX_LOGPROB_ENTRIES = 2**22

# dataset limits (`dataset.max_file_mb`, `dataset.max_row_kb`): read by infra.datasets and domains/dataset.py
DEFAULT_MAX_FILE_MB = 512.0  # the largest dataset file read (the whole file stays in a per-process cache)
DEFAULT_MAX_ROW_KB = 1024.0  # the largest row: the UTF-8 bytes of the cells a domain reads
