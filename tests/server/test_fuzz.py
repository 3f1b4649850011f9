"""Property-based fuzzing of the two generate endpoints over HTTP, on the in-process server
(fake model); their bodies alone are fuzzed in-process by tests/api/test_translation_fuzz.py.

Hypothesis draws a request: a valid body (kept small enough to fit the context) that zero, one
or two mutations may break, or a body that is not a request at all (other JSON, broken JSON,
random bytes, deep nesting, too big); then headers: the API key in good and bad forms (raw
non-UTF-8 bytes included), X-Request-Id variants, Content-Type and Content-Encoding. Every
request goes out through a blocking http.client (raw header bytes reach the wire as they are;
the server runs on its own loop thread) and every answer must satisfy, whatever was sent:

    never a 5xx, never a hang (a 10 s client timeout)
    not 200 -> a 4xx in the OpenAI error envelope with a message
    not a JSON Content-Type -> 415 (before anything else is read)
    bad key -> 401; valid body + good key -> 200; a body broken on purpose -> 4xx
    200 -> a well-formed body (choices, usage) or SSE stream (`data:` lines, `data: [DONE]` last)
    X-Request-Id -> echoed when it is a well-formed id, else replaced by the server's own

and after the run the server still answers a plain request and holds no request state.
Bugs it found have their own regression tests: ``test_a_null_token_id_is_refused_at_the_edge``
and ``test_http_layer_errors`` (a body that does not match its Content-Encoding). Malformed HTTP
is answered by aiohttp's parser below the app, as a plain-text 4xx:
``test_malformed_http_gets_a_4xx_from_the_parser`` pins that it is 4xx and harmless.
"""

import collections
import gzip
import http.client
import json
import logging
import re
import socket
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import MODEL
from tests.server.inprocess import InProcessServer

KEY = "sekret"
VOCAB, MAX_LEN = 512, 128  # the fake engine's vocabulary; the server's context length
# Requests the fuzz sends, about half to each endpoint: what only HTTP shows (headers, key
# forms, encodings, streams, the server unharmed). The body space itself is fuzzed in-process,
# 2,500 bodies through the same translation: tests/api/test_translation_fuzz.py.
EXAMPLES = 600
TIMEOUT = 10.0  # seconds per request: longer is a hang
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SCHEMAS = {COMPLETIONS: "CompletionRequest", CHAT: "ChatCompletionRequest"}
ECHOED_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # X-Request-Ids the server echoes
SERVER_ID = re.compile(r"[0-9a-f]{32}")  # what it sends back instead
OK, ANY, BAD = 0, 1, 2  # what a body may get: 200 / 200 or 4xx / 4xx (the worst mutation wins)
DEEP = re.compile(r'"@@deep(\d+)([\[{])@@"')  # placeholder spliced into nesting after json.dumps


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer(api_key=KEY, max_model_len=MAX_LEN)
    yield server
    server.stop()


@dataclass
class Case:
    path: str
    body: dict | None  # the request as JSON (None when the bytes are not a JSON object)
    data: bytes  # what goes on the wire
    expect: int  # OK, ANY or BAD
    key_ok: bool | None  # None: two Authorization headers, either answer is right
    headers: list[tuple[str, str | bytes]]

    @property
    def json_body(self) -> bool:
        """Sent as JSON: a Content-Type of application/json (else the answer is 415)."""
        kinds = [v for k, v in self.headers if k.lower() == "content-type"]
        return bool(kinds) and isinstance(kinds[0], str) and kinds[0].split(";")[0] == JSON


# -- values ------------------------------------------------------------------------------------
# Valid prompts fit the context with room for max_tokens <= 20: a character is at most 4 byte
# tokens (the tokenizer only prepends "▁" and replaces spaces), so 20 characters are <= 82 tokens
# with BOS; two chat messages of 8 characters, templated, are <= 104 (measured, role "assistant").

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8)
_not_bool = _json.filter(lambda v: not isinstance(v, bool))
_not_str = _json.filter(lambda v: not isinstance(v, str))
_not_int = st.floats() | st.text(max_size=8) | st.booleans() | st.lists(st.integers(), max_size=2)
_short_text = st.text(min_size=1, max_size=20)
_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=100)
_stop = st.text(min_size=1, max_size=8)
_surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc80" * 3])  # not Unicode text


