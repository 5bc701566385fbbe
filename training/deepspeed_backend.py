"""The DeepSpeed training backend: one engine per trainer, CPU (gloo) by default, ZeRO-1/2/3 on GPUs at scale.

A trainer builds its model, wraps it in `DeepSpeedBackend(model, TrainSettings(...))`, and per optimizer step does

    out = backend(input_ids=ids, attention_mask=attn)          # forward through the engine (ZeRO hooks)
    loss = Σ_local ℓ_t / backend.loss_normalizer(N_global)     # token-level, see "Loss normalisation"
    metrics = backend.step(loss)                               # engine.backward + engine.step

Loss normalisation (token-level aggregation across ranks): derived in `training.ds_config` (`loss_normalizer`).

Where things run: `init_distributed` reads the launcher's env (torchrun or the `deepspeed` launcher set RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without a launcher it sets them for a world of one (otherwise
DeepSpeed tries MPI discovery and fails). A world of one rendezvouses through an in-process store, so a trainer
opens no port beyond loopback. The accelerator comes from `DS_ACCELERATOR`
(importing `infra` sets cpu when no CUDA device is visible); the process-group backend follows the accelerator: gloo on cpu, nccl on
cuda, the accelerator's own backend otherwise.

The optimizer is always a torch AdamW handed to DeepSpeed (never DeepSpeed's FusedAdam, which JIT-compiles for
minutes on CPU), fused (`fused=True`, torch's own kernel, nothing to compile) when its parameters are on CUDA
(`training.ds_config.adamw_kwargs`); the schedule is a torch LambdaLR (`lr_multiplier`), stepped by the engine
after each update.
"""
from __future__ import annotations

import functools
import os
import random
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _import_deepspeed():
    """`import deepspeed` without the MLflow import its autotuner does at import time to see whether it could log
    there (~1 s of CPU in every trainer process; Alloy never runs DeepSpeed's autotuner, and logs to MLflow itself,
    importing it lazily where tracking is on). MLflow is hidden for the import only (an import of it raises, so the
    autotuner records it absent, as on a machine without it); later imports load it as usual."""
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


# DeepSpeed picks its accelerator at import time: `import training` (the parent package, imported first) sets
# DS_ACCELERATOR (see training/__init__.py).
deepspeed = _import_deepspeed()
from deepspeed.accelerator import get_accelerator  # noqa: E402

from infra.placement import GPU_MEM_FRACTION_ENV  # noqa: E402
from training.ds_config import (TrainSettings, adamw_kwargs, build_ds_config, loss_normalizer,  # noqa: E402
                                lr_multiplier)
from training.mfu import ModelShape, card_peak  # noqa: E402
from training.safe_load import deepspeed_allowed, safe_torch_load  # noqa: E402

CHECKPOINT_TAG = "state"  # fixed tag: one resumable state per directory, no "latest" guessing
RNG_FORMAT = 2  # rng_rank<r>.pt holds only ints, lists and tensors (format 1 held numpy arrays: not weights_only)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_dist_backend() -> str:
    """gloo on the cpu accelerator, nccl on cuda, the accelerator's own backend (hccl, ccl, ...) otherwise."""
    name = get_accelerator().device_name()
    if name == "cpu":
        return "gloo"  # DeepSpeed's cpu default is oneCCL, which is not installed; gloo needs nothing
    return get_accelerator().communication_backend_name()


_SELF_RENDEZVOUS = "ALLOY_SELF_RENDEZVOUS"  # "pid:port" of the process that wrote a world-of-one env


