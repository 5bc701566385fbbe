"""Domain registry: the built-ins by name, and plugins loaded from a dotted path `"package.module:ClassName"`.

`load_domain("addition", difficulty=2)` builds a built-in; `load_domain("palindrome",
impl="palindrome_domain:Palindrome")` imports any importable module (installed, or on `sys.path`/`PYTHONPATH`)
and builds the class, which must subclass `domains.base.Domain`. Every failure is a `DomainLoadError` whose message
names the domain, the plugin path and the cause. A config domain with a `dataset` section is a
`domains.dataset.DatasetDomain` (`load_domains`).
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


def split_needs(cfg, name: str) -> dict[str, list[tuple[str, int]]]:
    """The config fields that ask domain `name` for rows of each split, with their numbers: base SFT, the
    specialist's rollouts / validations / own eval (when specialists train), the student's prompts and in-training
    evals, and the final eval."""
    needs: dict[str, list[tuple[str, int]]] = {
        "train": [("base.n_train_per_domain", cfg.base.n_train_per_domain),
                  ("distill.n_prompts_per_domain", cfg.distill.n_prompts_per_domain)],
        "val": [], "eval": [("eval.n_eval", cfg.eval.n_eval)]}
    if cfg.specialists.enabled:
        sc, own = cfg.specialists.for_domain(name), cfg.specialists.per_domain.get(name, {})

        def key(f: str) -> str:  # the field that set the number: the domain's own override, or the stage's
            return f"specialists.per_domain.{name}.{f}" if f in own else f"specialists.{f}"

        needs["train"].append((key("n_prompts"), sc.n_prompts))
        if sc.val_every:
            needs["val"].append((key("val_n"), sc.val_n))
        if sc.eval_n:
            needs["eval"].append((key("eval_n"), sc.eval_n))
    if cfg.distill.eval_every:
        needs["eval"].append(("distill.eval_n", cfg.distill.eval_n))
    return needs


def load_dataset_domain(d, i: int, cfg=None) -> Domain:
    """The DatasetDomain of `cfg.domains[i]` (`d`, with a `dataset` section); a ConfigError naming the field:
    `domains.<i>.verifier` for a bad verifier spec, `domains.<i>.dataset.path` for a file that cannot be read or
    is too small for `cfg`'s split sizes, `domains.<i>.dataset` for bad rows or columns."""
    from domains.dataset import DatasetDomain, DatasetError
    from domains.verifiers import get_verifier
    from infra.config import ConfigError

    # a model-rewarded domain's verifier is its ground truth `reward.truth` when it has one (evaluation's score)
    truth = d.reward.truth if d.reward is not None else None
    spec, where = (truth, "reward.truth") if truth else (d.verifier, "verifier")
    try:
        get_verifier(spec)
    except ValueError as exc:
        raise ConfigError(f"domains.{i}.{where}: {exc}") from None
    ds = d.dataset
    try:
        domain = DatasetDomain(d.name, ds.path, prompt=ds.prompt, answer=ds.answer, fields=ds.fields,
                               system=ds.system or d.system or "", max_new_tokens=ds.max_new_tokens,
                               verifier=spec, max_file_mb=ds.max_file_mb, max_row_kb=ds.max_row_kb)
    except ValueError as exc:  # DatasetError (file, suffix, columns, bad rows) or a verifier's refusal
        where = f"dataset.{exc.field}" if isinstance(exc, DatasetError) and exc.field else "dataset"
        raise ConfigError(f"domains.{i}.{where}: {exc}") from exc
    if d.reward is not None:  # trained on a model's reward (domains/model_reward.py); `verify` is the truth, if any
        domain.reward_kind, domain.has_truth = d.reward.kind, bool(truth)
    if cfg is not None:
        try:
            domain.check_sizes(split_needs(cfg, d.name))
        except ValueError as exc:
            raise ConfigError(f"domains.{i}.dataset.path: {exc}") from None
    return domain


def load_domains(cfg) -> dict[str, Domain]:
    """Instantiate every domain configured in `cfg.domains` (an `infra.config.AlloyConfig`), keyed by name; a bad
    plugin fails with a `ConfigError` naming the config path (`domains.<i>.impl` or `domains.<i>.name`), a bad
    dataset domain naming its field (`load_dataset_domain`). `domains.<i>.system` becomes the domain's `system`."""
    from infra.config import ConfigError

    out = {}
    for i, d in enumerate(cfg.domains):
        if getattr(d, "dataset", None) is not None:
            out[d.name] = load_dataset_domain(d, i, cfg)
            continue
        try:
            out[d.name] = load_domain(d.name, impl=d.impl, difficulty=d.difficulty, params=dict(d.params))
        except Exception as exc:  # DomainLoadError or anything a plugin raises
            where = f"domains.{i}" + (".impl" if d.impl else ".name")
            raise ConfigError(f"{where}: cannot load domain {d.name!r}"
                              + (f" from plugin {d.impl!r}" if d.impl else "") + f": {exc}") from exc
        if getattr(d, "system", None):
            out[d.name].system = d.system
    return out
