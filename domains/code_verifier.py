"""The `code` verifier (`domains.verifiers.get_verifier("code")`): its sandboxed program, and the decision on what
that program reports. The tests themselves are parsed and evaluated in `domains.code_tests`.

`code` / `code:<timeout_s>` (default 5 s): the response's code (the last ```python fenced block, else the last ```
block, else the whole response) against `row["tests"]` (Python source, or a list of lines). Threat model: the
solution is hostile code that wants 1.0 without solving the task; it runs in `sandbox.runner` (`python -I -S`,
standard library only, no network, 512 MiB, the time limit, a uid, PID namespace, Landlock and seccomp of its own).

Issue 52's design, in three rules:
1. **The parent decides every test.** The tests are parsed when the dataset loads (`parse_code_tests`; a row that
   cannot be parsed is refused then, naming the row and line) into the CALLS of the solution they need (`f(2, 3)`,
   literal arguments) and a plan of everything around them (comparisons, and/or/not, all/any, isclose, `in`,
   methods such as `.startswith`, arithmetic), which THIS process evaluates on plain values. The child evaluates only
   the calls and reports, per call, a value in a tagged encoding of plain data (`{"l": [...]}` a list, `t` a tuple,
   `s` a set, `d` a dict as pairs; None/bool/int/float/str as JSON), an exception, or "not plain". No object the
   solution made is ever compared, hashed or asked for its truth here; truth is strict (a bare `assert f(x)` needs
   `True`, see `domains.code_tests`).
2. **Nothing the solution writes is a verdict.** The sandboxed program is two processes. The REPORTER (`_main` of the
   runner) never runs solution code: it makes itself non-dumpable (a same-uid process cannot open its
   `/proc/<pid>/fd`, `mem` or `environ`; seccomp denies ptrace and process_vm_*), forks the WORKER, reads the worker's
   record from a pipe (capped), reaps it, and is the only writer of fd 1: a header line (the worker's exit status,
   the record's length, whether it overflowed or was not ASCII, whether the reporter is non-dumpable) and the record.
   The worker points fds 0 and 1 at /dev/null before the solution runs, then runs it and writes its record to the
   pipe. The solution can rewrite the worker (builtins, `json`, the harness's frame, `sys.exit`) and write any bytes
   to the pipe, but all it can ever say is "call i returned value v", which is exactly what returning v does; the
   parent accepts one record with one entry per call and nothing else on fd 1 (`judge_code_record`), and compares the
   values with expectations the child never had. So a forged record is worth what an honest answer is worth.
3. **Expected values never enter the sandbox.** The work dir (one per call, made here with `mkdtemp` and removed
   after the call) holds `solution.py`, `runner.py` and `calls.json` (the call sources only); argv is
   `python runner.py`, the environment is the sandbox's scrubbed one, stdin /dev/null. The expected values, the test
   source and the row stay in this process.

A timeout, an exit before the record (`sys.exit` caught as "exit", `os._exit`), a crash, a non-plain value, an
exception, a malformed, oversized (1 MiB) or missing record, a reporter killed by the solution, each score 0 with a
reason (`CODE_REASONS`; the verifier returned by `get_verifier` counts them in `.outcomes`, `verifier_outcomes(domain)`
reads them, and the specialist adds each step's to its guard totals as `reward_<reason>`). `code_report` returns the
`CodeReport` (score, reason, detail). The sandbox must be able to run `python`; where it refuses, the verifier raises
RuntimeError (the domain counts a verifier error) instead of scoring 0 in silence. The red-team suite is
tests/reliability/test_reward_forgery.py (and tests/unit/test_code_verifier_forgery.py, the first round).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from domains.code_tests import MAX_DEPTH, CallFailed, CodeTest, calls_of, holds, parse_code_tests

__all__ = ["CODE_REASONS", "CodeReport", "CodeTest", "code_passes", "code_report", "extract_code",
           "judge_code_record", "parse_code_tests", "row_tests", "run_code_tests"]

CODE_MEMORY_MB = 512
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
CODE_REASONS: tuple[str, ...] = ("pass", "wrong", "error", "not_plain", "solution_error", "exit", "crash", "timeout",
                                 "malformed")
CODE_MAX_OUTPUT = 1 << 20  # bytes of the worker's values (and of stderr) read back
_HEADER_MAX = 512  # bytes of the reporter's header line
# The sandboxed program. The REPORTER (this file's `_main`) never runs a line of the solution: it makes itself
# non-dumpable (so a process of the same uid cannot open its /proc/<pid>/fd, mem or environ), forks the WORKER, reads
# the worker's values from a pipe (at most CODE_MAX_OUTPUT bytes, until the worker exits and the pipe is drained),
# and is the only writer of fd 1: one header line `{"status", "bytes", "over", "ascii", "guarded"}` and the worker's
# bytes. The worker points fds 0 and 1 at /dev/null before the solution runs, so nothing it does reaches fd 1; it
# runs the solution, evaluates each call and writes `{"loaded", "results"}` to its pipe: claims of "this call
# returned this value", which the parent decodes as plain data and judges (`judge_code_record`).
_CODE_RUNNER = r"""import json, os, select, sys
CAP = %d
def _no_dump():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE, 0
    except Exception:
        return False
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
def _worker(w, calls, source):
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = open(os.devnull, "w")
    ns, loaded, results = {"__name__": "solution", "__builtins__": __builtins__}, True, []
    try:
        exec(compile(source, "solution.py", "exec"), ns)
    except BaseException as e:
        loaded = f"{type(e).__name__}: {e}"[:300]
    if loaded is True:
        for i, expr in enumerate(calls):
            try:
                value = eval(compile(expr, f"<call {i}>", "eval"), ns)
            except BaseException as e:
                results.append({"e": f"{type(e).__name__}: {e}"[:300]})
                continue
            try:
                results.append({"v": _plain(value)})
            except Exception as e:
                results.append({"u": f"{e}"[:100]})
    data = memoryview(json.dumps({"loaded": loaded, "results": results}).encode())
    while data:
        data = data[os.write(w, data):]
    os._exit(0)
