"""The tests of a `code` row as data the verifier decides itself (`domains.code_verifier`; issue 52).

A row's `tests` are asserts. Each is parsed HERE, when the dataset loads, into a plan: the calls to the solution it
needs (`f(2, 3)`, `Solution().run([1])`: a callee that is not one of the helpers below, with literal arguments or
such calls), which only the sandboxed child evaluates, and everything around them, which only THIS process
evaluates (`evaluate`), on the plain values the child reported for those calls. So every comparison, truth test,
`all`/`any`, `isclose`, `in`, method call (`.startswith`), subscript and arithmetic of a test is applied by the
parent to plain data (None, bool, int, float, str, list, tuple, dict, set) it decoded itself: no object the solution
made is ever asked `==`, `bool()` or anything else, and the child never sees an expected value or the test source.

Accepted around the calls (anything else is a ValueError naming the line, and the row is refused at load):
literals of plain data; `==`, `!=`, `<`, `<=`, `>`, `>=`, `in`, `not in` (chains too) and `is` / `is not` against
None, True, False or a type; `and`, `or`, `not`; unary `-`/`+`; `+ - * / // % **` on numbers; subscripts and
slices; list/tuple/set/dict displays; the type names `int float str bool list tuple dict set frozenset`; the helpers
`abs len sorted(reverse=) reversed min max sum round all any isinstance type` and the type names called;
`math.isclose(rel_tol=, abs_tol=)`, `math.sqrt floor ceil fabs isnan isinf isfinite`, the constants `math.pi e tau
inf nan`; the methods of `METHODS` on a value of that type (`f(x).startswith("a")`, `f(x).get("k")`).

Truth is strict: every value an `assert`, `not`, `and`, `or`, `all` or `any` tests must be a bool, so a bare
`assert f(x)` passes only when `f(x)` returned `True` (not 1, not a non-empty list), and `assert not f(x)` only on
`False`. The parent's own comparisons give bools, so ordinary tests are unaffected. Refused besides unsupported
syntax: an assert on a display or constant (`assert (f(1) == 1, f(2) == 2)` is always true in Python), an assert
that calls nothing of the solution, statements other than asserts, an assert message that is not a literal.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # nesting of a plain value
_PLAIN_SCALARS = (type(None), bool, int, float, str)
TYPE_NAMES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset)}
HELPERS: dict[str, tuple[str, ...]] = {  # name -> keyword arguments it accepts
    "abs": (), "len": (), "sorted": ("reverse",), "reversed": (), "min": (), "max": (), "sum": (), "round": (),
    "all": (), "any": (), "isinstance": (), "type": (), **{n: () for n in TYPE_NAMES},
    "math.isclose": ("rel_tol", "abs_tol"), "math.sqrt": (), "math.floor": (), "math.ceil": (), "math.fabs": (),
    "math.isnan": (), "math.isinf": (), "math.isfinite": ()}
MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}
_STR_METHODS = ("startswith", "endswith", "lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "count",
                "find", "rfind", "index", "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower", "title",
                "capitalize", "replace", "join", "splitlines")
METHODS: dict[type, tuple[str, ...]] = {str: _STR_METHODS, list: ("count", "index"), tuple: ("count", "index"),
                                        dict: ("get", "keys", "values", "items"),
                                        set: ("issubset", "issuperset", "union", "intersection", "difference"),
                                        frozenset: ("issubset", "issuperset", "union", "intersection", "difference")}
_ALL_METHODS = frozenset(m for ms in METHODS.values() for m in ms)
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.In: "in",
        ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
FORMS = ("asserts over calls to the solution with literal arguments, decided by the verifier: comparisons "
         "(== != < <= > >= in, `is` None/True/False), and/or/not, arithmetic, subscripts, literals of None, bool, "
         "int, float, str, list, tuple, dict, set, the helpers abs len sorted min max sum round all any isinstance "
         "type math.isclose (domains/code_tests.py)")


class Refused(ValueError):
    """A test the verifier cannot decide by itself (the message says why)."""


class CallFailed(Exception):
    """Stands in `values` for a call that raised (`reason` "error" or "exit") or returned no plain data
    ("not_plain"); raised when the evaluation needs that value (so `x or f(1)` with x true never needs `f(1)`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class Failed(Exception):
    """A test that does not hold for the reported values (not a bool where one is needed, a type the parent does not
    operate on); an ordinary failure, like a wrong value."""


@dataclass(frozen=True)
class CodeTest:
    """One parsed assert. `plan` (nested tuples, see `_parse`) is evaluated by the parent; `calls` are the sources
    of the solution calls it needs (the child evaluates only those); `source` the assert's test, `line` its line."""
    source: str
    plan: tuple
    calls: tuple[str, ...]
    line: int

    @property
    def expr(self) -> str:
        """The one call of an `assert <call> == <literal>` (else the test's source): for messages and demos."""
        return self.calls[0] if self.expected is not None else self.source

    @property
    def expected(self) -> Any:
        """The literal of an `assert <call> == <literal>` / `<literal> == <call>`, else None."""
        p = self.plan
        if p[0] == "cmp" and len(p[2]) == 1 and p[2][0][0] == "==":
            a, b = p[1], p[2][0][1]
            if a[0] == "call" and b[0] == "const":
                return b[1]
            if b[0] == "call" and a[0] == "const":
                return a[1]
        return None


def is_plain(v: Any, depth: int = 0) -> bool:
    """True iff `v` is plain data by exact type (no subclass): None, bool, int, float, str, or a list, tuple, set,
    frozenset, dict of plain data, nested at most `MAX_DEPTH`."""
    t = type(v)
    if t in _PLAIN_SCALARS:
        return True
    if depth > MAX_DEPTH:
        return False
    if t in (list, tuple, set, frozenset):
        return all(is_plain(x, depth + 1) for x in v)
    if t is dict:
        return all(is_plain(k, depth + 1) and is_plain(x, depth + 1) for k, x in v.items())
    return False


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _callee_ok(func: ast.AST) -> bool:
    """A callee of the solution: a name that is no helper, or an attribute of such a name or of a solution call."""
    if isinstance(func, ast.Name):
        return func.id not in HELPERS and func.id != "math"
    if isinstance(func, ast.Attribute):
        if func.attr.startswith("_"):  # `f(1).__eq__(2)` asks the solution's object, not a function of the task
            return False
        v = func.value
        return _callee_ok(v) if isinstance(v, ast.Name) else _is_solution_call(v)
    return False


def _is_solution_call(n: ast.AST) -> bool:
    if not isinstance(n, ast.Call) or not _callee_ok(n.func):
        return False
    for a in list(n.args) + [k.value for k in n.keywords]:
        if isinstance(a, ast.Starred) or not (_literal(a)[0] or _is_solution_call(a)):
            return False
    return all(k.arg is not None for k in n.keywords)


def _parse(n: ast.AST) -> tuple:
    """The plan of an expression (Refused when some part is not supported)."""
    if isinstance(n, ast.Constant):
        if type(n.value) not in _PLAIN_SCALARS:
            raise Refused(f"the expected value {ast.unparse(n)[:80]!r} is a {type(n.value).__name__}, not plain "
                          "data (None, bool, int, float, str, list, tuple, dict, set)")
        return ("const", n.value)
    if isinstance(n, (ast.List, ast.Tuple, ast.Set)):
        return (type(n).__name__.lower(), tuple(_parse(x) for x in n.elts))
    if isinstance(n, ast.Dict):
        if any(k is None for k in n.keys):
            raise Refused("`**` in a dict display")
        return ("dict", tuple(_parse(k) for k in n.keys), tuple(_parse(v) for v in n.values))
    if isinstance(n, ast.Name):
        if n.id in TYPE_NAMES:
            return ("type", n.id)
        raise Refused(f"the name `{n.id}` is neither a call to the solution nor a known type")
    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "math" \
            and n.attr in MATH_CONSTANTS:
        return ("const", MATH_CONSTANTS[n.attr])
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)) and isinstance(n.operand, ast.Constant) \
            and type(n.operand.value) in (int, float):
        return ("const", ast.literal_eval(n))  # -1 is a literal, as in `assert f(1) == -1`
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub, ast.UAdd)):
        return ({ast.Not: "not", ast.USub: "neg", ast.UAdd: "pos"}[type(n.op)], _parse(n.operand))
    if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
        return ("bin", _BIN[type(n.op)], _parse(n.left), _parse(n.right))
    if isinstance(n, ast.BoolOp):
        return ("and" if isinstance(n.op, ast.And) else "or", tuple(_parse(v) for v in n.values))
    if isinstance(n, ast.Compare) and all(type(op) in _CMP for op in n.ops):
        first, rest = _parse(n.left), tuple((_CMP[type(op)], _parse(c)) for op, c in zip(n.ops, n.comparators))
        left = first
        for op, right in rest:
            if op in ("is", "is not") and not (_singleton(right) or (right[0] == "type" and left[0] == "helper")):
                raise Refused(f"`{op}` compares identity; only `is None/True/False` (or `type(x) is <type>`) "
                              "is supported")
            left = right
        return ("cmp", first, rest)
    if isinstance(n, ast.Subscript):
        s = n.slice
        if isinstance(s, ast.Slice):
            idx = ("slice",) + tuple(None if p is None else _parse(p) for p in (s.lower, s.upper, s.step))
        else:
            idx = _parse(s)
        return ("sub", _parse(n.value), idx)
    if isinstance(n, ast.Call):
        return _parse_call(n)
    raise Refused(f"`{ast.unparse(n)[:80]}` ({type(n).__name__}) is not supported")


