"""Tool-call parsing: whole outputs, and streamed outputs split every which way must add up to the same."""

import json
import random
import re

import pytest

from tinyserve.api.tools.parsers import (
    PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolStreamParser,
    new_call_id,
    parse_tool_calls,
)

W = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
WC = ("get_weather", {"city": "Paris", "unit": "celsius"})  # the call W makes
BRAVE = '<|python_tag|>brave_search.call(query="x")'  # Llama's built-in tool syntax: not JSON
PLAIN = "Plain a < b, <tool and <tool_call_x> text <"
F = frozenset({"get_weather", "f", "g"})

# (parser, model output, tool_names, expected content, expected [(name, arguments)])
SAMPLES = [
    # -- llama3_json
    ("llama3_json", "<|python_tag|>" + W, None, None, [WC]),
    ("llama3_json", "  \n" + W, F, None, [WC]),
    (
        "llama3_json",  # braces and `;` inside strings; both argument keys; trailing `;`
        '{"name": "f", "arguments": {"x": [1, {"y": "};{"}]}} ;\n {"name": "g", "parameters": {}};',
        None,
        None,
        [("f", {"x": [1, {"y": "};{"}]}), ("g", {})],
    ),
    (
        "llama3_json",
        '{"type": "function", "name": "f", "parameters": {"s": "naïve ✓"}}',
        F,
        None,
        [("f", {"s": "naïve ✓"})],
    ),
    ("llama3_json", '{"name": "f", "parameters": "{\\"a\\": 1}"}', None, None, [("f", {"a": 1})]),
    ("llama3_json", W + "\nLet me know if you need more.", None, "Let me know if you need more.", [WC]),
    ("llama3_json", "Sure! " + W, None, "Sure! " + W, []),  # does not start with a call
    ("llama3_json", W[:-1], None, W[:-1], []),  # truncated JSON: all content
    ("llama3_json", W + '; {"name": "g", "parameters": ', None, W + '; {"name": "g", "parameters": ', []),
    ("llama3_json", '{"answer": 42, "name": "x"}', None, '{"answer": 42, "name": "x"}', []),
    ("llama3_json", W, frozenset({"other"}), W, []),  # unknown tool: not a call
    ("llama3_json", BRAVE, None, BRAVE, []),
    ("llama3_json", "<|pyth is not the tag", None, "<|pyth is not the tag", []),
    ("llama3_json", "<b>bold</b> and {braces}", None, "<b>bold</b> and {braces}", []),
    ("llama3_json", "   ", None, None, []),
    ("llama3_json", "", None, None, []),
    # -- hermes
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', F, None, [("f", {"a": 1})]),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {"b": [true, null]}}</tool_call>\n\nDone.',
        None,
        "Let me check.\n\n\n\nDone.",
        [("f", {"a": "<tool_call>"}), ("g", {"b": [True, None]})],
    ),
    ("hermes", PLAIN, None, PLAIN, []),
    (
        "hermes",
        'Sure <tool_call>{"name": "f", "arguments": {}}',
        None,
        'Sure <tool_call>{"name": "f", "arguments": {}}',
        [],
    ),  # unterminated
    (
        "hermes",  # malformed block stays content; the valid one after it is a call
        '<tool_call>{bad json}</tool_call> then <tool_call>{"name": "f", "arguments": {"k": "日本"}}'
        "</tool_call>",
        None,
        "<tool_call>{bad json}</tool_call> then",
        [("f", {"k": "日本"})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        F,
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        [],
    ),  # unknown tool
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, '<tool_call>{"name": "f"}</tool_call>', []),
    ("hermes", "  \n ", None, None, []),
    (
        "hermes",
        ' \n Hello\n<tool_call>{"name": "g", "arguments": {}}</tool_call>  ',
        None,
        "Hello",
        [("g", {})],
    ),
]


def _check(result: tuple[str | None, list[ToolCall]], content, calls) -> None:
    got_content, got_calls = result
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("parser,text,names,content,calls", SAMPLES)
def test_parse_whole(parser, text, names, content, calls):
    _check(parse_tool_calls(text, parser, names), content, calls)


def test_arguments_and_ids():
    _, calls = parse_tool_calls('{"name": "f", "parameters": {"s": "é", "n": [1, 2]}}', "llama3_json")
    assert calls[0].arguments == json.dumps({"s": "é", "n": [1, 2]}, ensure_ascii=False)
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "mistral")
    with pytest.raises(ValueError):
        ToolStreamParser("mistral")


# -- streaming ---------------------------------------------------------------------------------


def _chunkings(text: str):
    for size in (1, 2, 3, 5):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(12):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10)))) if text else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _stream(parser, chunks, names=None):
    """Run a stream; return (content pieces, deltas) in the order they were emitted."""
    sp = ToolStreamParser(parser, names)
    pieces: list[str] = []
    deltas: list[ToolCallDelta] = []
    for step in [*(lambda c=c: sp.feed(c) for c in chunks), sp.finish]:
        content, ds = step()
        pieces.append(content)
        deltas += ds
    assert sp.has_calls == bool(deltas)
    return pieces, deltas


def _accumulate(deltas: list[ToolCallDelta]) -> list[dict]:
    calls: list[dict] = []
    for d in deltas:
        if d.index == len(calls):  # a call's first delta carries its id and name, later ones don't
            assert d.id is not None and d.name is not None
            calls.append({"id": d.id, "name": d.name, "arguments": ""})
        else:
            assert d.index == len(calls) - 1 and d.id is None and d.name is None
        calls[d.index]["arguments"] += d.arguments
    return calls


