"""The `calc` program of `sandbox.runner.PROGRAMS`: integer arithmetic through an AST whitelist (`safe_calc`), run
inside the sandbox like any other program (`_CALC_MAIN`: the function's own source and a main, for `python -I -S
-c`), so even a pathological expression is bounded by the call's limits.
"""
from __future__ import annotations

import inspect


def safe_calc(expr: str) -> str:
    """Evaluate integer arithmetic: + - * / // % ** and parentheses on integer literals. Self-contained (only `ast`),
    because its source is also run inside the sandbox. Exponents ≤ 256, results ≤ 300 digits. '/' is exact
    division: an integer when it divides, else the quotient rounded to 6 decimals."""
    import ast as _ast

    def ev(node):
        if isinstance(node, _ast.Expression):
            return ev(node.body)
        if isinstance(node, _ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, _ast.UnaryOp) and isinstance(node.op, (_ast.USub, _ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, _ast.USub) else v
        if isinstance(node, _ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            op = type(node.op).__name__
            if op == "Pow":
                if not isinstance(b, int) or not 0 <= b <= 256 or abs(a) > 10**300:
                    raise ValueError("exponent out of range")
                r = a**b
            elif op in ("Div", "FloorDiv", "Mod") and b == 0:
                raise ValueError("division by zero")
            elif op == "Div":
                r = a // b if isinstance(a, int) and isinstance(b, int) and a % b == 0 else round(a / b, 6)
            else:
                fn = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mult": lambda x, y: x * y,
                      "FloorDiv": lambda x, y: x // y, "Mod": lambda x, y: x % y}.get(op)
                if fn is None:
                    raise ValueError(f"operator {op} not allowed")
                r = fn(a, b)
            if isinstance(r, int) and abs(r) >= 10**300:
                raise ValueError("result too large")
            return r
        raise ValueError(f"{type(node).__name__} not allowed")

    if len(expr) > 200:
        raise ValueError("expression too long")
    return str(ev(_ast.parse(expr.strip(), mode="eval")))


_CALC_MAIN = ("import sys\n" + inspect.getsource(safe_calc) +
              "try:\n    print(safe_calc(' '.join(sys.argv[1:])))\n"
              "except Exception as e:\n    print(f'calc: {e}', file=sys.stderr); sys.exit(1)\n")
