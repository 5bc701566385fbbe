"""alloy.detached.http_json against a real loopback HTTP server: Prefect's 503 ("retry me": SQLite busy) is retried,
every other error is raised at once, and a server that keeps answering 503 ends in that 503."""
from __future__ import annotations

import json
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from alloy.detached import http_json


def serve(answers: list[tuple[int, dict, dict | None]]):
    """A server that answers its requests with `answers` in order (status, headers, JSON body), the last one for
    good; it records (method, path, body) of each request."""
    seen: list[tuple[str, str, object]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            seen.append((self.command, self.path, json.loads(self.rfile.read(n)) if n else None))
            status, headers, body = answers[min(len(seen), len(answers)) - 1]
            raw = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def test_503_is_retried_until_the_answer_and_the_body_is_sent_each_time():
    srv, url, seen = serve([(503, {}, {"exception_message": "Service Unavailable"})] * 2 + [(200, {}, [{"id": "a"}])])
    try:
        assert http_json(url + "/flow_runs/filter", {"limit": 5}, retry_s=(0.01, 0.01, 0.01)) == [{"id": "a"}]
    finally:
        srv.shutdown()
    assert seen == [("POST", "/flow_runs/filter", {"limit": 5})] * 3


def test_empty_answer_is_none_and_get_and_patch_are_the_methods_used():
    srv, url, seen = serve([(204, {}, None)])
    try:
        assert http_json(url + "/deployments/d", {"parameters": {}}, "PATCH") is None
        assert http_json(url + "/health") is None
    finally:
        srv.shutdown()
    assert [(m, p) for m, p, _ in seen] == [("PATCH", "/deployments/d"), ("GET", "/health")]


def test_other_errors_are_raised_at_once_and_a_lasting_503_in_the_end():
    srv, url, seen = serve([(500, {}, {"exception_message": "Internal Server Error"})])
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(url + "/x", {}, retry_s=(0.01, 0.01))
        assert err.value.code == 500 and len(seen) == 1
    finally:
        srv.shutdown()
    srv, url, seen = serve([(503, {"Retry-After": "0.02"}, {"exception_message": "Service Unavailable"})])
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(url + "/x", {}, retry_s=(0.01, 0.01))
        assert err.value.code == 503 and len(seen) == 3  # the first try and two retries
    finally:
        srv.shutdown()
