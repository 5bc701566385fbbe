"""Storage under faults, against a real moto S3 server on loopback (tests/s3_fixtures.py) and local disk.

Complements tests/integration/test_storage.py (a flaky fsspec backend, an S3 outage by stopping the server, a crash
raised from the progress hook, every kind of invalid manifest). Here the faults come from outside the process:

- a fault-injecting HTTP proxy in front of moto answers some requests with S3 503 SlowDown / 500 InternalError, or
  drops the connection without a response; botocore's and s3fs' own retries are switched off, so what rides the
  faults out is `infra.storage`'s RetryPolicy alone (and a permanent 403 is not retried);
- a saver process is SIGKILLed halfway through a checkpoint (no exception, no `finally`): the half-written
  checkpoint never becomes visible, on S3 and on local disk, also when the kill hits a re-save over an existing one;
- a trainer-style resume (`latest_complete` → `load_checkpoint`) past a newest checkpoint whose bytes were corrupted
  at the same size.
"""
from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from infra.storage import (MANIFEST, CheckpointError, RetryPolicy, checkpoint_name, get_fs, join, latest_complete,
                           load_latest,
                           list_checkpoints, load_checkpoint, save_checkpoint, to_local, verify_checkpoint)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OURS = RetryPolicy(attempts=4, base_s=0.01, max_s=0.05)
FILES = {"config.json": b'{"hidden_size": 64}', "model.safetensors": bytes(range(256)) * 40,
         "trainer.json": b'{"step": 0}', "april/buffer.jsonl": b'{"rid": 1}\n' * 3}


def make_src(root: Path, tag: bytes = b"") -> Path:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data + tag)
    return root


# --------------------------------------------------------------------------------------------- the faulty proxy


class FaultyProxy:
    """A plain HTTP/1.1 reverse proxy on 127.0.0.1 in front of an S3 endpoint, injecting faults on chosen requests.

    `plan(method, path, n)` → None (forward) or a fault: "503" (S3 SlowDown), "500" (InternalError), "403"
    (AccessDenied, permanent), "drop" (close the connection without a response). `n` counts earlier requests with the
    same method and path, so "fail the first attempt of every request" is `lambda m, p, n: "503" if n == 0 else None`.
    """

    XML = {"503": (503, "SlowDown", "Please reduce your request rate."),
           "500": (500, "InternalError", "We encountered an internal error. Please try again."),
           "403": (403, "AccessDenied", "Access Denied")}

    def __init__(self, upstream: str, plan):
        self.upstream = upstream.split("://", 1)[1]
        self.plan, self.seen, self.faults = plan, {}, []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = (self.command, self.path.split("?")[0])
                with proxy.lock:
                    n = proxy.seen[key] = proxy.seen.get(key, -1) + 1
                    fault = proxy.plan(self.command, self.path, n)
                    if fault:
                        proxy.faults.append((self.command, self.path, fault))
                if fault == "drop":  # the client sees its connection die mid-request
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fault:
                    status, code, msg = proxy.XML[fault]
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{msg}"
                           f"</Message><RequestId>fault</RequestId></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                    return
                up = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    resp = up.getresponse()
                    data = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", resp.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    up.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def only_ours(endpoint: str) -> dict:
    """s3fs options that turn off botocore's retries (the `no_s3fs_retries` fixture turns off s3fs' own loop):
    every retry left is infra.storage's."""
    return {"endpoint_url": endpoint, "config_kwargs": {"retries": {"total_max_attempts": 1}},
            "skip_instance_cache": True}


def retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "alloy.storage" and " retry " in r.getMessage()]


@pytest.fixture
def bucket(moto_server, s3_env) -> str:
    return moto_server.create_bucket()


