"""The one way to start and health-check engine servers, and the CLI's one HTTP helper, against stub loopback servers
(no engine starts: tests/integration/test_launcher.py and tests/e2e/test_teachers_cli.py run real ones):

- `engine.launcher.wait_healthy` reports each server that did not answer /health (timed out, or what `failed` said)
  and follows a server that `failed` moved to a new address;
- `ServerSpec.for_engine` / `Supervisor.for_engine` take bind address, key, backend and thread count from the
  config's `engine` section, restarts and health timeout from a `teachers`-like section;
- `alloy.detached.http_request` sends a JSON body and the bearer key, and names the URL in its errors.
"""
from __future__ import annotations

import functools
import threading
import urllib.error
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from alloy.detached import http_get, http_request
from engine.launcher import ServerSpec, Supervisor, free_port, wait_healthy
from infra.config import load_config

pytestmark = pytest.mark.unit


class QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_health(folder):
    """A loopback file server whose /health is a file in `folder`: it answers 200 (and 404 to everything else)."""
    (folder / "health").write_text("true")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietFiles, directory=str(folder)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def nothing_listens() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_wait_healthy_names_each_server_that_did_not_come_up(tmp_path):
    srv, url = serve_health(tmp_path)
    silent = nothing_listens()
    try:
        down = wait_healthy({"up": url, "silent": silent, "dead": url}, 0.5, "key",
                            failed=lambda n: "the process exited" if n == "dead" else None)
    finally:
        srv.shutdown()
    assert down == {"silent": f"not healthy at {silent} after 0s", "dead": "the process exited"}


def test_wait_healthy_follows_a_server_moved_to_a_new_address(tmp_path):
    srv, url = serve_health(tmp_path)
    urls = {"moved": nothing_listens()}
    moves = []

    def failed(name: str) -> None:
        if not moves:  # as the Supervisor does after relaunching on another port
            moves.append(urls[name])
            urls[name] = url

    try:
        assert wait_healthy(urls, 5.0, failed=failed) == {}
    finally:
        srv.shutdown()


def test_specs_and_supervisors_come_from_the_config_sections(tmp_path):
    cfg = load_config("configs/smoke.yaml", ["engine.host=0.0.0.0", "engine.threads=2"])
    spec = ServerSpec.for_engine("judge", tmp_path / "ckpt", cfg.engine)
    assert (spec.name, spec.model_path, spec.host, spec.api_key) == ("judge", str(tmp_path / "ckpt"), "0.0.0.0", None)
    assert spec.backend == "embedded" and spec.env == {}
    sup = Supervisor.for_engine(tmp_path / "logs", cfg.engine, SimpleNamespace(max_restarts=1, health_timeout_s=9.0))
    plain = Supervisor.for_engine(tmp_path / "logs", cfg.engine)
    try:
        assert (sup.threads_per_server, sup.max_restarts, sup.health_timeout) == (2, 1, 9.0)
        assert (plain.max_restarts, plain.health_timeout) == (3, 180.0)  # the Supervisor's defaults
    finally:
        sup.stop()
        plain.stop()


def test_http_request_sends_the_key_and_its_errors_name_the_url(tmp_path, monkeypatch):
    srv, url = serve_health(tmp_path)
    try:
        assert http_request(url + "/health") == (200, b"true")
        with pytest.raises(urllib.error.HTTPError, match=f"HTTP Error 404: .*\\(GET {url}/nothing\\)") as err:
            http_request(url + "/nothing")
        assert err.value.code == 404 and http_get(url + "/nothing")[0] == 404  # http_get returns an error status
    finally:
        srv.shutdown()
    dead = nothing_listens() + "/health"
    with pytest.raises(ConnectionError, match=f"^{dead}: no answer within 2 s"):
        http_request(dead, timeout=2.0)
    assert http_get(dead) == (0, b"")

    sent = []

    def no_network(req, timeout):
        sent.append(req)
        raise OSError("no network here")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(ConnectionError, match="no network here"):
        http_request(url + "/x", {"a": 1}, api_key="secret")
    assert sent[0].get_method() == "POST" and sent[0].data == b'{"a": 1}'
    assert sent[0].get_header("Authorization") == "Bearer secret"
