"""The `code` verifier against forged solutions (issue 34): programs that try to score 1.0 without a correct `add`
by attacking the runner in their own process, not by solving the task. Every one must score 0.0, with a reason the
verifier's outcome counts (and the specialist's guard totals) record; correct solutions still score 1.0 and wrong
ones 0.0. The decision is the parent's: the child only ever sees the call expressions, never the expected values
or the test source (checked by watching the work dir the sandbox gets)."""
import time

import pytest

from domains.code_verifier import CODE_REASONS, code_report, judge_code_record, parse_code_tests
from domains.verifiers import answer_problem, get_verifier, verifier_outcomes
from sandbox.runner import isolation_support
from teachers.specialist import reward_outcome_counts

pytestmark = pytest.mark.unit
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(40, 2) == 42"
ROW = {"tests": TESTS}
needs_sandbox = pytest.mark.skipif(isolation_support() == "none",
                                   reason="no namespaces: the sandbox refuses python (test_verifiers covers that)")

FORGERIES = {
    # the four of the issue, adapted to the new runner
    "open_patched": "import builtins, io\nbuiltins.open = lambda *a, **k: io.StringIO('')\n"
                    "def add(a, b):\n    return 0\n",
    "compile_patched": "import builtins\n_c = builtins.compile\n"
                       "builtins.compile = lambda *a, **k: _c('True', '<x>', 'eval')\n",
    "frame_delimiter_and_exit": (
        "import sys, os, json\n"
        "f, delim = sys._getframe(), None\n"
        "while f is not None:\n"
        "    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
        "        if isinstance(v, str) and v.startswith('@@alloy-result-'):\n"
        "            delim = v\n"
        "    f = f.f_back\n"
        "delim = delim or sys.argv[-1]\n"
        "rec = json.dumps({'loaded': True, 'results': [{'v': True}] * 3})\n"
        "for fd in range(1, 8):\n"
        "    try:\n        os.write(fd, (delim + rec + '\\n').encode())\n    except OSError:\n        pass\n"
        "os._exit(0)\n"),
    "equals_everything": "class Any:\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = object.__hash__\n"
                         "def add(a, b):\n    return Any()\n",
    # more of the same family
    "int_subclass_equal_to_all": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                                 "    __hash__ = int.__hash__\n"
                                 "def add(a, b):\n    return I(0)\n",
    "reads_the_tests": (
        "import os, re, glob\n"
        "_found = {}\n"
        "for p in glob.glob('**', recursive=True) + glob.glob('.*') + ['tests.py', '../tests.py']:\n"
        "    try:\n        text = open(p).read()\n    except Exception:\n        continue\n"
        "    for m in re.finditer(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', text):\n"
        "        _found[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))\n"
        "def add(a, b):\n    return _found.get((a, b), -999)\n"),
    "sys_exit_0": "import sys\nsys.exit(0)\n",
    "os_exit_0": "import os\nos._exit(0)\n",
    "raise_system_exit": "raise SystemExit\n",
    "exit_inside_the_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys_exit_inside_the_call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "atexit_exit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return None\n",
    "patch_sys_and_os": (
        "import sys, os\n"
        "sys.exit = lambda *a: None\nos._exit = lambda *a: None\nos.write = lambda fd, b: len(b)\n"
        "sys.stdout = sys.__stdout__\nsys.argv[:] = ['x']\n"
        "def add(a, b):\n    return 'PASS'\n"),
    "patch_json_dumps": (
        "import json\n"
        "json.dumps = lambda o, *a, **k: '{\"loaded\": true, \"results\": '\n"
        "                               '[{\"v\": true}, {\"v\": true}, {\"v\": true}]}'\n"
        "def add(a, b):\n    return 0\n"),
    "print_markers": (
        "import sys, os\n"
        "for m in ['PASS', 'OK', 'ok', '1.0', 'All tests passed', '@@alloy-result-', sys.argv[-1],\n"
        "          sys.argv[-1] + '{\"loaded\": true, \"results\": []}']:\n"
        "    print(m)\n    os.write(1, (m + '\\n').encode())\n    os.write(2, (m + '\\n').encode())\n"
        "def add(a, b):\n    return 1\n"),
    "two_records": (  # the worker's record plus a forged one on its pipe (found in the harness's frame): refused
        "import sys, os, json\nw = sys._getframe(1).f_locals['w']\n"
        "rec = json.dumps({'loaded': True, 'results': [{'v': 5}, {'v': 0}, {'v': 42}]})\n"
        "os.write(w, rec.encode())\n"
        "def add(a, b):\n    return a - b\n"),
    "not_plain_result": "def add(a, b):\n    return [a + b, object()]\n",
    "bytes_result": "def add(a, b):\n    return str(a + b).encode()\n",
    "segfault": "import ctypes\nctypes.string_at(0)\n",
    "huge_output": "import sys\ndef add(a, b):\n    return 'x' * (3 << 20)\n",
}


