"""Test helpers for `configs/preference.yaml` (issue 54's worked example): its path and its preference pairs, made
by scripts/make_preference_pairs.py as a user makes them (deterministic from the seed)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "preference.yaml")


def make_pairs(out: Path, rows: int = 1500, pairs: int = 400, seed: int = 3) -> None:
    """Write the example's data files under `out` with the script's own `main`."""
    script = ROOT / "scripts" / "make_preference_pairs.py"
    spec = importlib.util.spec_from_file_location("make_preference_pairs", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(out), "--rows", str(rows), "--pairs", str(pairs), "--seed", str(seed)]) == 0


def tiny_reward_files(folder: Path, prompt: str = "p{i}=") -> tuple[Path, Path]:
    """(rows, pairs) for a config test of a model-rewarded dataset domain: 20 prompt/answer rows (`prompt` formatted
    with the row's index) and one preference pair; nothing is trained on them."""
    rows, pairs = folder / "rows.jsonl", folder / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": prompt.format(i=i), "answer": f"a{i}"}) + "\n" for i in range(20)))
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "a!", "rejected": "a"}) + "\n")
    return rows, pairs
