"""Storage: fsspec URLs (`file://`, plain paths, `s3://bucket/prefix`), atomic checkpoints, small JSON helpers.

A checkpoint is a directory of files (HF model files, trainer state, rollout buffer, anything a resume needs)
committed by a `COMPLETE` manifest that is written LAST:

    {"version": 1, "step": 100, "created": "2026-…Z", "files": {"model.safetensors": {"size": n, "sha256": hex}},
     "meta": {...}}

Readers trust only directories whose manifest is present, parseable and matches the files on storage, so a
crash at any point of a save leaves nothing that looks like a checkpoint:

- `file://`: files are copied into a hidden `.tmp-…` sibling, the manifest is written, and the directory is
  renamed into place (a rename is atomic on POSIX): the checkpoint appears whole or not at all.
- `s3://` (and any other fsspec backend): a stale manifest is removed first, every file is uploaded (each upload
  retried on transient errors with bounded exponential backoff), then the manifest is PUT. An S3 PUT is atomic
  per object, so a reader sees either no manifest (the directory is skipped) or the whole one.

S3 options come from the standard environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_DEFAULT_REGION / AWS_REGION) or an explicit
`storage_options` dict, which wins key by key. Nothing here logs options: they hold secrets.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import posixpath
import random
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import fsspec
from fsspec.utils import get_protocol

from infra.names import key, local_path  # noqa: F401  (local_path: re-exported)

log = logging.getLogger("alloy.storage")

MANIFEST = "COMPLETE"
MANIFEST_VERSION = 1
_LOCAL_PROTOCOLS = ("file", "local")
_S3_PROTOCOLS = ("s3", "s3a")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the checkpoint URL and the bad file."""


# --------------------------------------------------------------------------------------------- URLs


def s3_options_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """s3fs options from the standard AWS environment variables (only those that are set)."""
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    for var, opt in (("AWS_ACCESS_KEY_ID", "key"), ("AWS_SECRET_ACCESS_KEY", "secret"), ("AWS_SESSION_TOKEN", "token")):
        if env.get(var):
            opts[opt] = env[var]
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")  # the service-specific one wins
    if endpoint:
        opts["endpoint_url"] = endpoint
    region = env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION")
    if region:
        opts["client_kwargs"] = {"region_name": region}
    return opts


def _options(url: str, storage_options: dict | None) -> dict[str, Any]:
    explicit = dict(storage_options or {})
    if get_protocol(url) not in _S3_PROTOCOLS:
        return explicit
    opts = s3_options_from_env()
    # client_kwargs is merged, not replaced: an explicit endpoint must not drop the region from the env
    client_kwargs = {**opts.get("client_kwargs", {}), **explicit.pop("client_kwargs", {})}
    opts.update(explicit)
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    return opts


