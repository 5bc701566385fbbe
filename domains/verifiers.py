"""Standard verifiers by name: `get_verifier(spec)` returns a `Verifier` = (response, answer, row) -> score in [0, 1].

Specs (`VERIFIERS` are the names):

- `exact`: `response.strip() == answer.strip()`, also after Unicode NFC normalisation.
- `numeric` / `numeric:<rel_tol>` (default 1e-6; absolute tolerance 1e-9): the FINAL number of the response against
  the final number of the answer. A number is `42`, `-2.5`, `.5`, `1e3`, `1,234,567` (comma groups of three, also
  thin / narrow no-break / no-break spaces; NOT a plain space: `3 100` is two numbers), `3/4` (a fraction),
  `\\frac{3}{4}`, `$1,234.50` (currency signs ignored), `50%` (the percent sign is ignored: `50%` is 50, so it
  matches an answer `50` or `50%`, not `0.5`). The last `\\boxed{...}` wins when there is one. No number: 0.
- `choice`: multiple choice, letters A-E (or as many letters as `row["choices"]` has options). The answer is a letter
  or an option text (`row["choices"]`: a list of option texts in letter order, or a dict letter -> text). The
  response's letter comes from "answer is B" / "Answer: (B)" / `\\boxed{B}` when it says so, else from a bare
  letter, a leading label ("B) 15", "(B) 15", "B. 15") or "(B)" anywhere, else from the exact option text. Two
  different letters, or none: 0. The label counts over the text: with choices ["12","15","18"], "A) 15" is A.
- `regex:<pattern>`: 1.0 iff `re.fullmatch(pattern, response.strip())`; the answer is not used. A pattern that does
  not compile is a ValueError at `get_verifier`. The pattern comes from the config: keep it linear (no nested
  quantifiers), since it runs on model output.
- `math` / `math:<timeout_s>` (default 2 s): expression equivalence with sympy. The response's expression is the last
  `\\boxed{...}`, else the text after the last "answer is", else after the last "=" (the answer's too), with light
  LaTeX (`\\frac`, `\\sqrt`, `\\cdot`, `^`, `\\pi`) turned into sympy syntax. Inputs over 200 characters, with `__`,
  or with characters outside digits, letters, spaces and `+-*/^().,` score 0; names are limited to a whitelist of
  functions and constants, everything else is a symbol. Equal when `simplify(a - b) == 0`, or numerically (at
  random points when there are symbols). The comparison runs in a persistent helper process (thread-safe, any
  thread) with an address-space limit; a comparison over the timeout kills it and scores 0.
- `code` / `code:<timeout_s>` (default 5 s): the response's code against `row["tests"]` (asserts), run in the
  sandbox and decided in THIS process, never in the solution's: `domains.code_verifier` (the protocol, the
  threat model and the reasons a zero is counted under, `CODE_REASONS`).

A verifier never raises for any str response (a malformed one scores 0.0). A bad answer or row for the verifier
(no number for `numeric`, an answer that is no option for `choice`, no `tests` for `code`) raises ValueError naming
it: `answer_problem(spec, answer, row)` finds those before training. Plugin domains call `get_verifier` in `score`.
What `get_verifier` returns is a `NamedVerifier` (a module-level function and its options), so it pickles.
"""
from __future__ import annotations

import atexit
import inspect
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping

from domains.code_verifier import CodeReport, code_report, parse_code_tests, row_tests

Verifier = Callable[[str, str, Mapping[str, Any]], float]
VERIFIERS: tuple[str, ...] = ("exact", "numeric", "choice", "regex", "math", "code")
SPECS = "exact, numeric, numeric:<rel_tol>, choice, regex:<pattern>, math, math:<timeout_s>, code, code:<timeout_s>"
ABS_TOL = 1e-9
MATH_MAX_CHARS = 200


# -- exact --------------------------------------------------------------------------------------------------------

def exact(response: str, answer: str, row: Mapping[str, Any] | None = None) -> float:
    r, a = response.strip(), answer.strip()
    return 1.0 if r == a or unicodedata.normalize("NFC", r) == unicodedata.normalize("NFC", a) else 0.0


# -- numbers ------------------------------------------------------------------------------------------------------

