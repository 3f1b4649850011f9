"""The chat templates the families ship (tests/data/chat_templates, copied from the models'
tokenizer_config.json) render exactly as transformers' ``apply_chat_template`` renders them:
Qwen2.5 (default system prompt, tools), Qwen3 (tools, thinking blocks, enable_thinking through
chat_template_kwargs), Gemma 2 (no system role), Gemma 3 (system folded into the first user
turn), Phi-3, Mistral v0.3 (``[INST]``, tools, 9-character call ids), gpt-oss (harmony:
system, developer and channel turns; tools as a TypeScript namespace). And the hermes parser
reads the calls a Qwen model writes in the form its template teaches."""

import asyncio
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from tests.conftest import STORIES_DIR
from tests.text.test_chat_templates import CHATS as LLAMA_CHATS
from tests.text.test_chat_templates import TOOLS
from tinyserve.api.errors import ApiError
from tinyserve.api.tools.parsers import ToolStreamParser, parse_tool_calls
from tinyserve.text.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

CHATS = {
    **LLAMA_CHATS,
    "thinking": [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                 {"role": "user", "content": "and 3+3?"}],
    "bad-roles": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}
CALL = {"id": "abc123XYZ", "type": "function",  # 9 characters: Mistral's template insists
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHATS = {
    "ask": [{"role": "user", "content": "Weather in Paris?"}],
    "call+result": [{"role": "system", "content": "You forecast."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "abc123XYZ",
                     "content": '{"temperature": 21}'}],
}


@pytest.fixture(scope="module")
def hf():
    return PreTrainedTokenizerFast(tokenizer_file=str(STORIES_DIR / "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def ours(name: str) -> Tokenizer:
    tok = Tokenizer(STORIES_DIR)
    tok.chat_template, tok._compiled_template = template(name), None
    return tok


def check_same(hf, name: str, messages, **kw) -> str | None:
    """Our rendering equals transformers'; both refuse together. -> the rendering."""
    hf.chat_template = template(name)
    gen = kw.pop("add_generation_prompt", True)
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                          **kw)
    except Exception as e:
        with pytest.raises(ValueError, match="rejected"):
            ours(name).apply_chat_template(messages, gen, **kw)
        assert "alternate" in str(e) or "not supported" in str(e) or "roles" in str(e), e
        return None
    got = ours(name).apply_chat_template(messages, gen, **kw)
    assert got == expected
    return got


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("gen", [True, False])
def test_family_templates_render_as_transformers(hf, name, chat, gen):
    check_same(hf, name, CHATS[chat], add_generation_prompt=gen)


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "mistral_v0_3", "gpt_oss"])
@pytest.mark.parametrize("chat", list(TOOL_CHATS))
def test_tools_render_as_transformers(hf, name, chat):
    got = check_same(hf, name, TOOL_CHATS[chat], tools=TOOLS)
    assert got is not None and "get_weather" in got


def test_what_each_family_does_with_a_system_message(hf):
    """Spot checks that the fixtures are what they claim: Qwen2.5 adds its default system
    prompt, Gemma 3 folds the system message into the first user turn, Gemma 2 refuses it."""
    user = CHATS["user"]
    assert "You are Qwen, created by Alibaba Cloud" in check_same(hf, "qwen2_5", user)
    assert "<|im_start|>system" not in check_same(hf, "qwen3", user)
    folded = check_same(hf, "gemma3", CHATS["system+turns"])
    assert folded.startswith("<s><start_of_turn>user\n  Be brief.  \n\nHi<end_of_turn>")
    assert check_same(hf, "gemma2", CHATS["system+turns"]) is None  # refused, as transformers
    assert check_same(hf, "phi3", user).endswith("<|user|>\nHello there<|end|>\n<|assistant|>\n")
    harmony = check_same(hf, "gpt_oss", CHATS["system+turns"])  # the system turn: developer's
    assert harmony.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\n  Be brief.  " in harmony
    assert harmony.endswith("<|end|><|start|>assistant")
    assert check_same(hf, "mistral_v0_3", user) == "<s>[INST] Hello there[/INST]"


