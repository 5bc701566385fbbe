"""The embedded engine server's hardening, against a real server process on loopback spoken to with raw sockets:
a half-sent request is dropped after `--read-timeout-s` (headers: the connection closes, that long after it opened or
its previous response; body: 408, then closes) while a response that takes longer than that is not cut; a body over the limit is 413 with SGLang's error body (whether
it announces its length or not); the default limit is the one derived from --max-total-tokens; binding a non-loopback
address without an API key logs a WARNING naming the address and the fix; an answer over --max-logprob-entries
(log-prob, id) entries is 400 naming the limit and the numbers; /update_weights_from_buffer reads only regular files
inside --weight-buffer-dir (a FIFO or a path outside is 400 at once, and no error quotes a file's bytes)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_proc import EngineProc, http, json_body
from engine.launcher import log_tail
from engine.server import body_limit_bytes, is_loopback

pytestmark = pytest.mark.integration

TIMEOUT_S = 0.5  # the server's --read-timeout-s in these tests (short: a long response must outlast it)
LIMIT_MB = 0.5
MAX_ENTRIES = 1000  # the server's --max-logprob-entries in these tests
SECRET = b"SECRET-CONTENT-0123456789"  # bytes of files the server must never quote


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    buffers = tmp_path_factory.mktemp("buffers")
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("hardening") / "server.log",
                     "--read-timeout-s", str(TIMEOUT_S), "--max-body-mb", str(LIMIT_MB),
                     "--max-logprob-entries", str(MAX_ENTRIES), "--weight-buffer-dir", str(buffers)).start()
    srv.buffer_dir = buffers
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


def read_one_response(s: socket.socket) -> tuple[int, bytes]:
    """One response (with a Content-Length) off a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, body
        body += chunk
    assert len(body) == length, (head, body)
    return int(head.split(b" ", 2)[1]), body


def test_the_header_deadline_restarts_after_each_response(server):
    """On a keep-alive connection the deadline counts from the previous response: requests spaced by less than the
    timeout keep it open past the timeout, and half-sent headers after a response are dropped that long after it."""
    with connect(server) as s:
        for _ in range(3):
            time.sleep(TIMEOUT_S * 0.6)  # idle, for less than the timeout (1.8 timeouts in all)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_one_response(s)[0] == 200
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0")  # ...and stall
        data, closed = read_until_closed(s)
    assert data == b"", data
    assert TIMEOUT_S * 0.8 <= closed - t0 < TIMEOUT_S + 5, closed - t0


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


# -- bounded answers: --max-logprob-entries ---------------------------------------------------------------------------
def post(server, body: dict) -> tuple[int, dict]:
    status, payload = http(server.url, "/generate", json.dumps(body).encode())
    return status, json_body(payload)


