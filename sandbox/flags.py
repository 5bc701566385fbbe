"""Which arguments of a file program name files (`sandbox.runner`, layer 2: the path check).

A program's own flags can name a file: `grep --file=PATH`, `grep -fPATH`, `grep -if PATH`, `--exclude-from PATH`,
a response file `@PATH`. A check that only looks at arguments that do not start with `-` lets all of these through,
and Landlock, the layer behind it, allows the system dirs. So every file program has an allow-list of flags
(`FlagSpec`), each declared to take no value (`NONE`), a value that is not a file (`VALUE`: a pattern, a count, a
word) or a file (`PATH`); `file_operands` parses the arguments as GNU getopt does (clustered short flags, a short
flag's value glued on or in the next argument, `--long=value` or `--long value`, `--` ending the flags) and returns
every argument that names a file: the operands and the values of `PATH` flags, plus, for any argument that starts
with `@`, the file it would name as a response file. A flag not on the list is refused, by its exact name: GNU
getopt also accepts unambiguous prefixes (`--exclude-f=PATH` is `--exclude-from`), which an allow-list of exact
names refuses by construction. Flags that follow symlinks out of the work dir (`grep -R`, `ls -L`) are not listed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NONE, VALUE, OPTIONAL, PATH = "none", "value", "optional", "path"  # OPTIONAL: a value only as `--long=value`


class FlagRefused(ValueError):
    """An argument names a flag the program's allow-list does not hold (the message names it)."""


@dataclass(frozen=True)
class FlagSpec:
    """A program's allowed flags: short letter → kind, long name (without `--`) → kind."""
    short: dict[str, str] = field(default_factory=dict)
    long: dict[str, str] = field(default_factory=dict)


def _short(letters: str, **valued: str) -> dict[str, str]:
    return {**dict.fromkeys(letters, NONE), **valued}


def _long(none: str, **valued: str) -> dict[str, str]:
    return {**dict.fromkeys(none.split(), NONE), **{k.replace("_", "-"): v for k, v in valued.items()}}


LS = FlagSpec(
    _short("aAbBcCdfFgGhiklmnNopqQrRsStuUvxX1", I=VALUE, w=VALUE, T=VALUE),
    _long("all almost-all escape ignore-backups directory classify no-group human-readable si inode "
          "numeric-uid-gid literal hide-control-chars quote-name reverse recursive size", hide=VALUE, ignore=VALUE,
          sort=VALUE, format=VALUE, width=VALUE, color=OPTIONAL, time=VALUE, quoting_style=VALUE,
          indicator_style=VALUE))
CAT = FlagSpec(_short("AbeEnstTuv"), _long("show-all number-nonblank show-ends number squeeze-blank show-tabs "
                                           "show-nonprinting"))
GREP = FlagSpec(
    _short("EFGPiyvwxcnhHlLoqsrabTZzUI0123456789", e=VALUE, f=PATH, m=VALUE, A=VALUE, B=VALUE, C=VALUE, d=VALUE,
           D=VALUE),
    _long("extended-regexp fixed-strings basic-regexp perl-regexp ignore-case no-ignore-case invert-match "
          "word-regexp line-regexp count files-with-matches files-without-match only-matching quiet silent "
          "no-messages byte-offset with-filename no-filename line-buffered initial-tab null null-data text "
          "recursive", regexp=VALUE, file=PATH, exclude_from=PATH, max_count=VALUE, after_context=VALUE,
          before_context=VALUE, context=VALUE, label=VALUE, include=VALUE, exclude=VALUE, exclude_dir=VALUE,
          directories=VALUE, devices=VALUE, binary_files=VALUE, color=OPTIONAL, colour=OPTIONAL))


def _long_flag(spec: FlagSpec, arg: str, rest: list[str], files: list[str]) -> None:
    """One `--name[=value]` argument; consumes its value from `rest` when it takes one and has no `=`."""
    name, eq, value = arg[2:].partition("=")
    kind = spec.long.get(name)
    if kind is None:
        raise FlagRefused(f"flag --{name} is not allowed for this program")
    if kind == NONE and eq:
        raise FlagRefused(f"flag --{name} takes no value")
    if kind in (VALUE, PATH) and not eq:
        if not rest:
            raise FlagRefused(f"flag --{name} needs a value")
        value = rest.pop(0)
    if kind == PATH:
        files.append(value)


def _short_flags(spec: FlagSpec, arg: str, rest: list[str], files: list[str]) -> None:
    """One cluster `-abc`, `-fPATH`, `-f PATH`, `-if PATH`: flags up to the first that takes a value, whose value is
    the rest of the cluster or else the next argument (consumed from `rest`)."""
    for i, letter in enumerate(arg[1:], start=1):
        kind = spec.short.get(letter)
        if kind is None:
            raise FlagRefused(f"flag -{letter} (in {arg!r}) is not allowed for this program")
        if kind == NONE:
            continue
        value = arg[i + 1:]
        if not value:
            if not rest:
                raise FlagRefused(f"flag -{letter} needs a value")
            value = rest.pop(0)
        if kind == PATH:
            files.append(value)
        return


def file_operands(spec: FlagSpec, args: list[str]) -> list[str]:
    """Every argument of `args` that names a file (see the module docstring), for the path check. Raises
    `FlagRefused` naming a flag the allow-list does not hold."""
    rest, flags_done = list(args), False
    files = [a[1:] for a in args if a.startswith("@") and len(a) > 1]  # response files, for programs that read them
    while rest:
        arg = rest.pop(0)
        if flags_done or arg == "-" or not arg.startswith("-"):
            files.append(arg)
        elif arg == "--":
            flags_done = True
        elif arg.startswith("--"):
            _long_flag(spec, arg, rest, files)
        else:
            _short_flags(spec, arg, rest, files)
    return files
