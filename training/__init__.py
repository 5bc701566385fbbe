"""The trainer machinery that `teachers/` (PPO specialists), `student/` (OPD) and the base SFT share.

- `training.worker`: the one trainer-process skeleton (flags, config, MLflow run, torch.distributed, signals).
- `training.progress_events`: a trainer's steps as JSON lines for the process that started it (`report`, `read_events`).
- `training.session`: what a trainer sets up (tokenizer, DeepSpeed backend, its supervised rollout server).
- `training.deepspeed_backend`: the DeepSpeed engine wrapper; `training.ds_config`: its settings, config and lr
  schedule (pure); `training.safe_load`: code-free checkpoint loads.
- `training.ranks`: rank 0 drives, the other ranks follow its collective steps.
- `training.policy_server`: weight pushes into the trainer's own engine server; `training.ledger`: exactly-once.
- `training.batching`, `training.logprobs`, `training.sft`: length buckets, chunked log-softmax, the SFT loop.
- `training.base_main`: the base SFT as a process (the domains' demonstrations, early stop on their val split), the
  sibling of `teachers.specialist_main` and `student.distill_main`.

DeepSpeed picks its accelerator when it is imported, and every import of it goes through this package, so this is
where the choice is made: `DS_ACCELERATOR=cpu` when no CUDA device is visible; unset otherwise, so DeepSpeed detects
CUDA itself. (A blanket default to cpu trained on the CPU of a GPU machine: bench/gpu_check.py found it on an H100.)
"""
import os as _os
import sys as _sys

# DeepSpeed JIT-compiles small C++ ops into TORCH_EXTENSIONS_DIR, shared by default (~/.cache/torch_extensions):
# another checkout or venv writes a different build file there and forces a rebuild (~35-100 s on 2 cores) in every
# process. One cache per environment (this venv) keeps builds from clashing.
_os.environ.setdefault("TORCH_EXTENSIONS_DIR", _os.path.join(_sys.prefix, "torch_extensions"))
if "DS_ACCELERATOR" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["DS_ACCELERATOR"] = "cpu"
