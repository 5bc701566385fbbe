"""Dataset domains: prompts and reference answers read from a file instead of a generator (domains/README.md,
"Dataset domains").

A `DatasetDomain` reads one table (`.jsonl`, `.json`, `.parquet` or `.csv`, the format from the suffix) from a local
path or any fsspec URL (`s3://…`; options from the environment as for `run.storage`) with pandas, once per process
(`infra.datasets.read_dataset` caches the bytes by size/mtime/ETag, this module the parsed rows by their sha256).
Every row is checked before anything trains: a missing or empty prompt, a non-string prompt, a missing or empty
answer (NaN counts as missing), a missing extra field, an answer the verifier cannot use: all bad rows (up to
MAX_BAD_ROWS shown) are refused in one DatasetError naming each by its 0-based data row (and its 1-based line for
JSONL). Numbers in the answer column become strings (42.0 → "42", 3.5 → "3.5"). Rows are deduplicated by prompt
(the first kept) and split train/val/eval by the sha256 of the prompt (`domains.base.prompt_split`), as the
generator domains are. Prompts are kept as they are: multi-line, any Unicode.

Limits (issue 34): a file over `dataset.max_file_mb` is refused before it is read (`infra.datasets`); a row whose
cells the domain reads (prompt, answer, fields: text as UTF-8, anything else as JSON) weigh more than
`dataset.max_row_kb`, or a cell nested deeper than MAX_JSON_DEPTH, is a bad row named by number (and line), like the
others; JSON nested past what the parsers take (pandas' 1024 levels, Python's recursion limit) is a DatasetError
naming the line, never a RecursionError.

The reward is the configured verifier (`domains.verifiers.get_verifier`), and the 0/1 accuracy is reward == 1.0.
"""
from __future__ import annotations

import io
import json
import math
import random
import reprlib
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from domains.base import MAX_BAD_ROWS, SPLITS, Domain, Example, prompt_split
from domains.verifiers import answer_problem, get_verifier
from infra.datasets import (DEFAULT_MAX_FILE_MB, DEFAULT_MAX_ROW_KB, BoundedCache, DatasetLimitError,
                            cache_budget_bytes, read_dataset)

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_JSON_DEPTH = 64  # nesting levels of one cell (lists/objects); deeper rows are refused, not recursed into
_SHORT = reprlib.Repr()  # a cell in an error message: bounded in length and depth (an 8 MB or 10,000-deep cell)
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel = 3

class DatasetError(ValueError):
    """A dataset that cannot be used; `field` is the `dataset` setting at fault ("path" for a file that cannot be
    read or has an unknown suffix, "" for its rows)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


# (sha256, format, columns, verifier) -> (examples, rows read, examples by split); bounded as infra.datasets' bytes
_PARSED = BoundedCache(cache_budget_bytes())


def dataset_format(path: str) -> str:
    """The table format of `path` from its suffix; ValueError naming the path and the accepted suffixes otherwise."""
    name = str(path).split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix, fmt in FORMATS.items():
        if name.endswith(suffix):
            return fmt
    raise DatasetError(f"dataset {path}: unknown file type; the suffix must be one of {', '.join(FORMATS)}", "path")


def _jsonl_lines(data: bytes) -> list[int]:
    """1-based line numbers of the non-blank lines of a JSONL file: data row i is on line `_jsonl_lines(data)[i]`."""
    return [i + 1 for i, line in enumerate(data.split(b"\n")) if line.strip()]


def _first_bad_json_line(data: bytes) -> str:
    row = -1
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        row += 1
        try:
            obj = json.loads(line)
        except ValueError as exc:
            return f"line {i + 1} is not valid JSON ({exc})"
        except RecursionError:
            return (f"row {row} (line {i + 1}) nests its JSON too deeply to parse (a cell may nest "
                    f"{MAX_JSON_DEPTH} levels)")
        if not isinstance(obj, dict):
            return f"line {i + 1} is a JSON {type(obj).__name__}, not an object"
    return ""


def read_table(path: str, data: bytes):
    """(DataFrame, 1-based line numbers of the data rows or None) of a dataset file's bytes."""
    fmt = dataset_format(path)
    try:
        if fmt == "jsonl":
            return pd.read_json(io.BytesIO(data), lines=True, dtype=False), _jsonl_lines(data)
        if fmt == "json":
            return pd.read_json(io.BytesIO(data), dtype=False), None
        if fmt == "parquet":
            return pd.read_parquet(io.BytesIO(data)), None
        # every CSV cell as text: "007" stays "007", and an empty cell is "" (refused as empty where it matters)
        return pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, encoding="utf-8-sig"), None
    except Exception as exc:  # RecursionError included
        why = (_first_bad_json_line(data) if fmt == "jsonl" else "") or f"{type(exc).__name__}: {str(exc)[:300]}"
        raise DatasetError(f"dataset {path}: cannot read it as {fmt}: {why}") from exc


