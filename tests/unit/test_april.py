"""APRIL buffer: request planning, merging continuations, staleness, the trained-id ledger, persistence, a
crash/resume replay that checks exactly-once, and `collect_batch` against a tiny asyncio engine double."""
import asyncio
import json
import time

import pytest

from teachers.april import (AprilBuffer, GenResult, Partial, Sample, collect_batch, merge_continuation,
                            plan_requests)

pytestmark = pytest.mark.unit


def partial(sid: str, versions: list[int], budget: int = 10, created: int | None = None) -> Partial:
    n = len(versions)
    return Partial(sid, f"r-{sid}", [1, 5, 6], list(range(20, 20 + n)), [-0.5] * n, list(versions), "addition",
                   {"prompt": "add:1+2=", "answer": "3"}, budget, versions[0] if created is None and versions
                   else (created or 0))


# -- planning and merging ------------------------------------------------------------------------------------------

def test_plan_requests_hand_numbers():
    assert plan_requests(8, 1.5, 3) == (3, 9)  # ceil(8 · 1.5) = 12 requests, the 3 partials first
    assert plan_requests(8, 1.5, 20) == (12, 0)  # more partials than requests: only 12 are resumed
    assert plan_requests(8, 1.0, 0) == (0, 8)
    assert plan_requests(3, 1.1, 1) == (1, 3)  # ceil(3.3) = 4
    assert plan_requests(10, 1.3, 0) == (0, 13)  # 10 · 1.3 = 13.000000000000002 in floats: still 13
    # min_extra: at least B + 4 once over-sampling at all; a fraction that already gives more wins; none when sync
    assert plan_requests(8, 1.25, 0, min_extra=4) == (0, 12)  # ceil(10) = 10 < 8 + 4
    assert plan_requests(64, 1.25, 16, min_extra=4) == (16, 64)  # ceil(80) = 80 > 68: unchanged
    assert plan_requests(8, 1.0, 0, min_extra=4) == (0, 8)
    assert plan_requests(8, 1.01, 30, min_extra=4) == (12, 0)
    for bad in [(0, 1.5, 0), (8, 0.9, 0), (8, 1.5, -1), (8, 1.5, 0, -1), (8, 1.5, 0, True)]:
        with pytest.raises(ValueError, match="plan_requests"):
            plan_requests(*bad)


def test_merge_continuation_appends_and_spends_budget():
    p = Partial.fresh("s1", [1, 5, 6], "addition", {"answer": "3"}, max_new_tokens=6, version=4)
    assert p.input_ids == [1, 5, 6] and p.remaining_budget == 6 and p.rollout_id == "s1"
    p2 = merge_continuation(p, [30, 31], [-0.25, -1.5], version=4, finished=False, finish_reason="abort")
    assert isinstance(p2, Partial)
    assert (p2.output_ids, p2.output_logprobs, p2.token_versions, p2.loss_mask) == (
        [30, 31], [-0.25, -1.5], [4, 4], [1, 1])
    assert p2.remaining_budget == 4 and p2.input_ids == [1, 5, 6, 30, 31] and p.output_ids == []  # p unchanged
    tool = merge_continuation(p2, [40], [0.0], version=5, finished=False, loss_mask=[0])  # env tokens: masked
    s = merge_continuation(tool, [32, 2], [-0.125, -0.0625], version=6, finished=True, finish_reason="stop")
    assert isinstance(s, Sample) and s.finish_reason == "stop" and s.sample_id == "s1"
    assert s.output_ids == [30, 31, 40, 32, 2] and s.token_versions == [4, 4, 5, 6, 6]
    assert s.loss_mask == [1, 1, 0, 1, 1] and s.output_logprobs == [-0.25, -1.5, 0.0, -0.125, -0.0625]
    # budget spent without finishing → a Sample cut by length
    cut = merge_continuation(p2, [1, 2, 3, 4], [-1.0] * 4, version=5, finished=False, finish_reason="abort")
    assert isinstance(cut, Sample) and cut.finish_reason == "length"