def _main():
    with open("calls.json", encoding="utf-8") as f:
        calls = json.load(f)
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    guarded = _no_dump()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _worker(w, calls, source)
    os.close(w)
    buf, code, eof, over = bytearray(), None, False, False
    while not eof and not over:
        ready = select.select([r], [], [], 0.05)[0]
        if ready:
            chunk = os.read(r, 65536)
            eof = not chunk
            buf += chunk
            over = len(buf) > CAP
        if code is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(st)
        elif not ready:
            break  # the worker is gone and its pipe drained (a process it forked may still hold the pipe open)
    if code is None:
        if over:
            os.kill(pid, 9)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    payload = bytes(buf[:CAP])
    ascii = payload.isascii() and b"\n" not in payload
    head = {"status": code, "bytes": len(payload) if ascii else 0, "over": over, "ascii": ascii, "guarded": guarded}
    out = memoryview(json.dumps(head).encode() + b"\n" + (payload if ascii else b""))
    while out:
        out = out[os.write(1, out):]
    os._exit(0)
_main()
""" % CODE_MAX_OUTPUT


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


def _decode(v: Any, depth: int = 0) -> Any:
    """A result value as the child's `_plain` encodes it, back to Python (plain types only); ValueError otherwise."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if depth > MAX_DEPTH or type(v) is not dict or len(v) != 1:
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


def judge_code_record(tests: list[CodeTest], payload: str) -> CodeReport:
    """Decide from the worker's bytes: one JSON object `{"loaded": true, "results": [...]}` with one entry per call
    of `calls_of(tests)` (`{"v": value}` in the tagged encoding, `{"e": why}` it raised, `{"u": type}` not plain),
    decoded here into plain values; each test is then evaluated here (`domains.code_tests.holds`) on them. Anything
    else scores 0 with its reason. The values are only the solution's claims: a test holds only when they are right."""
    calls = calls_of(tests)
    n, k = len(tests), len(calls)
    try:
        record = json.loads(payload)
        if type(record) is not dict or set(record) != {"loaded", "results"} or type(record["results"]) is not list:
            raise ValueError("bad record shape")
        loaded, results = record["loaded"], record["results"]
        if loaded is not True:
            if type(loaded) is not str:
                raise ValueError("bad 'loaded'")
            return CodeReport(0.0, "exit" if loaded.startswith("SystemExit") else "solution_error",
                              f"the solution did not load: {loaded[:200]}", 0, n)
        if len(results) != k:
            raise ValueError(f"{len(results)} results for {k} calls")
        values: dict[str, Any] = {}
        for call, r in zip(calls, results):
            if type(r) is not dict or len(r) != 1:
                raise ValueError("bad result entry")
            (kind, value), = r.items()
            if kind == "v":
                values[call] = _decode(value)
            elif kind == "e" and type(value) is str:
                values[call] = CallFailed(_raised_reason(value), f"`{call[:80]}` raised {value[:200]}")
            elif kind == "u" and type(value) is str:
                values[call] = CallFailed("not_plain", f"`{call[:80]}` returned a {value[:60]}, not plain data")
            else:
                raise ValueError("bad result entry")
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        return CodeReport(0.0, "malformed", f"the result record is malformed: {str(e)[:200]}", 0, n)
    passed, first = 0, None
    for test in tests:
        reason, detail = holds(test, values)
        if reason == "pass":
            passed += 1
        elif first is None:
            first = (reason, f"tests line {test.line} {detail}")
    if first is None:
        return CodeReport(1.0, "pass", "", passed, n)
    return CodeReport(0.0, first[0], first[1], passed, n)


