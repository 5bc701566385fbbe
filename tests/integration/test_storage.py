"""Storage against real backends: local tmp dirs and a real moto S3 server on loopback (no mocks of our code).

Faults are real too: a crash is an exception raised from the save's progress hook, a transient error is either a
flaky fsspec backend that drops the first upload of every file, or the S3 server stopped and restarted mid-save.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from infra.storage import (MANIFEST, CheckpointError, RetryPolicy, checkpoint_name, get_fs, join, latest_complete,
                           list_checkpoints, load_checkpoint, prune, read_json, read_text, s3_options_from_env,
                           save_checkpoint, to_local, verify_checkpoint, write_json, write_text)
from s3_fixtures import MotoS3, moto_server, s3_bucket, s3_env  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.integration

FAST = RetryPolicy(attempts=3, base_s=0.01, max_s=0.02)
FILES = {  # a checkpoint-shaped directory: model files, trainer state, a nested rollout buffer
    "config.json": b'{"hidden_size": 64}',
    "model.safetensors": bytes(range(256)) * 40,
    "trainer_state.json": b'{"step": 0}',
    "april/buffer.jsonl": b'{"rid": 1, "tokens": [5, 6]}\n' * 3,
}


def make_src(root: Path, tag: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data + tag.encode())
    return root


@pytest.fixture(params=["file", "s3"])
def prefix(request, tmp_path):
    """A checkpoint prefix URL on each backend."""
    if request.param == "file":
        return "file://" + str(tmp_path / "store" / "ckpts")
    return join(request.getfixturevalue("s3_bucket"), "run", "ckpts")


def warned(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]


# --------------------------------------------------------------------------------------------- URLs and options


def test_join_to_local_and_get_fs(tmp_path):
    assert join("s3://b/p/", "step-1/", "x.json") == "s3://b/p/step-1/x.json"
    for bad in ("/step-1", "../x", "a/../../x", ".", "a//b", "s3://other/k", "~/x", "a\\b"):  # issue 34
        with pytest.raises(ValueError, match="storage key part"):
            join("s3://b/p", bad)
    assert join("file:///a", "b", "") == "file:///a/b"
    assert to_local("file:///tmp/a/b") == "/tmp/a/b"
    assert to_local(str(tmp_path / "x")) == str(tmp_path / "x")
    with pytest.raises(ValueError, match="not a local path"):
        to_local("s3://bucket/x")
    fs, path = get_fs("s3://bucket/some/prefix", storage_options={"endpoint_url": "http://127.0.0.1:1"})
    assert path == "bucket/some/prefix" and "s3" in fs.protocol


def test_s3_options_from_env_and_explicit_override(monkeypatch):
    env = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_ENDPOINT_URL": "http://generic:1",
           "AWS_ENDPOINT_URL_S3": "http://s3-specific:2", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert s3_options_from_env(env) == {"key": "AK", "secret": "SK", "endpoint_url": "http://s3-specific:2",
                                        "client_kwargs": {"region_name": "eu-west-1"}}
    assert s3_options_from_env({"AWS_ENDPOINT_URL": "http://generic:1"}) == {"endpoint_url": "http://generic:1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fs, _ = get_fs("s3://b/x", storage_options={"key": "AK2", "client_kwargs": {"verify": False}})
    # explicit key wins, the env's secret/endpoint stay, client_kwargs are merged (the env's region survives)
    assert (fs.key, fs.secret, fs.endpoint_url) == ("AK2", "SK", "http://s3-specific:2")
    assert fs.client_kwargs == {"region_name": "eu-west-1", "verify": False}


# --------------------------------------------------------------------------------------------- checkpoints


def test_save_latest_load_roundtrip(prefix, tmp_path):
    src = make_src(tmp_path / "src")
    assert latest_complete(prefix) is None  # prefix does not exist yet
    u10 = save_checkpoint(src, join(prefix, checkpoint_name(10)), step=10, meta={"stage": "base"})
    (src / "trainer_state.json").write_bytes(b'{"step": 20}')
    u20 = save_checkpoint(src, join(prefix, checkpoint_name(20)), step=20, meta={"stage": "base", "loss": 0.5})
    assert u20 == join(prefix, "step-00000020")
    assert latest_complete(prefix) == u20
    assert latest_complete(prefix, deep=True) == u20
    assert [(c.name, c.step, c.complete) for c in list_checkpoints(prefix)] == [
        ("step-00000010", 10, True), ("step-00000020", 20, True)]

    out = tmp_path / "loaded"
    m = load_checkpoint(u20, out)
    assert m["version"] == 1 and m["step"] == 20 and m["meta"] == {"stage": "base", "loss": 0.5}
    assert sorted(m["files"]) == sorted(FILES)
    assert m["files"]["trainer_state.json"] == {"size": 12, "sha256": hashlib.sha256(b'{"step": 20}').hexdigest()}
    for rel in FILES:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    assert not list(out.rglob("*.part")) and not (out / MANIFEST).exists()
    assert load_checkpoint(u10, tmp_path / "l10")["files"]["trainer_state.json"]["size"] == 11
    assert verify_checkpoint(u10, deep=True) == (True, "ok")


def test_plain_local_path_and_resave_replaces(tmp_path):
    src = make_src(tmp_path / "src")
    prefix = str(tmp_path / "plain")
    url = save_checkpoint(src, join(prefix, checkpoint_name(1)), step=1)
    (src / "model.safetensors").write_bytes(b"new weights")
    assert save_checkpoint(src, url, step=1) == url
    assert load_checkpoint(url, tmp_path / "out")["files"]["model.safetensors"]["size"] == len(b"new weights")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in Path(prefix).iterdir()) == ["step-00000001"]  # no staging or trash left


def test_invalid_checkpoints_are_skipped_with_a_warning(prefix, tmp_path, caplog):
    src = make_src(tmp_path / "src")
    good = save_checkpoint(src, join(prefix, checkpoint_name(1)), step=1)
    fs, root = get_fs(prefix)
    for step in (2, 3, 4, 5):
        save_checkpoint(src, join(prefix, checkpoint_name(step)), step=step)
    fs.rm_file(f"{root}/step-00000002/{MANIFEST}")  # no manifest
    fs.pipe_file(f"{root}/step-00000003/{MANIFEST}", b'{"version": 1, "step": 3, "fil')  # truncated JSON
    fs.pipe_file(f"{root}/step-00000004/model.safetensors", b"short")  # wrong size
    same_size = bytes(reversed(FILES["model.safetensors"]))  # right size, wrong bytes: only deep=True sees it
    fs.pipe_file(f"{root}/step-00000005/model.safetensors", same_size)

    caplog.set_level(logging.WARNING, logger="alloy.storage")
    assert latest_complete(prefix) == join(prefix, "step-00000005")
    assert warned(caplog, "step-00000002")[0].endswith("no COMPLETE manifest (incomplete, crashed or in-progress save)")
    assert "not valid JSON" in warned(caplog, "step-00000003")[0]
    assert "'model.safetensors' has 5 bytes, manifest says 10240" in warned(caplog, "step-00000004")[0]
    caplog.clear()
    assert latest_complete(prefix, deep=True) == good
    assert "sha256" in warned(caplog, "step-00000005")[0]
    assert verify_checkpoint(join(prefix, "step-00000004")) == (
        False, "file 'model.safetensors' has 5 bytes, manifest says 10240")
    with pytest.raises(CheckpointError, match="step-00000005: file 'model.safetensors' sha256 mismatch"):
        load_checkpoint(join(prefix, "step-00000005"), tmp_path / "bad")
    with pytest.raises(CheckpointError, match="no COMPLETE manifest"):
        load_checkpoint(join(prefix, "step-00000002"), tmp_path / "bad")


def test_manifest_missing_file_and_schema_errors(tmp_path):
    src = make_src(tmp_path / "src")
    prefix = "file://" + str(tmp_path / "ck")
    url = save_checkpoint(src, join(prefix, checkpoint_name(7)), step=7)
    Path(to_local(url), "april", "buffer.jsonl").unlink()
    assert verify_checkpoint(url) == (False, "file 'april/buffer.jsonl' listed in the manifest is missing")
    m = json.loads(Path(to_local(url), MANIFEST).read_text())
    m["files"]["../escape"] = {"size": 1, "sha256": "0" * 64}
    Path(to_local(url), MANIFEST).write_text(json.dumps(m))
    assert verify_checkpoint(url) == (False, "manifest lists an unsafe path '../escape'")
    with pytest.raises(CheckpointError, match="is not a directory"):
        save_checkpoint(tmp_path / "nope", join(prefix, "x"), step=1)
    with pytest.raises(CheckpointError, match="meta must be JSON"):
        save_checkpoint(src, join(prefix, "y"), step=1, meta={"bad": object()})


def test_crash_mid_upload_leaves_no_visible_checkpoint(prefix, tmp_path, caplog):
    src = make_src(tmp_path / "src")
    prev = save_checkpoint(src, join(prefix, checkpoint_name(1)), step=1)
    seen = []

    def crash_after_half(rel, i, n):
        seen.append(rel)
        if i == n // 2:
            raise KeyboardInterrupt("simulated kill")  # BaseException: nothing may swallow it

    dest = join(prefix, checkpoint_name(2))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(src, dest, step=2, on_file=crash_after_half)
    assert len(seen) == len(FILES) // 2
    caplog.set_level(logging.WARNING, logger="alloy.storage")
    assert latest_complete(prefix) == prev
    assert verify_checkpoint(dest)[0] is False
    if prefix.startswith("file://"):  # atomic rename: not even a partial directory, and the staging dir is gone
        assert sorted(p.name for p in Path(to_local(prefix)).iterdir()) == ["step-00000001"]
    else:  # S3: the partial upload is there but has no manifest, so it is skipped with a warning
        assert "no COMPLETE manifest" in warned(caplog, "step-00000002")[0]
    # the retried save commits over the partial one
    save_checkpoint(src, dest, step=2)
    assert latest_complete(prefix) == dest


def test_prune_keeps_the_newest_complete(prefix, tmp_path):
    src = make_src(tmp_path / "src")
    for step in range(1, 6):
        save_checkpoint(src, join(prefix, checkpoint_name(step)), step=step)
    fs, root = get_fs(prefix)
    fs.makedirs(f"{root}/step-00000006", exist_ok=True)
    fs.pipe_file(f"{root}/step-00000006/model.safetensors", b"in progress")  # another writer's save, no manifest
    deleted = prune(prefix, keep_last=2)
    assert deleted == [join(prefix, checkpoint_name(s)) for s in (1, 2, 3)]
    infos = list_checkpoints(prefix)
    assert [(c.name, c.complete) for c in infos] == [
        ("step-00000004", True), ("step-00000005", True), ("step-00000006", False)]
    assert prune(prefix, keep_last=1) == [join(prefix, checkpoint_name(4))]
    assert prune(prefix, keep_last=1) == []
    assert latest_complete(prefix) == join(prefix, checkpoint_name(5))
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune(prefix, keep_last=0)


# --------------------------------------------------------------------------------------------- transient errors


class FlakyFS(MemoryFileSystem):
    """An in-memory fsspec backend whose uploads fail `fail_first` times per path with `error` (a real fsspec
    implementation with injected faults, standing in for a network filesystem)."""
    protocol = ("flaky",)
    fail_first = 1
    error: type[BaseException] = ConnectionResetError
    calls: dict[str, int] = {}

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(path[len("flaky://"):] if path.startswith("flaky://") else path)

    def put_file(self, lpath, rpath, *args, **kwargs):
        n = FlakyFS.calls[rpath] = FlakyFS.calls.get(rpath, 0) + 1
        if n <= FlakyFS.fail_first:
            raise FlakyFS.error(f"injected fault {n} for {rpath}")
        return super().put_file(lpath, rpath, *args, **kwargs)


@pytest.fixture
def flaky(tmp_path):
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    FlakyFS.calls, FlakyFS.fail_first, FlakyFS.error = {}, 1, ConnectionResetError
    return f"flaky://{tmp_path.name}"


def test_transient_upload_errors_are_retried(flaky, tmp_path, caplog):
    src = make_src(tmp_path / "src")
    caplog.set_level(logging.WARNING, logger="alloy.storage")
    url = save_checkpoint(src, join(flaky, checkpoint_name(3)), step=3, retry=FAST)
    assert sorted(FlakyFS.calls.values()) == [2] * len(FILES)  # each file: one injected failure, one success
    assert len(warned(caplog, "ConnectionResetError")) == len(FILES)
    assert verify_checkpoint(url, deep=True) == (True, "ok")
    assert latest_complete(flaky) == url


def test_retries_are_bounded_and_permanent_errors_not_retried(flaky, tmp_path):
    src = make_src(tmp_path / "src")
    FlakyFS.fail_first = 10
    with pytest.raises(ConnectionResetError, match="injected fault 3"):
        save_checkpoint(src, join(flaky, checkpoint_name(1)), step=1, retry=FAST)
    assert max(FlakyFS.calls.values()) == FAST.attempts
    FlakyFS.calls, FlakyFS.error = {}, PermissionError
    with pytest.raises(PermissionError):
        save_checkpoint(src, join(flaky, checkpoint_name(2)), step=2, retry=FAST)
    assert list(FlakyFS.calls.values()) == [1]
    assert latest_complete(flaky) is None


def test_s3_outage_mid_save_is_ridden_out(s3_env, tmp_path, caplog):
    """Stop a real S3 server after the first file, restart it 1.5 s later: the uploads retry through the outage."""
    server = MotoS3().start()  # its own server: the outage must not hit other tests' shared one
    restart = threading.Timer(1.5, server.start)
    try:
        bucket = server.create_bucket()
        # s3fs and botocore retry too; cap them so the outage outlasts their retries and reaches ours
        opts = {"endpoint_url": server.endpoint_url, "config_kwargs": {"retries": {"max_attempts": 1}},
                "key": "testing", "secret": "never-log-this-secret"}
        src = make_src(tmp_path / "src")
        url = f"s3://{bucket}/ck/{checkpoint_name(9)}"

        def outage_after_first_file(rel, i, n):
            if i == 1:
                server.stop()
                restart.start()

        caplog.set_level(logging.DEBUG, logger="alloy")
        save_checkpoint(src, url, step=9, storage_options=opts, retry=RetryPolicy(attempts=8, base_s=0.2, max_s=1.0),
                        on_file=outage_after_first_file)
        restart.join()
        retried = warned(caplog, "EndpointConnectionError")
        assert retried and all(m.startswith("upload ") for m in retried), retried
        assert "never-log-this-secret" not in caplog.text
        assert verify_checkpoint(url, deep=True, storage_options=opts) == (True, "ok")
        assert latest_complete(f"s3://{bucket}/ck", storage_options=opts) == url
    finally:
        restart.cancel()
        server.stop()


# --------------------------------------------------------------------------------------------- small files


def test_json_and_text_helpers(prefix, tmp_path):
    obj = {"a": [1, 2.5, None], "b": {"c": "ü"}}
    write_json(join(prefix, "sub", "report.json"), obj)
    assert read_json(join(prefix, "sub", "report.json")) == obj
    write_text(join(prefix, "note.txt"), "hello\n")
    write_text(join(prefix, "note.txt"), "replaced\n")
    assert read_text(join(prefix, "note.txt")) == "replaced\n"
    if prefix.startswith("file://"):  # atomic local writes leave no temp files behind
        names = sorted(str(p.relative_to(to_local(prefix))) for p in Path(to_local(prefix)).rglob("*"))
        assert names == ["note.txt", "sub", os.path.join("sub", "report.json")]
    with pytest.raises(FileNotFoundError):
        read_json(join(prefix, "missing.json"))


def test_tree_sha256_is_by_content_cached_per_directory_and_follows_a_change(tmp_path):
    """`tree_sha256`: the same files in two places hash alike (names and contents, the manifest left out); a file
    changed in place gives a new hash; the per-process cache holds one entry per directory, not one per version."""
    from infra import storage
    from infra.storage import tree_sha256

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "model.bin").write_bytes(b"weights")
        (d / "sub" / "cfg.json").write_text("{}")
    (b / MANIFEST).write_text("{}")
    want = hashlib.sha256(f"model.bin\0{hashlib.sha256(b'weights').hexdigest()}\n"
                          f"sub/cfg.json\0{hashlib.sha256(b'{}').hexdigest()}\n".encode()).hexdigest()
    assert tree_sha256(a) == tree_sha256(b) == want
    entries = len(storage._TREE_SHA)
    for version in range(3):
        (a / "model.bin").write_bytes(b"weights v%d" % version)
        os.utime(a / "model.bin", ns=(version + 10**18, version + 10**18))  # a new mtime even within one clock tick
        assert tree_sha256(a) != want
    assert len(storage._TREE_SHA) == entries  # three versions of `a`: its entry replaced, none added
    assert tree_sha256(a) == tree_sha256(str(a) + "/")  # the same directory, however it is written
