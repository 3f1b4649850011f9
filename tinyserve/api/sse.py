"""Server-Sent Events: a response's chunks as ``data: <json>`` events (a chunk the shaper names,
``(name, struct)``, also gets an ``event: <name>`` line: the Responses and Messages APIs), then
the shaper's closing bytes (``data: [DONE]`` for OpenAI's chat and completions).

Headers go out first (with the answering model), then whatever the shaper makes of each batch
of outputs. Once headers are sent an error can no longer change the status: it becomes the
last event, as the shaper's API words it. A client that stops reading for WRITE_TIMEOUT_S is
treated as gone (its request is aborted by the caller).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec
from aiohttp import web

from tinyserve.api.access_log import AccessInfo
from tinyserve.api.errors import ApiError
from tinyserve.api.shaper import Shaper, logprob_entries
from tinyserve.messages import Output

WRITE_TIMEOUT_S = 30.0  # a streaming client that reads nothing for this long has gone
OFF_LOOP_LOGPROBS = 256  # outputs carrying more logprob entries are shaped in a worker thread


async def stream(request: web.Request, outputs: AsyncIterator[list[tuple[int, Output]]],
                 shaper: Shaper, headers: dict[str, str], access: AccessInfo | None,
                 count_error: Callable[[ApiError], None]) -> web.StreamResponse:
    """Send ``outputs`` (batches of (choice index, Output)) as the shaper's chunks."""
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    send = _sender(resp, request.transport)
    shape = Events(shaper)

    await send(encode(shaper.opening()))
    loop = asyncio.get_running_loop()
    try:
        async with contextlib.aclosing(outputs):
            async for outs in outputs:
                if logprob_entries([out for _, out in outs]) > OFF_LOOP_LOGPROBS:
                    # (a prompt's logprobs: shaped off the loop, as whole bodies are)
                    await send(await loop.run_in_executor(None, shape, outs))
                else:
                    await send(shape(outs))
    except ApiError as e:  # headers are sent: the error becomes the last event
        count_error(e)
        if access is not None:
            access.stream_error = e.status
        await send(encode(shaper.stream_error(e)))
    if closing := shaper.closing():
        await resp.write(closing)
    await resp.write_eof()
    return resp


class Events:
    """Batches of (choice index, Output) as the shaper's SSE events, in bytes.

    An Output that is text alone, for a choice whose shaper says such an Output's chunk is
    its text in fixed surroundings (``Shaper.plain``), goes through that choice's template:
    the bytes the shaper's own chunk encodes to, made once from a sentinel text, with the
    text's JSON string in its place - one small encode a token instead of building and
    encoding the chunk's structs (a tenth of a streamed token's host time)."""

    SENTINEL = "\x01tinyserve:text\x01"

    def __init__(self, shaper: Shaper) -> None:
        self._shaper = shaper
        self._plain = shaper.plain  # (the Messages and Responses shapers': never)
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, outs: list[tuple[int, Output]]) -> bytes:
        shaper, plain, parts = self._shaper, self._plain, []
        for i, out in outs:
            if (out.text and out.finish_reason is None and not out.tokens and not out.token_ids
                    and out.prompt_logprobs is None and plain(i)):
                template = self._templates[i] if i in self._templates else self._template(i)
                if template is not None:
                    parts += (template[0], msgspec.json.encode(out.text), template[1])
                    continue
            parts.extend(map(event, shaper.chunks(out, i)))
        return b"".join(parts)

    def _template(self, index: int) -> tuple[bytes, bytes] | None:
        """(``plain`` promises the sentinel's chunk changes no state of the shaper.)"""
        chunks = self._shaper.chunks(Output(self.SENTINEL, (), 1), index)
        data, marker = encode(chunks), msgspec.json.encode(self.SENTINEL)
        template = None
        if len(chunks) == 1 and data.count(marker) == 1:
            head, tail = data.split(marker)
            template = (head, tail)
        self._templates[index] = template
        return template


def encode(chunks: list) -> bytes:
    return b"".join(map(event, chunks))


def event(chunk: msgspec.Struct | tuple[str, msgspec.Struct]) -> bytes:
    """One SSE event: ``data: <json>``, after ``event: <name>`` for a named chunk."""
    if isinstance(chunk, tuple):
        name, payload = chunk
        return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _sender(resp: web.StreamResponse, transport: asyncio.Transport | None):
    async def send(data: bytes) -> None:
        if not data:
            return
        if (transport is not None and not transport.get_write_buffer_size()
                and len(data) <= transport.get_write_buffer_limits()[1]):
            # The socket took everything so far and this write fits under the high-water
            # mark: the transport cannot pause, so aiohttp's drain cannot wait on the reader
            # and the write needs no timeout - the common case, and a timer per write was a
            # tenth of the loop's time at 256 streams.
            await resp.write(data)
            return
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await resp.write(data)
        except TimeoutError:  # it stopped reading: treat it as gone (aborts the request)
            raise ConnectionResetError("the client stopped reading the stream") from None

    return send