@pytest.fixture
def no_s3fs_retries(monkeypatch):
    """s3fs retries throttling and dropped connections itself (class attribute `retries`, 5 attempts), which would
    hide whether infra.storage's policy works; one attempt each leaves the retrying to us."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


def test_s3_errors_and_dropped_connections_are_retried_by_our_policy(bucket, s3_env, no_s3fs_retries, tmp_path,
                                                                    caplog):
    """Every distinct request fails at first (503 SlowDown, 500 InternalError or a dropped connection, in turn);
    the save, the scan and the download all complete, each fault shows as one of our retry warnings, and the bytes
    are intact."""
    kinds, chosen = ["503", "500", "drop"], {}

    def first_attempt_fails(method, path, n):
        # a drop hits the first TWO attempts: aiohttp silently re-sends once when a pooled keep-alive connection
        # turns out dead, which is legitimate transport behaviour, not a retry policy
        kind = chosen.setdefault((method, path), kinds[len(chosen) % 3])
        return kind if n < (2 if kind == "drop" else 1) else None

    proxy = FaultyProxy(s3_env, first_attempt_fails)
    try:
        opts = only_ours(proxy.url)
        prefix = f"s3://{bucket}/run/ckpts"
        caplog.set_level(logging.WARNING, logger="alloy.storage")
        url = save_checkpoint(make_src(tmp_path / "src"), join(prefix, checkpoint_name(3)), step=3,
                              storage_options=opts, retry=OURS)
        assert latest_complete(prefix, storage_options=opts, retry=OURS) == url
        m = load_checkpoint(url, tmp_path / "out", storage_options=opts, retry=OURS)
        assert m["step"] == 3 and all((tmp_path / "out" / rel).read_bytes() == data for rel, data in FILES.items())
        ops = {(m, p): f for m, p, f in proxy.faults}  # every request of the save/scan/load failed at first
        assert set(ops.values()) == {"503", "500", "drop"} and len(ops) >= 10, proxy.faults
        warnings = retry_warnings(caplog)
        # each 503/500 reached our policy exactly once, each dropped request at least once (at most twice)
        assert len(ops) <= len(warnings) <= len(proxy.faults), (warnings, proxy.faults)

        def count(*needles):
            return sum(any(x in w for x in needles) for w in warnings)

        assert count("reduce your request rate", "Service Unavailable") == list(ops.values()).count("503")
        assert count("internal error") == list(ops.values()).count("500")
        assert count("ConnectionClosedError") >= list(ops.values()).count("drop")
        assert any(w.startswith("upload ") for w in warnings) and any(w.startswith("download ") for w in warnings)
    finally:
        proxy.close()
    assert verify_checkpoint(url, deep=True) == (True, "ok")  # straight to moto, no proxy: the bytes are right


def test_s3_faults_on_every_attempt_give_up_after_the_policy_and_leave_nothing_visible(bucket, s3_env, no_s3fs_retries,
                                                                                       tmp_path, caplog):
    """An upload that fails on every attempt: exactly `attempts` tries, then the error; no checkpoint appears.
    A permanent error (403 AccessDenied) is not retried at all."""
    prefix = f"s3://{bucket}/ck"
    good = save_checkpoint(make_src(tmp_path / "src"), join(prefix, checkpoint_name(1)), step=1)

    def weights_always_503(method, path, n):
        return "503" if method == "PUT" and path.endswith("/model.safetensors") else None

    proxy = FaultyProxy(s3_env, weights_always_503)
    try:
        with pytest.raises(OSError):
            save_checkpoint(tmp_path / "src", join(prefix, checkpoint_name(2)), step=2,
                            storage_options=only_ours(proxy.url), retry=OURS)
        assert [f for f in proxy.faults if f[1].endswith("model.safetensors")] == \
            [("PUT", f"/{bucket}/ck/step-00000002/model.safetensors", "503")] * OURS.attempts
    finally:
        proxy.close()
    caplog.set_level(logging.WARNING, logger="alloy.storage")
    assert latest_complete(prefix) == good
    assert any("step-00000002" in m and "no COMPLETE manifest" in m for m in caplog.messages)

    proxy = FaultyProxy(s3_env, lambda m, p, n: "403" if m == "PUT" else None)
    try:
        with pytest.raises(PermissionError):
            save_checkpoint(tmp_path / "src", join(prefix, checkpoint_name(3)), step=3,
                            storage_options=only_ours(proxy.url), retry=OURS)
        assert len(proxy.faults) == 1  # one PUT, refused, not repeated
    finally:
        proxy.close()
    assert latest_complete(prefix) == good


# --------------------------------------------------------------------------------------------- SIGKILL mid-save

SAVER = textwrap.dedent("""
    import sys, time
    from infra.storage import save_checkpoint
    src, dest, step = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def hang_halfway(rel, i, n):
        if i == n // 2:
            print("HALF", rel, flush=True)
            time.sleep(600)  # the parent SIGKILLs us here

    save_checkpoint(src, dest, step, on_file=hang_halfway)
    print("DONE", flush=True)
