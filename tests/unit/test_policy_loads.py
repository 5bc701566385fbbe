"""PolicyServer tracks its own weight loads (training/policy_server.py): `wait_version(v)` waits for version v however
many pushes away it is, a failed load's error reaches every later wait, and `load_s` times the deferred loads. The
loads here are stand-ins for the server's (no server: the tracking alone, as the student's sampler uses it)."""
from __future__ import annotations

import asyncio

import pytest

from training.policy_server import PolicyServer

pytestmark = pytest.mark.unit


def tracker_only(version: int = 0) -> PolicyServer:
    """A PolicyServer with its load tracking and nothing else (no supervisor, no server)."""
    s = PolicyServer.__new__(PolicyServer)
    s.version = s.loaded_version = version
    s._loading, s.load_error, s.load_s, s._load_done = None, None, 0.0, None
    return s


def start_load(s: PolicyServer, version: int, fail: bool = False, took: float = 0.05) -> None:
    """What `push(..., wait=False)` does once the snapshot is written: the load as a tracked task."""
    async def load() -> None:
        await asyncio.sleep(took)
        if fail:
            raise ConnectionError(f"load of {version} failed")
        s.loaded_version = version

    s.version = version
    s._loading = asyncio.ensure_future(s._tracked(load()))


def test_wait_version_waits_for_a_push_not_yet_started_and_loads_stay_timed():
    async def main():
        s = tracker_only(3)
        await s.wait_version(2)  # already loaded: returns at once
        waiter = asyncio.ensure_future(s.wait_version(5))
        start_load(s, 4)
        await s.wait_loaded()
        assert s.loaded_version == 4 and not waiter.done()  # version 4 is not enough
        start_load(s, 5)  # a push that had not started when the waiter began
        await asyncio.wait_for(waiter, 5)
        assert s.loaded_version == 5 and s.load_s >= 0.09

    asyncio.run(main())


def test_a_failed_load_fails_every_later_wait():
    async def main():
        s = tracker_only(0)
        waiter = asyncio.ensure_future(s.wait_version(1))
        start_load(s, 1, fail=True)
        with pytest.raises(ConnectionError, match="load of 1 failed"):
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(ConnectionError):
            await s.wait_loaded()  # the load itself: its error, once (then forgotten, as before)
        await s.wait_loaded()
        assert s.loaded_version == 0 and isinstance(s.load_error, ConnectionError)
        with pytest.raises(ConnectionError):
            await s.wait_version(0)  # sticky: a run must not go on past a load that failed

    asyncio.run(main())
