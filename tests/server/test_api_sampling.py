"""vLLM's sampling extensions and OpenAI's n, echo and structured output, on the real server
(stories260k): each honoured as OpenAI / vLLM define it."""

import asyncio
import json

import jsonschema
import pytest
from openai import OpenAI

from tests.server.conftest import get, metric_value
from tests.server.helpers import MODEL, completion, post, run, stream

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(server, text: str) -> list[int]:
    _, out, _ = run(post(server.url, "/tokenize", {"prompt": text, "add_special_tokens": False}))
    return out["tokens"]


def ids_of(r) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_logit_bias_forces_and_bans(server):
    c = client(server)
    ids = {"return_tokens_as_token_ids": True}
    base = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                temperature=0, logprobs=0, extra_body=ids)
    first = ids_of(base)[0]
    # +100 on one token: greedy picks it every time (vLLM adds the bias to the logit)
    was = tokens_of(server, "Once upon a time, there was")[-1]
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                             logit_bias={str(was): 100})
    assert r.choices[0].text == " was" * 4
    # -100 bans: the greedy first token never appears, sampled or not
    for temperature in (0.0, 1.0):
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                 temperature=temperature, seed=3, logprobs=0, extra_body=ids,
                                 logit_bias={str(first): -100})
        assert first not in ids_of(r)
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion("Once", logit_bias={"99999": 5})))
    assert status == 400 and body["error"]["param"] == "logit_bias", body
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion("Once", logit_bias={"dog": 5})))
    assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_penalties_change_greedy_output_and_are_bounded(server):
    async def all_of(bodies):
        return await asyncio.gather(*(post(server.url, "/v1/completions", b) for b in bodies))

    variants = [{}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                {"repetition_penalty": 2.0}]
    outs = run(all_of([completion(PROMPT, max_tokens=16, **v) for v in variants]))
    assert all(status == 200 for status, _, _ in outs), outs
    texts = [body["choices"][0]["text"] for _, body, _ in outs]
    assert all(t != texts[0] for t in texts[1:]), texts
    bad = [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
           ("min_tokens", 100)]
    outs = run(all_of([completion("Once", max_tokens=8, **{f: v}) for f, v in bad]))
    for (field, _), (status, body, _) in zip(bad, outs):
        assert status == 400 and body["error"]["param"] == field, body


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(server):
    c = client(server)
    was = tokens_of(server, "Once upon a time, there was")[-1]  # greedy: ", there was a"
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                             temperature=0, extra_body={"stop_token_ids": [was],
                                                        "min_tokens": 6})
    assert r.usage.completion_tokens >= 6 and " was" not in r.choices[0].text[:6]
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                             temperature=0, stop=[" was"], extra_body={"min_tokens": 6})
    assert r.usage.completion_tokens >= 6


