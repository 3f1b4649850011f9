"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them: the
Llama 3.1 (tools, dates), Llama 2 and Mistral (role checks via raise_exception) and ChatML
templates written out below, plus loop controls, on the bundled tokenizer."""

import pytest
from transformers import PreTrainedTokenizerFast

from tests.conftest import STORIES_DIR
from tinyserve.text.tokenizer import Tokenizer

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message without one!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}")

LOOP_CONTROLS = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "[{{ loop.index }}:{{ m['content'] | tojson }}]{% if loop.index >= 3 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}>{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city (été, <b>)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CHATS = {
    "user": [{"role": "user", "content": "Hello there"}],
    "system+turns": [{"role": "system", "content": "  Be brief.  "},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": " Hello! "},
                     {"role": "user", "content": "Tell me a story about <tags> & \"quotes\""}],
    "turns": [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
              {"role": "user", "content": "Three"}],
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": {"temperature": 21, "sky": "clear"}},
]


@pytest.fixture(scope="module")
def hf():
    return PreTrainedTokenizerFast(tokenizer_file=str(STORIES_DIR / "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def ours(template: str) -> Tokenizer:
    tok = Tokenizer(STORIES_DIR)
    tok.chat_template, tok._compiled_template = template, None
    return tok


def theirs(hf, template: str, messages, **kw) -> str:
    hf.chat_template = template
    return hf.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("template", [LLAMA31, LLAMA2, CHATML, MISTRAL, LOOP_CONTROLS],
                         ids=["llama3.1", "llama2", "chatml", "mistral", "loop-controls"])
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("gen", [True, False])
def test_renders_as_transformers(hf, template, chat, gen):
    messages = CHATS[chat]
    try:
        expected = theirs(hf, template, messages, add_generation_prompt=gen)
    except Exception as e:  # the template refuses this chat (roles): so must we
        with pytest.raises(ValueError, match="rejected"):
            ours(template).apply_chat_template(messages, gen)
        assert "alternate" in str(e) or "roles" in str(e)
        return
    assert ours(template).apply_chat_template(messages, gen) == expected


@pytest.mark.parametrize("in_user", [True, False])
def test_tools_and_tool_calls_render_as_transformers(hf, in_user):
    kw = {"tools_in_user_message": in_user}
    expected = theirs(hf, LLAMA31, TOOL_CHAT, add_generation_prompt=True, tools=TOOLS, **kw)
    got = ours(LLAMA31).apply_chat_template(TOOL_CHAT, True, tools=TOOLS, **kw)
    assert got == expected
    assert "été, <b>" in got  # tojson neither escapes HTML nor forces ASCII
    assert "Today Date: " in got  # strftime_now


def test_role_checks_raise_like_transformers(hf):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for template in (LLAMA2, MISTRAL):
        with pytest.raises(Exception, match="alternate"):
            theirs(hf, template, bad)
        with pytest.raises(ValueError, match="alternate"):
            ours(template).apply_chat_template(bad)


def test_the_sandbox_holds():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError):
        ours(evil).apply_chat_template([{"role": "user", "content": "x"}])


def test_the_api_path_renders_tools_and_calls_as_transformers(hf):
    """A chat request as an OpenAI client sends it (arguments as a JSON string, a tool
    message with its call id) reaches the template as transformers would render it, and
    /tokenize with the same tools gives the same ids."""
    import asyncio
    import json

    from tinyserve.api.openai.fields import decode as decode_request
    from tinyserve.api.openai.requests import ChatCompletionRequest, TokenizeRequest
    from tinyserve.api.prepare import parse
    from tinyserve.api.prompts import PromptParser

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    wire = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    body = json.dumps({"model": "m", "messages": wire, "tools": TOOLS}).encode()
    parser = PromptParser(4096, 512, ours(LLAMA31))
    ids, _, tools = asyncio.run(parse(parser, decode_request(body, ChatCompletionRequest)))
    assert tools.mode == "auto" and parser.tool_parser == "llama3_json"
    as_hf = [wire[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    expected = theirs(hf, LLAMA31, as_hf, add_generation_prompt=True, tools=TOOLS)
    assert ids[0] == parser.tokenizer.encode(expected, False)
    tok_req = decode_request(json.dumps({"messages": wire, "tools": TOOLS}).encode(),
                             TokenizeRequest)
    assert asyncio.run(parser.tokenize(tok_req)) == ids[0]
