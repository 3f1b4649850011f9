"""api/tools (plan.py, output.py) without a server: tool_choice -> constraint, output ->
tool_calls (each mode)."""

import json

import pytest

from tinyserve.api.errors import ApiError
from tinyserve.api.tools.output import ToolOutput
from tinyserve.api.tools.plan import plan

F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}


def test_modes_and_their_constraints():
    assert plan(None, None, "llama3_json") is None and plan([], "auto", "hermes") is None
    auto = plan([F, G], None, "llama3_json")
    assert auto.mode == "auto" and auto.tools == [F, G] and auto.guided is None
    none = plan([F], "none", "llama3_json")
    assert none.mode == "none" and none.tools is None  # not shown to the model
    req = plan([F, G], "required", "hermes", parallel=False)
    schema = json.loads(req.guided.value)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan([F, G], {"type": "function", "function": {"name": "f"}}, "hermes")
    assert named.named == "f" and json.loads(named.guided.value) == F["function"]["parameters"]


@pytest.mark.parametrize("tools, choice", [
    ([{"type": "function"}], None), ([F, F], None), ("f", None), ([F], "sometimes"),
    (None, "required"), ([F], {"type": "function", "function": {"name": "zz"}})])
def test_bad_tools_name_the_field(tools, choice):
    with pytest.raises(ApiError) as e:
        plan(tools, choice, "llama3_json")
    assert e.value.status == 400 and e.value.param in ("tools", "tool_choice")


def test_outputs_per_mode_whole_and_streamed():
    text = '{"name": "f", "parameters": {"x": 3}}'
    out = ToolOutput(plan([F], "auto", "llama3_json"))
    content, calls = out.whole(text)
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 3}
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    out = ToolOutput(plan([F], "none", "llama3_json"))
    assert out.whole(text) == (text, []) and out.finish_reason("stop") == "stop"
    # named: the output is the arguments, streamed as they come
    out = ToolOutput(plan([F], {"type": "function", "function": {"name": "f"}}, "hermes"))
    pieces = [out.feed('{"x"'), out.feed(": 3}"), out.finish()]
    deltas = [d for _, ds in pieces for d in ds]
    assert deltas[0].id and deltas[0].name == "f"
    assert "".join(d.arguments for d in deltas) == '{"x": 3}'
    assert out.finish_reason("stop") == "stop"  # OpenAI: a forced function ends with "stop"
    # required: the JSON list, parsed at the end; cut short, it stays content
    out = ToolOutput(plan([F, G], "required", "hermes"))
    assert out.feed('[{"name": "g", "parameters": {}}, ') == ("", [])
    content, deltas = out.finish()
    assert content == '[{"name": "g", "parameters": {}}, ' and deltas == []
    out = ToolOutput(plan([F, G], "required", "hermes"))
    out.feed('[{"name": "g", "parameters": {}}]')
    content, deltas = out.finish()
    assert content == "" and [d.name for d in deltas] == ["g"]
    assert out.finish_reason("stop") == "tool_calls"