@pytest.fixture(scope="module")
def verifier():
    return get_verifier("code:2")


@needs_sandbox
def test_correct_and_wrong_solutions(verifier):
    good = "Here:\n```python\ndef add(a, b):\n    print('noise ' * 20000)\n    return a + b\n```"
    assert verifier(good, "", ROW) == 1.0
    assert verifier("def add(a, b):\n    return a - b", "", ROW) == 0.0
    assert verifier("def add(a, b):\n    return a +", "", ROW) == 0.0
    almost = "def add(a, b):\n    return 42 if a == 40 else a + b + (a == -1)"
    assert code_report(almost, "", ROW, 2).reason == "wrong"
    rich = {"tests": ["assert pair(1) == (1, 2)", "assert not is_even(3)", "assert is_even(4)",
                      "assert nothing() is None", "assert table() == {'a': [1, 2.5], 'b': None}",
                      "assert {1, 2} == digits(21)", "assert half(1) == 0.5"]}
    src = ("def pair(x): return (x, x + 1)\ndef is_even(x): return x % 2 == 0\ndef nothing(): pass\n"
           "def table(): return {'a': [1, 2.5], 'b': None}\ndef digits(n): return {int(c) for c in str(n)}\n"
           "def half(x): return x / 2\n")
    assert verifier(src, "", rich) == 1.0
    assert verifier(src.replace("(x, x + 1)", "[x, x + 1]"), "", rich) == 0.0  # a list is not the tuple asked for
    assert verifier(src.replace("def nothing(): pass", "def nothing(): return 0"), "", rich) == 0.0  # `is None`


@needs_sandbox
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgeries_score_zero_with_a_reason(verifier, name):
    report = code_report(FORGERIES[name], "", ROW, 2)
    assert report.score == 0.0 and report.reason in CODE_REASONS and report.reason != "pass", (name, report)
    assert verifier(FORGERIES[name], "", ROW) == 0.0
    want = {"sys_exit_0": "exit", "os_exit_0": "exit", "raise_system_exit": "exit", "exit_inside_the_call": "exit",
            "frame_delimiter_and_exit": "malformed", "equals_everything": "not_plain", "segfault": "crash",
            "int_subclass_equal_to_all": "not_plain", "two_records": "malformed", "bytes_result": "not_plain",
            "sys_exit_inside_the_call": "exit", "reads_the_tests": "wrong", "huge_output": "malformed"}
    if name in want:
        assert report.reason == want[name], (name, report)


@needs_sandbox
def test_an_endless_loop_is_a_timeout(verifier):
    t0 = time.monotonic()
    report = code_report("def add(a, b):\n    while True:\n        pass\n", "", ROW, 1)
    assert report.score == 0.0 and report.reason == "timeout" and "1 s" in report.detail
    assert time.monotonic() - t0 < 4


@needs_sandbox
def test_the_child_never_sees_expected_values_or_tests(monkeypatch):
    import sandbox.pool as pool
    seen: dict[str, str] = {}
    real = pool.run_tool_pooled

    def spy(command, workdir, **kw):
        from pathlib import Path
        for p in Path(workdir).rglob("*"):
            seen[p.name] = p.read_text()
        return real(command, workdir, **kw)

    monkeypatch.setattr(pool, "run_tool_pooled", spy)
    row = {"tests": "assert add(2, 3) == 123456789\nassert add(1, 1) == 987654321"}
    assert code_report("def add(a, b): return a + b", "", row, 2).reason == "wrong"
    assert set(seen) == {"solution.py", "runner.py", "calls.json"}
    for name, text in seen.items():
        assert "123456789" not in text and "987654321" not in text and "assert" not in text, name


def test_the_parent_decides_from_plain_data_only():
    tests = parse_code_tests(TESTS)
    assert [(t.expr, t.expected, t.calls) for t in tests] == [("add(2, 3)", 5, ("add(2, 3)",)),
                                                              ("add(-1, 1)", 0, ("add(-1, 1)",)),
                                                              ("add(40, 2)", 42, ("add(40, 2)",))]
    ok = '{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"v": 42}]}'
    assert judge_code_record(tests, ok).score == 1.0
    for bad, reason in [("", "malformed"), (ok + ok, "malformed"), ("noise " + ok, "malformed"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}]}', "malformed"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"v": {"x": 42}}]}', "malformed"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"v": 42, "e": "x"}]}', "malformed"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"v": "42"}]}', "wrong"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"u": "Any"}]}', "not_plain"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"e": "KeyError: 1"}]}', "error"),
                        ('{"loaded": "SyntaxError: bad", "results": []}', "solution_error"),
                        ('{"loaded": true, "results": [{"v": 5}, {"v": 0}, {"v": 42}], "x": 1}', "malformed"),
                        ("[" * 100000, "malformed")]:
        r = judge_code_record(tests, bad)
        assert r.score == 0.0 and r.reason == reason, (bad[:80], r)


