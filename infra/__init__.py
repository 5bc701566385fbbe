"""The ground floor: typed config, storage, tracking, models/tokenizers/chat, processes, placement, report.

Light on purpose: importing `infra` (or `infra.config`, `infra.placement`, `infra.procs`, `infra.http`) imports no
torch; the modules that need it (`infra.models`, `infra.generation`) import it themselves.
"""
import os as _os

_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
