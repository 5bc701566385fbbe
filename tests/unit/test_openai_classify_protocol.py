"""The pure pieces of the OpenAI-compatible and /classify endpoints (engine/openai_api.py, engine/classify.py), the
reward model's batching rule (engine/reward_model.py) and the client's parsers of their answers, on Alloy's char
tokenizer (with and without a chat template) and hand-written answers."""
from __future__ import annotations

import json
import math

import pytest

from engine.classify import (is_classifier_checkpoint, parse_classify, parse_v1_classify, softmax,
                             v1_classify_response)
from engine.openai_api import parse_chat, parse_completion, response, streamable_text
from engine.protocol import Limits, ProtocolError
from engine.responses import EngineResponseError, parse_chat_reply
from engine.responses import parse_classify as parse_classify_answer

pytestmark = pytest.mark.unit

LIMITS = Limits(vocab_size=100, context_len=64, max_total_tokens=400, max_seqs=8)
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from infra.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture()
def chat_tok(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = CHATML
    return t


def refused(fn, *args, match: str):
    with pytest.raises(ProtocolError) as e:
        fn(*args)
    assert match in e.value.message, e.value.message
    return e.value


# -- /v1/completions and /v1/chat/completions requests ---------------------------------------------------------
def test_completion_prompts_n_seeds_and_rids(tok):
    req = parse_completion({"prompt": ["ab", [5, 6, 7]], "n": 2, "max_tokens": 3, "temperature": 0.5, "seed": 10,
                            "stop": "x", "top_k": 4}, tok, LIMITS)
    assert req.kind == "completion" and req.id.startswith("cmpl-") and req.n == 2
    assert [s.input_ids for s in req.seqs] == [tuple(tok("ab").input_ids)] * 2 + [(5, 6, 7)] * 2
    assert [s.sampling.seed for s in req.seqs] == [10, 11, 12, 13]  # choice k: seed + k
    assert {s.sampling.max_new_tokens for s in req.seqs} == {3} and req.seqs[0].sampling.stop_strs == ("x",)
    assert req.seqs[0].sampling.top_k == 4 and req.seqs[0].sampling.temperature == 0.5
    assert len({s.rid for s in req.seqs}) == 4 and all(req.id in s.abort_keys for s in req.seqs)
    assert req.prompt_tokens == len(tok("ab").input_ids) + 3  # each prompt once, whatever n


def test_default_max_tokens_fills_the_context_and_the_budget(tok):
    one = parse_completion({"prompt": [1] * 10}, tok, LIMITS)
    assert one.seqs[0].sampling.max_new_tokens == 64 - 10 - 1  # the context is the bound
    many = parse_completion({"prompt": [1] * 10, "n": 8}, tok, LIMITS)
    assert many.seqs[0].sampling.max_new_tokens == (400 - 80) // 8  # the server's token budget is
    refused(parse_completion, {"prompt": [1] * 63}, tok, LIMITS, match="max_tokens")


@pytest.mark.parametrize("body,field", [
    ({"prompt": None}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, 200]}, "prompt[1]"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"), ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 100}, "max_tokens"), ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"), ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "n": 9}, "sequences"),
    ({"prompt": "a", "stop": [""]}, "stop"), ({"prompt": "a", "seed": "1"}, "seed"),
    ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "logprobs": 2}, "logprobs"), ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_bad_completion_fields_are_named(tok, body, field):
    refused(parse_completion, body, tok, LIMITS, match=field)


def test_neutral_and_unknown_fields_pass(tok):
    req = parse_completion({"prompt": "a", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0,
                            "logprobs": None, "logit_bias": None, "user": "u", "some_future_field": 1,
                            "stream": True, "stream_options": {"include_usage": True}}, tok, LIMITS)
    assert req.stream and req.include_usage


def test_chat_renders_the_template_and_stops_at_the_turn_end(chat_tok):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    req = parse_chat({"messages": msgs, "max_tokens": 4}, chat_tok, LIMITS)
    text = "<|system|>be brief\n<|user|>hi\nthere\n<|assistant|>"
    assert req.kind == "chat" and req.seqs[0].input_ids == tuple(chat_tok(text, add_special_tokens=False).input_ids)
    assert chat_tok.eos_token_id in req.seqs[0].sampling.stop_token_ids  # infra.chat.end_of_turn_ids


