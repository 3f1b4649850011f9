"""Token ids a request names (a prompt sent as ids, stop_token_ids, logit_bias keys) outside the
model's vocabulary, huge (2^63, 2^64 - 1, beyond) or negative: a 400 in the API's error
envelope, with ``param`` set and the message naming the id, and nothing reaches the engine.

The in-process server's fake model has stories260k's vocabulary of 512 ids. The Responses and
Messages APIs take no token ids (their fields are text)."""

import json

import pytest
import requests

from tests.server.helpers import MODEL
from tests.server.inprocess import InProcessServer

BAD_IDS = [512, 513, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1,
           10**30]
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "max_tokens": 2, "prompt": "Hi"}


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer()
    yield server
    server.stop()


def cases(token: int) -> list[tuple[str, dict, str]]:
    """(path, body, param) for each place a request names a token id."""
    return [
        ("/v1/completions", {**COMPLETION, "prompt": [5, token]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [[5], [5, token]]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [5, token]}, "prompt_token_ids"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [5, token]}, "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": [token]}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 1, str(token): -100}},
         "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(token): 2}}, "logit_bias"),
    ]


@pytest.mark.parametrize("token", BAD_IDS)
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_it(srv, token):
    steps = srv.runner.steps
    for path, body, param in cases(token):
        r = requests.post(srv.url + path, data=json.dumps(body),
                          headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert f"token id {token} " in error["message"], error
        assert "[0, 512)" in error["message"], error
    assert srv.runner.steps == steps  # none of them reached the engine


@pytest.mark.parametrize("key", ["1_0", " 5", "5 ", "\u0665", "+5", "0x5", "5.0", "", "1" * 41])
def test_a_logit_bias_key_that_is_not_a_decimal_id_is_refused(srv, key):
    r = requests.post(srv.url + "/v1/completions", json={**COMPLETION, "logit_bias": {key: 1}},
                      timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and "is not a token id" in error["message"], error


def test_ids_in_the_vocabulary_still_run(srv):
    r = requests.post(srv.url + "/v1/completions", json={
        **COMPLETION, "prompt": [1, 5, 511], "stop_token_ids": [0, 511],
        "logit_bias": {"0": 1, "511": -100, "007": 1}}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(srv.url + "/v1/chat/completions", json={
        **CHAT, "prompt_token_ids": [1, 511], "logit_bias": {"511": 1}}, timeout=30)
    assert r.status_code == 200, r.text
