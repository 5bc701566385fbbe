"""Dataset files, read once per process: the bytes of a local path or fsspec URL (`s3://…`) and their sha256.

`read_dataset(url)` is what a dataset domain (domains/dataset.py) parses and what keys the checkpoints of a run on
that dataset (`DatasetConfig`'s content hash in `AlloyConfig.fingerprint`): both read through this cache, so a
process downloads a file once, and a file changed on storage (another size, mtime or ETag) is read again, which
moves every checkpoint prefix built on it. URLs and their options go through `infra.storage.get_fs` (S3 endpoint
and credentials from the standard AWS environment variables, as for `run.storage`).

The caches are bounded (`BoundedCache`): least recently used files go first once the cached bytes pass
`ALLOY_DATASET_CACHE_MB` (default 1024), the newest entry always stays (a file larger than the budget is still read
once per process, not once per access). domains/dataset.py bounds its parsed rows the same way.

A file larger than `max_bytes` (`dataset.max_file_mb`, default DEFAULT_MAX_FILE_MB) is refused before it is read
(its size from the storage's listing) with a `DatasetLimitError` naming the file, its size and the setting to raise.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any, Hashable

from infra.choices import DEFAULT_MAX_FILE_MB, DEFAULT_MAX_ROW_KB  # noqa: F401  (re-exported)
from infra.storage import get_fs, read_bytes

CACHE_ENV = "ALLOY_DATASET_CACHE_MB"


class DatasetLimitError(ValueError):
    """A dataset over one of its limits; `field` names the `dataset` setting that raises it (e.g. "max_file_mb")."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 // 10 else f"{n} bytes"


def check_file_size(url: str, size: int, max_bytes: int | None) -> None:
    """DatasetLimitError if `size` bytes is over `max_bytes` (None: no limit)."""
    if max_bytes is not None and size > max_bytes:
        raise DatasetLimitError(f"dataset {url} is {_mib(size)}, over the limit of {_mib(max_bytes)} "
                                f"(dataset.max_file_mb); raise dataset.max_file_mb or use a smaller file",
                                "max_file_mb")


def cache_budget_bytes() -> int:
    """The byte budget of each dataset cache: `ALLOY_DATASET_CACHE_MB` (a positive number), else 1 GiB."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    try:
        mb = float(raw) if raw else 1024.0
    except ValueError:
        raise ValueError(f"{CACHE_ENV} must be a number of MiB, got {raw!r}") from None
    if mb <= 0:
        raise ValueError(f"{CACHE_ENV} must be > 0, got {raw!r}")
    return int(mb * 2 ** 20)


class BoundedCache:
    """A thread-safe least-recently-used map whose values together weigh at most `max_weight` (bytes, say); the
    entry put last is never evicted, however heavy. `get` counts as a use."""

    def __init__(self, max_weight: int):
        self.max_weight = max_weight
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: Any, weight: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._items[key] = (value, weight)
            self._weight += weight
            while self._weight > self.max_weight and len(self._items) > 1:
                _, (_, w) = self._items.popitem(last=False)
                self._weight -= w

    @property
    def weight(self) -> int:
        return self._weight

    def __len__(self) -> int:
        return len(self._items)


_CACHE = BoundedCache(cache_budget_bytes())  # full URL -> (version stamp, bytes, sha256 hex)


def _stamp(url: str) -> tuple[str, tuple]:
    """(the file's full URL (a relative local path made absolute), what changes when the file does: size and mtime
    (local), ETag / LastModified (S3 and other object stores)). Raises FileNotFoundError for a missing file."""
    fs, path = get_fs(url)
    info = fs.info(path)
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{url} is a directory, not a dataset file")
    return fs.unstrip_protocol(path), tuple(str(info.get(k)) for k in ("size", "mtime", "ETag", "LastModified",
                                                                       "etag", "last_modified"))


def read_dataset(url: str, max_bytes: int | None = None) -> tuple[bytes, str]:
    """(the file's bytes, their sha256 hex) of a local path or fsspec URL, from the process cache while the file's
    size/mtime/ETag is unchanged. A file over `max_bytes` is a DatasetLimitError, before it is read when its
    listing gives its size."""
    key, stamp = _stamp(str(url))
    if stamp[0].isdigit():  # the listed size
        check_file_size(str(url), int(stamp[0]), max_bytes)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        check_file_size(str(url), len(hit[1]), max_bytes)
        return hit[1], hit[2]
    data = read_bytes(key)
    check_file_size(str(url), len(data), max_bytes)  # a store that lists no size, or a file grown since
    digest = hashlib.sha256(data).hexdigest()
    _CACHE.put(key, (stamp, data, digest), len(data))
    return data, digest


def dataset_sha256(url: str, max_bytes: int | None = None) -> str:
    """The sha256 hex of a dataset file's bytes (cached as `read_dataset`)."""
    return read_dataset(url, max_bytes)[1]
