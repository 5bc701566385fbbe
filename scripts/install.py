"""Install Alloy into the virtual environment `make setup` made: torch's CPU build first (anything that depends on
torch would otherwise pull a multi-GB CUDA build), then the package with its dev extras, pinned by constraints.txt,
and every module byte-compiled (where PYTHONDONTWRITEBYTECODE is set, nothing would ever write a .pyc: each process
would compile its imports from source).

With uv when it can be had (installed into the venv by its pip, from the index pip uses): uv resolves, unpacks and
compiles on every core. Otherwise, or when uv fails, with pip alone. pip's settings (its config files and PIP_*
variables: index-url, extra-index-url, find-links, cert, trusted-host, timeout, no-index) are handed to uv as their
UV_* equivalents and pip's constraint files as `-c`, so both read the same indexes under the same caps. A fresh
setup here took 47 s with uv (an empty uv cache) vs ~135 s with pip (docs/results.md#ci).

usage: python scripts/install.py VENV [--pip]   (--pip: skip uv)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
UV = "uv==0.13.9"
# pip's option → (uv's variable, separator of several values)
PIP_TO_UV = {"index-url": ("UV_DEFAULT_INDEX", None), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
             "find-links": ("UV_FIND_LINKS", ","), "trusted-host": ("UV_INSECURE_HOST", " "),
             "cert": ("SSL_CERT_FILE", None),
             "timeout": ("UV_HTTP_TIMEOUT", None), "default-timeout": ("UV_HTTP_TIMEOUT", None)}
SECTIONS = ("global", "install", ":env:")  # `pip config list`'s sections, lowest precedence first (files merged)


def pip_settings(pip: Path) -> dict[str, list[str]]:
    """pip's effective install settings: {option: [values]}."""
    return parse_pip_config(subprocess.run([str(pip), "config", "list"], capture_output=True, text=True).stdout)


def parse_pip_config(out: str) -> dict[str, list[str]]:
    """`pip config list`'s lines (`section.option='v1 v2'`) as {option: [values]}; a later section wins."""
    found: dict[tuple[int, str], list[str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, opt = key.rpartition(".")
        if sep and section in SECTIONS:
            found[(SECTIONS.index(section), opt)] = value.strip().strip("'\"").replace("\\n", " ").split()
    return {opt: vals for (_, opt), vals in sorted(found.items())}


def uv_env(settings: dict[str, list[str]]) -> dict[str, str]:
    """The environment that makes uv read what pip reads (pip considers every index; so does this strategy)."""
    env = {**os.environ, "UV_INDEX_STRATEGY": "unsafe-best-match"}
    for opt, vals in settings.items():
        if opt in PIP_TO_UV and vals:
            var, sep = PIP_TO_UV[opt]
            env[var] = sep.join(vals) if sep else vals[-1]
    if settings.get("no-index") in (["1"], ["true"], ["yes"]):
        env["UV_NO_INDEX"] = "1"
    return env


def run(cmd: list[str], env: dict | None = None) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def with_uv(venv: Path) -> bool:
    pip, py = venv / "bin" / "pip", venv / "bin" / "python"
    if run([str(pip), "install", "-q", "--disable-pip-version-check", UV]) != 0:
        return False
    settings = pip_settings(pip)
    uv, env = [str(venv / "bin" / "uv"), "pip", "install", "-q", "--python", str(py)], uv_env(settings)
    machine = sum((["-c", c] for c in settings.get("constraint", [])), [])  # pip's own constraint files too
    return (run(uv + machine + ["--compile-bytecode", TORCH], env) == 0
            and run(uv + machine + ["--compile-bytecode", "-c", "constraints.txt", "-e", ".[dev]"], env) == 0)


def with_pip(venv: Path) -> bool:
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    return run(pip + [TORCH]) == 0 and run(pip + ["-c", "constraints.txt", "-e", ".[dev]"]) == 0


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.rsplit("usage: ", 1)[1], file=sys.stderr)
        return 2
    venv = Path(argv[0]).resolve()
    if not (venv / "bin" / "python").exists():
        print(f"install: {venv}: no virtual environment there (python -m venv {argv[0]})", file=sys.stderr)
        return 2
    if "--pip" not in argv and with_uv(venv):
        return 0
    if "--pip" not in argv:
        print("install: uv could not be installed or failed; installing with pip", file=sys.stderr)
    return 0 if with_pip(venv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