def _singleton(plan: tuple) -> bool:
    return plan[0] == "const" and (plan[1] is None or type(plan[1]) is bool)


def _parse_call(n: ast.Call) -> tuple:
    f = n.func
    name = f.id if isinstance(f, ast.Name) else (
        f"math.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"
        else None)
    if name in HELPERS:
        if any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg not in HELPERS[name] for k in n.keywords):
            raise Refused(f"`{ast.unparse(n)[:80]}`: {name} takes only positional arguments"
                          + (f" and {', '.join(HELPERS[name])}=" if HELPERS[name] else ""))
        return ("helper", name, tuple(_parse(a) for a in n.args),
                tuple((k.arg, _parse(k.value)) for k in n.keywords))
    if isinstance(f, ast.Attribute) and f.attr in _ALL_METHODS and not isinstance(f.value, ast.Name):
        # a method of a value (`f(x).startswith("a")`, `", ".join(f(x))`): applied here, to plain data
        recv = ("call", ast.unparse(f.value)) if _is_solution_call(f.value) else _parse(f.value)
        if n.keywords or any(isinstance(a, ast.Starred) for a in n.args):
            raise Refused(f"`{ast.unparse(n)[:80]}`: methods take only positional arguments")
        return ("method", f.attr, recv, tuple(_parse(a) for a in n.args))
    if _is_solution_call(n):
        return ("call", ast.unparse(n))
    if name == "math" or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"):
        raise Refused(f"`{ast.unparse(n)[:80]}`: math.{getattr(f, 'attr', '?')} is not a supported helper")
    raise Refused(f"`{ast.unparse(n)[:80]}` is a call the verifier cannot decide (a call to the solution takes "
                  "only literal arguments or other such calls; helpers: " + ", ".join(sorted(HELPERS)) + ")")


