"""Preference data for reward models, and the one rendering of the text a reward model scores.

    pairs = load_preferences(path, margin="margin")      # (PreferencePair, ...) in file order; DatasetError if bad
    train, val = split_pairs(pairs, val_fraction=0.1)    # held out by the hash of the prompt
    ids = reward_input_ids(tok, prompt, response, system, mode, max_length)

A preference file is a table like a dataset domain's (domains/dataset.py: `.jsonl`, `.json`, `.parquet` or `.csv`, a
local path or an fsspec URL such as `s3://…`, read once per process through `infra.datasets.read_dataset`, with the
same `dataset.max_file_mb` / `max_row_kb` limits and the same JSON-depth guard): one row per pair, columns `prompt`,
`chosen`, `rejected` (names configurable) and optionally a numeric margin column (how much better the chosen response
is: the Bradley–Terry loss's m, training/rm_math.py). Every row is checked before anything trains; all bad rows (up to
MAX_BAD_ROWS shown) are refused in one DatasetError naming the file, each row (0-based, and its 1-based line for
JSONL) and the missing, empty or non-text field. Rows are not deduplicated: several pairs per prompt are normal.

The held-out split is by a hash of the prompt (sha256, as `domains.base.prompt_split`): every pair of one prompt
lands on the same side, whatever the file order or the seed, so the validation accuracy measures prompts the model
never trained on.

`reward_input_ids` is what a reward model reads: the prompt rendered exactly as every stage renders it for the
policy (`infra.chat.render_prompt_ids`: the chat template with the system message, or BOS + prompt) followed by the
response and the turn's end (`infra.chat.completion_ids`), i.e. the ids the policy produced when it answered. The RM
trainer (training/reward_main.py) and a domain rewarded by a served RM both call it, so the model is scored on what
it was trained on.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

from domains.base import MAX_BAD_ROWS
from domains.dataset import (_SHORT, MAX_JSON_DEPTH, DatasetError, _cell_bytes, _depth, _kib, _missing, dataset_format,
                             read_table)
from infra.chat import completion_ids, render_prompt_ids
from infra.datasets import DEFAULT_MAX_FILE_MB, DEFAULT_MAX_ROW_KB, DatasetLimitError, read_dataset


@dataclass(frozen=True)
class PreferencePair:
    """One row: `chosen` is preferred over `rejected` as an answer to `prompt`, by at least `margin` (0: any)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    index: int = 0  # the 0-based data row it came from


def _text_problem(row: dict, col: str, what: str) -> str | None:
    v = row.get(col)
    if _missing(v):
        return f"field {col!r} ({what}) is missing"
    if not isinstance(v, str):
        return f"field {col!r} ({what}) is {type(v).__name__} {_SHORT.repr(v)}, not a string"
    if not v.strip():
        return f"field {col!r} ({what}) is empty"
    return None


