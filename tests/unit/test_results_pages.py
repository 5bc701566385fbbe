"""The results pages say only what their JSONs say (issue 56, item 5).

Rows checked: every markdown table row of docs/results.md, the rows of README.md's "## Results" table, and every
table row of bench/README.md (there only the rows that cite a result JSON matter).

Citations in a row:

- ``git show REV:PATH`` (REV a commit, optionally ``~N``) points into history: the file need not exist now (a later
  run overwrote it), but ``git cat-file -e REV:PATH`` must succeed, i.e. the commit exists and held that file.
  Skipped outside a git checkout.
- Any other token ending in ``.json``: ``../bench/results/X.json``, ``bench/results/X.json``, ``results/X.json`` or a
  bare ``X.json`` (read as bench/results/X.json). A brace form such as ``overhead_ab_2026-11-29/{before,after}_{1,2,3}.json``
  is expanded. Tokens with a placeholder (``<tag>``, ``<card>``, ``$OUT/``) are patterns, not files, and are
  skipped; tokens under another folder (runs/, /tmp/, ...) are not result files and are skipped;
  ``NOT_RESULT_FILES`` names the remaining exceptions and why.

Every current file cited must exist under bench/results/, parse, and carry ``meta.commit``: a commit of this
repository (a ``meta`` reconstructed from git history, ``reconstructed: true``, counts). ``META_COMMIT_NULL`` lists
the runs made from plain copies outside a checkout, whose ``meta.commit`` is null by construction (their row says so).

The met / not-met rule. A JSON's verdict is the first boolean found of: top-level ``met``, ``target.met``,
``headline.met.all`` (every target the bench judges). A row's words are read after dropping struck-through text
(``~~...~~``: void figures) and the ``git show`` spans: "not met" in any form the tables use (``**not met**``,
``not met:``, ``(not met)``) and "met" not preceded by "not" (``**met**``, ``met:``, ``wall met``). Against every
cited JSON (current or ``git show``) that has a verdict:

- a JSON with ``false`` requires the row to say "not met" somewhere. A row may give the sub-targets separately
  ("wall **met**; CPU **not met**"), but it may not leave the miss unsaid ("2× missed" is not enough: that is how
  the weight-push row went wrong);
- if every such JSON says ``true``, the row must not say "not met" (it would contradict its JSON);
- a JSON with ``true`` in a row that also cites a ``false`` one requires a plain "met" too.

A row that cites no JSON with a verdict is not judged; neither is a row's wording beyond these two words. Not
judged either: bench/README.md's tables (a catalogue of each bench's result file, no results in them) and the rows in
``VERDICT_NOT_JUDGED``, which cite a JSON for a side figure rather than for its target.
"""
from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PAGES = ("docs/results.md", "README.md", "bench/README.md")

# Cited .json names that are not committed result files, and why.
NOT_RESULT_FILES = {
    "gpu_check.json": "bench/README's table gives it as gpu_check.py's default --out; the committed runs are "
                      "gpu_check_h100*.json",
}
# Runs made from plain copies of two trees outside a git checkout: the harness wrote commit null (the row says so).
META_COMMIT_NULL = {f"overhead_ab_2026-11-29/{a}_{i}.json" for a in ("before", "after") for i in (1, 2, 3)}

# Rows (by a unique piece of their text) that cite a JSON for a figure other than its target, and why.
VERDICT_NOT_JUDGED = {
    "push per OPD step in `overhead.py`": "cites overhead.json for the weight push's share of a step; that run's "
                                          "overhead target is judged in the peers table's row",
}
VERDICT_PAGES = ("docs/results.md", "README.md")

GIT_SHOW = re.compile(r"git show ([0-9a-f]{7,40}(?:~\d+)?):([\w./-]+?\.json)")
JSON_TOKEN = re.compile(r"[\w./{},<>$-]*\.json")
STRUCK = re.compile(r"~~.*?~~")
NOT_MET = re.compile(r"\bnot\W{0,4}met\b", re.IGNORECASE)
MET = re.compile(r"(?<![A-Za-z._`])met\b", re.IGNORECASE)
SEPARATOR = re.compile(r"^\|[\s|:-]+\|?\s*$")
HEX = re.compile(r"^[0-9a-f]{7,40}$")


def _table_rows(page: str) -> list[tuple[int, str]]:
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    if page == "README.md":  # only the results table
        start = next(i for i, l in enumerate(lines) if l.strip() == "## Results")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        span = range(start, end)
    else:
        span = range(len(lines))
    return [(i + 1, lines[i]) for i in span if lines[i].startswith("|") and not SEPARATOR.match(lines[i])]


def _expand_braces(token: str) -> list[str]:
    parts = re.split(r"(\{[^{}]*\})", token)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _result_path(token: str) -> str | None:
    """bench/results-relative path of a cited token, or None when it is not a result file."""
    if "<" in token or "$" in token:
        return None
    for prefix in ("../bench/results/", "bench/results/", "results/"):
        if token.startswith(prefix):
            return token[len(prefix):]
    if "/" in token:
        rel = token
        return rel if (RESULTS / rel.split("/")[0]).is_dir() else None
    return token


