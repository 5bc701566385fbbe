"""Names that become paths: the one pattern of run, experiment and domain names, and the one builder of storage keys.

A run name becomes the run's directory (`<run.root>/<run.name>`), a domain name a work dir
(`<work>/specialists/<domain>`), a log file and a storage prefix (`specialist-<domain>-<fp>`), so a name must be one
plain path segment: `NAME_PATTERN` (a letter or digit, then up to 63 letters, digits, `.`, `_` or `-`, and no `..`
anywhere). The config checks every such name when it loads (`check_name`, the error names the dotted path:
`domains.3.name: ...`).

Storage keys and local paths built from names go through `key` (`infra.storage.join` and `local_path` call it),
which refuses `..`, `.`, empty segments, absolute parts (`/x`, `~x`, `C:`, `scheme://`) and backslashes, so a name
that slipped past the config (a plugin's own name, a caller's string) still cannot leave its root.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME = re.compile(NAME_PATTERN)
NAME_RULE = "1 to 64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit, without '..'"


def name_problem(name: object) -> str | None:
    """Why `name` is not a safe name (NAME_PATTERN), or None if it is."""
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not _NAME.fullmatch(name) or ".." in name:
        return f"must be {NAME_RULE} (names become directories and storage keys)"
    return None


def check_name(name: str, what: str = "name") -> str:
    """`name` if it matches NAME_PATTERN (without '..'); ValueError naming `what` and the value otherwise (the
    config's validators pass what="" : its errors name the dotted path and show the value themselves)."""
    why = name_problem(name)
    if why:
        raise ValueError(f"{what} {name!r}: {why}" if what else why)
    return name


def key(*parts: object) -> str:
    """The relative storage key of `parts` joined with '/': each part may hold '/'-separated segments (a trailing
    '/' is dropped), none may be empty, '.' or '..', hold a backslash or NUL, or make the key absolute. ValueError
    naming the bad part otherwise; at least one part.

    key("specialist-add-0123", "final") == "specialist-add-0123/final"; key("a", "../b") raises."""
    segments: list[str] = []
    for part in parts:
        p = str(part)
        bad = _part_problem(p)
        if bad:
            raise ValueError(f"storage key part {p!r}: {bad}")
        segments.extend(p.rstrip("/").split("/"))
    if not segments:
        raise ValueError("storage key: no parts")
    return "/".join(segments)


def local_path(root: str | os.PathLike, *parts: object) -> Path:
    """`root` / the relative key of `parts` (`key`): a local work dir or file built from names, which cannot leave
    `root`. local_path("/w", "specialists", "add") == Path("/w/specialists/add")."""
    return Path(root).joinpath(*key(*parts).split("/"))


def _part_problem(p: str) -> str | None:
    if not p.rstrip("/"):
        return "empty"
    if p.startswith(("/", "~")) or re.match(r"[A-Za-z]:", p) or "://" in p:
        return "absolute (a key part must be relative)"
    if "\\" in p or "\0" in p:
        return "holds a backslash or NUL"
    for seg in p.rstrip("/").split("/"):
        if seg in ("", ".", ".."):
            return f"segment {seg!r} ('', '.' and '..' are refused)"
    return None
