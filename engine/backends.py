"""Kinds of engine server a `Supervisor` can launch (`engine.backend`), each one object looked up by name.

A `ServerBackend` says everything that differs between the embedded server and SGLang: which module to run, the
model flag, the options it accepts (each passed as `--name-with-dashes`), where the sampling seed goes, whether
the API key travels in argv (SGLang reads it only there) or in the environment (ours: not visible in `ps`), and
whether it is a CPU server (one torch thread each). The names are `infra.choices.Backend` (what `engine.backend`
accepts); `BACKENDS` has one launcher per member, checked at import, so a new backend is a member there plus its
`ServerBackend` here.

Light on purpose (no torch, no aiohttp): the launcher and the CLI import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from infra.choices import Backend, values

# SGLang `ServerArgs` fields a GPU user typically sets (flag = "--" + name with "-"), from
# sgl-project/sglang python/sglang/srt/server_args.py. Booleans are store_true flags.
SGLANG_OPTIONS: dict[str, type] = {
    "tokenizer_path": str, "skip_tokenizer_init": bool, "tp_size": int, "dp_size": int, "pp_size": int,
    "mem_fraction_static": float, "context_length": int, "dtype": str, "trust_remote_code": bool,
    "max_running_requests": int, "chunked_prefill_size": int, "max_total_tokens": int, "random_seed": int,
    "served_model_name": str, "log_level": str, "quantization": str, "kv_cache_dtype": str,
    "attention_backend": str, "base_gpu_id": int, "disable_cuda_graph": bool, "disable_radix_cache": bool,
    "enable_deterministic_inference": bool,
}

# Options of `python -m engine.server` (see its argparse), under the same names as SGLang's where they mean
# the same thing (device: auto | cpu | cuda | cuda:N; dtype: auto | float32 | bfloat16 | float16;
# mem_fraction_static: its share of the GPU, CUDA only).
EMBEDDED_OPTIONS: dict[str, type] = {
    "max_running_requests": int, "max_total_tokens": int, "max_prefill_tokens": int, "seed": int,
    "read_timeout_s": float, "max_body_mb": float, "device": str, "dtype": str, "mem_fraction_static": float,
    "max_logprob_entries": int,
}


@dataclass(frozen=True)
class ServerBackend:
    """How to launch one kind of engine server (see the module docstring)."""

    name: Backend
    label: str  # in messages
    module: str  # run as `python -m <module>`
    model_flag: str  # flag naming the model directory
    options: Mapping[str, type]  # option name → type; flag = "--" + name with "-"; bool = store_true
    seed_option: str  # the option that seeds the server's sampling stream
    api_key_in_argv: bool  # True: `--api-key KEY`; False: the key goes in the child's environment (API_KEY_ENV)
    cpu: bool  # our own server (CPU or CUDA): DS_ACCELERATOR=cpu (it uses no DeepSpeed) and the supervisor's thread
    # count per server (OMP_NUM_THREADS; its host-side work on a GPU too)
    takes_sglang_args: bool  # launched with `engine.sglang_args` as options
    weights_buffer_flag: str | None = None  # flag naming a weight buffer applied at start (engine/weight_buffer.py)
    buffer_dir_flag: str | None = None  # flag naming a directory /update_weights_from_buffer may read (repeatable)

    def option_args(self, options: Mapping[str, Any]) -> list[str]:
        """{"tp_size": 2, "trust_remote_code": True} → ["--tp-size", "2", "--trust-remote-code"]; unknown keys
        raise, naming this backend's known options."""
        args: list[str] = []
        for key, value in options.items():
            if key not in self.options:
                raise ValueError(f"unknown {self.label} option {key!r}; known: {sorted(self.options)} "
                                 "(use extra_args for others)")
            flag = "--" + key.replace("_", "-")
            if self.options[key] is bool:
                if value:
                    args.append(flag)
            elif value is not None:
                args += [flag, str(self.options[key](value))]
        return args


BACKENDS: Mapping[str, ServerBackend] = MappingProxyType({b.name: b for b in (
    ServerBackend(Backend.EMBEDDED, label="embedded server", module="engine.server", model_flag="--model",
                  options=MappingProxyType(EMBEDDED_OPTIONS), seed_option="seed", api_key_in_argv=False, cpu=True,
                  takes_sglang_args=False, weights_buffer_flag="--weights-buffer",
                  buffer_dir_flag="--weight-buffer-dir"),
    ServerBackend(Backend.SGLANG, label="SGLang", module="sglang.launch_server", model_flag="--model-path",
                  options=MappingProxyType(SGLANG_OPTIONS), seed_option="random_seed", api_key_in_argv=True,
                  cpu=False, takes_sglang_args=True),
)})
if set(BACKENDS) != set(Backend):  # pragma: no cover - a new member of infra.choices.Backend without a launcher
    raise ImportError(f"engine.backends: no ServerBackend for {sorted(set(Backend) - set(BACKENDS))}")


def server_backend(name: str) -> ServerBackend:
    """The backend registered under `name`; an unknown name raises, listing the valid ones."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"engine backend must be one of {list(values(Backend))}, got {name!r}") from None
