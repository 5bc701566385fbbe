"""Alloy's engine layer: the embedded SGLang-protocol server (CPU, HF transformers) and the client/launcher.

- `infra.engine.server`: `python -m infra.engine.server --model DIR --port P`; `build_app`, `main`.
- `infra.engine.scheduler`: the continuous-batching engine (one thread owns the model).
- `infra.engine.protocol`: `/generate` request validation and SGLang response shapes.
- `infra.engine.sampling`, `infra.engine.kv_cache`: sampling math and the batch KV cache.
- `infra.engine.client`, `infra.engine.launcher`: the one HTTP client and the server supervisor.

Submodules are imported on demand: importing `infra.engine` does not import torch.
"""
