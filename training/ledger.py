"""The exactly-once ledger: the ids of the samples a trainer has trained, saved in the same checkpoint as the weights.

A trainer gives every sample a stable id (a function of its prompt cursor), drops the ids already trained
(`filter_untrained`, which also drops an id repeated within one batch, e.g. a network retry that returned one request
twice), and records the ids it trained (`mark_trained`) in the same commit as the weight update they went into. After a
crash the weights, the cursor and the ledger roll back together, so every id is trained once in the committed history.
Used by the OPD student (student/trainer.py) and, with its buffer of partial rollouts, by APRIL (teachers/april.py).

The ledger grows by one short string per trained sample (~30 bytes; 1M samples ≈ 30 MB of JSON).
"""
from __future__ import annotations

from typing import Iterable, Protocol

STATE_FORMAT = 1


class HasSampleId(Protocol):
    sample_id: str


class Ledger:
    """Trained sample ids, plus the count of samples skipped as already trained or repeated. Not thread-safe (one
    event loop)."""

    def __init__(self) -> None:
        self._ledger: set[str] = set()
        self.duplicates_skipped = 0

    def mark_trained(self, ids: Iterable[str]) -> None:
        """Record sample ids as trained (call with the same commit as the weight update they went into)."""
        self._ledger.update(ids)

    def was_trained(self, sample_id: str) -> bool:
        return sample_id in self._ledger

    @property
    def n_trained(self) -> int:
        return len(self._ledger)

    def filter_untrained(self, samples: Iterable[HasSampleId]) -> list:
        """The samples whose id is neither in the ledger nor repeated earlier in this batch (counted if dropped)."""
        seen: set[str] = set()
        out = []
        for s in samples:
            if s.sample_id in self._ledger or s.sample_id in seen:
                self.duplicates_skipped += 1
                continue
            seen.add(s.sample_id)
            out.append(s)
        return out

    def state_dict(self) -> dict:
        """{"format", "counters": {"duplicates_skipped"}, "ledger": sorted ids}: JSON-serialisable, the same keys the
        APRIL buffer's state has (which adds its partials and counters)."""
        return {"format": STATE_FORMAT, "counters": {"duplicates_skipped": self.duplicates_skipped},
                "ledger": sorted(self._ledger)}

    def load_state_dict(self, state: dict) -> None:
        """Replace the ids and the counter from a `state_dict()` (an APRIL buffer's state loads too: its ledger)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected format {STATE_FORMAT}, got {got!r}")
        ids = state.get("ledger", [])
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"{type(self).__name__}.load_state_dict: `ledger` must be a list of sample ids")
        self._ledger = set(ids)
        self.duplicates_skipped = int(state.get("counters", {}).get("duplicates_skipped", 0))
