"""OpenAI's Responses API through the official client: whole and streamed (the SDK's stream
helper), function tools round trips by resent items and by previous_response_id, text.format,
the store (per tenant, bounded, LRU), refusals by name, and a fuzz of hostile bodies.

The model tests run on stories260k (greedy); the store, tenant and fuzz tests on the in-process
server's fake model (fast, and its output never ends on its own).
"""

import json

import jsonschema
import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import metric_value
from tests.server.helpers import MODEL
from tests.server.inprocess import InProcessServer
from tinyserve.api.responses.store import ResponseStore

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def raw_events(url: str, body: dict, key: str = "unused") -> list[tuple[str, dict]]:
    """(event name, data) of a streamed response, from the wire."""
    r = requests.post(url + "/v1/responses", json={**body, "stream": True}, stream=True,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    events, name = [], None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
            name = None
    return events


# -- on stories260k -------------------------------------------------------------------------

def test_whole_and_streamed_responses_agree(server):
    c = client(server.url)
    kw = dict(model=MODEL, input="Yes or no?", max_output_tokens=40, temperature=0, text=FORMAT)
    whole = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert whole.status == final.status == "completed"
    assert whole.output_text == final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    for r in (whole, final):
        assert [i.type for i in r.output] == ["message"]
        assert r.output[0].content[0].type == "output_text"
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert isinstance(r.usage.input_tokens_details.cached_tokens, int)
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        final.usage.input_tokens, final.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt, again


def test_the_event_sequence_and_an_incomplete_response(server):
    events = raw_events(server.url, {"model": MODEL, "input": "Once upon a time",
                                     "max_output_tokens": 5, "temperature": 0})
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = names.count("response.output_text.delta")
    assert deltas >= 1 and names == (
        ["response.created", "response.in_progress", "response.output_item.added",
         "response.content_part.added"] + ["response.output_text.delta"] * deltas
        + ["response.output_text.done", "response.content_part.done",
           "response.output_item.done", "response.incomplete"])
    last = events[-1][1]["response"]
    assert last["status"] == "incomplete"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == 5
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert last["output"][0]["content"][0]["text"] == text
    whole = client(server.url).responses.create(model=MODEL, input="Once upon a time",
                                                 max_output_tokens=5, temperature=0)
    assert whole.status == "incomplete" and whole.output_text == text


def test_a_function_tool_round_trip_by_items_and_by_previous_response_id(server):
    c = client(server.url)
    first = c.responses.create(model=MODEL, input="What is the weather in Paris?",
                               tools=[WEATHER], max_output_tokens=40, temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    resent = c.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}, result])
    chained = c.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=6,
                                 temperature=0, previous_response_id=first.id, input=[result])
    assert chained.previous_response_id == first.id
    # the same conversation, rendered through the same template: the same prompt and answer
    assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == resent.output_text


def test_a_required_call_streams_as_function_call_events(server):
    c = client(server.url)
    kw = dict(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    whole = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    for r in (whole, final):
        assert [i.type for i in r.output] == ["function_call"]
        jsonschema.validate(json.loads(r.output[0].arguments), WEATHER["parameters"])
    assert final.output[0].arguments == whole.output[0].arguments


def test_instructions_do_not_carry_over(server):
    c = client(server.url)
    first = c.responses.create(model=MODEL, input="Hi", instructions="Be brief. " * 20,
                               max_output_tokens=2, temperature=0)
    plain = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    assert first.usage.input_tokens > plain.usage.input_tokens
    follow = c.responses.create(model=MODEL, input="More", previous_response_id=first.id,
                                max_output_tokens=2, temperature=0)
    again = c.responses.create(model=MODEL, input="More", previous_response_id=plain.id,
                               max_output_tokens=2, temperature=0)
    assert follow.instructions is None
    assert follow.usage.input_tokens == again.usage.input_tokens  # first's instructions gone


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": 5}, "input"),
    ({"model": None}, "model"),
    ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_what_is_not_honoured_is_refused_by_name(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server.url).responses.create(**{"model": MODEL, "input": "Hi", **body})
    assert e.value.body["param"] == param, e.value.body


def test_unknown_ids_are_404(server):
    c = client(server.url)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        c.responses.delete("resp_nope")
    assert server.metric("tinyserve:api_requests_total",
                         '{endpoint="/v1/responses/{response_id}",code="404"}') >= 2


# -- the store, tenants, hostile bodies (in-process, fake model) ---------------------------

TENANTS_FILE = '[tenants.a]\napi_key = "ka"\n[tenants.b]\napi_key = "kb"\n'


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    from tinyserve.cli.tenants import load_tenants

    path = tmp_path_factory.mktemp("resp") / "tenants.toml"
    path.write_text(TENANTS_FILE)
    srv = InProcessServer(tenants=load_tenants(str(path)), responses_store_max=3)
    yield srv
    srv.stop()


def make(c: openai.OpenAI, **kw) -> openai.types.responses.Response:
    return c.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kw})