def _repeat(lo: int, hi: int) -> st.SearchStrategy[str]:
    """Text of lo..hi characters, cheaply: a short random piece repeated."""
    return st.builds(lambda piece, n: (piece * n)[:n], st.text(min_size=1, max_size=8),
                     st.integers(lo, hi))


def _deep(lo: int = 500, hi: int = 5000, brackets: str = "[{") -> st.SearchStrategy[str]:
    return st.builds(lambda d, b: f"@@deep{d}{b}@@", st.integers(lo, hi), st.sampled_from(brackets))


def _nest(m: re.Match) -> str:
    depth, bracket = int(m.group(1)), m.group(2)
    if bracket == "[":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


_common = st.fixed_dictionaries({}, optional={
    "temperature": st.none() | st.floats(0, 2),
    "top_p": st.none() | st.floats(0.01, 1),
    "top_k": st.none() | st.sampled_from([-1, 0]) | st.integers(1, VOCAB),
    "seed": st.none() | st.integers(-(2**63), 2**64 - 1),
    "stop": st.none() | _stop | st.lists(_stop, max_size=4),
    "n": st.just(1),
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.none() | st.text(max_size=20),
})

_stream = st.sampled_from([{}, {"stream": False}, {"stream": True}, {"stream": True}])


def _one_in(n: int) -> st.SearchStrategy[bool]:
    """True one time in n (uniform: hypothesis favours the ends of an integer range)."""
    return st.sampled_from(range(n)).map(lambda i: i == n - 1)


@st.composite
def _completion(draw) -> dict:
    prompt = draw(st.one_of(_short_text, _ids, _short_text.map(lambda s: [s]), _ids.map(lambda i: [i]),
                            st.lists(_short_text | _ids, min_size=2, max_size=4)))  # a batch
    body = {"model": MODEL, "prompt": prompt, **draw(_common), **draw(_stream)}
    body.update(draw(st.fixed_dictionaries({}, optional={
        "max_tokens": st.none() | st.integers(1, 20),  # absent: 16
        "logprobs": st.none() | st.integers(0, 20),
        "echo": st.just(False)})))
    return _stream_options_need_stream(body)


_part = st.fixed_dictionaries({"type": st.just("text")}, optional={"text": st.none() | st.text(max_size=4)})
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"])}, optional={
    "content": st.none() | st.text(max_size=8) | st.lists(_part, max_size=2),
    "name": st.text(max_size=8)})


@st.composite
def _chat(draw) -> dict:
    body = {"model": MODEL, "messages": draw(st.lists(_message, min_size=1, max_size=2)),
            **draw(_common), **draw(_stream)}
    body.update(draw(st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 20),  # neither: whatever the context leaves
        "max_completion_tokens": st.integers(1, 20)})))
    if draw(st.booleans()):
        body["logprobs"] = logprobs = draw(st.booleans())
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 20) if logprobs else st.just(0))
    return _stream_options_need_stream(body)


def _stream_options_need_stream(body: dict) -> dict:
    """Valid bodies carry stream_options only with stream: true (OpenAI's rule)."""
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    return body


# -- mutations: (strategy of a value, how it goes into the body) --------------------------------

def _set(field: str):
    def put(body: dict, value) -> None:
        body[field] = value
    return put


def _insert(body: dict, bad) -> None:
    """A bad element somewhere in a token-id prompt."""
    ids, at, value = bad
    body["prompt"] = ids[:at] + [value] + ids[at:]


def _over_context(body: dict, n: int) -> None:
    body["prompt"], body["max_tokens"] = list(range(1, n + 1)), MAX_LEN - n + 1


def _chat_max_tokens(body: dict, value) -> None:
    body.pop("max_completion_tokens", None)  # it would win over max_tokens
    body["max_tokens"] = value


def _bad_message(body: dict, bad) -> None:
    at, message = bad
    messages = body.get("messages")  # an earlier mutation may have replaced the list
    messages = messages if isinstance(messages, list) else []
    body["messages"] = messages[:at] + [message] + messages[at:]


def _options_without_stream(body: dict, options) -> None:
    body["stream"] = False
    body["stream_options"] = options


def _delete(field: str):
    def drop(body: dict, _) -> None:
        body.pop(field, None)
    return drop


