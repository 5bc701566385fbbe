"""docs/security.md states each fact as "checked by" a named test: every test it names exists (a file path or a bare
test file name, then `::test_name`; a bare `::test_name` is in the file named last), so a renamed or deleted test
cannot leave a claim that nothing checks."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
_REF = re.compile(r"((?:tests/[\w/]+/)?test_\w+\.py)|::(test_\w+)")


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file, test name or None for a whole file) for every reference in `text`, in order."""
    out, last = [], None
    for path, name in _REF.findall(text):
        if path:
            last = path
            out.append((path, None))
        else:
            assert last is not None, f"::{name} before any test file"
            out.append((last, name))
    return out


def _resolve(path: str) -> Path:
    """A path from the repository root, or a bare file name found once under tests/."""
    if "/" in path:
        return REPO / path
    found = sorted((REPO / "tests").rglob(path))
    assert len(found) == 1, f"{path}: {len(found)} files of that name under tests/"
    return found[0]


def test_every_test_the_security_page_names_exists():
    refs = named_tests((REPO / "docs" / "security.md").read_text())
    assert len(refs) > 20
    for path, name in refs:
        source = _resolve(path).read_text()
        assert name is None or re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
