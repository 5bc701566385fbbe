"""Rows a `code` dataset cannot be scored on safely (issues 34, 52): tests the verifier cannot decide by itself
(helper statements, a `check` function, an always-true tuple, a bytes literal) or no tests at all are refused when
the domain loads, all at once, each named by its row and line, before anything trains; the good rows are kept
as they are.
The forged solutions themselves are in tests/unit/test_code_verifier_forgery.py."""
from __future__ import annotations

import json

import pytest

from domains.dataset import DatasetDomain, DatasetError

pytestmark = pytest.mark.unit


def test_untranslatable_code_rows_are_refused_naming_each(tmp_path):
    rows = [{"prompt": "add", "answer": "-", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
            {"prompt": "helper", "answer": "-", "tests": "x = 1\nassert add(x, 2) == 3"},
            {"prompt": "bytes", "answer": "-", "tests": ["assert f() == b'x'"]},
            {"prompt": "none", "answer": "-", "tests": None},
            {"prompt": "tuple", "answer": "-", "tests": ["assert (f(1) == 3, f(2) == 4)"]},
            {"prompt": "check", "answer": "-", "tests": "def check(f):\n    assert f(1) == 2\ncheck(g)"},
            {"prompt": "pair", "answer": "-", "tests": ["assert pair(1) == (1, 2)", "assert not odd(2)"]}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as e:
        DatasetDomain("code_rows", str(path), fields=["tests"], verifier="code")
    msg = str(e.value)
    assert "has 5 bad row(s) of 7" in msg, msg
    for row, says in [(1, "field 'tests' line 1: a statement of type Assign"),
                      (2, "the expected value \"b'x'\" is a bytes, not plain data"),
                      (3, "field 'tests' is missing"),
                      (4, "`(f(1) == 3, f(2) == 4)` asserts a tuple, which Python finds always true"),
                      (5, "field 'tests' line 1: a statement of type FunctionDef")]:
        assert f"row {row} (line {row + 1}): " in msg and says in msg.split(f"row {row} (line {row + 1}): ")[1], \
            (row, msg)
    for good in (0, 6):
        assert f"row {good} " not in msg
    path.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i in (0, 6)))
    dom = DatasetDomain("code_rows", str(path), fields=["tests"], verifier="code")
    assert dom.n_rows == 2
