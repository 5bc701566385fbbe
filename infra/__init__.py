"""Infrastructure: config, models, engine server/client, launcher, DeepSpeed backend, storage, tracking."""
import os as _os

# DeepSpeed picks its accelerator at import time; default to CPU unless the user chose otherwise.
_os.environ.setdefault("DS_ACCELERATOR", "cpu")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