def test_merge_continuation_rejects_bookkeeping_bugs():
    p = partial("a", [3, 3], budget=2)
    with pytest.raises(ValueError, match="exceed remaining_budget=2"):
        merge_continuation(p, [1, 2, 3], [0.0] * 3, 3, finished=False)
    with pytest.raises(ValueError, match="2 new_ids but 1 new_logprobs"):
        merge_continuation(p, [1, 2], [0.0], 3, finished=False)
    with pytest.raises(ValueError, match="older than the partial's newest token"):
        merge_continuation(p, [1], [0.0], 2, finished=False)
    with pytest.raises(ValueError, match="not finished"):
        merge_continuation(p, [1], [0.0], 3, finished=True, finish_reason="abort")
    with pytest.raises(ValueError, match="output_logprobs has 1 entries for 2 output_ids"):
        Partial("x", "x", [1], [5, 6], [-1.0], [0, 0], "d", {}, 3, 0)


def test_blocked_calls_travel_through_resumes_checkpoints_and_into_the_sample(tmp_path):
    """A trajectory whose first segment had a call the guard blocked stays a blocked trajectory after it resumes
    (APRIL), after a checkpoint round trip, and in the finished Sample: its reward is then 0
    (`domains.guard.guarded_reward`), whatever the later segments do."""
    p = Partial.fresh("t1", [1, 2], "tool_add", {"answer": "5"}, max_new_tokens=12, version=0)
    seg1 = merge_continuation(p, [30, 31, 40], [-0.5, -0.5, 0.0], version=0, finished=False,
                              loss_mask=[1, 1, 0], blocked_calls=1)
    assert isinstance(seg1, Partial) and seg1.blocked_calls == 1 and p.blocked_calls == 0
    buf = AprilBuffer(max_staleness=3)
    buf.add_partial(seg1)
    buf.save(tmp_path / "april.json")
    restored = AprilBuffer(max_staleness=3)
    restored.load(tmp_path / "april.json")
    (back,) = restored.take_resumable(1, 1)
    assert back.blocked_calls == 1
    seg2 = merge_continuation(back, [32, 41, 33], [-0.25, 0.0, -0.25], version=1, finished=False,
                              loss_mask=[1, 0, 1], blocked_calls=0)  # an allowed call after the blocked one
    done = merge_continuation(seg2, [2], [-0.125], version=1, finished=True, finish_reason="stop")
    assert isinstance(done, Sample) and done.blocked_calls == 1
    twice = merge_continuation(back, [34, 42], [-0.25, 0.0], version=1, finished=True, finish_reason="stop",
                               loss_mask=[1, 0], blocked_calls=1)  # blocked again after the resume
    assert twice.blocked_calls == 2
    # a state written before the field existed loads as "nothing blocked"; a bad count is refused by name
    state = restored.state_dict() | {"partials": [{k: v for k, v in vars(seg1).items() if k != "blocked_calls"}]}
    old = AprilBuffer(max_staleness=3)
    old.load_state_dict(json.loads(json.dumps(state)))
    assert old.take_resumable(1, 1)[0].blocked_calls == 0
    with pytest.raises(ValueError, match="blocked_calls must be an int >= 0, got -1"):
        Partial("x", "x", [1], [], [], [], "d", {}, 3, 0, blocked_calls=-1)


# -- buffer ----------------------------------------------------------------------------------------------------------

def test_take_resumable_oldest_first_and_drops_stale():
    buf = AprilBuffer(max_staleness=2)
    buf.add_partial(partial("new", [9, 9]))
    buf.add_partial(partial("old", [7, 8]))  # oldest token version 7: lag 10 − 7 = 3 > 2 at version 10
    buf.add_partial(partial("mid", [8, 9]))  # lag 2: kept
    buf.add_partial(partial("mid2", [8]))  # same age as "mid", inserted later
    buf.add_partial(Partial.fresh("empty", [1], "d", {}, 5, version=0))  # no tokens: never stale
    assert len(buf) == 5 and buf.added == 5
    taken = buf.take_resumable(current_version=10, k=3)
    assert [p.sample_id for p in taken] == ["empty", "mid", "mid2"]  # created_version 0 counts as oldest
    assert buf.dropped_stale == 1 and buf.resumed == 3 and len(buf) == 1 and "old" not in buf and "new" in buf
    assert buf.take_resumable(10, 5)[0].sample_id == "new" and len(buf) == 0


def test_add_partial_refuses_duplicates_trained_ids_and_spent_budget():
    buf = AprilBuffer(max_staleness=1)
    buf.add_partial(partial("a", [0]))
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.add_partial(partial("a", [0]))
    buf.mark_trained(["t1"])
    with pytest.raises(ValueError, match="already trained"):
        buf.add_partial(partial("t1", [0]))
    with pytest.raises(ValueError, match="no budget left"):
        buf.add_partial(partial("b", [0], budget=0))
    with pytest.raises(ValueError, match="still a buffered partial"):
        buf.mark_trained(["a"])


