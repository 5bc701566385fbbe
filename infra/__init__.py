"""Infrastructure: config, models, engine server/client, launcher, DeepSpeed backend, storage, tracking."""
import os as _os

_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "DS_ACCELERATOR" not in _os.environ:
    # DeepSpeed picks its accelerator at import time. CPU unless a GPU is visible (then DeepSpeed detects CUDA itself).
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ["DS_ACCELERATOR"] = "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        _os.environ["DS_ACCELERATOR"] = "cpu"
