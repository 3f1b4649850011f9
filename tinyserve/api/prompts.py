"""Prompt building for one served model: chat templates and tokenization, with every length
bounded before the work it would cost.

The cheap checks run first, so hostile input costs almost nothing: the body is decoded by
msgspec (types, nesting depth; ``fields.decode_request``), the model routed, and text longer
than the context could ever hold is refused by its character count before it is tokenized.
Only then are chat templates rendered and text tokenized, in a worker thread when the input is
large. Every refusal is an ``ApiError`` 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.api.tools.plan import plan as tools_plan
from tinyserve.core.engine_core import check_token_ids
from tinyserve.messages import FieldError, GrammarSpec
from tinyserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tinyserve.text.grammar import CompiledGrammar, GrammarCompiler

OFF_LOOP_CHARS = 4096  # inputs longer than this are templated / tokenized in a worker thread
CHARS_PER_TURN = 16  # what a chat template's markup adds per message, roughly
MAX_BATCH_PROMPTS = 64  # prompts in one completions request (each is a request to admission)
# what a template sees that chat_template_kwargs may not replace (the request's own fields, the
# tokenizer's special tokens, the sandbox's functions)
# The roles the chat API defines: a template renders a role verbatim, so any other text could
# write a turn of its own ("user|>\nfake\n<|system"); OpenAI answers 400 to an unknown role.
ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
    "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "raise_exception",
    "strftime_now", "self"})


class PromptParser:
    """One served model's view of a request: its tokenizer, context length and vocabulary."""

    def __init__(self, max_model_len: int, vocab_size: int, tokenizer: Tokenizer,
                 root: str = "", grammars: GrammarCompiler | None = None,
                 tool_parser: str = "auto", special_tokens_in_content: str = "text") -> None:
        self.root = root  # the checkpoint (GET /v1/models)
        self.grammars = grammars  # the engine's (shared with its runner: one compile cache)
        if tool_parser == "auto":  # Hermes-style templates show calls as <tool_call> blocks
            tool_parser = "hermes" if "<tool_call>" in (tokenizer.chat_template or "") \
                else "llama3_json"
        self.tool_parser = tool_parser
        # "text": special-token text in chat content is plain text (a turn cannot be forged
        # from content); "parse": as transformers and vLLM tokenize it (--special-tokens-in-content)
        self.parse_content_specials = special_tokens_in_content == "parse"
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        # No token stands for more characters than max_token_chars: more characters than
        # that many per context slot cannot fit, whatever the tokenizer would make of them.
        self.max_chars = max_model_len * tokenizer.max_token_chars

    async def prompts(self, req: ChatCompletionRequest | CompletionRequest,
                      tools: ToolPlan | None = None) -> list[list[int]]:
        """The token ids of a request's prompts: a chat's one (its ``prompt_token_ids`` as
        sent, vLLM's token-in, else its messages templated), or each of a completions batch;
        ``truncate_prompt_tokens`` keeps each one's last k (vLLM)."""
        if isinstance(req, ChatCompletionRequest) and req.prompt_token_ids:
            prompts = [self._token_prompt(req.prompt_token_ids, "prompt_token_ids")]
        elif isinstance(req, ChatCompletionRequest):
            prompts = [await self._chat_prompt(req, tools=tools and tools.tools)]
        else:
            batch = batch_of(req.prompt)
            prompts = []
            for i, p in enumerate(batch):
                try:
                    prompts.append(await self._completion_prompt(p))
                except ApiError as e:
                    if len(batch) > 1:  # which one
                        e.message = f"prompt[{i}]: {e.message}"
                    raise
        if (k := req.truncate_prompt_tokens) is not None:
            if k < 1:
                raise ApiError(400, f"truncate_prompt_tokens must be >= 1, got {k}",
                               param="truncate_prompt_tokens")
            prompts = [p[-k:] for p in prompts]
        return prompts

    def max_tokens_for(self, req: ChatCompletionRequest | CompletionRequest,
                       prompts: list[list[int]]) -> int:
        """The completion budget: what the request asks for (``max_completion_tokens`` first
        in chat), else OpenAI's defaults: 16 for completions, the rest of the context of the
        longest prompt for chat."""
        chat = isinstance(req, ChatCompletionRequest)
        if chat and req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = (16 if req.max_tokens is None and not chat else req.max_tokens,
                                "max_tokens")
        longest = max(len(p) for p in prompts)
        prompt_param = ("prompt_token_ids" if req.prompt_token_ids else "messages") if chat \
            else "prompt"
        return self.max_tokens(requested, longest, param, prompt_param)

    async def check_grammar(self, spec: GrammarSpec, field: str) -> CompiledGrammar:
        """Compile it now (cached for the runner): a bad or unsatisfiable one is a 400."""
        if self.grammars is None:
            raise ApiError(400, "structured output is not available for this model (its "
                           "tokenizer has no EOS token)", param=field,
                           code="unsupported_parameter")
        try:
            return await _off_loop(len(spec.value), self.grammars.compile, spec)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"structured output: {e}", param=field) from None

    async def tokenize(self, req: TokenizeRequest) -> list[int]:
        """``POST /tokenize``: the ids a completion or chat request with this prompt would
        run (same template, same limits), without running it."""
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if req.add_special_tokens:  # vLLM's chat default is off; the template adds them
                raise ApiError(400, "add_special_tokens is not supported with messages",
                               param="add_special_tokens", code="unsupported_parameter")
            tools = tools_plan(req.tools, None, self.tool_parser)
            return await self._chat_prompt(req, req.add_generation_prompt,
                                           tools=tools and tools.tools)
        self._check_chars(len(req.prompt), "prompt")
        add = True if req.add_special_tokens is None else req.add_special_tokens
        return await _off_loop(len(req.prompt), self.tokenizer.encode, req.prompt, add)

    async def detokenize(self, ids: list[int]) -> str:
        if len(ids) > self.max_model_len:  # before looking at each element
            raise ApiError(400, f"tokens: {len(ids)} ids, more than the model's context of "
                           f"{self.max_model_len}", param="tokens")
        self._check_ids(ids, "tokens")
        return await _off_loop(len(ids) * 4, self.tokenizer.decode, ids, False)

    async def _chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest,
                           add_generation_prompt: bool = True,
                           tools: list[dict] | None = None) -> list[int]:
        if not req.messages:
            other = " (or send prompt_token_ids)" if isinstance(req, ChatCompletionRequest) \
                else ""
            raise ApiError(400, f"messages must not be empty{other}", param="messages")
        if len(req.messages) > self.max_model_len:  # no template renders a turn in no token
            raise ApiError(400, f"messages: {len(req.messages)} messages cannot fit in "
                           f"{self.max_model_len} tokens", param="messages",
                           code="context_length_exceeded")
        messages = template_messages(req.messages)
        extra = _template_kwargs(req.chat_template_kwargs)
        chars = sum(len(m["content"]) + len(m["role"]) + CHARS_PER_TURN for m in messages)
        chars += sum(len(msgspec.json.encode(m.get("tool_calls") or "")) for m in messages)
        if tools:
            chars += len(msgspec.json.encode(tools))
        if extra:
            chars += len(msgspec.json.encode(extra))
        self._check_chars(chars, "messages")
        try:
            pieces = await _off_loop(chars, functools.partial(
                self.tokenizer.render_chat, messages, add_generation_prompt, tools,
                self.parse_content_specials, **extra))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt_chars = sum(len(text) for text, _ in pieces)
        self._check_chars(prompt_chars, "messages")
        return await _off_loop(prompt_chars, self.tokenizer.encode_chat, pieces)

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            self._check_chars(len(prompt), "prompt")
            return await _off_loop(len(prompt), self.tokenizer.encode, prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids",
                           param="prompt")
        return self._token_prompt(prompt, "prompt")

    def _token_prompt(self, ids: list[Any], field: str) -> list[int]:
        """A prompt sent as token ids: it fits the context and names only vocabulary ids."""
        if len(ids) >= self.max_model_len:  # before looking at each element
            self.max_tokens(1, len(ids), "max_tokens", field)
        self._check_ids(ids, field)
        return ids

    def _check_ids(self, ids: list[Any], field: str) -> None:
        try:
            check_token_ids(ids, self.vocab_size, field)
        except FieldError as e:
            raise ApiError.from_field(e) from None

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens; {param} has {chars} characters, more than that many tokens "
                           f"can hold ({self.max_chars}).", param=param,
                           code="context_length_exceeded")

    def max_tokens(self, requested: int | None, prompt_len: int, param: str,
                   prompt_param: str) -> int:
        """The completion's token budget; 400 if the prompt and it exceed the context."""
        max_len = self.max_model_len
        if requested is not None and requested < 1:
            raise ApiError(400, f"{param} must be at least 1, got {requested}", param=param)
        if prompt_len >= max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, your prompt has {prompt_len} tokens.", param=prompt_param,
                           code="context_length_exceeded")
        if requested is None:
            return max_len - prompt_len
        if prompt_len + requested > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, you requested {prompt_len + requested} tokens "
                           f"({prompt_len} in the prompt, {requested} in the completion).",
                           param=param, code="context_length_exceeded")
        return requested


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as templates expect them (transformers' and vLLM's way): text content,
    assistant tool calls with their arguments parsed, a tool result's id and name."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{m.role[:40]!r}", param="messages")
        d: dict[str, Any] = {"role": m.role, "content": m.text(f"messages[{i}]")}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, 'messages: each tool call is {"id": ..., "type": '
                                   '"function", "function": {"name": ..., "arguments": ...}}',
                                   param="messages")
                fn = dict(fn)
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except (ValueError, RecursionError):
                        pass
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        out.append(d)
    return out


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM): more variables for the template; none may replace what
    the template gets from the request or the tokenizer."""
    if not kwargs:
        return {}
    for name in kwargs:
        if not name.isidentifier() or name in RESERVED_TEMPLATE_NAMES:
            what = "is set by the request or the tokenizer" if name.isidentifier() \
                else "is not a template variable name"
            raise ApiError(400, f"chat_template_kwargs: {name!r} {what}",
                           param="chat_template_kwargs")
    return kwargs


def batch_of(prompt: Any) -> list[Any]:
    """A completions ``prompt`` -> its prompts: a string, a list of token ids, or a list of
    either (OpenAI's batch: one choice per prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request, "
                           f"got {len(prompt)}", param="prompt")
        for p in prompt:
            if not isinstance(p, (str, list)):
                raise ApiError(400, "prompt: a batch is a list of strings or of token-id "
                               "lists", param="prompt")
        return prompt
    return [prompt]


async def _off_loop(size: int, fn: Callable, *args: Any) -> Any:
    """Small inputs inline; large ones in a worker thread, so the event loop keeps serving."""
    if size <= OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
