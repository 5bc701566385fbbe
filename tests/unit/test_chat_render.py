"""One prompt rendering for every stage (infra/chat.py): the ids base SFT trains on, a specialist rollout sends, the
student sampler sends and evaluation feeds are the same, for the char tokenizer (no template: exactly [BOS] + prompt,
as before) and for a byte-level BPE with a ChatML template, with a system message and multi-line Unicode prompts.
Each stage's ids come from its own code path (SFT pairs, PromptCursor, PromptStream, score_examples' generate call)."""
from __future__ import annotations

import pytest

from domains.base import Example
from domains.evaluate import score_examples
from infra.chat import (completion_ids, end_of_turn_ids, render_prompt_ids, stop_token_ids, token_budget,
                        token_ids_containing)
from infra.models import load_model, load_tokenizer
from training.sft import encode_pair
from student.sampler import PromptStream, decode_response
from training.base_main import demonstrations
from teachers.rollout import PromptCursor

pytestmark = pytest.mark.unit

SYSTEM = "Réponds par un nombre. Answer with a number."
UNICODE_PROMPTS = [
    "Frage: Jürgen kauft 3 Brötchen für je 0,45 €.\nWie viel bezahlt er?",
    "問題：りんごが3個とみかんが4個あります。\nくだものは全部で何個ですか？",
    "Which planet is known as the Red Planet? 🪐\nA) Venus\nB) Mars",
    "Вопрос: Сколько будет 6 × 7?\n\n  (answer below)",
]
ASCII_PROMPTS = ["add:12+34=", "rev:abc=", "multi\nline=", "x y z ="]


class TextDomain:
    """A domain of fixed examples with a system message and an answer budget in tokens (as dataset domains have):
    the same examples in every split, so every stage draws them."""

    def __init__(self, name: str, prompts: list[str], system: str = "", budget: int | None = None):
        self.name, self.system, self._budget = name, system, budget
        self.examples = [Example(name, p, str(i), 1) for i, p in enumerate(prompts)]

    def split(self, split: str, n: int, seed: int) -> list[Example]:
        return self.examples[:n]

    def verify(self, example: Example, response: object) -> float:
        return float(response == example.answer)

    def token_budget(self, tokenizer) -> int:
        return self._budget


def stage_ids(model, tok, dom, mode: str) -> dict[str, dict[str, list[int]]]:
    """{stage: {prompt: ids}} from each stage's own code path."""
    n = len(dom.examples)
    sft = {}
    for prompt, answer, system in demonstrations({dom.name: dom}, n, 0):  # the base stage's pairs
        ids, n_ctx = encode_pair(tok, prompt, answer, system, mode)
        sft[prompt] = ids[:n_ctx]
    rollout = {}
    for p in PromptCursor(dom, tok, n, 0, chat_template=mode).take(n, max_new_tokens=4, version=0):
        rollout[p.example["prompt"]] = list(p.input_ids)
    student = {it.example.prompt: it.prompt_ids
               for it in PromptStream({dom.name: dom}, tok, n, 0, chat_template=mode).take(n)}
    fed, budgets = [], []
    generate = model.generate

    def recording_generate(input_ids, attention_mask, max_new_tokens, **kw):  # what evaluation feeds the model
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            fed.append([t for t, m in zip(row, mask) if m])  # left padding removed
        budgets.append(max_new_tokens)
        return generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **kw)

    model.generate = recording_generate
    try:
        score_examples(model, tok, {dom.name: dom}, {dom.name: dom.examples}, max_new_tokens=3, batch_size=2,
                       chat_template=mode)
    finally:
        del model.generate
    assert budgets == [dom.token_budget(tok) or 3] * 2  # the domain's own budget in tokens (two batches)
    by_ids = {tuple(v): k for k, v in sft.items()}
    evaluation = {by_ids.get(tuple(ids), f"<unmatched {ids}>"): ids for ids in fed}
    return {"sft": sft, "rollout": rollout, "student": student, "eval": evaluation}


