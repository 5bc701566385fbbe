"""Light things stay light: the engine's client and launcher, the CLI, the config, the planner and the sandbox import
no torch (nor transformers / DeepSpeed), each checked in a fresh interpreter (nothing imported before it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LIGHT = ["engine", "engine.client", "engine.launcher", "engine.backends", "engine.protocol", "engine.wire",
         "infra", "infra.config", "infra.choices", "infra.placement", "infra.checkpoint_budget", "alloy.cli",
         "sandbox.runner"]
HEAVY = ("torch", "transformers", "deepspeed")


def loaded_after(modules: list[str]) -> dict[str, list[str]]:
    """{module: the HEAVY packages in sys.modules after importing it alone in a fresh interpreter}."""
    code = ("import importlib, json, sys\nm = sys.argv[1]\nimportlib.import_module(m)\n"
            f"print(json.dumps({{m: sorted(h for h in {HEAVY!r} if h in sys.modules)}}))")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # infra once imported torch to set it
    # one fresh interpreter per module: a module imported earlier cannot hide what a later one pulls in
    out = {}
    for m in modules:
        res = subprocess.run([sys.executable, "-c", code, m], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        out.update(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def test_light_modules_import_no_torch():
    heavy = {m: found for m, found in loaded_after(LIGHT).items() if found}
    assert not heavy, f"imports torch (or transformers / deepspeed) where it must not: {heavy}"


def test_the_check_sees_a_heavy_import():
    assert loaded_after(["training.ranks"])["training.ranks"][:1] == ["torch"]