def test_include_stop_str_in_output(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                             temperature=0, stop=[" was"],
                             extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ", there was" and r.choices[0].finish_reason == "stop"


def test_n_choices_share_the_prompt_and_reproduce_with_a_seed(server):
    c = client(server)
    before = server.metric("tinyserve:prefix_cache_hits_total")
    prompt_len = len(tokens_of(server, PROMPT)) + 1  # (+ BOS)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=4,
                             seed=11)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert len({ch.text for ch in r.choices}) > 1  # choices differ ...
    again = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                 n=4, seed=11)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # ... reproducibly
    # One prefill: choices 1..3 found the prompt's full blocks in the prefix cache.
    full_blocks = (prompt_len - 1) // 16 * 16
    assert server.metric("tinyserve:prefix_cache_hits_total") - before >= 2 * 3 * full_blocks
    assert r.usage.prompt_tokens == prompt_len  # counted once, as OpenAI does
    assert r.usage.completion_tokens == sum(8 for _ in r.choices) or r.usage.completion_tokens > 8
    # Streaming chat, n=2: each choice's deltas under its index, then one usage.
    events, done, _ = run(stream(server.url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
        "n": 2, "seed": 5, "stream_options": {"include_usage": True}}))
    texts = {0: "", 1: ""}
    for e in events:
        for ch in e["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    whole = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=5, n=2, seed=5)
    assert texts == {i: ch.message.content for i, ch in enumerate(whole.choices)}
    assert done and events[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    status, body, _ = run(post(server.url, "/v1/completions", completion("Once", n=65)))
    assert status == 400 and body["error"]["param"] == "n", body


def test_echo_with_logprobs_returns_the_prompt_scored(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                             temperature=0, echo=True, logprobs=1)
    plain = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                 temperature=0, logprobs=1)
    ch, lp = r.choices[0], r.choices[0].logprobs
    assert ch.text == "Once upon a time" + plain.choices[0].text
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == sorted(lp.text_offset)
    # The same streamed: the prompt first, then the completion; offsets agree.
    events, _, _ = run(stream(server.url, "/v1/completions", completion(
        "Once upon a time", max_tokens=2, echo=True, logprobs=1)))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert text == ch.text and offsets == lp.text_offset
    # echo without logprobs: text only; ids are echoed decoded with their special tokens, as
    # vLLM echoes them (the BOS sent as id 1 is "<s>")
    r = c.completions.create(model=MODEL, prompt=[1, 403, 407], max_tokens=2, temperature=0,
                             echo=True)
    assert r.choices[0].text.startswith("<s> Once upon")


def test_prompt_logprobs_in_vllm_shape(server):
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion("Once upon a time", max_tokens=1, prompt_logprobs=2)))
    assert status == 200, body
    pl = body["choices"][0]["prompt_logprobs"]
    ids = [1] + tokens_of(server, "Once upon a time")
    assert len(pl) == len(ids) and pl[0] is None
    for token, entry in zip(ids[1:], pl[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or entry[str(token)]["rank"] > 2
    status, body, _ = run(post(server.url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}))
    assert status == 200 and body["prompt_logprobs"][0] is None, body
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])


def test_return_tokens_as_token_ids_and_truncate_prompt_tokens(server):
    r = client(server).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=2, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "truncate_prompt_tokens": 3})
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    assert r.usage.prompt_tokens == 3


def test_streamed_text_offsets_equal_whole_ones_when_a_stop_string_holds_text_back(server):
    body = completion("Once upon a time", max_tokens=12, logprobs=1, stop=[" girl named Tom"])
    _, whole, _ = run(post(server.url, "/v1/completions", body))
    events, _, _ = run(stream(server.url, "/v1/completions", body))
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "age": {"type": "integer", "minimum": 0, "maximum": 9},
    "mood": {"enum": ["happy", "sad"]},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 1}},
    "required": ["name", "age", "mood"], "additionalProperties": False}


def valid(doc) -> bool:
    try:
        jsonschema.validate(doc, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def test_json_schema_output_validates_in_50_of_50_samples(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about a girl."}],
        temperature=1.0, max_tokens=64, n=50, seed=1234,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA}})
    docs = [json.loads(ch.message.content) for ch in r.choices]
    assert len(docs) == 50 and all(valid(d) for d in docs), [ch.message.content
                                                                for ch in r.choices]
    assert all(ch.finish_reason == "stop" for ch in r.choices)


def test_other_constraints(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="The pet was a", max_tokens=8,
                             temperature=1.0, seed=2, n=4,
                             extra_body={"guided_choice": ["cat", "dog", "red bird"]})
    assert {ch.text for ch in r.choices} <= {"cat", "dog", "red bird"}
    r = c.completions.create(model=MODEL, prompt="Code:", max_tokens=10, temperature=1.0,
                             seed=3, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_or_unsatisfiable_grammars_are_a_400(server, extra, param):
    status, body, _ = run(post(server.url, "/v1/completions", completion("Once", **extra)))
    assert status == 400 and body["error"]["param"] == param, body
    assert get(server.url + "/health")[0] == 200


def test_metrics_carry_the_request_params(server):
    client(server).completions.create(model=MODEL, prompt="Once", max_tokens=3, n=3)
    text = get(server.url + "/metrics")[1]
    assert metric_value(text, "tinyserve:request_params_n_count") >= 1
    assert 'model_name="stories260k"' in text