def test_ledger_filters_trained_and_repeated_samples():
    buf = AprilBuffer(max_staleness=1)
    mk = lambda sid: Sample(sid, sid, [1], [5], [-1.0], [0], "d", {}, "stop", [1])  # noqa: E731
    buf.mark_trained(["s1"])
    kept = buf.filter_untrained([mk("s1"), mk("s2"), mk("s3"), mk("s2")])
    assert [s.sample_id for s in kept] == ["s2", "s3"] and buf.duplicates_skipped == 2
    assert buf.was_trained("s1") and not buf.was_trained("s2")


def test_state_dict_round_trip_and_atomic_save(tmp_path):
    buf = AprilBuffer(max_staleness=3)
    for sid, v in [("b", [2, 3]), ("a", [1])]:
        buf.add_partial(partial(sid, v))
    buf.mark_trained(["z", "y"])
    buf.take_resumable(3, 0)
    state = json.loads(json.dumps(buf.state_dict()))  # JSON-serialisable
    assert [p["sample_id"] for p in state["partials"]] == ["b", "a"] and state["ledger"] == ["y", "z"]
    path = tmp_path / "april.json"
    buf.save(path)
    assert [f.name for f in tmp_path.iterdir()] == ["april.json"]  # no temp file left behind
    other = AprilBuffer(max_staleness=3)
    other.load(path)
    assert other.state_dict() == buf.state_dict()
    assert [p.sample_id for p in other.take_resumable(3, 2)] == ["a", "b"]  # ages survive the round trip
    assert other.was_trained("y") and other.counters["added"] == 2
    path.write_text('{"format": 1, "partials": [{"sample_id": "x"}]}')
    with pytest.raises(ValueError, match=r"partials\[0\] is invalid"):
        other.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        other.load(path)
    bad = buf.state_dict() | {"ledger": ["b"]}
    with pytest.raises(ValueError, match="both buffered and trained"):
        other.load_state_dict(bad)


# -- exactly-once across a crash -------------------------------------------------------------------------------------

LENGTHS = [3, 9, 4, 15, 2, 7, 30, 5, 6, 11, 3, 8, 25, 4, 9, 2, 14, 6, 3, 12, 5, 40, 7, 4]  # tokens to finish


def _run(steps: range, state: dict | None, crash_at: int | None):
    """A deterministic replay of the trainer's APRIL loop: each step resumes partials, issues fresh prompts from a
    cursor, generates 6 tokens per request (the 'engine'), trains the finished ones and commits
    (buffer state + cursor + trained ids) together. A crash skips the commit of that step and everything after."""
    buf = AprilBuffer(max_staleness=2)
    cursor, trained = 0, []
    if state is not None:
        buf.load_state_dict(state["buffer"])
        cursor, trained = state["cursor"], list(state["trained"])
    dropped, commit = [], state
    for step in steps:
        version = step
        dropped += [p.sample_id for p in buf.drop_stale(version)]
        n_resume, n_fresh = plan_requests(4, 1.5, len(buf))
        reqs = buf.take_resumable(version, n_resume)
        for _ in range(n_fresh):
            if cursor < len(LENGTHS):
                reqs.append(Partial.fresh(f"s{cursor}", [1], "d", {}, 64, version))
                cursor += 1
        samples = []
        for p in reqs:
            n = min(6, LENGTHS[int(p.sample_id[1:])] - len(p.output_ids))
            out = merge_continuation(p, [7] * n, [-1.0] * n, version, finished=len(p.output_ids) + n
                                     == LENGTHS[int(p.sample_id[1:])])
            samples.append(out) if isinstance(out, Sample) else buf.add_partial(out)
        batch = buf.filter_untrained(samples)
        trained += [s.sample_id for s in batch]
        buf.mark_trained(s.sample_id for s in batch)
        if step == crash_at:
            return commit, dropped  # the step trained in memory but never committed
        commit = {"buffer": json.loads(json.dumps(buf.state_dict())), "cursor": cursor, "trained": list(trained)}
    return commit, dropped