""")


def kill_saver_halfway(src: Path, dest: str, step: int) -> str:
    """Run a saver process, SIGKILL it once half the files are stored; returns the file it had just stored."""
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(src), dest, str(step)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert line.startswith("HALF"), proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return line.split()[1]


@pytest.fixture(params=["file", "s3"])
def prefix(request, tmp_path):
    if request.param == "file":
        return "file://" + str(tmp_path / "store")
    return f"s3://{request.getfixturevalue('bucket')}/ckpts"


def test_sigkill_mid_save_never_leaves_a_visible_checkpoint(prefix, tmp_path, caplog):
    """A new checkpoint killed halfway: invisible; the next save of the same step commits over the debris."""
    src = make_src(tmp_path / "src")
    prev = save_checkpoint(src, join(prefix, checkpoint_name(1)), step=1)
    dest = join(prefix, checkpoint_name(2))
    kill_saver_halfway(src, dest, 2)
    caplog.set_level(logging.WARNING, logger="alloy.storage")
    assert latest_complete(prefix) == prev
    assert verify_checkpoint(dest)[0] is False
    if prefix.startswith("s3://"):  # the partial upload is there, without a manifest: skipped with a warning
        (partial,) = [c for c in list_checkpoints(prefix) if not c.complete]
        assert partial.name == "step-00000002" and "no COMPLETE manifest" in partial.reason
        assert any("skipping checkpoint" in m and "step-00000002" in m for m in caplog.messages)
    else:  # only a hidden staging dir is left, which no reader looks at
        names = sorted(p.name for p in Path(to_local(prefix)).iterdir())
        assert len(names) == 2 and names[0].startswith(".tmp-step-00000002-") and names[1] == "step-00000001"
        assert [c.name for c in list_checkpoints(prefix)] == ["step-00000001"]
    assert save_checkpoint(src, dest, step=2) == dest
    assert latest_complete(prefix, deep=True) == dest
    if prefix.startswith("file://"):  # and the killed saver's staging dir is gone with that commit
        assert sorted(p.name for p in Path(to_local(prefix)).iterdir()) == ["step-00000001", "step-00000002"]


def test_sigkill_mid_resave_never_mixes_old_and_new_files(prefix, tmp_path):
    """Re-saving an existing step (a retried stage) killed halfway: never a mix of old and new bytes under one
    manifest. Local disk keeps the old checkpoint whole (rename); S3 un-commits it first, so readers fall back."""
    old_src, new_src = make_src(tmp_path / "old"), make_src(tmp_path / "new", tag=b"#new")
    first = save_checkpoint(old_src, join(prefix, checkpoint_name(1)), step=1)
    dest = save_checkpoint(old_src, join(prefix, checkpoint_name(2)), step=2)
    kill_saver_halfway(new_src, dest, 2)
    if prefix.startswith("file://"):
        assert latest_complete(prefix, deep=True) == dest
        load_checkpoint(dest, tmp_path / "got")
        assert all((tmp_path / "got" / rel).read_bytes() == data for rel, data in FILES.items())  # all old
    else:
        assert latest_complete(prefix, deep=True) == first
        assert verify_checkpoint(dest) == (False, "no COMPLETE manifest (incomplete, crashed or in-progress save)")


# --------------------------------------------------------------------------------------------- resume past corruption


def test_wrong_manifest_is_skipped_and_the_previous_checkpoint_used(prefix, tmp_path, caplog):
    """The newest checkpoint's manifest is missing, or lists a size its file does not have: a resume's
    `latest_complete` skips it with a warning naming it and takes the previous one, which loads."""
    src = make_src(tmp_path / "src")
    for step in (1, 2, 3):
        save_checkpoint(src, join(prefix, checkpoint_name(step)), step=step)
    fs, root = get_fs(prefix)
    fs.rm_file(f"{root}/step-00000003/{MANIFEST}")
    m = json.loads(fs.cat_file(f"{root}/step-00000002/{MANIFEST}"))
    m["files"]["trainer.json"]["size"] += 1
    fs.pipe_file(f"{root}/step-00000002/{MANIFEST}", json.dumps(m).encode())
    caplog.set_level(logging.WARNING, logger="alloy.storage")
    url = latest_complete(prefix)
    assert url == join(prefix, checkpoint_name(1))
    assert load_checkpoint(url, tmp_path / "r")["step"] == 1
    skipped = {m.split()[2].rstrip(":").rsplit("/", 1)[-1]: m for m in caplog.messages if "skipping checkpoint" in m}
    assert set(skipped) == {"step-00000002", "step-00000003"}
    assert "'trainer.json' has 11 bytes, manifest says 12" in skipped["step-00000002"]


def test_resume_falls_back_past_a_checkpoint_with_corrupt_bytes(tmp_path):
    """DistillTrainer.resume / SpecialistTrainer.resume (`load_latest`) on a same-size corruption of the newest."""
    prefix = "file://" + str(tmp_path / "store")
    src = make_src(tmp_path / "src")
    for step in (1, 2):
        save_checkpoint(src, join(prefix, checkpoint_name(step)), step=step)
    weights = Path(to_local(prefix), "step-00000002", "model.safetensors")
    weights.write_bytes(bytes(reversed(weights.read_bytes())))  # bit rot: same size, wrong bytes
    assert latest_complete(prefix).endswith("step-00000002")  # sizes match: the cheap check cannot tell
    url = load_latest(prefix, tmp_path / "resume")  # the trainers' call: verifies while loading, falls back
    assert url == join(prefix, checkpoint_name(1))
    assert (tmp_path / "resume" / "model.safetensors").read_bytes() == Path(src, "model.safetensors").read_bytes()
