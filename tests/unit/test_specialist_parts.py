"""Pure parts of the specialist trainer: the off-policy mask in the PPO batch alignment, the prompt cursor's ids,
and the pipeline's report rows for specialists."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from teachers.april import Sample
from teachers.ppo_step import build_batch
from teachers.specialist import offpolicy_mask

pytestmark = pytest.mark.unit


def test_offpolicy_mask_drops_only_tokens_older_than_max_lag():
    # row 0: prompt [1, 9] (P=2), 3 output tokens sampled at versions 3, 3, 5; row 1: prompt [1] (P=1), 2 tokens at v5
    a = Sample("a", "a", [1, 9], [10, 11, 12], [-1.0, -1.0, -1.0], [3, 3, 5], "d", {}, "stop")
    b = Sample("b", "b", [1], [20, 21], [-1.0, -1.0], [5, 5], "d", {}, "stop")
    batch = build_batch([a, b], pad_id=0, rewards=[1.0, 0.0])
    # T = 5 (row 0: 2 + 3); output token j of a row with prompt length P is predicted at position P + j − 1:
    # row 0 → t = 1, 2, 3; row 1 → t = 0, 1; the last column predicts nothing
    assert batch.mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    m = offpolicy_mask([a, b], batch.mask, version=5, max_lag=1)  # lag of v3 tokens is 2 > 1: dropped
    assert m.tolist() == [[0, 0, 0, 1, 0], [1, 1, 0, 0, 0]]
    assert offpolicy_mask([a, b], batch.mask, version=5, max_lag=2).tolist() == batch.mask.tolist()
    assert m.dtype == batch.mask.dtype


def test_prompt_cursor_ids_follow_the_cursor_and_cycle_the_pool(tiny_model_dir):
    from domains.registry import load_domain
    from infra.models import load_tokenizer
    from teachers.rollout import PromptCursor

    tok = load_tokenizer(tiny_model_dir)
    cur = PromptCursor(load_domain("reverse"), tok, n=3, seed=0)
    first = cur.take(2, max_new_tokens=8, version=4)
    more = cur.take(2, max_new_tokens=8, version=5)
    assert [p.sample_id for p in first + more] == [f"reverse-{i:08d}" for i in range(4)]
    assert more[1].prompt_ids == first[0].prompt_ids  # pool of 3 cycles: item 3 is item 0 again, under a new id
    assert first[0].prompt_ids[0] == tok.bos_token_id and first[0].remaining_budget == 8
    assert first[0].created_version == 4 and cur.cursor == 4
    again = PromptCursor(load_domain("reverse"), tok, n=3, seed=0)
    again.cursor = 2  # a restored cursor re-issues the same ids for the same prompts
    assert [(p.sample_id, p.prompt_ids) for p in again.take(2, 8, 0)] == [(p.sample_id, p.prompt_ids) for p in more]


def test_pipeline_specialist_rows_and_guard_totals():
    from flows.pipeline import guard_totals

    specs = {"tool_add": {"guard": {"tool_calls": 7, "flagged": 3, "blocked": 2, "judged": 3, "judge_blocked": 2,
                                    "judge_calls": 2, "judge_errors": 1}},
             "tool_files": {"guard": {"tool_calls": 5, "flagged": 1, "blocked": 0, "judged": 1, "judge_blocked": 0}},
             "reverse": {"guard": {}}, "copy": {}}
    assert guard_totals(specs) == {"tool_calls": 12, "flagged": 4, "blocked": 2, "judged": 4, "judge_blocked": 2,
                                   "judge_errors": 1}
    specs["code"] = {"guard": {"reward_exit": 2, "reward_not_plain": 1}}  # the code verifier's zeros by reason
    specs["code2"] = {"guard": {"reward_exit": 1}}
    assert guard_totals(specs) == {"tool_calls": 12, "flagged": 4, "blocked": 2, "judged": 4, "judge_blocked": 2,
                                   "judge_errors": 1, "reward_exit": 3, "reward_not_plain": 1}
