"""Evaluation runs the one episode loop (`domains.episodes`) the rollouts and the student run, with the same token
budget and the same compaction as the domain's training (issue 55): `tool_long`, whose episodes outgrow a small
context, is evaluated in the window its specialist was trained in.

A scripted policy plays tool_long's intended path (one `cat` per file, then the sum) and records every context it is
given; nothing is mocked: the episodes run in the real sandboxed envs through `domains.evaluate`."""
from __future__ import annotations

import pytest

from domains.compaction import Compaction, compactions_of
from domains.episodes import episode_budget
from domains.evaluate import EpisodeModel, run_tool_episodes, tool_domain_scores
from domains.registry import load_domain
from infra.chat import PromptRenderer
from tool_scripts import char_tokenizer

pytestmark = pytest.mark.unit


def _intended(examples, n_files: int, seen: list[int]) -> EpisodeModel:
    """Turn t < N of episode i: `!cat f{t+1}`; turn N: the sum, then EOS. Every context's length goes to `seen`."""
    tok = char_tokenizer()

    async def generate(batch):
        out = []
        for i, ctx, room, turn in batch:
            seen.append(len(ctx) + room)
            text = f"!cat f{turn + 1}\n" if turn < n_files else examples[i].answer
            ids = list(tok(text, add_special_tokens=False).input_ids) + ([tok.eos_token_id] if turn >= n_files else [])
            out.append((ids[:room], [0.0] * min(len(ids), room), "stop" if len(ids) <= room else "length"))
        return out

    return EpisodeModel(tok, PromptRenderer(tok, "none"), [tok.eos_token_id], None, generate)


def test_tool_long_is_evaluated_in_the_context_window_it_was_trained_in():
    dom = load_domain("tool_long")
    exs = dom.split("eval", 3, seed=0)
    window = Compaction(max_context_tokens=64, keep_last=1)
    budget = episode_budget(dom, 16, window)
    seen: list[int] = []
    scores = tool_domain_scores(dom, exs, _intended(exs, dom.n_files, seen), budget, window)
    assert scores.raw == scores.clean == [1.0] * 3  # the intended path still pays through the compacted context
    assert max(seen) <= 64  # no turn was asked of a longer context than training gives
    eps = run_tool_episodes(dom, exs, _intended(exs, dom.n_files, []), budget, compaction=window)
    assert all(ep.compactions >= 1 for ep in eps)
    full: list[int] = []
    tool_domain_scores(dom, exs, _intended(exs, dom.n_files, full), budget)  # no compaction: the whole history
    assert max(full) > 64  # so the window above did bind


def test_the_stage_evaluation_takes_the_specialists_compaction_per_domain():
    """`compactions_of(cfg.specialists, ...)` is what tasks/evaluate.py passes: the per-domain override reaches
    tool_long only, and the eval budget equals the specialists' rollout budget for it."""
    from infra.config import load_config
    from teachers.specialist_main import response_budget

    cfg = load_config("configs/agentic.yaml")
    per = compactions_of(cfg.specialists, ["tool_long", "tool_add"])
    assert per["tool_long"] is not None and per["tool_add"] is None
    dom = load_domain("tool_long")
    assert episode_budget(dom, cfg.eval.max_new_tokens, per["tool_long"]) == \
        response_budget(cfg, dom, char_tokenizer())


def test_one_episode_loop_drives_every_tool_env():
    """Only `domains.episodes.EpisodeRun` steps a tool env (runs the call a turn ends with): the rollouts
    (teachers/rollout.py), the student (student/sampler.py), evaluation (domains/evaluate.py) and the benches all
    go through it, and none of them keeps a loop of its own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    product = [p for d in ("alloy", "bench", "domains", "engine", "flows", "infra", "sandbox", "student", "tasks",
                           "teachers", "training") for p in (root / d).rglob("*.py")]
    stepping = sorted(str(p.relative_to(root)) for p in product if re.search(r"\benv\.step\(", p.read_text()))
    assert stepping == ["domains/episodes.py"]
    users = {"teachers/rollout.py", "student/sampler.py", "domains/evaluate.py"}
    assert all("from domains.episodes import" in (root / u).read_text() for u in users)
    assert not re.search(r"^(async )?def run_episode\b", (root / "domains/tools.py").read_text(), re.M)