@pytest.mark.parametrize("parser,text,names,content,calls", SAMPLES)
def test_stream_matches_whole(parser, text, names, content, calls):
    for chunks in _chunkings(text):
        pieces, deltas = _stream(parser, chunks, names)
        streamed = "".join(pieces)
        assert (streamed.strip() or None) == (content.strip() if content else None), chunks
        if parser == "hermes":  # hermes content is stripped in the stream too, exactly
            assert streamed == (content or "")
        got = _accumulate(deltas)
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls, chunks
        assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) for c in got)


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "f", "arguments": {"a": "}"}}',
    '{"name": "g", "parameters": {}}',
    "<|python_tag|>",
    "<tool",
    "<",
    "{",
    "}",
    ";",
    " ",
    "\n",
    "text",
    '"x"',
    '{"name": "h"}',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    '<tool_call>\n{"name": "h"}\n</tool_call>',
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize("parser", PARSERS)
def test_stream_matches_whole_fuzz(parser):
    """Random outputs built from the pieces that matter (tags, calls, half-tags, braces, space)."""
    rng = random.Random(parser)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 8)))
        names = rng.choice([None, frozenset({"f", "g"})])
        content, calls = parse_tool_calls(text, parser, names)
        expected = [(c.name, json.loads(c.arguments)) for c in calls]
        for chunks in [list(text), [text[i : i + 4] for i in range(0, len(text), 4)]]:
            pieces, deltas = _stream(parser, chunks, names)
            assert ("".join(pieces).strip() or None) == (content.strip() if content else None), text
            if parser == "hermes":
                assert "".join(pieces) == (content or ""), text
            assert [(c["name"], json.loads(c["arguments"])) for c in _accumulate(deltas)] == expected, text


def test_llama3_holds_calls_and_passes_content():
    sp = ToolStreamParser("llama3_json")
    assert sp.feed(" ") == ("", [])  # could still be leading space before `{`
    assert sp.feed('{"name": "f", ') == ("", [])
    assert sp.feed('"parameters": {}}') == ("", [])  # all-or-nothing: wait for the end
    content, deltas = sp.finish()
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", "{}")]

    sp = ToolStreamParser("llama3_json")
    assert sp.feed("<|py") == ("", [])  # may be the tag
    assert sp.feed("thon_tag|>") == ("", [])
    sp = ToolStreamParser("llama3_json")
    assert sp.feed("<|py") == ("", [])
    assert sp.feed("x") == ("<|pyx", [])  # not the tag after all
    sp = ToolStreamParser("llama3_json")
    assert sp.feed("\nHel") == ("\nHel", [])  # content goes out at once
    assert sp.feed('lo {"name": "f", "parameters": {}}') == ('lo {"name": "f", "parameters": {}}', [])
    assert sp.finish() == ("", []) and not sp.has_calls
    assert sp.finish() == ("", [])
    with pytest.raises(RuntimeError):
        sp.feed("x")


def test_llama3_invalid_json_is_content_at_finish():
    sp = ToolStreamParser("llama3_json")
    assert sp.feed('{"answer": ') == ("", [])
    assert sp.feed("42}") == ("", [])
    assert sp.finish() == ('{"answer": 42}', [])


def test_hermes_emits_calls_when_blocks_close():
    sp = ToolStreamParser("hermes")
    assert sp.feed("Hi <tool") == ("Hi", [])  # " <tool" held: may be a start tag
    assert sp.feed('_call>{"name": "f", "argu') == ("", [])
    content, deltas = sp.feed('ments": {"a": 1}}</tool_')
    assert (content, deltas) == ("", [])
    content, deltas = sp.feed("call> ok")
    assert content == "  ok" and len(deltas) == 1 and sp.has_calls
    assert (deltas[0].index, deltas[0].name, json.loads(deltas[0].arguments)) == (0, "f", {"a": 1})
    assert sp.feed(" <tool_call>{") == ("", [])
    content, deltas = sp.feed('"name": "g", "arguments": {}}</tool_call>')
    assert [(d.index, d.name) for d in deltas] == [(1, "g")]
    assert sp.finish() == ("", [])


def test_openai_stream_state_accumulates_deltas():
    """The deltas, sent as a server would send them, accumulate in the openai client as expected."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    def chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk.model_validate(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    for parser, text, names, content, calls in SAMPLES:
        for chunks in [list(text), [text]]:
            state = ChatCompletionStreamState()
            state.handle_chunk(chunk({"role": "assistant", "content": ""}))
            sp = ToolStreamParser(parser, names)
            for piece, deltas in [*(sp.feed(c) for c in chunks), sp.finish()]:
                if piece:
                    state.handle_chunk(chunk({"content": piece}))
                if deltas:
                    tool_calls = []
                    for d in deltas:
                        entry: dict = {"index": d.index, "function": {"arguments": d.arguments}}
                        if d.id is not None:
                            entry.update(id=d.id, type="function")
                            entry["function"]["name"] = d.name
                        tool_calls.append(entry)
                    state.handle_chunk(chunk({"tool_calls": tool_calls}))
            state.handle_chunk(chunk({}, "tool_calls" if sp.has_calls else "stop"))
            message = state.get_final_completion().choices[0].message
            assert (message.content or "").strip() == (content or "").strip()
            got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in message.tool_calls or []]
            assert got == calls
            assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", tc.id) for tc in message.tool_calls or [])


def test_parsers_listed():
    assert PARSERS == ("llama3_json", "hermes")
