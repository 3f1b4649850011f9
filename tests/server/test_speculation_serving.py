"""Speculative decoding through the server (issue 24): streamed and whole answers with stop
strings, n > 1, penalties, json_schema output and a forced tool call the same as a server
without it; vLLM's spec_decode metrics count the verify steps; a bad speculative config or a
draft with another tokenizer is refused by name."""

import asyncio
import json

import pytest

from tests.server.conftest import get, metric_value
from tests.server.helpers import MODEL, chat, completion, post, stream
from tests.server.inprocess import InProcessServer
from tinyserve.cli.values import parse_speculative_config
from tinyserve.config import EngineConfig, SpeculativeConfig

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. "
         "Once upon a time, there was a little")
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Lily", "Tom", "Sue"]},
                                            "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def _server(stories_dir, speculative):
    from tinyserve.engine.device_engine import DeviceEngine

    return InProcessServer(engine=DeviceEngine(EngineConfig(
        model=str(stories_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=8,
        speculative=speculative)))


@pytest.fixture(scope="module")
def servers(stories_dir):
    plain = _server(stories_dir, None)
    spec = _server(stories_dir, SpeculativeConfig(num_speculative_tokens=4))
    yield plain, spec
    plain.stop()
    spec.stop()


REQUESTS = [
    ("/v1/completions", completion(STORY, 24, stop=[" Lily", "park"])),
    ("/v1/completions", completion(STORY, 20, n=2, temperature=0.9, seed=11)),
    ("/v1/completions", completion(STORY, 16, logprobs=2, presence_penalty=0.5)),
    ("/v1/chat/completions", chat(STORY, 40, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})),
    ("/v1/chat/completions", chat(STORY, 40, tools=[{"type": "function", "function": {
        "name": "tell", "parameters": SCHEMA}}], tool_choice={
        "type": "function", "function": {"name": "tell"}})),
]


def _text(events: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        for c in e.get("choices", ()):
            delta = c.get("delta") or {}
            piece = c.get("text") if "text" in c else delta.get("content")
            for call in delta.get("tool_calls") or ():  # a forced call's arguments
                piece = (piece or "") + call["function"].get("arguments", "")
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


def _finish(events: list[dict]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for e in events for c in e.get("choices", ())
            if c.get("finish_reason")}


def test_streamed_and_whole_answers_are_the_same_as_without_speculation(servers):
    import jsonschema
    plain, spec = servers

    async def main():
        for path, body in REQUESTS:
            # one server at a time: Triton's interpreter is not thread-safe (one grid state)
            want, _, _ = await stream(plain.url, path, body)
            got, _, _ = await stream(spec.url, path, body)
            assert _text(got) == _text(want), (path, body)
            assert _finish(got) == _finish(want), (path, body)
            s1, whole, _ = await post(spec.url, path, body)
            assert s1 == 200, whole
            texts = [c["text"] if "text" in c else
                     c["message"]["content"] or c["message"]["tool_calls"][0]["function"][
                         "arguments"] for c in whole["choices"]]
            assert texts == [_text(want)[i] for i in range(len(texts))]
            if "response_format" in body or "tools" in body:
                jsonschema.validate(json.loads(texts[0]), SCHEMA)
    asyncio.run(main())
    _, text = get(spec.url + "/metrics")
    verifies = metric_value(text, "tinyserve:spec_decode_num_drafts_total", f'model="{MODEL}"')
    proposed = metric_value(text, "tinyserve:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "tinyserve:spec_decode_num_accepted_tokens_total")
    at_0 = metric_value(text, "tinyserve:spec_decode_num_accepted_tokens_per_pos_total",
                        'position="0"')
    assert verifies > 0 and proposed >= verifies and 0 < accepted <= proposed
    assert 0 < at_0 <= verifies
    _, plain_text = get(plain.url + "/metrics")
    assert "spec_decode" not in plain_text  # no empty families where nothing speculates


@pytest.mark.parametrize("text, why", [
    ('{"method": "eagle"}', "needs a trained head"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "needs its checkpoint"),
    ('{"num_speculative_tokens": 4, "bogus": 1}', "unknown keys"),
    ("[1, 2]", "JSON object"), ("{", "not JSON"),
])
def test_a_bad_speculative_config_is_refused_by_name(text, why):
    with pytest.raises(ValueError, match=why):
        parse_speculative_config(text)


def test_a_draft_with_another_tokenizer_is_refused(stories_dir, tmp_path):
    from tinyserve.engine.device_engine import DeviceEngine
    from tinyserve.engine.loading.demo import DEMO_CONFIG, write_random_llama, write_tokenizer

    write_random_llama(tmp_path, DEMO_CONFIG)
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="tokenizer|vocab"):
        DeviceEngine(EngineConfig(model=str(stories_dir), dtype="float32", num_kv_blocks=32,
                                  speculative=SpeculativeConfig(method="draft_model",
                                                                model=str(tmp_path))))
