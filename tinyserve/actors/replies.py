"""What a request's reader is sent after a step, and when: the batcher's outbound half.

An Output carries the text and tokens new since the request's last one (``stream_interval``:
one every that many tokens, the first and the last at once, as vLLM's). Handing one to the
request's reply queue wakes its reader, which shapes what it finds there and writes it to
the socket: per hand-off a task switch, a write and (on a loopback peer) the receiver's TCP
work inside our ``send``, the largest costs a token has at a small model's step rate.

So hand-offs are rationed: a token bucket of ``write_rate`` per second of the model's
steps, for its requests together. While it has tokens every Output goes out with the step
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

from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.core.request import Request
from tinyserve.messages import Failed, Output, TokenInfo

log = logging.getLogger(__name__)

BURST_S = 0.02  # the bucket holds at most this long's worth of hand-offs


def reply(req: Request, msg: Output | Failed) -> None:
    """Never blocks and never raises: the queue is sized for every reply a request can get,
    and one that is full anyway belongs to a reader that is gone or already failed."""
    try:
        req.reply_to.put_nowait(msg)
    except asyncio.QueueFull:
        log.warning("request %d: reply queue full, dropping %s", req.request_id,
                    type(msg).__name__)


class Replies:
    """Owns the Outputs that wait (on their Request's ``held``) and the hand-off budget."""

    def __init__(self, stream_interval: int = 1, write_rate: float = 0.0) -> None:
        self._interval = stream_interval
        self._rate = write_rate  # 0: every Output is handed over at once
        self._cap = max(write_rate * BURST_S, 1.0)
        self._budget = self._cap
        self._last = float("-inf")  # when the last step came back
        # requests with Outputs waiting, the longest-waiting first (dicts keep insertion order)
        self._waiting: dict[Request, None] = {}

    def refill(self, now: float) -> None:
        """A step is back at ``now``: the hand-offs earned since the last (before
        ``advanced``)."""
        if self._rate:
            since, self._last = now - self._last, now
            self._budget = min(self._budget + self._rate * since, self._cap)

    def advanced(self, req: Request) -> None:
        """A step gave it new tokens: its Output, if one is due, goes out or waits."""
        seq = req.seq
        if self._interval > 1 and not (seq.finish_reason is not None or not req.sent_tokens or
                                       seq.num_output_tokens - req.sent_tokens >= self._interval):
            return
        out = self._output(req)
        if out is None:
            return
        # the first text a reader sees (not the first token: that may have shown nothing)
        if not self._rate or not req.handed or out.finish_reason is not None:
            self.send(req, out)
            return
        # In line behind those already waiting, even when the bucket has room: a request
        # served here, ahead of them, would take this step's hand-offs first every step
        # (the steps' order is the same each time) and the last in it would wait to the end.
        req.held.append(out)
        if req not in self._waiting:
            self._waiting[req] = None

    def stepped(self) -> None:
        """After a step's results: hand over what the budget allows, longest waiting first."""
        while self._waiting and self._budget >= 1.0:
            self._budget -= 1.0
            self.flush(next(iter(self._waiting)))

    def send(self, req: Request, msg: Output | Failed) -> None:
        """Hand ``msg`` over now, behind whatever of the request's is waiting."""
        if req.held:
            self.flush(req)
        if self._rate:
            self._budget -= 1.0
        req.handed = True
        reply(req, msg)

    def flush(self, req: Request) -> None:
        """Everything of the request's that waits, now (before a last reply, and as it ends)."""
        self._waiting.pop(req, None)
        held, req.held = req.held, []
        if type(req.reply_to) is ReplyQueue:
            try:
                req.reply_to.put_many(held)  # (one call for the lot: the common case)
                return
            except asyncio.QueueFull:
                pass  # (as many as fit, then reply's warning for each of the rest)
        for out in held:
            reply(req, out)

    # -- the Output ------------------------------------------------------------------------------
    @staticmethod
    def _output(req: Request) -> Output | None:
        """The text and tokens new since the last Output: O(new tokens), whatever the history.
        None: nothing to show yet (e.g. half a UTF-8 character held back)."""
        seq = req.seq
        finished = seq.finish_reason is not None  # (seq.is_finished: one call fewer a token)
        text = req.detok.stream_delta(finished)
        num_prompt = len(seq.prompt_token_ids)
        n_out = len(seq.token_ids) - num_prompt
        new = n_out - req.sent_tokens
        p = seq.params
        ids: tuple[int, ...] = ()
        tokens: tuple[TokenInfo, ...] = ()
        if new > 0 and (p.logprobs is not None or p.return_token_ids):
            ids = tuple(seq.token_ids[num_prompt + req.sent_tokens:])
            if p.logprobs is not None:
                tokens = tuple(TokenInfo(t, lp, top or ()) for t, (lp, top) in zip(
                    ids, seq.logprobs[req.sent_tokens:], strict=True))
        req.sent_tokens = n_out
        if not text and not ids and not finished:
            return None
        prompt_lps, ranks = None, ()
        if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True  # once: O(prompt) on the first Output only
            prompt = seq.prompt_token_ids
            prompt_lps = (None,) + tuple(TokenInfo(prompt[i + 1], lp, top)
                                         for i, (lp, _, top) in enumerate(seq.prompt_lps))
            ranks = tuple(rank for _, rank, _ in seq.prompt_lps)
        # (positional, in Output's field order: one of these per streamed token)
        return Output(text, tokens, new, seq.finish_reason, num_prompt, n_out,
                      seq.num_cached_tokens, prompt_lps, ranks,
                      _stop_reason(req) if finished else None,
                      ids if p.return_token_ids else ())


def _stop_reason(req: Request) -> str | int | None:
    """What ended a request that finished with "stop": its stop string, or its stop token
    (EOS: None, as vLLM reports it)."""
    seq = req.seq
    if seq.finish_reason != "stop":
        return None
    if req.detok.matched is not None:
        return req.detok.matched
    last = seq.token_ids[-1]
    return last if last in seq.params.stop_token_ids else None
