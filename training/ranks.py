"""Multi-rank trainers where rank 0 drives: it runs the loop (engine server, rollouts, scoring, ledger, evals,
MLflow, checkpoint commits) and names each collective step before taking part in it; the other ranks follow.

    ranks = Ranks()                                  # rank / world size of the current process group
    ranks.on(trainer.update_shard)                   # every rank registers the same handlers (by their names)
    if ranks.is_main:
        ...; ranks.call(trainer.update_shard, batch) # rank 0: broadcast ("update_shard", (batch,)), then run it
        ranks.finish()                               # the followers leave `follow`
    else:
        ranks.follow()                               # run each announced handler until rank 0 finishes

`led(backend, ranks, "policy")` wraps a DeepSpeedBackend for rank 0 so that its collective methods (`save_hf`,
`save_state`, `load_state`, `named_weights` under ZeRO-3) are announced first: code written for one rank (a weight push, a checkpoint) then
works unchanged. With a world of one nothing is broadcast and `led` returns the backend itself.
Paths in announced calls are rank 0's: the ranks share one machine (torchrun --standalone).
"""
from __future__ import annotations

from typing import Any, Callable

DONE = "__done__"
COLLECTIVE_METHODS = ("save_hf", "save_state", "load_state", "named_weights")


def process_world_size() -> int:
    """The world size of this process's torch.distributed group; 1 when none is initialised."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def require_same_world(saved: int | None, now: int, what: str, setting: str, url: str) -> None:
    """A checkpoint holds one DeepSpeed state per rank (and rank 0's buffer/ledger): resuming it needs the world size
    that wrote it (`saved`; None, from before this was recorded: 1). Raises ValueError naming `setting` otherwise."""
    saved = 1 if saved is None else int(saved)
    if saved != now:
        raise ValueError(f"{what}: checkpoint {url} was written by {saved} rank(s) and this run has {now}; resume it "
                         f"with {setting}={saved}, or start afresh (another run.storage, or run.resume=false)")


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Ranks:
    def __init__(self):
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0
        self.world_size = dist.get_world_size() if initialised else 1
        self.handlers: dict[str, Callable] = {}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def on(self, op: str | Callable, fn: Callable | None = None) -> None:
        """Register `fn` as `op`; or a function / bound method `op` under its own name (`op.__name__`)."""
        if fn is None:
            op, fn = op.__name__, op
        self.handlers[op] = fn

    def call(self, op: str | Callable, *args, local: Callable | None = None) -> Any:
        """Rank 0: announce `op(*args)` to the followers, then run it here (`local()` instead, when given: the same
        collective with rank-0-only extras such as a tokenizer to save). `op` is a registered name, or the function
        / bound method registered with `on(fn)`: `ranks.call(self.update_shard, batch)` reads as the call it is."""
        if callable(op):
            op = op.__name__
        if not self.is_main:
            raise RuntimeError(f"Ranks.call({op!r}) on rank {self.rank}: only rank 0 drives")
        if op not in self.handlers:
            raise KeyError(f"Ranks.call: no handler for {op!r}; registered: {sorted(self.handlers)}")
        if self.world_size > 1:
            _broadcast((op, args))
        return local() if local is not None else self.handlers[op](*args)

    def finish(self) -> None:
        """Rank 0: release the followers (their `follow` returns)."""
        if self.is_main and self.world_size > 1:
            _broadcast((DONE, ()))

    def follow(self) -> int:
        """Ranks > 0: run every call rank 0 announces, until it finishes; returns how many ran."""
        n = 0
        while True:
            op, args = _broadcast(None)
            if op == DONE:
                return n
            self.handlers[op](*args)
            n += 1


class _Led:
    """A backend whose collective methods rank 0 announces first (see the module docstring)."""

    def __init__(self, backend, ranks: Ranks, name: str):
        self._backend, self._ranks, self._name = backend, ranks, name

    def __getattr__(self, attr: str):
        return getattr(self._backend, attr)

    def save_hf(self, out_dir, tokenizer=None):
        return self._ranks.call(f"{self._name}.save_hf", out_dir,
                                local=lambda: self._backend.save_hf(out_dir, tokenizer=tokenizer))

    def save_state(self, state_dir):
        return self._ranks.call(f"{self._name}.save_state", state_dir)

    def named_weights(self, on_device: bool = False):
        if self._backend.settings.zero_stage != 3:  # a collective only under ZeRO-3 (the gather)
            return self._backend.named_weights(on_device)
        return self._ranks.call(f"{self._name}.named_weights", on_device)

    def load_state(self, state_dir):
        return self._ranks.call(f"{self._name}.load_state", state_dir)


def led(backend, ranks: Ranks, name: str):
    """Register `backend`'s collective methods as `<name>.<method>` on every rank; on rank 0 of a world > 1, the
    backend wrapped so that those methods are announced; otherwise the backend itself."""
    for m in COLLECTIVE_METHODS:
        ranks.on(f"{name}.{m}", getattr(backend, m))
    return _Led(backend, ranks, name) if ranks.world_size > 1 and ranks.is_main else backend
