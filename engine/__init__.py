"""Alloy's engine layer: the embedded SGLang-protocol server (CPU, HF transformers) and the client/launcher.

- `engine.server`: `python -m engine.server --model DIR --port P`; `build_app`, `main`.
- `engine.request_guards`: the server's error and auth middlewares, body limit and bounded body reads.
- `engine.scheduler`: the continuous-batching engine (one thread owns the model).
- `engine.weight_updates`: the engine's weight updates (queued, ordered after older requests, applied).
- `engine.protocol`: `/generate` request validation and SGLang response shapes.
- `engine.sampling`, `engine.kv_cache`: sampling math and the batch KV cache.
- `engine.client`, `engine.launcher`: the one HTTP client and the server supervisor.

Submodules are imported on demand: importing `engine` does not import torch.
"""