def test_qwen3_thinking_switch_through_the_api_path(hf):
    """Qwen3's enable_thinking as a client sends it, chat_template_kwargs (vLLM's extension),
    renders as transformers renders the keyword; a name the request owns is refused."""
    from tinyserve.api.openai.fields import decode as decode_request
    from tinyserve.api.openai.requests import ChatCompletionRequest, TokenizeRequest
    from tinyserve.api.prepare import parse
    from tinyserve.api.prompts import PromptParser

    parser = PromptParser(4096, 512, ours("qwen3"))
    assert parser.tool_parser == "hermes"
    messages = CHATS["thinking"]
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        body = {"model": "m", "messages": messages, "chat_template_kwargs": kwargs}
        ids, _, _ = asyncio.run(parse(parser, decode_request(json.dumps(body).encode(),
                                                             ChatCompletionRequest)))
        expected = check_same(hf, "qwen3", messages, **(kwargs or {}))
        assert ids[0] == parser.tokenizer.encode(expected, False)
        assert ("<think>\n\n</think>" in expected) == (kwargs == {"enable_thinking": False})
        tok = decode_request(json.dumps({k: v for k, v in body.items() if k != "model"}
                                        ).encode(), TokenizeRequest)
        assert asyncio.run(parser.tokenize(tok)) == ids[0]
    for bad in ({"messages": []}, {"bos_token": "x"}, {"not a name": 1}, {"self": 1},
                {"sep_token": "x"}):
        body = {"model": "m", "messages": messages, "chat_template_kwargs": bad}
        with pytest.raises(ApiError) as e:
            asyncio.run(parse(parser, decode_request(json.dumps(body).encode(),
                                                     ChatCompletionRequest)))
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


QWEN_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Lyon"}}\n</tool_call>')


def test_hermes_reads_the_calls_qwen_writes():
    """Two calls in the form the Qwen templates teach (a JSON object between <tool_call> lines),
    whole and streamed in awkward pieces: the same calls and the same content."""
    content, calls = parse_tool_calls(QWEN_OUTPUT, "hermes", frozenset({"get_weather"}))
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    for size in (1, 3, 7):
        stream = ToolStreamParser("hermes", frozenset({"get_weather"}))
        text, deltas = "", []
        for i in range(0, len(QWEN_OUTPUT), size):
            t, d = stream.feed(QWEN_OUTPUT[i:i + size])
            text += t
            deltas += d
        t, d = stream.finish()
        text, deltas = text + t, deltas + d
        assert text.strip() == "Let me check."
        args: dict[int, str] = {}
        names = {}
        for d in deltas:
            args[d.index] = args.get(d.index, "") + d.arguments
            if d.name:
                names[d.index] = d.name
        assert names == {0: "get_weather", 1: "get_weather"}
        assert [json.loads(args[i]) for i in (0, 1)] == [{"city": "Paris"}, {"city": "Lyon"}]


def test_a_qwen_assistant_turn_with_calls_round_trips_through_the_template(hf):
    """The calls the parser returns, sent back as the assistant turn OpenAI clients send (the
    arguments as JSON text), render as transformers renders the same turn."""
    import msgspec

    from tinyserve.api.openai.requests import ChatMessage
    from tinyserve.api.prompts import template_messages

    _, calls = parse_tool_calls(QWEN_OUTPUT, "hermes", frozenset({"get_weather"}))
    wire = [{"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "21"},
            {"role": "tool", "tool_call_id": calls[1].id, "content": "19"}]
    msgs = template_messages(msgspec.convert(wire, list[ChatMessage]))
    got = ours("qwen2_5").apply_chat_template(msgs, True, tools=TOOLS)
    as_hf = [wire[0], {**wire[1], "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in wire[1]["tool_calls"]]}, *wire[2:]]
    hf.chat_template = template("qwen2_5")
    assert got == hf.apply_chat_template(as_hf, tokenize=False, add_generation_prompt=True,
                                         tools=TOOLS)
    assert got.count("<tool_response>") == 2
