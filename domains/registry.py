"""Domain registry: the built-ins by name, and plugins loaded from a dotted path `"package.module:ClassName"`.

`load_domain("addition", difficulty=2)` builds a built-in; `load_domain("palindrome",
impl="palindrome_domain:Palindrome")` imports any importable module (installed, or on `sys.path`/`PYTHONPATH`)
and builds the class, which must subclass `domains.base.Domain`. Every failure is a `DomainLoadError` whose message
names the domain, the plugin path and the cause.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from domains.base import Domain
from domains.builtin import ALL

BUILTIN: dict[str, type[Domain]] = {cls.name: cls for cls in ALL}


class DomainLoadError(ValueError):
    """A domain that cannot be built: unknown name, bad plugin path, import error, wrong class, bad params."""


def list_domains() -> list[str]:
    """Names of the built-in domains, sorted."""
    return sorted(BUILTIN)


def _plugin_class(name: str, impl: str) -> type[Domain]:
    where = f"domain {name!r} (plugin {impl!r})"
    module_name, sep, attr_path = impl.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise DomainLoadError(f"{where}: impl must look like 'package.module:ClassName'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises at import time
        raise DomainLoadError(f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):  # "Outer.Inner" reaches a nested class
        if not hasattr(obj, part):
            raise DomainLoadError(f"{where}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Domain)):
        raise DomainLoadError(f"{where}: {attr_path!r} is {obj!r}, not a subclass of domains.base.Domain")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise DomainLoadError(f"{where}: class {attr_path!r} is abstract (implement: {missing})")
    return obj


def load_domain(name: str, impl: str | None = None, difficulty: int = 1, params: dict | None = None) -> Domain:
    """Build the domain `name`: a built-in, or the plugin class at `impl` ("package.module:ClassName").

    A plugin instance takes `name` as its name (so examples, scores and teachers are keyed by the configured name),
    which lets one plugin class serve under several names, e.g. at different difficulties.
    """
    where = f"domain {name!r}" + (f" (plugin {impl!r})" if impl else "")
    if impl is None:
        if name not in BUILTIN:
            raise DomainLoadError(f"{where}: no built-in domain of that name (built-ins: {', '.join(list_domains())}); "
                                  f"for a plugin set impl='package.module:ClassName'")
        cls = BUILTIN[name]
    else:
        cls = _plugin_class(name, impl)
    if params is not None and not isinstance(params, dict):
        raise DomainLoadError(f"{where}: params must be a mapping, got {type(params).__name__}")
    try:
        domain = cls(difficulty=difficulty, **(params or {}))
    except Exception as exc:
        raise DomainLoadError(f"{where}: {cls.__name__}(difficulty={difficulty!r}, params={params or {}!r}) "
                              f"failed: {type(exc).__name__}: {exc}") from exc
    domain.name = name
    return domain


def load_domains(cfg) -> dict[str, Domain]:
    """Instantiate every domain configured in `cfg.domains` (an `infra.config.AlloyConfig`), keyed by name; a bad
    plugin fails with a `ConfigError` naming the config path (`domains.<i>.impl` or `domains.<i>.name`)."""
    from infra.config import ConfigError

    out = {}
    for i, d in enumerate(cfg.domains):
        try:
            out[d.name] = load_domain(d.name, impl=d.impl, difficulty=d.difficulty, params=dict(d.params))
        except Exception as exc:  # DomainLoadError or anything a plugin raises
            where = f"domains.{i}" + (".impl" if d.impl else ".name")
            raise ConfigError(f"{where}: cannot load domain {d.name!r}"
                              + (f" from plugin {d.impl!r}" if d.impl else "") + f": {exc}") from exc
    return out
