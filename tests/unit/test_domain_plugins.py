"""Domain plugins: the example plugin (examples/plugins, outside the packages) loads by `impl` and works end to end,
and every way a plugin can fail gives a DomainLoadError that names the domain, the plugin path and the cause."""
import sys
import textwrap
from pathlib import Path

import pytest

from domains.base import Domain
from domains.registry import BUILTIN, DomainLoadError, load_domain

pytestmark = pytest.mark.unit

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "examples" / "plugins"
IMPL = "palindrome_domain:Palindrome"


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS_DIR))


@pytest.fixture
def scratch_modules(tmp_path, monkeypatch):
    """Write throwaway plugin modules into a folder on sys.path; forget them from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(module: str, source: str) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        written.append(module)

    yield write
    for module in written:
        sys.modules.pop(module, None)


def test_example_plugin_loads_by_impl_and_works(plugin_path):
    dom = load_domain("palindrome", impl=IMPL, difficulty=2)
    assert isinstance(dom, Domain) and type(dom).__name__ == "Palindrome" and dom.difficulty == 2
    assert dom.tag not in {cls.tag for cls in BUILTIN.values()}
    train, evals = dom.split("train", 500, seed=0), dom.split("eval", 100, seed=0)
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert dom.split("train", 500, seed=0) == train
    for ex in train + evals:
        s = ex.prompt[len("pal:"):-1]
        assert ex.domain == "palindrome" and ex.prompt.startswith("pal:") and 3 <= len(s) <= 7
        assert ex.answer == ("yes" if s == s[::-1] else "no")
        assert dom.verify(ex, ex.answer) == 1.0 and dom.verify(ex, f" {ex.answer}\n") == 1.0
        assert dom.verify(ex, "no" if ex.answer == "yes" else "yes") == 0.0
        assert dom.verify(ex, None) == 0.0 and dom.verify(ex, "x" * 1_000_000) == 0.0
    assert 200 <= sum(e.answer == "yes" for e in train) <= 300
    assert dom.verifier_errors == 0


def test_example_plugin_by_hand_and_params(plugin_path):
    dom = load_domain("palindrome", impl=IMPL, params={"alphabet": "xy"})
    assert dom.verify(dom.make("xyyx", "yes"), "yes") == 1.0
    assert all(set(ex.prompt[4:-1]) <= {"x", "y"} for ex in dom.split("train", 40, seed=3))


def test_plugin_takes_the_configured_name(plugin_path):
    """One plugin class can serve under several configured names (e.g. two difficulties)."""
    dom = load_domain("palindrome_hard", impl=IMPL, difficulty=5)
    assert dom.name == "palindrome_hard"
    assert {ex.domain for ex in dom.split("eval", 20, seed=0)} == {"palindrome_hard"}
    # the class attribute is untouched, so another instance keeps its own name
    assert load_domain("palindrome", impl=IMPL).name == "palindrome"


def test_builtin_loads_through_impl_too():
    dom = load_domain("addition_hard", impl="domains.builtin.arithmetic:Addition", difficulty=4)
    assert dom.digits == 5 and dom.split("train", 1, seed=0)[0].domain == "addition_hard"


def _fails(name, impl=None, **kw) -> str:
    with pytest.raises(DomainLoadError) as info:
        load_domain(name, impl=impl, **kw)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert repr(name) in msg and (impl is None or repr(impl) in msg), msg
    return msg


def test_module_not_importable():
    msg = _fails("pal", "no_such_module_for_alloy_tests:Palindrome")
    assert "cannot import module 'no_such_module_for_alloy_tests'" in msg and "ModuleNotFoundError" in msg


def test_module_raising_at_import(scratch_modules):
    scratch_modules("alloy_test_broken_plugin", "raise RuntimeError('plugin exploded at import')\n")
    msg = _fails("pal", "alloy_test_broken_plugin:Whatever")
    assert "RuntimeError: plugin exploded at import" in msg


def test_attribute_missing(plugin_path):
    msg = _fails("pal", "palindrome_domain:NoSuchClass")
    assert "has no attribute 'NoSuchClass'" in msg


@pytest.mark.parametrize("attr", ["Example", "random", "Palindrome.generate"])
def test_not_a_domain_subclass(plugin_path, attr):
    msg = _fails("pal", f"palindrome_domain:{attr}")
    assert "not a subclass of domains.base.Domain" in msg


def test_abstract_class():
    msg = _fails("base", "domains.base:Domain")
    assert "is abstract" in msg and "generate" in msg and "score" in msg


def test_constructor_raises(plugin_path, scratch_modules):
    assert "param 'alphabet'" in _fails("pal", IMPL, params={"alphabet": "a"})  # the plugin's own check
    assert "unknown param 'colour'" in _fails("pal", IMPL, params={"colour": "red"})
    assert "difficulty must be an int in [1, 10]" in _fails("pal", IMPL, difficulty=0)
    scratch_modules("alloy_test_nameless_plugin", """
        from domains.base import Domain

        class Nameless(Domain):
            def generate(self, rng): ...
            def score(self, example, response): return 0.0
    """)
    assert "must set a non-empty class attribute 'name'" in _fails("x", "alloy_test_nameless_plugin:Nameless")


@pytest.mark.parametrize("impl", ["palindrome_domain", "palindrome_domain:", ":Palindrome", "a:b:c"])
def test_malformed_impl(impl):
    assert "package.module:ClassName" in _fails("pal", impl)


def test_unknown_builtin_and_bad_builtin_params():
    msg = _fails("no_such_domain")
    assert "no built-in domain" in msg and "addition" in msg and "impl=" in msg
    assert "unknown param 'digits'" in _fails("addition", params={"digits": 3})
    assert "params must be a mapping" in _fails("addition", params=["digits"])
