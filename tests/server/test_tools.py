"""Tool calling with the official openai client against the real server (stories260k): tools
reach the template, tool_choice constrains the output, the output comes back as tool_calls,
whole and streamed, and the conversation goes on with the tool's result."""

import json

import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.helpers import MODEL, chat, post, run

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def streamed(c, **kw):
    """The openai client's own accumulation of a streamed answer."""
    state = ChatCompletionStreamState()
    for chunk in c.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")


def test_a_forced_tool_call_round_trip_whole_and_streamed(server):
    c = client(server)
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0.8, seed=7)
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"  # OpenAI: a forced function just stops
    check_weather_call(msg.tool_calls[0])
    s = streamed(c, **kw).choices[0]
    assert s.finish_reason == "stop"
    assert [(t.function.name, t.function.arguments) for t in s.message.tool_calls] \
        == [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    # The conversation goes on: the call and the tool's answer go back through the template.
    call = msg.tool_calls[0]
    follow = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=[WEATHER],
                                       messages=[*MESSAGES, msg.model_dump(exclude_none=True),
                                                 {"role": "tool", "tool_call_id": call.id,
                                                  "content": '{"temp": 21}'}])
    assert follow.choices[0].message.content is not None


def test_required_makes_a_call_of_one_of_the_tools(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[TIME], tool_choice="required", max_tokens=60,
        temperature=0.8, seed=1, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")


def test_auto_parses_the_models_own_calls(server):
    # The tiny model never calls a tool by itself: a guided schema makes it write a Llama 3
    # JSON call, which tool_choice "auto" (the llama3_json parser) turns into tool_calls.
    call_schema = {"type": "object", "properties": {
        "name": {"const": "get_time"}, "parameters": TIME["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}
    c = client(server)
    kw = dict(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], max_tokens=48,
              temperature=0.8, seed=3, extra_body={"guided_json": call_schema})
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    # (streamed auto parsing: tests/api/test_tool_parsers.py, every chunking, openai's accumulator)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tools_are_a_400(server, body, param):
    status, out, _ = run(post(server.url, "/v1/chat/completions", {**chat("Hi"), **body}))
    assert status == 400 and out["error"]["param"] == param, out
