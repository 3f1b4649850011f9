"""For every generate route, the whole answer equals the fold of the stream, folded as each
API's own client folds it (the openai SDK's stream state for chat, the Responses API's last
event, the anthropic SDK's final message; completions by hand, as OpenAI documents them):
text, tool calls, finish / stop reason, logprobs, token ids and usage.

The in-process server runs the fake model that keeps to grammars (GuidedFakeRunner): its
tokens depend on the sequence alone, so a whole and a streamed request get the same tokens,
and anything that differs between the two answers is the shaping's doing. Each case runs once
before it is compared, so both answers find the prompt in the prefix cache alike (usage's
cached tokens).
"""

import json

import anthropic
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.helpers import MODEL
from tests.server.inprocess import GuidedFakeRunner, InProcessServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer(GuidedFakeRunner(), max_model_len=256)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(srv):
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


# -- chat completions -------------------------------------------------------------------------

def _chat_view(r, token_ids: dict[int, list[int]] | None = None) -> dict:
    """What a chat completion says, less what each answer names afresh (ids, created).
    ``token_ids``: vLLM's, folded by hand (the openai client's fold keeps no extension)."""
    ids = token_ids or {c.index: getattr(c, "token_ids", None) for c in r.choices}
    return {"usage": r.usage.model_dump(exclude_none=True), "choices": [{
        "index": c.index, "finish_reason": c.finish_reason, "content": c.message.content,
        "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
        "logprobs": None if c.logprobs is None else [
            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in c.logprobs.content],
        "token_ids": ids[c.index]} for c in r.choices]}


@pytest.mark.parametrize("kw", [
    {},
    {"n": 2, "logprobs": True, "top_logprobs": 2, "extra_body": {"return_token_ids": True}},
    {"stop": ["e"]},
    {"tools": [WEATHER, TIME], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "n": 2},
    {"response_format": {"type": "json_object"}, "max_tokens": 6},  # cut short: "length"
], ids=["plain", "n2-logprobs-ids", "stop", "required", "named", "required-n2", "cut"])
def test_chat_completions(oai, kw):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 100, "temperature": 0, **kw}
    oai.chat.completions.create(**kw)  # (the prompt into the prefix cache)
    whole = oai.chat.completions.create(**kw)
    state, ids = ChatCompletionStreamState(), {}
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                             **kw):
        state.handle_chunk(chunk)
        for c in chunk.choices:
            got = getattr(c, "token_ids", None)
            ids[c.index] = ids.get(c.index) if got is None else (ids.get(c.index) or []) + got
    folded = state.current_completion_snapshot  # (the SDK refuses to "parse" a cut answer)
    assert _chat_view(folded, ids) == _chat_view(whole)
    if "tools" in kw:  # (the cases that call: the comparison covered calls)
        assert all(c.message.tool_calls for c in whole.choices), whole


# -- completions ------------------------------------------------------------------------------

def _fold_completions(chunks) -> dict:
    """A completions stream folded as OpenAI documents it: each choice's text and logprobs
    are the concatenation of its chunks', the usage the last chunk's."""
    choices, usage = {}, None
    for c in chunks:
        usage = c.usage or usage
        for ch in c.choices:
            got = choices.setdefault(ch.index, {"index": ch.index, "text": "", "logprobs": None,
                                                "finish_reason": None})
            got["text"] += ch.text
            got["finish_reason"] = ch.finish_reason or got["finish_reason"]
            if ch.logprobs is not None:
                lp = got["logprobs"] = got["logprobs"] or {
                    "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for k in lp:
                    lp[k] += getattr(ch.logprobs, k)
    return {"choices": [choices[i] for i in sorted(choices)],
            "usage": usage.model_dump(exclude_none=True)}


def _completions_view(r) -> dict:
    return {"choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": None if c.logprobs is None else c.logprobs.model_dump()}
                        for c in r.choices], "usage": r.usage.model_dump(exclude_none=True)}


@pytest.mark.parametrize("kw", [
    {"prompt": "Once upon a time"},
    {"prompt": ["Once upon", "a cat sat"], "n": 2, "logprobs": 2, "echo": True},
    {"prompt": "Once upon a time", "stop": ["e"], "max_tokens": 30},
], ids=["plain", "batch-n2-logprobs-echo", "stop"])
def test_completions(oai, kw):
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0, **kw}
    oai.completions.create(**kw)  # (the prompt into the prefix cache)
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True},
                                         **kw))
    assert _fold_completions(chunks) == _completions_view(whole)


# -- the Responses API ------------------------------------------------------------------------

def _response_view(r: dict) -> dict:
    items = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in r["output"]]
    return {"status": r["status"], "output": items, "usage": r["usage"],
            "incomplete_details": r["incomplete_details"]}


@pytest.mark.parametrize("kw", [
    {},
    {"tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": "required",
     "parallel_tool_calls": False},
    {"max_output_tokens": 3},  # incomplete
], ids=["plain", "required", "incomplete"])
def test_responses(oai, kw):
    kw = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 100,
          "temperature": 0, **kw}
    oai.responses.create(**kw)  # (the prompt into the prefix cache)
    whole = oai.responses.create(**kw).model_dump()
    events = list(oai.responses.create(stream=True, **kw))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert _response_view(last.response.model_dump()) == _response_view(whole)
    if "tools" in kw:
        assert [i["type"] for i in whole["output"]] == ["function_call"]


# -- Anthropic's Messages API -----------------------------------------------------------------

def _message_view(m) -> dict:
    blocks = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]
    return {"content": blocks, "stop_reason": m.stop_reason, "stop_sequence": m.stop_sequence,
            "usage": m.usage.model_dump(exclude_none=True)}


@pytest.mark.parametrize("kw", [
    {},
    {"stop_sequences": ["e"]},
    {"tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
     "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
], ids=["plain", "stop-sequence", "tool-any"])
def test_messages(srv, kw):
    c = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 100, "messages": ASK, **kw}
    c.messages.create(**kw)  # (the prompt into the prefix cache)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        folded = s.get_final_message()
    assert _message_view(folded) == _message_view(whole)
    if "tools" in kw:
        assert whole.stop_reason == "tool_use" and json.dumps(whole.content[-1].input)
