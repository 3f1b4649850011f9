"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) with the official
``anthropic`` client: the real server (stories260k, greedy) for what the model writes, the
in-process server (fake model) for keys, quotas, faults and fuzzing, and the shaper and the
translation on their own for what the tiny model cannot be made to write.

The SDK no longer takes temperature as an argument: it goes in ``extra_body``, as the API
still defines it."""

import asyncio
import collections
import json
import random
import string
import time

import aiohttp
import anthropic
import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import MODEL, post, run
from tests.server.inprocess import FakeRunner, InProcessServer
from tinyserve.api.anthropic.request import chat_request, decode
from tinyserve.api.anthropic.shaper import MessagesShaper
from tinyserve.api.anthropic.types import CountTokensRequest, MessagesRequest
from tinyserve.api.errors import ApiError
from tinyserve.api.shaper import whole
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.config import TenantConfig
from tinyserve.messages import Output

GREEDY = {"temperature": 0}
HI = [{"role": "user", "content": "Once upon a time"}]
UNIT = {"name": "get_unit", "description": "The unit to use",
        "input_schema": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                         "required": ["unit"], "additionalProperties": False}}
KEY, METERED = "sekret", "metered-key"
EVENT_NAMES = {"message_start", "content_block_start", "ping", "content_block_delta",
               "content_block_stop", "message_delta", "message_stop"}


def client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def content(m) -> list[dict]:
    """A message's blocks as JSON (a streamed message's are the SDK's Parsed* kinds)."""
    return [b.model_dump(exclude_none=True) for b in m.content]


