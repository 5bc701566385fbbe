"""Teacher registry: domain → teacher endpoint, and the one `EngineClient` per teacher.

Teachers are either checkpoints this run launches (`tasks/teachers.py`, through `engine.launcher`: embedded servers
on CPU, or SGLang on GPUs) or servers that already run elsewhere (`{domain: url}`), or a mix; the registry holds
their URLs once they are up. The OPD student routes each prompt to
`registry.client(domain)`; before distillation starts, `check_tokenizers` makes sure every teacher speaks the
student's vocabulary, since OPD compares log-probs token id by token id.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from engine.client import EngineClient
from infra.http import run_sync


class TokenizerMismatch(ValueError):
    """A teacher's tokenizer differs from the student's (vocab, special token ids, or text → ids pipeline)."""


PIPELINE_PARTS = ("model", "normalizer", "pre_tokenizer", "added_tokens")


def _pipeline_hashes(tok) -> dict[str, str]:
    """sha256 of each part of a fast tokenizer's tokenizer.json that decides its ids for a text: the model section
    without its vocab (compared on its own: a BPE's merges, a WordLevel/Unigram's settings), the normalizer, the
    pre-tokenizer, and the added tokens (id, content, special). {} for a tokenizer without a `tokenizers` backend."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return {}
    spec = json.loads(backend.to_str())
    model = {k: v for k, v in (spec.get("model") or {}).items() if k != "vocab"}
    added = sorted((a["id"], a["content"], bool(a.get("special"))) for a in spec.get("added_tokens") or [])
    parts = {"model": model, "normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"),
             "added_tokens": added}
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest() for k, v in parts.items()}


def tokenizer_fingerprint(tok) -> dict[str, Any]:
    """What must agree for token-level distillation: the vocab (token → id), the special token ids, and the
    pipeline that maps text to ids (`_pipeline_hashes`: e.g. two BPEs with the same vocab but other merges)."""
    return {
        "vocab": dict(tok.get_vocab()),
        "special_ids": {k: getattr(tok, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")},
        "pipeline": _pipeline_hashes(tok),
    }


def describe_difference(student: dict, teacher: dict) -> str:
    """A short human description of how two fingerprints differ."""
    parts = []
    sv, tv = student["vocab"], teacher["vocab"]
    if sv != tv:
        only_s, only_t = sorted(set(sv) - set(tv)), sorted(set(tv) - set(sv))
        moved = sorted(t for t in set(sv) & set(tv) if sv[t] != tv[t])
        parts.append(f"vocab size {len(tv)} vs student {len(sv)}; {len(only_t)} tokens only in teacher "
                     f"{only_t[:3]}, {len(only_s)} only in student {only_s[:3]}, {len(moved)} with other ids {moved[:3]}")
    for k, sid in student["special_ids"].items():
        if teacher["special_ids"][k] != sid:
            parts.append(f"{k}_token_id {teacher['special_ids'][k]} vs student {sid}")
    sp, tp = student.get("pipeline") or {}, teacher.get("pipeline") or {}
    if sp and tp:
        differ = [k for k in PIPELINE_PARTS if sp.get(k) != tp.get(k)]
        if differ:  # "model" of a BPE: its merges (the vocab is compared above)
            parts.append("tokenizer.json differs in " + ", ".join("model (merges)" if k == "model" else k
                                                                  for k in differ))
    return "; ".join(parts)


class TeacherRegistry:
    """Maps each domain to its teacher server URL and hands out one cached `EngineClient` per domain."""

    def __init__(self, endpoints: Mapping[str, str] | None = None, *, api_key: str | None = None,
                 client_kwargs: Mapping[str, Any] | None = None):
        self._endpoints: dict[str, str] = {}
        self._api_keys: dict[str, str | None] = {}
        self._clients: dict[str, EngineClient] = {}
        self._client_kwargs = dict(client_kwargs or {})
        for domain, url in (endpoints or {}).items():
            self.add(domain, url, api_key=api_key)

    def add(self, domain: str, url: str, api_key: str | None = None) -> None:
        if domain in self._endpoints:
            raise ValueError(f"teacher for domain {domain!r} already registered at {self._endpoints[domain]}")
        self._endpoints[domain] = url.rstrip("/")
        self._api_keys[domain] = api_key

    def domains(self) -> list[str]:
        return sorted(self._endpoints)

    def endpoints(self) -> dict[str, str]:
        return dict(self._endpoints)

    def endpoint(self, domain: str) -> str:
        try:
            return self._endpoints[domain]
        except KeyError:
            raise KeyError(f"no teacher registered for domain {domain!r}; known domains: {self.domains()}") from None

    def client(self, domain: str) -> EngineClient:
        """The cached client of `domain`'s teacher (one per domain, so one HTTP session per loop per teacher)."""
        if domain not in self._clients:
            self._clients[domain] = EngineClient(self.endpoint(domain), api_key=self._api_keys[domain],
                                                 **self._client_kwargs)
        return self._clients[domain]

    async def aclose(self) -> None:
        """Close every client's session on the running loop."""
        for c in self._clients.values():
            await c.aclose()

    def _run(self, coro):
        return run_sync(coro, cleanup=self.aclose)

    # -- checks (sync: run once at the flow boundary, before distillation) ----------------------------------------
    def model_infos(self) -> dict[str, dict]:
        async def all_():
            infos = await asyncio.gather(*(self.client(d).model_info() for d in self.domains()))
            return dict(zip(self.domains(), infos))

        return self._run(all_())

    def check_tokenizers(self, student_tokenizer_dir: str | Path) -> dict[str, str]:
        """Compare each teacher's tokenizer (from `/get_model_info` → `tokenizer_path`, else `model_path`) with the
        student's: vocab, bos/eos/pad/unk ids and tokenizer.json's pipeline (merges, normalizer, pre-tokenizer,
        added tokens). Returns {domain: "match" | "unverified: <why>"} (a teacher whose
        tokenizer is not a local dir, e.g. a remote SGLang server, cannot be checked here). Raises
        `TokenizerMismatch` naming every teacher that differs."""
        from infra.models import load_tokenizer

        student = tokenizer_fingerprint(load_tokenizer(student_tokenizer_dir))
        cache: dict[str, dict] = {}
        result, mismatches = {}, []
        for domain, info in self.model_infos().items():
            path = info.get("tokenizer_path") or info.get("model_path")
            if not path or not Path(path).is_dir():
                result[domain] = f"unverified: tokenizer path {path!r} is not a local directory"
                continue
            if path not in cache:
                cache[path] = tokenizer_fingerprint(load_tokenizer(path))
            diff = describe_difference(student, cache[path])
            result[domain] = "match" if not diff else "mismatch"
            if diff:
                mismatches.append(f"{domain} ({path}): {diff}")
        if mismatches:
            raise TokenizerMismatch(f"teacher tokenizers differ from the student's ({student_tokenizer_dir}):\n  "
                                    + "\n  ".join(mismatches))
        return result