def parse_code_tests(tests: str) -> list[CodeTest]:
    """`row["tests"]` (Python source) as data: one `CodeTest` per top-level assert (module docstring). Anything
    else is a ValueError naming the line; an unparseable source or one with no assert is a ValueError too."""
    try:
        tree = ast.parse(tests)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"code verifier: the row's tests do not parse as Python: {e}") from None
    out: list[CodeTest] = []
    for stmt in tree.body:
        where = f"code verifier: field 'tests' line {stmt.lineno}"
        if not isinstance(stmt, ast.Assert):
            raise ValueError(f"{where}: a statement of type {type(stmt).__name__}; only asserts are supported: "
                             f"{FORMS}")
        t, src = stmt.test, ast.unparse(stmt.test)
        if stmt.msg is not None and not isinstance(stmt.msg, ast.Constant):
            raise ValueError(f"{where}: the assert's message must be a literal")
        if isinstance(t, (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Constant)):
            raise ValueError(f"{where}: `{src[:80]}` asserts a {type(t).__name__.lower()}, which Python finds "
                             "always true (or always false); assert each comparison, or all([...]) of them")
        try:
            plan = _parse(t)
        except Refused as e:
            raise ValueError(f"{where}: `{src[:80]}` is not one of the supported forms: {e}") from None
        except RecursionError:
            raise ValueError(f"{where}: nested too deep") from None
        calls = tuple(dict.fromkeys(_calls(plan)))
        if not calls:
            raise ValueError(f"{where}: `{src[:80]}` calls nothing of the solution, so it tests nothing")
        out.append(CodeTest(src, plan, calls, stmt.lineno))
    if not out:
        raise ValueError("code verifier: the row's tests contain no assert")
    return out