_bad_token = (st.integers(max_value=-1) | st.integers(min_value=VOCAB) | st.sampled_from([2**64, 2**70])
              | st.floats() | st.booleans() | st.text(max_size=4) | st.none()
              | st.lists(st.integers(0, VOCAB - 1), max_size=3) | st.just({"id": 1}))
_bad_max_tokens = st.integers(max_value=0) | st.integers(min_value=MAX_LEN) | _not_int
_bad_common = [
    (st.text(max_size=20).filter(lambda m: m != MODEL) | _not_str, _set("model")),
    (st.none(), _delete("model")),
    (st.floats(max_value=-1e-9) | st.floats(min_value=100.001) | st.just(1e308) | st.text(max_size=4),
     _set("temperature")),
    (st.floats(max_value=0.0) | st.floats(min_value=1.0001) | st.text(max_size=4), _set("top_p")),
    (st.integers(max_value=-2) | st.integers(min_value=VOCAB + 1)
     | st.sampled_from([2**31, 2**63, 2**64, -(2**63)]) | st.floats() | st.text(max_size=4), _set("top_k")),
    (st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1) | st.floats() | st.text(max_size=4),
     _set("seed")),
    (st.just("") | st.lists(_stop, min_size=17, max_size=24) | _repeat(257, 1000)
     | st.lists(_stop, max_size=2).map(lambda s: [*s, ""]) | st.lists(st.integers() | st.none(), min_size=1)
     | st.integers() | st.just({"s": "x"}), _set("stop")),
    (st.integers(max_value=0) | st.integers(min_value=65), _set("n")),
    (st.floats(min_value=2.001) | st.floats(max_value=-2.001) | st.text(max_size=3),
     _set("presence_penalty")),
    (st.dictionaries(st.text(alphabet="abxyz_.", max_size=4), st.floats(-5, 5),
                     min_size=1, max_size=3) | st.just({"99999": 1}) | st.just([1]),
     _set("logit_bias")),
    (st.integers(max_value=-1) | st.floats(), _set("min_tokens")),
    (_not_bool, _set("stream")),
    (_json.filter(lambda v: v is not None and not isinstance(v, dict))
     | st.fixed_dictionaries({"include_usage": _not_bool}), _set("stream_options")),
    (st.fixed_dictionaries({"include_usage": st.booleans()}), _options_without_stream),
    (_not_bool, _set("ignore_eos")),
    (_json.filter(lambda v: v is not None and not isinstance(v, str)), _set("user")),
    (_surrogates, _set("user")),
]
_bad = {
    COMPLETIONS: _bad_common + [
        (st.sampled_from(["", [], [""], [[]], None, 0, True, {"text": "x"}]), _set("prompt")),
        (st.tuples(_ids, st.integers(0, 100), _bad_token), _insert),
        (_repeat(1000, 20_000) | _surrogates, _set("prompt")),
        (st.builds(lambda n, k: [(7 * i + k) % VOCAB for i in range(n)], st.integers(MAX_LEN, 600),
                   st.integers(0, VOCAB - 1)), _set("prompt")),
        (st.lists(_short_text | _ids, min_size=1, max_size=3).map(lambda b: [*b, 7]),
         _set("prompt")),  # a batch with a bare number in it
        (st.integers(100, MAX_LEN - 1), _over_context),
        (_bad_max_tokens, _set("max_tokens")),
        (st.integers(min_value=21) | st.integers(max_value=-1) | st.booleans() | st.text(max_size=4),
         _set("logprobs")),
        (_not_bool.filter(lambda v: v is not False and v is not True), _set("echo")),
        (st.none(), _delete("prompt")),
        (_deep(brackets="["), _set("prompt")),
    ],
    CHAT: _bad_common + [
        (st.just([]) | _json.filter(lambda v: not isinstance(v, list)), _set("messages")),
        (st.none(), _delete("messages")),
        (st.tuples(st.integers(0, 2), st.one_of(
            st.just({}), st.fixed_dictionaries({"role": _not_str}),
            st.fixed_dictionaries({"role": st.just("user"), "content": st.integers() | st.booleans()
                                   | st.dictionaries(st.text(max_size=4), _json, max_size=2)}),
            st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.one_of(
                st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
                st.just({"text": "no type"}), st.just("bare string"),
                st.fixed_dictionaries({"type": st.just("text"), "text": _not_str.filter(
                    lambda v: v is not None)})), min_size=1, max_size=2)}),
            st.fixed_dictionaries({"role": st.just("user"), "content": _repeat(1000, 20_000) | _surrogates}),
            st.text(max_size=4) | st.integers() | st.none())), _bad_message),
        (_bad_max_tokens, _chat_max_tokens),
        (_bad_max_tokens, _set("max_completion_tokens")),
        (_not_bool, _set("logprobs")),
        (st.builds(lambda n: {"logprobs": True, "top_logprobs": n}, st.integers(min_value=21)
                   | st.integers(max_value=-1)), lambda body, v: body.update(v)),
        (st.builds(lambda n: {"logprobs": False, "top_logprobs": n}, st.integers(min_value=1)
                   | st.integers(max_value=-1)), lambda body, v: body.update(v)),
        (_not_int.filter(lambda v: v is not None), _set("top_logprobs")),
        (_deep(brackets="["), _set("messages")),
    ],
}