def assert_same_everywhere(stages: dict, dom) -> None:
    for ex in dom.examples:
        ref = stages["sft"][ex.prompt]
        for stage, ids in stages.items():
            assert ids.get(ex.prompt) == ref, f"{stage} renders {ex.prompt!r} differently"


def test_char_tokenizer_renders_bos_plus_prompt_in_every_stage(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    assert not tok.chat_template  # no template: "auto" is BOS + prompt, exactly the ids of before
    dom = TextDomain("plain", ASCII_PROMPTS, system=SYSTEM)  # a system message has no place without a template
    stages = stage_ids(model, tok, dom, "auto")
    assert_same_everywhere(stages, dom)
    for ex in dom.examples:
        assert stages["sft"][ex.prompt] == [tok.bos_token_id] + tok(ex.prompt, add_special_tokens=False).input_ids
    ids, n_ctx = encode_pair(tok, "ab=", "xy")
    assert ids[n_ctx:] == tok("xy", add_special_tokens=False).input_ids + [tok.eos_token_id]  # SFT target + EOS
    assert stop_token_ids(tok, model.generation_config) == [tok.eos_token_id]
    assert token_ids_containing(tok, "\n") == {tok.convert_tokens_to_ids("\n")}  # the tool turn end: one token


def test_chatml_bpe_renders_the_template_identically_in_every_stage(qwen2_bpe_dir):
    tok, model = load_tokenizer(qwen2_bpe_dir), load_model(qwen2_bpe_dir)
    assert tok.chat_template and tok.bos_token_id is None
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    dom = TextDomain("wordmath", UNICODE_PROMPTS, system=SYSTEM, budget=5)
    stages = stage_ids(model, tok, dom, "auto")
    assert_same_everywhere(stages, dom)
    for ex in dom.examples:
        ids = stages["rollout"][ex.prompt]
        text = tok.decode(ids)
        assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{ex.prompt}<|im_end|>\n"
                        "<|im_start|>assistant\n")  # byte-exact round trip of the multi-line Unicode prompt
        assert ids[0] == im_start and None not in ids
    # the SFT target ends the assistant turn; generation stops there, at EOS and at the generation config's ids
    assert end_of_turn_ids(tok) == [im_end]
    assert completion_ids(tok, "42")[-1] == im_end
    stops = stop_token_ids(tok, model.generation_config)
    assert im_end in stops and set(stops) >= set(_as_list(model.generation_config.eos_token_id))
    assert decode_response(tok, tok("42", add_special_tokens=False).input_ids + [im_end, 5, 6], stops) == "42"
    # mode "none": BOS + prompt, and a tokenizer without BOS gets no None prepended
    plain = render_prompt_ids(tok, UNICODE_PROMPTS[0], SYSTEM, "none")
    assert plain == tok(UNICODE_PROMPTS[0], add_special_tokens=False).input_ids
    stages = stage_ids(model, tok, dom, "none")
    assert_same_everywhere(stages, dom)
    assert stages["student"][UNICODE_PROMPTS[0]] == plain
    # a turn of the tool protocol ends at any token holding a newline (BPE merges them into longer tokens)
    newline = token_ids_containing(tok, "\n")
    assert tok.convert_tokens_to_ids(tok.tokenize("\n")[0]) in newline
    assert all("\n" in tok.decode([t]) for t in newline) and len(newline) > 1


def test_modes_and_budgets_are_checked():
    with pytest.raises(ValueError, match="model.chat_template"):
        render_prompt_ids(object(), "x", mode="chatml")
    assert token_budget(TextDomain("d", ["p"], budget=7), None, 16) == 7
    assert token_budget(TextDomain("d", ["p"]), None, 16) == 16  # no budget of its own
    assert token_budget(object(), None, 16) == 16  # built-in domains keep the configured budget


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]