def _launched_by_a_launcher() -> bool:
    """True when RANK & co. come from torchrun / the deepspeed launcher / mpirun.

    A world-of-one env written by `init_distributed` in a *parent* process is inherited by its children (Prefect
    workers, subprocesses); joining it would make the child host a second store on the parent's port. Such an env
    is recognised by the marker and rewritten. A launcher started from such a parent sets its own MASTER_PORT, so
    the marker no longer matches and the launcher's env wins.
    """
    if "OMPI_COMM_WORLD_RANK" in os.environ and "RANK" not in os.environ:
        return True  # mpirun: DeepSpeed's MPI discovery fills in the rest
    if "RANK" not in os.environ:
        return False
    marker = os.environ.get(_SELF_RENDEZVOUS, "")
    pid, _, port = marker.partition(":")
    inherited = bool(marker) and pid != str(os.getpid()) and port == os.environ.get("MASTER_PORT")
    return not inherited


def _loopback_interface() -> str | None:
    """Name of the network interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


_SELF_GLOO_IFNAME = "ALLOY_SELF_GLOO_IFNAME"  # the GLOO_SOCKET_IFNAME a world of one set (not the user's choice)


def _init_world_of_one(backend: str) -> None:
    """The process group of a lone process, with nothing listening beyond loopback.

    The rendezvous store is an in-process `HashStore` (the env:// default is a TCPStore server bound to every
    interface, reachable by anyone on the network, without authentication). gloo still opens a listening socket
    per process group (DeepSpeed makes more groups later) on the interface the host name resolves to, so unless
    the user chose one (GLOO_SOCKET_IFNAME), it is pointed at the loopback interface for the life of the process.
    """
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = _loopback_interface()
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ[_SELF_GLOO_IFNAME] = loopback
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _forget_inherited_gloo_interface() -> None:
    """A multi-process launch from inside a world of one inherits its loopback-only GLOO_SOCKET_IFNAME; drop it so
    ranks on other machines can reach this one (a value the user set is kept)."""
    ours = os.environ.pop(_SELF_GLOO_IFNAME, None)
    if ours is not None and os.environ.get("GLOO_SOCKET_IFNAME") == ours:
        del os.environ["GLOO_SOCKET_IFNAME"]


def _skip_cpu_shm_op() -> None:
    """On the CPU accelerator DeepSpeed's comm backend JIT-compiles its shared-memory all-reduce op
    (`deepspeed_shm_comm`) at every init unless built: ~35-100 s of C++ compile once per environment on 2 cores, and
    a compiler on the machine. Only `inference_all_reduce` (DeepSpeed's tensor-parallel inference engine) uses it;
    training's collectives go through torch.distributed (gloo here). So it is marked unavailable, as DeepSpeed marks
    an op it cannot build; its backend then leaves it out (`shm_comm_op` None)."""
    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def apply_gpu_memory_fraction() -> float | None:
    """Cap this rank's CUDA caching allocator at the fraction of its GPU (`cuda:LOCAL_RANK`) the placement plan gave
    its trainer, when GPUs are shared (`resources.share_gpus`: `infra.placement.trainer_env` sets
    GPU_MEM_FRACTION_ENV), so trainers and servers sharing a GPU each stay within their planned share: an allocation
    beyond it raises CUDA out-of-memory in this process instead of starving its neighbours. Returns the fraction
    applied; None (nothing done) without the variable or without CUDA. Called by `init_distributed`, which every
    trainer passes through before it allocates (DeepSpeedBackend, training.session.trainable)."""
    raw = os.environ.get(GPU_MEM_FRACTION_ENV, "").strip()
    if not raw or not torch.cuda.is_available():
        return None
    try:
        fraction = float(raw)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{GPU_MEM_FRACTION_ENV}={raw!r}: must be a fraction of the GPU in (0, 1]")
    device = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join (or create) the process group; idempotent. Returns (rank, world_size).

    A world of one (no launcher, or a launcher asking for one process) gets an in-process store: no rendezvous
    server, no port open beyond loopback (see `_init_world_of_one`). Without a launcher the rendezvous env vars are
    also set for a world of one (DeepSpeed reads RANK, LOCAL_RANK & co. from os.environ; MASTER_PORT is a free
    port number that only marks the env as ours, nothing listens on it). Launched by torchrun / the deepspeed
    launcher with more processes: their env:// rendezvous, with MASTER_ADDR defaulting to 127.0.0.1 (one machine);
    by mpirun: DeepSpeed's MPI discovery. On the CPU, DeepSpeed's shared-memory all-reduce op is not built (see
    `_skip_cpu_shm_op`). A trainer on a shared GPU caps its allocator at its planned fraction
    (`apply_gpu_memory_fraction`).
    """
    _skip_cpu_shm_op()
    if not dist.is_initialized():
        backend = backend or default_dist_backend()
        if not _launched_by_a_launcher():
            port = _free_port()
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.environ[_SELF_RENDEZVOUS] = f"{os.getpid()}:{port}"
        elif "RANK" in os.environ:  # torchrun / deepspeed launcher (not mpirun, whose discovery sets it)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if os.environ.get("WORLD_SIZE") != "1":
            _forget_inherited_gloo_interface()
        if get_accelerator().device_name() != "cpu":
            # bind this rank to its device before the (nccl) group is created, as torch recommends
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if os.environ.get("WORLD_SIZE") == "1":
            _init_world_of_one(backend)  # then DeepSpeed below only wraps it (no second group, no TCPStore)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    else:
        deepspeed.init_distributed(verbose=False)  # wraps a user-created torch group; no-op if already done
    apply_gpu_memory_fraction()
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Leave the process group (call at the end of a launched script: a rank exiting with a live gloo group can
    abort with 'terminate called without an active exception' while its peer is still shutting down)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every accelerator device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for the backend
        pass


def _rng_state() -> dict:
    """This rank's RNG states as plain ints, lists and tensors, so that they load back with weights_only=True
    (`random.getstate()` is already a tuple of ints; numpy's key array becomes a list)."""
    state: dict[str, Any] = {"format": RNG_FORMAT, "python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, source: Path) -> None:
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        raise ValueError(f"load_state: {source} is not an RNG state of format {RNG_FORMAT} (written by an older "
                         "Alloy?); resume from a checkpoint written by this version")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing on an HF model, or on the HF backbone of a wrapper (the critic's `ValueModel`):
    each decoder layer's activations are recomputed in the backward pass (non-reentrant torch.utils.checkpoint,
    active in train mode only). A model with neither raises, naming its class."""
    target = model if hasattr(model, "gradient_checkpointing_enable") else getattr(model, "backbone", None)
    if target is None or not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable "
                         "(an HF model, or a wrapper with an HF `backbone`, has)")
    # the config's use_cache stays as it is (the module also generates, and is saved for serving): HF turns the
    # cache off for a training forward under checkpointing itself
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on ≥2-D weights (matrices, embeddings), none on 1-D (norm gains, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class DeepSpeedBackend:
    """A DeepSpeed engine around `model`, with the few calls a trainer needs.

    Forward through the backend (`backend(**batch)`), not through `backend.module`, when the output feeds `step`:
    the engine's forward registers the ZeRO backward hooks. `backend.module` (the plain HF model) is for generation,
    evaluation and inspection.
    """

    def __init__(self, model: torch.nn.Module, settings: TrainSettings):
        init_distributed()
        accel = get_accelerator()
        if (settings.dtype == "fp16" and not accel.is_fp16_supported()) or \
                (settings.dtype == "bf16" and not accel.is_bf16_supported()):
            raise ValueError(f"TrainSettings.dtype={settings.dtype!r} is not supported on the "
                             f"{accel.device_name()!r} accelerator (DS_ACCELERATOR); use 'fp32' or another dtype")
        self.settings = settings
        if settings.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        seed_everything(settings.seed)
        self.ds_config = build_ds_config(settings, dist.get_world_size())
        s = settings

        def make_optimizer(groups):
            device = next((p.device.type for g in groups for p in g["params"]), "cpu")
            return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay,
                                     **adamw_kwargs(device, self.ds_config))

        def make_scheduler(optimizer):
            # LambdaLR.state_dict skips plain lambdas; the schedule is rebuilt from settings, only the step is saved
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: lr_multiplier(step, s.warmup_steps, s.lr_schedule, s.total_steps))

        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, s.weight_decay), optimizer=make_optimizer,
            lr_scheduler=make_scheduler, config=self.ds_config)
        # the plain torch AdamW under stage 0 + fp32 keeps no grad norm: step() computes it itself then
        self._norm_tracked = hasattr(self.engine.optimizer, "_global_grad_norm")
        # DeepSpeed unpickles checkpoints with weights_only=False (a tampered file would run code): every file
        # its load_checkpoint reads goes through this engine's checkpoint_engine.load, so that is made safe here
        allowed = deepspeed_allowed()
        self.engine.checkpoint_engine.load = (
            lambda path, map_location=None: safe_torch_load(path, map_location=map_location, allow=allowed))

    # ---- identity -------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_step(self) -> int:
        """Optimizer updates applied so far (restored by `load_state`)."""
        return int(self.engine.global_steps)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @functools.cached_property
    def model_shape(self) -> ModelShape:
        """The trained model's parameters, layers and hidden size: what its training FLOPs per token are counted
        from (`training.mfu`). Each parameter once (a tied one too); under ZeRO-3 its full size (`ds_numel`)."""
        n = sum(int(getattr(p, "ds_numel", p.numel())) for p in self.module.parameters())
        return ModelShape.of(getattr(self.module, "config", None), n)

    @property
    def peak_tflops(self) -> float | None:
        """This rank's card's dense bf16 peak (TFLOP/s, `training.mfu.card_peak`), None off CUDA or for a card not
        in the table: the denominator of the MFU a trainer reports."""
        if self.device.type != "cuda":
            return None
        return card_peak(torch.cuda.get_device_name(self.device))

    def forward_buckets(self, wanted: int) -> int:
        """How many forward calls a trainer may split one micro-batch into (length buckets, less padding): 1 under
        ZeRO-3, where every forward gathers the sharded parameters again (measured on one H100,
        bench/results/gpu_check_zero3_buckets.json: 4 forwards of 2 rows before one backward ran at 0.28× a plain
        torch loop, one forward of 8 rows at 0.38×); `wanted` otherwise."""
        return 1 if self.settings.zero_stage == 3 else wanted

    # ---- training -------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Forward through the DeepSpeed engine (required for the output of a loss passed to `step`)."""
        return self.engine(*args, **kwargs)

    def loss_normalizer(self, global_tokens: float) -> float:
        """N / (W·G): divide this rank's summed token loss by this (N = tokens of the whole optimizer step)."""
        return loss_normalizer(global_tokens, self.world_size, self.settings.grad_accum)

    def step(self, loss: torch.Tensor) -> dict:
        """Backward `loss` (a scalar normalised with `loss_normalizer`) and, at an accumulation boundary, update.

        Returns {"lr": lr this update used, "stepped": 1.0 at a boundary else 0.0, "grad_norm": the global
        pre-clip L2 norm of the averaged gradient (at a boundary; inf after an fp16 overflow, whose update is skipped)}.
        A collective under W > 1: every rank calls it once per micro-batch.
        """
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        lr = float(engine.get_lr()[0])  # read before step(): the scheduler advances inside it
        engine.backward(loss)
        own_norm = self._module_grad_norm() if boundary and not self._norm_tracked else None
        engine.step()
        if not boundary:
            return {"lr": lr, "stepped": 0.0}
        norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
        return {"lr": lr, "stepped": 1.0, "grad_norm": float(norm) if norm is not None else float("nan")}

    def accumulate(self, loss: torch.Tensor, *, last: bool) -> dict:
        """`step` for a step of any number of micro-batches (token-budget micro-batches, `micro_batch_tokens`):
        backward `loss` (normalised with `loss_normalizer`, as for `step`); `last`: the step's final micro-batch,
        whose backward reduces the gradients and after which the optimizer updates. Returns what `step` returns.

        DeepSpeed counts grad_accum micro-steps to find the boundary; here the caller names it instead
        (`set_gradient_accumulation_boundary`, DeepSpeed's documented way), so it needs grad_accum 1 (every
        `engine.step()` is then a boundary in DeepSpeed's own count as well). Each backward is scaled by
        1/grad_accum = 1, so the gradients are the sum of the micro-batches' and the update is exact. A collective
        under W > 1 (ZeRO-2/3 reduce in every backward): every rank calls it the same number of times."""
        if self.settings.grad_accum != 1:
            raise ValueError(f"accumulate: TrainSettings.grad_accum={self.settings.grad_accum}; a step of "
                             "token-budget micro-batches needs grad_accum 1")
        engine = self.engine
        engine.set_gradient_accumulation_boundary(last)
        if not last:
            lr = float(engine.get_lr()[0])
            engine.backward(loss)
            return {"lr": lr, "stepped": 0.0}
        return self.step(loss)  # boundary: backward, reduce, update (left set: grad_accum 1 makes every step one)

    def _module_grad_norm(self) -> float:
        # stage 0: the engine all-reduced (averaged) the module grads in backward, so every rank holds the global grad
        norms = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def train_mode(self) -> None:
        self.engine.train()

    def eval_mode(self) -> None:
        self.engine.eval()

    # ---- collectives ----------------------------------------------------------------------------------------
    def barrier(self) -> None:
        dist.barrier()

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def all_reduce_max(self, value: float) -> float:
        """Largest value of a scalar over ranks (how many micro-batches every rank must backward)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_reduce_mean(self, value: float) -> float:
        """Mean of a scalar metric over ranks (with `loss_normalizer` losses: the global token-mean loss)."""
        return self.all_reduce_sum(value) / self.world_size

    # ---- saving ---------------------------------------------------------------------------------------------
    def save_hf(self, out_dir: str | Path, tokenizer=None) -> None:
        """Write an HF-format model (config + safetensors, plus `tokenizer` if given) to `out_dir` on rank 0.

        A collective: call it on every rank. Under ZeRO-3 the parameters are sharded, so they are gathered one layer
        at a time into a state dict on rank 0 first. Weights are saved in the training dtype (fp32 master weights
        of bf16/fp16 runs stay in the optimizer state: see `save_state`).
        """
        out = Path(out_dir)
        state_dict = None
        if self.settings.zero_stage == 3:
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()  # all ranks take part; None off rank 0
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
            self.module.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out))
        self.barrier()

    def named_weights(self, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        """The current weights as {HF state-dict name: CPU tensor} on rank 0 (None on the other ranks), in the
        training dtype, each tied tensor once (under its first name, e.g. the input embeddings, not the tied LM
        head): what `save_hf` writes, without the files (a weight push through `engine.weight_buffer`).

        A collective under ZeRO-3 (the same layer-by-layer gather as `save_hf`: call it on every rank). On a CPU
        accelerator the tensors are the live parameters themselves, not copies: read them before the next
        optimizer step (`PolicyServer.push` snapshots them into a buffer file first). `on_device`: leave them where
        they live (CUDA tensors for SGLang's tensor/NCCL weight sync, engine/sglang_sync.py); under ZeRO-3 the
        gathered layers are then copied on the device (`_zero3_gather_on_device`), not to the host as DeepSpeed's
        consolidation does."""
        if self.settings.zero_stage == 3:
            state = (self._zero3_gather_on_device() if on_device  # all ranks take part; None off rank 0
                     else self.engine._zero3_consolidated_16bit_state_dict())
        else:
            state = self.module.state_dict() if self.is_main else None
        if not self.is_main or state is None:
            return None
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int]] = set()
        for name, t in state.items():
            t = t.detach()
            key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
            if key in seen:  # a tied weight: the same tensor under a second name
                continue
            seen.add(key)
            out[name] = t if on_device or t.device.type == "cpu" else t.to("cpu")
        return out

    def _zero3_gather_on_device(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3's parameters, gathered one module at a time (every rank takes part) and copied on rank 0 on the
        device they were gathered to: a full copy of the weights in the training dtype on rank 0's device, none on
        the host. Tied parameters (one `ds_id`) appear once per name, sharing one tensor (`named_weights` keeps the
        first name)."""
        state: dict[str, torch.Tensor] | None = {} if self.is_main else None
        by_id: dict[int, torch.Tensor] = {}

        def gather(module: torch.nn.Module, prefix: str) -> None:
            params = list(module.parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if state is not None:
                    for name, p in module.named_parameters(recurse=False):
                        key = getattr(p, "ds_id", id(p))
                        if key not in by_id:
                            by_id[key] = p.detach().clone()
                        state[prefix + name] = by_id[key]
                    for name, b in module.named_buffers(recurse=False):
                        if name not in module._non_persistent_buffers_set:
                            state[prefix + name] = b.detach().clone()
            for name, child in module.named_children():
                gather(child, prefix + name + ".")

        gather(self.module, "")
        return state

    def save_state(self, state_dir: str | Path) -> Path:
        """Save everything needed to resume (a collective: call on every rank). Returns state_dir/CHECKPOINT_TAG.

        What lands in `state_dir` (DeepSpeed's layout, fixed tag "state"):
          latest                                        the tag name ("state")
          zero_to_fp32.py                               DeepSpeed's script to rebuild fp32 weights from ZeRO shards
          state/mp_rank_00_model_states.pt              module weights, lr-scheduler state, global step, ds config
                                                        (stage 0: also the optimizer state)
          state/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   stages 1-3: rank r's optimizer (+ fp32 master) shard
          state/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: rank r's parameter shard
          state/rng_rank<r>.pt                          rank r's python / numpy / torch (/ cuda) RNG states
        On several nodes `state_dir` must be a shared filesystem. Resume with the same world size and ZeRO stage.
        `load_state` reads every one of these files with torch.load(weights_only=True) (`training.safe_load`): a file
        holding anything but tensors, plain containers and DeepSpeed's few state classes is refused, never run.
        """
        root = Path(state_dir)
        self.engine.save_checkpoint(str(root), tag=CHECKPOINT_TAG)
        tag_dir = root / CHECKPOINT_TAG
        tag_dir.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), tag_dir / f"rng_rank{self.rank}.pt")
        self.barrier()
        return tag_dir

    def load_state(self, state_dir: str | Path) -> None:
        """Resume from `save_state(state_dir)`: weights, optimizer, scheduler, global step and this rank's RNG."""
        root = Path(state_dir)
        if not (root / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"load_state: no '{CHECKPOINT_TAG}' checkpoint under {root}")
        if self.engine.load_universal_checkpoint() or self.engine.has_moe_layers:
            # those paths call torch.load(weights_only=False) directly, past the safe checkpoint_engine.load
            raise ValueError("load_state: universal and MoE checkpoints are not supported (DeepSpeed would unpickle "
                             "them with weights_only=False); remove checkpoint.load_universal from ds_config_overrides")
        path, _ = self.engine.load_checkpoint(str(root), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"load_state: DeepSpeed could not load the checkpoint in {root / CHECKPOINT_TAG}")
        rng_file = root / CHECKPOINT_TAG / f"rng_rank{self.rank}.pt"
        if not rng_file.exists():
            raise FileNotFoundError(f"load_state: {rng_file} missing (saved with a different world size?)")
        _set_rng_state(safe_torch_load(rng_file), rng_file)
        self.barrier()

    def close(self) -> None:
        """Release the engine's hooks and buffers (the module stays usable on stages 0-2) and, on a GPU, the cached
        blocks the allocator holds, so a process that goes on (the flow's in-process base SFT) gives them back."""
        self.engine.destroy()
        if self.device.type == "cuda":
            release_gpu_memory()


def release_gpu_memory() -> None:
    """Collect unreachable objects (DeepSpeed engines hold reference cycles) and give the CUDA allocator's cached
    blocks back to the driver: what a process that trained in-process and goes on (the flow's base SFT) calls."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