def get_fs(url: str, *, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for an fsspec URL or a plain local path (made absolute)."""
    return fsspec.core.url_to_fs(str(url), **_options(str(url), storage_options))


def is_local(url: str) -> bool:
    return get_protocol(str(url)) in _LOCAL_PROTOCOLS


def join(url: str, *parts: str) -> str:
    """Join parts onto a URL with '/', keeping its scheme: join("s3://b/p", "step-1", "x") == "s3://b/p/step-1/x".
    Empty parts are skipped; the others form a relative key (`infra.names.key`): '..', '.', empty segments and
    absolute parts are a ValueError, so a key built from a name stays under `url`."""
    out = str(url).rstrip("/")
    parts = tuple(p for p in parts if str(p) != "")
    return f"{out}/{key(*parts)}" if parts else out


def to_local(url: str) -> str:
    """The absolute local path of a `file://` URL or plain path; ValueError for remote URLs."""
    if not is_local(url):
        raise ValueError(f"{url!r} is not a local path or file:// URL")
    return get_fs(url)[1]


# --------------------------------------------------------------------------------------------- retries


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: attempt k (1-based) waits min(max_s, base_s·2^(k-1))·U(0.5, 1) after failing."""
    attempts: int = 5
    base_s: float = 0.5
    max_s: float = 8.0


DEFAULT_RETRY = RetryPolicy()
_TRANSIENT_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded", "500", "502", "503", "504"}


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: dropped/refused connections, timeouts, S3 5xx and throttling.

    Walks the cause chain because s3fs re-raises botocore errors as plain OSError with the original as __cause__.
    Missing files, permissions and our own CheckpointError are never transient.
    """
    try:
        from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        ClientError = BotoConnectionError = HTTPClientError = ()  # type: ignore[assignment,misc]
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError
    except ImportError:  # pragma: no cover
        ClientConnectionError = ClientPayloadError = ()  # type: ignore[assignment,misc]
    from fsspec.exceptions import FSTimeoutError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                          FileExistsError, CheckpointError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError, socket.timeout, FSTimeoutError, BotoConnectionError,
                          HTTPClientError, ClientConnectionError, ClientPayloadError)):
            return True
        if isinstance(e, ClientError):
            resp = e.response if isinstance(e.response, dict) else {}
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return str(resp.get("Error", {}).get("Code")) in _TRANSIENT_CODES or int(status) >= 500
        e = e.__cause__ or e.__context__
    return False


def _retry(fn: Callable[[], Any], what: str, policy: RetryPolicy) -> Any:
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt >= policy.attempts or not is_transient(exc):
                raise
            delay = min(policy.max_s, policy.base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            log.warning("%s failed (%s: %s); retry %d/%d in %.2f s", what, type(exc).__name__, exc,
                        attempt, policy.attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------------- small files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Write to a temp file in the same directory, fsync (`durable`), rename over the target: readers see old or
    new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        _fsync_dir(path.parent)


def write_bytes(url: str, data: bytes, *, storage_options: dict | None = None,
                retry: RetryPolicy = DEFAULT_RETRY, durable: bool = True) -> None:
    """`data` as the object at `url`, whole or not at all (a local file: renamed into place; `durable`: fsynced
    first, file and folder, so it survives a power loss; a debug record may skip that)."""
    if is_local(url):
        _write_local_atomic(Path(to_local(url)), data, durable)
        return
    fs, path = get_fs(url, storage_options=storage_options)
    _retry(lambda: fs.pipe_file(path, data), f"write {url}", retry)


def read_bytes(url: str, *, storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY) -> bytes:
    fs, path = get_fs(url, storage_options=storage_options)
    return _retry(lambda: fs.cat_file(path), f"read {url}", retry)


def write_text(url: str, text: str, **kw) -> None:
    """Write a UTF-8 text file (atomic for local paths; one PUT for S3)."""
    write_bytes(url, text.encode("utf-8"), **kw)


def read_text(url: str, **kw) -> str:
    return read_bytes(url, **kw).decode("utf-8")


def write_json(url: str, obj: Any, **kw) -> None:
    """Write obj as indented JSON (atomic for local paths; one PUT for S3)."""
    write_text(url, json.dumps(obj, indent=2) + "\n", **kw)


def read_json(url: str, **kw) -> Any:
    return json.loads(read_text(url, **kw))


def exists(url: str, *, storage_options: dict | None = None) -> bool:
    fs, path = get_fs(url, storage_options=storage_options)
    fs.invalidate_cache(path)
    return _retry(lambda: fs.exists(path), f"check {url}", DEFAULT_RETRY)


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint at `step`: step-00000100."""
    return f"step-{int(step):08d}"


def _hash_file(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _scan(src: Path) -> list[str]:
    """Relative posix paths of every file under src (symlinks followed), except a top-level manifest."""
    out = []
    for root, _dirs, files in os.walk(src, followlinks=True):
        for name in files:
            rel = Path(root, name).relative_to(src).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


_TREE_SHA: dict[str, tuple[tuple, str]] = {}  # resolved directory → (its files' names, sizes, mtimes; their sha256)


def tree_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a local directory's files, by relative name and content in name order (a top-level manifest
    left out): what a checkpoint directory holds, wherever it lies. Cached per process and directory while each
    file's size and mtime stay the same, so a large checkpoint is read once; a changed directory replaces its entry
    (a long-lived worker keeps one per directory it hashed, not one per version)."""
    src = Path(path)
    rels = _scan(src)
    stats = tuple((rel, st.st_size, st.st_mtime_ns) for rel in rels for st in [(src / rel).stat()])
    key = str(src.resolve())
    cached = _TREE_SHA.get(key)
    if cached is None or cached[0] != stats:
        h = hashlib.sha256()
        for rel in rels:
            h.update(f"{rel}\0{_hash_file(src / rel)[1]}\n".encode())
        cached = _TREE_SHA[key] = (stats, h.hexdigest())
    return cached[1]


def _safe_rel(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts and rel != MANIFEST


def _manifest_problem(m: Any) -> str | None:
    """Why a parsed manifest is invalid, or None."""
    if not isinstance(m, dict):
        return "manifest is not a JSON object"
    if m.get("version") != MANIFEST_VERSION:
        return f"manifest version {m.get('version')!r} is not {MANIFEST_VERSION}"
    if not isinstance(m.get("step"), int) or isinstance(m.get("step"), bool):
        return f"manifest step {m.get('step')!r} is not an int"
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for rel, info in files.items():
        if not _safe_rel(rel):
            return f"manifest lists an unsafe path {rel!r}"
        if (not isinstance(info, dict) or not isinstance(info.get("size"), int) or info["size"] < 0
                or not isinstance(info.get("sha256"), str) or len(info["sha256"]) != 64):
            return f"manifest entry for {rel!r} needs an int size and a 64-hex sha256"
    return None


def _read_manifest(fs, path: str, retry: RetryPolicy) -> tuple[dict | None, str]:
    """(manifest, "") or (None, reason)."""
    mpath = posixpath.join(path, MANIFEST)
    try:
        raw = _retry(lambda: fs.cat_file(mpath), f"read {mpath}", retry)
    except FileNotFoundError:
        return None, f"no {MANIFEST} manifest (incomplete, crashed or in-progress save)"
    try:
        m = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"{MANIFEST} manifest is not valid JSON ({exc})"
    problem = _manifest_problem(m)
    return (None, problem) if problem else (m, "")


def _check(fs, path: str, deep: bool, retry: RetryPolicy) -> tuple[dict | None, str]:
    """(manifest, "") when the checkpoint at path is valid, else (None, reason). Network errors propagate."""
    fs.invalidate_cache(path)
    m, reason = _read_manifest(fs, path, retry)
    if m is None:
        return None, reason
    listing = _retry(lambda: fs.find(path, detail=True), f"list {path}", retry)
    root = path.rstrip("/") + "/"
    sizes = {name[len(root):]: info.get("size") for name, info in listing.items() if name.startswith(root)}
    for rel, info in m["files"].items():
        if rel not in sizes:
            return None, f"file {rel!r} listed in the manifest is missing"
        if sizes[rel] != info["size"]:
            return None, f"file {rel!r} has {sizes[rel]} bytes, manifest says {info['size']}"
    if deep:
        for rel, info in m["files"].items():
            h = hashlib.sha256()
            with fs.open(posixpath.join(path, rel), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            if h.hexdigest() != info["sha256"]:
                got, want = h.hexdigest()[:12], info["sha256"][:12]
                return None, f"file {rel!r} sha256 {got}… does not match the manifest's {want}…"
    return m, ""


def verify_checkpoint(url: str, *, deep: bool = False, storage_options: dict | None = None,
                      retry: RetryPolicy = DEFAULT_RETRY) -> tuple[bool, str]:
    """(True, "ok") if the checkpoint's manifest is valid and every file exists with its size (and sha256 if deep)."""
    fs, path = get_fs(url, storage_options=storage_options)
    m, reason = _check(fs, path, deep, retry)
    return (True, "ok") if m is not None else (False, reason)


def save_checkpoint(local_dir: str | os.PathLike, dest_url: str, step: int, meta: dict | None = None, *,
                    storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                    on_file: Callable[[str, int, int], None] | None = None) -> str:
    """Commit every file under local_dir as the checkpoint dest_url (manifest last); returns dest_url.

    `on_file(relpath, i, n)` is called after file i of n is stored (progress; tests raise from it to simulate a crash).
    Re-saving an existing checkpoint replaces it.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise CheckpointError(f"save_checkpoint: local_dir {str(local_dir)!r} is not a directory")
    rels = _scan(src)
    if not rels:
        raise CheckpointError(f"save_checkpoint: local_dir {str(local_dir)!r} holds no files")
    files = {}
    for rel in rels:
        size, sha = _hash_file(src / rel)
        files[rel] = {"size": size, "sha256": sha}
    manifest = {"version": MANIFEST_VERSION, "step": int(step),
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": files, "meta": meta or {}}
    try:
        data = (json.dumps(manifest, indent=2) + "\n").encode()
    except TypeError as exc:
        raise CheckpointError(f"save_checkpoint: meta must be JSON-serialisable: {exc}") from exc
    t0 = time.monotonic()
    if is_local(dest_url):
        _commit_local(src, rels, data, Path(to_local(dest_url)), retry, on_file)
    else:
        fs, path = get_fs(dest_url, storage_options=storage_options)
        _commit_remote(src, rels, data, fs, path, dest_url, retry, on_file)
    total = sum(f["size"] for f in files.values())
    log.info("committed checkpoint %s (step %d, %d files, %.1f MB, %.1f s)", dest_url, step, len(rels), total / 1e6,
             time.monotonic() - t0)
    return dest_url


def _copy_durable(src: Path, dst: Path) -> None:
    """Copy and fsync: after a power loss a committed manifest must not vouch for a file still in the page cache."""
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def _commit_local(src: Path, rels: list[str], manifest: bytes, final: Path, retry: RetryPolicy, on_file) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        for i, rel in enumerate(rels, 1):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _retry(lambda: _copy_durable(src / rel, target), f"copy {rel}", retry)
            if on_file:
                on_file(rel, i, len(rels))
        _write_local_atomic(tmp / MANIFEST, manifest)
        old = None
        if final.exists():  # a directory cannot be renamed over a non-empty one: move the old one aside first
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None:
                os.rename(old, final)
            raise
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _remove_debris(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_debris(final: Path) -> None:
    """Remove what a saver killed mid-save of this same checkpoint left (hidden `.tmp-<name>-*` staging and
    `.old-<name>-*` trash directories): `final` is now committed, so they can never be needed."""
    for debris in [*final.parent.glob(f".tmp-{final.name}-*"), *final.parent.glob(f".old-{final.name}-*")]:
        log.info("removing %s, left by an interrupted save of %s", debris.name, final.name)
        shutil.rmtree(debris, ignore_errors=True)


def _commit_remote(src: Path, rels: list[str], manifest: bytes, fs, path: str, url: str, retry: RetryPolicy,
                   on_file) -> None:
    mpath = posixpath.join(path, MANIFEST)
    fs.invalidate_cache(path)
    # un-commit first: while files are being replaced the old manifest would vouch for a mix of old and new files
    if _retry(lambda: fs.exists(mpath), f"check {url}", retry):
        _retry(lambda: fs.rm_file(mpath), f"un-commit {url}", retry)
    for i, rel in enumerate(rels, 1):
        _retry(lambda: fs.put_file(str(src / rel), posixpath.join(path, rel)), f"upload {rel} to {url}", retry)
        if on_file:
            on_file(rel, i, len(rels))
    _retry(lambda: fs.pipe_file(mpath, manifest), f"commit {url}", retry)


def load_checkpoint(url: str, local_dir: str | os.PathLike, *, storage_options: dict | None = None,
                    retry: RetryPolicy = DEFAULT_RETRY) -> dict:
    """Download the checkpoint at url into local_dir, verifying every file's size and sha256; returns the manifest.

    Each file lands under a `.part` name and is renamed into place only once verified; files already in local_dir
    that the manifest does not list are left alone. CheckpointError on a missing or invalid manifest, a missing file,
    or a size/sha256 mismatch.
    """
    fs, path = get_fs(url, storage_options=storage_options)
    fs.invalidate_cache(path)
    m, reason = _read_manifest(fs, path, retry)
    if m is None:
        raise CheckpointError(f"{url}: {reason}")
    dest = Path(local_dir)
    dest.mkdir(parents=True, exist_ok=True)
    for rel, info in m["files"].items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        try:
            _retry(lambda: fs.get_file(posixpath.join(path, rel), str(part)), f"download {rel} from {url}", retry)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url}: file {rel!r} listed in the manifest is missing") from exc
        size, sha = _hash_file(part)
        if size != info["size"] or sha != info["sha256"]:
            part.unlink(missing_ok=True)
            what = f"has {size} bytes, manifest says {info['size']}" if size != info["size"] else "sha256 mismatch"
            raise CheckpointError(f"{url}: file {rel!r} {what}")
        os.replace(part, target)
    log.info("loaded checkpoint %s (step %d) into %s", url, m["step"], dest)
    return m


@dataclass
class CheckpointInfo:
    """One directory under a checkpoint prefix. step and manifest are None unless complete."""
    url: str
    name: str
    complete: bool
    reason: str = ""
    step: int | None = None
    manifest: dict | None = field(default=None, repr=False)


def list_checkpoints(prefix_url: str, pattern: str = "step-*", *, deep: bool = False,
                     storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY) -> list[CheckpointInfo]:
    """Every directory under prefix_url whose name matches pattern, checked; complete ones sorted by step first."""
    fs, path = get_fs(prefix_url, storage_options=storage_options)
    fs.invalidate_cache(path)
    try:
        entries = _retry(lambda: fs.ls(path, detail=True), f"list {prefix_url}", retry)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = posixpath.basename(e["name"].rstrip("/"))
        # hidden names are our own staging (.tmp-…) and trash (.old-…) directories
        if e.get("type") != "directory" or name.startswith(".") or not fnmatch.fnmatchcase(name, pattern):
            continue
        m, reason = _check(fs, posixpath.join(path, name), deep, retry)
        out.append(CheckpointInfo(url=join(prefix_url, name), name=name, complete=m is not None, reason=reason,
                                  step=m["step"] if m else None, manifest=m))
    out.sort(key=lambda c: (not c.complete, c.step if c.step is not None else 0, c.name))
    return out


def latest_complete(prefix_url: str, pattern: str = "step-*", *, deep: bool = False,
                    storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY) -> str | None:
    """URL of the complete checkpoint with the highest manifest step under prefix_url, or None.

    Directories without a valid manifest (missing, unparseable, a listed file missing or of the wrong size; with
    deep=True also a sha256 mismatch) are skipped with a warning naming them and the reason.
    """
    infos = list_checkpoints(prefix_url, pattern, storage_options=storage_options, retry=retry)
    for c in infos:
        if not c.complete:
            log.warning("skipping checkpoint %s: %s", c.url, c.reason)
    complete = sorted((c for c in infos if c.complete), key=lambda c: (c.step, c.name), reverse=True)
    for c in complete:
        if deep:  # hashing reads every byte, so only as far down the list as needed
            ok, reason = verify_checkpoint(c.url, deep=True, storage_options=storage_options, retry=retry)
            if not ok:
                log.warning("skipping checkpoint %s: %s", c.url, reason)
                continue
        return c.url
    return None


def load_latest(prefix_url: str, local_dir: str | os.PathLike, pattern: str = "step-*", *,
                storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY) -> str | None:
    """Load the newest checkpoint under prefix_url that loads cleanly into local_dir; returns its URL, or None.

    What a resume needs: `latest_complete` checks sizes only, `load_checkpoint` verifies every sha256 while copying,
    so a newest checkpoint with same-size bit rot raises there. That one is skipped with a warning and the next
    newest is tried, instead of failing the resume.
    """
    infos = list_checkpoints(prefix_url, pattern, storage_options=storage_options, retry=retry)
    for c in infos:
        if not c.complete:
            log.warning("skipping checkpoint %s: %s", c.url, c.reason)
    for c in sorted((c for c in infos if c.complete), key=lambda c: (c.step, c.name), reverse=True):
        shutil.rmtree(local_dir, ignore_errors=True)
        try:
            load_checkpoint(c.url, local_dir, storage_options=storage_options, retry=retry)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", c.url, exc)
            continue
        return c.url
    shutil.rmtree(local_dir, ignore_errors=True)
    return None


def prune(prefix_url: str, keep_last: int, pattern: str = "step-*", *, storage_options: dict | None = None,
          retry: RetryPolicy = DEFAULT_RETRY) -> list[str]:
    """Delete all but the keep_last newest complete checkpoints (never the newest); returns the deleted URLs.

    Incomplete directories are left alone: one may be another writer's save in progress.
    """
    if keep_last < 1:
        raise ValueError(f"prune: keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    complete = [c for c in list_checkpoints(prefix_url, pattern, storage_options=storage_options, retry=retry)
                if c.complete]
    doomed = complete[:-keep_last]
    for c in doomed:
        _delete_checkpoint(c.url, storage_options, retry)
        log.info("pruned checkpoint %s (step %s)", c.url, c.step)
    return [c.url for c in doomed]


def delete_checkpoint(url: str, *, storage_options: dict | None = None, retry: RetryPolicy = DEFAULT_RETRY) -> None:
    """Delete the checkpoint at `url` (locally renamed out of sight first; remotely the manifest first, so a delete
    cut short leaves an incomplete directory, never a complete-looking partial one)."""
    _delete_checkpoint(url, storage_options, retry)
    log.info("deleted checkpoint %s", url)


def _delete_checkpoint(url: str, storage_options: dict | None, retry: RetryPolicy) -> None:
    if is_local(url):
        final = Path(to_local(url))
        trash = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)  # disappears atomically; the slow delete happens out of sight
        shutil.rmtree(trash, ignore_errors=True)
        return
    fs, path = get_fs(url, storage_options=storage_options)
    # the manifest goes first, so a delete cut short leaves an incomplete directory, never a "complete" partial one
    _retry(lambda: fs.rm_file(posixpath.join(path, MANIFEST)), f"un-commit {url}", retry)
    _retry(lambda: fs.rm(path, recursive=True), f"delete {url}", retry)
