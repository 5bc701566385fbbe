"""Several plain domains behind the one-domain interface the specialist trainer uses: mixed multi-task RL.

`SpecialistTrainer` (teachers/specialist.py) is written for one domain: its `PromptCursor` cycles
`domain.split("train", n, seed)`, its rewards are `domain.verify(example, response)` and it counts
`domain.verifier_errors`. `MixedDomain` provides exactly those over several domains, so one PPO policy trains on a
mix of all their prompts with no change to the trainer or the rollout code:

    split(split, n, seed)   each domain's own split (n split evenly; the first n mod k domains get one more),
                            interleaved round-robin d1[0], d2[0], …, dk[0], d1[1], … so every batch the cursor takes
                            is evenly mixed and the prompts are the same ones the per-domain specialists train on
    verify(example, resp)   routed by `example.domain` (every Example carries its domain's name) to that domain's
                            own `verify`, so partial credit and error counting are each domain's own
    verifier_errors         the sum over the domains

Only plain domains: a tool domain's episodes need its env (the Roller picks the turn protocol per trainer, not per
row), so mixing one in is refused.
"""
from __future__ import annotations

from typing import Sequence

from domains.base import Example


class MixedDomain:
    """A Domain-like composite of `domains` (distinct names, no tool domains) under the name `name`."""

    def __init__(self, domains: Sequence, name: str = "mixed"):
        if not domains:
            raise ValueError("MixedDomain: needs at least one domain")
        names = [d.name for d in domains]
        if len(set(names)) != len(names):
            raise ValueError(f"MixedDomain: domain names must be distinct, got {names}")
        tools = [d.name for d in domains if callable(getattr(d, "env", None))]
        if tools:
            raise ValueError(f"MixedDomain: tool domains cannot be mixed (their episodes need their env): {tools}")
        if name in names:
            raise ValueError(f"MixedDomain: name {name!r} is also one of the mixed domains")
        self.name, self.domains = name, {d.name: d for d in domains}
        self.max_answer_chars = max(d.max_answer_chars for d in domains)

    @property
    def verifier_errors(self) -> int:
        return sum(d.verifier_errors for d in self.domains.values())

    def split(self, split: str, n: int, seed: int) -> list[Example]:
        """n examples: domain i contributes n // k (+1 for i < n mod k) of its own `split(split, ·, seed)`,
        interleaved round-robin in the order the domains were given."""
        k = len(self.domains)
        parts = [d.split(split, n // k + (i < n % k), seed) for i, d in enumerate(self.domains.values())]
        return [part[j] for j in range(max(map(len, parts))) for part in parts if j < len(part)]

    def verify(self, example: Example, response: object) -> float:
        """The reward of `example`'s own domain (`Domain.verify`: never raises, clamped to [0, 1])."""
        if example.domain not in self.domains:
            raise KeyError(f"MixedDomain {self.name!r}: example of unknown domain {example.domain!r} "
                           f"(mixed: {sorted(self.domains)})")
        return self.domains[example.domain].verify(example, response)

    def credit(self, example: Example, response: str) -> list[float] | None:
        """Where `example`'s own domain places its reward (`Domain.credit`), so mixed-domain RL gets the same
        per-token credit as the specialists."""
        return self.domains[example.domain].credit(example, response)

    def __repr__(self) -> str:
        return f"MixedDomain(name={self.name!r}, domains={list(self.domains.values())!r})"