def test_chat_errors_name_the_field(tok, chat_tok):
    refused(parse_chat, {"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS, match="no chat template")
    refused(parse_chat, {"messages": []}, chat_tok, LIMITS, match="messages")
    refused(parse_chat, {"messages": [{"content": "x"}]}, chat_tok, LIMITS, match="messages[0].role")
    refused(parse_chat, {"messages": [{"role": "user", "content": 5}]}, chat_tok, LIMITS, match="messages[0].content")
    refused(parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat_tok, LIMITS,
            match="messages[0].content[0]")
    refused(parse_chat, [1], chat_tok, LIMITS, match="JSON object")


def test_response_shapes(tok):
    req = parse_completion({"prompt": "ab", "n": 2, "max_tokens": 3}, tok, LIMITS)
    out = response(req, "m", ["x", "y"], [{"type": "length", "length": 3}, {"type": "stop", "matched": "z"}], 5)
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "stop"]
    assert out["choices"][1]["matched_stop"] == "z" and out["choices"][0]["text"] == "x"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


@pytest.mark.parametrize("text,stops,safe", [
    ("hello wor", ("world",), "hello "),  # a tail that may grow into the stop string is held back
    ("hello world and", ("world",), "hello "),  # a contained stop string cuts there
    ("abc", (), "abc"), ("ab\n", ("\n\n",), "ab"), ("ab\n\nc", ("\n\n", "c"), "ab"), ("xy", ("yz", "xyz"), ""),
])
def test_streamable_text(text, stops, safe):
    assert streamable_text(text, stops) == safe


# -- /classify ---------------------------------------------------------------------------------------------------
def test_classify_shapes(tok):
    single = parse_classify({"text": "ab"}, tok, LIMITS)
    assert single.is_single and single.inputs == [tuple(tok("ab").input_ids)] and len(single.rids) == 1
    batch = parse_classify({"input_ids": [[5, 6], [7]], "rid": ["a", "b"], "sampling_params": {}}, tok, LIMITS)
    assert not batch.is_single and batch.inputs == [(5, 6), (7,)] and batch.rids == ["a", "b"]
    assert parse_classify({"input_ids": [5, 6]}, tok, LIMITS).is_single
    v1 = parse_v1_classify({"model": "m", "input": ["ab", "c"]}, tok, LIMITS)
    assert len(v1.inputs) == 2 and not v1.is_single
    assert parse_v1_classify({"input": [[4], [5, 6]]}, tok, LIMITS).inputs == [(4,), (5, 6)]


@pytest.mark.parametrize("body,field", [
    ({"text": [["q", "d"]]}, "cross-encoder"), ({"input_ids": [[1] * 64]}, "context length"),
    ({"input_ids": [[1]] * 9}, "limit of 8"), ({"input_ids": [[1] * 60] * 7}, "max_total_tokens"),
    ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds"), ({"text": "a", "sampling_params": 3}, "sampling_params"),
    ({"rid": 5, "text": "a"}, "rid"),
])
def test_bad_classify_bodies(tok, body, field):
    refused(parse_classify, body, tok, LIMITS, match=field)


def test_v1_classify_errors_name_input(tok):
    refused(parse_v1_classify, {"input": []}, tok, LIMITS, match="input")
    refused(parse_v1_classify, {"input": [1, 500]}, tok, LIMITS, match="input[1]")


def test_v1_classify_response():
    out = v1_classify_response([[0.0, math.log(3.0)], [2.0]], [4, 5], "m", {0: "bad", 1: "good"})
    assert out["object"] == "list" and out["model"] == "m" and out["id"].startswith("classify-")
    assert out["data"][0]["probs"] == pytest.approx([0.25, 0.75]) and out["data"][0]["label"] == "good"
    assert out["data"][1] == {"index": 1, "label": "bad", "probs": [1.0], "num_classes": 1}
    assert out["usage"] == {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    assert softmax([1000.0, 1000.0]) == [0.5, 0.5]  # no overflow


def test_is_classifier_checkpoint(tmp_path):
    assert not is_classifier_checkpoint(tmp_path)  # no config
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    assert is_classifier_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_classifier_checkpoint(tmp_path)


def test_score_position_is_hf_pooling():
    from engine.reward_model import score_position

    assert score_position([5, 6, 7], None) == 2 and score_position([5, 6, 7], 0) == 2
    assert score_position([5, 6, 0, 0], 0) == 1 and score_position([0, 0], 0) == 0  # all pad: HF's argmax gives 0


def test_length_batches():
    from infra.batch_groups import token_budget_groups

    def length_batches(lengths, max_batch, max_tokens):  # the reward-model server's cut
        return token_budget_groups(lengths, max_tokens, max_rows=max_batch)

    lengths = [5, 1, 3, 9, 2, 2]
    groups = length_batches(lengths, max_batch=2, max_tokens=100)
    assert sorted(i for g in groups for i in g) == list(range(6)) and all(len(g) <= 2 for g in groups)
    assert [lengths[g[0]] for g in groups] == sorted(lengths[g[0]] for g in groups)  # shortest first
    tight = length_batches(lengths, max_batch=64, max_tokens=9)
    assert all(len(g) * max(lengths[i] for i in g) <= 9 or len(g) == 1 for g in tight)
    assert length_batches([], 4, 10) == []


# -- the client's parsers ----------------------------------------------------------------------------------------
def test_client_parses_classify_answers():
    body = [{"embedding": [0.5], "meta_info": {}}, {"embedding": [1, -2.0], "meta_info": {}}]
    assert parse_classify_answer(body, 2) == [[0.5], [1.0, -2.0]]
    for bad, n in [(body, 3), ({"embedding": [1.0]}, 1), ([{"embedding": []}], 1), ([{"embedding": [float("nan")]}], 1),
                   ([{"embedding": ["x"]}], 1)]:
        with pytest.raises(EngineResponseError):
            parse_classify_answer(bad, n)


def test_client_parses_chat_replies():
    r = parse_chat_reply({"model": "m", "choices": [{"message": {"role": "assistant", "content": "4"},
                                                     "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    assert (r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens, r.model) == ("4", "stop", 3, 1, "m")
    assert parse_chat_reply({"choices": [{"message": {"content": ""}}]}).prompt_tokens is None
    for bad in [{}, {"choices": []}, {"choices": [{"message": {"content": None, "tool_calls": []}}]}, []]:
        with pytest.raises(EngineResponseError):
            parse_chat_reply(bad)
