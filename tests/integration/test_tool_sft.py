"""Base SFT on tool trajectories (`base.tool_trajectories`): a nano model in a DeepSpeedBackend trains a few steps on
`tool_add` demonstrations whose tool output lines are loss-masked, and starts its answers with the tool call."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from domains.registry import load_domains
from infra.chat import render_prompt_ids
from infra.config import load_config
from infra.models import init_model_dir
from training.sft import train_sft
from training.session import train_settings, trainable
from training.base_main import demonstrations

pytestmark = pytest.mark.integration

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


def test_nano_base_sft_on_tool_add_trajectories(tmp_path):
    cfg = load_config(SMOKE, ["model.preset=nano", "domains=[{name: tool_add}]", "base.tool_trajectories=true",
                              "base.n_train_per_domain=32", "base.steps=20", "base.train.lr=1.0e-2",
                              "base.train.micro_batch_size=32"])
    pairs = demonstrations(load_domains(cfg), cfg.base.n_train_per_domain, cfg.run.seed, cfg.base.tool_trajectories)
    # every pair is a trajectory: `!calc a+b⏎` (trained), `>sum⏎` (masked), `sum` (trained); + EOS
    assert all([t for _, t in c] == [True, False, True] for _, c, _ in pairs)
    trained = sum(len(c[0][0]) + len(c[2][0]) + 1 for _, c, _ in pairs)

    tok, backend = trainable(init_model_dir("nano", tmp_path / "init", seed=0),
                             train_settings(cfg.base.train, cfg.base.steps, cfg.run.seed))
    history: list[dict] = []
    last = train_sft(backend, tok, pairs, cfg.base.steps, len(pairs), seed=0,
                     on_step=lambda step, m: history.append(dict(m)))
    assert len(history) == cfg.base.steps and all(m["tokens"] == trained for m in history)  # the output lines: 0
    assert last["loss"] < 0.6 * history[0]["loss"]

    # the call is the same string for every prompt: learned first (greedy continuation of a train prompt)
    ids = torch.tensor([render_prompt_ids(tok, pairs[0][0])])
    model = backend.module.eval()
    with torch.no_grad():
        for _ in range(len("!calc ")):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert tok.decode(ids[0, -len("!calc "):]) == "!calc "
