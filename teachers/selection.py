"""Validation, best-checkpoint selection and early stopping for a specialist.

RL on a small policy does not climb monotonically: a domain can reach its peak and then collapse (entropy → 0, the
reward falls back below the base). Every `val_every` steps (and before the first) the trainer scores its policy,
greedy, on `val_n` prompts of the domain's **val split** (`Domain.split("val")`, a 5% hash bucket): never trained
on (no stage draws train prompts from it) and disjoint from the eval split by construction (the final score stays
an unbiased measurement), drawn like eval. (The first version validated on the train split's tail after the
training pool. Brackets then selected a policy that validated 0.605 and scored 0.44 on eval: its generator was
skewed, so distinct-prompt splits of different sizes held different shares of "yes"; brackets now draws
uniformly, see `domains.builtin.text.Brackets`.) The best-scoring policy is kept; with
`select: best` it becomes the specialist. `patience` and `stop_at` end training early.

The rules are pure (`Selection`), the scoring is `domains.evaluate.score_examples` on the trainer's own module.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Selection:
    """Validation history and the best step so far. A score counts as a new best when it beats the best by more
    than `min_delta` (ties keep the earlier, less trained policy)."""

    history: list[dict] = field(default_factory=list)  # [{"step": k, "score": s}]
    best_step: int | None = None
    best_score: float | None = None

    def record(self, step: int, score: float, min_delta: float = 0.0) -> bool:
        """Add a validation result; True iff it is the new best."""
        self.history.append({"step": step, "score": float(score)})
        if self.best_score is None or score > self.best_score + min_delta:
            self.best_step, self.best_score = step, float(score)
            return True
        return False

    def since_best(self) -> int:
        """Validations after the best one."""
        if self.best_step is None:
            return 0
        return sum(1 for h in self.history if h["step"] > self.best_step)

    def stop_reason(self, patience: int, stop_at: float | None) -> str | None:
        """Why training should stop now, or None: `stop_at` reached by the latest score, or `patience` validations
        (> 0) in a row without a new best."""
        if not self.history:
            return None
        latest = self.history[-1]["score"]
        if stop_at is not None and latest >= stop_at:
            return f"validation score {latest:.3f} >= stop_at {stop_at}"
        if patience > 0 and self.since_best() >= patience:
            return f"{patience} validations without a new best (best {self.best_score:.3f} at step {self.best_step})"
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history), "best_step": self.best_step, "best_score": self.best_score}

    @classmethod
    def from_state(cls, d: dict | None) -> "Selection":
        return cls(**d) if d else cls()
