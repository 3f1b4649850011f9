"""OpenAI / vLLM API parity on a real server: fields defined elsewhere are honoured or
refused by name (never silently ignored), model retrieval, vLLM's tokenize endpoints."""

import logging

import openai
import pytest
from openai import OpenAI

from tests.server.conftest import get
from tests.server.helpers import MODEL, chat, completion, post, run
from tinyserve.api import decode as api_fields
from tinyserve.api.errors import ApiError
from tinyserve.api.openai.fields import decode as decode_request
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("field, value", [
    ("bad_words", ["dog"]), ("echo", True), ("use_beam_search", True), ("min_p", 0.1),
    ("allowed_token_ids", [1, 2]), ("continue_final_message", True), ("best_of", 2),
])
def test_defined_but_unhonoured_fields_are_refused_by_name(server, field, value):
    status, body, _ = run(post(server.url, "/v1/chat/completions", {**chat("Hi"), field: value}))
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["code"] == "unsupported_parameter"


def test_completions_refuse_their_own_unhonoured_fields(server):
    for field, value in (("suffix", "The end."), ("best_of", 3)):
        status, body, _ = run(post(server.url, "/v1/completions",
                                   {**completion("Once"), field: value}))
        assert status == 400 and body["error"]["param"] == field, body


def test_neutral_values_of_those_fields_are_accepted(server):
    # What SDKs and benchmark clients send by default asks for nothing: answered as usual.
    body = {**chat("Hi"), "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
            "repetition_penalty": 1.0, "min_tokens": 0, "skip_special_tokens": True,
            "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True,
            "echo": False, "add_generation_prompt": True}
    status, out, _ = run(post(server.url, "/v1/chat/completions", body))
    assert status == 200, out
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                          temperature=0, presence_penalty=0, best_of=1,
                                          logit_bias={})
    assert r.choices[0].text == ", there was a"


def test_fields_nobody_defines_are_ignored_and_logged_once(server, caplog):
    status, out, _ = run(post(server.url, "/v1/completions",
                              {**completion("Once"), "x_my_tracing_tag": "abc"}))
    assert status == 200, out
    with caplog.at_level(logging.INFO, logger="tinyserve.api.decode"):
        api_fields._seen_unknown.discard("zz_unknown")
        for _ in range(3):
            decode_request(b'{"model": "m", "prompt": "x", "zz_unknown": 1}', CompletionRequest)
    assert sum("zz_unknown" in r.message for r in caplog.records) == 1


def test_the_seen_set_is_bounded():
    before = set(api_fields._seen_unknown)
    try:
        for i in range(api_fields._SEEN_LIMIT + 50):
            decode_request(b'{"model": "m", "prompt": "x", "k%d": 1}' % i, CompletionRequest)
        assert len(api_fields._seen_unknown) <= api_fields._SEEN_LIMIT
    finally:
        api_fields._seen_unknown.clear()
        api_fields._seen_unknown.update(before)


def test_stream_options_need_stream():
    for options in (b'{"include_usage": true}', b'{"include_usage": false}'):
        with pytest.raises(ApiError) as e:
            decode_request(b'{"model": "m", "messages": [], "stream_options": ' + options + b"}",
                           ChatCompletionRequest)
        assert e.value.param == "stream_options"
    # vLLM's rule is on truthiness: empty or null options ask for nothing.
    for options in (b"{}", b"null"):
        decode_request(b'{"model": "m", "messages": [], "stream": false, "stream_options": '
                       + options + b"}", ChatCompletionRequest)
    decode_request(b'{"model": "m", "messages": [], "stream": true, '
                   b'"stream_options": {"include_usage": true}}', ChatCompletionRequest)
    # vLLM's continuous_usage_stats is honoured (test_vllm_extensions.py)
    req = decode_request(b'{"model": "m", "messages": [], "stream": true, "stream_options": '
                         b'{"include_usage": true, "continuous_usage_stats": true}}',
                         ChatCompletionRequest)
    assert req.stream_options.continuous_usage_stats


def test_field_check_is_type_strict():
    # false is not 0 and "0" is not 0: a client sending them asked for something odd.
    for bad in (b'"presence_penalty": false', b'"presence_penalty": "0"',
                b'"echo": 0', b'"tools": {"a": 1}', b'"tools": ""', b'"logit_bias": []',
                b'"prompt_embeds": "abc"', b'"repetition_min_count": 2'):
        with pytest.raises(ApiError):
            decode_request(b'{"model": "m", "messages": [], ' + bad + b"}",
                           ChatCompletionRequest)


def test_models_carry_vllm_fields_and_retrieve_works(server):
    c = client(server)
    card = c.models.list().data[0]
    assert card.id == MODEL and card.max_model_len == 512 and card.root
    got = c.models.retrieve(MODEL)
    assert got.id == MODEL and got.max_model_len == 512
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    assert get(server.url + "/v1/models/" + MODEL)[0] == 200


def test_tokenize_and_detokenize_round_trip(server):
    status, out, _ = run(post(server.url, "/tokenize", {"model": MODEL,
                                                         "prompt": "Once upon a time"}))
    assert status == 200, out
    assert out["count"] == 5 == len(out["tokens"]) and out["max_model_len"] == 512
    # The completion of the same prompt reports the same count.
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert r.usage.prompt_tokens == out["count"]
    status, text, _ = run(post(server.url, "/detokenize", {"model": MODEL,
                                                            "tokens": out["tokens"][1:]}))
    assert status == 200 and text["prompt"] == "Once upon a time", text
    status, out2, _ = run(post(server.url, "/tokenize", {"prompt": "Once upon a time",
                                                          "add_special_tokens": False,
                                                          "return_token_strs": True}))
    assert out2["tokens"] == out["tokens"][1:] and len(out2["token_strs"]) == 4