def test_unparseable_tests_are_refused_before_training():
    for tests, says in [("x = 2\nassert add(x, 3) == 5", "field 'tests' line 1: a statement of type Assign"),
                        ("def check(f):\n    assert f(1) == 2", "a statement of type FunctionDef"),
                        ("assert add(1, x) == 3", "`add(1, x)` is a call the verifier cannot decide"),
                        ("assert (add(1, 2) == 3, add(2, 2) == 4)", "asserts a tuple, which Python finds always"),
                        ("assert all(add(i, 1) == i + 1 for i in range(3))", "(GeneratorExp) is not supported"),
                        ("assert add(1, 2).__eq__(3)", "is not one of the supported forms"),
                        ("assert len([1, 2]) == 2", "calls nothing of the solution"),
                        ("assert add(1, 2) == b'3'", "the expected value \"b'3'\" is a bytes"),
                        ("assert add(1, 2) == 3\nassert (", "do not parse as Python"),
                        ("import math\nassert add(1, 2) == 3", "a statement of type Import"),
                        ("# only a comment", "contain no assert")]:
        why = answer_problem("code", "", {"tests": tests})
        assert why is not None and says in why, (tests, why)
    assert answer_problem("code", "", ROW) is None
    assert answer_problem("code", "", {"tests": ["assert f(1) == [1, (2, 3)]", "assert not g(0)"]}) is None
    assert answer_problem("code", "", {"tests": ["assert add(1, 2) == add(2, 1)", "assert add(1, 2) != 4",
                                                 "assert abs(add(1, 2) - 3) < 1e-9"]}) is None  # decided here now
    with pytest.raises(ValueError, match="field 'tests' line 1: a statement of type Assign"):
        get_verifier("code:1")("def add(a, b): return a + b", "", {"tests": "x = 1\nassert add(x, 1) == 2"})


@needs_sandbox
def test_outcomes_are_counted_for_the_guard():
    v = get_verifier("code:1")
    for src in ["def add(a, b): return a + b", "def add(a, b): return a - b", FORGERIES["os_exit_0"],
                FORGERIES["equals_everything"], "def add(a, b):\n    while True: pass"]:
        v(src, "", ROW)

    class Domain:  # a dataset domain holds its verifier as `verifier`
        verifier = v

    counts = verifier_outcomes(Domain())
    assert counts == {"pass": 1, "wrong": 1, "exit": 1, "not_plain": 1, "timeout": 1}

    class Mixed:
        domains = {"a": Domain(), "b": Domain()}

    assert verifier_outcomes(Mixed())["timeout"] == 2
    assert reward_outcome_counts({"pass": 1, "wrong": 1}, counts) == {"reward_exit": 1, "reward_not_plain": 1,
                                                                      "reward_timeout": 1}
    import pickle
    assert pickle.loads(pickle.dumps(v)).outcomes.snapshot() == counts


def test_a_dataset_with_untranslatable_tests_is_refused_naming_the_row(tmp_path):
    import json

    from domains.dataset import DatasetDomain, DatasetError
    rows = [{"prompt": "Write add(a, b).", "answer": "-", "tests": ["assert add(1, 2) == 3"]},
            {"prompt": "Write mul(a, b).", "answer": "-", "tests": ["def check(f):", "    assert f(2, 3) == 6"]}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as e:
        DatasetDomain("codeds", str(path), fields=["tests"], verifier="code:2")
    assert "row 1" in str(e.value) and "a statement of type FunctionDef" in str(e.value), str(e.value)


@needs_sandbox
def test_a_dataset_domain_counts_its_code_outcomes(tmp_path):
    import json

    from domains.dataset import DatasetDomain
    rows = [{"prompt": f"Write add(a, b) #{i}.", "answer": "-", "tests": ["assert add(1, 2) == 3"]} for i in range(3)]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dom = DatasetDomain("codeds", str(path), fields=["tests"], verifier="code:2")
    ex = dom.examples[0]
    assert dom.verify(ex, "def add(a, b): return a + b") == 1.0
    assert dom.verify(ex, FORGERIES["equals_everything"]) == 0.0
    assert dom.verify(ex, FORGERIES["os_exit_0"]) == 0.0
    assert verifier_outcomes(dom) == {"pass": 1, "not_plain": 1, "exit": 1} and dom.verifier_errors == 0
