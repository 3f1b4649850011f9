"""Over the real server (``python -m tinyserve``, stories260k): a token id outside the
vocabulary, huge or negative, is a 400 naming it, and the server serves on (the in-process
cases, every field and endpoint: tests/api/test_token_id_refusals.py)."""

import requests

from tests.server.helpers import MODEL


def test_out_of_vocabulary_ids_are_400s_naming_the_id(server):
    url = server.url + "/v1/completions"
    base = {"model": MODEL, "max_tokens": 2, "prompt": "Once"}
    for body, param, token in [({**base, "prompt": [1, 513]}, "prompt", 513),
                               ({**base, "prompt": [1, 2**64 - 1]}, "prompt", 2**64 - 1),
                               ({**base, "stop_token_ids": [2**63]}, "stop_token_ids", 2**63),
                               ({**base, "logit_bias": {"-1": 5}}, "logit_bias", -1)]:
        r = requests.post(url, json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"token id {token} " in error["message"], error
    ok = requests.post(url, json={**base, "stop_token_ids": [511], "logit_bias": {"511": 1}},
                       timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"], ok.text