def _missing(v: Any) -> bool:
    """None, NaN (also numpy's), pandas' NA/NaT: a missing cell."""
    return v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v))


def _plain(v: Any) -> Any:
    """A cell as plain Python (numpy arrays from Parquet list columns → lists, numpy scalars → Python scalars), so
    an Example's meta survives JSON, deepcopy and `dataclasses.asdict`."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "tolist"):  # a numpy array → list, a numpy scalar → its Python scalar
        return _plain(v.tolist())
    return v


def _depth(v: Any) -> int:
    """Nesting levels of a cell (a scalar 0, [1] 1, [[1]] 2…), without recursion; counting stops past
    MAX_JSON_DEPTH."""
    deepest, stack = 0, [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        elif hasattr(x, "tolist") and getattr(x, "ndim", 0):  # a numpy array from a Parquet list column
            x = list(x)
        if isinstance(x, (list, tuple)):
            deepest = max(deepest, d + 1)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((y, d + 1) for y in x)
    return deepest


def _cell_bytes(v: Any) -> int:
    """A cell's weight toward `dataset.max_row_kb`: text as UTF-8, anything else as JSON."""
    if _missing(v):
        return 0
    if isinstance(v, str):
        return len(v.encode("utf-8", "surrogatepass"))
    return len(json.dumps(_plain(v), ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def answer_text(v: Any) -> str | None:
    """The answer cell as the reference string, or None if it cannot be one: a str stripped of surrounding space,
    an int as is, a finite float without a needless ".0" (42.0 → "42", 3.5 → "3.5")."""
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and math.isfinite(v):
        return str(int(v)) if v.is_integer() else repr(v)
    return None


def _row_problems(row: Mapping[str, Any], prompt: str, answer: str, fields: Sequence[str],
                  max_row_bytes: int | None = None) -> list[str]:
    deep = [c for c, v in row.items() if _depth(v) > MAX_JSON_DEPTH]
    if deep:  # nothing else is looked at: even its repr would recurse that deep
        return [f"field {c!r} nests more than {MAX_JSON_DEPTH} levels deep" for c in deep]
    if max_row_bytes is not None:
        size = sum(_cell_bytes(v) for v in row.values())
        if size > max_row_bytes:
            return [f"the row is {_kib(size)}, over the limit of {_kib(max_row_bytes)} (dataset.max_row_kb; raise "
                    f"it or shorten the row)"]
    out = []
    p = row.get(prompt)
    if _missing(p):
        out.append(f"field {prompt!r} (the prompt) is missing")
    elif not isinstance(p, str):
        out.append(f"field {prompt!r} (the prompt) is {type(p).__name__} {_SHORT.repr(p)}, not a string")
    elif not p.strip():
        out.append(f"field {prompt!r} (the prompt) is empty")
    a = row.get(answer)
    if _missing(a):
        out.append(f"field {answer!r} (the answer) is missing")
    elif answer_text(a) is None:
        out.append(f"field {answer!r} (the answer) is {type(a).__name__} {_SHORT.repr(a)}, not a string or a finite "
                   "number")
    elif not answer_text(a):
        out.append(f"field {answer!r} (the answer) is empty")
    for f in fields:
        v = row.get(f)
        if _missing(v):
            out.append(f"field {f!r} is missing")
    return out


def parse_rows(path: str, data: bytes, name: str, prompt: str, answer: str, fields: Sequence[str],
               verifier: str = "exact", max_row_bytes: int | None = None) -> tuple[list[Example], int]:
    """(the valid, deduplicated examples in file order, the number of data rows) of a dataset file's bytes; a
    DatasetError naming every bad row (up to MAX_BAD_ROWS) if any row is bad, including a row whose answer the
    `verifier` cannot use (`domains.verifiers.answer_problem`: no number for numeric, no such option for choice…),
    a row over `max_row_bytes` (None: no limit) and a cell nested deeper than MAX_JSON_DEPTH. Only oversized rows:
    the error's `field` is "max_row_kb"."""
    df, lines = read_table(path, data)
    columns = [str(c) for c in df.columns]
    absent = [c for c in (prompt, answer, *fields) if c not in columns]
    if absent:
        raise DatasetError(f"dataset {path}: no column {', '.join(map(repr, absent))} (columns: {', '.join(columns)}); "
                           f"set dataset.prompt / dataset.answer / dataset.fields to the column names")
    cols = {c: df[c].tolist() for c in dict.fromkeys((prompt, answer, *fields))}
    n = len(df)
    bad: list[str] = []
    n_bad = n_big = 0
    out: list[Example] = []
    seen: set[str] = set()
    for i in range(n):
        row = {c: v[i] for c, v in cols.items()}
        problems = _row_problems(row, prompt, answer, fields, max_row_bytes)
        extra = {} if problems else {f: _plain(row[f]) for f in fields}
        if not problems and (why := answer_problem(verifier, answer_text(row[answer]), extra)):
            problems = [f"field {answer!r} (the answer): {why} (verifier {verifier!r})"]
        if problems:
            n_bad += 1
            n_big += "dataset.max_row_kb" in problems[0]
            if len(bad) < MAX_BAD_ROWS:
                where = f"row {i}" + (f" (line {lines[i]})" if lines is not None and i < len(lines) else "")
                bad.append(f"  {where}: " + "; ".join(problems))
            continue
        p = row[prompt]
        if p in seen or n_bad:  # after a bad row only the check goes on: nothing is used
            continue
        seen.add(p)
        out.append(Example(name, p, answer_text(row[answer]), 1, {"row": extra, "index": i}))
    if n_bad:
        more = f"\n  … and {n_bad - len(bad)} more (the first {MAX_BAD_ROWS} shown)" if n_bad > len(bad) else ""
        lines_note = ", lines 1-based" if lines is not None else ""
        raise DatasetError(f"domain {name!r}: dataset {path} has {n_bad} bad row(s) of {n} (rows are 0-based data rows"
                           f"{lines_note}); fix or drop them:\n" + "\n".join(bad) + more,
                           "max_row_kb" if n_big == n_bad else "")
    return out, n


class DatasetDomain(Domain):
    """A domain whose examples are the rows of a dataset file (module docstring). `verifier` is a spec for
    `domains.verifiers.get_verifier` (exact, numeric, choice, regex:<pattern>, math, code)."""

    description = "Prompts and reference answers from a dataset file."
    # a domain rewarded by a model (`reward:`; domains/model_reward.py): its kind, and whether `verify` is a ground
    # truth (`reward.truth`) that evaluation reports as the score; None / False for a verifier-rewarded domain
    reward_kind: str | None = None
    has_truth: bool = False

    def __init__(self, name: str, path: str, prompt: str = "prompt", answer: str = "answer",
                 fields: Sequence[str] = (), system: str = "", max_new_tokens: int | None = None,
                 verifier: str = "exact", max_file_mb: float = DEFAULT_MAX_FILE_MB,
                 max_row_kb: float = DEFAULT_MAX_ROW_KB):
        self.name = name
        self.path, self.prompt_field, self.answer_field = str(path), prompt, answer
        self.fields = tuple(fields)
        self.system = system or ""
        self.max_new_tokens = max_new_tokens
        self.verifier_spec = verifier
        self.max_file_bytes, self.max_row_bytes = int(max_file_mb * 2 ** 20), int(max_row_kb * 2 ** 10)
        self.verifier: Callable[[str, str, Mapping[str, Any]], float] = get_verifier(verifier)
        super().__init__(difficulty=1)

    def setup(self) -> None:
        dataset_format(self.path)  # an unknown suffix fails before any download
        try:
            data, digest = read_dataset(self.path, self.max_file_bytes)
        except DatasetLimitError as exc:
            raise DatasetError(f"domain {self.name!r}: {exc}", exc.field) from None
        except FileNotFoundError:
            raise DatasetError(f"domain {self.name!r}: dataset {self.path} not found", "path") from None
        except OSError as exc:
            raise DatasetError(f"domain {self.name!r}: cannot read dataset {self.path}: {type(exc).__name__}: {exc}",
                               "path") from exc
        self.sha256 = digest
        self._key = (digest, dataset_format(self.path), self.name, self.prompt_field, self.answer_field, self.fields,
                     self.verifier_spec, self.max_row_bytes)
        examples, n_rows, _ = self._parsed(data)
        if not examples:
            raise DatasetError(f"domain {self.name!r}: dataset {self.path} has no rows")
        self.max_answer_chars = max(len(ex.answer) for ex in examples)

    def _parsed(self, data: bytes | None = None) -> tuple[tuple[Example, ...], int, dict[str, list[Example]]]:
        """(examples, rows read, examples by split) from the process-wide cache, parsed on a miss. The rows live
        there, not on the instance, so the domain stays small wherever it is serialised (a Prefect flow run's
        parameters hold the run context, domains included, and are limited to 512 KB)."""
        hit = _PARSED.get(self._key)
        if hit is None:
            if data is None:
                data, _ = read_dataset(self.path, self.max_file_bytes)
            examples, n_rows = parse_rows(self.path, data, self.name, self.prompt_field, self.answer_field,
                                          self.fields, self.verifier_spec, self.max_row_bytes)
            by_split: dict[str, list[Example]] = {s: [] for s in SPLITS}
            for ex in examples:
                by_split[prompt_split(ex.prompt)].append(ex)
            hit = (tuple(examples), n_rows, by_split)
            _PARSED.put(self._key, hit, len(data))  # the rows weigh about what their file does
        return hit

    @property
    def examples(self) -> tuple[Example, ...]:
        """Every distinct row, in file order."""
        return self._parsed()[0]

    @property
    def n_rows(self) -> int:
        """Rows read from the file (before deduplication)."""
        return self._parsed()[1]

    @property
    def by_split(self) -> dict[str, list[Example]]:
        """The rows of each split (train, val, eval), in file order."""
        return self._parsed()[2]

    # -- the Domain interface ------------------------------------------------------------------------------------

    def generate(self, rng: random.Random) -> Example:
        """A random row (of any split); the splits come from `split`, which does not draw from here."""
        return rng.choice(self.examples)

    def score(self, example: Example, response: str) -> float:
        return self.verifier(response, example.answer, example.meta.get("row", {}))

    def is_correct(self, example: Example, response: object) -> bool:
        """The 0/1 accuracy: the verifier's full reward."""
        return self.verify(example, response) == 1.0

    @property
    def max_response_chars(self) -> int:
        """Generous: a response of the whole token budget must reach the verifier (a BPE token may hold ~16
        characters)."""
        return max(8192, 1024 + 16 * self.max_answer_chars, 32 * (self.max_new_tokens or 0))

    def split(self, split: str, n: int, seed: int) -> list[Example]:
        """n rows of the split, deterministic in (name, split, seed) and prefix-stable: the split's rows in a seeded
        shuffle, cut to n. More than the split has is a ValueError saying how many it has."""
        if split not in SPLITS:
            raise ValueError(f"domain {self.name!r}: split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"domain {self.name!r}: n must be a non-negative int, got {n!r}")
        rows = self.by_split[split]
        if n > len(rows):
            raise ValueError(f"domain {self.name!r}: the {split} split of dataset {self.path} has {len(rows)} rows "
                             f"(of {len(self.examples)} distinct prompts), {n} requested")
        order = list(range(len(rows)))
        random.Random(f"{self.name}|{split}|{seed}").shuffle(order)
        return [rows[i] for i in order[:n]]

    def check_sizes(self, needs: Mapping[str, Sequence[tuple[str, int]]]) -> None:
        """Refuse a dataset too small for the configured split sizes: `needs` maps a split to the (config field,
        n) pairs that ask it for rows; the ValueError says how many rows each split has and which fields ask more."""
        short = []
        for split, asks in needs.items():
            have = len(self.by_split[split])
            over = [(f, n) for f, n in asks if n > have]
            if over:
                asked = ", ".join(f"{f} = {n}" for f, n in over)
                short.append(f"the {split} split has {have} rows, but {asked} asks for more")
        if short:
            sizes = ", ".join(f"{s} {len(self.by_split[s])}" for s in SPLITS)
            raise ValueError(f"domain {self.name!r}: dataset {self.path} is too small: {'; '.join(short)} "
                             f"({self.n_rows} rows read, {len(self.examples)} distinct prompts, split by prompt hash "
                             f"into {sizes}); lower those settings or use a larger dataset")

    def token_budget(self, tokenizer) -> int:
        """Response budget in tokens: `dataset.max_new_tokens` if set, else twice the longest train answer in
        `tokenizer`'s tokens plus 8 (room for EOS and format)."""
        if self.max_new_tokens:
            return int(self.max_new_tokens)
        answers = sorted({ex.answer for ex in (self.by_split["train"] or self.examples)})
        ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
        return 2 * max(len(x) for x in ids) + 8

    def __repr__(self) -> str:
        return (f"DatasetDomain(name={self.name!r}, path={self.path!r}, rows={len(self.examples)}, "
                f"verifier={self.verifier_spec!r})")
