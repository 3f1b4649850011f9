"""vLLM's extensions that its own OpenAI-API tests send, on the real server (stories260k):
return_token_ids, chat token-in (prompt_token_ids), stream_options.continuous_usage_stats,
prompt_logprobs=-1, the echo of a token-id prompt and iteration_tokens_total. The assertions
are vLLM's (tests/entrypoints/openai/...), made exact where the tiny model allows."""

import math

import pytest
from openai import OpenAI

from tests.server.conftest import get, metric_value
from tests.server.helpers import MODEL, chat, completion, post, run, stream
from tests.server.test_tools import WEATHER
from tinyserve.core.engine_core import check_sampling_vocabulary
from tinyserve.messages import MAX_PROMPT_LOGPROB_ENTRIES, FieldError, SamplingParams

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about a cat."}]


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tokenize(server, **body) -> list[int]:
    status, out, _ = run(post(server.url, "/tokenize", {"model": MODEL, **body}))
    assert status == 200, out
    return out["tokens"]


def detokenize(server, ids: list[int]) -> str:
    status, out, _ = run(post(server.url, "/detokenize", {"model": MODEL, "tokens": ids}))
    assert status == 200, out
    return out["prompt"]


def as_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


# -- return_token_ids ---------------------------------------------------------------------------

def test_completion_token_ids_are_the_ones_that_ran(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                             logprobs=1, extra_body={"return_token_ids": True,
                                                     "return_tokens_as_token_ids": True})
    ch = r.choices[0]
    assert ch.prompt_token_ids == tokenize(server, prompt=PROMPT)  # BOS included
    assert ch.token_ids == as_ids(ch.logprobs.tokens) and len(ch.token_ids) == 5
    assert detokenize(server, ch.token_ids) == ch.text == ", there was a little"
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                 extra_body={"return_token_ids": False}).model_dump()
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None
    # A stop string cuts the text, not the ids: the token that completed it is among them.
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                             stop=["was"], extra_body={"return_token_ids": True})
    assert r.choices[0].text == ", there " and r.choices[0].finish_reason == "stop"
    assert detokenize(server, r.choices[0].token_ids).startswith(", there was")


def test_echo_with_token_ids_and_prompt_logprobs(server):
    # vLLM's test_comparison_with_prompt_logprobs_and_logprobs, with a token-id prompt
    ids = tokenize(server, prompt=PROMPT)
    r = client(server).completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "prompt_logprobs": 1})
    ch = r.choices[0]
    assert ch.prompt_token_ids == ids and ch.prompt_logprobs is not None
    assert as_ids(ch.logprobs.tokens) == ids + ch.token_ids  # the prompt's, then the output's
    # vLLM echoes the ids decoded with their special tokens ("<s>" for the BOS sent as an id)
    assert ch.text == detokenize(server, ids) + detokenize(server, ch.token_ids)
    assert ch.text.startswith("<s> Once upon a time")
    # the echoed prompt's alternatives are bounded by logprobs (vLLM: at most logprobs + 1)
    assert all(1 <= len(top) <= 2 for top in ch.logprobs.top_logprobs[1:])


def test_streamed_token_ids_add_up_to_the_whole_call(server):
    body = completion(PROMPT, max_tokens=4, n=2, seed=7, temperature=1.0,
                      return_token_ids=True)
    status, whole, _ = run(post(server.url, "/v1/completions", body))
    assert status == 200, whole
    events, done, _ = run(stream(server.url, "/v1/completions", body))
    assert done
    got: dict[int, list[int]] = {0: [], 1: []}
    firsts = set()
    for e in events:
        for ch in e["choices"]:
            got[ch["index"]] += ch["token_ids"]  # on every chunk, [] at worst (vLLM's)
            if "prompt_token_ids" in ch:  # only each choice's first chunk
                assert ch["index"] not in firsts and ch["prompt_token_ids"] == \
                    tokenize(server, prompt=PROMPT)
                firsts.add(ch["index"])
    assert firsts == {0, 1}
    for ch in whole["choices"]:
        assert got[ch["index"]] == ch["token_ids"] and len(ch["token_ids"]) == 4