def prompt_tokens(usage) -> int:
    """The whole prompt: Anthropic reports the part read from the cache apart."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


async def sse(url: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed answer; checks nothing else is sent."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/messages", json={**body, "stream": True},
                          headers=headers) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            text = await r.text()
    events = []
    for chunk in text.split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert text.endswith("\n\n") and "[DONE]" not in text
    return events


def check_sequence(events: list[tuple[str, dict]]) -> None:
    """Anthropic's grammar of a stream: message_start, blocks (start, a ping after the
    first, deltas, stop, indices 0, 1, ...), message_delta, message_stop."""
    names = [n for n, _ in events]
    assert all(data["type"] == name for name, data in events), events
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_block, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == next_index
            open_block, next_index = data["index"], next_index + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_block, (name, data)
            open_block = None if name == "content_block_stop" else open_block
        else:
            assert name == "ping", name
    assert open_block is None
    if "content_block_start" in names:
        assert names[names.index("content_block_start") + 1] == "ping"
    assert names.count("ping") <= 1


# -- the real model ---------------------------------------------------------------------------

def test_a_message_whole_and_streamed_are_the_same(server):
    c = client(server.url)
    kw = dict(model=MODEL, max_tokens=12, messages=HI, system="You tell stories.",
              extra_body=GREEDY)
    whole = c.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and whole.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text.strip()
    assert whole.usage.output_tokens == 12 and whole.stop_sequence is None
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert content(final) == content(whole) and final.stop_reason == whole.stop_reason
    # The same prompt, the same output; the second call may read part of it from the cache.
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_round_trip_whole_and_streamed(server):
    c = client(server.url)
    kw = dict(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Units?"}],
              tools=[UNIT], tool_choice={"type": "tool", "name": "get_unit"},
              extra_body=GREEDY)
    m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use", m  # Anthropic says tool_use for a forced tool too
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_unit" and call.id.startswith("toolu_")
    assert call.input in ({"unit": "c"}, {"unit": "f"})
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(call.name, call.input)]
    # The call and its result go back through the template; the model answers in text.
    answer = c.messages.create(
        model=MODEL, max_tokens=4, tools=[UNIT], extra_body=GREEDY,
        messages=[*kw["messages"], m.to_param(), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "Celsius"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_tool_choice_any_makes_one_call_by_grammar(server):
    m = client(server.url).messages.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Units?"}],
        tools=[UNIT], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_unit"
    assert call.input in ({"unit": "c"}, {"unit": "f"})


def test_auto_parses_the_models_own_call_from_the_stream(server):
    # The tiny model never calls a tool by itself: output_config.format (a grammar) makes it
    # write a Llama 3 JSON call, which tool_choice auto's parser turns into a tool_use block.
    call = {"type": "object", "properties": {"name": {"const": "get_unit"},
                                             "parameters": UNIT["input_schema"]},
            "required": ["name", "parameters"], "additionalProperties": False}
    with client(server.url).messages.stream(
            model=MODEL, max_tokens=48, messages=[{"role": "user", "content": "Units?"}],
            tools=[UNIT], output_config={"format": {"type": "json_schema", "schema": call}},
            extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use", final
    (block,) = final.content
    assert block.type == "tool_use" and block.input in ({"unit": "c"}, {"unit": "f"})


def test_stop_sequences_end_the_message_without_their_text(server):
    c = client(server.url)
    kw = dict(model=MODEL, messages=HI, extra_body=GREEDY)
    text = c.messages.create(max_tokens=8, **kw).content[0].text
    stop = text[4:6]  # certain to come: greedy writes the same text again
    before = text[:text.index(stop)]
    m = c.messages.create(max_tokens=8, stop_sequences=["zzqx", stop], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in m.content) == before
    with c.messages.stream(max_tokens=8, stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert content(final) == content(m)


def test_count_tokens_is_the_prompt_a_message_runs(server):
    c = client(server.url)
    messages = [*HI, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me see."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_unit", "input": {"unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "It is cold."}]}]
    kw = dict(model=MODEL, messages=messages, system=[{"type": "text", "text": "Be brief."}],
              tools=[UNIT])
    counted = c.messages.count_tokens(**kw).input_tokens
    used = c.messages.create(max_tokens=1, extra_body=GREEDY, **kw).usage
    assert counted == prompt_tokens(used)
    # system and the tool's result are in it (this model's template does not show tools)
    assert c.messages.count_tokens(**{**kw, "system": ""}).input_tokens < counted
    assert c.messages.count_tokens(model=MODEL, messages=messages[:1]).input_tokens < counted
    # the same ids /tokenize gives for the chat messages they translate to
    status, tok, _ = run(post(server.url, "/tokenize", {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, HI[0],
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_unit", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "It is cold."}]}))
    assert status == 200 and tok["count"] == counted


@pytest.mark.parametrize("kw, needle", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "'image'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [*HI, {"role": "assistant", "content": "The"}]}, "prefill"),
])
def test_refusals_are_bad_request_errors_naming_what(server, kw, needle):
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 4, "messages": HI, **kw}.items()
            if v is not None}  # (the SDK's create cannot leave max_tokens out: post it)
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server.url).post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"], e.value.body


# -- keys, quotas, faults (fake model) --------------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    server = InProcessServer(max_model_len=128, tenants=(
        TenantConfig("open", KEY), TenantConfig("metered", METERED, tokens_per_minute=100)))
    yield server
    server.stop()


def test_the_stream_is_anthropics_event_sequence_and_x_api_key_works(srv):
    body = {"model": MODEL, "max_tokens": 5, "messages": HI}
    events = run(sse(srv.url, body, {"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                     "anthropic-beta": "whatever-2099-01-01"}))
    check_sequence(events)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith(
        "msg_")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    # The same stream, folded by the SDK's own accumulator, is the whole answer's message.
    snapshot, bufs = None, {}
    for _, data in events:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    status, whole, _ = run(post(srv.url, "/v1/messages", body, {"x-api-key": KEY}))
    assert status == 200 and whole["content"] == content(snapshot)
    status, got, _ = run(post(srv.url, "/v1/messages", body, {"x-api-key": "wrong"}))
    assert status == 401 and got == {"type": "error", "error": {
        "type": "authentication_error", "message": got["error"]["message"]}}


def test_a_body_that_is_not_json_gets_415_in_anthropics_envelope(srv):
    async def main(path: str) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(srv.url + path, data=json.dumps(
                {"model": MODEL, "max_tokens": 2, "messages": HI}),
                headers={"Content-Type": "text/plain", "x-api-key": KEY}) as r:
            return r.status, await r.json()

    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, body = asyncio.run(main(path))
        assert status == 415 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and "Content-Type" in body[
            "error"]["message"]


def test_status_errors_are_the_sdks_exception_classes(srv):
    with pytest.raises(anthropic.AuthenticationError):
        client(srv.url, "wrong").messages.create(model=MODEL, max_tokens=2, messages=HI)
    with pytest.raises(anthropic.NotFoundError) as e:
        client(srv.url, KEY).messages.create(model="claude-nope", max_tokens=2, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client(srv.url, KEY).messages.count_tokens(model="claude-nope", messages=HI)
    # metered: 100 tokens a minute; the first message takes 60, the second cannot fit now
    c = client(srv.url, METERED)
    n = c.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert c.messages.create(model=MODEL, max_tokens=60 - n, messages=HI).usage.output_tokens
    with pytest.raises(anthropic.RateLimitError) as e:
        c.messages.create(model=MODEL, max_tokens=60 - n, messages=HI)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert int(e.value.response.headers["Retry-After"]) >= 1


def test_a_fault_mid_stream_is_an_error_event_then_529_overloaded():
    srv = InProcessServer(FakeRunner(step_seconds=0.05), max_failed_steps=1,
                          tenants=(TenantConfig("open", KEY),))
    try:
        c = client(srv.url, KEY)
        got = []
        with pytest.raises(anthropic.APIStatusError) as e:
            with c.messages.stream(model=MODEL, max_tokens=60, messages=HI) as s:
                for event in s:
                    got.append(event.type)
                    if event.type == "content_block_delta":
                        srv.runner.fail_next = 100  # the steps from now on fail
        assert got[:2] == ["message_start", "content_block_start"] and "message_stop" not in got
        # (the failed step's 500, or the 503 of a server that just turned unhealthy)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] in ("api_error", "overloaded_error")
        deadline = time.monotonic() + 5  # the supervisor notices, then the server sheds load
        while True:
            try:
                c.messages.create(model=MODEL, max_tokens=2, messages=HI)
            except anthropic.OverloadedError as over:
                assert over.status_code == 529
                assert over.body["error"]["type"] == "overloaded_error"
                break
            except anthropic.InternalServerError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        srv.stop()


# -- fuzz -------------------------------------------------------------------------------------

def _json_of(floats: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                  max_size=3),
        max_leaves=6)


# json.dumps writes inf and nan as Infinity / NaN, which are not JSON: only a mutated body
# may hold them (a valid one must decode)
_json = _json_of(st.floats())
_json_valid = _json_of(st.floats(allow_nan=False, allow_infinity=False))
_short = st.text(alphabet=string.ascii_letters + " .", max_size=6)
_text_block = st.builds(lambda t: {"type": "text", "text": t}, _short)
_tool_use = st.builds(lambda i, u: {"type": "tool_use", "id": i, "name": "get_unit",
                                    "input": {"unit": u}}, st.text(min_size=1, max_size=6),
                      st.sampled_from(["c", "f"]))
_tool_result = st.builds(lambda i, c, err: {"type": "tool_result", "tool_use_id": i,
                                            "content": c, "is_error": err},
                         st.text(min_size=1, max_size=6),
                         _short | st.lists(_text_block, max_size=2), st.booleans())
_user = st.builds(lambda c: {"role": "user", "content": c},
                  _short | st.lists(_text_block | _tool_result, min_size=1, max_size=2))
_assistant = st.builds(lambda c: {"role": "assistant", "content": c},
                       _short | st.lists(_text_block | _tool_use, min_size=1, max_size=2))
_options = st.fixed_dictionaries({}, optional={
    "system": _short | st.lists(_text_block, max_size=2),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "temperature": st.floats(0, 1), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
    "stream": st.booleans(), "metadata": st.just({"user_id": "u-1"}),
    "tools": st.just([UNIT]), "tool_choice": st.sampled_from([
        {"type": "auto"}, {"type": "none"}, {"type": "auto", "disable_parallel_tool_use": True}]),
    "service_tier": st.sampled_from(["auto", "standard_only"]),
    "thinking": st.just({"type": "disabled"}),
    "anything_undefined": _json_valid})


@st.composite
def _valid(draw) -> dict:
    turns = [draw(_user)]
    for _ in range(draw(st.integers(0, 1))):
        turns += [draw(_assistant), draw(_user)]
    return {"model": MODEL, "max_tokens": draw(st.integers(1, 12)), "messages": turns,
            **draw(_options)}


_FIELDS = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
           "top_p", "top_k", "stream", "tools", "tool_choice", "metadata", "thinking",
           "output_config", "container", "mcp_servers", "speed"]
_odd_blocks = st.sampled_from([
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    {"type": "document", "source": {"type": "text", "data": "x"}}, {"type": "text"},
    {"type": "tool_use", "id": 1, "name": "x", "input": []}, {"text": "no type"},
    {"type": "tool_result", "content": [{"type": "image"}]}, {"type": "thinking"},
    {"type": "server_tool_use", "id": "x", "name": "web_search", "input": {}}, "bare"])


@st.composite
def _mutated(draw) -> dict:
    body = draw(_valid())
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["set", "set", "drop", "block", "role", "deep", "model",
                                     "tools"]))
        if kind == "set":
            body[draw(st.sampled_from(_FIELDS))] = draw(_json)
        elif kind == "model":
            body["model"] = draw(st.text(max_size=12).filter(lambda m: m != MODEL))
        elif kind == "tools":  # a server tool, a forced call (no grammar on the fake model)
            body.update(draw(st.sampled_from([
                {"tools": [{"type": "bash_20250124", "name": "bash"}]},
                {"tools": [UNIT], "tool_choice": {"type": "any"}},
                {"tools": [UNIT, UNIT]}, {"tools": [{**UNIT, "input_schema": None}]}])))
        elif kind == "drop":
            body.pop(draw(st.sampled_from(["model", "max_tokens", "messages"])), None)
        elif kind == "block" and isinstance(body.get("messages"), list):
            role = draw(st.sampled_from(["user", "assistant"]))
            body["messages"].insert(0, {"role": role, "content": [draw(_odd_blocks)]})
        elif kind == "role" and isinstance(body.get("messages"), list):
            body["messages"].insert(0, {"role": draw(st.text(max_size=9)), "content": "x"})
        else:
            body[draw(st.sampled_from(_FIELDS))] = json.loads("[" * 60 + "]" * 60)
    return body


def _check_answer(path: str, body: dict, status: int, ctype: str, data: bytes) -> None:
    assert status < 500, (status, data[:300])
    if status != 200:
        err = json.loads(data)
        assert ctype.startswith("application/json") and set(err) == {"type", "error"}, err
        assert err["type"] == "error" and err["error"]["message"], err
        assert err["error"]["type"] in ("invalid_request_error", "not_found_error",
                                        "request_too_large"), err
        return
    if path.endswith("count_tokens"):
        assert json.loads(data)["input_tokens"] > 0
        return
    if body.get("stream") is True:
        events = [(n[len("event: "):], json.loads(d[len("data: "):])) for n, d in (
            chunk.split("\n") for chunk in data.decode().split("\n\n")[:-1])]
        check_sequence(events)
        return
    m = json.loads(data)
    assert m["type"] == "message" and m["stop_reason"] in (
        "end_turn", "max_tokens", "stop_sequence", "tool_use"), m
    assert all(b["type"] in ("text", "tool_use") for b in m["content"]), m
    assert 1 <= m["usage"]["output_tokens"] <= body["max_tokens"], m


def test_fuzz_both_endpoints_never_5xx_and_leave_nothing_running(srv):
    statuses = collections.Counter()

    async def send(path: str, raw: bytes) -> tuple[int, str, bytes]:
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + path, data=raw, headers={
                    "x-api-key": KEY, "Content-Type": "application/json"}) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.read()

    # (over HTTP: the answers and the server unharmed; bodies alone, 1,500 of them, are fuzzed
    # in-process by tests/api/test_translation_fuzz.py)
    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(valid=st.booleans(), data=st.data(), count=st.booleans(), garble=st.integers(0, 9))
    def one(valid, data, count, garble):
        body = data.draw(_valid() if valid else _mutated())
        path = "/v1/messages/count_tokens" if count else "/v1/messages"
        raw = json.dumps(body).encode()
        if garble == 0:  # not JSON, or not an object
            valid, raw = False, random.Random(len(raw)).choice(
                [raw[: len(raw) // 2], b"[1]", b"\xff{"])
        status, ctype, answer = asyncio.run(send(path, raw))
        statuses[status] += 1
        _check_answer(path, body, status, ctype, answer)
        if valid and status != 200:  # only a context the prompt outgrew may refuse it
            assert "context length" in json.loads(answer)["error"]["message"], answer

    one()
    print(f"\nanthropic fuzz: {statuses.total()} requests, by status {dict(statuses)}")
    assert statuses[200] >= 30 and statuses[400] >= 30 and statuses[404] >= 2, statuses
    # still answering, and nothing left behind
    m = client(srv.url, KEY).messages.create(model=MODEL, max_tokens=3, messages=HI)
    assert m.usage.output_tokens == 3
    assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "requests": 0,
                               "live": 0}


# -- the translation and the shaper on their own ----------------------------------------------

def test_a_conversation_translates_to_the_chat_it_means():
    req = decode(json.dumps({
        "model": MODEL, "max_tokens": 9, "stop_sequences": ["END"], "top_k": 5,
        "metadata": {"user_id": "u7"}, "system": [{"type": "text", "text": "A"},
                                                   {"type": "text", "text": "B"}],
        "tools": [UNIT], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_9", "name": "get_unit", "input": {"unit": "c"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "cold",
                 "is_error": True},
                {"type": "text", "text": "and"}, {"type": "text", "text": " now?"}]}]}).encode(),
        MessagesRequest)
    chat, one_call = chat_request(req)
    got = [(m.role, m.text(), m.tool_call_id) for m in chat.messages]
    assert got == [("system", "AB", None), ("user", "hi", None),
                   ("assistant", "Let me check.", None), ("tool", "Error: cold", "toolu_9"),
                   ("user", "and now?", None)]
    assert chat.messages[2].tool_calls == [{"id": "toolu_9", "type": "function", "function": {
        "name": "get_unit", "arguments": '{"unit":"c"}'}}]
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_unit", "parameters": UNIT["input_schema"],
        "description": "The unit to use"}}]
    assert (chat.tool_choice, chat.parallel_tool_calls, one_call) == ("required", False, True)
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.user, chat.temperature, chat.n) == (
        9, ["END"], 5, "u7", 1.0, 1)  # Anthropic's default temperature is 1


@pytest.mark.parametrize("extra, needle", [
    ({"container": "c-1"}, "container"), ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"speed": "fast"}, "speed"), ({"output_config": {"effort": "low"}}, "effort"),
    ({"tools": [{**UNIT, "strict": True}]}, "strict"),
    ({"tools": [{**UNIT, "name": "has space"}]}, "name"),
    ({"tools": [{**UNIT, "input_schema": {"type": "array"}}]}, "input_schema"),
    ({"tools": [UNIT], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"stop_sequences": [""]}, "stop_sequences"), ({"top_k": -1}, "top_k"),
    ({"messages": []}, "at least one"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": []}]}, "empty"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}]}]}, "content"),
    ({"system": [{"type": "image", "source": {}}]}, "system[0]"),
])
def test_what_cannot_be_honoured_is_refused_by_name(extra, needle):
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": HI, **extra}).encode()
    sampling = {"stop_sequences", "top_k"} & set(extra)  # (not a count's: it ignores them)
    for kind in (MessagesRequest,) if sampling else (MessagesRequest, CountTokensRequest):
        with pytest.raises(ApiError) as e:
            chat_request(decode(body, kind))
        assert e.value.status == 400 and needle in e.value.message, e.value.message


def test_neutral_values_of_defined_fields_are_accepted():
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "service_tier": "standard_only",
            "container": None, "mcp_servers": [], "speed": "standard", "cache_control": {
                "type": "ephemeral"}, "thinking": {"type": "disabled"},
            "output_config": {"effort": "high"}, "some_future_field": {"x": 1}}
    chat, _ = chat_request(decode(json.dumps(body).encode(), MessagesRequest))
    assert chat.response_format is None and chat.messages[0].text() == HI[0]["content"]


def _outs(*texts: str, reason: str = "stop", stop: str | None = None) -> list[Output]:
    n = len(texts)
    return [Output(t, (), 1, reason if i == n - 1 else None, prompt_tokens=20,
                   completion_tokens=i + 1, cached_tokens=16,
                   stop_reason=stop if i == n - 1 else None) for i, t in enumerate(texts)]


def _events_and_body(outs: list[Output], plan: ToolPlan | None = None, one_call=False):
    streamed = MessagesShaper(MODEL, plan, one_call)
    events = [e for o in outs for e in streamed.chunks(o)]
    body = msgspec.to_builtins(whole(MessagesShaper(MODEL, plan, one_call),
                                     [(0, o) for o in outs]))
    snapshot, bufs = None, {}  # the SDK's own fold of the stream
    for _, payload in events:
        snapshot = accumulate_event(event=msgspec.to_builtins(payload),
                                    current_snapshot=snapshot, json_bufs=bufs)
    def same(message: dict) -> dict:  # (each shaper names its own ids)
        blocks = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
        return {**{k: v for k, v in message.items() if k != "id" and v is not None},
                "content": blocks}

    assert same(snapshot.model_dump(include=set(body), exclude_none=True)) == same(body)
    check_sequence([(n, msgspec.to_builtins(p)) for n, p in events])
    return [n for n, _ in events], body


def test_hermes_calls_after_text_become_blocks_and_one_call_keeps_the_first():
    plan = ToolPlan([UNIT], frozenset({"get_unit", "other"}), "auto", "hermes")
    texts = ["Let me ", "check. <tool_call>", '{"name": "get_unit", "arguments": {"unit": ',
             '"f"}}</tool_call>', '<tool_call>{"name": "other", "arguments": {}}</tool_call>']
    names, body = _events_and_body(_outs(*texts), plan)
    assert [(b["type"], b.get("text"), b.get("input")) for b in body["content"]] == [
        ("text", "Let me check.", None), ("tool_use", None, {"unit": "f"}),
        ("tool_use", None, {})]
    assert body["content"][1]["id"].startswith("toolu_") and body["stop_reason"] == "tool_use"
    assert names.count("content_block_start") == 3
    _, body = _events_and_body(_outs(*texts), plan, one_call=True)
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]
    assert body["content"][1]["name"] == "get_unit"


@pytest.mark.parametrize("outs, reason, sequence", [
    (_outs("a", "b", reason="length"), "max_tokens", None),
    (_outs("a", "b", stop="STOP"), "stop_sequence", "STOP"),
    (_outs("a", ""), "end_turn", None),
    (_outs(""), "end_turn", None),  # nothing written: no block at all
])
def test_stop_reasons_and_usage(outs, reason, sequence):
    names, body = _events_and_body(outs)
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
    assert body["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 16,
                             "cache_creation_input_tokens": 0,
                             "output_tokens": outs[-1].completion_tokens}
    text = "".join(o.text for o in outs)
    assert body["content"] == ([{"type": "text", "text": text}] if text else [])
    assert ("ping" in names) == bool(text)


def test_a_forced_call_cut_short_streams_what_was_written():
    plan = ToolPlan([UNIT], frozenset({"get_unit"}), "named", "llama3_json", named="get_unit")
    names, body = _events_and_body(_outs('{"unit"', ': "c"}'), plan)
    assert body["content"][0]["input"] == {"unit": "c"} and body["stop_reason"] == "tool_use"
    assert names.count("content_block_delta") == 2  # the arguments as they came
    streamed = MessagesShaper(MODEL, plan, False)
    events = [e for o in _outs('{"unit"', reason="length") for e in streamed.chunks(o)]
    assert [p.delta.partial_json for n, p in events if n == "content_block_delta"] == ['{"unit"']
    body = msgspec.to_builtins(whole(MessagesShaper(MODEL, plan, False),
                                     [(0, o) for o in _outs('{"unit"', reason="length")]))
    assert body["content"][0]["input"] == {} and body["stop_reason"] == "max_tokens"