def _gray(known: dict[str, list[str]], path: str) -> list:
    """Mutations whose answer may be 200 or 4xx: arbitrary JSON in any schema field, an odd
    role, a mid-length prompt, unknown fields (deeply nested ones too)."""
    unknown = st.text(min_size=1, max_size=12).filter(lambda k: k not in known[path])
    field = st.sampled_from(known[path])
    gray = [
        (st.tuples(field, _json), lambda body, kv: body.__setitem__(*kv)),
        (st.dictionaries(unknown, _json, max_size=3), lambda body, extra: body.update(extra)),
        (st.tuples(unknown, _deep()), lambda body, kv: body.__setitem__(*kv)),
    ]
    if path == CHAT:
        gray.append((st.text(max_size=20), lambda body, role: body["messages"][0].update(role=role)))
    else:
        gray.append((_repeat(21, 999), _set("prompt")))
    return gray


# -- whole requests ----------------------------------------------------------------------------

_not_a_request = st.one_of(
    _json.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"{}", b'{"model": }', b"\xff\xfe{}", b"[" * 3000, b"{" * 3000,
                     b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode()]),
    _deep(brackets="[").map(lambda s: DEEP.sub(_nest, json.dumps(s)).encode()),
    st.integers(1, 256).map(lambda k: b'{"model": "%s", "prompt": "%s"}' % (
        MODEL.encode(), b"a" * (4 * 2**20 + k))),  # over max_body_bytes: 413
)

_good_keys = st.sampled_from([f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}", f"Bearer {KEY}  ",
                              f"Bearer \t {KEY}"])
_header_bytes = st.binary(max_size=40).map(  # what http.client lets through: no CR, LF or controls
    lambda b: bytes(c for c in b if c == 9 or 32 <= c < 127 or c >= 128).strip())
_bad_keys = st.one_of(
    st.sampled_from(["", "Bearer", "Bearer ", "Bearer wrong", KEY, f"Basic {KEY}", f"Token {KEY}",
                     f"Bearer {KEY}2", f"Bearer {KEY[:-1]}", f"Bearer\t{KEY}", f"Bearer {KEY.upper()}"]),
    st.sampled_from([b"Bearer sekr\xe9t", b"Bearer sekret\xff", "Bearer sékret".encode(),
                     b"Bearer \xc3\x28", b"\xff\xfe\xfd"]),
    _header_bytes.filter(lambda b: KEY.encode() not in b),
)
_request_ids = st.one_of(
    st.from_regex(ECHOED_ID, fullmatch=True),
    st.just("fuzz-duplicate-id"),  # the same id on many requests
    st.integers(129, 8000).map(lambda n: "r" * n),
    st.sampled_from(["with spaces in it", "tab\tin", "id/with/slashes", "", " "]),
    st.sampled_from([b"id-\xff\xfe", b"caf\xe9", "café".encode(), "\U0001F600".encode()]),
    _header_bytes,
)
JSON = "application/json"
_json_types = st.sampled_from([JSON, "application/json; charset=utf-8"])
# what a browser posts cross-origin without a CORS preflight, and other non-JSON types (None:
# no Content-Type header at all)
_other_types = st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                "multipart/form-data; boundary=z", "", b"application/\xffjson"])