def test_crash_and_resume_trains_every_sample_exactly_once():
    clean, dropped_clean = _run(range(0, 12), None, None)
    before_crash, dropped_a = _run(range(0, 12), None, crash_at=5)  # commits after steps 0..4, crash in step 5
    resumed, dropped_b = _run(range(5, 12), before_crash, None)
    for final, dropped in [(clean, dropped_clean), (resumed, dropped_a + dropped_b)]:
        trained = final["trained"]
        assert len(trained) == len(set(trained)), "a sample was trained twice"
        buffered = [p["sample_id"] for p in final["buffer"]["partials"]]
        issued = {f"s{i}" for i in range(final["cursor"])}
        dropped_set = set(dropped) - set(trained)  # a crashed step's drop is replayed after the restore
        assert set(trained) | set(buffered) | dropped_set == issued, "a sample was lost"
        assert not (set(trained) & set(buffered))
    assert clean["trained"] == resumed["trained"] and clean["cursor"] == resumed["cursor"] == len(LENGTHS)
    assert before_crash["cursor"] < len(LENGTHS)  # the crash really happened mid-run
    assert {"s6", "s12", "s21"} <= set(dropped_clean)  # the 30-, 25- and 40-token samples went stale


# -- collect_batch against an engine double --------------------------------------------------------------------------

class TinyEngine:
    """Test double of the engine: request i emits LENGTH[i] tokens, one per `token_s`; abort → partial output."""

    def __init__(self, lengths: list[int], token_s: float = 0.002, deaf: set[int] = frozenset(), fail: int = -1):
        self.lengths, self.token_s, self.deaf, self.fail = lengths, token_s, deaf, fail
        self.abort = asyncio.Event()
        self.abort_calls = 0

    async def submit(self, i: int) -> GenResult:
        ids: list[int] = []
        for t in range(self.lengths[i]):
            if self.abort.is_set() and i not in self.deaf:
                return GenResult(ids, [-0.5] * len(ids), "abort")
            if i == self.fail and t == 1:
                raise ConnectionError(f"request {i} lost")
            await asyncio.sleep(self.token_s)
            ids.append(10 + t)
        return GenResult(ids, [-0.5] * len(ids), "stop")

    async def abort_all(self) -> None:
        self.abort_calls += 1
        self.abort.set()


TAIL = [2, 3, 4, 5, 6, 8, 10, 12, 500, 800, 1000, 2000]  # long-tailed: the last four would take 1-4 s


def test_collect_batch_stops_at_target_and_keeps_partials():
    eng = TinyEngine(TAIL)
    t0 = time.monotonic()
    finished, partials = asyncio.run(collect_batch(eng.submit, eng.abort_all, batch_target=8, n_requests=12))
    assert time.monotonic() - t0 < 1.0  # did not wait for the tail (the shortest straggler needs ~1 s)
    assert sorted(i for i, _ in finished) == list(range(8)) and eng.abort_calls == 1
    assert all(r.output_ids == [10 + t for t in range(TAIL[i])] for i, r in finished)
    assert [i for i, _ in partials] == [8, 9, 10, 11]
    for i, r in partials:
        assert r.finish_reason == "abort" and 0 < len(r.output_ids) < TAIL[i]
        assert r.output_ids == [10 + t for t in range(len(r.output_ids))]  # the prefix generated so far


def test_collect_batch_without_abort_when_target_needs_everything():
    eng = TinyEngine([3, 1, 2])
    finished, partials = asyncio.run(collect_batch(eng.submit, eng.abort_all, batch_target=5, n_requests=3))
    assert [i for i, _ in finished] == [1, 2, 0] and partials == [] and eng.abort_calls == 0  # completion order


def test_collect_batch_cancels_a_request_that_ignores_the_abort():
    eng = TinyEngine([1, 2, 5000], deaf={2})
    t0 = time.monotonic()
    finished, partials = asyncio.run(collect_batch(eng.submit, eng.abort_all, 2, 3, abort_timeout_s=0.2))
    assert time.monotonic() - t0 < 1.0 and len(finished) == 2
    assert partials == [(2, GenResult([], [], "abort"))]  # kept as a partial with no new tokens: not lost


def test_collect_batch_aborts_the_rest_and_raises_on_a_failed_request():
    eng = TinyEngine([1000, 1000, 1000, 1000], fail=2)

    async def run():
        with pytest.raises(ConnectionError, match="request 2 lost"):
            await collect_batch(eng.submit, eng.abort_all, 2, 4)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == [] and eng.abort_calls == 1  # nothing left running
