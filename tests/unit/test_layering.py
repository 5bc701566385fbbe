"""Imports follow the floors that docs/architecture.md states (its "Layering" block, the one statement of the order),
read from the source with `ast` (nothing is imported):

- a package may import its own modules and any package on a floor below it, never one above it;
- packages on one floor (`teachers | student`, `engine | sandbox`) never import each other:
  what both need lives below them;
- no cycle between modules: no two modules import each other, directly or around a loop.

Every import counts, also one inside a function (a lazy import is still a dependency). The checker checks itself on
a planted tree (`test_the_checks_catch_violations`), and every top-level package of the tree is on a floor.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- floors (top first; read by tests/unit/test_layering.py) -->"
NOT_PRODUCT = {"tests", "docs", "configs", "deploy", "examples", "runs"}  # folders that hold no layered code


def read_floors(doc: Path) -> dict[str, int]:
    """{package: floor} from the fenced block after MARKER in `doc`: one line a floor, top first, packages of a floor
    separated by `|`, then (after two spaces) what lives there. The ground is floor 0."""
    text = doc.read_text()
    assert MARKER in text, f"{doc}: no floors block (the line {MARKER!r})"
    block = text.split(MARKER, 1)[1].split("```", 2)[1]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    floors = {}
    for i, ln in enumerate(lines):
        names = re.split(r"\s{2,}", ln.strip(), maxsplit=1)[0]
        for name in names.split("|"):
            floors[name.strip()] = len(lines) - 1 - i
    return floors


LAYER = read_floors(ROOT / "docs" / "architecture.md")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_modules(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """{dotted module name: (path, tree)} of every .py file under the layered packages."""
    out = {}
    for pkg in LAYER:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path, root)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return out


def imported_modules(name: str, path: Path, tree: ast.Module, known: set[str]) -> list[tuple[str, int]]:
    """(imported project module, line) for every import in `tree`, at any depth; `from pkg import mod` names the
    submodule when there is one."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
    result = []
    for mod, line in out:
        while mod and mod not in known and "." in mod:  # `import engine.client` → engine.client
            mod = mod.rsplit(".", 1)[0]
        if mod in known and mod != name:
            result.append((mod, line))
    return result


def graph(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, list[tuple[str, int]]]:
    known = set(modules)
    return {name: imported_modules(name, path, tree, known) for name, (path, tree) in modules.items()}


def layer_violations(edges: dict[str, list[tuple[str, int]]], modules: dict, root: Path = ROOT) -> list[str]:
    bad = []
    for src, targets in edges.items():
        a = src.split(".")[0]
        for dst, line in targets:
            b = dst.split(".")[0]
            if a == b:
                continue
            if LAYER[b] >= LAYER[a]:  # upward, or sideways (teachers ↔ student)
                bad.append(f"{modules[src][0].relative_to(root)}:{line}: {a} must not import {b} ({dst})")
    return bad


def cycles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    succ = {n: sorted({d for d, _ in ts}) for n, ts in edges.items()}

    def visit(root: str) -> None:
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for n in succ:
        if n not in index:
            visit(n)
    return out


def test_the_floors_cover_the_tree():
    """Every top-level package of the tree (a folder with Python files) is on a floor, and every floor exists."""
    assert LAYER["infra"] == 0 and LAYER["bench"] == LAYER["scripts"] == max(LAYER.values()), LAYER
    assert LAYER["teachers"] == LAYER["student"] and LAYER["engine"] < LAYER["domains"] < LAYER["training"] < LAYER["teachers"]
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/*.py")}
    assert folders - NOT_PRODUCT == set(LAYER), f"on no floor: {folders - NOT_PRODUCT - set(LAYER)}; " \
                                                f"no such folder: {set(LAYER) - folders}"


def test_imports_follow_the_layering():
    modules = read_modules(ROOT)
    assert {"tasks.context", "teachers.specialist_main", "student.trainer", "infra.storage", "engine.client",
            "training.worker", "sandbox.runner", "bench.trl_compare", "scripts.install"} <= set(modules)
    bad = layer_violations(graph(modules), modules)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph(read_modules(ROOT)))
    assert not found, "modules that import each other: " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_checks_catch_violations(tmp_path):
    """The checker itself: an upward import, a sideways one, a lazy one inside a function, and a cycle are found."""
    files = {
        "infra/__init__.py": "", "infra/a.py": "def f():\n    from domains import d\n",
        "domains/__init__.py": "", "domains/d.py": "from infra import a\n",
        "teachers/__init__.py": "", "teachers/t.py": "import student.s\n",
        "student/__init__.py": "", "student/s.py": "from . import s2\n", "student/s2.py": "from student.s import x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for pkg in LAYER:
        (tmp_path / pkg).mkdir(exist_ok=True)
    modules = {module_name(p, tmp_path): (p, ast.parse(p.read_text())) for p in tmp_path.rglob("*.py")}
    edges = graph(modules)
    assert edges["student.s"] == [("student.s2", 1)] and edges["infra.a"] == [("domains.d", 2)]
    bad = layer_violations(edges, modules, tmp_path)
    assert any("infra/a.py:2: infra must not import domains" in b for b in bad), bad
    assert any("teachers/t.py:1: teachers must not import student" in b for b in bad), bad
    assert not any("domains/d.py" in b for b in bad)
    assert sorted(cycles(edges)) == [["domains.d", "infra.a"], ["student.s", "student.s2"]]


def test_a_planted_upward_import_in_the_real_tree_is_found():
    """The real tree plus one planted module per kind of wrong import fails; the floors' own parser reads a doc."""
    modules = read_modules(ROOT)
    planted = {"engine.planted": "from training import worker\n",        # engine (floor 1) → training (floor 3)
               "infra.planted": "def f():\n    import sandbox.runner\n",  # ground → floor 1, lazily
               "domains.planted": "from training.ledger import Ledger\n",  # domains (floor 2) → training (3)
               "teachers.planted": "from student import trainer\n"}  # sideways on the top trainer floor
    for name, text in planted.items():
        modules[name] = (ROOT / (name.replace(".", "/") + ".py"), ast.parse(text))
    bad = layer_violations(graph(modules), modules)
    assert sorted(b.split(":")[0] for b in bad) == ["domains/planted.py", "engine/planted.py", "infra/planted.py",
                                                       "teachers/planted.py"], bad
    assert "engine must not import training (training.worker)" in "\n".join(bad)


def test_read_floors(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(f"text\n{MARKER}\n```\ntop | side   what\n\nmid    x | y\nground  z\n```\n")
    assert read_floors(doc) == {"top": 2, "side": 2, "mid": 1, "ground": 0}
