"""The embedded engine server's hardening, against a real server process on loopback spoken to with raw sockets:
a half-sent request is dropped after `--read-timeout-s` (headers: the connection closes; body: 408, then closes) while
a response that takes longer than that is not cut; a body over the limit is 413 with SGLang's error body (whether
it announces its length or not); the default limit is the one derived from --max-total-tokens; binding a non-loopback
address without an API key logs a WARNING naming the address and the fix."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_proc import EngineProc, http, json_body
from engine.launcher import log_tail
from engine.server import body_limit_bytes, is_loopback

pytestmark = pytest.mark.integration

TIMEOUT_S = 0.5  # the server's --read-timeout-s in these tests (short: a long response must outlast it)
LIMIT_MB = 0.5


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("hardening") / "server.log",
                     "--read-timeout-s", str(TIMEOUT_S), "--max-body-mb", str(LIMIT_MB)).start()
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10 * TIMEOUT_S + 5)
    return s


def read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (monotonic)."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic()


def split_response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def test_half_sent_headers_are_dropped_after_the_read_timeout(server):
    with connect(server) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")  # ...and stall
        data, closed = read_until_closed(s)
    assert data == b"", data  # no request was ever complete: nothing to answer
    assert TIMEOUT_S * 0.9 <= closed - t0 < TIMEOUT_S + 5, closed - t0
    assert http(server.url, "/health", method="GET")[0] == 200  # the server itself is fine


def test_half_sent_body_gets_408_and_the_connection_is_closed(server):
    body = json.dumps({"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}).encode()
    with connect(server) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])  # headers whole, body stalls
        data, closed = read_until_closed(s)
    status, out = split_response(data)
    assert status == 408 and "--read-timeout-s" in out["error"]["message"], out
    assert TIMEOUT_S * 0.9 <= closed - t0 < TIMEOUT_S + 5, closed - t0  # dropped at once, no lingering read
    assert "body not received" in log_tail(server.log_path)


def test_a_response_longer_than_the_read_timeout_is_not_cut(server):
    """The timeout is on reading the request, never on producing the response: send more and more 256-row
    /generate requests at once (one request is capped by --max-total-tokens; requests in flight together share the
    scheduler) until one takes well over the timeout, and check every response came back whole."""
    rows = 256

    def one(k: int) -> tuple[float, int, list]:
        body = {"input_ids": [[1, 5 + (i + k) % 50, 6] for i in range(rows)],
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        t0 = time.monotonic()
        status, payload = http(server.url, "/generate", json.dumps(body).encode(), timeout=300)
        return time.monotonic() - t0, status, json_body(payload)

    seconds = 0.0
    for concurrent in (1, 2, 4, 8, 16):  # a faster machine needs more (one 256-row request took 0.82 s on a CI run)
        with ThreadPoolExecutor(concurrent) as pool:
            results = list(pool.map(one, range(concurrent)))
        for _, status, out in results:
            assert status == 200, out
            assert len(out) == rows and all(o["meta_info"]["completion_tokens"] == 200 for o in out)
        seconds = max(r[0] for r in results)  # the requests queue behind each other: the last waits longest
        if seconds > 2 * TIMEOUT_S:
            break
    assert seconds > 2 * TIMEOUT_S, f"the slowest request took only {seconds:.2f}s: the check proved nothing"


def test_oversized_bodies_are_413_with_the_error_json(server):
    raw = json.dumps({"input_ids": [1] * 300_000}).encode()  # ~900 KB > 0.5 MB
    status, payload = http(server.url, "/generate", raw)  # announces its Content-Length: refused unread
    out = json_body(payload)
    assert status == 413 and set(out) == {"error"} and "too large" in out["error"]["message"], out
    assert str(int(LIMIT_MB * 2**20)) in out["error"]["message"] and "--max-body-mb" in out["error"]["message"]
    # chunked, so no length up front: refused once the bytes read pass the limit
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for i in range(0, len(raw), 65536):
            piece = raw[i:i + 65536]
            s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        data, _ = read_until_closed(s)
    status, out = split_response(data)
    assert status == 413 and set(out) == {"error"} and "too large" in out["error"]["message"], out
    assert http(server.url, "/health", method="GET")[0] == 200


def test_default_body_limit_is_derived_from_the_protocol(tiny_model_dir, tmp_path):
    assert body_limit_bytes(65536, 4096) == 6 * 2**20  # 16 B a token + 1 KiB a sequence + 1 MiB
    assert body_limit_bytes(2 * 65536, 4096) == body_limit_bytes(65536, 4096) + 65536 * 16
    srv = EngineProc(tiny_model_dir, tmp_path / "default.log", "--max-total-tokens", "4096").start()
    try:
        srv.wait_healthy()
        limit = body_limit_bytes(4096, 4096)
        assert f"body limit {limit} bytes" in srv.log_path.read_text()
        over = b'{"input_ids": [' + b"1, " * (limit // 3) + b"1]}"
        status, payload = http(srv.url, "/generate", over)
        assert status == 413 and str(limit) in json_body(payload)["error"]["message"]
        assert "without an API key" not in srv.log_path.read_text()  # loopback without a key: nothing to warn of
    finally:
        srv.kill()


def test_non_loopback_bind_without_a_key_warns(tiny_model_dir, tmp_path):
    log_path = tmp_path / "wildcard.log"
    srv = EngineProc(tiny_model_dir, log_path, "--host", "0.0.0.0").start()
    try:
        deadline = time.monotonic() + 60
        while "WARNING" not in (log_path.read_text() if log_path.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        srv.kill()  # never leave a key-less server on the wildcard address
    text = log_path.read_text()
    warning = next((ln for ln in text.splitlines() if "WARNING" in ln), None)
    assert warning is not None, text
    assert "0.0.0.0" in warning and "without an api key" in warning.lower() and "--api-key" in warning, warning


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("", False), ("10.1.2.3", False), ("example.org", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_with_a_key_the_non_loopback_bind_does_not_warn(tiny_model_dir, tmp_path):
    log_path = tmp_path / "keyed.log"
    srv = EngineProc(tiny_model_dir, log_path, "--host", "0.0.0.0", api_key="k-123").start()
    try:
        srv.wait_healthy()  # every start-up line is in the log by now
    finally:
        srv.kill()
    text = log_path.read_text()
    assert "alloy engine server on http://0.0.0.0" in text and "without an API key" not in text, text
