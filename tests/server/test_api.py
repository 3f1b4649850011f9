"""OpenAI-compatible API on a real server: chat and completions, streaming and not."""

from openai import OpenAI

from tests.server.conftest import get
from tests.server.helpers import MODEL, completion, post, run, stream


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_health_ready(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    assert get(server.url + "/health")[0] == 200
    assert get(server.url + "/ready")[0] == 200


def test_completion_streamed_equals_non_streamed_and_usage(server):
    c = client(server)
    prompt = "Once upon a time"
    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        if ch.choices)
    assert text == whole.choices[0].text == ", there was a little girl named Lily"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == 5  # BOS + 4 (reference.json)
    assert whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == 15


def test_chat_streamed_equals_non_streamed_and_usage(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me about a cat."}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 5


def test_stop_strings_never_leak_into_the_stream(server):
    body = completion("Once upon a time", max_tokens=20, stop=["Lily."])
    status, whole, _ = run(post(server.url, "/v1/completions", body))
    events, done, _ = run(stream(server.url, "/v1/completions", body))
    pieces = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert status == 200 and done
    assert whole["choices"][0]["text"] == "".join(pieces) == ", there was a little girl named "
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert not any("Lily" in p for p in pieces)


def test_logprobs_in_both_apis(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                             temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text == ", there was"
    assert lp.text_offset == [0, 1, 7]
    assert all(len(t) == 2 for t in lp.top_logprobs)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)  # greedy


def test_token_id_prompt_and_seeded_sampling(server):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt=[1, 403, 407, 261, 378], max_tokens=6,
                             temperature=0.9, seed=7)
    b = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                             temperature=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_every_response_carries_a_request_id(server):
    status, _, headers = run(post(server.url, "/v1/completions", completion("Hi", 1),
                                  headers={"X-Request-Id": "my-id-1"}))
    assert status == 200 and headers["X-Request-Id"] == "my-id-1"
    status, _, headers = run(post(server.url, "/v1/completions", {"bad": 1}))
    assert status == 400 and headers["X-Request-Id"]
    _, _, headers = run(stream(server.url, "/v1/completions", completion("Hi", 1)))
    assert headers["X-Request-Id"]