def _margin_value(v: Any) -> float | None:
    """A margin cell as a finite float (CSV cells are text: "0.5"), or None if it is none."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _problems(row: dict, cols: dict[str, str], margin: str | None, max_row_bytes: int | None) -> list[str]:
    deep = [c for c, v in row.items() if _depth(v) > MAX_JSON_DEPTH]
    if deep:
        return [f"field {c!r} nests more than {MAX_JSON_DEPTH} levels deep" for c in deep]
    if max_row_bytes is not None:
        size = sum(_cell_bytes(v) for v in row.values())
        if size > max_row_bytes:
            return [f"the row is {_kib(size)}, over the limit of {_kib(max_row_bytes)} (max_row_kb; raise it or "
                    "shorten the row)"]
    out = [p for what, col in cols.items() if (p := _text_problem(row, col, what))]
    if not out and row[cols["the chosen response"]] == row[cols["the rejected response"]]:
        out.append("the chosen and the rejected response are the same text (the pair prefers nothing)")
    if margin is not None:
        v = row.get(margin)
        if _missing(v):
            out.append(f"field {margin!r} (the margin) is missing")
        elif _margin_value(v) is None:
            out.append(f"field {margin!r} (the margin) is {type(v).__name__} {_SHORT.repr(v)}, not a finite number")
    return out


def parse_preferences(path: str, data: bytes, prompt: str = "prompt", chosen: str = "chosen",
                      rejected: str = "rejected", margin: str | None = None,
                      max_row_bytes: int | None = None) -> tuple[PreferencePair, ...]:
    """The pairs of a preference file's bytes, in file order; a DatasetError naming the file and every bad row (up to
    MAX_BAD_ROWS), or the absent columns, or an empty file."""
    df, lines = read_table(path, data)
    if not len(df):
        raise DatasetError(f"preference data {path} has no rows")
    columns = [str(c) for c in df.columns]
    wanted = {"the prompt": prompt, "the chosen response": chosen, "the rejected response": rejected}
    absent = [c for c in (*wanted.values(), *([margin] if margin else [])) if c not in columns]
    if absent:
        raise DatasetError(f"preference data {path}: no column {', '.join(map(repr, absent))} (columns: "
                           f"{', '.join(columns)}); set prompt / chosen / rejected / margin_column to the column names")
    cells = {c: df[c].tolist() for c in dict.fromkeys((*wanted.values(), *([margin] if margin else [])))}
    bad: list[str] = []
    n_bad = 0
    out: list[PreferencePair] = []
    for i in range(len(df)):
        row = {c: v[i] for c, v in cells.items()}
        problems = _problems(row, wanted, margin, max_row_bytes)
        if problems:
            n_bad += 1
            if len(bad) < MAX_BAD_ROWS:
                where = f"row {i}" + (f" (line {lines[i]})" if lines is not None and i < len(lines) else "")
                bad.append(f"  {where}: " + "; ".join(problems))
            continue
        m = _margin_value(row[margin]) if margin else 0.0
        out.append(PreferencePair(row[prompt], row[chosen], row[rejected], float(m), i))
    if n_bad:
        more = f"\n  … and {n_bad - len(bad)} more (the first {MAX_BAD_ROWS} shown)" if n_bad > len(bad) else ""
        note = ", lines 1-based" if lines is not None else ""
        raise DatasetError(f"preference data {path} has {n_bad} bad row(s) of {len(df)} (rows are 0-based data rows"
                           f"{note}); fix or drop them:\n" + "\n".join(bad) + more)
    return tuple(out)


def load_preferences(path: str, prompt: str = "prompt", chosen: str = "chosen", rejected: str = "rejected",
                     margin: str | None = None, max_file_mb: float = DEFAULT_MAX_FILE_MB,
                     max_row_kb: float = DEFAULT_MAX_ROW_KB) -> tuple[PreferencePair, ...]:
    """Read and check a preference file (module docstring); DatasetError naming the file when it cannot be read, is
    too large, or has bad rows."""
    dataset_format(path)  # an unknown suffix fails before any download
    try:
        data, _ = read_dataset(path, int(max_file_mb * 2 ** 20))
    except DatasetLimitError as exc:
        raise DatasetError(f"preference data: {exc}", exc.field) from None
    except FileNotFoundError:
        raise DatasetError(f"preference data {path} not found", "path") from None
    except OSError as exc:
        raise DatasetError(f"preference data {path}: cannot read it: {type(exc).__name__}: {exc}", "path") from exc
    return parse_preferences(path, data, prompt, chosen, rejected, margin, int(max_row_kb * 2 ** 10))


def held_out(prompt: str, fraction: float) -> bool:
    """Whether `prompt`'s pairs are held out: a uniform draw in [0, 1) from the prompt's sha256, below `fraction`."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return h / 2 ** 64 < fraction


def split_pairs(pairs: Sequence[PreferencePair], val_fraction: float) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, val) by `held_out(prompt, val_fraction)`, each in file order. ValueError when either side is empty
    (too few prompts for the fraction)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train = [p for p in pairs if not held_out(p.prompt, val_fraction)]
    val = [p for p in pairs if held_out(p.prompt, val_fraction)]
    if not train or not val:
        prompts = len({p.prompt for p in pairs})
        raise ValueError(f"val_fraction {val_fraction} of {len(pairs)} pairs ({prompts} distinct prompts) leaves "
                         f"{len(train)} to train and {len(val)} held out; both need some: change val_fraction or "
                         "give val_data")
    return train, val


def reward_input_ids(tokenizer, prompt: str, response: str, system: str = "", mode: str = "auto",
                     max_length: int | None = None) -> list[int]:
    """The ids a reward model scores for `response` to `prompt`: `render_prompt_ids(prompt, system, mode)` +
    `completion_ids(response, mode)` (the response and the turn's end: EOS or the template's end-of-turn token), as
    the policy produced them. Longer than `max_length`: the last `max_length` ids (the start of the prompt is cut,
    never the end of the response the score is read at)."""
    ids = render_prompt_ids(tokenizer, prompt, system, mode) + completion_ids(tokenizer, response, mode)
    if max_length is not None and len(ids) > max_length:
        ids = ids[len(ids) - max_length:]
    return ids