_TAGS = frozenset(("const", "call", "type", "list", "tuple", "set", "dict", "not", "neg", "pos", "bin", "and", "or",
                   "cmp", "sub", "slice", "helper", "method"))


def _calls(part: Any) -> list[str]:
    """The solution calls in a plan (or a tuple of plans, operators and keyword names), in order."""
    if type(part) is not tuple or not part:
        return []
    if type(part[0]) is str and part[0] in _TAGS:
        if part[0] == "call":
            return [part[1]]
        if part[0] in ("const", "type"):
            return []
        part = part[1:]
    return [c for p in part for c in _calls(p)]


def calls_of(tests: list[CodeTest]) -> list[str]:
    """The distinct solution calls of `tests`, in order of first use: what the child evaluates, one value each."""
    return list(dict.fromkeys(c for t in tests for c in t.calls))



# -- the parent's evaluation ------------------------------------------------------------------------------------------

def _truth(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise Failed(f"{what} is {repr(v)[:60]}, a {type(v).__name__}, not a bool")
    return v


def _number(v: Any) -> Any:
    if type(v) not in (int, float, bool):
        raise Failed(f"arithmetic on a {type(v).__name__}")
    return v


def _binop(op: str, a: Any, b: Any) -> Any:
    a, b = _number(a), _number(b)
    if op == "**" and type(b) is not float and abs(b) > 64:
        raise Failed("an exponent over 64")
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b, "//": lambda: a // b,
            "%": lambda: a % b, "**": lambda: a ** b}[op]()


def _compare(op: str, a: Any, b: Any) -> bool:
    if op in ("is", "is not"):
        same = a is b
        return same if op == "is" else not same
    r = {"==": lambda: a == b, "!=": lambda: a != b, "<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b,
         ">=": lambda: a >= b, "in": lambda: a in b, "not in": lambda: a not in b}[op]()
    return _truth(r, f"`{op}`")  # plain data always gives a bool; kept strict all the same


def _helper(name: str, args: list, kwargs: dict) -> Any:
    if name in ("all", "any"):
        if len(args) != 1 or type(args[0]) not in (list, tuple, set, frozenset, dict):
            raise Failed(f"{name}() of a {type(args[0]).__name__ if args else 'nothing'}")
        items = [_truth(x, f"an item of {name}()") for x in args[0]]
        return all(items) if name == "all" else any(items)
    if name == "isinstance":
        if len(args) != 2:
            raise Failed("isinstance() takes 2 arguments")
        types = args[1] if type(args[1]) is tuple else (args[1],)
        if not all(t in TYPE_NAMES.values() for t in types):
            raise Failed("isinstance() of an unknown type")
        return isinstance(args[0], types)
    if name == "type":
        return type(args[0]) if len(args) == 1 else _fail("type() takes 1 argument")
    if name == "reversed":
        return list(reversed(args[0])) if len(args) == 1 else _fail("reversed() takes 1 argument")
    if name.startswith("math."):
        return getattr(math, name[5:])(*args, **kwargs)
    if name in TYPE_NAMES and any(type(a) is type for a in args):
        raise Failed(f"{name}() of a type")
    fn = {"abs": abs, "len": len, "sorted": sorted, "min": min, "max": max, "sum": sum, "round": round,
          **TYPE_NAMES}[name]
    return fn(*args, **kwargs)


