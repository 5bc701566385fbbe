"""docs/config.md is generated from infra/config.py (scripts/gen_config_docs.py) and must be current."""
import importlib.util
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.config import AlloyConfig, SpecialistsConfig, TrainConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_docs.py"
DOC = REPO / "docs" / "config.md"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_config_md_is_current():
    gen = load_generator()
    assert DOC.read_text() == gen.render(), (
        "docs/config.md is out of date with infra/config.py: run `.venv/bin/python scripts/gen_config_docs.py`")


def test_every_field_of_every_section_is_documented_with_its_default():
    text = load_generator().render()

    def walk(cls: type[BaseModel], top: bool) -> None:
        for name, field in cls.model_fields.items():
            row = f"[`{name}" if top else f"| `{name}` |"  # top-level keys are the list of sections
            assert row in text, f"{cls.__name__}.{name} is missing from docs/config.md"
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, top=False)

    walk(AlloyConfig, top=True)
    # a Literal's allowed values, a bound, and a nested section's non-default values are spelled out
    assert "| `zero_stage` | one of `0`, `1`, `2`, `3` | `0` |" in text
    assert "| `difficulty` | int (≥ 1, ≤ 10) | `1` |" in text
    spec_default = SpecialistsConfig().policy_train
    assert spec_default.micro_batch_size != TrainConfig().micro_batch_size
    assert "| `policy_train` | [section](#trainconfig) | section defaults, except `{micro_batch_size: 64}` |" in text


def test_check_flag_fails_on_a_stale_file_and_names_the_command(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--check", "--path", str(stale)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1
    assert "scripts/gen_config_docs.py" in out.stderr and str(stale) in out.stderr
    written = subprocess.run([sys.executable, str(SCRIPT), "--path", str(stale)], capture_output=True, text=True,
                             cwd=REPO)
    assert written.returncode == 0 and stale.read_text() == load_generator().render()
    again = subprocess.run([sys.executable, str(SCRIPT), "--check", "--path", str(stale)], capture_output=True,
                           text=True, cwd=REPO)
    assert again.returncode == 0, again.stderr
