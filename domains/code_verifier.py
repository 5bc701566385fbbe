"""The `code` verifier (`domains.verifiers.get_verifier("code")`: its runner program, the parsing of the tests and
the decision on the child's record).

`code` / `code:<timeout_s>` (default 5 s): the response's code (the last ```python fenced block, else the last ```
block, else the whole response) against `row["tests"]` (Python source, or a list of lines), decided in THIS process,
never in the solution's. The tests are parsed here (`parse_code_tests`, with `ast`) into one (expression, expected
value) pair per assert: `assert <expr> == <literal>` (either side the literal), `assert <expr> is True|False|None`,
`assert <expr>` (truthy), `assert not <expr>` (falsy); the literal is `ast.literal_eval`'d and must be plain data
(None, bool, int, float, str, list, tuple, dict, set). Any other statement or form is a ValueError naming the line
(`answer_problem` refuses the row before training): there is no weaker legacy mode. Only the expressions
(`calls.json`), the solution and a small runner are written to the sandbox's work dir; the expected values and the
test source never leave this process. The child (`sandbox.runner.run_tool` via the helper of `sandbox.pool`, `python -I -S`, standard library only,
no network, 512 MiB, the time limit) sends fd 1 to /dev/null (stderr is kept for the crash reason), runs the
solution, evaluates each expression in the solution's namespace and writes one line `<per-run delimiter><json>`
with, per test, the value encoded with exact types (`{"l": [...]}` a list, `t` a tuple, `s` a set, `d` a dict as
pairs; only those and None/bool/int/float/str, by `type(v) is`, so an int subclass or an object "equal to
everything" is not plain), or the exception raised. This process accepts exactly one such record with exactly one
entry per test, decodes it into plain values and compares them with the expected values it kept (builtin `==` on
plain data). 1.0 iff every test passes. Nothing the child does is trusted: it may patch builtins, `sys`, `os`,
`json`, read the delimiter from a frame and print any record it likes; a record only says "these are the values",
and only the right values pass, which is solving the task. A timeout, an exit before the record (`sys.exit`,
`os._exit`), a crash, a non-plain value, an exception, a missing, duplicated, oversized (1 MiB) or malformed record
each score 0 with a reason (`CODE_REASONS`; the verifier returned by `get_verifier` counts them in `.outcomes`,
`verifier_outcomes(domain)` reads them, and the specialist adds each step's to its guard totals as
`reward_<reason>`). `code_report` returns the `CodeReport` (score, reason, detail). The sandbox must be able to run
`python` (network closed by its namespace or seccomp); where it refuses, the verifier raises RuntimeError (the
domain counts a verifier error) instead of scoring 0 in silence.
"""
from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

CODE_MEMORY_MB = 512
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
CODE_REASONS: tuple[str, ...] = ("pass", "wrong", "error", "not_plain", "solution_error", "exit", "crash", "timeout",
                                 "malformed")
CODE_MAX_OUTPUT = 1 << 20  # bytes of the child's result record (stdout) and stderr read back
_MAX_DEPTH = 64  # nesting of a result value
# The child: reads the call expressions (never the expected values: they stay in the parent), sends fd 1 to /dev/null,
# runs the solution, evaluates each call in the solution's namespace and writes ONE line `<delimiter><json>` to a
# private dup of the original stdout, then `os._exit(0)`. It is a convenience for honest solutions, not a defence:
# the solution shares this process and may rewrite any of it, so nothing here is trusted (see `code_report`).
_CODE_RUNNER = r'''import json, os, sys
def _plain(v, depth=0):
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if depth > 64:
        raise TypeError("nested too deep")
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "s", frozenset: "s"}[t]
        return {tag: [_plain(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in v.items()]}
    raise TypeError(t.__name__)
def _main():
    delim = sys.argv.pop()
    with open("calls.json", encoding="utf-8") as f:
        calls = json.load(f)
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    sys.stdout = open(os.devnull, "w")
    ns, loaded, results = {"__name__": "solution", "__builtins__": __builtins__}, True, []
    try:
        exec(compile(source, "solution.py", "exec"), ns)
    except BaseException as e:
        loaded = f"{type(e).__name__}: {e}"[:300]
    if loaded is True:
        for i, expr in enumerate(calls):
            try:
                value = eval(compile(expr, f"<test {i}>", "eval"), ns)
            except BaseException as e:
                results.append({"e": f"{type(e).__name__}: {e}"[:300]})
                continue
            try:
                results.append({"v": _plain(value)})
            except Exception as e:
                results.append({"u": f"{e}"[:100]})
    out.write(delim + json.dumps({"loaded": loaded, "results": results}) + "\n")
    out.flush()
    os._exit(0)
_main()
'''


def extract_code(response: str) -> str:
    """The last ```python (or ```py / ```python3) fenced block, else the last fenced block, else the response."""
    blocks = _FENCE_RE.findall(response)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    return blocks[-1][1] if blocks else response


