"""Red team of the `code` verifier, second round (issue 52): programs that try to score 1.0 without solving the task.

Each case is a row's tests, a forged solution and a correct one: the forgery must score 0.0 (or its row be refused
at load, `REFUSED`) and the correct solution 1.0. The classes: a comparison or truth test the child would evaluate
(and/or, `is True`, `== True`, all/any, `not !=`, a method of the returned object, the solution's own `math`),
objects that lie (`__eq__`, `__bool__`, int/str subclasses, NaN), attacks on the worker (patched builtins and json,
exits, `__del__`, fake records on stdout, stderr and fds 3-9), attacks on the reporter (its /proc fds, killing or
stopping it), and reading the expected values from argv, the environment, files, frames, `gc` or the parent, in
the machine's sandbox mode and in each weaker one it has. From the host side: the work dir of each call is gone
afterwards and a correct episode cannot leave its answers for a later one (files in /tmp, /dev/shm, the work dir).
The first round is tests/unit/test_code_verifier_forgery.py."""
from __future__ import annotations

import json
import os

import pytest

from domains.code_verifier import code_report, parse_code_tests
from sandbox.runner import available_modes, isolation_support

pytestmark = [pytest.mark.unit, pytest.mark.skipif(isolation_support() == "none",
                                                   reason="no namespaces: the sandbox refuses python")]
LIAR = ("class Liar:\n"
        "    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "    def __bool__(self): return True\n    def __lt__(self, o): return True\n"
        "    def __gt__(self, o): return True\n    def __sub__(self, o): return 0\n"
        "    def __rsub__(self, o): return 0\n"
        "    def __abs__(self): return 0\n    def startswith(self, *a): return True\n    __hash__ = object.__hash__\n")
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(2, 3) == 5\nassert add(40, 2) == 42"
FRAMES = (  # every string and int reachable: frames, gc, argv, env, files of the work dir, /tmp and the parent
    "import gc, os, sys, glob\n"
    "seen = []\n"
    "f = sys._getframe()\n"
    "while f is not None:\n"
    "    seen += list(f.f_locals.values()) + list(f.f_globals.values())\n    f = f.f_back\n"
    "seen += gc.get_objects() + sys.argv + list(os.environ.values())\n"
    "for p in glob.glob('*') + glob.glob('.*') + glob.glob('/tmp/**', recursive=True) + [\n"
    "        f'/proc/{os.getppid()}/environ', f'/proc/{os.getppid()}/cmdline', '/proc/1/environ']:\n"
    "    try:\n        seen.append(open(p, 'rb').read().decode('latin-1'))\n    except Exception:\n        pass\n"
    "for p in [f'/proc/{os.getppid()}/mem', '/proc/1/mem']:\n"
    "    try:\n        seen.append(str(os.open(p, os.O_RDONLY)))\n    except Exception:\n        pass\n"
    "text = ' '.join(repr(x) for x in seen if isinstance(x, (str, int, bytes, list, dict, tuple)))\n"
    "m = '123456789'[::-1]  # the value looked for, built after the search (its source holds only the reverse)\n"
    "def add(a, b):\n    return int(m) if m in text else -1\n")
RECORD = "json.dumps({'loaded': True, 'results': [{'v': True}, {'v': True}]})"

