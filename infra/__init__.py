"""Infrastructure: config, models, engine server/client, launcher, DeepSpeed backend, storage, tracking."""
import os as _os
import sys as _sys

_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed JIT-compiles small C++ ops (the CPU shm op at every init_distributed) into TORCH_EXTENSIONS_DIR, shared
# by default (~/.cache/torch_extensions): another checkout or venv writes a different build file there and forces a
# rebuild (~35-100 s on 2 cores) in every process. One cache per environment (this venv) keeps builds from clashing.
_os.environ.setdefault("TORCH_EXTENSIONS_DIR", _os.path.join(_sys.prefix, "torch_extensions"))
if "DS_ACCELERATOR" not in _os.environ:
    # DeepSpeed picks its accelerator at import time. CPU unless a GPU is visible (then DeepSpeed detects CUDA itself).
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ["DS_ACCELERATOR"] = "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        _os.environ["DS_ACCELERATOR"] = "cpu"
