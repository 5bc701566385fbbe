"""OpenAI-compatible endpoints of the embedded engine, spoken to by the `openai` client package itself: a tiny Qwen2
with a ChatML template (`qwen2_bpe_dir`) served by `python -m engine.server` on loopback, with an API key.

- `chat.completions.create` and `completions.create`: greedy answers equal /generate's greedy answer for the same
  prompt (the chat template's ids; the completion's text tokenized as /generate's `text`), `usage` counts the
  prompt once and every generated token, `finish_reason` is "length" at max_tokens and "stop" at a stop string
  (which the text leaves out), `n` choices, a seeded sample is reproducible;
- streaming: the role first, deltas that add up to the non-streamed answer, the finish_reason last, the usage chunk;
- errors: a wrong key (AuthenticationError), a bad body (BadRequestError naming the field), a tokenizer without a
  chat template (400 saying so); `/v1/models` lists the served model;
- `EngineClient.chat` against the same server.
"""
from __future__ import annotations

import json

import pytest

from engine_proc import EngineProc, http

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

KEY = "chat-test-key"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Anna has 12 apples and buys 30 more. How many apples does she have now?"}]
PROMPT = "Question: A train travels 1,250 km in 5 hours. What is its average speed in km/h?\nAnswer:"


@pytest.fixture(scope="module")
def server(qwen2_bpe_dir, tmp_path_factory):
    proc = EngineProc(qwen2_bpe_dir, tmp_path_factory.mktemp("oai-log") / "server.log", "--served-model-name",
                      "tiny-chat", api_key=KEY).start()
    yield proc.wait_healthy()
    proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def generate(server, body) -> dict:
    status, raw = http(server.url, "/generate", json.dumps(body).encode(),
                       headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, raw
    return json.loads(raw)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_chat_greedy_equals_generate(server, client, qwen2_bpe_dir):
    from infra.chat import end_of_turn_ids
    from infra.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen2_bpe_dir)
    ids = chat_ids(tok, MESSAGES)
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
    ref = generate(server, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop_token_ids": end_of_turn_ids(tok)}})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny-chat"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.finish_reason == ref["meta_info"]["finish_reason"]["type"] == "length"
    assert r.usage.prompt_tokens == len(ids) == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == len(ids) + 12


def test_completion_greedy_equals_generate_n_and_stop(server, client):
    ref = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}})
    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10, temperature=0, n=2)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [ref["text"]] * 2
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] and r.usage.completion_tokens == 20
    # a stop string inside the greedy answer ends it there, left out of the text, finish_reason "stop"
    text = ref["text"]
    assert len(text) >= 2, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    s = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10, temperature=0, stop=stop)
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == text[:text.find(stop)]
    # token-id prompts and a batch of prompts: one choice per prompt, in order
    b = client.completions.create(model="tiny-chat", prompt=[PROMPT, "Answer: 42\nQuestion:"], max_tokens=4,
                                  temperature=0)
    assert [c.index for c in b.choices] == [0, 1] and b.choices[0].text == generate(server, {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})["text"]


def test_seeded_samples_reproduce(client):
    kw = dict(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=2)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streaming_adds_up_to_the_answer(client, kind):
    if kind == "chat":
        kw = dict(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        kw = dict(model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0)
        whole = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_errors(server, client, tiny_model_dir, tmp_path):
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4)
    for kw, field in [(dict(messages=[]), "messages"), (dict(messages=MESSAGES, max_tokens=-1), "max_tokens"),
                      (dict(messages=MESSAGES, temperature=-1), "temperature"),
                      (dict(messages=MESSAGES, max_tokens=10**6), "max_tokens"),
                      (dict(messages=MESSAGES, presence_penalty=0.5), "presence_penalty"),
                      (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
                          "url": "http://x/y.png"}}]}]), "messages[0].content[0]")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-chat", **kw)
        assert field in str(e.value), (field, str(e.value))
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="tiny-chat", prompt=[], max_tokens=4)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    # a tokenizer without a chat template (the char tokenizer): chat is a 400 that says so, completions work
    proc = EngineProc(tiny_model_dir, tmp_path / "char.log").start().wait_healthy()
    try:
        char = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            char.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        assert char.completions.create(model="m", prompt="abc", max_tokens=3).usage.completion_tokens <= 3
    finally:
        proc.kill()


def test_engine_client_chat(server, client):
    from engine.client import EngineClient, EngineRequestError

    whole = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0)
    for base in (server.url, f"{server.url}/v1"):  # a base URL with or without /v1
        c = EngineClient(base, api_key=KEY)
        reply = c.run_sync(c.chat(MESSAGES, max_tokens=6))
        assert reply.text == whole.choices[0].message.content and reply.finish_reason == "length"
        assert reply.prompt_tokens == whole.usage.prompt_tokens and reply.completion_tokens == 6
    c = EngineClient(server.url, api_key=KEY)
    with pytest.raises(EngineRequestError, match="messages"):
        c.run_sync(c.chat([{"role": "user", "content": [{"type": "audio"}]}]))
