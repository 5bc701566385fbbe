"""Dataset files, read once per process: the bytes of a local path or fsspec URL (`s3://…`) and their sha256.

`read_dataset(url)` is what a dataset domain (domains/dataset.py) parses and what keys the checkpoints of a run on
that dataset (`DatasetConfig`'s content hash in `AlloyConfig.fingerprint`): both read through this cache, so a
process downloads a file once, and a file changed on storage (another size, mtime or ETag) is read again, which
moves every checkpoint prefix built on it. URLs and their options go through `infra.storage.get_fs` (S3 endpoint
and credentials from the standard AWS environment variables, as for `run.storage`).
"""
from __future__ import annotations

import hashlib
import threading

from infra.storage import get_fs, read_bytes

_CACHE: dict[str, tuple[tuple, bytes, str]] = {}  # full URL -> (version stamp, bytes, sha256 hex)
_LOCK = threading.Lock()


def _stamp(url: str) -> tuple[str, tuple]:
    """(the file's full URL (a relative local path made absolute), what changes when the file does: size and mtime
    (local), ETag / LastModified (S3 and other object stores)). Raises FileNotFoundError for a missing file."""
    fs, path = get_fs(url)
    info = fs.info(path)
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{url} is a directory, not a dataset file")
    return fs.unstrip_protocol(path), tuple(str(info.get(k)) for k in ("size", "mtime", "ETag", "LastModified",
                                                                       "etag", "last_modified"))


def read_dataset(url: str) -> tuple[bytes, str]:
    """(the file's bytes, their sha256 hex) of a local path or fsspec URL, from the process cache while the file's
    size/mtime/ETag is unchanged."""
    key, stamp = _stamp(str(url))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1], hit[2]
    data = read_bytes(key)
    digest = hashlib.sha256(data).hexdigest()
    with _LOCK:
        _CACHE[key] = (stamp, data, digest)
    return data, digest


def dataset_sha256(url: str) -> str:
    """The sha256 hex of a dataset file's bytes (cached as `read_dataset`)."""
    return read_dataset(url)[1]