def _fail(msg: str) -> Any:
    raise Failed(msg)


def _method(name: str, recv: Any, args: list) -> Any:
    if name not in METHODS.get(type(recv), ()):
        raise Failed(f"`.{name}()` on a {type(recv).__name__}")
    out = getattr(recv, name)(*args)
    return list(out) if name in ("keys", "values", "items") else out


def evaluate(plan: tuple, values: dict[str, Any]) -> Any:
    """The value of `plan` (`_parse`) with each solution call replaced by its value in `values` (plain data the
    parent decoded). Raises Failed when a truth test meets a non-bool or an operation meets a type it is not for;
    other exceptions of the builtins (TypeError, ZeroDivisionError, IndexError, ...) propagate: the caller treats
    any exception as a failed test."""
    kind = plan[0]
    if kind == "const":
        return plan[1]
    if kind == "call":
        v = values[plan[1]]
        if type(v) is CallFailed:
            raise v
        return v
    if kind == "type":
        return TYPE_NAMES[plan[1]]
    if kind in ("list", "tuple", "set"):
        items = [evaluate(p, values) for p in plan[1]]
        return {"list": list, "tuple": tuple, "set": set}[kind](items)
    if kind == "dict":
        return {evaluate(k, values): evaluate(v, values) for k, v in zip(plan[1], plan[2])}
    if kind == "not":
        return not _truth(evaluate(plan[1], values), "the operand of `not`")
    if kind in ("neg", "pos"):
        v = _number(evaluate(plan[1], values))
        return -v if kind == "neg" else +v
    if kind == "bin":
        return _binop(plan[1], evaluate(plan[2], values), evaluate(plan[3], values))
    if kind in ("and", "or"):
        for p in plan[1]:  # short-circuit like Python, on bools only
            v = _truth(evaluate(p, values), f"an operand of `{kind}`")
            if v is (kind == "or"):
                return v
        return kind == "and"
    if kind == "cmp":
        left = evaluate(plan[1], values)
        for op, p in plan[2]:
            right = evaluate(p, values)
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if kind == "sub":
        recv = evaluate(plan[1], values)
        if type(recv) not in (list, tuple, str, dict):
            raise Failed(f"a subscript of a {type(recv).__name__}")
        idx = plan[2]
        if idx[0] == "slice":
            return recv[slice(*(None if p is None else evaluate(p, values) for p in idx[1:]))]
        return recv[evaluate(idx, values)]
    if kind == "helper":
        return _helper(plan[1], [evaluate(p, values) for p in plan[2]], {k: evaluate(p, values) for k, p in plan[3]})
    if kind == "method":
        return _method(plan[1], evaluate(plan[2], values), [evaluate(p, values) for p in plan[3]])
    raise AssertionError(f"unknown plan node {kind!r}")


def holds(test: CodeTest, values: dict[str, Any]) -> tuple[str, str]:
    """("pass", "") when `test` holds for the reported `values` (its value is exactly True), else (reason, detail):
    "wrong" (False, not a bool, an operation refused by plain data), or the reason of a `CallFailed` it needed."""
    try:
        v = evaluate(test.plan, values)
        if v is True:
            return "pass", ""
        return "wrong", (f"`{test.source[:80]}` is False" if v is False else
                         f"`{test.source[:80]}` is {repr(v)[:60]}, a {type(v).__name__}, not a bool")
    except CallFailed as e:
        return e.reason, e.detail
    except Failed as e:
        return "wrong", f"`{test.source[:80]}`: {e}"
    except Exception as e:  # a builtin refusing plain data (TypeError, ZeroDivisionError, ...): a failed test
        return "wrong", f"`{test.source[:80]}` raised {type(e).__name__}: {str(e)[:100]}"