def code_report(response: str, answer: str, row: Mapping[str, Any] | None = None,
                timeout_s: float = 5.0) -> CodeReport:
    """Run the response's code against `row["tests"]` (module docstring: the protocol and the threat model)."""
    return run_code_tests(extract_code(response), parse_code_tests(row_tests(row)), timeout_s)


_HEADER_KEYS = {"status", "bytes", "over", "ascii", "guarded"}


def run_code_tests(code: str, tests: list[CodeTest], timeout_s: float = 5.0) -> CodeReport:
    """Run `code` (the solution's source) against parsed `tests` in the sandbox and decide here: only the calls
    reach the child (module docstring). Also used by tool domains that hold the solution apart from the response
    (`domains.builtin.tool_code`)."""
    from sandbox.pool import run_tool_pooled
    work = tempfile.mkdtemp(prefix="alloy-code-")  # per call, removed below: no call's files outlive it
    try:
        os.chmod(work, 0o755)  # the sandbox runs as a uid of its own when we are root
        for name, text in (("solution.py", code), ("runner.py", _CODE_RUNNER),
                           ("calls.json", json.dumps(calls_of(tests)))):
            path = os.path.join(work, name)
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            os.chmod(path, 0o644)
        res = run_tool_pooled("python runner.py", work, timeout_s=timeout_s, memory_mb=CODE_MEMORY_MB,
                              allowed={"python"}, max_output_bytes=CODE_MAX_OUTPUT + _HEADER_MAX)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if res.blocked_reason:
        raise RuntimeError(f"code verifier: the sandbox refused to run python: {res.blocked_reason}")
    n = len(tests)
    if res.timed_out:
        return CodeReport(0.0, "timeout", f"over the {timeout_s:g} s limit", 0, n)
    head_text, _, payload = res.stdout.partition("\n")
    try:
        head = json.loads(head_text)
        if type(head) is not dict or set(head) != _HEADER_KEYS or type(head["status"]) is not int \
                or type(head["bytes"]) is not int:
            raise ValueError("bad header")
    except (ValueError, RecursionError):  # the reporter did not finish: killed (by the solution, or a limit)
        return CodeReport(0.0, "crash", f"exit status {res.exit_code}: {res.stderr.strip()[-200:]}", 0, n)
    if head["over"] is not False or res.truncated:
        return CodeReport(0.0, "malformed", f"the values passed {CODE_MAX_OUTPUT} bytes", 0, n)
    if head["ascii"] is not True or len(payload) != head["bytes"]:
        return CodeReport(0.0, "malformed", "the values are not one ASCII JSON record", 0, n)
    if not payload:  # the worker wrote nothing: os._exit, a signal, the memory limit
        if head["status"] == 0:
            return CodeReport(0.0, "exit", "exited with status 0 before the values were written", 0, n)
        return CodeReport(0.0, "crash", f"exit status {head['status']}: {res.stderr.strip()[-200:]}", 0, n)
    return judge_code_record(tests, payload)


def code_passes(response: str, answer: str, row: Mapping[str, Any] | None = None, timeout_s: float = 5.0) -> float:
    """`code_report(...).score`."""
    return code_report(response, answer, row, timeout_s).score
