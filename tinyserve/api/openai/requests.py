"""OpenAI's and vLLM's request bodies (msgspec Structs), straight from JSON: completions, chat
completions (which the Responses and Messages APIs translate to), tokenize and detokenize.

Unknown fields are ignored here (clients send many we do not use); ``fields.py`` decides which
of them a request may carry. Value ranges are checked where the values become engine fields
(``api/sampling.py``, ``SamplingParams``), vocabulary checks in the engine core.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tinyserve.api.content import join_text


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage in every chunk


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

    def text(self, where: str = "messages") -> str:
        """The content as one string (text parts joined; other parts are a 400)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return join_text(self.content, ("text",), f"{where}.content", lambda p: p.type,
                         lambda p: p.text)


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, TGI)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): for benchmarks
    stop_token_ids: list[int] | None = None  # extension (vLLM): stop on these tokens
    skip_special_tokens: bool = True  # extension (vLLM): special tokens out of the text
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    repetition_penalty: float | None = None  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM): logprobs of the prompt's tokens
    include_stop_str_in_output: bool = False  # extension (vLLM)
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs name token ids
    # extension (vLLM): the prompt's and the output's token ids beside the text
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None  # extension (vLLM): keep the prompt's last k
    # structured output: OpenAI's response_format, or one of vLLM's guided_* / structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by tools.plan
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: one call at most ("required")
    # extension (vLLM): more variables for the chat template, e.g. Qwen3's enable_thinking
    chat_template_kwargs: dict[str, Any] | None = None
    # extension (vLLM, token-in): the prompt as token ids, templated by the client; messages
    # are then ignored (send []) and no template option may be sent (fields.py)
    prompt_token_ids: list[int] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch (a list of either)
    logprobs: int | None = None
    echo: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: a completion ``prompt`` or chat ``messages``."""

    model: str | None = None  # default: the first served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: default on; messages: off (the template)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False
    user: str | None = None  # picks a --route alias's target as a completion's would
    tools: list[Any] | None = None  # messages only: handed to the chat template, as in chat
    chat_template_kwargs: dict[str, Any] | None = None  # messages only, as in chat


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