def scoring_body(top: int, n_ids: int, prompt: int = 10, new: int = 10) -> dict:
    """prompt + new positions (input log-probs from 0, `new` generated tokens) × (1 + top + n_ids) entries."""
    return {"input_ids": [1] + [5 + i % 50 for i in range(prompt - 1)], "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": top, "token_ids_logprob": list(range(10, 10 + n_ids)),
            "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0.0}}


def test_an_answer_over_the_logprob_cap_is_400_naming_it(server):
    # 20 positions × (1 + 41 + 9) = 1020 > 1000
    status, out = post(server, scoring_body(top=41, n_ids=9))
    msg = out["error"]["message"]
    assert status == 400 and f"max_logprob_entries {MAX_ENTRIES}" in msg and "20 × (1 + 41 + 9) = 1020" in msg, out
    assert "positions × (1 + top_logprobs_num + len(token_ids_logprob))" in msg
    # a batch is summed over its sequences (n = 2 doubles it): 2 × 20 × (1 + 20 + 9) = 1200
    body = {**scoring_body(top=20, n_ids=9), "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "n": 2}}
    status, out = post(server, body)
    assert status == 400 and "= 1200" in out["error"]["message"] and str(MAX_ENTRIES) in out["error"]["message"], out
    assert http(server.url, "/health", method="GET")[0] == 200


@pytest.mark.parametrize("top,n_ids", [(40, 8), (40, 9)])  # 20 × 49 = 980 just under; 20 × 50 = 1000, at the cap
def test_an_answer_at_or_under_the_logprob_cap_is_served(server, top, n_ids):
    status, out = post(server, scoring_body(top=top, n_ids=n_ids))
    assert status == 200, out
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == 10 and len(meta["output_token_logprobs"]) == 10
    assert all(len(e) == top for e in meta["output_top_logprobs"]) and len(meta["input_top_logprobs"]) == 10
    assert all(len(e) == n_ids for e in meta["output_token_ids_logprobs"])
    # without return_logprob nothing is counted (no log-probs come back)
    status, out = post(server, {**scoring_body(top=100, n_ids=50), "return_logprob": False})
    assert status == 200 and "output_top_logprobs" not in out["meta_info"], out


@pytest.mark.parametrize("top", [-1, 101, 10**9])  # the tiny model's vocabulary has 100 ids
def test_top_logprobs_num_outside_the_vocabulary_is_400(server, top):
    status, out = post(server, scoring_body(top=top, n_ids=0, new=1))
    assert status == 400 and "top_logprobs_num" in out["error"]["message"] and "[0, 100]" in out["error"]["message"]


# -- /update_weights_from_buffer reads regular files inside --weight-buffer-dir only ----------------------------------
def update_from(server, path) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, payload = http(server.url, "/update_weights_from_buffer", json.dumps({"path": str(path)}).encode(),
                           timeout=30)
    return status, json_body(payload), time.monotonic() - t0


def message(out: dict) -> str:
    return out["error"]["message"] if "error" in out else out["message"]


def test_weight_buffer_paths_outside_the_dir_or_not_regular_are_400_at_once(server, tmp_path):
    bdir = server.buffer_dir
    outside = tmp_path / "secret.wbuf"
    outside.write_bytes(SECRET * 4)
    fifo = bdir / "pipe.wbuf"
    os.mkfifo(fifo)
    (bdir / "leak.wbuf").symlink_to(outside)  # inside the dir, pointing out of it
    (bdir / "sub").mkdir()
    cases = [(outside, "outside"), (bdir / "leak.wbuf", "outside"), (bdir / ".." / outside.name, "outside"),
             ("/etc/passwd", "outside"), (fifo, "a FIFO"), (bdir / "sub", "a directory")]
    try:
        for path, why in cases:
            status, out, took = update_from(server, path)
            assert status == 400 and why in message(out) and "--weight-buffer-dir" in message(out), (path, out)
            assert os.path.realpath(bdir) in message(out), out  # the rule names the allowed directory
            assert SECRET.decode()[:6] not in json.dumps(out), out
            assert took < 5, (path, took)  # answered at once: no thread waits on a FIFO's writer
        # a regular file inside the dir that is not a weight buffer: refused without quoting a byte of it
        (bdir / "junk.wbuf").write_bytes(SECRET * 4)
        status, out, _ = update_from(server, bdir / "junk.wbuf")
        assert status == 400 and out["success"] is False and "bad magic" in out["message"], out
        assert SECRET.decode()[:6] not in json.dumps(out) and "SECR" not in out["message"], out
        assert http(server.url, "/health", method="GET")[0] == 200
    finally:
        fifo.unlink()


def test_weight_buffers_inside_the_dir_still_load(server, model):
    from engine.weight_buffer import write_buffer

    buf = server.buffer_dir / "w.wbuf"
    write_buffer(buf, model.state_dict(), "inside")
    (server.buffer_dir / "link.wbuf").symlink_to(buf)  # a symlink that stays inside the dir is fine
    for path, version in ((buf, "inside"), (server.buffer_dir / "link.wbuf", "inside")):
        status, out, _ = update_from(server, path)
        assert status == 200 and out["success"] is True, out
        info = json_body(http(server.url, "/get_model_info", method="GET")[1])
        assert info["weight_version"] == version


def test_read_buffer_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    from engine.weight_buffer import WeightBufferError, read_buffer

    fifo = tmp_path / "p.wbuf"
    os.mkfifo(fifo)
    got: list = []

    def read():
        try:
            read_buffer(fifo)
        except WeightBufferError as e:
            got.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the hung open so the test process can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("read_buffer blocked on a FIFO")
    assert got and "not a regular file" in got[0], got
