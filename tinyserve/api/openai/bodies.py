"""OpenAI's and vLLM's answers (msgspec Structs): completions, chat completions and their
stream chunks, logprobs, tool calls, usage, model cards, tokenize results."""

from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # None: an echoed prompt's first token
    text_offset: list[int]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


# vLLM's return_token_ids: ``token_ids`` (the generated ids, a stop token included) on each
# choice and streamed choice, ``prompt_token_ids`` (the ids the engine ran) on a chat answer or
# its first chunks, on a completion choice or its first chunk; absent unless asked for.
TokenIds = list[int] | msgspec.UnsetType


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: TokenIds = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    created: int = msgspec.field(default_factory=now)
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET  # vLLM's extension
    prompt_token_ids: TokenIds = msgspec.UNSET


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: TokenIds = msgspec.UNSET


class _Choices(msgspec.Struct):
    """What a completions body and a chat stream chunk share (subclasses narrow ``choices``
    and add ``object``, which OpenAI puts last)."""

    id: str
    model: str
    choices: list
    created: int
    usage: Usage | None = None


class ChatCompletionChunk(_Choices):
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: TokenIds = msgspec.UNSET
    # only in the stream a whole answer is folded from (a stream with prompt_logprobs is a 400)
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class PromptLogprob(msgspec.Struct):
    """vLLM's entry for one candidate of a prompt position (``prompt_logprobs``)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, else token id (as text) ->
# its entry, for the prompt's own token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    token_ids: TokenIds = msgspec.UNSET
    prompt_token_ids: TokenIds = msgspec.UNSET


class CompletionResponse(_Choices):
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct):
    """One entry of ``GET /v1/models``, with vLLM's extra fields (benchmark clients read
    ``max_model_len`` and ``root``)."""

    id: str
    max_model_len: int
    root: str = ""  # the checkpoint it serves (for a --route alias: the alias)
    parent: str | None = None
    created: int = msgspec.field(default_factory=now)
    object: Literal["model"] = "model"
    owned_by: str = "tinyserve"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