_SEP = "[,\u2009\u202f\u00a0]"  # comma, thin space, narrow no-break space, no-break space
_NUM_RE = re.compile(
    rf"(?:(?<![\w)\].])([-+\u2212]))?[$€£¥]?\s*"
    rf"(?<![\d.])((?:\d{{1,3}}(?:{_SEP}\d{{3}})+|\d+)(?:\.\d+)?|\.\d+)"
    rf"(?:[eE]([-+]?\d{{1,4}}))?"
    rf"(?:\s*/\s*(\d+(?:\.\d+)?)(?![\d.]))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?[\d.]+)\s*\}\s*\{\s*([-+]?[\d.]+)\s*\}")


def _balanced(text: str, open_at: int) -> tuple[str, int] | None:
    """(the text inside the brace group that opens at `open_at`, index after it), or None if unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, or None."""
    starts = [m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        got = _balanced(text, start)
        if got is not None:
            return got[0]
    return None


def _to_fraction(sign: str, digits: str, exp: str | None, denom: str | None) -> Fraction | None:
    value = Fraction(re.sub(_SEP, "", digits))
    if exp:
        value *= Fraction(10) ** int(exp)
    if denom is not None:
        if Fraction(denom) == 0:
            return None
        value /= Fraction(denom)
    return -value if sign in ("-", "\u2212") else value


def final_number(text: str) -> Fraction | None:
    """The last number in `text` (see the module docstring for the forms), exact; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None and (inside := final_number(boxed.replace("\\boxed", ""))) is not None:
        return inside
    text = _FRAC_RE.sub(r"\1/\2", text.replace("\\%", "%").replace("\\$", "$"))
    try:
        for m in reversed(list(_NUM_RE.finditer(text))):
            value = _to_fraction(*m.groups())
            if value is not None:
                return value
    except (ValueError, ZeroDivisionError):  # e.g. an int over Python's digit limit
        return None
    return None


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    return abs(a - b) <= max(Fraction(rel_tol) * max(abs(a), abs(b)), Fraction(ABS_TOL))


def numeric(response: str, answer: str, row: Mapping[str, Any] | None = None, rel_tol: float = 1e-6) -> float:
    want = final_number(answer)
    if want is None:
        raise ValueError(f"numeric verifier: the answer {answer!r} has no number")
    got = final_number(response)
    return 1.0 if got is not None and _close(got, want, rel_tol) else 0.0


# -- multiple choice ----------------------------------------------------------------------------------------------

def _norm_text(s: str) -> str:
    return " ".join(unicodedata.normalize("NFC", s).split()).casefold().rstrip(".")


def _options(row: Mapping[str, Any]) -> dict[str, str]:
    """{letter: option text} from `row["choices"]` (a list in letter order or a dict), else A-E without texts."""
    choices = row.get("choices") if row else None
    if choices is None:
        return {c: "" for c in "ABCDE"}
    if isinstance(choices, Mapping):
        out = {str(k).strip().upper(): str(v) for k, v in choices.items()}
        if not out or not all(re.fullmatch("[A-Z]", k) for k in out):
            raise ValueError(f"choice verifier: row field 'choices' as a dict needs single letters A-Z as keys, "
                             f"got {sorted(out)}")
        return out
    if isinstance(choices, (list, tuple)) or hasattr(choices, "tolist"):  # a numpy array from parquet
        items = list(choices.tolist() if hasattr(choices, "tolist") else choices)
        if not 1 <= len(items) <= 26:
            raise ValueError(f"choice verifier: row field 'choices' has {len(items)} options (1 to 26 allowed)")
        return {chr(ord("A") + i): str(v) for i, v in enumerate(items)}
    raise ValueError(f"choice verifier: row field 'choices' must be a list or a dict, not {type(choices).__name__}")


def _answer_letter(answer: str, options: dict[str, str]) -> str:
    a = answer.strip()
    m = re.fullmatch(r"\(?([A-Za-z])[).]?", a)
    if m and m.group(1).upper() in options:
        return m.group(1).upper()
    for letter, text in options.items():
        if text and _norm_text(text) == _norm_text(a):
            return letter
    raise ValueError(f"choice verifier: the answer {answer!r} is neither an option letter "
                     f"({', '.join(options)}) nor an option text")


def chosen_letters(response: str, options: dict[str, str]) -> set[str]:
    """The letters `response` gives as its answer (see the module docstring); more than one means ambiguous."""
    text = response.replace("*", "").strip()
    letters = "".join(options)
    cls = f"[{letters}{letters.lower()}]"
    explicit = re.findall(rf"(?i:answer)(?:\s+(?i:is))?\s*[:=]?\s*\(?([{letters}])\)?(?![A-Za-z])", text)
    boxed = last_boxed(text)
    if boxed is not None and re.fullmatch(rf"\s*\(?{cls}\)?\s*", boxed):
        explicit.append(boxed.strip(" ()"))
    if explicit:
        return {c.upper() for c in explicit}
    found = set()
    if m := re.fullmatch(rf"\(?({cls})\)?[.:]?", text):
        found.add(m.group(1).upper())
    found |= set(re.findall(rf"(?m)^\s*\(?([{letters}])[).:](?:\s|$)", text))
    found |= set(re.findall(rf"\(([{letters}])\)", text))
    if not found:
        found |= {k for k, v in options.items() if v and _norm_text(v) == _norm_text(text)}
    return found


def choice(response: str, answer: str, row: Mapping[str, Any] | None = None) -> float:
    options = _options(row or {})
    want = _answer_letter(answer, options)
    got = chosen_letters(response, options)
    return 1.0 if got == {want} else 0.0


# -- regex --------------------------------------------------------------------------------------------------------

def _compile(spec: str, pattern: str) -> re.Pattern:
    if not pattern:
        raise ValueError(f"verifier {spec!r}: regex needs a pattern (regex:<pattern>); valid verifiers: {SPECS}")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"verifier {spec!r}: the pattern does not compile: {e}; valid verifiers: {SPECS}") from None
    return compiled


def regex_match(response: str, answer: str, row: Mapping[str, Any] | None = None,
                pattern: re.Pattern | None = None) -> float:
    assert pattern is not None, "regex_match needs a compiled pattern"
    return 1.0 if pattern.fullmatch(response.strip()) else 0.0


# -- math (sympy in a helper process) -----------------------------------------------------------------------------

_MATH_CHARS = re.compile(r"[0-9A-Za-z\s+\-*/^().,]*")
_MATH_NAMES = {"sqrt", "exp", "log", "ln", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan",
               "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "abs", "pi", "e", "i", "oo", "infty", "infinity"}


def _latex_to_plain(s: str) -> str:
    s = s.replace("$", "").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[,;:! ]", " ", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    for _ in range(20):  # \frac{a}{b} -> ((a)/(b)), \sqrt{a} -> sqrt(a), innermost first is not needed
        m = re.search(r"\\frac\s*\{", s) or re.search(r"\\sqrt\s*\{", s)
        if not m:
            break
        first = _balanced(s, m.end() - 1)
        if first is None:
            break
        if m.group(0).startswith("\\frac"):
            rest = s[first[1]:].lstrip()
            second = _balanced(rest, 0) if rest.startswith("{") else None
            if second is None:
                break
            s = s[:m.start()] + f"(({first[0]})/({second[0]}))" + rest[second[1]:]
        else:
            s = s[:m.start()] + f"sqrt({first[0]})" + s[first[1]:]
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = re.sub(r"\\([A-Za-z]+)", r" \1 ", s)
    return s.replace("{", "(").replace("}", ")").strip()


def math_expression(text: str) -> str:
    """The expression a response (or an answer) gives: last \\boxed{...}, else after the last "answer is", else after
    the last "=", as plain sympy-parsable text (thousands commas and a trailing period removed)."""
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    else:
        low = text.lower()
        at = low.rfind("answer is")
        if at >= 0:
            text = text[at + len("answer is"):]
        text = text.rsplit("=", 1)[-1].lstrip(":")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", _latex_to_plain(text)).strip()  # 1,000 -> 1000
    return text[:-1].strip() if text.endswith(".") else text


def math_input_problem(expr: str) -> str | None:
    """Why `expr` is refused before parsing (length, `__`, characters, a stray '.'), or None."""
    if not expr:
        return "empty expression"
    if len(expr) > MATH_MAX_CHARS:
        return f"longer than {MATH_MAX_CHARS} characters"
    if "__" in expr:
        return "contains '__'"
    if not _MATH_CHARS.fullmatch(expr):
        return "characters outside digits, letters, spaces and +-*/^().,"
    if re.search(r"\.(?!\d)|[A-Za-z)]\.", expr):
        return "a '.' that is not a decimal point"
    return None


def _sympy_equivalent(a: str, b: str) -> bool:
    """Self-contained (its source also runs in the helper process): a and b parse with a whitelist and are equal."""
    import keyword
    import random as _random
    import re as _re

    import sympy as sp
    from sympy.parsing.sympy_parser import (auto_number, auto_symbol, convert_xor,
                                            implicit_multiplication_application, parse_expr)

    names = {"sqrt": sp.sqrt, "exp": sp.exp, "log": sp.log, "ln": sp.log, "sin": sp.sin, "cos": sp.cos,
             "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc, "asin": sp.asin, "acos": sp.acos,
             "atan": sp.atan, "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan, "sinh": sp.sinh,
             "cosh": sp.cosh, "tanh": sp.tanh, "abs": sp.Abs, "pi": sp.pi, "e": sp.E, "i": sp.I, "oo": sp.oo,
             "infty": sp.oo, "infinity": sp.oo}
    glob = {"__builtins__": {}, "Integer": sp.Integer, "Float": sp.Float, "Rational": sp.Rational,
            "Symbol": sp.Symbol, "Function": sp.Function, **names}

    def parse(s: str):
        for word in _re.findall(r"[A-Za-z]+", s):
            if keyword.iskeyword(word):
                raise ValueError(f"keyword {word!r}")
        return parse_expr(s, local_dict={}, global_dict=dict(glob),
                          transformations=(auto_symbol, auto_number, convert_xor,
                                           implicit_multiplication_application))

    ea, eb = parse(a), parse(b)
    diff = sp.simplify(ea - eb)
    if diff == 0:
        return True
    syms = sorted(diff.free_symbols, key=str)
    rng, checked = _random.Random(0), 0
    for _ in range(12 if syms else 1):
        point = {s: sp.Rational(rng.randint(-300, 300), 97) for s in syms}
        try:
            d, scale = complex(sp.N(diff.subs(point))), complex(sp.N(ea.subs(point)))
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if not (math.isfinite(d.real) and math.isfinite(d.imag)):
            continue
        if abs(d) > 1e-9 * max(1.0, abs(scale)):
            return False
        checked += 1
    return checked >= (3 if syms else 1)


_MATH_WORKER = ("import json, math, resource, sys\n"
                "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
                + inspect.getsource(_sympy_equivalent) +
                "import sympy\nprint('ready', flush=True)\n"
                "for line in sys.stdin:\n"
                "    req = json.loads(line)\n"
                "    try:\n        out = {'eq': bool(_sympy_equivalent(req['a'], req['b']))}\n"
                "    except Exception as e:\n        out = {'eq': False, 'error': f'{type(e).__name__}: {e}'[:300]}\n"
                "    print(json.dumps(out), flush=True)\n")


class _MathWorker:
    """One persistent helper process per parent process (restarted after a timeout or in a forked child)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.buf = b""

    def _read_line(self, timeout_s: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def _start(self) -> None:
        from infra.secrets import scrubbed_env  # the helper parses untrusted text: no credentials in its environment

        self.proc = subprocess.Popen([sys.executable, "-c", _MATH_WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                     env=scrubbed_env())
        self.pid, self.buf = os.getpid(), b""
        if self._read_line(120.0) != b"ready":
            self._stop()
            raise RuntimeError("math verifier: the sympy helper process did not start")

    def _stop(self) -> None:
        if self.proc is not None and self.pid == os.getpid():
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
        self.proc = None

    def close(self) -> None:
        with self.lock:
            self._stop()

    def equivalent(self, a: str, b: str, timeout_s: float) -> bool:
        with self.lock:
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                self.proc = None
                self._start()
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write((json.dumps({"a": a, "b": b}) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._stop()
                return False
            line = self._read_line(timeout_s)
            if line is None:  # over the time limit (or the helper died): kill it, the next call starts a new one
                self._stop()
                return False
            return bool(json.loads(line).get("eq"))


_math_worker = _MathWorker()
atexit.register(_math_worker.close)


def _plain_number(expr: str) -> Fraction | None:
    m = _NUM_RE.fullmatch(expr.strip())
    return _to_fraction(*m.groups()) if m else None


def math_equal(response: str, answer: str, row: Mapping[str, Any] | None = None, timeout_s: float = 2.0) -> float:
    want = math_expression(answer)
    why = math_input_problem(want)
    if why:
        raise ValueError(f"math verifier: the answer {answer!r} is not usable: {why}")
    got = math_expression(response)
    if math_input_problem(got):
        return 0.0
    try:
        a, b = _plain_number(got), _plain_number(want)
    except (ValueError, ZeroDivisionError):
        a = b = None
    if a is not None and b is not None:  # fast path: two plain numbers need no sympy
        return 1.0 if _close(a, b, 1e-9) else 0.0
    return 1.0 if _math_worker.equivalent(got, want, timeout_s) else 0.0


class OutcomeCounts:
    """Thread-safe counts of a verifier's outcomes by reason (for `code`: `CODE_REASONS`); pickles without its lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getstate__(self) -> dict:
        return {"counts": self.snapshot()}

    def __setstate__(self, state: dict) -> None:
        self._lock, self._counts = threading.Lock(), dict(state["counts"])


def verifier_outcomes(domain: Any) -> dict[str, int]:
    """The cumulative outcome counts of `domain`'s verifier (a dataset domain's `verifier`, or those of a
    `MixedDomain`'s domains, summed); {} for domains whose verifier keeps none."""
    out: dict[str, int] = {}
    parts = getattr(domain, "domains", None)
    for d in (parts.values() if isinstance(parts, Mapping) else [domain]):
        counts = getattr(getattr(d, "verifier", None), "outcomes", None)
        if isinstance(counts, OutcomeCounts):
            for k, v in counts.snapshot().items():
                out[k] = out.get(k, 0) + v
    return out


# -- by name ------------------------------------------------------------------------------------------------------

def _number_arg(spec: str, arg: str, what: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (what == "timeout" and value == 0):
        raise ValueError(f"verifier {spec!r}: {arg!r} is not a valid {what} (a finite number"
                         f"{' > 0' if what == 'timeout' else ' >= 0'}); valid verifiers: {SPECS}")
    return value


@dataclass(frozen=True)
class NamedVerifier:
    """What `get_verifier` returns: a module-level scoring function and its options, so it pickles (a domain
    holding one can cross process boundaries). Calling it returns 0.0 for a non-str response and clamps to
    [0, 1]; errors about the answer or the row (ValueError, RuntimeError) still raise. A function that returns a
    `CodeReport` (`code`) has its reason counted in `outcomes` (`verifier_outcomes(domain)` reads them)."""
    spec: str
    fn: Callable[..., Any]
    options: tuple[tuple[str, Any], ...] = ()
    outcomes: OutcomeCounts = field(default_factory=OutcomeCounts, compare=False, repr=False)

    def __call__(self, response: str, answer: str, row: Mapping[str, Any] | None = None) -> float:
        if not isinstance(response, str):
            return 0.0
        score = self.fn(response, str(answer), row if row is not None else {}, **dict(self.options))
        if isinstance(score, CodeReport):
            self.outcomes.add(score.reason)
            score = score.score
        return min(1.0, max(0.0, float(score)))


def get_verifier(spec: str) -> Verifier:
    """The verifier for `spec` (see the module docstring). Unknown names, bad patterns and bad numbers raise
    ValueError naming the spec and listing the valid ones."""
    if not isinstance(spec, str):
        raise ValueError(f"verifier {spec!r}: must be a string; valid verifiers: {SPECS}")
    name, sep, arg = spec.partition(":")
    name = name.strip()
    if name == "regex":
        return NamedVerifier(spec, regex_match, (("pattern", _compile(spec, arg)),))
    if sep and name in ("exact", "choice"):
        raise ValueError(f"verifier {spec!r}: {name} takes no argument; valid verifiers: {SPECS}")
    if name == "exact":
        return NamedVerifier(spec, exact)
    if name == "choice":
        return NamedVerifier(spec, choice)
    if name == "numeric":
        return NamedVerifier(spec, numeric, (("rel_tol", _number_arg(spec, arg, "relative tolerance")),) if sep else ())
    if name == "math":
        return NamedVerifier(spec, math_equal, (("timeout_s", _number_arg(spec, arg, "timeout")),) if sep else ())
    if name == "code":
        return NamedVerifier(spec, code_report, (("timeout_s", _number_arg(spec, arg, "timeout")),) if sep else ())
    raise ValueError(f"unknown verifier {spec!r}; valid verifiers: {SPECS}")


def answer_problem(spec: str, answer: Any, row: Mapping[str, Any] | None = None) -> str | None:
    """Why `answer` (with `row`) cannot be scored by the verifier `spec`, or None: for refusing bad dataset rows
    before training. Cheap: runs no sandbox and no sympy."""
    if not isinstance(answer, str):
        return f"the answer must be a string, not {type(answer).__name__}"
    name = spec.strip().partition(":")[0]
    try:
        if name == "numeric" and final_number(answer) is None:
            return f"the answer {answer!r} has no number"
        if name == "choice":
            _answer_letter(answer, _options(row or {}))
        if name == "math" and (why := math_input_problem(math_expression(answer))):
            return f"the answer {answer!r} is not usable: {why}"
        if name == "code":
            parse_code_tests(row_tests(row))
    except ValueError as e:
        return str(e).split(": ", 1)[-1]
    return None
