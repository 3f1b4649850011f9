"""Tool-call parsing of model output, whole (parse_tool_calls) and streamed (ToolStreamParser).

Two formats, after vLLM's parsers of the same names:

  llama3_json  Llama 3.1/3.2: the whole output is `[<|python_tag|>]{"name": .., "parameters": {..}}`,
               several objects separated by `;`. Output that does not start (after whitespace) with
               `{` or the tag is plain content, and so is output whose JSON does not parse: a call
               is all-or-nothing, as in vLLM.
  hermes       Hermes/Qwen: `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks anywhere in
               the text; the text outside them is the content. A block that is unterminated,
               malformed or names an unknown tool stays in the content, raw, so nothing is lost.

Pure Python on purpose: the server wires this into the chat endpoint; nothing here knows about
tokens, requests or HTTP.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

import msgspec

PARSERS: tuple[str, ...] = ("llama3_json", "hermes")

_PYTHON_TAG = "<|python_tag|>"
_START, _END = "<tool_call>", "</tool_call>"
# Non-greedy: a block ends at the first end tag after its start tag, as the streaming scan does.
_HERMES_BLOCK = re.compile(re.escape(_START) + "(.*?)" + re.escape(_END), re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits
_WS = " \t\n\r"  # JSON's whitespace: what may sit between llama3_json's objects


class ToolCall(msgspec.Struct, frozen=True):
    id: str  # "call_" + 24 random alphanumerics, OpenAI's shape
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallDelta(msgspec.Struct, frozen=True):
    """One OpenAI streaming `tool_calls[]` entry; a client appends `arguments` per `index`."""

    index: int
    id: str | None = None  # only on the call's first delta
    name: str | None = None  # only on the call's first delta
    arguments: str = ""


def new_call_id() -> str:
    # secrets, not random: ids must not collide across requests even if someone seeds `random`.
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _check_parser(parser: str) -> None:
    if parser not in PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; expected one of {', '.join(PARSERS)}")


def _make_call(obj: Any, tool_names: frozenset[str] | None) -> ToolCall | None:
    """A ToolCall from a decoded `{"name", "arguments"|"parameters"}` object, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    # Llama's own prompt says "parameters", vLLM's templates say "arguments": take either, like
    # vLLM; there is no default, so a JSON answer that merely has a "name" key is not a call.
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", None)
    if isinstance(args, str):  # some models double-encode the arguments object
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def _skip_ws(s: str, pos: int) -> int:
    while pos < len(s) and s[pos] in _WS:
        pos += 1
    return pos


def _parse_llama3(text: str, tool_names: frozenset[str] | None) -> tuple[str | None, list[ToolCall]]:
    plain = (text if text.strip() else None), []
    s = text.lstrip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG) :]
    elif not s.startswith("{"):
        return plain
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            obj, pos = decoder.raw_decode(s, _skip_ws(s, pos))
        except (ValueError, RecursionError):
            return plain  # vLLM: "treat the tool call as regular JSON"
        call = _make_call(obj, tool_names)
        if call is None:  # not a call, or an unknown tool: the output as a whole is not calls
            return plain
        calls.append(call)
        pos = _skip_ws(s, pos)
        if s.startswith(";", pos):
            pos = _skip_ws(s, pos + 1)
        if not s.startswith("{", pos):
            break
    # vLLM drops text after the last object; we keep it as content rather than lose it.
    return (s[pos:].strip() or None), calls


def _parse_hermes(text: str, tool_names: frozenset[str] | None) -> tuple[str | None, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for m in _HERMES_BLOCK.finditer(text):
        content.append(text[pos : m.start()])
        pos = m.end()
        try:
            call = _make_call(json.loads(m.group(1)), tool_names)
        except (ValueError, RecursionError):
            call = None
        if call is None:
            content.append(m.group(0))
        else:
            calls.append(call)
    content.append(text[pos:])  # includes any unterminated block, raw
    return ("".join(content).strip() or None), calls


def parse_tool_calls(
    text: str, parser: str, tool_names: frozenset[str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole model output. A call to a tool not in `tool_names` (when
    given) is not a call: it stays in the content."""
    _check_parser(parser)
    return (_parse_llama3 if parser == "llama3_json" else _parse_hermes)(text, tool_names)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text to hold back,
    since the next delta may complete the tag."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolStreamParser:
    """Splits streamed model output into content and tool-call deltas, one parser per choice.

    Text that may still turn out to be a tool call is held back, so no part of a call is ever sent
    as content; everything else is sent as soon as it is known. Each call goes out whole, as one
    delta, once its JSON is complete (llama3_json: at finish(), since its calls are
    all-or-nothing). The deltas and content add up to what parse_tool_calls gives on the whole text.
    """

    def __init__(self, parser: str, tool_names: frozenset[str] | None = None) -> None:
        _check_parser(parser)
        self._parser = parser
        self._tool_names = tool_names
        self._buf = ""  # received but not yet emitted
        self._index = 0  # next call's index
        self._finished = False
        # llama3_json: "undecided" until the first non-space text says call or content.
        self._mode = "undecided"
        # hermes: inside an open <tool_call> block (the block, start tag included, is in _buf),
        # and how much of _buf has already been searched for the end tag.
        self._in_block = False
        self._scanned = 0
        # hermes content is stripped as parse_tool_calls strips it: whitespace is held until
        # non-space content follows, and leading whitespace is dropped.
        self._ws = ""
        self._sent_content = False

    @property
    def has_calls(self) -> bool:
        return self._index > 0

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content to send now, tool-call deltas to send now) after one more piece of output."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta_text
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of the stream: held text that did not become a call is content."""
        if self._finished:
            return "", []
        self._finished = True
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._parser == "llama3_json":
            return self._step_llama3(final)
        content, deltas = self._step_hermes(final)
        return self._strip(content, final), deltas

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for call in calls:
            out.append(ToolCallDelta(self._index, call.id, call.name, call.arguments))
            self._index += 1
        return out

    def _step_llama3(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._mode = "call"
            elif head and not _PYTHON_TAG.startswith(head):
                self._mode = "content"
        if self._mode == "content" or final:
            # At the end the held text is parsed whole; a failed parse gives it all back as content.
            text, self._buf = self._buf, ""
            if self._mode == "content":
                return text, []
            content, calls = _parse_llama3(text, self._tool_names)
            return content or "", self._deltas(calls)
        return "", []

    def _step_hermes(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._in_block:
                end = self._buf.find(_END, max(len(_START), self._scanned - len(_END) + 1))
                if end < 0:
                    self._scanned = len(self._buf)
                    if final:  # unterminated: the raw block is content
                        content.append(self._buf)
                        self._buf = ""
                    break
                end += len(_END)
                block, self._buf = self._buf[:end], self._buf[end:]
                self._in_block = False
                try:
                    call = _make_call(json.loads(block[len(_START) : -len(_END)]), self._tool_names)
                except (ValueError, RecursionError):
                    call = None
                if call is None:
                    content.append(block)
                else:
                    deltas += self._deltas([call])
            else:
                start = self._buf.find(_START)
                if start < 0:
                    cut = len(self._buf) - (0 if final else _partial_suffix(self._buf, _START))
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_block, self._scanned = True, len(_START)
        return "".join(content), deltas

    def _strip(self, text: str, final: bool) -> str:
        text = self._ws + text
        body = text.rstrip()
        self._ws = "" if final else text[len(body) :]
        if not self._sent_content:
            body = body.lstrip()
        self._sent_content = self._sent_content or bool(body)
        return body