@st.composite
def _headers(draw) -> tuple[bool | None, list[tuple[str, str | bytes]]]:
    """-> (whether the key is right: None when two keys make it the server's pick), headers."""
    headers, key_ok = [], True
    auth = draw(st.sampled_from(["good"] * 6 + ["bad", "missing", "two"]))
    if auth == "good":
        headers.append((draw(st.sampled_from(["Authorization", "authorization"])), draw(_good_keys)))
    elif auth == "bad":
        headers.append(("Authorization", draw(_bad_keys)))
        key_ok = False
    elif auth == "missing":
        key_ok = False
    else:
        pair = [("Authorization", draw(_good_keys)), ("Authorization", draw(_bad_keys))]
        headers += draw(st.permutations(pair))
        key_ok = None
    for _ in range(draw(st.integers(0, 2))):  # 2: a duplicated X-Request-Id header
        headers.append(("X-Request-Id", draw(_request_ids)))
    kind = draw(_other_types) if draw(_one_in(8)) else draw(_json_types)
    if kind is not None:
        headers.append(("Content-Type", kind))
    if draw(_one_in(10)):
        headers.append(("Expect", "100-continue"))
    return key_ok, headers


def _cases(known: dict[str, list[str]]) -> st.SearchStrategy[Case]:
    gray = {path: _gray(known, path) for path in (COMPLETIONS, CHAT)}

    @st.composite
    def case(draw) -> Case:
        path = draw(st.sampled_from([COMPLETIONS, CHAT]))
        key_ok, headers = draw(_headers())
        if draw(_one_in(8)):
            data, body, expect = draw(_not_a_request), None, BAD
        else:
            body = draw(_completion() if path == COMPLETIONS else _chat())
            expect = OK
            for _ in range(draw(st.sampled_from([0, 0, 1]))):  # gray first: bad ones win
                value, put = draw(st.sampled_from(gray[path]))
                put(body, draw(value))
                expect = ANY
            for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
                value, put = draw(st.sampled_from(_bad[path]))
                put(body, draw(value))
                expect = BAD
            text = json.dumps(body, ensure_ascii=draw(st.booleans()))
            data = DEEP.sub(_nest, text).encode("utf-8", "surrogatepass")
        if draw(_one_in(10)):
            headers.append(("Content-Encoding", "gzip"))
            data = gzip.compress(data)
        return Case(path, body, data, expect, key_ok, headers)

    return case()


# -- one request, checked ----------------------------------------------------------------------

def _send(port: int, case: Case) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.putrequest("POST", case.path, skip_accept_encoding=True)
        for name, value in case.headers:
            conn.putheader(name, value)  # bytes go out as they are
        conn.putheader("Content-Length", str(len(case.data)))
        conn.endheaders(case.data)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def _check_request_id(case: Case, headers: http.client.HTTPMessage) -> None:
    sent = [v for k, v in case.headers if k == "X-Request-Id"]
    first = sent[0] if sent else ""  # the server reads the first one
    if isinstance(first, bytes):
        first = first.decode("utf-8", "surrogateescape")
    first = first.strip(" \t")
    got = headers.get("X-Request-Id")
    if ECHOED_ID.fullmatch(first):
        assert got == first
    else:
        assert got and SERVER_ID.fullmatch(got), got


