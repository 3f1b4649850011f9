"""Batcher actor: owns every request's state and drives the engine step loop.

Its inbox takes Submit, Abort and StepResult. Each turn it applies everything queued, and if
no step is in flight it schedules the next one (continuous batching: running decodes plus as
much prefill as the token budget allows) and hands it to the executor. Results come back to
the same inbox, so request state is only ever touched here, on the event loop.

Inbox capacity: 2 * (admission capacity) + 8. Admission bounds the requests in the system, and
each contributes at most one Submit and one Abort, plus one StepResult in flight, so
``put_nowait`` from ingress (aborts) and admission can never find it full.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from tinyserve.actors.metrics import Metrics
from tinyserve.core.engine import EngineCore
from tinyserve.core.sequence import Sequence
from tinyserve.messages import (
    Abort,
    AbortAll,
    Output,
    Rejected,
    RequestFinished,
    StepPlan,
    StepResult,
    StepStats,
    Submit,
    TokenInfo,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    submit: Submit
    seq: Sequence
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    sent_tokens: int = 0


class Batcher:
    def __init__(self, core: EngineCore, executor_inbox: asyncio.Queue, metrics: Metrics,
                 capacity: int, batch_timeout_ms: float = 0.0) -> None:
        self.core = core
        self._executor_inbox = executor_inbox
        self._metrics = metrics
        self._batch_timeout = batch_timeout_ms / 1000.0
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=2 * capacity + 8)
        self.requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, str] = {}
        self._in_flight: StepPlan | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # -- queries (snapshots for other actors) ------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.requests)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self._handle(await self.inbox.get())
            while not self.inbox.empty():
                self._handle(self.inbox.get_nowait())
            if self._in_flight is None and self.core.has_unfinished:
                await self._wait_for_company()
                self._launch()
            self._update_idle()

    def _handle(self, msg) -> None:
        try:
            match msg:
                case StepResult():
                    self._on_result(msg)
                case Submit():
                    self._on_submit(msg)
                case Abort():
                    self._on_abort(msg.request_id)
                case AbortAll():
                    for rid in list(self.requests):
                        self._on_abort(rid)
                case _:
                    log.error("batcher: unknown message %r", msg)
        except Exception:
            log.exception("batcher: failed to handle %r", type(msg).__name__)

    async def _wait_for_company(self) -> None:
        """An idle engine given one new request may wait batch_timeout for more to arrive."""
        if not self._batch_timeout or self.core.scheduler.num_running:
            return
        deadline = time.monotonic() + self._batch_timeout
        while self.core.scheduler.num_waiting < self.core.cfg.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                msg = await asyncio.wait_for(self.inbox.get(), left)
            except TimeoutError:
                return
            self._handle(msg)
            if self._in_flight is not None or not self.core.has_unfinished:
                return

    def _launch(self) -> None:
        plan = self.core.schedule()
        if plan is None:
            log.error("scheduler returned no step with %d requests pending", self.num_requests)
            return
        now = time.monotonic()
        for s in plan.seqs:
            st = self.requests.get(self._by_seq.get(s.seq_id, ""))
            if st is not None and st.first_scheduled is None:
                st.first_scheduled = now
        self._in_flight = plan
        self._executor_inbox.put_nowait(plan)  # capacity 1 and nothing in flight: never full

    def _update_idle(self) -> None:
        if self._in_flight is None and not self.requests:
            self._idle.set()
        else:
            self._idle.clear()

    # -- messages ----------------------------------------------------------------------------
    def _on_submit(self, msg: Submit) -> None:
        try:
            seq = self.core.add_request(msg.prompt_token_ids, msg.params, msg.cache_salt)
        except ValueError as e:
            msg.reply_to.put_nowait(Rejected(400, str(e)))
            return
        self.requests[msg.request_id] = RequestState(msg, seq)
        self._by_seq[seq.seq_id] = msg.request_id

    def _on_abort(self, request_id: str) -> None:
        st = self.requests.get(request_id)
        if st is None:
            return
        self.core.abort(st.seq.seq_id)  # frees its KV blocks now
        self._finish(request_id, st)
        self._emit_stats(0)

    def _on_result(self, result: StepResult) -> None:
        plan, self._in_flight = self._in_flight, None
        if plan is None or plan.step_id != result.step_id:
            log.error("batcher: unexpected result for step %d", result.step_id)
            return
        if result.error:
            log.error("step %d failed: %s", result.step_id, result.error)
        now = time.monotonic()
        for seq in self.core.process(plan, result):
            rid = self._by_seq.get(seq.seq_id)
            st = self.requests.get(rid) if rid else None
            if st is None:
                continue
            if seq.finish_reason != "error":
                st.token_times.append(now)
            self._send(st, seq)
            if seq.is_finished:
                self._finish(rid, st)
        self._emit_stats(plan.num_tokens)

    # -- outputs -----------------------------------------------------------------------------
    def _send(self, st: RequestState, seq: Sequence) -> None:
        detok = self.core.detokenizers.get(seq.seq_id)
        text = detok.stream_delta(final=seq.is_finished) if detok else ""
        n_out = seq.num_output_tokens
        new = n_out - st.sent_tokens
        tokens: tuple[TokenInfo, ...] = ()
        if seq.params.logprobs is not None and new > 0:
            ids = seq.output_token_ids[st.sent_tokens:]
            tokens = tuple(TokenInfo(t, lp, top or ())
                           for t, (lp, top) in zip(ids, seq.logprobs[st.sent_tokens:], strict=True))
        st.sent_tokens = n_out
        if not text and not tokens and not seq.is_finished:
            return  # nothing to show yet (e.g. half a UTF-8 character held back)
        st.submit.reply_to.put_nowait(Output(
            text=text, tokens=tokens, num_new_tokens=new,
            finish_reason=seq.finish_reason if seq.is_finished else None,
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=n_out,
            cached_tokens=seq.num_cached_tokens))

    def _finish(self, rid: str, st: RequestState) -> None:
        seq = st.seq
        if seq.finish_reason == "abort":
            st.submit.reply_to.put_nowait(Output(
                text="", tokens=(), num_new_tokens=0, finish_reason="abort",
                prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens))
        self.core.release(seq.seq_id)
        self.requests.pop(rid, None)
        self._by_seq.pop(seq.seq_id, None)
        if st.submit.internal:
            return
        arrival = st.submit.arrival_time
        times = st.token_times
        self._metrics.emit(RequestFinished(
            finish_reason=seq.finish_reason or "abort", prompt_tokens=seq.num_prompt_tokens,
            generation_tokens=seq.num_output_tokens,
            queue_seconds=None if st.first_scheduled is None else st.first_scheduled - arrival,
            ttft_seconds=times[0] - arrival if times else None,
            e2e_seconds=(times[-1] if times else time.monotonic()) - arrival,
            itl_seconds=tuple(b - a for a, b in zip(times, times[1:]))))

    def _emit_stats(self, num_tokens: int) -> None:
        sched, kv = self.core.scheduler, self.core.kv
        self._metrics.emit(StepStats(
            num_tokens=num_tokens, num_running=sched.num_running, num_waiting=sched.num_waiting,
            kv_usage=kv.usage, preemptions=sched.num_preemptions,
            prompt_tokens_computed=sched.num_prompt_tokens_computed,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits))
