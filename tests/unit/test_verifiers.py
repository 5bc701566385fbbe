"""The standard verifiers (domains/verifiers.py) on hand-made cases: the forms each accepts, the tricky ones (trailing
text, thousands separators, fractions, a number in the middle, the wrong letter with the right number), the spec
errors, the math helper process (equivalence, a timeout, use off the main thread) and code in the real sandbox (pass,
a failed assert, an endless loop, exit tricks)."""
import pickle
import threading
import time

import pytest

from domains.code_verifier import extract_code
from domains.verifiers import VERIFIERS, answer_problem, final_number, get_verifier, math_expression
from sandbox.runner import isolation_support

pytestmark = pytest.mark.unit
NO_ROW: dict = {}


def test_names_and_spec_errors():
    assert VERIFIERS == ("exact", "numeric", "choice", "regex", "math", "code")
    for name in VERIFIERS:
        assert callable(get_verifier(name if name != "regex" else "regex:a+"))
    for bad, says in [("fuzzy", "unknown verifier 'fuzzy'"), ("numeric:abc", "'abc' is not a valid relative"),
                      ("numeric:-1", "not a valid relative tolerance"), ("numeric:nan", "not a valid"),
                      ("math:0", "not a valid timeout"), ("exact:1", "exact takes no argument"),
                      ("regex:", "regex needs a pattern"), ("regex:(ab", "'regex:(ab': the pattern does not compile")]:
        with pytest.raises(ValueError) as e:
            get_verifier(bad)
        assert says in str(e.value) and "valid verifiers: exact, numeric" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"missing \), unterminated subpattern at position 0"):
        get_verifier("regex:(ab")


def test_verifiers_pickle():  # a domain holding one may cross process boundaries
    for spec in ["exact", "numeric:0.01", "choice", r"regex:\d+", "math:1", "code:1"]:
        v = pickle.loads(pickle.dumps(get_verifier(spec)))
        assert v.spec == spec
    assert pickle.loads(pickle.dumps(get_verifier(r"regex:\d+")))("123", "", NO_ROW) == 1.0


def test_exact_strips_and_normalises_unicode():
    v = get_verifier("exact")
    assert v("  Paris\n", "Paris", NO_ROW) == 1.0
    assert v("Caf\u0065\u0301", "Caf\u00e9", NO_ROW) == 1.0  # e + combining acute == é after NFC
    assert v("paris", "Paris", NO_ROW) == 0.0 and v("", "Paris", NO_ROW) == 0.0


@pytest.mark.parametrize("text, value", [
    ("42", 42), ("so the answer is 42.", 42), ("1,000", 1000), ("1,234,567 apples", 1234567), ("1\u2009000", 1000),
    ("1\u202f000\u202f000", 10**6), ("1e3", 1000), ("2.5E-2", 0.025), ("-2.5", -2.5), ("\u22122.5", -2.5), (".5", 0.5),
    ("3/4", 0.75), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75), ("$1,234.50", 1234.5), ("-$5", -5), ("50%", 50),
    ("\\boxed{42}. Check: 6*7 = 42, also 43", 42), ("First 7 apples, then 5 more: 12 in total.", 12),
    ("pages 10-12", 12), ("x = -3", -3), ("3 100", 100), ("1,2,3", 3),
])
def test_final_number_forms(text, value):
    assert final_number(text) == pytest.approx(value)


def test_numeric_scores():
    v = get_verifier("numeric")
    assert v("Adding them up, the answer is 1,000.", "1000", NO_ROW) == 1.0  # thousands separator + trailing text
    assert v("3/4", "0.75", NO_ROW) == 1.0 and v("0.75", "3/4", NO_ROW) == 1.0  # fractions, both ways
    assert v("It is 1e3", "1,000", NO_ROW) == 1.0
    assert v("The total is $1,234.50 today", "1234.5", NO_ROW) == 1.0
    assert v("50%", "50", NO_ROW) == 1.0 and v("0.5", "50%", NO_ROW) == 0.0  # '%' is ignored, not divided
    # the final number counts: a right number in the middle followed by a different one is wrong, and vice versa
    assert v("I first got 42 but then 41", "42", NO_ROW) == 0.0
    assert v("Not 41: after checking, 42", "42", NO_ROW) == 1.0
    assert v("I don't know", "42", NO_ROW) == 0.0 and v("", "42", NO_ROW) == 0.0
    assert v("#### 72", "Natalia sold 48/2 = 24 clips in May. #### 72", NO_ROW) == 1.0  # the answer's final number
    assert v("1000.0005", "1000", NO_ROW) == 1.0 and v("1000.01", "1000", NO_ROW) == 0.0  # rel 1e-6
    assert get_verifier("numeric:0.01")("1005", "1000", NO_ROW) == 1.0
    assert v("1e-10", "0", NO_ROW) == 1.0 and v("1e-8", "0", NO_ROW) == 0.0  # absolute 1e-9 around zero
    assert v("9" * 5000, "1", NO_ROW) == 0.0  # over Python's int-string limit: no number, no exception
    with pytest.raises(ValueError, match="numeric verifier: the answer 'n/a' has no number"):
        v("1", "n/a", NO_ROW)


