"""The translation code fuzzed in-process: a body as each API's route reads it (its front's
translate, then the shared prepare: routing, prompts, sampling, vocabulary, grammar) and the
answer's shaper folding a finished output. Whatever the body, the outcome is the request made
ready, or an ApiError with a 4xx status and a message - never another exception; a body that
is valid on purpose is made ready.

Bodies come from the HTTP fuzzers' own strategies (tests/server/test_fuzz.py,
test_anthropic_api.py, test_responses_api.py), which keep a few hundred requests over HTTP for
what only HTTP shows (headers, encodings, streams, the server unharmed); thousands run here,
where each costs a millisecond instead of a connection.
"""

import asyncio
import collections
import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server import test_anthropic_api as anthropic_fuzz
from tests.server import test_fuzz as openai_fuzz
from tests.server import test_responses_api as responses_fuzz
from tests.server.helpers import MODEL
from tinyserve import __version__
from tinyserve.actors.admission import Admission
from tinyserve.actors.lanes import Lane
from tinyserve.api.anthropic import routes as anthropic_routes
from tinyserve.api.context import ApiContext, Serving
from tinyserve.api.errors import ApiError
from tinyserve.api.openai import routes as openai_routes
from tinyserve.api.ops.openapi import openapi_spec
from tinyserve.api.prepare import prepare
from tinyserve.api.prompts import PromptParser
from tinyserve.api.responses.routes import ResponsesRoutes
from tinyserve.api.shaper import whole
from tinyserve.config import ServerConfig, TenantConfig
from tinyserve.core.routing import Router
from tinyserve.messages import Output
from tinyserve.models import STORIES260K
from tinyserve.text.tokenizer import Tokenizer

TENANT = TenantConfig("t", "k")
CFG = ServerConfig(tenants=(TENANT,))
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def serving() -> Serving:
    """The loaded models as the handlers see them, without actors: a real parser (the
    fuzzers' context and vocabulary), router and admission (asked, never run)."""
    parser = PromptParser(openai_fuzz.MAX_LEN, openai_fuzz.VOCAB, Tokenizer(STORIES260K),
                          str(STORIES260K))
    admission = Admission([Lane(MODEL, asyncio.Queue(), 64, openai_fuzz.MAX_LEN)],
                          tenants=(TENANT,))
    return Serving({MODEL: parser}, admission, Router([MODEL]), metrics=None, supervisor=None)


def _run(serving: Serving, translate, data: bytes) -> str:
    """One body through a route's translation: "ready", or the ApiError's status."""
    try:
        call = translate(data, TENANT)
        prepared = asyncio.run(prepare(serving, TENANT, call.request))
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message, (e.status, e.message)
        return str(e.status)
    choices = len(prepared.prompts) * call.request.n
    shaper = call.shaper(prepared, MODEL, choices, True)
    last = Output("x", (), 1, "stop", prompt_tokens=len(prepared.prompts[0]), completion_tokens=1)
    assert whole(shaper, [(i, last) for i in range(choices)])  # (the answer folds)
    return "ready"


def test_openai_bodies(serving):
    schemas = openapi_spec(__version__)["components"]["schemas"]
    known = {path: sorted(schemas[name]["properties"])
             for path, name in openai_fuzz.SCHEMAS.items()}
    routes = {openai_fuzz.COMPLETIONS: openai_routes._completion,
              openai_fuzz.CHAT: openai_routes._chat}
    outcomes = collections.Counter()

    @settings(max_examples=2500, **SETTINGS)
    @given(case=openai_fuzz._cases(known))
    def one(case) -> None:
        data = case.data
        if ("Content-Encoding", "gzip") in case.headers:
            data = gzip.decompress(data)  # (as aiohttp reads it)
        if len(data) > CFG.max_body_bytes:
            return  # (a 413 before any translation: the HTTP fuzz's)
        got = _run(serving, routes[case.path], data)
        if case.expect == openai_fuzz.OK:
            assert got == "ready", (got, case.body)
        elif case.expect == openai_fuzz.BAD:
            assert got != "ready", case.body
        outcomes[got] += 1

    one()
    print(f"\nopenai translation fuzz: {dict(outcomes)}")
    assert outcomes["ready"] >= 500 and outcomes["400"] >= 500, outcomes


def test_anthropic_bodies(serving):
    outcomes = collections.Counter()

    @settings(max_examples=1500, **SETTINGS)
    @given(valid=st.booleans(), data=st.data())
    def one(valid, data) -> None:
        body = data.draw(anthropic_fuzz._valid() if valid else anthropic_fuzz._mutated())
        got = _run(serving, anthropic_routes._translate, json.dumps(body).encode())
        if valid:  # only a context the prompt outgrew may refuse it
            assert got == "ready" or got == "400", body
        outcomes[got] += 1

    one()
    print(f"\nanthropic translation fuzz: {dict(outcomes)}")
    assert outcomes["ready"] >= 300 and outcomes["400"] >= 300, outcomes


def test_responses_bodies(serving):
    routes = ResponsesRoutes(ApiContext(CFG), generator=None)
    outcomes = collections.Counter()

    @settings(max_examples=1500, **SETTINGS)
    @given(items=st.lists(responses_fuzz._ITEMS, max_size=4), mutations=st.dictionaries(
        st.sampled_from(responses_fuzz._FIELDS), responses_fuzz._JSON, max_size=2),
        stream=st.booleans())
    def one(items, mutations, stream) -> None:
        body = {"model": MODEL, "input": items or "Hi", "max_output_tokens": 3,
                "tools": [responses_fuzz.WEATHER], "stream": stream, **mutations}
        got = _run(serving, routes._translate, json.dumps(body).encode())
        if not mutations:
            assert got == "ready", body
        outcomes[got] += 1

    one()
    print(f"\nresponses translation fuzz: {dict(outcomes)}")
    assert outcomes["ready"] >= 100 and outcomes["400"] >= 100, outcomes