def _citations(row: str) -> tuple[list[str], list[tuple[str, str]]]:
    history = GIT_SHOW.findall(row)
    rest = GIT_SHOW.sub(" ", row)
    current = []
    for token in JSON_TOKEN.findall(rest):
        for one in _expand_braces(token):
            rel = _result_path(one)
            if rel is not None and rel not in NOT_RESULT_FILES and rel not in current:
                current.append(rel)
    return current, history


def _rows_with_citations():
    out = []
    for page in PAGES:
        for line_no, row in _table_rows(page):
            current, history = _citations(row)
            if current or history:
                out.append((f"{page}:{line_no}", row, current, history))
    return out


ROWS = _rows_with_citations()


def _in_git() -> bool:
    return (REPO / ".git").exists() and subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True).returncode == 0


def _verdict(data) -> bool | None:
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("met"), bool):
        return data["met"]
    target = data.get("target")
    if isinstance(target, dict) and isinstance(target.get("met"), bool):
        return target["met"]
    met = (data.get("headline") or {}).get("met") if isinstance(data.get("headline"), dict) else None
    if isinstance(met, dict) and isinstance(met.get("all"), bool):
        return met["all"]
    return None


def test_the_pages_cite_results():
    """The parser finds the pages' citations (a guard against a regex that silently matches nothing)."""
    assert len(ROWS) > 40
    cited = {rel for _, _, current, _ in ROWS for rel in current}
    assert {"weight_push.json", "trl_compare_sweep.json", "async_specialists.json"} <= cited
    assert any(history for _, _, _, history in ROWS)
    assert "overhead_ab_2026-11-29/before_1.json" in cited  # the brace form expands


@pytest.mark.parametrize("where,row,current,history", ROWS, ids=[r[0] for r in ROWS])
def test_cited_json_exists_parses_and_has_meta_commit(where, row, current, history):
    for rel in current:
        path = RESULTS / rel
        assert path.is_file(), f"{where} cites {rel}, which is not under bench/results/"
        data = json.loads(path.read_text(encoding="utf-8"))
        meta = data.get("meta") if isinstance(data, dict) else None
        assert isinstance(meta, dict) and "commit" in meta, f"{where}: {rel} has no meta.commit"
        if rel in META_COMMIT_NULL:
            assert meta["commit"] is None
            continue
        assert isinstance(meta["commit"], str) and HEX.match(meta["commit"]), f"{where}: {rel} meta.commit"


def test_meta_commits_and_history_citations_exist_in_git():
    if not _in_git():
        pytest.skip("not a git checkout")
    objects = []
    for where, _, current, history in ROWS:
        for rel in current:
            if rel in META_COMMIT_NULL or not (RESULTS / rel).is_file():
                continue
            commit = json.loads((RESULTS / rel).read_text(encoding="utf-8")).get("meta", {}).get("commit")
            if isinstance(commit, str):
                objects.append((where, f"{rel}: meta.commit", f"{commit}^{{commit}}"))
        for rev, path in history:
            objects.append((where, f"git show {rev}:{path}", f"{rev}:{path}"))
    query = "".join(obj + "\n" for _, _, obj in objects)
    out = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], input=query, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    missing = [f"{where}: {what}" for (where, what, _), line in zip(objects, out) if line.endswith(" missing")]
    assert not missing, "not in this repository's history:\n" + "\n".join(missing)


def _history_json(rev: str, path: str):
    out = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else None


@pytest.mark.parametrize("where,row,current,history", ROWS, ids=[r[0] for r in ROWS])
def test_row_met_words_match_the_json(where, row, current, history):
    if not where.startswith(VERDICT_PAGES) or any(key in row for key in VERDICT_NOT_JUDGED):
        return
    verdicts = {}
    for rel in current:
        path = RESULTS / rel
        if path.is_file():
            verdicts[rel] = _verdict(json.loads(path.read_text(encoding="utf-8")))
    if history and _in_git():
        for rev, path in history:
            verdicts[f"git show {rev}:{path}"] = _verdict(_history_json(rev, path))
    verdicts = {k: v for k, v in verdicts.items() if v is not None}
    if not verdicts:
        return
    text = GIT_SHOW.sub(" ", STRUCK.sub(" ", row))
    says_not_met = bool(NOT_MET.search(text))
    says_met = bool(MET.search(NOT_MET.sub(" ", text)))
    false = [k for k, v in verdicts.items() if v is False]
    true = [k for k, v in verdicts.items() if v is True]
    assert not false or says_not_met, f"{where}: {false} say met: false, the row never says 'not met'"
    if not false:
        assert not says_not_met, f"{where}: the row says 'not met', its JSON(s) {true} say met: true"
    else:
        assert not true or says_met, f"{where}: {true} say met: true, the row never says 'met'"