def test_choice_scores():
    v = get_verifier("choice")
    row = {"choices": ["12", "15", "18"]}
    for good in ["B", "b", "(B)", "B)", "B.", "Answer: B", "The answer is B.", "The answer is (B) 15", "**B**",
                 "\\boxed{B}", "B) 15", "15", " 15. "]:
        assert v(good, "B", row) == 1.0, good
    assert v("A) 15", "B", row) == 0.0  # the right number with the wrong letter: the label counts
    assert v("(A) 15", "B", row) == 0.0
    for bad in ["A", "C", "(A) or (B)", "The answer is A. No wait, the answer is B.", "I am not sure", "", "16"]:
        assert v(bad, "B", row) == 0.0, bad
    assert v("The answer is B", "15", row) == 1.0  # the answer given as the option text
    assert v("B", "15", {"choices": {"A": "12", "B": "15"}}) == 1.0  # choices as a dict
    assert v("E", "e", NO_ROW) == 1.0 and v("Answer: D", "C", NO_ROW) == 0.0  # A-E without choices
    with pytest.raises(ValueError, match="the answer '21' is neither an option letter"):
        v("B", "21", row)
    assert answer_problem("choice", "F", NO_ROW) is not None and answer_problem("choice", "15", row) is None


def test_regex_fullmatch_on_the_stripped_response():
    v = get_verifier(r"regex:\d{3}-\d{4}")
    assert v(" 555-1234\n", "ignored", NO_ROW) == 1.0
    assert v("call 555-1234", "", NO_ROW) == 0.0 and v("555-12345", "", NO_ROW) == 0.0
    assert get_verifier("regex:(yes|no)")("no", "", NO_ROW) == 1.0  # ':' after the name only splits once
    assert get_verifier("regex:a:b")("a:b", "", NO_ROW) == 1.0


def test_math_expression_extraction():
    assert math_expression("so x = 2x + 2.") == "2x + 2"
    assert math_expression("The answer is \\frac{1}{2}") == "((1)/(2))"
    assert math_expression("\\boxed{\\sqrt{8}} = wrong") == "sqrt(8)"


def test_math_equivalence():
    v = get_verifier("math")
    assert v("2*x+2", "2*(x+1)", NO_ROW) == 1.0
    assert v("The answer is 2x + 2.", "2(x+1)", NO_ROW) == 1.0  # implicit multiplication, trailing period
    assert v("$\\boxed{\\frac{x^2-1}{x-1}}$", "x+1", NO_ROW) == 1.0
    assert v("sin(x)^2 + cos(x)^2", "1", NO_ROW) == 1.0 and v("2\\sqrt{2}", "sqrt(8)", NO_ROW) == 1.0
    assert v("\\frac{1}{2}", "0.5", NO_ROW) == 1.0 and v("1,000", "10^3", NO_ROW) == 1.0
    assert v("2*x+1", "2*(x+1)", NO_ROW) == 0.0 and v("y + 1", "x + 1", NO_ROW) == 0.0
    # refused before parsing, scored 0: too long, dunder, quotes, attribute access, unknown callables are symbols
    for hostile in ["x" * 201, "__import__('os')", "open('/etc/passwd')", "(1).real", "eval(1)", "lambda x: x"]:
        assert v(hostile, "1", NO_ROW) == 0.0, hostile
    with pytest.raises(ValueError, match="math verifier: the answer"):
        v("1", "x" * 300, NO_ROW)


def test_math_timeout_then_recovers_and_works_off_the_main_thread():
    v = get_verifier("math:0.5")
    t0 = time.monotonic()
    assert v("9^9^9", "1", NO_ROW) == 0.0  # a huge power: over the limit, the helper is killed
    assert time.monotonic() - t0 < 5
    out = []
    # the recovery: a fresh helper (one per process, shared by every math verifier), started from another thread; a
    # generous limit here, since its first sympy call on a loaded 2-core machine took over the 0.5 s (a flaky test)
    again = get_verifier("math:30")
    th = threading.Thread(target=lambda: out.append(again("(x+1)^2", "x^2+2x+1", NO_ROW)))
    th.start()
    th.join(60)
    assert out == [1.0]  # a fresh helper, started from another thread


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("```\ny = 1\n```") == "y = 1\n"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_code_in_the_sandbox():
    v = get_verifier("code:1")
    row = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}
    good = "Here you go:\n```python\ndef add(a, b):\n    print('noise ' * 20000)\n    return a + b\n```"
    if isolation_support() == "none":  # no namespaces here: the sandbox refuses python, loudly
        with pytest.raises(RuntimeError, match="the sandbox refused to run python"):
            v(good, "", row)
        return
    assert v(good, "", row) == 1.0  # loud output is discarded, not a failure
    assert v("def add(a, b):\n    return a - b", "", row) == 0.0  # an assert fails
    assert v("def add(a, b):\n    return a +", "", row) == 0.0  # a syntax error
    t0 = time.monotonic()
    assert v("```python\nwhile True:\n    pass\n```", "", row) == 0.0  # killed at the time limit
    assert time.monotonic() - t0 < 4
    for trick in ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"]:
        assert v(trick, "", row) == 0.0, trick  # leaving before the tests ran is not a pass
    assert v("def add(a, b): return a + b", "", {"tests": ["assert add(1, 1) == 2"]}) == 1.0  # tests as a list
    with pytest.raises(ValueError, match="the row needs a field 'tests'"):
        v("x = 1", "", NO_ROW)


def test_answer_problem_and_never_raising_on_responses():
    assert answer_problem("numeric", "abc") == "the answer 'abc' has no number"
    assert answer_problem("numeric", "3/4") is None and answer_problem("exact", "anything") is None
    assert answer_problem("numeric", 3) == "the answer must be a string, not int"
    assert "needs a field 'tests'" in answer_problem("code", "", {})
    weird = ["", "\x00", "\u2028" * 50, "A" * 10000, "(((((", "\\boxed{", "```", "1/0", "\\frac{1}{0}"]
    for spec, answer, row in [("exact", "x", NO_ROW), ("numeric", "1", NO_ROW), ("choice", "A", NO_ROW),
                              ("regex:a", "", NO_ROW), ("math", "x", NO_ROW)]:
        v = get_verifier(spec)
        for response in weird:
            assert v(response, answer, row) in (0.0, 1.0), (spec, response)