def test_tokenize_chat_matches_the_chat_prompt(server):
    msgs = [{"role": "user", "content": "Hi there"}]
    status, out, _ = run(post(server.url, "/tokenize", {"model": MODEL, "messages": msgs}))
    assert status == 200, out
    r = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == out["count"]
    _, without, _ = run(post(server.url, "/tokenize", {"model": MODEL, "messages": msgs,
                                                        "add_generation_prompt": False}))
    assert without["count"] < out["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
     "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1] * 600}, "tokens"),
])
def test_tokenize_errors(server, path, body, param):
    status, out, _ = run(post(server.url, path, body))
    assert status in (400, 404), out
    assert out["error"]["param"] == param, out


PROMPTS8 = ["Once upon a time", "The dog", "Lily wanted", "One day, Tom", "The sun was",
            "She had a big", "They went to the", "Ben and Mia"]


def test_a_batch_of_prompts_answers_each_as_if_alone(server):
    c = client(server)
    solo = [c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
            for p in PROMPTS8]
    batch = c.completions.create(model=MODEL, prompt=PROMPTS8, max_tokens=6, temperature=0)
    assert [ch.index for ch in batch.choices] == list(range(8))
    assert [ch.text for ch in batch.choices] == [s.choices[0].text for s in solo]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in solo)
    # Token-id prompts too, and the stream: every choice's text, then one usage for all.
    ids = [[1, 403, 407, 261, 378], [1, 334, 281]]
    whole = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                 logprobs=1)
    texts, usage_chunks = ["", ""], []
    for chunk in c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                      stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        if chunk.usage:
            usage_chunks.append(chunk.usage)
    assert texts == [ch.text for ch in whole.choices]
    assert len(usage_chunks) == 1 and usage_chunks[0].total_tokens == whole.usage.total_tokens
    assert all(len(ch.logprobs.tokens) == 5 for ch in whole.choices)


def test_a_batch_is_refused_whole(server):
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion(["Once", "x" * 5000], max_tokens=4)))
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion(["Once"] * 65, max_tokens=1)))
    assert status == 400 and "at most 64" in body["error"]["message"], body
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion(["Once", 5], max_tokens=1)))
    assert status == 400, body


def test_logprobs_zero_names_the_sampled_token(server):
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                                          temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs


def test_openapi_names_every_api_route():
    import re

    from tinyserve.api.app import Api
    from tinyserve.api.ops.openapi import openapi_spec
    from tinyserve.config import ServerConfig

    app = Api(ServerConfig()).app()
    routes = {(r.method.lower(), re.sub(r"\{(\w+):[^}]*\}", r"{\1}", r.resource.canonical))
              for r in app.router.routes() if r.method != "HEAD"}
    paths = openapi_spec("x")["paths"]
    described = {(m, p) for p, ops in paths.items() for m in ops}
    undocumented = {(m, p) for m, p in routes - described
                    if p not in ("/metrics", "/openapi.json")}
    assert not undocumented, undocumented
    assert ("get", "/v1/models/{model_id}") in described and ("post", "/tokenize") in described


def test_stop_token_ids_end_the_text_without_their_own(server):
    # Greedy: ", there was a little girl named Lily"; stop on " was".
    _, tok, _ = run(post(server.url, "/tokenize", {"prompt": "Once upon a time, there was",
                                                    "return_token_strs": True}))
    was = tok["tokens"][-1]
    assert tok["token_strs"][-1] == " was"
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                          temperature=0, extra_body={"stop_token_ids": [was]})
    assert r.choices[0].text == ", there" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 3  # the stop token counts, as in vLLM
    status, body, _ = run(post(server.url, "/v1/completions",
                               {**completion("Once"), "stop_token_ids": [512]}))
    assert status == 400 and body["error"]["param"] == "stop_token_ids", body
    status, body, _ = run(post(server.url, "/v1/completions",
                               {**completion("Once"), "stop_token_ids": list(range(17))}))
    assert status == 400 and body["error"]["param"] == "stop_token_ids", body


def test_skip_special_tokens_reaches_the_engine():
    from tinyserve.api.sampling import sampling_params

    req = decode_request(b'{"model": "m", "prompt": "x", "skip_special_tokens": false, '
                         b'"stop_token_ids": [3, 4]}', CompletionRequest)
    params, _ = sampling_params(req, 4)
    assert params.skip_special_tokens is False and params.stop_token_ids == (3, 4)


def test_a_batch_no_wait_could_admit_is_a_400():
    """Admission's answer, asked before anything is compiled (the API asks; it decides)."""
    import asyncio

    from tinyserve.actors.admission import Admission
    from tinyserve.actors.lanes import Lane
    from tinyserve.config import TenantConfig

    def refusal(prompts, tenant):
        admission = Admission([Lane("m", asyncio.Queue(), 8, 64)], tenants=(tenant,))
        return admission.refuse_early(tenant.name, "m", prompts, 1, 10)

    assert refusal([[1, 2]] * 8, TenantConfig("t")) is None  # exactly the capacity
    for tenant, n, what in ((TenantConfig("t"), 9, "capacity"),
                            (TenantConfig("t", max_concurrent=2), 3, "max_concurrent"),
                            (TenantConfig("t", tokens_per_minute=30), 3, "per minute")):
        failed = refusal([[1, 2]] * n, tenant)
        assert failed.status == 400 and what in failed.message


def test_batch_errors_name_the_prompt(server):
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion(["Once", [1, 10**6]], max_tokens=1)))
    assert status == 400 and body["error"]["message"].startswith("prompt[1]: "), body
