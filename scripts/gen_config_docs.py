"""Generate docs/config.md, the config reference, from the pydantic models of `infra.config`.

    .venv/bin/python scripts/gen_config_docs.py            # (re)write docs/config.md
    .venv/bin/python scripts/gen_config_docs.py --check    # exit 1 if docs/config.md is out of date

Pure: it imports `infra.config` and walks `AlloyConfig` (nested models, types, defaults, bounds, allowed values of
Literal types, field descriptions, class docstrings); it runs nothing and reads no config file. Each model class gets
one section, named by every dotted path where it is used (`TrainConfig` serves four). The unit test
`tests/unit/test_config_docs.py` compares `render()` with the committed file.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: `infra` is imported from this checkout
    sys.path.insert(0, str(REPO))

import annotated_types  # noqa: E402  (pydantic's constraint objects)
from pydantic import BaseModel, PlainSerializer  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from infra.config import AlloyConfig  # noqa: E402

DOC_PATH = REPO / "docs" / "config.md"
COMMAND = ".venv/bin/python scripts/gen_config_docs.py"

INTRO = f"""# Configuration reference

<!-- Generated from infra/config.py by scripts/gen_config_docs.py: do not edit by hand.
     Regenerate with `{COMMAND}` (or `make config-docs`). -->

A run is configured by one YAML file (`configs/smoke.yaml`, `configs/demo.yaml`, `configs/gpu-1.yaml`,
`configs/gpu-example.yaml`).
Every field has a default except `domains`; unknown keys and wrong types are refused before anything runs, with
the dotted path of every bad field (exit code 2). `alloy config FILE` prints a config with every default filled
in.

- **Overrides**: `--set a.b.c=value` on `alloy run`, `alloy config` and `alloy eval` (values are YAML scalars;
  list items by index: `--set domains.0.difficulty=2`). Precedence: `--set` > environment > file.
- **Secrets** come from the environment, never from a file or argv: `ALLOY_ENGINE_API_KEY` (`engine.api_key`),
  `ALLOY_JUDGE_API_KEY` (`specialists.guard.judge_api_key`), `ALLOY_SECRET_OVERRIDES` (a JSON list of `a.b=value`
  overrides for any other secret field). `alloy run --set engine.api_key=…` moves the value into the environment
  for you. Secret fields print as `***`.
- **Process starts**: on a host without a GPU, trainers and engine servers are forked from a process zygote that
  has done their imports (`python -m infra.zygote` in `ps`; a server starts in ~0.4 s instead of ~2.4 s).
  `ALLOY_ZYGOTE=0` in the environment of `alloy run` (or a worker) starts every child fresh instead; GPU hosts
  always do (docs/architecture.md, "Processes").
- **Reuse**: a stage's checkpoints are keyed by a hash of the settings that shape its result; a rerun with the
  same settings reuses complete checkpoints (`run.resume`). Fields marked *ops* (scheduling, logging, serving,
  credentials) are left out of that hash: changing them reuses the checkpoints.
"""


# ------------------------------------------------------------------------------------------ types and values


def _literal(values: tuple) -> str:
    return "one of " + ", ".join(f"`{_value(v)}`" for v in values)


def type_name(ann: Any, sections: dict[type, str]) -> str:
    """A field annotation in words: `int`, `float or null`, `one of \\`a\\`, \\`b\\``, `list of [domain](#…)`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return type_name(args[0], sections)
    if origin is Literal:
        return _literal(args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a, sections) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, set):
        return "list of " + (type_name(args[0], sections) if args else "any")
    if origin is dict or ann is dict:
        return "mapping" + (f" of {type_name(args[0], sections)} → {type_name(args[1], sections)}" if args else "")
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return f"[section](#{_anchor(ann)})"
    if ann is Any:
        return "any"
    return {str: "string", int: "int", float: "float", bool: "bool"}.get(ann, getattr(ann, "__name__", str(ann)))


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, BaseModel):
        v = v.model_dump()
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def bounds(metadata: list) -> str:
    """Numeric and length constraints (`≥ 1, ≤ 512`) from a field's pydantic metadata."""
    words = []
    for m in metadata:
        for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                words.append(f"{sym} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            words.append(f"at least {m.min_length} item(s)")
    return ", ".join(words)


def default_text(field, ann_model: type[BaseModel] | None) -> str:
    """The default as YAML would write it; a nested section shows only what differs from its class defaults."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if ann_model is not None and isinstance(value, BaseModel):
        plain = ann_model().model_dump()
        diff = {k: v for k, v in value.model_dump().items() if plain.get(k) != v}
        return "section defaults" + (f", except `{_value(diff)}`" if diff else "")
    return f"`{_value(value)}`"


def _model_of(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in typing.get_args(ann):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _own_doc(cls: type) -> str:
    """The first paragraph of a class's own docstring, on one line ("" if it has none: not BaseModel's)."""
    doc = cls.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()) if doc else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _is_ops(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("fingerprint") is False


# ------------------------------------------------------------------------------------------ walking


def collect(root: type[BaseModel] = AlloyConfig) -> dict[type, list[str]]:
    """{model class: [dotted paths where it is used]}, in depth-first field order ("" is the root)."""
    found: dict[type, list[str]] = {root: [""]}
    order = [root]

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            sub = _model_of(field.annotation)
            if sub is None:
                continue
            is_list = typing.get_origin(field.annotation) is list
            path = f"{prefix}{name}" + ("[]" if is_list else "")
            if sub not in found:
                found[sub] = []
                order.append(sub)
                found[sub].append(path)
                walk(sub, path + ".")
            else:
                found[sub].append(path)

    walk(root, "")
    return {cls: found[cls] for cls in order}


def render_section(cls: type[BaseModel], paths: list[str], sections: dict[type, str]) -> list[str]:
    title = ", ".join(f"`{p}`" for p in paths) if paths != [""] else "Top level"
    lines = [f'<a id="{_anchor(cls)}"></a>', "", f"## {title}", ""]
    if _own_doc(cls):
        lines += [_own_doc(cls), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        sub = _model_of(field.annotation)
        typ = type_name(field.annotation, sections)
        limits = bounds(field.metadata)
        if limits:
            typ += f" ({limits})"
        if any(isinstance(m, PlainSerializer) for m in field.metadata):
            typ += ", secret"
        desc = field.description or ""
        if sub is not None and not desc:
            desc = _own_doc(sub)
        if _is_ops(field):
            desc = ("*ops* " + desc).strip()
        default = default_text(field, sub if typing.get_origin(field.annotation) is not list else None)
        lines.append(f"| `{name}` | {_cell(typ)} | {_cell(default)} | {_cell(desc)} |")
    return lines + [""]


def render() -> str:
    """The whole of docs/config.md."""
    found = collect()
    sections = {cls: _anchor(cls) for cls in found}
    out = [INTRO]
    out += ["Sections (the top-level keys, and the sections nested in them):", ""]
    out += [f"- [`{paths[0]}`](#{_anchor(cls)})" + (f": {_own_doc(cls)}" if _own_doc(cls) else "")
            for cls, paths in found.items() if paths != [""]]
    out += [""]
    for cls, paths in found.items():
        if paths != [""]:  # the top level holds only the sections, listed above
            out += render_section(cls, paths, sections)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate the config reference (docs/config.md) from infra/config.py.")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is out of date instead of writing it")
    p.add_argument("--path", default=str(DOC_PATH), help="the markdown file (default: docs/config.md)")
    args = p.parse_args(argv)
    path, text = Path(args.path), render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date with infra/config.py; regenerate it with `{COMMAND}` "
                  f"(or `make config-docs`)", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