# name -> (tests, forged solution); the correct solution is CORRECT.get(name, ADD)
CASES: dict[str, tuple[str, str]] = {
    # a comparison or truth test the child would have evaluated
    "and_of_comparisons": ("assert add(2, 3) == 5 and add(40, 2) == 42", LIAR + "def add(a, b): return Liar()\n"),
    "is_true_of_a_comparison": ("assert (add(2, 3) == 5) is True", LIAR + "def add(a, b): return Liar()\n"),
    "eq_true_of_a_comparison": ("assert (add(2, 3) == 5) == True", LIAR + "def add(a, b): return Liar()\n"),
    "all_over_comparisons": ("assert all([add(2, 3) == 5, add(40, 2) == 42])",
                             LIAR + "def add(a, b): return Liar()\n"),
    "any_over_comparisons": ("assert any([add(2, 3) == 5, add(2, 3) == 6])", LIAR + "def add(a, b): return Liar()\n"),
    "not_of_ne": ("assert not add(2, 3) != 5", LIAR + "def add(a, b): return Liar()\n"),
    "method_of_the_result": ("assert greet('bo').startswith('hello')", LIAR + "def greet(n): return Liar()\n"),
    "method_of_a_str_subclass": ("assert greet('bo').startswith('hello')",
                                 "class S(str):\n    def startswith(self, *a): return True\n"
                                 "def greet(n): return S('bye')\n"),
    "own_math_isclose": ("assert math.isclose(half(1), 0.5, rel_tol=1e-9)",
                         "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\n"
                         "import builtins\nbuiltins.math = math\ndef half(x): return 7\n"),
    "abs_tolerance_with_a_liar": ("assert abs(half(1) - 0.5) < 1e-9", LIAR + "def half(x): return Liar()\n"),
    "in_with_a_liar": ("assert add(2, 3) in (5, 6)", LIAR + "def add(a, b): return Liar()\n"),
    # objects that lie, returned where a plain value is compared
    "eq_everything": (ADD_TESTS, LIAR + "def add(a, b): return Liar()\n"),
    "int_subclass": (ADD_TESTS, "class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
                                "def add(a, b): return I(0)\n"),
    "str_subclass": ("assert name() == 'alloy'", "class S(str):\n    def __eq__(s, o): return True\n"
                                                  "    __hash__ = str.__hash__\ndef name(): return S('x')\n"),
    "truthy_object_for_a_bare_assert": ("assert is_even(4)\nassert not is_even(3)",
                                        "class T:\n    def __bool__(self): return True\ndef is_even(n): return T()\n"),
    "one_for_true": ("assert is_even(4)\nassert not is_even(3)", "def is_even(n): return 1 - n % 2\n"),
    "empty_list_for_false": ("assert is_even(4)\nassert not is_even(3)", "def is_even(n): return [1] if n % 2 == 0 "
                                                                         "else []\n"),
    "nan": ("assert half(1) == 0.5\nassert math.isclose(half(3), 1.5)\nassert not half(5) != 2.5",
            "def half(x): return float('nan')\n"),
    "dict_subclass": ("assert table() == {'a': 1}", "class D(dict):\n    def __eq__(s, o): return True\n"
                                                    "def table(): return D()\n"),
    # attacks on the worker
    "patched_builtins": (ADD_TESTS, "import builtins\nbuiltins.type = lambda *a: int\n"
                                    "builtins.isinstance = lambda *a: True\ndef add(a, b): return object()\n"),
    "patched_json_dumps": (ADD_TESTS, "import json\n_d = json.dumps\n"
                                      f"json.dumps = lambda *a, **k: {RECORD.replace('json.dumps', '_d')}\n"
                                      "def add(a, b): return 0\n"),
    "sys_exit_before_the_calls": (ADD_TESTS, "import sys\nsys.exit(0)\n"),
    "os_exit_in_the_call": (ADD_TESTS, "import os\ndef add(a, b): os._exit(0)\n"),
    "del_at_exit": (ADD_TESTS, "import os, json\nclass X:\n    def __del__(self):\n"
                               f"        os.write(1, ({RECORD} + '\\n').encode())\n"
                               "        raise SystemExit(0)\n_keep = X()\ndef add(a, b): return X() and 0\n"),
    "fake_lines_on_stdout_and_stderr": (ADD_TESTS, "import os, sys, json\n"
                                        "head = json.dumps({'status': 0, 'bytes': 60, 'over': False, 'ascii': True,"
                                        " 'guarded': True})\n"
                                        f"for fd in (1, 2):\n    os.write(fd, (head + '\\n' + {RECORD}).encode())\n"
                                        f"print(head)\nprint({RECORD})\nsys.__stdout__.write(head)\n"
                                        "def add(a, b): return 1\n"),
    "forged_record_on_fds_3_to_9_then_exit": (ADD_TESTS, "import os, json\n"
                                              f"for fd in range(3, 10):\n    try:\n"
                                              f"        os.write(fd, {RECORD}.encode())\n"
                                              "    except OSError:\n        pass\nos._exit(0)\n"),
    "forged_record_via_the_harness_frame": (ADD_TESTS, "import sys, os, json\nw = sys._getframe(1).f_locals['w']\n"
                                            f"os.write(w, {RECORD}.encode())\nos._exit(0)\n"),
    # attacks on the reporter (the parent in the sandbox, the only writer of the verdict's channel)
    "write_the_reporters_stdout_through_proc": (
        ADD_TESTS, "import os, json\n"
                   "head = json.dumps({'status': 0, 'bytes': 60, 'over': False, 'ascii': True, 'guarded': True})\n"
                   "for p in (os.getppid(), 1):\n    try:\n"
                   "        fd = os.open(f'/proc/{p}/fd/1', os.O_WRONLY)\n"
                   f"        os.write(fd, (head + '\\n' + {RECORD}).encode())\n"
                   "    except OSError:\n        pass\nos._exit(0)\n"),
    "kill_the_reporter": (ADD_TESTS, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                     "def add(a, b): return 0\n"),
    "stop_the_reporter": (ADD_TESTS, "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
                                     "def add(a, b): return 0\n"),
    # looking for the expected values (987654321 is only in the tests, never sent to the sandbox)
    "read_expected_values_anywhere": ("assert add(2, 3) == 987654321", FRAMES),
}
CORRECT = {"method_of_the_result": "def greet(n): return 'hello ' + n\n",
           "method_of_a_str_subclass": "def greet(n): return 'hello ' + n\n",
           "own_math_isclose": "def half(x): return x / 2\n",
           "abs_tolerance_with_a_liar": "def half(x): return x / 2\n",
           "nan": "def half(x): return x / 2\n", "str_subclass": "def name(): return 'alloy'\n",
           "truthy_object_for_a_bare_assert": "def is_even(n): return n % 2 == 0\n",
           "one_for_true": "def is_even(n): return n % 2 == 0\n",
           "empty_list_for_false": "def is_even(n): return n % 2 == 0\n",
           "dict_subclass": "def table(): return {'a': 1}\n",
           "read_expected_values_anywhere": "def add(a, b): return 987654321\n"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_forgery_scores_zero_and_a_correct_solution_one(name):
    tests, forged = CASES[name]
    row = {"tests": tests}
    report = code_report(forged, "", row, 2)
    assert report.score == 0.0 and report.reason != "pass", (name, report)
    good = code_report(CORRECT.get(name, ADD), "", row, 2)
    assert good.score == 1.0, (name, good)


@pytest.mark.parametrize("mode", [m for m in available_modes() if m != isolation_support()])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_forgery_scores_zero_in_every_other_sandbox_mode(monkeypatch, mode, name):
    """The same cases with the sandbox forced into each weaker mode the machine has ("userns", "none": no PID
    namespace, so the worker can signal the reporter: killing or stopping it still scores 0)."""
    import sandbox.pool as pool
    from sandbox.runner import run_tool
    monkeypatch.setattr(pool, "run_tool_pooled", lambda command, workdir, **kw: run_tool(command, workdir,
                                                                                         isolation=mode, **kw))
    tests, forged = CASES[name]
    assert code_report(forged, "", {"tests": tests}, 2).score == 0.0, (mode, name)
    assert code_report(CORRECT.get(name, ADD), "", {"tests": tests}, 2).score == 1.0, (mode, name)


REFUSED = {  # rows whose asserts Python itself would let a liar (or anything) pass: refused at load, never run
    "tuple_of_comparisons": "assert (add(2, 3) == 5, add(40, 2) == 42)",
    "list_of_comparisons": "assert [add(2, 3) == 5]",
    "generator_in_all": "assert all(add(i, 1) == i + 1 for i in range(3))",
    "dunder_of_the_result": "assert add(2, 3).__eq__(5)",
    "a_name_the_child_would_resolve": "assert add(2, 3) == expected",
    "a_lambda": "assert (lambda: add(2, 3))() == 5",
    "a_call_with_a_computed_argument": "assert add(len('ab'), 3) == 5",
    "nothing_of_the_solution": "assert 5 == 5",
    "an_unknown_helper": "assert math.fsum([add(2, 3)]) == 5",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_undecidable_row_is_refused_at_load_naming_it(tmp_path, name):
    from domains.dataset import DatasetDomain, DatasetError
    with pytest.raises(ValueError, match="field 'tests' line 1"):
        parse_code_tests(REFUSED[name])
    rows = [{"prompt": "add", "answer": "-", "tests": [ADD_TESTS]}, {"prompt": name, "answer": "-",
                                                                     "tests": [REFUSED[name]]}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as e:
        DatasetDomain("redteam", str(path), fields=["tests"], verifier="code:2")
    assert "has 1 bad row(s) of 2" in str(e.value) and "row 1 (line 2): " in str(e.value), str(e.value)


def test_the_work_dir_is_per_call_and_gone_after_it(monkeypatch):
    import sandbox.pool as pool
    dirs: list[str] = []
    real = pool.run_tool_pooled

    def spy(command, workdir, **kw):
        dirs.append(str(workdir))
        assert sorted(os.listdir(workdir)) == ["calls.json", "runner.py", "solution.py"]
        assert "987654321" not in open(os.path.join(workdir, "calls.json")).read()
        return real(command, workdir, **kw)

    monkeypatch.setattr(pool, "run_tool_pooled", spy)
    row = {"tests": "assert add(2, 3) == 987654321"}
    for _ in range(2):
        assert code_report(ADD, "", row, 2).reason == "wrong"
    assert len(set(dirs)) == 2 and not any(os.path.exists(d) for d in dirs)


def test_a_correct_episode_cannot_leave_its_answers_for_a_later_one():
    """The first episode solves and tries to publish its answers where a later call could read them; the second
    only looks for them. Judged by the second's score and, from the host, by what is left in /tmp and /dev/shm."""
    row = {"tests": "assert add(2, 3) == 987654321"}
    publish = ("import os\n"
               "for d in ('/tmp', '/dev/shm', '/var/tmp', '.', os.path.expanduser('~')):\n"
               "    try:\n        open(os.path.join(d, 'alloy-leak-987'), 'w').write('987654321')\n"
               "    except OSError:\n        pass\n"
               "def add(a, b): return 987654321\n")
    read = ("import os\nfound = -1\n"
            "for d in ('/tmp', '/dev/shm', '/var/tmp', '.', os.path.expanduser('~')):\n"
            "    try:\n        found = int(open(os.path.join(d, 'alloy-leak-987')).read())\n"
            "    except (OSError, ValueError):\n        pass\n"
            "def add(a, b): return found\n")
    before = {d: set(os.listdir(d)) for d in ("/tmp", "/dev/shm") if os.path.isdir(d)}
    assert code_report(publish, "", row, 2).score == 1.0
    assert code_report(read, "", row, 2).reason == "wrong"
    for d, names in before.items():
        assert "alloy-leak-987" not in set(os.listdir(d)) - names, d
