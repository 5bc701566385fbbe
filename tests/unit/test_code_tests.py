"""`domains.code_tests`: the asserts of a `code` row parsed into solution calls and a plan the parent evaluates on
plain values (issue 52). Pure: no sandbox; the values are written by hand as the child would report them."""
from __future__ import annotations

import pytest

from domains.code_tests import CallFailed, calls_of, holds, parse_code_tests

pytestmark = pytest.mark.unit


def _one(src: str):
    (test,) = parse_code_tests(src)
    return test


def test_calls_are_split_from_what_the_parent_decides():
    t = _one("assert f(1) == 2 and g('a', k=[1]) == 3")
    assert t.calls == ("f(1)", "g('a', k=[1])")
    assert t.plan == ("and", (("cmp", ("call", "f(1)"), (("==", ("const", 2)),)),
                              ("cmp", ("call", "g('a', k=[1])"), (("==", ("const", 3)),))))
    tests = parse_code_tests("assert f(1) == 2\nassert f(1) != 3\nassert Solution().run([1, 2]) == -1")
    assert calls_of(tests) == ["f(1)", "Solution().run([1, 2])"]  # one value per distinct call
    assert (tests[0].expr, tests[0].expected) == ("f(1)", 2) and tests[2].expected == -1
    assert tests[1].expected is None and tests[1].expr == "f(1) != 3"


@pytest.mark.parametrize("src, values, want", [
    ("assert f(1) == 2 and g(2) == 3", {"f(1)": 2, "g(2)": 3}, "pass"),
    ("assert f(1) == 2 and g(2) == 3", {"f(1)": 2, "g(2)": 4}, "wrong"),
    ("assert (f(1) == 2) is True", {"f(1)": 3}, "wrong"),
    ("assert all([f(1) == 2, f(2) == 3])", {"f(1)": 2, "f(2)": 3}, "pass"),
    ("assert any([f(1) == 2, f(2) == 3])", {"f(1)": 0, "f(2)": 0}, "wrong"),
    ("assert not f(1) != 2", {"f(1)": 2}, "pass"),
    ("assert f(1).startswith('ab')", {"f(1)": "abc"}, "pass"),
    ("assert f(1).startswith('ab')", {"f(1)": ["ab"]}, "wrong"),  # no .startswith on a list
    ("assert math.isclose(f(1), 0.5, rel_tol=1e-6)", {"f(1)": 0.5000004}, "pass"),  # |d| = 4e-7 <= 5e-7
    ("assert math.isclose(f(1), 0.5, rel_tol=1e-6)", {"f(1)": 0.5000006}, "wrong"),  # 6e-7 > 5e-7
    ("assert math.isclose(f(1), 0.0, abs_tol=1e-3)", {"f(1)": 0.0009}, "pass"),
    ("assert abs(f(1) - 0.5) < 1e-9", {"f(1)": float("nan")}, "wrong"),
    ("assert f(1) in (1, 2)", {"f(1)": 2}, "pass"),
    ("assert f(1) is None", {"f(1)": 0}, "wrong"),
    ("assert type(f(1)) is int", {"f(1)": True}, "wrong"),  # a bool is not an int here
    ("assert isinstance(f(1), (int, float))", {"f(1)": 1.5}, "pass"),
    ("assert sorted(f(1), reverse=True) == [3, 2]", {"f(1)": [2, 3]}, "pass"),
    ("assert ', '.join(f(1)) == 'a, b'", {"f(1)": ["a", "b"]}, "pass"),
    ("assert f(1)[1:] == [2] and len(f(1)) == 2", {"f(1)": [1, 2]}, "pass"),
    ("assert f(1) == {'a': (1, 2)}", {"f(1)": {"a": (1, 2)}}, "pass"),
    ("assert f(1) == {'a': (1, 2)}", {"f(1)": {"a": [1, 2]}}, "wrong"),  # a list is not the tuple asked for
    ("assert f(1)", {"f(1)": True}, "pass"),
    ("assert f(1)", {"f(1)": 1}, "wrong"),  # strict truth: 1 is not True
    ("assert not f(1)", {"f(1)": []}, "wrong"),
    ("assert not f(1)", {"f(1)": False}, "pass"),
    ("assert f(1) ** 2 == 4", {"f(1)": 2}, "pass"),
    ("assert f(1) ** 100 == 0", {"f(1)": 2}, "wrong"),  # an exponent over 64 is refused, not computed
    ("assert f(1) // 0 == 1", {"f(1)": 1}, "wrong"),  # ZeroDivisionError: a failed test
    ("assert f(1) == 2 or f(2) == 3", {"f(1)": 2, "f(2)": CallFailed("error", "boom")}, "pass"),  # not needed
    ("assert f(1) == 2 or f(2) == 3", {"f(1)": 1, "f(2)": CallFailed("error", "boom")}, "error"),
    ("assert f(1) == 2", {"f(1)": CallFailed("not_plain", "a Liar")}, "not_plain"),
])
def test_the_parent_evaluates_on_plain_values(src, values, want):
    assert holds(_one(src), values)[0] == want, holds(_one(src), values)


@pytest.mark.parametrize("src, says", [
    ("assert (f(1) == 2, f(2) == 3)", "asserts a tuple, which Python finds always true"),
    ("assert [f(1) == 2]", "asserts a list"),
    ("assert all(f(i) == i for i in range(3))", "(GeneratorExp) is not supported"),
    ("assert f(1).__eq__(2)", "a call the verifier cannot decide"),
    ("assert f(x) == 1", "`f(x)` is a call the verifier cannot decide"),
    ("assert f(1) == y", "the name `y` is neither a call to the solution nor a known type"),
    ("assert f(1) is 2", "only `is None/True/False`"),
    ("assert f(1) == b'x'", "is a bytes, not plain data"),
    ("assert 2 == 2", "calls nothing of the solution"),
    ("assert math.fsum([f(1)]) == 1", "math.fsum is not a supported helper"),
    ("assert sorted(f(1), key=len) == []", "sorted takes only positional arguments and reverse="),
    ("assert f(1) == 2, msg()", "the assert's message must be a literal"),
    ("x = 1\nassert f(x) == 2", "line 1: a statement of type Assign"),
])
def test_what_the_parent_cannot_decide_is_refused_naming_the_line(src, says):
    with pytest.raises(ValueError, match="field 'tests' line 1") as e:
        parse_code_tests(src)
    assert says in str(e.value), str(e.value)
