"""The model behind a reward-model server: an HF sequence-classification checkpoint scored in batched forwards.

`python -m engine.server --model DIR` serves this instead of the generation engine when DIR's config names a
`...ForSequenceClassification` architecture (`engine.classify.is_classifier_checkpoint`); its endpoints are
engine/classify.py's. What it computes, per input: the classification head's logits (`num_labels` floats; a reward
model has one) at the input's last token that is not the config's `pad_token_id` (`score_position`): exactly HF's
`AutoModelForSequenceClassification` forward on the input, so what training/reward_main.py trained is what is
served. SGLang reads the final token (LAST pooling); the two differ only for an input that ends with the pad id
(a tokenizer whose pad is its EOS, scoring a response closed by EOS): such a model scores alike on both engines only
if its pad id differs from the tokens its inputs end with.

Batching: a request's inputs are sorted by length and cut into forwards of at most `max_batch` rows and
`max_prefill_tokens` padded tokens (a single input longer than that runs alone); each forward is one right-padded
batch through the backbone (`model.base_model`, with the attention mask: padding changes no real token's hidden
state) and the head (`model.score`) on each row's last real position. Forwards run on one worker thread, so
concurrent requests queue instead of competing for the cores; the event loop only waits.

The same surface as `engine.scheduler.Engine` where the server touches it (`start`, `stop`, `ready`,
`load_error`, `abort`, `model_path`, `device`, `dtype`, `mem_fraction_static`, `weight_version`), and
`is_generation = False` (what /get_model_info reports). Weight updates are not served for reward models.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import torch

from engine.device import (check_mem_fraction, dtype_name, enter_device, memory_budget_error, oom_as_error,
                           resolve_device, resolve_dtype)
from infra.batch_groups import token_budget_groups
from infra.choices import MAX_PREFILL_TOKENS, MAX_TOTAL_TOKENS

log = logging.getLogger("alloy.engine")

MAX_BATCH = 64  # rows per forward (with `max_prefill_tokens` padded tokens, the bound on one forward's activations)


def score_position(ids, pad_id: int | None) -> int:
    """Where HF's sequence classifiers read the score: the last position whose id is not `pad_id` (0 when every id
    is the pad id, as HF's argmax gives); the last position when the config has no pad id."""
    if pad_id is None:
        return len(ids) - 1
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_id), 0)


class RewardModel:
    """A sequence-classification model served on /classify. Thread-safe: `score` may be awaited from any number
    of requests (their forwards run one at a time on the worker thread)."""

    is_generation = False

    def __init__(self, model_dir: str, *, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS, max_batch: int = MAX_BATCH, threads: int | None = None,
                 weight_version: str = "default", device: str = "cpu", dtype: str = "auto",
                 mem_fraction_static: float | None = None):
        self.model_path = self.tokenizer_path = str(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.mem_fraction_static = check_mem_fraction(mem_fraction_static)
        self.max_total_tokens, self.max_prefill_tokens, self.max_batch = max_total_tokens, max_prefill_tokens, max_batch
        self.threads, self.weight_version = threads, weight_version
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alloy-reward-model")
        self.stats = {"requests": 0, "inputs": 0, "forwards": 0, "tokens": 0, "padded_tokens": 0, "seconds": 0.0}

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the tokenizer and model on the worker thread (`ready` is set after; `load_error` if it failed)."""
        self._pool.submit(self._load_guarded)

    def stop(self, timeout: float = 10.0) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "") -> None:
        """Nothing to abort: a request's forwards are short and finish on their own (the server calls this on
        shutdown, as for the generation engine)."""

    def _load_guarded(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported through /health (503), the log and the exit status
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("failed to load reward model from %s", self.model_path)
            return
        self.ready.set()
        log.info("reward model ready: %s (%s, %d label(s)) on %s in %s, vocab %d, context %d", self.model_path,
                 self.architecture, self.num_labels, self.device, dtype_name(self.dtype), self.vocab_size,
                 self.context_len)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from infra.models import placement_kwargs
        from infra.tokenizer import load_tokenizer

        enter_device(self.device, self.threads, self.mem_fraction_static)
        self.tokenizer = load_tokenizer(self.model_path)
        with oom_as_error(self.device, self.mem_fraction_static):
            model = AutoModelForSequenceClassification.from_pretrained(
                self.model_path, dtype=self.dtype, **placement_kwargs(self.device))
        model.eval()
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module) or model.base_model is model:
            raise ValueError(f"{type(model).__name__}: the embedded engine scores decoder reward models (a `score` "
                             "head on the backbone's last hidden state, as LlamaForSequenceClassification); this "
                             "model has none")
        self.model, self._head = model, head  # already on the device (placement_kwargs)
        cfg = model.config
        self.architecture = type(model).__name__
        self.num_labels = int(cfg.num_labels)
        self.id2label = {int(k): str(v) for k, v in (getattr(cfg, "id2label", None) or {}).items()}
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.pad_token_id = getattr(text_cfg, "pad_token_id", None)
        self.context_len = int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)
        with torch.inference_mode():
            self._forward([[0, 0]])  # warm-up: the first forward pays one-off allocation/dispatch costs
        budget = memory_budget_error(self.device, self.mem_fraction_static)
        if budget is not None:
            raise RuntimeError(budget)

    # -- scoring --------------------------------------------------------------------------------------------------
    async def score(self, inputs: list[tuple[int, ...]] | list[list[int]]) -> list[list[float]]:
        """The head's logits at the last token of each input (`num_labels` floats each), in input order."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.score_sync, inputs)

    def score_sync(self, inputs) -> list[list[float]]:
        t0 = time.perf_counter()
        lengths = [len(x) for x in inputs]
        out: list[list[float] | None] = [None] * len(inputs)
        with torch.inference_mode():
            for group in token_budget_groups(lengths, self.max_prefill_tokens, max_rows=self.max_batch):
                rows = self._forward([list(inputs[i]) for i in group])
                for i, row in zip(group, rows):
                    out[i] = row
                self.stats["forwards"] += 1
                self.stats["padded_tokens"] += len(group) * max(lengths[i] for i in group)
        self.stats["requests"] += 1
        self.stats["inputs"] += len(inputs)
        self.stats["tokens"] += sum(lengths)
        self.stats["seconds"] += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _forward(self, seqs: list[list[int]]) -> list[list[float]]:
        """One right-padded forward of `seqs` → (len(seqs), num_labels) logits at each one's `score_position`."""
        at = torch.tensor([score_position(s, getattr(self, "pad_token_id", None)) for s in seqs])
        n = torch.tensor([len(s) for s in seqs])
        L = int(n.max())
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = 1
        hidden = self.model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       use_cache=False)[0]  # (B, L, H)
        last = hidden[torch.arange(len(seqs), device=hidden.device), at.to(hidden.device)]  # (B, H)
        return self._head(last).float().cpu().tolist()

    def server_info(self) -> dict:
        """What /get_server_info reports for this model (its counters included)."""
        return {"architecture": getattr(self, "architecture", None), "num_labels": getattr(self, "num_labels", None),
                "max_total_tokens": self.max_total_tokens, "max_prefill_tokens": self.max_prefill_tokens,
                "max_batch": self.max_batch, "context_length": getattr(self, "context_len", None),
                "vocab_size": getattr(self, "vocab_size", None),
                **{f"classify_{k}": (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()}}