def _check_error(case: Case, status: int, headers: http.client.HTTPMessage, data: bytes) -> None:
    assert 400 <= status < 500, (status, data[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), data[:300]
    body = json.loads(data)
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if not case.json_body:
        assert status == 415 and err["code"] == "unsupported_media_type", (status, err)
    elif status == 401:
        assert case.key_ok is not True and err["code"] == "invalid_api_key", err
    else:
        assert case.key_ok is not False, f"bad key answered {status}: {err}"
        assert case.expect != OK, f"a valid request got {status}: {err}"


def _max_tokens(body: dict, chat: bool) -> int:
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    if body.get("max_tokens") is not None:
        return body["max_tokens"]
    return MAX_LEN if chat else 16


def _choices(body: dict) -> int:
    """One choice per prompt of a batched completions request, else one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _check_json(case: Case, data: bytes) -> None:
    chat = case.path == CHAT
    out = json.loads(data)
    assert out["object"] == ("chat.completion" if chat else "text_completion"), out
    assert out["model"] == MODEL and isinstance(out["id"], str) and out["id"]
    n = _choices(case.body)
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(n)), choices
    for choice in choices:
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
    use = out["usage"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"] <= n * MAX_LEN, use
    assert n <= use["completion_tokens"] <= n * _max_tokens(case.body, chat), (use, case.body)
    prompt = case.body.get("prompt")
    if not chat and isinstance(prompt, list) and n == 1:
        ids = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
        if all(type(t) is int for t in ids):  # token ids: the prompt is exactly these
            assert use["prompt_tokens"] == len(ids), use
    choice = choices[0]
    if chat and case.body.get("logprobs") is True:
        entries = choice["logprobs"]["content"]
        assert len(entries) == use["completion_tokens"]
        assert all(len(e["top_logprobs"]) == (case.body.get("top_logprobs") or 0) for e in entries)
    elif not chat and case.body.get("logprobs") is not None:
        assert sum(len(c["logprobs"]["tokens"]) for c in choices) == use["completion_tokens"]


def _check_sse(case: Case, data: bytes) -> None:
    events = data.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], data[-300:]
    kind = "chat.completion.chunk" if case.path == CHAT else "text_completion"
    finish, usage = [], []
    for event in events[:-2]:
        assert event.startswith(b"data: "), event
        chunk = json.loads(event[len(b"data: "):])
        assert "error" not in chunk and chunk["object"] == kind, chunk
        assert isinstance(chunk["choices"], list), chunk
        finish += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
        usage += [chunk["usage"]] if chunk.get("usage") else []
    n = _choices(case.body)
    assert len(finish) == n and set(finish) <= {"stop", "length"}, finish
    if (case.body.get("stream_options") or {}).get("include_usage"):
        [use] = usage
        assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"] <= n * MAX_LEN, use
    else:
        assert usage == [], usage


def _check(port: int, case: Case) -> int:
    t0 = time.monotonic()
    status, headers, data = _send(port, case)
    assert time.monotonic() - t0 < TIMEOUT
    assert status < 500, (status, data[:300])
    _check_request_id(case, headers)
    if status != 200:
        _check_error(case, status, headers, data)
        return status
    assert case.key_ok is not False and case.expect != BAD and case.json_body, data[:300]
    if case.body.get("stream") is True:
        assert headers.get("Content-Type", "").startswith("text/event-stream")
        _check_sse(case, data)
    else:
        assert headers.get("Content-Type", "").startswith("application/json")
        _check_json(case, data)
    return status


# -- the tests ---------------------------------------------------------------------------------

def _openapi(srv: InProcessServer) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/openapi.json")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/json")
        return json.loads(resp.read())
    finally:
        conn.close()


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        here = [node["$ref"]] if "$ref" in node else []
        return here + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_describes_both_request_schemas(srv):
    doc = _openapi(srv)
    assert doc["openapi"].startswith("3.1.") and doc["info"]["title"] and doc["info"]["version"]
    schemas = doc["components"]["schemas"]
    for path, name in SCHEMAS.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["type"] == "object" and "model" in schemas[name]["required"]
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    for ref in _refs(doc):  # every reference resolves inside the document
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def test_raw_non_utf8_header_bytes_reach_the_server(srv, monkeypatch):
    seen = []
    from tinyserve.api import pipeline

    auth = pipeline.authenticate

    def spy(request, tenants):
        seen.append((request.headers.get("Authorization"), request.headers.get("X-Request-Id")))
        return auth(request, tenants)

    monkeypatch.setattr(pipeline, "authenticate", spy)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    headers = [("Authorization", b"Bearer sekr\xe9t\xff"), ("X-Request-Id", b"id-\xfe"),
               ("Content-Type", JSON)]
    case = Case(COMPLETIONS, None, body, OK, False, headers)
    assert _check(srv.server.port, case) == 401
    # aiohttp keeps undecodable bytes as surrogate escapes: the very bytes sent arrived
    assert seen == [("Bearer sekr\udce9t\udcff", "id-\udcfe")]


def test_fuzz_generate_endpoints(srv, caplog):
    schemas = _openapi(srv)["components"]["schemas"]
    known = {path: sorted(schemas[name]["properties"]) for path, name in SCHEMAS.items()}
    port, statuses, t0 = srv.server.port, collections.Counter(), time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
    @given(case=_cases(known))
    def one(case: Case) -> None:
        statuses[case.path, _check(port, case)] += 1

    with caplog.at_level(logging.WARNING):
        one()
        # the strategy's rarest end, sent for sure: a body over max_body_bytes
        big = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"a" * (4 * 2**20 + 1))
        case = Case(COMPLETIONS, None, big, BAD, True,
                    [("Authorization", f"Bearer {KEY}"), ("Content-Type", JSON)])
        statuses[COMPLETIONS, _check(port, case)] += 1
    by_status = collections.Counter(status for (_, status) in statuses.elements())
    print(f"\nfuzz: {statuses.total()} requests in {time.monotonic() - t0:.1f} s, by status: "
          f"{dict(sorted(by_status.items()))}")
    assert statuses.total() >= EXAMPLES // 2, statuses
    assert {status for _, status in statuses} >= {200, 400, 401, 404, 413, 415}, statuses
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

    # The server is unharmed: a plain request is served, nothing is left behind.
    for path, body in [(COMPLETIONS, {"model": MODEL, "prompt": "Once", "max_tokens": 4}),
                       (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 4})]:
        case = Case(path, body, json.dumps(body).encode(), OK, True,
                    [("Authorization", f"Bearer {KEY}"), ("Content-Type", JSON)])
        assert _check(port, case) == 200
    assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "requests": 0, "live": 0}


@pytest.mark.parametrize("prompt", [[None], [1, None, 2], [[5, None]]])
def test_a_null_token_id_is_refused_at_the_edge(srv, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    case = Case(COMPLETIONS, body, json.dumps(body).encode(), BAD, True,
                [("Authorization", f"Bearer {KEY}"), ("Content-Type", JSON)])
    status, headers, data = _send(srv.server.port, case)
    assert status == 400, data[:300]
    _check_error(case, status, headers, data)
    assert json.loads(data)["error"]["param"] == "prompt"


# -- below the app: aiohttp's HTTP parser and content decoding ----------------------------------

def _raw_exchange(port: int, request: bytes) -> tuple[int, bytes, bytes]:
    """-> (status, raw header block, body) for bytes written straight to the socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def _request(*headers: bytes, body: bytes | None = None, chunked: bytes | None = None) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode() if body is None else body
    lines = [b"POST /v1/completions HTTP/1.1", b"Host: x", b"Connection: close",
             b"Authorization: Bearer " + KEY.encode(), b"Content-Type: " + JSON.encode(), *headers]
    if chunked is None:
        lines.append(b"Content-Length: %d" % len(body))
    else:
        lines.append(b"Transfer-Encoding: chunked")
        body = chunked
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.parametrize("request_bytes", [
    pytest.param(_request(b"Content-Encoding: gzip"), id="gzip-header-plain-body"),
    pytest.param(_request(b"Content-Encoding: deflate"), id="deflate-header-plain-body"),
    pytest.param(_request(b"Content-Encoding: gzip", body=gzip.compress(b'{"model": 1}')[:-4]),
                 id="gzip-truncated"),
])
def test_http_layer_errors(srv, request_bytes):
    status, head, body = _raw_exchange(srv.server.port, request_bytes)
    assert 400 <= status < 500, (status, body[:300])
    assert b"content-type: application/json" in head.lower(), (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err


@pytest.mark.parametrize("request_bytes", [
    pytest.param(_request(b"Content-Encoding: br"), id="unsupported-encoding"),
    pytest.param(_request(b"X-Request-Id: " + b"r" * 9000), id="header-over-8190-bytes"),
    pytest.param(_request(b"X-Request-Id: a\x00b"), id="nul-in-header-value"),
    pytest.param(_request(b"X-\xe9: 1"), id="non-ascii-header-name"),
    pytest.param(_request(b"Expect: tea"), id="unknown-expect"),
    pytest.param(_request(chunked=b"zz\r\nabc\r\n0\r\n\r\n"), id="bad-chunk-size"),
])
def test_malformed_http_gets_a_4xx_from_the_parser(srv, request_bytes):
    """Not HTTP we can parse: aiohttp answers below the app (plain text, no envelope). It must
    still be a 4xx, and the server must go on serving."""
    status, _, body = _raw_exchange(srv.server.port, request_bytes)
    assert 400 <= status < 500, (status, body[:300])
    assert _raw_exchange(srv.server.port, _request())[0] == 200