def row_tests(row: Mapping[str, Any] | None) -> str:
    tests = (row or {}).get("tests")
    if hasattr(tests, "tolist"):
        tests = tests.tolist()
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests)
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError("code verifier: the row needs a field 'tests' (Python source with asserts, or a list of "
                         f"lines), got {type(tests).__name__}")
    return tests


@dataclass(frozen=True)
class CodeTest:
    """One parsed assert: `expr` (source) runs in the sandbox; `expected` and `mode` stay in the parent.
    mode "eq": got == expected; "is": same type and equal (`is True/False/None`); "truthy" / "falsy": bool(got)."""
    expr: str
    expected: Any
    mode: str
    line: int


def _is_plain(v: Any, depth: int = 0) -> bool:
    if v is None or type(v) in (bool, int, float, str):
        return True
    if depth > _MAX_DEPTH:
        return False
    if type(v) in (list, tuple, set, frozenset):
        return all(_is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(_is_plain(k, depth + 1) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return True, value


_TEST_FORMS = ("`assert <expr> == <literal>` (or `<literal> == <expr>`), `assert <expr> is True|False|None`, "
               "`assert <expr>` and `assert not <expr>`, where <literal> is a Python literal of None, bool, int, "
               "float, str, list, tuple, dict, set")


def parse_code_tests(tests: str) -> list[CodeTest]:
    """`row["tests"]` (see `row_tests`) as data: one `CodeTest` per top-level assert. Anything else (other
    statements, comparisons with no literal side, `!=`, `<`, chained comparisons, non-plain literals) is a
    ValueError naming the line: such tests cannot be decided outside the solution's process."""
    try:
        tree = ast.parse(tests)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"code verifier: the row's tests do not parse as Python: {e}") from None
    out: list[CodeTest] = []
    for stmt in tree.body:
        where = f"code verifier: field 'tests' line {stmt.lineno}"
        if not isinstance(stmt, ast.Assert):
            raise ValueError(f"{where}: a statement of type {type(stmt).__name__}; only asserts are supported, "
                             f"of the forms {_TEST_FORMS}")
        t = stmt.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1:
            left, op, right = t.left, t.ops[0], t.comparators[0]
            ok_r, val_r = _literal(right)
            ok_l, val_l = _literal(left)
            if isinstance(op, ast.Eq) and (ok_r or ok_l):
                expr, expected = (left, val_r) if ok_r else (right, val_l)
                if not _is_plain(expected):
                    raise ValueError(f"{where}: the expected value {ast.unparse(right if ok_r else left)[:80]!r} is "
                                     f"a {type(expected).__name__}, not plain data (None, bool, int, float, str, "
                                     "list, tuple, dict, set)")
                out.append(CodeTest(ast.unparse(expr), expected, "eq", stmt.lineno))
                continue
            if isinstance(op, ast.Is) and ok_r and (val_r is None or type(val_r) is bool):
                out.append(CodeTest(ast.unparse(left), val_r, "is", stmt.lineno))
                continue
            raise ValueError(f"{where}: `{ast.unparse(t)[:80]}` is not one of the supported forms {_TEST_FORMS}")
        if isinstance(t, ast.Compare) or _literal(t)[0]:
            raise ValueError(f"{where}: `{ast.unparse(t)[:80]}` is not one of the supported forms {_TEST_FORMS}")
        if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            out.append(CodeTest(ast.unparse(t.operand), False, "falsy", stmt.lineno))
        else:
            out.append(CodeTest(ast.unparse(t), True, "truthy", stmt.lineno))
    if not out:
        raise ValueError("code verifier: the row's tests contain no assert")
    return out


def _decode(v: Any, depth: int = 0) -> Any:
    """A result value as the child's `_plain` encodes it, back to Python (plain types only); ValueError otherwise."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if depth > _MAX_DEPTH or type(v) is not dict or len(v) != 1:
        raise ValueError("not plain data")
    (tag, items), = v.items()
    if type(items) is not list:
        raise ValueError("not plain data")
    if tag == "l":
        return [_decode(x, depth + 1) for x in items]
    if tag == "t":
        return tuple(_decode(x, depth + 1) for x in items)
    if tag == "s":
        return {_decode(x, depth + 1) for x in items}  # TypeError for an unhashable member: malformed
    if tag == "d":
        if not all(type(p) is list and len(p) == 2 for p in items):
            raise ValueError("not plain data")
        return {_decode(k, depth + 1): _decode(x, depth + 1) for k, x in items}
    raise ValueError("not plain data")


def _test_passes(test: CodeTest, got: Any) -> bool:
    if test.mode == "truthy":
        return bool(got)
    if test.mode == "falsy":
        return not got
    if test.mode == "is":
        return type(got) is type(test.expected) and got == test.expected
    return bool(got == test.expected)  # both plain values built in this process: == is the builtin one


@dataclass(frozen=True)
class CodeReport:
    """What `code_report` decided: `score` 1.0 iff every test passed; `reason` one of `CODE_REASONS` (the first
    failure's), `detail` a short human text, `passed` / `total` tests."""
    score: float
    reason: str
    detail: str = ""
    passed: int = 0
    total: int = 0


def _raised_reason(why: str) -> str:
    return "exit" if why.startswith("SystemExit") else "error"


def judge_code_record(tests: list[CodeTest], stdout: str, delim: str) -> CodeReport:
    """Decide from the child's stdout: exactly one line `<delim><json>` with one plain result per test, compared here
    with the expected values the child never saw. Anything else scores 0 with its reason."""
    n = len(tests)
    lines = [ln for ln in stdout.split("\n") if ln.startswith(delim)]
    if len(lines) != 1:
        return CodeReport(0.0, "malformed", f"{len(lines)} result records (one expected)", 0, n)
    try:
        record = json.loads(lines[0][len(delim):])
        if type(record) is not dict or set(record) != {"loaded", "results"} or type(record["results"]) is not list:
            raise ValueError("bad record shape")
        loaded, results = record["loaded"], record["results"]
        if loaded is not True:
            if type(loaded) is not str:
                raise ValueError("bad 'loaded'")
            return CodeReport(0.0, "exit" if loaded.startswith("SystemExit") else "solution_error",
                              f"the solution did not load: {loaded[:200]}", 0, n)
        if len(results) != n:
            raise ValueError(f"{len(results)} results for {n} tests")
        decoded: list[tuple[str, Any]] = []
        for r in results:
            if type(r) is not dict or len(r) != 1:
                raise ValueError("bad result entry")
            (kind, value), = r.items()
            if kind == "v":
                decoded.append(("v", _decode(value)))
            elif kind in ("e", "u") and type(value) is str:
                decoded.append((kind, value))
            else:
                raise ValueError("bad result entry")
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        return CodeReport(0.0, "malformed", f"the result record is malformed: {str(e)[:200]}", 0, n)
    passed, first = 0, None
    for test, (kind, value) in zip(tests, decoded):
        if kind == "v" and _test_passes(test, value):
            passed += 1
            continue
        if first is None:
            if kind == "e":
                first = (_raised_reason(value), f"tests line {test.line} `{test.expr[:80]}` raised {value[:200]}")
            elif kind == "u":
                first = ("not_plain", f"tests line {test.line} `{test.expr[:80]}` returned a {value[:60]}, "
                                      "not plain data")
            else:
                first = ("wrong", f"tests line {test.line} `{test.expr[:80]}` returned {repr(value)[:120]}")
    if first is None:
        return CodeReport(1.0, "pass", "", passed, n)
    return CodeReport(0.0, first[0], first[1], passed, n)


def code_report(response: str, answer: str, row: Mapping[str, Any] | None = None,
                timeout_s: float = 5.0) -> CodeReport:
    """Run the response's code against `row["tests"]` (module docstring: the protocol and the threat model)."""
    return run_code_tests(extract_code(response), parse_code_tests(row_tests(row)), timeout_s)


def run_code_tests(code: str, tests: list[CodeTest], timeout_s: float = 5.0) -> CodeReport:
    """Run `code` (the solution's source) against parsed `tests` in the sandbox and decide here: only the tests'
    expressions reach the child (module docstring). Also used by tool domains that hold the solution apart from the
    response (`domains.tool_code`)."""
    from sandbox.pool import run_tool_pooled
    work = tempfile.mkdtemp(prefix="alloy-code-")
    try:
        os.chmod(work, 0o755)  # the sandbox runs as `nobody` when we are root
        for name, text in (("solution.py", code), ("runner.py", _CODE_RUNNER),
                           ("calls.json", json.dumps([t.expr for t in tests]))):
            path = os.path.join(work, name)
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            os.chmod(path, 0o644)
        delim = "@@alloy-result-" + secrets.token_hex(16) + "@@"
        res = run_tool_pooled(f"python runner.py {delim}", work, timeout_s=timeout_s, memory_mb=CODE_MEMORY_MB,
                       allowed={"python"}, max_output_bytes=CODE_MAX_OUTPUT)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if res.blocked_reason:
        raise RuntimeError(f"code verifier: the sandbox refused to run python: {res.blocked_reason}")
    n = len(tests)
    if res.timed_out:
        return CodeReport(0.0, "timeout", f"over the {timeout_s:g} s limit", 0, n)
    if delim not in res.stdout:  # it never got to write its record: os._exit, a signal, the memory limit
        if res.exit_code == 0:
            return CodeReport(0.0, "exit", "exited with status 0 before the results were written", 0, n)
        return CodeReport(0.0, "crash", f"exit status {res.exit_code}: {res.stderr.strip()[-200:]}", 0, n)
    if res.truncated:
        return CodeReport(0.0, "malformed", f"the output passed {CODE_MAX_OUTPUT} bytes", 0, n)
    return judge_code_record(tests, res.stdout, delim)


def code_passes(response: str, answer: str, row: Mapping[str, Any] | None = None, timeout_s: float = 5.0) -> float:
    """`code_report(...).score`."""
    return code_report(response, answer, row, timeout_s).score
