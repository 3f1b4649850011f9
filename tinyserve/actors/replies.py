"""What a request's reader is sent after a step, and when: the batcher's outbound half.

An Output carries the text and tokens new since the request's last one (``stream_interval``:
one every that many tokens, the first and the last at once, as vLLM's). Handing one to the
request's reply queue wakes its reader, which shapes what it finds there and writes it to
the socket: per hand-off a task switch, a write and (on a loopback peer) the receiver's TCP
work inside our ``send``, the largest costs a token has at a small model's step rate.

Each request's reply side is owned here, in a reader record opened when the request joins and
closed when it ends: its queue, the tokens already handed over, whether its prompt logprobs
went out, the Outputs waiting.

Those costs are why hand-offs are rationed: a token bucket of ``write_rate`` per second of
the model's steps, for its requests together. While it has tokens every Output goes out with the step
that made it (a few streams, or slow steps: no change at all). Past it, Outputs wait on
their request, longest-waiting request first, and go out together in its next hand-off -
each still its own Output, so a stream still gets one SSE event per token, in fewer, larger
writes. A request's first Output and its last never wait (time to first token, and its end,
are not delayed). At N busy streams a token waits at most about N / write_rate seconds.

The rate is the loop's, not the device's: set too high for the host, a loop that falls behind
stretches the steps, earns more hand-offs per step and stays behind (16,000 a second on the
2-vCPU development VM settled there in some runs, at 1.5x the CPU a token; 8,000 did not).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.core import stopping
from tinyserve.core.request import Request
from tinyserve.messages import Failed, Output, TokenInfo

log = logging.getLogger(__name__)

BURST_S = 0.02  # the bucket holds at most this long's worth of hand-offs


def reply(queue: Any, msg: Output | Failed, request_id: int) -> None:
    """Never blocks and never raises: the queue is sized for every reply a request can get,
    and one that is full anyway belongs to a reader that is gone or already failed."""
    try:
        queue.put_nowait(msg)
    except asyncio.QueueFull:
        log.warning("request %d: reply queue full, dropping %s", request_id, type(msg).__name__)


@dataclass(slots=True, eq=False)
class _Reader:
    """One request's reply side."""

    request_id: int
    queue: Any  # the request's own bounded reply queue (a ReplyQueue)
    sent_tokens: int = 0  # output tokens already handed to the queue
    prompt_logprobs_sent: bool = False
    held: list[Output] = field(default_factory=list)  # Outputs waiting to go out
    handed: bool = False  # its reader has been handed something


class Replies:
    """Owns every request's reply side, the Outputs that wait, and the hand-off budget."""

    def __init__(self, stream_interval: int = 1, write_rate: float = 0.0) -> None:
        self._interval = stream_interval
        self._rate = write_rate  # 0: every Output is handed over at once
        self._cap = max(write_rate * BURST_S, 1.0)
        self._budget = self._cap
        self._last = float("-inf")  # when the last step came back
        self._readers: dict[int, _Reader] = {}  # by request id
        # readers with Outputs waiting, the longest-waiting first (dicts keep insertion order)
        self._waiting: dict[_Reader, None] = {}

    def open(self, request_id: int, queue: Any) -> None:
        """A request joined: what it is sent goes to ``queue``."""
        self._readers[request_id] = _Reader(request_id, queue)

    def close(self, req: Request) -> None:
        """It ended: anything still waiting goes out, and its reply side is forgotten."""
        r = self._readers.pop(req.request_id, None)
        if r is not None:
            self._flush(r)

    def waiting(self, req: Request) -> int:
        """Its Outputs that wait to go out (a snapshot)."""
        r = self._readers.get(req.request_id)
        return 0 if r is None else len(r.held)

    def refill(self, now: float) -> None:
        """A step is back at ``now``: the hand-offs earned since the last (before
        ``advanced``)."""
        if self._rate:
            since, self._last = now - self._last, now
            self._budget = min(self._budget + self._rate * since, self._cap)

    def advanced(self, req: Request) -> None:
        """A step gave it new tokens: its Output, if one is due, goes out or waits."""
        r, seq = self._readers[req.request_id], req.seq
        if self._interval > 1 and not (seq.finish_reason is not None or not r.sent_tokens or
                                       seq.num_output_tokens - r.sent_tokens >= self._interval):
            return
        out = _output(req, r)
        if out is None:
            return
        # the first text a reader sees (not the first token: that may have shown nothing)
        if not self._rate or not r.handed or out.finish_reason is not None:
            self._send(r, out)
            return
        # In line behind those already waiting, even when the bucket has room: a request
        # served here, ahead of them, would take this step's hand-offs first every step
        # (the steps' order is the same each time) and the last in it would wait to the end.
        r.held.append(out)
        if r not in self._waiting:
            self._waiting[r] = None

    def stepped(self) -> None:
        """After a step's results: hand over what the budget allows, longest waiting first."""
        while self._waiting and self._budget >= 1.0:
            self._budget -= 1.0
            self._flush(next(iter(self._waiting)))

    def send(self, req: Request, msg: Output | Failed) -> None:
        """Hand ``msg`` over now, behind whatever of the request's is waiting."""
        self._send(self._readers[req.request_id], msg)

    def _send(self, r: _Reader, msg: Output | Failed) -> None:
        if r.held:
            self._flush(r)
        if self._rate:
            self._budget -= 1.0
        r.handed = True
        reply(r.queue, msg, r.request_id)

    def _flush(self, r: _Reader) -> None:
        """Everything of the reader's that waits, now (before a last reply, and as it ends)."""
        self._waiting.pop(r, None)
        held, r.held = r.held, []
        if type(r.queue) is ReplyQueue:
            try:
                r.queue.put_many(held)  # (one call for the lot: the common case)
                return
            except asyncio.QueueFull:
                pass  # (as many as fit, then reply's warning for each of the rest)
        for out in held:
            reply(r.queue, out, r.request_id)


def _output(req: Request, r: _Reader) -> Output | None:
    """The text and tokens new since the reader's last Output: O(new tokens), whatever the
    history. None: nothing to show yet (e.g. half a UTF-8 character held back)."""
    seq = req.seq
    finished = seq.finish_reason is not None  # (seq.is_finished: one call fewer a token)
    text = req.detok.stream_delta(finished)
    num_prompt = len(seq.prompt_token_ids)
    n_out = len(seq.token_ids) - num_prompt
    new = n_out - r.sent_tokens
    p = seq.params
    ids: tuple[int, ...] = ()
    tokens: tuple[TokenInfo, ...] = ()
    if new > 0 and (p.logprobs is not None or p.return_token_ids):
        ids = tuple(seq.token_ids[num_prompt + r.sent_tokens:])
        if p.logprobs is not None:
            tokens = tuple(TokenInfo(t, lp, top or ()) for t, (lp, top) in zip(
                ids, seq.logprobs[r.sent_tokens:], strict=True))
    r.sent_tokens = n_out
    if not text and not ids and not finished:
        return None
    prompt_lps, ranks = None, ()
    if p.prompt_logprobs is not None and not r.prompt_logprobs_sent:
        r.prompt_logprobs_sent = True  # once: O(prompt) on the first Output only
        prompt_lps, ranks = seq.prompt_logprobs()
    # (positional, in Output's field order: one of these per streamed token)
    return Output(text, tokens, new, seq.finish_reason, num_prompt, n_out,
                  seq.num_cached_tokens, prompt_lps, ranks,
                  stopping.stop_reason(seq, req.detok) if finished else None,
                  ids if p.return_token_ids else ())