def test_chat_token_ids_whole_and_streamed(server):
    c = client(server)
    prompt_ids = tokenize(server, messages=MESSAGES)
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                  logprobs=True, extra_body={"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True})
    assert r.prompt_token_ids == prompt_ids
    ids = r.choices[0].token_ids
    assert ids == as_ids([t.token for t in r.choices[0].logprobs.content]) and len(ids) == 4
    assert detokenize(server, r.choices[0].token_ids) == r.choices[0].message.content
    collected, content, chunks = [], "", list(c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
        extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == prompt_ids
    for chunk in chunks[1:]:
        assert "prompt_token_ids" not in chunk.model_dump()
    for chunk in chunks:
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            if "token_ids" in chunk.choices[0].model_dump():
                collected.extend(chunk.choices[0].token_ids)
    assert collected == r.choices[0].token_ids and content == r.choices[0].message.content
    assert "token_ids" not in c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1).choices[0].model_dump()


def test_token_ids_and_continuous_usage_beside_tools_and_n(server):
    # the tool parser holds text back; the ids and the counts still add up, per choice
    body = chat("What is the weather in Paris?", 4, tools=[WEATHER], n=2, seed=3,
                temperature=1.0, return_token_ids=True)
    status, whole, _ = run(post(server.url, "/v1/chat/completions", body))
    assert status == 200, whole
    events, _, _ = run(stream(server.url, "/v1/chat/completions", {
        **body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    ids: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        (ch,) = e["choices"]
        ids[ch["index"]] += ch.get("token_ids", [])
        assert e["usage"]["completion_tokens"] == len(ids[ch["index"]])
    for ch in whole["choices"]:
        assert ids[ch["index"]] == ch["token_ids"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


# -- chat token-in --------------------------------------------------------------------------------

def test_chat_token_in_matches_messages(server):
    c = client(server)
    prompt_ids = tokenize(server, messages=MESSAGES)
    baseline = c.chat.completions.create(model=MODEL, messages=MESSAGES,
                                         max_completion_tokens=4, temperature=0)
    token_in = c.chat.completions.create(
        model=MODEL, messages=[], max_completion_tokens=4, temperature=0,
        extra_body={"prompt_token_ids": prompt_ids, "return_token_ids": True})
    assert token_in.prompt_token_ids == prompt_ids
    assert token_in.choices[0].message.content == baseline.choices[0].message.content
    assert token_in.usage.prompt_tokens == baseline.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("option, value", [
    ("add_generation_prompt", True), ("chat_template", "{{ x }}"), ("echo", False),
    ("continue_final_message", False), ("add_special_tokens", False), ("documents", []),
    ("chat_template_kwargs", {})])
def test_chat_token_in_refuses_template_options(server, option, value):
    body = {**chat("unused", 2), "messages": [], "prompt_token_ids": [1, 403], option: value}
    status, out, _ = run(post(server.url, "/v1/chat/completions", body))
    assert status == 400 and out["error"]["param"] == "prompt_token_ids", out
    assert option in out["error"]["message"]


def test_chat_token_in_checks_its_ids(server):
    for ids, param in (([1, 512], "prompt_token_ids"), ([1] * 600, "prompt_token_ids")):
        body = {**chat("unused", 2), "messages": [], "prompt_token_ids": ids}
        status, out, _ = run(post(server.url, "/v1/chat/completions", body))
        assert status == 400 and out["error"]["param"] == param, out
    status, out, _ = run(post(server.url, "/v1/chat/completions", {**chat("x"), "messages": []}))
    assert status == 400 and out["error"]["param"] == "messages", out


# -- stream_options.continuous_usage_stats ------------------------------------------------------

def test_chat_continuous_usage_stats(server):
    # vLLM's test_chat_completion_stream_options, continuous case
    stream_ = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    last, chunks = 0, list(stream_)
    for chunk in chunks:
        assert chunk.usage.prompt_tokens > 0
        assert last == 0 or chunk.usage.completion_tokens > last or (
            not chunk.choices and chunk.usage.completion_tokens == last)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + \
            chunk.usage.completion_tokens
        last = chunk.usage.completion_tokens
    assert last == 5 and chunks[0].usage.completion_tokens == 0
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"


def test_completion_continuous_usage_stats(server):
    c = client(server)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       stream=True, stream_options=opts))
    for i, chunk in enumerate(chunks[:-1]):
        assert chunk.usage.prompt_tokens == 5 and chunk.usage.completion_tokens == i + 1
        assert chunk.usage.total_tokens == 6 + i
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    # vLLM: continuous usage only with include_usage
    for chunk in c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True}):
        assert chunk.usage is None


# -- prompt_logprobs=-1 ----------------------------------------------------------------------------

def test_prompt_logprobs_minus_one_is_the_whole_vocabulary(server):
    ids = [1, *tokenize(server, prompt=PROMPT, add_special_tokens=False)]
    status, full, _ = run(post(server.url, "/v1/completions",
                               completion(PROMPT, 1, prompt_logprobs=-1)))
    assert status == 200, full
    _, top1, _ = run(post(server.url, "/v1/completions", completion(PROMPT, 1, prompt_logprobs=1)))
    entries, ones = full["choices"][0]["prompt_logprobs"], top1["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, one in zip(ids[1:], entries[1:], ones[1:], strict=True):
        assert len(entry) == 512  # stories260k's vocabulary
        assert math.isclose(sum(math.exp(e["logprob"]) for e in entry.values()), 1, abs_tol=1e-4)
        assert entry[str(token)] == one[str(token)]  # bit for bit, rank included
        best = min(entry.items(), key=lambda kv: kv[1]["rank"])
        assert one[best[0]]["rank"] == 1 and one[best[0]]["logprob"] == best[1]["logprob"]
        ordered = sorted(entry.values(), key=lambda e: e["rank"])
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ordered, ordered[1:]))
    # beside echo and logprobs=1 the echoed tokens keep logprobs' bound (vLLM: at most 2)
    status, echoed, _ = run(post(server.url, "/v1/completions", completion(
        PROMPT, 1, prompt_logprobs=-1, echo=True, logprobs=1)))
    assert status == 200 and echoed["choices"][0]["prompt_logprobs"] == entries, echoed
    tops = echoed["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:])
    # chat takes it too (not streamed: vLLM refuses prompt_logprobs with a chat stream)
    status, out, _ = run(post(server.url, "/v1/chat/completions",
                              chat("Hi", 1, prompt_logprobs=-1)))
    assert status == 200 and all(len(e) == 512 for e in out["prompt_logprobs"][1:]), out
    status, out, _ = run(post(server.url, "/v1/completions", completion(PROMPT, 1,
                                                                       prompt_logprobs=-2)))
    assert status == 400 and out["error"]["param"] == "prompt_logprobs", out


def test_prompt_logprobs_minus_one_is_bounded(server):
    p = SamplingParams(prompt_logprobs=-1)
    vocab = 32_000
    most = MAX_PROMPT_LOGPROB_ENTRIES // vocab  # positions: a 9-token prompt's 8
    check_sampling_vocabulary(p, vocab, most)
    with pytest.raises(FieldError) as e:
        check_sampling_vocabulary(p, vocab, most + 1)
    assert e.value.field == "prompt_logprobs" and f"at most {most} positions" in str(e.value)
    check_sampling_vocabulary(SamplingParams(prompt_logprobs=20), vocab, 4096)
    with pytest.raises(FieldError):
        SamplingParams(logprobs=-1)  # only the prompt's may be the whole vocabulary
    # on the server the bound covers every choice: 512 x 300 positions fit, twice do not
    ids = [1] + [403] * 300
    status, out, _ = run(post(server.url, "/v1/completions",
                              completion(ids, 1, prompt_logprobs=-1, n=2)))
    assert status == 400 and out["error"]["param"] == "prompt_logprobs", out


# -- iteration_tokens_total --------------------------------------------------------------------------

def test_iteration_tokens_count_as_vllm_counts_them(server):
    # vLLM's test_metrics_counts: requests x (prompt + max_tokens), the repeats' cached prompt
    # tokens included; one observation per generated token (sequential requests)
    name = "tinyserve:iteration_tokens_total"
    ids = tokenize(server, prompt=PROMPT * 4)
    before = (server.metric(name + "_sum"), server.metric(name + "_count"))
    for _ in range(3):
        client(server).completions.create(model=MODEL, prompt=ids, max_tokens=3,
                                          extra_body={"ignore_eos": True})
    text = get(server.url + "/metrics")[1]
    assert metric_value(text, name + "_sum") - before[0] == 3 * (len(ids) + 3)
    assert metric_value(text, name + "_count") - before[1] == 3 * 3
