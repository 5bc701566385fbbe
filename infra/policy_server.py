"""A trainer's own rollout server: one engine server serving the current policy, weights pushed after each step.

Used by both RL trainers (specialist PPO, OPD student). The trainer saves HF weights to a versioned directory,
the live server loads them with `update_weights_from_disk`, and the supervisor records them so that a restarted
server comes back with the latest weights and the same `weight_version`.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from infra.engine.backends import server_backend
from infra.engine.client import EngineClient
from infra.engine.launcher import ServerSpec, Supervisor, launch_settings
from infra.placement import rollout_placement

log = logging.getLogger("alloy.policy_server")


class PolicyServer:
    """Serve `model_dir` under `name`, bound to `host` (the trainer passes `cfg.engine.host`);
    `push(backend, tokenizer, version)` publishes new weights.

    Keeps the last `keep` weight directories under `work_dir/weights/` (the server may still be reading the
    previous one while it swaps).
    """

    def __init__(self, supervisor: Supervisor, name: str, model_dir: str, work_dir: str | Path, *,
                 backend: str = "embedded", api_key: str | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, options: dict | None = None, keep: int = 2, version: int = 0,
                 seed: int | None = None, env: dict[str, str] | None = None):
        self.supervisor, self.name = supervisor, name
        extra, options = list(extra_args or []), dict(options or {})
        if seed is not None:  # the sampling stream follows the run's seed (and differs after a resume at `version`)
            stream = (seed * 1_000_003 + version) % 2 ** 31
            options[server_backend(backend).seed_option] = stream
        self.weights_dir = Path(work_dir) / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.keep, self.version = keep, version
        spec = ServerSpec(name=name, model_path=str(model_dir), backend=backend, host=host, api_key=api_key,
                          extra_args=extra, options=options, weight_version=str(version), env=dict(env or {}))
        self.url = supervisor.start([spec])[name]
        # retries ride out a supervisor restart of this server (tens of seconds on a loaded machine): ~30 s budget
        self.client = EngineClient(self.url, api_key=api_key, max_retries=10, backoff_base=0.25, backoff_max=4.0)
        self._pushed: list[Path] = []

    @classmethod
    def for_engine(cls, engine_cfg, supervisor: Supervisor, name: str, model_dir: str, work_dir: str | Path,
                   **kw) -> "PolicyServer":
        """A rollout server launched as `engine_cfg` (infra.config.EngineConfig) says: backend (embedded or real
        SGLang), its options, bind address, API key; on the GPUs the trainer process was given for it
        (infra/placement.py `trainer_env`: PLACEMENT_ENV), if any."""
        settings = launch_settings(engine_cfg, rollout_placement(os.environ))
        return cls(supervisor, name, model_dir, work_dir, **settings, api_key=engine_cfg.api_key,
                   host=engine_cfg.host, **kw)

    async def push(self, train_backend, tokenizer, version: int) -> str:
        """Save the trainer's weights (rank 0) and load them into the live server as `weight_version=version`."""
        path = self.weights_dir / f"v{version:06d}"
        if path.exists():
            shutil.rmtree(path)
        train_backend.save_hf(str(path), tokenizer=tokenizer)
        await self.client.update_weights(str(path), version=str(version), flush_cache=True)
        self.supervisor.set_weights(self.name, str(path), str(version))
        self.version = version
        self._pushed.append(path)
        while len(self._pushed) > self.keep:
            shutil.rmtree(self._pushed.pop(0), ignore_errors=True)
        return str(path)

    async def aclose(self) -> None:
        await self.client.aclose()