def test_one_tenant_never_sees_anothers_responses(fake):
    a, b = client(fake.url, "ka"), client(fake.url, "kb")
    mine = make(a)
    assert a.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        make(b, previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    assert a.responses.retrieve(mine.id).id == mine.id  # b's tries changed nothing
    a.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(mine.id)


def test_the_store_drops_the_least_recently_used(fake):
    a, b = client(fake.url, "ka"), client(fake.url, "kb")
    kept_b = make(b)
    r1, r2, r3 = make(a), make(a), make(a)
    a.responses.retrieve(r1.id)  # used: r2 is now the oldest
    r4 = make(a)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r2.id)
    for r in (r1, r3, r4):
        assert a.responses.retrieve(r.id).id == r.id
    assert b.responses.retrieve(kept_b.id).id == kept_b.id  # a's bound is a's own
    unstored = make(a, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def test_the_store_bounds_bytes():
    store = ResponseStore(max_count=100, max_bytes=3000)
    msgs = [{"role": "user", "content": "x" * 500}]
    for i in range(8):
        assert store.put("t", {"id": f"r{i}"}, msgs)
    assert 0 < store.count("t") < 8 and store.get("t", "r7") is not None
    assert store.get("t", "r0") is None and store.evicted == 8 - store.count("t")
    assert not store.put("t", {"id": "big"}, [{"role": "user", "content": "x" * 4000}])
    assert store.get("other", "r7") is None


def test_a_chain_of_stored_turns_grows_the_prompt(fake):
    a = client(fake.url, "ka")
    prev, lengths = None, []
    for _ in range(3):
        r = make(a, previous_response_id=prev) if prev else make(a)
        lengths.append(r.usage.input_tokens)
        prev = r.id
    assert lengths[0] < lengths[1] < lengths[2]


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
           "tool_choice", "parallel_tool_calls", "text", "metadata", "stream", "store",
           "previous_response_id", "user", "background", "reasoning", "truncation"]
_ITEMS = st.sampled_from([
    {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "output_text",
                                                                          "text": "ok"}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"role": "developer", "content": "be nice"}])


# (over HTTP; 1,500 bodies through the translation alone: tests/api/test_translation_fuzz.py)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(items=st.lists(_ITEMS, max_size=4), mutations=st.dictionaries(
    st.sampled_from(_FIELDS), _JSON, max_size=2), stream=st.booleans())
def test_hostile_bodies_never_get_a_5xx(fake, items, mutations, stream):
    body = {"model": MODEL, "input": items or "Hi", "max_output_tokens": 3, "tools": [WEATHER],
            "stream": stream, **mutations}
    r = requests.post(fake.url + "/v1/responses", json=body, timeout=30,
                      headers={"Authorization": "Bearer ka"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" or r.status_code in (
            401, 404, 429), (body, err)


def test_after_the_fuzz_nothing_is_left_running(fake):
    a = client(fake.url, "ka")
    assert make(a).status == "incomplete"
    snap = fake.wait_idle()
    assert not any(snap.values()), snap
    text = requests.get(fake.url + "/metrics", timeout=10).text
    assert metric_value(text, "tinyserve:api_requests_total",
                        '{endpoint="/v1/responses",code="200"}') > 0
