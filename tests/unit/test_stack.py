"""The process plumbing under `alloy up/down` and `alloy teachers`: detached spawn, pid identity, tree stop, ports."""
from __future__ import annotations

import socket
import sys
import time

import psutil
import pytest

from alloy.detached import StackError, is_alive, pick_port, read_state, spawn, stop_entries, write_state

pytestmark = pytest.mark.unit

# A parent that starts a child in its *own* session (like a flow run a worker starts), then both sleep.
TREE = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); time.sleep(60)")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_entries_kills_the_group_and_descendants_in_other_sessions(tmp_path):
    entry = spawn("tree", [sys.executable, "-c", TREE], tmp_path / "tree.log", env=None, cwd=tmp_path)
    p = psutil.Process(entry["pid"])
    deadline = time.monotonic() + 10
    while not p.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = p.children()
    assert child.pid != p.pid and psutil.Process(child.pid).as_dict(["pid"])  # running
    assert is_alive(entry)
    assert stop_entries([entry], grace_s=3.0) == sorted([p.pid, child.pid])
    assert _gone(p.pid) and _gone(child.pid)
    assert not is_alive(entry)
    assert stop_entries([entry]) == []  # idempotent: nothing left to signal


def test_a_recycled_pid_is_never_ours(tmp_path):
    """Same pid, another start time (the pid was reused): not alive, and stop_entries leaves it alone."""
    entry = spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log", None, tmp_path)
    impostor = {**entry, "create_time": entry["create_time"] - 1000.0}
    assert not is_alive(impostor)
    assert stop_entries([impostor], grace_s=0.5) == []
    assert is_alive(entry)
    stop_entries([entry], grace_s=3.0)
    assert not is_alive(entry)


def test_pick_port_names_the_component_of_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError, match=rf"port {port} \(mlflow, --mlflow-port\) is already in use"):
            pick_port(port, "mlflow, --mlflow-port")
    assert pick_port(port, "mlflow") == port  # free again once closed
    assert 0 < pick_port(0, "x") < 65536


def test_state_file_roundtrip_and_bad_json(tmp_path):
    path = tmp_path / "stack.json"
    assert read_state(path) is None
    write_state(path, {"components": {"a": {"pid": 1}}})
    assert read_state(path) == {"components": {"a": {"pid": 1}}}
    path.write_text("{oops")
    with pytest.raises(StackError, match="stack.json is not valid JSON"):
        read_state(path)


def test_pinned_fastapi_treats_an_explicit_null_optional_body_field_as_missing():
    """What a stock `prefect server start` needs from the pinned FastAPI (pyproject.toml: >=0.139,<0.151): Prefect
    3.8.8's client sends optional body fields as explicit nulls (`prefect deploy` reads a pool's workers with
    `{"limit": null, "offset": null}`), the server declares them `limit: int = Body(None)`; FastAPI 0.151+ validates
    the null against `int` and answers 422. Required fields still reject null."""
    from fastapi import Body, FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.post("/filter")
    def filter_(limit: int = Body(200), offset: int = Body(0), name: str = Body(...)):
        return {"limit": limit, "offset": offset, "name": name}

    c = TestClient(app)
    r = c.post("/filter", json={"limit": None, "offset": None, "name": "w"})
    assert r.status_code == 200, f"this FastAPI rejects explicit nulls, so `prefect deploy` fails: {r.text[:300]}"
    assert r.json() == {"limit": 200, "offset": 0, "name": "w"}
    assert c.post("/filter", json={"limit": 5, "name": "w"}).json() == {"limit": 5, "offset": 0, "name": "w"}
    assert c.post("/filter", json={"limit": 5, "name": None}).status_code == 422
